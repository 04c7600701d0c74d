"""The Apptainer backend: Slurm clusters, where unprivileged bubblewrap is often not allowed.

The same `ExecSpec` becomes

    apptainer exec --containall --cleanenv --no-home --no-mount bind-paths,hostfs,home,cwd,sys,devpts \\
        --net --network none --no-privs --security seccomp:<profile> \\
        --bind <private host copy>:/src:ro --scratch /work --pwd /work [--memory --pids-limit --cpus] \\
        sandbox.sif /bin/sh -c 'cp -R /src/. /work/ && exec prlimit <rlimits> -- "$@"' sh <argv>

on an image built from containers/sandbox.def (`hpcrl sandbox build-image`), with Apptainer
1.2 or later (older ones cannot leave the site's bind paths out: refused). It runs under the
same `Supervised` child supervision as bwrap (`ProcessSession`): no tty, stdin fed as the
program reads, stdout/stderr as capped bytes, the whole process group killed at the output cap
or the wall limit, and apptainer itself killed when the server dies (setpriv --pdeathsig).

What it isolates (construction tested here; runs only where apptainer is installed):

* `--containall` = `--contain --pid --ipc --cleanenv`: own PID and IPC namespaces, a cleared
  environment, a minimal /dev. `--no-mount bind-paths,hostfs,...`: none of apptainer.conf's
  `bind path` entries (a run directory on a site-bound filesystem would otherwise show the
  run's keys/*.key_secret and take writes to submitit's *_result.pkl, which the supervisor
  unpickles), no host filesystems, no $HOME, working directory, /sys or /dev/pts: only the
  image and the program copy. The copy on the host is private (0700 directory, 0600 files; the
  container runs as the same user) and removed after the run. `--net --network none`: loopback
  only. `--no-privs`: no capabilities, no setuid escalation inside.
* `--security seccomp:` hpcrl's profile (hpcrl.sandbox.seccomp; `sandbox.apptainer_seccomp`):
  memfd_create, SysV shm, io_uring, userfaultfd, perf_event_open, bpf and the keyring calls
  fail, and so do unshare/clone with CLONE_NEWUSER (no nested user namespace) and clone3.
* Resources: rlimits inside (CPU seconds, file size, processes, open files, no core; memory
  per `sandbox.memory_fallback`, as for bwrap), the wall deadline and output caps from outside.
  `--memory`, `--pids-limit` and `--cpus` only with `cgroups=True` (`sandbox.apptainer_cgroups`):
  they need cgroups v2 with systemd delegation, which Slurm jobs often lack.

What it does not isolate:

* `work_mb`, `tmp_mb`, `shm_mb` and `inodes` are not enforced: /work and /tmp live in the
  session directory, one tmpfs capped only by apptainer.conf's `sessiondir max size` (64 MiB
  by default; no cap at all with `memory fs type = ramfs`), and /dev/shm is a tmpfs Apptainer
  mounts with the kernel's default size (half the RAM). Single files are capped by RLIMIT_FSIZE.
  Without cgroups, files written to /dev/shm are therefore the one memory no limit counts: use
  `apptainer_cgroups` where the site allows, or `memory_fallback: refuse` to insist on it.
* It runs as the calling user (no per-slot uid): sandboxes of one server share a uid, so only
  the namespaces, not file permissions, keep them apart; a fork bomb is bounded by RLIMIT_NPROC
  of that user across all of its processes on the node.
* Without cgroups: memory is capped per process (a run may hold `pids` times memory_mb), and
  CPU is not shared per run (`Limits.cpus` is ignored).
* The kernel, the image's contents (readable). Whether the container's processes die with
  apptainer's starter when the server is SIGKILLed is Apptainer's doing (--pid); not verified
  here, where Apptainer cannot be installed.
* A program exiting 128+N by itself is reported as killed by signal N; apptainer's own
  failures are recognised by exit 255 with a `FATAL:` line.
* Measurements: `cpu_s` and `peak_memory_mb` come from wait4's rusage of apptainer's process,
  which counts the container processes it reaped; the peak is the largest single process's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import hpcrl
from hpcrl.sandbox.backend import Backend, ProcessSession, Session, rlimit_args
from hpcrl.sandbox.languages import languages
from hpcrl.sandbox.result import SandboxUnavailable
from hpcrl.sandbox.seccomp import apptainer_profile
from hpcrl.sandbox.spec import Limits, SourceFile

__all__ = ["ApptainerBackend", "ProcessSession", "apptainer_args", "build_args", "build_image", "default_def_file"]

_COPY_SH = 'cp -R /src/. /work/ && exec prlimit "$@"'
_RUN_SH = 'exec prlimit "$@"'
_MIB = 1024 * 1024


def default_def_file() -> Path:
    """containers/sandbox.def shipped with hpcrl (package data)."""

    return Path(hpcrl.__file__).resolve().parent / "containers" / "sandbox.def"


# Everything apptainer.conf would mount besides the image: all `bind path` entries (the site's
# binds: where run directories, with their keys and submitit's pickles, usually live), every
# host filesystem (`mount hostfs`), $HOME, the working directory, /sys and /dev/pts.
NO_MOUNT = "bind-paths,hostfs,home,cwd,sys,devpts"


def apptainer_args(
    argv: Sequence[str],
    limits: Limits,
    *,
    image: str,
    src_dir: str,
    cgroups: bool = False,
    memory_fallback: str = "address_space",
    reserve_mb: int = 0,
    seccomp_profile: str | None = None,
    workspace: str | None = None,
) -> list[str]:
    """The arguments after `apptainer` for running `argv` from `src_dir` under `limits`; with
    `workspace` (a session's host directory) that is bound as /work instead of a scratch copy. Pure."""
    args = [
        "exec",
        "--containall",
        "--cleanenv",
        "--no-home",
        "--no-mount",
        NO_MOUNT,
        "--net",
        "--network",
        "none",
        "--no-privs",
    ]
    if seccomp_profile is not None:
        args += ["--security", f"seccomp:{seccomp_profile}"]
    work = ["--bind", f"{workspace}:/work"] if workspace is not None else ["--scratch", "/work"]
    args += [
        "--bind",
        f"{src_dir}:/src:ro",
        *work,
        "--pwd",
        "/work",
        "--env",
        "HOME=/work",
        "--env",
        "TMPDIR=/tmp",
        "--env",
        "LANG=C.UTF-8",
    ]
    if memory_fallback == "address_space" and not cgroups:
        args += ["--env", "MALLOC_ARENA_MAX=2"]  # see launcher.bwrap_args
    if cgroups:
        args += [
            "--memory",
            f"{limits.memory_mb}M",
            "--memory-swap",
            f"{limits.memory_mb}M",
            "--pids-limit",
            str(limits.pids + 4),
            "--cpus",
            f"{limits.cpus:g}",
        ]
    memory = "cgroup" if cgroups else memory_fallback
    # A session's workspace already holds its files: nothing to copy in.
    run_sh = _RUN_SH if workspace is not None else _COPY_SH
    args += [image, "/bin/sh", "-c", run_sh, "sh", *rlimit_args(limits, memory=memory, reserve_mb=reserve_mb)]
    args += ["--", *argv]
    return args


def apptainer_version(apptainer: str) -> tuple[int, int] | None:
    """(major, minor) from `apptainer --version` ('apptainer version 1.3.4'); None if not Apptainer."""
    try:
        out = subprocess.run([apptainer, "--version"], capture_output=True, timeout=30).stdout.decode()
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"apptainer version (\d+)\.(\d+)", out.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


class ApptainerBackend(Backend):
    """Apptainer on an image from containers/sandbox.def. See the module docstring for what it isolates."""

    name = "apptainer"
    check_hint = "; does the image run (`apptainer exec IMAGE true`), and is --network none allowed here?"

    def __init__(
        self,
        image: str = "sandbox.sif",
        *,
        apptainer: str = "apptainer",
        cgroups: bool = False,
        memory_fallback: str = "address_space",
        seccomp: bool = True,
    ):
        path = shutil.which(apptainer)
        if path is None:
            raise SandboxUnavailable(
                f"apptainer backend: {apptainer!r} not found on PATH; load it (e.g. `module load apptainer`) "
                "or use sandbox.backend: bwrap"
            )
        if not os.path.exists(image):
            raise SandboxUnavailable(
                f"apptainer backend: image {image} does not exist; "
                f"build it with `hpcrl sandbox build-image --out {image}`"
            )
        version = apptainer_version(path)
        if version is None or version < (1, 2):
            # --no-mount bind-paths came with Apptainer 1.2; older ones (and SingularityCE) only
            # warn about it and bind the site's paths anyway.
            found = "unknown" if version is None else ".".join(map(str, version))
            raise SandboxUnavailable(
                f"apptainer backend: {path} is not Apptainer 1.2 or later ({found}): "
                "older versions cannot be told to leave the site's bind paths out of the sandbox; "
                "load a newer one (e.g. `module load apptainer`)"
            )
        if not cgroups and memory_fallback == "refuse":
            raise SandboxUnavailable(
                "apptainer backend: no memory cgroup (sandbox.apptainer_cgroups is false) and "
                "sandbox.memory_fallback is refuse; enable apptainer_cgroups where cgroups v2 is delegated, or set "
                "memory_fallback: address_space (each process's address space capped; see sandbox/bwrap.py)"
            )
        self.apptainer = path
        self.image = image
        self.cgroups = cgroups
        self.memory_fallback = memory_fallback
        self.seccomp = seccomp
        # A private directory for the seccomp profile; each run's program copy gets its own.
        self._private = tempfile.mkdtemp(prefix="hpcrl-apptainer-")
        weakref.finalize(self, shutil.rmtree, self._private, True)
        self._profile = None
        if seccomp:
            self._profile = os.path.join(self._private, "seccomp.json")
            _write_private(self._profile, apptainer_profile().encode())

    def close(self) -> None:
        shutil.rmtree(self._private, ignore_errors=True)

    def describe(self) -> str:
        memory = (
            "memory, pids, cpus: cgroup (--memory/--pids-limit/--cpus)"
            if self.cgroups
            else f"memory: {'RLIMIT_AS' if self.memory_fallback == 'address_space' else 'RLIMIT_DATA'} per process, "
            "/dev/shm not capped (no cgroup); pids: RLIMIT_NPROC; cpus: not enforced"
        )
        return (
            f"apptainer {self.image}; {memory}; seccomp: {'yes' if self._profile else 'no'}; "
            "work_mb/tmp_mb/shm_mb/inodes: not enforced (sessiondir max size)"
        )

    def languages(self) -> tuple[str, ...]:

        return languages()  # the image installs all of them

    def _launch(
        self,
        files: tuple[SourceFile, ...],
        argv: tuple[str, ...],
        limits: Limits,
        *,
        reserve_mb: int = 0,
        workspace: str | None = None,
    ) -> Session:
        # The container runs as this user: the copy is for it alone (0700 directories, 0600 files).
        src = tempfile.mkdtemp(prefix="hpcrl-src-")
        try:
            for f in files:
                p = Path(src, f.path)
                p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                _write_private(str(p), f.data, 0o700 if f.executable else 0o600)
            args = apptainer_args(
                argv,
                limits,
                image=self.image,
                src_dir=src,
                cgroups=self.cgroups,
                memory_fallback=self.memory_fallback,
                reserve_mb=reserve_mb,
                seccomp_profile=self._profile,
                workspace=workspace,
            )
            env = {k: v for k, v in os.environ.items() if k in ("PATH", "APPTAINER_CACHEDIR", "APPTAINER_TMPDIR")}
            return ProcessSession([self.apptainer, *args], limits, env=env, cleanup=[src])
        except BaseException:
            shutil.rmtree(src, ignore_errors=True)
            raise


def build_image(
    def_file: str | os.PathLike,
    out: str | os.PathLike,
    *,
    apptainer: str = "apptainer",
    fakeroot: bool = False,
    force: bool = False,
) -> int:
    """`apptainer build [--fakeroot] [--force] OUT DEF`, output streamed to this terminal; returns its exit code."""
    path = shutil.which(apptainer)
    if path is None:
        raise SandboxUnavailable(f"{apptainer!r} not found on PATH; build the image on a machine with Apptainer")
    # Interactive and long (minutes): the terminal gets its output as it comes.
    return subprocess.run([path, *build_args(str(def_file), str(out), fakeroot=fakeroot, force=force)]).returncode


def build_args(def_file: str, out: str, *, fakeroot: bool = False, force: bool = False) -> list[str]:
    """The arguments after `apptainer` that build `out` from `def_file`. Pure."""
    return ["build", *(["--fakeroot"] if fakeroot else []), *(["--force"] if force else []), out, def_file]


def _write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)  # whatever the umask
    finally:
        os.close(fd)
