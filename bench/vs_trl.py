"""hpcrl against the TRL peer baseline on one task, side by side: the same task module, model
shape, tokenizer alphabet and training wall time, run one after the other on this machine.

    python bench/vs_trl.py --task-module /work/shared/peers/sum_task.py --minutes 10 --seed 0 [--json out.json]
        [--trl-alphabet same|shipped|both] [--order trl-first|hpcrl-first] [--out DIR] [KEY=VALUE ...]

The task module has the two functions of the peer harness's interface (shared/peers/README.md):
`make_task` for TRL (trl_grpo_baseline.py --task-module PATH:make_task) and `make_domain` for
hpcrl (a site domain, `domains=[{name: <stem>, module: "<stem>:make_domain"}]`), so any task is
compared the same way. Each system trains for `--minutes` of training wall time:

* TRL: `trl_grpo_baseline.py` (its own venv, TRL_PEER_VENV, default /tmp/trl-peer, created by
  run_trl_baseline.sh if missing) with `--max-minutes`, `--seed`, and the domain's action
  length as `--max-completion-length`; its clock starts at `on_train_begin`.
* hpcrl: `hpcrl run` in its default configuration (config.yaml; KEY=VALUE overrides are added,
  and `learner.max_steps` is lifted so that time, not steps, ends the run) with every component a
  process (store writer, coordinator, ZeRO-3 learner, generator); its clock starts when the
  learner first asks for data, and it is stopped (SIGTERM, a clean stop) once its metrics show
  `--minutes` of training; later steps are not counted.

Alphabet: hpcrl's tiny model uses `policy.tiny.charset: auto`, the task's own characters.
`--trl-alphabet same` (the default) gives the TRL harness exactly that alphabet (its module
constant ALPHABET, set before its main() builds the tokenizer), so both models have the same
vocabulary and shape (tied embeddings, hidden 64, 2 layers, 4 heads, MLP 256); `shipped` runs
the harness as it is (its 48-character alphabet); `both` runs TRL twice.

Printed for each run: the moving-average reward (window 20 optimizer steps, as the harness
computes it) at 60, 150, 300 and 600 s, and its median and 10th percentile over the last fifth
before each (48-60 s, ..., 480-600 s: one instant can fall on a single bad step); the time to a
moving average of 0.5 and 0.9, steps, samples/s (TRL: completions generated per second of
training; hpcrl: trajectories trained per second), and the load average during the run (other
jobs share the machine: per-step and per-sample figures do not depend on it, wall-clock ones
do). `--json` writes everything, and `--out` keeps the runs and a `vs_trl.png` of the curves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadavg import LoadSampler  # bench/loadavg.py: this folder is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("HPCRL_PEERS", "/work/shared/peers"))
CHECKPOINTS_S = (60, 150, 300, 600)
TARGETS = (0.5, 0.9)
WINDOW = 20

_TRL_MAIN = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("trl_grpo_baseline", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["trl_grpo_baseline"] = mod
spec.loader.exec_module(mod)
if sys.argv[2] != "-":
    mod.ALPHABET = sys.argv[2]  # the tokenizer's characters, read when main() builds it
mod.main(sys.argv[3:])
"""


