"""The chaos drill (`hpcrl chaos`): a short version on the local executor, and its bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpcrl.jobs.chaos import parse_duration
from hpcrl.rl.coordinator import read_status

from conftest import RUN_GUARD_S, wait_for
from test_run import ROOT, finish, hpcrl, no_processes_left


def test_durations_parse_and_bad_ones_are_one_line_exit_2(tmp_path):
    assert (parse_duration("90"), parse_duration("90s"), parse_duration("30m"), parse_duration("2h")) == (
        90.0,
        90.0,
        1800.0,
        7200.0,
    )
    for bad in ("soon", "-5s", "0", "infm", "nan"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.resolved.yaml").write_text("{}\n")
    for args in (["--every", "soon"], ["--kinds", "explode"], ["--targets", "gpu"]):
        out = subprocess.run(
            [sys.executable, "-m", "hpcrl.jobs.cli", "chaos", str(run), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (args, out.stderr)


@pytest.mark.slow
def test_a_short_drill_kills_and_stalls_components_and_the_run_keeps_its_invariants(tmp_path):
    # Short leases so a stall outlasts them; a checkpoint every 5 steps so kills cost little; a
    # budget of restarts that fits the drill.
    proc = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=400",
        "learner.checkpoint_every=5",
        "coordinator.lease_s=4",
        "store.lease_s=4",
        "supervise.restarts=20",
        "--run-id",
        "drill",
        "--quiet",  # nothing reads its output until the end: a progress line would fill the pipe
    )
    run_dir = tmp_path / "drill"
    try:
        wait_for(
            lambda: (
                ((read_status(run_dir) if (run_dir / "status.json").exists() else {}).get("learner") or {}).get(
                    "step", 0
                )
                >= 3
            ),
            RUN_GUARD_S,
            what="the run to train 3 steps",
        )
        drill = subprocess.run(
            [sys.executable, "-m", "hpcrl.jobs.cli", "chaos", str(run_dir)]
            + ["--duration", "50s", "--every", "8s", "--stall", "6s", "--seed", "3", "--json"]
            # Not the launcher yet: after its kill a store writer can outlive `hpcrl resume`'s wait
            # for the old components, and the resumed run never starts (an open defect).
            + ["--targets", "coordinator,store,learner,gen"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=RUN_GUARD_S,
        )
    finally:
        if proc.poll() is None:
            finish(proc, RUN_GUARD_S)
    report = json.loads(drill.stdout.strip().splitlines()[-1])
    assert drill.returncode == 0 and report["ok"], drill.stdout[-4000:]
    kinds = {f["kind"] for f in report["faults"]}
    assert len(report["faults"]) >= 3 and kinds == {"kill", "stall"}, report["faults"]
    assert report["restarts"], report  # each kill of a component cost it a restart
    assert report["accounting"]["lost"] == 0 and report["accounting"]["trained_twice"] == 0
    assert set(report["invariants"]) == {
        "reached_max_steps",
        "step_never_went_back",
        "published_version_only_grew",
        "no_trajectory_trained_twice",
        "every_acknowledged_trajectory_accounted",
        "reward_did_not_collapse",
    }
    assert json.loads((run_dir / "chaos" / "report.json").read_text())["ok"]
    no_processes_left(run_dir)
