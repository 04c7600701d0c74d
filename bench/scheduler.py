"""Scheduler benchmark: packer decision latency at 10,000 pending tasks x 10,000 GPUs, and the policy table.

    .venv/bin/python bench/scheduler.py            # about a minute on 2 cores
    .venv/bin/python bench/scheduler.py --quick    # smaller sizes, for a look

1. Decision latency. A steady state of N GPUs with owners' idle windows and M pending rollout
   tasks (lognormal estimates, 10 policy versions); then a stream of the events the real
   components send: a borrowed task finishes (the GPU takes the next fitting task), a task
   arrives (the tightest free window that fits), an owner takes its GPU back (preempting,
   re-queueing), an owner lends its GPU again. Every packer call is timed. Side by side on the
   same event stream: the linear-scan ReferencePacker, whose answers must be identical.
2. The simulator's table of policies on every shipped trace (throughput against the fair sync),
   dropping stale episodes and with every started episode trained (--no-drop).
3. How much backfill's result depends on its two knobs (min_chunk_s, reclaim_quantile).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(packer, n_gpus: int, n_pending: int, rng: random.Random):
    """Open a window on every GPU, then submit tasks until n_pending wait (most GPUs then run one)."""
    now = 0.0
    for g in range(n_gpus):
        packer.open_window(g, now, now + rng.lognormvariate(math.log(30.0), 1.0))
    next_id = 0
    while packer.pending < n_pending:
        packer.submit(_task(next_id, rng), now)
        next_id += 1
    return now, next_id


def _task(i: int, rng: random.Random):
    from hpcrl.slurm.backfill.packer import RolloutTask

    return RolloutTask(i, f"d{i % 300}", rng.lognormvariate(math.log(8.0), 1.0), rng.randrange(10), i)


def events(packer, n_ops: int, n_gpus: int, n_pending: int, seed: int, record: list | None = None):
    """Drive `packer` with a deterministic event stream; returns per-call times in ns."""
    rng = random.Random(seed)
    now, next_id = build(packer, n_gpus, n_pending, rng)
    busy = {g for g in range(n_gpus) if packer.running_on(g) is not None}
    open_ = set(range(n_gpus))
    closed: list[int] = []
    busy_list = sorted(busy)
    times = []
    clock = time.perf_counter_ns
    for _ in range(n_ops):
        now += 0.001
        r = rng.random()
        if r < 0.45 and busy_list:
            i = rng.randrange(len(busy_list))
            g = busy_list[i]
            until = now + rng.lognormvariate(math.log(30.0), 1.0) if rng.random() < 0.5 else None
            t0 = clock()
            out = packer.finish(g, now, until=until)
            times.append(clock() - t0)
            if out is None:
                busy_list[i] = busy_list[-1]
                busy_list.pop()
                busy.discard(g)
        elif r < 0.80:
            t = _task(next_id, rng)
            next_id += 1
            t0 = clock()
            out = packer.submit(t, now)
            times.append(clock() - t0)
            if out is not None:
                busy.add(out.gpu)
                busy_list.append(out.gpu)
        elif r < 0.90 and len(open_) > n_gpus // 2:
            g = rng.choice(busy_list) if busy_list and rng.random() < 0.7 else rng.randrange(n_gpus)
            if g not in open_:
                continue
            t0 = clock()
            out = packer.close_window(g, now)
            times.append(clock() - t0)
            open_.discard(g)
            closed.append(g)
            if g in busy:
                busy.discard(g)
                busy_list.remove(g)
            if out.replacement is not None:
                busy.add(out.replacement.gpu)
                busy_list.append(out.replacement.gpu)
        elif closed:
            g = closed.pop(rng.randrange(len(closed)))
            t0 = clock()
            out = packer.open_window(g, now, now + rng.lognormvariate(math.log(30.0), 1.0))
            times.append(clock() - t0)
            open_.add(g)
            if out is not None:
                busy.add(g)
                busy_list.append(g)
        else:
            continue
        if record is not None:
            record.append(out)
    return times


def latency(label: str, make, n_gpus: int, n_pending: int, n_ops: int, seed: int = 1, record=None) -> dict:
    packer = make()
    times = events(packer, n_ops, n_gpus, n_pending, seed, record)
    us = sorted(t / 1000 for t in times)
    return {
        "label": label,
        "gpus": n_gpus,
        "pending": n_pending,
        "calls": len(us),
        "mean_us": statistics.fmean(us),
        "p50_us": us[len(us) // 2],
        "p99_us": us[int(len(us) * 0.99)],
        "p999_us": us[int(len(us) * 0.999)],
        "max_us": us[-1],
        "pending_after": packer.pending,
    }


def fmt(r: dict) -> str:
    return (
        f"  {r['label']:<26} {r['gpus']:>7} GPUs {r['pending']:>7} pending: {r['calls']:>6} calls, "
        f"mean {r['mean_us']:8.1f} us, p50 {r['p50_us']:6.1f}, p99 {r['p99_us']:6.1f}, "
        f"p99.9 {r['p999_us']:7.1f}, max {r['max_us']:8.1f} us"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    args = ap.parse_args()
    from hpcrl.slurm.backfill.packer import GapPacker
    from hpcrl.slurm.sim.run import POLICIES, format_table, simulate
    from hpcrl.slurm.sim.trace import World, load_trace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the oracle lives with the tests
    from packer_ref import ReferencePacker

    t_all = time.monotonic()
    big = 2_000 if args.quick else 10_000
    ops = 20_000 if args.quick else 100_000
    print("1. packer decision latency (GapPacker: class heaps + sorted free-window index)")
    rows = [latency("GapPacker", GapPacker, big, big, ops)]
    if not args.quick:
        rows.append(latency("GapPacker", GapPacker, big, 100_000, ops))
    for r in rows:
        print(fmt(r))
    target = rows[0]
    print(
        f"  target < 1 ms per decision at {target['pending']:,} pending x {target['gpus']:,} GPUs: "
        f"mean {target['mean_us'] / 1000:.3f} ms, p99 {target['p99_us'] / 1000:.3f} ms "
        f"-> {'met' if target['p99_us'] < 1000 else 'NOT met'}"
    )

    side = 1_000 if args.quick else 2_000
    side_ops = 3_000 if args.quick else 6_000
    fast_out, ref_out = [], []
    fast = latency("GapPacker", GapPacker, side, side, side_ops, seed=2, record=fast_out)
    ref = latency("ReferencePacker (scan)", ReferencePacker, side, side, side_ops, seed=2, record=ref_out)
    same = fast_out == ref_out
    print(f"  side by side on one event stream ({side} GPUs x {side} pending), identical answers: {same}")
    print(fmt(fast))
    print(fmt(ref))
    print(f"  linear scan / indexed: {ref['mean_us'] / fast['mean_us']:.0f}x slower per call")
    if not same:
        print("ERROR: the indexed packer and the reference disagree", file=sys.stderr)
        return 1

    print("\n2. simulated policies (trajectories per GPU-hour relative to sync, the fair baseline)")
    traces = sorted((ROOT / "slurm" / "sim" / "traces").glob("*.yaml"))
    for path in traces:
        for drop in (True, False):
            trace = load_trace(path)
            trace = dataclasses.replace(trace, training=dataclasses.replace(trace.training, drop_stale=drop))
            world = World(trace)
            t0 = time.monotonic()
            results = [simulate(trace, p, world=world) for p in POLICIES]
            print(
                f"\n  {trace.name}{'' if drop else ' --no-drop (every started episode trained)'}: "
                f"{trace.cluster.learner_gpus}+{trace.cluster.generator_gpus} GPUs, "
                f"{len(world.domains)} domains, {trace.training.steps} steps x {trace.training.batch_size}, "
                f"staleness bound {trace.training.max_staleness} ({time.monotonic() - t0:.1f} s to simulate)"
            )
            print("  " + format_table(results).replace("\n", "\n  "))
            b = results[-1]
            print(
                f"  backfill: busy {b.busy_fraction:.1%} = useful {b.useful_fraction:.1%} + dropped "
                f"{b.dropped_fraction:.1%} + open at the end {b.open_fraction:.1%}; {b.decisions} packer decisions"
            )

    print("\n3. backfill on heavy-tail-300 against its knobs (busy fraction / traj per GPU-h)")
    trace = load_trace(ROOT / "slurm" / "sim" / "traces" / "heavy-tail-300.yaml")
    world = World(trace)
    chunks, quants = (0.0, 3.0, 8.0, 20.0), (0.1, 0.25, 0.5)
    print("  min_chunk_s \\ reclaim_quantile " + "".join(f"{q:>16}" for q in quants))
    for c in chunks:
        cells = []
        for q in quants:
            t = dataclasses.replace(
                trace, scheduler=dataclasses.replace(trace.scheduler, min_chunk_s=c, reclaim_quantile=q)
            )
            r = simulate(t, "backfill", world=world)
            cells.append(f"{r.busy_fraction:.1%} / {r.throughput_per_gpu_hour:.1f}")
        print(f"  {c:>29g} " + "".join(f"{x:>16}" for x in cells))
    print(f"\nwall {time.monotonic() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
