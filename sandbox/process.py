"""Supervising one child process: stdin feeding, capped stdout/stderr, a wall deadline, kill, reap.

    proc = Supervised(argv, env=env, output_cap=1 << 20, deadline=time.monotonic() + 5)
    proc.start(); proc.send(b"input"); proc.close_stdin()
    raw = proc.wait()          # RawOutcome: wait status, bytes, flags, rusage

One thread, one `selectors` loop over the pipes and a pidfd, so a flood or a sleeper never
blocks the caller past the deadline. Going over `output_cap` on either stream or past the
deadline kills the child at once (`on_kill` then kills the rest of the sandbox). `pump(until)`
runs the same loop until a condition holds, which is how the judge talks to a live program.

Every child is forked by one thread of the process (`_Spawner`), whatever thread asks: the
kernel's parent-death signal (PR_SET_PDEATHSIG, which the sandbox launcher and `setpriv
--pdeathsig` arm) fires when the *thread* that forked a child ends, and a sandbox started by a
run's thread (the next one, started ahead) is used by whichever thread runs next. That thread
lives as long as the process, so children still die with the process, SIGKILL included.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import queue
import resource
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["RawOutcome", "Supervised", "setpriv_pdeathsig", "guard_args", "become_subreaper", "reap_group"]

# Run as the last step before the real program, after a parent-death signal was set: if the
# parent that started us is already gone (it died before the signal was armed, so the signal
# will never come), stop here rather than run unsupervised. $PPID is read at the shell's start,
# which is after the prctl; exec keeps the pid, so the parent is still the one Popen forked from.
_GUARD_SH = '[ "$PPID" = "$1" ] || exit 125; shift; exec "$@"'


@functools.cache
def setpriv_pdeathsig() -> bool:
    """Whether `setpriv --pdeathsig` exists here (util-linux 2.33 and later)."""
    path = shutil.which("setpriv")
    if path is None:
        return False
    try:
        out = subprocess.run([path, "--help"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--pdeathsig" in out


def guard_args(ppid: int | None = None) -> list[str]:
    """`sh -c GUARD sh <ppid>`: exec the rest only while `ppid` (default: this process) is the parent."""
    return ["/bin/sh", "-c", _GUARD_SH, "sh", str(os.getpid() if ppid is None else ppid)]


class _Spawner:
    """One daemon thread that runs every Popen of this process (see the module docstring)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        with self._lock:  # started on first use, and anew in a forked child (where it is gone)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="hpcrl-spawner", daemon=True)
                self._thread.start()
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._q.put((args, kwargs, box))
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        while True:
            args, kwargs, box = self._q.get()
            try:
                box.put((True, subprocess.Popen(*args, **kwargs)))
            except BaseException as exc:  # handed to the asking thread
                box.put((False, exc))


_spawner = _Spawner()

# After the child is reaped, how long to keep draining pipes that something else still holds.
_DRAIN_GRACE_S = 0.5
_CHUNK = 65536


@dataclass
class RawOutcome:
    exit_code: int | None  # set when the child exited
    signal: int | None  # set when a signal killed it
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    output_limited: bool
    wall_s: float
    rusage: resource.struct_rusage | None
    side: bytes  # what arrived on the side channel (bwrap's --json-status-fd)


