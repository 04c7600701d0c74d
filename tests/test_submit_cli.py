"""`hpcrl submit --dry-run`, `hpcrl sbatch` scripts, and `status`/`logs`/`cancel` on runs Slurm has
no part in: what they print and refuse, without a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_submit import ROOT, SMALL, hpcrl

pytestmark = pytest.mark.slurm  # as tests/test_submit.py: these run with the Slurm suite


def test_submit_refuses_the_local_executor(tmp_path):
    out = hpcrl("submit", "config.yaml", f"experiment.run_root={tmp_path}")
    assert out.returncode == 2
    assert "executor=slurm" in out.stderr and "hpcrl run" in out.stderr
    assert not any(tmp_path.iterdir())


def test_submit_dry_run_prints_each_roles_sbatch_script_and_creates_nothing(tmp_path):
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "generators.count=2",
        "--dry-run",
        "--run-id",
        "dry",
    )
    assert out.returncode == 0, out.stderr
    scripts = dict(part.split(" =====\n", 1) for part in out.stdout.split("# ===== ")[1:])
    assert list(scripts) == ["store", "coordinator", "learner", "gen-0", "gen-1", "supervisor"]
    for name, text in scripts.items():
        # The boot module runs first, so an early SIGUSR2 is held until the component can drain on it.
        assert text.startswith("#!/bin/bash") and "-u -m hpcrl.jobs.boot -u -m submitit.core._submit" in text
        assert f"--job-name=hpcrl-dry-{name}" in text and "#SBATCH --signal=USR2@30" in text
        gpu = name == "learner" or name.startswith("gen-")
        assert (f"#SBATCH --partition={'gpu' if gpu else 'cpu'}") in text
        assert ("#SBATCH --gpus-per-node=1" in text) == gpu
    assert "#SBATCH --cpus-per-task=2" in scripts["learner"]
    assert not (tmp_path / "dry").exists()


def test_dry_run_renders_sandbox_servers_as_one_array_on_the_cpu_partition(tmp_path):
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "sandbox.servers=3",
        "domains=[{name: arith/copy}, {name: synth}]",
        "--dry-run",
        "--run-id",
        "code",
    )
    assert out.returncode == 0, out.stderr
    scripts = dict(part.split(" =====\n", 1) for part in out.stdout.split("# ===== ")[1:])
    assert list(scripts) == ["store", "coordinator", "sandbox", "learner", "gen-0", "supervisor"]
    assert "#SBATCH --array=0-2%3" in scripts["sandbox"] and "#SBATCH --partition=cpu" in scripts["sandbox"]
    assert f"#SBATCH --output={tmp_path}/code/submitit/%A_%a_0_log.out" in scripts["sandbox"]


def test_sbatch_writes_readable_scripts_and_refuses_a_multi_node_hetjob(tmp_path):
    out = hpcrl(
        "sbatch",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "-o",
        str(tmp_path / "s"),
        "--run-id",
        "hand",
    )
    assert out.returncode == 0, out.stderr
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == [
        "coordinator.sbatch",
        "gen-0.sbatch",
        "learner.sbatch",
        "store.sbatch",
        "submit.sh",
        "supervisor.sbatch",
    ]
    learner = (tmp_path / "s" / "learner.sbatch").read_text()
    for line in (
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@30",
        f"#SBATCH --output={tmp_path}/hand/submitit/%j_0_log.out",
        f"-m hpcrl.jobs.scripts {tmp_path}/hand learner",
    ):
        assert line in learner, line
    assert subprocess.run(["bash", "-n", str(tmp_path / "s" / "submit.sh")]).returncode == 0
    assert (tmp_path / "hand" / "config.resolved.yaml").exists()
    # Until submit.sh runs, status says the run waits for it, and where it is.
    st = hpcrl("status", str(tmp_path / "hand"))
    assert st.returncode == 1 and f"not submitted yet; submit with: bash {tmp_path}/s/submit.sh" in st.stdout, st
    snap = json.loads(hpcrl("status", str(tmp_path / "hand"), "--json").stdout)
    assert (snap["executor"], snap["state"]) == ("slurm", "not submitted") and "submit.sh" in snap["message"]

    out = hpcrl(
        "sbatch",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "-o",
        str(tmp_path / "h"),
        "--run-id",
        "het",
        "--hetjob",
    )
    assert out.returncode == 0, out.stderr
    het = (tmp_path / "h" / "run.hetjob.sbatch").read_text()
    assert het.count("#SBATCH hetjob") == 1  # one group per partition: cpu (store, coordinator), gpu
    assert "#SBATCH --ntasks-per-node=2" in het and "#SBATCH --gpus-per-node=2" in het
    assert "srun --het-group=1 --exact -n1 -c2 --mem=4096M --gres=gpu:1" in het

    out = hpcrl(
        "sbatch",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "slurm.learner.nodes=2",
        "-o",
        str(tmp_path / "m"),
        "--run-id",
        "multi",
        "--hetjob",
    )
    assert out.returncode == 2 and "nodes > 1" in out.stderr
    assert not (tmp_path / "multi").exists()


def test_cancel_logs_status_of_unknown_or_local_runs_exit_2(tmp_path):
    for verb in ("cancel", "logs", "status"):
        out = hpcrl(verb, str(tmp_path / "nope"))
        assert out.returncode == 2 and "is not a run directory" in out.stderr, (verb, out.stderr)
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.resolved.yaml").write_text("executor: local\n")
    out = hpcrl("cancel", str(local))
    assert out.returncode == 2 and "not a Slurm run" in out.stderr, out.stderr
    # `hpcrl logs` reads a local run's logs/index.json (tests/test_run.py); without one it says where they are.
    out = hpcrl("logs", str(local))
    assert out.returncode == 2 and "recorded no jobs" in out.stderr and str(local / "submitit") in out.stderr


def fake_run(root: Path, name: str, jobs: dict | None, status: dict | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.resolved.yaml").write_text("executor: slurm\n")
    if status is not None:
        (run / "status.json").write_text(json.dumps(status))
    if jobs is not None:
        (run / "jobs.json").write_text(json.dumps(jobs))
    return run


def test_status_without_run_lists_recent_runs_newest_first(tmp_path):
    old = fake_run(tmp_path, "old", {"state": "finished", "components": {}}, {"learner": {"step": 9}})
    past = time.time() - 3600  # older by its config's mtime, what the listing sorts by
    os.utime(old / "config.resolved.yaml", (past, past))
    fake_run(tmp_path, "new", None, {"state": "running", "learner": {"step": 3}})
    (tmp_path / "not-a-run").mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"experiment: {{run_root: {tmp_path}}}\n")
    out = hpcrl("status", "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    runs = json.loads(out.stdout)["runs"]
    assert [(r["run"], r["executor"], r["state"], r["step"]) for r in runs] == [
        ("new", "local", "running", 3),
        ("old", "slurm", "finished", 9),
    ]
    out = hpcrl("status", "--config", str(cfg))
    assert out.returncode == 0 and out.stdout.index("new") < out.stdout.index("old")


def test_logs_prints_and_follows_a_components_files(tmp_path):
    run = fake_run(
        tmp_path,
        "r",
        {
            "state": "running",
            "components": {"learner": {"role": "learner", "job_id": "41", "history": ["40", "41"], "restarts": 1}},
        },
    )
    (run / "submitit").mkdir()
    (run / "submitit" / "40_0_log.err").write_text("first life\n")
    err = run / "submitit" / "41_0_log.err"
    err.write_text("step 1\n")
    out = hpcrl("logs", str(run), "learner")
    assert out.returncode == 0 and "step 1" in out.stdout and "first life" not in out.stdout
    assert "first life" in hpcrl("logs", str(run), "learner", "--all").stdout
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.jobs.cli", "logs", str(run), "learner", "-f"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert "==> learner:" in proc.stdout.readline() and proc.stdout.readline() == "step 1\n"
        with open(err, "a") as f:
            f.write("step 2\n")
        assert proc.stdout.readline() == "[learner] step 2\n"
    finally:
        proc.kill()
        proc.wait()
