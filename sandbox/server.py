"""The sandbox server: a slot pool behind a CURVE ZeroMQ ROUTER (hpcrl.core.transport).

    hpcrl sandbox serve --slots 4 --run-dir runs/quickstart-20261202-120000-ab12 [--name sandbox-0]

It publishes endpoints/<name>.json in the run directory, admits only clients holding one of
the run's keys, says at start which limits its backend enforces, and runs until SIGTERM or
SIGINT. On bwrap as root its slots take free uids of the host's pool (hpcrl.sandbox.uids),
listed in uids/<name>.json in the run directory while it holds them. Clients: `hpcrl.sandbox.client.SandboxClient`.

Requests (envelopes with an id; body -> reply kind and body):

    exec            ExecSpec.to_wire()                            -> result   ExecResult.to_wire()
    judge_io        {language, files, cases, limits, stop_on_fail} -> verdict  Verdict.to_wire()
    judge_function  {program, entry_point, test, trusted_prelude, name, limits, files?, language?} -> verdict
    info            {}                                            -> info {backend, languages, slots, queue, ...}
    session         {op, session?, ...} (hpcrl.sandbox.session)  -> session {ok, error?, ...}

Sessions (`session`, served when the server has a SessionManager, as `serve` gives it) keep a
workspace on this server across operations; a session is pinned to the server that opened it.
Each operation is a job on the pool like an exec; a malformed one is answered at once with
ok: false (not bad_request: a script driving a session reads every answer the same way).

Bytes of 4 KiB or more in a reply (a program's stdout, up to `output_kb`) travel as frames
after the header, not in it (`result.lift_bytes`; the client puts them back): the wire caps a
header at 1 MiB, and a bigger one was dropped by the client, which then timed out.

The replies that are not answers: `busy` (queue full: nothing ran; send again, under a new
id, later), `bad_request` (malformed, or limits over `sandbox.ceiling`: sending again will not
help), `sandbox_failed` (the sandbox infrastructure failed; the message says how).

Limits come with each request, but never above the server's own `sandbox.ceiling` (defaults
included: a judge request without limits asks for the harness's): a domain, or any other
holder of the run's keys, cannot lift the isolation limits the site configured.

Idempotency: a request id that is running gets its reply routed to whichever socket asked
last (a client retries on a fresh socket), and an id already answered is answered again from
a cache, so a retry never runs a program twice within one server's life. Across a server
restart an id is run again; sandboxed runs have no effects outside, so that is only work.

`judge_function` runs the request's *test* code unsandboxed, in a checker process of its own
under the request's limits (hpcrl.sandbox.judge; the candidate runs in a sandbox): only run
components holding the run's keys can send requests. With default limits it takes harness
sandboxes and checkers each slot starts ahead (hpcrl.sandbox.warm, two of each per slot).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from queue import SimpleQueue
from typing import Any

from hpcrl.core.files import atomic_write_json
from hpcrl.core.liveness import beat
from hpcrl.core.metrics import provide
from hpcrl.core.rpc import DEFERRED, Reply, RequestServer
from hpcrl.core.transport import Node
from hpcrl.sandbox import judge
from hpcrl.sandbox.pool import SlotPool
from hpcrl.sandbox.result import SandboxError, lift_bytes, sink_bytes
from hpcrl.sandbox.session import SessionManager, SessionOp
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile
from hpcrl.sandbox.warm import WarmHarness

log = logging.getLogger("hpcrl.sandbox.server")

__all__ = ["SandboxServer", "serve", "record_uids"]


def _limits(d: Any) -> Limits | None:
    return Limits.from_wire(d) if d else None


def _blob(value: Any, where: str) -> bytes:
    """`value` as bytes if it is bytes or str. Never bytes(value) of anything else: bytes(n) of an
    int is n zero bytes (a request could make this process allocate, or raise OverflowError)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise ValueError(f"{where} must be bytes or str (got {type(value).__name__})")


def _io_cases(raw: Any) -> list:
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"cases must be a list of [stdin, expected] pairs (got {type(raw).__name__})")
    cases = []
    for k, case in enumerate(raw):
        if not isinstance(case, (list, tuple)) or len(case) != 2:
            raise ValueError(f"case {k} must be a [stdin, expected] pair")
        cases.append(judge.IOCase(_blob(case[0], f"case {k} stdin"), _blob(case[1], f"case {k} expected")))
    return cases


