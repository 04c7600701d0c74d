"""Token log-probabilities and the policy's entropy at each position, from one forward pass.

    lp, entropy = logprobs_and_entropy(engine, input_ids, attention_mask, grad_entropy=True)

The learner's micro-step needs both: the log-probabilities for the policy-gradient loss, the
entropy H(pi(. | tokens < t)) for the entropy bonus (differentiable, `grad_entropy`) and for the
per-step diagnostics (detached otherwise). This is the one place the learner gets them; a
chunked head that returns (logprobs, entropy) itself can replace it without touching the loss.
"""

from __future__ import annotations

import torch

__all__ = ["logprobs_and_entropy"]


def logprobs_and_entropy(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, grad_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(input_ids[:, t] | < t), entropy of that next-token distribution), each [B, T-1]
    float32, t >= 1. Positions count real tokens only, as in `policy.token_logprobs`."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    lp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(grad_entropy and torch.is_grad_enabled()):
        src = logp if grad_entropy else logp.detach()
        entropy = -(src.exp() * src).sum(-1)
    return lp, entropy
