"""The reference policy for a KL penalty (`learner.algorithm.beta`): the initial model, frozen,
partitioned by ZeRO-3 the same way as the trained one.

    ref = ReferencePolicy(ds, make_model, ds_config)      # make_model() builds the initial policy
    ref_lp = ref.logprobs(input_ids, attention_mask)      # [B, T-1], no gradient
    kl_sum, stats = kl_penalty(lp, ref_lp, action_mask, weights, is_weight)   # summed over action tokens

The initial model is rebuilt from `policy.path` (or the tiny model's seed), so a resumed
learner gets the same reference without storing it in its checkpoints. It runs as a DeepSpeed
engine without an optimizer: its parameters are sharded over the learner ranks and gathered
layer by layer in its forward pass, as the policy's are; offloaded the same way too.

The penalty is beta x KL(pi || ref), the policy's own distribution (temperature 1, untruncated)
against the reference's, per action token. Its loss is k2 = 1/2 (log pi(a) - log ref(a))^2 per
sampled token: the gradient (log pi - log ref) grad log pi has expectation grad KL(pi || ref)
under a ~ pi (the score-function term E_pi[grad log pi] is 0), so descending it pulls pi toward
ref the way the documented KL does; with a reward, the fixed point is pi* proportional to
ref x exp(r / beta). k3 = exp(ref - lp) - (ref - lp) - 1, often used as a loss, has gradient
(1 - ref/pi) grad log pi, whose expectation under pi is grad KL(ref || pi): the reverse
divergence, another fixed point. k1 = log pi - log ref has gradient grad log pi, expectation 0.
Tokens come from the behaviour distribution mu (stale weights, another temperature), not from
pi, so each token's term is weighted by pi(a) / mu(a), detached and capped at max_ratio like
the policy loss's importance weight; on-policy at temperature 1 the weight is 1. The statistic
`ref_kl` is the same weight times k3 (unbiased for KL(pi || ref), never negative).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hpcrl.rl.model.logprobs import PolicyHead

__all__ = ["ReferencePolicy", "kl_penalty", "reference_config"]


def reference_config(train_config: dict[str, Any]) -> dict[str, Any]:
    """The trained engine's config less what only training needs (optimizer, scheduler, clipping)."""
    keep = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization", "bf16", "fp16")
    cfg = {k: train_config[k] for k in keep if k in train_config}
    zero = dict(cfg.get("zero_optimization", {}))
    zero.pop("offload_optimizer", None)
    cfg["zero_optimization"] = zero
    cfg.update(steps_per_print=1 << 30, wall_clock_breakdown=False)
    return cfg


class ReferencePolicy:
    def __init__(self, ds, make_model: Callable[[], Any], train_config: dict[str, Any], chunk_tokens: int):
        model = make_model()
        model.config.use_cache = False
        head = PolicyHead(model, chunk_tokens, zero3=True)
        head.requires_grad_(False)
        head.eval()
        self.engine, *_ = ds.initialize(model=head, config=reference_config(train_config))
        self.engine.eval()

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.engine(input_ids, attention_mask)[0]

    def close(self) -> None:
        self.engine.destroy()


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
):
    """(the loss term: sum over action tokens of k2 = 1/2 (lp - ref)^2, whose expected gradient is
    that of KL(pi || ref) (see the module docstring), each token weighted by `is_weight` (pi / mu,
    detached and capped by the caller; None: on-policy, 1) and as the policy loss weights it
    (`weights`, algorithm.token_weights: 1 per token, or 1/|o| per sequence under loss_agg seq,
    so that `beta` means the same under every loss_agg); {"ref_kl_sum": the sum of is_weight x
    k3 over the action tokens, an estimate of KL(pi || ref) for the per-token statistic}).
    `logprobs` are the policy's own (temperature 1, untruncated), with gradient."""
    d = (logprobs - ref_logprobs) * mask
    w = mask if is_weight is None else is_weight.detach() * mask
    k2 = 0.5 * d * d * w
    total = (k2 * weights).sum() if weights is not None else k2.sum()
    with torch.no_grad():
        k3 = (torch.exp(-d) + d - 1) * w
    return total, {"ref_kl_sum": float(k3.sum())}
