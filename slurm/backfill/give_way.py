"""Which of the run's rollout jobs give their GPUs back to another user's pending job (pure).

    give = jobs_to_give_way(snap, records, own_ids, rollout_partition)   # {our job: the job it blocks}
    since, due = overdue(give, since, now_s, after_s)                    # blocking for after_s or more
    every_s = give_way_interval_s(configured_s, scheduler_parameters)   # how often to look

The backfill contract is that a rollout job delays no one's start, including a job whose start
moved earlier because another ended before its limit. The run's planner (book.py `SlurmRollouts`,
for the live run and the simulator alike) cancels what these rules name.
"""

from __future__ import annotations

import bisect
import datetime as dt
import functools
import heapq
import itertools

from hpcrl.slurm.backfill.snapshot import QueueSnapshot, backfill_parameters

__all__ = ["jobs_to_give_way", "rollout_jobs_to_yield", "overdue", "give_way_interval_s", "WAITING_ON_OTHERS"]

# Reasons of a pending job that no scheduling pass would start now, whatever is free.
WAITING_ON_OTHERS = ("JobHeld", "Dependency", "BeginTime", "Reservation", "PartitionDown", "PartitionInactive")


def jobs_to_give_way(snap: QueueSnapshot, records: dict, own_ids, rollout_partition: str = "") -> dict[str, str]:
    """{our running rollout job: the pending job it keeps from starting} on `snap` (pure).

    `records`: the run's rollout jobs (book.py records, by name); `own_ids`: the run's other
    jobs. Pending jobs of the run itself, jobs without GPUs and jobs of the rollout partition
    (Slurm plans those below ours) are no one to give way to."""
    running = {r["job_id"]: r for r in records.values() if r["state"] == "active" and not r.get("pending")}
    if not running:
        return {}
    own = set(own_ids) | {r["job_id"] for r in records.values()}
    # highest priority first, looked at only as far as one could still start on ours
    pending = (
        j for j in snap.index.by_priority if j.job_id not in own and j.gpus > 0 and j.partition != rollout_partition
    )
    members = {part.name: part.nodes for part in snap.partitions}
    idle = {n.name: n.gpus_idle for n in snap.nodes}
    ours: dict[str, list[tuple[str, int]]] = {}
    for job in snap.running:
        if job.job_id in running:
            where = job.nodes[0] if len(job.nodes) == 1 else ",".join(job.nodes)
            ours.setdefault(where, []).append((job.job_id, running[job.job_id]["gpus"]))
    return rollout_jobs_to_yield(pending, idle, ours, members, snap.now, by_priority=True)


