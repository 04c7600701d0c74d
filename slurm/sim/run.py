"""Trace-driven simulator of GPU utilization under the rollout policies.

    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy backfill --plot util.png
    python -c "from hpcrl.slurm.sim.run import simulate; from hpcrl.slurm.sim.trace import load_trace; \
               print(simulate(load_trace('slurm/sim/traces/small.yaml'), 'sync').summary_line())"

`simulate(trace, policy)` runs one policy on a simulated clock (slurm/sim/policies.py,
slurm/sim/backfill.py) and returns a `SimResult`: GPU busy fraction per role and overall, and
what the busy time went into (useful: training and the trajectories trained on; dropped:
episodes given up as too stale; open: episodes still in flight or waiting when the run ended),
trajectories trained on per GPU-hour, the length distribution of trained, started and dropped
episodes (a policy that wins by dropping long episodes shows it), the staleness of every
trained trajectory, and for backfill what its rollout jobs did. Capacity is the GPU time the
run held: its fixed GPUs for the whole run, and each rollout job's GPU while it ran. Two sets
of books are checked on every run (engine.py): busy + lost + idle = capacity for every role,
and busy = training + the generation time of every started episode, each counted once as
trained, dropped or open.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from hpcrl.slurm.sim.backfill import BackfillPolicy
from hpcrl.slurm.sim.engine import (
    DROPPED,
    KINDS,
    TRAINED,
    Lengths,
    RoleUsage,
    SimInvariantError,
    WorkSplit,
    check_conservation,
    check_work,
)
from hpcrl.slurm.sim.policies import AsyncPolicy, SimBase, SyncPolicy, SyncSplitPolicy
from hpcrl.slurm.sim.trace import Trace, World

POLICIES: dict[str, type[SimBase]] = {
    "sync": SyncPolicy,
    "sync-split": SyncSplitPolicy,
    "async": AsyncPolicy,
    "backfill": BackfillPolicy,
}

__all__ = ["POLICIES", "SimResult", "simulate", "format_table", "plot_timeline"]


@dataclass(frozen=True)
class SimResult:
    trace: str
    policy: str
    learner_gpus: int
    generator_gpus: int
    drop_stale: bool  # False: nothing dropped, every policy trains episodes 0..steps x batch - 1
    makespan_s: float
    steps: int
    trajectories: int  # trained on
    throughput_per_gpu_hour: float
    capacity_s: float  # GPUs x makespan
    busy_fraction: float  # (owner + packed) / capacity over all GPUs
    useful_fraction: float  # training + generation of trajectories that were trained on, / capacity
    dropped_fraction: float  # generation of episodes dropped as too stale, / capacity
    open_fraction: float  # generation of episodes in flight or untrained when the run ended, / capacity
    lost_fraction: float  # borrowed work preempted by its owner (not busy), / capacity
    work: WorkSplit  # the busy time split by what it went into, seconds
    learner: RoleUsage
    generator: RoleUsage
    rollout: RoleUsage  # the rollout jobs' GPUs, while each ran (backfill with a `slurm:` section)
    max_staleness: int  # the bound (enforced only with drop_stale)
    staleness: tuple[int, ...]  # trained trajectories by staleness 0, 1, ...
    episodes_started: int
    dropped_episodes: int  # episodes given up because they were too stale to train on
    trained_len: Lengths  # episode lengths (generation + sandbox seconds of all turns)
    started_len: Lengths
    dropped_len: Lengths
    preemptions: int  # episodes rollout jobs handed back unfinished (withdrawn, given way, window over)
    packed_tasks: int  # episodes rollout jobs leased
    decisions: int  # queue snapshots the run's planner decided on
    sandbox_busy_fraction: float
    events: int
    wall_s: float
    timeline: dict | None = None  # binned utilization, when asked for (plots)
    rollout_jobs: dict | None = None  # backfill: submitted, started, withdrawn, gave_way, ended_in_window, ...

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness)
        return sum(i * c for i, c in enumerate(self.staleness)) / n if n else 0.0

    @property
    def max_trained_staleness(self) -> int:
        return max((i for i, c in enumerate(self.staleness) if c), default=0)

    def summary_line(self) -> str:
        bound = f"bound {self.max_staleness}" if self.drop_stale else "no drops"
        return (
            f"{self.policy}: busy {self.busy_fraction:.1%} useful {self.useful_fraction:.1%} "
            f"dropped {self.dropped_fraction:.1%} "
            f"(learner {self.learner.busy_fraction:.1%}, generators {self.generator.busy_fraction:.1%}), "
            f"{self.throughput_per_gpu_hour:.2f} traj/GPU-h, "
            f"makespan {self.makespan_s / 3600:.2f} h, staleness mean {self.mean_staleness:.2f} "
            f"max {self.max_trained_staleness} ({bound})"
        )

    def to_json(self) -> dict:
        """One policy's result; busy, useful, dropped, open and lost are fractions of GPU capacity."""
        h = 1 / 3600.0
        w = self.work
        roles = {}
        for role in ("learner", "generator", "rollout"):
            u = getattr(self, role)
            roles[role] = {**asdict(u), "busy_fraction": u.busy_fraction}
        extra = {} if self.rollout_jobs is None else {"rollout_jobs": self.rollout_jobs}
        return {
            "policy": self.policy,
            "trace": self.trace,
            "drop_stale": self.drop_stale,
            "busy": self.busy_fraction,
            "useful": self.useful_fraction,
            "dropped": self.dropped_fraction,
            "open": self.open_fraction,
            "lost": self.lost_fraction,
            "trained_len_s": self.trained_len.to_json(),
            "started_len_s": self.started_len.to_json(),
            "dropped_len_s": self.dropped_len.to_json(),
            "traj_per_gpu_hour": self.throughput_per_gpu_hour,
            "trajectories": self.trajectories,
            "steps": self.steps,
            "makespan_s": self.makespan_s,
            "gpu_h": {
                "capacity": self.capacity_s * h,
                "busy": self.busy_fraction * self.capacity_s * h,
                "useful": w.useful_s * h,
                "training": w.training_s * h,
                "trained_generation": w.trained_s * h,
                "dropped": w.dropped_s * h,
                "open": w.open_s * h,
                "lost": self.lost_fraction * self.capacity_s * h,
            },
            "episodes": {
                "started": self.episodes_started,
                "trained": w.trained,
                "dropped": w.dropped,
                "open": w.open,
            },
            "staleness": {
                "bound": self.max_staleness,
                "enforced": self.drop_stale,
                "mean": self.mean_staleness,
                "max": self.max_trained_staleness,
                "counts": list(self.staleness),
            },
            "learner_gpus": self.learner_gpus,
            "generator_gpus": self.generator_gpus,
            **roles,
            # kept for the output's shape: episodes rollout jobs leased, handed back, and planner snapshots
            "packer": {"placements": self.packed_tasks, "preemptions": self.preemptions, "decisions": self.decisions},
            "sandbox_busy": self.sandbox_busy_fraction,
            "events": self.events,
            "wall_s": self.wall_s,
            **extra,
        }


