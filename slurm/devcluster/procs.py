"""Finding, starting, waiting for and stopping the dev cluster's daemons.

A daemon is a psutil.Process: psutil checks pid plus start time, so a reused pid is never taken for
it. Between calls the identity is kept in run/<role>.id ("PID CREATE_TIME"). A pid, from that record,
the daemon's own pid file or a scan, counts only if the process runs the role's executable and carries
HPCRL_DEVCLUSTER_TAG=<state>#<role> in its environment, so we never touch another cluster's processes.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psutil

from .layout import TAG_VAR, DaemonFailed, Layout, log

DAEMON_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def alive(p: psutil.Process) -> bool:
    """Is exactly this process still there? A zombie counts as gone, unless only its main thread has
    exited and other threads still run (then it may still hold its ports)."""
    try:
        return p.is_running() and (p.status() != psutil.STATUS_ZOMBIE or p.num_threads() > 1)
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until these processes are gone (zombies count as gone); return those still alive."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _read_pid(path: Path) -> int | None:
    try:
        digits = "".join(c for c in path.read_text() if c.isdigit())
    except OSError:
        return None
    return int(digits) if digits else None


class Supervisor:
    """The daemons of one state folder. Writes run/<role>.id records only while `locked` (the caller
    holds the state folder's lock), so a `status` running beside an `up` never races it."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.locked = False
        self.started: dict[str, subprocess.Popen] = {}  # started by this process: we can learn their exit status

    def is_role(self, p: psutil.Process, role: str, *, fresh_ok: bool = False) -> bool:
        """Does p run ROLE's executable and carry our tag? With `fresh_ok`, an environment that still reads
        empty passes too: Popen (vfork) returns once the exec is under way, when /proc/PID/exe already is
        the daemon but /proc/PID/environ may still be empty (64 of 300 starts on a busy 2-core machine)."""
        try:
            exe = os.path.basename(p.exe())
            env = p.environ()
        except psutil.Error:
            return False
        want = self.layout.role(role).exe
        tag_ok = env.get(TAG_VAR) == self.layout.tag(role) or (fresh_ok and not env)
        return tag_ok and (exe == want or exe.startswith(want + "-"))

    def _from_record(self, role: str) -> psutil.Process | None:
        try:
            pid, ctime = self.layout.idfile(role).read_text().split()
            p = psutil.Process(int(pid))
            # create_time() is the kernel's boot time (whole seconds, moved by clock adjustments) plus the start
            # ticks: allow for a step. (A record in ticks, from the old bash script, never matches: we fall through.)
            return p if abs(p.create_time() - float(ctime)) < 1.5 else None
        except (OSError, ValueError, psutil.Error):
            return None

    def _from_pidfile(self, role: str) -> psutil.Process | None:
        pid = _read_pid(self.layout.pidfile(role))
        try:
            return psutil.Process(pid) if pid else None
        except psutil.Error:
            return None

    def _from_scan(self, role: str) -> psutil.Process | None:
        # The oldest match: slurmctld's forked slurmscriptd carries the same tag and executable.
        found = [p for p in self.tagged() if self.is_role(p, role) and alive(p)]
        return min(found, key=lambda p: (p.create_time(), p.pid), default=None)

    def find(self, role: str) -> psutil.Process | None:
        """ROLE's live process, if any. Our record first, then the daemon's pid file, then a scan for our
        tag (pid file lost, e.g. removed by an old instance exiting while a new one started)."""
        p = self._from_record(role)  # written by us right after the start, possibly before the tag is readable
        if p is not None and self.is_role(p, role, fresh_ok=True) and alive(p):
            return p
        for source in (self._from_pidfile, self._from_scan):
            p = source(role)
            if p is not None and self.is_role(p, role) and alive(p):
                self._write_record(role, p)
                return p
        return None

    def running(self, role: str) -> bool:
        return self.find(role) is not None

    def _write_record(self, role: str, p: psutil.Process) -> None:
        if not self.locked:
            return
        path = self.layout.idfile(role)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        try:
            tmp.write_text(f"{p.pid} {p.create_time()!r}\n")
            tmp.replace(path)  # readers never see half a record
        except (OSError, psutil.Error):
            tmp.unlink(missing_ok=True)

    def tagged(self) -> list[psutil.Process]:
        """Every process carrying a tag of this state folder: daemons and their children (slurmstepd...)."""
        prefix = f"{self.layout.state}#"
        out = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get(TAG_VAR, "").startswith(prefix):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def kill_tagged(self) -> list[int]:
        """SIGKILL every process still carrying our tag; wait a little for them to go; return their pids."""
        left = self.tagged()
        for p in left:
            _signal(p, signal.SIGKILL)
        wait_gone(left, 5)
        return [p.pid for p in left]

    def start(self, role: str, argv: list[str]) -> None:
        """Start ROLE detached: own session (no caller's terminal or signals), clean environment, output
        appended to log/ROLE.out (never the caller's pipes). Popen returns once the exec is under way, so
        the recorded pid already runs the daemon's executable."""
        env = {
            "PATH": DAEMON_PATH,
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "SLURM_CONF": str(self.layout.slurm_conf),
            TAG_VAR: self.layout.tag(role),
        }
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        with open(self.layout.outfile(role), "ab") as out:
            out.write(f"===== {stamp} start {role}: {shlex.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True
            )
        self.started[role] = proc
        with contextlib.suppress(psutil.Error):  # already gone: wait_until reports it, with its exit status
            self._write_record(role, psutil.Process(proc.pid))

    def exit_note(self, role: str) -> str:
        """' (exit status N)' if this process started ROLE and it has exited."""
        proc = self.started.get(role)
        if proc is None or proc.poll() is None:
            return ""
        rc = proc.returncode
        return f" (exit status {rc})" if rc >= 0 else f" (killed by signal {-rc})"

    def still_running(self, role: str, p: psutil.Process | None) -> psutil.Process | None:
        """p if it still lives; else ROLE's process if it runs as another one. Never concludes from a pid file
        alone: the daemons write and delete their pid files themselves."""
        return p if p is not None and alive(p) else self.find(role)

    def wait_until(self, role: str, timeout_s: float, what: str, check: Callable[[], bool]) -> None:
        """Poll check() until it holds; fail, naming ROLE, if its process exits or the time runs out."""
        p = self.find(role)
        if p is None:
            raise DaemonFailed(role, f"not running{self.exit_note(role)} before waiting for: {what}")
        deadline = time.monotonic() + timeout_s
        while not check():
            p = self.still_running(role, p)
            if p is None:
                raise DaemonFailed(role, f"process exited{self.exit_note(role)} while waiting for: {what}")
            if time.monotonic() > deadline:
                raise DaemonFailed(role, f"timed out after {timeout_s:g}s waiting for: {what}")
            time.sleep(0.2)

    def stop(self, roles: list[str], timeout_s: float) -> None:
        """SIGTERM, wait, SIGKILL; these roles in parallel. Waits on the process, not its pid file (a daemon
        removes that before it is gone)."""
        procs = {role: p for role in roles if (p := self.find(role)) is not None}
        for p in procs.values():
            _signal(p, signal.SIGTERM)
        stuck = wait_gone(list(procs.values()), timeout_s)
        for role, p in procs.items():
            if p in stuck:
                log(f"{role} (pid {p.pid}) did not stop after {timeout_s:g}s: SIGKILL")
                _signal(p, signal.SIGKILL)
        still = wait_gone(stuck, 10) if stuck else []
        for role, p in procs.items():
            if p in still:
                log(f"WARNING: {role} (pid {p.pid}) still there after SIGKILL")
        for role in roles:
            if role in self.started:
                self.started[role].poll()  # reap our own child
            self.layout.pidfile(role).unlink(missing_ok=True)
            self.layout.idfile(role).unlink(missing_ok=True)


def _signal(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)  # psutil refuses if the pid now belongs to another process


def tail_logs(layout: Layout, role: str) -> None:
    """Print the end of ROLE's log, and its output of the last start, to stderr."""
    logfile, outfile = layout.logfile(role), layout.outfile(role)
    if _size(logfile):
        log_lines = logfile.read_text(errors="replace").splitlines()[-25:]
        _print_block(f"----- tail of {logfile} -----", log_lines)
    if _size(outfile):
        lines = outfile.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("===== ") and " start " in line]
        last_start = lines[starts[-1] :] if starts else lines
        _print_block(f"----- tail of {outfile} (last start) -----", last_start[-15:])


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _print_block(title: str, lines: list[str]) -> None:
    print("\n".join([title, *lines]), file=sys.stderr, flush=True)
