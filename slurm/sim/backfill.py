"""`backfill`: the live run in the simulator, deciding with the live code.

What a run with `scheduler.policy: backfill` does, on a simulated clock:

* **Flow control** as the coordinator's (rl/coordinator/coordinator.py): new episodes only while fewer than
  max(1, max_staleness) x batch_size are outstanding beyond what the learner consumed; episodes
  handed back by a rollout job are issued again first. Stale episodes are dropped as in async.
* **Lending inside a generator** (`training.lend_episodes`, the run's generators.lend_episodes):
  a generator takes more episodes while some wait on sandboxes, by slurm/backfill/lending.py's
  `episodes_to_take`, the rule rl/rollout/generator.py runs.
* **Rollout jobs in Slurm's backfill windows** (with a `slurm:` section and scheduler.max_rollout_jobs
  and max_rollout_gpus > 0): the run's planner rounds (slurm/backfill/book.py `SlurmRollouts`: the
  window, job sizing, --time/--time-min, withdrawal, give-way) run against the simulated controller
  (slurm.py) on the supervisor's clock: every SUPERVISOR_POLL_S, with a look for give-way every
  give_way_interval_s in between, sizes planned with scheduler.prior_s as the episode time as the
  live planner does. A rollout job Slurm starts is one more generator: after its start-up it
  leases episodes only while `may_lease` (its own fit_quantile of episode durations, prior_s until
  it has min_samples) and ends by `must_end`; when it ends, is withdrawn or gives way, its
  unfinished episodes are handed back and run again from the start elsewhere (their GPU time so
  far is `lost`). A rollout job's GPU counts in the run's capacity while Slurm has it running.

Without a `slurm:` section (or with the caps at 0) no rollout job runs: backfill is async with
the coordinator's flow control and lending. The learner never lends its GPUs (the live learner
does not).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from hpcrl.slurm.backfill.book import SlurmRollouts, active, rollout_job_counts
from hpcrl.slurm.backfill.estimates import DurationEstimator
from hpcrl.slurm.backfill.give_way import give_way_interval_s
from hpcrl.slurm.backfill.lending import episodes_to_take, may_lease, must_end, room_for_another_generator
from hpcrl.slurm.backfill.planner import PlanSettings, RolloutJobSize, withdraw_after_s
from hpcrl.slurm.sbatch import Resources
from hpcrl.slurm.sim.engine import OPEN, Episode, EventLoop, SimInvariantError
from hpcrl.slurm.sim.policies import AsyncPolicy
from hpcrl.slurm.sim.slurm import BASE_TS, PARTITION, SimJob, SimSlurm
from hpcrl.slurm.sim.trace import Trace, World
from hpcrl.slurm.sim.workload import Workload

__all__ = ["BackfillPolicy", "SUPERVISOR_POLL_S", "coordinator_max_ahead"]

# The Slurm supervisor ticks the planner every poll (jobs/supervise.py SupervisorComponent.poll_s).
SUPERVISOR_POLL_S = 2.0
STUCK_S = 48 * 3600.0  # a run without a training step this long is a simulator bug


def coordinator_max_ahead(max_staleness: int, batch: int) -> int:
    """The coordinator's flow control at coordinator.max_groups_ahead null (rl/coordinator/coordinator.py)."""
    return max(1, max_staleness) * batch


@dataclass
class _RolloutGen:
    """A rollout job Slurm started: one generator on its GPU until it ends."""

    job_id: str
    name: str
    deadline: float  # its EndTime: start + the limit Slurm granted
    est: DurationEstimator
    q: float
    ready: bool = False  # start-up done
    leasing: bool = True  # once it stops, it stays stopped (jobs/rollout.py WindowedSource)
    taken: dict[int, float] = field(default_factory=dict)  # episode -> when leased

    def episode_s(self) -> float:
        return self.est.quantile("episode", self.q)


