"""From trajectories to training tensors: groups, staleness, token layout.

    buf = GroupBuffer(group_size=8)
    buf.add(traj)                                         # as trajectories arrive, in any order
    groups = buf.pop(n_groups=16, version=12, max_staleness=2)   # None until 16 fresh groups are complete
    tb = collate(trajs, advantages, pad_id)               # TokenBatch, right-padded

A group is the trajectories of one task instance: same domain, task and group number, which is
`episode // group_size` (the coordinator's sampler numbers a group's episodes consecutively;
a re-issued episode keeps its number). Task ids are unique for the life of a run by contract
(`Task`); the group number keeps two groups apart even for a site domain whose ids repeat.
A group is complete when `group_size` of them arrived; then it is eligible if its oldest
step's policy version is at most `max_staleness` behind the learner (older complete groups are
dropped and counted). Groups leave in completion order, so training sees data roughly in the order it was made.
With `filter_zero_variance` (dynamic sampling, as in DAPO) a complete group whose rewards are
all equal is dropped on arrival (`filtered` counts its trajectories): its advantages would all
be 0, so it carries no gradient, and the coordinator issues a new group in its place, so every
batch is made of groups with a learning signal.

One trajectory is one row: for each step its prompt, action and observation tokens, in order;
only action tokens with loss_mask 1 are trained, each with the log-probability the generator
recorded for it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import torch

from hpcrl.rl.algorithms import TokenBatch
from hpcrl.rl.trajectory import Trajectory

__all__ = ["GroupBuffer", "DROP_REASONS", "collate", "layout"]

# Closed groups remembered beyond the staleness horizon (GroupBuffer._closed): ~500 steps of 32
# groups; under 1 MB in memory and in the learner's checkpoint.
_CLOSED_KEEP = 16384
# Why the learner dropped a trajectory: too many versions behind it, its group had closed (a
# re-issued episode finished twice), the same episode twice in a group not yet trained, or its
# group's rewards were all equal (filter_groups).
DROP_REASONS = ("stale", "late", "duplicate", "filtered")


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
        self.dropped_stale = 0  # trajectories
        self.duplicates = 0
        # Groups the learner will never train (stale, or filtered), each counted once however
        # many of its members had arrived: the coordinator's flow control counts them as
        # consumed, and a group counted short would hold a place in its window for ever.
        self.dropped_groups = 0

    def key(self, traj: Trajectory) -> tuple[str, str, int]:
        return (traj.domain, traj.task, traj.episode // self.group_size)

    @property
    def depth(self) -> dict[str, int]:
        """Groups waiting: still filling ("open") and whole, ready to train ("complete")."""
        return {"open": len(self._open), "complete": len(self._complete)}

    def add(self, traj: Trajectory) -> None:
        key = self.key(traj)
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
        if len(group) == self.group_size:
            members = list(self._open.pop(key).values())
            if self.filter_zero_variance and len({t.final_reward for t in members}) == 1:
                self._close(key, members)
                self.filtered += len(members)
                self.dropped_groups += 1
                self._dropped.extend((t.id, "filtered") for t in members)
                return
            self._complete[key] = members

    def _drop(self, trajs, reason: str) -> None:
        if reason == "stale":
            self.dropped_stale += len(trajs)
        else:  # a second copy of an episode: from two generators, or after its group closed
            self.duplicates += len(trajs)
        self._dropped.extend((t.id, reason) for t in trajs)

    def _close(self, key, trajs, version: int | None = None) -> None:
        self._closed[key] = max(t.max_policy_version for t in trajs) if version is None else version
        self._closed.move_to_end(key)

    def pop(self, n_groups: int, version: int, max_staleness: int) -> list[list[Trajectory]] | None:
        """The first n_groups eligible complete groups, or None (nothing removed) if fewer exist.
        Groups too stale to be trained, complete or not, are dropped on the way."""

        def stale(trajs) -> bool:
            return version - min(t.min_policy_version for t in trajs) > max_staleness

        # Closed at the learner's version, not their own: their missing members may still come.
        for key in [k for k, g in self._complete.items() if stale(g)]:
            g = self._complete.pop(key)
            self._close(key, g, version)
            self._drop(g, "stale")
            self.dropped_groups += 1
        # An open group whose oldest member is already too stale can never be trained.
        for key in [k for k, g in self._open.items() if stale(g.values())]:
            g = list(self._open.pop(key).values())
            self._close(key, g, version)
            self._drop(g, "stale")
            self.dropped_groups += 1
        horizon = version - max_staleness - 1
        while len(self._closed) > _CLOSED_KEEP and next(iter(self._closed.values())) < horizon:
            self._closed.popitem(last=False)
        if len(self._complete) < n_groups:
            return None
        out = [self._complete.popitem(last=False) for _ in range(n_groups)]
        for key, g in out:
            self._close(key, g)
        return [g for _, g in out]

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


def layout(traj: Trajectory) -> tuple[list[int], list[float], list[float]]:
    """(token ids, action mask [T-1], behaviour logprobs [T-1]) of one trajectory, aligned so that
    index t of the last two describes token t+1."""
    ids: list[int] = []
    mask: list[float] = []
    behav: list[float] = []
    for s in traj.steps:
        for part, is_action in ((s.prompt_tokens, False), (s.action_tokens, True), (s.observation_tokens, False)):
            if not len(part):
                continue
            ids.extend(part.tolist())
            if is_action:
                mask.extend(s.loss_mask.astype(float).tolist())
                behav.extend(s.action_logprobs.astype(float).tolist())
            else:
                mask.extend([0.0] * len(part))
                behav.extend([0.0] * len(part))
    # Token 0 is never predicted: drop its slot so the arrays line up with token_logprobs.
    return ids, mask[1:], behav[1:]


def collate(trajs: Sequence[Trajectory], advantages: torch.Tensor, pad_id: int) -> TokenBatch:
    return collate_rows([layout(t) for t in trajs], advantages, pad_id)


def collate_rows(rows: Sequence[tuple[list[int], list[float], list[float]]], advantages: torch.Tensor, pad_id: int):
    """`collate` of rows already laid out (`layout`), right-padded to the longest."""
    width = max(len(ids) for ids, _, _ in rows)
    n = len(rows)
    # Filled as numpy arrays, converted once: a torch.as_tensor per row and field cost ~17 ms of
    # a 256-row batch, ~15 % of the tiny model's training step.
    ids_a = np.full((n, width), pad_id, dtype=np.int64)
    attn = np.zeros((n, width), dtype=np.int64)
    mask_a = np.zeros((n, width - 1), dtype=np.float32)
    behav_a = np.zeros((n, width - 1), dtype=np.float32)
    for i, (ids, mask, behav) in enumerate(rows):
        ids_a[i, : len(ids)] = ids
        attn[i, : len(ids)] = 1
        mask_a[i, : len(mask)] = mask
        behav_a[i, : len(behav)] = behav
    tensors = (torch.from_numpy(a) for a in (ids_a, attn, mask_a, behav_a))
    return TokenBatch(*tensors, advantages.float())
