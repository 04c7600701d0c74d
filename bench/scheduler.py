"""Scheduler benchmark: the simulated policies on every shipped trace, and the live run against its knobs.

    .venv/bin/python bench/scheduler.py            # about a minute on 2 cores
    .venv/bin/python bench/scheduler.py --quick    # without the no-drop tables and the knob grid

1. The simulator's table of policies on every shipped trace (throughput against the fair sync),
   dropping stale episodes and with every started episode trained (--no-drop). `backfill` is the
   live run: the coordinator's flow control, lending, and rollout jobs planned by the live
   planner's rounds against the simulated Slurm partition of the trace (slurm/sim/); its rollout
   jobs' line says what they did and how much later other users' jobs started than without them.
2. The live run on sandbox-heavy against generators.lend_episodes and the rollout-job caps
   (scheduler.max_rollout_jobs = max_rollout_gpus): busy fraction / trajectories per GPU-hour of
   the GPUs it held.
The planner's decision time at scale is bench/planner.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="drop-stale tables only, no knob grid")
    args = ap.parse_args()
    from hpcrl.slurm.sim.run import POLICIES, format_table, simulate
    from hpcrl.slurm.sim.trace import World, load_trace

    t_all = time.monotonic()
    print("1. simulated policies (trajectories per GPU-hour relative to sync, the fair baseline)")
    for path in sorted((ROOT / "slurm" / "sim" / "traces").glob("*.yaml")):
        for drop in (True,) if args.quick else (True, False):
            trace = load_trace(path)
            trace = dataclasses.replace(trace, training=dataclasses.replace(trace.training, drop_stale=drop))
            world = World(trace)
            t0 = time.monotonic()
            results = [simulate(trace, p, world=world) for p in POLICIES]
            part = ""
            if trace.slurm is not None:
                part = f", partition {trace.slurm.nodes} x {trace.slurm.gpus_per_node} GPUs shared"
            print(
                f"\n  {trace.name}{'' if drop else ' --no-drop (every started episode trained)'}: "
                f"{trace.cluster.learner_gpus}+{trace.cluster.generator_gpus} GPUs{part}, "
                f"{len(world.domains)} domains, {trace.training.steps} steps x {trace.training.batch_size}, "
                f"staleness bound {trace.training.max_staleness} ({time.monotonic() - t0:.1f} s to simulate)"
            )
            print("  " + format_table(results).replace("\n", "\n  "))
            b = results[-1]
            j = b.rollout_jobs
            others = j.get("others")
            print(
                f"  backfill: busy {b.busy_fraction:.1%} = useful {b.useful_fraction:.1%} + dropped "
                f"{b.dropped_fraction:.1%} + open at the end {b.open_fraction:.1%}; rollout jobs {j['submitted']} "
                f"submitted, {j['started']} started, {j['withdrawn']} withdrawn, {j['gave_way']} gave way, "
                f"{j['rollout_gpu_h']:.1f} GPU-h ({b.rollout.busy_fraction:.0%} busy), {j['episodes_handed_back']} "
                "episodes handed back"
                + (
                    f"; other users' start delay max {others['max_start_delay_s']:.0f} s, mean "
                    f"{others['mean_start_delay_s']:.1f} s"
                    if others
                    else ""
                )
            )
    if not args.quick:
        print("\n2. backfill on sandbox-heavy: busy fraction / trajectories per GPU-hour held")
        trace = load_trace(ROOT / "slurm" / "sim" / "traces" / "sandbox-heavy.yaml")
        world = World(trace)
        caps, lends = (0, 16, 32), (0, 4, 8)
        print("  lend_episodes \\ rollout jobs " + "".join(f"{c:>16}" for c in caps))
        for lend in lends:
            cells = []
            for cap in caps:
                t = dataclasses.replace(
                    trace,
                    training=dataclasses.replace(trace.training, lend_episodes=lend),
                    scheduler=dataclasses.replace(trace.scheduler, max_rollout_jobs=cap, max_rollout_gpus=cap),
                )
                r = simulate(t, "backfill", world=world)
                cells.append(f"{r.busy_fraction:.1%} / {r.throughput_per_gpu_hour:.1f}")
            print(f"  {lend:>28} " + "".join(f"{x:>16}" for x in cells))
    print(f"\nwall {time.monotonic() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
