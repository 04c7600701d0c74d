"""Backfill rollout jobs in a submitted run on the real dev Slurm cluster (make devcluster).

Another user's job holds all four GPUs of one node; the run's learner and generator take two of
the other node's; another user's job that needs a whole node's GPUs is then queued (submitted
held, released once the run's GPU jobs run, so Slurm plans it behind the holder). The run's
supervisor finds the window (squeue --start) and submits two rollout jobs sized to it (--time
ending before the queued job's expected start, and --time-min): Slurm starts them at once,
ahead of the queued job, whose expected start does not move. They run the real generator: their
trajectories are trained and `hpcrl status --json` lists them. One is scancelled mid-window
while frozen holding leases: whatever it handed back is re-leased well before lease_s (arith
episodes take milliseconds, so once thawed it usually stores them instead: both are fine);
the other stops by itself before its window ends (stopped_by window, COMPLETED, not requeued or
resubmitted). Nothing is lost or trained twice; `hpcrl cancel` leaves no rollout job behind.
A gpu job that needs the GPUs two rollout jobs hold, each holding episodes at a closed gate
(tests/gated_quiz.py), makes them go: preempted by Slurm with `scheduler.rollout_partition=scavenger`
(the dev cluster's preemptible partition), cancelled by the run's give-way without one. They hand
their episodes back, those are issued again at once, the gpu job starts; the run then reaches
max_steps, ends finished, and no rollout job is left queued.
A rollout partition that Slurm would not preempt is refused at submit.
Slurm takes a rollout job's --nice (scheduler.rollout_nice) as last in priority, not as held.
The pure parts (which rollout jobs give way to a pending job, SchedulerParameters) and a rollout
job's indifference to Slurm's early time-limit warning are tested without the cluster.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import signal
from pathlib import Path

import pytest

from hpcrl.core.config import SchedulerConfig
from hpcrl.jobs.launch import read_jobs
from hpcrl.jobs.rollout_plan import ROLLOUT_NAME
from hpcrl.jobs.supervise import queue_states
from hpcrl.rl.coordinator.report import read_status
from hpcrl.slurm import parse, queries
from hpcrl.slurm.command import run_slurm
from hpcrl.slurm.sbatch import Resources, render_script, submit_script, write_script

from audit import account
from conftest import wait_for
from test_submit import SMALL, all_ids, hpcrl, status_json

LEASE_S = 60.0  # far above the re-lease time of a handed-back episode, so the two are told apart
ROLLOUT_NICE = SchedulerConfig().rollout_nice


def other_job(tmp_path: Path, name: str, gpus: int, time_min: int, seconds: int, *sbatch_args: str) -> str:
    """Another user's job on the gpu partition (one node, `gpus` GPUs)."""
    text = render_script(
        [Resources(partition="gpu", time_min=time_min, nodes=1, gpus_per_node=gpus, mem_mb=256)],
        [f"sleep {seconds}"],
        job_name=name,
        output=str(tmp_path / f"{name}-%j.out"),
    )
    return submit_script(write_script(text, tmp_path / f"{name}.sh"), sbatch_args)


def state(job_id: str) -> str | None:
    return queue_states([job_id]).get(job_id)


def expected_start(job_id: str) -> dt.datetime | None:
    return next((j.expected_start for j in queries.pending_jobs("gpu") if j.job_id == job_id), None)


def rollouts(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / ROLLOUT_NAME).read_text())["jobs"]
    except (OSError, ValueError, KeyError):
        return {}


def produced(run_dir: Path, name: str) -> int:
    g = ((read_status(run_dir) or {}).get("generators") or {}).get(name) or {}
    return int(g.get("stats", {}).get("trajectories", 0))


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "coordinator" / "leases.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def held(run_dir: Path, name: str) -> set[int]:
    """Episodes leased to `name` and not settled (done, handed back, failed or expired)."""
    out: set[int] = set()
    for e in events(run_dir):
        out -= set(e.get("expired", {}).get(name, []))
        if e.get("g") == name:
            out |= {ep for ep, _ in e.get("leased", [])}
            out -= set(e.get("done", [])) | set(e.get("released", [])) | {f[0] for f in e.get("failed", [])}
    return out


