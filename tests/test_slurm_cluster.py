"""Every Slurm feature hpcrl uses, exercised on the real dev cluster (make devcluster).

submitit on `cpu` and on `gpu` with one and two GPUs, a job array, a heterogeneous job across
both partitions, a failing job, sacct states, the parsers on live output, `sbatch --test-only`
and `squeue --start` estimates, and cancellation.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import time
from pathlib import Path

import pytest
import submitit

from hpcrl.core.config import load_config
from hpcrl.jobs.launch import make_executor
from hpcrl.slurm import parse, queries
from hpcrl.slurm.command import SlurmCommandError, run_slurm
from hpcrl.slurm.sbatch import Resources, render_script, submit_script, write_script

from conftest import wait_for

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


def job_env() -> dict[str, str]:
    keys = (
        "SLURM_JOB_ID",
        "SLURM_JOB_PARTITION",
        "CUDA_VISIBLE_DEVICES",
        "SLURM_JOB_GPUS",
        "SLURM_ARRAY_TASK_ID",
        "SLURMD_NODENAME",
    )
    return {k: os.environ.get(k, "") for k in keys}


def square(x: int) -> int:
    return x * x


def explode(message: str) -> None:
    raise RuntimeError(message)


def settle(job_id: str, timeout_s: float = 60) -> queries.JobRecord:
    """Wait until accounting (slurmdbd) has the job's complete record in a terminal state.

    slurmctld sends start and end records to slurmdbd asynchronously: for a moment after the
    job ends, sacct can show the end state with the start record's fields (partition) empty.
    """

    def done():
        rec = queries.job_records([job_id]).get(job_id)
        return rec if rec and rec.state in TERMINAL and rec.partition and rec.end else None

    return wait_for(done, timeout_s, what=f"sacct terminal state of job {job_id}")


@pytest.fixture
def cfg(tmp_path):
    return load_config(
        ROOT / "config.yaml",
        [
            f"experiment.run_root={tmp_path}",
            "executor=slurm",
            "slurm.coordinator.time_min=5",
            "slurm.learner.time_min=5",
            "slurm.generator.time_min=5",
            "slurm.sandbox.time_min=5",
            "slurm.coordinator.signal_delay_s=30",
            "slurm.learner.signal_delay_s=30",
            "slurm.generator.signal_delay_s=30",
            "slurm.sandbox.signal_delay_s=30",
            # The job functions below live in this test module:
            # slurm.setup puts it on the job's import path.
            f"slurm.setup=['export PYTHONPATH={ROOT / 'tests'}']",
        ],
    )


def with_gpus(cfg, n: int):
    learner = dataclasses.replace(cfg.slurm.learner, gpus_per_node=n)
    return dataclasses.replace(cfg.slurm, learner=learner)


def test_submitit_function_on_cpu(slurm_cluster, cfg, tmp_path):
    ex = make_executor("slurm", cfg.slurm, "coordinator", tmp_path / "submitit")
    job = ex.submit(job_env)
    env = job.result()
    assert env["SLURM_JOB_PARTITION"] == "cpu"
    assert env["SLURM_JOB_ID"] == job.job_id
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    rec = settle(job.job_id)
    assert (rec.state, rec.exit_code, rec.partition) == ("COMPLETED", 0, "cpu")
    assert rec.nodes and rec.nodes[0] in ("n1", "n2")


@pytest.mark.parametrize("gpus", [1, 2])
def test_submitit_gpu_job_sees_its_gpus(slurm_cluster, cfg, tmp_path, gpus):
    ex = make_executor("slurm", with_gpus(cfg, gpus), "learner", tmp_path / "submitit")
    env = ex.submit(job_env).result()
    assert env["SLURM_JOB_PARTITION"] == "gpu"
    visible = env["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(visible) == gpus and all(v.isdigit() for v in visible), env
    assert len(env["SLURM_JOB_GPUS"].split(",")) == gpus


def test_job_array(slurm_cluster, cfg, tmp_path):
    ex = make_executor("slurm", cfg.slurm, "sandbox", tmp_path / "submitit")
    ex.update_parameters(array_parallelism=3)
    jobs = ex.map_array(square, list(range(6)))
    assert [j.result() for j in jobs] == [0, 1, 4, 9, 16, 25]
    array_id = jobs[0].job_id.split("_")[0]
    assert all(j.job_id.startswith(array_id + "_") for j in jobs)
    # The throttle is visible to Slurm as ArrayTaskThrottle.
    for j in jobs:
        assert settle(j.job_id).state == "COMPLETED"


def test_failing_job_raises_clear_error(slurm_cluster, cfg, tmp_path):
    ex = make_executor("slurm", cfg.slurm, "coordinator", tmp_path / "submitit")
    job = ex.submit(explode, "reward model exploded on purpose")
    with pytest.raises(submitit.core.utils.FailedJobError) as info:
        job.result()
    text = str(info.value)
    assert "reward model exploded on purpose" in text and "RuntimeError" in text
    rec = settle(job.job_id)
    # submitit's wrapper catches the exception, stores it, and exits non-zero.
    assert rec.state in ("FAILED", "COMPLETED")


def test_failing_batch_script_state_in_sacct(slurm_cluster, tmp_path):
    script = write_script(
        render_script(
            [Resources(partition="cpu", time_min=2)],
            ["echo about to fail", "exit 3"],
            job_name="hpcrl-fail",
            output=str(tmp_path / "%j.out"),
        ),
        tmp_path / "fail.sh",
    )
    job_id = submit_script(script)
    rec = settle(job_id)
    assert (rec.state, rec.exit_code) == ("FAILED", 3)


def test_heterogeneous_job_spans_both_partitions(slurm_cluster, tmp_path):
    out = tmp_path / "het-%j.out"
    body = [
        "srun --het-group=0 bash -c 'echo \"group0 $SLURM_JOB_PARTITION $SLURMD_NODENAME\"'",
        "srun --het-group=1 bash -c 'echo \"group1 $SLURM_JOB_PARTITION $SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES\"'",
    ]
    text = render_script(
        [Resources(partition="cpu", time_min=2), Resources(partition="gpu", time_min=2, gpus_per_node=1)],
        body,
        job_name="hpcrl-het",
        output=str(out),
    )
    assert text.count("#SBATCH hetjob") == 1
    job_id = submit_script(write_script(text, tmp_path / "het.sh"))
    log = tmp_path / f"het-{job_id}.out"
    wait_for(lambda: log.exists() and "group1" in log.read_text(), 60, what="hetjob output")
    lines = log.read_text().splitlines()
    g0 = next(line for line in lines if line.startswith("group0"))
    g1 = next(line for line in lines if line.startswith("group1"))
    assert g0.split()[1] == "cpu"
    assert g1.split()[1] == "gpu" and g1.split("gpus=")[1].strip().isdigit()

    # Accounting knows both components, JOBID+0 on cpu and JOBID+1 on gpu.
    def components():
        rows = parse.parse_delimited(
            run_slurm(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,Partition,State"]).stdout,
            ("job_id", "partition", "state"),
        )
        done = [r for r in rows if r["state"] == "COMPLETED"]
        return rows if len(done) == 2 else None

    rows = wait_for(components, 60, what="hetjob components in sacct")
    assert {r["job_id"]: r["partition"] for r in rows} == {f"{job_id}+0": "cpu", f"{job_id}+1": "gpu"}


def test_live_partitions_and_nodes(slurm_cluster):
    parts = {p.name: p for p in queries.partitions()}
    assert {"cpu", "gpu"} <= set(parts)
    gpu = parts["gpu"]
    assert gpu.up and set(gpu.nodes) == {"n1", "n2"}
    assert gpu.gpus_total == 8 and gpu.cpus_total == 16
    assert 0 <= gpu.gpus_idle <= gpu.gpus_total - gpu.gpus_alloc
    nodes = {n.name: n for n in queries.nodes()}
    assert set(nodes) == {"n1", "n2"}
    assert all(n.gpus_total == 4 and n.cpus_total == 8 and n.usable for n in nodes.values())
    # sinfo agrees with scontrol on CPU totals (%C = allocated/idle/other/total).
    rows = parse.parse_delimited(
        run_slurm(["sinfo", "-h", "-p", "gpu", "-o", "%R|%C|%G"]).stdout, ("p", "cpus", "gres")
    )
    assert sum(int(r["cpus"].split("/")[3]) for r in rows) == 16
    assert all(parse.gpus_in_gres(r["gres"]) == 4 for r in rows)


def hold_script(tmp_path: Path, name: str, gpus: int, time_min: int, seconds: int) -> Path:
    return write_script(
        render_script(
            [Resources(partition="gpu", time_min=time_min, gpus_per_node=gpus, cpus_per_task=1)],
            [f"sleep {seconds}"],
            job_name=name,
            output=str(tmp_path / "%j.out"),
        ),
        tmp_path / f"{name}.sh",
    )


def test_full_gpu_partition_estimates_and_cancel(slurm_cluster, tmp_path):
    """Hold all 8 GPUs; a ninth GPU job pends with an expected start; --test-only agrees; cancel."""
    holders = [submit_script(hold_script(tmp_path, f"hpcrl-hold{i}", 4, 3, 170)) for i in range(2)]
    try:

        def all_running():
            rows = queries.queue(job_ids=holders)
            return len(rows) == 2 and all(r["state"] == "RUNNING" for r in rows)

        wait_for(all_running, 60, what="GPU holders running")
        gpu = next(p for p in queries.partitions() if p.name == "gpu")
        assert (gpu.gpus_alloc, gpu.gpus_idle) == (8, 0)

        waiter = submit_script(hold_script(tmp_path, "hpcrl-wait", 1, 2, 5))
        holders.append(waiter)
        before = dt.datetime.now().replace(microsecond=0)

        def estimated():
            mine = [j for j in queries.pending_jobs("gpu") if j.job_id == waiter]
            return mine[0] if mine and mine[0].expected_start else None

        pend = wait_for(estimated, 30, what="squeue --start estimate")
        assert pend.gpus == 1 and pend.time_limit_s == 120
        # The holders end at their 3-minute limits at the latest; the backfill plan says so.
        assert before <= pend.expected_start <= before + dt.timedelta(minutes=3, seconds=30)

        est = queries.expected_start(["-p", "gpu", "--gpus-per-node=1", "-t", "1"])
        assert est.partition == "gpu" and est.cpus >= 1
        assert est.start >= before + dt.timedelta(seconds=30), "no GPU is free, so not 'now'"
        assert est.nodes and set(est.nodes) <= {"n1", "n2"}
        cpu_est = queries.expected_start(["-p", "cpu", "-t", "1"])
        assert cpu_est.start <= dt.datetime.now() + dt.timedelta(seconds=30), "the cpu partition has room now"
    finally:
        queries.cancel(holders)
    for job_id in holders:
        rec = settle(job_id)
        assert rec.state == "CANCELLED" and rec.cancelled_by is not None
    assert not queries.queue(job_ids=holders)


def test_submitit_cancel(slurm_cluster, cfg, tmp_path):
    ex = make_executor("slurm", cfg.slurm, "coordinator", tmp_path / "submitit")
    job = ex.submit(time.sleep, 120)
    wait_for(lambda: job.state == "RUNNING", 60, what="sleeping job running")
    job.cancel()
    assert settle(job.job_id).state == "CANCELLED"
    wait_for(lambda: job.state.startswith("CANCELLED"), 30, what="submitit sees CANCELLED")


def test_slurm_errors_carry_command_code_and_stderr(slurm_cluster):
    with pytest.raises(SlurmCommandError) as info:
        run_slurm(["sbatch", "-p", "nosuchpartition", "--wrap", "true"])
    err = info.value
    assert err.returncode != 0 and "nosuchpartition" in str(err) and "sbatch -p nosuchpartition" in str(err)
    assert "invalid partition" in err.stderr.lower()
    assert queries.show_job("999999999") is None
