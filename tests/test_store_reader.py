"""The learner-side store reader: arrival order across shards, an exactly-once cursor, following a
live writer, damaged segments skipped and named."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from test_store import cfg, flip_token_byte, make

from hpcrl.rl.store.layout import MANIFEST_NAME, list_shards
from hpcrl.rl.store.reader import StoreReader
from hpcrl.rl.store.writer import ShardWriter


def test_reader_merges_shards_in_arrival_order(tmp_path):
    a = ShardWriter(tmp_path, "wa", cfg(flush_every=2))
    b = ShardWriter(tmp_path, "wb", cfg(flush_every=2))
    expected = []
    ta, tb = make(6, generator="a"), make(6, generator="b")
    for i in range(3):  # flushes alternate a, b, a, b, ...
        for w, ts in ((a, ta), (b, tb)):
            for t in ts[2 * i : 2 * i + 2]:
                w.append(t)
            expected += ts[2 * i : 2 * i + 2]
            time.sleep(0.002)
    a.close()
    b.close()
    got = list(StoreReader(tmp_path))
    assert got == expected


def test_cursor_resume_is_exactly_once(tmp_path):
    trajs = make(100)
    with ShardWriter(tmp_path, "w0", cfg(flush_every=7, shard_max_rows=30)) as w:
        for t in trajs:
            w.append(t)
    seen = []
    reader = StoreReader(tmp_path)
    rng = np.random.default_rng(0)
    while True:
        batch = reader.next_batch(int(rng.integers(1, 12)))
        seen += [t.id for t in batch.trajectories]
        if not batch.trajectories:
            break
        if rng.random() < 0.5:  # "crash": a new reader resumes from the saved state
            state = json.loads(json.dumps(reader.state_dict()))
            reader = StoreReader(tmp_path)
            reader.load_state_dict(state)
    assert seen == [t.id for t in trajs]  # arrival order, each once
    assert reader.consumed == 100


def test_reader_follows_a_live_writer(tmp_path):
    w = ShardWriter(tmp_path, "w0", cfg(flush_every=5))
    reader = StoreReader(tmp_path, refresh_s=0.01)
    assert len(reader.next_batch(5)) == 0
    trajs = make(10)
    for t in trajs[:5]:
        w.append(t)
    assert [t.id for t in reader.next_batch(5, timeout_s=5).trajectories] == [t.id for t in trajs[:5]]
    for t in trajs[5:]:
        w.append(t)
    w.close()
    assert [t.id for t in reader.next_batch(10, timeout_s=0.5).trajectories] == [t.id for t in trajs[5:]]


def test_a_live_shard_refresh_parses_only_new_segment_names(tmp_path, monkeypatch):
    """The learner lists an open shard every store_refresh_s while it waits: each listing must
    cost what is new, not the whole shard (which grows to ~shard_max_rows / flush_every)."""
    from hpcrl.rl.store import reader as reader_mod

    real = reader_mod.parse_segment_name
    w = ShardWriter(tmp_path, "w0", cfg(flush_every=1))
    trajs = make(30)
    for t in trajs[:20]:
        w.append(t)
    w.flush()
    reader = StoreReader(tmp_path)
    assert [t.id for t in reader.next_batch(20).trajectories] == [t.id for t in trajs[:20]]
    parsed = []
    monkeypatch.setattr(reader_mod, "parse_segment_name", lambda n: parsed.append(n) or real(n))
    for t in trajs[20:23]:
        w.append(t)
    w.flush()
    reader.refresh()
    assert len([n for n in parsed if real(n)]) == 3  # the three new segments, not all 23
    assert [t.id for t in reader.next_batch(10).trajectories] == [t.id for t in trajs[20:23]]
    for t in trajs[23:]:
        w.append(t)
    w.close()  # finalized: read whole once more (its manifest), nothing handed out twice
    reader.refresh()
    assert [t.id for t in reader.next_batch(10).trajectories] == [t.id for t in trajs[23:]]
    assert reader._shards[next(iter(reader._shards))].finalized


def test_next_batch_with_min_size_returns_what_it_holds_without_waiting(tmp_path, monkeypatch):
    """The learner asks for up to 256 with min_size 1: three visible trajectories come back at
    once (they may complete its batch), not after the timeout spent waiting for more."""
    import types

    from hpcrl.rl.store import reader as reader_mod

    with ShardWriter(tmp_path, "w0", cfg(flush_every=3)) as w:
        trajs = make(3)
        for t in trajs:
            w.append(t)
    readers = StoreReader(tmp_path), StoreReader(tmp_path)

    def no_wait(_s):
        raise AssertionError("next_batch waited although it held trajectories")

    monkeypatch.setattr(reader_mod, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=no_wait))
    got = readers[0].next_batch(256, timeout_s=3600, min_size=1).trajectories
    assert [t.id for t in got] == [t.id for t in trajs]
    with pytest.raises(AssertionError, match="waited"):
        readers[1].next_batch(256, timeout_s=3600)  # without min_size it waits for a full batch


def test_reader_rejects_damaged_segments_and_goes_on(tmp_path, caplog):
    trajs = make(12)
    with ShardWriter(tmp_path, "w0", cfg(flush_every=4)) as w:
        for t in trajs:
            w.append(t)
    [state] = list_shards(tmp_path)
    flip_token_byte(state.path / state.segment_names[0])
    with open(state.path / state.segment_names[1], "r+b") as fh:
        fh.truncate(500)
    with caplog.at_level(logging.WARNING, logger="hpcrl.store"):
        reader = StoreReader(tmp_path)
        got = list(reader)
    assert [t.id for t in got] == [t.id for t in trajs[8:]]
    reasons = [r for _, r in reader.rejected]
    assert "checksum mismatch in tokens" in reasons[0] and "truncated" in reasons[1]
    assert sum("rejected segment" in r.message for r in caplog.records) == 2


def test_reader_with_unreadable_manifest_reads_segments(tmp_path, caplog):
    with ShardWriter(tmp_path, "w0", cfg(flush_every=4)) as w:
        for t in make(8):
            w.append(t)
    [state] = list_shards(tmp_path)
    (state.path / MANIFEST_NAME).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="hpcrl.store"):
        reader = StoreReader(tmp_path)
        assert len(list(reader)) == 8
        for _ in range(3):  # the learner looks every store_refresh_s: one warning, not one a look
            reader.refresh()
    assert sum("unreadable MANIFEST.json" in r.message for r in caplog.records) == 1


def test_reader_state_from_another_version_is_refused(tmp_path):
    with pytest.raises(ValueError, match="reader state version"):
        StoreReader(tmp_path).load_state_dict({"version": 99})
