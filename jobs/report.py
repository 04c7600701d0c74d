"""What a run shows: the one-line progress, the status summary, and reward.png.

    follower = MetricsFollower(run_dir)            # metrics.jsonl, read as it grows
    line = progress_line(read_status(run_dir), 300, follower.poll())
    signal = learning_signal(run_dir)              # skipped steps, and a warning when nothing is learnt
    write_reward_png(run_dir)       # reward against step, overall and per domain, from metrics.jsonl

A step without learning signal is one where every group's rewards were equal (every advantage
0): the learner skips its update (`skipped`, with learner.skip_empty_steps) or trains on nothing
but the entropy bonus. The progress line and `hpcrl status` count skipped steps, and warn when
the last NO_SIGNAL_STEPS steps in a row had no signal: the task is out of the model's reach (every
reward 0) or solved (every reward 1), and more steps will not change it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.core.sinks import step_rows_since

__all__ = [
    "progress_line",
    "status_text",
    "read_metrics",
    "write_reward_png",
    "MetricsFollower",
    "LearningSignal",
    "learning_signal",
    "signal_lines",
    "next_steps",
    "typed_path",
    "NO_SIGNAL_STEPS",
]

NO_SIGNAL_STEPS = 20  # steps in a row without learning signal before the run warns


@dataclass(frozen=True)
class LearningSignal:
    steps: int = 0  # learner steps reported (a step redone after a restart counts once)
    skipped: int = 0  # of them, steps whose update was skipped: every advantage 0
    streak: int = 0  # the latest steps in a row without learning signal
    flat_reward: float | None = None  # the one reward every trajectory of those steps had, if one

    @property
    def warning(self) -> str | None:
        if self.streak < NO_SIGNAL_STEPS:
            return None
        if self.flat_reward is not None:
            return f"no learning signal: every reward {self.flat_reward:g} for {self.streak} steps"
        return f"no learning signal: no group's rewards differed for {self.streak} steps (every advantage 0)"


def _no_signal(row: dict) -> bool:
    zero_var = row.get("zero_var_groups")
    return row.get("skipped") is True or (isinstance(zero_var, (int, float)) and zero_var >= 1.0)


def _flat_value(row: dict) -> float | None:
    """The reward every trajectory of a step without signal had, when its groups agree on one."""
    values = list((row.get("reward_by_prompt") or {}).values()) or [row.get("reward")]
    if not values or not all(isinstance(v, (int, float)) for v in values):
        return None
    return values[0] if max(values) - min(values) < 1e-9 else None


class MetricsFollower:
    """metrics.jsonl read as it grows: each poll parses only the whole lines appended since."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._offset = 0
        self._by_step: dict[int, dict] = {}

    def _read(self) -> None:
        rows, self._offset = step_rows_since(self.path, self._offset)
        for row in rows:
            self._by_step[row["step"]] = row  # a restarted learner's report of a step replaces the first

    def rows(self) -> list[dict]:
        """One row per step, in step order (the later report of a step a restart redid)."""
        self._read()
        return [self._by_step[k] for k in sorted(self._by_step)]

    def poll(self) -> LearningSignal:
        self._read()
        steps = sorted(self._by_step)
        flats: list[float | None] = []  # the latest steps without signal, newest first
        for k in reversed(steps):
            if not _no_signal(self._by_step[k]):
                break
            flats.append(_flat_value(self._by_step[k]))
        first = flats[0] if flats else None
        same = first is not None and all(v is not None and abs(v - first) < 1e-9 for v in flats)
        skipped = sum(1 for k in steps if self._by_step[k].get("skipped") is True)
        return LearningSignal(len(steps), skipped, len(flats), first if same else None)


def learning_signal(run_dir: str | os.PathLike) -> LearningSignal:
    return MetricsFollower(run_dir).poll()


def _busy(status: dict) -> str:
    b = status.get("busy", {})
    return " ".join(f"{k} {100 * float(v):3.0f}%" for k, v in b.items())


def _skipped(sig: LearningSignal | None) -> str:
    return f"  skipped {sig.skipped}/{sig.steps}" if sig is not None and sig.skipped else ""


def progress_line(status: dict | None, max_steps: int, signal: LearningSignal | None = None) -> str:
    if not status:
        return "starting: waiting for the coordinator's first status"
    ln = status.get("learner") or {}
    if "step" not in ln:
        c = status.get("counts", {})
        return (
            f"warming up: {c.get('completed', 0)} episodes done, {status.get('traj_per_s', 0):.0f} traj/s, "
            f"busy {_busy(status)}"
        )
    line = (
        f"step {ln['step']:>4}/{max_steps}  reward {_num(ln.get('reward'), '.3f')}{_skipped(signal)}  "
        f"v{ln.get('version', 0)}  {status.get('traj_per_s', 0):6.0f} traj/s  busy {_busy(status)}  "
        f"stale-dropped {ln.get('dropped_stale', 0)}"
    )
    if signal is not None and signal.warning:
        line = f"{line}  | {signal.warning}"
    return line


