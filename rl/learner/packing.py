"""Shared-prompt packing: the learner runs a group's common prompt through the model once.

    units = plan_units(rows, groups, budget_tokens=8192)    # rows: layout() of each trajectory
    pb = pack(units, rows, pad_id)                            # tensors for one micro-batch
    mask = attention_mask(pb.segment, "sdpa", torch.float32)  # [R, 1, L, L]

GRPO samples a group of completions of one prompt. Trained as a row each, the prompt passes
through the model once per member. Packed, a group is one row: the members' common prefix (the
prompt, and any first tokens they all sampled alike) once, then each member's own tokens. The
attention mask lets a member's tokens see the prefix and that member's earlier tokens only, and
positions continue from the prefix, so every token gets exactly the hidden state it gets in a row
of its own; the log-probability of a member's token is read from the position that predicts it,
which for its first own token is the prefix's last. Gradients add up over the members that
share a position, as they would over separate rows.

A group is packed when that removes at least `MIN_SAVED` of its tokens (short prompts and long
completions save little, and a packed row's attention costs its length squared); else each
member is a unit of its own (prefix 0: plain causal attention; a micro-batch of such units
needs no 4-D mask, so a long row of its own costs no [L, L] tensor). A packed unit holds at
most `budget_tokens` tokens: a group longer than that is split over several units, each with
the prefix. Needs an attention that takes an arbitrary mask (sdpa, eager; not flash-attention 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hpcrl.rl.model.logprobs import Shaping

__all__ = ["Unit", "PackedBatch", "plan_units", "pack", "attention_mask", "MASKED_ATTENTION"]

MIN_SAVED = 0.25  # pack a group only when sharing its prefix removes this share of its tokens
MASKED_ATTENTION = ("sdpa", "eager")  # attention implementations that take a 4-D mask

# rl/learner/batch.py layout(): ids, action mask, behaviour logprobs, sampling parameters [T-1, 3] or None
Row = tuple[list[int], list[float], list[float], "np.ndarray | None"]
Rows = Mapping[int, Row] | Sequence[Row]  # rows by index


@dataclass(frozen=True)
class Unit:
    """One packed row: `members` (indices into the rows) sharing their first `prefix` tokens."""

    members: tuple[int, ...]
    prefix: int
    length: int  # tokens of the packed row


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [R, L] packed rows, padded with pad_id
    position_ids: torch.Tensor  # [R, L] each token's position in its member's own sequence
    segment: torch.Tensor  # [R, L] 0: shared prefix, j > 0: the row's j-th member, -1: padding
    src: torch.Tensor  # [N] flat index into [R * L]: the position whose hidden state predicts ...
    targets: torch.Tensor  # [N] ... this token, an action token (mask > 0) of some member
    dest: torch.Tensor  # [N] flat index of that token's slot in the members' [B, T-1] grid
    members: int  # B: rows of the grid, in the order the units list them
    width: int  # T - 1: columns of the grid (the longest member's length - 1)
    shaping: Shaping | None = None  # [N] each: the sampling parameters of each target (None: the model's own)

    def to(self, device) -> PackedBatch:
        fields = (self.input_ids, self.position_ids, self.segment, self.src, self.targets, self.dest)
        shaping = self.shaping.to(device) if self.shaping is not None else None
        return PackedBatch(*(t.to(device) for t in fields), self.members, self.width, shaping)


def _common_prefix(seqs: Sequence[list[int]]) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs[1:]):
            return i
    return n


def plan_units(rows: Rows, groups: Sequence[Sequence[int]], budget_tokens: int = 0, max_members: int = 0) -> list[Unit]:
    """Units for `groups` (each a list of row indices), longest first; `budget_tokens` caps a
    packed unit's length and `max_members` its trajectories (0: no cap)."""
    units: list[Unit] = []
    for members in groups:
        ids = [rows[i][0] for i in members]
        c = _common_prefix(ids) if len(members) > 1 else 0
        total = sum(len(s) for s in ids)
        if c == 0 or (len(members) - 1) * c < MIN_SAVED * total:
            units += [Unit((i,), 0, len(s)) for i, s in zip(members, ids)]
            continue
        cur: list[int] = []
        length = c
        for i, s in zip(members, ids):
            own = len(s) - c
            if cur and ((budget_tokens and length + own > budget_tokens) or len(cur) == max_members):
                units.append(Unit(tuple(cur), c, length))
                cur, length = [], c
            cur.append(i)
            length += own
        units.append(Unit(tuple(cur), c, length))
    units.sort(key=lambda u: -u.length)
    return units


