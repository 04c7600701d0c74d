"""What a sandbox may have left on the host: processes, files, cgroups, mounts.

    before = Snapshot.take()
    ... run sandboxes as uids 61000..61015 ...
    assert not host_residue(range(61000, 61016), before)     # [] when clean

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


def _processes(uids: set[int]) -> list[str]:
    found = []
    mine = _ancestry()  # run as a normal user, the sandboxes share our uid (and our parents')
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in mine:
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


def _ancestry() -> set[str]:
    """This process and its ancestors (pids as strings)."""
    out, pid = set(), str(os.getpid())
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


def _cgroups() -> list[str]:
    """Run leaves under this process's hpcrl-sbx-<pid> parents, and parents of dead processes."""
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


def host_residue(uids: Iterable[int], before: Snapshot | None = None, *, cgroups: bool = True) -> list[str]:
    """Everything of the sandboxes (run as `uids`) still on the host; empty when clean.

    `cgroups=False` skips the cgroup check: a SIGKILLed server cannot remove its (empty)
    cgroup directories; the next server to start on the machine sweeps them.
    """
    uid_set = set(uids)
    found = _processes(uid_set) + _files(uid_set, _SCRATCH) + (_cgroups() if cgroups else [])
    if before is not None:
        found += [f"mount {m} appeared" for m in sorted(_mounts() - before.mounts)]
    return found
