"""Pure Slurm parsers on captured text (the live-output checks are in test_slurm_cluster.py)."""

from __future__ import annotations

import datetime as dt
import os
import re

import pytest

from hpcrl.core.config import load_config
from hpcrl.jobs.launch import slurm_parameters
from hpcrl.slurm import parse
from hpcrl.slurm.command import SlurmCommandError, run_slurm
from hpcrl.slurm.sbatch import Resources, render_script

# Captured from the dev cluster (Slurm 22.05), `scontrol -o show node`, one record per line.
NODE_TEXT = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=8 CPUAlloc=5 CPUEfctv=8 CPUTot=8 CPULoad=0.41 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:4 NodeAddr=127.0.0.1 NodeHostName=box "
    "Port=16818 Version=22.05.8 OS=Linux 6.1.0-28-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.119-1 (2024-11-22)  "
    "RealMemory=16384 AllocMem=2048 FreeMem=20000 Sockets=1 Boards=1 State=MIXED ThreadsPerCore=1 TmpDisk=0 "
    "Weight=1 Owner=N/A MCS_label=N/A Partitions=cpu,gpu BootTime=2026-12-02T07:58:11 "
    "SlurmdStartTime=2026-12-02T12:20:01 LastBusyTime=2026-12-02T12:21:40 "
    "CfgTRES=cpu=8,mem=16G,billing=8,gres/gpu=4 AllocTRES=cpu=5,mem=2G,gres/gpu=3 CapWatts=n/a "
    "CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=8 CPUAlloc=0 CPUEfctv=8 CPUTot=8 CPULoad=0.41 "
    "Gres=gpu:4 NodeAddr=127.0.0.1 RealMemory=16384 AllocMem=0 State=IDLE+DRAIN Partitions=cpu,gpu "
    "CfgTRES=cpu=8,mem=16G,billing=8,gres/gpu=4 AllocTRES= "
    "Reason=Not responding [slurm@2026-12-02T12:00:00]\n"
)


def test_scontrol_records_keep_spaces_and_equals_in_values():
    n1, n2 = parse.parse_scontrol_records(NODE_TEXT)
    assert n1["NodeName"] == "n1" and n1["CPUAlloc"] == "5"
    assert n1["OS"].startswith("Linux 6.1.0-28-amd64 #1 SMP") and n1["OS"].endswith("(2024-11-22)")
    assert n1["CfgTRES"] == "cpu=8,mem=16G,billing=8,gres/gpu=4"
    assert parse.gpus_in_tres(n1["AllocTRES"]) == 3 and parse.gpus_in_tres(n2["AllocTRES"]) == 0
    assert n2["Reason"] == "Not responding [slurm@2026-12-02T12:00:00]"
    assert n2["State"] == "IDLE+DRAIN"


def test_scontrol_job_record():
    text = (
        "JobId=42 JobName=hpcrl-learner UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 "
        "Account=hpcrl QOS=normal JobState=PENDING Reason=Resources Dependency=(null) Requeue=1 Restarts=2 "
        "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=00:05:00 TimeMin=N/A "
        "SubmitTime=2026-12-02T12:30:00 StartTime=2026-12-02T12:35:00 EndTime=2026-12-02T12:40:00 "
        "Partition=gpu NodeList=(null) NumNodes=1 NumCPUs=1 TRES=cpu=1,mem=256M,node=1,billing=1,gres/gpu=2 "
        "Command=/tmp/run dir/submission.sh WorkDir=/tmp TresPerNode=gres:gpu:2\n"
    )
    (job,) = parse.parse_scontrol_records(text)
    assert job["JobId"] == "42" and job["Restarts"] == "2" and job["JobState"] == "PENDING"
    assert job["Command"] == "/tmp/run dir/submission.sh"
    assert parse.gpus_in_tres(job["TRES"]) == 2 and parse.gpus_in_gres(job["TresPerNode"]) == 2
    assert parse.parse_duration_s(job["TimeLimit"]) == 300
    assert parse.parse_timestamp(job["StartTime"]) == dt.datetime(2026, 12, 2, 12, 35)


