"""Batched sampling with a KV cache, returning every sampled token's log-probability.

    sampler = Sampler(policy, seed=0)
    out = sampler.sample([[1, 40, 41], [1, 42]], max_new=[1, 64], stops=[(), ("# end",)])
    out[1].tokens, out[1].logprobs, out[1].text, out[1].finish   # finish: eos | stop | length

Rows are left-padded to one length, prefilled in one forward pass, then decoded token by token
with the cache. Positions count real tokens only (as `token_logprobs` does), so the learner
recomputes the same log-probabilities from the same tokens. Sampling is from the model's own
distribution (temperature 1): the recorded log-probabilities are exactly the behaviour
policy's, which the learner's importance ratio needs. Text is exact: an action's text is its
tokens decoded in the company of the context before them, and stop strings are matched on
text produced incrementally (`IncrementalText`), never on tokens decoded one by one. Rows that
finish early drop out of the batch (and its cache) once fewer than half remain.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hpcrl.rl.policy import Policy

__all__ = ["Sample", "Sampler"]


@dataclass(frozen=True)
class Sample:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish: Literal["eos", "stop", "length"]


class Sampler:
    def __init__(self, policy: Policy, seed: int):
        self.policy = policy
        self.gen = torch.Generator(device=policy.device)
        self.gen.manual_seed(seed)
        # transformers 5 renamed past_key_values to cache; speak whichever this version speaks.
        params = inspect.signature(policy.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _forward(self, **kw):
        cache = kw.pop("cache", None)
        if cache is not None:
            kw[self._cache_kw] = cache
        out = self.policy.model(use_cache=True, **self._last_only, **kw)
        past = out.cache if hasattr(out, "cache") else out.past_key_values
        return past, out.logits[:, -1, :]

    @torch.no_grad()
    def sample(
        self, contexts: Sequence[Sequence[int]], max_new: Sequence[int], stops: Sequence[tuple[str, ...]]
    ) -> list[Sample]:
        n = len(contexts)
        if not (n == len(max_new) == len(stops)):
            raise ValueError(f"Sampler.sample: {n} contexts, {len(max_new)} max_new, {len(stops)} stops; need one each")
        if n == 0:
            return []
        if min(len(c) for c in contexts) == 0:
            raise ValueError("Sampler.sample: every context needs at least one token (e.g. bos)")
        dev, pol = self.policy.device, self.policy
        pol.model.eval()
        width = max(len(c) for c in contexts)
        ids = torch.full((n, width), pol.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c) :] = torch.as_tensor(c, dtype=torch.long)
            mask[i, width - len(c) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        past, logits = self._forward(input_ids=ids, attention_mask=mask, position_ids=pos)
        next_pos = mask.sum(-1, keepdim=True)  # [n, 1]

        rows = list(range(n))  # batch position -> original row
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        texts = ["" for _ in range(n)]
        finish: list[str | None] = [None] * n
        limit = [int(m) for m in max_new]
        # A stop string can only complete on a token containing its last character.
        last_chars = [{s[-1] for s in st if s} for st in stops]
        eos = pol.eos_ids
        # Only rows with stop strings need their text while sampling (incrementally, exactly).
        detok = [IncrementalText(pol, contexts[r]) if last_chars[r] else None for r in range(n)]

        for _ in range(max(limit)):
            logp = torch.log_softmax(logits.float(), dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=self.gen)  # [b, 1]
            tok_lp = logp.gather(-1, tok).squeeze(-1).tolist()
            tok_list = tok.squeeze(-1).tolist()
            keep = []
            for b, r in enumerate(rows):
                if finish[r] is not None:
                    continue  # done earlier; still in the batch until it shrinks
                t = tok_list[b]
                toks[r].append(t)
                lps[r].append(tok_lp[b])
                if t in eos:
                    finish[r] = "eos"
                else:
                    piece = detok[r].push(t) if detok[r] is not None else ""
                    texts[r] += piece
                    if (
                        piece
                        and any(ch in piece for ch in last_chars[r])
                        and any(s in texts[r][-len(s) - len(piece) :] for s in stops[r])
                    ):
                        finish[r] = "stop"
                    elif len(toks[r]) >= limit[r]:
                        finish[r] = "length"
                if finish[r] is None:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(rows) // 2:
                # Most rows are done: shrink the batch and its cache instead of computing for them.
                sel = torch.as_tensor(keep, device=dev)
                past.batch_select_indices(sel)
                tok, mask, next_pos = tok[sel], mask[sel], next_pos[sel]
                rows = [rows[b] for b in keep]
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            past, logits = self._forward(input_ids=tok, attention_mask=mask, position_ids=next_pos, cache=past)
            next_pos = next_pos + 1
        return [
            Sample(tuple(toks[r]), tuple(lps[r]), pol.decode_after(contexts[r], toks[r]), finish[r] or "length")
            for r in range(n)
        ]


class IncrementalText:
    """Text of a growing token sequence, exactly, one token at a time: decode a short window of
    recent tokens and hand out only what it adds once it no longer ends in a partial character
    (byte-level BPE splits multi-byte characters across tokens; SentencePiece words carry their
    leading space on the first piece). The same method as vLLM's incremental detokenizer."""

    def __init__(self, policy: Policy, context: Sequence[int]):
        self.policy = policy
        self.ids = list(context[-4:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens already turned into text

    def push(self, tok: int) -> str:
        self.ids.append(int(tok))
        dec = self.policy.decode
        before = dec(self.ids[self.prefix : self.read])
        now = dec(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""
