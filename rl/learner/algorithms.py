"""Policy-gradient losses by name: GRPO's clipped loss, decoupled PPO, and truncated-IS REINFORCE.

    algo = make_algorithm(cfg.learner.algorithm)            # ALGORITHMS.get(name)(cfg)
    adv = algo.advantages(rewards, group_index)             # one value per trajectory
    loss_sum, stats = algo.token_loss(logprobs, batch, entropy)   # weighted sum over action tokens
    den = algo.denominator([action tokens of each row])     # summed over ranks: loss = loss_sum / den

Samples come from generators that may run policy versions behind the learner (a long
multi-turn episode's first turns many versions: rl/learner/batch.py bounds a group by its newest
action), so every action token carries the log-probability its *behaviour* policy gave it: of
the distribution that drew it (temperature, top-k, top-p: rl/rollout/engine.py), and the learner's
`logprobs` are the current policy's under the same sampling parameters. The ratio
r = pi_theta(a) / mu(a) = exp(logprob_now - logprob_behaviour) corrects for that staleness:

* `grpo`: per token -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), the PPO surrogate with
  the behaviour policy as the old policy (as in asynchronous GRPO). The clip is centred on the
  behaviour policy, so a stale token whose ratio drifted past the clip (from staleness, not
  from this update) gets no gradient. The clip may be asymmetric:
  clip_high > clip_low (DAPO's clip-higher) lets a token with a positive advantage gain more
  probability per update (ratio up to 1 + clip_high) than one with a negative advantage may lose
  (1 - clip_low), so rare tokens can still rise: a guard against entropy collapse. A separate upper bound
  `max_ratio` caps r for negative advantages too, where the PPO min() would let a very stale
  token's weight grow without bound.
* `decoupled_ppo` (AReaL's decoupled PPO): the trust region and the off-policy correction
  separated. The clip is centred on the *proximal* policy pi_prox, the learner's weights
  before this step's update, and the behaviour policy enters as an importance weight capped at
  max_ratio: per token -min(pi_prox / mu, max_ratio) x min(r' A, clip(r', 1 - clip_low,
  1 + clip_high) A) with r' = pi_theta / pi_prox. The learner makes one optimizer step per
  batch, so pi_prox is the policy its forward pass runs: its log-probabilities are that
  pass's, detached (no second pass). r' is then 1 in value and the clip never cuts a
  gradient: every stale token is trained, weighted by its capped behaviour ratio, where grpo
  would zero those past the clip. (Its gradient is then that of `reinforce`; the two differ
  only in how they would treat several updates per batch.)
* `reinforce`: -min(r, max_ratio) A log pi_theta(a) with the weight held constant (truncated
  importance sampling), no trust region.

Advantages are group-relative: each trajectory's reward minus the mean of its group (the
episodes of one task instance), divided by the group's standard deviation when
`normalize_std` is on.

Losses are weighted *sums*; the learner divides them by a denominator summed over the whole
batch (all ranks, all micro-batches), so ranks and micro-batches of different sizes give the
same gradient as one big batch. `loss_agg` picks the weights and the denominator:

* `token` (DAPO, TRL's default): weight 1 per action token, / the batch's action tokens;
  every token counts the same, so long answers weigh more.
* `seq` (the original GRPO): weight 1/|o_i| per token of sequence i, / the batch's sequences;
  every sequence counts the same (a length bias: short wrong answers are pushed down harder).
* `constant` (Dr. GRPO): weight 1, / (sequences x loss_len): no division by any length.

`entropy_coef` adds an entropy bonus: each action token's loss gets -entropy_coef x H(pi(.|s_t)),
with the same weights, so the gradient also spreads probability over the vocabulary (the policy
keeps exploring prompts it has not solved, instead of answering them deterministically wrong).
`entropy_decay_steps` lowers the coefficient linearly to 0 over that many steps: explore early,
then let every answer sharpen.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpcrl.core.config import AlgorithmConfig
from hpcrl.rl.common.registry import Registry
from hpcrl.rl.model.logprobs import Shaping

__all__ = [
    "ALGORITHMS", "Algorithm", "GRPO", "DecoupledPPO", "Reinforce", "TokenBatch", "make_algorithm", "group_advantages",
]  # fmt: skip


@dataclass(frozen=True)
class TokenBatch:
    """The per-token view of a micro-batch, aligned with `token_logprobs` (length T-1).

    `action_mask[b, t]` is 1 where token t+1 of row b is a trained action token;
    `behaviour_logprobs` holds the generator's log-probabilities there (0 elsewhere): of the
    distribution the token was drawn from, whose parameters `shaping` holds per position (None:
    every token was drawn from the model's own distribution); `advantages[b]` is the row's
    advantage, shared by all its action tokens.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    action_mask: torch.Tensor  # [B, T-1] float
    behaviour_logprobs: torch.Tensor  # [B, T-1] float
    advantages: torch.Tensor  # [B] float
    shaping: Shaping | None = None  # [B, T-1] each

    @property
    def n_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    def to(self, device) -> TokenBatch:
        fields = (self.input_ids, self.attention_mask, self.action_mask, self.behaviour_logprobs, self.advantages)
        shaping = self.shaping.to(device) if self.shaping is not None else None
        return TokenBatch(*(t.to(device) for t in fields), shaping=shaping)


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, normalize_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """reward - mean(group), optionally / std(group); a group whose rewards are all equal gets 0."""
    rewards = rewards.float()
    n_groups = int(group_index.max().item()) + 1 if len(group_index) else 0
    count = torch.zeros(n_groups).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(n_groups).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    if not normalize_std:
        return centred
    var = torch.zeros(n_groups).index_add_(0, group_index, centred**2) / count.clamp(min=2).sub(1)  # unbiased
    std = var.sqrt()[group_index]
    return torch.where(std > eps, centred / (std + eps), torch.zeros_like(centred))


class Algorithm(abc.ABC):
    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg

    def advantages(self, rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        return group_advantages(rewards, group_index, self.cfg.normalize_std)

    @abc.abstractmethod
    def token_losses(self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """Per-token losses [B, T-1] (masking happens in token_loss)."""

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """Where the loss cuts or caps a token's gradient (for the clip_fraction statistic)."""
        return ratio > self.cfg.max_ratio

    def token_weights(self, mask: torch.Tensor) -> torch.Tensor:
        """Each action token's weight in the loss sum ([B, T-1]; 0 off the action tokens)."""
        if self.cfg.loss_agg == "seq":
            return mask / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return mask

    def denominator(self, row_tokens: Sequence[int]) -> float:
        """What rows with these action-token counts add to the batch's loss denominator."""
        if self.cfg.loss_agg == "token":
            return float(sum(row_tokens))
        rows = float(sum(1 for n in row_tokens if n > 0))
        return rows * self.cfg.loss_len if self.cfg.loss_agg == "constant" else rows

    def token_loss(
        self,
        logprobs: torch.Tensor,
        batch: TokenBatch,
        entropy: torch.Tensor | None = None,
        entropy_coef: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(weighted sum of per-token losses over action tokens, statistics summed over those
        tokens). `entropy` [B, T-1], each position's policy entropy, adds the entropy bonus
        (differentiable) and the entropy statistics; `entropy_coef` is the bonus's coefficient
        at this step (schedule.entropy_coef_at; None: the configured one)."""
        coef = self.cfg.entropy_coef if entropy_coef is None else entropy_coef
        mask = batch.action_mask
        # Behaviour logprobs are 0 off the action tokens; mask before exp so padding cannot overflow.
        log_ratio = (logprobs - batch.behaviour_logprobs) * mask
        ratio = torch.exp(log_ratio)
        adv = batch.advantages[:, None].to(logprobs.dtype).expand_as(logprobs)
        losses = self.token_losses(logprobs, ratio, adv)
        if entropy is not None and coef:
            losses = losses - coef * entropy
        loss_sum = (losses * self.token_weights(mask)).sum()
        with torch.no_grad():
            clipped = self.clipped(ratio, adv)
            on = mask > 0
            stats = {
                "tokens": float(mask.sum()),
                "rows": float(on.any(-1).sum()),
                "ratio_sum": float((ratio * mask).sum()),
                "ratio_min": float(ratio[on].min()) if on.any() else float("inf"),  # no tokens: no extreme
                "ratio_max": float(ratio[on].max()) if on.any() else float("-inf"),
                "clipped_sum": float((clipped.float() * mask).sum()),
                # k3 estimator of KL(mu || pi), non-negative per token
                "kl_sum": float(((ratio - 1 - log_ratio) * mask).sum()),
            }
            if entropy is not None:
                first = on & (mask.cumsum(-1) == 1)  # each row's first action token
                stats["entropy_sum"] = float((entropy * mask).sum())
                stats["entropy_first_sum"] = float(entropy[first].sum())
        return loss_sum, stats


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm")


@ALGORITHMS.register("grpo")
class GRPO(Algorithm):
    def token_losses(self, logprobs, ratio, adv):
        lo, hi = 1.0 - self.cfg.clip_low, 1.0 + self.cfg.clip_high
        surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        # Dual clip: with A < 0 the min() above is unbounded in r; cap the weight at max_ratio.
        capped = torch.where(adv < 0, torch.maximum(surrogate, self.cfg.max_ratio * adv), surrogate)
        return -capped

    def clipped(self, ratio, adv):
        lo, hi = 1.0 - self.cfg.clip_low, 1.0 + self.cfg.clip_high
        return ((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0)) | (ratio > self.cfg.max_ratio)


@ALGORITHMS.register("decoupled_ppo")
class DecoupledPPO(Algorithm):
    def token_losses(self, logprobs, ratio, adv):
        # The proximal policy is this forward pass's (one optimizer step per batch): its
        # log-probabilities detached. `ratio` is pi_theta / mu, so its value is pi_prox / mu.
        behaviour_weight = ratio.detach().clamp(max=self.cfg.max_ratio)
        r = torch.exp(logprobs - logprobs.detach())
        lo, hi = 1.0 - self.cfg.clip_low, 1.0 + self.cfg.clip_high
        return -behaviour_weight * torch.minimum(r * adv, r.clamp(lo, hi) * adv)


@ALGORITHMS.register("reinforce")
class Reinforce(Algorithm):
    def token_losses(self, logprobs, ratio, adv):
        weight = ratio.detach().clamp(max=self.cfg.max_ratio)
        return -(weight * adv * logprobs)


def make_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    return ALGORITHMS.get(cfg.name)(cfg)
