"""The learner's schedules: the learning rate (linear warm-up, then constant, linear or cosine
decay) and the entropy bonus's coefficient (constant, or a linear decay to 0).

    lr = lr_at(cfg.learner, step)          # the rate for learner step `step` (0-based)
    c = entropy_coef_at(cfg.learner.algorithm, step)   # the entropy bonus's coefficient there
    set_lr(engine.optimizer, lr)           # every parameter group

Step s < lr_warmup_steps trains at lr x (s + 1) / lr_warmup_steps. After the warm-up,
`constant` keeps lr; `linear` and `cosine` decay from lr to lr x lr_min_ratio over
`lr_decay_steps` (0: until `max_steps`) and stay there if the run goes on. A decay of its own
length serves a run that time or a user ends rather than `max_steps`. `step` is the learner's
step, which counts every batch, one skipped for want of signal (skip_empty_steps) included: the
curves follow the data consumed. Both schedules are pure functions of the step, which the
learner's checkpoint restores, so a resumed run continues on the same curves.
"""

from __future__ import annotations

import math

from hpcrl.core.config import AlgorithmConfig, LearnerConfig

__all__ = ["lr_at", "set_lr", "entropy_coef_at"]


def lr_at(cfg: LearnerConfig, step: int) -> float:
    base, warm = cfg.lr, cfg.lr_warmup_steps
    if step < warm:
        return base * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return base
    span = cfg.lr_decay_steps or cfg.max_steps - warm
    frac = min(1.0, (step - warm) / max(1, span))
    low = base * cfg.lr_min_ratio
    if cfg.lr_schedule == "linear":
        return base - (base - low) * frac
    return low + 0.5 * (base - low) * (1.0 + math.cos(math.pi * frac))


def entropy_coef_at(cfg: AlgorithmConfig, step: int) -> float:
    """The entropy bonus's coefficient at optimizer step `step` (0-based): entropy_coef, decayed
    linearly to 0 over entropy_decay_steps when that is set (a pure function of the step too)."""
    if not cfg.entropy_decay_steps:
        return cfg.entropy_coef
    return cfg.entropy_coef * max(0.0, 1.0 - step / cfg.entropy_decay_steps)


def set_lr(optimizer, lr: float) -> None:
    """Set `lr` on every parameter group (a torch optimizer or DeepSpeed's wrapper of one)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
