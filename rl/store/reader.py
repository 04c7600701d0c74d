"""The learner's view of the trajectory store: arrival order, an exactly-once cursor, batches.

    from hpcrl.rl.store.reader import StoreReader
    reader = StoreReader(run_dir / "trajectories")
    reader.load_state_dict(ckpt.get("reader", {}))          # resume where the checkpoint was taken
    batch = reader.next_batch(32, timeout_s=10)
    ...group and train on batch.trajectories...
    ckpt["reader"] = reader.state_dict()                     # saved atomically with the weights

Order: segments (one per writer flush) are merged across shards by flush time, and rows within
a segment keep their order. The cursor is kept per shard (next segment sequence number and
row), not as one global position, so a segment that appears late (a slow filesystem, clock
skew between hosts) is still read, after its turn, instead of being skipped.

Exactly once: a trajectory counts as consumed when `next_batch` returns it. `state_dict()`
holds the per-shard read positions, so restoring it after a restart returns every unconsumed
trajectory once and no consumed one again, provided the state is saved together with the
model update that used the batches (that is the learner's checkpoint). The reader hands over
everything: staleness is judged once, per GRPO group, by the learner's GroupBuffer.

Damage: a segment that fails to open, to match its checksum or its shard's manifest is
rejected with a logged reason (`rejected`), and the reader goes on with the next one.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.rl.record.columns import Columns
from hpcrl.rl.record.tables import ARRAY_NAMES
from hpcrl.rl.record.trajectory import Trajectory
from hpcrl.rl.store.layout import (
    MANIFEST_NAME,
    SegmentError,
    SegmentInfo,
    ShardState,
    list_shards,
    parse_segment_name,
    read_segment,
    read_shard,
)

__all__ = ["StoreReader", "Batch", "Segment", "segments_of", "iter_segments", "resolve_store"]

log = logging.getLogger("hpcrl.store")
STATE_VERSION = 1


def resolve_store(path: str | os.PathLike) -> Path:
    """A run directory holds its store in `trajectories/`; any other directory is the store."""
    p = Path(path)
    return p / "trajectories" if (p / "trajectories").is_dir() else p


@dataclass(frozen=True)
class Batch:
    trajectories: tuple[Trajectory, ...]

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass(frozen=True)
class Segment:
    """A segment file of a shard, in the order a reader reads them: its sequence number, when it
    was flushed, its file name, and what the shard's manifest says of it (None: unverified)."""

    seq: int
    flushed_us: int
    name: str
    expect: SegmentInfo | None


@dataclass
class _Shard:
    path: Path
    segments: list[Segment] = field(default_factory=list)  # by sequence number
    seen: set[str] = field(default_factory=set)  # directory entries already looked at
    seq: int = 1  # read position: next row is `row` of the first segment with seq >= `seq`
    row: int = 0
    finalized: bool = False
    unverified: bool = False  # its manifest is there but unreadable: read segment by segment

    def set_segments(self, state: ShardState) -> None:
        self.segments = sorted(segments_of(state), key=lambda g: g.seq)
        self.seen = set(state.segment_names)
        self.finalized = state.finalized
        self.unverified = state.manifest_error is not None

    def add(self, seg: Segment) -> None:
        bisect.insort(self.segments, seg, key=lambda g: g.seq)


def segments_of(state: ShardState) -> list[Segment]:
    """The segments of a shard to read: those its manifest lists (others are ignored, with a
    warning), or without a readable manifest every segment file, unverified."""
    if state.manifest is not None:
        listed = {s.name for s in state.manifest.segments}
        extra = [n for n in state.segment_names if n not in listed]
        if extra:
            log.warning(
                "shard %s: ignoring %d segment file(s) not in its manifest: %s", state.name, len(extra), extra[:3]
            )
        out = []
        for s in state.manifest.segments:
            parsed = parse_segment_name(s.name)
            if parsed:
                out.append(Segment(parsed[0], parsed[1], s.name, s))
        return out
    if state.manifest_error:
        log.warning("shard %s: %s; reading its segments unverified by a manifest", state.name, state.manifest_error)
    return [Segment(*parse_segment_name(n), n, None) for n in state.segment_names]


def iter_segments(
    store: Path, on_error=None, fields: tuple[str, ...] = ARRAY_NAMES
) -> Iterator[tuple[ShardState, str, Columns]]:
    """Every readable segment of every shard, verified; `on_error(shard, name, reason)` for the rest.
    With `fields` a subset (e.g. ("traj", "steps")) only those arrays are read and checked."""
    for state in list_shards(store):
        for seg in segments_of(state):
            try:
                yield state, seg.name, read_segment(state.path / seg.name, seg.expect, fields)
            except SegmentError as exc:
                if on_error:
                    on_error(state, seg.name, str(exc))


