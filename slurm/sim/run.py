"""Trace-driven simulator of GPU utilization under the three rollout policies.

    hpcrl sim slurm/sim/traces/heavy-tail-300.yaml --policy backfill --plot util.png
    python -c "from hpcrl.slurm.sim.run import simulate; from hpcrl.slurm.sim.trace import load_trace; \
               print(simulate(load_trace('slurm/sim/traces/small.yaml'), 'sync').summary_line())"

`simulate(trace, policy)` runs one policy on a simulated clock (slurm/sim/policies.py,
slurm/sim/backfill.py) and returns a `SimResult`: GPU busy fraction per role and overall,
trajectories trained on per GPU-hour, the staleness of every trained trajectory, and the
packer's counters. GPU-time conservation is checked on every run (engine.py): a result
exists only if busy + lost + idle = capacity for every role.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from hpcrl.slurm.sim.backfill import BackfillPolicy
from hpcrl.slurm.sim.engine import KINDS, RoleUsage, check_conservation
from hpcrl.slurm.sim.policies import AsyncPolicy, SimBase, SyncPolicy
from hpcrl.slurm.sim.trace import Trace, World

POLICIES: dict[str, type[SimBase]] = {"sync": SyncPolicy, "async": AsyncPolicy, "backfill": BackfillPolicy}

__all__ = ["POLICIES", "SimResult", "simulate", "format_table", "plot_timeline"]


@dataclass(frozen=True)
class SimResult:
    trace: str
    policy: str
    learner_gpus: int
    generator_gpus: int
    makespan_s: float
    steps: int
    trajectories: int  # trained on
    throughput_per_gpu_hour: float
    busy_fraction: float  # (owner + packed) / capacity over all GPUs
    useful_fraction: float  # training + generation of trajectories that were trained on, / capacity
    learner: RoleUsage
    generator: RoleUsage
    max_staleness: int
    staleness: tuple[int, ...]  # trained trajectories by staleness 0..max_staleness
    episodes_started: int
    dropped: int  # episodes given up because they were too stale to train on
    preemptions: int
    packed_tasks: int
    decisions: int
    sandbox_busy_fraction: float
    events: int
    wall_s: float
    timeline: dict | None = None  # binned utilization, when asked for (plots)

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness)
        return sum(i * c for i, c in enumerate(self.staleness)) / n if n else 0.0

    def summary_line(self) -> str:
        return (
            f"{self.policy}: busy {self.busy_fraction:.1%} useful {self.useful_fraction:.1%} "
            f"(learner {self.learner.busy_fraction:.1%}, generators {self.generator.busy_fraction:.1%}), "
            f"{self.throughput_per_gpu_hour:.2f} traj/GPU-h, "
            f"makespan {self.makespan_s / 3600:.2f} h, staleness mean {self.mean_staleness:.2f} "
            f"max {max((i for i, c in enumerate(self.staleness) if c), default=0)} (bound {self.max_staleness})"
        )

    def to_json(self) -> dict:
        out = asdict(self)
        for role in ("learner", "generator"):
            out[role]["busy_fraction"] = getattr(self, role).busy_fraction
        out["mean_staleness"] = self.mean_staleness
        return out


def simulate(trace: Trace, policy: str, *, timeline_bins: int = 0, world: World | None = None) -> SimResult:
    """Run `policy` ('sync', 'async', 'backfill') on `trace`; timeline_bins > 0 keeps a binned
    utilization timeline for plotting."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    t0 = time.perf_counter()
    sim = POLICIES[policy](trace, world, keep_intervals=timeline_bins > 0).run()
    makespan = sim.end_time
    usage = check_conservation(sim.ledger, sim.tally, makespan)
    wall = time.perf_counter() - t0
    n_gpus = sim.L + sim.G
    busy = sum(u.busy_s for u in usage.values()) / (n_gpus * makespan)
    packer = getattr(sim, "packer", None)
    return SimResult(
        trace=trace.name,
        policy=policy,
        learner_gpus=sim.L,
        generator_gpus=sim.G,
        makespan_s=makespan,
        steps=sim.steps_done,
        trajectories=sim.train.consumed,
        throughput_per_gpu_hour=sim.train.consumed / (n_gpus * makespan / 3600.0),
        busy_fraction=busy,
        useful_fraction=(usage["learner"].owner_s + sim.train.useful_gen_s) / (n_gpus * makespan),
        learner=usage["learner"],
        generator=usage["generator"],
        max_staleness=sim.train.max_staleness,
        staleness=tuple(sim.train.staleness),
        episodes_started=sim.episodes_started,
        dropped=sim.train.dropped + sim.aborted,
        preemptions=packer.preemptions if packer else 0,
        packed_tasks=packer.placements if packer else 0,
        decisions=packer.decisions if packer else 0,
        sandbox_busy_fraction=sim.sandbox.busy_s / (trace.cluster.sandbox_slots * makespan),
        events=sim.loop.events,
        wall_s=wall,
        timeline=_bin_timeline(sim, makespan, timeline_bins) if timeline_bins > 0 else None,
    )


