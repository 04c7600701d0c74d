"""Acknowledged, lossless, deduplicated delivery of trajectories to the shard writer.

    # generator side
    sender = TrajectorySender(node, "store")
    sender.send(traj)              # kept until acknowledged; never blocks longer than block_s
    sender.pump()                  # call often: reads acks, resends what is due
    sender.wait_acked(timeout_s=60)

    # writer side (the store component, hpcrl.jobs.components.StoreComponent)
    receiver = TrajectoryReceiver(node, "store", ShardWriter(store, "store-0", cfg.store))
    receiver.serve(stop_event)     # or receiver.poll_once(timeout_s) in your own loop

PUSH/PULL cannot carry acknowledgements back, so the sender is a DEALER with a fixed routing
id and the writer a ROUTER (with ZMQ_ROUTER_HANDOVER, so a reconnecting sender keeps its
slot). Trajectories travel in batches (message kind "trajs"): a batch is its `Columns`, the
layout a shard segment stores, so the writer checks it in bulk and buffers it as it came,
never rebuilding one Python object per trajectory. Every acknowledgement and rejection
names trajectory ids.

Guarantees:
* The writer acknowledges an id only after the flush that stored it returned, i.e. the
  segment is fsynced under its final name; a duplicate of a stored id is acknowledged at once.
* The sender keeps every unacknowledged trajectory. It resends all of them when the writer's
  endpoint file shows a new instance (writer restarted), and any one that waited
  `resend_after_s` (lost in a dead connection). Resends are harmless: the writer drops an id
  it has stored or buffered (its dedup index is rebuilt from disk on restart).
* A writer that stopped for good (WriterStopped: it lost its shard to a newer writer, or cannot
  prove what is durable) ends `serve()` with that exception: the service exits, its senders
  resend to the writer that replaces it.
* A trajectory the writer cannot accept (fails validation) is answered with "reject" and the
  reason; the sender logs it and stops resending it (`rejected`). A batch whose framing is
  broken is rejected whole, by the ids it names: resending it could only fail again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

import zmq

from hpcrl.core.liveness import beat, peer_starting
from hpcrl.core.rpc import Router
from hpcrl.core.transport import Node, TransportError, read_endpoint
from hpcrl.core.wire import BadMessage, decode, encode, send_frames
from hpcrl.rl.record.columns import Columns, ColumnsError, wire_bytes
from hpcrl.rl.record.trajectory import Trajectory
from hpcrl.rl.store.layout import WriterStopped

__all__ = ["TrajectorySender", "TrajectoryReceiver", "TrajectorySink"]

log = logging.getLogger("hpcrl.transport")


class TrajectorySink(Protocol):
    """What the receiver stores into: the ShardWriter's interface."""

    def append_columns(self, cols: Columns): ...  # -> FlushResult | None (has .ids)
    def poll(self): ...
    def seconds_to_flush(self) -> float | None: ...
    def stored_mask(self, ids: list[str]) -> list[bool]: ...  # which of ids are stored
    def is_pending(self, traj_id: str) -> bool: ...
    def close(self): ...