def simulate(trace: Trace, policy: str, *, timeline_bins: int = 0, world: World | None = None) -> SimResult:
    """Run `policy` (one of POLICIES) on `trace`; timeline_bins > 0 keeps a binned utilization
    timeline for plotting."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    t0 = time.perf_counter()
    sim = POLICIES[policy](trace, world, keep_intervals=timeline_bins > 0).run()
    makespan = sim.end_time
    usage = check_conservation(sim.ledger, sim.tally, makespan)
    busy_s = sum(u.busy_s for u in usage.values())
    work = check_work(sim.episodes, busy_s, sim.train_gpu_s, sim.open_episodes())
    if work.trained != sim.train.consumed or work.dropped != sim.train.dropped + sim.aborted:
        raise SimInvariantError(
            f"{work.trained} episodes trained and {work.dropped} dropped by their fate, but the learner took "
            f"{sim.train.consumed} and {sim.train.dropped + sim.aborted} were dropped"
        )
    wall = time.perf_counter() - t0
    cap = sum(u.capacity_s for u in usage.values())
    rollouts = sim.rollout_summary() if isinstance(sim, BackfillPolicy) else None
    return SimResult(
        trace=trace.name,
        policy=policy,
        learner_gpus=sim.L,
        generator_gpus=sim.G,
        drop_stale=trace.training.drop_stale,
        makespan_s=makespan,
        steps=sim.steps_done,
        trajectories=sim.train.consumed,
        throughput_per_gpu_hour=sim.train.consumed / (cap / 3600.0),
        capacity_s=cap,
        busy_fraction=busy_s / cap,
        useful_fraction=work.useful_s / cap,
        dropped_fraction=work.dropped_s / cap,
        open_fraction=work.open_s / cap,
        lost_fraction=sum(u.lost_s for u in usage.values()) / cap,
        work=work,
        learner=usage["learner"],
        generator=usage["generator"],
        rollout=usage["rollout"],
        max_staleness=sim.train.max_staleness,
        staleness=tuple(sim.train.staleness),
        episodes_started=sim.episodes_started,
        dropped_episodes=work.dropped,
        trained_len=Lengths.of([ep.spec.length_s for ep in sim.episodes if ep.fate == TRAINED]),
        started_len=Lengths.of([ep.spec.length_s for ep in sim.episodes]),
        dropped_len=Lengths.of([ep.spec.length_s for ep in sim.episodes if ep.fate == DROPPED]),
        preemptions=rollouts["episodes_handed_back"] if rollouts else 0,
        packed_tasks=rollouts["episodes_leased"] if rollouts else 0,
        decisions=sim.rounds.snapshots if rollouts and sim.rounds is not None else 0,
        sandbox_busy_fraction=sim.sandbox.busy_s / (trace.cluster.sandbox_slots * makespan),
        events=sim.loop.events,
        wall_s=wall,
        timeline=_bin_timeline(sim, makespan, timeline_bins) if timeline_bins > 0 else None,
        rollout_jobs=rollouts,
    )


def _bin_timeline(sim: SimBase, makespan: float, bins: int) -> dict:
    """Per time bin: the fraction of the learner's and of the generators' GPUs in each state, and
    the rollout jobs' GPUs in each state (a count: how many are held changes over time)."""
    import numpy as np

    edges = np.linspace(0.0, makespan, bins + 1)
    iv = np.array(sim.ledger.intervals, dtype=float).reshape(-1, 4)
    index = {"learner": 0, "generator": 1, "rollout": 2}
    roles = np.array([index[r] for r in sim.roles])
    out: dict = {"t_s": ((edges[:-1] + edges[1:]) / 2).tolist()}
    width = edges[1] - edges[0]
    for r, role in enumerate(index):
        n = int((roles == r).sum()) if role != "rollout" else 1
        sel = iv[roles[iv[:, 0].astype(int)] == r] if len(iv) else iv
        for k, kind in enumerate(KINDS):
            part = sel[sel[:, 1] == k] if len(sel) else sel
            starts, ends = part[:, 2], part[:, 3]
            # Covered time up to each edge, summed over intervals; differences give each bin's share.
            covered = np.array([np.clip(e - starts, 0.0, ends - starts).sum() for e in edges])
            out[f"{role}.{kind}"] = (np.diff(covered) / (width * n)).tolist()
    return out


