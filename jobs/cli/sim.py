"""`hpcrl sim TRACE.yaml|RUN_DIR --policy sync|sync-split|async|backfill|all [--no-drop] [--json] [--plot FILE]`.

    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy all            # the policy table
    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy all --no-drop  # every policy trains the same episodes
    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy backfill --plot util.png
    hpcrl sim runs/my-run --setup slurm/sim/traces/small.yaml --policy all  # replay what a run measured

Runs the rollout scheduling policies on a simulated clock over a trace (format:
slurm/sim/traces/README.md) and prints, per policy, GPU busy time and what it went into (useful:
training and the trajectories trained on; dropped: episodes given up as too stale), throughput
in trajectories per GPU-hour, the length distribution of trained and started episodes, and the
staleness of the trajectories trained on. `sync` is the strongest synchronous baseline (every
GPU generates from one pool, then every GPU trains); `sync-split` the weaker one of a split
cluster (learner GPUs never generate, generators never train).

A run directory (or a trajectory store) instead of a trace replays its measured episodes: every
stored trajectory's per-turn generate_s (GPU time of the turn) and env_s (the environment step,
sandbox included; the GPU is free meanwhile). The cluster, training and scheduler come from
--setup FILE (any trace file; its families are not used) and the flags, which override a
trace's values too. A bad trace, run directory or argument exits 2 with one line naming the key
or option.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_PLOT_SUFFIXES = (".png", ".pdf", ".svg")
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
            "Drive the rollout scheduler with a simulated clock over TRACE (GPUs, sandbox slots, hundreds of "
            "domains with heavy-tailed generation and sandbox times) or over the measured episodes of a run "
            "directory. Prints GPU busy and useful time, dropped work, trajectories per GPU-hour, trained vs "
            "started episode lengths and the staleness distribution. Example traces: slurm/sim/traces/."
        ),
    )
    p.add_argument(
        "trace",
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
    for flag in _OVERRIDES:
        section, key = _OVERRIDES[flag]
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, metavar="N", help=f"override {section}.{key}")
    p.set_defaults(func=run)


def read_measured(path: str | Path):
    """The measured episodes of a run directory or trajectory store (slurm.sim.trace.MeasuredEpisode),
    and the segments that could not be read. UsageError when there is nothing to replay."""
    import numpy as np

    from hpcrl.jobs.cli import UsageError
    from hpcrl.rl.store.reader import iter_segments, resolve_store
    from hpcrl.slurm.sim.trace import MeasuredEpisode

    store = resolve_store(path)
    bad: list[str] = []
    out: list[MeasuredEpisode] = []
    for _, _, cols in iter_segments(store, on_error=lambda st, nm, why: bad.append(f"{st.name}/{nm}: {why}")):
        t, steps = cols.traj, cols.steps
        gen = steps["generate_s"].tolist()
        # The environment step's wall time holds the sandbox run (sandbox_s) and the rest of the step.
        env = np.maximum(steps["env_s"], steps["sandbox_s"]).tolist()
        for domain, first, n in zip(t["domain"].tolist(), t["step_start"].tolist(), t["n_steps"].tolist()):
            if n > 0:
                out.append(
                    MeasuredEpisode(domain.decode(), tuple(gen[first : first + n]), tuple(env[first : first + n]))
                )
    if not out:
        why = f"; {len(bad)} unreadable segment(s), first: {bad[0]}" if bad else ""
        raise UsageError(
            f"{path}: no trajectories to replay (looked for trajectory shards in {store}){why}; "
            "pass a run directory that stored trajectories, or a trace file"
        )
    if not any(sum(m.gen_s) > 0 for m in out):
        raise UsageError(f"{path}: {len(out)} trajectories, but none recorded any generate_s: nothing to replay")
    return out, bad


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from hpcrl.core.schema import ConfigError
    from hpcrl.jobs.cli import UsageError

    if args.plot:
        plot = Path(args.plot)
        if plot.suffix.lower() not in _PLOT_SUFFIXES:
            raise UsageError(f"--plot {args.plot}: the file name must end in {', '.join(_PLOT_SUFFIXES)}")
        if not plot.parent.is_dir():
            raise UsageError(f"--plot {args.plot}: folder {plot.parent} does not exist; create it or pick another path")
        if args.policy == "all":
            raise UsageError(f"--plot draws one policy's timeline; pick --policy {', '.join(_POLICY_CHOICES)}")
    if args.bins < 10:
        raise UsageError(f"--bins must be at least 10 (got {args.bins})")

    from hpcrl.slurm.sim.run import format_table, plot_timeline, simulate
    from hpcrl.slurm.sim.trace import World, load_trace, replay_trace

    overrides: dict[str, dict] = {}
    for flag, (section, key) in _OVERRIDES.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    path = Path(args.trace)
    measured, unreadable = None, []
    if path.is_dir():
        measured, unreadable = read_measured(path)  # nothing to replay is the first thing to say
        try:
            trace = replay_trace(path, args.setup, overrides)
        except ConfigError as exc:
            if args.setup or "missing" not in exc.message:
                raise
            hint = "; a run directory takes its cluster and training from --setup TRACE.yaml (and the flags)"
            raise ConfigError(exc.path, exc.message + hint, origin=exc.origin) from None
    else:
        if args.setup:
            raise UsageError(f"--setup is for replaying a run directory; {args.trace} is a trace file already")
        trace = load_trace(path, overrides)
    if args.no_drop:
        trace = dataclasses.replace(trace, training=dataclasses.replace(trace.training, drop_stale=False))
    if trace.replay and measured is None:  # a trace file that names a run to replay
        measured, unreadable = read_measured(trace.replay)
    world = World(trace, measured)

    policies = list(_POLICY_CHOICES) if args.policy == "all" else [args.policy or trace.scheduler.policy]
    results = [simulate(trace, p, timeline_bins=args.bins if args.plot else 0, world=world) for p in policies]
    if args.plot:
        plot_timeline(results[0], args.plot)
    if args.json:
        docs = []
        for r in results:
            doc = r.to_json()
            if trace.replay:
                doc["replay"] = {"run": trace.replay, "episodes": len(world.measured), "unreadable": unreadable}
            docs.append(doc)
        print(json.dumps(docs if args.policy == "all" else docs[0], indent=2))
        return 0
    t = trace.training
    source = (
        f"replay of {trace.replay} ({len(world.measured)} measured episodes"
        + (f", {len(unreadable)} unreadable segments skipped" if unreadable else "")
        + ")"
        if trace.replay
        else ""
    )
    print(
        f"trace {trace.name}{': ' + source if source else ''}: {trace.cluster.learner_gpus} learner + "
        f"{trace.cluster.generator_gpus} generator GPUs, {trace.cluster.sandbox_slots} sandbox slots, "
        f"{len(world.domain_names)} domains, {t.steps} steps of {t.batch_size} trajectories, "
        + (
            f"staleness bound {t.max_staleness} (stale episodes dropped)"
            if t.drop_stale
            else f"no drops (every episode trained; admission bound {t.max_staleness})"
        )
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
        w = r.work
        print(
            f"  busy {r.busy_fraction:.1%} = useful {r.useful_fraction:.1%} (training {w.training_s / r.capacity_s:.1%}"
            f" + trained trajectories {w.trained_s / r.capacity_s:.1%}) + dropped {r.dropped_fraction:.1%}"
            f" + open at the end {r.open_fraction:.1%}"
        )
        print(
            f"  episodes: {r.episodes_started} started, {w.trained} trained (staleness counts {list(r.staleness)}), "
            f"{w.dropped} dropped as too stale, {w.open} open at the end"
        )
        print(
            "  episode length s (mean/p99/max): "
            + ", ".join(
                f"{name} {x.mean:.0f}/{x.p99:.0f}/{x.max:.0f}"
                for name, x in (("trained", r.trained_len), ("started", r.started_len), ("dropped", r.dropped_len))
                if x.n
            )
        )
        print(f"  {r.packed_tasks} packed tasks, {r.preemptions} preempted; simulated in {r.wall_s:.2f} s")
    if args.plot:
        print(f"utilization timeline: {args.plot}")
    return 0
