"""HDF5 shard writer: flushing, durability, recovery, dedup across restarts, the store service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcrl.core.config import StoreConfig
from hpcrl.rl.record.columns import Columns
from hpcrl.rl.record.flat import EncodeBuffers
from hpcrl.rl.record.synth import SynthShape, synth_trajectory
from hpcrl.rl.store.layout import (
    MANIFEST_NAME,
    QUARANTINE_DIR,
    SegmentError,
    StoreError,
    list_shards,
    load_segment,
    new_shard_dir,
    publish_segment,
    read_segment,
    segment_meta,
    write_segment,
)
from hpcrl.rl.store.writer import ShardWriter

SMALL = SynthShape(first_prompt=(20, 60), later_prompt=(2, 8), action=(10, 60), observation=(0, 40))


def make(n: int, *, generator="g", start=0, seed=0, versions=None, shape=SMALL):
    rng = np.random.default_rng(seed)
    return [
        synth_trajectory(rng, "r", generator, start + i, shape, policy_version=(versions[i] if versions else 0))
        for i in range(n)
    ]


def cfg(**kw) -> StoreConfig:
    base = dict(flush_every=4, flush_interval_s=30.0, flush_idle_s=30.0, compression="none", shard_max_rows=10_000)
    base.update(kw)
    return StoreConfig(**base)


def stored(store: Path) -> list:
    out = []
    for state in list_shards(store):
        names = [s.name for s in state.manifest.segments] if state.manifest else state.segment_names
        for name in names:
            cols = read_segment(state.path / name)
            out += [cols.trajectory(i) for i in range(cols.rows)]
    return out


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# -- writer -------------------------------------------------------------------------------------


def test_flush_by_count_acknowledges_exactly_the_durable_ids(tmp_path):
    trajs = make(10)
    w = ShardWriter(tmp_path, "w0", cfg(flush_every=4))
    results = []
    for i, t in enumerate(trajs):
        r = w.append(t)
        assert w.buffered == (i + 1) % 4  # every 4th append hands the batch to a segment
        if r:
            results.append(r)
            # Acknowledged means: renamed to the final name (and fsynced) already.
            assert all((tmp_path / seg).exists() for seg in r.segments)
    results.append(w.flush())
    assert [i for r in results for i in r.ids] == [t.id for t in trajs]
    assert [r.total_rows for r in results] == sorted({r.total_rows for r in results})
    assert results[-1].total_rows == 10 and w.buffered == 0
    assert w.close() is None
    assert stored(tmp_path) == trajs


def poll_until(w, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if r := w.poll():
            return r
        time.sleep(0.005)
    return None


def wait_due(w, timeout_s=120.0):
    """Until the writer's buffer is due by time (a condition, not a sleep of the right length)."""
    deadline = time.monotonic() + timeout_s
    while w.seconds_to_flush() != 0.0:
        assert time.monotonic() < deadline, "the buffer never fell due"
        time.sleep(0.005)


def test_flush_by_age(tmp_path):
    w = ShardWriter(tmp_path, "w0", cfg(flush_every=1000, flush_interval_s=0.05))
    w.append(make(1)[0])
    assert w.seconds_to_flush() <= 0.05  # nothing flushes it before it is due (flush_idle_s is 30 s here)
    wait_due(w)
    assert poll_until(w, timeout_s=120.0).rows == 1
    w.append(make(1, start=1)[0])
    wait_due(w)
    w.append(make(1, start=2)[0])  # an append past the deadline flushes too
    assert w.buffered == 0
    assert poll_until(w, timeout_s=120.0).rows == 2
    w.close()


def test_a_pause_in_the_input_flushes_without_waiting_for_company(tmp_path):
    """The last trajectories of a learner's batch must not wait for the next batch to fill their
    segment (flush_every) or for flush_interval_s: that stalled the pipeline ~0.3 s per step."""
    w = ShardWriter(tmp_path, "w0", cfg(flush_every=1000, flush_interval_s=3600.0, flush_idle_s=0.05))
    results = [w.append(t) for t in make(3)]
    due = w.seconds_to_flush()  # None if a pause between the appends flushed them all already
    assert due is None or due <= 0.05  # due within flush_idle_s, not flush_interval_s
    deadline = time.monotonic() + 120.0
    while sum(r.rows for r in results if r) < 3:  # whether a pause fell between the appends or not
        assert time.monotonic() < deadline, "a paused input was never flushed"
        results.append(w.poll())
        time.sleep(0.005)
    assert w.buffered == 0
    w.close()


