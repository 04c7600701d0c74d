"""The process inside a rollout job (or an owner's idle window): claim a task that fits, run it, store it.

    python -m hpcrl.slurm.backfill.worker --queue RUN/rollout-queue --owner slurm-$SLURM_JOB_ID \
        --runner hpcrl.slurm.backfill.worker:synthetic --margin-s 5

Inside a Slurm job the deadline is the job's EndTime (Slurm may have cut the limit down to
--time-min to fit a backfill window, so the script's own --time is not the truth); outside,
it is --until (epoch seconds). The worker asks a `GapPacker` (the scheduler's own decision
code) for the oldest pending task whose estimate fits before the deadline, claims it,
runs it and stores the result atomically; it exits 0 when nothing fits any more, which hands
the GPU back early. SIGTERM or SIGINT (scancel, the time limit, preemption, an owner
reclaiming its GPU) stops the running task without storing anything for it and exits 143;
the coordinator re-issues the task (DirTaskQueue.release).

A runner is `module:function` taking (task, payload, stop: threading.Event) and returning a
result dict, or None when `stop` interrupted it. `synthetic` is the dev cluster's stand-in
for generation on its fake GPUs: it holds the GPU for payload["work_s"] seconds.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hpcrl.slurm.backfill.packer import GapPacker, RolloutTask
from hpcrl.slurm.backfill.taskqueue import DirTaskQueue

Runner = Callable[[RolloutTask, dict, threading.Event], "dict | None"]


@dataclass(frozen=True)
class WindowReport:
    owner: str
    started: float
    ended: float
    tasks_done: int
    busy_s: float  # time spent running tasks that completed
    stopped: bool  # interrupted (signal / stop event) rather than out of fitting work


def synthetic(task: RolloutTask, payload: dict, stop: threading.Event) -> dict | None:
    """Hold the (fake) GPU for payload['work_s'] seconds; None if stopped before the end."""
    work = float(payload.get("work_s", task.est_s))
    if stop.wait(work):
        return None
    return {"work_s": work}


def load_runner(spec: str) -> Runner:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--runner {spec!r}: expected module:function, e.g. hpcrl.slurm.backfill.worker:synthetic")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--runner {spec!r}: cannot load it ({exc})") from None
    if not callable(fn):
        raise ValueError(f"--runner {spec!r}: {attr} is not callable")
    return fn


def run_window(
    queue: DirTaskQueue,
    owner: str,
    until: float,
    runner: Runner,
    stop: threading.Event,
    margin_s: float = 0.0,
    clock: Callable[[], float] = time.time,
) -> WindowReport:
    """Run fitting tasks from `queue` until `until` (epoch s), nothing fits, or `stop` is set."""
    started = clock()
    done, busy = 0, 0.0
    while not stop.is_set():
        now = clock()
        packer = GapPacker(margin_s=margin_s)
        for t in queue.pending_tasks():
            packer.submit(t, now)
        placement = packer.open_window("gpu", now, max(until, now))
        if placement is None:
            break
        task = placement.task
        if not queue.claim(task.task_id, owner):
            continue  # another worker was faster; look again
        _, payload = queue.claimed_payload(task.task_id, owner)
        t0 = clock()
        result = runner(task, payload, stop)
        t1 = clock()
        if result is None:
            break  # interrupted: the claim stays until the coordinator re-issues it
        queue.complete(
            task.task_id,
            owner,
            {
                **result,
                "task_id": task.task_id,
                "domain": task.domain,
                "owner": owner,
                "start": t0,
                "end": t1,
                "job_id": os.environ.get("SLURM_JOB_ID", ""),
                "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            },
        )
        done += 1
        busy += t1 - t0
    return WindowReport(owner, started, clock(), done, busy, stop.is_set())


def slurm_deadline(job_id: str) -> float:
    """The job's EndTime as epoch seconds (Slurm prints local time)."""
    from hpcrl.slurm import parse, queries

    rec = queries.show_job(job_id)
    end = parse.parse_timestamp(rec.get("EndTime", "")) if rec else None
    if end is None:
        raise RuntimeError(f"Slurm job {job_id} has no EndTime (scontrol show job {job_id})")
    return end.timestamp()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcrl.slurm.backfill.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", required=True, help="the task queue folder (DirTaskQueue)")
    ap.add_argument("--owner", required=True, help="claim name, e.g. slurm-$SLURM_JOB_ID")
    ap.add_argument("--until", type=float, help="deadline, epoch seconds (default: the Slurm job's EndTime)")
    ap.add_argument(
        "--runner", default="hpcrl.slurm.backfill.worker:synthetic", help="module:function that runs one task"
    )
    ap.add_argument("--margin-s", type=float, default=5.0, help="stop starting tasks this long before the deadline")
    args = ap.parse_args(argv)
    try:
        runner = load_runner(args.runner)
        if args.margin_s < 0:
            raise ValueError(f"--margin-s must be >= 0 (got {args.margin_s})")
        if args.until is not None:
            until = args.until
        elif os.environ.get("SLURM_JOB_ID"):
            until = slurm_deadline(os.environ["SLURM_JOB_ID"])
        else:
            raise ValueError("--until is required outside a Slurm job")
        if not os.path.isdir(args.queue):
            raise ValueError(f"--queue {args.queue}: no such folder")
    except ValueError as exc:
        print(f"rollout_worker: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    report = run_window(DirTaskQueue(args.queue), args.owner, until, runner, stop, args.margin_s)
    print(
        f"rollout_worker {args.owner}: {report.tasks_done} task(s), busy {report.busy_s:.1f} s of "
        f"{report.ended - report.started:.1f} s, {'stopped by signal' if report.stopped else 'no fitting work left'}",
        flush=True,
    )
    return 143 if report.stopped else 0


if __name__ == "__main__":
    sys.exit(main())
