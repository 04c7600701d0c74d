"""Trajectory store throughput: HDF5 shard writer vs raw numpy vs JSONL, the reader, and restart.

    .venv/bin/python bench/store.py [--count 1536] [--flush-every 64] [--repeat 5] [--dir /tmp] [--quick] [--json]

All three writers get the same trajectories (synthetic multi-step episodes of ~4k tokens) and
the same durability: data fsynced once per flush of `--flush-every` trajectories, and the
directory fsynced once the file is new (a created file's name is not durable until then).

* hdf5:  the real ShardWriter (append -> one immutable segment per flush -> fsync, rename,
         fsync dir; manifest at close).
* raw:   the same columns (same encoder and encode buffers, same bytes) appended with
         ndarray.tofile to one file.
* jsonl: one json.dumps(trajectory.to_dict()) line per trajectory (what many RL frameworks dump).
* hdf5 columns / raw columns: the wire path. The trajectories arrive as pre-encoded `Columns`
         batches cut the way TrajectorySender cuts them (up to 128 or 1 MiB); the writer takes
         them with ShardWriter.append_columns, raw appends each batch's arrays to one file;
         both sync once `--flush-every` rows have accumulated.

"payload" is the bytes of the flat arrays and record tables (what raw writes); every rate is
payload MB/s so the figures compare. Each variant runs `--repeat` times, interleaved, and the
median is reported. The storage-only lines time pre-encoded columns, isolating the file format.

restart: a writer started on a store another writer of its name filled and closed, for two store
sizes ten times apart (`--restart-sizes`): `restart_s` with the shards' indexes (the writer's
dedup check opens them, reading no segment) against `restart_legacy_s`, the same store with the
indexes removed (every segment's id column read, as before indexes existed), interleaved.

--json prints one object: writer_mb_s and raw_mb_s (the wire path, payload MB/s), the other
variants' rates, and `restart` with `sizes`, `restart_s` and `restart_legacy_s` per size.

The ratios depend on the machine: where an fsync is slow (ms), raw waits for each one while the
writer syncs on a background thread; where it is fast (tmpfs, a fresh VM's cached disk), both are
CPU-bound and the ratio is the CPU cost of the format. The first line gives the fsync latency of
`--dir` and the load average, so a figure can be read with them; run it on both kinds of disk
(e.g. `--dir /dev/shm` for the CPU-bound case).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcrl.core.config import StoreConfig
from hpcrl.rl.record.columns import Columns, wire_bytes
from hpcrl.rl.record.flat import EncodeBuffers
from hpcrl.rl.record.synth import SynthShape, synth_trajectory
from hpcrl.rl.store.index import INDEX_NAME
from hpcrl.rl.store.reader import StoreReader
from hpcrl.rl.store.segment import publish_segment, write_segment
from hpcrl.rl.store.writer import ShardWriter


def batches(trajs, n):
    return [trajs[i : i + n] for i in range(0, len(trajs), n)]


def run_hdf5(trajs, flush_every, root: Path) -> float:
    t0 = time.perf_counter()
    with ShardWriter(root, "bench", StoreConfig(flush_every=flush_every, flush_interval_s=3600)) as w:
        for t in trajs:
            w.append(t)
    return time.perf_counter() - t0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_raw(trajs, flush_every, root: Path) -> float:
    t0 = time.perf_counter()
    bufs = EncodeBuffers()  # as the writer encodes: same encoder, same buffer reuse
    with open(root / "raw.bin", "wb") as fh:
        for i, batch in enumerate(batches(trajs, flush_every)):
            for _, arr in Columns.encode(batch, bufs).arrays():
                arr.tofile(fh)
            fh.flush()
            os.fsync(fh.fileno())
            if i == 0:
                fsync_dir(root)  # the new file's name, as the writer syncs each segment's
    return time.perf_counter() - t0


def run_jsonl(trajs, flush_every, root: Path) -> float:
    t0 = time.perf_counter()
    with open(root / "trajs.jsonl", "w") as fh:
        for i, batch in enumerate(batches(trajs, flush_every)):
            for t in batch:
                fh.write(json.dumps(t.to_dict()) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            if i == 0:
                fsync_dir(root)
    return time.perf_counter() - t0


def wire_batches(trajs, batch_max=128, batch_bytes=1 << 20) -> list[Columns]:
    """The trajectories as the sender's batches (same cut rule), pre-encoded."""
    out, batch, size = [], [], 0
    for t in trajs:
        n = wire_bytes(t)
        if batch and (len(batch) >= batch_max or size + n > batch_bytes):
            out.append(Columns.encode(batch))
            batch, size = [], 0
        batch.append(t)
        size += n
    return out + ([Columns.encode(batch)] if batch else [])