def test_finalized_shard_matches_manifest_and_layout_is_flat_and_chunked(tmp_path):
    trajs = make(9)
    with ShardWriter(tmp_path, "w0", cfg(flush_every=4)) as w:
        for t in trajs:
            w.append(t)
    [state] = list_shards(tmp_path)
    m = state.manifest
    assert m.status == "closed" and m.rows == 9 and [s.rows for s in m.segments] == [4, 4, 1]
    assert state.segment_names == [s.name for s in m.segments]
    raw = json.loads((state.path / MANIFEST_NAME).read_text())
    assert raw["rows"] == 9 and raw["crc32"] == m.crc32 and raw["bytes"] == sum(s.bytes for s in m.segments)
    for info in m.segments:
        found = load_segment(state.path / info.name, info)[1]  # as recovery lists it
        assert (found.rows, found.crc32, found.bytes) == (info.rows, info.crc32, info.bytes)
        with h5py.File(state.path / info.name, "r") as f:
            # Five flat datasets however many trajectories: no dataset per trajectory.
            assert sorted(f) == ["logprobs", "loss_mask", "steps", "tokens", "traj"]
            # Immutable and uncompressed: contiguous storage of a fixed extent, no chunk index.
            assert all(f[n].chunks is None and f[n].maxshape == f[n].shape for n in f)
            assert segment_meta(f)["rows"] == info.rows and segment_meta(f)["format_version"] == 2
            assert f.userblock_size == 512  # the segment header, with the checksums


def write_and_publish(path, cols, attrs, compression="none"):
    tmp = path.with_name(path.name + ".tmp")
    info = write_segment(tmp, cols, attrs, compression)
    publish_segment(tmp, path)
    return info


def test_segments_of_several_batches_chunks_and_empty_datasets_round_trip(tmp_path, monkeypatch):
    """A segment made of several batches (written piece by piece), compressed chunks with a
    short last one, and zero-length datasets all read back exact."""
    import hpcrl.rl.store.segment as segment_mod

    trajs = make(20)
    parts = [Columns.encode(trajs[:7]), Columns.encode(trajs[7:8]), Columns.encode(trajs[8:])]
    path = tmp_path / "seg-000001-0000000000000000.h5"
    info = write_and_publish(path, parts, {"seq": 1})
    back = read_segment(path, info)
    assert [back.trajectory(i) for i in range(back.rows)] == trajs
    assert info.rows == 20 and info.bytes == path.stat().st_size
    monkeypatch.setattr(segment_mod, "CHUNK_BYTES", 1000)  # tokens of 20 trajectories: many chunks
    path = tmp_path / "seg-000002-0000000000000000.h5"
    write_and_publish(path, parts, {"seq": 2}, "lzf")
    back = read_segment(path)
    assert [back.trajectory(i) for i in range(back.rows)] == trajs
    with h5py.File(path, "r") as f:
        assert f["tokens"].id.get_num_chunks() > 2 and len(f["tokens"]) % f["tokens"].chunks[0] != 0
    empty = Columns.encode([], EncodeBuffers())
    write_and_publish(tmp_path / "seg-000003-0000000000000000.h5", empty, {"seq": 3})
    assert read_segment(tmp_path / "seg-000003-0000000000000000.h5").rows == 0


def test_encode_buffers_give_the_same_columns_and_are_reused():
    bufs = EncodeBuffers()
    big, small = make(12, seed=1), make(3, seed=2)
    a = Columns.encode(big, bufs)
    assert all(x.tobytes() == y.tobytes() for (_, x), (_, y) in zip(a.arrays(), Columns.encode(big).arrays()))
    tokens = a.tokens
    b = Columns.encode(small, bufs)  # smaller: same memory, no new allocation
    assert np.shares_memory(b.tokens, tokens) and b.crc32() == Columns.encode(small).crc32()
    bigger = big + make(12, seed=3)
    c = Columns.encode(bigger, bufs)  # larger: grows
    assert c.crc32() == Columns.encode(bigger).crc32() and len(c.tokens) > len(tokens)


def test_start_writeback_is_advisory(tmp_path):
    from hpcrl.rl.store.segment import start_writeback

    (tmp_path / "f").write_bytes(b"x" * 10_000)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    start_writeback(fd)
    os.close(fd)
    start_writeback(fd)  # a closed descriptor: ignored, never raises


