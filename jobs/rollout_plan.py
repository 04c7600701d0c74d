"""The run's backfill planner: rollout jobs (jobs/rollout.py) into idle-GPU windows, up to the caps.

    planner = rollout_planner(cfg, run_dir, roles)   # None unless scheduler.policy is backfill and
                                                     # max_rollout_jobs and max_rollout_gpus are > 0
    planner.tick()                                   # every poll of LocalRun / the Slurm supervisor
    planner.watch()                                  # between the Slurm supervisor's polls (give-way)
    planner.stop_all()                               # the run is over

It lives in the process that already watches the run's jobs (`LocalRun` for `hpcrl run`, the
supervisor job for `hpcrl submit`): that process owns submitting jobs, and no other process
needs a Slurm client loop of its own. Every `scheduler.plan_interval_s` it decides:

- **Is there work for more generators?** Only while the coordinator runs and its flow control
  has room (`coordinator_has_work`: fewer groups outstanding than it may hand out, or episodes
  queued for re-issue). When flow control is full the learner is the bottleneck: another
  generator would only hold a GPU idle, so none is started.
- **Which window?** On Slurm (jobs/rollout_slurm.py) the window of `slurm.generator.partition`
  in a snapshot of the queue (squeue --start; slurm/backfill/planner.py `plan_rollout_jobs`, the
  run's own jobs excluded), in whole rollout jobs of the generator role's shape (GPUs, CPUs,
  memory), sized by `size_rollout_jobs`: --time the
  longest limit that backfill accepts before the next pending GPU job (`minutes_that_fit`),
  --time-min one minute less (at least one episode + job_overhead_s + rollout_drain_s: see
  size_rollout_jobs), as many jobs as idle GPUs hold, with `--nice scheduler.rollout_nice` (last
  in priority: one left pending holds no reservation ahead of anyone). Jobs that end early pull
  pending jobs' starts into GPUs a rollout job holds. In `scheduler.rollout_partition`
  (preemptible by the GPU partition: checked at submit and here, slurm/preempt.py) Slurm preempts
  such a rollout job in its next pass (SIGTERM: it hands back and exits). Otherwise the planner
  cancels it at once (slurm/backfill/give_way.py) within `scheduler.give_way_interval_s` (by default a
  quarter of Slurm's bf_interval: between its polls the supervisor runs `watch()`, one squeue of
  the partitions, and the full check once a job there started or ended); with a rollout partition
  only after `rollout_yield_after_s` of Slurm not preempting it.
  Locally the windows are `scheduler.local_windows` (seconds from the run start); each is
  filled once, its processes get its end as their deadline and are signalled (SIGTERM) there,
  killed rollout_drain_s + 30 s later if still alive, as Slurm's time limit would.
- **Did Slurm take it?** `--time` leaves `scheduler.slurm_margin_s` (default Slurm's bf_interval
  + 4 s) before the window's end: the wait for the backfill pass that can start it. A job Slurm
  has looked at (squeue's reason is no longer None) and left pending past
  `scheduler.rollout_withdraw_s` (default two passes + 4 s) did not fit after all: it is
  withdrawn (it holds no episodes yet), and the same window (blocking job, its expected start,
  free GPUs per node) is not tried again until it changes.
- **How many?** At most max_rollout_jobs at once and max_rollout_gpus GPUs in all.

`<run>/rollout.json` records every rollout job (name, job id, GPUs, planned window end,
state, and `preempted`: Slurm's PreemptTime when Slurm preempted it); `hpcrl status` lists them
as components with role `rollout`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path

from hpcrl.core.config import Config
from hpcrl.core.files import atomic_write_json
from hpcrl.jobs.rollout import ROLLOUT_DIR, RolloutComponent
from hpcrl.jobs.rollout_slurm import SlurmBackend
from hpcrl.rl.coordinator.report import read_status
from hpcrl.slurm import queries
from hpcrl.slurm.backfill.give_way import give_way_interval_s
from hpcrl.slurm.backfill.lending import room_for_another_generator
from hpcrl.slurm.backfill.planner import RolloutJobSize, withdraw_after_s
from hpcrl.slurm.backfill.snapshot import backfill_parameters
from hpcrl.slurm.preempt import check_preemptible

# hpcrl imports inside functions here would load numpy for every importer of this module (start-up speed).

__all__ = [
    "coordinator_has_work",
    "rollout_planner",
    "rollout_job_parameters",
    "check_rollout_partition",
    "rollout_summary",
    "RolloutPlanner",
    "ROLLOUT_NAME",
]

log = logging.getLogger("hpcrl.rollout")
ROLLOUT_NAME = "rollout.json"
KILL_GRACE_S = 30.0  # after its window's end (+ drain), a local rollout process that lingers is killed


def coordinator_has_work(status: dict | None, max_ahead_groups: int) -> bool:
    """Would the coordinator hand episodes to one more generator? (status.json, pure)"""
    if not status or status.get("state") != "running":
        return False
    ln = status.get("learner") or {}
    if "version" not in ln:
        return False  # no weights published yet: a generator started now would only wait for them
    consumed = int(ln.get("trained_groups", 0)) + int(ln.get("dropped_groups", 0))
    outstanding = int(status.get("groups_issued", 0)) - consumed
    return room_for_another_generator(int(status.get("queued", 0)), outstanding, max_ahead_groups)


class RolloutPlanner:
    """Keeps the rollout jobs of one run (see the module doc); `backend` is LocalBackend or SlurmBackend."""

    def __init__(self, cfg: Config, run_dir: Path, template, backend, clock=time.time):
        self.cfg, self.sched, self.run_dir = cfg, cfg.scheduler, Path(run_dir)
        self.template, self.backend, self.clock = template, backend, clock
        lc = cfg.learner
        self.max_ahead = cfg.coordinator.max_groups_ahead or max(1, lc.max_staleness) * lc.batch_groups
        self.gpus_per_job = max(cfg.slurm.generator.gpus_per_node, 1)
        self.record = self._load()
        self._next_plan = 0.0
        self._seen = None  # the partitions' jobs at the last watch()
        self._why = ""  # why the last plan submitted nothing (logged when it changes)
        self.watch_interval_s = math.inf  # how often watch() is due (Slurm: give_way_interval_s)

    def _load(self) -> dict:
        import json

        path = self.run_dir / ROLLOUT_NAME
        if path.exists():  # a requeued supervisor goes on where its predecessor was
            return json.loads(path.read_text())
        return {"started": self.clock(), "next": 0, "jobs": {}, "windows": []}

    def save(self) -> None:
        atomic_write_json(self.run_dir / ROLLOUT_NAME, self.record)

    def active(self) -> dict[str, dict]:
        return {n: j for n, j in self.record["jobs"].items() if j["state"] == "active"}

    def free(self) -> tuple[int, int]:
        act = self.active().values()
        return (
            self.sched.max_rollout_jobs - len(act),
            self.sched.max_rollout_gpus - sum(j["gpus"] for j in act),
        )

    def episode_s(self) -> float:
        return self.sched.prior_s

    def new_component(self, deadline: float | None) -> tuple[str, RolloutComponent]:
        n = self.record["next"]
        self.record["next"] = n + 1
        name = f"rollout-{n}"
        seed = self.cfg.experiment.seed + 1000 * (1000 + n)  # apart from the fixed generators' seeds
        return name, RolloutComponent.like(self.template, name, seed, deadline, self.sched)

    def tick(self) -> None:
        now = self.clock()
        changed = self.backend.reap(self, now)
        if now >= self._next_plan:
            self._next_plan = now + self.sched.plan_interval_s
            jobs_free, gpus_free = self.free()
            if jobs_free > 0 and gpus_free >= self.gpus_per_job:
                if coordinator_has_work(read_status(self.run_dir), self.max_ahead):
                    changed = self.backend.plan(self, now, jobs_free, gpus_free) or changed
                else:
                    self.why_not("the coordinator has no work for another generator (flow control full, or no weights)")
        if changed:
            self.save()

    def why_not(self, why: str, key=None) -> None:
        """Log why no rollout job was submitted, once per reason in a row (`key`, or the text):
        the run's log says what the planner saw at each change, not a line every plan."""
        key = why if key is None else key
        if key != self._why:
            self._why = key
            if why:
                log.info("rollout: none submitted: %s", why)

    def watch(self) -> None:
        """Between the Slurm supervisor's polls: tick() at once if a job in the partitions started,
        ended or was queued since the last look (one squeue), so a rollout job gives way within one
        look of it. Local runs have no one to give way to and never call it."""
        if not any(not j.get("pending") for j in self.active().values()):
            return  # nothing running that could be in anyone's way
        seen = self.backend.signature(self)
        if seen != self._seen:
            self.tick()
            self._seen = seen  # after the check: one that failed (squeue busy) is tried again

    def stop_all(self) -> None:
        self.backend.stop_all(self)
        self.save()


