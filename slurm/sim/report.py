"""`hpcrl sim` in one function: build the trace, run the policies, print the table or the JSON.

    text = run_sim(SimRequest(trace="slurm/sim/traces/small.yaml", policy="all"), read_store)

`read_store` is the trajectory store's reader for replaying a run directory (replay.py); the
CLI passes rl/store's. Bad input raises `replay.SimInputError` (a one-line message) or a
ConfigError naming the trace key; nothing is written before the input is known good.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.core.schema import ConfigError
from hpcrl.slurm.sim.replay import SimInputError, read_measured
from hpcrl.slurm.sim.run import POLICIES, format_table, plot_timeline, simulate
from hpcrl.slurm.sim.shared import compare, format_comparison
from hpcrl.slurm.sim.trace import World, ignored_note, load_trace, replay_trace

__all__ = ["SimRequest", "run_sim", "PLOT_SUFFIXES"]

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


@dataclass(frozen=True)
class SimRequest:
    trace: str = ""  # a trace file, or a run directory to replay
    policy: str | None = None  # one of POLICIES, "all", or None: the trace's scheduler.policy
    no_drop: bool = False
    json: bool = False
    plot: str | None = None
    bins: int = 240
    setup: str | None = None  # with a run directory: the trace whose cluster, training and scheduler to use
    overrides: dict = field(default_factory=dict)  # {"cluster": {"learner_gpus": 8}, ...}
    experiments: tuple[str, ...] = ()  # several traces: shared GPUs against split ones (shared.py)
    share_efficiency: float = 0.9
    hours: float | None = None


def run_sim(req: SimRequest, read_store: Callable | None = None, note: Callable[[str], None] = print) -> str:
    """The text `hpcrl sim` prints (a table, or JSON); `note` hears remarks about the input."""
    if req.experiments:
        if req.trace or req.setup or req.plot or req.policy:
            raise SimInputError("--experiments takes trace files only: no TRACE argument, --policy, --setup or --plot")
        traces = [load_trace(p, req.overrides) for p in req.experiments]
        for t in traces:
            if t.replay:
                raise SimInputError(
                    f"--experiments {t.name}: a trace that replays a run cannot be shared; use families"
                )
            if ignored_note(t):
                note(ignored_note(t))
        if req.no_drop:
            traces = [_no_drop(t) for t in traces]
        result = compare(traces, efficiency=req.share_efficiency, hours=req.hours)
        return json.dumps(result, indent=2) if req.json else format_comparison(result)
    if not req.trace:
        raise SimInputError("give a TRACE file or run directory (or --experiments TRACE1 TRACE2 ...)")
    if req.plot:
        plot = Path(req.plot)
        if plot.suffix.lower() not in PLOT_SUFFIXES:
            raise SimInputError(f"--plot {req.plot}: the file name must end in {', '.join(PLOT_SUFFIXES)}")
        if not plot.parent.is_dir():
            raise SimInputError(
                f"--plot {req.plot}: folder {plot.parent} does not exist; create it or pick another path"
            )
        if req.policy == "all":
            raise SimInputError(f"--plot draws one policy's timeline; pick --policy {', '.join(POLICIES)}")
    if req.bins < 10:
        raise SimInputError(f"--bins must be at least 10 (got {req.bins})")

    path = Path(req.trace)
    measured, unreadable = None, []
    if path.is_dir():
        measured, unreadable = read_measured(path, read_store)  # nothing to replay is the first thing to say
        try:
            trace = replay_trace(path, req.setup, req.overrides)
        except ConfigError as exc:
            if req.setup or "missing" not in exc.message:
                raise
            hint = "; a run directory takes its cluster and training from --setup TRACE.yaml (and the flags)"
            raise ConfigError(exc.path, exc.message + hint, origin=exc.origin) from None
    else:
        if req.setup:
            raise SimInputError(f"--setup is for replaying a run directory; {req.trace} is a trace file already")
        trace = load_trace(path, req.overrides)
    if ignored_note(trace):
        note(ignored_note(trace))
    if req.no_drop:
        trace = _no_drop(trace)
    if trace.replay and measured is None:  # a trace file that names a run to replay
        measured, unreadable = read_measured(trace.replay, read_store)
    world = World(trace, measured)

    policies = list(POLICIES) if req.policy == "all" else [req.policy or trace.scheduler.policy]
    results = [simulate(trace, p, timeline_bins=req.bins if req.plot else 0, world=world) for p in policies]
    if req.plot:
        plot_timeline(results[0], req.plot)
    if req.json:
        docs = []
        for r in results:
            doc = r.to_json()
            if trace.replay:
                doc["replay"] = {"run": trace.replay, "episodes": len(world.measured), "unreadable": unreadable}
            docs.append(doc)
        return json.dumps(docs if req.policy == "all" else docs[0], indent=2)
    lines = [_headline(trace, world, unreadable)]
    if len(results) > 1:
        lines.append(format_table(results))
        lines += [_rollout_line(r) for r in results if r.rollout_jobs and r.rollout_jobs["submitted"]]
    else:
        lines += _one_policy(results[0])
    if req.plot:
        lines.append(f"utilization timeline: {req.plot}")
    return "\n".join(lines)


def _no_drop(trace):
    return dataclasses.replace(trace, training=dataclasses.replace(trace.training, drop_stale=False))


def _headline(trace, world, unreadable) -> str:
    t = trace.training
    source = (
        f"replay of {trace.replay} ({len(world.measured)} measured episodes"
        + (f", {len(unreadable)} unreadable segments skipped" if unreadable else "")
        + ")"
        if trace.replay
        else ""
    )
    part = ""
    if trace.slurm is not None:
        s = trace.slurm
        part = f", a partition of {s.nodes} x {s.gpus_per_node} GPUs shared with other users"
    return (
        f"trace {trace.name}{': ' + source if source else ''}: {trace.cluster.learner_gpus} learner + "
        f"{trace.cluster.generator_gpus} generator GPUs{part}, {trace.cluster.sandbox_slots} sandbox slots, "
        f"{len(world.domain_names)} domains, {t.steps} steps of {t.batch_size} trajectories, "
        + (
            f"staleness bound {t.max_staleness} (stale episodes dropped)"
            if t.drop_stale
            else f"no drops (every episode trained; admission bound {t.max_staleness})"
        )
    )


def _rollout_line(r) -> str:
    j = r.rollout_jobs
    others = j.get("others")
    tail = (
        f"; other users' jobs: {others['started']} started, start delay max {others['max_start_delay_s']:.0f} s, "
        f"mean {others['mean_start_delay_s']:.1f} s against no rollout jobs"
        if others
        else ""
    )
    return (
        f"  {r.policy} rollout jobs: {j['submitted']} submitted, {j['started']} started, {j['withdrawn']} withdrawn, "
        f"{j['gave_way']} gave way, {j['ended_in_window']} ended in their window; {j['rollout_gpu_h']:.1f} GPU-h, "
        f"busy {r.rollout.busy_fraction:.1%}, {j['episodes_leased']} episodes leased, "
        f"{j['episodes_handed_back']} handed back{tail}"
    )


def _one_policy(r) -> list[str]:
    lines = [r.summary_line()]
    for u in (r.learner, r.generator, r.rollout):
        if u.capacity_s:
            lines.append(
                f"  {u.role:<9} {u.gpus:>5} GPUs: own work {u.owner_s / u.capacity_s:6.1%}"
                f"  lost {u.lost_s / u.capacity_s:5.1%}  idle {u.idle_s / u.capacity_s:6.1%}"
            )
    w = r.work
    lines.append(
        f"  busy {r.busy_fraction:.1%} = useful {r.useful_fraction:.1%} (training {w.training_s / r.capacity_s:.1%}"
        f" + trained trajectories {w.trained_s / r.capacity_s:.1%}) + dropped {r.dropped_fraction:.1%}"
        f" + open at the end {r.open_fraction:.1%}"
    )
    lines.append(
        f"  episodes: {r.episodes_started} started, {w.trained} trained (staleness counts {list(r.staleness)}), "
        f"{w.dropped} dropped as too stale, {w.open} open at the end"
    )
    lines.append(
        "  episode length s (mean/p99/max): "
        + ", ".join(
            f"{name} {x.mean:.0f}/{x.p99:.0f}/{x.max:.0f}"
            for name, x in (("trained", r.trained_len), ("started", r.started_len), ("dropped", r.dropped_len))
            if x.n
        )
    )
    if r.rollout_jobs and r.rollout_jobs["submitted"]:
        lines.append(_rollout_line(r))
    lines.append(f"  simulated in {r.wall_s:.2f} s")
    return lines