def rollout_jobs_to_yield(
    pending,
    idle_by_node: dict[str, int],
    ours_by_node: dict[str, list[tuple[str, int]]],
    members: dict,
    now: dt.datetime | None = None,
    by_priority: bool = False,
) -> dict[str, str]:
    """{our rollout job id: the pending job it must give way to} (pure).

    `pending`: other users' pending GPU jobs; `idle_by_node`: idle GPUs per node; `ours_by_node`:
    our running rollout jobs per node, (job id, GPUs); `members`: partition -> its nodes; `now`:
    the time the expected starts are read against (Slurm's local time). Jobs are taken in
    priority order, as Slurm's scheduler takes them. A pending job of N nodes with G GPUs each
    that held or dependent jobs aside finds fewer than N nodes with G idle GPUs, but enough once
    our rollout jobs' GPUs count as idle, gets those: ours are given back on as few nodes as it
    needs. GPUs a pending job could take (with or without ours) are not counted again for the
    jobs after it. A higher-priority job that cannot start now even with ours holds the nodes
    Slurm planned it on (`sched_nodes`) from its expected start: a lower one that would still run
    then may not start there (Slurm's backfill does not delay it; squeue says reason Priority),
    so ours are not given back for it on those nodes. Without a plan (no nodes or no start
    known) nothing is held, and ours are given back as before. CPUs and memory are not weighed:
    a rollout job holds little of either.

    Linear in the pending jobs: only nodes with idle GPUs or ours can start a job on ours (a
    one-node job finds its best fit in buckets by idle GPUs), the jobs are taken from a heap in
    priority order (or as given, `by_priority`: an iterable already in that order, ties in the
    snapshot's), a job of a shape (partition, nodes, GPUs, limit) that found no room is not
    looked for again, and once no such node is left the jobs after it need no look
    (tests/test_scheduler_backfill.py checks it against the plain scan over every node for every
    job). Jobs without GPUs take none."""
    free = _Nodes(idle_by_node, ours_by_node)
    if not free.ours:
        return {}
    bound = max(free.idle[n] + free.lend.get(n, 0) for n in free.cands)  # only shrinks: an upper bound throughout
    out: dict[str, str] = {}
    held_from: dict[str, dt.datetime] = {}  # node -> earliest start of a blocked higher job planned there
    positions: dict[str, dict[str, int]] = {}
    in_order: dict[str, bool] = {}  # partition -> its nodes are listed in the nodes' order
    failed: set[tuple] = set()  # job shapes that found no room
    for job in pending if by_priority else _by_priority(pending):
        if not free.cands:
            break  # no node is left where a job could start on ours
        if job.nodes < 1 or job.gpus < 1 or job.reason.startswith(WAITING_ON_OTHERS):
            continue
        per_node = -(-job.gpus // job.nodes)
        ready: list[str] = []
        could: list[str] = []
        shape = (job.partition, job.nodes, per_node, job.time_limit_s)
        if per_node <= bound and shape not in failed:
            pos = positions.get(job.partition)
            if pos is None:
                pos = positions[job.partition] = {n: k for k, n in enumerate(members.get(job.partition, ()))}
                in_order[job.partition] = free.in_order(members.get(job.partition, ()))
            end = None
            if now is not None and held_from:
                end = now + dt.timedelta(seconds=job.time_limit_s) if job.time_limit_s is not None else dt.datetime.max

            usable = functools.partial(_usable, pos, held_from, end)
            if job.nodes == 1 and in_order[job.partition]:
                ready, could = free.single(per_node, usable, pos)
            else:
                ready, could = free.scan(per_node, usable, pos)
        short = max(job.nodes - len(ready), 0)
        if short > len(could):
            # Idle GPUs and ours only ever shrink, and holds only grow: a job of this shape will not
            # find room later in this decision either.
            failed.add(shape)
            # It waits for others' GPUs too: giving ours back would not start it. It holds its plan.
            if job.expected_start is not None:
                for n in job.sched_nodes:
                    if job.expected_start < held_from.get(n, dt.datetime.max):
                        held_from[n] = job.expected_start
            continue
        for n in could[:short]:
            out.update((job_id, job.job_id) for job_id in free.lend_to(n, per_node))
        for n in ready[: job.nodes - short] + could[:short]:
            free.take(n, per_node)  # it takes these: not for the jobs after it
    return out


def _usable(pos: dict, held_from: dict, end: dt.datetime | None, n: str) -> bool:
    """The node is the job's partition's, and no blocked higher job's plan holds it before the
    job, started now, would end."""
    return n in pos and (end is None or not held_from.get(n, dt.datetime.max) < end)


class _Nodes:
    """Idle GPUs and our rollout jobs per node, for `rollout_jobs_to_yield`. `cands`: the nodes
    where a job could still start on ours (idle GPUs, or ours there), bucketed by idle GPUs in the
    nodes' order, so that a one-node job finds its best fit without looking at every node."""

    def __init__(self, idle_by_node: dict[str, int], ours_by_node: dict[str, list[tuple[str, int]]]):
        self.idle = dict(idle_by_node)
        self.order = {n: k for k, n in enumerate(self.idle)}
        # ours per node, fewest GPUs first: popped from the end, the largest go first
        self.ours = {n: sorted(js, key=lambda jg: jg[1]) for n, js in ours_by_node.items() if js and n in self.idle}
        self.lend = {n: sum(g for _, g in js) for n, js in self.ours.items()}
        self.cands = {n for n, f in self.idle.items() if f > 0 or n in self.ours}
        self.buckets: dict[int, list[tuple[int, str]]] = {}
        for n in sorted(self.cands, key=self.order.__getitem__):
            self.buckets.setdefault(self.idle[n], []).append((self.order[n], n))

    def in_order(self, members) -> bool:
        ks = [self.order[n] for n in members if n in self.order]
        return all(a < b for a, b in itertools.pairwise(ks))

    def single(self, per_node: int, usable, pos) -> tuple[list[str], list[str]]:
        """(the best fit with per_node idle GPUs, else the node where ours make room) for a one-node job."""
        for v in sorted(k for k, b in self.buckets.items() if b and k >= per_node):
            n = next((n for _, n in self.buckets[v] if usable(n)), None)
            if n is not None:
                return [n], []
        could = [
            n
            for n in self.ours
            if n in self.cands and usable(n) and self.idle[n] < per_node <= self.idle[n] + self.lend[n]
        ]
        could.sort(key=lambda n: (-self.idle[n], pos[n]))
        return [], could[:1]

    def scan(self, per_node: int, usable, pos) -> tuple[list[str], list[str]]:
        nodes = sorted((n for n in self.cands if usable(n)), key=pos.__getitem__)
        ready = sorted((n for n in nodes if self.idle[n] >= per_node), key=self.idle.__getitem__)
        could = [n for n in nodes if self.idle[n] < per_node <= self.idle[n] + self.lend.get(n, 0)]
        return ready, sorted(could, key=lambda n: -self.idle[n])

    def _set(self, n: str, value: int) -> None:
        if n in self.cands:
            self.buckets[self.idle[n]].remove((self.order[n], n))
        self.idle[n] = value
        if value > 0 or self.ours.get(n):
            self.cands.add(n)
            bisect.insort(self.buckets.setdefault(value, []), (self.order[n], n))
        else:
            self.cands.discard(n)

    def lend_to(self, n: str, per_node: int) -> list[str]:
        """Give back ours on `n`, largest first, until per_node GPUs are idle there; their ids."""
        gone = []
        while self.idle[n] < per_node:
            job_id, gpus = self.ours[n].pop()
            gone.append(job_id)
            self.lend[n] -= gpus
            self._set(n, self.idle[n] + gpus)
        return gone

    def take(self, n: str, gpus: int) -> None:
        self._set(n, self.idle[n] - gpus)


def _by_priority(pending):
    heap = [(-job.priority, i) for i, job in enumerate(pending)]
    heapq.heapify(heap)
    while heap:
        yield pending[heapq.heappop(heap)[1]]


def overdue(blocking: dict[str, str], since: dict[str, float], now: float, after_s: float) -> tuple[dict, dict]:
    """(since when each rollout job of `blocking` has blocked a pending job, those that have for
    `after_s` or more) (pure). One that stopped blocking is forgotten: blocking again starts anew."""
    since = {j: since.get(j, now) for j in blocking}
    return since, {j: other for j, other in blocking.items() if now - since[j] >= after_s}


def give_way_interval_s(configured_s: float, scheduler_parameters: dict[str, str]) -> float:
    """How often the supervisor watches for a job that our rollout jobs keep from starting (pure):
    `configured_s`, or a quarter of Slurm's bf_interval (30 s when unset), at least 0.25 s. A job
    that ends early pulls a pending job's start into our GPUs; Slurm's next backfill pass would
    start it there, so giving way well within one pass keeps its start where it would have been
    without us. One squeue per look: on a production cluster (bf_interval 30 s) every 7.5 s."""
    if configured_s > 0:
        return configured_s
    return max(backfill_parameters(scheduler_parameters)[1] / 4, 0.25)
