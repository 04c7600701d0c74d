"""Sandbox sessions: a workspace that lives across operations on one sandbox server.

    mgr = SessionManager.from_config(cfg.sandbox)
    r = mgr.execute(SessionOp.from_wire({"op": "open"}), backend)          # {"ok": True, "session": ID}
    mgr.execute(SessionOp.from_wire({"op": "write", "session": ID, "path": "a.py", "content": "print(1)"}), backend)
    mgr.execute(SessionOp.from_wire({"op": "run", "session": ID, "cmd": ["python3", "a.py"]}), backend)

Operations (every result has `ok`, and `error` when it is false; paths are relative to the
workspace, which is also the working directory of `run`):

    open      {limits?, language?}          -> {session, limits}
    write     {path, content, executable?}  -> {bytes}
    read      {path}                        -> {content}       (at most limits.output_kb)
    list      {}                            -> {entries: [{path, type, size}]}
    run       {cmd: [argv], timeout_s?, stdin?} -> {status, exit_code, stdout, stderr, wall_s, ...}
    snapshot  {}                            -> {snapshot}
    restore   {snapshot?}                   -> {}              (no id: the latest snapshot)
    close     {}                            -> {}

A run goes through the backend's one launch path (`Backend.run_in`): the same namespaces,
seccomp filter, rlimits, cgroups and slot uid as a one-shot execution, with the session's
workspace bound as /work instead of a fresh tmpfs; its wall limit is `timeout_s` (default the
session's wall_s), also its CPU limit, both within the server's ceiling. Before a run on a
slot whose uid differs from the one owning the workspace, the tree is handed to that uid.

Ownership: session ids are 128 random bits. The transport shows no caller identity finer than
"holds the run's keys" (every component of a run holds them), so the id is the capability.

Life: a session no operation touched for `sandbox.session_idle_s` is closed by `expire()`
(the server calls it from its loop), at most `sandbox.max_sessions` are open, at most
`sandbox.max_snapshots` snapshots each. Closing removes the workspace and every snapshot.

Disk: a session holds its workspace (at most `work_mb`) and its snapshots, which together may
hold one workspace's worth more (`work_mb` again); a snapshot past that is refused. On the
server, what sessions keep on session_dir's disk (snapshots, and workspaces that are plain
directories, counted at their quota from the open) stays within `sandbox.session_dir_mb`: an
open or a snapshot that would pass it is refused. A tmpfs workspace is RAM, not that disk.
A workspace whose quota is measured (no tmpfs) is held to it three ways: a write that would
pass it is refused; a command runs with RLIMIT_FSIZE at the room left and is killed when a
check every 0.2 s finds the workspace over its bytes or entries (so it passes the quota by at
most what it writes in that time); and a workspace left over it runs no command and takes no
write or snapshot until a restore brings it back (or the session closes).
One operation at a time per session: a second one meanwhile is refused, not queued (it would
hold a slot waiting).
"""

from __future__ import annotations

import base64
import logging
import math
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hpcrl.sandbox.languages import get_language
from hpcrl.sandbox.result import SandboxError
from hpcrl.sandbox.spec import Limits
from hpcrl.sandbox.workspace import Workspace, WorkspaceError, sweep, tree_footprint

log = logging.getLogger(__name__)
_MIB = 1024 * 1024

__all__ = ["SessionOp", "SessionManager", "OPS", "json_result"]

OPS = ("open", "write", "read", "list", "run", "snapshot", "restore", "close")
_KEYS = {
    "open": {"limits", "language"},
    "write": {"path", "content", "content_b64", "executable"},
    "read": {"path"},
    "list": set(),
    "run": {"cmd", "timeout_s", "stdin"},
    "snapshot": set(),
    "restore": {"snapshot"},
    "close": set(),
}


