"""A simulated Slurm controller: one GPU partition, other users' jobs, the main scheduler and backfill.

    ctl = SimSlurm(loop, spec)                        # spec: a trace's `slurm:` section
    ctl.place_run(learner_gpus, generator_gpus)       # the run's fixed jobs, running from the start
    ctl.submit(SimJob(...), now)                      # queued; started by a scheduling pass
    ctl.snapshot()                                    # a QueueSnapshot, as slurm/backfill/live.py reads one

It answers the same questions as the live controller (book.Cluster: snapshot, job_states,
preempt_time, cancel), so `hpcrl sim` runs the live planner's rounds (slurm/backfill/book.py)
against it. What it models of Slurm 22.05's sched/backfill, and what it does not:

* Jobs are single-node; a job asks for GPUs, CPUs and memory, and starts on the fullest node
  that holds them (best fit). The run's learner is one job per node it spans.
* Priority is first come, first served among other users' jobs; a job with --nice (rollout
  jobs) sorts below all of them. The main scheduler runs at every submission and job end: it
  starts pending jobs in priority order and stops at the first that does not fit (the
  partition waits for backfill; its reason is Resources, the rest Priority).
* The backfill pass runs every bf_interval_s: it plans running jobs to end at start + time
  limit (it cannot know they end early), takes pending jobs in priority order, books each at the
  earliest time and node its whole limit fits, and starts the ones that fit now without touching
  a booking. Bookings start at their time aligned down to bf_resolution_s (measured on the dev
  cluster: a job planned for 15:45:08 held its nodes from 15:45:00), so a job started now must
  end by the aligned start. A pending job's expected start (squeue --start) is where it is
  booked; one no pass has looked at yet has none and reason None.
* --time-min: a job is granted exactly its --time-min when it has one (measured on 22.05, idle
  or not).
* Not modelled: multi-node jobs, fairshare and QOS priorities, partitions of several tiers and
  preemption (rollout jobs give way through the planner, not through Slurm), bf_max_job_test and
  the other limits of a pass, the time a pass or a scheduling cycle takes, node failures, and
  KillWait (a cancelled job frees its resources at once).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable

from hpcrl.slurm.backfill.give_way import WAITING_ON_OTHERS
from hpcrl.slurm.backfill.snapshot import QueueSnapshot
from hpcrl.slurm.queries import NodeState, PartitionState, PendingJob, RunningJob
from hpcrl.slurm.sim.profile import Profile

# hpcrl imports inside functions here would load yaml for every importer of this module (start-up speed).

__all__ = ["SimSlurm", "SimJob", "BASE", "at", "PARTITION"]

# Simulated time 0 as the controller's clock shows it: a whole hour, so bf_resolution steps of
# the simulated clock and of the timestamps the planner floors are the same.
BASE_TS = 1_893_456_000  # 2030-01-01T00:00:00Z
BASE = dt.datetime.fromtimestamp(BASE_TS)
PARTITION = "gpu"
NO_LIMIT = math.inf


def at(t: float) -> dt.datetime:
    """Simulated time `t` (seconds) as the controller's local time."""
    return BASE + dt.timedelta(seconds=t)


class SimJob:
    """One job in the simulated queue."""

    __slots__ = (
        "job_id",
        "name",
        "kind",
        "gpus",
        "cpus",
        "mem_mb",
        "limit_s",
        "time_min_s",
        "run_s",
        "priority",
        "order",
        "state",
        "node",
        "submit",
        "start",
        "planned_end",
        "end",
        "expected_start",
        "sched_node",
        "reason",
        "on_start",
        "on_end",
        "_token",
        "_shown",
        "held",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        gpus: int,
        cpus: int,
        mem_mb: int,
        limit_s: float,
        *,
        run_s: float | None = None,
        time_min_s: float | None = None,
        nice: bool = False,
        priority: int | None = None,
        on_start: Callable[[SimJob, float], None] | None = None,
        on_end: Callable[[SimJob, float, str], None] | None = None,
    ):
        self.name, self.kind = name, kind  # kind: "other", "own" (the run's fixed jobs) or "rollout"
        self.gpus, self.cpus, self.mem_mb = gpus, cpus, mem_mb
        self.limit_s, self.time_min_s, self.run_s = limit_s, time_min_s, run_s  # run_s None: until it ends itself
        # higher first; None: first come first served (set at submission); --nice: below everyone
        self.priority = 0 if nice else priority
        self.job_id, self.order, self.state = "", 0, "PENDING"
        self.node: SimNode | None = None
        self.submit = self.start = self.planned_end = self.end = math.nan
        self.expected_start: float | None = None
        self.sched_node: str | None = None
        self.reason = "None"
        self.on_start, self.on_end = on_start, on_end
        self._token = 0
        self._shown = None  # (what it showed as, the PendingJob / RunningJob squeue would print)
        self.held = False  # held or waiting on a dependency: no scheduling pass starts it


