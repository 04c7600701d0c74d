"""Supervising a run's jobs: restart what dies, finish when the learner is done, fail loudly.

    run = LocalRun(cfg, run_dir, plan(cfg, run_dir, domains))   # `hpcrl run`: jobs on this machine
    run.start(); ok = run.wait(on_status=print_progress); run.shutdown()

    record = submit_run(cfg, run_dir, roles, search_path)         # on Slurm: every job, then the supervisor,
                                                                  # SupervisorComponent, a small job of its own

Both decide alike (`verdict`, and jobs/restarts.py): a component whose job ended before the
run is over, or whose heartbeats say it hangs (then it is killed first), is submitted again
after a backoff, within a budget of `supervise.restarts` per `supervise.restart_window_s`
that refills as old restarts age out; the learner's return value says whether the run is done
(it reached learner.max_steps), and a generator that returns "stopped by the coordinator" was
told the run is over and is not restarted. Every poll writes supervision.json, from which a
generator learns that the coordinator or store it cannot reach is on its way back, and waits.
Components resume from the run directory: the learner from its checkpoint, the store writer
by recovering its shard, the coordinator from its state file.

`LocalRun` drives submitit's LocalExecutor from the launching process. On Slurm the
supervisor job polls one `squeue` for all the run's job ids every few seconds. A job that is
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

import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import psutil
import submitit

from hpcrl.core.config import Config
from hpcrl.core.liveness import beat
from hpcrl.core.metrics import provide
from hpcrl.core.metrics import serve as serve_metrics
from hpcrl.core.rpc import RequestClient
from hpcrl.core.transport import Node
from hpcrl.jobs.components import LAUNCHER_ENV, finish_job, start_component
from hpcrl.jobs.launch import SUPERVISOR, Role, check_slurm, make_executor, plan, read_jobs, slurm_executor, write_jobs
from hpcrl.jobs.restarts import Watch
from hpcrl.rl.coordinator import read_status
from hpcrl.slurm import parse, queries
from hpcrl.slurm.command import SlurmCommandError, run_slurm

__all__ = [
    "LocalRun",
    "RunFailed",
    "SupervisorComponent",
    "submit_run",
    "verdict",
    "queue_states",
    "queue_jobs",
    "pids",
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


def verdict(name: str, result: Any, max_steps: int) -> Literal["finished", "ended", "died"]:
    """What a component's ended job means for the run; `result` is its return value or exception."""
    if name == "learner" and type(result) is int and result >= max_steps:
        return "finished"
    if isinstance(result, dict) and result.get("stopped_by") == "coordinator":
        return "ended"  # told the run is over; the learner is finishing up
    return "died"


def _no_result(job) -> BaseException | None:
    """A local job whose process ended without writing its result (killed by a signal), or None.

    submitit's result() waits up to 15 s for a result file that may still be crossing a network
    filesystem; a local job's process writes it before exiting, so its absence is final, and
    waiting held this loop (every other component unwatched) for 15 s per killed component."""
    process = getattr(job, "_process", None)
    if process is None or job.paths.result_pickle.exists():
        return None
    code = process.poll()
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return RuntimeError(f"job {job.job_id} ended without a result ({how})")


def _why(name: str, result: Any, max_steps: int) -> str:
    if isinstance(result, BaseException):
        return str(result)
    if name == "learner" and type(result) is int:
        return f"learner stopped at step {result} of {max_steps}"
    return f"exited before the run was over (returned {result!r})"


def _stop_coordinator(run_dir: Path, client_name: str) -> None:
    try:
        with Node(run_dir, client_name) as node:
            RequestClient(node, "coordinator", timeout_s=2.0, retries=1, discover_timeout_s=1.0).request("stop")
    except Exception as exc:  # cancelling afterwards still ends everything
        log.warning("could not ask the coordinator to stop: %s", exc)


# -- on this machine ------------------------------------------------------------------------------


