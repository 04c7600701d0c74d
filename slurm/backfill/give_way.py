"""Which of the run's rollout jobs give their GPUs back to another user's pending job (pure).

    give = jobs_to_give_way(snap, records, own_ids, rollout_partition)   # {our job: the job it blocks}
    since, due = overdue(give, since, now_s, after_s)                    # blocking for after_s or more
    every_s = give_way_interval_s(configured_s, scheduler_parameters)   # how often to look

The backfill contract is that a rollout job delays no one's start, including a job whose start
moved earlier because another ended before its limit. The run's planner (book.py `SlurmRollouts`,
for the live run and the simulator alike) cancels what these rules name.
"""

from __future__ import annotations

import datetime as dt
import heapq

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
    pending = [j for j in snap.pending if j.job_id not in own and j.gpus > 0 and j.partition != rollout_partition]
    if not pending:
        return {}
    members = {part.name: part.nodes for part in snap.partitions}
    idle = {n.name: n.gpus_idle for n in snap.nodes}
    ours: dict[str, list[tuple[str, int]]] = {}
    for job in snap.running:
        if job.job_id in running:
            where = job.nodes[0] if len(job.nodes) == 1 else ",".join(job.nodes)
            ours.setdefault(where, []).append((job.job_id, running[job.job_id]["gpus"]))
    return rollout_jobs_to_yield(pending, idle, ours, members, snap.now)


def rollout_jobs_to_yield(
    pending,
    idle_by_node: dict[str, int],
    ours_by_node: dict[str, list[tuple[str, int]]],
    members: dict,
    now: dt.datetime | None = None,
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

    Linear in the pending jobs and the nodes with idle GPUs or ours: only those can start a job
    on ours, the jobs are taken from a heap in priority order, and once no such node is left the
    jobs after it need no look (tests/test_scheduler_backfill.py checks it against the plain
    scan over every node for every job). Jobs without GPUs take none."""
    idle = dict(idle_by_node)
    # ours per node, fewest GPUs first: popped from the end, the largest go first
    ours = {n: sorted(js, key=lambda jg: jg[1]) for n, js in ours_by_node.items() if js and n in idle}
    if not ours:
        return {}
    lend = {n: sum(g for _, g in js) for n, js in ours.items()}
    cands = {n for n, free in idle.items() if free > 0 or n in ours}  # nodes where a job could start on ours
    bound = max(idle[n] + lend.get(n, 0) for n in cands)  # only shrinks: an upper bound throughout
    out: dict[str, str] = {}
    held_from: dict[str, dt.datetime] = {}  # node -> earliest start of a blocked higher job planned there
    positions: dict[str, dict[str, int]] = {}
    heap = [(-job.priority, i) for i, job in enumerate(pending)]
    heapq.heapify(heap)
    while heap and cands:
        job = pending[heapq.heappop(heap)[1]]
        if job.nodes < 1 or job.gpus < 1 or job.reason.startswith(WAITING_ON_OTHERS):
            continue
        per_node = -(-job.gpus // job.nodes)
        ready: list[str] = []
        could: list[str] = []
        if per_node <= bound:
            pos = positions.get(job.partition)
            if pos is None:
                pos = positions[job.partition] = {n: k for k, n in enumerate(members.get(job.partition, ()))}
            end = None
            if now is not None and held_from:
                end = now + dt.timedelta(seconds=job.time_limit_s) if job.time_limit_s is not None else dt.datetime.max
            nodes = sorted(
                (n for n in cands if n in pos and (end is None or not held_from.get(n, dt.datetime.max) < end)),
                key=pos.__getitem__,
            )
            ready = sorted((n for n in nodes if idle[n] >= per_node), key=idle.__getitem__)
            could = sorted((n for n in nodes if idle[n] < per_node <= idle[n] + lend.get(n, 0)), key=lambda n: -idle[n])
        short = max(job.nodes - len(ready), 0)
        if short > len(could):
            # It waits for others' GPUs too: giving ours back would not start it. It holds its plan.
            if job.expected_start is not None:
                for n in job.sched_nodes:
                    if job.expected_start < held_from.get(n, dt.datetime.max):
                        held_from[n] = job.expected_start
            continue
        for n in could[:short]:
            while idle[n] < per_node:
                job_id, gpus = ours[n].pop()
                out[job_id] = job.job_id
                idle[n] += gpus
                lend[n] -= gpus
        for n in ready[: job.nodes - short] + could[:short]:
            idle[n] -= per_node  # it takes these: not for the jobs after it
            if idle[n] <= 0 and not ours.get(n):
                cands.discard(n)
    return out


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
