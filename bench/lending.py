"""Does lending pay? The generator alone, with and without `generators.lend_episodes`, side by side.

    .venv/bin/python bench/lending.py [--env judge|remote] [--seconds 20] [--rounds 3]
        [--in-flight 16] [--lend 16] [--json out.json]

Lending: an episode waiting on its sandbox leaves its row of the batch idle;
with `lend_episodes` N the generator takes up to N more episodes meanwhile, still decoding at most
`episodes_in_flight` rows at once. Three configurations run in turn, `--rounds` times
(interleaved, so load drifts hit all alike), each for `--seconds` after a warm-up:

  base    episodes_in_flight = K, lend 0 (today's default)
  lend    episodes_in_flight = K, lend_episodes = N
  wide    episodes_in_flight = K + N, lend 0: the same episodes open, but up to K + N rows
          decode at once (what lending avoids: a batch, and its memory, N rows larger)

`--env judge`: the code domains (code-repair, synth) through the real bwrap sandbox on this
machine's cores, which the sampling shares. `--env remote`: arith/copy whose every step waits
a seeded lognormal time (median `--latency-ms`) without using a core, as a sandbox on another
node (a CPU partition) would. Printed per configuration: trajectories/s (median over rounds)
and its ratio to base, mean rows per sampling call, the largest batch, and the share of the
generator's wall time with nothing to decode (waiting on environments).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def remote_domain(latency_ms: float, seed: int):
    """arith/copy, every step first waiting ~latency_ms off this machine's cores."""
    import numpy as np

    from hpcrl.rl.domains import Domain, Environment, get_domain

    inner = get_domain("arith/copy")
    rng = np.random.default_rng(seed)

    class Remote(Domain):
        name, needs_executor, action = inner.name, True, inner.action

        def task(self, index):
            return inner.task(index)

        def make_env(self, task, executor=None):
            return RemoteEnv(inner.make_env(task), float(rng.lognormal(np.log(latency_ms / 1e3), 0.5)))

    class RemoteEnv(Environment):
        def __init__(self, env, wait_s):
            self.env, self.wait_s = env, wait_s

        def reset(self):
            return self.env.reset()

        def step(self, action):
            time.sleep(self.wait_s)  # the remote sandbox's run: no core of ours is used
            return self.env.step(action)

    return {inner.name: Remote()}


def measure(cfg, domains, judge, seconds: float) -> dict:
    """One configuration: the generator alone, tasks from an in-process sampler, trajectories dropped."""
    from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
    from hpcrl.rl.model.policy import Policy
    from hpcrl.rl.rollout.generator import Generator

    gen = Generator(cfg.generators, Policy.load(cfg.policy, seed=0), domains, run="b", name="g", seed=0, executor=judge)
    rows: list[int] = []
    step = gen.engine.step

    def counted():
        rows.append(len(gen.engine.rows) + len(gen.engine.pending))
        return step()

    gen.engine.step = counted
    source = LocalTaskSource(TaskSampler({n: 1.0 for n in domains}, cfg.learner.group_size, 0))
    count = [0]
    sink = lambda _t: count.__setitem__(0, count[0] + 1)
    gen.run(source, sink, stop=lambda: count[0] >= 2 * cfg.generators.episodes_in_flight)  # warm-up
    s0 = dict(vars(gen.stats))
    n0, t0 = count[0], time.perf_counter()
    gen.run(source, sink, stop=lambda: time.perf_counter() - t0 >= seconds)
    wall, s = time.perf_counter() - t0, gen.stats
    gen.close()
    d = {k: getattr(s, k) - s0[k] for k in ("batches", "batch_rows", "env_wait_s", "wall_s", "lent")}
    return {
        "traj_per_s": (count[0] - n0) / wall,
        "rows": d["batch_rows"] / max(d["batches"], 1),
        "max_rows": max(rows),
        "env_wait": d["env_wait_s"] / d["wall_s"],
        "lent": d["lent"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=("judge", "remote"), default="remote")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--lend", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, default=200.0, help="--env remote: median step wait")
    ap.add_argument("--uid-base", type=int, default=61000, help="--env judge: the sandbox's slot uids")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import torch

    from hpcrl.core.config import load_config
    from hpcrl.rl.domains import load_domains
    from hpcrl.rl.model.alphabet import resolve_charset

    torch.set_num_threads(1)  # as each component does
    k, n = args.in_flight, args.lend
    threads = max(8, 2 * (k + n)) if args.env == "remote" else 8
    common = [f"generators.env_threads={threads}", "generators.max_turns=3", "generators.max_new_tokens=48"]
    common.append(f"domains={_domains(args.env)}")
    judge = None
    if args.env == "judge":
        from hpcrl.rl.domains.code import SandboxJudge
        from hpcrl.sandbox.auto import make_backend

        sandbox = load_config(ROOT / "config.yaml", [f"sandbox.uid_base={args.uid_base}"]).sandbox
        backend = make_backend(sandbox)
        backend.check()
        judge = SandboxJudge(backend)
    setups = {
        "base": [f"generators.episodes_in_flight={k}", "generators.lend_episodes=0"],
        "lend": [f"generators.episodes_in_flight={k}", f"generators.lend_episodes={n}"],
        "wide": [f"generators.episodes_in_flight={k + n}", "generators.lend_episodes=0"],
    }
    results: dict[str, list[dict]] = {name: [] for name in setups}
    for r in range(args.rounds):
        for name, over in setups.items():
            cfg = load_config(ROOT / "config.yaml", [*over, *common])
            loaded = load_domains(cfg.domains)
            cfg = resolve_charset(cfg, loaded)
            domains = remote_domain(args.latency_ms, r) if args.env == "remote" else loaded
            results[name].append(measure(cfg, domains, judge or object(), args.seconds))
            print(f"round {r + 1} {name}: {results[name][-1]}", flush=True)
    base_rate = statistics.median(x["traj_per_s"] for x in results["base"])
    print(f"\nenv {args.env}, episodes_in_flight {k}, lend {n}, {args.rounds} rounds of {args.seconds:.0f} s")
    print(f"{'':6} {'traj/s':>8} {'ratio':>6} {'rows':>6} {'max rows':>8} {'env wait':>8}")
    summary = {}
    for name, xs in results.items():
        med = {key: statistics.median(x[key] for x in xs) for key in ("traj_per_s", "rows", "env_wait")}
        med["max_rows"] = max(x["max_rows"] for x in xs)
        med["ratio"] = med["traj_per_s"] / base_rate
        summary[name] = med
        print(
            f"{name:6} {med['traj_per_s']:8.1f} {med['ratio']:6.2f} {med['rows']:6.1f} "
            f"{med['max_rows']:8d} {100 * med['env_wait']:7.1f}%"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": results, "summary": summary}, indent=1))


def _domains(env: str) -> str:
    return "[{name: code-repair}, {name: synth}]" if env == "judge" else "[{name: arith/copy}]"


if __name__ == "__main__":
    main()
