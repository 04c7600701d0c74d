"""The live rollout planner's decision time on synthetic queue snapshots, up to 10,000 GPUs and 100,000 pending jobs.

    .venv/bin/python bench/planner.py            # about a minute on 2 cores
    .venv/bin/python bench/planner.py --json     # [{"gpus", "pending", "decision_ms", "read_ms"}, ...]
    .venv/bin/python bench/planner.py --quick    # the smaller sizes only

A decision is one supervisor tick of the live planner's rounds on one snapshot
(slurm/backfill/book.py `SlurmRollouts`: which pending rollout jobs to withdraw, which running
ones give way to another user's job, the window and the rollout jobs sized to it), the code a
run's supervisor and `hpcrl sim` run. The snapshot is a busy partition of 8-GPU nodes: nodes
mostly allocated, a few GPUs idle here and there, 1-8 GPU jobs running and pending with Slurm's
expected starts and planned nodes, 64 of the run's rollout jobs running and 4 pending. Timed
apart (`read_ms`): building that snapshot from the text of squeue --start, squeue, scontrol show
node and partition through slurm/queries.py's parsers (the commands themselves are not run).
Goal: a decision under 100 ms at 10,000 GPUs and 100,000 pending jobs, and linear or better in
the pending jobs: the last column is the time per pending job, relative to the smallest size.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import subprocess
import sys
import time

SIZES = [(80, 100), (800, 1_000), (2_000, 10_000), (10_000, 10_000), (10_000, 100_000)]
NOW = dt.datetime(2026, 12, 7, 12, 0, 0)


def synthetic(gpus: int, pending: int, seed: int = 1):
    """(text each Slurm command prints, the run's record of its rollout jobs)."""
    rng = random.Random(seed)
    n_nodes = gpus // 8
    nodes = [f"g{i:05d}" for i in range(n_nodes)]
    node_lines, running_lines, record = [], [], {}
    job_id = 1_000_000
    ours = 0
    for name in nodes:
        used = 8 if rng.random() < 0.8 else rng.randint(4, 7)  # most full, some with a few idle GPUs
        left = used
        while left > 0:
            g = min(left, rng.choice([1, 2, 4, 8]))
            left -= g
            job_id += 1
            end = NOW + dt.timedelta(seconds=rng.randint(60, 86_400))
            mine = ours < 64 and g == 1 and used < 8 and rng.random() < 0.5
            running_lines.append(
                f"{job_id}|gpu|1|gres:gpu:{g}|{name}|{end:%Y-%m-%dT%H:%M:%S}|{'rollout' if mine else 'x'}|{8 * g}|"
                f"{64 * g}G"
            )
            if mine:
                ours += 1
                record[f"rollout-{ours}"] = {
                    "job_id": str(job_id),
                    "state": "active",
                    "gpus": 1,
                    "pending": False,
                    "submitted": 0.0,
                }
        node_lines.append(
            f"NodeName={name} State=MIXED Partitions=gpu CPUTot=64 CPUAlloc={8 * used} RealMemory=524288 "
            f"AllocMem={65536 * used} CfgTRES=cpu=64,mem=512G,billing=64,gres/gpu=8 "
            f"AllocTRES=cpu={8 * used},mem={64 * used}G,gres/gpu={used}"
        )
    pending_lines = []
    for i in range(pending):
        job_id += 1
        g = rng.choice([1, 1, 2, 4, 8])
        start = NOW + dt.timedelta(seconds=rng.randint(30, 7 * 86_400))
        limit = rng.choice(["1:00:00", "4:00:00", "1-00:00:00"])
        reason = "Resources" if i == 0 else rng.choice(["Priority", "Priority", "Priority", "JobHeldUser"])
        name = "x"
        if i < 4:  # the run's pending rollout jobs, left there by Slurm
            name, reason = "rollout", "Priority"
            record[f"pending-{i}"] = {
                "job_id": str(job_id),
                "state": "active",
                "gpus": 1,
                "pending": True,
                "submitted": 0.0,
            }
        pending_lines.append(
            f"{job_id}|gpu|u{i % 500}|1|{8 * g}|{limit}|{start:%Y-%m-%dT%H:%M:%S}|{rng.randint(1, 10**6)}|"
            f"gres:gpu:{g}|{reason}|{rng.choice(nodes)}|{name}|{64 * g}G"
        )
    partition = f"PartitionName=gpu State=UP Nodes=g[00000-{n_nodes - 1:05d}] MaxTime=UNLIMITED"
    texts = {
        "show node": "\n".join(node_lines),
        "show partition": partition,
        "--start": "\n".join(pending_lines),
        "RUNNING": "\n".join(running_lines),
    }
    return texts, record


def read(texts: dict):
    """The live adapter's read_snapshot, its commands answered from `texts`."""
    from hpcrl.slurm import queries
    from hpcrl.slurm.backfill import live

    def fake(argv, **_):
        key = next(k for k in texts if k in " ".join(argv))
        return subprocess.CompletedProcess(argv, 0, texts[key] + "\n", "")

    real = queries.run_slurm
    queries.run_slurm = fake
    try:
        snap = live.read_snapshot({"bf_interval": "30", "bf_resolution": "60"})
    finally:
        queries.run_slurm = real
    return snap


class Fixed:
    """book.Cluster answering from one snapshot (its squeue -j answer prepared beforehand)."""

    def __init__(self, snap, ids):
        self.snap = snap
        states = {j.job_id: "PENDING" for j in snap.pending} | {j.job_id: "RUNNING" for j in snap.running}
        self.states = {j: states[j] for j in ids if j in states}
        self.cancelled: list[str] = []

    def snapshot(self):
        return self.snap

    def job_states(self, ids):
        return self.states

    def preempt_time(self, job_id):
        return None

    def cancel(self, ids):
        self.cancelled += list(ids)


def decide(snap, record: dict) -> tuple[float, dict]:
    """One tick of the live rounds on `snap`: seconds, and what it decided."""
    from hpcrl.core.config import SchedulerConfig
    from hpcrl.slurm.backfill.book import SlurmRollouts
    from hpcrl.slurm.backfill.planner import PlanSettings, RolloutJobSize
    from hpcrl.slurm.sbatch import Resources

    jobs = {k: dict(v) for k, v in record.items()}
    cluster = Fixed(snap, [r["job_id"] for r in jobs.values()])
    need = Resources(partition="gpu", gpus_per_node=1, cpus_per_task=8, mem_mb=65536)
    rounds = SlurmRollouts(cluster, PlanSettings("gpu", 1, 60, SchedulerConfig(), need), withdraw_after_s=64.0)
    sized: list[RolloutJobSize] = []
    t0 = time.perf_counter()
    rounds.reap(jobs, 1000.0)
    rounds.plan(jobs, 1000.0, 16, 16, 30.0, lambda s: sized.append(s) or (f"new-{len(sized)}", "0"))
    elapsed = time.perf_counter() - t0
    return elapsed, {
        "withdrawn": sum(1 for r in jobs.values() if r.get("withdrawn")),
        "gave_way": sum(1 for r in jobs.values() if r.get("yielded_to")),
        "submitted": len(sized),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON list")
    ap.add_argument("--quick", action="store_true", help="only the sizes up to 2,000 GPUs")
    ap.add_argument("--rounds", type=int, default=5, help="decisions timed per size (median)")
    args = ap.parse_args()
    rows = []
    for gpus, pending in SIZES[:3] if args.quick else SIZES:
        texts, record = synthetic(gpus, pending)
        reads, decisions, what = [], [], {}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            snap = read(texts)
            reads.append(time.perf_counter() - t0)
            s, what = decide(snap, record)
            decisions.append(s)
        rows.append(
            {
                "gpus": gpus,
                "pending": pending,
                "decision_ms": statistics.median(decisions) * 1000,
                "read_ms": statistics.median(reads) * 1000,
                "decided": what,
            }
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    base = rows[0]["decision_ms"] / rows[0]["pending"]
    print(f"{'GPUs':>7} {'pending':>8} {'decision ms':>12} {'read ms':>9} {'per pending job vs smallest':>28}  decided")
    for r in rows:
        per = r["decision_ms"] / r["pending"] / base
        d = r["decided"]
        print(
            f"{r['gpus']:>7,} {r['pending']:>8,} {r['decision_ms']:>12.2f} {r['read_ms']:>9.1f} {per:>27.2f}x  "
            f"{d['withdrawn']} withdrawn, {d['gave_way']} gave way, {d['submitted']} submitted"
        )
    top = rows[-1]
    verdict = "met" if top["decision_ms"] < 100 else "NOT met"
    print(f"goal < 100 ms per decision at {top['gpus']:,} GPUs and {top['pending']:,} pending: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
