"""Per-execution cgroups: memory, pids and CPU limits, CPU and peak-memory accounting, whole-tree kill.

Machines differ (cgroup v1, v2 or a hybrid of both; delegated or not), so `probe()` tries, once
per process, to create a cgroup in each hierarchy under the cgroup this process already lives
in, and reports what it could set up:

    >>> probe().describe()
    'memory limit: v1, pids limit: v1, cpu accounting: v2, cpu limit: v1, kill: v2 cgroup.kill'

Nothing here raises because a controller is missing; the backend logs what is enforced and
falls back to rlimits. Each execution gets `RunCgroups` with a fresh leaf per hierarchy; the
launcher writes its own pid into `procs_files` before it drops privileges, so every process of
the sandbox is born inside. `close()` kills whatever is still inside and removes the leaves.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

__all__ = ["CgroupSupport", "RunCgroups", "probe"]

_GROUP_PREFIX = "hpcrl-sbx-"


@dataclass(frozen=True)
class CgroupSupport:
    """Where this process may create cgroups, per role. A None dir means: not available here."""

    memory_dir: str | None = None
    memory_version: str | None = None
    pids_dir: str | None = None
    pids_version: str | None = None
    cpu_dir: str | None = None  # accounting: cpu.stat (v2) or cpuacct.usage (v1)
    cpu_version: str | None = None
    cpu_limit_dir: str | None = None  # a quota: cpu.max (v2) or cpu.cfs_quota_us (v1)
    cpu_limit_version: str | None = None
    kill_dir: str | None = None  # a v2 parent whose leaves have cgroup.kill
    notes: tuple[str, ...] = field(default=())

    @property
    def memory(self) -> bool:
        return self.memory_dir is not None

    @property
    def pids(self) -> bool:
        return self.pids_dir is not None

    @property
    def cpu_limit(self) -> bool:
        return self.cpu_limit_dir is not None

    def dirs(self) -> set[str]:
        """Every parent this process created (one per hierarchy in use)."""
        return {self.memory_dir, self.pids_dir, self.cpu_dir, self.cpu_limit_dir, self.kill_dir} - {None}

    def describe(self) -> str:
        def one(what: str, version: str | None) -> str:
            return f"{what}: {version}" if version else f"{what}: not enforced"

        return ", ".join(
            [
                one("memory limit", self.memory_version),
                one("pids limit", self.pids_version),
                one("cpu accounting", self.cpu_version),
                one("cpu limit", self.cpu_limit_version),
                "kill: v2 cgroup.kill" if self.kill_dir else "kill: pid namespace + signal each process",
            ]
        )


def _mounts() -> tuple[dict[str, tuple[str, str]], tuple[str, str] | None]:
    """v1 controller -> (mountpoint, mount root), and the v2 (mountpoint, root) if mounted."""
    v1: dict[str, tuple[str, str]] = {}
    v2 = None
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            parts, rparts = left.split(), right.split()
            if len(rparts) < 3:
                continue
            root, mountpoint, fstype, opts = parts[3], parts[4], rparts[0], rparts[2].split(",")
            if fstype == "cgroup2" and v2 is None:
                v2 = (mountpoint, root)
            elif fstype == "cgroup":
                for opt in opts:
                    if opt in ("memory", "pids", "cpuacct", "cpu"):
                        v1.setdefault(opt, (mountpoint, root))
    return v1, v2


def _own_paths() -> tuple[dict[str, str], str | None]:
    v1: dict[str, str] = {}
    v2 = None
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if hid == "0" and ctrls == "":
                v2 = path
            for c in ctrls.split(","):
                v1[c] = path
    return v1, v2


def _join(mount: tuple[str, str], path: str) -> str:
    mountpoint, root = mount
    rel = path[len(root) :] if root != "/" and path.startswith(root) else path
    return os.path.join(mountpoint, rel.lstrip("/"))


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _probe_hierarchy(base: str, checks: dict[str, tuple[str, str | None]]) -> tuple[str | None, set[str]]:
    """Create `base/hpcrl-sbx-<pid>` and a leaf under it; return (parent, roles whose check passed).

    `checks` maps role -> (file, value): the file must exist in the leaf, and accept `value`
    (None: existence is enough, e.g. the write-only cgroup.kill).
    """
    if not os.path.isdir(base):
        return None, set()
    parent = os.path.join(base, f"{_GROUP_PREFIX}{os.getpid()}")
    leaf = os.path.join(parent, "probe")
    ok: set[str] = set()
    try:
        os.makedirs(parent, exist_ok=True)
        # v2: a leaf has the memory/pids files only if its parent delegates them; this works
        # where our own cgroup has them (systemd Delegate=yes, Slurm's cgroup/v2), else no-op.
        for ctrl in ("+memory", "+pids", "+cpu"):
            try:
                _write(os.path.join(parent, "cgroup.subtree_control"), ctrl)
            except OSError:
                pass
        os.makedirs(leaf, exist_ok=True)
    except OSError:
        _rmdir_quiet(parent)
        return None, set()
    try:
        for role, (fname, value) in checks.items():
            path = os.path.join(leaf, fname)
            try:
                if not os.path.exists(path):
                    continue
                if value is not None:
                    _write(path, value)
                ok.add(role)
            except OSError:
                pass
    finally:
        _rmdir_quiet(leaf)
    if not ok:
        _rmdir_quiet(parent)
        return None, set()
    return parent, ok


def _rmdir_quiet(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _sweep_stale(base: str) -> None:
    """Remove leftovers of dead hpcrl processes (a crash skips atexit), killing what is inside."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(_GROUP_PREFIX + r"(\d+)", name)
        if not m or int(m.group(1)) == os.getpid() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        parent = os.path.join(base, name)
        for leaf in [os.path.join(parent, d) for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d))]:
            _kill_procs([leaf], deadline=time.monotonic() + 2.0)
            _rmdir_quiet(leaf)
        _rmdir_quiet(parent)


