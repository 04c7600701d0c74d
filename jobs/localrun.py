"""A run's jobs on this machine (`hpcrl run`): start them, restart what dies, finish when done.

    run = LocalRun(cfg, run_dir, plan(cfg, run_dir, domains))   # jobs through submitit's LocalExecutor
    run.start(); ok = run.wait(on_status=print_progress); run.shutdown()
    pids(run_dir, "gen-0")                                      # a component's processes on this host

`LocalRun` decides as the Slurm supervisor does (jobs/supervise.py: `verdict`, jobs/restarts.py's
budgets and backoff), from the launching process: it polls each job, restarts one that ended
before the run is over or hangs (killed first), ticks the run's rollout planner, and writes
supervision.json each poll. Component processes record themselves in procs/<name>.json;
`live_procs` and `pids` read those back, for this loop, `hpcrl status`, `hpcrl chaos` and resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from hpcrl.core.config import Config
from hpcrl.core.metrics import provide
from hpcrl.core.metrics import serve as serve_metrics
from hpcrl.core.schema import to_dict
from hpcrl.core.sinks import MetricSinks
from hpcrl.jobs.components import LAUNCHER_ENV
from hpcrl.jobs.launch import SUPERVISOR, Role, component_jobs, link_logs, make_executor
from hpcrl.jobs.restarts import Watch
from hpcrl.jobs.rollout_plan import rollout_planner
from hpcrl.jobs.supervise import RunFailed, error_line, failed_twice, stop_coordinator, verdict, why_ended
from hpcrl.rl.coordinator.report import METRICS_NAME, read_status

__all__ = ["LocalRun", "live_procs", "pids", "STOP_STAGE_S"]

log = logging.getLogger("hpcrl.supervise")
# How long each of shutdown's three stages may take before what is left of it is killed: a run
# asked to stop (Ctrl-C, SIGTERM) is gone within 3 x this.
STOP_STAGE_S = 60.0


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


@contextlib.contextmanager
def _children_ignore_sigint():
    """Start submitit's local controller with SIGINT ignored (inherited across exec). It sits in
    the terminal's process group: a Ctrl-C would reach it too, and it would die of a
    KeyboardInterrupt and kill its job unstopped (a learner without its stop checkpoint). This
    process, which gets the same Ctrl-C, stops the run in order; the component below the
    controller installs its own SIGINT handler (jobs/components.py). A Ctrl-C in the instant of a
    submit is lost (press it again)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal dispositions are the main thread's to change; restarts submit from there
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
        # Job ids a resumed run's components had under the launcher before this one (`hpcrl logs --all`).
        self._earlier: dict[str, list[str]] = component_jobs(self.run_dir) or {}
        self.sinks: MetricSinks | None = None  # TensorBoard / W&B (metrics.tensorboard, metrics.wandb)

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def _submit(self, role: Role) -> None:
        ex = make_executor(
            self.cfg.executor, self.cfg.slurm, role.slurm_role, self.run_dir / "submitit", job_name=f"hpcrl-{role.name}"
        )
        role.started = time.time()
        with _children_ignore_sigint():
            role.job = ex.submit(role.component)
        role.history.append(role.job.job_id)
        link_logs(self.run_dir, role.name, role.job, self._earlier.get(role.name, []) + role.history)
        log.info("submitted %s as job %s", role.name, role.job.job_id)

    def start(self) -> None:
        # Jobs inherit this: they stop by themselves if this process is killed (components.py).
        me = psutil.Process()
        os.environ[LAUNCHER_ENV] = f"{me.pid}:{me.create_time()}"
        serve_metrics(self.run_dir, SUPERVISOR, self.cfg.metrics)
        provide(self.metrics)
        self.sinks = MetricSinks(self.run_dir, self.cfg.metrics, self.run_dir / METRICS_NAME, to_dict(self.cfg))

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
        if self.sinks is not None:
            self.sinks.pump()

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
            self._ended_badly(role, f"hung: {why}", now, at_start=False)
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
        at_start = not self.watch.running(name, role.job.job_id, role.started, role.slurm_role)
        self._ended_badly(role, why_ended(name, result, self.cfg.learner.max_steps), now, at_start)
        return "starting"

    def _ended_badly(self, role: Role, why: str, now: float, at_start: bool) -> None:
        """Schedule the restart of a role that died or hung, within its budget, or fail the run:
        the budget is spent, or it failed before its main loop the same way as the time before."""
        line = error_line(why)
        log_path = role.job.paths.stderr
        if at_start and role.start_failure == line:
            raise RunFailed(failed_twice(role.name, line, log_path), role.name)
        role.start_failure = line if at_start else None
        when = self.watch.schedule(role.name, role.restart_times, line, now)
        if when is None:
            raise RunFailed(f"{self.watch.spent(role.name, role.restart_times, line)} (log: {log_path})", role.name)
        if role.name == "learner" and self._ended:
            # Generators that were told the run is over are needed again by a resumed learner.
            for other in sorted(self._ended):
                self._submit(self.role(other))
            self._ended.clear()
        self._due[role.name] = when

    def _kill(self, role: Role) -> None:
        """A job, whole: SIGKILL to its registered processes and to submitit's controller and every
        process below it (one still starting has no procs/ record). SIGKILL reaches a stopped or
        deadlocked process; SIGTERM may not, and submitit's cancel is SIGINT, which a run started
        in the background (`hpcrl run ... &`) hands its jobs ignored."""
        procs = set(pids(self.run_dir, role.name))
        ctl = getattr(role.job, "_process", None)
        if ctl is not None and ctl.poll() is None:
            procs.add(ctl.pid)
            try:
                procs |= {c.pid for c in psutil.Process(ctl.pid).children(recursive=True)}
            except psutil.Error:
                pass
        for proc in procs:
            try:
                os.kill(proc, signal.SIGKILL)
            except ProcessLookupError:
                pass

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

    def shutdown(self, grace_s: float = STOP_STAGE_S) -> None:
        """Stop generators and the learner (the coordinator tells generators; the learner
        checkpoints), then the sandboxes, then coordinator and store; each stage gets `grace_s`,
        after which what still runs of it is killed. So a run stops within 3 x grace_s."""
        self.watch.publish({r.name: "ended" for r in self.roles})  # no client waits for a peer any more
        coord = self.role("coordinator").job
        if coord is not None and not coord.done():
            stop_coordinator(self.run_dir, "hpcrl-run")
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
                    log.warning("%s did not stop within %.0f s; killing it", r.name, grace_s)
                    self._kill(r)
        if self.sinks is not None:
            self.sinks.close()  # the coordinator wrote its last row

    def stop_role(self, role: Role) -> None:
        """Ask a role to finish cleanly: SIGTERM (local), scancel on Slurm (which sends SIGTERM
        and waits KillWait). submitit's local cancel would SIGKILL after ~1 s."""
        if role.job is None or role.job.done():
            return
        if self.cfg.executor != "local":
            role.job.cancel()
            return
        procs = pids(self.run_dir, role.name)
        if not procs:
            # Still starting: it holds nothing to hand back yet, and submitit passes SIGTERM over
            # until the component has installed its own handlers (it would run on for the stage).
            self._kill(role)
            return
        for proc in procs:  # once each: a second signal must not arrive inside the first's handler
            try:
                os.kill(proc, signal.SIGTERM)
            except ProcessLookupError:
                pass


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
