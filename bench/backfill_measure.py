"""What bench/backfill_live.py measures from sacct's records and the jobs' own clocks (pure).

    overlap_s(start, end, t0, t1)                       # seconds a job ran inside [t0, t1]
    holes_by_node(records, nodes, t0, t1, need)         # idle and fillable GPU-hours per node
    waits_after_free(spans, gpus_by_node, t0)           # each background job's wait once its GPUs were free
    pending_time(spans, gpus_by_node, t0)               # ... and why it pended: rollout jobs, or Slurm's latency
    startable_now(x, running, pending, gpus_by_node)    # the pending jobs Slurm's backfill would start at x

Jobs are given to the last two as `Stretch`es: times in epoch seconds from the jobs' own clocks
where they have them, sacct's whole seconds where not.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

__all__ = ["Stretch", "overlap_s", "holes_by_node", "waits_after_free", "PendingTime", "pending_time", "startable_now"]


@dataclasses.dataclass(frozen=True)
class Stretch:
    """One job's time on its node, as the wait and block measures read it."""

    name: str
    node: str
    gpus: int
    start: float | None  # None: it never started
    end: float | None  # None: still running
    kind: str  # "background" (another user's job), "own" (the run's fixed jobs) or "rollout"
    limit_s: float = math.inf  # its time limit: Slurm plans a running job to end at start + limit
    priority: int = 0  # the order Slurm takes pending jobs in, first first (here: the job id)


def overlap_s(start, end, t0: float, t1: float) -> float:
    if start is None:
        return 0.0
    s, e = start.timestamp(), (end.timestamp() if end is not None else t1)
    return max(0.0, min(e, t1) - max(s, t0))


def holes_by_node(recs, nodes, t0: float, t1: float, need) -> dict[str, dict[str, float]]:
    """Idle GPU-seconds of each node over [t0, t1], and the part of them a rollout job of `need`
    could have held: a GPU counts only while the node's idle CPUs and free memory hold whole
    jobs of `need` beside it (the live planner's own rule, jobs_fitting). `recs` are the sacct
    records of every job on the nodes in that time, CPU jobs too (they hold memory)."""
    from hpcrl.slurm.backfill.planner import jobs_fitting

    spans = [  # (node, start, end, gpus, cpus, mem_mb) of each running stretch, per node
        (n, max(r.start.timestamp(), t0), min(r.end.timestamp() if r.end else t1, t1), r.gpus, r.cpus, r.mem_mb)
        for r in recs
        if r.start is not None
        for n in r.nodes[:1]  # every job here is single-node
    ]
    cuts = sorted({t0, t1, *(a for _, a, _, *_ in spans), *(b for _, _, b, *_ in spans)})
    out = {}
    for node in nodes:
        idle = fillable = 0.0
        for a, b in itertools.pairwise(cuts):
            if b <= a or a < t0 or b > t1:
                continue
            on = [sp for sp in spans if sp[0] == node.name and sp[1] <= a and sp[2] >= b]
            now = dataclasses.replace(
                node,
                state="MIXED",
                gpus_alloc=sum(sp[3] for sp in on),
                cpus_alloc=sum(sp[4] for sp in on),
                alloc_memory_mb=sum(sp[5] for sp in on),
            )
            idle += now.gpus_idle * (b - a)
            fillable += min(jobs_fitting(now, need) * max(need.gpus_per_node, 1), now.gpus_idle) * (b - a)
        out[node.name] = {"idle_gpu_h": idle / 3600, "fillable_gpu_h": fillable / 3600}
    return out


def waits_after_free(spans: list[Stretch], gpus_by_node: dict[str, int], t0: float) -> dict[str, float]:
    """How long each background job waited after the node it started on had the GPUs it needed
    free, counting every job there but rollout jobs (pure). In the baseline that is Slurm's own
    latency (the next scheduling pass after the end that freed them); in the backfill run, more
    than that means a rollout job held them. Unlike the delay from t0 it does not add up along a
    chain of jobs each waiting for the one before. It does not see a job kept off another node
    (pending_time does)."""

    def used(on, x):
        return sum(g for a, b, g in on if a <= x < b)

    out = {}
    for job in spans:
        if job.kind != "background" or job.start is None:
            continue
        on = [
            (o.start, math.inf if o.end is None else o.end, o.gpus)
            for o in spans
            if o.node == job.node and o.kind != "rollout" and o.name != job.name and o.start is not None
        ]
        free_from = t0
        for point in sorted({x for a, b, _ in on for x in (a, b) if x < job.start}, reverse=True):
            if gpus_by_node[job.node] - used(on, point - 1e-6) < job.gpus:
                free_from = point  # the moment the last of the GPUs it took came free
                break
        out[job.name] = job.start - max(free_from, t0)
    return out


