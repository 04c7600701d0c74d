"""The bubblewrap backend: local machines and CI.

What it isolates (each checked by tests/test_sandbox_adversarial.py):

* Processes: new PID, IPC, UTS, network, cgroup and user namespaces; the program sees only its
  own processes, is uid 65534 inside and an unprivileged per-slot uid outside (`setpriv` drops
  to it, all capabilities and groups gone, no_new_privs), never root. `--new-session` (no
  TIOCSTI into our terminal), `--disable-userns` (no nested user namespace to remount from),
  `--die-with-parent`. SIGKILL of the outer bwrap ends the PID namespace, setsid daemons
  included; where cgroups exist, what is left in the run's cgroup is killed as well.
* Files: read-only /usr (+ the /bin, /lib symlinks, /etc/alternatives, /etc/ld.so.cache),
  a read-only root, nothing else of the host: no /home, /root, run directories or sockets.
  /work (the program, copied in through memfds), /tmp and /dev/shm are size-capped tmpfs that
  vanish with the sandbox. The environment is cleared (PATH, HOME, TMPDIR, LANG only).
* Network: a new network namespace with loopback only; no DNS, no host TCP or unix sockets.
* Resources: rlimits set inside (CPU, file size, processes, open files, no core dumps), a
  memory and a pids cgroup per run where this machine lets us create them (`describe()` says
  which), output caps and a wall deadline enforced from outside.

What it does not isolate:

* The kernel: a kernel exploit escapes (gVisor `runsc` would add a user-space kernel at
  ~190 ms per run). There is no seccomp filter.
* Without a memory cgroup, memory is capped per process (RLIMIT_DATA) only, not in total.
* CPU time is not shared fairly between concurrent slots (no cpu controller), and disk I/O
  bandwidth of reading /usr is not limited.
* /usr of the host is visible read-only: installed software and its versions can be read.
* A program that exits with status 128+N by itself is reported as killed by signal N.

Side effect on the calling process: it becomes a child subreaper (prctl), so that bwrap's
pid-1, which outlives the outer bwrap by a moment, is reaped here and not left as a zombie
for the host's init.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import shutil
import threading
import time
import weakref

from hpcrl.sandbox.backend import Backend, Exit, Session, SupervisedSession, classify, rlimit_args
from hpcrl.sandbox.cgroups import CgroupSupport, RunCgroups, probe
from hpcrl.sandbox.process import Supervised
from hpcrl.sandbox.result import ExecResult, SandboxError, SandboxUnavailable
from hpcrl.sandbox.spec import Limits, SourceFile
from hpcrl.sandbox.uids import claim_slot_uid

log = logging.getLogger(__name__)

__all__ = ["BwrapBackend", "bwrap_args", "unavailable_reason", "SANDBOX_ENV"]

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
}
# Only this reaches the launcher (and so /proc/1/environ inside): never the server's own environment.
_LAUNCH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
# Writes the launcher's pid into each cgroup, then becomes setpriv -> bwrap (same pid), so every
# sandbox process is born inside the cgroups. Exit 125 means the cgroup refused us.
_JOIN_SH = 'for f; do shift; [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; done; exec "$@"'
_INNER_UID = 65534
_PR_SET_CHILD_SUBREAPER = 36
_MIB = 1024 * 1024


def _host_layout() -> list[str]:
    """ro-binds for /usr and whatever of /bin, /lib... the host has as symlinks or directories."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ("/etc/alternatives", "/etc/ld.so.cache"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_args(
    argv: tuple[str, ...],
    limits: Limits,
    file_fds: list[tuple[SourceFile, int]],
    *,
    status_fd: int | None,
    memory_by_rlimit: bool,
    bwrap: str = "bwrap",
    layout: list[str] | None = None,
) -> list[str]:
    """The bwrap command line for `argv` under `limits`, `file_fds` copied into /work. Pure."""
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid",
        str(_INNER_UID),
        "--gid",
        str(_INNER_UID),
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--disable-userns",
        *(layout if layout is not None else _host_layout()),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        # /dev/shm would otherwise be a writable tmpfs of half the host's RAM.
        "--size",
        str(limits.shm_mb * _MIB),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--size",
        str(limits.tmp_mb * _MIB),
        "--tmpfs",
        "/tmp",
        "--size",
        str(limits.work_mb * _MIB),
        "--perms",
        "0755",
        "--tmpfs",
        "/work",
    ]
    made = set()
    for f, fd in file_fds:
        parts = f.path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/work/" + "/".join(parts[:i])
            if d not in made:
                made.add(d)
                args += ["--perms", "0755", "--dir", d]
        args += ["--perms", "0755" if f.executable else "0644", "--file", str(fd), f"/work/{f.path}"]
    args += ["--chdir", "/work", "--remount-ro", "/", "--clearenv"]
    for k, v in SANDBOX_ENV.items():
        args += ["--setenv", k, v]
    if status_fd is not None:
        args += ["--json-status-fd", str(status_fd)]
    args += ["--", "prlimit", *rlimit_args(limits, memory_by_rlimit=memory_by_rlimit), "--", *argv]
    return args


