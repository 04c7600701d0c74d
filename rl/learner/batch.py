"""From trajectories to training tensors: groups, staleness, token layout.

    buf = GroupBuffer(group_size=8)
    buf.add(traj)                                         # as trajectories arrive, in any order
    groups = buf.pop(n_groups=16, version=12, max_staleness=2)   # None until 16 fresh groups are complete
    buf.abandon([group numbers])                          # the coordinator gave up an episode of these
    tb = collate(trajs, advantages, pad_id)               # TokenBatch, right-padded

A group is the trajectories of one task instance: same domain, task and group number, which is
`episode // group_size` (the coordinator's sampler numbers a group's episodes consecutively;
a re-issued episode keeps its number). Task ids are unique for the life of a run by contract
(`Task`); the group number keeps two groups apart even for a site domain whose ids repeat.
A group is complete when `group_size` of them arrived. Complete groups leave oldest first by
their newest action (ties in completion order): training sees data in the order it was made,
and the groups nearest the staleness bound go first. Completion order instead would put a slow
group that has just finished behind every fast group that finished while it ran: its wait
there adds to its final environment step, and its data ages past the bound.

Staleness is bounded at admission, by the group's newest action: a complete group is trained
if the newest step any of its members sampled is at most `max_staleness` policy versions behind
the learner, and dropped (counted, per domain) otherwise. Older steps of the same group (the
first turns of a long multi-turn episode, a member that finished early and waited for the
others) are trained too, their off-policyness corrected per token by importance weights (the
algorithm's: GRPO's dual clip, or decoupled PPO's capped behaviour weight, rl/learner/algorithms.py).
Measuring a group by its oldest step instead (as hpcrl once did) drops exactly the long
episodes, and the groups that wait for one, however fresh most of their tokens are: training
drifts toward fast episodes and fast domains. An incomplete group is never dropped for its age
(a member still running may be fresh); a group that can never be complete (the coordinator
gave up one of its episodes) is closed when the coordinator says so (`abandon`), and what
arrived of it is dropped ("abandoned"). What the rule still measures is time since a group's
last sample: the final environment step (a test run, a judge) and the wait for the learner. A
domain whose final step alone outlasts max_staleness learner steps has every group dropped;
its `dropped_stale` count says so, and max_staleness must cover that step.

With `filter_zero_variance` (dynamic sampling, as in DAPO) a complete group whose rewards are
all equal is dropped on arrival (`filtered` counts its trajectories): its advantages would all
be 0, so it carries no gradient, and the coordinator issues a new group in its place, so every
batch is made of groups with a learning signal. Every group closed without training (stale,
filtered, abandoned) is counted once in `dropped_groups`: the coordinator's flow control counts
it consumed and issues another in its place.

Per domain, `domain_counts()` tells what arrived (first copies: episodes that finished), what
was trained and what was dropped and why, with the turns and tokens of what arrived and what
was trained: a length or domain bias in what the learner trains shows there.

One trajectory is one row: for each step its prompt, action and observation tokens, in order;
only action tokens with loss_mask 1 are trained, each with the log-probability the generator
recorded for it and, for a step drawn at another temperature or truncated, its sampling
parameters (the learner scores the current policy under them). A greedy step (temperature 0)
is never trained.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from hpcrl.rl.learner.algorithms import TokenBatch
from hpcrl.rl.model.logprobs import Shaping
from hpcrl.rl.record.trajectory import Trajectory

__all__ = ["GroupBuffer", "DROP_REASONS", "Row", "collate", "collate_rows", "layout", "trained_tokens"]

# Closed groups remembered beyond the staleness horizon (GroupBuffer._closed): ~500 steps of 32
# groups; under 1 MB in memory and in the learner's checkpoint.
_CLOSED_KEEP = 16384
# Why the learner dropped a trajectory: its group's newest action was too many versions behind
# the learner, its group had closed (a re-issued episode finished twice), the same episode twice
# in a group not yet trained, its group's rewards were all equal (filter_groups), or its group
# can never be complete (the coordinator gave up one of its episodes).
DROP_REASONS = ("stale", "late", "duplicate", "filtered", "abandoned")

# One trajectory laid out (`layout`): token ids, action mask [T-1], behaviour log-probabilities
# [T-1], and None or the sampling parameters per position [T-1, 3] (temperature, top_p, top_k).
Row = tuple[list[int], list[float], list[float], "np.ndarray | None"]


def trained_tokens(traj: Trajectory) -> int:
    """The action tokens of `traj` the loss trains (loss mask 1, greedy steps excepted)."""
    return sum(int(s.loss_mask.sum()) for s in traj.steps if not s.greedy)


def _newest(trajs: Iterable[Trajectory]) -> int:
    return max(t.max_policy_version for t in trajs)


class GroupBuffer:
    """Complete groups for the learner; see the module docstring. `drained()` hands out the ids
    of trajectories dropped since the last call, each with its reason (DROP_REASONS), so the
    learner's audit log accounts for every trajectory it read."""

    def __init__(self, group_size: int, filter_zero_variance: bool = False):
        self.group_size = group_size
        self.filter_zero_variance = filter_zero_variance
        self.filtered = 0  # trajectories of zero-variance groups dropped (dynamic sampling)
        self._open: dict[tuple[str, str, int], dict[int, Trajectory]] = {}
        self._complete: collections.OrderedDict[tuple[str, str, int], list[Trajectory]] = collections.OrderedDict()
        # Groups already handed out or dropped -> their newest policy version, in closing order.
        # A late copy of one of their episodes (a re-issued episode both generators finished) is
        # dropped. Entries are kept while younger than the staleness horizon, and the last
        # _CLOSED_KEEP in any case: a re-issued episode can arrive long after its group closed
        # (a lease that ran out), and taken for a new group it would be counted a second time.
        self._closed: collections.OrderedDict[tuple[str, str, int], int] = collections.OrderedDict()
        self._dropped: list[tuple[str, str]] = []  # (trajectory id, reason) since the last drained()
        # Group numbers the coordinator gave up an episode of (they can never be complete).
        self._abandoned: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.dropped_stale = 0  # trajectories
        self.duplicates = 0
        # Groups the learner will never train (stale, filtered, abandoned), each counted once
        # however many of its members had arrived: the coordinator's flow control counts them
        # as consumed, and a group counted short would hold a place in its window for ever.
        self.dropped_groups = 0
        self._domains: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def key(self, traj: Trajectory) -> tuple[str, str, int]:
        return (traj.domain, traj.task, traj.episode // self.group_size)

    @property
    def depth(self) -> dict[str, int]:
        """Groups waiting: still filling ("open") and whole, ready to train ("complete")."""
        return {"open": len(self._open), "complete": len(self._complete)}

    def add(self, traj: Trajectory) -> None:
        key = self.key(traj)
        if key[2] in self._abandoned and key not in self._closed:
            self._drop([traj], "abandoned")
            return
        if key in self._closed:
            self._drop([traj], "late")
            return
        if key in self._complete:
            # Its group is whole and waits to be trained, so this is a second copy of one of its
            # episodes (a re-issued lease both generators finished). Taken for a new open group,
            # it would have replaced the waiting group unaccounted once that group filled again.
            self._drop([traj], "duplicate")
            return
        group = self._open.setdefault(key, {})
        if traj.episode in group:
            self._drop([traj], "duplicate")  # the same episode from two generators: keep the first
            return
        group[traj.episode] = traj
        self._count(traj, "arrived")
        if len(group) == self.group_size:
            members = list(self._open.pop(key).values())
            if self.filter_zero_variance and len({t.final_reward for t in members}) == 1:
                self._close(key, members)
                self.dropped_groups += 1
                self._drop(members, "filtered")
                return
            self._complete[key] = members

    def _count(self, traj: Trajectory, what: str) -> None:
        c = self._domains[traj.domain]
        c[what] += 1
        if what in ("arrived", "trained"):
            c[what + "_turns"] += len(traj.steps)
            c[what + "_tokens"] += traj.n_tokens

    def _drop(self, trajs, reason: str) -> None:
        if reason == "stale":
            self.dropped_stale += len(trajs)
        elif reason == "filtered":
            self.filtered += len(trajs)
        elif reason in ("late", "duplicate"):  # a second copy: from two generators, or after its group closed
            self.duplicates += len(trajs)
        for t in trajs:
            self._count(t, "dropped_" + reason)
        self._dropped.extend((t.id, reason) for t in trajs)

    def _close(self, key, trajs, version: int | None = None) -> None:
        self._closed[key] = max(t.max_policy_version for t in trajs) if version is None else version
        self._closed.move_to_end(key)

    def pop(self, n_groups: int, version: int, max_staleness: int) -> list[list[Trajectory]] | None:
        """n_groups eligible complete groups, oldest newest action first, or None (nothing
        removed) if fewer exist. Complete groups whose newest action is more than max_staleness
        versions behind `version` are dropped on the way (incomplete groups never are)."""
        # Closed at the learner's version, not their own: a late copy may still come.
        for key in [k for k, g in self._complete.items() if version - _newest(g) > max_staleness]:
            g = self._complete.pop(key)
            self._close(key, g, version)
            self._drop(g, "stale")
            self.dropped_groups += 1
        horizon = version - max_staleness - 1
        while len(self._closed) > _CLOSED_KEEP and next(iter(self._closed.values())) < horizon:
            self._closed.popitem(last=False)
        if len(self._complete) < n_groups:
            return None
        oldest = sorted(self._complete, key=lambda k: _newest(self._complete[k]))[:n_groups]  # stable
        out = [(key, self._complete.pop(key)) for key in oldest]
        for key, g in out:
            self._close(key, g)
            for t in g:
                self._count(t, "trained")
        return [g for _, g in out]

    def abandon(self, groups: Iterable[int]) -> int:
        """Close the groups with these numbers (the coordinator gave up one of their episodes:
        they can never be complete): what arrived of them is dropped now, what arrives later on
        arrival. Each is counted once in dropped_groups; a group already trained, dropped or
        complete is left as it is. Returns how many were closed now."""
        closed = 0
        for g in groups:
            g = int(g)
            if g in self._abandoned:
                continue
            self._abandoned[g] = None
            while len(self._abandoned) > _CLOSED_KEEP:
                self._abandoned.popitem(last=False)
            if any(k[2] == g for k in self._complete) or any(k[2] == g for k in self._closed):
                continue  # complete after all (a late copy made it whole), or already closed
            for key in [k for k in self._open if k[2] == g]:
                self._drop(list(self._open.pop(key).values()), "abandoned")
            self.dropped_groups += 1
            closed += 1
        return closed

    def domain_counts(self) -> dict[str, dict[str, int]]:
        """Per domain, cumulative: arrived, trained and dropped_<reason> trajectories, and the
        turns and tokens of those arrived and trained (`arrived_turns`, `trained_tokens`, ...)."""
        return {d: dict(c) for d, c in sorted(self._domains.items())}

    def drained(self) -> list[tuple[str, str]]:
        """(id, reason) of each trajectory dropped since the last call; reasons in DROP_REASONS."""
        out, self._dropped = self._dropped, []
        return out

    @property
    def complete_groups(self) -> int:
        return len(self._complete)

    @property
    def open_trajectories(self) -> int:
        return sum(len(g) for g in self._open.values())

    def state_dict(self) -> dict:
        """Everything buffered (as Trajectory.to_dict records) and the closed groups: saved with
        the learner's checkpoint, so a restart neither loses nor repeats a buffered trajectory."""
        return {
            "open": [t.to_dict() for g in self._open.values() for t in g.values()],
            "complete": [t.to_dict() for g in self._complete.values() for t in g],
            "closed": [[d, t, v, g] for (d, t, g), v in self._closed.items()],
            "dropped": [i for i, _ in self._dropped],
            "dropped_why": [why for _, why in self._dropped],
            "counters": [self.dropped_stale, self.duplicates, self.filtered, self.dropped_groups],
            "abandoned": list(self._abandoned),
            "domains": self.domain_counts(),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        # Closed groups saved before group numbers were part of the key ([d, t, v]) are kept
        # under group -1, which no arriving trajectory has: they expire as before.
        self._closed = collections.OrderedDict(
            ((row[0], row[1], int(row[3]) if len(row) > 3 else -1), int(row[2])) for row in state["closed"]
        )
        for rec in state["complete"] + state["open"]:
            traj = Trajectory.from_dict(rec)
            key = self.key(traj)
            self._open.setdefault(key, {})[traj.episode] = traj
            if len(self._open[key]) == self.group_size:
                self._complete[key] = list(self._open.pop(key).values())
        # Checkpoints from before reasons were kept: their reason is unknown, not invented.
        why = state.get("dropped_why") or ["unknown"] * len(state["dropped"])
        self._dropped = list(zip(state["dropped"], why))
        self.dropped_stale, self.duplicates, *rest = state["counters"]
        self.filtered = int(rest[0]) if rest else 0
        # Older checkpoints counted trajectories only: their estimate, as the learner made it then.
        self.dropped_groups = int(rest[1]) if len(rest) > 1 else (self.dropped_stale + self.filtered) // self.group_size
        self._abandoned = collections.OrderedDict((int(g), None) for g in state.get("abandoned", []))
        self._domains = collections.defaultdict(collections.Counter)
        for d, c in (state.get("domains") or {}).items():  # older checkpoints: counted from here on
            self._domains[d].update({k: int(v) for k, v in c.items()})


def layout(traj: Trajectory) -> Row:
    """(token ids, action mask [T-1], behaviour logprobs [T-1], sampling parameters [T-1, 3] or
    None) of one trajectory, aligned so that index t of the last three describes token t+1. The
    parameters (temperature, top_p, top_k per position; 1, 1, 0 off the actions) are None when
    every trained step was drawn from the model's own distribution. Greedy steps are masked."""
    ids: list[int] = []
    mask: list[float] = []
    behav: list[float] = []
    shaped = [] if any(not s.plain and not s.greedy for s in traj.steps) else None
    for s in traj.steps:
        for part, is_action in ((s.prompt_tokens, False), (s.action_tokens, True), (s.observation_tokens, False)):
            if not len(part):
                continue
            ids.extend(part.tolist())
            if is_action:
                if shaped is not None and not s.greedy:
                    shaped.append((len(mask), len(part), s.temperature, s.top_p, s.top_k))
                mask.extend([0.0] * len(part) if s.greedy else s.loss_mask.astype(float).tolist())
                behav.extend(s.action_logprobs.astype(float).tolist())
            else:
                mask.extend([0.0] * len(part))
                behav.extend([0.0] * len(part))
    shape = None
    if shaped is not None:
        shape = np.tile(np.array([1.0, 1.0, 0.0], np.float32), (len(mask), 1))
        for at, n, temp, top_p, top_k in shaped:
            shape[at : at + n] = (temp, top_p, top_k)
        shape = shape[1:]
    # Token 0 is never predicted: drop its slot so the arrays line up with token_logprobs.
    return ids, mask[1:], behav[1:], shape


def collate(trajs: Sequence[Trajectory], advantages: torch.Tensor, pad_id: int) -> TokenBatch:
    return collate_rows([layout(t) for t in trajs], advantages, pad_id)


def collate_rows(rows: Sequence[Row], advantages: torch.Tensor, pad_id: int) -> TokenBatch:
    """`collate` of rows already laid out (`layout`), right-padded to the longest."""
    width = max(len(r[0]) for r in rows)
    n = len(rows)
    # Filled as numpy arrays, converted once: a torch.as_tensor per row and field cost ~17 ms of
    # a 256-row batch, ~15 % of the tiny model's training step.
    ids_a = np.full((n, width), pad_id, dtype=np.int64)
    attn = np.zeros((n, width), dtype=np.int64)
    mask_a = np.zeros((n, width - 1), dtype=np.float32)
    behav_a = np.zeros((n, width - 1), dtype=np.float32)
    shape_a = None
    if any(r[3] is not None for r in rows):
        shape_a = np.tile(np.array([1.0, 1.0, 0.0], np.float32), (n, width - 1, 1))
    for i, (ids, mask, behav, shape) in enumerate(rows):
        ids_a[i, : len(ids)] = ids
        attn[i, : len(ids)] = 1
        mask_a[i, : len(mask)] = mask
        behav_a[i, : len(behav)] = behav
        if shape is not None:
            shape_a[i, : len(shape)] = shape
    tensors = (torch.from_numpy(a) for a in (ids_a, attn, mask_a, behav_a))
    return TokenBatch(*tensors, advantages.float(), shaping=shaping_of(shape_a))


def shaping_of(shape: np.ndarray | None) -> Shaping | None:
    """Sampling parameters [..., 3] (temperature, top_p, top_k) as a `Shaping`, or None."""
    if shape is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(shape))
    return Shaping(t[..., 0].contiguous(), t[..., 1].contiguous(), t[..., 2].long())