def run_hdf5_columns(wire, flush_every, root: Path) -> float:
    t0 = time.perf_counter()
    with ShardWriter(root, "bench", StoreConfig(flush_every=flush_every, flush_interval_s=3600)) as w:
        for cols in wire:
            w.append_columns(cols)
    return time.perf_counter() - t0


def run_raw_columns(wire, flush_every, root: Path) -> float:
    t0 = time.perf_counter()
    with open(root / "raw.bin", "wb") as fh:
        rows = synced = 0
        for cols in wire:
            for _, arr in cols.arrays():
                arr.tofile(fh)
            rows += cols.rows
            if rows >= flush_every:  # the writer's count rule: sync once flush_every have accumulated
                fh.flush()
                os.fsync(fh.fileno())
                if not synced:
                    fsync_dir(root)
                synced, rows = synced + 1, 0
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def fsync_latency_ms(root: Path, nbytes: int) -> float:
    """Median time to fsync a new file of `nbytes` just written in `root` (the write not timed)."""
    data = os.urandom(nbytes)
    times = []
    for i in range(9):
        path = root / f"fsync-probe-{i}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(fd, data)
        t0 = time.perf_counter()
        os.fsync(fd)
        times.append(time.perf_counter() - t0)
        os.close(fd)
        path.unlink()
    return statistics.median(times) * 1e3


def run_hdf5_storage(cols_list, root: Path) -> float:
    t0 = time.perf_counter()
    for i, cols in enumerate(cols_list):
        path = root / f"seg-{i:06d}-{0:016d}.h5"
        tmp = path.with_name(path.name + ".tmp")
        write_segment(tmp, cols, {"seq": i + 1})
        publish_segment(tmp, path)  # what the writer's sync thread does, here synchronously
    return time.perf_counter() - t0


def run_raw_storage(cols_list, root: Path) -> float:
    t0 = time.perf_counter()
    with open(root / "raw.bin", "wb") as fh:
        for i, cols in enumerate(cols_list):
            for _, arr in cols.arrays():
                arr.tofile(fh)
            fh.flush()
            os.fsync(fh.fileno())
            if i == 0:
                fsync_dir(root)
    return time.perf_counter() - t0