def _num(v, fmt: str) -> str:
    """A metric for display: '-' when the run has none (null in metrics.jsonl, not yet reported)."""
    return format(v, fmt) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "-"


def signal_lines(sig: LearningSignal) -> list[str]:
    """`hpcrl status`'s words on skipped steps and a missing learning signal (none when all is well)."""
    lines = []
    if sig.skipped:
        lines.append(f"skipped    {sig.skipped} of {sig.steps} steps (every advantage 0: no update)")
    if sig.warning:
        lines.append(f"WARNING    {sig.warning}")
    return lines


def typed_path(path: str | os.PathLike) -> str:
    """A path as the user would type it: relative to here when it is below here."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(path)


def next_steps(run_dir: str | os.PathLike, component: str | None = None) -> str:
    """The two lines an interrupted or failed run ends with: how to continue it, where its logs are."""
    ref = typed_path(run_dir)
    return f"continue it with:  hpcrl resume {ref}\nits components' logs:  hpcrl logs {ref}" + (
        f" {component}" if component else ""
    )


def status_text(run_dir: str | os.PathLike, status: dict | None) -> str:
    """A multi-line summary for `hpcrl status`."""
    run_dir = Path(run_dir)
    if status is None:
        return f"{run_dir}: no status.json yet (the coordinator has not started, or this is not a run directory)"
    age = time.time() - float(status.get("updated", 0))
    ln = status.get("learner") or {}
    lines = [
        f"run        {run_dir.name}  ({status.get('state')}, status {age:.0f} s old)",
        f"learner    step {ln.get('step', '-')}  version {ln.get('version', '-')}  "
        f"reward {_num(ln.get('reward'), '.3f')}  loss {_num(ln.get('loss'), '+.4f')}  "
        f"life {ln.get('life', 1)}",
        *signal_lines(learning_signal(run_dir)),
        f"throughput {status.get('traj_per_s', 0):.1f} trajectories/s  busy {_busy(status)}",
        "episodes   " + "  ".join(f"{k} {v}" for k, v in sorted(status.get("counts", {}).items())),
        f"in flight  {status.get('leases', 0)} leased, {status.get('queued', 0)} queued",
    ]
    for domain, r in sorted((status.get("reward_by_domain") or {}).items()):
        lines.append(f"  reward {domain:<28} {r:.3f}")
    lines += domain_lines(status.get("domains") or {})
    for name, g in sorted((status.get("generators") or {}).items()):
        st = g.get("stats", {})
        lines.append(
            f"  {name:<10} {'LOST' if g.get('lost') else 'ok':<4} trajectories {st.get('trajectories', 0)}  "
            f"version {st.get('version', '-')}  busy {100 * st.get('busy_fraction', 0):.0f}%  "
            f"last seen {time.time() - g.get('last_seen', 0):.0f} s ago"
        )
    png = run_dir / "reward.png"
    if png.exists():
        lines.append(f"reward curve {png}")
    if status.get("state") == "stopped":  # stopped before learner.max_steps: interrupted, or it failed
        lines.append(next_steps(run_dir))
    return "\n".join(lines)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """metrics.jsonl, one row per step: a restarted learner repeats steps, and the later report
    of a step is the one the run kept."""
    return MetricsFollower(run_dir).rows()


def domain_lines(domains: dict) -> list[str]:
    """Per domain: episodes issued, trained, dropped, and the mean turns of those trained against
    those that finished (a gap is a length bias in what the learner trains)."""
    out = []
    for d, r in sorted(domains.items()):
        turns = {k: "-" if r.get(k) is None else f"{r[k]:.1f}" for k in ("trained_turns_mean", "started_turns_mean")}
        out.append(
            f"  episodes {d:<26} issued {r.get('issued', 0)}  trained {r.get('trained', 0)} "
            f"({100 * r.get('trained_share', 0):.0f}% of trained, {100 * r.get('issued_share', 0):.0f}% of issued)  "
            f"dropped {r.get('dropped', 0)} (stale {r.get('dropped_stale', 0)})  "
            f"turns trained {turns['trained_turns_mean']} / finished {turns['started_turns_mean']}"
        )
    return out


def write_reward_png(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path | None:
    """reward.png (default RUN/reward.png): reward by step, overall and per domain; None before step 1."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    domains = sorted({d for r in rows for d in r.get("reward_by_domain", {})})
    for d in domains:
        pts = [(r["step"], r["reward_by_domain"][d]) for r in rows if d in r.get("reward_by_domain", {})]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, alpha=0.7, label=d)
    ax.plot(steps, [r["reward"] for r in rows], color="black", lw=2, label="all domains")
    ax.set_xlabel("learner step")
    ax.set_ylabel("mean episode reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"{Path(run_dir).name}: reward by step")
    ax.legend(loc="lower right", fontsize=8, ncol=1 + len(domains) // 8)
    fig.tight_layout()
    out = Path(run_dir) / "reward.png" if out is None else Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