_probe_lock = threading.Lock()
_probed: CgroupSupport | None = None


def probe() -> CgroupSupport:
    """What this process can enforce with cgroups (cached; cheap after the first call)."""
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe()
            if _probed.dirs():
                atexit.register(_remove_parents, _probed)
        return _probed


def _probe() -> CgroupSupport:
    try:
        mounts_v1, mount_v2 = _mounts()
        own_v1, own_v2 = _own_paths()
    except OSError as exc:
        return CgroupSupport(notes=(f"cannot read cgroup mounts: {exc}",))
    found: dict[str, tuple[str, str]] = {}
    notes = []
    if mount_v2 is not None and own_v2 is not None:
        base = _join(mount_v2, own_v2)
        _sweep_stale(base)
        parent, ok = _probe_hierarchy(
            base,
            {
                "memory": ("memory.max", "67108864"),
                "pids": ("pids.max", "64"),
                "cpu": ("cpu.stat", None),
                "cpu_limit": ("cpu.max", "100000 100000"),
                "kill": ("cgroup.kill", None),
            },
        )
        for role in ok:
            found[role] = (parent, "v2")
    for role, ctrl, fname, value in (
        ("memory", "memory", "memory.limit_in_bytes", "67108864"),
        ("pids", "pids", "pids.max", "64"),
        ("cpu", "cpuacct", "cpuacct.usage", None),
        ("cpu_limit", "cpu", "cpu.cfs_quota_us", "100000"),
    ):
        if role in found or ctrl not in mounts_v1 or ctrl not in own_v1:
            continue
        base = _join(mounts_v1[ctrl], own_v1[ctrl])
        _sweep_stale(base)
        parent, ok = _probe_hierarchy(base, {role: (fname, value)})
        if parent:
            found[role] = (parent, "v1")
        else:
            notes.append(f"{ctrl} (v1) at {base}: cannot create a child cgroup")
    if "cpu_limit" in found:
        _weigh_parent(*found["cpu_limit"])
    get = lambda role: found.get(role, (None, None))
    return CgroupSupport(
        memory_dir=get("memory")[0],
        memory_version=get("memory")[1],
        pids_dir=get("pids")[0],
        pids_version=get("pids")[1],
        cpu_dir=get("cpu")[0],
        cpu_version=get("cpu")[1],
        cpu_limit_dir=get("cpu_limit")[0],
        cpu_limit_version=get("cpu_limit")[1],
        kill_dir=get("kill")[0],
        notes=tuple(notes),
    )


def _weigh_parent(parent: str, version: str) -> None:
    """Give our parent the CPU weight of as many tasks as there are CPUs: its runs share that
    among themselves, where without cgroups each process of theirs weighed as one task."""
    n = os.cpu_count() or 1
    try:
        if version == "v2":
            _write(os.path.join(parent, "cpu.weight"), str(min(10000, 100 * n)))
        else:
            _write(os.path.join(parent, "cpu.shares"), str(1024 * n))
    except OSError:
        pass


def _remove_parents(support: CgroupSupport) -> None:
    for d in support.dirs():
        _rmdir_quiet(d)


def _procs(dirs: list[str]) -> set[int]:
    pids: set[int] = set()
    for d in dirs:
        try:
            pids.update(int(x) for x in _read(os.path.join(d, "cgroup.procs")).split())
        except FileNotFoundError:
            pass
    return pids


def _kill_procs(dirs: list[str], deadline: float) -> set[int]:
    """SIGKILL every process in `dirs` until they are empty or `deadline`; return survivors."""
    while True:
        left = _procs(dirs)
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