def _lens(x: Lengths) -> str:
    return f"{x.mean:.0f}/{x.p99:.0f}/{x.max:.0f}"


def format_table(results: list[SimResult]) -> str:
    """The policies side by side, with throughput relative to sync (fair) when it is there.

    busy, useful and dropped are shares of GPU capacity (useful: training and the trajectories
    trained on; dropped: episodes given up as too stale); lengths are the episodes' own
    generation + sandbox seconds, mean/p99/max, of the trajectories trained on and of every
    episode started."""
    base = next((r for r in results if r.policy == "sync"), results[0])
    head = (
        f"{'policy':<10} {'busy':>6} {'useful':>6} {'dropped':>7} {'lost':>5} {'learner':>7} {'gens':>6} "
        f"{'traj/GPU-h':>10} {'vs ' + base.policy:>8} {'makespan h':>10} "
        f"{'trained len s':>15} {'started len s':>15} {'staleness':>17} {'eps dropped':>11} {'preempt':>7}"
    )
    sub = (
        f"{'':<10} {'':>6} {'':>6} {'':>7} {'':>5} {'':>7} {'':>6} {'':>10} {'':>8} {'':>10} "
        f"{'mean/p99/max':>15} {'mean/p99/max':>15} {'mean/max':>17} {'':>11} {'':>7}"
    )
    lines = [head, sub, "-" * len(head)]
    for r in results:
        bound = f"(<={r.max_staleness})" if r.drop_stale else "(no drop)"
        lines.append(
            f"{r.policy:<10} {r.busy_fraction:>6.1%} {r.useful_fraction:>6.1%} {r.dropped_fraction:>7.1%} "
            f"{r.lost_fraction:>5.1%} {r.learner.busy_fraction:>7.1%} {r.generator.busy_fraction:>6.1%} "
            f"{r.throughput_per_gpu_hour:>10.2f} {r.throughput_per_gpu_hour / base.throughput_per_gpu_hour:>7.2f}x "
            f"{r.makespan_s / 3600:>10.2f} {_lens(r.trained_len):>15} {_lens(r.started_len):>15} "
            f"{f'{r.mean_staleness:.2f}/{r.max_trained_staleness} {bound}':>17} "
            f"{r.dropped_episodes:>11} {r.preemptions:>7}"
        )
    return "\n".join(lines)


