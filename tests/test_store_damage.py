"""Damaged segment files: every damage is a SegmentError, recovery quarantines, the
reader rejects and goes on, and the checksum covers the enum tables and the row count too."""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcrl.core.config import StoreConfig
from hpcrl.rl.record.columns import Columns
from hpcrl.rl.record.synth import SynthShape, synth_trajectory
from hpcrl.rl.store.layout import (
    MANIFEST_NAME,
    QUARANTINE_DIR,
    SegmentError,
    list_shards,
    read_segment,
    recover_shard,
)
from hpcrl.rl.store.reader import StoreReader
from hpcrl.rl.store.writer import ShardWriter

SMALL = SynthShape(first_prompt=(20, 60), later_prompt=(2, 8), action=(10, 60), observation=(0, 40))


def make(n: int, start: int = 0, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [synth_trajectory(rng, "r", "g", start + i, SMALL) for i in range(n)]


def write_store(path: Path, n: int = 12, flush_every: int = 4, **kw) -> list:
    trajs = make(n)
    cfg = StoreConfig(flush_every=flush_every, flush_interval_s=30.0, flush_idle_s=30.0, **kw)
    with ShardWriter(path, "w0", cfg) as w:
        for t in trajs:
            w.append(t)
    return trajs


def mutations(data: bytes, rng: random.Random, n: int):
    """`n` damaged copies of a file: bit flips anywhere, in the first 4 KiB (header and HDF5
    metadata), overwritten runs, truncations, appended bytes, zeroed 512-byte blocks."""
    out = []
    while len(out) < n:
        b = bytearray(data)
        kind = rng.choice(["bit", "head", "run", "truncate", "append", "zero"])
        if kind == "bit":
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif kind == "head":
            i = rng.randrange(min(4096, len(b)))
            b[i] ^= rng.randrange(1, 256)
        elif kind == "run":
            i = rng.randrange(len(b) - 16)
            b[i : i + 16] = bytes(rng.randrange(256) for _ in range(16))
        elif kind == "truncate":
            del b[rng.randrange(len(b)) :]
        elif kind == "append":
            b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            i = rng.randrange(len(b) // 512) * 512
            b[i : i + 512] = bytes(len(b[i : i + 512]))
        if bytes(b) != data:
            out.append((kind, bytes(b)))
    return out


def test_every_damage_is_a_segment_error(tmp_path):
    """Fuzzed copies of real segments: read_segment raises SegmentError, and only that, for
    every one of them (the checksum covers every byte); a partial read either raises
    SegmentError or returns exactly the undamaged table."""
    write_store(tmp_path / "store")
    [state] = list_shards(tmp_path / "store")
    rng = random.Random(16)
    target = tmp_path / "seg-000001-0000000000000000.h5"
    undetected, partial_wrong = [], []
    for name in state.segment_names:
        original = (state.path / name).read_bytes()
        traj = read_segment(state.path / name).traj
        for kind, data in mutations(original, rng, 150):
            target.write_bytes(data)
            try:
                read_segment(target)
                undetected.append(kind)
            except SegmentError:
                pass  # anything else propagates and fails the test
            try:
                got = read_segment(target, fields=("traj",)).traj
                if got.tobytes() != traj.tobytes():
                    partial_wrong.append(kind)
            except SegmentError:
                pass
    assert not undetected, f"damage read as good data: {undetected}"
    assert not partial_wrong, f"partial reads returned damaged tables: {partial_wrong}"


def test_recovery_quarantines_damaged_segments_and_terminates(tmp_path):
    store = tmp_path / "store"
    trajs = write_store(store, n=12, flush_every=2)  # six segments
    [state] = list_shards(store)
    (state.path / MANIFEST_NAME).unlink()  # as if its writer died: recovery must verify each
    rng = random.Random(3)
    damaged = state.segment_names[1::2]
    for name in damaged:
        data = (state.path / name).read_bytes()
        (state.path / name).write_bytes(mutations(data, rng, 1)[0][1])
    report = recover_shard(store, state.path)
    assert sorted(q["name"] for q in report.quarantined) == sorted(damaged)
    assert report.segments == 3 and report.rows == 6
    assert sorted(p.name for p in (store / QUARANTINE_DIR / state.name).glob("seg-*.h5")) == sorted(damaged)
    kept = {t.id for t in StoreReader(store)}
    assert kept == {t.id for i, t in enumerate(trajs) if (i // 2) % 2 == 0}


def test_reader_rejects_fuzzed_segments_and_goes_on(tmp_path):
    """A finalized shard whose segments are damaged in every way: the reader hands out exactly
    the intact ones, rejects the rest with a reason, and terminates."""
    store = tmp_path / "store"
    trajs = write_store(store, n=40, flush_every=2)  # twenty segments
    [state] = list_shards(store)
    rng = random.Random(5)
    intact = set()
    for i, name in enumerate(state.segment_names):
        if i % 4 == 0:
            intact |= {t.id for t in trajs[2 * i : 2 * i + 2]}
            continue
        data = (state.path / name).read_bytes()
        (state.path / name).write_bytes(mutations(data, rng, 1)[0][1])
    reader = StoreReader(store)
    got = [t.id for t in reader]
    assert set(got) == intact and len(got) == len(intact)
    assert len(reader.rejected) == 15 and all(reason for _, reason in reader.rejected)


def test_checksum_covers_the_enum_tables_and_rows(tmp_path):
    """A segment whose JSON attribute is rewritten consistently (valid HDF5, the arrays untouched):
    swapped sandbox names or a changed row count must not read as good data."""
    write_store(tmp_path / "store", n=4, flush_every=4)
    [state] = list_shards(tmp_path / "store")
    seg = state.path / state.segment_names[0]
    for change in ("names", "rows"):
        bad = tmp_path / f"{change}-{seg.name}"
        shutil.copy(seg, bad)
        with h5py.File(bad, "r+") as f:
            meta = json.loads(f.attrs["hpcrl_segment"])
            if change == "names":
                names = meta["sandbox_names"]
                names[1], names[3] = names[3], names[1]  # "ok" <-> "timeout"
            else:
                meta["rows"] += 0  # same value, rewritten: the bytes HDF5 wrote still change
                meta["writer"] = "someone-else"
            f.attrs["hpcrl_segment"] = json.dumps(meta, sort_keys=True)
        with pytest.raises(SegmentError):
            read_segment(bad)


def _write_v1(path: Path, cols: Columns) -> None:
    """A segment as hpcrl wrote it before format v2: five datasets and a JSON attribute whose
    CRC-32 covers the five arrays only."""
    crc = 0
    for _, arr in cols.arrays():
        crc = zlib.crc32(np.ascontiguousarray(arr).view(np.uint8).reshape(-1), crc)
    with h5py.File(path, "w") as f:
        for name, arr in cols.arrays():
            f.create_dataset(name, data=arr, chunks=(max(1, len(arr)),), maxshape=(None,))
        meta = {
            "format": "hpcrl-trajectory-segment",
            "format_version": 1,
            "rows": cols.rows,
            "crc32": crc,
            "truncation_names": list(cols.truncation_names),
            "sandbox_names": list(cols.sandbox_names),
            "compression": "none",
        }
        f.attrs["hpcrl_segment"] = json.dumps(meta, sort_keys=True)


def test_format_v1_segments_still_read(tmp_path):
    trajs = make(6)
    shard = tmp_path / "store" / "w0.20261201T000000u000000.host.1.abcd1234"
    shard.mkdir(parents=True)
    _write_v1(shard / "seg-000001-0000000000000001.h5", Columns.encode(trajs[:3]))
    _write_v1(shard / "seg-000002-0000000000000002.h5", Columns.encode(trajs[3:]))
    cols = read_segment(shard / "seg-000001-0000000000000001.h5")
    assert [cols.trajectory(i) for i in range(cols.rows)] == trajs[:3]
    assert read_segment(shard / "seg-000002-0000000000000002.h5", fields=("traj",)).ids() == [t.id for t in trajs[3:]]
    report = recover_shard(tmp_path / "store", shard)  # a shard of v1 segments recovers as before
    assert report.rows == 6 and not report.quarantined
    assert [t.id for t in StoreReader(tmp_path / "store")] == [t.id for t in trajs]
    with h5py.File(shard / "seg-000001-0000000000000001.h5", "r+") as f:
        f["tokens"][0] ^= 1  # v1 still checks its arrays
    with pytest.raises(SegmentError, match="checksum mismatch"):
        read_segment(shard / "seg-000001-0000000000000001.h5")
