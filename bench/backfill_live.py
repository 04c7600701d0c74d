"""Backfill rollout jobs in a real run on the dev Slurm cluster: do they fill the partition's holes
without delaying anyone?

    make devcluster && .venv/bin/python bench/backfill_live.py [--json] [--seed 7]   # about 6 minutes
    .venv/bin/python bench/backfill_live.py --rollout-partition scavenger   # Slurm preempts them
    .venv/bin/python bench/backfill_live.py --keep /tmp/bflive   # keep the runs' logs to read after
    .venv/bin/python bench/backfill_live.py --set scheduler.give_way_interval_s=2   # any override

The same hpcrl run (`hpcrl submit`, tiny policy, the default domains; learner and one generator,
2 of the 8 GPUs) twice, under the same background workload of other jobs on the gpu partition:
a seeded mix of 1-, 2- and 4-GPU jobs whose time limits are 2-4x what they run (as users ask),
so Slurm plans them by their limits and holes open when they end early or wait for a whole
node. They are submitted held before the run and released together (t0) once the run's learner
has published weights, so both runs see the same queue from the same moment.

* baseline: scheduler.max_rollout_jobs=0: the run's fixed components only;
* backfill: up to --rollout-jobs rollout jobs (1 GPU each) that the run's supervisor sizes to
  the windows squeue --start shows (jobs/rollout_plan.py); with --rollout-partition they are
  submitted to that preemptible partition (scheduler.rollout_partition: the dev cluster's
  `scavenger`), so Slurm preempts one that blocks a background job (the planner's give-way then
  waits scheduler.rollout_yield_after_s before it cancels one itself).

Each run is measured over [t0, the last background job's end] from sacct (1 s resolution), then
cancelled (`hpcrl cancel`: its rollout jobs too, by id). Printed: hole_gpu_h (idle GPU-hours of
the partition in the baseline), fillable_gpu_h (the part of them where a rollout job of the
generator role's GPUs, CPUs and memory fits beside the jobs there, the planner's own rule),
filled_gpu_h (GPU-hours rollout jobs held in the backfill run over the same span),
filled_fraction and filled_of_fillable, rollout_jobs {submitted, started, ended_in_window: ended
before the window they were sized to closed, gave_way: cancelled by the planner, preempted: by
Slurm, withdrawn: pending past scheduler.rollout_withdraw_s, cancelled before they ran},
trained_from_rollout_jobs, lost and duplicated (rl/audit/audit.py account: must be 0), max_delay_s
(largest start delay of a background job, backfill vs baseline, each from its t0, read from the
job's own clock as it starts: sacct's whole seconds cannot tell a delay from the 1-s
bf_interval; max_delay_sacct_s beside) against bf_interval_s, max_added_wait_s (each background
job's wait after the node it started on had its GPUs free, rollout jobs not counted, from its
own clocks at its start and at its predecessors' ends, backfill minus baseline: a delay the
rollout jobs added, apart from the delays a chain of jobs carries from one to the next),
max_blocked_by_rollout_s (within the backfill run: the longest a background job pended while
Slurm, as backfill_measure.startable_now reckons its plan from the jobs' limits, would have
started it but for the rollout jobs; free of the pass timing two runs differ by) with
max_startable_s beside it (the longest one pended while that reckoning said Slurm would start
it anyway: about a pass where it plans as Slurm does), and per run the partition's busy
GPU-hours, trajectories trained, trained per hpcrl GPU-hour, the reward at the end,
holes_by_node and memory_mb (each of the run's jobs: sacct's sampled peak against its request).
The run's jobs ask for memory as they use it (SMALL below); `--set-both slurm.generator.mem_gb=4`
and the like restore config.yaml's requests in both runs.
Only this script's own jobs are cancelled, by id; it refuses to start while other jobs are queued.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backfill_measure import Stretch, holes_by_node, overlap_s, pending_time, waits_after_free

ROOT = Path(__file__).resolve().parents[1]
GPUS_TOTAL = 8
SMALL = [  # one- to ten-minute jobs, as tests/test_submit.py runs them
    "executor=slurm",
    *(f"slurm.{r}.time_min=10" for r in ("coordinator", "learner", "generator", "sandbox")),
    *(f"slurm.{r}.signal_delay_s=30" for r in ("coordinator", "learner", "generator", "sandbox")),
    # Memory asked as used: sacct's MaxRSS of these jobs on the dev cluster (2026-12-06) was 53-89 MB
    # (store, coordinator, supervisor), 487 MB (learner) and 379 MB (a generator): each gets 2.7-10x that.
    # At config.yaml's 2/4/4 GB the run's own jobs held 14 of n1's 16 GB, and no rollout job fit
    # beside them: over a third of every hole was on n1 (printed per run as holes_by_node).
    "slurm.coordinator.mem_gb=0.5",
    "slurm.learner.mem_gb=2",
    "slurm.generator.mem_gb=1",
    "learner.max_steps=1000000",
    "generators.episodes_in_flight=16",  # one small fixed generator: the coordinator has work to lend
    "scheduler.policy=backfill",
    "scheduler.plan_interval_s=2",
    "scheduler.prior_s=5",
    "scheduler.rollout_drain_s=5",
    "scheduler.job_overhead_s=20",
]


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def hpcrl(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hpcrl.jobs.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout_s)


def workload(seed: int) -> list[tuple[str, int, int, int]]:
    """(name, gpus, time limit min, seconds it runs): a seeded mix that leaves holes."""
    rng = random.Random(seed)
    out = []
    for i in range(9):
        gpus = rng.choice([1, 1, 2, 2, 4])
        run_s = rng.randint(20, 60)
        limit_min = max(2, round(run_s * rng.uniform(2.0, 4.0) / 60))
        out.append((f"other-{i}", gpus, limit_min, run_s))
    return out


def submit_held(tmp: Path, name: str, gpus: int, limit_min: int, run_s: int) -> str:
    from hpcrl.slurm.sbatch import Resources, render_script, submit_script, write_script

    res = Resources(partition="gpu", time_min=limit_min, nodes=1, gpus_per_node=gpus, mem_mb=256)
    # Its own clock at its start, to the microsecond: sacct's start times are whole seconds, too
    # coarse to tell a delay from Slurm's 1-s backfill interval.
    clock = f"date +%s.%N > {tmp / name}.started"
    done = f"date +%s.%N > {tmp / name}.ended"  # ... and at its end: when the GPUs it frees come free
    text = render_script([res], [clock, f"sleep {run_s}", done], job_name=name, output=str(tmp / f"{name}-%j.out"))
    return submit_script(write_script(text, tmp / f"{name}.sh"), ["--hold"])


def stretches(others, recs, own, rollout, deadline, scripts: Path, limits_s) -> list[Stretch]:
    """Every job on the partition in one run, as the wait and block measures read it. Background
    jobs by their own clocks (sacct's whole second where one is missing), with their time limits,
    and their job ids as the order Slurm takes them in; the run's fixed jobs by sacct. Rollout
    jobs as long as they can have held their GPUs: from sacct's start (the second it fell in) to
    the earlier of the end of sacct's last second and when the supervisor saw the job gone; Slurm
    plans each to end at the EndTime it read at its start (`deadline`)."""

    def clock(name: str, what: str, fallback):
        f = scripts / f"{name}.{what}"
        return float(f.read_text()) if f.exists() else (fallback.timestamp() if fallback else None)

    node = lambda r: r.nodes[0] if r.nodes else ""
    out = []
    for n, j in others.items():
        r = recs[j]
        started, ended = clock(n, "started", r.start), clock(n, "ended", r.end)
        out.append(Stretch(n, node(r), r.gpus, started, ended, "background", limits_s[n], int(j)))
    out += [
        Stretch(j, node(r), r.gpus, r.start and r.start.timestamp(), r.end and r.end.timestamp(), "own")
        for j in own
        if (r := recs.get(j))
    ]
    for name, rec in rollout.items():
        r = recs.get(rec["job_id"])
        if r is None or r.start is None:
            continue
        # "ended" is when the supervisor saw it gone, except where it set it as it cancelled the job
        seen = (
            rec.get("ended")
            if rec.get("slurm_state") != "cancelled at the run's end" and not rec.get("withdrawn")
            else None
        )
        end = r.end and min(r.end.timestamp() + 1, seen or math.inf)
        start = r.start.timestamp()
        out.append(Stretch(rec["job_id"], node(r), r.gpus, start, end, "rollout", deadline.get(name, math.inf) - start))
    return out


def run_once(mode: str, tmp: Path, args) -> dict:
    from hpcrl.core.config import load_config
    from hpcrl.jobs.accounting import run_members
    from hpcrl.jobs.launch import read_jobs, role_resources
    from hpcrl.jobs.supervise import queue_states
    from hpcrl.rl.audit.audit import AUDIT_NAME, account, lineage
    from hpcrl.rl.coordinator.report import read_status
    from hpcrl.slurm import queries
    from hpcrl.slurm.backfill.book import rollout_job_counts
    from hpcrl.slurm.backfill.planner import describe

    jobs_cap = args.rollout_jobs if mode == "backfill" else 0
    part = [f"scheduler.rollout_partition={args.rollout_partition}", *args.set] if mode == "backfill" else []
    run_dir = tmp / mode
    scripts = tmp / f"{mode}-others"
    scripts.mkdir(parents=True)
    load = workload(args.seed)
    others = {name: submit_held(scripts, name, g, lim, s) for name, g, lim, s in load}
    log(f"{mode}: {len(others)} background jobs held; submitting the run")
    try:
        out = hpcrl(
            "submit",
            "config.yaml",
            *SMALL,
            f"experiment.run_root={tmp}",
            f"scheduler.max_rollout_jobs={jobs_cap}",
            f"scheduler.max_rollout_gpus={jobs_cap}",
            *args.set_both,
            *part,
            "sandbox.uid_base=64000",  # no domain here starts sandboxes; if one does, away from fixed test uids
            "--run-id",
            mode,
        )
        if out.returncode != 0:
            raise RuntimeError(f"hpcrl submit failed: {out.stderr[-2000:]}")
        comps = read_jobs(run_dir)["components"]
        gpu_jobs = [comps["learner"]["job_id"], comps["gen-0"]["job_id"]]
        wait_until(lambda: all(queue_states(gpu_jobs).get(j) == "RUNNING" for j in gpu_jobs), 120, "run's GPU jobs")
        wait_until(
            lambda: ((read_status(run_dir) or {}).get("learner") or {}).get("version") is not None, 180, "weights"
        )
        from hpcrl.slurm.command import run_slurm

        t0 = time.time()
        run_slurm(["scontrol", "release", ",".join(others.values())])
        log(f"{mode}: background released")
        ids = list(others.values())
        wait_until(lambda: not queue_states(ids), 600, "the background workload to finish", interval_s=1.0)
        t_done = time.time()
        st = read_status(run_dir) or {}
        log(f"{mode}: background done after {t_done - t0:.0f} s; cancelling the run")
    finally:
        out = hpcrl("cancel", str(run_dir), timeout_s=180)
        queries.cancel([j for j in others.values() if j in queue_states(list(others.values()))])
    rollout = json.loads((run_dir / "rollout.json").read_text())["jobs"] if (run_dir / "rollout.json").exists() else {}
    rids = [r["job_id"] for r in rollout.values()]
    members = run_members(read_jobs(run_dir))
    own = list(members)  # the GPU jobs and the CPU ones: on these nodes they hold memory too
    every = ids + rids + own

    def settled():
        recs = queries.job_records(every)
        return recs if all(j in recs and (recs[j].end or not recs[j].start) for j in every) else None

    recs = wait_until(settled, 90, "accounting records", interval_s=1.0)
    bg = {j: recs[j] for j in ids}
    t1 = max(r.end.timestamp() for r in bg.values())
    span = t1 - t0
    busy_bg = sum(overlap_s(r.start, r.end, t0, t1) * r.gpus for r in bg.values())
    busy_fixed = sum(overlap_s(recs[j].start, recs[j].end, t0, t1) * max(recs[j].gpus, 1) for j in gpu_jobs)
    busy_rollout = sum(overlap_s(recs[j].start, recs[j].end, t0, t1) * max(recs[j].gpus, 1) for j in rids)
    need = role_resources(load_config(run_dir / "config.resolved.yaml").slurm, "generator")
    gpu_nodes = [n for n in queries.nodes() if "gpu" in n.partitions]
    by_node = holes_by_node(list(recs.values()), gpu_nodes, t0, t1, need)

    deadline = {  # the EndTime each rollout job read at its start: the limit Slurm granted
        name: json.loads(f.read_text())["deadline"]
        for name in rollout
        if (f := run_dir / "rollout" / f"{name}.json").exists()
    }
    limits_s = {name: lim * 60 for name, _, lim, _ in load}
    spans = stretches(others, recs, own, rollout, deadline, scripts, limits_s)
    gpus_by_node = {n.name: n.gpus_total for n in gpu_nodes}
    waits = waits_after_free(spans, gpus_by_node, t0)
    pended = pending_time(spans, gpus_by_node, t0)
    peaks = queries.peak_rss_mb(own + rids)
    memory_mb = {  # what each of the run's jobs used (sampled peak) against what it asked for
        name: [round(peaks.get(j, 0)), recs[j].mem_mb] for j, names in members.items() if j in recs for name, _ in names
    }
    if any(j in peaks for j in rids):
        memory_mb["rollout"] = [round(max(peaks.get(j, 0) for j in rids)), max(recs[j].mem_mb for j in rids)]
    acct = account(run_dir)
    trained_ids = []
    for r in lineage(run_dir / AUDIT_NAME)[0]:
        trained_ids += r["trained"]
    hpcrl_gpu_s = busy_fixed + busy_rollout
    granted_s, held_s, startup_s = [], [], []
    leases = run_dir / "coordinator" / "leases.jsonl"
    first_lease = {}  # rollout job name -> when it leased its first episode: its start-up ends there
    for line in leases.read_text().splitlines() if leases.exists() else []:
        e = json.loads(line)
        if e.get("leased") and str(e.get("g", "")).startswith("rollout-"):
            first_lease.setdefault(e["g"], e["t"])
    for name, r in rollout.items():
        rec = recs.get(r["job_id"])
        if rec is None or rec.start is None or rec.end is None:
            continue
        held_s.append(round(rec.end.timestamp() - rec.start.timestamp()))
        if name in first_lease:
            startup_s.append(round(first_lease[name] - rec.start.timestamp(), 1))
        if name in deadline:
            granted_s.append(round(deadline[name] - rec.start.timestamp()))
    return {
        "mode": mode,
        "span_s": round(span, 1),
        "capacity_gpu_h": GPUS_TOTAL * span / 3600,
        "idle_gpu_h": (GPUS_TOTAL * span - busy_bg - busy_fixed - busy_rollout) / 3600,
        "busy_gpu_h": (busy_bg + busy_fixed + busy_rollout) / 3600,
        # per node: idle GPU-hours, and those a rollout job (the generator role's GPUs, CPUs and
        # memory) fits beside what runs there; in the baseline, the holes rollout jobs could fill
        "holes_by_node": {n: {k: round(v, 5) for k, v in h.items()} for n, h in by_node.items()},
        "fillable_gpu_h": sum(h["fillable_gpu_h"] for h in by_node.values()),
        "rollout_job_request": describe(need),
        "wait_after_free_s": {n: round(w, 2) for n, w in waits.items()},
        "blocked_by_rollout_s": {n: round(w, 2) for n, w in pended.blocked_by_rollout_s.items()},
        "startable_s": {n: round(w, 2) for n, w in pended.startable_s.items()},
        "memory_mb": memory_mb,
        "rollout_gpu_h": busy_rollout / 3600,
        "background_start_s": {n: (bg[j].start.timestamp() - t0) for n, j in others.items()},
        "background_clock_s": {j.name: j.start - t0 for j in spans if j.kind == "background"},
        # Slurm plans in bf_resolution steps (60 s): a hole's end is floored to the minute, so how
        # much of a 1-2 minute hole a one-minute job can use depends on where in its minute t0 fell.
        "t0_second_of_minute": round(t0 % 60, 1),
        "first_rollout_submit_s": round(min(r["submitted"] for r in rollout.values()) - t0, 1) if rollout else None,
        "rollout_jobs": {
            # submitted, started, withdrawn (pended too long: never ran), gave_way (cancelled by the
            # planner), preempted (by Slurm), ended_in_window: counted as `hpcrl sim` counts them
            **rollout_job_counts(rollout, *_clocks(recs, rids)),
            "time_limit_min": sorted({r["time_limit_min"] for r in rollout.values()}),
            "granted_limit_s": sorted(granted_s),
            "held_s": sorted(held_s),  # Slurm start to end of each rollout job
            "startup_s": sorted(startup_s),  # its start to its first leased episode (none: never leased)
        },
        "trained": acct.trained,
        "trained_from_rollout_jobs": sum("/rollout-" in i for i in trained_ids),
        "trained_per_hpcrl_gpu_h": acct.trained / (hpcrl_gpu_s / 3600) if hpcrl_gpu_s else 0.0,
        "reward": (st.get("learner") or {}).get("reward"),
        "lost": acct.lost,
        "duplicated": acct.trained_twice,
        "step": (st.get("learner") or {}).get("step"),
    }


def _clocks(recs, job_ids) -> tuple[dict, dict]:
    """{job id: sacct start}, {job id: sacct end} in epoch seconds (None where it has none)."""
    starts = {j: recs[j].start.timestamp() if j in recs and recs[j].start else None for j in job_ids}
    ends = {j: recs[j].end.timestamp() if j in recs and recs[j].end else None for j in job_ids}
    return starts, ends


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--rollout-jobs", type=int, default=4, help="scheduler.max_rollout_jobs (= GPUs) of the backfill run"
    )
    p.add_argument(
        "--rollout-partition",
        default="",
        help="scheduler.rollout_partition of the backfill run: a preemptible partition (dev cluster: scavenger)",
    )
    p.add_argument("--keep", default="", help="keep both runs' directories (logs, rollout.json) under this folder")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override of the backfill run, e.g. scheduler.rollout_yield_after_s=0 (repeatable)",
    )
    p.add_argument(
        "--set-both",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override of both runs, e.g. slurm.generator.mem_gb=4 (repeatable)",
    )
    args = p.parse_args()
    from hpcrl.slurm import queries

    if queries.queue():
        print("the dev cluster's queue is not empty: wait for it (or cancel your jobs) first", file=sys.stderr)
        return 2
    bf_interval_s = int(queries.scheduler_parameters().get("bf_interval", 30))
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        where = contextlib.nullcontext(tempfile.mkdtemp(prefix="hpcrl-bflive-", dir=args.keep))
    else:
        where = tempfile.TemporaryDirectory(prefix="hpcrl-bflive-", dir=os.environ.get("HPCRL_BENCH_DIR"))
    with where as d:
        base = run_once("baseline", Path(d), args)
        wait_until(lambda: not queries.queue(), 120, "the queue to empty between runs")
        bf = run_once("backfill", Path(d), args)
    # Delays from each job's own clock (what its user sees, sub-second); sacct's whole seconds beside.
    delays = {n: bf["background_clock_s"][n] - s for n, s in base["background_clock_s"].items()}
    sacct_delays = {n: bf["background_start_s"][n] - s for n, s in base["background_start_s"].items()}
    added = {n: bf["wait_after_free_s"][n] - w for n, w in base["wait_after_free_s"].items()}
    hole = base["idle_gpu_h"]
    out = {
        "hole_gpu_h": round(hole, 5),
        "filled_gpu_h": round(bf["rollout_gpu_h"], 5),
        "filled_fraction": round(bf["rollout_gpu_h"] / hole, 3) if hole > 0 else None,
        "fillable_gpu_h": round(base["fillable_gpu_h"], 5),  # the holes a rollout job's shape fits in
        "filled_of_fillable": round(bf["rollout_gpu_h"] / base["fillable_gpu_h"], 3)
        if base["fillable_gpu_h"] > 0
        else None,
        "rollout_job_request": bf["rollout_job_request"],
        "rollout_jobs": bf["rollout_jobs"],
        "trained_from_rollout_jobs": bf["trained_from_rollout_jobs"],
        "lost": base["lost"] + bf["lost"],
        "duplicated": base["duplicated"] + bf["duplicated"],
        "max_delay_s": round(max(delays.values()), 2),
        "max_delay_sacct_s": round(max(sacct_delays.values()), 1),
        "bf_interval_s": bf_interval_s,
        "rollout_partition": args.rollout_partition or None,
        "overrides": args.set,
        "overrides_both": args.set_both,
        "delays_s": {n: round(v, 2) for n, v in delays.items()},
        # each background job's wait after its node had its GPUs free (rollout jobs not counted),
        # backfill minus baseline: what rollout jobs added, without the delays carried down a chain
        "max_added_wait_s": round(max(added.values()), 2),
        "added_wait_s": {n: round(v, 2) for n, v in added.items()},
        # within the backfill run: how long rollout jobs held GPUs a pending background job needed
        # (an upper bound on the delay they caused, free of the pass timing two runs differ by)
        "max_blocked_by_rollout_s": round(max(bf["blocked_by_rollout_s"].values(), default=0.0), 2),
        # the check on that reckoning: the longest a job pended while it said Slurm would start it
        # with every job there (about a backfill pass where it plans as Slurm does), both runs
        "max_startable_s": round(max(v for r in (base, bf) for v in r["startable_s"].values()), 2),
        "runs": {
            r["mode"]: {k: v for k, v in r.items() if k not in ("background_start_s", "background_clock_s", "mode")}
            for r in (base, bf)
        },
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'':34s}{'baseline':>14s}{'backfill':>14s}")
    for key, fmt in [
        ("span_s", ".0f"),
        ("busy_gpu_h", ".4f"),
        ("idle_gpu_h", ".4f"),
        ("rollout_gpu_h", ".4f"),
        ("trained", "d"),
        ("trained_per_hpcrl_gpu_h", ".0f"),
        ("reward", ".3f"),
    ]:
        a, b = base[key], bf[key]
        a, b = ("-" if v is None else format(v, fmt) for v in (a, b))
        print(f"{key:34s}{a:>14s}{b:>14s}")
    for key in (
        "hole_gpu_h",
        "fillable_gpu_h",
        "filled_gpu_h",
        "filled_fraction",
        "filled_of_fillable",
        "rollout_job_request",
        "rollout_jobs",
        "trained_from_rollout_jobs",
    ):
        print(f"{key:34s}{out[key]}")
    print(f"{'lost / duplicated':34s}{out['lost']} / {out['duplicated']}")
    print(f"{'max_delay_s (bf_interval_s)':34s}{out['max_delay_s']} ({bf_interval_s})")
    print(f"{'max_delay_sacct_s':34s}{out['max_delay_sacct_s']}")
    print(f"{'max_added_wait_s':34s}{out['max_added_wait_s']}")
    print(f"{'max_blocked_by_rollout_s':34s}{out['max_blocked_by_rollout_s']}")
    print(f"{'max_startable_s':34s}{out['max_startable_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