@dataclass(frozen=True)
class SessionOp:
    """One checked operation; `from_wire` raises ValueError naming what is wrong."""

    op: str
    session: str | None = None
    path: str | None = None
    content: bytes = b""
    executable: bool = False
    cmd: tuple[str, ...] = ()
    timeout_s: float | None = None
    stdin: bytes = b""
    snapshot: str | None = None
    limits: Limits | None = None
    language: str | None = None

    @classmethod
    def from_wire(cls, d: Any) -> SessionOp:
        if not isinstance(d, dict):
            raise ValueError(f"an operation is a mapping such as {{'op': 'open'}} (got {type(d).__name__})")
        op = d.get("op")
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)} (got {op!r})")
        unknown = set(d) - _KEYS[op] - {"op", "session"}
        if unknown:
            raise ValueError(f"{op}: unknown keys {sorted(unknown)}; {op} takes {sorted(_KEYS[op]) or 'none'}")
        sid = d.get("session")
        if op != "open" and not isinstance(sid, str):
            raise ValueError(f"{op}: 'session' must name an open session (the id `open` returned)")
        kw: dict[str, Any] = {"op": op, "session": sid}
        if op in ("write", "read"):
            if not isinstance(d.get("path"), str):
                raise ValueError(f"{op}: 'path' must be a string relative to the workspace")
            kw["path"] = d["path"]
        if op == "write":
            kw["content"] = _content(d)
            kw["executable"] = bool(d.get("executable", False))
        if op == "run":
            cmd = d.get("cmd")
            if (
                not isinstance(cmd, (list, tuple))
                or not cmd
                or not all(isinstance(a, str) and "\0" not in a for a in cmd)
            ):
                raise ValueError("run: 'cmd' must be a non-empty list of strings (argv), e.g. ['python3', 'main.py']")
            kw["cmd"] = tuple(cmd)
            t = d.get("timeout_s")
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf):
                raise ValueError(f"run: 'timeout_s' must be a positive number of seconds (got {t!r})")
            kw["timeout_s"] = None if t is None else float(t)
            stdin = d.get("stdin", b"")
            if not isinstance(stdin, (str, bytes)):
                raise ValueError("run: 'stdin' must be a string")
            kw["stdin"] = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        if op == "restore":
            if d.get("snapshot") is not None and not isinstance(d["snapshot"], str):
                raise ValueError("restore: 'snapshot' must be the id a snapshot op returned (or absent: the latest)")
            kw["snapshot"] = d.get("snapshot")
        if op == "open":
            kw["limits"] = Limits.from_wire(d["limits"]) if d.get("limits") else None
            if d.get("language") is not None:
                kw["language"] = get_language(str(d["language"])).name  # ValueError lists the languages
        return cls(**kw)


def _content(d: dict) -> bytes:
    if "content_b64" in d:
        try:
            return base64.b64decode(d["content_b64"], validate=True)
        except (TypeError, ValueError):
            raise ValueError("write: 'content_b64' is not valid base64") from None
    c = d.get("content")
    if isinstance(c, str):
        return c.encode()
    if isinstance(c, (bytes, bytearray)):
        return bytes(c)
    raise ValueError("write: 'content' must be a string (or bytes; or give 'content_b64')")


@dataclass
class _Session:
    sid: str
    home: str  # the session's directory: work/ (the workspace) and snap/ (snapshots)
    ws: Workspace
    limits: Limits
    reserve_mb: int
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    snapshots: dict[str, str] = field(default_factory=dict)  # id -> directory
    snap_bytes: int = 0  # what its snapshots hold on disk
    disk: int = 0  # what it counts against the server's session_dir_mb


