"""Generator and learner in one process, taking turns: the synchronous reference loop.

    python -m hpcrl.rl.learner.inprocess config.yaml [KEY=VALUE ...] --run-dir /tmp/r1 [--metrics m.jsonl]

The generator runs until the buffer holds one batch of fresh groups, the learner takes an
optimizer step and publishes the weights, the generator picks them up, and so on: on-policy,
with the same Generator, Learner (one-rank DeepSpeed ZeRO-3), weight files and domains as the
distributed run, minus processes and sockets. Useful to debug a domain or an algorithm, and as
the learning test's loop. Code domains get a local sandbox backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpcrl.core.config import Config, load_config
from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler, domain_report
from hpcrl.rl.domains import SandboxJudge, load_domains
from hpcrl.rl.learner.batch import GroupBuffer
from hpcrl.rl.learner.learner import Learner
from hpcrl.rl.model.alphabet import resolve_charset
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.evaluate import PeriodicEvaluator
from hpcrl.rl.rollout.generator import Generator
from hpcrl.rl.weights.shards import WeightStore
from hpcrl.sandbox.auto import make_backend

__all__ = ["train_in_process"]


def train_in_process(
    cfg: Config,
    run_dir: str | Path,
    on_step: Callable[[dict], None] = lambda m: None,
    stop_at_reward: float | None = None,
) -> list[dict]:
    """Train up to cfg.learner.max_steps optimizer steps (resuming from the run dir's newest
    checkpoint, if any), or until a step's mean reward reaches `stop_at_reward`; return each
    step's metrics. Episodes in flight at a crash are not saved: a resumed loop samples new ones."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed = cfg.experiment.seed
    domains = load_domains(cfg.domains)
    cfg = resolve_charset(cfg, domains)
    learner = Learner(cfg.learner, cfg.policy, run_dir, seed=seed)
    resumed = learner.setup()
    executor = None
    if any(d.needs_executor for d in domains.values()):
        executor = SandboxJudge(make_backend(cfg.sandbox))
    policy = Policy.load(cfg.policy, seed=seed)
    gen = Generator(
        # Synchronous and exactly on-policy: nothing sampled under old weights goes on.
        dataclasses.replace(cfg.generators, weight_swap="restart"),
        policy,
        domains,
        run=run_dir.name or "run",
        name="gen-0",
        seed=seed,
        executor=executor,
        weights=WeightStore(run_dir, keep=cfg.learner.keep_weights),
    )
    sizes = {name: d.size for name, d in domains.items()}
    sampler = TaskSampler({d.name: d.weight for d in cfg.domains}, cfg.learner.group_size, seed, sizes)
    if "sampler" in resumed:
        sampler.restore(resumed["sampler"])  # new task instances, not the ones before the checkpoint
    source = LocalTaskSource(sampler)
    evaluator = None
    if cfg.learner.eval.every_steps:
        # Synchronous like the rest of this loop: the evaluation runs in line after publishing.
        def make_judge():  # the training's own sandbox, or one for code domains evaluated alone
            return executor or SandboxJudge(make_backend(cfg.sandbox))

        evaluator = PeriodicEvaluator(run_dir, cfg.learner.eval, cfg.policy, make_judge)
    buffer = GroupBuffer(cfg.learner.group_size, filter_zero_variance=cfg.learner.filter_groups)
    history: list[dict] = []
    t0 = time.perf_counter()
    try:
        while learner.step < cfg.learner.max_steps:
            batch: list = []

            def ready(batch: list = batch) -> bool:
                got = buffer.pop(cfg.learner.batch_groups, learner.version, cfg.learner.max_staleness)
                if got is not None:
                    batch.extend(got)
                return got is not None

            gen.run(source, buffer.add, stop=ready)
            m = learner.train_step(batch)
            learner.publisher.flush()  # announced before the next round samples: exactly on-policy
            m["elapsed_s"] = time.perf_counter() - t0
            m["generator_busy"] = gen.stats.busy_fraction
            m["generated"], m["filtered"] = gen.stats.trajectories, buffer.filtered
            m["domains"] = domain_report(sampler.issued(), buffer.domain_counts())
            if evaluator is not None and evaluator.due(learner.step):
                m.update(evaluator.run_now(learner.step, learner.version))
            history.append(m)
            on_step(m)
            if learner.step % cfg.learner.checkpoint_every == 0:
                learner.checkpoint({"sampler": sampler.state()})
            if stop_at_reward is not None and m["reward"] >= stop_at_reward:
                break
    finally:
        gen.close()
        learner.close()
        if evaluator is not None:
            evaluator.close()
    return history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcrl.rl.learner.inprocess", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="experiment YAML, e.g. config.yaml")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    ap.add_argument("--run-dir", required=True, help="folder for weights and checkpoints (created)")
    ap.add_argument("--metrics", help="append one JSON line of metrics per step here")
    ap.add_argument("--stop-at-reward", type=float, help="stop once a step's mean reward reaches this")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    out = open(args.metrics, "a") if args.metrics else None

    def report(m: dict) -> None:
        print(
            f"step {m['step']:4d}  reward {m['reward']:.3f}  loss {m['loss']:+.4f}  "
            f"clip {m['clip_fraction']:.3f}  {m['elapsed_s']:.1f} s",
            flush=True,
        )
        if out:
            out.write(json.dumps(m) + "\n")
            out.flush()

    try:
        train_in_process(cfg, args.run_dir, report, args.stop_at_reward)
    finally:
        if out:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
