"""The Apptainer backend: Slurm clusters, where unprivileged bubblewrap is often not allowed.

The same `ExecSpec` becomes

    apptainer exec --containall --cleanenv --no-home --net --network none --no-privs \\
        --bind <host tmp>:/src:ro --scratch /work --pwd /work [--memory ... --pids-limit ...] \\
        sandbox.sif /bin/sh -c 'cp -R /src/. /work/ && exec prlimit <rlimits> -- "$@"' sh <argv>

on an image built from containers/sandbox.def (`hpcrl sandbox build-image`). It runs under the
same `Supervised` child supervision as bwrap (`ProcessSession`): no tty, stdin fed as the
program reads, stdout/stderr as capped bytes, and the whole process group killed at the output
cap or the wall limit.

What it isolates:

* `--containall` = `--contain --pid --ipc --cleanenv`: own PID and IPC namespaces, a cleared
  environment, no host filesystems except the image and the read-only program copy; /tmp and
  /work live in the session directory (a tmpfs capped by apptainer.conf's `sessiondir max size`,
  64 MiB by default). `--no-home`: no $HOME. `--net --network none`: a network namespace with
  loopback only. `--no-privs`: no capabilities, no setuid escalation inside.
* Resources: rlimits inside (CPU, file size, processes, open files, no core; RLIMIT_DATA per
  process for memory), the wall deadline and output caps from outside. `--memory` and
  `--pids-limit` only with `cgroups=True`: they need cgroups v2 with systemd delegation,
  which Slurm jobs often lack.

What it does not isolate:

* It runs as the calling user (no per-slot uid): sandboxes of one server share a uid, so
  only the namespaces, not file permissions, keep them apart.
* Without cgroups, memory is capped per process only, and a fork bomb is bounded by
  RLIMIT_NPROC of the user across all of that user's processes on the node.
* The kernel (no seccomp), the image's contents (readable), and CPU fairness between slots.
* A program exiting 128+N by itself is reported as killed by signal N; apptainer's own
  failures are recognised by exit 255 with a `FATAL:` line.
* Measurements: `cpu_s` and `peak_memory_mb` come from wait4's rusage of apptainer's process,
  which counts the container processes it reaped; the peak is the largest single process's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hpcrl.sandbox.backend import Backend, Exit, Session, SupervisedSession, classify, rlimit_args
from hpcrl.sandbox.process import Supervised, guard_args, reap_group, setpriv_pdeathsig
from hpcrl.sandbox.result import ExecResult, SandboxUnavailable
from hpcrl.sandbox.spec import Limits, SourceFile

__all__ = ["ApptainerBackend", "ProcessSession", "apptainer_args", "build_args", "build_image", "default_def_file"]

_COPY_SH = 'cp -R /src/. /work/ && exec prlimit "$@"'
_MIB = 1024 * 1024


def default_def_file() -> Path:
    """containers/sandbox.def shipped with hpcrl (package data)."""
    import hpcrl

    return Path(hpcrl.__file__).resolve().parent / "containers" / "sandbox.def"


def apptainer_args(
    argv: Sequence[str],
    limits: Limits,
    *,
    image: str,
    src_dir: str,
    cgroups: bool = False,
    memory_fallback: str = "address_space",
    reserve_mb: int = 0,
) -> list[str]:
    """The arguments after `apptainer` for running `argv` from `src_dir` under `limits`. Pure."""
    args = [
        "exec",
        "--containall",
        "--cleanenv",
        "--no-home",
        "--net",
        "--network",
        "none",
        "--no-privs",
        "--bind",
        f"{src_dir}:/src:ro",
        "--scratch",
        "/work",
        "--pwd",
        "/work",
        "--env",
        "HOME=/work",
        "--env",
        "TMPDIR=/tmp",
        "--env",
        "LANG=C.UTF-8",
    ]
    if cgroups:
        args += [
            "--memory",
            f"{limits.memory_mb}M",
            "--memory-swap",
            f"{limits.memory_mb}M",
            "--pids-limit",
            str(limits.pids + 4),
        ]
    memory = "cgroup" if cgroups else memory_fallback
    args += [image, "/bin/sh", "-c", _COPY_SH, "sh", *rlimit_args(limits, memory=memory, reserve_mb=reserve_mb)]
    args += ["--", *argv]
    return args


class ProcessSession(SupervisedSession):
    """Any command under `Supervised` (used for apptainer): stdin fed as the program reads, output
    capped, the wall limit enforced, and at a kill the whole process group killed (apptainer's
    starter, the container's init and what runs in it share one session). CPU and peak memory
    come from wait4's rusage of the reaped child."""

    def __init__(self, argv: Sequence[str], limits: Limits, *, env: dict[str, str], cleanup: Sequence[str] = ()):
        # Dies with this process (its starting thread), SIGKILL included: `setpriv --pdeathsig`
        # and a check that we are still its parent, or the same from a preexec_fn where setpriv
        # is too old. That kills apptainer's starter; the container's processes live in its pid
        # namespace (--containall), whose fate when the starter dies is apptainer's.
        armed = setpriv_pdeathsig()
        proc = Supervised(
            [shutil.which("setpriv") or "setpriv", "--pdeathsig", "KILL", "--", *guard_args(), *argv]
            if armed
            else list(argv),
            env=env,
            output_cap=limits.output_kb * 1024,
            deadline=time.monotonic() + limits.wall_s,
            on_kill=self._kill_group,
            die_with_parent=not armed,
        )
        super().__init__(proc, limits)
        self._cleanup = list(cleanup)
        try:
            proc.start()
        except BaseException:
            self._remove()
            raise

    def _kill_group(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the child leads its own session
        except (ProcessLookupError, PermissionError):
            pass

    def _remove(self) -> None:
        for d in self._cleanup:
            shutil.rmtree(d, ignore_errors=True)

    def finish(self) -> ExecResult:
        if self._result is not None:
            return self._result
        try:
            raw = self._proc.wait()
        finally:
            self._remove()
            reap_group(self._proc.pid, timeout_s=0.0)  # members orphaned to us, if we are a subreaper
        ru = raw.rusage
        # Apptainer exits 255 with FATAL: on stderr when the container never started.
        started = not (raw.exit_code == 255 and b"FATAL:" in raw.stderr)
        ex = Exit(
            exit_code=raw.exit_code,
            signal=raw.signal,
            started=started,
            timed_out=raw.timed_out,
            output_limited=raw.output_limited,
            oom_killed=False,
            cpu_s=(ru.ru_utime + ru.ru_stime) if ru else None,
            peak_memory_mb=(ru.ru_maxrss / 1024) if ru else None,
            wall_s=raw.wall_s,
        )
        self._result = classify(ex, self._limits, raw.stdout, raw.stderr, raw.stdout_truncated, raw.stderr_truncated)
        return self._result


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

    def describe(self) -> str:
        return f"apptainer {self.image}; cgroups: {'--memory/--pids-limit' if self.cgroups else 'none (rlimits only)'}"

    def languages(self) -> tuple[str, ...]:
        from hpcrl.sandbox.languages import languages

        return languages()  # the image installs all of them

    def _launch(
        self, files: tuple[SourceFile, ...], argv: tuple[str, ...], limits: Limits, *, reserve_mb: int = 0
    ) -> Session:
        src = tempfile.mkdtemp(prefix="hpcrl-src-")
        try:
            os.chmod(src, 0o755)
            for f in files:
                p = Path(src, f.path)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(f.data)
                p.chmod(0o755 if f.executable else 0o644)
            args = apptainer_args(
                argv,
                limits,
                image=self.image,
                src_dir=src,
                cgroups=self.cgroups,
                memory_fallback=self.memory_fallback,
                reserve_mb=reserve_mb,
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