def run_reader(root: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    reader = StoreReader(root)
    n = 0
    while batch := reader.next_batch(256).trajectories:
        n += len(batch)
    return time.perf_counter() - t0, n


def restart_bench(root: Path, sizes: list[int], rounds: int) -> dict:
    """Seconds to start a writer on a closed store of each size, with and without the indexes."""
    shape = SynthShape(first_prompt=(20, 40), later_prompt=(2, 6), action=(10, 30), observation=(0, 20))
    cfg = StoreConfig(flush_interval_s=3600, shard_max_rows=4096)
    out: dict = {"sizes": sizes, "restart_s": [], "restart_legacy_s": [], "segments": [], "shards": []}
    for n in sizes:
        rng = np.random.default_rng(1)
        store = root / f"restart-{n}"
        with ShardWriter(store, "w0", cfg) as w:
            for i in range(n):
                w.append(synth_trajectory(rng, "bench", "gen-0", i, shape))
        shards = [p for p in store.iterdir() if p.is_dir()]
        indexes = {p: (p / INDEX_NAME).read_bytes() for p in shards}
        with_idx, legacy = [], []
        for _ in range(rounds):
            for kind in ("index", "legacy"):
                for p, data in indexes.items():  # the store as the variant needs it
                    if kind == "index":
                        (p / INDEX_NAME).write_bytes(data)
                    else:
                        (p / INDEX_NAME).unlink(missing_ok=True)
                t0 = time.perf_counter()
                w = ShardWriter(store, "w0", cfg)
                dt = time.perf_counter() - t0
                w.close()  # nothing appended: its empty shard is removed
                (with_idx if kind == "index" else legacy).append(dt)
        out["restart_s"].append(round(statistics.median(with_idx), 4))
        out["restart_legacy_s"].append(round(statistics.median(legacy), 4))
        out["segments"].append(sum(1 for p in shards for _ in p.glob("seg-*.h5")))
        out["shards"].append(len(shards))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=1536)
    p.add_argument("--flush-every", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--dir", default=None, help="where to write (default: a temp dir; use the filesystem you care about)"
    )
    p.add_argument("--restart-sizes", default="2000,20000", help="store sizes (trajectories) for the restart")
    p.add_argument("--quick", action="store_true", help="512 trajectories, 3 repeats, restart sizes 1000,10000")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (the table goes to stderr)")
    args = p.parse_args()
    if args.quick:
        args.count, args.repeat, args.restart_sizes = 512, 3, "1000,10000"
    if args.json:
        sys.stdout = sys.stderr  # the human-readable lines; the JSON goes to the real stdout
    restart_sizes = [int(x) for x in args.restart_sizes.split(",")]
    rng = np.random.default_rng(0)
    trajs = [synth_trajectory(rng, "bench", "gen-0", i) for i in range(args.count)]
    cols_list = [Columns.encode(b) for b in batches(trajs, args.flush_every)]
    wire = wire_batches(trajs)
    payload = sum(c.nbytes for c in cols_list)
    tokens = sum(t.n_tokens for t in trajs)
    base = Path(tempfile.mkdtemp(prefix="hpcrl-bench-store-", dir=args.dir))
    print(
        f"{args.count} trajectories, {tokens / args.count:.0f} tokens and {payload / args.count / 1e3:.1f} kB each, "
        f"{sum(len(t.steps) for t in trajs) / args.count:.1f} steps; flush every {args.flush_every}; "
        f"payload {payload / 1e6:.1f} MB; {len(wire)} wire batches; dir {base}"
    )
    print(
        f"fsync of a new {payload / len(cols_list) / 1e6:.1f} MB file here: "
        f"{fsync_latency_ms(base, payload // len(cols_list)):.2f} ms; load average {os.getloadavg()[0]:.2f}"
    )
    times: dict[str, list[float]] = {}
    variants = {
        "hdf5": lambda d: run_hdf5(trajs, args.flush_every, d),
        "raw": lambda d: run_raw(trajs, args.flush_every, d),
        "jsonl": lambda d: run_jsonl(trajs, args.flush_every, d),
        "hdf5 storage-only": lambda d: run_hdf5_storage(cols_list, d),
        "raw storage-only": lambda d: run_raw_storage(cols_list, d),
        "hdf5 columns": lambda d: run_hdf5_columns(wire, args.flush_every, d),
        "raw columns": lambda d: run_raw_columns(wire, args.flush_every, d),
    }
    read_times = []
    sizes = {}
    try:
        for r in range(args.repeat):
            for name, fn in variants.items():
                d = base / f"{name.replace(' ', '_')}-{r}"
                d.mkdir()
                # Start each variant with no dirty pages or pending deletes of the previous one
                # in the journal: its fsyncs would otherwise pay for them.
                os.sync()
                times.setdefault(name, []).append(fn(d))
                sizes[name] = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                if name in ("hdf5", "hdf5 columns"):
                    dt, n = run_reader(d)
                    assert n == args.count, f"reader returned {n} of {args.count}"
                    if name == "hdf5":
                        read_times.append(dt)
                shutil.rmtree(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: payload / v / 1e6 for k, v in med.items()}
    print(f"{'variant':<20} {'median s':>9} {'payload MB/s':>13} {'traj/s':>9} {'on-disk MB':>11}")
    for k in variants:
        print(f"{k:<20} {med[k]:>9.3f} {rate[k]:>13.1f} {args.count / med[k]:>9.0f} {sizes[k] / 1e6:>11.1f}")
    rd = statistics.median(read_times)
    print(f"{'reader (hdf5)':<20} {rd:>9.3f} {payload / rd / 1e6:>13.1f} {args.count / rd:>9.0f}")
    best = {k: min(v) for k, v in times.items()}
    print(
        f"ratio hdf5/raw               {med['raw'] / med['hdf5']:.2f}   (target >= 0.70; best-of-{args.repeat}: "
        f"{best['raw'] / best['hdf5']:.2f})"
    )
    print(f"ratio hdf5/jsonl             {med['jsonl'] / med['hdf5']:.2f}   (target >= 5)")
    print(f"ratio storage-only hdf5/raw  {med['raw storage-only'] / med['hdf5 storage-only']:.2f}")
    print(
        f"ratio columns hdf5/raw       {med['raw columns'] / med['hdf5 columns']:.2f}   (best-of-{args.repeat}: "
        f"{best['raw columns'] / best['hdf5 columns']:.2f})"
    )
    print(f"ratio reader/hdf5 writer     {med['hdf5'] / rd:.2f}")
    base = Path(tempfile.mkdtemp(prefix="hpcrl-bench-store-", dir=args.dir))
    try:
        restart = restart_bench(base, restart_sizes, args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for i, n in enumerate(restart_sizes):
        print(
            f"restart, {n} trajectories ({restart['segments'][i]} segments, {restart['shards'][i]} shards): "
            f"{restart['restart_s'][i]:.4f} s with indexes, {restart['restart_legacy_s'][i]:.4f} s reading segments"
        )
    if args.json:
        report = {
            "count": args.count,
            "payload_mb": round(payload / 1e6, 2),
            "writer_mb_s": round(rate["hdf5 columns"], 1),
            "raw_mb_s": round(rate["raw columns"], 1),
            "writer_over_raw": round(med["raw columns"] / med["hdf5 columns"], 3),
            "rates_mb_s": {k: round(v, 1) for k, v in rate.items()},
            "reader_mb_s": round(payload / rd / 1e6, 1),
            "restart": restart,
            "restart_s": restart["restart_s"],
            "load_average": round(os.getloadavg()[0], 2),
        }
        sys.__stdout__.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
