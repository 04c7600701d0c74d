"""Who holds a shard: the owner's liveness (pid on this host, OWNER.json heartbeat elsewhere).

    why = owner_alive(state, lease_s)   # None: its writer is dead (or lost its lease), recover it
    hold_shard(path); release_shard(path)   # the shards live writers of this process hold
    reports = take_over(store, "store-0", lease_s)   # a new writer of a name: recover its dead shards
    ids = StoredIds.load(store, "store-0")  # what the name stored: the new writer's dedup check

A shard is written by one writer, named in the shard directory's name (host and pid). On the
same host its pid says whether it runs; for this process itself, the registry of shards held
by live ShardWriters does (a stopped or closed writer's shard is free although its pid runs).
On another host the mtime of OWNER.json is the heartbeat: a writer refreshes it at each flush
and at least every lease/3 seconds, so one silent for `lease_s` is presumed dead. Presumed
only: it may be stalled (SIGSTOP, a slow parallel-filesystem fsync) and come back; the fence
(`hpcrl.rl.store.layout`) makes sure that it then cannot publish anything.
"""

from __future__ import annotations

import calendar
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import psutil

from hpcrl.rl.store.index import id_keys, member, read_index
from hpcrl.rl.store.layout import (
    OWNER_NAME,
    RecoveryReport,
    SegmentError,
    ShardState,
    StoreError,
    list_shards,
    read_segment,
    recover_shard,
    short_host,
)

__all__ = ["owner_alive", "hold_shard", "release_shard", "take_over", "StoredIds"]

log = logging.getLogger("hpcrl.store")

_LIVE_SHARDS: set[Path] = set()


def hold_shard(path: Path) -> None:
    _LIVE_SHARDS.add(path.resolve())


def release_shard(path: Path) -> None:
    _LIVE_SHARDS.discard(path.resolve())


def owner_alive(state: ShardState, lease_s: float) -> str | None:
    """Why the shard's writer may still be alive (None: it is dead, the shard may be recovered)."""
    try:
        _, stamp, host, pid, _ = state.name.split(".")
        started = calendar.timegm(time.strptime(stamp.split("u")[0], "%Y%m%dT%H%M%S"))
        pid = int(pid)
    except ValueError:
        return None  # not a name this code makes: no owner to protect
    if host == short_host():
        if pid == os.getpid():
            return "a writer in this process holds it" if state.path.resolve() in _LIVE_SHARDS else None
        try:
            proc = psutil.Process(pid)
            # A pid reused by a process started after the shard cannot be its writer.
            if proc.create_time() <= started + 1 and proc.status() != psutil.STATUS_ZOMBIE:
                return f"pid {pid} on this host is still running"
        except psutil.Error:
            pass
        return None
    owner = state.path / OWNER_NAME
    try:
        beat = (owner if owner.exists() else state.path).stat().st_mtime
    except OSError:
        return None
    age = time.time() - beat
    if age < lease_s:
        return f"host {host} sent a heartbeat {age:.0f} s ago (lease {lease_s:.0f} s)"
    return None


def take_over(store: Path, writer: str, lease_s: float) -> list[RecoveryReport]:
    """Recover (fence, verify, finalize) every open shard of `writer` whose owner is dead or past
    its lease; StoreError if one is alive. Also tidies what a writer fenced earlier left behind."""
    reports = []
    for state in list_shards(store):
        if state.writer != writer:
            continue
        if state.finalized:
            if state.fenced and state.unlisted:  # late files of a writer fenced before: tidy
                reports.append(recover_shard(store, state.path))
            continue
        alive = owner_alive(state, lease_s)
        if alive:
            raise StoreError(
                f"writer name {writer!r} is in use: shard {state.name} is open and {alive}; give each "
                "writer its own name, or wait for the lease to expire if that writer is dead"
            )
        reports.append(recover_shard(store, state.path))
    return reports


class StoredIds:
    """The ids a writer name stored, for its dedup check: each finalized shard's index
    (hpcrl.rl.store.index), searched in place, plus a set for what is not indexed: this
    writer's own shard until it is finalized, and shards without a usable index (read once).
    Opening it reads no segment of an indexed shard: its cost grows with the shards, not rows."""

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []
        self._loose: set[bytes] = set()

    @classmethod
    def load(cls, store: Path, writer: str) -> StoredIds:
        out = cls()
        for state in list_shards(store):
            if state.writer != writer:
                continue
            idx = read_index(state.path, state.manifest.segments if state.manifest else None)
            if idx is not None:
                out._runs.append(idx.keys)
                continue
            names = [s.name for s in state.manifest.segments] if state.manifest else state.segment_names
            for name in names:
                try:
                    out._loose.update(id_keys(read_segment(state.path / name, fields=("traj",)).ids()).tolist())
                except SegmentError as exc:
                    log.warning("dedup index: skipping %s/%s: %s", state.name, name, exc)
        return out

    def __len__(self) -> int:
        return len(self._loose) + sum(len(r) for r in self._runs)

    def add_keys(self, keys: np.ndarray) -> None:
        """Stored now (keys: hpcrl.rl.store.index.id_keys of their ids)."""
        self._loose.update(keys.tolist())

    def seal(self, keys: np.ndarray) -> None:
        """A shard's index is written: search its (sorted) keys in place, drop them from the set."""
        self._runs.append(keys)
        self._loose.difference_update(np.asarray(keys).tolist())

    def mask(self, ids: Sequence[str]) -> np.ndarray:
        """Which of `ids` are stored (a bool per id)."""
        keys = id_keys(ids)
        hit = np.fromiter((k in self._loose for k in keys.tolist()), bool, len(keys))
        for run in self._runs:
            hit |= member(run, keys)
        return hit

    def __contains__(self, tid: str) -> bool:
        return bool(self.mask([tid])[0])
