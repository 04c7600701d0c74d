"""`hpcrl plot RUN`'s pictures: reward per domain, throughput, staleness, what each domain was
issued and trained, and where each component's time went, as PNGs in RUN/plots/, from the run's
own records.

    paths, summary = write_plots(run_dir)          # RUN/plots/{reward,throughput,staleness,domains,utilisation}.png
                                                    # (+ eval.png when learner.eval wrote pass@k)
    ivs = learner_intervals(raw_metrics_rows)       # [Interval(start, end, {state: seconds})] from metrics.jsonl
    ivs = generator_intervals(timeline_samples)     # {generator: [Interval]} from coordinator/timeline.jsonl
    fractions = binned(ivs, STATES, t0, t1, bins)   # [{state: share of the bin}] for a stack plot

The learner's timeline comes from its per-step report (metrics.jsonl): between two reports it
trained for `step_s`, gathered weights for the generators for `publish_s`, checkpointed for
`checkpoint_s` and waited for a batch for `wait_s`; the rest is "reporting & bookkeeping" (its
audit log, fsynced each step, the report to the coordinator, handing the batch to the other
ranks). The first report's interval starts at the coordinator's start, and what its parts leave
is "starting" (model and DeepSpeed set-up). A restarted learner's gap (from its last report to
its new life's first) is "down". A generator's timeline comes from the coordinator's samples of
its cumulative counters (busy_s sampling, weights_s loading weights, source_s coordinating,
env_wait_s waiting on environment steps with nothing to decode, idle_s with no episode to run,
wall_s inside its loop); what its loop spent on none of those is "env steps & tokenizing"
(environments that run in the generator's own thread, such as arith's, tokenizing prompts and
observations, assembling episodes). The difference of two samples is one interval (the first
sample's reaches back to the loop's start); when the sample's `life` changed (or, in an older
run, a counter went down) the generator restarted, so the interval is down until the new
process's loop began and its counters are all there is. Time outside a generator's loop is
"down". Every state has a colour of its own.

throughput.png breaks its lines where the learner was down (a new life, or no report for far
longer than steps take) and shades that time; staleness.png draws the oldest and the mean
staleness so that one never hides the other, and the trajectories dropped as stale in a panel
of their own.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcrl.jobs.report import read_metrics, write_reward_png
from hpcrl.rl.coordinator.events import TIMELINE_NAME, read_jsonl
from hpcrl.rl.coordinator.report import METRICS_NAME

__all__ = [
    "Interval",
    "LEARNER_STATES",
    "GENERATOR_STATES",
    "COLOURS",
    "downtime",
    "learner_intervals",
    "generator_intervals",
    "binned",
    "shares",
    "write_plots",
]

LEARNER_REST = "reporting & bookkeeping"  # between reports, outside the measured parts (see above)
GENERATOR_REST = "env steps & tokenizing"  # in the loop, outside the measured counters (see above)
LEARNER_STATES = (
    "training", "syncing weights", "checkpointing", "waiting for data", LEARNER_REST, "starting", "down"
)  # fmt: skip
GENERATOR_STATES = (
    "generating", "syncing weights", "coordination", "waiting for sandbox", "idle", GENERATOR_REST, "down"
)  # fmt: skip
_COUNTERS = (
    "wall_s",
    "busy_s",
    "weights_s",
    "source_s",
    "env_wait_s",
    "idle_s",
)  # rl/rollout/generator.py GeneratorStats
COLOURS = {  # one colour per state, none shared: a legend entry names exactly one thing
    "training": "#2ca02c",  # green
    "generating": "#17becf",  # cyan
    "syncing weights": "#1f77b4",  # blue
    "checkpointing": "#9467bd",  # purple
    "coordination": "#ff7f0e",  # orange
    "waiting for sandbox": "#e377c2",  # pink
    "waiting for data": "#d62728",  # red
    "idle": "#ffd92f",  # yellow
    LEARNER_REST: "#8c564b",  # brown
    GENERATOR_REST: "#bcbd22",  # olive
    "starting": "#c7c7c7",  # light grey
    "down": "#000000",
}


@dataclass(frozen=True)
class Interval:
    """A stretch of one component's time and how it was spent: seconds per state, summing to
    end - start. The records say how much of each, not in which order, so a plot spreads each
    state evenly over its interval."""

    start: float  # unix seconds
    end: float
    parts: dict[str, float]


def _interval(t0: float, t1: float, parts: Sequence[tuple[str, float]], rest: str) -> Interval:
    """[t0, t1] with the named parts (each clipped to what is left, in order) and `rest` the remainder."""
    out: dict[str, float] = {}
    left = t1 - t0
    for state, secs in parts:
        d = min(max(0.0, float(secs)), left)
        if d > 0:
            out[state] = out.get(state, 0.0) + d
            left -= d
    if left > 0:
        out[rest] = out.get(rest, 0.0) + left
    return Interval(t0, t1, out)


def learner_intervals(rows: Sequence[dict], started_at: float | None = None) -> list[Interval]:
    """The learner's timeline from metrics.jsonl rows in file order (restarted steps included)."""
    rows = [r for r in rows if isinstance(r.get("time"), (int, float))]
    if not rows:
        return []
    if started_at is None:
        r0 = rows[0]
        started_at = float(r0["time"]) - float(r0.get("elapsed_s", 0.0))
    out: list[Interval] = []
    prev_t, prev_life = started_at, rows[0].get("life", 1)
    for n, r in enumerate(rows):
        t = float(r["time"])
        if t <= prev_t:
            continue
        parts = [
            ("waiting for data", r.get("wait_s", 0.0)),
            ("checkpointing", r.get("checkpoint_s", 0.0)),
            ("training", r.get("step_s", 0.0)),
            ("syncing weights", r.get("publish_s", 0.0)),
        ]
        if r.get("life", 1) != prev_life:
            # A new life: what it spent on this step is at the end of the gap; the rest was down.
            busy = min(t - prev_t, sum(max(0.0, float(s)) for _, s in parts))
            out.append(_interval(prev_t, t - busy, [], "down"))
            out.append(_interval(t - busy, t, parts, LEARNER_REST))
        else:  # before the first step, what is not accounted for is loading the model and engine
            out.append(_interval(prev_t, t, parts, "starting" if n == 0 else LEARNER_REST))
        prev_t, prev_life = t, r.get("life", 1)
    return [iv for iv in out if iv.end > iv.start]


