"""A run on Slurm: submit every component as its own job, record the job ids, supervise them.

    run_dir = create_run_dir(cfg)                       # cfg.executor == "slurm"
    record = submit_run(cfg, run_dir, search_path=[config_dir])   # returns at once; jobs keep running
    print(record["components"]["learner"]["job_id"])
    scripts = dry_run_scripts(cfg, run_dir)             # {component: sbatch text}; submits nothing

Each component (the same picklable classes as local runs, see jobs/components.py) goes to its
role's partition: store writer and coordinator on `slurm.coordinator`, the learner on
`slurm.learner`, generators on `slurm.generator`, sandbox servers on `slurm.sandbox` as one job
array. `<run>/jobs.json` (written atomically) maps component -> current job id, earlier job ids
and restarts; `hpcrl status/cancel/logs` read it.

Who restarts a dead component: a small supervisor job (`SupervisorComponent`, on the
coordinator's partition and resources) submitted last. It polls one `squeue` for all the
run's job ids every few seconds. A job that is still in the queue in any non-terminal state
(PENDING, RUNNING, COMPLETING, REQUEUED, ...) is alive: a requeue (`scontrol requeue`, a time
limit's checkpoint-and-requeue, preemption) keeps its job id and is left to Slurm. A job that
left the queue, or reached a terminal state, before the run is over is submitted again (new
job id) until it has used `max_restarts`; then the supervisor writes state "failed" with the
reason into jobs.json, cancels every job of the run (freeing the nodes) and exits with an
error, so the run fails loudly. When the learner reaches learner.max_steps the supervisor
asks the coordinator to stop, lets generators finish, cancels the services and writes state
"finished". The supervisor, like every component, is requeued at its time limit (SIGUSR2,
see jobs/components.py) and re-reads jobs.json when it runs again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import submitit

from hpcrl.jobs.config import Config
from hpcrl.jobs.launch import make_executor

__all__ = ["JOBS_NAME", "CANCEL_NAME", "read_jobs", "write_jobs", "submit_run", "dry_run_scripts", "preflight",
           "SupervisorComponent"]

log = logging.getLogger("hpcrl.slurmrun")

JOBS_NAME = "jobs.json"
CANCEL_NAME = "cancel.requested"  # written by `hpcrl cancel`: the supervisor restarts nothing after it
SUPERVISOR = "supervisor"
# squeue states after which the job will not run again under this id.
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
            "SPECIAL_EXIT", "REVOKED"}


def read_jobs(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(run_dir) / JOBS_NAME).read_text())
    except FileNotFoundError:
        return None


def write_jobs(run_dir: str | os.PathLike, record: dict) -> None:
    """Atomically: readers (status, cancel) never see half a file."""
    path = Path(run_dir) / JOBS_NAME
    tmp = path.with_name(f".{JOBS_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _folder(run_dir: Path) -> Path:
    return run_dir / "submitit"


def _roles(cfg: Config, run_dir: Path, search_path: Sequence[str], max_restarts: int):
    from hpcrl.jobs.runner import RunJobs

    if cfg.executor != "slurm":
        raise ValueError(f"a Slurm run needs executor: slurm (got {cfg.executor!r}); `hpcrl run` runs locally")
    return RunJobs(cfg, run_dir, search_path=search_path, max_restarts=max_restarts)


def _executor(cfg: Config, run_dir: Path, slurm_role: str, name: str) -> submitit.Executor:
    return make_executor("slurm", cfg.slurm, slurm_role, _folder(run_dir), job_name=f"hpcrl-{run_dir.name}-{name}")


def submit_run(cfg: Config, run_dir: str | os.PathLike, search_path: Sequence[str] = (), max_restarts: int = 3) -> dict:
    """Submit every component, then the supervisor; write and return the jobs.json record."""
    run_dir = Path(run_dir)
    jobs = _roles(cfg, run_dir, search_path, max_restarts)
    record = {"executor": "slurm", "run_dir": str(run_dir), "submitted": time.time(), "state": "submitted",
              "message": "", "max_restarts": max_restarts, "search_path": list(search_path), "components": {}}

    def note(role, job_id: str) -> None:
        record["components"][role.name] = {"role": role.slurm_role, "job_id": job_id, "history": [job_id],
                                           "restarts": 0}

    sandboxes = [r for r in jobs.roles if r.slurm_role == "sandbox"]
    for role in jobs.roles:
        if role.slurm_role == "sandbox":
            continue
        job = _executor(cfg, run_dir, role.slurm_role, role.name).submit(role.component)
        note(role, job.job_id)
        if role.name == "coordinator" and sandboxes:
            # One job array for all sandbox servers (a restarted one comes back as a plain job).
            ex = _executor(cfg, run_dir, "sandbox", "sandbox")
            with ex.batch():
                array = [ex.submit(r.component) for r in sandboxes]
            for r, job in zip(sandboxes, array):
                note(r, job.job_id)
    write_jobs(run_dir, record)
    sup = _executor(cfg, run_dir, "coordinator", SUPERVISOR).submit(
        SupervisorComponent(run_dir, cfg, tuple(search_path), max_restarts))
    record["supervisor"] = {"job_id": sup.job_id, "history": [sup.job_id]}
    record["state"] = "running"
    write_jobs(run_dir, record)
    return record


def preflight(cfg: Config) -> list[str]:
    """Warnings about cluster settings (`scontrol show config`) that break requeue or signals."""
    from hpcrl.slurm.command import run_slurm

    conf = {}
    for line in run_slurm(["scontrol", "show", "config"]).stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            conf[key.strip()] = value.strip()
    warn = []
    if conf.get("JobRequeue") == "0":
        warn.append("JobRequeue=0: jobs are not requeueable, so a component at its time limit cannot requeue "
                    "itself; the supervisor resubmits it instead (a new job id, one restart of its budget)")
    kill_wait = int((conf.get("KillWait") or "30").split()[0])
    if kill_wait < 10:
        warn.append(f"KillWait={kill_wait} s: a cancelled or requeued component has only that long after SIGTERM to "
                    "checkpoint and flush; the learner may resume from an older checkpoint and the store's open "
                    "shard is then recovered at next open")
    mode = conf.get("PreemptMode", "OFF").upper()
    if conf.get("PreemptType", "preempt/none") != "preempt/none" and ("CANCEL" in mode or "SUSPEND" in mode):
        warn.append(f"PreemptMode={mode}: preempted components are cancelled or suspended, not requeued; the "
                    "supervisor resubmits cancelled ones (each costs a restart)")
    for role in ("coordinator", "learner", "generator", "sandbox"):
        delay = cfg.slurm.role(role).signal_delay_s
        if delay < 60:
            warn.append(f"slurm.{role}.signal_delay_s={delay}: Slurm checks time limits about once a minute, so the "
                        "USR2 that starts the drain may come too late; 120 or more is safer")
    return warn


def dry_run_scripts(cfg: Config, run_dir: str | os.PathLike, search_path: Sequence[str] = ()) -> dict[str, str]:
    """The sbatch script submitit would submit for each component (and the supervisor); nothing is queued."""
    run_dir = Path(run_dir)
    jobs = _roles(cfg, run_dir, search_path, 0)
    out = {}
    sandboxes = sum(r.slurm_role == "sandbox" for r in jobs.roles)
    for name, slurm_role in [(r.name, r.slurm_role) for r in jobs.roles] + [(SUPERVISOR, "coordinator")]:
        if slurm_role == "sandbox":
            if name != "sandbox-0":
                continue
            name = "sandbox"  # one job array, as submit_run submits it
        ex = _executor(cfg, run_dir, slurm_role, name)
        if name == "sandbox":
            ex.parameters["map_count"] = sandboxes
        out[name] = ex._make_submission_file_text(ex._submitit_command_str, "dry-run")
    return out


def queue_states(job_ids: Sequence[str]) -> dict[str, str]:
    """{job id: squeue state} for the ids still in the queue (one squeue call).

    Unlike queries.queue this raises when squeue fails for any reason other than "every id has
    left the queue": a controller hiccup must not look like every job died.
    """
    from hpcrl.slurm import parse
    from hpcrl.slurm.command import SlurmCommandError, run_slurm

    if not job_ids:
        return {}
    out = run_slurm(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(job_ids)], check=False)
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return {}
        raise SlurmCommandError(list(out.argv), out.returncode, out.stderr)
    return {r["job_id"]: r["state"] for r in parse.parse_delimited(out.stdout, ("job_id", "state"))}


def _result(folder: Path, job_id: str):
    """A finished job's return value, or an Exception for a failure / missing result."""
    job = submitit.SlurmJob(folder=folder, job_id=job_id)
    path = job.paths.result_pickle
    if not path.exists():
        return RuntimeError(f"job {job_id} left no result (killed or cancelled); see {job.paths.stderr}")
    try:
        outcome, value = submitit.core.utils.pickle_load(path)
    except Exception as exc:  # noqa: BLE001 - a truncated pickle is a failure like any other
        return exc
    return value if outcome == "success" else RuntimeError(str(value)[-800:])


