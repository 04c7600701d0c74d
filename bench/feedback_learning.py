"""Does the sandbox's feedback teach? First-attempt against second-attempt success over training,
on `libcall` (rl/domains/libcall.py), read from the trajectories a run stored.

    python bench/feedback_learning.py [--config examples/feedback.yaml] [--seeds 0 1 2]
        [--window 10] [--out DIR] [--png PATH] [--json PATH] [KEY=VALUE ...]
    python bench/feedback_learning.py --runs RUN_DIR [RUN_DIR ...]      # only read finished runs

Each seed is one `hpcrl run` of the config (every component a process: store writer,
coordinator, sandbox server, generator, ZeRO-3 learner; KEY=VALUE overrides are added), one
after the other. Its store (`trajectories/`, HDF5) is then read back: per episode, whether
attempt 1 succeeded and, when it failed, whether attempt 2 did. Episodes are grouped into
windows of `--window` policy versions (the version that sampled attempt 1; one per learner
step), and for each window the script prints both rates side by side, and their ratio: attempt 1
has nothing to go on but the prompt (at best 1/K for K names), attempt 2 also has the error line
of attempt 1. A ratio well above 1 that grows with training is the feedback being learned.

`--png` draws both rates per seed against the learner step (the 1/K ceiling of a guess dashed),
`--json` writes every window, the wall time and the load average of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from loadavg import LoadSampler  # bench/loadavg.py: this folder is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "feedback.yaml"


def attempt_windows(trajectories: Iterable, window: int, domain: str | None = None) -> list[dict]:
    """Per window of `window` policy versions (that of each episode's first attempt): episodes,
    attempt-1 successes, attempt-1 failures that had a second attempt, and their successes.
    A step succeeded when its reward is positive (libcall rewards only a right answer)."""
    rows: dict[int, dict] = {}
    for t in trajectories:
        if (domain is not None and t.domain != domain) or not t.steps or t.truncation != "none":
            continue
        w = t.steps[0].policy_version // window
        r = rows.setdefault(w, {"first_version": w * window, "episodes": 0, "first_ok": 0, "second": 0, "second_ok": 0})
        r["episodes"] += 1
        if t.steps[0].reward > 0:
            r["first_ok"] += 1
        elif len(t.steps) > 1:
            r["second"] += 1
            r["second_ok"] += int(t.steps[1].reward > 0)
    out = []
    for w in sorted(rows):
        r = rows[w]
        r["first"] = r["first_ok"] / r["episodes"]
        r["second_given_first_failed"] = r["second_ok"] / r["second"] if r["second"] else float("nan")
        out.append(r)
    return out


def read_run(run_dir: Path, window: int) -> list[dict]:
    from hpcrl.rl.store.reader import StoreReader

    return attempt_windows(StoreReader(run_dir), window)


def train(config: Path, seed: int, root: Path, overrides: list[str]) -> dict:
    """One `hpcrl run` to its `learner.max_steps`; its run directory, wall time and load."""
    run_id = f"feedback-s{seed}"
    cmd = [sys.executable, "-m", "hpcrl.jobs.cli", "run", str(config), f"experiment.seed={seed}"]
    cmd += [f"experiment.run_root={root}", *overrides, "--run-id", run_id, "--quiet"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with LoadSampler() as load, open(root / f"{run_id}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"bench/feedback_learning.py: hpcrl run exited {rc}; see {root / f'{run_id}.log'}")
    return {"seed": seed, "run_dir": str(root / run_id), "wall_s": round(wall, 1), "load": load.summary()}


def _rate(x: float) -> str:
    return "   -" if x != x else f"{x:.2f}"


def summary(windows: list[dict]) -> dict:
    """Attempt-1 and attempt-2 success in the first, middle and last window."""
    pick = {"start": windows[0], "middle": windows[len(windows) // 2], "end": windows[-1]} if windows else {}
    return {
        k: {"versions": w["first_version"], "first": w["first"], "second": w["second_given_first_failed"]}
        for k, w in pick.items()
    }


def report(run: dict, window: int) -> str:
    lines = [f"seed {run['seed']}: {run['run_dir']}  wall {run.get('wall_s', '-')} s  load {run.get('load', '-')}"]
    lines.append(f"  {'steps':>9} {'episodes':>9} {'attempt 1':>10} {'attempt 2 | 1 failed':>21} {'ratio':>6}")
    for w in run["windows"]:
        a, b = w["first"], w["second_given_first_failed"]
        ratio = f"{b / a:6.1f}" if a > 0 and b == b else "     -"
        steps = f"{w['first_version']}-{w['first_version'] + window - 1}"
        lines.append(f"  {steps:>9} {w['episodes']:>9} {_rate(a):>10} {_rate(b):>21} {ratio}")
    return "\n".join(lines)


def plot(runs: list[dict], window: int, names: int | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        ws = run["windows"]
        x = [w["first_version"] + window / 2 for w in ws]
        c = colors[i % len(colors)]
        second = [w["second_given_first_failed"] for w in ws]
        ax.plot(x, second, "-", color=c, label=f"attempt 2 | attempt 1 failed, seed {run['seed']}")
        ax.plot(x, [w["first"] for w in ws], ":", color=c, label=f"attempt 1, seed {run['seed']}")
    if names:
        ax.axhline(1 / names, color="gray", ls="--", lw=0.8, label=f"1/{names}: a guess")
    ax.set_xlabel("learner step (policy version of attempt 1)")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1.02)
    ax.set_title("libcall: the second attempt reads the first one's error line")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_facts(run_dir: Path) -> dict:
    """The seed and the number of names K of a run, from the config it ran (config.resolved.yaml)."""
    from hpcrl.core.config import load_config
    from hpcrl.rl.domains import load_domains

    cfg = load_config(run_dir / "config.resolved.yaml")
    names = [len(d.names) for d in load_domains(cfg.domains).values() if hasattr(d, "names")]
    return {"seed": cfg.experiment.seed, "names": names[0] if names else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every run")
    ap.add_argument("--config", type=Path, default=CONFIG, help="experiment YAML (default examples/feedback.yaml)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="experiment.seed of each run (default 0)")
    ap.add_argument("--window", type=int, default=10, help="learner steps per window (default 10)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a new temporary one)")
    ap.add_argument("--runs", type=Path, nargs="+", help="read these finished run directories instead of training")
    ap.add_argument("--png", type=Path, help="draw the curves here")
    ap.add_argument("--json", type=Path, help="write every window, wall time and load here")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window must be at least 1")
    runs = []
    if args.runs:
        runs = [{"run_dir": str(p)} for p in args.runs]
    else:
        import tempfile

        root = args.out or Path(tempfile.mkdtemp(prefix="feedback-learning-"))
        for seed in args.seeds:
            print(f"seed {seed}: hpcrl run {args.config} -> {root}", flush=True)
            runs.append(train(args.config, seed, root, args.overrides))
    for run in runs:
        run.update(run_facts(Path(run["run_dir"])))
        run["windows"] = read_run(Path(run["run_dir"]), args.window)
        run["summary"] = summary(run["windows"])
        print(report(run, args.window), flush=True)
    if args.png:
        plot(runs, args.window, runs[0]["names"], args.png)
        print(f"wrote {args.png}")
    if args.json:
        args.json.write_text(json.dumps({"window": args.window, "runs": runs}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
