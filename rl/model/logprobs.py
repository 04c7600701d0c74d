"""Token log-probabilities and entropy in chunks: peak memory does not grow with vocab x tokens.

    head = PolicyHead(hf_model, chunk_tokens=1024)        # what the learner hands to DeepSpeed
    lp, entropy = head(input_ids, attention_mask)         # [2, B, T-1] float32
    lp, entropy, model_lp = head(input_ids, attention_mask, shaping=Shaping(temp, top_p, top_k))
    lp = token_logprobs(hf_model, input_ids, attention_mask)   # the same for any causal LM
    logq = shaped_log_softmax(logits, temperature, top_p, top_k)  # the sampling distribution

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

Sampling parameters: a token drawn at temperature T, or from a top-k/top-p truncation, was drawn
from q = `shaped_log_softmax(logits)`, not from the model's own softmax. The decode engine
(rl/rollout/engine.py) samples from that function and records log q; given the same parameters
(`Shaping`, per scored token) the head scores log q of the current logits the same way, the
truncation recomputed from them (so a ratio against the recorded value is 1 on-policy), besides
the model's own log-probability (temperature 1, untruncated: for the KL penalty) and entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["PolicyHead", "Shaping", "shaped_log_softmax", "chunked_logprobs", "token_logprobs", "full_logprobs"]

# The log-probability a scored token gets when the current policy's truncation (top-k/top-p)
# leaves it out (its true value is -inf): against any token a truncated sampler draws (log q
# above ~-15) its ratio is below 1e-6, and the arithmetic after stays finite.
CUT_LOGPROB = -30.0


@dataclass(frozen=True)
class Shaping:
    """Sampling parameters per scored token, each shaped like the targets: temperature (> 0),
    top_p in (0, 1] and top_k (0: no top-k). Temperature 1, top_p 1, top_k 0: the model's own."""

    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64

    def to(self, device) -> Shaping:
        return Shaping(self.temperature.to(device), self.top_p.to(device), self.top_k.to(device))

    def flat(self) -> Shaping:
        return Shaping(self.temperature.reshape(-1), self.top_p.reshape(-1), self.top_k.reshape(-1))

    def __getitem__(self, sl) -> Shaping:
        return Shaping(self.temperature[sl], self.top_p[sl], self.top_k[sl])


