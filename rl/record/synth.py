"""Synthetic trajectories with realistic shapes, for benchmarks, fault drills and tests.

    from hpcrl.rl.record.synth import SynthShape, synth_trajectory
    rng = np.random.default_rng(0)
    t = synth_trajectory(rng, run="synth", generator="gen-0", episode=0)

The default shape is a multi-step coding episode of a few thousand tokens: a task prompt,
then 2-6 turns of model actions (with logprobs) and sandbox feedback, some truncated. Token
ids are random; nothing here is a stub of a model, only a source of correctly shaped data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hpcrl.rl.record.trajectory import SANDBOX_STATUSES, SandboxOutcome, Step, Trajectory

__all__ = ["SynthShape", "synth_trajectory", "DEFAULT_SHAPE", "TINY_SHAPE"]

DOMAINS = ("arith", "code", "docqa", "cad3d")


@dataclass(frozen=True)
class SynthShape:
    """Ranges (inclusive low, exclusive high) of the parts of a synthetic episode."""

    steps: tuple[int, int] = (2, 7)
    first_prompt: tuple[int, int] = (300, 800)
    later_prompt: tuple[int, int] = (16, 96)  # turn separators, tool headers
    action: tuple[int, int] = (200, 900)
    observation: tuple[int, int] = (50, 500)
    vocab: int = 151_000


DEFAULT_SHAPE = SynthShape()
TINY_SHAPE = SynthShape(steps=(1, 4), first_prompt=(4, 16), later_prompt=(0, 4), action=(1, 12), observation=(0, 8))


def synth_trajectory(
    rng: np.random.Generator,
    run: str,
    generator: str,
    episode: int,
    shape: SynthShape = DEFAULT_SHAPE,
    policy_version: int = 0,
) -> Trajectory:
    n_steps = int(rng.integers(*shape.steps))
    start = time.time()
    steps = []
    version = policy_version
    for k in range(n_steps):
        # An asynchronous generator can see a weight update mid-episode.
        if k and rng.random() < 0.1:
            version += 1
        p = int(rng.integers(*(shape.first_prompt if k == 0 else shape.later_prompt)))
        a = int(rng.integers(*shape.action))
        o = int(rng.integers(*shape.observation))
        status = SANDBOX_STATUSES[int(rng.integers(1, len(SANDBOX_STATUSES)))]
        steps.append(
            Step(
                policy_version=version,
                prompt_tokens=rng.integers(0, shape.vocab, p, dtype=np.int32),
                action_tokens=rng.integers(0, shape.vocab, a, dtype=np.int32),
                action_logprobs=-rng.exponential(0.7, a).astype(np.float32),
                loss_mask=(rng.random(a) < 0.97).astype(np.uint8),
                observation_tokens=rng.integers(0, shape.vocab, o, dtype=np.int32),
                reward=float(rng.normal(0.0, 0.1)),
                sandbox=SandboxOutcome(status, 0 if status == "ok" else int(rng.integers(1, 3)), float(rng.random())),
                generate_s=float(rng.random() * 2),
                env_s=float(rng.random()),
            )
        )
    truncation = "max_steps" if n_steps == shape.steps[1] - 1 and rng.random() < 0.5 else "none"
    return Trajectory(
        run=run,
        domain=DOMAINS[int(rng.integers(len(DOMAINS)))],
        task=f"task-{int(rng.integers(10_000)):05d}",
        episode=episode,
        generator=generator,
        steps=tuple(steps),
        final_reward=float(rng.random() < 0.4),
        truncation=truncation,
        started_at=start,
        finished_at=start + sum(s.generate_s + s.env_s for s in steps),
    )