def startable_now(x: float, running, pending, gpus_by_node: dict[str, int]) -> set[str]:
    """The pending jobs Slurm's backfill would start at `x` (pure), reckoned as it plans: running
    jobs end at their time limits, pending ones are taken in priority order and each is booked on
    the node and at the earliest time its GPUs are free for its whole limit, beside the bookings
    of the jobs before it; those booked at `x` start now. A lower job may start before a higher
    one that waits, if it ends before the higher one's booking (Slurm's backfill contract).
    `running`: (node, gpus, planned end); `pending`: (name, gpus, limit_s), in priority order.
    Single-node jobs; where several nodes fit now, the fullest that fits (as best fit packs)."""
    booked = {n: [(x, b, g) for nd, g, b in running if nd == n] for n in gpus_by_node}
    out = set()
    for name, need, limit_s in pending:
        best = None
        for node, total in gpus_by_node.items():
            uses = booked[node]
            for e in sorted({x, *(b for _, b, _ in uses if b > x)}):  # free GPUs only grow at an end
                if all(_free(total, uses, p) >= need for p in {e, *(a for a, _, _ in uses if e < a < e + limit_s)}):
                    best = min(best or (math.inf,), (e, _free(total, uses, e), node))
                    break
        if best is not None:
            e, _, node = best
            booked[node].append((e, e + limit_s, need))
            if e == x:
                out.add(name)
    return out


def _free(total: int, uses, at: float) -> int:
    return total - sum(g for a, b, g in uses if a <= at < b)


@dataclasses.dataclass(frozen=True)
class PendingTime:
    """Seconds each background job pended, by why (`pending_time`)."""

    blocked_by_rollout_s: dict[str, float]  # Slurm would have started it but for the rollout jobs
    # Slurm would have started it with every job there: its own latency (about a backfill pass),
    # or, much longer, a sign that `startable_now` does not plan as this Slurm does
    startable_s: dict[str, float]


def pending_time(spans: list[Stretch], gpus_by_node: dict[str, int], t0: float, step_s: float = 0.05) -> PendingTime:
    """Why each background job was still pending, every `step_s` from t0 (all are released then)
    to its start (pure): blocked by rollout jobs where `startable_now` starts it when they are
    taken away and not with them there; startable where it starts it with them there.

    Holding what a job would take is the one way a rollout job delays a start, and this reads it
    within the backfill run itself, apart from the pass-to-pass timing two runs of Slurm differ
    by. A rollout job sized to end before a higher job's booking, where a lower job could not
    have fit before it anyway, blocks no one. Give rollout jobs conservative times (start early,
    end late) where the clocks are coarse; `limit_s` of a rollout job is what Slurm granted."""
    bg = sorted((j for j in spans if j.kind == "background" and j.start is not None), key=lambda j: j.priority)
    last = max((j.start for j in bg), default=t0)
    blocked = {j.name: 0.0 for j in bg}
    startable = dict(blocked)
    for i in range(math.ceil((last - t0) / step_s)):
        x = t0 + (i + 0.5) * step_s
        pending = [(j.name, j.gpus, j.limit_s) for j in bg if x < j.start]
        if not pending:
            continue
        on = [j for j in spans if j.start is not None and j.start <= x and (j.end is None or x < j.end)]
        plan = [(j.node, j.gpus, max(j.start + j.limit_s, x), j.kind) for j in on]  # Slurm's view at x
        now = startable_now(x, [p[:3] for p in plan], pending, gpus_by_node)
        for name in now:
            startable[name] += step_s
        for name in startable_now(x, [p[:3] for p in plan if p[3] != "rollout"], pending, gpus_by_node) - now:
            blocked[name] += step_s
    return PendingTime(blocked, startable)