class SupervisorComponent(submitit.helpers.Checkpointable):
    """Watches the run's jobs and resubmits dead ones within the restart budget (see the module doc)."""

    def __init__(self, run_dir, cfg: Config, search_path=(), max_restarts: int = 3, poll_s: float = 2.0):
        self.run_dir, self.cfg, self.search_path = Path(run_dir), cfg, tuple(search_path)
        self.max_restarts, self.poll_s = max_restarts, poll_s

    def __call__(self) -> str:
        from hpcrl.jobs.components import _finish, _start
        from hpcrl.slurm.command import SlurmCommandError

        stop = _start(self.run_dir, SUPERVISOR, SUPERVISOR)
        jobs = _roles(self.cfg, self.run_dir, self.search_path, self.max_restarts)
        self.components = {r.name: r for r in jobs.roles}
        record = read_jobs(self.run_dir)
        while not stop.is_set():
            if (self.run_dir / CANCEL_NAME).exists():
                return "cancelled"
            try:
                done = self.check(record)
            except SlurmCommandError as exc:  # the controller is busy or restarting: try again next poll
                log.warning("%s", exc)
                done = None
            if done:
                return done
            stop.wait(self.poll_s)
        return _finish(stop, "stopped")  # at its own time limit: requeued, it re-reads jobs.json

    def check(self, record: dict) -> str | None:
        """One poll: restart dead components; 'finished' when the learner is done, raise when out of budget."""
        comps = record["components"]
        states = queue_states([c["job_id"] for c in comps.values()])
        for name, c in comps.items():
            state = states.get(c["job_id"])
            if c.get("ended") or (state is not None and state not in TERMINAL):
                continue
            if (self.run_dir / CANCEL_NAME).exists():
                return "cancelled"
            result = _result(_folder(self.run_dir), c["job_id"])
            if name == "learner" and isinstance(result, int) and result >= self.cfg.learner.max_steps:
                self.finish(record)
                return "finished"
            if isinstance(result, dict) and result.get("stopped_by") == "coordinator":
                c["ended"] = True  # told the run is over; the learner is finishing up
                write_jobs(self.run_dir, record)
                continue
            reason = f"job {c['job_id']} {state or 'left the queue'}: {result}"
            if c["restarts"] >= self.max_restarts:
                self.fail(record, f"{name} failed {c['restarts'] + 1} times; last: {reason}")
            if name == "learner":
                for other in comps.values():  # generators told to stop are needed by the resumed learner
                    if other.pop("ended", False):
                        self.resubmit(record, next(k for k, v in comps.items() if v is other))
            c["restarts"] += 1
            log.warning("%s ended (%s); restarting it (%d/%d)", name, reason[:300], c["restarts"], self.max_restarts)
            self.resubmit(record, name)
        return None

    def resubmit(self, record: dict, name: str) -> None:
        role = self.components[name]
        job = _executor(self.cfg, self.run_dir, role.slurm_role, name).submit(role.component)
        c = record["components"][name]
        c["job_id"] = job.job_id
        c["history"].append(job.job_id)
        write_jobs(self.run_dir, record)

    def _cancel_all(self, record: dict) -> None:
        from hpcrl.slurm import queries

        queries.cancel([c["job_id"] for c in record["components"].values()])

    def fail(self, record: dict, message: str) -> None:
        from hpcrl.jobs.runner import RunFailed

        record.update(state="failed", message=message, ended=time.time())
        write_jobs(self.run_dir, record)
        self._cancel_all(record)  # free the nodes
        raise RunFailed(message)

    def finish(self, record: dict, grace_s: float = 30.0) -> None:
        from hpcrl.jobs.transport import Node
        from hpcrl.jobs.transport_rpc import RequestClient

        try:
            with Node(self.run_dir, "hpcrl-supervisor") as node:
                RequestClient(node, "coordinator", timeout_s=2.0, retries=1, discover_timeout_s=1.0).request("stop")
        except Exception as exc:  # noqa: BLE001 - cancelling below still ends everything
            log.warning("could not ask the coordinator to stop: %s", exc)
        gens = [c["job_id"] for n, c in record["components"].items() if n.startswith("gen-")]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(s not in TERMINAL for s in queue_states(gens).values()):
            time.sleep(1.0)
        self._cancel_all(record)  # scancel: SIGTERM, the store flushes and finalizes its shard
        record.update(state="finished", ended=time.time())
        write_jobs(self.run_dir, record)

