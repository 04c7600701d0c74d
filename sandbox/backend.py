"""What every sandbox backend shares: compile-then-run, sessions, and turning exits into statuses.

    backend = make_backend(cfg.sandbox)            # hpcrl.sandbox.auto: BwrapBackend or ApptainerBackend
    result = backend.run(ExecSpec.single("python", "print(42)"))
    with backend.session(spec) as s:               # a live program, for the judge
        s.send(b"...\\n"); line = s.read_line(timeout_s=2); result = s.finish()

A backend implements one primitive, `_launch(files, argv, limits)`, returning a `Session` on a
started sandbox; this base class adds compilation (its own sandbox run under the language's
compile limits; a failed compile is a `compile_error` result) and the status rules in
`classify`, so both backends report the same thing for the same program. `ProcessSession` is a Session over
any command (apptainer; the judge's checker process), killed with its whole process group.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
import shutil
import signal as _signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hpcrl.sandbox.languages import available_languages, get_language
from hpcrl.sandbox.process import Supervised, guard_args, reap_group, setpriv_pdeathsig
from hpcrl.sandbox.result import ExecResult, SandboxUnavailable
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile

__all__ = [
    "Backend",
    "Session",
    "SupervisedSession",
    "ProcessSession",
    "Exit",
    "CompileFailed",
    "classify",
    "rlimit_args",
    "MEMORY_MODES",
]


class Session(abc.ABC):
    """A started sandboxed program. Use `finish()` exactly once (or leave the `with` block)."""

    @abc.abstractmethod
    def send(self, data: bytes) -> None: ...

    @abc.abstractmethod
    def close_stdin(self) -> None: ...

    @abc.abstractmethod
    def read_line(self, timeout_s: float) -> bytes | None:
        """The next stdout line (with its newline), or None on EOF, exit or timeout."""

    @abc.abstractmethod
    def finish(self) -> ExecResult:
        """Close stdin, wait (killing at the wall limit), clean up, classify."""

    @abc.abstractmethod
    def kill(self) -> None: ...

    @abc.abstractmethod
    def restart_clock(self, wall_s: float | None = None) -> None:
        """Count the wall limit (or `wall_s`) from now: a sandbox started ahead waits without a deadline."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the program is still running (non-blocking)."""


class SupervisedSession(Session):
    """A Session over one `Supervised` child: the I/O every backend's session shares. Subclasses
    add `finish()`, which turns the child's RawOutcome into an ExecResult their own way."""

    def __init__(self, proc: Supervised, limits: Limits):
        self._proc = proc
        self._limits = limits
        self._result: ExecResult | None = None
        self._consumed = 0

    def send(self, data: bytes) -> None:
        self._proc.send(data)

    def close_stdin(self) -> None:
        self._proc.close_stdin()

    def read_line(self, timeout_s: float) -> bytes | None:
        out = self._proc.out

        def have_line() -> bool:
            return out.find(b"\n", self._consumed) >= 0

        if not self._proc.pump(have_line, deadline=time.monotonic() + timeout_s):
            return None
        end = out.index(b"\n", self._consumed) + 1
        line = bytes(out[self._consumed : end])
        self._consumed = end
        return line

    def kill(self) -> None:
        if self._result is None:
            self._proc.kill()

    def restart_clock(self, wall_s: float | None = None) -> None:
        self._proc.deadline = time.monotonic() + (self._limits.wall_s if wall_s is None else wall_s)

    def alive(self) -> bool:
        return self._result is None and self._proc.poll_alive()


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
            os.killpg(self._proc.pid, _signal.SIGKILL)  # the child leads its own session
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


@dataclass(frozen=True)
class Exit:
    """How the sandbox ended, as seen from outside, plus what the backend measured."""

    exit_code: int | None
    signal: int | None
    started: bool  # the program was exec'd (False: the sandbox failed to set up)
    timed_out: bool
    output_limited: bool
    oom_killed: bool
    cpu_s: float | None
    peak_memory_mb: float | None
    wall_s: float


