"""The reference policy for a KL penalty (`learner.algorithm.beta`): the initial model, frozen,
partitioned by ZeRO-3 the same way as the trained one.

    ref = ReferencePolicy(ds, make_model, ds_config)      # make_model() builds the initial policy
    ref_lp = ref.logprobs(input_ids, attention_mask)      # [B, T-1], no gradient
    kl_sum, stats = kl_penalty(lp, ref_lp, action_mask)    # k3 estimator, summed over action tokens

The initial model is rebuilt from `policy.path` (or the tiny model's seed), so a resumed
learner gets the same reference without storing it in its checkpoints. It runs as a DeepSpeed
engine without an optimizer: its parameters are sharded over the learner ranks and gathered
layer by layer in its forward pass, as the policy's are; offloaded the same way too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hpcrl.rl.logprobs import PolicyHead

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
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
):
    """(the loss term: sum over action tokens of KL(pi || ref) by the k3 estimator, each token
    weighted as the policy loss weights it (`algorithm.token_weights`: 1 per token, or 1/|o| per
    sequence under loss_agg seq), so that `beta` means the same under every loss_agg;
    {"ref_kl_sum": the unweighted sum, for the per-token statistic}).

    k3 = exp(ref - lp) - (ref - lp) - 1 per sampled token: unbiased for KL(pi || ref) under
    samples from pi, never negative, with gradient exp(ref - lp) - 1 pulling lp towards ref."""
    d = (ref_logprobs - logprobs) * mask
    k3 = (torch.exp(d) - d - 1) * mask
    total = (k3 * weights).sum() if weights is not None else k3.sum()
    return total, {"ref_kl_sum": float(k3.detach().sum())}
