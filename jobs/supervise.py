"""Supervising a run's jobs: restart what dies, finish when the learner is done, fail loudly.

    record = submit_run(cfg, run_dir, roles, search_path)         # on Slurm: every job, then the supervisor,
                                                                  # SupervisorComponent, a small job of its own

Both decide alike (`verdict`, and jobs/restarts.py): a component whose job ended before the
run is over, or whose heartbeats say it hangs (then it is killed first), is submitted again
after a backoff, within a budget of `supervise.restarts` per `supervise.restart_window_s`
that refills as old restarts age out; one that fails twice in a row before reaching its main
loop with the same error (`error_line`: a missing model, a bad install) stops the run at once,
naming that error and its log; the learner's return value says whether the run is done
(it reached learner.max_steps), and a generator that returns "stopped by the coordinator" was
told the run is over and is not restarted. Every poll writes supervision.json, from which a
generator learns that the coordinator or store it cannot reach is on its way back, and waits.
Components resume from the run directory: the learner from its checkpoint, the store writer
by recovering its shard, the coordinator from its state file.

On this machine `LocalRun` (jobs/localrun.py) drives submitit's LocalExecutor from the
launching process, deciding with this module's `verdict`. On Slurm the supervisor job polls
one `squeue` for all the run's job ids every few seconds. A job that is
still in the queue in any non-terminal state (PENDING, RUNNING, COMPLETING, REQUEUED, ...) is
alive, unless it is RUNNING and hung (scancelled, then restarted): a requeue (`scontrol
requeue`, a time limit's checkpoint-and-requeue, preemption) keeps its job id and is left to
Slurm. A job that left the queue, or reached a terminal state, before the run is over is
resubmitted (new job id; restart times are kept in jobs.json) until it has used its budget;
then the supervisor writes state "failed" with the reason into jobs.json, cancels every job of
the run (freeing the nodes) and exits with an error. When the learner reaches learner.max_steps it asks the
coordinator to stop, lets generators finish, cancels the services and writes state "finished".
Like every component it is requeued at its time limit (SIGUSR2) and re-reads jobs.json.

Both also tick the run's backfill planner (jobs/rollout_plan.py; scheduler.max_rollout_jobs > 0)
each poll: its rollout jobs live in rollout.json, not jobs.json, are never restarted (their end
is normal), and are cancelled by id when the run finishes, fails or is cancelled.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import submitit

from hpcrl.core.config import Config
from hpcrl.core.liveness import beat
from hpcrl.core.metrics import provide
from hpcrl.core.rpc import RequestClient
from hpcrl.core.schema import to_dict
from hpcrl.core.sinks import MetricSinks
from hpcrl.core.transport import Node
from hpcrl.jobs.components import finish_job, start_component
from hpcrl.jobs.launch import (
    SUPERVISOR,
    Role,
    check_slurm,
    link_logs,
    plan,
    read_jobs,
    slurm_executor,
    write_jobs,
)
from hpcrl.jobs.restarts import Watch
from hpcrl.jobs.rollout_plan import rollout_planner
from hpcrl.rl.coordinator.report import METRICS_NAME
from hpcrl.slurm import parse, queries
from hpcrl.slurm.command import SlurmCommandError, run_slurm

__all__ = [
    "RunFailed",
    "SupervisorComponent",
    "error_line",
    "submit_run",
    "verdict",
    "queue_states",
    "queue_jobs",
    "why_ended",
    "stop_coordinator",
    "CANCEL_NAME",
]

log = logging.getLogger("hpcrl.supervise")

CANCEL_NAME = "cancel.requested"  # written by `hpcrl cancel`: the supervisor restarts nothing after it
# squeue states after which the job will not run again under this id.
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "SPECIAL_EXIT",
    "REVOKED",
}


class RunFailed(RuntimeError):
    """A role kept failing; the message names it and points at its log."""

    def __init__(self, message: str, component: str | None = None):
        super().__init__(message)
        self.component = component


def error_line(why: str) -> str:
    """The one line that says why a component ended: a traceback's exception line (submitit puts
    the job's traceback between dashed lines and its own advice after them), else the last line."""
    text = str(why)
    if "----------------------\n" in text:
        text = text.split("----------------------\n")[1]
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):  # a traceback ends with its final exception, unindented
        if not ln.startswith((" ", "\t", "Traceback ", "During handling", "The above exception")):
            return ln[:600]
    return lines[-1].strip()[:600] if lines else "ended without saying why"