class SessionManager:
    """The sessions of one sandbox server. `execute` runs in slot threads; `expire` in the server's."""

    def __init__(
        self,
        session_dir: str,
        *,
        idle_s: float = 600.0,
        max_sessions: int = 64,
        max_snapshots: int = 8,
        ceiling: Limits | None = None,
        max_disk_bytes: int | None = None,
        tmpfs: bool = True,
        clock=time.monotonic,
    ):
        real = os.path.realpath(session_dir)
        if real == "/tmp" or real.startswith("/tmp/"):
            raise ValueError(
                f"sandbox.session_dir {session_dir!r} is under /tmp, which each sandbox's launcher covers with its "
                "own tmpfs (the workspace would not be seen); use e.g. /var/tmp/hpcrl-sessions"
            )
        if not os.path.lexists(real):
            os.makedirs(real, mode=0o711, exist_ok=True)
            os.chmod(real, 0o711)  # whatever the umask: slot uids pass through to their workspaces
        st = os.lstat(real)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            # In a world-writable place (/var/tmp) someone else's directory could have our
            # workspaces renamed under us, and a tmpfs mounted where they point.
            raise ValueError(
                f"sandbox.session_dir {real} must be a directory of uid {os.geteuid()} that only it can write "
                f"(it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); remove it, or name another"
            )
        sweep(real)
        # Ours alone to list; slot uids may only pass through to their own workspace (0711).
        self.root = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=real)
        os.chmod(self.root, 0o711)
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self.max_snapshots = max_snapshots
        self.ceiling = ceiling
        self.max_disk_bytes = max_disk_bytes  # session_dir_mb: snapshots and measured workspaces together
        self.tmpfs = tmpfs  # False: workspaces are directories on session_dir's disk, their quota measured
        self.disk = 0  # bytes counted against max_disk_bytes, all sessions
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self.opened = self.expired = 0
        # Successful operations by kind and the bytes writes brought: what an episode sent (tests, metrics).
        self.ops: Counter = Counter()
        self.bytes_written = 0

    @classmethod
    def from_config(cls, cfg) -> SessionManager:
        return cls(
            cfg.session_dir,
            idle_s=cfg.session_idle_s,
            max_sessions=cfg.max_sessions,
            max_snapshots=cfg.max_snapshots,
            ceiling=cfg.ceiling,
            max_disk_bytes=cfg.session_dir_mb * _MIB,
            tmpfs=cfg.session_tmpfs,
        )

    def __len__(self) -> int:
        return len(self._sessions)

    def execute(self, op: SessionOp, backend) -> dict:
        """The result of `op`, always a mapping with `ok`; never raises for the client's mistakes."""
        try:
            if op.op == "open":
                out = {"ok": True, **self._open(op, backend)}
                with self._lock:
                    self.ops["open"] += 1
                return out
            s = self._take(op.session)
            try:
                out = getattr(self, f"_{op.op}")(s, op, backend)
            finally:
                s.last_used = self._clock()
                s.lock.release()
            with self._lock:
                self.ops[op.op] += 1
                self.bytes_written += len(op.content)
            return {"ok": True, **out}
        except (ValueError, SandboxError) as exc:  # WorkspaceError is a ValueError
            return {"ok": False, "error": f"{op.op}: {exc}" if not str(exc).startswith(op.op) else str(exc)}
        except OSError as exc:
            log.warning("session %s: %s failed: %s", op.session, op.op, exc)
            return {"ok": False, "error": f"{op.op}: {exc.strerror or exc} (on the sandbox node)"}

    def expire(self) -> int:
        """Close sessions idle for `idle_s`; how many. Busy ones (an operation running) wait."""
        now = self._clock()
        gone = []
        with self._lock:
            for sid, s in list(self._sessions.items()):
                if now - s.last_used >= self.idle_s and s.lock.acquire(blocking=False):
                    gone.append(self._sessions.pop(sid))
        for s in gone:
            self._destroy(s)
        self.expired += len(gone)
        return len(gone)

    def close_all(self) -> None:
        with self._lock:
            gone = list(self._sessions.values())
            self._sessions.clear()
        for s in gone:
            self._destroy(s)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- operations --------------------------------------------------------------------------
    def _open(self, op: SessionOp, backend) -> dict:
        limits = op.limits or Limits()
        if self.ceiling is not None:
            limits.check_within(self.ceiling)
        reserve = 0
        if op.language is not None:
            backend.require(op.language)
            reserve = get_language(op.language).address_space_mb
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise ValueError(
                    f"this server holds its maximum of {self.max_sessions} sessions (sandbox.max_sessions); "
                    f"close one, or wait for idle ones to expire (sandbox.session_idle_s={self.idle_s:g})"
                )
            sid = secrets.token_hex(16)
            home = os.path.join(self.root, sid)
            s = _Session(sid, home, None, limits, reserve, self._clock())  # type: ignore[arg-type]
            s.lock.acquire()  # nobody may use it before its workspace exists
            self._sessions[sid] = s
        try:
            os.mkdir(home, 0o711)
            os.chmod(home, 0o711)  # the umask (the CLI's is 077) must not lock the slot uid out
            os.mkdir(os.path.join(home, "snap"), 0o700)
            s.ws = Workspace.create(os.path.join(home, "work"), limits, getattr(backend, "uid", None), self.tmpfs)
            if not s.ws.mounted:  # on disk: it may grow to its quota, counted as such from now
                self._count(s, s.ws.quota_bytes, f"a workspace of {limits.work_mb} MiB")
        except BaseException:
            with self._lock:
                self._sessions.pop(sid, None)
            self._uncount(s)
            if s.ws is not None:
                s.ws.remove()
            shutil.rmtree(home, ignore_errors=True)
            raise
        finally:
            s.lock.release()
        self.opened += 1
        return {"session": sid, "limits": limits.to_wire(), "quota": "tmpfs" if s.ws.mounted else "measured"}

    def _write(self, s: _Session, op: SessionOp, backend) -> dict:
        self._check_measured(s)
        return {"bytes": s.ws.write(op.path, op.content, executable=op.executable)}

    def _read(self, s: _Session, op: SessionOp, backend) -> dict:
        return {"content": s.ws.read(op.path, s.limits.output_kb * 1024)}

    def _list(self, s: _Session, op: SessionOp, backend) -> dict:
        entries, truncated = s.ws.tree(s.limits.inodes)
        return {"entries": entries, "truncated": truncated}

    def _run(self, s: _Session, op: SessionOp, backend) -> dict:
        t = op.timeout_s if op.timeout_s is not None else s.limits.wall_s
        limits = s.limits.replace(wall_s=t, cpu_s=t)
        if self.ceiling is not None:
            limits.check_within(self.ceiling, "run")
        watch = None
        if not s.ws.mounted:
            used = self._check_measured(s)
            # No file may outgrow the room left, and the run dies once the tree is over the quota.
            room_mb = max(1, (s.ws.quota_bytes - used) // _MIB)
            limits = limits.replace(file_size_mb=min(limits.file_size_mb, room_mb))
            watch = lambda: self._over(s)[0] is not None
        s.ws.chown(getattr(backend, "uid", None))
        res = backend.run_in(s.ws.root, op.cmd, limits, reserve_mb=s.reserve_mb, stdin=op.stdin, watch=watch)
        out = res.to_wire()
        # The program owns the workspace's root and may have opened it to every host user.
        os.chmod(s.ws.root, 0o700)
        over = self._over(s)[0] if watch is not None else None
        if over is not None:
            raise WorkspaceError(
                f"the run went over the workspace's quota ({over}; measured, no tmpfs here) and was stopped "
                f"(status {res.status}); no command runs until a restore brings it back, or close the session"
            )
        return out

    def _over(self, s: _Session) -> tuple[str | None, int]:
        """(what a measured workspace is over, bytes or entries, or None; the bytes it holds)."""
        size, entries = s.ws.footprint()
        if size > s.ws.quota_bytes:
            return f"{size / _MIB:.1f} MiB of limits.work_mb={s.limits.work_mb}", size
        if entries > s.limits.inodes:
            return f"{entries} entries of limits.inodes={s.limits.inodes}", size
        return None, size

    def _check_measured(self, s: _Session) -> int:
        """The bytes a measured workspace holds; WorkspaceError if it is over its quota (a command
        left it so): nothing but a restore or a close is done on it then."""
        if s.ws.mounted:
            return 0
        over, size = self._over(s)
        if over is not None:
            raise WorkspaceError(
                f"the workspace is over its quota ({over}): restore a snapshot, or close the session; "
                "no command, write or snapshot is done on it until then"
            )
        return size

    def _snapshot(self, s: _Session, op: SessionOp, backend) -> dict:
        if len(s.snapshots) >= self.max_snapshots:
            raise ValueError(
                f"the session holds its maximum of {self.max_snapshots} snapshots (sandbox.max_snapshots); "
                "open a new session for more"
            )
        self._check_measured(s)
        size = s.ws.usage()
        quota = s.limits.work_mb * _MIB
        if s.snap_bytes + size > quota:
            raise ValueError(
                f"the session's snapshots would hold {(s.snap_bytes + size) / _MIB:.1f} MiB, over their quota of "
                f"{s.limits.work_mb} MiB (limits.work_mb: one workspace's worth for all of them); open a session "
                "with more work_mb, or a new one"
            )
        self._count(s, size, f"a snapshot of {size / _MIB:.1f} MiB")
        snap = secrets.token_hex(8)
        d = os.path.join(s.home, "snap", snap)
        try:
            s.ws.copy_to(d)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            self._uncount(s, size)
            raise
        actual = tree_footprint(d)[0]  # the copy's own blocks (directories are allocated anew)
        with self._lock:
            self.disk += actual - size
            s.disk += actual - size
        s.snap_bytes += actual
        s.snapshots[snap] = d
        return {"snapshot": snap}

    def _restore(self, s: _Session, op: SessionOp, backend) -> dict:
        if op.snapshot is None and not s.snapshots:
            raise ValueError("the session has no snapshot yet; take one with a snapshot op")
        # Without an id: the latest (dicts keep insertion order), for scripts that cannot know the id.
        d = s.snapshots.get(op.snapshot) if op.snapshot is not None else list(s.snapshots.values())[-1]
        if d is None:
            raise ValueError(f"no snapshot {op.snapshot!r} in this session; use an id its snapshot op returned")
        s.ws.restore_from(d)
        return {}

    def _close(self, s: _Session, op: SessionOp, backend) -> dict:
        with self._lock:
            self._sessions.pop(s.sid, None)
        self._destroy(s)
        return {}

    # -- machinery ---------------------------------------------------------------------------
    def _take(self, sid: str | None) -> _Session:
        with self._lock:
            s = self._sessions.get(sid) if sid else None
        if s is None:
            raise ValueError(
                f"no open session {sid!r} on this server (closed, expired after "
                f"sandbox.session_idle_s={self.idle_s:g} s idle, or never opened); open a new one"
            )
        if not s.lock.acquire(blocking=False):
            raise ValueError(f"session {sid} is busy with another operation; send one operation at a time")
        if s.sid not in self._sessions:  # closed or expired while we waited for the lock
            s.lock.release()
            raise ValueError(f"no open session {sid!r} on this server (closed meanwhile); open a new one")
        return s

    def _count(self, s: _Session, size: int, what: str) -> None:
        """Count `size` bytes of `s` against the server's session_dir_mb, or refuse (ValueError)."""
        with self._lock:
            if self.max_disk_bytes is not None and self.disk + size > self.max_disk_bytes:
                raise ValueError(
                    f"this sandbox server's sessions hold {self.disk / _MIB:.1f} MiB of disk; {what} would pass its "
                    f"cap of {self.max_disk_bytes // _MIB} MiB (sandbox.session_dir_mb); close sessions or snapshot "
                    "less"
                )
            self.disk += size
            s.disk += size

    def _uncount(self, s: _Session, size: int | None = None) -> None:
        with self._lock:
            size = s.disk if size is None else size
            self.disk -= size
            s.disk -= size

    def _destroy(self, s: _Session) -> None:
        if s.ws is not None:
            s.ws.remove()
        shutil.rmtree(s.home, ignore_errors=True)
        self._uncount(s)


def json_result(result: dict) -> dict:
    """A result as JSON can carry it: `content` as UTF-8 text (or `content_b64` when it is not),
    stdout/stderr decoded (bad bytes become U+FFFD, as `hpcrl sandbox exec --json` prints them)."""
    out = dict(result)
    content = out.pop("content", None)
    if isinstance(content, (bytes, bytearray)):
        try:
            out["content"] = bytes(content).decode("utf-8")
        except UnicodeDecodeError:
            out["content_b64"] = base64.b64encode(content).decode()
    elif content is not None:
        out["content"] = content
    for k in ("stdout", "stderr"):
        if isinstance(out.get(k), (bytes, bytearray)):
            out[k] = bytes(out[k]).decode("utf-8", "replace")
    for k in ("wall_s", "cpu_s", "peak_memory_mb"):
        if isinstance(out.get(k), float):
            out[k] = round(out[k], 4)
    return out
