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
  /work (the program, copied in through memfds), /tmp and /dev/shm are tmpfs capped in bytes
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
import time
import weakref

from hpcrl.sandbox.backend import Backend, Exit, Session, SupervisedSession, classify, rlimit_args
from hpcrl.sandbox.cgroups import CgroupSupport, RunCgroups, probe
from hpcrl.sandbox.launcher import JOIN_FAILED, TMPFS_DIR, helper, launcher_args
from hpcrl.sandbox.process import Supervised, become_subreaper, reap_group
from hpcrl.sandbox.result import ExecResult, SandboxError, SandboxUnavailable
from hpcrl.sandbox.seccomp import filter_program
from hpcrl.sandbox.seccomp import supported as seccomp_supported
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
_INNER_UID = 65534
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
    memory: str,
    reserve_mb: int = 0,
    seccomp_fd: int | None = None,
    bwrap: str = "bwrap",
    layout: list[str] | None = None,
    workspace: str | None = None,
) -> list[str]:
    """The bwrap command line for `argv` under `limits`, `file_fds` copied into /work, memory capped
    by `memory` (backend.rlimit_args), the filter of hpcrl.sandbox.seccomp read from `seccomp_fd`.
    `workspace`: a host directory bound as /work instead of the run's tmpfs (a session's; it must
    not lie under /tmp, which the launcher covers with its own tmpfs). Pure."""
    args = [
        bwrap,
        # Everything but the pid namespace, which is the launcher's (bwrap is its pid 1).
        "--unshare-user",
        "--unshare-ipc",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
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
        # The launcher's tmpfs, capped in bytes and inodes (bwrap's own --size caps bytes only);
        # /dev/shm would otherwise be a writable tmpfs of half the host's RAM.
        "--bind",
        f"{TMPFS_DIR}/shm",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--bind",
        f"{TMPFS_DIR}/tmp",
        "/tmp",
        "--bind",
        workspace if workspace is not None else f"{TMPFS_DIR}/work",
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
    env = dict(SANDBOX_ENV)
    if memory == "address_space":
        # glibc reserves 64 MiB of address space per malloc arena (one per thread, up to 8 per
        # core): under RLIMIT_AS that, not memory, would stop a threaded program.
        env["MALLOC_ARENA_MAX"] = "2"
    for k, v in env.items():
        args += ["--setenv", k, v]
    if status_fd is not None:
        args += ["--json-status-fd", str(status_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--", "prlimit", *rlimit_args(limits, memory=memory, reserve_mb=reserve_mb), "--", *argv]
    return args


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
        # bwrap reports the exit code only of a program it started; a run we killed never gets
        # that far, but the caller's kill of a live session is no setup failure either.
        started = b'"exit-code"' in raw.side or (self._proc.killed and b'"child-pid"' in raw.side)
        if raw.exit_code == 125 and not started and raw.stderr.startswith(JOIN_FAILED):
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

    def __init__(
        self,
        uid: int = 61000,
        *,
        bwrap: str = "bwrap",
        use_cgroups: bool = True,
        memory_fallback: str = "address_space",
    ):
        missing = [t for t in (bwrap, "prlimit") if shutil.which(t) is None]
        self._root = os.geteuid() == 0
        if missing:
            raise SandboxUnavailable(
                f"bwrap backend: {', '.join(missing)} not found on PATH; install bubblewrap and util-linux "
                "(apt-get install bubblewrap util-linux) or use sandbox.backend: apptainer"
            )
        if self._root and uid <= 0:
            raise SandboxUnavailable(f"bwrap backend: slot uid must be an unprivileged uid > 0 (got {uid})")
        self.uid = uid if self._root else os.geteuid()
        self._launch_path = helper()  # before the slot is claimed: a host without a compiler fails here
        self._languages: tuple[str | None, tuple[str, ...]] = (None, ())
        # As root each slot is its own host uid: nobody's account, and no other server's slot.
        self._claim = claim_slot_uid(uid) if self._root else None
        if self._claim is not None:
            weakref.finalize(self, self._claim.release)
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
        return f"bwrap as {who}; {memory}; {seccomp}; cgroups: {self.cgroups.describe()}"

    def _launch(
        self,
        files: tuple[SourceFile, ...],
        argv: tuple[str, ...],
        limits: Limits,
        *,
        reserve_mb: int = 0,
        workspace: str | None = None,
    ) -> Session:
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
            seccomp_fd = None
            if self._seccomp is not None:
                seccomp_fd = os.memfd_create("hpcrl-seccomp", 0)  # bwrap reads it to the end and closes it
                fds.append(seccomp_fd)
                _write_all(seccomp_fd, self._seccomp)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
            cmd = bwrap_args(
                argv,
                limits,
                file_fds,
                status_fd=status_w,
                memory=self.memory,
                reserve_mb=reserve_mb,
                seccomp_fd=seccomp_fd,
                bwrap=self.bwrap,
                layout=self._layout,
                workspace=workspace,
            )
            if self.cgroups.dirs():
                # The launcher, its pid 1 (bwrap) and prlimit count towards pids.max: leave room.
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
                deadline=time.monotonic() + limits.wall_s,
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
        return BwrapSession(proc, cg, limits, status_r, self.uid)


_announced = False


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