@pytest.mark.slurm
def test_rollout_jobs_backfill_a_window_train_and_lose_nothing(slurm_cluster, tmp_path):
    others: list[str] = []
    run_dir = tmp_path / "bf"
    try:
        # Its limit is cut to four minutes from now once the run is up (below), so the window
        # the rollout jobs get does not shrink with how long a busy machine takes to start the run.
        holder = other_job(tmp_path, "other-holder", 4, 30, 1800)
        others.append(holder)
        wait_for(lambda: state(holder) == "RUNNING", 60, what="another user's job holding a node's GPUs")
        # Submitted held: while the other node is still idle it would start at once.
        big = other_job(tmp_path, "other-node", 4, 30, 1800, "--hold")
        others.append(big)
        out = hpcrl(
            "submit",
            "config.yaml",
            *SMALL,
            f"experiment.run_root={tmp_path}",
            "learner.max_steps=100000",
            "generators.episodes_in_flight=16",  # one small fixed generator: rollout jobs find work
            f"coordinator.lease_s={LEASE_S}",
            "scheduler.policy=backfill",
            "scheduler.max_rollout_jobs=2",
            "scheduler.max_rollout_gpus=2",
            "scheduler.plan_interval_s=2",
            "scheduler.prior_s=5",
            "scheduler.rollout_drain_s=5",
            "scheduler.job_overhead_s=20",
            "scheduler.slurm_margin_s=20",
            "--run-id",
            "bf",
        )
        assert out.returncode == 0, out.stderr
        comps = read_jobs(run_dir)["components"]
        gpu_jobs = [comps["learner"]["job_id"], comps["gen-0"]["job_id"]]
        wait_for(lambda: all(state(j) == "RUNNING" for j in gpu_jobs), 90, what="the run's GPU jobs running")
        wait_for(
            lambda: (read_status(run_dir) or {}).get("learner", {}).get("version") is not None,
            120,
            what="the learner's first published weights",
        )
        assert not rollouts(run_dir), "a held job of unknown start leaves no window"
        ran_min = parse.parse_duration_s(queries.show_job(holder)["RunTime"]) // 60
        run_slurm(["scontrol", "update", f"JobId={holder}", f"TimeLimit={int(ran_min) + 4}"])
        run_slurm(["scontrol", "release", big])
        before = wait_for(lambda: expected_start(big), 30, what="Slurm's planned start of the queued job")
        assert before > dt.datetime.now() + dt.timedelta(seconds=60), "it waits for the holder's GPUs"

        def two_running() -> bool:
            jobs = rollouts(run_dir)
            return len(jobs) == 2 and all(state(j["job_id"]) == "RUNNING" for j in jobs.values())

        wait_for(two_running, 90, what="two rollout jobs started by backfill")
        assert state(big) == "PENDING", "they started ahead of the queued job"
        after = expected_start(big)
        assert after is not None and after <= before + dt.timedelta(seconds=60), (before, after)
        jobs = rollouts(run_dir)
        for name, rec in jobs.items():
            info = queries.show_job(rec["job_id"])
            limit_s = parse.parse_duration_s(info["TimeLimit"])
            end = parse.parse_timestamp(info["EndTime"])
            assert rec["blocked_by"] == big and rec["time_min_min"] <= rec["time_limit_min"], rec
            assert limit_s <= rec["time_limit_min"] * 60 and end <= before, (name, info["TimeLimit"], end, before)
            assert info["TimeMin"] not in ("", "N/A", None), info
            assert int(info["Nice"]) == ROLLOUT_NICE, info  # last in priority, started by backfill all the same
        snap = status_json(run_dir)
        rows = {c["name"]: c for c in snap["components"] if c.get("role") == "rollout"}
        assert set(rows) == set(jobs), rows
        for name, r in rows.items():
            assert r["gpus"] == 1 and r["job_id"] == jobs[name]["job_id"] and r["state"] == "RUNNING", r
            assert 0 < r["window_left_s"] <= jobs[name]["window_s"] and "trajectories" in r, r

        wait_for(lambda: all(produced(run_dir, n) > 0 for n in jobs), 120, what="both rollout jobs producing")
        victim = jobs["rollout-1"]["job_id"]
        # Arith episodes take milliseconds: freeze the victim (the dev cluster's nodes are this
        # machine) until the lease log says it holds episodes, so scancel lands while it does.
        pid = int(json.loads((run_dir / "rollout" / "rollout-1.json").read_text())["pid"])

        def frozen_holding() -> bool:
            os.kill(pid, signal.SIGSTOP)  # frozen, it sends no sync: what it holds stays held
            if held(run_dir, "rollout-1"):
                return True
            os.kill(pid, signal.SIGCONT)
            return False

        wait_for(frozen_holding, 60, interval_s=0.05, what="rollout-1 frozen while holding episodes")
        queries.cancel([victim])  # SIGTERM, KillWait, SIGKILL: as a reclaimed GPU
        os.kill(pid, signal.SIGCONT)

        def ended() -> bool:
            return all(
                j["state"] == "ended"
                for j in rollouts(run_dir).values()
                if j["job_id"] in {r["job_id"] for r in jobs.values()}
            )

        wait_for(ended, 300, what="both rollout jobs ended (one cancelled, one at its window's end)")
        after_window = rollouts(run_dir)
        r0 = after_window["rollout-0"]
        kind, value = pickle.loads((run_dir / "submitit" / f"{r0['job_id']}_0_result.pkl").read_bytes())
        assert kind == "success" and value["stopped_by"] == "window", value
        acct = queries.job_records([r0["job_id"]])[r0["job_id"]]
        assert acct.state == "COMPLETED", acct
        assert r0["ended"] <= r0["window_end"] + 10, "it ended before its window did (+ one poll)"
        assert state(big) in ("PENDING", "RUNNING")
        # Neither was resubmitted under the same name: a rollout job's end is not a failure.
        assert sum(1 for j in after_window.values() if j["job_id"] in (r0["job_id"], victim)) == 2
        assert {"rollout-0", "rollout-1"} <= set(after_window) and all(
            n in ("rollout-0", "rollout-1") or int(n.split("-")[1]) >= 2 for n in after_window
        )

        evs = events(run_dir)
        released = {ep: e["t"] for e in evs if e.get("g") == "rollout-1" for ep in e.get("released", [])}
        expired = {g: eps for e in evs for g, eps in e.get("expired", {}).items()}
        again = {}
        for e in evs:
            for ep, _attempt in e.get("leased", []):
                if ep in released and e["t"] >= released[ep] and ep not in again:
                    again[ep] = e["t"] - released[ep]
        wait_for(
            lambda: not held(run_dir, "rollout-1") and not held(run_dir, "rollout-0"),
            LEASE_S + 30,
            what="every lease of the rollout jobs settled",
        )
        step = read_status(run_dir)["learner"]["step"]
        wait_for(lambda: read_status(run_dir)["learner"]["step"] >= step + 3, 120, what="3 more learner steps")
    except BaseException:
        hpcrl("cancel", str(run_dir))
        raise
    finally:
        queries.cancel(others)
    out = hpcrl("cancel", str(run_dir), timeout_s=120)
    assert out.returncode == 0, out.stderr
    rollout_ids = [j["job_id"] for j in rollouts(run_dir).values()]
    wait_for(lambda: not queue_states(all_ids(run_dir) + rollout_ids), 60, what="every job of the run gone")

    assert set(again) == set(released), set(released) - set(again)
    assert max(again.values(), default=0.0) < LEASE_S / 2, again
    assert "rollout-0" not in expired, expired
    trained, _, stored = account(run_dir)
    by_rollout = {g: sum(f"/{g}/" in i for i in trained) for g in ("rollout-0", "rollout-1")}
    assert all(by_rollout.values()), by_rollout
    print(
        f"rollout jobs: {len(rollout_ids)} submitted; --time {[j['time_limit_min'] for j in jobs.values()]} min "
        f"before job {big} (expected start {before:%H:%M:%S} -> {after:%H:%M:%S}); trained from rollout jobs "
        f"{by_rollout}; handed back {len(released)} (re-leased within {max(again.values(), default=0.0):.2f} s); "
        f"trained {len(trained)} unique, stored {len(stored)}"
    )


