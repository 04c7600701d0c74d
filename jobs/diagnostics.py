"""diagnostics.png: the learner's per-step statistics of a run, the picture to look at when
learning stalls (next to reward.png; `hpcrl run` writes both).

    write_diagnostics_png(run_dir)                  # from <run_dir>/metrics.jsonl
    write_diagnostics_png(run_dir, out="x.png", title="...", window=20)

Eight panels against the learner step: reward (per step and moving average, per domain);
entropy of the policy at the action tokens (mean, and at each answer's first token); the
fraction of groups with zero reward variance (no gradient) and of trajectories with a non-zero
advantage; advantage statistics; the importance ratio (min, mean, max) and the clip fraction;
the staleness histogram (share of each batch 0, 1, 2... versions behind); completion length
and the share ending with eos; and per-prompt success over time (the most frequent prompts,
rows, by step bins; blank where a prompt was not in a batch). rl/learner/diagnostics.py defines them.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

from hpcrl.jobs.report import read_metrics

__all__ = ["write_diagnostics_png", "moving_average"]

_MAX_PROMPTS = 100
_MAX_BINS = 60


def moving_average(xs: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start); NaN values are skipped."""
    out = []
    for i in range(len(xs)):
        part = [x for x in xs[max(0, i - window + 1) : i + 1] if x == x]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def _series(rows: list[dict], key: str) -> list[float]:
    out = []
    for r in rows:
        v = r.get(key)
        out.append(float(v) if isinstance(v, (int, float)) and v is not None else math.nan)
    return out


def write_diagnostics_png(
    run_dir: str | os.PathLike, out: str | os.PathLike | None = None, title: str | None = None, window: int = 20
) -> Path | None:
    rows = read_metrics(run_dir)
    if not rows or "zero_var_groups" not in rows[-1]:
        return None  # no learner step yet, or metrics from an hpcrl without diagnostics
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    ma = lambda key: moving_average(_series(rows, key), window)
    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5), dpi=80)
    ax = axes[0, 0]
    ax.plot(steps, _series(rows, "reward"), color="black", lw=0.5, alpha=0.3)
    ax.plot(steps, ma("reward"), color="black", lw=2, label=f"all (MA {window})")
    domains = sorted({d for r in rows for d in r.get("reward_by_domain", {})})
    if len(domains) > 1:
        for d in domains[:8]:
            ax.plot(
                steps,
                moving_average([r.get("reward_by_domain", {}).get(d, math.nan) for r in rows], window),
                lw=1,
                label=d,
            )
    ax.set(title="reward", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[0, 1]
    ax.plot(steps, ma("entropy"), label="mean over action tokens")
    ax.plot(steps, ma("entropy_first"), label="first action token")
    ax.set(title="policy entropy (nats)", ylim=(0, None))
    ax.legend(fontsize=7)

    ax = axes[0, 2]
    ax.plot(steps, ma("zero_var_groups"), color="tab:red", label="groups with zero reward variance")
    ax.plot(steps, ma("adv_nonzero"), color="tab:green", label="trajectories with A != 0")
    skipped = [s for s, r in zip(steps, rows) if r.get("skipped")]
    if skipped:
        ax.plot(skipped, [1.0] * len(skipped), "|", color="tab:gray", label=f"skipped steps ({len(skipped)})")
    ax.set(title="learning signal (fractions)", ylim=(-0.02, 1.05))
    ax.legend(fontsize=7)

    ax = axes[0, 3]
    for key, label in (("adv_max", "max"), ("adv_abs_mean", "mean |A|"), ("adv_min", "min")):
        ax.plot(steps, ma(key), label=label)
    ax.set(title="advantages")
    ax.legend(fontsize=7)

    ax = axes[1, 0]
    for key, label in (("ratio_max", "max"), ("ratio_mean", "mean"), ("ratio_min", "min")):
        ax.plot(steps, _series(rows, key), lw=0.8, label=label)
    lo = min((x for x in _series(rows, "ratio_min") if x == x), default=1.0)
    hi = max((x for x in _series(rows, "ratio_max") if x == x), default=1.0)
    log = lo > 0 and hi / lo > 3  # log scale only when the ratio strays far from 1
    ax.set(title="importance ratio pi/mu and clip fraction", yscale="log" if log else "linear")
    ax.legend(fontsize=7, loc="upper left")
    twin = ax.twinx()
    twin.plot(steps, ma("clip_fraction"), color="tab:purple", lw=1.5, label="clip fraction")
    twin.set_ylim(0, max(0.05, max((x for x in ma("clip_fraction") if x == x), default=0) * 1.2))
    twin.legend(fontsize=7, loc="upper right")

    ax = axes[1, 1]
    ages = sorted({int(k) for r in rows for k in r.get("staleness_hist", {})})
    totals = [max(sum(r.get("staleness_hist", {}).values()), 1) for r in rows]
    shares = [[r.get("staleness_hist", {}).get(str(a), 0) / n for r, n in zip(rows, totals)] for a in ages]
    ax.stackplot(steps, *shares, labels=[f"{a} behind" for a in ages])
    ax.set(title="staleness histogram (share of batch)", ylim=(0, 1))
    ax.legend(fontsize=7, loc="lower left")

    ax = axes[1, 2]
    ax.plot(steps, ma("completion_len"), label="action tokens per trajectory")
    ax.set(title="completion length", ylim=(0, None))
    twin = ax.twinx()
    twin.plot(steps, ma("eos_fraction"), color="tab:orange", label="ended with eos")
    twin.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="upper right")

    _prompt_heatmap(axes[1, 3], rows, steps)
    for a in axes.flat:
        a.grid(alpha=0.3)
        a.set_xlabel("learner step")
    fig.suptitle(title or f"{Path(run_dir).name}: learner diagnostics per step", fontsize=11)
    fig.tight_layout()
    path = Path(out) if out else Path(run_dir) / "diagnostics.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _prompt_heatmap(ax, rows: list[dict], steps: list[int]) -> None:
    seen = Counter(k for r in rows for k in r.get("reward_by_prompt", {}))
    prompts = sorted(k for k, _ in seen.most_common(_MAX_PROMPTS))
    bins = min(_MAX_BINS, len(rows))
    size = math.ceil(len(rows) / bins)
    grid = []
    for p in prompts:
        line = []
        for b in range(0, len(rows), size):
            vals = [r["reward_by_prompt"][p] for r in rows[b : b + size] if p in r.get("reward_by_prompt", {})]
            line.append(sum(vals) / len(vals) if vals else math.nan)
        grid.append(line)
    ax.set_title(f"per-prompt success ({len(prompts)} of {len(seen)} prompts)")
    if not grid:
        return
    extent = (steps[0], steps[-1], len(prompts) - 0.5, -0.5)
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest", extent=extent)
    ticks = list(range(0, len(prompts), max(1, len(prompts) // 10)))
    ax.set_yticks(ticks, [prompts[i].split(":", 1)[-1][:14] for i in ticks], fontsize=6)
    ax.figure.colorbar(im, ax=ax, fraction=0.05)
