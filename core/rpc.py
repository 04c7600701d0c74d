"""Control requests with timeouts and retries, and policy-version announcements (PUB/SUB).

    # server side
    def handle(env: Envelope) -> Reply:
        if env.kind != "exec":
            raise ValueError(f"unknown request {env.kind!r}")
        return Reply("result", {"exit_code": 0}, arrays=[stdout_tokens])
    server = RequestServer(node, "coordinator", handle)
    server.serve(stop_event)                     # or server.poll_once(timeout_s) in your own loop
    # a handler may answer later, from the serving thread: return DEFERRED, then
    server.reply(env.msg_id, Reply("result", ...))   # (the sandbox server runs jobs on a slot pool)

    # client side
    client = RequestClient(node, "sandbox-0", timeout_s=5, retries=2)
    reply = client.request("exec", {"code": "print(1)"})   # Envelope; RequestTimeout / RemoteError

    # policy versions
    pub = VersionPublisher(node); pub.publish(12); pub.tick()   # tick() republishes for late joiners
    sub = VersionSubscriber(node); sub.poll(0.1)               # newest version seen, or None

A client made with `wait_restarting=True` keeps trying past its last retry while the
supervisor says the service is being restarted (core/liveness.py).

Retries are idempotent: a request keeps its id across attempts and the server replays the
cached reply of an id it has already answered instead of running the handler twice; a retry of
an id still being worked on (DEFERRED) is answered, when the answer comes, on the socket that
asked last. The cache is bounded by count and by bytes, so large replies cannot grow it
without limit. Each retry uses a fresh socket and re-reads the endpoint file, so a restarted
server (new port, new instance) is found. A handler exception becomes an "error" reply
(RemoteError on the client); malformed requests are dropped with a log line; the server never
dies of input.

Every server here receives through `Router`: a bound ROUTER socket and the one receive loop
(wait on it and on extra file descriptors, then take every message waiting).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from hpcrl.core.liveness import peer_starting
from hpcrl.core.transport import Node, TransportError, read_endpoint
from hpcrl.core.wire import BadMessage, Envelope, decode, encode, send_frames

__all__ = [
    "Reply",
    "DEFERRED",
    "Router",
    "RequestServer",
    "RequestClient",
    "PendingRequest",
    "RequestTimeout",
    "RemoteError",
    "VersionPublisher",
    "VersionSubscriber",
]

log = logging.getLogger("hpcrl.transport")
POLICY_TOPIC = b"policy"


class RequestTimeout(TransportError):
    """No reply after every attempt; the message names the service, address and what to check."""


class RemoteError(TransportError):
    """The server's handler raised; the message carries its error text."""


@dataclass(frozen=True)
class Reply:
    kind: str
    body: Any = None
    arrays: Sequence[np.ndarray] = field(default_factory=tuple)
    remember: bool = True  # False: not replayed to a retry (e.g. "busy": a retry should try again)


DEFERRED = object()  # a handler's answer "later": RequestServer.reply(msg_id, Reply) sends it


class Router:
    """A bound ROUTER socket and the one receive loop of every server here.

    `poll_once(timeout_s)` waits up to `timeout_s` for a message (or for one of the `also` file
    descriptors, e.g. a wake-up pipe, to become readable), then hands every message waiting to
    `on_message(peer, frames)` and returns how many there were and which `also` fds were ready.
    """

    def __init__(self, node: Node, service: str, on_message: Callable[[bytes, list], None], also: Sequence[int] = ()):
        self.node = node
        self.on_message = on_message
        self.sock, self.endpoint = node.bind(zmq.ROUTER, service)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        for fd in also:
            self._poller.register(fd, zmq.POLLIN)

    def poll_once(self, timeout_s: float) -> tuple[int, set[int]]:
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        n = 0
        if self.sock in ready:
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.on_message(frames[0].bytes, frames[1:])
                n += 1
        self.node.log_events()
        return n, {fd for fd in ready if fd is not self.sock}

    def send(self, peer: bytes, frames: Sequence[Any], flags: int = 0) -> None:
        send_frames(self.sock, [peer, *frames], flags)

    def close(self) -> None:
        self.sock.close(0)


