"""The chaos drill (`hpcrl chaos`): a short version on the local executor, and its bad input;
the two ways a killed launcher's jobs used to outlive `hpcrl resume`'s wait for them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from hpcrl.core.config import load_config
from hpcrl.core.files import atomic_write_json
from hpcrl.jobs.chaos import Drill, parse_duration
from hpcrl.jobs.launch import make_executor
from hpcrl.jobs.resume import job_processes, local_resume_check
from hpcrl.rl.coordinator.report import read_status

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


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _register(run_dir, name: str, pid: int) -> None:
    """procs/<name>.json as start_component writes it."""
    (run_dir / "procs").mkdir(exist_ok=True)
    record = {"name": name, "role": name.split("-")[0], "host": socket.gethostname(), "pid": pid}
    atomic_write_json(run_dir / "procs" / f"{name}.json", {**record, "started": time.time()})


def test_a_stall_continues_the_process_it_stopped_though_another_took_its_name(tmp_path):
    # A killed launcher's store job, still starting, is stalled; meanwhile the resumed run's store
    # registers as store-0. The SIGCONT used to go to that one, and the old store stayed stopped
    # for good, which every later `hpcrl resume` waited for in vain.
    old, new = _sleeper(), _sleeper()
    try:
        _register(tmp_path, "store-0", old.pid)
        drill = Drill(tmp_path, load_config(None), duration_s=1, every_s=1, stall_s=1.0)

        def take_over() -> None:
            wait_for(lambda: psutil.Process(old.pid).status() == psutil.STATUS_STOPPED, 30, 0.05, "the stall")
            _register(tmp_path, "store-0", new.pid)

        thread = threading.Thread(target=take_over)
        thread.start()
        fault = drill._inject("stall", "store-0")
        thread.join()
        assert fault.note == "" and json.loads((tmp_path / "procs" / "store-0.json").read_text())["pid"] == new.pid
        wait_for(
            lambda: psutil.Process(old.pid).status() != psutil.STATUS_STOPPED, 10, 0.05, "the stalled process to go on"
        )
        assert psutil.Process(new.pid).status() != psutil.STATUS_STOPPED
    finally:
        for p in (old, new):
            p.kill()
            p.wait()


def test_a_component_stops_when_its_killed_launcher_is_left_a_zombie(tmp_path):
    # `hpcrl run` started by a process that does not reap it at once (this test suite, a script):
    # after its kill -9 it is a zombie, which the components took for a live launcher, so the
    # store writer served on past `hpcrl resume`'s wait (the drill's launcher kill, in a test).
    launcher = _sleeper()
    try:
        spec = f"{launcher.pid}:{psutil.Process(launcher.pid).create_time()}"
        code = (
            "import sys; from pathlib import Path; from hpcrl.jobs.components import start_component; "
            "stop = start_component(Path(sys.argv[1]), 'store-0', 'store'); stop.wait(); print('stopped')"
        )
        component = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            env=dict(os.environ, HPCRL_LAUNCHER=spec),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        try:
            wait_for(lambda: (tmp_path / "procs" / "store-0.json").exists() or component.poll() is not None, 60)
            assert component.poll() is None, component.communicate()[0]
            launcher.kill()  # and not reaped: a zombie until the finally below
            wait_for(lambda: psutil.Process(launcher.pid).status() == psutil.STATUS_ZOMBIE, 10, 0.05, "the zombie")
            out, _ = component.communicate(timeout=60)
            assert component.returncode == 0 and "is gone; stopping" in out and "stopped" in out, out
        finally:
            if component.poll() is None:
                component.kill()
                component.wait()
    finally:
        launcher.kill()
        launcher.wait()


def test_resume_waits_for_a_job_that_has_not_registered_yet(tmp_path):
    # A job the dead launcher submitted just before it died is still importing: no procs/ record
    # yet. Resuming beside it would run two generations of the run's components at once.
    cfg = load_config(None)
    job = make_executor("local", cfg.slurm, "sandbox", tmp_path / "submitit", job_name="hpcrl-test").submit(
        time.sleep, 600
    )
    try:
        # The job's task, under its controller: this test's descendants (submitit runs them locally).
        task = wait_for(
            lambda: [p.pid for p in psutil.Process().children(recursive=True) if "_submit" in " ".join(p.cmdline())],
            60,
            what="the job's task process",
        )[0]
        assert task in job_processes(tmp_path) and not (tmp_path / "procs").exists()
        why = local_resume_check(tmp_path, cfg, wait_s=1.0)
        assert why is not None and "still running" in why and str(task) in why, why
        os.kill(task, signal.SIGKILL)  # the job ends (its controller follows its task)
        assert local_resume_check(tmp_path, cfg, wait_s=60.0) is None
    finally:
        job.cancel()


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
            + ["--duration", "50s", "--every", "8s", "--stall", "6s", "--json"]
            # Seed 3 draws "kill" and the last of five targets (coordinator, gen-0, learner-0,
            # store-0, supervisor) first: the launcher dies first, and the drill resumes the run.
            + ["--seed", "3", "--targets", "coordinator,store,learner,gen,supervisor"],
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
    first = report["faults"][0]
    assert (first["kind"], first["target"], first["note"]) == ("kill", "supervisor", ""), report["faults"]
    assert first["recovered_s"] is not None, report["faults"]  # the resumed run trained on
    assert "resuming run drill" in (run_dir / "chaos" / "resume-1.log").read_text()
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