def _privdrop_args(uid: int) -> list[str]:
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


class BwrapSession(SupervisedSession):
    def __init__(self, proc: Supervised, cg: RunCgroups | None, limits: Limits, status_r: int, uid: int):
        super().__init__(proc, limits)
        self._uid = uid
        self._cg = cg
        self._status_r = status_r

    def finish(self) -> ExecResult:
        if self._result is not None:
            return self._result
        try:
            raw = self._proc.wait()
        finally:
            with _launch_lock:
                _unreaped.discard(self._proc.pid)
            os.close(self._status_r)
            cg_stats = self._close_cgroups()
        oom, cpu_cg, peak_cg = cg_stats
        ru = raw.rusage
        cpu = cpu_cg if cpu_cg is not None else ((ru.ru_utime + ru.ru_stime) if ru else 0.0)
        peak = (peak_cg / _MIB) if peak_cg is not None else ((ru.ru_maxrss / 1024) if ru else 0.0)
        # bwrap reports the exit code only of a program it started; a run we killed never gets
        # that far, but the caller's kill of a live session is no setup failure either.
        started = b'"exit-code"' in raw.side or (self._proc.killed and b'"child-pid"' in raw.side)
        if not _reap_init(raw.side):
            # Killed before bwrap told us its init's pid, or the init outlived the wait: find it.
            _reap_lost_inits(self._uid, wait_s=2.0 if self._proc.killed else 0.0)
        if raw.exit_code == 125 and not started and raw.stderr.startswith(b"sh: "):
            raise SandboxError(f"cannot move the sandbox into its cgroups: {raw.stderr.decode(errors='replace')}")
        ex = Exit(
            exit_code=raw.exit_code,
            signal=raw.signal,
            started=started,
            timed_out=raw.timed_out,
            output_limited=raw.output_limited,
            oom_killed=oom,
            cpu_s=cpu,
            peak_memory_mb=peak,
            wall_s=raw.wall_s,
        )
        self._result = classify(ex, self._limits, raw.stdout, raw.stderr, raw.stdout_truncated, raw.stderr_truncated)
        return self._result

    def _close_cgroups(self) -> tuple[bool, float | None, int | None]:
        if self._cg is None:
            return False, None, None
        try:
            stats = (self._cg.oom_killed(), self._cg.cpu_seconds(), self._cg.peak_memory_bytes())
        finally:
            try:
                self._cg.close()
            except OSError as exc:
                raise SandboxError(f"sandbox cleanup failed: {exc}") from exc
        return stats


class BwrapBackend(Backend):
    """bubblewrap, started as host uid `uid` (one per slot). See the module docstring for what it isolates."""

    name = "bwrap"
    check_hint = "; are unprivileged user namespaces enabled (sysctl user.max_user_namespaces > 0)?"

    def __init__(self, uid: int = 61000, *, bwrap: str = "bwrap", use_cgroups: bool = True):
        missing = [t for t in (bwrap, "prlimit", "sh") if shutil.which(t) is None]
        self._root = os.geteuid() == 0
        if self._root and shutil.which("setpriv") is None:
            missing.append("setpriv")
        if missing:
            raise SandboxUnavailable(
                f"bwrap backend: {', '.join(missing)} not found on PATH; install bubblewrap and util-linux "
                "(apt-get install bubblewrap util-linux) or use sandbox.backend: apptainer"
            )
        if self._root and uid <= 0:
            raise SandboxUnavailable(f"bwrap backend: slot uid must be an unprivileged uid > 0 (got {uid})")
        self.uid = uid if self._root else os.geteuid()
        # As root each slot is its own host uid: nobody's account, and no other server's slot.
        self._claim = claim_slot_uid(uid) if self._root else None
        if self._claim is not None:
            weakref.finalize(self, self._claim.release)
        self.bwrap = shutil.which(bwrap)
        self.cgroups: CgroupSupport = probe() if (use_cgroups and self._root) else CgroupSupport()
        _become_subreaper()
        self._layout = _host_layout()
        global _announced
        if not _announced:  # once per process: which limits this machine lets us enforce
            _announced = True
            log.info(
                "bwrap sandbox: cgroups: %s%s",
                self.cgroups.describe(),
                "" if self._root else "; not root: no per-slot uids, no cgroups",
            )

    def close(self) -> None:
        """Give up this backend's slot uid (another process may then use it); idempotent."""
        if self._claim is not None:
            self._claim.release()

    def describe(self) -> str:
        who = f"uid {self.uid}" + ("" if self._root else " (not root: no per-slot uid)")
        return f"bwrap as {who}; cgroups: {self.cgroups.describe()}"

    def _launch(self, files: tuple[SourceFile, ...], argv: tuple[str, ...], limits: Limits) -> Session:
        fds: list[int] = []
        file_fds = []
        status_r, status_w = os.pipe()
        cg = None
        try:
            for f in files:
                fd = os.memfd_create("hpcrl-src", 0)
                fds.append(fd)
                _write_all(fd, f.data)
                os.lseek(fd, 0, os.SEEK_SET)
                file_fds.append((f, fd))
            memory_cg = self.cgroups.memory
            cmd = bwrap_args(
                argv,
                limits,
                file_fds,
                status_fd=status_w,
                memory_by_rlimit=not memory_cg,
                bwrap=self.bwrap,
                layout=self._layout,
            )
            if self._root:
                cmd = _privdrop_args(self.uid) + cmd
            if any((self.cgroups.memory_dir, self.cgroups.pids_dir, self.cgroups.cpu_dir, self.cgroups.kill_dir)):
                # The outer bwrap, its pid-1 and the launcher count towards pids.max: leave room.
                cg = RunCgroups.create(self.cgroups, memory_bytes=limits.memory_mb * _MIB, pids_max=limits.pids + 4)
                cmd = ["/bin/sh", "-c", _JOIN_SH, "sh", *cg.procs_files, "--", *cmd]
            proc = Supervised(
                cmd,
                env=dict(_LAUNCH_ENV),
                output_cap=limits.output_kb * 1024,
                deadline=time.monotonic() + limits.wall_s,
                pass_fds=[*fds, status_w],
                side_fd=status_r,
                on_kill=cg.kill if cg else None,
            )
            with _launch_lock:  # a sweep must never take a launched outer bwrap for a lost init
                proc.start()
                _unreaped.add(proc.pid)
        except BaseException:
            os.close(status_r)
            if cg is not None:
                cg.close()
            raise
        finally:
            os.close(status_w)
            for fd in fds:
                os.close(fd)
        return BwrapSession(proc, cg, limits, status_r, self.uid)