def moving_average(xs: list[float], w: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= w:
            total -= xs[i - w]
        out.append(total / min(i + 1, w))
    return out


def summarize(points: list[tuple[int, float, int, float]], minutes: float) -> dict:
    """points: (step, training seconds, samples so far, reward) per optimizer step; the steps
    after `minutes` do not count (a step that ends past it still shows that the run got there)."""
    reached = max((p[1] for p in points), default=0.0)
    points = [p for p in points if p[1] <= minutes * 60 + 1e-6]
    if not points:
        return {"steps": 0}
    ma = moving_average([p[3] for p in points])
    full = min(WINDOW, len(ma))  # as the harness: a target counts once the window is full

    def at(seconds: float):
        idx = [i for i, p in enumerate(points) if p[1] <= seconds]
        return round(ma[idx[-1]], 4) if idx and reached >= seconds else None

    def first(target: float):
        hit = next((i for i, v in enumerate(ma) if i + 1 >= full and v >= target), None)
        return None if hit is None else {"seconds": round(points[hit][1], 1), "step": points[hit][0]}

    def trailing(seconds: float):
        """Median and 10th percentile of the moving average over the last fifth before `seconds`:
        the value at one instant can sit on a single bad step (a 20-step window late in a run
        holds ~1.5 s of hpcrl's steps), so it is read beside the level around it."""
        vals = sorted(m for p, m in zip(points, ma) if 0.8 * seconds <= p[1] <= seconds)
        if not vals or reached < seconds:
            return None
        return {"median": round(vals[len(vals) // 2], 4), "p10": round(vals[len(vals) // 10], 4)}

    wall = points[-1][1]
    return {
        "ma_at_s": {str(s): at(s) for s in CHECKPOINTS_S},
        "ma_trailing_s": {str(s): trailing(s) for s in CHECKPOINTS_S},
        "to_ma": {str(t): first(t) for t in TARGETS},
        "steps": points[-1][0],
        "samples": points[-1][2],
        "train_s": round(wall, 1),
        "samples_per_s": round(points[-1][2] / max(wall, 1e-9), 1),
        "steps_per_s": round(points[-1][0] / max(wall, 1e-9), 2),
        "ma_end": round(ma[-1], 4),
        "curve": [[round(p[1], 2), round(m, 4), p[0]] for p, m in zip(points, ma)],
    }


# -- TRL ------------------------------------------------------------------------------------------


def trl_python() -> Path:
    venv = Path(os.environ.get("TRL_PEER_VENV", "/tmp/trl-peer"))
    if not (venv / ".pins-ok").exists():  # create the harness's venv the way its runner does
        subprocess.run([str(PEERS / "run_trl_baseline.sh"), "--help"], check=True, stdout=subprocess.DEVNULL)
    return venv / "bin" / "python"


def run_trl(task: Path, alphabet: str | None, seed: int, minutes: float, max_len: int, out: Path) -> dict:
    py = trl_python()
    venv = py.parent.parent
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
        WANDB_MODE="disabled",
        CUDA_VISIBLE_DEVICES="",
        PYTHONHASHSEED="0",
        HF_HOME=str(venv / "hf-home"),
        MPLCONFIGDIR=str(venv / "mpl"),
    )
    env.pop("PYTHONPATH", None)
    args = ["--task-module", f"{task}:make_task", "--steps", "10000000", "--max-minutes", str(minutes)]
    args += ["--seed", str(seed), "--max-completion-length", str(max_len), "--out", str(out)]
    cmd = [str(py), "-c", _TRL_MAIN, str(PEERS / "trl_grpo_baseline.py"), alphabet or "-", *args]
    out.mkdir(parents=True, exist_ok=True)
    with LoadSampler() as load, open(out / "trl.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = json.loads((out / "result.json").read_text())
    points = [(r["step"], r["wall_s"], r["completions"], r["reward"]) for r in rows if r.get("reward") is not None]
    s = summarize(points, minutes)
    model = result.get("model", {})
    s.update(system="trl", vocab=model.get("vocab"), params=model.get("params"), load=load.summary(), out=str(out))
    s["greedy_eval"] = result.get("greedy_eval_reward")
    return s


# -- hpcrl ----------------------------------------------------------------------------------------


def domain_of(task: Path, label: str, overrides: list[str]):
    """The hpcrl config and the domain the task module makes (for the alphabet and action length)."""
    sys.path.insert(0, str(task.parent))
    from hpcrl.core.config import load_config
    from hpcrl.rl.domains import load_domains
    from hpcrl.rl.model.alphabet import resolve_charset

    cfg = load_config(
        ROOT / "config.yaml", [f'domains=[{{name: {label}, module: "{task.stem}:make_domain"}}]', *overrides]
    )
    domains = load_domains(cfg.domains)
    return resolve_charset(cfg, domains), domains[label]


def run_hpcrl(
    task: Path, label: str, seed: int, minutes: float, overrides: list[str], group_size: int, out: Path
) -> dict:
    root = out / "runs"
    cmd = [sys.executable, "-m", "hpcrl.jobs.cli", "run", str(ROOT / "config.yaml")]
    cmd += [f'domains=[{{name: {label}, module: "{task.stem}:make_domain"}}]', f"experiment.seed={seed}"]
    cmd += [f"experiment.run_root={root}", "learner.max_steps=10000000", *overrides, "--run-id", "run", "--quiet"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(task.parent), os.environ.get("PYTHONPATH", "")]))
    out.mkdir(parents=True, exist_ok=True)
    metrics = root / "run" / "metrics.jsonl"
    with LoadSampler() as load, open(out / "hpcrl.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            t0 = None
            while proc.poll() is None:
                time.sleep(1.0)
                last = _last_row(metrics)
                if last is not None and t0 is None:
                    t0 = _start(_rows(metrics)[0])  # once: the first report
                if last is not None and t0 is not None and last["time"] - t0 >= minutes * 60:
                    break
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # a clean stop: the learner checkpoints, the store finalizes
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    rows = _rows(metrics)
    if not rows:
        raise SystemExit(f"bench/vs_trl.py: hpcrl made no learner step; see {out / 'hpcrl.log'}")
    t0 = _start(rows[0])
    points = [(r["step"], r["time"] - t0, r["trained_groups"] * group_size, r["reward"]) for r in rows]
    s = summarize(points, minutes)
    s.update(system="hpcrl", params=_params(root / "run"), load=load.summary(), out=str(root / "run"))
    return s


def _params(run_dir: Path) -> int | None:
    """Parameters of the published policy (tied weights stored once, as the model has them)."""
    files = sorted((run_dir / "weights").glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    with safe_open(str(files[-1]), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "rotary" not in k)


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    by_step = {}
    text = path.read_text()
    # While the run is live its last line may be half written: only whole lines count.
    for line in text[: text.rfind("\n") + 1].splitlines():
        if line.strip():
            r = json.loads(line)
            by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


def _last_row(path: Path) -> dict | None:
    """The newest whole line of a live metrics file, read from its end: reading the whole file
    every second took CPU from the run being measured (megabytes late in a 10-minute run)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read()
    except FileNotFoundError:
        return None
    lines = tail[: tail.rfind(b"\n") + 1].splitlines()
    return json.loads(lines[-1]) if lines and lines[-1].strip() else None


def _start(first: dict) -> float:
    """When the learner first asked for data: its first report, less that step and its wait."""
    return first["time"] - first.get("step_s", 0.0) - first.get("wait_s", 0.0)


# -- report ---------------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    head = f"{'system':24}" + "".join(f"{'MA@' + str(s) + 's':>9}" for s in CHECKPOINTS_S)
    head += "".join(f"{'t(MA>=' + str(t) + ')':>12}" for t in TARGETS)
    head += f"{'steps':>8}{'samples/s':>11}{'load mean/max':>15}"
    lines = [head]
    for r in results:
        cells = "".join(
            f"{'-' if r['ma_at_s'][str(s)] is None else format(r['ma_at_s'][str(s)], '.3f'):>9}" for s in CHECKPOINTS_S
        )
        cells += "".join(
            f"{'-' if r['to_ma'][str(t)] is None else format(r['to_ma'][str(t)]['seconds'], '.0f') + ' s':>12}"
            for t in TARGETS
        )
        name = r["system"] + (f" ({r['vocab']} tokens)" if r.get("vocab") else "")
        lines.append(
            f"{name:24}{cells}{r['steps']:>8}{r['samples_per_s']:>11.0f}"
            f"{str(r['load']['mean']) + ' / ' + str(r['load']['max']):>15}"
        )
    lines += ["", "moving average over the last fifth before each checkpoint, median (10th percentile):"]
    for r in results:
        name = r["system"] + (f" ({r['vocab']} tokens)" if r.get("vocab") else "")
        trail = r.get("ma_trailing_s") or {}
        cells = "".join(
            f"{'-' if not trail.get(str(s)) else '{median:.3f} ({p10:.3f})'.format(**trail[str(s)]):>17}"
            for s in CHECKPOINTS_S
        )
        lines.append(f"{name:24}{cells}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    for r in results:
        c = r["curve"]
        label = r["system"] + (f" ({r['vocab']} tokens)" if r.get("vocab") else "") + f", {r['samples_per_s']:.0f}/s"
        ax.plot([p[0] for p in c], [p[1] for p in c], label=label)
    for t in TARGETS:
        ax.axhline(t, color="gray", lw=0.5, ls=":")
    ax.set(xlabel="training seconds", ylabel=f"moving-average reward ({WINDOW} steps)", ylim=(-0.02, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="hpcrl config overrides (default: none)")
    ap.add_argument("--task-module", required=True, help="a .py file with make_task (TRL) and make_domain (hpcrl)")
    ap.add_argument("--minutes", type=float, default=10.0, help="training wall time of each system")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-alphabet", choices=("same", "shipped", "both"), default="same")
    ap.add_argument("--order", choices=("trl-first", "hpcrl-first"), default="trl-first")
    ap.add_argument("--name", help="the domain's label in hpcrl (default: the module's name without _task)")
    ap.add_argument("--out", help="keep the runs and vs_trl.png here (default: a temporary folder)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    task = Path(args.task_module).resolve()
    label = args.name or task.stem.removesuffix("_task")
    out = Path(args.out or tempfile.mkdtemp(prefix="vs-trl-"))
    cfg, domain = domain_of(task, label, args.overrides)
    charset = cfg.policy.tiny.charset
    same = None if charset == "printable" else charset
    if same is None and args.trl_alphabet != "shipped":
        print("the task declares no alphabet (hpcrl uses printable ASCII): TRL runs with its shipped one")
    alphabets = {"same": [same], "shipped": [None], "both": [same, None]}[args.trl_alphabet]
    if same is None:
        alphabets = [None]
    print(
        f"task {task.name} (hpcrl domain {label!r}, alphabet {charset!r}), {args.minutes:g} min each, "
        f"seed {args.seed}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    jobs = [("trl", a) for a in alphabets]
    jobs = jobs + [("hpcrl", None)] if args.order == "trl-first" else [("hpcrl", None), *jobs]
    results = []
    for system, alphabet in jobs:
        tag = "same" if alphabet else "shipped"
        print(f"{system}{' (' + tag + ' alphabet)' if system == 'trl' else ''} ...", flush=True)
        if system == "trl":
            r = run_trl(task, alphabet, args.seed, args.minutes, domain.action.max_tokens, out / f"trl-{tag}")
            r["alphabet"] = tag
        else:
            r = run_hpcrl(task, label, args.seed, args.minutes, args.overrides, cfg.learner.group_size, out / "hpcrl")
            r["vocab"] = len(charset) + 4 if same else None
        results.append(r)
        print(table([r]).splitlines()[1], flush=True)
    print()
    print(table(results))
    plot(results, out / "vs_trl.png", f"{task.stem}, seed {args.seed}, {args.minutes:g} min each")
    print(f"runs and vs_trl.png in {out}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"task": str(task), "seed": args.seed, "minutes": args.minutes, "charset": charset, "results": results},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