def failed_twice(name: str, line: str, log_path) -> str:
    """The run's failure message for a component that failed twice at start with `line`."""
    return f"{name} failed twice at start: {line} (log: {log_path})"


def verdict(name: str, result: Any, max_steps: int) -> Literal["finished", "ended", "died"]:
    """What a component's ended job means for the run; `result` is its return value or exception."""
    if name == "learner" and type(result) is int and result >= max_steps:
        return "finished"
    if isinstance(result, dict) and result.get("stopped_by") == "coordinator":
        return "ended"  # told the run is over; the learner is finishing up
    return "died"


def why_ended(name: str, result: Any, max_steps: int) -> str:
    if isinstance(result, BaseException):
        return str(result)
    if name == "learner" and type(result) is int:
        return f"learner stopped at step {result} of {max_steps}"
    return f"exited before the run was over (returned {result!r})"


def stop_coordinator(run_dir: Path, client_name: str) -> None:
    try:
        with Node(run_dir, client_name) as node:
            RequestClient(node, "coordinator", timeout_s=2.0, retries=1, discover_timeout_s=1.0).request("stop")
    except Exception as exc:  # cancelling afterwards still ends everything
        log.warning("could not ask the coordinator to stop: %s", exc)


# -- on Slurm -------------------------------------------------------------------------------------


def queue_jobs(job_ids: Sequence[str]) -> dict[str, tuple[str, float | None]]:
    """{job id: (squeue state, start time or None)} for the ids still in the queue (one squeue call).

    Unlike queries.queue this raises when squeue fails for any reason other than "every id has
    left the queue": a controller hiccup must not look like every job died.
    """
    if not job_ids:
        return {}
    out = run_slurm(["squeue", "-h", "-r", "-o", "%i|%T|%S", "-j", ",".join(job_ids)], check=False)
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return {}
        raise SlurmCommandError(list(out.argv), out.returncode, out.stderr)
    rows = parse.parse_delimited(out.stdout, ("job_id", "state", "start"))
    jobs = {}
    for r in rows:
        start = parse.parse_timestamp(r["start"]) if r["state"] == "RUNNING" else None
        jobs[r["job_id"]] = (r["state"], start.timestamp() if start else None)
    return jobs


def queue_states(job_ids: Sequence[str]) -> dict[str, str]:
    """{job id: squeue state} for the ids still in the queue (see queue_jobs)."""
    return {j: state for j, (state, _) in queue_jobs(job_ids).items()}


def _result(folder: Path, job_id: str) -> Any:
    """A finished job's return value, or an Exception for a failure / missing result."""
    job = submitit.SlurmJob(folder=folder, job_id=job_id)
    path = job.paths.result_pickle
    if not path.exists():
        return RuntimeError(f"job {job_id} left no result (killed or cancelled); see {job.paths.stderr}")
    try:
        outcome, value = submitit.core.utils.pickle_load(path)
    except Exception as exc:  # a truncated pickle is a failure like any other
        return exc
    return value if outcome == "success" else RuntimeError(str(value)[-800:])


def submit_run(
    cfg: Config,
    run_dir: str | os.PathLike,
    roles: Sequence[Role],
    search_path: Sequence[str] = (),
) -> dict:
    """Submit every component, then the supervisor; write and return the jobs.json record."""
    check_slurm(cfg)
    run_dir = Path(run_dir)
    record = {
        "executor": "slurm",
        "run_dir": str(run_dir),
        "submitted": time.time(),
        "state": "submitted",
        "message": "",
        "search_path": list(search_path),
        "components": {},
    }

    def note(role: Role, job) -> None:
        record["components"][role.name] = {
            "role": role.slurm_role,
            "job_id": job.job_id,
            "history": [job.job_id],
            "restarts": 0,
            "restart_times": [],
        }
        link_logs(run_dir, role.name, job)

    sandboxes = [r for r in roles if r.slurm_role == "sandbox"]
    for role in roles:
        if role.slurm_role == "sandbox":
            continue
        note(role, slurm_executor(cfg, run_dir, role.slurm_role, role.name).submit(role.component))
        if role.name == "coordinator" and sandboxes:
            # One job array for all sandbox servers (a restarted one comes back as a plain job).
            ex = slurm_executor(cfg, run_dir, "sandbox", "sandbox")
            with ex.batch():
                array = [ex.submit(r.component) for r in sandboxes]
            for r, job in zip(sandboxes, array):
                note(r, job)
    write_jobs(run_dir, record)
    sup = slurm_executor(cfg, run_dir, "coordinator", SUPERVISOR).submit(
        SupervisorComponent(run_dir, cfg, tuple(search_path))
    )
    link_logs(run_dir, SUPERVISOR, sup)
    record["supervisor"] = {"job_id": sup.job_id, "history": [sup.job_id]}
    record["state"] = "running"
    write_jobs(run_dir, record)
    return record


