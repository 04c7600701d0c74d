"""`hpcrl sim TRACE.yaml|RUN_DIR --policy sync|sync-split|async|backfill|all [--no-drop] [--json] [--plot FILE]`,
and `hpcrl sim --experiments TRACE1 TRACE2 ... [--json]`.

    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy all            # the policy table
    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy all --no-drop  # every policy trains the same episodes
    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy backfill --plot util.png
    hpcrl sim runs/my-run --setup slurm/sim/traces/small.yaml --policy all  # replay what a run measured
    hpcrl sim --experiments a.yaml b.yaml --json                           # shared GPUs against split ones

Parses the arguments and calls slurm/sim/report.py `run_sim`, handing it the trajectory
store's reader for replays (slurm/ does not import rl/). What the simulator models:
slurm/sim/__init__.py and slurm/sim/traces/README.md. A bad trace, run directory or argument
exits 2 with one line naming the key or option.
"""

from __future__ import annotations

import argparse
import sys

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).

_POLICY_CHOICES = ("sync", "sync-split", "async", "backfill")
# --flag: (section, key) of the trace it overrides
_OVERRIDES = {
    "learner_gpus": ("cluster", "learner_gpus"),
    "generator_gpus": ("cluster", "generator_gpus"),
    "sandbox_slots": ("cluster", "sandbox_slots"),
    "steps": ("training", "steps"),
    "batch_size": ("training", "batch_size"),
    "max_staleness": ("training", "max_staleness"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate GPU utilization of the sync, sync-split, async and backfill rollout policies",
        description=(
            "Drive the rollout policies with a simulated clock over TRACE (GPUs, sandbox slots, hundreds of "
            "domains with heavy-tailed generation and sandbox times; optionally a Slurm partition shared with "
            "other users) or over the measured episodes of a run directory. backfill is the live run: its "
            "rollout jobs are planned by the live planner's decisions against a simulated Slurm. Prints GPU busy "
            "and useful time, dropped work, trajectories per GPU-hour, trained vs started episode lengths and "
            "the staleness distribution. Example traces: slurm/sim/traces/."
        ),
    )
    p.add_argument(
        "trace",
        nargs="?",
        default="",
        metavar="TRACE_OR_RUN",
        help="trace YAML file (e.g. slurm/sim/traces/heavy-tail-300.yaml), or a run directory / trajectory "
        "store whose measured episodes are replayed",
    )
    p.add_argument(
        "--policy",
        choices=(*_POLICY_CHOICES, "all"),
        default=None,
        help="scheduling policy (default: the trace's scheduler.policy); 'all' prints the table of policies",
    )
    p.add_argument(
        "--no-drop",
        action="store_true",
        help="drop no stale episode: train every one (off-policy correction only); every policy then starts "
        "exactly steps x batch_size episodes and trains the same ones",
    )
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON (a list for --policy all)")
    p.add_argument("--plot", metavar="FILE", help="draw the GPU utilization timeline into FILE (.png, .pdf or .svg)")
    p.add_argument("--bins", type=int, default=240, help="time bins of the --plot timeline (default 240)")
    p.add_argument(
        "--setup",
        metavar="FILE",
        help="with a run directory: the trace file whose cluster, training and scheduler to use",
    )
    p.add_argument(
        "--experiments",
        nargs="+",
        metavar="TRACE",
        default=(),
        help="several experiments' traces: their generators on shared GPUs (GRES shards) against the same GPUs "
        "split between them, side by side",
    )
    p.add_argument(
        "--share-efficiency",
        type=float,
        default=0.9,
        metavar="E",
        help="with --experiments: throughput of a GPU that several generators use at once, relative to one "
        "alone (default 0.9)",
    )
    p.add_argument(
        "--hours", type=float, metavar="H", help="with --experiments: simulated hours (default: the shortest run)"
    )
    for flag in _OVERRIDES:
        section, key = _OVERRIDES[flag]
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, metavar="N", help=f"override {section}.{key}")
    p.set_defaults(func=run)


def read_store(path, on_error):
    """The trajectory store's reader, as slurm/sim/replay.py takes it."""
    from hpcrl.rl.store.reader import iter_segments, resolve_store

    store = resolve_store(path)
    return store, (cols for _, _, cols in iter_segments(store, on_error=on_error))


def run(args: argparse.Namespace) -> int:
    from hpcrl.jobs.cli import UsageError
    from hpcrl.slurm.sim.replay import SimInputError
    from hpcrl.slurm.sim.report import SimRequest, run_sim

    overrides: dict[str, dict] = {}
    for flag, (section, key) in _OVERRIDES.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    req = SimRequest(
        trace=args.trace,
        policy=args.policy,
        no_drop=args.no_drop,
        json=args.json,
        plot=args.plot,
        bins=args.bins,
        setup=args.setup,
        overrides=overrides,
        experiments=tuple(args.experiments),
        share_efficiency=args.share_efficiency,
        hours=args.hours,
    )
    try:
        print(run_sim(req, read_store, note=lambda line: print(line, file=sys.stderr)))
    except SimInputError as exc:
        raise UsageError(str(exc)) from None
    return 0
