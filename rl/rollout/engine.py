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
batch and the new rows' caches on the left; columns no row uses any more are trimmed. Each
layer's keys and values sit at the front of a buffer with room for the rows' remaining tokens
(`_Slab`): a decode step writes its column in place instead of concatenating the whole cache.

Kept caches: when a row finishes, its keys and values (real columns only) are kept for the
episode, newest first within `kv_keep_bytes` (least recently kept are dropped first: their
episodes re-prefill their whole context); `forget(key)` when the episode ends. Needs a model
whose cache is transformers' DynamicCache of full-attention layers (Llama, Qwen2, Mistral, ...):
the engine hands it a DynamicCache whose layers are `_Slab`s.

Sampling per row: temperature (0: greedy), top_p, top_k, several eos ids, stop strings
(matched on exactly decoded text). `sample_tokens` is the whole of it, a pure function of the
logits, the rows' parameters and a generator: each token is drawn from the row's sampling
distribution q (`shaped_log_softmax`, rl/model/logprobs.py: logits / temperature, then top-k, then
top-p) and its recorded log-probability is log q of that token, the distribution that drew it.
The learner scores the current policy under the same parameters (stored with each step of the
trajectory), so on-policy ratios are 1 and a token drawn hot or truncated enters the loss with
the probability it was drawn with. Greedy rows (temperature 0) take the argmax and record 0.0 (a
point mass: nothing to learn from; the generator stores such steps untrained). Tokens are drawn
by inverting each row's CDF (`_draw`), not with torch.multinomial (an exponential variate per
vocabulary entry).
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hpcrl.rl.model.logprobs import shaped_log_softmax
from hpcrl.rl.model.policy import Policy

__all__ = ["SamplingSpec", "DecodeEngine", "ContextTooLong", "Sample", "IncrementalText", "sample_tokens"]