def test_slurm_puts_a_job_with_the_rollout_nice_last_and_does_not_hold_it(slurm_cluster, tmp_path):
    """scheduler.rollout_nice as this Slurm takes it: a job submitted with it sorts below a job
    submitted after it (first come would rank it first), and it is not held (priority 0 is
    Slurm's mark of a held job). The dev cluster ranks by priority/basic; under multifactor Slurm
    takes the nice off the computed priority in the same way."""
    later = "--begin=now+3600"  # pending, with a priority, and never started
    ids = [
        other_job(tmp_path, "niced", 1, 2, 1, later, f"--nice={ROLLOUT_NICE}"),
        other_job(tmp_path, "plain", 1, 2, 1, later),
    ]
    try:

        def both_pending():
            got = {j.job_id: j.priority for j in queries.pending_jobs() if j.job_id in ids}
            return got if len(got) == 2 else None

        prio = wait_for(both_pending, 30, what="the two jobs pending")
        assert 0 < prio[ids[0]] < prio[ids[1]], prio
    finally:
        queries.cancel(ids)


def submit_to_start_s(job_id: str) -> float:
    """sacct's Start - Submit of a job (1 s resolution), once it has started."""
    rec = wait_for(
        lambda: (r := queries.job_records([job_id]).get(job_id)) and r.start and r,
        120,
        what=f"job {job_id} started (sacct)",
    )
    return (rec.start - rec.submit).total_seconds()


