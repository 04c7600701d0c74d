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

from hpcrl.slurm.backfill.snapshot import QueueSnapshot, backfill_parameters

__all__ = ["jobs_to_give_way", "rollout_jobs_to_yield", "overdue", "give_way_interval_s"]

_WAITING_ON_OTHERS = ("JobHeld", "Dependency", "BeginTime", "Reservation", "PartitionDown", "PartitionInactive")


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
    a rollout job holds little of either."""
    idle = dict(idle_by_node)
    ours = {n: list(js) for n, js in ours_by_node.items()}
    out: dict[str, str] = {}
    held: list[tuple[dt.datetime, frozenset[str]]] = []  # (from when, nodes) of blocked higher ones
    for _, job in sorted(enumerate(pending), key=lambda ij: (-ij[1].priority, ij[0])):
        if job.nodes < 1 or job.reason.startswith(_WAITING_ON_OTHERS):
            continue
        per_node = -(-job.gpus // job.nodes)
        nodes = [n for n in members.get(job.partition, ()) if n in idle and not _held_for(job, n, held, now)]
        ready = sorted((n for n in nodes if idle[n] >= per_node), key=lambda n: idle[n])
        lendable = lambda n: idle[n] + sum(g for _, g in ours.get(n, []))
        could = sorted((n for n in nodes if idle[n] < per_node <= lendable(n)), key=lambda n: -idle[n])
        short = max(job.nodes - len(ready), 0)
        if short > len(could):
            # It waits for others' GPUs too: giving ours back would not start it. It holds its plan.
            if job.expected_start is not None and job.sched_nodes:
                held.append((job.expected_start, frozenset(job.sched_nodes)))
            continue
        for n in could[:short]:
            ours[n].sort(key=lambda jg: jg[1])
            while idle[n] < per_node:
                job_id, gpus = ours[n].pop()
                out[job_id] = job.job_id
                idle[n] += gpus
        for n in ready[: job.nodes - short] + could[:short]:
            idle[n] -= per_node  # it takes these: not for the jobs after it
    return out


def _held_for(job, node: str, held: list[tuple[dt.datetime, frozenset[str]]], now: dt.datetime | None) -> bool:
    """Whether a higher-priority job's plan keeps `job` off `node`: it holds the node from a time
    before `job`, started now, would end (a job without a time limit never ends in time)."""
    if now is None:
        return False
    end = now + dt.timedelta(seconds=job.time_limit_s) if job.time_limit_s is not None else dt.datetime.max
    return any(node in nodes and start < end for start, nodes in held)


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