def _job(
    kind: str,
    body: Any,
    warm_for: Callable[[Any, Limits | None], Any] = lambda b, lim: None,
    ceiling: Limits | None = None,
) -> Callable:
    """Parse a request into a job `fn(backend) -> (reply kind, reply body)`; ValueError if malformed
    or if it asks for more than `ceiling` (the limits it would run under, defaults included)."""

    def within(limits: Limits, where: str) -> None:
        if ceiling is not None:
            limits.check_within(ceiling, where)  # the client's error names the request kind

    if not isinstance(body, dict):
        raise ValueError(f"{kind}: body must be a mapping")
    if kind == "exec":
        spec = ExecSpec.from_wire(body)
        within(spec.limits, "limits")
        if spec.compile_limits is not None:
            within(spec.compile_limits, "compile_limits")
        return lambda backend: ("result", backend.run(spec).to_wire())
    if kind == "judge_io":
        try:
            files = tuple(SourceFile(str(p), d, bool(x)) for p, d, x in body["files"])
            cases = _io_cases(body["cases"])
            language, stop = str(body["language"]), bool(body.get("stop_on_fail", True))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"judge_io: {exc}") from None
        limits = _limits(body.get("limits"))
        within(limits or Limits(), "limits")
        return lambda backend: (
            "verdict",
            judge.judge_io(backend, language, files, cases, limits, stop_on_fail=stop).to_wire(),
        )
    if kind == "judge_function":
        try:
            task = judge.FunctionTask(
                program=str(body["program"]),
                entry_point=str(body["entry_point"]),
                test=str(body["test"]),
                trusted_prelude=str(body.get("trusted_prelude", "")),
                name=str(body.get("name", "task")),
                files=tuple((str(p), str(t)) for p, t in body.get("files") or ()),
                language=str(body.get("language", "python")),
            )
        except KeyError as exc:
            raise ValueError(f"judge_function: missing {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"judge_function: {exc}") from None
        limits = _limits(body.get("limits"))
        within(limits or judge.HARNESS_LIMITS, "limits")
        return lambda backend: (
            "verdict",
            judge.judge_function(backend, task, limits, warm=warm_for(backend, limits)).to_wire(),
        )
    raise ValueError(f"unknown request kind {kind!r}; kinds: exec, judge_io, judge_function, session, info")


class SandboxServer:
    """Requests in through a RequestServer, jobs out to the pool, replies back when a slot finishes."""

    def __init__(
        self,
        node: Node,
        service: str,
        pool: SlotPool,
        *,
        replay_cache: int = 4096,
        replay_cache_bytes: int = 64 << 20,
        ceiling: Limits | None = None,
        sessions: SessionManager | None = None,
    ):
        self.node = node
        self.sessions = sessions  # None: this server opens no sessions
        self.ceiling = ceiling  # requests over it are refused (bad_request), whoever sends them
        self.service = service
        self.pool = pool
        self._done: SimpleQueue = SimpleQueue()  # (request id, Reply) from the slot threads
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.server = RequestServer(
            node,
            service,
            self._handle,
            replay_cache=replay_cache,
            replay_cache_bytes=replay_cache_bytes,
            also=[self._wake_r],
        )
        self.endpoint = self.server.endpoint
        self.refused = 0
        self.replies: Counter = Counter()  # reply kind -> count (serving thread only)
        self.statuses: Counter = Counter()  # an execution's status (ok, error, timeout, oom, ...) -> count
        self.exec_wall_s = 0.0  # wall seconds of the requests: their mean latency is the ratio
        self._close_lock = threading.Lock()
        self._closed = False
        self._warm: dict[int, Any] = {}

    served = property(lambda self: self.server.served)
    replayed = property(lambda self: self.server.replayed)
    dropped = property(lambda self: self.server.dropped)

    def _warm_for(self, backend, limits: Limits | None):
        """The slot's WarmHarness for default-limit function judging (created in, and used by, its thread)."""
        if limits is not None:
            return None
        warm = self._warm.get(id(backend))
        if warm is None:
            warm = self._warm[id(backend)] = WarmHarness(backend, spares=2)
        return warm

    def info(self) -> dict:
        b = self.pool.backends[0]
        return {
            "backend": b.describe(),
            "languages": list(b.languages()),
            "slots": self.pool.slots,
            "queue": self.pool.queue_max,
            "busy": self.pool.busy,
            "queued": self.pool.queued,
            "ceiling": self.ceiling.to_wire() if self.ceiling is not None else None,
            "sessions": len(self.sessions) if self.sessions is not None else None,
        }

    def poll_once(self, timeout_s: float = 0.1) -> None:
        _, ready = self.server.router.poll_once(timeout_s)
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while not self._done.empty():
            rid, reply = self._done.get()
            self._count(reply)
            self.server.reply(rid, reply)
        if self.sessions is not None:
            self.sessions.expire()

    def _count(self, reply: Reply) -> None:
        self.replies[reply.kind] += 1
        body = reply.body if isinstance(reply.body, dict) else {}
        # An exec's ExecResult is the body (and a session run's); a judge's Verdict holds the candidate's as "result".
        res = body if reply.kind in ("result", "session") else body.get("result")
        if res is None and isinstance(body.get("cases"), list):  # judged case by case: the last run's
            res = next(
                (c.get("result") for c in reversed(body["cases"]) if isinstance(c, dict) and c.get("result")), None
            )
        if isinstance(res, dict) and isinstance(res.get("status"), str):
            self.statuses[res["status"]] += 1
        if isinstance(body.get("wall_s"), (int, float)):
            self.exec_wall_s += float(body["wall_s"])

    def metrics(self) -> dict:
        """What the server's Prometheus endpoint shows (core/metrics.py)."""
        return {
            "sandbox_slots": self.pool.slots,
            "sandbox_busy_slots": self.pool.busy,
            "sandbox_queued": self.pool.queued,
            "sandbox_requests_total": self.served,
            "sandbox_refused_total": self.refused,
            "sandbox_replies_total:kind": dict(self.replies),
            "sandbox_results_total:status": dict(self.statuses),
            "sandbox_exec_wall_seconds_total": self.exec_wall_s,
            "sandbox_sessions": len(self.sessions) if self.sessions is not None else 0,
        }

    def serve(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        while not stop.is_set():
            beat()
            self.poll_once(poll_s)

    def _handle(self, env) -> Any:
        if env.kind == "info":
            return Reply("info", self.info(), remember=False)
        if env.kind == "session":
            try:
                if self.sessions is None:
                    raise ValueError("this sandbox server serves no sessions (its log says why: sandbox.session_dir)")
                op = SessionOp.from_wire(sink_bytes(env.body, env.arrays))
            except ValueError as exc:
                return Reply("session", {"ok": False, "error": str(exc)})
            fn = lambda backend: ("session", self.sessions.execute(op, backend))
        else:
            try:
                fn = _job(env.kind, env.body, self._warm_for, self.ceiling)
            except ValueError as exc:
                return Reply("bad_request", {"message": str(exc)})
        rid = env.msg_id
        if not self.pool.try_submit(fn, lambda res, exc: self._complete(rid, res, exc)):
            self.refused += 1
            return Reply("busy", {"slots": self.pool.slots, "queue": self.pool.queue_max}, remember=False)
        return DEFERRED

    def _complete(self, rid: str, res: Any, exc: BaseException | None) -> None:
        """In a slot's thread: hand the reply to the serving thread (zmq sockets are single-threaded)."""
        if exc is None:
            kind, body = res
        elif isinstance(exc, SandboxError):
            kind, body = "sandbox_failed", {"message": str(exc)}
            log.error("%s: sandbox failed: %s", self.service, exc)
        elif isinstance(exc, ValueError):
            kind, body = "bad_request", {"message": str(exc)}
        else:
            log.error("%s: request %s failed", self.service, rid, exc_info=exc)
            kind, body = "sandbox_failed", {"message": f"{type(exc).__name__}: {exc}"}
        body, frames = lift_bytes(body)
        self._done.put((rid, Reply(kind, body, frames)))
        with self._close_lock:  # never write to a closed (or reused) descriptor
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def close(self) -> None:
        """Close the socket and kill the spare harness sandboxes; call after the pool has stopped."""
        for warm in self._warm.values():
            warm.close()
        self._warm.clear()
        if self.sessions is not None:
            self.sessions.close_all()  # their workspaces and snapshots go with the server
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.server.close()


def serve(cfg, *, run_dir: str, slots: int, name: str = "sandbox-0", stop: threading.Event | None = None) -> int:
    """Run a sandbox server until SIGTERM/SIGINT (or `stop`); returns the process exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    pool = SlotPool.from_config(cfg, slots=slots)
    record = record_uids(run_dir, name, pool.uids)
    node = None
    try:
        pool.backends[0].check()
        node = Node(run_dir, name)
        try:
            sessions = SessionManager.from_config(cfg)
        except (ValueError, OSError) as exc:  # executions need no session directory: serve them anyway
            log.warning("sandbox server %s: no sessions: %s", name, exc)
            sessions = None
        server = SandboxServer(node, name, pool, ceiling=cfg.ceiling, sessions=sessions)
        provide(server.metrics)
        log.info(
            "sandbox server %s at %s: %d slot(s), queue %d; %s",
            name,
            server.endpoint.address,
            pool.slots,
            pool.queue_max,
            pool.backends[0].describe(),
        )
        t0 = time.monotonic()
        server.serve(stop)
        log.info(
            "sandbox server %s stopping after %.0f s: %d served, %d replayed, %d refused (busy), %d dropped",
            name,
            time.monotonic() - t0,
            server.served,
            server.replayed,
            server.refused,
            server.dropped,
        )
        pool.close()
        server.close()
    finally:
        pool.close()  # the slot uids go back to the host's pool
        if record is not None:
            record.unlink(missing_ok=True)
        if node is not None:
            node.close()
    return 0


def record_uids(run_dir: str, name: str, uids: list[int]) -> Path | None:
    """Write `uids/<name>.json` in the run directory: which host uids this server's slots run as
    (for whoever audits or cleans up the host); removed when the server gives them back."""
    if not uids:
        return None
    path = Path(run_dir) / "uids" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"name": name, "host": socket.gethostname(), "pid": os.getpid(), "uids": uids})
    log.info("sandbox server %s: slot uids %s of this host's pool", name, ", ".join(map(str, uids)))
    return path