def _nbytes(frames: Sequence[Any]) -> int:
    return sum(f.nbytes if isinstance(f, (np.ndarray, memoryview)) else len(f) for f in frames)


class RequestServer:
    """ROUTER-based request server; `handler(Envelope) -> Reply | DEFERRED` runs in the serving thread."""

    def __init__(
        self,
        node: Node,
        service: str,
        handler: Callable[[Envelope], Any],
        *,
        replay_cache: int = 4096,
        replay_cache_bytes: int = 64 << 20,
        also: Sequence[int] = (),
    ):
        self.node = node
        self.handler = handler
        self.router = Router(node, service, self._on_message, also)
        self.sock, self.endpoint = self.router.sock, self.router.endpoint
        self._replies: OrderedDict[str, list] = OrderedDict()
        self._replies_bytes = 0
        self._replay_cache, self._replay_cache_bytes = replay_cache, replay_cache_bytes
        self._inflight: dict[str, bytes] = {}  # deferred request id -> routing id of the socket that asked last
        self.served = self.replayed = self.dropped = 0

    def poll_once(self, timeout_s: float = 0.1) -> int:
        """Serve every request that arrives within `timeout_s`; returns how many were handled."""
        return self.router.poll_once(timeout_s)[0]

    def _on_message(self, peer: bytes, frames: list) -> None:
        try:
            env = decode(frames, self.node.limits)
            if not env.msg_id:
                raise BadMessage("request without an id")
        except BadMessage as exc:
            self.dropped += 1
            log.warning("%s: dropped a request: %s", self.endpoint.service, exc)
            return
        rid = env.msg_id
        cached = self._replies.get(rid)
        if cached is not None:
            self.replayed += 1
            self.router.send(peer, cached)
            return
        if rid in self._inflight:
            self._inflight[rid] = peer  # a retry on a fresh socket: answer there
            return
        try:
            reply = self.handler(env)
            if reply is DEFERRED:
                self._inflight[rid] = peer
                return
            if not isinstance(reply, Reply):
                raise TypeError(f"handler returned {type(reply).__name__}, expected Reply")
        except Exception as exc:  # a handler bug must not take the server down
            log.exception("%s: handler failed on %r", self.endpoint.service, env.kind)
            reply = Reply("error", {"message": f"{type(exc).__name__}: {exc}"})
        self._finish(rid, peer, reply)

    def reply(self, rid: str, reply: Reply) -> None:
        """The answer to a request whose handler returned DEFERRED (call from the serving thread)."""
        self._finish(rid, self._inflight.pop(rid, None), reply)

    def _finish(self, rid: str, peer: bytes | None, reply: Reply) -> None:
        out = encode(reply.kind, reply.body, reply.arrays, msg_id=rid)
        if reply.remember:
            self._remember(rid, out)
            self.served += 1
        if peer is not None:
            self.router.send(peer, out)

    def _remember(self, rid: str, frames: list) -> None:
        size = _nbytes(frames)
        if size > self._replay_cache_bytes:
            return  # too big to keep: a retry of it runs again
        self._replies[rid] = frames
        self._replies_bytes += size
        while len(self._replies) > self._replay_cache or self._replies_bytes > self._replay_cache_bytes:
            _, old = self._replies.popitem(last=False)
            self._replies_bytes -= _nbytes(old)

    def serve(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        while not stop.is_set():
            self.poll_once(poll_s)

    def close(self) -> None:
        self.router.close()


class RequestClient:
    """DEALER-based request client with per-attempt timeout and retries (a socket per attempt)."""

    def __init__(
        self,
        node: Node,
        service: str,
        *,
        timeout_s: float = 5.0,
        retries: int = 2,
        discover_timeout_s: float = 30.0,
        wait_restarting: bool = False,
    ):
        self.node = node
        self.service = service
        # True: past the last retry, keep trying while the supervisor says the service is being
        # restarted (core/liveness.py) instead of raising RequestTimeout.
        self.wait_restarting = wait_restarting
        self.timeout_s = timeout_s
        self.retries = retries
        self.discover_timeout_s = discover_timeout_s
        self._sock: zmq.Socket | None = None
        self._ep = None
        self._pending: PendingRequest | None = None

    def _socket(self, fresh: bool) -> zmq.Socket:
        if fresh and self._sock is not None:
            self._sock.close(0)  # drop whatever the old connection still queues
            self._sock = None
        if self._sock is None:
            ep = read_endpoint(self.node.run_dir, self.service, self.discover_timeout_s)
            self._sock, self._ep = self.node.connect(zmq.DEALER, ep)
        return self._sock

    def request(
        self,
        kind: str,
        body: Any = None,
        arrays: Sequence[np.ndarray] = (),
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Envelope:
        """Send and wait for the reply (retrying per attempt timeout); RequestTimeout / RemoteError."""
        pending = self.start(kind, body, arrays, timeout_s=timeout_s, retries=retries)
        while True:
            env = pending.poll(3600.0)
            if env is not None:
                return env

    def start(
        self,
        kind: str,
        body: Any = None,
        arrays: Sequence[np.ndarray] = (),
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> PendingRequest:
        """Send without waiting: the caller goes on with its work and polls the returned request
        (one outstanding request per client: its socket is shared)."""
        if self._pending is not None and not self._pending.settled:
            raise RuntimeError(f"{self.service}: a request ({self._pending.kind!r}) is still outstanding")
        rid = os.urandom(12).hex()
        self._pending = PendingRequest(
            self,
            kind,
            rid,
            encode(kind, body, arrays, msg_id=rid),
            self.timeout_s if timeout_s is None else timeout_s,
            self.retries if retries is None else retries,
        )
        return self._pending

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None


class PendingRequest:
    """A request in flight (RequestClient.start): `poll(wait_s)` gives the reply once it is there.

    Same guarantees as `request()`: the id stays across attempts (the server replays its cached
    reply), each retry uses a fresh socket and re-reads the endpoint, and after the last attempt
    `poll` raises RequestTimeout.
    """

    def __init__(self, client: RequestClient, kind: str, rid: str, frames: list, timeout_s: float, retries: int):
        self.client, self.kind, self.rid, self.frames = client, kind, rid, frames
        self.timeout_s, self.retries = timeout_s, retries
        self.attempt = 0
        self.settled = False
        self._waiting_logged = -math.inf
        self._waited = False  # it waited for a restarting service: a fresh round of retries once it is back
        self._send()

    def _send(self) -> None:
        self._sock = self.client._socket(fresh=self.attempt > 0)
        send_frames(self._sock, self.frames)
        self.deadline = time.monotonic() + self.timeout_s

    def poll(self, wait_s: float = 0.0) -> Envelope | None:
        """The reply, if it arrives within `wait_s` (0: only look); None otherwise."""
        if self.settled:
            raise RuntimeError(f"{self.client.service}: the reply to {self.kind!r} was already taken")
        end = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                if (
                    self.attempt >= self.retries
                    and self.client.wait_restarting
                    and peer_starting(self.client.node.run_dir, self.client.service)
                ):
                    # The supervisor is restarting the service (its job may wait in the queue for
                    # long): keep trying with the same id instead of failing this client too.
                    if now - self._waiting_logged >= 60.0:
                        log.warning("%s is being restarted; waiting for it (%r)", self.client.service, self.kind)
                        self._waiting_logged = now
                    self._waited = True
                    self._send()
                    continue
                if self._waited and self.attempt >= self.retries:
                    # Back from its restart: it gets every retry afresh (the last send may have
                    # gone to the old address before the new instance published its endpoint).
                    self._waited = False
                    self.attempt = 0
                if self.attempt >= self.retries:
                    self.settled = True
                    address = self.client._ep.address if self.client._ep else "?"
                    raise RequestTimeout(
                        f"{self.client.service} at {address}: no reply to {self.kind!r} after {self.retries + 1} "
                        f"attempt(s) of {self.timeout_s:.1f} s; is the service running, and does "
                        f"endpoints/{self.client.service}.json name it?"
                    )
                log.info(
                    "%s: no reply to %r within %.1f s (attempt %d/%d); retrying",
                    self.client.service,
                    self.kind,
                    self.timeout_s,
                    self.attempt + 1,
                    self.retries + 1,
                )
                self.attempt += 1
                self._send()
                continue
            if self._sock.poll(max(0, math.ceil((min(end, self.deadline) - now) * 1000))):
                env = self._receive()
                if env is not None:
                    return env
            elif time.monotonic() >= end:
                return None

    def _receive(self) -> Envelope | None:
        try:
            env = decode(self._sock.recv_multipart(copy=False), self.client.node.limits)
        except BadMessage as exc:
            log.warning("%s: dropped a malformed reply: %s", self.client.service, exc)
            return None
        if env.msg_id != self.rid:
            return None  # a late reply to an earlier request
        self.settled = True
        if env.kind == "error":
            raise RemoteError(f"{self.client.service} failed on {self.kind!r}: {(env.body or {}).get('message')}")
        return env


class VersionPublisher:
    """PUB socket announcing the learner's policy version; republishes for late subscribers."""

    def __init__(self, node: Node, service: str = "policy", republish_s: float = 1.0):
        self.sock, self.endpoint = node.bind(zmq.PUB, service)
        self.node = node
        self.republish_s = republish_s
        self.version: int | None = None
        self._info: dict = {}
        self._sent_at = 0.0

    def publish(self, version: int, info: dict | None = None) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"policy version must be an int >= 0 (got {version!r})")
        self.version, self._info = version, dict(info or {})
        self._send()

    def _send(self) -> None:
        frames = encode("policy_version", {"version": self.version, **self._info})
        try:
            send_frames(self.sock, [POLICY_TOPIC, *frames], zmq.NOBLOCK)
        except zmq.Again:
            pass  # PUB drops for slow subscribers anyway; the next tick repeats the version
        self._sent_at = time.monotonic()

    def tick(self) -> None:
        """Call periodically: repeats the current version every `republish_s` (SUB joins late)."""
        self.node.log_events()
        if self.version is not None and time.monotonic() - self._sent_at >= self.republish_s:
            self._send()


class VersionSubscriber:
    """SUB socket tracking the newest policy version announced."""

    def __init__(self, node: Node, service: str = "policy", discover_timeout_s: float = 30.0):
        self.node = node
        self.sock, self.endpoint = node.connect(zmq.SUB, service, discover_timeout_s)
        self.sock.subscribe(POLICY_TOPIC)
        self.version: int | None = None
        self.info: dict = {}

    def poll(self, timeout_s: float = 0.0) -> int | None:
        """Drain announcements (waiting up to `timeout_s` for the first); the newest version."""
        wait_ms = int(timeout_s * 1000)
        while self.sock.poll(wait_ms):
            wait_ms = 0
            frames = self.sock.recv_multipart(copy=False)
            try:
                env = decode(frames[1:], self.node.limits)
                version = env.body["version"]
                if env.kind != "policy_version" or isinstance(version, bool) or not isinstance(version, int):
                    raise BadMessage(f"not a policy version announcement ({env.kind!r})")
            except (BadMessage, KeyError, TypeError) as exc:
                log.warning("policy subscriber: dropped a message: %s", exc)
                continue
            if self.version is None or version >= self.version:
                self.version, self.info = version, env.body
        return self.version

    def wait_for(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while (self.version is None or self.version < version) and time.monotonic() < deadline:
            self.poll(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.version is not None and self.version >= version