def test_shards_rotate_at_shard_max_rows(tmp_path):
    with ShardWriter(tmp_path, "w0", cfg(flush_every=2, shard_max_rows=5)) as w:
        for t in make(13):
            w.append(t)
    shards = list_shards(tmp_path)
    assert [s.manifest.rows for s in shards] == [6, 6, 1]
    assert all(s.manifest.status == "closed" for s in shards)


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_compression_round_trips_and_shrinks(tmp_path, compression):
    trajs = make(20, shape=SynthShape(action=(200, 400)))
    sizes = {}
    for comp in ("none", compression):
        with ShardWriter(tmp_path / comp, "w0", cfg(flush_every=20, compression=comp)) as w:
            for t in trajs:
                w.append(t)
        [state] = list_shards(tmp_path / comp)
        seg = state.path / state.segment_names[0]
        with h5py.File(seg, "r") as f:
            assert segment_meta(f)["compression"] == comp
            assert (f["tokens"].compression is not None) == (comp != "none")
        sizes[comp] = seg.stat().st_size
        assert stored(tmp_path / comp) == trajs
    assert sizes[compression] < 0.9 * sizes["none"]


def test_shard_names_are_unique(tmp_path):
    names = {new_shard_dir(tmp_path, "w0").name for _ in range(200)}
    assert len(names) == 200


def test_two_processes_write_one_store_without_file_locking(tmp_path):
    env = {**os.environ, "HDF5_USE_FILE_LOCKING": "FALSE"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hpcrl.jobs.cli",
                "traj",
                "synth",
                str(tmp_path),
                "--count",
                "40",
                "--writer",
                name,
                "--tiny",
                "--flush-every",
                "3",
            ],
            env=env,
            stdout=subprocess.PIPE,
        )
        for name in ("gen-a", "gen-b")
    ]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and out.split()[-1] == b"40"
    shards = list_shards(tmp_path)
    assert sorted(s.writer for s in shards) == ["gen-a", "gen-b"]
    ids = [t.id for t in stored(tmp_path)]
    assert len(ids) == len(set(ids)) == 80


def test_a_live_writer_name_cannot_be_reused(tmp_path):
    w = ShardWriter(tmp_path, "w0", cfg())
    with pytest.raises(StoreError, match="writer name 'w0' is in use"):
        ShardWriter(tmp_path, "w0", cfg())
    w.close()
    ShardWriter(tmp_path, "w0", cfg()).close()  # fine once the first one finalized its shard


def test_bad_writer_name(tmp_path):
    with pytest.raises(StoreError, match="no dots"):
        ShardWriter(tmp_path, "w.0")


def test_dedup_across_restart(tmp_path):
    trajs = make(5)
    with ShardWriter(tmp_path, "w0", cfg()) as w:
        for t in trajs:
            w.append(t)
        assert w.append(trajs[0]) is None and w.duplicates == 1  # buffered duplicate
    w = ShardWriter(tmp_path, "w0", cfg(flush_every=1))
    assert w.is_stored(trajs[3].id)
    assert all(w.append(t) is None for t in trajs)
    assert w.duplicates == 5
    w.close()
    assert len(stored(tmp_path)) == 5


def test_failed_flush_keeps_records_and_acknowledges_nothing(tmp_path, monkeypatch):
    import hpcrl.rl.store.sync as sync_mod

    w = ShardWriter(tmp_path, "w0", cfg(flush_every=100))
    trajs = make(3)
    for t in trajs:
        w.append(t)
    real = sync_mod.create_segment

    def refused(*args, **kwargs):
        raise PermissionError(13, "injected: permission denied")

    monkeypatch.setattr(sync_mod, "create_segment", refused)
    with pytest.raises(StoreError, match="3 record\\(s\\) kept in memory"):
        w.flush()
    assert w.buffered == 3 and w.total_rows == 0
    monkeypatch.setattr(sync_mod, "create_segment", real)
    assert w.flush().ids == tuple(t.id for t in trajs)
    w.close()
    assert stored(tmp_path) == trajs


def test_a_shard_directory_gone_under_the_writer_stops_it(tmp_path):
    """Recovery removes an empty shard it fenced: a writer whose shard directory is gone lost it
    (or someone deleted it) and stops rather than retry forever; a new writer takes over."""
    from hpcrl.rl.store.writer import WriterStopped

    w = ShardWriter(tmp_path, "w0", cfg(flush_every=100))
    trajs = make(3)
    for t in trajs:
        w.append(t)
    shard = w._shard
    for p in shard.iterdir():
        p.unlink()
    shard.rmdir()
    with pytest.raises(WriterStopped, match="fenced"):
        w.flush()
    assert w.total_rows == 0
    with ShardWriter(tmp_path, "w0", cfg()) as w2:  # its senders resend to the new writer
        for t in trajs:
            w2.append(t)
    assert stored(tmp_path) == trajs