class LocalBackend:
    """Windows from scheduler.local_windows; rollout processes through submitit's LocalExecutor."""

    def __init__(self, executor_factory):
        self.executor_factory = executor_factory  # name -> a submitit executor
        self.jobs: dict = {}  # name -> submitit job

    def plan(self, p: RolloutPlanner, now: float, jobs_free: int, gpus_free: int) -> bool:
        t0, changed = p.record["started"], False
        for i, w in enumerate(p.sched.local_windows):
            if i in p.record["windows"]:
                continue
            start, end = t0 + w.start_s, t0 + w.start_s + w.length_s
            if not start <= now < end:
                continue
            left = end - now
            if left < p.episode_s() + p.sched.rollout_drain_s:
                continue  # too short now: one episode would not finish
            jobs = min(w.gpus // p.gpus_per_job, jobs_free, gpus_free // p.gpus_per_job)
            if jobs < 1:
                continue
            p.record["windows"].append(i)
            for _ in range(jobs):
                name, comp = p.new_component(end)
                job = self.executor_factory(name).submit(comp)
                self.jobs[name] = job
                p.record["jobs"][name] = {
                    "job_id": job.job_id,
                    "gpus": p.gpus_per_job,
                    "window": i,
                    "window_end": end,
                    "submitted": now,
                    "state": "active",
                }
                log.info("rollout: %s in local window %d (%.0f s left)", name, i, left)
            jobs_free -= jobs
            gpus_free -= jobs * p.gpus_per_job
            changed = True
        return changed

    def reap(self, p: RolloutPlanner, now: float) -> bool:
        changed = False
        for name, rec in p.active().items():
            job = self.jobs.get(name)
            if job is None or job.done():
                rec.update(state="ended", ended=now)
                changed = True
                continue
            if now >= rec["window_end"] and not rec.get("signalled"):
                rec["signalled"] = now  # the window is over: as Slurm's time limit, SIGTERM
                _signal(pids(p.run_dir, name), signal.SIGTERM)
                changed = True
            elif now >= rec["window_end"] + p.sched.rollout_drain_s + KILL_GRACE_S:
                log.warning("rollout: %s outlived its window; killing it", name)
                _signal(pids(p.run_dir, name), signal.SIGKILL)
                job.cancel()
        return changed

    def stop_all(self, p: RolloutPlanner, grace_s: float = 60.0) -> None:
        for name in p.active():
            _signal(pids(p.run_dir, name), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(not self.jobs[n].done() for n in p.active() if n in self.jobs) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in p.active():
            if name in self.jobs and not self.jobs[name].done():
                self.jobs[name].cancel()
        self.reap(p, time.time())


def pids(run_dir: Path, name: str) -> list[int]:
    """The pid of a local rollout process (rollout/<name>.json), if it is still that process."""
    import json

    import psutil

    try:
        rec = json.loads((run_dir / ROLLOUT_DIR / f"{name}.json").read_text())
        proc = psutil.Process(int(rec["pid"]))
        if proc.create_time() <= float(rec["started"]) + 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return [proc.pid]
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        pass
    return []


def _signal(procs: list[int], sig: int) -> None:
    for proc in procs:
        try:
            os.kill(proc, sig)
        except ProcessLookupError:
            pass


def rollout_jobs_on(cfg: Config) -> bool:
    s = cfg.scheduler
    return s.policy == "backfill" and s.max_rollout_jobs > 0 and s.max_rollout_gpus > 0


def rollout_summary(cfg: Config) -> str:
    """What a run will do about idle GPUs, one line for `hpcrl submit` to print (pure): rollout
    jobs are off unless both caps are set, and a user who left them at 0 is told which to set."""
    s = cfg.scheduler
    if rollout_jobs_on(cfg):
        part = s.rollout_partition or cfg.slurm.generator.partition
        return (
            f"rollout jobs: up to {s.max_rollout_jobs} ({s.max_rollout_gpus} GPUs) in backfill windows of "
            f"{part}, sized and submitted by the supervisor"
        )
    if s.policy != "backfill":
        return f"rollout jobs: none (scheduler.policy is {s.policy})"
    zero = [k for k in ("max_rollout_jobs", "max_rollout_gpus") if getattr(s, k) == 0]
    return (
        f"rollout jobs: none (scheduler.{' and '.join(zero)} {'are' if len(zero) > 1 else 'is'} 0); set "
        "scheduler.max_rollout_jobs and scheduler.max_rollout_gpus above 0 to run rollout jobs in the partition's "
        "idle GPUs"
    )


def check_rollout_partition(cfg: Config) -> None:
    """ConfigError unless scheduler.rollout_partition (when set, for a Slurm run with rollout jobs)
    is preemptible by slurm.generator.partition on the live cluster (slurm/preempt.py)."""
    if cfg.executor == "slurm" and cfg.scheduler.rollout_partition and rollout_jobs_on(cfg):
        check_preemptible(cfg.scheduler.rollout_partition, cfg.slurm.generator.partition)


def rollout_job_parameters(cfg: Config, job_name: str, size: RolloutJobSize) -> dict:
    """submitit.SlurmExecutor keywords of one rollout job (pure): the generator role's, with the
    window's --time and --time-min, in scheduler.rollout_partition when set."""
    from hpcrl.jobs.launch import slurm_parameters

    s = cfg.scheduler
    params = slurm_parameters(
        cfg.slurm, "generator", job_name, size.time_limit_min, size.time_min_min, partition=s.rollout_partition or None
    )
    extra = params.setdefault("additional_parameters", {})
    # Never requeued (its window is gone by then): under PreemptMode=REQUEUE Slurm then cancels
    # it instead, and the planner sizes a new job to a new window.
    extra["no_requeue"] = True
    if s.rollout_nice:
        # Last in priority: backfill still starts it where it fits now without delaying anyone,
        # but one left pending (its window gone) never gets a reservation ahead of another job.
        extra["nice"] = s.rollout_nice
    # Its own deadline ends it (jobs/rollout.py); USR2 is only a late backstop and must not come
    # at the start of a job shorter than the fixed generators' signal delay.
    params["signal_delay_s"] = max(int(s.rollout_drain_s), 1)
    return params


def rollout_planner(cfg: Config, run_dir: str | os.PathLike, roles, own_job_ids=None) -> RolloutPlanner | None:
    """The run's planner, or None when backfill rollout jobs are off (the default)."""
    s = cfg.scheduler
    if not rollout_jobs_on(cfg):
        return None
    run_dir = Path(run_dir)
    template = next((r.component for r in roles if r.slurm_role == "generator"), None)
    if template is None:
        raise ValueError("scheduler.max_rollout_jobs > 0 needs generators.count >= 1: rollout jobs run what gen-0 runs")
    from hpcrl.jobs.launch import BOOT_PYTHON, make_executor, role_resources

    check_rollout_partition(cfg)
    if cfg.executor == "local":
        backend = LocalBackend(
            lambda name: make_executor("local", cfg.slurm, "generator", run_dir / "submitit", job_name=f"hpcrl-{name}")
        )
    else:
        import submitit

        def slurm_executor(name: str, size: RolloutJobSize):
            ex = submitit.SlurmExecutor(folder=run_dir / "submitit", max_num_timeout=0, python=BOOT_PYTHON)
            ex.update_parameters(**rollout_job_parameters(cfg, f"hpcrl-{run_dir.name}-{name}", size))
            return ex

        params = queries.scheduler_parameters()  # once: they change only with a reconfigure
        yield_after_s = s.rollout_yield_after_s if s.rollout_partition else 0.0
        withdraw_s = withdraw_after_s(s.rollout_withdraw_s, backfill_parameters(params)[1])
        need = role_resources(cfg.slurm, "generator")  # what each rollout job asks for (slurm_parameters)
        backend = SlurmBackend(slurm_executor, own_job_ids or (lambda: ()), yield_after_s, params, withdraw_s, need)
    planner = RolloutPlanner(cfg, run_dir, template, backend)
    if cfg.executor == "slurm":
        planner.watch_interval_s = give_way_interval_s(s.give_way_interval_s, params)
        log.info(
            "rollout: give-way checked every %.2f s; a rollout job pending %.0f s is withdrawn",
            planner.watch_interval_s,
            withdraw_s,
        )
    return planner