def test_memory_of_a_tres_string_in_mb():
    assert parse.mem_mb_in_tres("billing=1,cpu=1,gres/gpu=1,mem=4G,node=1") == 4096
    assert parse.mem_mb_in_tres("cpu=1,mem=256M,node=1") == 256
    assert parse.mem_mb_in_tres("mem=2.50G") == 2560 and parse.mem_mb_in_tres("mem=1T") == 1024 * 1024
    assert parse.mem_mb_in_tres("mem=512K") == 0 and parse.mem_mb_in_tres("mem=1000") == 1000
    assert parse.mem_mb_in_tres("cpu=1,node=1") == 0 and parse.mem_mb_in_tres("") == 0
    assert parse.mem_mb_in_tres("mem=lots") == 0
    assert parse.parse_mem_mb("388532K") == 388532 / 1024 and parse.parse_mem_mb(" 4G ") == 4096
    assert parse.parse_mem_mb("") is None and parse.parse_mem_mb("0") == 0


def test_peak_rss_of_each_job_is_the_largest_of_its_steps():
    text = "1205|\n1205.batch|12096K\n1205.0|498944K\n1212|\n1203.batch|12228K\n1203.0|90996K\n"  # sacct -P
    peaks = parse.peak_rss_by_job(text)
    assert peaks == {"1205": 498944 / 1024, "1203": 90996 / 1024}  # 1212 never ran: absent


def test_delimited_rows_allow_separator_in_last_field():
    rows = parse.parse_delimited("1|cpu|RUNNING|my|name\n\n2|gpu|PENDING|x\n", ("id", "p", "state", "name"))
    assert rows[0] == {"id": "1", "p": "cpu", "state": "RUNNING", "name": "my|name"}
    with pytest.raises(parse.SlurmParseError, match="line 1: expected 4 fields"):
        parse.parse_delimited("1|cpu\n", ("id", "p", "state", "name"))


@pytest.mark.parametrize(
    "expr, hosts",
    [
        ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
        ("n1,n2", ["n1", "n2"]),
        ("gpu[01-03],cpu5", ["gpu01", "gpu02", "gpu03", "cpu5"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("(null)", []),
        ("", []),
    ],
)
def test_hostlists(expr, hosts):
    assert parse.expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("1-02:03:04", 93784),
        ("02:03:04", 7384),
        ("03:04", 184),
        ("5", 300),
        ("2-0", 172800),
        ("UNLIMITED", None),
        ("INVALID", None),
        ("N/A", None),
        ("00:00:00", 0),
    ],
)
def test_durations(text, seconds):
    assert parse.parse_duration_s(text) == seconds


@pytest.mark.parametrize(
    "gres, n",
    [
        ("gpu:4", 4),
        ("gpu:a100:2(S:0-1)", 2),
        ("gres:gpu:2", 2),
        ("gres/gpu:3", 3),
        ("(null)", 0),
        ("gpu:2,shard:8", 2),
        ("gpu", 1),
        ("N/A", 0),
        ("", 0),
    ],
)
def test_gpus_in_gres(gres, n):
    assert parse.gpus_in_gres(gres) == n


def test_test_only_and_sbatch_outputs():
    est = parse.parse_test_only(
        "sbatch: Job 57 to start at 2026-12-02T12:43:10 using 1 processors on nodes n[1-2] in partition gpu\n"
    )
    assert est.job_id == 57 and est.start == dt.datetime(2026, 12, 2, 12, 43, 10)
    assert est.nodes == ("n1", "n2") and est.partition == "gpu" and est.cpus == 1
    with pytest.raises(parse.SlurmParseError, match="no start estimate"):
        parse.parse_test_only("sbatch: error: Batch job submission failed: Invalid partition name specified")
    assert parse.parse_sbatch_job_id("123\n") == "123"
    assert parse.parse_sbatch_job_id("123;hpcrldev\n") == "123"
    assert parse.parse_sbatch_job_id("Submitted batch job 77\n") == "77"
    with pytest.raises(parse.SlurmParseError):
        parse.parse_sbatch_job_id("sbatch: error: oops")


def test_states_and_exit_codes():
    assert parse.split_state("CANCELLED by 0") == ("CANCELLED", "0")
    assert parse.split_state("COMPLETED") == ("COMPLETED", None)
    assert parse.split_state("REQUEUED+") == ("REQUEUED", None)
    assert parse.parse_exit_code("1:0") == (1, 0)
    assert parse.parse_exit_code("0:15") == (0, 15)


