"""Token log-probabilities and entropy in chunks: peak memory does not grow with vocab x tokens.

    head = PolicyHead(hf_model, chunk_tokens=1024)        # what the learner hands to DeepSpeed
    lp, entropy = head(input_ids, attention_mask)         # [B, T-1] float32 each
    lp = token_logprobs(hf_model, input_ids, attention_mask)   # the same for any causal LM

A full float32 log_softmax over [batch, tokens, vocab] is 4 x B x T x V bytes (16 GB for 32
sequences of 1k tokens at a 128k vocabulary), and autograd keeps it for the backward pass.
Here the decoder runs once to its last hidden state; the output projection, log-softmax,
target gather and entropy then run `chunk_tokens` tokens at a time under activation
checkpointing: each chunk's logits exist only while that chunk is computed, in the forward
pass and again in the backward pass. Peak extra memory is one chunk's logits (4 x chunk x V
bytes), whatever B x T is. Input that fits one chunk is not recomputed: autograd keeps that
chunk, which its backward pass would rebuild anyway.

Under ZeRO-3 the head's weight is partitioned and belongs to `lm_head`, whose own forward never
runs here; `PolicyHead` registers it as an external parameter so DeepSpeed gathers it for the
head's forward and backward. Models whose head is more than a linear projection get their
extras: Gemma-2's final logit soft-capping and Cohere's logit scale.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["PolicyHead", "chunked_logprobs", "token_logprobs", "full_logprobs"]


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    # Positions count real tokens only, so left and right padding give the same values.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _chunk_stats(hidden, weight, bias, targets, softcap: float | None, scale: float | None):
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    p = torch.softmax(logits, dim=-1)
    # H = lse - sum(p * logits), the sum as a batched dot product: no third [chunk, V] tensor.
    entropy = lse - torch.bmm(p.unsqueeze(1), logits.unsqueeze(2)).reshape(lse.shape)
    return lp, entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int = 1024,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy), each shaped like `targets`, from hidden states [..., H] and the
    output projection `weight` [V, H]; `chunk_tokens` tokens at a time, recomputed in backward."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    lps, ents = [], []
    # Recomputing saves memory only when there are several chunks: a lone chunk's tensors exist
    # again in its backward pass anyway, so the peak is the same, and the recompute (a second
    # projection and softmax, checkpoint's bookkeeping) is pure cost.
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad) and y.numel() > chunk_tokens
    for start in range(0, y.numel(), chunk_tokens):
        hc, yc = h[start : start + chunk_tokens], y[start : start + chunk_tokens]
        if grad:
            lp, ent = checkpoint(_chunk_stats, hc, weight, bias, yc, softcap, scale, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(hc, weight, bias, yc, softcap, scale)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = h.new_zeros(0, dtype=torch.float32)
        return empty.reshape(shape), empty.reshape(shape)
    return torch.cat(lps).reshape(shape), torch.cat(ents).reshape(shape)


def _head_extras(config) -> tuple[float | None, float | None]:
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    return (float(softcap) if softcap else None), (float(scale) if scale not in (None, 1, 1.0) else None)


class PolicyHead(torch.nn.Module):
    """A causal LM whose forward returns per-token (logprobs, entropy) computed in chunks."""

    def __init__(self, lm, chunk_tokens: int = 1024, zero3: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = int(chunk_tokens)
        head = lm.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise ValueError(f"{type(lm).__name__}: no linear output head (get_output_embeddings); cannot score tokens")
        self._softcap, self._scale = _head_extras(lm.config)
        if zero3 or hasattr(head.weight, "ds_id"):
            # ZeRO-3: the head's weight is used outside lm_head's forward; DeepSpeed gathers it
            # for this module's forward and backward once told (before or after initialize).
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter

            register_external_parameter(self, head.weight)
            if getattr(head, "bias", None) is not None:
                register_external_parameter(self, head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, packed=None):
        """(log p, entropy) of each next token, [B, T-1]. With `packed` (rl/packing.py; the
        arguments are then its packed rows and 4-D mask) only the action tokens it lists are
        scored and put in their slots of the members' grid, the others 0, stacked: [2, B, T-1]."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = _positions(attention_mask) if packed is None else packed.position_ids
        out = self.lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        )
        head = self.lm.get_output_embeddings()
        kw = dict(bias=getattr(head, "bias", None), softcap=self._softcap, scale=self._scale)
        if packed is None:
            hidden = out.last_hidden_state[:, :-1]
            return chunked_logprobs(hidden, head.weight, input_ids[:, 1:], self.chunk_tokens, **kw)
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]).index_select(0, packed.src)
        lp, ent = chunked_logprobs(hidden, head.weight, packed.targets, self.chunk_tokens, **kw)
        # One output tensor [2, B, T-1], not two: ZeRO-3 hooks each output's backward, and the
        # order two of them fired in varied with the batch; ranks that disagree on it deadlock.
        which = (torch.arange(2, device=lp.device)[:, None], packed.dest[None])
        both = lp.new_zeros(2, packed.members * packed.width).index_put(which, torch.stack((lp, ent)))
        return both.view(2, packed.members, packed.width)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, chunk_tokens=1024):
    """log p(input_ids[:, t] | input_ids[:, <t]) for t >= 1, shape [B, T-1], float32.

    `model` is a Hugging Face causal LM, a `PolicyHead`, or a DeepSpeed engine around one.
    Padding may be on either side: positions are counted over real tokens only, which is what
    the generator's KV-cached sampling uses, so both sides agree.
    """
    inner = getattr(model, "module", model)
    if isinstance(inner, PolicyHead):
        return model(input_ids, attention_mask)[0]
    return PolicyHead(model, chunk_tokens)(input_ids, attention_mask)[0]


def full_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The unchunked reference: a float32 log_softmax over the whole [B, T, V] logits."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask))
    logits = out.logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
