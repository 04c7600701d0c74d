"""The Apptainer backend: Slurm clusters, where unprivileged bubblewrap is often not allowed.

The same `ExecSpec` becomes

    apptainer exec --containall --cleanenv --no-home --net --network none --no-privs \\
        --bind <host tmp>:/src:ro --scratch /work --pwd /work [--memory ... --pids-limit ...] \\
        sandbox.sif /bin/sh -c 'cp -R /src/. /work/ && exec prlimit <rlimits> -- "$@"' sh <argv>

on an image built from containers/sandbox.def (`hpcrl sandbox build-image`). It is driven
through the `sh` package (`ShSession`): no tty, stdin fed from a queue, stdout/stderr as bytes
through pipes whose chunks go to a callback that kills the process group at the output cap,
and a timer that kills it at the wall limit.

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
* Measurements: `peak_memory_mb` is not measured (None); `cpu_s` comes from this process's
  children's totals and is reported only while one run is in flight in the process (else None).
"""

from __future__ import annotations

import os
import queue
import resource
import selectors
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from hpcrl.sandbox.backend import Backend, Exit, Session, classify, rlimit_args
from hpcrl.sandbox.result import ExecResult, SandboxUnavailable
from hpcrl.sandbox.spec import Limits, SourceFile

__all__ = ["ApptainerBackend", "ShSession", "apptainer_args", "build_args", "build_image", "default_def_file"]

_COPY_SH = 'cp -R /src/. /work/ && exec prlimit "$@"'
_MIB = 1024 * 1024


def default_def_file() -> Path:
    """containers/sandbox.def shipped with hpcrl (package data)."""
    import hpcrl

    return Path(hpcrl.__file__).resolve().parent / "containers" / "sandbox.def"


def apptainer_args(
    argv: Sequence[str], limits: Limits, *, image: str, src_dir: str, cgroups: bool = False
) -> list[str]:
    """The arguments after `apptainer` for running `argv` from `src_dir` under `limits`. Pure."""
    args = [
        "exec", "--containall", "--cleanenv", "--no-home", "--net", "--network", "none", "--no-privs",
        "--bind", f"{src_dir}:/src:ro", "--scratch", "/work", "--pwd", "/work",
        "--env", "HOME=/work", "--env", "TMPDIR=/tmp", "--env", "LANG=C.UTF-8",
    ]
    if cgroups:
        args += ["--memory", f"{limits.memory_mb}M", "--memory-swap", f"{limits.memory_mb}M",
                 "--pids-limit", str(limits.pids + 4)]
    args += [image, "/bin/sh", "-c", _COPY_SH, "sh",
             *rlimit_args(limits, memory_by_rlimit=not cgroups), "--", *argv]
    return args


