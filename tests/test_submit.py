"""`hpcrl submit/sbatch/status/cancel/logs` on the dev cluster (make devcluster), plus their input errors.

End to end: the default experiment submitted with executor=slurm; the learner is requeued
(`scontrol requeue`) mid-run and resumes from its checkpoint with no trajectory lost or trained
twice, a generator's job is cancelled and the supervisor replaces it, the run finishes and frees
every job. `hpcrl cancel` of a running run leaves no job; `bash DIR/submit.sh` of `hpcrl sbatch`
(separate jobs, and one heterogeneous job) trains and ends by itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.jobs.launch import read_jobs
from hpcrl.jobs.supervise import queue_states
from hpcrl.rl.coordinator.report import read_status

from conftest import wait_for

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
# Small, fast runs: one-minute jobs would do, but the signal must stay inside the time limit.
SMALL = [
    "executor=slurm",
    "slurm.coordinator.time_min=10",
    "slurm.learner.time_min=10",
    "slurm.generator.time_min=10",
    "slurm.sandbox.time_min=10",
    "slurm.coordinator.signal_delay_s=30",
    "slurm.learner.signal_delay_s=30",
    "slurm.generator.signal_delay_s=30",
    "slurm.sandbox.signal_delay_s=30",
]


def hpcrl(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout_s,
    )


def status_json(run_dir: Path) -> dict:
    out = hpcrl("status", "--json", str(run_dir))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def all_ids(run_dir: Path) -> list[str]:
    jobs = read_jobs(run_dir)
    sup = [jobs["supervisor"]] if jobs.get("supervisor") else []
    return list(dict.fromkeys(j for c in [*jobs["components"].values(), *sup] for j in c["history"]))


# ---- input errors and rendering (no jobs are submitted) ----


def test_status_json_shape_for_jobs_slurm_no_longer_knows(slurm_cluster, tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.resolved.yaml").write_text("executor: slurm\n")
    (run / "status.json").write_text(
        json.dumps(
            {
                "state": "running",
                "updated": time.time(),
                "traj_per_s": 3.0,
                "learner": {"step": 7, "version": 7, "reward": 0.5},
                "counts": {"completed": 99},
                "reward_by_domain": {"a": 0.5},
            }
        )
    )
    (run / "jobs.json").write_text(
        json.dumps(
            {
                "state": "running",
                "components": {
                    "store": {"role": "coordinator", "job_id": "999990", "history": ["999990"], "restarts": 0},
                    "learner": {"role": "learner", "job_id": "999991", "history": ["999991"], "restarts": 1},
                },
                "supervisor": {"job_id": "999992", "history": ["999992"]},
            }
        )
    )
    snap = status_json(run)
    assert (snap["step"], snap["version"], snap["trajectories"], snap["reward_by_domain"]) == (7, 7, 99, {"a": 0.5})
    assert [(c["name"], c["job_id"], c["state"]) for c in snap["components"]] == [
        ("store", "999990", "UNKNOWN"),
        ("learner", "999991", "UNKNOWN"),
        ("supervisor", "999992", "UNKNOWN"),
    ]
    assert snap["components"][1]["restarts"] == 1
    assert snap["state"] == "ended"  # no job of it is left in the queue
    out = hpcrl("logs", str(run), "learner")
    assert out.returncode == 1 and "no log files yet" in out.stderr
    out = hpcrl("logs", str(run), "gen-9")
    assert out.returncode == 2 and "components: store, learner, supervisor" in out.stderr


# ---- on the dev cluster ----


def test_submitted_run_survives_requeue_and_a_killed_generator(slurm_cluster, tmp_path):
    from hpcrl.rl.learner.service import AUDIT_NAME
    from hpcrl.slurm.command import run_slurm

    from audit import account, lineage

    t0 = time.monotonic()
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=100",
        "learner.checkpoint_every=10",
        "--run-id",
        "e2e",
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "e2e"
    try:
        jobs = read_jobs(run_dir)
        for name in ("store", "coordinator", "learner", "gen-0"):
            assert f"{name}" in out.stdout and jobs["components"][name]["job_id"] in out.stdout
        wait_for(
            lambda: all(c["state"] == "RUNNING" for c in status_json(run_dir)["components"]),
            30,
            what="every component RUNNING",
        )
        print(f"submit -> every component running: {time.monotonic() - t0:.1f} s")
        t = time.monotonic()
        snap = status_json(run_dir)
        print(f"hpcrl status --json: {time.monotonic() - t:.2f} s")
        assert {c["name"] for c in snap["components"]} == {"store", "coordinator", "learner", "gen-0", "supervisor"}
        assert {c["node"] for c in snap["components"]} <= {"n1", "n2"}

        step = wait_for(
            lambda: (status_json(run_dir)["step"] or 0) >= 14 and status_json(run_dir)["step"],
            90,
            interval_s=0.2,
            what="learner step 14",
        )
        learner = jobs["components"]["learner"]["job_id"]
        run_slurm(["scontrol", "requeue", learner])  # SIGTERM now, the same job id runs again later
        gen = jobs["components"]["gen-0"]["job_id"]
        run_slurm(["scancel", gen])
        wait_for(lambda: read_jobs(run_dir)["components"]["gen-0"]["job_id"] != gen, 30, what="gen-0 resubmitted")
        wait_for(lambda: read_jobs(run_dir)["state"] in ("finished", "failed"), 150, what="the run to finish")
        jobs = read_jobs(run_dir)
        assert jobs["state"] == "finished", jobs
        assert jobs["components"]["learner"]["history"] == [learner]  # requeued in place, not resubmitted
        assert jobs["components"]["gen-0"]["restarts"] == 1 and len(jobs["components"]["gen-0"]["history"]) == 2
        wait_for(lambda: not queue_states(all_ids(run_dir)), 30, what="every job of the run to leave the queue")
    except BaseException:
        hpcrl("cancel", str(run_dir))  # leave no job behind
        raise

    records, lives = lineage(run_dir / AUDIT_NAME)
    assert lives == 2, "the requeued learner should have started twice"
    assert [r["step"] for r in records] == list(range(1, 101))
    audit = [json.loads(line) for line in (run_dir / AUDIT_NAME).read_text().splitlines()]
    resumed = [a for a in audit if "resumed_step" in a]
    # From a checkpoint (step 10's, or the one taken while draining on SIGTERM), never from step 0.
    assert 10 <= resumed[1]["resumed_step"] < 100, (resumed, step)
    trained, _, _ = account(run_dir)
    assert len(trained) == 100 * 256

    st = read_status(run_dir)
    assert st["learner"]["step"] == 100
    out = hpcrl("logs", str(run_dir), "learner")
    assert out.returncode == 0 and "==> learner:" in out.stdout


def test_cancel_stops_every_job_and_finalizes_the_store(slurm_cluster, tmp_path):
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=100000",
        "--run-id",
        "cancel",
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "cancel"
    wait_for(lambda: (status_json(run_dir)["step"] or 0) >= 2, 60, what="learner steps")
    out = hpcrl("cancel", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert "store writer flushed and finalized its shards" in out.stdout, out.stdout
    assert not queue_states(all_ids(run_dir)), "cancel returns once every job has left the queue"
    assert read_jobs(run_dir)["state"] == "cancelled"
    assert status_json(run_dir)["state"] == "cancelled"


def test_time_limit_signal_drains_and_requeues_and_a_spent_budget_fails_the_run(slurm_cluster, tmp_path):
    from hpcrl.rl.learner.service import AUDIT_NAME
    from hpcrl.slurm.command import run_slurm

    from audit import lineage

    # A 2-minute learner signalled 90 s ahead. slurmctld looks at time limits only every 30-60 s and
    # may send the warning early rather than late, even in the job's first second (seen in CI: USR2
    # 1 s in, while submitit was still unpickling the learner): the job
    # must drain and requeue whenever the signal comes (jobs/boot.py holds an early one). With a
    # 1-minute limit signalled 50 s ahead, a look landing in the first 10 s sent nothing and the next
    # one found the job over its limit and killed it. No periodic checkpoint before step 1000: a
    # resume past step 0 can only come from the checkpoint taken while draining.
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "slurm.learner.time_min=2",
        "slurm.learner.signal_delay_s=90",
        "learner.max_steps=100000",
        "learner.checkpoint_every=1000",
        "supervise.restarts=0",
        "--run-id",
        "limit",
    )
    assert out.returncode == 0, out.stderr
    assert "warning: KillWait=2 s" in out.stderr and "warning: slurm.coordinator.signal_delay_s=30" in out.stderr
    assert "slurm.learner.signal_delay_s" not in out.stderr  # 90 s ahead is no warning
    run_dir = tmp_path / "limit"
    learner = read_jobs(run_dir)["components"]["learner"]["job_id"]
    try:
        try:
            wait_for(
                lambda: (run_dir / AUDIT_NAME).exists() and lineage(run_dir / AUDIT_NAME)[1] >= 2,
                200,
                what="the learner to drain on SIGUSR2, requeue and start again",
            )
        except AssertionError as exc:
            acct = run_slurm(
                ["sacct", "-D", "-X", "-j", learner, "--format=JobID,State,Start,End,Elapsed"], check=False
            )
            log = hpcrl("logs", str(run_dir), "learner").stdout
            raise AssertionError(f"{exc}\n{acct.stdout}\n{log[-3000:]}") from None
        jobs = read_jobs(run_dir)
        assert jobs["components"]["learner"]["history"] == [learner] and jobs["state"] == "running"
        audit = [json.loads(line) for line in (run_dir / AUDIT_NAME).read_text().splitlines()]
        second = [i for i, a in enumerate(audit) if "resumed_step" in a][1]
        first_life = [a["step"] for a in audit[:second] if "step" in a]
        # The drain kept every step the first life trained (none, if USR2 came while it was still
        # starting on a busy machine): only the checkpoint taken on SIGUSR2 can give this.
        assert audit[second]["resumed_step"] == max(first_life, default=0), (audit[second], first_life)
        log = hpcrl("logs", str(run_dir), "learner").stdout
        assert "SIGUSR2" in log and f"job {learner} requeued" in log, log[-3000:]

        # Restart budget 0: the next component that dies fails the run, which frees every node.
        gen = jobs["components"]["gen-0"]["job_id"]
        run_slurm(["scancel", gen])
        wait_for(lambda: read_jobs(run_dir)["state"] == "failed", 30, what="the run to fail")
        wait_for(lambda: not queue_states(all_ids(run_dir)), 30, what="every job of the failed run to leave the queue")
    except BaseException:
        hpcrl("cancel", str(run_dir))
        raise
    jobs = read_jobs(run_dir)
    assert jobs["message"].startswith("gen-0 ended and has used its 0 restart(s)") and gen in jobs["message"], jobs[
        "message"
    ]
    out = hpcrl("status", str(run_dir))
    assert out.returncode == 0 and "failed: gen-0 ended and has used its 0 restart(s)" in out.stdout, out.stdout


def test_sandbox_servers_are_submitted_as_one_job_array(slurm_cluster, tmp_path):
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "sandbox.servers=2",
        "domains=[{name: arith/copy}, {name: synth}]",
        "--run-id",
        "array",
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "array"
    try:
        comps = read_jobs(run_dir)["components"]
        array = comps["sandbox-0"]["job_id"].split("_")[0]
        assert (comps["sandbox-0"]["job_id"], comps["sandbox-1"]["job_id"]) == (f"{array}_0", f"{array}_1")
        assert all(c["role"] == "sandbox" for n, c in comps.items() if n.startswith("sandbox"))
        snap = status_json(run_dir)
        states = {c["name"]: c["state"] for c in snap["components"]}
        assert states["sandbox-0"] in ("PENDING", "RUNNING") and states["sandbox-1"] in ("PENDING", "RUNNING"), states
    finally:
        # No grace: the store is cancelled at once; cancel reports what its shards look like either way.
        out = hpcrl("cancel", str(run_dir), "--grace-s", "0")
    assert out.returncode == 0, out.stderr
    assert not queue_states(all_ids(run_dir)), "cancel returns once every job has left the queue"
    from hpcrl.rl.store.layout import list_shards

    open_shards = [s.name for s in list_shards(run_dir / "trajectories") if not s.finalized]
    if open_shards:
        assert f"stopped before finalizing {', '.join(open_shards)}" in out.stdout, out.stdout
    else:
        assert "store writer flushed and finalized its shards" in out.stdout, out.stdout


@pytest.mark.parametrize("hetjob", [False, True], ids=["jobs", "hetjob"])
def test_sbatch_scripts_submitted_by_hand_train_and_end(slurm_cluster, tmp_path, hetjob):
    out = hpcrl(
        "sbatch",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=10",
        "-o",
        str(tmp_path / "s"),
        "--run-id",
        "hand",
        *(["--hetjob"] if hetjob else []),
    )
    assert out.returncode == 0, out.stderr
    sub = subprocess.run(["bash", str(tmp_path / "s" / "submit.sh")], capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    run_dir = tmp_path / "hand"
    try:
        wait_for(
            lambda: any(c["state"] == "RUNNING" for c in status_json(run_dir)["components"]),
            30,
            what="the hand-submitted jobs to run",
        )
        wait_for(lambda: (status_json(run_dir)["step"] or 0) >= 10, 90, what="learner step 10")
        wait_for(lambda: not queue_states(all_ids(run_dir)), 60, what="the run's jobs to end by themselves")
    except BaseException:
        hpcrl("cancel", str(run_dir))  # leave no job behind
        raise
    snap = status_json(run_dir)
    # With a supervisor the run ends "finished"; a hetjob has none and simply has no job left.
    assert snap["step"] == 10 and snap["state"] == ("ended" if hetjob else "finished"), snap
