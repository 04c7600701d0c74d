"""The bubblewrap backend: local machines and CI, as root (per-slot uids, cgroups) or as a normal user.

What it isolates (checked by tests/test_sandbox_adversarial.py, test_sandbox_memory.py and
`bench/sandbox.py --abuse`, which counts the probes contained):

* Processes: every process of a run lives in a pid namespace of the launcher's
  (hpcrl.sandbox.launcher), armed to die with the server even when it is SIGKILLed; the program
  sees only bwrap (pid 1) and its own processes. New IPC, UTS, network, cgroup and user
  namespaces; the program is uid 65534 inside and, as root, an unprivileged per-slot uid
  outside (the launcher drops to it, all capabilities and groups gone, no_new_privs; no account's
  uid and no other server's, hpcrl.sandbox.uids), never root; not root, it is our own uid.
  `--new-session` (no TIOCSTI into our terminal), `--disable-userns` (no nested user
  namespace to remount from). Killing the launcher ends the run, setsid daemons included;
  where cgroups exist, what is left in the run's cgroup is killed as well.
* Files: read-only /usr (+ the /bin, /lib symlinks, /etc/alternatives, /etc/ld.so.cache),
  a read-only root, nothing else of the host: no /home, /root, run directories or sockets.
  /work (the program, written there by the launcher helper from stdin), /tmp and /dev/shm are tmpfs capped in bytes
  and in inodes (`Limits.inodes`: empty files take no space) that vanish with the run (a
  session's run binds its workspace as /work instead: a tmpfs with the same caps that lives
  until the session closes, hpcrl.sandbox.workspace). The
  environment is cleared (PATH, HOME, TMPDIR, LANG; MALLOC_ARENA_MAX under RLIMIT_AS).
* Network: a new network namespace with loopback only; no DNS, no host TCP or unix sockets.
* Resources: rlimits set inside (CPU seconds, file size, processes, open files, no core
  dumps), a memory, a pids and a cpu cgroup per run where this machine lets us create them
  (`describe()` says which: runs share the CPU by equal weight, each capped at `Limits.cpus`
  cores however many processes it starts), output caps and a wall deadline from outside.
* System calls: a seccomp filter (hpcrl.sandbox.seccomp) answers ENOSYS to memfd_create,
  memfd_secret and SysV shmget (memory no rlimit counts), io_uring, userfaultfd,
  perf_event_open, bpf and the keyring calls (kernel surface), and setsid (see below), on
  x86_64 and aarch64; elsewhere there is none, and describe() says so.

What it does not isolate:

* The kernel: a kernel exploit escapes (gVisor `runsc` would add a user-space kernel at
  ~190 ms per run); the filter removes only the calls above.
* Without a memory cgroup (not root, or none can be made) `sandbox.memory_fallback` decides:
  `address_space` (default) caps each process's address space (RLIMIT_AS = memory_mb plus
  the language's reserve; node: 1 GiB) and its private memory (RLIMIT_DATA = memory_mb), so
  private and shared mappings count and, with the filter, user memory is held only in mappings
  and in the capped tmpfs;
  what that costs: the cap is per process, so a run may hold up to `pids` times memory_mb in
  total (8 processes x 200 MiB under 256 MiB got through); reserved but untouched address space
  counts (thread stacks, malloc arenas); a runtime reserving more than its language's reserve
  does not start; kernel memory (socket buffers, page tables) is not capped; peak memory is the
  largest process's, CPU time that of processes reaped (a killed run's may count less).
  `refuse` will not run without a memory cgroup; `data` is RLIMIT_DATA alone, which leaves
  shared mappings unbounded (unsafe).
* Without a cpu controller there is no CPU quota: RLIMIT_CPU bounds each process's seconds,
  and the share between runs is the kernel's autogroups (one per session; setsid is refused,
  so a run stays one) where they apply: kernel.sched_autogroup_enabled=1 and the server in the
  root cpu cgroup. Inside a Slurm job's cgroup, or with autogroups off, a run with many busy
  processes can starve other slots into timeouts. Disk I/O bandwidth of reading /usr is not
  limited.
* /usr of the host is visible read-only: installed software and its versions can be read.
* A program that exits with status 128+N by itself is reported as killed by signal N.

Side effects on the calling process: it becomes a child subreaper (prctl), so that the pid 1
of a launcher it killed is reaped here, not left as a zombie for the host's init; as root it
holds a lock per slot uid (/run/lock/hpcrl-sandbox) until `close()` or its end.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from hpcrl.sandbox.backend import Backend, Exit, Session, SupervisedSession, classify
from hpcrl.sandbox.cgroups import CgroupSupport, RunCgroups, probe
from hpcrl.sandbox.launcher import (
    EXEC,
    FAIL,
    JOIN_FAILED,
    READY,
    bwrap_args,
    exec_header,
    helper,
    host_layout,
    launcher_args,
)
from hpcrl.sandbox.process import Supervised, become_subreaper, reap_group
from hpcrl.sandbox.result import ExecResult, SandboxError, SandboxUnavailable
from hpcrl.sandbox.seccomp import filter_program
from hpcrl.sandbox.seccomp import supported as seccomp_supported
from hpcrl.sandbox.spec import Limits, SourceFile
from hpcrl.sandbox.uids import claim_slot_uid

log = logging.getLogger(__name__)

__all__ = ["BwrapBackend", "unavailable_reason"]

# Only this reaches the launcher (and so /proc/1/environ inside): never the server's own environment.
_LAUNCH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
_MIB = 1024 * 1024


_MARKS = len(READY) + len(EXEC)  # what the helper writes to stdout before the program runs
_IDLE_S = 365 * 86400.0  # a sandbox started ahead waits without a wall limit until it is given its command
_AHEAD_KEYS = 2  # limits a backend keeps a sandbox started for (a compiled language: compile and run)


class BwrapSession(SupervisedSession):
    def __init__(self, proc: Supervised, cg: RunCgroups | None, limits: Limits, status_r: int):
        super().__init__(proc, limits)
        self._cg = cg
        self._status_r = status_r
        self._then: Callable[[], None] | None = None

    def go(self, files: tuple[SourceFile, ...], argv: tuple[str, ...], limits: Limits) -> None:
        """Give the waiting sandbox its files and command; its wall clock and output caps start now."""
        self._limits = limits
        self._proc.output_cap = limits.output_kb * 1024
        self._proc.start_clock(limits.wall_s)
        self._proc.send(exec_header(files, argv))

    def read_line(self, timeout_s: float) -> bytes | None:
        if self._consumed < _MARKS:  # the helper's markers first: the program's output follows them
            out, deadline = self._proc.out, time.monotonic() + timeout_s
            if not self._proc.pump(lambda: len(out) >= _MARKS, deadline=deadline) or out[:_MARKS] != READY + EXEC:
                return None
            self._consumed = _MARKS
            timeout_s = max(0.0, deadline - time.monotonic())
        return super().read_line(timeout_s)

    def finish(self) -> ExecResult:
        if self._result is not None:
            return self._result
        try:
            return self._finish()
        finally:
            then, self._then = self._then, None
            if then is not None:
                then()

    def _finish(self) -> ExecResult:
        try:
            raw = self._proc.wait()
            # The launcher was killed (or died) before the pid 1 of its namespace: that process,
            # killed with it, is orphaned to us (subreaper); reap it, and so the namespace.
            reap_group(self._proc.pid, timeout_s=5.0)
        finally:
            os.close(self._status_r)
            cg_stats = self._close_cgroups()
        oom, cpu_cg, peak_cg = cg_stats
        ru = raw.rusage
        cpu = cpu_cg if cpu_cg is not None else ((ru.ru_utime + ru.ru_stime) if ru else 0.0)
        peak = (peak_cg / _MIB) if peak_cg is not None else ((ru.ru_maxrss / 1024) if ru else 0.0)
        # The program ran only if the helper said it would exec it (nothing before that marker is
        # the program's); bwrap reports the exit code of the program it started, and a run we
        # killed never gets that far.
        ran = raw.stdout[:_MARKS] == READY + EXEC
        stdout = raw.stdout[_MARKS:] if ran else b""
        started = ran and (b'"exit-code"' in raw.side or self._proc.killed)
        if raw.exit_code == 125 and not started and raw.stderr.startswith(JOIN_FAILED):
            raise SandboxError(f"cannot move the sandbox into its cgroups: {raw.stderr.decode(errors='replace')}")
        if raw.stdout[:_MARKS] == READY + FAIL and not self._proc.killed:
            log.warning("sandbox setup failed: %s", raw.stderr.decode(errors="replace").strip()[-300:])
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
        self._result = classify(ex, self._limits, stdout, raw.stderr, raw.stdout_truncated, raw.stderr_truncated)
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


def _discard(s: BwrapSession) -> None:
    """End a sandbox that was started ahead and never given a command."""
    s.kill()
    try:
        s.finish()
    except SandboxError as exc:
        log.warning("a sandbox started ahead ended badly: %s", exc)


def _close(ahead: dict, claim) -> None:
    """The backend's end (close() or its finalizer): its waiting sandboxes before its uid."""
    while ahead:
        _discard(ahead.pop(next(iter(ahead))))
    if claim is not None:
        claim.release()