class StoreReader:
    def __init__(self, store: str | os.PathLike, *, refresh_s: float = 0.5):
        self.store = resolve_store(store)
        self.refresh_s = refresh_s
        self._shards: dict[str, _Shard] = {}
        self._current: tuple[str, int, Columns] | None = None  # the head segment being read
        self._rejected: set[tuple[str, int]] = set()
        self.rejected: list[tuple[str, str]] = []  # (shard/segment, reason), in order found
        self.consumed = 0
        self._last_refresh = float("-inf")
        self.refresh()

    # -- discovery --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Rescan the store for new shards and segments (cheap: directory listings only)."""
        self._last_refresh = time.monotonic()
        # A finalized shard never changes: re-reading every one's listing and manifest made a
        # refresh cost O(whole store) (67 ms at 5,000 segments, and growing all run). A live
        # shard's listing is taken again, but only names not seen before are parsed: parsing
        # all of them cost ~3 ms a refresh at 800 segments, growing until the shard rotates.
        live = [shard for shard in self._shards.values() if not shard.finalized]
        for state in list_shards(self.store, skip=set(self._shards)):
            self._shards[state.name] = shard = _Shard(state.path)
            shard.set_segments(state)  # just listed: not listed again below
        for shard in live:
            self._refresh_live(shard)

    def _refresh_live(self, shard: _Shard) -> None:
        try:
            entries = set(os.listdir(shard.path))
        except OSError:
            return  # not there (yet): a cursor restored for a shard this store lacks
        finalized = MANIFEST_NAME in entries and not shard.unverified
        if finalized or not {g.name for g in shard.segments} <= entries:
            # Finalized since (its manifest decides what it holds, read once), or segments
            # taken out of it (a recovery's quarantine): read it whole. A shard whose manifest
            # is unreadable is followed like an open one (and warned about once, not every look).
            shard.set_segments(read_shard(shard.path))
            return
        for name in entries - shard.seen:
            parsed = parse_segment_name(name)
            if parsed:
                shard.add(Segment(parsed[0], parsed[1], name, None))
        shard.seen |= entries

    def _reject(self, shard: str, seq: int, name: str, reason: str) -> None:
        if (shard, seq) not in self._rejected:
            self._rejected.add((shard, seq))
            self.rejected.append((f"{shard}/{name}", reason))
            log.warning("rejected segment %s/%s: %s; going on with the next one", shard, name, reason)

    def _head(self, name: str) -> Segment | None:
        shard = self._shards[name]
        for seg in shard.segments[bisect.bisect_left(shard.segments, shard.seq, key=lambda g: g.seq) :]:
            if (name, seg.seq) not in self._rejected:
                return seg
        return None

    def _load_next_segment(self) -> bool:
        """Make the earliest-flushed unread segment current; False when none is visible."""
        while True:
            heads = [(seg.flushed_us, name, seg) for name in self._shards if (seg := self._head(name))]
            if not heads:
                return False
            _, name, seg = min(heads, key=lambda h: (h[0], h[1]))
            shard = self._shards[name]
            if seg.seq != shard.seq:
                shard.seq, shard.row = seg.seq, 0
            try:
                cols = read_segment(shard.path / seg.name, seg.expect)
            except SegmentError as exc:
                self._reject(name, seg.seq, seg.name, str(exc))
                continue
            self._current = (name, seg.seq, cols)
            return True

    # -- reading ----------------------------------------------------------------------------

    def _pull(self) -> Trajectory | None:
        """Advance the read position by one trajectory."""
        while True:
            if self._current is None and not self._load_next_segment():
                return None
            name, seq, cols = self._current
            shard = self._shards[name]
            if shard.row >= cols.rows:
                shard.seq, shard.row, self._current = seq + 1, 0, None
                continue
            row = shard.row
            shard.row += 1
            try:
                return cols.trajectory(row, trusted=True)  # checksummed
            except Exception as exc:  # whatever it is, a learner must not crash on it in a loop
                self._reject(name, seq, f"seq {seq}", f"row {row} undecodable: {type(exc).__name__}: {exc}")
                shard.seq, shard.row, self._current = seq + 1, 0, None

    def next_batch(self, size: int, timeout_s: float = 0.0, min_size: int | None = None) -> Batch:
        """Up to `size` trajectories; waits up to `timeout_s` for writers to flush more while it
        holds fewer than `min_size` (default `size`). The learner asks with min_size 1: what it
        already holds may complete its batch, and waiting for company that only comes once
        that batch is trained would stall it for the whole timeout."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1 (got {size})")
        enough = size if min_size is None else max(1, min(min_size, size))
        deadline = time.monotonic() + timeout_s
        out: list[Trajectory] = []
        while True:
            while len(out) < size and (traj := self._pull()) is not None:
                out.append(traj)
                self.consumed += 1
            now = time.monotonic()
            if len(out) >= enough or now >= deadline:
                return Batch(tuple(out))
            if now - self._last_refresh >= self.refresh_s:
                self.refresh()
            else:
                time.sleep(max(0.0, min(self.refresh_s - (now - self._last_refresh), deadline - now)))

    def __iter__(self) -> Iterator[Trajectory]:
        """Every trajectory visible now, consumed one by one in arrival order."""
        while True:
            batch = self.next_batch(1)
            if not batch.trajectories:
                return
            yield batch.trajectories[0]

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able cursor: the per-shard read positions."""
        return {
            "version": STATE_VERSION,
            "positions": {n: [s.seq, s.row] for n, s in self._shards.items() if (s.seq, s.row) != (1, 0)},
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor from `state_dict()`; an empty dict means start from the beginning."""
        if not state:
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"reader state version {state.get('version')!r} is not {STATE_VERSION}; "
                "it was saved by another hpcrl version"
            )
        self.refresh()
        self._current = None
        for name, (seq, row) in state["positions"].items():
            shard = self._shards.setdefault(name, _Shard(self.store / name))
            shard.seq, shard.row = int(seq), int(row)
        self.consumed = int(state.get("consumed", 0))
