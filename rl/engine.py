"""Continuous batching with a KV cache kept across an episode's turns.

    engine = DecodeEngine(policy, seed=0, kv_keep_bytes=2 << 30)
    engine.submit(ep, context, max_new=64, spec=SamplingSpec(temperature=0.7, stops=("```",)))
    for key, sample in engine.step():     # one token for every row in the batch
        ...                               # a finished row's slot is free for the next submit

One batch, one KV cache: every `step()` first admits what was submitted (prefilling only the
tokens the model has not seen: the whole context for a new episode, or just the last action
token and the new observation for one whose cache was kept), then decodes one token for every
row. A row that finishes leaves the batch at once and a waiting episode takes its place at the
next step, so no row waits for the longest one of a batch (static batching's cost).

Rows of different lengths share the cache: each row is right-aligned, padding columns are
masked out, and positions are explicit (real tokens only, as `token_logprobs` counts them), so
holes left by rows that came and went change nothing. Admitting rows pads the shorter of the
batch and the new rows' caches on the left; columns no row uses any more are trimmed.

Kept caches: when a row finishes, its keys and values (real columns only) are kept for the
episode, newest first within `kv_keep_bytes` (least recently kept are dropped first: their
episodes re-prefill their whole context); `forget(key)` when the episode ends. Needs a model
whose cache is transformers' DynamicCache of full-attention layers (Llama, Qwen2, Mistral, ...).

Sampling per row: temperature (0: greedy), top_p, top_k, several eos ids, stop strings
(matched on exactly decoded text). The recorded log-probability is the model's own
(temperature 1, untruncated): what the learner recomputes, so on-policy ratios are 1;
temperature and truncation shape which tokens are drawn.
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hpcrl.rl.policy import Policy

__all__ = ["SamplingSpec", "DecodeEngine", "ContextTooLong", "Sample", "IncrementalText"]


@dataclass(frozen=True)
class Sample:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish: Literal["eos", "stop", "length"]
    seconds: float = 0.0  # from submission to the last token


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


class ContextTooLong(ValueError):
    """A context does not fit the model's (or generators.max_context's) length."""


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stops: tuple[str, ...] = ()
    eos: frozenset[int] = frozenset()  # beyond the policy's own eos ids

    @property
    def plain(self) -> bool:
        return self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k <= 0


@dataclass
class _Row:
    key: Any
    context: list[int]
    max_new: int
    spec: SamplingSpec
    eos: frozenset[int]
    pos: int = 0  # position of the next token fed to the model
    last: int = -1  # sampled, not yet in the cache
    toks: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    text: str = ""
    detok: Any = None
    last_chars: frozenset[str] = frozenset()
    started: float = 0.0
    keep: bool = True


class DecodeEngine:
    def __init__(self, policy: Policy, seed: int, kv_keep_bytes: int = 0, max_context: int | None = None):
        self.policy = policy
        self.gen = torch.Generator(device=policy.device)
        self.gen.manual_seed(seed)
        self.kv_keep_bytes = int(kv_keep_bytes)
        self.max_context = max_context or int(getattr(policy.model.config, "max_position_embeddings", 1 << 30))
        params = inspect.signature(policy.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; speak whichever this version speaks.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.rows: list[_Row] = []
        self.cache = None  # DynamicCache of the rows, [B, H, L, D] per layer
        self.mask: torch.Tensor | None = None  # [B, L]
        self.pending: list[_Row] = []
        self.kept: OrderedDict[Any, tuple[int, list[tuple[torch.Tensor, torch.Tensor]], int]] = OrderedDict()
        self.kept_bytes = 0
        self.prefilled_tokens = 0  # tokens run through prefill (what keeping caches saves)

    # -- the caller's side ------------------------------------------------------------------

    def submit(self, key: Any, context, max_new: int, spec: SamplingSpec = SamplingSpec(), keep: bool = True):
        """Queue a row: sample up to `max_new` tokens after `context` (its full token list)."""
        if not context:
            raise ValueError("DecodeEngine.submit: the context needs at least one token (e.g. bos)")
        if len(context) + 1 > self.max_context:
            raise ContextTooLong(
                f"a context of {len(context)} tokens does not fit max_context {self.max_context} "
                "(generators.max_context, or the model's max_position_embeddings)"
            )
        max_new = max(1, min(int(max_new), self.max_context - len(context)))
        row = _Row(key, list(context), max_new, spec, self.policy.eos_ids | spec.eos, keep=keep)
        row.last_chars = frozenset(s[-1] for s in spec.stops if s)
        if row.last_chars:
            row.detok = IncrementalText(self.policy, row.context)
        row.started = time.perf_counter()
        self.pending.append(row)

    def forget(self, key: Any) -> None:
        """The episode is over: drop its kept cache."""
        got = self.kept.pop(key, None)
        if got is not None:
            self.kept_bytes -= got[2]

    def clear(self) -> None:
        """Drop every row, pending row and kept cache (new weights: nothing computed with the old)."""
        self.rows, self.pending, self.cache, self.mask = [], [], None, None
        self.kept.clear()
        self.kept_bytes = 0

    def abandon(self) -> list[Any]:
        """Drop the rows in flight (partial actions) and pending ones; return their keys."""
        keys = [r.key for r in self.rows + self.pending]
        self.rows, self.pending, self.cache, self.mask = [], [], None, None
        return keys

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.pending)

    # -- one step ---------------------------------------------------------------------------

    def _forward(self, ids, mask, pos, cache):
        kw = {self._cache_kw: cache} if cache is not None else {}
        out = self.policy.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self._last_only, **kw
        )
        past = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
        return past, out.logits[:, -1, :]

    @torch.no_grad()
    def step(self) -> list[tuple[Any, Any]]:
        """Admit what was submitted, decode one token for every row; the rows that finished."""
        dev = self.policy.device
        self.policy.model.eval()
        logits = []
        if self.rows:
            ids = torch.tensor([[r.last] for r in self.rows], device=dev)
            pos = torch.tensor([[r.pos] for r in self.rows], device=dev)
            self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
            self.cache, lg = self._forward(ids, self.mask, pos, self.cache)
            logits.append(lg)
            for r in self.rows:
                r.pos += 1
        if self.pending:
            new, self.pending = self.pending, []
            cache, mask, lg = self._prefill(new)
            self._merge(new, cache, mask)
            logits.append(lg)
        if not logits:
            return []
        toks, lps = self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])
        return self._advance(toks, lps)

    def _prefill(self, rows: list[_Row]):
        dev, pol = self.policy.device, self.policy
        pasts = []
        for r in rows:
            got = self.kept.pop(r.key, None)
            if got is not None:
                self.kept_bytes -= got[2]
                if got[0] >= len(r.context):
                    got = None  # nothing new to feed (cannot happen with a fresh observation)
            pasts.append(got)
        n_past = [p[0] if p is not None else 0 for p in pasts]
        new = [r.context[n:] for r, n in zip(rows, n_past)]
        P, M, b = max(n_past), max(len(x) for x in new), len(rows)
        ids = torch.full((b, M), pol.pad_id, dtype=torch.long)
        pos = torch.zeros((b, M), dtype=torch.long)
        mask = torch.zeros((b, P + M), dtype=torch.long)
        for i, (x, n) in enumerate(zip(new, n_past)):
            ids[i, M - len(x) :] = torch.as_tensor(x)
            pos[i, M - len(x) :] = torch.arange(n, n + len(x))
            mask[i, P - n : P] = 1
            mask[i, P + M - len(x) :] = 1
            rows[i].pos = n + len(x)
        self.prefilled_tokens += sum(len(x) for x in new)
        cache = None
        if P > 0:
            from transformers import DynamicCache

            layers = []
            template = next(p for p in pasts if p is not None)[1]
            for li, (k0, v0) in enumerate(template):
                k = k0.new_zeros((b, k0.shape[0], P, k0.shape[2]))
                v = v0.new_zeros((b, v0.shape[0], P, v0.shape[2]))
                for i, p in enumerate(pasts):
                    if p is not None:
                        k[i, :, P - p[0] :] = p[1][li][0]
                        v[i, :, P - p[0] :] = p[1][li][1]
                layers.append((k, v))
            cache = DynamicCache(layers)
        mask = mask.to(dev)
        cache, logits = self._forward(ids.to(dev), mask, pos.to(dev), cache)
        return cache, mask, logits

    def _merge(self, rows: list[_Row], cache, mask: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        La, Lb = self.mask.shape[1], mask.shape[1]
        L = max(La, Lb)
        for la, lb in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = getattr(la, name), getattr(lb, name)
                setattr(la, name, torch.cat([_left_pad(a, L - La), _left_pad(b, L - Lb)], dim=0))
        self.mask = torch.cat([_left_pad_mask(self.mask, L - La), _left_pad_mask(mask, L - Lb)], dim=0)
        self.rows.extend(rows)

    def _sample(self, logits: torch.Tensor):
        logp = torch.log_softmax(logits.float(), dim=-1)
        specs = [r.spec for r in self.rows]
        if all(s.plain for s in specs):
            tok = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(-1)
        else:
            tok = self._sample_shaped(logits.float(), specs)
        return tok.tolist(), logp.gather(-1, tok[:, None]).squeeze(-1).tolist()

    def _sample_shaped(self, logits: torch.Tensor, specs) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([max(s.temperature, 1e-6) for s in specs], device=dev)
        z = logits / temp[:, None]
        if any(s.top_k > 0 or s.top_p < 1.0 for s in specs):
            sz, idx = torch.sort(z, dim=-1, descending=True)
            ks = torch.tensor([s.top_k if s.top_k > 0 else z.shape[-1] for s in specs], device=dev)
            cut = torch.arange(z.shape[-1], device=dev)[None, :] >= ks[:, None]
            p = torch.softmax(sz, dim=-1)
            top_p = torch.tensor([s.top_p for s in specs], device=dev)
            cut |= (p.cumsum(-1) - p) > top_p[:, None]  # keep the smallest prefix reaching top_p
            sz = sz.masked_fill(cut, float("-inf"))
            z = torch.full_like(z, float("-inf")).scatter(-1, idx, sz)
        tok = torch.multinomial(torch.softmax(z, dim=-1), 1, generator=self.gen).squeeze(-1)
        greedy = torch.tensor([s.temperature == 0 for s in specs], device=dev)
        return torch.where(greedy, logits.argmax(-1), tok)

    def _advance(self, toks: list[int], lps: list[float]):
        done, keep_idx = [], []
        for b, r in enumerate(self.rows):
            t = toks[b]
            r.toks.append(t)
            r.lps.append(lps[b])
            r.last = t
            finish = None
            if t in r.eos:
                finish = "eos"
            else:
                if r.detok is not None:
                    piece = r.detok.push(t)
                    r.text += piece
                    if piece and any(c in piece for c in r.last_chars):
                        if any(s in r.text[-len(s) - len(piece) :] for s in r.spec.stops):
                            finish = "stop"
                if finish is None and (len(r.toks) >= r.max_new or r.pos + 1 >= self.max_context):
                    finish = "length"
            if finish is None:
                keep_idx.append(b)
            else:
                done.append((b, r, finish))
        if not done:
            return []
        out = []
        for b, r, finish in done:
            if r.keep and self.kv_keep_bytes > 0:
                self._keep(b, r)
            text = self.policy.decode_after(r.context, r.toks)
            out.append((r.key, Sample(tuple(r.toks), tuple(r.lps), text, finish, time.perf_counter() - r.started)))
        self._select(keep_idx)
        return out

    def _keep(self, b: int, r: _Row) -> None:
        """The row's real cache columns (context + action but its last token), for its next turn."""
        cols = self.mask[b].bool()
        layers = [(la.keys[b][:, cols].clone(), la.values[b][:, cols].clone()) for la in self.cache.layers]
        n = int(cols.sum())
        size = sum(k.numel() * k.element_size() * 2 for k, _ in layers)
        if size > self.kv_keep_bytes:
            return
        while self.kept and self.kept_bytes + size > self.kv_keep_bytes:
            _, (_, _, s) = self.kept.popitem(last=False)
            self.kept_bytes -= s
        self.kept[r.key] = (n, layers, size)
        self.kept_bytes += size

    def _select(self, idx: list[int]) -> None:
        if not idx:
            self.rows, self.cache, self.mask = [], None, None
            return
        sel = torch.as_tensor(idx, device=self.mask.device)
        self.rows = [self.rows[i] for i in idx]
        self.mask = self.mask[sel]
        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[sel, :, first:]
            layer.values = layer.values[sel, :, first:]


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    return torch.cat([t.new_zeros((t.shape[0], t.shape[1], n, t.shape[3])), t], dim=2)


def _left_pad_mask(m: torch.Tensor, n: int) -> torch.Tensor:
    return m if n == 0 else torch.cat([m.new_zeros((m.shape[0], n)), m], dim=1)