class Supervised:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        output_cap: int,
        deadline: float,
        pass_fds: Sequence[int] = (),
        side_fd: int | None = None,
        on_kill: Callable[[], None] | None = None,
        cwd: str | None = None,
        die_with_parent: bool = False,
    ):
        self.argv = list(argv)
        self.env = env
        self.output_cap = output_cap
        self.deadline = deadline
        self.pass_fds = tuple(pass_fds)
        self.side_fd = side_fd
        self.on_kill = on_kill
        self.cwd = cwd
        # Only where argv cannot arm it itself (no setpriv --pdeathsig): a preexec_fn (fork, not
        # vfork; it calls nothing but two C functions).
        self.die_with_parent = die_with_parent
        self.out = bytearray()
        self.err = bytearray()
        self.out_head = 0  # bytes at the head of stdout that are not the child's (not under output_cap)
        self.side = bytearray()
        self.out_truncated = self.err_truncated = False
        self.timed_out = self.output_limited = False
        self._pending = bytearray()
        self._stdin_closing = False
        self._popen: subprocess.Popen | None = None
        self._sel = selectors.DefaultSelector()
        self._open: set[int] = set()
        self._status: int | None = None
        self._rusage = None
        self._killed = False
        self._exited_at: float | None = None
        self._t0 = 0.0
        self._wall = 0.0
        self._pidfd: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._t0 = time.monotonic()
        self._popen = _spawner.popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            pass_fds=self.pass_fds,
            close_fds=True,
            start_new_session=True,
            cwd=self.cwd,
            preexec_fn=_die_with(os.getpid()) if self.die_with_parent else None,
        )
        p = self._popen
        for f, ev in ((p.stdout, selectors.EVENT_READ), (p.stderr, selectors.EVENT_READ)):
            os.set_blocking(f.fileno(), False)
            self._sel.register(f.fileno(), ev)
            self._open.add(f.fileno())
        os.set_blocking(p.stdin.fileno(), False)
        if self.side_fd is not None:
            os.set_blocking(self.side_fd, False)
            self._sel.register(self.side_fd, selectors.EVENT_READ)
            self._open.add(self.side_fd)
        try:
            self._pidfd = os.pidfd_open(p.pid)
            self._sel.register(self._pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            self._pidfd = None  # old kernel: poll the child every 10 ms instead

    def start_clock(self, wall_s: float) -> None:
        """The run starts now: its wall time counts from here and its deadline is `wall_s` away
        (a child started ahead of its work, which waited until now)."""
        self._t0 = time.monotonic()
        self.deadline = self._t0 + wall_s

    @property
    def pid(self) -> int:
        assert self._popen is not None
        return self._popen.pid

    @property
    def killed(self) -> bool:
        """kill() was called (by the caller, a deadline or an output cap)."""
        return self._killed

    @property
    def exited(self) -> bool:
        return self._status is not None

    def poll_alive(self) -> bool:
        """Reap the child if it has exited (non-blocking); whether it still runs."""
        self._reap(block=False)
        return self._status is None

    def send(self, data: bytes) -> None:
        """Queue bytes for the child's stdin; they are written as the child reads."""
        if self._stdin_closing:
            raise ValueError("stdin already closed")
        if data:
            self._pending += data
            self._watch_stdin()

    def close_stdin(self) -> None:
        self._stdin_closing = True
        if not self._pending:
            self._close_stdin_now()

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            if self._status is None and self._popen is not None:
                try:
                    os.kill(self._popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.on_kill is not None:
                self.on_kill()

    def pump(self, until: Callable[[], bool] | None = None, deadline: float | None = None) -> bool:
        """Run the I/O loop until `until()` holds (True), or the child is done or the deadline passes (False).

        `deadline` (earlier than the run's own) bounds this call only; the run's deadline kills.
        """
        while True:
            if until is not None and until():
                return True
            if self._done():
                return False
            now = time.monotonic()
            if now >= self.deadline and not self.exited and not self._killed:
                self.timed_out = True
                self.kill()
            if deadline is not None and now >= deadline:
                return False
            if self.exited:
                limit = (self._exited_at or now) + _DRAIN_GRACE_S
            elif self._killed:
                limit = now + 1.0  # SIGKILL sent: the pidfd wakes us when it is done
            else:
                limit = self.deadline
            if deadline is not None:
                limit = min(limit, deadline)
            timeout = max(0.0, limit - now)
            if self._pidfd is None:
                timeout = min(timeout, 0.01)
            self._step(timeout)
            if self._pidfd is None:
                self._reap(block=False)

    def wait(self) -> RawOutcome:
        """Close stdin if still open, run to the end (kill at the deadline), reap, return the outcome."""
        self.close_stdin()
        self.pump()
        if not self.exited:
            self.kill()
            self._reap(block=True)
        self._drain_side()
        self._wall = (self._exited_at or time.monotonic()) - self._t0
        self._cleanup()
        if self._status is None:
            raise RuntimeError("child not reaped")
        st = self._status
        return RawOutcome(
            exit_code=os.WEXITSTATUS(st) if os.WIFEXITED(st) else None,
            signal=os.WTERMSIG(st) if os.WIFSIGNALED(st) else None,
            stdout=bytes(self.out),
            stderr=bytes(self.err),
            stdout_truncated=self.out_truncated,
            stderr_truncated=self.err_truncated,
            timed_out=self.timed_out,
            output_limited=self.output_limited,
            wall_s=self._wall,
            rusage=self._rusage,
            side=bytes(self.side),
        )

    # -- internals ---------------------------------------------------------------------------
    def _drain_side(self) -> None:
        # The loop ends once stdout/stderr are closed and the child is reaped, which can come
        # before it got round to the side channel: what the child wrote there is in the pipe by
        # now (it has exited), so read it without waiting.
        if self.side_fd is None or self.side_fd not in self._open:
            return
        while len(self.side) < 65536:
            try:
                data = os.read(self.side_fd, _CHUNK)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            self.side += data[: 65536 - len(self.side)]

    def _done(self) -> bool:
        if not self.exited:
            return False
        pipes_open = bool(self._open - ({self.side_fd} if self.side_fd is not None else set()))
        if not pipes_open:
            return True
        # Something outside the sandbox's pid namespace may still hold a pipe; do not wait forever.
        return time.monotonic() >= (self._exited_at or 0) + _DRAIN_GRACE_S

    def _watch_stdin(self) -> None:
        p = self._popen
        if p is None or p.stdin is None or p.stdin.closed:
            return
        fd = p.stdin.fileno()
        try:
            self._sel.register(fd, selectors.EVENT_WRITE)
        except KeyError:
            pass

    def _close_stdin_now(self) -> None:
        p = self._popen
        if p is not None and p.stdin is not None and not p.stdin.closed:
            try:
                self._sel.unregister(p.stdin.fileno())
            except (KeyError, ValueError):
                pass
            try:
                p.stdin.close()
            except OSError:
                pass

    def _step(self, timeout: float) -> None:
        p = self._popen
        for key, _ in self._sel.select(timeout):
            fd = key.fd
            if fd == self._pidfd:
                self._reap(block=False)
            elif p.stdin is not None and not p.stdin.closed and fd == p.stdin.fileno():
                self._write_stdin()
            else:
                self._read(fd)

    def _write_stdin(self) -> None:
        p = self._popen
        try:
            n = os.write(p.stdin.fileno(), self._pending[:_CHUNK])
            del self._pending[:n]
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            # The program stopped reading (exited or closed stdin): its business, not an error.
            self._pending.clear()
            self._close_stdin_now()
            return
        if not self._pending:
            if self._stdin_closing:
                self._close_stdin_now()
            else:
                try:
                    self._sel.unregister(p.stdin.fileno())
                except (KeyError, ValueError):
                    pass

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            data = b""
        if not data:
            self._sel.unregister(fd)
            self._open.discard(fd)
            return
        if fd == self.side_fd:
            self.side += data[: 65536 - len(self.side)]
            return
        is_out = fd == self._popen.stdout.fileno()
        buf = self.out if is_out else self.err
        room = self.output_cap + (self.out_head if is_out else 0) - len(buf)
        if len(data) > room:
            buf += data[: max(room, 0)]
            if is_out:
                self.out_truncated = True
            else:
                self.err_truncated = True
            if not self.output_limited:
                self.output_limited = True
                self.kill()
        else:
            buf += data

    def _reap(self, block: bool) -> None:
        if self._status is not None or self._popen is None:
            return
        try:
            pid, status, rusage = os.wait4(self._popen.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        self._status, self._rusage = status, rusage
        self._exited_at = time.monotonic()
        # Tell Popen the child is gone so it never waits on (or warns about) a reused pid.
        self._popen.returncode = os.waitstatus_to_exitcode(status)
        if self._pidfd is not None:
            try:
                self._sel.unregister(self._pidfd)
            except KeyError:
                pass

    def _cleanup(self) -> None:
        p = self._popen
        self._sel.close()
        for f in (p.stdin, p.stdout, p.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


_PR_SET_PDEATHSIG = 1


def _die_with(ppid: int) -> Callable[[], None]:
    """A preexec_fn: SIGKILL this child when its parent thread dies; exit at once if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl, getppid = libc.prctl, libc.getppid  # looked up now, not in the forked child

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or getppid() != ppid:
            os._exit(125)

    return arm


_PR_SET_CHILD_SUBREAPER = 36
_subreaper: bool | None = None


def become_subreaper() -> bool:
    """Make this process a child subreaper (once): orphans of its children come here, not to the
    host's init (which in a container may never reap them), and `reap_group` can reap them."""
    global _subreaper
    if _subreaper is None:
        try:
            _subreaper = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except OSError:
            _subreaper = False
    return _subreaper


def reap_group(pgid: int, timeout_s: float) -> bool:
    """Reap the members of process group `pgid` that were orphaned to this process (a subreaper)
    when their parent, the group's leader, was killed; wait up to `timeout_s` for those still
    dying. Returns whether none is left. Only members that are our children are touched."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return True  # no child of ours left in the group
        if pid:
            continue
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