def plot_timeline(result: SimResult, path: str) -> None:
    """Stacked utilization over time per role, and the overall busy fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.timeline
    if tl is None:
        raise ValueError("plot_timeline: simulate() was run without timeline_bins")
    hours = [t / 3600 for t in tl["t_s"]]
    colors = {"owner": "#2b6cb0", "packed": "#38a169", "lost": "#e53e3e", "idle": "#e2e8f0"}
    n_l, n_g = result.learner_gpus, result.generator_gpus
    kinds = ("owner", "lost", "idle")
    held_r = [sum(tl[f"rollout.{k}"][i] for k in KINDS) for i in range(len(hours))]
    panels = 4 if any(held_r) else 3
    fig, axes = plt.subplots(panels, 1, figsize=(10, 2.5 * panels), sharex=True)
    overall = [
        (n_l * tl["learner.owner"][i] + n_g * tl["generator.owner"][i] + tl["rollout.owner"][i])
        / (n_l + n_g + held_r[i])
        for i in range(len(hours))
    ]
    axes[0].plot(hours, overall, color="black")
    axes[0].set_ylim(0, 1.02)
    axes[0].set_ylabel("busy, GPUs held")
    axes[0].set_title(
        f"{result.trace}: policy {result.policy}, busy {result.busy_fraction:.1%}, "
        f"{result.throughput_per_gpu_hour:.2f} trajectories/GPU-h"
    )
    labels = {"owner": "own work", "lost": "lost (handed back)", "idle": "idle"}
    for ax, role, n in ((axes[1], "learner", n_l), (axes[2], "generator", n_g)):
        ax.stackplot(
            hours,
            *[tl[f"{role}.{k}"] for k in kinds],
            labels=[labels[k] for k in kinds],
            colors=[colors[k] for k in kinds],
        )
        ax.set_ylim(0, 1.0)
        ax.set_ylabel(f"{role} GPUs ({n})")
    if panels == 4:
        axes[3].stackplot(
            hours,
            *[tl[f"rollout.{k}"] for k in kinds],
            labels=[labels[k] for k in kinds],
            colors=[colors[k] for k in kinds],
        )
        axes[3].set_ylabel("rollout-job GPUs")
    axes[1].legend(loc="lower right", fontsize=8, ncol=3)
    axes[-1].set_xlabel("simulated time, hours")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