def generator_intervals(samples: Iterable[dict]) -> dict[str, list[Interval]]:
    """Each generator's timeline from coordinator/timeline.jsonl samples in file order."""
    last: dict[str, tuple[float, dict]] = {}
    out: dict[str, list[Interval]] = {}
    for s in samples:
        if not isinstance(s.get("t"), (int, float)) or not isinstance(s.get("gens"), dict):
            continue
        for name, c in s["gens"].items():
            if not isinstance(c, dict):
                continue
            cur = {k: float(c.get(k, 0.0)) for k in _COUNTERS}  # an older run lacks the newer counters: 0
            t = float(c.get("seen", s["t"]))  # when the counters were reported
            # A generator's first sample covers its loop from the start (its counters began at 0).
            life = c.get("life")
            t_prev, prev, prev_life = last.get(name, (t - cur["wall_s"], dict.fromkeys(_COUNTERS, 0.0), life))
            if t <= t_prev:
                continue  # no sync since the last sample
            last[name] = (t, cur, life)
            # A new process: its life id changed (an older run's records have none: its counters went down).
            restarted = life != prev_life or cur["wall_s"] < prev["wall_s"]
            d = {k: cur[k] if restarted else cur[k] - prev[k] for k in cur}
            parts = [
                ("generating", d["busy_s"]),
                ("syncing weights", d["weights_s"]),
                ("coordination", d["source_s"]),
                ("waiting for sandbox", d["env_wait_s"]),
                ("idle", d["idle_s"]),
            ]
            loop_s = min(t - t_prev, max(0.0, d["wall_s"]))
            rest = loop_s - sum(max(0.0, x) for _, x in parts)  # in the loop: inline env steps, tokenizing
            ivs = out.setdefault(name, [])
            if restarted:  # down until the new process's loop began, then what it did
                ivs.append(_interval(t_prev, t - loop_s, [], "down"))
                t_prev = t - loop_s
            ivs.append(_interval(t_prev, t, [*parts, (GENERATOR_REST, rest)], "down"))
    return {n: [iv for iv in ivs if iv.end > iv.start] for n, ivs in out.items()}