def test_recovery_keeps_flushed_segments_and_quarantines_damage(tmp_path):
    """A writer process killed with open shard, a half-written segment and a damaged one."""
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from hpcrl.core.config import StoreConfig
        from hpcrl.rl.store.writer import ShardWriter
        from hpcrl.rl.record.synth import synth_trajectory, TINY_SHAPE
        rng = np.random.default_rng(0)
        w = ShardWriter({str(tmp_path)!r}, "w0", StoreConfig(flush_every=2))
        for i in range(6):
            w.append(synth_trajectory(rng, "r", "g", i, TINY_SHAPE))
        w.flush()  # three durable segments
        w.append(synth_trajectory(rng, "r", "g", 6, TINY_SHAPE))  # buffered only: lost, never acked
        (w._shard / "seg-000004-0000000000000000.h5.tmp").write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    subprocess.run([sys.executable, "-c", script], timeout=60)
    [state] = list_shards(tmp_path)
    assert not state.finalized and len(state.segment_names) == 3
    with open(state.path / state.segment_names[1], "r+b") as fh:  # disk damage in segment 2
        fh.truncate(1000)
    w = ShardWriter(tmp_path, "w0", cfg())
    [report] = w.recovered
    assert report.rows == 4 and report.segments == 2
    reasons = {q["name"]: q["reason"] for q in report.quarantined}
    assert "never acknowledged" in reasons["seg-000004-0000000000000000.h5.tmp"]
    assert "truncated" in reasons[state.segment_names[1]]
    w.close()
    recovered = next(s for s in list_shards(tmp_path) if s.name == state.name)
    assert recovered.manifest.status == "recovered" and recovered.manifest.rows == 4
    qdir = tmp_path / QUARANTINE_DIR / state.name
    assert (qdir / f"{state.segment_names[1]}.reason.txt").read_text().startswith("truncated")
    assert [t.episode for t in stored(tmp_path)] == [0, 1, 4, 5]


def test_orphan_of_another_dead_process_is_recovered_not_reused(tmp_path):
    with ShardWriter(tmp_path, "w0", cfg(flush_every=2)) as w:
        for t in make(4):
            w.append(t)
    [state] = list_shards(tmp_path)
    (state.path / MANIFEST_NAME).unlink()  # as if its writer died before finalizing
    writer, stamp, host, _, rand = state.name.split(".")
    orphan = state.path.rename(tmp_path / f"{writer}.{stamp}.{host}.{dead_pid()}.{rand}")
    w = ShardWriter(tmp_path, "w0", cfg())
    assert [r.shard for r in w.recovered] == [orphan.name]
    w.close()
    assert len(stored(tmp_path)) == 4


# -- segment verification ---------------------------------------------------------------------


def flip_token_byte(path: Path) -> None:
    with h5py.File(path, "r") as f:
        offset = f["tokens"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        b = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([b[0] ^ 0x40]))


def test_read_segment_detects_bit_flips_truncation_and_manifest_mismatch(tmp_path):
    with ShardWriter(tmp_path, "w0", cfg(flush_every=4)) as w:
        for t in make(8):
            w.append(t)
    [state] = list_shards(tmp_path)
    a, b = (state.path / n for n in state.segment_names)
    info_a, info_b = state.manifest.segments
    with pytest.raises(SegmentError, match="the manifest says 5"):
        read_segment(a, type(info_a)(**{**info_a.__dict__, "rows": 5}))
    with pytest.raises(SegmentError, match="manifest"):
        read_segment(a, type(info_a)(**{**info_a.__dict__, "crc32": info_a.crc32 ^ 1}))
    flip_token_byte(a)
    with pytest.raises(SegmentError, match="checksum mismatch"):
        read_segment(a, info_a)
    with open(b, "r+b") as fh:
        fh.truncate(b.stat().st_size // 2)
    with pytest.raises(SegmentError, match="truncated"):
        read_segment(b, info_b)


# -- reader -------------------------------------------------------------------------------------


def test_store_service_sigterm_finalizes(tmp_path):
    """`tests/store_service.py` exits cleanly on SIGTERM with its shard finalized."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "store_service.py"), str(tmp_path), "--bind-host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().startswith("ready tcp://127.0.0.1:")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert list_shards(tmp_path / "trajectories") == []  # nothing written, empty shard removed