_seq = itertools.count()
_CPU_PERIOD_US = 100_000


class RunCgroups:
    """The leaves of one execution, one per hierarchy in use; create with `RunCgroups.create`."""

    def __init__(self, support: CgroupSupport, leaves: dict[str, str]):
        self.support = support
        self.leaves = leaves  # role -> leaf dir
        self._oom_before = 0

    @classmethod
    def create(cls, support: CgroupSupport, memory_bytes: int, pids_max: int, cpus: float = 0.0) -> RunCgroups:
        """Leaves for one run: `memory_bytes` and `pids_max` where enforced, and a quota of `cpus`
        cores (0: none) where a cpu controller is: sibling leaves share the CPU by equal weight,
        and the quota keeps one run from taking more however many processes it starts."""
        name = f"run-{next(_seq)}"
        leaves: dict[str, str] = {}
        dirs: dict[str, str] = {}
        for role in ("memory", "pids", "cpu", "cpu_limit", "kill"):
            parent = getattr(support, f"{role}_dir")
            if parent is None:
                continue
            leaf = dirs.get(parent) or os.path.join(parent, name)
            if parent not in dirs:
                os.makedirs(leaf, exist_ok=True)
                dirs[parent] = leaf
            leaves[role] = leaf
        self = cls(support, leaves)
        try:
            if "memory" in leaves:
                mem = leaves["memory"]
                if support.memory_version == "v2":
                    _write(f"{mem}/memory.max", str(memory_bytes))
                    for fname, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                        if os.path.exists(f"{mem}/{fname}"):
                            _write(f"{mem}/{fname}", value)
                else:
                    _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))
                    if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):
                        try:  # no swap either: a swapping bomb would only be slower, not stopped
                            _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
                        except OSError:
                            pass
                self._oom_before = self.oom_kills()
            if "pids" in leaves:
                _write(f"{leaves['pids']}/pids.max", str(pids_max))
            if "cpu_limit" in leaves and cpus > 0:
                quota = max(1000, int(cpus * _CPU_PERIOD_US))
                if support.cpu_limit_version == "v2":
                    _write(f"{leaves['cpu_limit']}/cpu.max", f"{quota} {_CPU_PERIOD_US}")
                else:
                    _write(f"{leaves['cpu_limit']}/cpu.cfs_period_us", str(_CPU_PERIOD_US))
                    _write(f"{leaves['cpu_limit']}/cpu.cfs_quota_us", str(quota))
        except OSError:
            self.close()
            raise
        return self

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in sorted(set(self.leaves.values()))]

    def oom_kills(self) -> int:
        mem = self.leaves.get("memory")
        if mem is None:
            return 0
        fname = "memory.events" if self.support.memory_version == "v2" else "memory.oom_control"
        try:
            m = re.search(r"^oom_kill (\d+)", _read(f"{mem}/{fname}"), re.M)
        except OSError:
            return 0
        return int(m.group(1)) if m else 0

    def oom_killed(self) -> bool:
        return self.oom_kills() > self._oom_before

    def peak_memory_bytes(self) -> int | None:
        mem = self.leaves.get("memory")
        if mem is None:
            return None
        fname = "memory.peak" if self.support.memory_version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int(_read(f"{mem}/{fname}").split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def cpu_seconds(self) -> float | None:
        cpu = self.leaves.get("cpu")
        if cpu is None:
            return None
        try:
            if self.support.cpu_version == "v2":
                m = re.search(r"^usage_usec (\d+)", _read(f"{cpu}/cpu.stat"), re.M)
                return int(m.group(1)) / 1e6 if m else None
            return int(_read(f"{cpu}/cpuacct.usage")) / 1e9
        except (OSError, ValueError):
            return None

    def pids(self) -> set[int]:
        return _procs(sorted(set(self.leaves.values())))

    def kill(self) -> None:
        """Kill every process inside, in one step where cgroup.kill exists."""
        if "kill" in self.leaves:
            try:
                _write(os.path.join(self.leaves["kill"], "cgroup.kill"), "1")
            except OSError:
                pass
        _kill_procs(sorted(set(self.leaves.values())), deadline=time.monotonic())

    def close(self, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove the leaves; raise if something will not die."""
        dirs = sorted(set(self.leaves.values()))
        if "kill" in self.leaves and _procs(dirs):
            self.kill()
        survivors = _kill_procs(dirs, deadline=time.monotonic() + timeout_s)
        if survivors:
            raise OSError(errno.EBUSY, f"sandbox processes {sorted(survivors)} survive SIGKILL in {dirs}")
        deadline = time.monotonic() + timeout_s
        for d in dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    # A just-emptied v1 memory cgroup can be EBUSY for a moment while it uncharges.
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.001)
        self.leaves = {}
