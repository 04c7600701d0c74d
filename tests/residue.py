"""What a sandbox may have left on the host: processes, files, cgroups, mounts.

    before = Snapshot.take()
    ... run sandboxes as uids 61000..61015 ...
    assert not host_residue(range(61000, 61016), before)     # [] when clean
    assert not host_residue([backend.uid], waiting=[backend])  # its next sandbox, started ahead, is not residue

Used by the adversarial tests after every probe and by bench/sandbox.py after its runs: a
sandbox that leaves nothing behind leaves no process of its slot uid,
no file owned by it in the host's shared scratch places, no populated cgroup of ours and no
mount in this mount namespace that was not there before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Snapshot", "host_residue", "adopt_orphans", "reap_orphans"]

_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")


def _mounts() -> frozenset[str]:
    with open("/proc/self/mountinfo") as fh:
        return frozenset(" ".join(line.split()[3:5]) for line in fh)


@dataclass(frozen=True)
class Snapshot:
    mounts: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(mounts=_mounts())


def _processes(uids: set[int], spared: set[str]) -> list[str]:
    found = []
    mine = _ancestry()  # run as a normal user, the sandboxes share our uid (and our parents')
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in mine or pid in spared:
            continue
        try:
            with open(f"/proc/{pid}/status") as fh:
                status = fh.read()
        except OSError:
            continue  # gone meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        ids = {int(x) for x in fields.get("Uid", "").split()}
        if ids & uids:
            name = fields.get("Name", "?").strip()
            state = fields.get("State", "?").strip()
            found.append(f"process {pid} ({name}, {state}) runs as uid {sorted(ids & uids)}")
    return found


def _stat(pid: str) -> tuple[str, str, str] | None:
    """(name, state, parent pid) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            head, tail = fh.read().rsplit(")", 1)
    except (OSError, ValueError):
        return None
    fields = tail.split()
    return head.split("(", 1)[1], fields[0], fields[1]


def _spared(launchers: set[int], servers: set[int]) -> set[str]:
    """The processes of sandboxes started ahead: each of `launchers` and what descends from it,
    and of each launcher a live `servers` process started, the tree when it is nothing but the
    launcher, bwrap and the helper waiting for its command (no program ever ran in it)."""
    if not launchers and not servers:
        return set()
    stats = {pid: st for pid in os.listdir("/proc") if pid.isdigit() and (st := _stat(pid)) is not None}
    kids: dict[str, list[str]] = {}
    for pid, (_, _, ppid) in stats.items():
        kids.setdefault(ppid, []).append(pid)

    def tree(pid: str) -> list[str]:
        out = [pid]
        for k in kids.get(pid, []):
            out += tree(k)
        return out

    out: set[str] = set()
    for pid in map(str, launchers):
        out.update(tree(pid))
    for server in map(str, servers):
        for pid in kids.get(server, []):
            members = tree(pid)
            names = sorted(stats[m][0] for m in members if m in stats)
            if names == [".hpcrl-exec", "bwrap", stats[pid][0]] and stats[pid][0].startswith("hpcrl-launch"):
                out.update(members)
    return out


def _ancestry(pid: str | None = None) -> set[str]:
    """A process (this one by default) and its ancestors (pids as strings)."""
    out, pid = set(), pid or str(os.getpid())
    while pid not in ("0", "") and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = fh.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            break
    return out


def _files(uids: set[int], roots: Iterable[str], depth: int = 2) -> list[str]:
    found = []

    def walk(path: str, level: int) -> None:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid in uids:
                found.append(f"file {e.path} owned by uid {st.st_uid}")
            elif level < depth and e.is_dir(follow_symlinks=False):
                walk(e.path, level + 1)

    for root in roots:
        walk(root, 0)
    return found


def _uid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


def _cgroups(uids: set[int], spared: set[str]) -> list[str]:
    """Run leaves under this process's hpcrl-sbx-<pid> parents, and parents of dead processes.
    A leaf whose processes are all spared, or all run as other slots' uids (another backend's
    sandbox started ahead: those uids' own checks judge it), is not counted."""
    from hpcrl.sandbox import cgroups

    support = cgroups.probe()
    found = []
    for parent in support.dirs():
        base = os.path.dirname(parent)
        for name in os.listdir(base):
            if name.startswith("hpcrl-sbx-") and not os.path.exists(f"/proc/{name[len('hpcrl-sbx-') :]}"):
                found.append(f"cgroup {os.path.join(base, name)} of a dead process left behind")
        try:
            leaves = [d for d in os.listdir(parent) if d.startswith("run-")]
        except OSError:
            continue
        for leaf in leaves:
            path = os.path.join(parent, leaf)
            try:
                procs = open(os.path.join(path, "cgroup.procs")).read().split()
            except OSError:
                procs = []
            if procs and all(p in spared or _uid(p) not in (uids | {0, None}) for p in procs):
                continue
            found.append(f"cgroup {path} left behind" + (f" with processes {procs}" if procs else ""))
    return found


def adopt_orphans() -> bool:
    """Make this process a child subreaper, so orphans (e.g. of a killed sandbox server) come here."""
    import ctypes

    pr_set_child_subreaper = 36
    return ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0


def reap_orphans(timeout_s: float = 2.0) -> int:
    """Reap zombie children this process adopted (e.g. of a killed sandbox server); returns how many.

    Only for a process that waits on all of its own subprocesses explicitly: it reaps any
    zombie child, whoever started it.
    """
    me = str(os.getpid())
    reaped = 0
    deadline = time.monotonic() + timeout_s
    while True:
        kids = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                kids.append((int(pid), fields[0]))
        zombies = [pid for pid, state in kids if state == "Z"]
        for pid in zombies:
            try:
                os.waitpid(pid, os.WNOHANG)
                reaped += 1
            except ChildProcessError:
                pass
        if not zombies or time.monotonic() > deadline:
            return reaped
        time.sleep(0.01)


def host_residue(
    uids: Iterable[int],
    before: Snapshot | None = None,
    *,
    cgroups: bool = True,
    waiting: list | tuple = (),
    servers: Iterable[int] = (),
) -> list[str]:
    """Everything of the sandboxes (run as `uids`) still on the host; empty when clean.

    `cgroups=False` skips the cgroup check: a SIGKILLed server cannot remove its (empty)
    cgroup directories; the next server to start on the machine sweeps them. `waiting`:
    backends of this process whose sandboxes started ahead (`BwrapBackend.waiting`) are
    theirs, not residue; `servers`: pids of sandbox servers whose sandboxes started ahead
    (waiting for a command, never having run one) are theirs.
    """
    uid_set = set(uids)
    for b in waiting:  # a sandbox still starting has processes yet to come
        assert b.settle(timeout_s=60), f"a sandbox started ahead by {b.describe()} never got ready"
    spared = _spared({pid for b in waiting for pid in b.waiting}, set(servers))
    found = _processes(uid_set, spared) + _files(uid_set, _SCRATCH) + (_cgroups(uid_set, spared) if cgroups else [])
    if before is not None:
        found += [f"mount {m} appeared" for m in sorted(_mounts() - before.mounts)]
    return found
