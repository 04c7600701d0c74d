"""Per-step statistics of a training batch: what a researcher looks at when learning stalls.

    m.update(batch_diagnostics(groups, adv, version, eos_ids, decode))   # into the step's metrics

The learner adds these to each step's metrics (and so to the run's `metrics.jsonl`):

* `zero_var_groups`: the fraction of groups whose rewards are all equal. Their advantages are 0,
  so they carry no policy gradient; near 1.0 the run learns nothing however long it trains.
* `stuck_groups`: the fraction of groups all scoring the same and below the batch's mean reward:
  prompts answered the same wrong way every time. Late in a run these are the ones the policy
  has stopped exploring (often a token the answer needs was pushed to ~0 probability).
* `group_reward_std`: mean over groups of the rewards' standard deviation.
* `adv_abs_mean`, `adv_min`, `adv_max`, `adv_nonzero` (fraction of trajectories with A != 0).
* `staleness_max`: the most policy versions any trained group's newest action was behind the
  learner: what `learner.max_staleness` bounds (rl/learner/batch.py).
* `staleness_hist`: {policy versions behind the learner: trajectories}, by each one's oldest
  step, and `staleness_oldest_max` its largest: how off-policy the oldest trained tokens are (a
  long episode's first turns), which importance weights correct and nothing bounds.
* `completion_len`: mean action tokens per trajectory; `eos_fraction`: the share whose last
  action ended with one of the model's eos ids (the rest hit the length limit or a stop string).
* `reward_by_prompt`: {"domain:prompt": mean reward of its group}, the per-prompt success (a
  prompt that appears in several groups of the batch gets their mean).

Token-level statistics (entropy, importance ratio, clip fraction) come from the loss
(`Algorithm.token_loss`), the learning rate from `rl/learner/schedule.py`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence

import torch

from hpcrl.rl.record.trajectory import Trajectory

__all__ = ["batch_diagnostics", "ZERO_VAR_EPS"]

ZERO_VAR_EPS = 1e-6


def _std(xs: list[float]) -> float:
    """Unbiased standard deviation, as the advantages use; 0 for fewer than two values."""
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def batch_diagnostics(
    groups: Sequence[Sequence[Trajectory]],
    adv: torch.Tensor,
    version: int,
    eos_ids: Collection[int],
    decode: Callable[[list[int]], str],
) -> dict:
    """Statistics of one batch; `adv` holds the trajectories' advantages in group order, `version`
    is the policy version being trained (before the step)."""
    trajs = [t for g in groups for t in g]
    stds = [_std([t.final_reward for t in g]) for g in groups]
    stale = collections.Counter(version - t.min_policy_version for t in trajs)
    newest = [version - max(t.max_policy_version for t in g) for g in groups if g]
    lengths = [sum(len(s.action_tokens) for s in t.steps) for t in trajs]
    ended = sum(1 for t in trajs if len(t.steps[-1].action_tokens) and int(t.steps[-1].action_tokens[-1]) in eos_ids)
    by_prompt: dict[str, list[float]] = collections.defaultdict(list)
    for g in groups:
        first = g[0]
        prompt = decode(first.steps[0].prompt_tokens.tolist()) if len(first.steps[0].prompt_tokens) else first.task
        by_prompt[f"{first.domain}:{prompt}"].extend(t.final_reward for t in g)
    n = max(len(trajs), 1)
    mean = sum(t.final_reward for t in trajs) / n
    stuck = sum(1 for s, g in zip(stds, groups) if s < ZERO_VAR_EPS and g[0].final_reward < mean - ZERO_VAR_EPS)
    return {
        "zero_var_groups": sum(1 for s in stds if s < ZERO_VAR_EPS) / max(len(groups), 1),
        "stuck_groups": stuck / max(len(groups), 1),
        "group_reward_std": sum(stds) / max(len(groups), 1),
        "adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
        "adv_min": float(adv.min()) if len(adv) else 0.0,
        "adv_max": float(adv.max()) if len(adv) else 0.0,
        "adv_nonzero": float((adv.abs() > 1e-8).float().mean()) if len(adv) else 0.0,
        "staleness_hist": {str(k): v for k, v in sorted(stale.items())},
        "staleness_max": max(newest, default=0),
        "staleness_oldest_max": max(stale, default=0),
        "completion_len": sum(lengths) / n,
        "eos_fraction": ended / n,
        "reward_by_prompt": {k: sum(v) / len(v) for k, v in by_prompt.items()},
    }