def binned(ivs: Sequence[Interval], states: Sequence[str], t0: float, t1: float, bins: int) -> list[dict[str, float]]:
    """Per bin of [t0, t1], the share of the bin each state covers (bins with no record sum to < 1)."""
    width = (t1 - t0) / bins if t1 > t0 and bins > 0 else 0.0
    out = [dict.fromkeys(states, 0.0) for _ in range(bins if width > 0 else 0)]
    for iv in ivs:
        span = iv.end - iv.start
        if width <= 0 or span <= 0:
            continue
        b = max(0, int((iv.start - t0) // width))
        while b < bins:
            lo, hi = t0 + b * width, t0 + (b + 1) * width
            if lo >= iv.end:
                break
            overlap = min(hi, iv.end) - max(lo, iv.start)
            if overlap > 0:
                for state, secs in iv.parts.items():
                    if state in out[b]:
                        out[b][state] += overlap * secs / span / width
            b += 1
    return out


def shares(ivs: Sequence[Interval]) -> dict[str, float]:
    """Each state's share of the whole timeline."""
    total = sum(iv.end - iv.start for iv in ivs)
    out: dict[str, float] = {}
    for iv in ivs:
        for state, secs in iv.parts.items():
            out[state] = out.get(state, 0.0) + secs / total
    return out


def _raw_metrics(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / METRICS_NAME) if isinstance(r.get("step"), int)]


def _max_staleness(run_dir: Path) -> int | None:
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
        return int(cfg["learner"]["max_staleness"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def write_plots(run_dir: str | os.PathLike) -> tuple[list[Path], dict]:
    """Write RUN/plots/*.png; returns (paths, summary). ValueError if the run has no step yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    raw = _raw_metrics(run_dir)
    rows = read_metrics(run_dir)  # one row per step, the last report of each
    if not rows:
        raise ValueError(f"{run_dir / METRICS_NAME}: no learner step recorded yet; plot once the run has trained")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    paths = [write_reward_png(run_dir, out_dir / "reward.png")]
    t_start = float(raw[0]["time"]) - float(raw[0].get("elapsed_s", 0.0))
    minutes = [(float(r["time"]) - t_start) / 60 for r in rows]

    paths.append(_save(_throughput_fig(plt, run_dir.name, rows, t_start), out_dir / "throughput.png"))
    paths.append(_save(_staleness_fig(plt, run_dir.name, rows, _max_staleness(run_dir)), out_dir / "staleness.png"))
    if any(r.get("domains") for r in rows):
        paths.append(_domains_png(plt, run_dir, rows, out_dir / "domains.png"))

    timelines = {"learner": (learner_intervals(raw, t_start), LEARNER_STATES)}
    gens = generator_intervals(read_jsonl(run_dir / TIMELINE_NAME))
    if len(gens) > 12:  # too many rows to read: one row of all generators together
        timelines["generators"] = ([iv for ivs in gens.values() for iv in ivs], GENERATOR_STATES)
    else:
        timelines |= {g: (ivs, GENERATOR_STATES) for g, ivs in sorted(gens.items())}
    paths.append(_utilisation_png(plt, run_dir, timelines, t_start, out_dir / "utilisation.png"))
    evals = eval_series(raw)
    if evals:
        paths.append(_eval_png(plt, run_dir, evals, out_dir / "eval.png"))
    summary = {
        "domains": rows[-1].get("domains") or {},
        "steps": len(rows),
        "last_step": rows[-1]["step"],
        "minutes": round(minutes[-1], 2),
        "share": {n: {k: round(v, 4) for k, v in shares(ivs).items()} for n, (ivs, _) in timelines.items() if ivs},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return paths, summary


_DOMAIN_KEYS = ("trained_share", "issued_share", "trained_turns_mean", "started_turns_mean")


def _domains_png(plt, run_dir: Path, rows: Sequence[dict], out: Path) -> Path:
    """Per domain against the learner step: its share of the episodes trained and of those issued
    (a slow domain trained below its issued share is being dropped), and the mean turns of the
    episodes trained against all that finished (a gap: long episodes are dropped)."""
    rows = [r for r in rows if r.get("domains")]
    steps = [r["step"] for r in rows]
    names = sorted({d for r in rows for d in r["domains"]})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for i, d in enumerate(names):
        colour = f"C{i % 10}"
        series = {k: [(r["domains"].get(d) or {}).get(k) for r in rows] for k in _DOMAIN_KEYS}
        ax.plot(steps, series["trained_share"], color=colour, lw=1.5, label=f"{d} trained")
        ax.plot(steps, series["issued_share"], color=colour, lw=1, ls="--", label=f"{d} issued")
        ax2.plot(steps, series["trained_turns_mean"], color=colour, lw=1.5, label=f"{d} trained")
        ax2.plot(steps, series["started_turns_mean"], color=colour, lw=1, ls="--", label=f"{d} finished")
    ax.set_ylabel("share of episodes (cumulative)")
    ax.set_ylim(0, 1)
    ax2.set_ylabel("turns per episode (mean, cumulative)")
    ax2.set_ylim(bottom=0)
    for a, title in ((ax, "issued and trained"), (ax2, "length of episodes trained and finished")):
        a.set_xlabel("learner step")
        a.legend(loc="best", fontsize=7)
        a.grid(alpha=0.3)
        a.set_title(f"{run_dir.name}: {title} per domain", fontsize=10)
    return _save(fig, out)


def downtime(rows: Sequence[dict]) -> list[int]:
    """Indices i of rows (one per step, in order) where the learner was down between rows i-1
    and i: a new life, or a silence ten times the median interval between reports (and over a
    minute). A line drawn across such a gap would show throughput that never happened."""
    times = [float(r["time"]) for r in rows]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    typical = gaps[len(gaps) // 2] if gaps else 0.0
    return [
        i
        for i in range(1, len(rows))
        if rows[i].get("life", 1) != rows[i - 1].get("life", 1) or times[i] - times[i - 1] > max(60.0, 10 * typical)
    ]


def _broken(xs: Sequence[float], ys: Sequence[float], breaks: Sequence[int]) -> tuple[list[float], list[float]]:
    """xs, ys with a NaN point before each break: matplotlib lifts the pen there."""
    bx, by = list(xs), list(ys)
    for i in sorted(breaks, reverse=True):
        bx.insert(i, math.nan)
        by.insert(i, math.nan)
    return bx, by


def _throughput_fig(plt, name: str, rows: Sequence[dict], t_start: float):
    minutes = [(float(r["time"]) - t_start) / 60 for r in rows]
    breaks = downtime(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    gen = [r.get("traj_per_s") or 0.0 for r in rows]
    trained = [sum((r.get("staleness_hist") or {}).values()) for r in rows]
    ax.plot(*_broken(minutes, gen, breaks), color="tab:green", label="generated (coordinator)")
    ax.plot(
        *_broken(minutes, _rate(rows, trained, breaks=breaks), breaks),
        color="tab:blue",
        label="trained (learner, 10-step mean)",
    )
    for k, i in enumerate(breaks):
        ax.axvspan(
            minutes[i - 1], minutes[i], color="lightgrey", alpha=0.6, lw=0, label="learner down" if k == 0 else None
        )
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("trajectories per second")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(f"{name}: throughput")
    return fig


def _staleness_fig(plt, name: str, rows: Sequence[dict], bound: int | None):
    steps = [r["step"] for r in rows]
    newest = [r.get("staleness_max") or 0 for r in rows]
    oldest = [r.get("staleness_oldest_max") or 0 for r in rows]
    mean = [_mean_staleness(r) for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    # The wide pale lines under the thin ones, so where they are equal (often: all fresh) each
    # still shows; the floor sits below 0 so a line at 0 is not drawn on the axis.
    ax.plot(
        steps,
        oldest,
        color="tab:purple",
        lw=6,
        alpha=0.25,
        drawstyle="steps-mid",
        label="oldest trained step",
        zorder=2,
    )
    ax.plot(
        steps,
        newest,
        color="tab:red",
        lw=3,
        alpha=0.45,
        drawstyle="steps-mid",
        label="newest action of a group (bounded)",
        zorder=3,
    )
    ax.plot(steps, mean, color="tab:orange", lw=1.2, marker=".", ms=3, label="mean, by oldest step", zorder=4)
    top = max([*oldest, *newest, bound or 0, 1])
    if bound is not None:
        ax.axhline(bound, color="black", ls="--", lw=1, label=f"bound (learner.max_staleness {bound})", zorder=1)
    ax.set_ylim(-0.05 * top - 0.1, top * 1.1 + 0.1)
    ax.set_ylabel("policy versions behind")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(f"{name}: staleness of the trajectories each step trained")
    dropped = [r.get("dropped_stale") or 0 for r in rows]
    ax2.plot(steps, dropped, color="grey", lw=1.2, label="dropped as stale (cumulative)")
    ax2.set_ylim(-0.05 * max(1, *dropped), max(1, *dropped) * 1.1)
    ax2.set_xlabel("learner step")
    ax2.set_ylabel("dropped")
    ax2.legend(loc="upper left", fontsize=8)
    ax2.grid(alpha=0.3)
    return fig


def _rate(rows: Sequence[dict], counts: Sequence[float], window: int = 10, breaks: Sequence[int] = ()) -> list[float]:
    """Per row, counts per second over the last `window` steps, never reaching back across a
    break (downtime); NaN (no point) where there is no interval yet: the first row, a break's."""
    out = [math.nan]
    for i in range(1, len(rows)):
        j = max([0, i - window, *(b for b in breaks if b <= i)])
        dt = float(rows[i]["time"]) - float(rows[j]["time"])
        out.append(sum(counts[j + 1 : i + 1]) / dt if dt > 0 else math.nan)
    return out


def _mean_staleness(row: dict) -> float:
    hist = row.get("staleness_hist") or {}
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else 0.0


def _utilisation_png(plt, run_dir: Path, timelines: dict, t0: float, out: Path) -> Path:
    t1 = max((iv.end for ivs, _ in timelines.values() for iv in ivs), default=t0 + 1)
    bins = 120
    height = 1.3 + 1.1 * len(timelines) + 0.25 * 3  # the legend's rows below
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, height), dpi=100, sharex=True)
    axes = [axes] if len(timelines) == 1 else list(axes)
    xs = [(t0 + (b + 0.5) * (t1 - t0) / bins - t0) / 60 for b in range(bins)]
    for ax, (name, (ivs, states)) in zip(axes, timelines.items()):
        frac = binned(ivs, states, t0, t1, bins)
        if name == "generators":  # several timelines summed into one row: shares of their sum
            frac = [{k: v / max(1e-9, sum(f.values())) for k, v in f.items()} for f in frac]
        ax.stackplot(
            xs, *[[f[s] for f in frac] for s in states], labels=states, colors=[COLOURS[s] for s in states], step="mid"
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
        ax.set_yticks([0, 1])
    axes[-1].set_xlabel("minutes since the run started")
    handles: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    labels = list(handles)
    axes[0].set_title(f"{run_dir.name}: where each component's time went", fontsize=10)
    ncol = min(4, len(labels))
    fig.legend([handles[k] for k in labels], labels, loc="lower center", ncol=ncol, fontsize=8)
    legend_in = 0.25 * -(-len(labels) // ncol) + 0.15
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    return _save(fig, out, tight=False)


def eval_series(rows: Sequence[dict]) -> dict[str, list[tuple[int, float]]]:
    """{"<domain> pass@k": [(learner step evaluated, value)]} from the eval/<domain>/pass@k keys
    a step's report carries when a periodic evaluation finished (learner.eval)."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        step = r.get("eval/step")
        for key, value in r.items():
            if key.startswith("eval/") and "/pass@" in key and isinstance(step, int):
                domain, _, k = key[len("eval/") :].rpartition("/")  # a domain name may hold a '/'
                out.setdefault(f"{domain} {k}", {})[step] = float(value)  # a repeated step: the later report
    return {name: sorted(points.items()) for name, points in sorted(out.items())}


def _eval_png(plt, run_dir: Path, series: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, points in series.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", lw=1, label=name)
    ax.set_xlabel("learner step evaluated")
    ax.set_ylabel("pass@k on held-out tasks")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(f"{run_dir.name}: held-out evaluation")
    return _save(fig, out)


def _save(fig, out: Path, tight: bool = True) -> Path:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