class SimNode:
    __slots__ = ("name", "gpus", "cpus", "mem_mb", "gpus_alloc", "cpus_alloc", "mem_alloc", "jobs")

    def __init__(self, name: str, gpus: int, cpus: int, mem_mb: int):
        self.name, self.gpus, self.cpus, self.mem_mb = name, gpus, cpus, mem_mb
        self.gpus_alloc = self.cpus_alloc = self.mem_alloc = 0
        self.jobs: set[SimJob] = set()

    def fits(self, job: SimJob) -> bool:
        return (
            self.gpus - self.gpus_alloc >= job.gpus
            and self.cpus - self.cpus_alloc >= job.cpus
            and self.mem_mb - self.mem_alloc >= job.mem_mb
        )


class SimSlurm:
    """The simulated controller on `loop` (engine.EventLoop); `spec` is a trace's SlurmSpec."""

    def __init__(self, loop, spec, epoch_s: float = BASE_TS, nodes: list[SimNode] | None = None):
        self.loop, self.spec = loop, spec
        self.epoch_s = epoch_s  # the controller's clock (epoch seconds) at simulated time 0
        mem = round(spec.mem_gb_per_node * 1024)
        self.nodes = nodes or [
            SimNode(f"n{i + 1:04d}", spec.gpus_per_node, spec.cpus_per_node, mem) for i in range(spec.nodes)
        ]
        self.jobs: dict[str, SimJob] = {}
        self.pending: list[SimJob] = []  # in priority order
        self.running: set[SimJob] = set()
        self.r = spec.bf_resolution_s
        self._next_id = 1
        self._main_due = False
        self.version = 0  # changes whenever a job is queued, starts or ends (the planner's cheap squeue)
        self.passes = 0
        self.views = 0  # changes whenever anything squeue or scontrol shows changes (passes update reasons, starts)
        self._snap_version = -1
        self._snap: tuple = ()

    @classmethod
    def from_snapshot(cls, snap: QueueSnapshot, ours: frozenset[str] | set[str] = frozenset()) -> SimSlurm:
        """This controller in the state a (live) snapshot shows, simulated time 0 being snap.now:
        its usable nodes, the running jobs releasing what they hold at their planned ends, and the
        pending jobs in priority order without estimates; `backfill_pass(0.0)` then plans them as
        this simulator's Slurm does. `ours`: job ids to show as rollout jobs. Every job is taken as
        one partition's (a pending job of another partition on these nodes competes the same way).
        Multi-node pending jobs are not modelled: NotImplementedError."""
        from hpcrl.slurm.sim.engine import EventLoop
        from hpcrl.slurm.sim.trace import SlurmSpec

        nodes = [SimNode(n.name, n.gpus_total, n.cpus_total, n.real_memory_mb) for n in snap.nodes if n.usable]
        spec = SlurmSpec(
            nodes=max(len(nodes), 1),
            gpus_per_node=max((n.gpus for n in nodes), default=1) or 1,
            bf_interval_s=snap.bf_interval_s,
            bf_resolution_s=snap.bf_resolution_s,
        )
        ctl = cls(EventLoop(), spec, epoch_s=snap.now.timestamp(), nodes=nodes)
        by_name = {n.name: n for n in nodes}
        for r in snap.running:
            n = len(r.nodes)
            end = math.inf if r.end is None else r.end.timestamp() - ctl.epoch_s
            for name in r.nodes:
                node = by_name.get(name)
                if node is None:
                    continue
                job = SimJob(
                    r.name, "rollout" if r.job_id in ours else "other", r.gpus // n, r.cpus // n, r.mem_mb, end
                )
                ctl._register(job, 0.0, r.job_id)
                ctl._start(job, node, 0.0, end)
        for state in snap.nodes:  # what the running list did not account for (a job that just ended, ...)
            node = by_name.get(state.name)
            if node is not None:
                rest = (state.gpus_alloc - node.gpus_alloc, state.cpus_alloc - node.cpus_alloc)
                mem = state.alloc_memory_mb - node.mem_alloc
                if max(*rest, mem) > 0:
                    job = SimJob("unaccounted", "other", max(rest[0], 0), max(rest[1], 0), max(mem, 0), NO_LIMIT)
                    ctl._register(job, 0.0)
                    ctl._start(job, node, 0.0, NO_LIMIT)
        for p in sorted(snap.pending, key=lambda p: (-p.priority, _job_order(p.job_id))):
            if p.nodes != 1:
                raise NotImplementedError(f"pending job {p.job_id} spans {p.nodes} nodes: not modelled")
            limit = math.inf if p.time_limit_s is None else float(p.time_limit_s)
            kind = "rollout" if p.job_id in ours else "other"
            job = SimJob(p.name, kind, p.gpus, p.cpus, p.mem_mb, limit, priority=p.priority)
            job.held = p.reason.startswith(WAITING_ON_OTHERS)
            job.reason = p.reason if job.held else "None"
            ctl._register(job, 0.0, p.job_id)
            ctl.pending.append(job)
        return ctl

    # ---------------------------------------------------------------- jobs
    def place_run(self, learner_gpus: int, generator_gpus: int, learner_shape, generator_shape) -> list[str]:
        """Start the run's fixed jobs at once (they run for the whole simulation): the learner on
        whole nodes first, one job per node it spans, then one 1-GPU job per generator."""
        jobs, left = [], learner_gpus
        while left > 0:
            g = min(left, self.spec.gpus_per_node)
            shape = (g * learner_shape.cpus, round(g * learner_shape.mem_gb * 1024))
            jobs.append(SimJob(f"learner-{len(jobs)}", "own", g, *shape, NO_LIMIT))
            left -= g
        for i in range(generator_gpus):
            shape = (generator_shape.cpus, round(generator_shape.mem_gb * 1024))
            jobs.append(SimJob(f"gen-{i}", "own", 1, *shape, NO_LIMIT))
        for job in jobs:
            self._register(job, self.loop.now)
            node = next((n for n in self.nodes if n.fits(job)), None)
            if node is None:
                raise ValueError(
                    f"slurm: the run's {job.name} ({job.gpus} GPUs, {job.cpus} CPUs, {job.mem_mb} MB) fits no node "
                    "beside the rest of the run; give the partition more or larger nodes"
                )
            self._start(job, node, self.loop.now, NO_LIMIT)
        return [j.job_id for j in jobs]

    def _register(self, job: SimJob, now: float, job_id: str = "") -> None:
        job.job_id, job.order, job.submit = job_id or str(self._next_id), self._next_id, now
        if job.priority is None:
            job.priority = 2**31 - job.order
        self._next_id += 1
        self.jobs[job.job_id] = job
        self.version += 1

    def submit(self, job: SimJob, now: float) -> str:
        self._register(job, now)
        self.pending.append(job)
        self.pending.sort(key=_priority)
        self._schedule_main(now)
        return job.job_id

    def finish(self, job_id: str, now: float, state: str = "COMPLETED") -> None:
        """A running job ended by itself (a rollout job that handed back and exited)."""
        job = self.jobs[job_id]
        if job.state == "RUNNING":
            self._end(job, now, state, notify=False)

    def cancel(self, job_ids, now: float | None = None) -> None:
        now = self.loop.now if now is None else now
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                continue
            if job.state == "PENDING":
                self.pending.remove(job)
                job.state, job.end = "CANCELLED", now
                self.version += 1
            elif job.state == "RUNNING":
                self._end(job, now, "CANCELLED", notify=True)

    def _start(self, job: SimJob, node: SimNode, now: float, limit_s: float) -> None:
        node.gpus_alloc += job.gpus
        node.cpus_alloc += job.cpus
        node.mem_alloc += job.mem_mb
        node.jobs.add(job)
        job.node, job.state, job.start = node, "RUNNING", now
        job.planned_end = now + limit_s
        job.expected_start, job.sched_node, job.reason = None, None, "None"
        job._shown = None
        self.running.add(job)
        self.version += 1
        ends = min(job.run_s if job.run_s is not None else math.inf, limit_s)
        if math.isfinite(ends):
            job._token += 1
            state = "COMPLETED" if job.run_s is not None and job.run_s <= limit_s else "TIMEOUT"
            self.loop.at(now + ends, self._end_event, (job, job._token, state))
        if job.on_start is not None:
            job.on_start(job, now)

    def _end_event(self, arg, now: float) -> None:
        job, token, state = arg
        if job.state == "RUNNING" and token == job._token:
            self._end(job, now, state, notify=True)

    def _end(self, job: SimJob, now: float, state: str, notify: bool) -> None:
        node = job.node
        node.gpus_alloc -= job.gpus
        node.cpus_alloc -= job.cpus
        node.mem_alloc -= job.mem_mb
        node.jobs.discard(job)
        self.running.discard(job)
        job.state, job.end = state, now
        job._token += 1
        self.version += 1
        self._schedule_main(now)
        if notify and job.on_end is not None:
            job.on_end(job, now, state)

    # ---------------------------------------------------------------- scheduling
    def start_passes(self, first_s: float) -> None:
        """Backfill passes every bf_interval_s from `first_s` on."""
        self.loop.at(first_s, self._backfill_event)

    def _schedule_main(self, now: float) -> None:
        if not self._main_due and self.pending:
            self._main_due = True
            self.loop.at(now, self._main_event)

    def _main_event(self, _: object, now: float) -> None:
        """Slurm's main scheduler: priority order, stopping at the first job that does not fit."""
        self._main_due = False
        blocked = False
        for job in list(self.pending):
            if job.held:
                continue
            if blocked:
                job.reason = "Priority"
                continue
            node = self._best_fit(job)
            if node is None:
                job.reason, blocked = "Resources", True
                continue
            self.pending.remove(job)
            self._start(job, node, now, job.time_min_s or job.limit_s)
        self.views += 1

    def _best_fit(self, job: SimJob) -> SimNode | None:
        best = None
        for n in self.nodes:
            if n.fits(job) and (best is None or n.gpus - n.gpus_alloc < best.gpus - best.gpus_alloc):
                best = n
        return best

    def _backfill_event(self, _: object, now: float) -> None:
        self.backfill_pass(now)
        self.loop.at(now + self.spec.bf_interval_s, self._backfill_event)

    def backfill_pass(self, now: float) -> None:
        """Book every pending job at its earliest start; start those that fit now (module doc)."""
        self.passes += 1
        r = self.r
        # Per node, free GPUs/CPUs/memory over time: from the running jobs' planned ends (they
        # come back then; a pass cannot know a job ends early) and this pass's bookings.
        profiles = {n.name: Profile(n, now) for n in self.nodes}
        first_blocked = True
        for job in list(self.pending):
            if job.held:
                continue
            length = job.time_min_s or job.limit_s
            need = (job.gpus, job.cpus, job.mem_mb)
            best = None  # (start, free GPUs now, node)
            for n in self.nodes:
                if n.gpus < job.gpus or n.cpus < job.cpus or n.mem_mb < job.mem_mb:
                    continue
                t = profiles[n.name].earliest(need, length)
                if t is not None and (best is None or (t, n.gpus - n.gpus_alloc) < best[:2]):
                    best = (t, n.gpus - n.gpus_alloc, n)
                    if t <= now and best[1] == job.gpus:
                        break  # starts now and fills the node exactly: no node fits better
            if best is None:
                job.reason = "Resources"  # it fits no node of the partition at all
                continue
            t, _, node = best
            if t <= now and node.fits(job):
                self.pending.remove(job)
                self._start(job, node, now, length)
                profiles[node.name].book(now, now + length, need)
                continue
            start = t - (t + self.epoch_s) % r if r > 0 else t  # bookings are aligned down to bf_resolution
            profiles[node.name].book(max(start, now), start + length, need)
            job.expected_start, job.sched_node = t, node.name
            job.reason = "Resources" if first_blocked else "Priority"
            first_blocked = False
        self.views += 1

    # ---------------------------------------------------------------- what the planner asks
    def snapshot(self) -> QueueSnapshot:
        """The queue now, as slurm/backfill/live.py reads it from a live controller."""
        if self._snap_version != (self.version, self.views):  # what squeue and scontrol would print changed
            self._snap_version = (self.version, self.views)
            self._snap = (
                tuple(_node_state(n) for n in self.nodes),
                (_partition(self.nodes),),
                self._pending(),
                self._running(),
            )
        nodes, parts, pending, running = self._snap
        return QueueSnapshot(self.at(self.loop.now), nodes, parts, pending, running, self.r, self.spec.bf_interval_s)

    def at(self, t: float) -> dt.datetime:
        """Simulated time `t` as the controller's local time."""
        return dt.datetime.fromtimestamp(self.epoch_s + t) if self.epoch_s != BASE_TS else at(t)

    def _pending(self) -> tuple[PendingJob, ...]:
        out = []
        for j in self.pending:
            key = (j.expected_start, j.reason, j.sched_node)
            if j._shown is None or j._shown[0] != key:
                j._shown = (key, _pending_job(j, self.at))
            out.append(j._shown[1])
        return tuple(sorted(out, key=lambda p: (p.expected_start or dt.datetime.max, p.job_id)))

    def _running(self) -> tuple[RunningJob, ...]:
        out = []
        for j in sorted(self.running, key=lambda j: j.order):
            if j._shown is None:
                end = None if math.isinf(j.planned_end) else self.at(j.planned_end)
                shown = RunningJob(j.job_id, PARTITION, j.name, (j.node.name,), j.gpus, end, j.cpus, j.mem_mb)
                j._shown = (None, shown)
            out.append(j._shown[1])
        return tuple(out)

    def job_states(self, job_ids) -> dict[str, str]:
        """{job id: state} of those still in the queue (pending or running)."""
        out = {}
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is not None and job.state in ("PENDING", "RUNNING"):
                out[job_id] = job.state
        return out

    def preempt_time(self, job_id: str) -> str | None:
        return None  # Slurm's preemption is not modelled: rollout jobs give way through the planner

    def signature(self, partitions=()) -> int:
        return self.version