def pack(units: Sequence[Unit], rows: Rows, pad_id: int) -> PackedBatch:
    """The tensors of `units` (one micro-batch). Grid row b is the b-th member in unit order."""
    n_rows, width = len(units), max(u.length for u in units)
    # Filled as numpy arrays, converted once (a torch slice assignment per member cost ~60 us).
    ids = np.full((n_rows, width), pad_id, dtype=np.int64)
    pos = np.zeros((n_rows, width), dtype=np.int64)
    seg = np.full((n_rows, width), -1, dtype=np.int64)
    src: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    dest: list[np.ndarray] = []
    shaped = any(rows[i][3] is not None for u in units for i in u.members)
    shapes: list[np.ndarray] = []
    grid_w = max(len(rows[i][0]) for u in units for i in u.members) - 1
    b = 0
    for r, u in enumerate(units):
        c = u.prefix
        ids[r, :c] = rows[u.members[0]][0][:c]
        pos[r, :c] = np.arange(c)
        seg[r, :c] = 0
        at = c  # where the next member's own tokens start
        base = r * width
        for j, i in enumerate(u.members, start=1):
            seq, mask = rows[i][0], rows[i][1]
            own = len(seq) - c
            ids[r, at : at + own] = seq[c:]
            pos[r, at : at + own] = np.arange(c, len(seq))
            seg[r, at : at + own] = j
            # mask[t] describes token t + 1, predicted by the hidden state at position t: in the
            # prefix while t < c, else in this member's own tokens.
            t = np.flatnonzero(np.asarray(mask) > 0)
            src.append(base + np.where(t < c, t, at + t - c))
            targets.append(np.asarray(seq, dtype=np.int64)[t + 1])
            dest.append(b * grid_w + t)
            if shaped:
                shape = rows[i][3]
                shapes.append(shape[t] if shape is not None else np.tile(np.float32([1.0, 1.0, 0.0]), (len(t), 1)))
            at += own
            b += 1
    if not any(len(x) for x in targets):
        # No action token to train (every loss mask 0): score one token anyway, into a slot the
        # mask ignores, so the loss still has a graph for backward (and ZeRO-3 its hooks).
        src, targets, dest = [np.zeros(1, np.int64)], [ids[0, :1]], [np.zeros(1, np.int64)]
        shapes = [np.float32([[1.0, 1.0, 0.0]])]
    flat = lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.int64))
    ids_t, pos_t, seg_t = (torch.from_numpy(a) for a in (ids, pos, seg))
    shaping = None
    if shaped:
        sh = torch.from_numpy(np.concatenate(shapes).astype(np.float32))
        shaping = Shaping(sh[:, 0].contiguous(), sh[:, 1].contiguous(), sh[:, 2].long())
    return PackedBatch(ids_t, pos_t, seg_t, flat(src), flat(targets), flat(dest), b, grid_w, shaping)


def attention_mask(segment: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, L, L] mask for `segment`: a token sees earlier tokens of the shared prefix and of its
    own segment (padding sees padding, so no row of the softmax is empty). sdpa takes it as
    booleans (True: attend); eager adds it to the scores (0 or the dtype's minimum)."""
    if implementation not in MASKED_ATTENTION:
        raise ValueError(f"shared-prompt packing needs one of {MASKED_ATTENTION} attention, not {implementation!r}")
    q, k = segment[:, :, None], segment[:, None, :]
    n = segment.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=segment.device).tril()
    allowed = (causal & ((k == 0) | (k == q)))[:, None]
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=segment.device).masked_fill(~allowed, torch.finfo(dtype).min)
