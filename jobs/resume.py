"""Continuing a run whose launcher or supervisor died: the run lock, and a supervisor that can be
started again by anyone.

    with run_lock(run_dir):                           # one driver per run: `hpcrl run` holds it for its life
        ...
    ensure_supervisor(run_dir)                        # `hpcrl supervise RUN`: a supervisor job if none is alive
    ensure_supervisor(run_dir, revive=True)           # `hpcrl resume RUN` of a Slurm run (also failed/cancelled)
    local_resume_check(run_dir, cfg)                  # `hpcrl resume RUN` of a local run: safe to start again?
    job_processes(run_dir)                            # this host's processes of the run's jobs, registered or not

A run's components resume from the run directory by themselves (the learner from its newest
whole checkpoint, the store writer from its shard, the coordinator from its state file), so
continuing a run is starting its components again with the same resolved config: locally
that is `hpcrl resume RUN` (a LocalRun over the same plan), on Slurm a new supervisor job,
whose first poll restarts every component that is no longer in the queue.

`ensure_supervisor` is idempotent (under the run lock, and it checks squeue for the recorded
supervisor job first), so a cron entry, a user or a component can call it whenever the
supervisor's heartbeat looks stale. The lock is an flock on `<run>/run.lock`; it holds across
nodes on filesystems that support flock (Lustre with `flock`, GPFS, NFSv4), and the file names
the holder for the error message.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from hpcrl.core.config import RESOLVED_NAME, Config, load_config
from hpcrl.core.files import atomic_write_json, read_json
from hpcrl.core.liveness import read_heartbeats
from hpcrl.slurm.command import outside_job, run_slurm

# hpcrl imports inside functions here would load msgpack, numpy, submitit, torch, zmq for every
# importer of this module (start-up speed).

__all__ = [
    "RunLocked",
    "run_lock",
    "ensure_supervisor",
    "local_resume_check",
    "job_processes",
    "LAUNCH_NAME",
    "write_launch",
]

LOCK_NAME = "run.lock"
LAUNCH_NAME = "launch.json"  # how a local run was launched: executor, domain search path


class RunLocked(RuntimeError):
    """Another process drives this run; the message names it."""


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold the run's lock for the block, or raise RunLocked naming the holder."""
    path = Path(run_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            raise RunLocked(f"{run_dir} is driven by {holder}; stop that first or wait for it to end") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def write_launch(run_dir: str | os.PathLike, executor: str, search_path) -> None:
    atomic_write_json(Path(run_dir) / LAUNCH_NAME, {"executor": executor, "search_path": list(search_path)})


def read_launch(run_dir: str | os.PathLike) -> dict:
    try:
        data = read_json(Path(run_dir) / LAUNCH_NAME)
    except (OSError, ValueError):
        data = None
    return data if isinstance(data, dict) else {}


def load_run_config(run_dir: str | os.PathLike) -> Config:
    return load_config(Path(run_dir) / RESOLVED_NAME)


def finished_step(run_dir: str | os.PathLike) -> int:
    """The learner's step in its last cursor (0 before the first checkpoint)."""
    from hpcrl.rl.learner.service import CURSOR_NAME

    try:
        return int(json.loads((Path(run_dir) / CURSOR_NAME).read_text()).get("step", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def job_processes(run_dir: str | os.PathLike) -> list[int]:
    """Pids of this host's processes that run one of the run's submitit jobs, its controller
    (`submitit.local._local FOLDER`) or its task (`... submitit.core._submit FOLDER`), FOLDER
    being `<run>/submitit`. Unlike procs/ records this sees a job from its first instruction: a
    job the dead launcher submitted just before it died is still importing, and registers later."""
    folder = (Path(run_dir) / "submitit").resolve()
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE or not any(w.startswith("submitit.") for w in cmd[:-1]):
                continue
            last = Path(cmd[-1])
            if (last if last.is_absolute() else Path(proc.cwd()) / last).resolve() == folder:
                out.append(proc.pid)
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or not ours to read
    return sorted(out)


def local_resume_check(run_dir: str | os.PathLike, cfg: Config, wait_s: float = 120.0) -> str | None:
    """None when the local run can be started again; else why not. Components left from the
    dead launcher stop by themselves (they watch it): this waits up to `wait_s` for them, and
    for every process of the run's jobs (`job_processes`): a job still starting when its launcher
    died has no procs/ record yet, and would otherwise run beside the resumed one (two store
    writers on one shard, an old endpoint file written over the new one)."""
    from hpcrl.jobs.localrun import pids

    if cfg.executor != "local":
        return f"{run_dir} is a Slurm run (executor: {cfg.executor}); `hpcrl resume` submits its supervisor instead"
    if finished_step(run_dir) >= cfg.learner.max_steps:
        return f"{run_dir} is finished (the learner reached learner.max_steps={cfg.learner.max_steps})"
    roles = ("coordinator", "store", "learner", "gen", "sandbox")

    def alive() -> dict[str, list[int]]:
        found = {r: pids(run_dir, r) for r in roles}
        found["jobs"] = job_processes(run_dir)
        return {k: v for k, v in found.items() if v}

    deadline = time.monotonic() + wait_s
    while left := alive():
        if time.monotonic() > deadline:
            return f"processes of {run_dir} are still running {left}; stop them (kill PID) and resume again"
        time.sleep(0.5)
    return None


def _hung(run_dir: Path, name: str, job_id: str, state: str, started: float | None, stale_s: float | None) -> bool:
    """A RUNNING supervisor job whose heartbeat (or, before its first, its start) is older than
    stale_s. A pending one is never hung: it has not had its chance yet."""

    if stale_s is None or state != "RUNNING":
        return False
    beats = [b["time"] for b in read_heartbeats(run_dir, name) if str(b.get("job_id")) == job_id]
    last = max(beats, default=started or time.time())
    return time.time() - last > stale_s


def ensure_supervisor(run_dir: str | os.PathLike, revive: bool = False, stale_s: float | None = None) -> str:
    """Submit a supervisor job for a Slurm run unless one is alive; returns what it did.

    `revive`: also continue a run that failed (its restart budgets start afresh) or was cancelled;
    without it those are left alone (a cron job must not undo an operator's `hpcrl cancel`).
    `stale_s`: a supervisor job RUNNING with a heartbeat older than this is hung: cancelled and
    replaced (without it, any supervisor still in the queue counts as alive)."""
    from hpcrl.jobs.launch import SUPERVISOR, read_jobs, slurm_executor, write_jobs
    from hpcrl.jobs.supervise import CANCEL_NAME, SupervisorComponent, queue_jobs

    run_dir = Path(run_dir)
    with run_lock(run_dir):
        record = read_jobs(run_dir)
        if record is None:
            raise ValueError(f"{run_dir} has no jobs.json: not a Slurm run (use `hpcrl resume` for a local one)")
        state = record.get("state")
        if state == "finished":
            return f"run {run_dir.name} is finished; nothing to do"
        if state in ("failed", "cancelled") and not revive:
            return f"run {run_dir.name} is {state}; `hpcrl resume {run_dir}` continues it"
        sup = (record.get("supervisor") or {}).get("job_id")
        queued = queue_jobs([sup]) if sup else {}
        if sup in queued:
            state, started = queued[sup]
            if not _hung(run_dir, SUPERVISOR, sup, state, started, stale_s):
                return f"supervisor job {sup} is alive; nothing to do"
            # RUNNING, and its main loop has not turned for stale_s: a hung supervisor is as
            # good as none, and it would never give way by itself.
            run_slurm(["scancel", sup], check=False)
        if revive and state in ("failed", "cancelled"):
            (run_dir / CANCEL_NAME).unlink(missing_ok=True)
            for c in record["components"].values():
                c["restart_times"] = []  # an operator's decision to go on: budgets start afresh
                c.pop("restart_due", None)
                c.pop("ended", None)
            record.update(state="running", message="")
        cfg = load_run_config(run_dir)
        with outside_job():  # called from a component's job too: its environment is not the supervisor's
            job = slurm_executor(cfg, run_dir, "coordinator", SUPERVISOR).submit(
                SupervisorComponent(run_dir, cfg, tuple(record.get("search_path", ())))
            )
        history = [*(record.get("supervisor") or {}).get("history", []), job.job_id]
        record["supervisor"] = {"job_id": job.job_id, "history": history}
        record["state"] = "running"
        write_jobs(run_dir, record)
        return f"submitted supervisor job {job.job_id} for run {run_dir.name}"