class ShSession(Session):
    """Any command driven through `sh`, output capped and deadline enforced (used for apptainer).

    sh spawns, feeds stdin from a queue, waits and reaps. Output comes back through pipes that
    this class reads itself, in bytes, handing each chunk to a callback that kills the process
    group at the cap: sh's own callback readers either read one byte per syscall (unbuffered:
    ~100 KB/s) or hold back a newline-free flood in memory until a newline comes (line mode).
    """

    def __init__(self, command: str, args: Sequence[str], limits: Limits, *, env: dict[str, str],
                 cleanup: list[str] | None = None):
        import sh  # the design card's choice for driving cluster tools

        self._limits = limits
        self._cap = limits.output_kb * 1024
        self._bufs = {"out": bytearray(), "err": bytearray()}
        self._trunc = {"out": False, "err": False}
        self._cond = threading.Condition()
        self._consumed = 0
        self._stdin: queue.Queue = queue.Queue()
        self._stdin_closed = False
        self._timed_out = self._output_limited = False
        self._killed = False
        self._result: ExecResult | None = None
        self._cleanup = cleanup or []
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._readers = {out_r: "out", err_r: "err"}
        self._eof = threading.Event()
        self._t0 = time.monotonic()
        self._cpu_meter = _ChildCpuMeter()
        try:
            self._proc = sh.Command(command)(
                *args, _in=self._stdin, _out=out_w, _err=err_w, _bg=True, _bg_exc=False,
                _tty_in=False, _tty_out=False, _new_session=True, _env=env, _ok_code=list(range(256)),
            )
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            self._cpu_meter.stop()
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self._reader = threading.Thread(target=self._read_loop, name="sh-session-reader", daemon=True)
        self._reader.start()
        self._timer = threading.Timer(limits.wall_s, self._on_timeout)
        self._timer.daemon = True
        self._timer.start()

    def _read_loop(self) -> None:
        sel = selectors.DefaultSelector()
        for fd in self._readers:
            sel.register(fd, selectors.EVENT_READ)
        open_fds = set(self._readers)
        try:
            while open_fds and not self._eof.is_set():
                for key, _ in sel.select(0.1):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        open_fds.discard(key.fd)
                    else:
                        self._on_chunk(self._readers[key.fd], data)
        finally:
            sel.close()
            for fd in self._readers:
                os.close(fd)
            with self._cond:
                self._eof.set()
                self._cond.notify_all()

    def _on_chunk(self, which: str, data: bytes) -> None:
        """The output callback: keep up to the cap, and kill the whole group the moment it is passed."""
        with self._cond:
            buf = self._bufs[which]
            room = self._cap - len(buf)
            if len(data) > room:
                buf += data[: max(room, 0)]
                self._trunc[which] = True
                if not self._output_limited:
                    self._output_limited = True
                    self._kill_group()
            else:
                buf += data
            self._cond.notify_all()

    def _on_timeout(self) -> None:
        self._timed_out = True
        self._kill_group()

    def _kill_group(self) -> None:
        if self._killed:
            return
        self._killed = True
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def send(self, data: bytes) -> None:
        if self._stdin_closed:
            raise ValueError("stdin already closed")
        self._stdin.put(data)

    def close_stdin(self) -> None:
        if not self._stdin_closed:
            self._stdin_closed = True
            self._stdin.put(None)

    def read_line(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                out = self._bufs["out"]
                i = out.find(b"\n", self._consumed)
                if i >= 0:
                    line = bytes(out[self._consumed:i + 1])
                    self._consumed = i + 1
                    return line
                left = deadline - time.monotonic()
                if left <= 0 or self._eof.is_set():
                    return None
                self._cond.wait(left)

    def kill(self) -> None:
        if self._result is None:
            self._kill_group()

    def restart_clock(self, wall_s: float | None = None) -> None:
        self._timer.cancel()
        self._timer = threading.Timer(self._limits.wall_s if wall_s is None else wall_s, self._on_timeout)
        self._timer.daemon = True
        self._timer.start()

    def alive(self) -> bool:
        return self._result is None and self._proc.is_alive()

    def finish(self) -> ExecResult:
        if self._result is not None:
            return self._result
        self.close_stdin()
        try:
            code, sig = self._wait()
            # The container's processes die with its PID namespace; give the pipes a moment to close.
            self._reader.join(timeout=0.5)
            self._eof.set()
            self._reader.join()
        finally:
            self._timer.cancel()
            for d in self._cleanup:
                shutil.rmtree(d, ignore_errors=True)
        wall = time.monotonic() - self._t0
        with self._cond:
            out, err = bytes(self._bufs["out"]), bytes(self._bufs["err"])
        started = not (code == 255 and b"FATAL:" in err)
        ex = Exit(exit_code=code, signal=sig, started=started, timed_out=self._timed_out,
                  output_limited=self._output_limited, oom_killed=False,
                  cpu_s=self._cpu_meter.stop(), peak_memory_mb=None, wall_s=wall)
        self._result = classify(ex, self._limits, out, err, self._trunc["out"], self._trunc["err"])
        return self._result

    def _wait(self) -> tuple[int | None, int | None]:
        import sh

        # sh's own wait(timeout=) would leave the process running; the timer kills it instead.
        try:
            self._proc.wait()
        except sh.SignalException as exc:
            return None, -exc.exit_code
        except sh.ErrorReturnCode as exc:
            return exc.exit_code, None
        code = self._proc.exit_code
        if code is not None and code < 0:
            return None, -code
        return code, None


class _ChildCpuMeter:
    """CPU time of reaped children during one run, from RUSAGE_CHILDREN deltas.

    sh reaps with waitpid (no rusage), so the process-wide children's total is all there is.
    It is exact only while a single run is in flight in this process; otherwise None.
    """

    _lock = threading.Lock()
    _in_flight = 0

    def __init__(self) -> None:
        with self._lock:
            type(self)._in_flight += 1
            self._alone = type(self)._in_flight == 1
        self._t0 = self._now()

    @staticmethod
    def _now() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    def stop(self) -> float | None:
        with self._lock:
            alone = self._alone and type(self)._in_flight == 1
            type(self)._in_flight -= 1
        return (self._now() - self._t0) if alone else None


class ApptainerBackend(Backend):
    """Apptainer on an image from containers/sandbox.def. See the module docstring for what it isolates."""

    name = "apptainer"
    check_hint = "; does the image run (`apptainer exec IMAGE true`), and is --network none allowed here?"

    def __init__(self, image: str = "sandbox.sif", *, apptainer: str = "apptainer", cgroups: bool = False):
        path = shutil.which(apptainer)
        if path is None:
            raise SandboxUnavailable(
                f"apptainer backend: {apptainer!r} not found on PATH; load it (e.g. `module load apptainer`) "
                "or use sandbox.backend: bwrap"
            )
        if not os.path.exists(image):
            raise SandboxUnavailable(
                f"apptainer backend: image {image} does not exist; build it with `hpcrl sandbox build-image --out {image}`"
            )
        self.apptainer = path
        self.image = image
        self.cgroups = cgroups

    def describe(self) -> str:
        return f"apptainer {self.image}; cgroups: {'--memory/--pids-limit' if self.cgroups else 'none (rlimits only)'}"

    def languages(self) -> tuple[str, ...]:
        from hpcrl.sandbox.languages import languages

        return languages()  # the image installs all of them

    def _launch(self, files: tuple[SourceFile, ...], argv: tuple[str, ...], limits: Limits) -> Session:
        src = tempfile.mkdtemp(prefix="hpcrl-src-")
        try:
            os.chmod(src, 0o755)
            for f in files:
                p = Path(src, f.path)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(f.data)
                p.chmod(0o755 if f.executable else 0o644)
            args = apptainer_args(argv, limits, image=self.image, src_dir=src, cgroups=self.cgroups)
            env = {k: v for k, v in os.environ.items() if k in ("PATH", "APPTAINER_CACHEDIR", "APPTAINER_TMPDIR")}
            return ShSession(self.apptainer, args, limits, env=env, cleanup=[src])
        except BaseException:
            shutil.rmtree(src, ignore_errors=True)
            raise


def build_image(def_file: str | os.PathLike, out: str | os.PathLike, *, apptainer: str = "apptainer",
                fakeroot: bool = False, force: bool = False) -> int:
    """`apptainer build [--fakeroot] [--force] OUT DEF`, output streamed to this terminal; returns its exit code."""
    import sh

    path = shutil.which(apptainer)
    if path is None:
        raise SandboxUnavailable(f"{apptainer!r} not found on PATH; build the image on a machine with Apptainer")
    try:
        sh.Command(path)(*build_args(str(def_file), str(out), fakeroot=fakeroot, force=force), _fg=True)
    except sh.ErrorReturnCode as exc:
        return exc.exit_code
    return 0


def build_args(def_file: str, out: str, *, fakeroot: bool = False, force: bool = False) -> list[str]:
    """The arguments after `apptainer` that build `out` from `def_file`. Pure."""
    return ["build", *(["--fakeroot"] if fakeroot else []), *(["--force"] if force else []), out, def_file]