class SupervisorComponent(submitit.helpers.Checkpointable):
    """Watches the run's jobs and restarts dead or hung ones within their budgets (see the module doc)."""

    def __init__(self, run_dir, cfg: Config, search_path=(), poll_s: float = 2.0):
        self.run_dir, self.cfg, self.search_path = Path(run_dir), cfg, tuple(search_path)
        self.poll_s = poll_s

    def __call__(self) -> str:
        stop = start_component(self.run_dir, SUPERVISOR, SUPERVISOR, self.cfg.metrics)
        self.components = {r.name: r for r in plan(self.cfg, self.run_dir, search_path=self.search_path)}
        self.watch = Watch(self.run_dir, self.cfg, SUPERVISOR)
        record = read_jobs(self.run_dir)
        comps = record["components"]

        # Backfill rollout jobs (scheduler.policy backfill): the same planner as LocalRun's; the
        # run's own jobs end no window (they are not "another job" that backfill must not delay).
        self.rollouts = rollout_planner(
            self.cfg, self.run_dir, list(self.components.values()), own_job_ids=lambda: self.own_ids(record)
        )
        provide(
            lambda: {
                "restarts_total:target": {n: c.get("restarts", 0) for n, c in comps.items()},
                "restarts_last_window:target": {
                    n: self.watch.recent(c.get("restart_times", [])) for n, c in comps.items()
                },
            }
        )
        # TensorBoard / W&B from metrics.jsonl (metrics.tensorboard, metrics.wandb): one writer, here.
        sinks = MetricSinks(self.run_dir, self.cfg.metrics, self.run_dir / METRICS_NAME, to_dict(self.cfg))
        try:
            while not stop.is_set():
                beat()
                if (self.run_dir / CANCEL_NAME).exists():
                    self.stop_rollouts()
                    return "cancelled"
                try:
                    done = self.check(record)
                except SlurmCommandError as exc:  # the controller is busy or restarting: try again next poll
                    log.warning("%s", exc)
                    done = None
                if done:
                    return done
                sinks.pump()
                self.between_polls(stop)
            return finish_job(stop, "stopped")  # at its own time limit: requeued, it re-reads jobs.json
        finally:
            sinks.close()

    def between_polls(self, stop) -> None:
        """Wait poll_s; meanwhile rollout jobs give way as soon as a job in their partitions ends
        (RolloutPlanner.watch every scheduler.give_way_interval_s), not a poll later."""
        due = time.monotonic() + self.poll_s
        step = self.rollouts.watch_interval_s if self.rollouts is not None else math.inf
        while not stop.wait(max(min(step, due - time.monotonic()), 0.0)) and time.monotonic() < due:
            try:
                self.rollouts.watch()
            except SlurmCommandError as exc:
                log.warning("%s", exc)

    def check(self, record: dict) -> str | None:
        """One poll: restart dead and hung components after their backoff; 'finished' when the
        learner is done; raise when one has used its restarts."""
        comps = record["components"]
        jobs = queue_jobs([c["job_id"] for c in comps.values()])
        now = time.time()
        states = {}
        for name, c in comps.items():
            states[name] = "starting"
            if c.get("restart_due") is not None:
                if now >= c["restart_due"]:
                    c.pop("restart_due")
                    c["restarts"] += 1
                    c.setdefault("restart_times", []).append(now)
                    self.resubmit(record, name)
                continue
            if c.get("ended"):
                states[name] = "ended"
                continue
            state, since = jobs.get(c["job_id"], (None, None))
            if state is not None and state not in TERMINAL:
                if state != "RUNNING" or since is None:
                    continue  # pending, configuring, requeued: Slurm has it
                role = self.components[name].slurm_role
                why = self.watch.hung(name, role, c["job_id"], since, now)
                if why is None:
                    states[name] = "running" if self.watch.running(name, c["job_id"], since, role) else "starting"
                    continue
                log.warning("%s (job %s) is hung: %s; cancelling it", name, c["job_id"], why)
                queries.cancel([c["job_id"]])
                self.ended_badly(record, name, f"job {c['job_id']} hung: {why}", now)
                continue
            if (self.run_dir / CANCEL_NAME).exists():
                return "cancelled"
            result = _result(self.run_dir / "submitit", c["job_id"])
            what = verdict(name, result, self.cfg.learner.max_steps)
            if what == "finished":
                self.watch.publish({n: "ended" for n in comps})
                self.finish(record)
                return "finished"
            if what == "ended":
                c["ended"] = True
                states[name] = "ended"
                write_jobs(self.run_dir, record)
                continue
            line = error_line(why_ended(name, result, self.cfg.learner.max_steps))
            role = self.components[name].slurm_role
            # Slurm job ids are not reused: every beat of this id is this job's.
            at_start = not self.watch.running(name, c["job_id"], 0.0, role)
            why = f"job {c['job_id']} {state or 'left the queue'}: {line}"
            self.ended_badly(record, name, why, now, at_start, line)
        self.watch.publish(states)
        if self.rollouts is not None:
            self.rollouts.tick()  # reap ended rollout jobs, submit new ones into a window
        return None

    def own_ids(self, record: dict) -> list[str]:
        """Every job id of the run now (components and the supervisor): none of them ends a window."""
        ids = [c["job_id"] for c in record["components"].values()]
        return ids + [j for j in (os.environ.get("SLURM_JOB_ID"), (record.get("supervisor") or {}).get("job_id")) if j]

    def stop_rollouts(self) -> None:
        """Cancel the run's rollout jobs (ours only, by id): scancel's SIGTERM makes each hand back
        its in-flight episodes, as at its window's end."""
        if getattr(self, "rollouts", None) is not None:
            try:
                self.rollouts.stop_all()
            except SlurmCommandError as exc:  # the run ends anyway; their own deadlines end them
                log.warning("could not cancel rollout jobs: %s", exc)

    def ended_badly(
        self, record: dict, name: str, why: str, now: float, at_start: bool = False, line: str | None = None
    ) -> None:
        """Schedule the restart of a component that died or hung, or fail the run: its budget is
        spent, or it failed before its main loop with the same error (`line`) as the time before."""
        comps = record["components"]
        c = comps[name]
        times = c.setdefault("restart_times", [])
        log_path = submitit.SlurmJob(folder=self.run_dir / "submitit", job_id=c["job_id"]).paths.stderr
        line = line or error_line(why)
        if at_start and c.get("start_failure") == line:
            self.fail(record, failed_twice(name, line, log_path), name)
        c["start_failure"] = line if at_start else None
        when = self.watch.schedule(name, times, why, now)
        if when is None:
            self.fail(record, f"{self.watch.spent(name, times, why)} (log: {log_path})", name)
        if name == "learner":
            for other, oc in comps.items():  # generators told to stop are needed by the resumed learner
                if oc.pop("ended", False):
                    self.resubmit(record, other)
        c["restart_due"] = when
        write_jobs(self.run_dir, record)

    def resubmit(self, record: dict, name: str) -> None:
        role = self.components[name]
        job = slurm_executor(self.cfg, self.run_dir, role.slurm_role, name).submit(role.component)
        c = record["components"][name]
        c["job_id"] = job.job_id
        c["history"].append(job.job_id)
        write_jobs(self.run_dir, record)
        link_logs(self.run_dir, name, job)

    def _cancel_all(self, record: dict) -> None:
        queries.cancel([c["job_id"] for c in record["components"].values()])

    def fail(self, record: dict, message: str, component: str | None = None) -> None:
        record.update(state="failed", message=message, ended=time.time())
        write_jobs(self.run_dir, record)
        self.stop_rollouts()
        self._cancel_all(record)  # free the nodes
        raise RunFailed(message, component)

    def finish(self, record: dict, grace_s: float = 30.0) -> None:
        stop_coordinator(self.run_dir, "hpcrl-supervisor")
        gens = [c["job_id"] for n, c in record["components"].items() if n.startswith("gen-")]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(s not in TERMINAL for s in queue_states(gens).values()):
            time.sleep(1.0)
        self.stop_rollouts()
        self._cancel_all(record)  # scancel: SIGTERM, the store flushes and finalizes its shard
        record.update(state="finished", ended=time.time())
        write_jobs(self.run_dir, record)
