"""What a run shows: the one-line progress, the status summary, and reward.png.

line = progress_line(read_status(run_dir), max_steps=300)
write_reward_png(run_dir)       # reward against step, overall and per domain, from metrics.jsonl
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["progress_line", "status_text", "read_metrics", "write_reward_png"]


def _busy(status: dict) -> str:
    b = status.get("busy", {})
    return " ".join(f"{k} {100 * float(v):3.0f}%" for k, v in b.items())


def progress_line(status: dict | None, max_steps: int) -> str:
    if not status:
        return "starting: waiting for the coordinator's first status"
    ln = status.get("learner") or {}
    if "step" not in ln:
        c = status.get("counts", {})
        return (
            f"warming up: {c.get('completed', 0)} episodes done, {status.get('traj_per_s', 0):.0f} traj/s, "
            f"busy {_busy(status)}"
        )
    return (
        f"step {ln['step']:>4}/{max_steps}  reward {ln.get('reward', 0):.3f}  v{ln.get('version', 0)}  "
        f"{status.get('traj_per_s', 0):6.0f} traj/s  busy {_busy(status)}  "
        f"stale-dropped {ln.get('dropped_stale', 0)}"
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
        f"reward {ln.get('reward', float('nan')):.3f}  loss {ln.get('loss', float('nan')):+.4f}  "
        f"life {ln.get('life', 1)}",
        f"throughput {status.get('traj_per_s', 0):.1f} trajectories/s  busy {_busy(status)}",
        "episodes   " + "  ".join(f"{k} {v}" for k, v in sorted(status.get("counts", {}).items())),
        f"in flight  {status.get('leases', 0)} leased, {status.get('queued', 0)} queued",
    ]
    for domain, r in sorted((status.get("reward_by_domain") or {}).items()):
        lines.append(f"  reward {domain:<28} {r:.3f}")
    from hpcrl.jobs.slurmstatus import domain_lines

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
    return "\n".join(lines)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # A restarted learner repeats steps: the later report of a step is the one the run kept.
    by_step = {}
    for r in rows:
        by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


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
