"""Naive vs backfill-aware rollout submission on the real dev Slurm cluster (issue 7, item 4).

    make devcluster && .venv/bin/python bench/backfill_cluster.py          # about 4 minutes

Each run: our learner job holds one node's 4 GPUs (--time=2) and alternates training and
idle phases (waiting for data, syncing weights); another user's job that needs all 8 GPUs
queues behind it, a second user's small job too; 40 rollout tasks with heavy-tailed
durations from 4 domains are pending.
* naive: 4 rollout jobs with the usual long limit (--time=10). Slurm cannot start them
  before the queued 8-GPU job without delaying it, so they wait for the learner and that
  job to finish; the learner's idle phases stay idle.
* backfill: the planner sizes rollout jobs to the window that squeue --start reveals
  (--time/--time-min), so backfill starts them at once on the free node, and the learner
  lends its idle phases to rollout tasks through the same GapPacker, taking the GPUs back on
  time (a task still running is stopped and re-issued).
Both runs drain the same task queue with the same worker; only submission differs. Printed:
makespan, idle GPU-seconds over the run (8 GPUs), when the other user's job started, ratios.
Only this script's own jobs are cancelled (by id); other jobs in the queue are waited out
first and reported if they overlap.

Inside the learner job the same file runs the learner stand-in: `backfill_cluster.py learner ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPUS_TOTAL = 8
LEARNER_S, TRAIN_S, IDLE_S = 60.0, 6.0, 6.0
OTHER_BIG_S, OTHER_SMALL_S = 10, 15
N_TASKS = 40
DOMAINS = {"code": 2.0, "math": 3.0, "agent": 4.0, "cad": 6.0}  # median seconds, lognormal sigma 0.7


def task_set(seed: int = 7):
    """Heavy-tailed rollout tasks, with estimates (p90) from earlier history of each domain."""
    from hpcrl.slurm.backfill.estimates import DurationEstimator
    from hpcrl.slurm.backfill.packer import RolloutTask

    rng = random.Random(seed)
    draw = lambda d: min(DOMAINS[d] * math.exp(0.7 * rng.gauss(0, 1)), 25.0)
    history = DurationEstimator(history=256, min_samples=8)
    for d in DOMAINS:
        for _ in range(200):
            history.record(d, draw(d))
    out = []
    for i in range(N_TASKS):
        d = rng.choice(list(DOMAINS))
        out.append((RolloutTask(i, d, est_s=history.quantile(d, 0.9)), {"work_s": round(draw(d), 2)}))
    return out


# ------------------------------------------------------------------------------ in the learner's job
def learner_main(args: argparse.Namespace) -> int:
    """Alternate training and idle phases; in backfill mode lend each idle phase to rollout tasks."""
    from hpcrl.slurm.backfill.taskqueue import DirTaskQueue
    from hpcrl.slurm.backfill.worker import run_window, synthetic

    queue = DirTaskQueue(args.queue)
    job = os.environ.get("SLURM_JOB_ID", "local")
    gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if g]
    quit_ = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: quit_.set())
    phases, start, reissued = [], time.time(), 0
    end = start + args.duration
    while time.time() < end and not quit_.is_set():
        t0 = time.time()
        quit_.wait(min(args.train_s, end - t0))
        phases.append(["train", t0, time.time()])
        t1 = time.time()
        until = min(t1 + args.idle_s, end)
        if args.mode == "backfill" and until > t1:
            reclaim = threading.Event()  # the learner needs its GPUs back at `until`, no later
            timer = threading.Timer(until - t1, reclaim.set)
            timer.start()
            owners = [f"learner-{job}-g{g}" for g in gpus]
            threads = [
                threading.Thread(target=run_window, args=(queue, o, until, synthetic, reclaim, 0.2)) for o in owners
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            timer.cancel()
            for o in owners:  # tasks cut off by the reclaim go back to the queue
                reissued += len(queue.release(o))
        quit_.wait(max(until - time.time(), 0.0))
        phases.append(["idle", t1, time.time()])
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": len(gpus), "phases": phases, "reissued": reissued}))
    os.replace(tmp, args.out)
    return 0


# ------------------------------------------------------------------------------ the driver
def submit(tmp: Path, name: str, body: str, *, nodes: int, gpus: int, time_min: int) -> str:
    from hpcrl.slurm.sbatch import Resources, render_script, submit_script, write_script

    text = render_script(
        [Resources(partition="gpu", time_min=time_min, nodes=nodes, gpus_per_node=gpus, mem_mb=512)],
        [body],
        job_name=name,
        output=str(tmp / f"{name}-%j.out"),
    )
    return submit_script(write_script(text, tmp / f"{name}.sh"))


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def others_on_gpu(own: set[str]) -> list[dict]:
    from hpcrl.slurm import queries

    return [r for r in queries.queue() if r["partition"] == "gpu" and r["job_id"].split("_")[0] not in own]


def run_mode(mode: str, workdir: Path) -> dict:
    from hpcrl.core.config import SchedulerConfig
    from hpcrl.slurm import queries
    from hpcrl.slurm.backfill.planner import BackfillPlanner, RolloutJobs, live_window
    from hpcrl.slurm.backfill.taskqueue import DirTaskQueue

    tmp = workdir / mode
    tmp.mkdir(parents=True)
    queue = DirTaskQueue(tmp / "queue")
    for task, payload in task_set():
        queue.put(task, payload)
    jobs = RolloutJobs(
        queue, partition="gpu", log_dir=tmp / "logs", worker_margin_s=1.0, job_name=f"hpcrl-rollout-{mode}"
    )
    # The dev cluster runs backfill every second (bf_interval=1, sched_interval=2): a 5 s margin
    # covers the wait for the next pass. Real clusters default to bf_interval=30 (config: 30 s).
    planner = BackfillPlanner(SchedulerConfig(job_overhead_s=5.0, slurm_margin_s=5.0), unbounded_time_min=10)
    own: list[str] = []
    reissued = 0
    try:
        busy_before = others_on_gpu(set())
        if busy_before:
            print(f"  waiting for {len(busy_before)} other job(s) on the gpu partition to finish ...", flush=True)
            wait_until(lambda: not others_on_gpu(set()), 240, "the gpu partition to be free of other jobs", 2.0)
        phases_file = tmp / "learner.json"
        learner = submit(
            tmp,
            f"hpcrl-learner-{mode}",
            f"exec {sys.executable} {Path(__file__).resolve()} learner --mode {mode} --queue {queue.root} "
            f"--duration {LEARNER_S} --train-s {TRAIN_S} --idle-s {IDLE_S} --out {phases_file}",
            nodes=1,
            gpus=4,
            time_min=2,
        )
        own.append(learner)
        wait_until(
            lambda: any(r["state"] == "RUNNING" for r in queries.queue(job_ids=[learner])), 60, "the learner to run"
        )
        big = submit(tmp, "other-lab-pretrain", f"sleep {OTHER_BIG_S}", nodes=2, gpus=4, time_min=1)
        small = submit(tmp, "other-lab-eval", f"sleep {OTHER_SMALL_S}", nodes=1, gpus=1, time_min=1)
        own += [big, small]
        if mode == "naive":
            for _ in range(4):  # the usual way: a fixed number of jobs with a generous limit
                own.append(jobs.submit_one(time_limit_min=10).job_id)
        while True:
            reissued += len(jobs.poll())
            counts = queue.counts()
            if counts["done"] == N_TASKS and not queries.queue(job_ids=own):
                break
            if mode == "backfill" and counts["pending"]:
                # (an empty job_ids list would mean "every job" to squeue)
                rows = {r["job_id"]: r for r in queries.queue(job_ids=tuple(jobs.active))} if jobs.active else {}
                if not any(r["state"] == "PENDING" for r in rows.values()):
                    # Capacity our running rollout jobs still have, against the work still pending.
                    left = sum(
                        max((queries_time_left(r) or 0) - 5.0, 0.0) for r in rows.values() if r["state"] == "RUNNING"
                    )
                    work = sum(planner.estimate(t) for t in queue.pending_tasks())
                    if work > left:
                        window = live_window("gpu", exclude=(learner, *jobs.active))  # other users' jobs count
                        plan = planner.plan(window, queue.pending_tasks())
                        if plan is not None:
                            own += [j.job_id for j in jobs.submit(plan)]
                            log(
                                f"window {window.length_s:.0f} s on {window.gpus_idle} idle GPU(s): {plan.jobs} job(s) "
                                f"--time={plan.time_limit_min} --time-min={plan.time_min_min}"
                            )
            time.sleep(1.0)
        intruders = [r for r in others_on_gpu(set(own))]
    finally:
        queries.cancel([j for j in own if queries.queue(job_ids=[j])])
    return measure(mode, queue, own, learner, big, small, phases_file, reissued, intruders)


_T0 = time.monotonic()


def log(msg: str) -> None:
    if os.environ.get("HPCRL_BENCH_VERBOSE"):
        print(f"  [{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def queries_time_left(row: dict) -> float | None:
    from hpcrl.slurm.parse import parse_duration_s

    return parse_duration_s(row.get("time_left", ""))


def measure(mode, queue, own, learner, big, small, phases_file, reissued, intruders) -> dict:
    """Busy and idle GPU-seconds over [learner start, last end] from sacct, the learner's own
    phase log and every rollout result; other users' jobs count as busy for their whole run."""
    from hpcrl.slurm import queries

    def settled():
        recs = queries.job_records(own)
        ok = all(r.start and r.end for j, r in recs.items() if j in own) and len(recs) >= len(own)
        return recs if ok else None

    recs = wait_until(settled, 60, "accounting records of every job")
    t0 = recs[learner].start.timestamp()
    t_end = max(r.end.timestamp() for r in recs.values())
    results = queue.results()
    task_s = sum(r["end"] - r["start"] for r in results.values())
    learner_log = json.loads(Path(phases_file).read_text())
    train_s = sum(e - s for kind, s, e in learner_log["phases"] if kind == "train") * learner_log["gpus"]
    others_s = sum((recs[j].end - recs[j].start).total_seconds() * g for j, g in ((big, 8), (small, 1)))
    makespan = t_end - t0
    busy = task_s + train_s + others_s
    return {
        "mode": mode,
        "makespan_s": makespan,
        "capacity_gpu_s": GPUS_TOTAL * makespan,
        "busy_gpu_s": busy,
        "idle_gpu_s": GPUS_TOTAL * makespan - busy,
        "rollout_task_gpu_s": task_s,
        "tasks_done": len(results),
        "tasks_in_learner_gaps": sum(1 for r in results.values() if r["owner"].startswith("learner-")),
        "reissued": reissued + learner_log["reissued"],
        "other_job_start_after_learner_end_s": (recs[big].start - recs[learner].end).total_seconds(),
        "other_job_start_s": recs[big].start.timestamp() - t0,
        "intruding_jobs": len(intruders),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    lp = sub.add_parser("learner", help="(inside the learner's Slurm job) the learner stand-in")
    lp.add_argument("--mode", choices=("naive", "backfill"), required=True)
    lp.add_argument("--queue", required=True)
    lp.add_argument("--duration", type=float, required=True)
    lp.add_argument("--train-s", type=float, required=True)
    lp.add_argument("--idle-s", type=float, required=True)
    lp.add_argument("--out", required=True)
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON too")
    ap.add_argument(
        "--keep", metavar="DIR", help="keep queues, logs and scripts under DIR (default: a temporary folder)"
    )
    args = ap.parse_args()
    if args.cmd == "learner":
        return learner_main(args)
    if not os.environ.get("SLURM_CONF"):
        env = os.popen(f"{sys.executable} -m hpcrl.slurm.devcluster env").read()
        for line in env.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            os.environ[key] = value.strip("'")
    from hpcrl.slurm import queries
    from hpcrl.slurm.command import SlurmCommandError

    try:
        queries.partitions()
    except SlurmCommandError as exc:
        print(f"backfill_cluster: the dev cluster does not answer (run `make devcluster`): {exc}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    out = []
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-backfill-") as d:
        if args.keep:
            d = args.keep
        for mode in os.environ.get("HPCRL_BENCH_MODES", "naive,backfill").split(","):
            print(f"running {mode} submission ...", flush=True)
            out.append(run_mode(mode, Path(d)))
    if len(out) != 2:
        print(json.dumps(out, indent=2))
        return 0
    naive, bf = out
    print(
        f"\nnaive vs backfill-aware rollout submission, dev cluster ({GPUS_TOTAL} fake GPUs), "
        f"{N_TASKS} heavy-tailed rollout tasks, wall {time.monotonic() - t_start:.0f} s"
    )
    print(f"{'':28}{'naive':>10}{'backfill':>10}{'ratio':>8}")
    for key, label in (("makespan_s", "makespan, s"), ("idle_gpu_s", "idle GPU-seconds")):
        print(f"{label:28}{naive[key]:>10.0f}{bf[key]:>10.0f}{naive[key] / bf[key]:>7.2f}x")
    for key, label in (
        ("busy_gpu_s", "busy GPU-seconds"),
        ("rollout_task_gpu_s", "rollout task GPU-seconds"),
        ("tasks_done", "tasks done"),
        ("tasks_in_learner_gaps", "  of them in learner gaps"),
        ("reissued", "cut off by a reclaim, re-run"),
        ("other_job_start_s", "other user's job start, s"),
        ("other_job_start_after_learner_end_s", "  after our learner ended, s"),
    ):
        print(f"{label:28}{naive[key]:>10.0f}{bf[key]:>10.0f}")
    for r in out:
        if r["intruding_jobs"]:
            print(
                f"note: {r['intruding_jobs']} job(s) of other users shared the gpu partition during the {r['mode']} run"
            )
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