_subreaper = False
_announced = False
# Pids of outer bwraps (our own children, run as the slot uid) not yet reaped by their session.
_unreaped: set[int] = set()
_launch_lock = threading.Lock()


def _become_subreaper() -> bool:
    """Adopt orphans, so the sandbox's pid-1 can be reaped here (see `_reap_init`)."""
    global _subreaper
    if not _subreaper:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _subreaper = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except OSError:
            _subreaper = False
        if not _subreaper:
            log.warning("cannot become a child subreaper: sandbox pid-1 processes are left for the host's init to reap")
    return _subreaper


def _reap_init(side: bytes, timeout_s: float = 5.0) -> bool:
    """Reap the sandbox's pid-1 (bwrap's init), orphaned to us when the outer bwrap exits.

    The outer bwrap exits as soon as the init reports the program's status, before the init
    itself is gone; its zombie would otherwise wait for the host's pid 1, which in a container
    may never reap. As subreaper we own it, and nobody else can reap it, so its pid is safe.
    Returns whether it is gone (False: its pid is unknown, or it was still alive at the timeout).
    """
    if not _subreaper:
        return True  # nothing comes to us; nothing to do
    m = re.search(rb'"child-pid": (\d+)', side)
    if not m:
        return False
    pid = int(m.group(1))
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return True  # already reaped
    try:
        select.select([fd], [], [], timeout_s)
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False  # not (yet) ours: leave it to the sweep
    finally:
        os.close(fd)


def _reap_lost_inits(uid: int, wait_s: float) -> None:
    """Reap every orphaned sandbox init of slot `uid` that came to us: bwrap processes that are
    our children but none of the outer bwraps we launched (those are in `_unreaped`).

    Needed when the outer bwrap was killed before it reported its init's pid: the init, killed
    with it, still comes to us as a zombie. Live ones (dying) are waited for up to `wait_s`.
    """
    if not _subreaper:
        return
    me = str(os.getpid())
    deadline = time.monotonic() + wait_s
    while True:
        alive = 0
        with _launch_lock:
            for pid, state in _bwrap_children(me, uid):
                if pid in _unreaped:
                    continue
                if state != "Z":
                    alive += 1
                    continue
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        if not alive or time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def _bwrap_children(ppid: str, uid: int) -> list[tuple[int, str]]:
    """(pid, state) of the bwrap processes of `uid` whose parent is `ppid` (a /proc scan)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
            comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")]
            state, parent = stat[stat.rindex(b")") + 2 :].split(b" ", 2)[:2]
            if comm != b"bwrap" or parent.decode() != ppid or os.stat(f"/proc/{name}").st_uid != uid:
                continue
        except (OSError, ValueError):
            continue  # gone meanwhile
        found.append((int(name), state.decode()))
    return found


def unavailable_reason(uid: int = 61000) -> str | None:
    """Why the bwrap backend cannot run here (None: it can): missing tools, or a trivial run fails."""
    try:
        backend = BwrapBackend(uid=uid)
    except SandboxUnavailable as exc:
        return str(exc)
    try:
        backend.check()
    except SandboxUnavailable as exc:
        return str(exc)
    finally:
        backend.close()
    return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