def _node_state(n: SimNode) -> NodeState:
    state = "IDLE" if not n.jobs else ("ALLOCATED" if n.gpus_alloc >= n.gpus else "MIXED")
    return NodeState(n.name, state, (PARTITION,), n.cpus, n.cpus_alloc, n.gpus, n.gpus_alloc, n.mem_mb, n.mem_alloc)


def _pending_job(j: SimJob, at) -> PendingJob:
    return PendingJob(
        j.job_id,
        PARTITION,
        "other" if j.kind == "other" else "me",
        j.name,
        1,
        j.cpus,
        j.gpus,
        None if math.isinf(j.limit_s) else int(j.limit_s),
        None if j.expected_start is None else at(j.expected_start),
        j.reason,
        j.priority,
        () if j.sched_node is None else (j.sched_node,),
        j.mem_mb,
    )


def _partition(nodes: list[SimNode]) -> PartitionState:
    gpus, gpus_alloc = sum(n.gpus for n in nodes), sum(n.gpus_alloc for n in nodes)
    cpus, cpus_alloc = sum(n.cpus for n in nodes), sum(n.cpus_alloc for n in nodes)
    names = tuple(n.name for n in nodes)
    return PartitionState(
        PARTITION, True, names, None, cpus, cpus_alloc, cpus - cpus_alloc, gpus, gpus_alloc, gpus - gpus_alloc
    )


def _job_order(job_id: str) -> tuple[int, str]:
    head = job_id.split("_", 1)[0]
    return (int(head), job_id) if head.isdigit() else (2**62, job_id)


def _priority(job: SimJob) -> tuple[int, int]:
    return (-job.priority, job.order)