class BackfillPolicy(AsyncPolicy):
    """The live run (see the module doc)."""

    name = "backfill"

    def __init__(self, trace: Trace, world: World | None = None, keep_intervals: bool = False):
        super().__init__(trace, world, keep_intervals)
        t, s = trace.training, trace.scheduler
        self.lend = t.lend_episodes
        self.admit_limit = coordinator_max_ahead(t.max_staleness, t.batch_size)
        self.reissue: deque[Episode] = deque()  # handed back by a rollout job: issued again first
        self.waiting = {g: 0 for g in self.generator_gpus}  # own episodes in a sandbox step
        self.gens: dict[int, _RolloutGen] = {}  # GPU -> the rollout job generating on it now
        self.by_job: dict[str, int] = {}
        self.record: dict[str, dict] = {}  # the planner's record of its rollout jobs (slurm/backfill/book.py)
        self.leased = self.handed_back = 0  # episodes rollout jobs leased, and handed back unfinished
        self._finishing = False
        self.slurm: SimSlurm | None = None
        self.rounds: SlurmRollouts | None = None
        spec = trace.slurm
        if spec is None or s.max_rollout_jobs < 1 or s.max_rollout_gpus < 1:
            return
        self.slurm = SimSlurm(self.loop, spec)
        gen = spec.generator
        self.need = Resources(
            partition=PARTITION, gpus_per_node=1, cpus_per_task=gen.cpus, mem_mb=max(1, round(gen.mem_gb * 1024))
        )
        settings = PlanSettings(PARTITION, 1, spec.rollout_time_min, s, self.need)
        params = {"bf_interval": str(spec.bf_interval_s), "bf_resolution": str(spec.bf_resolution_s)}
        self.own_ids: list[str] = []
        self.rounds = SlurmRollouts(
            self.slurm,
            settings,
            lambda: self.own_ids,
            withdraw_after_s=withdraw_after_s(s.rollout_withdraw_s, spec.bf_interval_s),
        )
        self.watch_s = give_way_interval_s(s.give_way_interval_s, params)
        self.startup_s = s.job_overhead_s if spec.startup_s is None else spec.startup_s
        self._next_plan = 0.0
        self._seen = None
        self._steps_seen = (0, 0.0)  # (steps done, when the last one was seen)
        self._names = 0

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        if self.slurm is not None:
            spec = self.trace.slurm
            self.loop.now = -spec.warmup_s  # other users' jobs run before the run starts
            c = self.trace.cluster
            self.own_ids = self.slurm.place_run(c.learner_gpus, c.generator_gpus, spec.learner, spec.generator)
            if spec.others is not None:
                Workload(self.slurm, spec.others, self.trace.seed).start(self.loop.now)
            self.slurm.start_passes(self.loop.now)
            self.loop.at(0.0, self._poll)
        super().start()

    def generators(self) -> list[int]:
        return list(self.generator_gpus) + [g for g, r in self.gens.items() if r.ready]

    # ---------------------------------------------------------------- the planner, on the supervisor's clock
    def _poll(self, _: object, now: float) -> None:
        if self.end_time is not None or self._finishing:
            return
        if self.steps_done > self._steps_seen[0]:
            self._steps_seen = (self.steps_done, now)
        elif now - self._steps_seen[1] > STUCK_S:  # other users' jobs keep the clock going: no "out of events"
            raise SimInvariantError(f"no training step for {STUCK_S / 3600:.0f} simulated hours: the run is stuck")
        self.tick(now)
        self.loop.at(now + SUPERVISOR_POLL_S, self._poll)
        k = 1
        while k * self.watch_s < SUPERVISOR_POLL_S - 1e-9:  # looks for give-way between polls
            self.loop.at(now + k * self.watch_s, self._watch)
            k += 1

    def tick(self, now: float) -> None:
        """jobs/rollout_plan.py RolloutPlanner.tick: reap, and every plan_interval_s plan if the
        caps and the coordinator leave room."""
        s = self.trace.scheduler
        wall = BASE_TS + now
        self.rounds.reap(self.record, wall)
        if now < self._next_plan:
            return
        self._next_plan = now + s.plan_interval_s
        act = active(self.record).values()
        jobs_free = s.max_rollout_jobs - len(act)
        gpus_free = s.max_rollout_gpus - sum(j["gpus"] for j in act)
        if jobs_free > 0 and gpus_free >= 1:
            if room_for_another_generator(len(self.reissue), self.open_episodes(), self.admit_limit):
                self.rounds.plan(self.record, wall, jobs_free, gpus_free, s.prior_s, self._submit)

    def _watch(self, _: object, now: float) -> None:
        """RolloutPlanner.watch: a full look only once a job of the partition started or ended."""
        if self.end_time is not None or self._finishing:
            return
        if not any(not j.get("pending") for j in active(self.record).values()):
            return
        seen = self.slurm.signature()
        if seen != self._seen:
            self.tick(now)
            self._seen = seen

    def _submit(self, size: RolloutJobSize) -> tuple[str, str]:
        name = f"rollout-{self._names}"
        self._names += 1
        s = self.trace.scheduler
        job = SimJob(
            name,
            "rollout",
            size.gpus_per_job,
            self.need.cpus_per_task,
            self.need.mem_mb,
            size.time_limit_min * 60.0,
            time_min_s=size.time_min_min * 60.0,
            nice=s.rollout_nice > 0,
            on_start=self._job_started,
            on_end=self._job_killed,
        )
        return name, self.slurm.submit(job, self.loop.now)

    # ---------------------------------------------------------------- rollout jobs as generators
    def _job_started(self, job: SimJob, now: float) -> None:
        g = self.ledger.add("rollout", now)
        self._run.append(None)
        self._token.append(0)
        self.own[g], self.ready[g], self.fresh[g] = set(), deque(), deque()
        self.reloading[g], self.reload_due[g], self.waiting[g] = True, False, 0  # start-up: loading the model
        s = self.trace.scheduler
        est = DurationEstimator(s.history, s.min_samples, s.prior_s)
        self.gens[g] = _RolloutGen(job.job_id, job.name, job.planned_end, est, s.fit_quantile)
        self.by_job[job.job_id] = g
        self.loop.at(now + self.startup_s, self._started_up, g)
        self.loop.at(max(job.planned_end - s.rollout_drain_s, now), lambda gg, t: self._check_end(gg, t), g)

    def _started_up(self, g: int, now: float) -> None:
        r = self.gens.get(g)
        if r is None:
            return
        r.ready = True
        self.reloading[g] = False
        self.top_up(g, now)

    def _job_killed(self, job: SimJob, now: float, state: str) -> None:
        """Slurm ended it (scancel: withdrawn or given way; its time limit): it hands back."""
        g = self.by_job.get(job.job_id)
        if g is not None and g in self.gens and not self._finishing:
            self._end_rollout(g, now, by_slurm=True)

    def _check_end(self, g: int, now: float) -> None:
        r = self.gens.get(g)
        if r is None or not r.ready:
            return
        drain = self.trace.scheduler.rollout_drain_s
        left = r.deadline - now
        if r.leasing and not may_lease(left, r.episode_s(), drain):
            r.leasing = False  # the live source checks at every take(), with or without room
        if must_end(left, drain, r.leasing, len(self.own[g])):
            self._end_rollout(g, now, by_slurm=False)

    def _end_rollout(self, g: int, now: float, by_slurm: bool) -> None:
        r = self.gens.pop(g)
        run = self._run[g]
        if run is not None:  # the turn it was generating stops here
            ep, start = run
            self._run[g] = None
            self._token[g] += 1
            span = self.ledger.end(g, now)
            if span >= 0:
                ep.spans.append(span)
            self.tally["rollout"][0] += now - start
            ep.gpu_s += now - start
        for ep in sorted(self.own[g], key=lambda e: e.index):
            self._hand_back(g, ep)
        self.own[g].clear()
        self.ready[g].clear()
        self.fresh[g].clear()
        self.reloading[g] = False
        self.ledger.release(g, now)
        if not by_slurm:
            self.slurm.finish(r.job_id, now)
        for h in self.generators():  # the handed-back episodes are issued again at once
            self.top_up(h, now)

    def _hand_back(self, g: int, ep: Episode) -> None:
        """Its generation so far is thrown away (lost); it starts again from its first turn."""
        lost = ep.gpu_s
        self.ledger.move(g, lost, ep.spans)
        self.tally["rollout"][0] -= lost
        self.tally["rollout"][2] += lost
        ep.gpu_s, ep.spans, ep.turn, ep.gen_left = 0.0, [], 0, ep.spec.gen_s[0]
        ep.epoch += 1
        ep.owner = -1
        ep.sbx_start = math.nan
        self.reissue.append(ep)
        self.handed_back += 1

    # ---------------------------------------------------------------- generators
    def acquire(self, g: int, now: float) -> Episode | None:
        r = self.gens.get(g)
        if r is not None:
            left = r.deadline - now
            if not r.leasing or not may_lease(left, r.episode_s(), self.trace.scheduler.rollout_drain_s):
                r.leasing = False
                return None
        if self.reissue:
            ep = self.reissue.popleft()
            ep.version = self.published  # generated afresh with the weights it gets now
        else:
            ep = super().acquire(g, now)
            if ep is None:
                return None
        if r is not None:
            r.taken[ep.index] = now
            self.leased += 1
        return ep

    def refill(self, g: int, now: float) -> None:
        if g >= self.L + self.G and g not in self.gens:
            return  # a rollout job that has ended takes nothing (an episode of it may settle after)
        want = episodes_to_take(self.k, len(self.own[g]), self.waiting[g], self.lend)
        for _ in range(want):
            ep = self.acquire(g, now)
            if ep is None:
                return
            ep.owner = g
            self.own[g].add(ep)
            self.fresh[g].append(ep)

    def gen_try(self, g: int, now: float) -> None:
        if g >= self.L + self.G and g not in self.gens:
            return  # a rollout job that has ended
        super().gen_try(g, now)
        if g in self.gens:
            self._check_end(g, now)

    def gen_done(self, g: int, ep: Episode, now: float) -> None:
        self.turn_generated(ep, now)
        if self.lend:
            self.refill(g, now)  # its row waits on the sandbox: lend it
        self.gen_try(g, now)

    def send_to_sandbox(self, ep: Episode, now: float) -> None:
        self.waiting[ep.owner] += 1
        super().send_to_sandbox(ep, now)

    def _sandbox_done(self, ep: Episode, now: float) -> None:
        self.waiting[ep.owner] -= 1
        super()._sandbox_done(ep, now)

    def complete(self, ep: Episode, now: float) -> None:
        r = self.gens.get(ep.owner)
        if r is not None:
            r.est.record("episode", now - r.taken.pop(ep.index, now))
        super().complete(ep, now)

    def open_episodes(self) -> int:
        return self.in_flight + self.train.ready

    # ---------------------------------------------------------------- the end
    def finish(self, now: float) -> None:
        for ep in self.episodes:
            if ep.fate == OPEN and not ep.done and ep.owner >= self.L + self.G and ep.owner not in self.gens:
                raise SimInvariantError(f"episode {ep.index} is held by rollout GPU {ep.owner}, whose job has ended")
        self._finishing = True
        if self.rounds is not None:
            self.rounds.stop_all(self.record, BASE_TS + now)  # their work in flight stays open, as the fixed ones'
        super().finish(now)

    def rollout_summary(self) -> dict:
        """What `hpcrl sim --json` reports of the rollout jobs: slurm/backfill/book.py's counts (as
        bench/backfill_live.py reports a live run's), the episodes they leased and handed back,
        and other users' jobs: how many started during the run and how much later than in the
        same simulation without rollout jobs (`others_start_delay_s`: max and mean over those
        that started in both)."""
        if self.slurm is None:
            return {
                **rollout_job_counts({}, {}, {}),
                "episodes_leased": 0,
                "episodes_handed_back": 0,
                "rollout_gpu_h": 0.0,
            }
        jobs = [self.slurm.jobs[r["job_id"]] for r in self.record.values()]
        starts = {j.job_id: None if math.isnan(j.start) else BASE_TS + j.start for j in jobs}
        ends = {j.job_id: None if math.isnan(j.end) else BASE_TS + j.end for j in jobs}
        held = sum(self.ledger.held_s(g, self.end_time) for g, r in enumerate(self.roles) if r == "rollout")
        out = {
            **rollout_job_counts(self.record, starts, ends),
            "episodes_leased": self.leased,
            "episodes_handed_back": self.handed_back,
            "rollout_gpu_h": held / 3600.0,
        }
        if self.trace.slurm.others is not None:
            out["others"] = self._others_delays()
        return out

    def _others_delays(self) -> dict:
        """Other users' jobs that started within the run, and their start delays against the same
        partition and workload simulated without rollout jobs."""
        end = self.end_time
        ran = {j.name: j.start for j in self.slurm.jobs.values() if j.kind == "other" and 0 <= j.start <= end}
        base = _without_rollout_jobs(self.trace, end)
        delays = [ran[n] - base[n] for n in ran if n in base]
        return {
            "started": len(ran),
            "max_start_delay_s": max(delays, default=0.0),
            "mean_start_delay_s": sum(delays) / len(delays) if delays else 0.0,
        }


def _without_rollout_jobs(trace: Trace, end: float) -> dict[str, float]:
    """{job name: start} of other users' jobs that started in [0, end] with the run's fixed jobs
    only: the same controller and workload (deterministic from the trace's seed)."""
    spec, c = trace.slurm, trace.cluster
    loop = EventLoop()
    loop.now = -spec.warmup_s
    ctl = SimSlurm(loop, spec)
    ctl.place_run(c.learner_gpus, c.generator_gpus, spec.learner, spec.generator)
    Workload(ctl, spec.others, trace.seed).start(loop.now)
    ctl.start_passes(loop.now)
    loop.run(lambda: loop.now > end)
    return {j.name: j.start for j in ctl.jobs.values() if j.kind == "other" and 0 <= j.start <= end}