class TrajectorySender:
    """Acknowledged, resending delivery of trajectories to the store writer.

    Trajectories travel in batches ("trajs": up to `batch_max` of them or `batch_bytes`, one
    message of four frames): CURVE boxes, send calls and receive calls are paid per frame, and
    at a few tens of kB per trajectory those per-frame costs, not the bytes, set the pace. A
    batch that is not full leaves once its oldest trajectory waited `linger_s`, at the next
    send() or pump(); wait_acked() and flush() send at once.

    `on_settled(traj_id, stored, reason)` is called once per trajectory when the writer answers:
    `stored=True` once it is flushed to disk, `stored=False` with the writer's reason when it
    was rejected. A caller that must not report work as done before it is durable (the
    generator's episode bookkeeping) hangs off this instead of polling the sender.
    """

    def __init__(
        self,
        node: Node,
        service: str = "store",
        *,
        max_unacked: int = 4096,
        resend_after_s: float = 15.0,
        block_s: float = 60.0,
        discover_timeout_s: float = 60.0,
        batch_max: int = 128,
        batch_bytes: int = 1 << 20,
        linger_s: float = 0.005,
        on_settled: Callable[[str, bool, str], None] | None = None,
    ):
        if batch_max < 1 or batch_bytes < 1 or linger_s < 0:
            raise ValueError(
                f"batch_max and batch_bytes must be >= 1 and linger_s >= 0 (got {batch_max}, {batch_bytes}, {linger_s})"
            )
        self.node = node
        self.on_settled = on_settled
        self.service = service
        self.max_unacked = max_unacked
        self.resend_after_s = resend_after_s
        self.block_s = block_s
        self.batch_max, self.batch_bytes, self.linger_s = batch_max, batch_bytes, linger_s
        self.routing_id = f"{node.name}.{os.urandom(4).hex()}".encode()
        # Every unacknowledged id -> the trajectory and its size on the wire in bytes.
        self._wire: dict[str, tuple[Trajectory, int]] = {}
        self._sent_at: OrderedDict[str, float] = OrderedDict()  # sent ids, oldest send first
        self._unsent: deque[tuple[str, int]] = deque()  # (id, bytes) waiting for a send (new, or due again)
        self._unsent_bytes = 0
        self._unsent_since = 0.0  # when the oldest id in _unsent was queued
        self._sock, self._ep = node.connect(zmq.DEALER, service, discover_timeout_s, routing_id=self.routing_id)
        self._checked_at = time.monotonic()
        self.sent = self.resent = self.acked = self.batches = 0
        self.rejected: list[tuple[str, str]] = []

    @property
    def unacked(self) -> int:
        return len(self._wire)

    def send(self, traj: Trajectory) -> None:
        """Queue one trajectory and send what is due; blocks (pumping acks) while `max_unacked` are in flight."""
        deadline = time.monotonic() + self.block_s
        while len(self._wire) >= self.max_unacked:
            if time.monotonic() >= deadline:
                if peer_starting(self.node.run_dir, self.service):
                    # The supervisor is restarting the writer: wait for it, however long its job queues.
                    log.warning("%s: %s is being restarted; waiting for it", self.node.name, self.service)
                    deadline = time.monotonic() + self.block_s
                    continue
                raise TransportError(
                    f"{len(self._wire)} trajectories unacknowledged by {self.service!r} for "
                    f"{self.block_s:.0f} s; is the store writer running?"
                )
            self.pump(0.05)
        tid = traj.id
        self._wire[tid] = (traj, wire_bytes(traj))  # encoded when its batch leaves
        self._queue(tid)
        self.sent += 1
        self._send_due()

    def flush(self) -> None:
        """Send every queued trajectory now, full batch or not (as far as the socket takes them)."""
        self._send_due(force=True)

    def _queue(self, tid: str) -> None:
        if not self._unsent:
            self._unsent_since = time.monotonic()
        size = self._wire[tid][1]
        self._unsent.append((tid, size))
        self._unsent_bytes += size

    def _send_due(self, force: bool = False) -> None:
        """Send queued ids in order, batch by batch, until the socket pushes back (no peer yet, or
        HWM) or what is left is a partial batch younger than `linger_s`."""
        while self._unsent:
            # Cheap test first: this runs once per send() and pump().
            if not (
                force
                or len(self._unsent) >= self.batch_max
                or self._unsent_bytes >= self.batch_bytes
                or time.monotonic() - self._unsent_since >= self.linger_s
            ):
                return
            batch: list[str] = []
            size = taken = 0
            for tid, n in self._unsent:
                if tid in self._wire:  # acknowledged meanwhile: dropped with this batch
                    if batch and (len(batch) >= self.batch_max or size + n > self.batch_bytes):
                        break
                    batch.append(tid)
                    size += n
                taken += 1
            if batch:
                body, arrays = Columns.encode([self._wire[t][0] for t in batch]).to_wire()
                try:
                    send_frames(self._sock, encode("trajs", body, arrays), zmq.NOBLOCK)
                except zmq.Again:
                    return  # pump() retries
                self.batches += 1
            now = time.monotonic()
            for _ in range(taken):
                self._unsent_bytes -= self._unsent.popleft()[1]
            for tid in batch:
                self._sent_at[tid] = now
                self._sent_at.move_to_end(tid)
            self._unsent_since = now  # what is left starts its own wait

    def pump(self, timeout_s: float = 0.0) -> int:
        """Read acks (waiting up to `timeout_s` for the first), resend what is due; returns #acked."""
        n = 0
        wait_ms = int(timeout_s * 1000)
        while self._sock.poll(wait_ms):
            wait_ms = 0
            n += self._on_reply(self._sock.recv_multipart(copy=False))
        now = time.monotonic()
        if self._wire and now - self._checked_at >= 0.5:
            self._checked_at = now
            self._check_endpoint()
        # Oldest send first, so the scan stops at the first one that is not due.
        while self._sent_at:
            tid, sent_at = next(iter(self._sent_at.items()))
            if now - sent_at < self.resend_after_s:
                break
            del self._sent_at[tid]
            self._queue(tid)
            self.resent += 1
        self._send_due()
        return n

    def _on_reply(self, frames: list) -> int:
        try:
            env = decode(frames, self.node.limits)
            ids = env.body["ids"]
            if env.kind not in ("ack", "reject") or not isinstance(ids, list):
                raise BadMessage(f"unexpected reply kind {env.kind!r}")
        except (BadMessage, KeyError, TypeError) as exc:
            log.warning("%s: dropped a malformed reply from the writer: %s", self.service, exc)
            return 0
        n = 0
        for tid in ids:
            if type(tid) is str and self._wire.pop(tid, None) is not None:
                self._sent_at.pop(tid, None)
                n += 1
                reason = ""
                if env.kind == "reject":
                    reason = str(env.body.get("reason", ""))
                    self.rejected.append((tid, reason))
                    log.error("%s rejected trajectory %s: %s", self.service, tid, reason)
                if self.on_settled is not None:
                    self.on_settled(tid, env.kind == "ack", reason)
        if env.kind == "ack":
            self.acked += n
        return n

    def _check_endpoint(self) -> None:
        try:
            ep = read_endpoint(self.node.run_dir, self.service)
        except TransportError:
            return
        if ep.instance != self._ep.instance or ep.address != self._ep.address:
            log.info(
                "%s restarted (%s -> %s); reconnecting and resending %d unacknowledged trajectories",
                self.service,
                self._ep.address,
                ep.address,
                len(self._wire),
            )
            self._sock.close(0)
            self._sock, self._ep = self.node.connect(zmq.DEALER, ep, routing_id=self.routing_id)
            self.resent += len(self._sent_at)
            self._sent_at.clear()
            self._unsent.clear()
            self._unsent_bytes = 0
            for tid in self._wire:  # everything, in the original order
                self._queue(tid)

    def wait_acked(self, timeout_s: float) -> bool:
        """Pump until nothing is unacknowledged (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self._wire and time.monotonic() < deadline:
            self.flush()  # nothing more is coming: no batch waits for company
            self.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        return not self._wire

    def close(self) -> None:
        if self._wire:
            log.warning("%s: closing with %d unacknowledged trajectories", self.service, len(self._wire))
        self._sock.close(0)


class TrajectoryReceiver:
    def __init__(self, node: Node, service: str, sink: TrajectorySink):
        self.node = node
        self.sink = sink
        self.router = Router(node, service, self._receive)
        self.sock, self.endpoint = self.router.sock, self.router.endpoint
        self._waiting: dict[str, bytes] = {}  # buffered id -> routing id to acknowledge
        self.received = self.duplicates = self.dropped = 0

    def poll_once(self, timeout_s: float = 0.1) -> int:
        """Receive what arrives within `timeout_s` (shorter if a flush falls due); returns #messages."""
        due = self.sink.seconds_to_flush()
        n, _ = self.router.poll_once(timeout_s if due is None else min(timeout_s, due))
        self._acknowledge(self._store(self.sink.poll))
        return n

    def _store(self, fn, *args):
        try:
            return fn(*args)
        except WriterStopped:
            raise  # for good: the service must end, its successor recovers the shard
        except Exception as exc:  # e.g. disk full: nothing is acked, senders resend
            log.error("%s: storing failed, nothing acknowledged, will retry: %s", self.endpoint.service, exc)
            return None

    def _receive(self, peer: bytes, frames: list) -> None:
        try:
            env = decode(frames, self.node.limits)
            if env.kind != "trajs":
                raise BadMessage(f"unexpected kind {env.kind!r}")
        except BadMessage as exc:
            self.dropped += 1
            log.warning("%s: dropped a message from %r: %s", self.endpoint.service, peer[:32], exc)
            return
        try:
            cols = Columns.from_wire(env.body, env.arrays)
        except ColumnsError as exc:
            ids = env.body.get("ids") if isinstance(env.body, dict) else None
            ids = [i for i in ids if type(i) is str] if isinstance(ids, list) else []
            self.dropped += max(1, len(ids))
            log.warning("%s: rejected a batch of %d from %r: %s", self.endpoint.service, len(ids), peer[:32], exc)
            if ids:  # named, so its sender stops resending what can never be stored
                self._send(peer, "reject", {"ids": ids, "reason": f"broken batch: {exc}"})
            return
        ids, take = env.body["ids"], []
        stored = self.sink.stored_mask(list(ids))
        for i, (tid, error) in enumerate(zip(ids, cols.row_errors())):
            if error is not None:
                self.dropped += 1
                log.warning("%s: rejected trajectory %s from %r: %s", self.endpoint.service, tid, peer[:32], error)
                self._send(peer, "reject", {"ids": [tid], "reason": error})
                continue
            self.received += 1
            if stored[i]:
                self.duplicates += 1
                self._send(peer, "ack", {"ids": [tid]})
                continue
            if self.sink.is_pending(tid):
                self.duplicates += 1
            else:
                take.append(i)
            self._waiting[tid] = peer  # the newest connection of the sender gets the ack
        if take:
            self._acknowledge(
                self._store(self.sink.append_columns, cols if len(take) == cols.rows else cols.take(take))
            )

    def _acknowledge(self, flushed) -> None:
        if not flushed:
            return
        by_peer: dict[bytes, list[str]] = {}
        for tid in flushed.ids:
            peer = self._waiting.pop(tid, None)
            if peer is not None:
                by_peer.setdefault(peer, []).append(tid)
        for peer, ids in by_peer.items():
            self._send(peer, "ack", {"ids": ids})

    def _send(self, peer: bytes, kind: str, body: dict) -> None:
        try:
            self.router.send(peer, encode(kind, body), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will resend and be acked then
            log.info("%s: could not send %s to %r: %s", self.endpoint.service, kind, peer[:32], exc)

    def serve(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        """Serve until `stop` is set, then flush and finalize the sink, acknowledging the rest."""
        while not stop.is_set():
            beat()
            self.poll_once(poll_s)
        self._acknowledge(self.sink.close())
