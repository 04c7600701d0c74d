"""A sandbox's command line: one small helper, one fork, a pid namespace of our own, bwrap, the helper again.

    hpcrl-launch (sandbox/launch.c, built once per host with the C compiler; one exec)
      [root] this pid into the run's cgroups
      [root] drop to the slot uid: no groups, no capabilities in any set, no_new_privs
      SIGKILL when the server dies; stop if the server is already gone
      new user (slot uid -> root), mount (private) and pid namespaces; fork:
      `-> pid 1 of the new pid namespace, SIGKILL when the launcher dies; stop if it is gone;
            a procfs of this namespace on /proc; tmpfs /tmp/{work,tmp,shm} with size= and
            nr_inodes= (bwrap's --size has no inode cap)
            exec bwrap ...           pid 1 here; the program is the only other process:
              hpcrl-launch --exec    bwrap's child, the program's uid, under the seccomp filter:
                                     waits for the files and the command on stdin, writes the
                                     files to /work, sets the rlimits, execs the command

It does in one process what a chain of `sh` (cgroups), `setpriv`, `unshare` and `sh` + two
`mount`s did in six execs, which cost more than bwrap itself. Why each step:

* A server that is SIGKILLed must take its sandboxes with it. bwrap's --die-with-parent arms
  PR_SET_PDEATHSIG in the outer bwrap only after it has made its namespaces, and in its init
  only after the whole mount setup: a kill in between (milliseconds; 18 of 30 kills of a busy
  server in a test) left a sandbox running with nobody to enforce its wall limit. Here the
  launcher arms its parent-death signal after the uid change (which would clear it) and then
  checks that its parent is still the server (else the server died first, and the signal will
  never come); the namespace's pid 1 arms its own right after the fork and checks that the
  launcher is still there (a pipe whose other end only the launcher holds). Every other
  process of the sandbox lives in that pid namespace; when its pid 1 dies the kernel kills all
  of it. So nothing of a sandbox outlives its launcher, and nothing but pid 1 can be orphaned
  (the backend, a subreaper, reaps it). bwrap makes no pid namespace of its own: it is pid 1
  of ours, its init is not needed. The launcher ends as pid 1 ended (exit status or signal).
* In the user namespace the slot uid is root, and nothing outside it. Pid 1 mounts the run's
  tmpfs there with `nr_inodes=` as well as `size=`, so empty files (which take no space) cannot
  exhaust inodes and kernel memory; the mounts vanish with the namespace, and bwrap binds them
  to /work, /tmp and /dev/shm. bwrap runs in it as that root with the namespace's
  capabilities, drops them (--cap-drop ALL) and nests its own user namespace, in which the
  program is uid 65534: it holds no capability in either, and from there cannot ptrace or
  read the environment of bwrap (a parent user namespace's process); SIGKILL from inside the
  pid namespace does not reach its pid 1.

* The sandbox is made before anybody says what runs in it, so a slot can keep its next one
  started (hpcrl.sandbox.bwrap): joining a cgroup costs an RCU grace period (~9 ms here, on
  any write to cgroup.procs) and bwrap's setup as much again, none of which depends on the
  program. The first program is the helper itself (`--exec`, delivered by bwrap as a file of
  the sandbox's root); the program cannot run before it has written its markers to stdout
  (READY, then EXEC or FAIL), so the server strips them knowing they are not the program's.
  It replaces prlimit in the chain: one exec, rlimits set after the files are written.

`bwrap_args` is the bwrap part (what the sandbox sees: sandbox/bwrap.py says what it isolates).

The helper is compiled from its source the first time a backend needs it on a host, into a
cache directory of the server's user that nobody else can write (`helper()`); its name holds a
hash of the source and compiler, so a changed source builds anew.

Exit status 125 from the launcher means a step refused (its message on stderr starts with
`hpcrl-launch:`, a failure to join the cgroups with `hpcrl-launch: cannot join the cgroup`);
an orphaned step stops silently, for nobody is listening any more.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from hpcrl.sandbox.backend import rlimit_args
from hpcrl.sandbox.result import SandboxUnavailable
from hpcrl.sandbox.spec import Limits, SourceFile

__all__ = [
    "launcher_args",
    "helper",
    "fstab",
    "TMPFS_DIR",
    "tmpfs_options",
    "JOIN_FAILED",
    "EXEC_PATH",
    "exec_args",
    "exec_header",
    "READY",
    "EXEC",
    "FAIL",
    "bwrap_args",
    "host_layout",
    "SANDBOX_ENV",
]

_MIB = 1024 * 1024
# Where pid 1 mounts the sandbox's tmpfs, in the launcher's own mount namespace (it hides the
# host's /tmp from bwrap, which needs nothing there; bwrap resolves --bind sources in the old
# root, so its own tmpfs on /tmp does not hide these).
TMPFS_DIR = "/tmp"
# How the launcher's refusal to join the run's cgroups starts on stderr.
JOIN_FAILED = b"hpcrl-launch: cannot join the cgroup"
# Where bwrap puts the helper inside the sandbox, to run first as the program's uid (`--exec`).
EXEC_PATH = "/.hpcrl-exec"
# What that first program writes to stdout before anything of the program's: waiting for its
# command; about to exec it; could not (why on stderr). Same length, each with a NUL of its own.
READY, EXEC, FAIL = b"\0hpcrl-ready\n", b"\0hpcrl-exec\n", b"\0hpcrl-fail\n"
_SOURCE = Path(__file__).with_name("launch.c")
_CFLAGS = ["-O2", "-Wall", "-Werror"]


def tmpfs_options(size_mb: int, inodes: int, mode: str = "0755") -> str:
    return f"size={size_mb * _MIB},nr_inodes={inodes},mode={mode}"


def fstab(limits: Limits) -> list[str]:
    """The launcher's mounts, in fstab syntax: a procfs of the new pid namespace over /proc
    (bwrap, which makes no pid namespace, binds the /proc it finds; the host's would show every
    host process), and the run's three tmpfs, capped in bytes and inodes (under a small tmpfs
    the launcher mounts over /tmp first). Pure."""
    return ["hpcrl-proc /proc proc nosuid,nodev,noexec 0 0"] + [
        f"hpcrl-{name} {TMPFS_DIR}/{name} tmpfs {tmpfs_options(mb, limits.inodes)},X-mount.mkdir 0 0"
        for name, mb in (("work", limits.work_mb), ("tmp", limits.tmp_mb), ("shm", limits.shm_mb))
    ]


def launcher_args(
    limits: Limits, uid: int | None, server_pid: int | None = None, cgroups: list[str] = (), launch: str | None = None
) -> list[str]:
    """Everything before `bwrap`: the helper with the run's cgroup.procs files (joined as root),
    `uid` (None: not root, no drop), the server's pid and the mounts. Pure but for getpid() and,
    without `launch`, `helper()`."""
    args = [launch or helper()]
    for f in cgroups:
        args += ["--cgroup", f]
    if uid is not None:
        args += ["--uid", str(uid)]
    args += ["--server", str(os.getpid() if server_pid is None else server_pid)]
    for line in fstab(limits):
        args += ["--mount", line]
    return [*args, "--"]


def exec_args(rlimits: list[str]) -> list[str]:
    """What bwrap runs: the helper waiting for its command on stdin, to run it under `rlimits`
    (prlimit's options, hpcrl.sandbox.backend.rlimit_args). Pure."""
    return [EXEC_PATH, "--exec", *rlimits, "--"]


def exec_header(files: Iterable[SourceFile], argv: Sequence[str]) -> bytes:
    """The command for a sandbox's waiting first program (launch.c's format): the files for
    /work, then argv. Pure."""
    out = [b"HPX1", struct.pack("<I", len(files := list(files)))]
    for f in files:
        path = f.path.encode()
        out += [struct.pack("<II", 0o755 if f.executable else 0o644, len(path)), path]
        out += [struct.pack("<Q", len(f.data)), bytes(f.data)]
    out.append(struct.pack("<I", len(argv)))
    for a in argv:
        b = a.encode()
        out += [struct.pack("<I", len(b)), b]
    return b"".join(out)


@functools.cache
def helper() -> str:
    """The launcher's path, built from launch.c on first use (SandboxUnavailable without a C
    compiler). The cache directory must belong to this user and be writable by nobody else:
    as root this binary is what every sandbox starts with."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise SandboxUnavailable(
            "bwrap backend: no C compiler (cc) to build the sandbox launcher; install gcc (apt-get install gcc)"
        )
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + os.fsencode(os.path.realpath(cc)) + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcrl"
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        _check_private(cache)
    except (OSError, SandboxUnavailable):
        cache = Path(tempfile.mkdtemp(prefix="hpcrl-launch-"))  # private to this process's user
    path = cache / f"hpcrl-launch-{key}"
    if path.exists():
        _check_private(path)
        return str(path)
    tmp = cache / f".{path.name}.{os.getpid()}.tmp"
    proc = subprocess.run([cc, *_CFLAGS, "-o", str(tmp), str(_SOURCE)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SandboxUnavailable(
            f"bwrap backend: cannot build the sandbox launcher ({cc}): {proc.stderr.strip()[:500]}"
        )
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return str(path)


def _check_private(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxUnavailable(
            f"bwrap backend: {path} is a link, not ours, or writable by others; remove it (the launcher is rebuilt)"
        )


SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
}
_INNER_UID = 65534


def host_layout() -> list[str]:
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
    limits: Limits,
    *,
    exec_fd: int,
    status_fd: int | None,
    memory: str,
    reserve_mb: int = 0,
    seccomp_fd: int | None = None,
    bwrap: str = "bwrap",
    layout: list[str] | None = None,
    workspace: str | None = None,
) -> list[str]:
    """The bwrap command line of a sandbox under `limits` whose first program is the helper
    read from `exec_fd` (hpcrl.sandbox.launcher: it waits for the files and the command on
    stdin), memory capped by `memory` (backend.rlimit_args), the filter of hpcrl.sandbox.seccomp
    read from `seccomp_fd`. `workspace`: a host directory bound as /work instead of the run's
    tmpfs (a session's; it must not lie under /tmp, which the launcher covers with its own
    tmpfs). Pure."""
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
        *(layout if layout is not None else host_layout()),
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
    # The helper, read-only in the sandbox's root (the slot uid cannot read the server's copy).
    args += ["--perms", "0555", "--file", str(exec_fd), EXEC_PATH]
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
    return [*args, "--", *exec_args(rlimit_args(limits, memory=memory, reserve_mb=reserve_mb))]