class BwrapBackend(Backend):
    """bubblewrap, started as host uid `uid` (one per slot). See the module docstring for what it isolates."""

    name = "bwrap"
    check_hint = "; are unprivileged user namespaces enabled (sysctl user.max_user_namespaces > 0)?"

    def __init__(
        self,
        uid: int = 61000,
        *,
        bwrap: str = "bwrap",
        use_cgroups: bool = True,
        memory_fallback: str = "address_space",
        start_ahead: bool = True,
    ):
        missing = [t for t in (bwrap,) if shutil.which(t) is None]
        self._root = os.geteuid() == 0
        if missing:
            raise SandboxUnavailable(
                f"bwrap backend: {', '.join(missing)} not found on PATH; install bubblewrap "
                "(apt-get install bubblewrap) or use sandbox.backend: apptainer"
            )
        if self._root and uid <= 0:
            raise SandboxUnavailable(f"bwrap backend: slot uid must be an unprivileged uid > 0 (got {uid})")
        self.uid = uid if self._root else os.geteuid()
        self._launch_path = helper()  # before the slot is claimed: a host without a compiler fails here
        self._exec_binary = Path(self._launch_path).read_bytes()  # the sandbox's first program, the same helper
        self._languages: tuple[str | None, tuple[str, ...]] = (None, ())
        # Per limits (less the wall clock and output cap, set when it is used): the sandbox started
        # for the next run, oldest first. Taken by a run, replaced when that run finishes.
        self.start_ahead = start_ahead
        self._ahead: dict[tuple[Limits, int], BwrapSession] = {}
        self._ahead_lock = threading.Lock()
        # As root each slot is its own host uid: nobody's account, and no other server's slot.
        self._claim = claim_slot_uid(uid) if self._root else None
        self._closed = False
        self._finalizer = weakref.finalize(self, _close, self._ahead, self._claim)
        self.bwrap = shutil.which(bwrap)
        self.cgroups: CgroupSupport = probe() if (use_cgroups and self._root) else CgroupSupport()
        if memory_fallback not in ("refuse", "address_space", "data"):
            raise ValueError(f"memory_fallback must be refuse, address_space or data (got {memory_fallback!r})")
        if not self.cgroups.memory and memory_fallback == "refuse":
            self.close()
            why = "not root" if not self._root else ("cgroups not used" if not use_cgroups else "none can be made here")
            raise SandboxUnavailable(
                f"bwrap backend: no memory cgroup ({why}) and sandbox.memory_fallback is refuse; run as root where "
                "cgroups can be made, or set memory_fallback: address_space (each process's address space "
                "capped; see sandbox/bwrap.py for what that costs)"
            )
        self.memory = "cgroup" if self.cgroups.memory else memory_fallback
        self._seccomp = filter_program() if seccomp_supported() else None
        if not become_subreaper():
            log.warning("cannot become a child subreaper: killed sandboxes are left for the host's init to reap")
        self._layout = host_layout()
        global _announced
        if not _announced:  # once per process: which limits this machine lets us enforce
            _announced = True
            log.info(
                "bwrap sandbox: cgroups: %s%s",
                self.cgroups.describe(),
                "" if self._root else "; not root: no per-slot uids, no cgroups",
            )

    def close(self) -> None:
        """End the sandboxes started ahead and give up this backend's slot uid (another process
        may then use it); idempotent."""
        with self._ahead_lock:
            self._closed = True
        self._finalizer()

    @property
    def waiting(self) -> tuple[int, ...]:
        """The launcher pids of the sandboxes started ahead: they run as this slot's uid, with
        nothing of a program in them, until a run takes them or the backend closes."""
        with self._ahead_lock:
            return tuple(s._proc.pid for s in self._ahead.values())

    def settle(self, timeout_s: float) -> bool:
        """Wait until every sandbox started ahead waits for its command (True), or `timeout_s`
        passed (False). One that died meanwhile (killed from outside) is ended and forgotten."""
        deadline = time.monotonic() + timeout_s
        with self._ahead_lock:
            waiting = list(self._ahead.items())
        for key, s in waiting:
            out = s._proc.out
            if s._proc.pump(lambda out=out: len(out) >= len(READY), deadline=deadline):
                continue
            if time.monotonic() >= deadline:
                return False
            with self._ahead_lock:
                if self._ahead.get(key) is s:
                    del self._ahead[key]
            _discard(s)
        return True

    def languages(self) -> tuple[str, ...]:
        """The languages whose tools are on this PATH, looked up once per PATH (every run asks)."""
        path = os.environ.get("PATH", "")
        if self._languages[0] != path:
            self._languages = (path, super().languages())
        return self._languages[1]

    def describe(self) -> str:
        who = f"uid {self.uid}" + ("" if self._root else " (not root: no per-slot uid)")
        memory = {
            "cgroup": f"memory: {self.cgroups.memory_version} cgroup",
            "address_space": "memory: RLIMIT_AS per process (no memory cgroup)",
            "data": "memory: RLIMIT_DATA per process only (no memory cgroup; shared mappings unbounded)",
        }[self.memory]
        seccomp = "seccomp filter" if self._seccomp else "no seccomp filter (unknown architecture)"
        ahead = "the next sandbox started ahead" if self.start_ahead else "each sandbox started on demand"
        return f"bwrap as {who}; {memory}; {seccomp}; cgroups: {self.cgroups.describe()}; {ahead}"

    def _launch(
        self,
        files: tuple[SourceFile, ...],
        argv: tuple[str, ...],
        limits: Limits,
        *,
        reserve_mb: int = 0,
        workspace: str | None = None,
    ) -> Session:
        # A session's command binds its workspace, known only now: always started on demand.
        key = (limits.replace(wall_s=1.0, output_kb=1), reserve_mb) if workspace is None else None
        s = self._take(key) if key is not None and self.start_ahead else None
        if s is None:
            s = self._start(limits, reserve_mb, workspace)
        if key is not None and self.start_ahead:
            me = weakref.ref(self)
            s._then = lambda: (b := me()) is not None and b._refill(key)
        s.go(files, argv, limits)
        return s

    def _take(self, key: tuple[Limits, int]) -> BwrapSession | None:
        with self._ahead_lock:
            s = self._ahead.pop(key, None)
        if s is not None and not s.alive():  # it died waiting (e.g. the host's OOM killer)
            _discard(s)
            s = None
        return s

    def _refill(self, key: tuple[Limits, int]) -> None:
        """Start the next run's sandbox for `key`, keeping those of the last _AHEAD_KEYS limits."""
        with self._ahead_lock:
            if self._closed or key in self._ahead:
                return
        try:
            s = self._start(key[0], key[1], None)
        except (OSError, SandboxError) as exc:
            log.warning("cannot start a sandbox ahead (the next run starts its own): %s", exc)
            return
        with self._ahead_lock:
            if self._closed or key in self._ahead:
                old = s
            else:
                self._ahead[key] = s
                old = self._ahead.pop(next(iter(self._ahead))) if len(self._ahead) > _AHEAD_KEYS else None
        if old is not None:
            _discard(old)

    def _start(self, limits: Limits, reserve_mb: int, workspace: str | None) -> BwrapSession:
        """A sandbox under `limits` whose first program waits for its command (BwrapSession.go)."""
        fds: list[int] = []
        status_r, status_w = os.pipe()
        cg = None
        try:
            exec_fd = os.memfd_create("hpcrl-exec", 0)  # bwrap copies it into the sandbox and closes it
            fds.append(exec_fd)
            _write_all(exec_fd, self._exec_binary)
            os.lseek(exec_fd, 0, os.SEEK_SET)
            seccomp_fd = None
            if self._seccomp is not None:
                seccomp_fd = os.memfd_create("hpcrl-seccomp", 0)  # bwrap reads it to the end and closes it
                fds.append(seccomp_fd)
                _write_all(seccomp_fd, self._seccomp)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
            cmd = bwrap_args(
                limits,
                exec_fd=exec_fd,
                status_fd=status_w,
                memory=self.memory,
                reserve_mb=reserve_mb,
                seccomp_fd=seccomp_fd,
                bwrap=self.bwrap,
                layout=self._layout,
                workspace=workspace,
            )
            if self.cgroups.dirs():
                # The launcher and its pid 1 (bwrap) count towards pids.max: leave room.
                cg = RunCgroups.create(
                    self.cgroups, memory_bytes=limits.memory_mb * _MIB, pids_max=limits.pids + 4, cpus=limits.cpus
                )
            cgroups = cg.procs_files if cg is not None else []
            cmd = (
                launcher_args(limits, self.uid if self._root else None, cgroups=cgroups, launch=self._launch_path) + cmd
            )
            proc = Supervised(
                cmd,
                env=dict(_LAUNCH_ENV),
                output_cap=limits.output_kb * 1024,
                deadline=time.monotonic() + _IDLE_S,
                pass_fds=[*fds, status_w],
                side_fd=status_r,
                on_kill=cg.kill if cg else None,
            )
            proc.start()
        except BaseException:
            os.close(status_r)
            if cg is not None:
                cg.close()
            raise
        finally:
            os.close(status_w)
            for fd in fds:
                os.close(fd)
        proc.out_head = _MARKS
        return BwrapSession(proc, cg, limits, status_r)


_announced = False


def unavailable_reason(uid: int = 61000) -> str | None:
    """Why the bwrap backend cannot run here (None: it can): missing tools, or a trivial run fails."""
    try:
        backend = BwrapBackend(uid=uid, start_ahead=False)  # one check: nothing to start ahead for
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