def test_run_slurm_error_carries_command_code_stderr(tmp_path):
    with pytest.raises(SlurmCommandError) as info:
        run_slurm(["bash", "-c", "echo 'sbatch: error: Invalid account' >&2; exit 1"])
    err = info.value
    assert err.returncode == 1 and "Invalid account" in err.stderr
    assert "`bash -c" in str(err) and "exit code 1" in str(err) and "slurm.account" in str(err)
    with pytest.raises(SlurmCommandError, match="timed out"):
        run_slurm(["sleep", "5"], timeout_s=0.2)
    # What a user sees: one line, the stderr line that says why, and what to do.
    munge = (
        "squeue: error: If munged is up, restart with --num-threads=10\n"
        'squeue: error: Munge encode failed: Failed to access "/x/munge.socket": No such file or directory\n'
        "slurm_load_jobs error: Protocol authentication error\n"
    )
    (tmp_path / "stderr").write_text(munge)
    with pytest.raises(SlurmCommandError) as info:
        run_slurm(["bash", "-c", f"cat {tmp_path / 'stderr'} >&2; exit 1"])
    line = info.value.summary()
    assert "\n" not in line and "Munge encode failed" in line and "start munge" in line, line
    with pytest.raises(SlurmCommandError) as info:
        run_slurm(["bash", "-c", "echo first >&2; echo last >&2; exit 3"])
    assert info.value.summary() == "`bash -c 'echo first >&2; echo last >&2; exit 3'` failed (exit code 3): last"
    out = run_slurm(["bash", "-c", "echo out; echo err >&2; exit 4"], check=False)
    assert (out.returncode, out.stdout, out.stderr) == (4, "out\n", "err\n")


def test_submit_to_a_cluster_that_does_not_answer_is_one_line_and_leaves_no_run(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "slurm.conf").write_text("")  # scontrol stops at once on an empty one
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", "submit", "config.yaml", "executor=slurm"]
        + [f"experiment.run_root={tmp_path / 'runs'}", "--run-id", "x"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env=dict(os.environ, SLURM_CONF=str(tmp_path / "slurm.conf")),
        timeout=120,
    )
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1, out.stderr
    # The first query the checks make (nodes, then config) is the one that says so.
    assert re.match(r"hpcrl submit: error: `scontrol [^`]+` failed \(exit code 1\): ", out.stderr), out.stderr
    assert not (tmp_path / "runs" / "x").exists()


def test_role_resources_become_submitit_parameters():
    cfg = load_config(
        None,
        [
            "slurm.account=proj",
            "slurm.qos=high",
            "slurm.setup=[module load cuda]",
            "slurm.extra_directives={reservation: rl}",
            "slurm.learner.gpus_per_node=4",
            "slurm.learner.tasks_per_node=4",
            "slurm.learner.extra_directives={constraint: a100}",
            "slurm.learner.mem_gb=1.5",
        ],
    )
    p = slurm_parameters(cfg.slurm, "learner", "hpcrl-learner")
    assert p["partition"] == "gpu" and p["gpus_per_node"] == 4 and p["mem"] == "1536M"
    assert p["account"] == "proj" and p["qos"] == "high" and p["setup"] == ["module load cuda"]
    assert p["additional_parameters"] == {"reservation": "rl", "constraint": "a100"}
    assert "gpus_per_node" not in slurm_parameters(cfg.slurm, "sandbox", "x")
    with pytest.raises(KeyError, match="roles: coordinator, learner, generator, sandbox"):
        slurm_parameters(cfg.slurm, "writer", "x")


def test_hetjob_rendering():
    text = render_script(
        [
            Resources(partition="cpu", time_min=5),
            Resources(partition="gpu", gpus_per_node=2, mem_mb=4096, extra={"constraint": "a100"}),
        ],
        ["srun --het-group=0 hostname"],
        job_name="het",
        output="/tmp/%j.out",
        signal="USR1@90",
        requeue=True,
    )
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    het = lines.index("#SBATCH hetjob")
    assert "#SBATCH --partition=cpu" in lines[:het] and "#SBATCH --partition=gpu" in lines[het:]
    assert "#SBATCH --gpus-per-node=2" in lines[het:] and "#SBATCH --constraint=a100" in lines[het:]
    assert "#SBATCH --signal=USR1@90" in lines and "#SBATCH --requeue" in lines
    with pytest.raises(ValueError):
        render_script([], [], job_name="x", output="y")


def test_outside_job_drops_the_calling_jobs_variables_for_a_submission(monkeypatch):
    from hpcrl.slurm.command import outside_job

    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "1")  # a GPU job's: its srun would ask a CPU job for GRES
    monkeypatch.setenv("SBATCH_PARTITION", "gpu")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")  # where the cluster is: kept
    with outside_job():
        assert "SLURM_GPUS_PER_NODE" not in os.environ and "SBATCH_PARTITION" not in os.environ
        assert os.environ["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert os.environ["SLURM_GPUS_PER_NODE"] == "1" and os.environ["SBATCH_PARTITION"] == "gpu"