def classify(
    ex: Exit, limits: Limits, stdout: bytes, stderr: bytes, stdout_truncated: bool, stderr_truncated: bool
) -> ExecResult:
    """The status rules, in order: a kill we made explains the exit before anything else does."""
    code, sig = ex.exit_code, ex.signal
    # bwrap and apptainer report a program killed by signal N as exit 128+N; a program that
    # exits 128+N by itself is indistinguishable from outside, and counts as killed.
    if code is not None and 128 < code <= 128 + 64 and ex.started:
        code, sig = None, code - 128
    if ex.output_limited:
        status = "output_limit"
    elif ex.oom_killed:
        # Even when the run then timed out (the OOM killer took a child, the parent waited on):
        # hitting the memory limit is the cause worth reporting.
        status = "memory_limit"
    elif ex.timed_out:
        status = "timeout"
    elif not ex.started:
        status = "sandbox_error"
    elif sig == _signal.SIGXCPU or (sig == _signal.SIGKILL and (ex.cpu_s or 0.0) >= limits.cpu_s * 0.95):
        status = "cpu_limit"
    elif sig is not None:
        status = "killed_by_signal"
    elif code:
        status = "nonzero_exit"
    else:
        status = "ok"
    return ExecResult(
        status=status,
        exit_code=code,
        signal=sig,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=stdout_truncated,
        stderr_truncated=stderr_truncated,
        wall_s=ex.wall_s,
        cpu_s=ex.cpu_s,
        peak_memory_mb=ex.peak_memory_mb,
    )


MEMORY_MODES = ("cgroup", "address_space", "data")


