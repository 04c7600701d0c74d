"""The learner's step alone: `train_step` time with shared-prompt packing against one row per
trajectory, on the same sampled batches.

    .venv/bin/python bench/learner_step.py [--steps 60] [--rounds 2] [--json out.json] [KEY=VALUE ...]

    # a site domain, e.g. the TRL peer's `sum` task (its folder on PYTHONPATH):
    PYTHONPATH=../shared/peers .venv/bin/python bench/learner_step.py \\
        'domains=[{name: sum, module: "sum_task:make_domain"}]'

Each round runs two child processes one after the other, `learner.share_prompt=true` and
`false`, nothing else differing: the generator samples 4 batches of real trajectories from
config.yaml's domains (overrides apply) with the untrained policy, rewards alternate within
each group so every group has a signal, then a one-rank ZeRO-3 Learner (gloo, one torch
thread, as in a run) trains `--steps` steps over them after 5 warm-up steps. Printed: ms of
wall and CPU per step for each, tokens per batch packed and unpacked, and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _child(steps: int, overrides: list[str]) -> dict:
    import torch

    from hpcrl.core.config import load_config
    from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
    from hpcrl.rl.domains import load_domains
    from hpcrl.rl.learner.batch import layout
    from hpcrl.rl.learner.learner import Learner
    from hpcrl.rl.learner.packing import plan_units
    from hpcrl.rl.model.alphabet import resolve_charset
    from hpcrl.rl.model.policy import Policy
    from hpcrl.rl.rollout.generator import Generator

    torch.set_num_threads(1)  # as each component does
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "config.yaml"), ["policy.device=cpu", *overrides])
    domains = load_domains(cfg.domains)
    if any(d.needs_executor for d in domains.values()):
        raise SystemExit("bench/learner_step.py: use domains without a sandbox")
    cfg = resolve_charset(cfg, domains)
    gen = Generator(cfg.generators, Policy.load(cfg.policy, seed=0), domains, run="bench", name="g", seed=0)
    sizes = {name: d.size for name, d in domains.items()}
    source = LocalTaskSource(TaskSampler({d.name: d.weight for d in cfg.domains}, cfg.learner.group_size, 0, sizes))
    open_groups: dict = {}
    full: list = []

    def add(t):
        g = open_groups.setdefault((t.domain, t.task, t.episode // cfg.learner.group_size), [])
        g.append(t)
        if len(g) == cfg.learner.group_size:
            full.append(g)

    k = cfg.learner.batch_groups
    gen.run(source, add, stop=lambda: len(full) >= 4 * k)
    gen.close()
    signal = lambda t, i, j: dataclasses.replace(t, final_reward=float((i + j) % 2))
    full = [[signal(t, i, j) for i, t in enumerate(g)] for j, g in enumerate(full)]
    batches = [full[i * k : (i + 1) * k] for i in range(4)]
    rows = [layout(t) for g in batches[0] for t in g]
    members = [list(range(i, i + cfg.learner.group_size)) for i in range(0, len(rows), cfg.learner.group_size)]
    tokens = {"unpacked": sum(len(r[0]) for r in rows), "packed": sum(u.length for u in plan_units(rows, members))}

    learner = Learner(cfg.learner, cfg.policy, tempfile.mkdtemp(prefix="hpcrl-bench-"), seed=0)
    learner.setup()
    for i in range(5):
        learner.train_step(batches[i % 4])
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        learner.train_step(batches[i % 4])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    learner.close()
    return {"wall_ms": 1000 * wall / steps, "cpu_ms": 1000 * cpu / steps, "tokens_per_batch": tokens}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per run (after 5 warm-up steps)")
    ap.add_argument("--rounds", type=int, default=2, help="packed/unpacked pairs, run one after the other")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (both variants)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.steps, a.overrides)))
        return 0
    runs: dict[str, list[dict]] = {"true": [], "false": []}
    for _ in range(a.rounds):
        for flag in runs:
            env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")  # fmt: skip
            cmd = [sys.executable, __file__, "--child", "--steps", str(a.steps), *a.overrides]
            out = subprocess.run([*cmd, f"learner.share_prompt={flag}"], env=env, capture_output=True, text=True)
            if out.returncode:
                sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
                raise SystemExit(f"bench/learner_step.py: the share_prompt={flag} run failed (exit {out.returncode})")
            runs[flag].append(json.loads(out.stdout.strip().splitlines()[-1]))
    tokens = runs["true"][0]["tokens_per_batch"]
    print(f"tokens per batch: {tokens['unpacked']} in rows, {tokens['packed']} packed")
    print(f"{'share_prompt':<14}{'wall ms/step':>14}{'CPU ms/step':>14}")
    for flag, rs in runs.items():
        wall = ", ".join(f"{r['wall_ms']:.1f}" for r in rs)
        cpu = ", ".join(f"{r['cpu_ms']:.1f}" for r in rs)
        print(f"{flag:<14}{wall:>14}{cpu:>14}")
    mean = {f: sum(r["wall_ms"] for r in rs) / len(rs) for f, rs in runs.items()}
    print(f"packed step / unpacked step: {mean['true'] / mean['false']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "ratio": mean["true"] / mean["false"], "overrides": a.overrides}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
