"""Listing and checking a trajectory store, and finalizing what dead writers left open:
`hpcrl traj ls`, `hpcrl traj verify [--repair]`.

    lease_s = store_lease_s(store)          # the run's store.lease_s (config.resolved.yaml), else the default
    report = verify_store(store, lease_s, repair=False)   # one dict per shard: status, segments, rows, problems
    shards = list_store(store, lease_s)     # one dict per shard from manifests (open shards: their segments)
    shard_status(state, lease_s)            # closed/recovered (its manifest), open, or orphaned (writer dead)

A shard is `orphaned` when no writer holds it any more: its owner's process is gone (same
host), or its heartbeat is older than the store's lease, the same rule a new writer applies
before fencing it (`hpcrl.rl.store.lease`). `repair` recovers such shards (fence, verify,
finalize; an empty one is removed) before checking them. Every listed segment is read and its
checksums verified; an open shard's visible segments likewise.
"""

from __future__ import annotations

from pathlib import Path

from hpcrl.core.config import RESOLVED_NAME, StoreConfig, load_config
from hpcrl.core.schema import ConfigError
from hpcrl.rl.store.layout import SegmentError, ShardState, list_shards, read_segment, read_shard, recover_shard
from hpcrl.rl.store.lease import owner_alive

__all__ = ["list_store", "shard_rows", "shard_status", "store_lease_s", "verify_store"]


def store_lease_s(store: Path) -> float:
    """`store.lease_s` of the run that owns `store` (its resolved config), else the default."""
    resolved = store.parent / RESOLVED_NAME
    if resolved.is_file():
        try:
            return load_config(str(resolved), []).store.lease_s
        except ConfigError:
            pass  # a config this hpcrl cannot read: the default lease, as for a bare store
    return StoreConfig().lease_s


def shard_status(state: ShardState, lease_s: float) -> str:
    if state.manifest is not None:
        return state.manifest.status
    return "open" if owner_alive(state, lease_s=lease_s) else "orphaned"


def shard_rows(state: ShardState) -> tuple[int, int, list[str]]:
    """(rows, bytes, problems) of a shard from its manifest, or its visible segments if open."""
    if state.manifest is not None:
        return state.manifest.rows, sum(s.bytes for s in state.manifest.segments), []
    rows = size = 0
    problems = []
    for name in state.segment_names:
        path = state.path / name
        try:
            rows += read_segment(path, fields=("traj",)).rows
            size += path.stat().st_size
        except (SegmentError, OSError) as exc:
            problems.append(f"{name}: {exc}")
    return rows, size, problems


def list_store(store: Path, lease_s: float) -> list[dict]:
    """One entry per shard: {shard, writer, status, segments, rows, bytes, problems}."""
    shards = []
    for state in list_shards(store):
        rows, size, problems = shard_rows(state)
        nseg = len(state.manifest.segments) if state.manifest else len(state.segment_names)
        shards.append(
            {
                "shard": state.name,
                "writer": state.writer,
                "status": shard_status(state, lease_s),
                "segments": nseg,
                "rows": rows,
                "bytes": size,
                "problems": problems,
            }
        )
    return shards


def verify_store(store: Path, lease_s: float, repair: bool = False) -> list[dict]:
    """One entry per shard: {shard, status, segments, rows, ok, problems}."""
    report = []
    for state in list_shards(store):
        if repair and state.manifest is None and not owner_alive(state, lease_s=lease_s):
            if recover_shard(store, state.path).removed:
                continue
            state = read_shard(state.path)
        problems = []
        if state.manifest_error:
            problems.append(state.manifest_error)
        if state.manifest is not None:
            listed = {s.name: s for s in state.manifest.segments}
            problems += [f"{n}: not listed in the manifest" for n in state.segment_names if n not in listed]
            checks = [(n, info) for n, info in listed.items()]
        else:
            checks = [(n, None) for n in state.segment_names]
        rows = 0
        for name, expect in checks:
            if not (state.path / name).exists():
                problems.append(f"{name}: listed in the manifest but missing")
                continue
            try:
                rows += read_segment(state.path / name, expect).rows
            except SegmentError as exc:
                problems.append(f"{name}: {exc}")
        report.append(
            {
                "shard": state.name,
                "status": shard_status(state, lease_s),
                "segments": len(checks),
                "rows": rows,
                "ok": not problems,
                "problems": problems,
            }
        )
    return report
