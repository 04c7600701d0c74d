"""The learner's view of the trajectory store: arrival order, exactly-once cursor, staleness, batches.

    from hpcrl.rl.store_reader import StoreReader
    reader = StoreReader(run_dir / "trajectories", max_staleness=cfg.learner.max_staleness)
    reader.load_state_dict(ckpt.get("reader", {}))          # resume where the checkpoint was taken
    batch = reader.next_batch(32, learner_version=v, timeout_s=10)
    ...train on batch.trajectories...
    ckpt["reader"] = reader.state_dict()                     # saved atomically with the weights

Order: segments (one per writer flush) are merged across shards by flush time, and rows within
a segment keep their order. The cursor is kept per shard (next segment sequence number and
row), not as one global position, so a segment that appears late (a slow filesystem, clock
skew between hosts) is still read, after its turn, instead of being skipped.

Exactly once: a trajectory counts as consumed when `next_batch` returns it. `state_dict()`
holds the per-shard read positions plus the rows read ahead into the sampling window but not
yet returned, so restoring it after a restart returns every unconsumed trajectory once and
no consumed one again, provided the state is saved together with the model update that used
the batches (that is the learner's checkpoint).

Staleness: with `max_staleness` set, a trajectory whose oldest step's policy version is more
than `max_staleness` behind `learner_version` is consumed without being returned (counted in
`dropped_stale`): it would only grow staler. It is tested on the stored column, before decoding.

Sampling: with `shuffle_window=W`, each batch is drawn uniformly from the next W fresh
trajectories in arrival order (seeded; the generator state is part of `state_dict`).

Damage: a segment that fails to open, to match its checksum or its shard's manifest is
rejected with a logged reason (`rejected`), and the reader goes on with the next one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hpcrl.rl.shards import SegmentError, SegmentInfo, ShardState, list_shards, parse_segment_name, read_segment
from hpcrl.rl.traj_columns import Columns, ColumnsError
from hpcrl.rl.trajectory import Trajectory

__all__ = ["StoreReader", "Batch", "iter_segments", "resolve_store"]

log = logging.getLogger("hpcrl.store")
STATE_VERSION = 1


def resolve_store(path: str | os.PathLike) -> Path:
    """A run directory holds its store in `trajectories/`; any other directory is the store."""
    p = Path(path)
    return p / "trajectories" if (p / "trajectories").is_dir() else p


@dataclass(frozen=True)
class Batch:
    trajectories: tuple[Trajectory, ...]
    dropped_stale: int  # consumed while building this batch but filtered out as stale

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass(frozen=True)
class _Seg:
    seq: int
    flushed_us: int
    name: str
    expect: SegmentInfo | None


@dataclass
class _Shard:
    path: Path
    segments: list[_Seg] = field(default_factory=list)
    seq: int = 1  # read position: next row is `row` of the first segment with seq >= `seq`
    row: int = 0
    finalized: bool = False


def _segments_of(state: ShardState) -> list[_Seg]:
    if state.manifest is not None:
        listed = {s.name for s in state.manifest.segments}
        extra = [n for n in state.segment_names if n not in listed]
        if extra:
            log.warning("shard %s: ignoring %d segment file(s) not in its manifest: %s", state.name, len(extra), extra[:3])
        out = []
        for s in state.manifest.segments:
            parsed = parse_segment_name(s.name)
            if parsed:
                out.append(_Seg(parsed[0], parsed[1], s.name, s))
        return out
    if state.manifest_error:
        log.warning("shard %s: %s; reading its segments unverified by a manifest", state.name, state.manifest_error)
    return [_Seg(*parse_segment_name(n), n, None) for n in state.segment_names]


def iter_segments(store: Path, on_error=None) -> Iterator[tuple[ShardState, str, Columns]]:
    """Every readable segment of every shard, verified; `on_error(shard, name, reason)` for the rest."""
    for state in list_shards(store):
        for seg in _segments_of(state):
            try:
                yield state, seg.name, read_segment(state.path / seg.name, seg.expect)
            except SegmentError as exc:
                if on_error:
                    on_error(state, seg.name, str(exc))


class StoreReader:
    def __init__(self, store: str | os.PathLike, *, max_staleness: int | None = None, shuffle_window: int = 0,
                 seed: int = 0, refresh_s: float = 0.5):
        if shuffle_window < 0:
            raise ValueError(f"shuffle_window must be >= 0 (got {shuffle_window})")
        self.store = resolve_store(store)
        self.max_staleness = max_staleness
        self.shuffle_window = shuffle_window
        self.refresh_s = refresh_s
        self._rng = np.random.default_rng(seed)
        self._shards: dict[str, _Shard] = {}
        self._current: tuple[str, int, Columns] | None = None  # the head segment being read
        self._window: list[tuple[tuple[str, int, int], Trajectory]] = []  # read ahead, not consumed
        self._rejected: set[tuple[str, int]] = set()
        self.rejected: list[tuple[str, str]] = []  # (shard/segment, reason), in order found
        self.consumed = 0
        self.dropped_stale = 0
        self._last_refresh = float("-inf")
        self.refresh()

    # -- discovery --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Rescan the store for new shards and segments (cheap: directory listings only)."""
        self._last_refresh = time.monotonic()
        for state in list_shards(self.store):
            shard = self._shards.setdefault(state.name, _Shard(state.path))
            if shard.finalized:
                continue
            shard.segments = _segments_of(state)
            shard.finalized = state.finalized

    def _reject(self, shard: str, seq: int, name: str, reason: str) -> None:
        if (shard, seq) not in self._rejected:
            self._rejected.add((shard, seq))
            self.rejected.append((f"{shard}/{name}", reason))
            log.warning("rejected segment %s/%s: %s; going on with the next one", shard, name, reason)

    def _head(self, name: str) -> _Seg | None:
        shard = self._shards[name]
        for seg in shard.segments:
            if seg.seq >= shard.seq and (name, seg.seq) not in self._rejected:
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

    def _is_stale(self, min_version: int, learner_version: int | None) -> bool:
        return (self.max_staleness is not None and learner_version is not None
                and learner_version - min_version > self.max_staleness)

    def _pull(self, learner_version: int | None) -> tuple[tuple[str, int, int], Trajectory] | None:
        """Advance the read position by one fresh trajectory (stale ones are consumed on the way)."""
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
            if self._is_stale(int(cols.traj["min_policy_version"][row]), learner_version):
                self.dropped_stale += 1
                self.consumed += 1
                continue
            try:
                return (name, seq, row), cols.trajectory(row, trusted=True)  # checksummed
            except ColumnsError as exc:
                self._reject(name, seq, f"seq {seq}", f"row {row} undecodable: {exc}")
                shard.seq, shard.row, self._current = seq + 1, 0, None

    def next_batch(self, size: int, learner_version: int | None = None, timeout_s: float = 0.0) -> Batch:
        """Up to `size` fresh trajectories; waits up to `timeout_s` for writers to flush more."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1 (got {size})")
        deadline = time.monotonic() + timeout_s
        stale_before = self.dropped_stale
        out: list[Trajectory] = []
        while True:
            if self.shuffle_window:
                self._fill_window(max(size, self.shuffle_window), learner_version)
                k = min(size - len(out), len(self._window))
                if k:
                    picks = sorted(self._rng.choice(len(self._window), size=k, replace=False).tolist())
                    out.extend(self._window[i][1] for i in picks)
                    for i in reversed(picks):
                        del self._window[i]
                    self.consumed += k
            else:
                while len(out) < size and (item := self._pull(learner_version)) is not None:
                    out.append(item[1])
                    self.consumed += 1
            now = time.monotonic()
            if len(out) >= size or now >= deadline:
                return Batch(tuple(out), self.dropped_stale - stale_before)
            if now - self._last_refresh >= self.refresh_s:
                self.refresh()
            else:
                time.sleep(min(0.05, deadline - now))

    def _fill_window(self, want: int, learner_version: int | None) -> None:
        self._drop_stale_window(learner_version)
        while len(self._window) < want and (item := self._pull(learner_version)) is not None:
            self._window.append(item)

    def _drop_stale_window(self, learner_version: int | None) -> None:
        if self.max_staleness is None or learner_version is None:
            return
        keep = [(pos, t) for pos, t in self._window if not self._is_stale(t.min_policy_version, learner_version)]
        dropped = len(self._window) - len(keep)
        self.dropped_stale += dropped
        self.consumed += dropped
        self._window = keep

    def __iter__(self) -> Iterator[Trajectory]:
        """Every trajectory visible now, consumed one by one in arrival order."""
        while True:
            batch = self.next_batch(1)
            if not batch.trajectories:
                return
            yield batch.trajectories[0]

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able cursor: per-shard positions, read-ahead rows not yet returned, RNG state."""
        return {
            "version": STATE_VERSION,
            "positions": {n: [s.seq, s.row] for n, s in self._shards.items() if (s.seq, s.row) != (1, 0)},
            "window": [list(pos) for pos, _ in self._window],
            "rng": self._rng.bit_generator.state,
            "consumed": self.consumed,
            "dropped_stale": self.dropped_stale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor from `state_dict()`; an empty dict means start from the beginning."""
        if not state:
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"reader state version {state.get('version')!r} is not {STATE_VERSION}; "
                             "it was saved by another hpcrl version")
        self.refresh()
        self._current, self._window = None, []
        for name, (seq, row) in state["positions"].items():
            shard = self._shards.setdefault(name, _Shard(self.store / name))
            shard.seq, shard.row = int(seq), int(row)
        if state.get("rng"):
            self._rng.bit_generator.state = state["rng"]
        self.consumed = int(state.get("consumed", 0))
        self.dropped_stale = int(state.get("dropped_stale", 0))
        segments: dict[tuple[str, int], Columns | None] = {}
        for name, seq, row in state.get("window", []):
            key = (name, int(seq))
            if key not in segments:
                segments[key] = self._read_for_window(*key)
            cols = segments[key]
            if cols is not None:
                try:
                    self._window.append(((name, int(seq), int(row)), cols.trajectory(int(row), trusted=True)))
                except (ColumnsError, IndexError) as exc:
                    self._reject(name, int(seq), f"seq {seq}", f"read-ahead row {row}: {exc}")

    def _read_for_window(self, name: str, seq: int) -> Columns | None:
        seg = next((s for s in self._shards[name].segments if s.seq == seq), None) if name in self._shards else None
        if seg is None:
            self._reject(name, seq, f"seq {seq}", "segment holding read-ahead rows is gone")
            return None
        try:
            return read_segment(self._shards[name].path / seg.name, seg.expect)
        except SegmentError as exc:
            self._reject(name, seq, seg.name, str(exc))
            return None
