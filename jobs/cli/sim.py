"""`hpcrl sim TRACE.yaml --policy sync|async|backfill|all [--json] [--plot FILE]`: simulate GPU utilization.

    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy backfill --plot util.png
    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy all          # the policy table

Runs the rollout scheduling policies on a simulated clock over a trace (format:
slurm/sim/traces/README.md) and prints GPU busy fractions per role and overall, throughput in
trajectories per GPU-hour, and the staleness of the trajectories trained on. A bad trace or
argument exits 2 with one line naming the key or option.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate GPU utilization of the sync, async and backfill rollout policies on a trace",
        description=(
            "Drive the rollout scheduler with a simulated clock over TRACE (GPUs, sandbox slots, hundreds of "
            "domains with heavy-tailed generation and sandbox times). Prints GPU busy fraction per role and "
            "overall, trajectories per GPU-hour and the staleness distribution. Example traces: slurm/sim/traces/."
        ),
    )
    p.add_argument("trace", help="trace YAML file, e.g. slurm/sim/traces/heavy-tail-300.yaml")
    p.add_argument(
        "--policy",
        choices=("sync", "async", "backfill", "all"),
        default=None,
        help="scheduling policy (default: the trace's scheduler.policy); 'all' prints the table of policies",
    )
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw the GPU utilization timeline into FILE (.png, .pdf or .svg)")
    p.add_argument("--bins", type=int, default=240, help="time bins of the --plot timeline (default 240)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcrl.jobs.cli import UsageError

    if args.plot:
        plot = Path(args.plot)
        if plot.suffix.lower() not in _PLOT_SUFFIXES:
            raise UsageError(f"--plot {args.plot}: the file name must end in {', '.join(_PLOT_SUFFIXES)}")
        if not plot.parent.is_dir():
            raise UsageError(f"--plot {args.plot}: folder {plot.parent} does not exist; create it or pick another path")
        if args.policy == "all":
            raise UsageError("--plot draws one policy's timeline; pick --policy sync, async or backfill")
    if args.bins < 10:
        raise UsageError(f"--bins must be at least 10 (got {args.bins})")

    from hpcrl.slurm.sim.run import format_table, plot_timeline, simulate
    from hpcrl.slurm.sim.trace import World, load_trace

    trace = load_trace(args.trace)
    policies = ["sync", "async", "backfill"] if args.policy == "all" else [args.policy or trace.scheduler.policy]
    world = World(trace)
    results = [simulate(trace, p, timeline_bins=args.bins if args.plot else 0, world=world) for p in policies]
    if args.plot:
        plot_timeline(results[0], args.plot)
    if args.json:
        docs = []
        for r in results:
            doc = r.to_json()
            doc.pop("timeline", None)
            docs.append(doc)
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
        return 0
    print(
        f"trace {trace.name}: {trace.cluster.learner_gpus} learner + {trace.cluster.generator_gpus} generator GPUs, "
        f"{trace.cluster.sandbox_slots} sandbox slots, {len(world.domains)} domains, {trace.training.steps} steps "
        f"of {trace.training.batch_size} trajectories, staleness bound {trace.training.max_staleness}"
    )
    if len(results) > 1:
        print(format_table(results))
    else:
        r = results[0]
        print(r.summary_line())
        for u in (r.learner, r.generator):
            print(
                f"  {u.role:<9} {u.gpus:>5} GPUs: own work {u.owner_s / u.capacity_s:6.1%}"
                f"  packed {u.packed_s / u.capacity_s:6.1%}  lost {u.lost_s / u.capacity_s:5.1%}"
                f"  idle {u.idle_s / u.capacity_s:6.1%}"
            )
        print(
            f"  trained {r.trajectories} trajectories (staleness counts {list(r.staleness)}), dropped {r.dropped} "
            f"too-stale episodes; {r.packed_tasks} packed tasks, {r.preemptions} preempted; "
            f"useful GPU work {r.useful_fraction:.1%}; simulated in {r.wall_s:.2f} s"
        )
    if args.plot:
        print(f"utilization timeline: {args.plot}")
    return 0