def shaped_log_softmax(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """log q [N, V] of the distribution a token is sampled from: `logits` [N, V] divided by the
    row's temperature [N] (> 0), then its top_k [N] largest (0: all), then the smallest prefix of
    those, by probability renormalised over them, whose mass reaches top_p [N]; -inf outside.
    The order of Hugging Face's and vLLM's samplers. Ties are broken by vocabulary index (a
    stable sort), so two calls on equal logits keep the same tokens. Differentiable in `logits`
    (the kept set is a constant of the input, as in the sampler)."""
    z = logits.float() / temperature.to(torch.float32)[:, None]
    trunc = (top_k > 0) | (top_p < 1.0)
    if not bool(trunc.any()):
        return torch.log_softmax(z, dim=-1)
    rows = trunc.nonzero().squeeze(-1)
    zr = z.index_select(0, rows)
    sz, idx = torch.sort(zr.detach(), dim=-1, descending=True, stable=True)
    V = z.shape[-1]
    k = top_k.index_select(0, rows)
    k = torch.where(k > 0, k, torch.full_like(k, V))
    cut = torch.arange(V, device=z.device)[None, :] >= k[:, None]
    p = torch.softmax(sz.masked_fill(cut, float("-inf")), dim=-1)
    # A token is cut once the mass before it already reached top_p (the first one never is).
    cut |= (p.cumsum(-1) - p) >= top_p.index_select(0, rows).to(p.dtype)[:, None]
    cut = torch.zeros_like(cut).scatter(-1, idx, cut)
    z = z.index_put((rows,), zr.masked_fill(cut, float("-inf")))
    return torch.log_softmax(z, dim=-1)


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    # Positions count real tokens only, so left and right padding give the same values.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _chunk_stats(hidden, weight, bias, targets, softcap, scale, temp=None, top_p=None, top_k=None):
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
    if temp is None:
        return lp, entropy
    # The sampling distribution's log q where a token was not drawn from the model's own.
    shaped = (temp != 1.0) | (top_p < 1.0) | (top_k > 0)
    lq = lp
    if bool(shaped.any()):
        rows = shaped.nonzero().squeeze(-1)
        logq = shaped_log_softmax(logits.index_select(0, rows), temp[rows], top_p[rows], top_k[rows])
        got = logq.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
        lq = lp.index_put((rows,), torch.where(torch.isfinite(got), got, torch.full_like(got, CUT_LOGPROB)))
    return lq, entropy, lp


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int = 1024,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    shaping: Shaping | None = None,
) -> tuple[torch.Tensor, ...]:
    """(log p(target), entropy), each shaped like `targets`, from hidden states [..., H] and the
    output projection `weight` [V, H]; `chunk_tokens` tokens at a time, recomputed in backward.
    With `shaping` (each field shaped like `targets`): (log q(target) of the sampling
    distribution (`shaped_log_softmax`; CUT_LOGPROB where the truncation leaves the target
    out), entropy, log p(target) of the model's own), the entropy always the model's own."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    sh = shaping.flat() if shaping is not None else None
    outs: list[list[torch.Tensor]] = []
    # Recomputing saves memory only when there are several chunks: a lone chunk's tensors exist
    # again in its backward pass anyway, so the peak is the same, and the recompute (a second
    # projection and softmax, checkpoint's bookkeeping) is pure cost.
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad) and y.numel() > chunk_tokens
    for start in range(0, y.numel(), chunk_tokens):
        end = start + chunk_tokens
        args = (h[start:end], weight, bias, y[start:end], softcap, scale)
        if sh is not None:
            args += (sh.temperature[start:end], sh.top_p[start:end], sh.top_k[start:end])
        got = checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args)
        outs.append(list(got))
    n = 2 if shaping is None else 3
    if not outs:
        empty = h.new_zeros(0, dtype=torch.float32).reshape(shape)
        return (empty,) * n
    return tuple(torch.cat([o[i] for o in outs]).reshape(shape) for i in range(n))


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

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed=None,
        shaping: Shaping | None = None,
    ):
        """(log p, entropy) of each next token, stacked: [2, B, T-1]. With `shaping` (sampling
        parameters per next token, [B, T-1] each; with `packed`, per listed token): (log q of
        the sampling distribution, entropy, the model's own log p), [3, B, T-1]. With `packed`
        (rl/learner/packing.py; the arguments are then its packed rows and 4-D mask) only the action
        tokens it lists are scored and put in their slots of the members' grid, the others 0.
        One output tensor, not several: ZeRO-3 hooks each output's backward, and the order two
        of them fired in varied with the batch; ranks that disagree on it deadlock."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = _positions(attention_mask) if packed is None else packed.position_ids
        out = self.lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        )
        head = self.lm.get_output_embeddings()
        kw = dict(bias=getattr(head, "bias", None), softcap=self._softcap, scale=self._scale)
        kw["shaping"] = shaping
        if packed is None:
            hidden = out.last_hidden_state[:, :-1]
            return torch.stack(chunked_logprobs(hidden, head.weight, input_ids[:, 1:], self.chunk_tokens, **kw))
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]).index_select(0, packed.src)
        got = torch.stack(chunked_logprobs(hidden, head.weight, packed.targets, self.chunk_tokens, **kw))
        n = got.shape[0]
        which = (torch.arange(n, device=got.device)[:, None], packed.dest[None])
        grid = got.new_zeros(n, packed.members * packed.width).index_put(which, got)
        return grid.view(n, packed.members, packed.width)


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