@pytest.mark.slurm
def test_a_preemptible_rollout_partition_is_refused_unless_slurm_preempts_it(slurm_cluster, tmp_path):
    # cpu has gpu's PriorityTier: gpu jobs cannot preempt its jobs. Refused before any job is queued.
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "scheduler.max_rollout_jobs=1",
        "scheduler.max_rollout_gpus=1",
        "scheduler.rollout_partition=cpu",
        "--run-id",
        "refused",
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("config error: scheduler.rollout_partition"), out.stderr
    assert "PriorityTier=1" in errors[0], errors
    assert not (tmp_path / "refused").exists()  # asked before the run directory is made: nothing left behind


@pytest.mark.slurm
@pytest.mark.parametrize("by", ["slurm", "planner"])
def test_rollout_jobs_make_way_for_a_gpu_job_and_nothing_is_lost(slurm_cluster, tmp_path, monkeypatch, by):
    """Rollout jobs hold the last two GPUs, each with episodes held in flight at a closed gate
    (tests/gated_quiz.py); a job of the gpu partition needing two GPUs on one node is submitted.
    `slurm`: they run in the dev cluster's `scavenger` partition (PriorityTier 0, PreemptMode=CANCEL,
    GraceTime=5) and Slurm preempts both (not the planner: its fallback is set far off).
    `planner`: they run in the gpu partition, and the supervisor's give-way (its watch between
    polls, jobs/rollout_plan.py) cancels both for that job. Either way they hand their episodes
    back, those are issued again at once, the gpu job starts. Then the run reaches max_steps: it
    ends finished and its rollout jobs leave the queue. Nothing lost, nothing trained twice."""
    import shutil

    others: list[str] = []
    run_dir = tmp_path / "pre"
    mode = (
        ["scheduler.rollout_partition=scavenger", "scheduler.rollout_yield_after_s=3600"]  # Slurm must do it
        if by == "slurm"
        else []
    )
    gate = tmp_path / "gate"
    gate.touch()  # open until the learner's first step (rollout jobs start only once weights exist)
    monkeypatch.setenv("HPCRL_GATE", str(gate))  # the run's jobs inherit it through sbatch
    shutil.copy(Path(__file__).with_name("gated_quiz.py"), tmp_path / "gated_quiz.py")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("domains:\n  - name: gated-quiz\n    module: gated_quiz:make_domain\n")
    try:
        # What a two-GPU job's submit-to-start costs on this cluster with GPUs idle: the baseline.
        base = other_job(tmp_path, "other-baseline", 2, 2, 1)
        others.append(base)
        baseline_s = submit_to_start_s(base)
        holder = other_job(tmp_path, "other-holder", 4, 10, 900)
        others.append(holder)
        wait_for(lambda: state(holder) == "RUNNING", 60, what="another user's job holding a node's GPUs")
        out = hpcrl(
            "submit",
            str(cfg),
            *SMALL,
            f"experiment.run_root={tmp_path}",
            "learner.max_steps=40",  # the learner waits at the gate too: it ends once the gate reopens
            "generators.episodes_in_flight=16",
            f"coordinator.lease_s={LEASE_S}",
            "sandbox.uid_base=64000",  # the domain steps on the pool: sandbox servers start
            "scheduler.policy=backfill",
            "scheduler.max_rollout_jobs=2",
            "scheduler.max_rollout_gpus=2",
            *mode,
            "scheduler.plan_interval_s=2",
            "scheduler.prior_s=5",
            "scheduler.rollout_drain_s=5",
            "--run-id",
            "pre",
        )
        assert out.returncode == 0, out.stderr
        wait_for(
            lambda: (read_status(run_dir) or {}).get("learner", {}).get("version") is not None,
            300,
            interval_s=0.1,
            what="the learner's first step",
        )
        gate.unlink()  # closed: every episode in flight stays there until it opens again
        assert read_status(run_dir)["learner"]["step"] < 30, "the run would end before the test is done"

        def two_holding() -> dict | None:
            jobs = rollouts(run_dir)
            if len(jobs) != 2 or not all(state(j["job_id"]) == "RUNNING" for j in jobs.values()):
                return None
            return jobs if all(held(run_dir, n) for n in jobs) else None

        jobs = wait_for(two_holding, 300, what="two rollout jobs running, each holding episodes at the gate")
        for rec in jobs.values():
            info = queries.show_job(rec["job_id"])
            assert info["Partition"] == ("scavenger" if by == "slurm" else "gpu") and info["Requeue"] == "0", info
        holding = {n: held(run_dir, n) for n in jobs}
        foreign = other_job(tmp_path, "other-gpu", 2, 2, 5)
        others.append(foreign)

        def handed_back() -> bool:
            evs = events(run_dir)
            return all(any(e.get("g") == n and e.get("released") for e in evs) for n in jobs)

        wait_for(handed_back, 120, what="both rollout jobs handing their episodes back")
        gate.touch()  # their environment steps finish: the jobs exit within GraceTime
        foreign_s = submit_to_start_s(foreign)
        wait_for(
            lambda: all(rollouts(run_dir)[n]["state"] == "ended" for n in jobs), 120, what="both rollout jobs ended"
        )
        ended = rollouts(run_dir)
        for name in jobs:
            rec = ended[name]
            # Right after a job ends, slurmdbd may hold a placeholder (name "allocation", no
            # partition) until the controller's start message for it arrives: wait for the whole one.
            acct = wait_for(
                lambda jid=rec["job_id"]: (r := queries.job_records([jid]).get(jid)) and r.partition and r,
                60,
                what=f"accounting's whole record of rollout job {rec['job_id']}",
            )
            if by == "slurm":
                assert rec.get("preempted") and "yielded_to" not in rec, rec  # Slurm's PreemptTime, not the planner
                assert acct.state != "CANCELLED" and acct.partition == "scavenger", acct
            else:
                assert rec.get("yielded_to") == foreign and not rec.get("preempted"), rec
                assert acct.state == "CANCELLED" and acct.partition == "gpu", acct
        if by == "slurm":
            rows = {c["name"]: c for c in status_json(run_dir)["components"] if c.get("role") == "rollout"}
            assert all(rows[n]["preempted"] == ended[n]["preempted"] for n in jobs), rows  # `hpcrl status` shows it
        wait_for(lambda: read_jobs(run_dir).get("state") == "finished", 600, what="the run reaching max_steps")
        rollout_ids = [j["job_id"] for j in rollouts(run_dir).values()]
        wait_for(lambda: not queue_states(rollout_ids), 60, what="the finished run's rollout jobs gone from squeue")
        assert all(j["state"] == "ended" for j in rollouts(run_dir).values()), rollouts(run_dir)
        wait_for(lambda: not queue_states(all_ids(run_dir)), 120, what="every job of the finished run gone")
    except BaseException:
        hpcrl("cancel", str(run_dir))
        raise
    finally:
        gate.touch()
        queries.cancel([j for j in others if state(j)])

    evs = events(run_dir)
    released = {ep: e["t"] for e in evs if e.get("g") in jobs for ep in e.get("released", [])}
    assert set(released) >= set().union(*holding.values()), (released, holding)
    again = {}
    for e in evs:
        for ep, _attempt in e.get("leased", []):
            if ep in released and e["t"] >= released[ep] and ep not in again:
                again[ep] = e["t"] - released[ep]
    assert set(again) == set(released), set(released) - set(again)
    assert max(again.values()) < LEASE_S / 2, again  # issued again as handed back, not after lease_s
    trace = hpcrl("traj", "trace", str(run_dir), str(min(released)))
    assert trace.returncode == 0 and "handed it back unfinished" in trace.stdout, (trace.stdout, trace.stderr)
    expired = {g for e in evs for g, eps in e.get("expired", {}).items() if eps}
    assert not expired & set(jobs), expired
    trained, _, stored = account(run_dir)
    print(
        f"{'preempted' if by == 'slurm' else 'gave way'}: {sorted(j['job_id'] for j in jobs.values())} (sacct "
        f"{[queries.job_records([j['job_id']])[j['job_id']].state for j in jobs.values()]}); handed back "
        f"{len(released)}, issued again within {max(again.values()):.2f} s; the gpu job's submit-to-start "
        f"{foreign_s:.0f} s (baseline on idle GPUs {baseline_s:.0f} s, sacct 1 s resolution); trained "
        f"{len(trained)} unique, stored {len(stored)}"
    )