def _bin_timeline(sim: SimBase, makespan: float, bins: int) -> dict:
    """Fraction of each role's GPUs in each state, per time bin."""
    import numpy as np

    edges = np.linspace(0.0, makespan, bins + 1)
    iv = np.array(sim.ledger.intervals, dtype=float).reshape(-1, 4)
    roles = np.array([0 if r == "learner" else 1 for r in sim.roles])
    out: dict = {"t_s": ((edges[:-1] + edges[1:]) / 2).tolist()}
    width = edges[1] - edges[0]
    for r, role in enumerate(("learner", "generator")):
        n = int((roles == r).sum())
        sel = iv[roles[iv[:, 0].astype(int)] == r] if len(iv) else iv
        for k, kind in enumerate(KINDS):
            part = sel[sel[:, 1] == k] if len(sel) else sel
            starts, ends = part[:, 2], part[:, 3]
            # Covered time up to each edge, summed over intervals; differences give each bin's share.
            covered = np.array([np.clip(e - starts, 0.0, ends - starts).sum() for e in edges])
            out[f"{role}.{kind}"] = (np.diff(covered) / (width * n)).tolist()
    return out


def format_table(results: list[SimResult]) -> str:
    """The policies side by side, with throughput relative to the first result (sync)."""
    base = results[0].throughput_per_gpu_hour
    head = (
        f"{'policy':<9} {'busy':>6} {'learner':>8} {'gens':>6} {'lost':>5} {'traj/GPU-h':>11} "
        f"{'vs ' + results[0].policy:>8} {'makespan h':>10} {'staleness mean/max':>18} {'dropped':>7} {'preempt':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lost = (r.learner.lost_s + r.generator.lost_s) / (r.learner.capacity_s + r.generator.capacity_s)
        smax = max((i for i, c in enumerate(r.staleness) if c), default=0)
        lines.append(
            f"{r.policy:<9} {r.busy_fraction:>6.1%} {r.learner.busy_fraction:>8.1%} {r.generator.busy_fraction:>6.1%} "
            f"{lost:>5.1%} {r.throughput_per_gpu_hour:>11.2f} {r.throughput_per_gpu_hour / base:>7.2f}x "
            f"{r.makespan_s / 3600:>10.2f} {f'{r.mean_staleness:.2f}/{smax} (<={r.max_staleness})':>18} "
            f"{r.dropped:>7} {r.preemptions:>7}"
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
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True)
    n_l, n_g = result.learner_gpus, result.generator_gpus
    overall = [
        (
            n_l * (tl["learner.owner"][i] + tl["learner.packed"][i])
            + n_g * (tl["generator.owner"][i] + tl["generator.packed"][i])
        )
        / (n_l + n_g)
        for i in range(len(hours))
    ]
    axes[0].plot(hours, overall, color="black")
    axes[0].set_ylim(0, 1.02)
    axes[0].set_ylabel("busy, all GPUs")
    axes[0].set_title(
        f"{result.trace}: policy {result.policy}, busy {result.busy_fraction:.1%}, "
        f"{result.throughput_per_gpu_hour:.2f} trajectories/GPU-h"
    )
    for ax, role, n in ((axes[1], "learner", n_l), (axes[2], "generator", n_g)):
        stack = [tl[f"{role}.{k}"] for k in ("owner", "packed", "lost", "idle")]
        ax.stackplot(
            hours,
            *stack,
            labels=["own work", "packed (borrowed)", "lost (preempted)", "idle"],
            colors=[colors[k] for k in ("owner", "packed", "lost", "idle")],
        )
        ax.set_ylim(0, 1.0)
        ax.set_ylabel(f"{role} GPUs ({n})")
    axes[1].legend(loc="lower right", fontsize=8, ncol=4)
    axes[2].set_xlabel("simulated time, hours")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