@dataclass(frozen=True)
class Sample:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # log q: of the distribution each token was drawn from
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
        if self.policy.model.training:  # eval() walks every module: not on every step
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
            pasts = [self._take_kept(r) for r in new]
            parts = []
            for g in _groups([len(r.context) - (p[0] if p else 0) for r, p in zip(new, pasts)]):
                rows = [new[i] for i in g]
                cache, mask, lg = self._prefill(rows, [pasts[i] for i in g])
                parts.append((rows, cache, mask))
                logits.append(lg)
            self._merge(parts)
        if not logits:
            return []
        toks, lps = self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])
        return self._advance(toks, lps)

    def _take_kept(self, r: _Row):
        got = self.kept.pop(r.key, None)
        if got is not None:
            self.kept_bytes -= got[2]
            if got[0] >= len(r.context):
                got = None  # nothing new to feed (cannot happen with a fresh observation)
        return got

    def _prefill(self, rows: list[_Row], pasts: list):
        dev, pol = self.policy.device, self.policy
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
        room = _room(rows, P + M)  # for the decode steps' columns
        if P > 0:
            # Each kept cache right-aligned at column P, straight into the buffers the forward
            # and the decode steps write on.
            template = next(p for p in pasts if p is not None)[1]
            layers = []
            for li in range(len(template)):
                kv = []
                for j in (0, 1):
                    t = template[li][j]
                    buf = t.new_zeros((b, t.shape[0], P + M + room, t.shape[2]))
                    for i, p in enumerate(pasts):
                        if p is not None:
                            buf[i, :, P - p[0] : P] = p[1][li][j]
                    kv.append(buf)
                layers.append(_Slab(room, *kv, n=P))
            cache = _slab_cache(layers)
        else:
            cache = _slab_cache(None, room)
        mask = mask.to(dev)
        cache, logits = self._forward(ids.to(dev), mask, pos.to(dev), cache)
        return cache, mask, logits

    def _merge(self, parts: list[tuple[list[_Row], Any, torch.Tensor]]) -> None:
        """The batch and the prefilled groups (rows, cache, mask) as one batch, in that order,
        right-aligned: one copy into new buffers (none for a lone group into an empty batch)."""
        if self.rows:
            parts = [(self.rows, self.cache, self.mask), *parts]
        if len(parts) == 1:
            self.rows, self.cache, self.mask = list(parts[0][0]), parts[0][1], parts[0][2]
            return
        L = max(m.shape[1] for _, _, m in parts)
        self.rows = [r for rows, _, _ in parts for r in rows]
        room = _room(self.rows, L)
        layers = []
        for li in range(len(parts[0][1].layers)):
            kv = []
            for name in ("keys", "values"):
                ts = [getattr(c.layers[li], name) for _, c, _ in parts]
                buf = ts[0].new_zeros((len(self.rows), ts[0].shape[1], L + room, ts[0].shape[3]))
                at = 0
                for t in ts:
                    buf[at : at + t.shape[0], :, L - t.shape[2] : L] = t
                    at += t.shape[0]
                kv.append(buf)
            layers.append(_Slab(room, *kv, n=L))
        self.cache = _slab_cache(layers)
        self.mask = torch.cat([_left_pad_mask(m, L - m.shape[1]) for _, _, m in parts], dim=0)

    def _sample(self, logits: torch.Tensor):
        specs = [r.spec for r in self.rows]
        if all(s.plain for s in specs):
            tok, lq = sample_tokens(logits, None, None, None, self.gen)
        else:
            dev = logits.device
            temp = torch.tensor([s.temperature for s in specs], device=dev)
            top_p = torch.tensor([s.top_p for s in specs], device=dev)
            top_k = torch.tensor([s.top_k for s in specs], device=dev)
            tok, lq = sample_tokens(logits, temp, top_p, top_k, self.gen)
        # One transfer for both (a single sync on an accelerator).
        both = torch.stack([tok.double(), lq.double()]).tolist()
        return [int(t) for t in both[0]], both[1]

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
        layers = [(la.keys[b][:, cols], la.values[b][:, cols]) for la in self.cache.layers]  # copies
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
        n = self.mask.shape[1]
        room = _room(self.rows, n)
        layers = []
        for la in self.cache.layers:
            kv = []
            for t in (la.keys, la.values):
                buf = t.new_empty((len(idx), t.shape[1], n + room, t.shape[3]))
                buf[:, :, :n] = t[sel, :, first:]
                kv.append(buf)
            layers.append(_Slab(room, *kv, n=n))
        self.cache = _slab_cache(layers)


