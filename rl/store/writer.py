"""The trajectory shard writer: buffer, flush by count, age or a pause in the input, acknowledge only what is durable.

    from hpcrl.rl.store.writer import ShardWriter
    with ShardWriter(run_dir / "trajectories", writer="store-0", cfg=cfg.store) as w:
        for traj in trajectories:
            flushed = w.append(traj)          # FlushResult: segments that became durable since the last call
            if flushed:
                ack(flushed.ids)              # these ids are on disk, fsynced, under final names
        w.append_columns(cols)                # a batch as it came off the wire (hpcrl.rl.store.stream)
        ...
        w.poll()                              # call when idle: flushes what is due (age, or input paused)
        w.flush()                             # write the buffer and wait until all of it is durable

A flush writes one immutable HDF5 segment (see `hpcrl.rl.store.layout` for why and for the crash
argument); `FlushResult.ids` are exactly the trajectories that became durable. Nothing in
`append` is durable until a FlushResult names it.

Pipelining: the caller's thread only encodes (loose trajectories into pooled buffers; batches
from the wire stay as they came) and hands each segment over; the sync thread
(`hpcrl.rl.store.sync`) writes it (HDF5 structure, the arrays straight from the batches,
checksums: `hpcrl.rl.store.segment`), fsyncs, renames, fsyncs the directory and checks the
fence, at most `MAX_INFLIGHT` segments at a time, visible strictly in sequence order. A
FlushResult (the acknowledgement) names only segments whose rename and directory fsync
completed, in a shard not fenced. `append`/`poll` return what completed since the last call
(several segments merged into one FlushResult), `flush()`/`close()` wait for all.

Failures: one before a rename takes the batches back into the buffer (nothing acknowledged,
nothing lost; StoreError, the next call retries, under new sequence numbers: a number names
at most one file, ever). A full disk or an HDF5 error never leaves a .tmp behind or the
writer without a shard; a manifest that cannot be written is retried. A visible segment not
proven durable (the directory fsync failed) or a fenced shard stops the writer for good
(WriterStopped on every call): it hands its shard over, a new writer recovers it.

On start the writer recovers the shards that an earlier, dead process with the same writer
name left open (`recover_shard`: fence, verify, finalize), and opens the ids already stored
under that name (each finalized shard's index, `hpcrl.rl.store.index`, searched in place: no
segment is read, so a restart costs the same early and late in a run), so a sender that resends
after a crash cannot create duplicates: `append` drops a trajectory whose id is stored or
buffered (`duplicates` counts them). A shard's index is written before its manifest; the ids
of the open shard are kept in memory until then. Two live
writers must not share a name: on the same host the pid in the shard name tells, across
hosts the OWNER.json heartbeat (refreshed at each flush and at least every lease/3 seconds;
`store.lease_s`); one silent past its lease is fenced (`hpcrl.rl.store.layout`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from hpcrl.core.config import StoreConfig
from hpcrl.rl.record.columns import Columns
from hpcrl.rl.record.flat import EncodeBuffers
from hpcrl.rl.record.trajectory import Trajectory
from hpcrl.rl.store.index import IndexPart, index_part
from hpcrl.rl.store.layout import (
    WRITER_NAME_RE,
    SegmentInfo,
    StoreError,
    WriterStopped,
    is_fenced,
    segment_name,
)
from hpcrl.rl.store.lease import StoredIds, owner_alive, release_shard, take_over
from hpcrl.rl.store.shards import ShardLifecycle
from hpcrl.rl.store.sync import MAX_INFLIGHT, Fenced, InFlight, SyncThread, Unproven

__all__ = ["ShardWriter", "FlushResult", "WriterStopped", "owner_alive"]

log = logging.getLogger("hpcrl.store")


@dataclass(frozen=True)
class FlushResult:
    """Durable flushes: these ids are on disk (fsynced, final names) and may be acknowledged."""

    segments: tuple[str, ...]  # "shard/segment" of each segment that became durable
    ids: tuple[str, ...]
    bytes: int
    total_rows: int  # acknowledged by this writer since it started

    @property
    def rows(self) -> int:
        return len(self.ids)


class ShardWriter(ShardLifecycle):
    """Writes one writer's shards under `store`; see the module docstring for the protocol."""

    def __init__(self, store: str | os.PathLike, writer: str, cfg: StoreConfig | None = None, *, dedup: bool = True):
        if not isinstance(writer, str) or not WRITER_NAME_RE.fullmatch(writer):
            raise StoreError(f"writer name {writer!r}: use 1-64 letters, digits, '_' or '-' (no dots), e.g. store-0")
        self.store = Path(store)
        self.writer = writer
        self.cfg = cfg or StoreConfig()
        self.lease_s = self.cfg.lease_s
        try:
            self.store.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.store}: {exc.strerror}") from None
        self.recovered = self._recover_previous()
        self._stored: StoredIds | None = StoredIds.load(self.store, self.writer) if dedup else None
        # The buffer, in arrival order: batches already in column form, then loose trajectories,
        # which are encoded together when the next batch arrives or at the flush.
        self._chunks: list[Columns] = []
        self._loose: list[Trajectory] = []
        self._buffered = 0
        # Encode buffers not in use: one is busy from a flush's encode until its segment is
        # filled on the sync thread, so up to MAX_INFLIGHT + 1 exist.
        self._free_bufs: deque[EncodeBuffers] = deque()  # the sync thread gives them back
        self._pending: set[str] = set()  # ids buffered or in flight: not durable yet
        self._oldest: float | None = None  # monotonic arrival time of the oldest buffered record
        self._newest = 0.0  # ... and of the newest
        self._shard: Path | None = None
        self._segments: list[SegmentInfo] = []  # durable segments of the open shard
        self._parts: list[IndexPart] = []  # ... and their index entries (hpcrl.rl.store.index)
        self._shard_rows = 0  # rows written to the open shard, durable or in flight
        self._seq = 0
        self._inflight: deque[InFlight] = deque()
        self._done: list[InFlight] = []  # synced, not yet reported in a FlushResult
        self._sync = SyncThread(f"hpcrl-store-{writer}")
        self._last_beat = 0.0
        self.total_rows = 0
        self.duplicates = 0
        self.closed = False
        self._stopped: str | None = None  # why the writer stopped for good (WriterStopped)
        # Shards whose segments are all durable, waiting for their manifest (retried on failure).
        self._unfinalized: list[tuple[Path, list[SegmentInfo], list[IndexPart]]] = []
        # Opened now, not at the first flush: from this moment the name is visibly in use.
        self._open_shard()

    # -- start-up ---------------------------------------------------------------------------

    def _recover_previous(self) -> list:
        return take_over(self.store, self.writer, self.lease_s)

    # -- appending --------------------------------------------------------------------------

    def is_stored(self, traj_id: str) -> bool:
        return self._stored is not None and traj_id in self._stored

    def stored_mask(self, ids: list[str]) -> list[bool]:
        """is_stored for many ids at once (one search of each shard index per batch)."""
        if self._stored is None or not ids:
            return [False] * len(ids)
        return self._stored.mask(ids).tolist()

    def is_pending(self, traj_id: str) -> bool:
        return traj_id in self._pending

    @property
    def buffered(self) -> int:
        return self._buffered

    def _usable(self) -> None:
        if self._stopped:
            raise WriterStopped(f"writer {self.writer!r} stopped: {self._stopped}")
        if self.closed:
            raise StoreError(f"writer {self.writer!r} is closed")

    def append(self, traj: Trajectory) -> FlushResult | None:
        """Buffer one trajectory; flush if the count or age bound is reached. Returns what became durable."""
        self._usable()
        if not isinstance(traj, Trajectory):
            raise TypeError(f"append() takes a Trajectory (got {type(traj).__name__})")
        tid = traj.id
        if tid in self._pending or self.is_stored(tid):
            self.duplicates += 1
            return None
        self._loose.append(traj)
        self._pending.add(tid)
        return self._added(1)

    def append_columns(self, cols: Columns) -> FlushResult | None:
        """Buffer a batch of trajectories in column form (checked: `Columns.row_errors` found
        nothing); rows whose id is stored or buffered are dropped. Returns what became durable."""
        self._usable()
        ids = cols.ids()
        stored = self.stored_mask(ids)
        keep = [i for i, tid in enumerate(ids) if tid not in self._pending and not stored[i]]
        self.duplicates += len(ids) - len(keep)
        if not keep:
            return None
        if len(keep) < len(ids):
            cols, ids = cols.take(keep), [ids[i] for i in keep]
        if len(set(ids)) < len(ids):  # one id twice within the batch: keep the first
            seen: set[str] = set()
            first = [i for i, tid in enumerate(ids) if not (tid in seen or seen.add(tid))]
            self.duplicates += len(ids) - len(first)
            cols, ids = cols.take(first), [ids[i] for i in first]
        self._encode_loose()
        self._chunks.append(cols)
        self._pending.update(ids)
        return self._added(len(ids))

    def _encode_loose(self) -> None:
        if self._loose:
            self._chunks.append(Columns.encode(self._loose))
            self._loose = []

    def _added(self, n: int) -> FlushResult | None:
        self._buffered += n
        self._newest = time.monotonic()
        if self._oldest is None:
            self._oldest = self._newest
        if self._buffered >= self.cfg.flush_every or self._flush_wait() == 0.0:
            self._submit()
        # Most appends only buffer: skip the pipeline bookkeeping while no sync has finished.
        if self._done or (self._inflight and self._inflight[0].settled):
            return self._collect(block=False)
        return None

    def seconds_to_flush(self) -> float | None:
        """Seconds until `poll` has work: a due flush or a sync to collect (None: idle)."""
        if self._inflight:
            return 0.002
        return self._flush_wait()

    def _flush_wait(self) -> float | None:
        """Seconds until the buffer is due (its age, or a pause in the input); None: empty."""
        if self._oldest is None:
            return None
        now = time.monotonic()
        by_age = self.cfg.flush_interval_s - (now - self._oldest)
        return max(0.0, min(by_age, self.cfg.flush_idle_s - (now - self._newest)))

    def poll(self) -> FlushResult | None:
        """Flush if the buffer is due (flush_interval_s old, or no input for flush_idle_s), also
        while an earlier segment is still syncing; return what became durable."""
        if self.closed and not self._stopped:
            return None
        self._usable()
        if time.monotonic() - self._last_beat > self.lease_s / 3:
            # Idle or not, a writer that lost its shard learns it within lease/3: it stops, so
            # its senders turn to the writer that replaced it.
            if self._shard is not None and is_fenced(self._shard):
                self._fenced(self._shard)
            self._heartbeat()
        if self._flush_wait() == 0.0:
            # Old enough, or the stream paused: the learner may be waiting for exactly these
            # (the last trajectories of its batch); holding them for company stalled the
            # pipeline by ~0.3 s per step (measured with bench/timeline.py).
            self._submit()
        return self._collect(block=False)

    def flush(self) -> FlushResult | None:
        """Write the buffer and wait until everything written is durable; return what became so.
        On StoreError nothing is in flight any more (what failed is back in the buffer)."""
        self._usable()
        try:
            self._submit()
        except WriterStopped:
            raise
        except StoreError:
            with contextlib.suppress(StoreError):  # the first failure is the one reported
                self._drain()
            raise
        return self._collect(block=True)

    # -- the pipeline -------------------------------------------------------------------------

    def _segment_parts(self) -> tuple[list[Columns], EncodeBuffers | None]:
        """The buffer as the batches of one segment, in arrival order: the batches as they came
        and the loose trajectories encoded (into pooled buffers, given back once filled)."""
        if not self._loose:
            return list(self._chunks), None
        bufs = self._free_bufs.pop() if self._free_bufs else EncodeBuffers()
        return self._chunks + [Columns.encode(self._loose, bufs)], bufs

    def _submit(self) -> None:
        """Write the buffer to a .tmp segment (this thread) and queue its sync (sync thread)."""
        if not self._buffered:
            return
        if self._sync.failed.is_set():
            self._collect(block=True)  # raises: the failed segments' records come back first
        while len(self._inflight) >= MAX_INFLIGHT:
            self._wait_oldest()
        if self._unfinalized:
            try:
                self._finalize_retired()
            except WriterStopped:  # fenced: this writer publishes nothing more
                raise
            except StoreError as exc:  # not in the way of new segments: retried at close
                log.warning("%s", exc)
        self._ensure_shard()
        shard, seq, now = self._shard, self._seq + 1, time.time()
        path = shard / segment_name(seq, int(now * 1e6))
        tmp = path.with_name(path.name + ".tmp")
        parts, bufs = self._segment_parts()
        # The segment file is written on the sync thread, the HDF5 structure included: here the
        # encoding evicts HDF5's working set from the caches (it cost twice as much here).
        attrs = {"shard": shard.name, "writer": self.writer, "seq": seq, "flushed_at": now}
        self._seq = seq
        ids = [tid for p in parts for tid in p.ids()]
        item = InFlight(shard, tmp, path, ids, (self._chunks, self._loose), bufs, self._free_bufs)
        item.make = (parts, attrs, self.cfg.compression)
        item.index = index_part(parts)
        self._chunks, self._loose, self._buffered, self._oldest = [], [], 0, None
        self._inflight.append(item)
        self._sync.hand_over(item)
        self._shard_rows += len(item.ids)
        if self._shard_rows >= self.cfg.shard_max_rows:
            self._rotate()

    def _rotate(self) -> None:
        """Finalize the open shard once all of it is durable and open the next one. Only the
        drain may raise here: a manifest or a shard that cannot be written now is retried at the
        next flush (which then raises if it still cannot write), never left half done."""
        self._drain()
        self._retire()
        try:
            self._finalize_retired()
            self._open_shard()
        except WriterStopped:
            raise
        except StoreError as exc:
            log.warning("%s", exc)

    def _wait_oldest(self) -> None:
        item = self._inflight[0]
        try:
            item.future.result()
        except Unproven as exc:
            self._stop(f"syncing {item.path.name}: {exc}")
            raise WriterStopped(f"writer {self.writer!r} stopped: {self._stopped}") from exc
        except Fenced as exc:
            self._fenced(exc.shard)
        except Exception as exc:  # never visible: take every unsynced batch back
            self._rebuffer()
            raise StoreError(
                f"writing {item.tmp} failed: {type(exc).__name__}: {exc}; {self._buffered} record(s) kept in memory "
                "(none acknowledged), fix the filesystem and flush again"
            ) from exc
        self._complete(self._inflight.popleft())

    def _release(self, item: InFlight) -> None:
        if item.fd >= 0:
            os.close(item.fd)
        if item.bufs is not None:
            self._free_bufs.append(item.bufs)
            item.bufs = None
        item.make = None  # drops its references to the batches

    def _complete(self, item: InFlight) -> None:
        # Every in-flight segment belongs to the open shard: rotation drains before finalizing.
        self._release(item)
        self._segments.append(item.info)
        self._parts.append(item.index)
        if self._stored is not None:  # durable: a resend of these is acknowledged at once
            self._stored.add_keys(item.index.keys)
        self._done.append(item)

    def _rebuffer(self) -> None:
        """After a failed sync: unsynced batches return to the buffer front, their .tmp files go."""
        batches: list[Columns] = []
        while self._inflight:
            item = self._inflight.popleft()
            if item.future.exception() is None:
                self._complete(item)  # synced before the failure
                continue
            self._release(item)
            item.tmp.unlink(missing_ok=True)
            chunks, loose = item.parts
            batches += chunks + ([Columns.encode(loose)] if loose else [])
        self._encode_loose()
        self._chunks = batches + self._chunks
        self._buffered = sum(c.rows for c in self._chunks)
        self._oldest = time.monotonic() if self._buffered else None
        # The failed sequence numbers are not used again: a number names at most one file, so
        # no reader or recovery can ever take one segment for another.
        self._shard_rows = sum(s.rows for s in self._segments)
        self._sync.failed.clear()

    def _fenced(self, shard: Path) -> None:
        """Stop (raises WriterStopped): a newer writer fenced `shard`, so nothing this one renames
        into it can count. What it acknowledged is listed by that writer's recovery."""
        self._stop(
            f"fenced: a newer writer of this name recovered shard {shard.name} (this one was silent for "
            f"more than its {self.lease_s:g} s lease); its senders resend to it"
        )
        raise WriterStopped(f"writer {self.writer!r} stopped: {self._stopped}")

    def _stop(self, reason: str) -> None:
        """Stop for good: acknowledge nothing more, leave every visible segment as it is for the
        next writer's recovery, remove the .tmp files nobody will rename, free the shard."""
        self._stopped = reason
        self._sync.shutdown()  # what is still queued fails fast (the failed flag is set)
        while self._inflight:
            item = self._inflight.popleft()
            self._release(item)
            if not isinstance(item.future.exception(), Unproven):
                item.tmp.unlink(missing_ok=True)
        for shard in [self._shard] + [s for s, _, _ in self._unfinalized]:
            if shard is not None:
                release_shard(shard)
        log.error("store writer %r stopped: %s; restart it (its shard is recovered then)", self.writer, reason)

    def _collect(self, block: bool) -> FlushResult | None:
        """Acknowledge finished syncs (in order); with `block`, wait for all of them."""
        while self._inflight and (block or self._inflight[0].settled):
            self._wait_oldest()
        return self._acknowledge()

    def _acknowledge(self) -> FlushResult | None:
        done, self._done = self._done, []
        if not done:
            return None
        ids = tuple(tid for item in done for tid in item.ids)
        self._pending.difference_update(ids)
        self.total_rows += len(ids)
        self._heartbeat()
        return FlushResult(
            tuple(f"{i.shard.name}/{i.info.name}" for i in done), ids, sum(i.info.bytes for i in done), self.total_rows
        )

    def _drain(self) -> None:
        while self._inflight:
            self._wait_oldest()

    def close(self) -> FlushResult | None:
        """Flush what is buffered, wait for every sync and finalize the shards (their manifests).

        On StoreError (e.g. the disk is full) nothing is lost and nothing half done: what was
        not acknowledged is still held, and close() may simply be called again."""
        if self._stopped:
            self._usable()
        if self.closed:
            return None
        self._submit()
        self._drain()
        self._retire()
        self._finalize_retired()  # before acknowledging: a retry of close() reports the rest
        result = self._acknowledge()
        self._sync.shutdown()
        self.closed = True
        return result

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()  # what was appended is consistent whatever failed in the caller
        except Exception:  # the caller's exception matters more
            log.exception("closing writer %r during an error exit failed", self.writer)
