"""Handing out episodes: which domain, which task instance, which episode number.

    sampler = TaskSampler({"arith/max2": 1.0, "code-repair": 0.1}, group_size=8, seed=0,
                          sizes={"code-repair": 164})   # domains with a finite list of tasks
    tickets = sampler.next_group()        # 8 EpisodeTickets of one task instance (a GRPO group)
    sampler.issued()                      # {domain: episodes handed out}
    domain_report(sampler.issued(), learner_counts)   # per domain: issued against trained, dropped

    source = LocalTaskSource(sampler)     # what a generator pulls from when run in-process
    source.take(16); source.done(ticket); source.failed(ticket, "sandbox died")

A ticket is plain data, so the coordinator can send it to a generator over the wire. Tickets of
one group share (domain, task index); the task id the domain gives that index names the group
in the trajectory store. Episode numbers are unique within a sampler's life; a resumed sampler
continues from its saved `state()`.

A domain with a finite list of n tasks (`Domain.size`) is visited in passes: pass p hands out
indices p x n + perm_p(0..n-1), where perm_p is a permutation seeded by (seed, domain, p). Every
pass holds each task once, consecutive groups are not neighbours in the list (a batch of one
domain's first 32 prompts is one corner of the task, `a+b=` with a in 0..3), and since perm_p is
a pure function of those three, a resumed sampler continues the same order. The domain sees the
index and takes task index mod n.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["EpisodeTicket", "TaskSampler", "TaskSource", "LocalTaskSource", "EpisodeFailed", "domain_report"]


@dataclass(frozen=True)
class EpisodeTicket:
    domain: str
    task_index: int
    episode: int
    group: int  # the group's number; the group_size tickets of one task instance share it
    attempt: int = 0  # how many times this episode was issued before (re-issues after failures)


class EpisodeFailed(RuntimeError):
    """An episode failed too often to keep re-issuing; the message names the domain and task."""


class TaskSampler:
    """Weighted choice of domain per group; a per-domain counter picks the task instance."""

    def __init__(
        self, weights: Mapping[str, float], group_size: int, seed: int, sizes: Mapping[str, int | None] | None = None
    ):
        if not weights:
            raise ValueError("TaskSampler: no domains; list at least one under `domains:` in the config")
        bad = {k: w for k, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"TaskSampler: weights must be > 0 (got {bad})")
        if group_size < 1:
            raise ValueError(f"TaskSampler: group_size must be >= 1 (got {group_size})")
        self.names = list(weights)
        self.weights = [float(weights[n]) for n in self.names]
        self.group_size = group_size
        self._rng = random.Random(seed)
        self._next_index = {n: 0 for n in self.names}
        self._seed = seed
        self._sizes = {n: int(k) for n, k in (sizes or {}).items() if n in self._next_index and k}
        self._perm: dict[str, tuple[int, list[int]]] = {}  # domain -> (pass, its permutation)
        self._next_episode = 0
        self._next_group = 0

    def next_group(self) -> list[EpisodeTicket]:
        domain = self._rng.choices(self.names, self.weights)[0]
        index = self._task_index(domain, self._next_index[domain])
        self._next_index[domain] += 1
        group = self._next_group
        self._next_group += 1
        out = []
        for _ in range(self.group_size):
            out.append(EpisodeTicket(domain, index, self._next_episode, group))
            self._next_episode += 1
        return out

    def _task_index(self, domain: str, position: int) -> int:
        n = self._sizes.get(domain)
        if not n:
            return position
        p, pos = divmod(position, n)
        cached = self._perm.get(domain)
        if cached is None or cached[0] != p:
            order = list(range(n))
            random.Random(f"{self._seed}:{domain}:{p}").shuffle(order)  # a str seed: the same in every process
            cached = self._perm[domain] = (p, order)
        return p * n + cached[1][pos]

    def state(self) -> dict:
        """JSON-able state: enough to continue without repeating an episode number or task index."""
        return {
            "rng": _rng_state_to_json(self._rng.getstate()),
            "next_index": dict(self._next_index),
            "next_episode": self._next_episode,
            "next_group": self._next_group,
        }

    def issued(self) -> dict[str, int]:
        """Episodes handed out so far per domain (first attempts: groups x group_size)."""
        return {n: i * self.group_size for n, i in self._next_index.items()}

    @property
    def next_numbers(self) -> tuple[int, int]:
        """(next episode number, next group number)."""
        return self._next_episode, self._next_group

    def skip_to(self, episode: int, group: int) -> None:
        """Never hand out an episode or group number below these (numbers a lost state may have
        issued). Group g keeps episodes g x group_size ... (the learner finds a trajectory's
        group as episode // group_size, rl/learner/batch.py), so both move to the same boundary."""
        g = max(self._next_group, int(group), -(-max(int(episode), self._next_episode) // self.group_size))
        self._next_group, self._next_episode = g, g * self.group_size

    def restore(self, state: dict) -> None:
        self._rng.setstate(_rng_state_from_json(state["rng"]))
        # Domains may be added or removed between runs; keep counters of those still configured.
        for name, idx in state["next_index"].items():
            if name in self._next_index:
                self._next_index[name] = int(idx)
        self._next_episode = int(state["next_episode"])
        self._next_group = int(state["next_group"])


def _rng_state_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_json(data) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)


class TaskSource(Protocol):
    """What a generator pulls episodes from (in-process sampler, or the coordinator's client)."""

    def take(self, n: int) -> Sequence[EpisodeTicket]:
        """Up to n tickets, without blocking; fewer (or none) when the source has none ready."""

    def done(self, ticket: EpisodeTicket) -> None: ...

    def failed(self, ticket: EpisodeTicket, reason: str, permanent: bool = False) -> None:
        """The episode failed; issued again up to max_attempts, or never if `permanent` (its task
        cannot succeed as posed, e.g. a prompt longer than the context: retrying wastes work)."""

    # Optional: `idle(timeout_s)`, called when the generator has nothing to do, waits for news
    # (a remote source: its coordinator's answer) instead of sleeping the whole timeout.


class LocalTaskSource:
    """A TaskSource over a TaskSampler in the same process; failed episodes are issued again
    (first in line) up to `max_attempts` times, then EpisodeFailed stops the run."""

    def __init__(self, sampler: TaskSampler, max_attempts: int = 3):
        self.sampler = sampler
        self.max_attempts = max_attempts
        self._queue: collections.deque[EpisodeTicket] = collections.deque()
        self.issued = 0
        self.completed = 0
        self.reissued = 0

    def take(self, n: int) -> list[EpisodeTicket]:
        if n <= 0:
            return []
        while len(self._queue) < n:
            self._queue.extend(self.sampler.next_group())
        out = [self._queue.popleft() for _ in range(n)]
        self.issued += len(out)
        return out

    def done(self, ticket: EpisodeTicket) -> None:
        self.completed += 1

    def failed(self, ticket: EpisodeTicket, reason: str, permanent: bool = False) -> None:
        if permanent or ticket.attempt + 1 >= self.max_attempts:
            raise EpisodeFailed(
                f"episode {ticket.episode} ({ticket.domain} task {ticket.task_index}) "
                f"failed {ticket.attempt + 1} times; last: {reason}"
            )
        self.reissued += 1
        self._queue.appendleft(
            EpisodeTicket(ticket.domain, ticket.task_index, ticket.episode, ticket.group, ticket.attempt + 1)
        )


def domain_report(
    issued: Mapping[str, int],
    learner: Mapping[str, Mapping[str, int]] | None,
    completed: Mapping[str, int] | None = None,
) -> dict[str, dict]:
    """Per domain: `issued` episodes (the task sampler's), `completed` (reported done by
    generators), and from the learner's cumulative counts (rl/learner/batch.py GroupBuffer.domain_counts):
    `arrived` (finished episodes it read, first copies), `trained`, `dropped_stale`, `dropped`
    (stale, filtered and abandoned: episodes never trained), the mean turns and tokens of those
    trained and of all that finished (`started_turns_mean`, ...), and each domain's share of
    what was issued and of what was trained."""
    learner, completed = learner or {}, completed or {}
    names = sorted(set(issued) | set(learner))
    total_issued = sum(issued.values()) or 1
    total_trained = sum(int(c.get("trained", 0)) for c in learner.values()) or 1
    out = {}
    for d in names:
        c = learner.get(d, {})
        trained, arrived = int(c.get("trained", 0)), int(c.get("arrived", 0))
        out[d] = {
            "issued": int(issued.get(d, 0)),
            "completed": int(completed.get(d, 0)),
            "arrived": arrived,
            "trained": trained,
            "dropped_stale": int(c.get("dropped_stale", 0)),
            "dropped": sum(int(c.get(f"dropped_{r}", 0)) for r in ("stale", "filtered", "abandoned")),
            "trained_turns_mean": c.get("trained_turns", 0) / trained if trained else None,
            "started_turns_mean": c.get("arrived_turns", 0) / arrived if arrived else None,
            "trained_tokens_mean": c.get("trained_tokens", 0) / trained if trained else None,
            "started_tokens_mean": c.get("arrived_tokens", 0) / arrived if arrived else None,
            "issued_share": issued.get(d, 0) / total_issued,
            "trained_share": trained / total_trained,
        }
    return out


def ticket_row(t: EpisodeTicket) -> tuple:
    """A ticket as plain data (state.json, the coordinator's replies); `ticket_from_row` inverts it."""
    return (t.domain, t.task_index, t.episode, t.group, t.attempt)


def ticket_from_row(row) -> EpisodeTicket:
    d, idx, ep, grp, att = row
    return EpisodeTicket(str(d), int(idx), int(ep), int(grp), int(att))
