"""Shard indexes: a restarted writer's dedup check, `hpcrl traj show` and the report read what
finalized shards hold without opening their segments, and fall back to the segments (never to a
wrong answer) where an index is missing or does not match its manifest."""

from __future__ import annotations

import numpy as np

from hpcrl.core.config import StoreConfig
from hpcrl.rl.record.synth import SynthShape, synth_trajectory
from hpcrl.rl.store import lease
from hpcrl.rl.store import segment_read as segment_read_module
from hpcrl.rl.store.index import INDEX_NAME, read_index
from hpcrl.rl.store.layout import list_shards
from hpcrl.rl.store.writer import ShardWriter

SMALL = SynthShape(first_prompt=(5, 10), later_prompt=(2, 4), action=(5, 10), observation=(0, 5))
CFG = StoreConfig(flush_every=4, flush_interval_s=30.0, flush_idle_s=30.0, shard_max_rows=8)


def trajs(n: int, start: int = 0):
    rng = np.random.default_rng(start)
    return [synth_trajectory(rng, "r", "g", start + i, SMALL) for i in range(n)]


def counting(monkeypatch, module, name="read_segment"):
    calls = []
    real = getattr(module, name)

    def spy(path, *a, **kw):
        calls.append(path.name)
        return real(path, *a, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_a_restarted_writer_dedups_from_the_indexes_without_reading_a_segment(tmp_path, monkeypatch):
    old = trajs(20)
    with ShardWriter(tmp_path, "w0", CFG) as w:
        for t in old:
            w.append(t)
    shards = list_shards(tmp_path)
    assert len(shards) == 3 and all(read_index(s.path, s.manifest.segments) is not None for s in shards)
    calls = counting(monkeypatch, lease)
    w = ShardWriter(tmp_path, "w0", CFG)
    assert calls == []  # the dedup check opened the indexes, no segment
    assert w.append(old[3]) is None and w.duplicates == 1
    new = trajs(2, start=100)
    w.append(new[0])
    assert w.stored_mask([old[19].id, new[0].id, new[1].id]) == [True, False, False]
    w.close()

    # An index that does not match its manifest (here: another shard's) is not used: that
    # shard's segments are read, and its ids are still found.
    first, second = list_shards(tmp_path)[:2]
    (first.path / INDEX_NAME).write_bytes((second.path / INDEX_NAME).read_bytes())
    assert read_index(first.path, first.manifest.segments) is None
    # A damaged one (a flipped bit) is not used either.
    third = list_shards(tmp_path)[2]
    data = bytearray((third.path / INDEX_NAME).read_bytes())
    data[-30] ^= 1
    (third.path / INDEX_NAME).write_bytes(bytes(data))
    assert read_index(third.path, third.manifest.segments) is None
    calls.clear()
    w = ShardWriter(tmp_path, "w0", CFG)
    assert sorted(calls) == sorted(s.name for s in first.manifest.segments + third.manifest.segments)
    assert w.stored_mask([t.id for t in old]) == [True] * 20
    w.close()


def test_a_recovered_shard_gets_an_index_and_its_ids_stay_deduplicated(tmp_path):
    w = ShardWriter(tmp_path, "w0", StoreConfig(flush_every=4, flush_interval_s=30.0, shard_max_rows=100))
    batch = trajs(6)
    for t in batch:
        w.append(t)
    w.flush()  # 6 durable, then the writer dies without finalizing its shard
    w._stop("killed in a test")
    w2 = ShardWriter(tmp_path, "w0", CFG)
    (state,) = [s for s in list_shards(tmp_path) if s.finalized]
    assert state.manifest.status == "recovered"
    assert read_index(state.path, state.manifest.segments).rows == 6
    assert w2.stored_mask([t.id for t in batch]) == [True] * 6
    w2.close()


def test_traj_show_opens_only_the_segments_whose_episode_range_holds_it(tmp_path, monkeypatch):
    from hpcrl.jobs.cli.traj import _find

    with ShardWriter(tmp_path, "w0", CFG) as w:
        for t in trajs(40):
            w.append(t)
    calls = counting(monkeypatch, segment_read_module)
    found = _find(tmp_path, "17")
    assert [t.episode for t in found] == [17]
    assert len(calls) == 1  # of 10 segments, only the one holding episodes 16-19