def rlimit_args(limits: Limits, *, memory: str = "cgroup", reserve_mb: int = 0) -> list[str]:
    """`prlimit` options applied inside the sandbox, so they count this sandbox's processes only.

    `memory` says what caps memory: a cgroup (no rlimit for it here), or where there is none,
    `address_space`: RLIMIT_AS of `memory_mb` plus the language's `reserve_mb` (what its
    runtime reserves and never touches, e.g. V8's ~700 MiB), with RLIMIT_DATA of `memory_mb`
    for the private memory; or `data`: RLIMIT_DATA alone, which leaves shared mappings
    uncounted. All are per process: the total of a run is up to `pids` times as much.
    """
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {', '.join(MEMORY_MODES)} (got {memory!r})")
    cpu = max(1, math.ceil(limits.cpu_s))
    args = [
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={limits.file_size_mb * 1024 * 1024}",
        f"--nproc={limits.pids}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    if memory != "cgroup":
        args.append(f"--data={limits.memory_mb * 1024 * 1024}")
    if memory == "address_space":
        args.append(f"--as={(limits.memory_mb + reserve_mb) * 1024 * 1024}")
    return args


class Backend(abc.ABC):
    """Runs an `ExecSpec` in isolation. Subclasses document what they isolate and what not."""

    name: str = "?"
    # What to check when even a trivial program does not run (appended to check()'s error).
    check_hint: str = ""

    @abc.abstractmethod
    def _launch(
        self,
        files: tuple[SourceFile, ...],
        argv: tuple[str, ...],
        limits: Limits,
        *,
        reserve_mb: int = 0,
        workspace: str | None = None,
    ) -> Session:
        """Start `argv` in a fresh sandbox with `files` in /work; raise SandboxError if it cannot start.
        `reserve_mb`: address space the program's runtime reserves beyond its memory (see rlimit_args).
        `workspace`: a host directory to bind as /work instead of a fresh one (a session's, which
        outlives the run; hpcrl.sandbox.session), with every other isolation step unchanged."""

    def describe(self) -> str:
        """One line: what this backend enforces on this machine."""
        return self.name

    def close(self) -> None:  # noqa: B027 (most backends hold nothing)
        """Give up what the backend holds for its life (bwrap as root: its slot uid). Idempotent."""

    def check(self) -> None:
        """Run a trivial program once; raise SandboxUnavailable with the reason if it fails."""

        res = self.run(ExecSpec.single("bash", "echo ok", limits=Limits(wall_s=30)))
        if res.status != "ok" or res.stdout != b"ok\n":
            raise SandboxUnavailable(
                f"{self.name} backend: a trivial program did not run ({res.status}): "
                f"{res.stderr.decode(errors='replace').strip()[-500:]}{self.check_hint}"
            )

    def languages(self) -> tuple[str, ...]:

        return available_languages()

    def require(self, language: str) -> None:
        """Raise SandboxUnavailable if `language` cannot run here (its compiler or interpreter is missing)."""

        lang = get_language(language)
        if lang.name not in self.languages():
            raise SandboxUnavailable(
                f"{self.name} backend: language {lang.name!r} is not available here ({', '.join(lang.tools)} "
                f"needed); available: {', '.join(self.languages()) or 'none'}"
            )

    # -- public API --------------------------------------------------------------------------
    def run(self, spec: ExecSpec, artifact: SourceFile | None = None) -> ExecResult:
        """Compile (if the language is compiled and no `artifact` is given), run, classify."""
        try:
            with self.session(spec, artifact) as s:
                if spec.stdin:
                    s.send(spec.stdin)
                return s.finish()
        except CompileFailed as exc:
            return exc.result

    def run_in(
        self,
        workspace: str,
        argv: tuple[str, ...],
        limits: Limits,
        *,
        reserve_mb: int = 0,
        stdin: bytes = b"",
        watch: Callable[[], bool] | None = None,
        watch_every_s: float = 0.2,
    ) -> ExecResult:
        """Run `argv` with the host directory `workspace` as /work (and working directory): a
        session's command, through the same `_launch` as every one-shot run, so the same isolation.
        `watch()`, called every `watch_every_s` while it runs (in this thread, which also moves
        its I/O), kills it when true: a quota the kernel does not hold (a measured workspace)."""
        s = self._launch((), tuple(argv), limits, reserve_mb=reserve_mb, workspace=workspace)
        try:
            if stdin:
                s.send(stdin)
            if watch is not None:
                s.close_stdin()
                due = time.monotonic() + watch_every_s
                while s.alive():
                    s.read_line(timeout_s=max(0.0, due - time.monotonic()))  # moves I/O and the deadline
                    if time.monotonic() >= due:
                        if watch():
                            s.kill()
                            break
                        due = time.monotonic() + watch_every_s
            return s.finish()
        finally:
            s.kill()
            s.finish()

    def build(self, spec: ExecSpec) -> ExecResult | SourceFile:
        """Compile a compiled language in its own sandbox: the binary as a SourceFile, or the failed result."""
        lang = get_language(spec.language)
        if not lang.compiled:
            raise ValueError(f"language {lang.name!r} is not compiled")
        self.require(lang.name)
        limits = spec.compile_limits or lang.compile_limits
        s = self._launch(spec.files, lang.compile, limits)
        res = s.finish()
        if res.status == "ok" and not res.stdout_truncated and res.stdout:
            return SourceFile(lang.artifact, res.stdout, executable=True)
        if res.status == "sandbox_error":
            return res
        # The compiler's failure (or a compile bomb hitting a limit) is the program's failure.
        return ExecResult(
            status="compile_error",
            exit_code=res.exit_code,
            signal=res.signal,
            stdout=b"",
            stderr=res.stderr,
            stderr_truncated=res.stderr_truncated,
            wall_s=res.wall_s,
            cpu_s=res.cpu_s,
            peak_memory_mb=res.peak_memory_mb,
        )

    @contextlib.contextmanager
    def session(
        self, spec: ExecSpec, artifact: SourceFile | None = None, *, command: tuple[str, ...] | None = None
    ) -> Iterator[Session]:
        """A live sandboxed program; leaving the block without `finish()` kills it.

        `command` replaces the language's run command (the judge starts its harness with
        `python3 -S`). A compile failure raises `CompileFailed` carrying the compile_error result.
        """
        s = self.start(spec, artifact, command=command)
        try:
            yield s
        finally:
            s.kill()
            s.finish()

    def start(
        self, spec: ExecSpec, artifact: SourceFile | None = None, *, command: tuple[str, ...] | None = None
    ) -> Session:
        """`session` without the `with`: the caller must `finish()` (or kill and finish) it."""
        lang = get_language(spec.language)
        self.require(lang.name)
        files = spec.files
        if lang.compiled:
            built = artifact or self.build(spec)
            if isinstance(built, ExecResult):
                raise CompileFailed(built)
            files = files + (built,)
        return self._launch(files, (command or lang.run) + spec.argv, spec.limits, reserve_mb=lang.address_space_mb)


class CompileFailed(Exception):
    """The compile step did not produce a program; `.result` is the compile_error result."""

    def __init__(self, result: ExecResult):
        super().__init__(result.status)
        self.result = result