class LocalRun:
    """Start, watch, heal and finish one run's jobs through submitit (`hpcrl run` is a thin shell
    over this). Every role is submitted with `make_executor` (executor: local)."""

    def __init__(self, cfg: Config, run_dir: str | Path, roles: Sequence[Role]):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.roles = list(roles)
        self.finished = False
        self.watch = Watch(self.run_dir, cfg)
        self._ended: set[str] = set()
        self._due: dict[str, float] = {}  # component -> when its restart is due (backing off)
        self.rollouts = None  # backfill rollout processes (jobs/rollout_plan.py), when configured

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def _submit(self, role: Role) -> None:
        ex = make_executor(
            self.cfg.executor, self.cfg.slurm, role.slurm_role, self.run_dir / "submitit", job_name=f"hpcrl-{role.name}"
        )
        role.started = time.time()
        role.job = ex.submit(role.component)
        role.history.append(role.job.job_id)
        log.info("submitted %s as job %s", role.name, role.job.job_id)

    def start(self) -> None:
        # Jobs inherit this: they stop by themselves if this process is killed (components.py).
        me = psutil.Process()
        os.environ[LAUNCHER_ENV] = f"{me.pid}:{me.create_time()}"
        serve_metrics(self.run_dir, SUPERVISOR, self.cfg.metrics)
        provide(self.metrics)
        from hpcrl.jobs.rollout_plan import rollout_planner

        self.rollouts = rollout_planner(self.cfg, self.run_dir, self.roles)
        for role in self.roles:
            self._submit(role)

    def metrics(self) -> dict:
        return {
            "restarts_total:target": {r.name: r.restarts for r in self.roles},
            "restarts_last_window:target": {r.name: self.watch.recent(r.restart_times) for r in self.roles},
        }

    def _check(self) -> None:
        """Restart roles that ended (after their backoff) or hang while the run goes on; raise when
        one has used its restarts; tell clients which peers are on their way (supervision.json)."""
        states: dict[str, str] = {}
        for role in self.roles:
            states[role.name] = self._check_role(role, time.time())
        self.watch.publish(states)
        if self.rollouts is not None and not self.finished:
            self.rollouts.tick()

    def _check_role(self, role: Role, now: float) -> str:
        name = role.name
        if name in self._due:
            if now >= self._due[name]:
                del self._due[name]
                role.restarts += 1
                role.restart_times.append(now)
                self._submit(role)
            return "starting"
        if not role.job.done():
            why = self.watch.hung(name, role.slurm_role, role.job.job_id, role.started, now)
            if why is None:
                up = self.watch.running(name, role.job.job_id, role.started, role.slurm_role)
                return "running" if up else "starting"
            log.warning("%s is hung: %s; killing it", name, why)
            self._kill(role)
            self._ended_badly(role, f"hung: {why}", now)
            return "starting"
        if name != "learner" and (self.finished or name in self._ended):
            return "ended"
        result = _no_result(role.job)
        if result is None:
            try:
                result = role.job.result()
            except Exception as exc:  # the job's failure, judged below
                result = exc
        what = verdict(name, result, self.cfg.learner.max_steps)
        if what == "finished":
            self.finished = True
            return "ended"
        if what == "ended":
            self._ended.add(name)
            return "ended"
        self._ended_badly(role, _why(name, result, self.cfg.learner.max_steps), now)
        return "starting"

    def _ended_badly(self, role: Role, why: str, now: float) -> None:
        """Schedule the restart of a role that died or hung, within its budget, or fail the run."""
        last = why.strip().splitlines()[-1] if why.strip() else "?"
        when = self.watch.schedule(role.name, role.restart_times, last, now)
        if when is None:
            raise RunFailed(
                f"{self.watch.spent(role.name, role.restart_times, why)} "
                f"(logs: {self.run_dir / 'submitit'}/{role.job.job_id}_*)"
            )
        if role.name == "learner" and self._ended:
            # Generators that were told the run is over are needed again by a resumed learner.
            for other in sorted(self._ended):
                self._submit(self.role(other))
            self._ended.clear()
        self._due[role.name] = when

    def _kill(self, role: Role) -> None:
        """A hung job, whole: SIGKILL reaches a stopped or deadlocked process; SIGTERM may not."""
        for proc in pids(self.run_dir, role.name):
            try:
                os.kill(proc, signal.SIGKILL)
            except ProcessLookupError:
                pass
        role.job.cancel()

    def wait(
        self,
        on_status: Callable[[dict | None], None] = lambda s: None,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
    ) -> bool:
        """Until the learner finished (True) or `timeout_s` passed (False); calls on_status each poll."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.finished:
            self._check()
            on_status(read_status(self.run_dir))
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        on_status(read_status(self.run_dir))
        return True

    def shutdown(self, grace_s: float = 60.0) -> None:
        """Stop generators (the coordinator tells them; cancel if they linger), then the services."""
        self.watch.publish({r.name: "ended" for r in self.roles})  # no client waits for a peer any more
        coord = self.role("coordinator").job
        if coord is not None and not coord.done():
            _stop_coordinator(self.run_dir, "hpcrl-run")
        if self.rollouts is not None:
            self.rollouts.stop_all()  # SIGTERM: they hand back what they hold, as the generators do
        order = [
            [r for r in self.roles if r.slurm_role in ("generator", "learner")],
            [r for r in self.roles if r.slurm_role == "sandbox"],
            [self.role("coordinator"), self.role("store")],
        ]
        order = [[r for r in group if r.job is not None] for group in order]  # interrupted while submitting
        for group in order:
            for r in group:
                self.stop_role(r)  # generators also hear it from the coordinator; the learner checkpoints
            deadline = time.monotonic() + grace_s
            while any(not r.job.done() for r in group) and time.monotonic() < deadline:
                time.sleep(0.2)
            for r in group:
                if not r.job.done():
                    log.warning("%s did not stop within %.0f s; cancelling it", r.name, grace_s)
                    r.job.cancel()

    def stop_role(self, role: Role) -> None:
        """Ask a role to finish cleanly: SIGTERM to its processes (local), scancel on Slurm
        (which sends SIGTERM and waits KillWait). submitit's local cancel would SIGKILL after ~1 s."""
        if role.job is None or role.job.done():
            return
        if self.cfg.executor != "local":
            role.job.cancel()
            return
        for proc in pids(self.run_dir, role.name):
            try:
                os.kill(proc, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def cancel_all(self) -> None:
        for r in self.roles:
            if r.job is not None and not r.job.done():
                r.job.cancel()


def live_procs(run_dir: str | Path) -> list[dict]:
    """The procs/<name>.json records (name, role, host, pid, started) of component processes
    alive on this host. A pid file outlives its process: a recycled pid is never taken for it."""
    out = []
    for f in sorted((Path(run_dir) / "procs").glob("*.json")):
        try:
            rec = json.loads(f.read_text())
            if rec.get("host") != socket.gethostname():
                continue
            proc = psutil.Process(int(rec["pid"]))
            if proc.create_time() <= float(rec["started"]) + 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(rec)
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            continue
    return out


def pids(run_dir: str | Path, role: str) -> list[int]:
    """Process ids of a role's tasks on this host (`live_procs` of that role)."""
    return [
        int(r["pid"])
        for r in live_procs(run_dir)
        if r.get("name", "") == role or r.get("name", "").startswith(role + "-")
    ]


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

    def note(role: Role, job_id: str) -> None:
        record["components"][role.name] = {
            "role": role.slurm_role,
            "job_id": job_id,
            "history": [job_id],
            "restarts": 0,
            "restart_times": [],
        }

    sandboxes = [r for r in roles if r.slurm_role == "sandbox"]
    for role in roles:
        if role.slurm_role == "sandbox":
            continue
        note(role, slurm_executor(cfg, run_dir, role.slurm_role, role.name).submit(role.component).job_id)
        if role.name == "coordinator" and sandboxes:
            # One job array for all sandbox servers (a restarted one comes back as a plain job).
            ex = slurm_executor(cfg, run_dir, "sandbox", "sandbox")
            with ex.batch():
                array = [ex.submit(r.component) for r in sandboxes]
            for r, job in zip(sandboxes, array):
                note(r, job.job_id)
    write_jobs(run_dir, record)
    sup = slurm_executor(cfg, run_dir, "coordinator", SUPERVISOR).submit(
        SupervisorComponent(run_dir, cfg, tuple(search_path))
    )
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
        from hpcrl.jobs.rollout_plan import rollout_planner

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
            self.between_polls(stop)
        return finish_job(stop, "stopped")  # at its own time limit: requeued, it re-reads jobs.json

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
            why = f"job {c['job_id']} {state or 'left the queue'}: {_why(name, result, self.cfg.learner.max_steps)}"
            self.ended_badly(record, name, why, now)
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

    def ended_badly(self, record: dict, name: str, why: str, now: float) -> None:
        """Schedule the restart of a component that died or hung, or fail the run (budget spent)."""
        comps = record["components"]
        c = comps[name]
        times = c.setdefault("restart_times", [])
        when = self.watch.schedule(name, times, why, now)
        if when is None:
            self.fail(record, self.watch.spent(name, times, why))
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

    def _cancel_all(self, record: dict) -> None:
        queries.cancel([c["job_id"] for c in record["components"].values()])

    def fail(self, record: dict, message: str) -> None:
        record.update(state="failed", message=message, ended=time.time())
        write_jobs(self.run_dir, record)
        self.stop_rollouts()
        self._cancel_all(record)  # free the nodes
        raise RunFailed(message)

    def finish(self, record: dict, grace_s: float = 30.0) -> None:
        _stop_coordinator(self.run_dir, "hpcrl-supervisor")
        gens = [c["job_id"] for n, c in record["components"].items() if n.startswith("gen-")]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(s not in TERMINAL for s in queue_states(gens).values()):
            time.sleep(1.0)
        self.stop_rollouts()
        self._cancel_all(record)  # scancel: SIGTERM, the store flushes and finalizes its shard
        record.update(state="finished", ended=time.time())
        write_jobs(self.run_dir, record)