class _Slab(DynamicLayer):
    """One layer's keys and values [B, H, n, D]: the front of buffers with room to grow along
    the sequence. A decode step writes its column in place, where DynamicLayer concatenates,
    copying every row's whole cache at every step (~33 MB a step for 16 rows of 500 tokens of
    the bench's 4-layer model: 17% of transformers' decode forwards in bench/generate.py)."""

    def __init__(self, room: int, bk: torch.Tensor | None = None, bv: torch.Tensor | None = None, n: int = 0):
        super().__init__()
        self.room = room  # columns to allocate beyond what a (re)allocation must hold
        if bk is not None:
            self._use(bk, bv, n)

    def _use(self, bk: torch.Tensor, bv: torch.Tensor, n: int) -> None:
        self.bk, self.bv, self.n = bk, bv, n
        self.keys, self.values = bk[:, :, :n], bv[:, :, :n]
        self.device, self.is_initialized = bk.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[2]
        if not self.is_initialized:  # a fresh batch's prefill
            shape = (*key_states.shape[:2], q + self.room, key_states.shape[3])
            self._use(key_states.new_empty(shape), value_states.new_empty(shape), 0)
        end = self.n + q
        if end > self.bk.shape[2]:  # more room than foreseen: grow by half, amortised O(1) a column
            cap = end + max(self.room, end // 2)
            bk = self.bk.new_empty((*self.bk.shape[:2], cap, self.bk.shape[3]))
            bv = self.bv.new_empty((*self.bv.shape[:2], cap, self.bv.shape[3]))
            bk[:, :, : self.n], bv[:, :, : self.n] = self.keys, self.values
            self._use(bk, bv, self.n)
        self.bk[:, :, self.n : end] = key_states
        self.bv[:, :, self.n : end] = value_states
        self._use(self.bk, self.bv, end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0


def _slab_cache(layers: list[_Slab] | None, room: int = 0) -> DynamicCache:
    """A DynamicCache made of _Slab layers: these, or (a fresh batch) one per layer as the
    forward reaches it."""
    cache = DynamicCache()
    cache.layers = layers if layers is not None else []
    cache.layer_class_to_replicate = None if layers is not None else (lambda: _Slab(room))
    return cache


# About what one more forward costs, in token positions: below it, rows of different lengths
# share a prefill and are padded; above, they split. The bench's model on one loaded core:
# ~17 ms for a one-token forward against ~0.44 ms a position of a 16 x 256 prefill, i.e. ~40
# positions. Kernel launches make a GPU's fixed cost weigh more; 128 leaves room for that
# (not tuned on a GPU).
_SPLIT_TOKENS = 128


def _groups(lengths: list[int], fixed: int = _SPLIT_TOKENS) -> list[list[int]]:
    """The rows to prefill together (indices into `lengths`, the tokens each must feed):
    longest first, a new group once a group's padding would pass `fixed` positions. One
    forward over all would pad every row to the longest: prompts of 65-257 tokens cost 16 x 257
    positions instead of their ~2,600, and a kept episode's 33 new tokens the same 257."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, waste = [[order[0]]], 0
    for i in order[1:]:
        w = lengths[groups[-1][0]] - lengths[i]
        if waste + w > fixed:
            groups.append([i])
            waste = 0
        else:
            groups[-1].append(i)
            waste += w
    return groups


def _room(rows: list[_Row], n: int) -> int:
    """Columns to allocate beyond the n in use: what the rows' decode steps add at most (one per
    token still to sample), but no more than max(64, n) ahead (a row that may run long but
    usually stops at eos would hold memory it never uses; _Slab grows if it does run long)."""
    return min(max((r.max_new - len(r.toks) for r in rows), default=0), max(64, n))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], log q of it [B]) for each row of `logits` [B, V], drawn from the row's sampling
    distribution q = shaped_log_softmax(logits, temperature, top_p, top_k) (rl/model/logprobs.py,
    the function the learner scores with). None for all three: the model's own distribution.
    A row at temperature 0 is greedy: its argmax, with log q = 0 (a point mass)."""
    logits = logits.float()
    if temperature is None:
        logq = torch.log_softmax(logits, dim=-1)
        tok = _draw(logq.exp(), gen)
        return tok, logq.gather(-1, tok[:, None]).squeeze(-1)
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logq = shaped_log_softmax(logits, temp, top_p, top_k)
    tok = _draw(logq.exp(), gen)
    lq = logq.gather(-1, tok[:, None]).squeeze(-1)
    return torch.where(greedy, logits.argmax(-1), tok), torch.where(greedy, torch.zeros_like(lq), lq)


def _draw(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of probabilities `p` [B, V] (need not sum to 1), by inverting the CDF:
    a cumulative sum and a binary search. torch.multinomial draws an exponential variate per
    vocabulary entry instead: 5.0-6.4 ms against 0.3-1.9 ms for 16 x 8192 on one core of the
    loaded CI machine. The CDF is float64 so that no token's share is lost to rounding.
    v = (1 - u) * total lies in (0, total], so the first index whose CDF reaches v always has a
    positive probability, even with zeros (top-k/top-p cuts) at either end."""
    cdf = p.cumsum(-1, dtype=torch.float64)
    u = torch.rand((p.shape[0], 1), generator=gen, device=p.device, dtype=torch.float64)
    return torch.searchsorted(cdf, (1.0 - u) * cdf[:, -1:]).squeeze(-1)


def _left_pad_mask(m: torch.Tensor, n: int) -> torch.Tensor:
    return m if n == 0 else torch.cat([m.new_zeros((m.shape[0], n)), m], dim=1)
