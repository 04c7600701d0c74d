"""An early SIGUSR2 (Slurm's time-limit warning, sent at a periodic check that can land in a job's
first second) must drain and requeue the job, not kill it while it is still importing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Stands in for a job's entry point: it announces that it is "importing", holds there until the
# test opens the gate, then starts as every component does and reports what its stop event says.
PROBE = """
import pathlib, sys, time
gate = pathlib.Path(sys.argv[1])
(gate.parent / "importing").touch()
while not gate.exists():
    time.sleep(0.02)
from hpcrl.jobs.components import start_component
stop = start_component(gate.parent, "probe", "learner")
print(f"set={stop.wait(60)} requeue={stop.requeue}", flush=True)
"""


def _run(tmp_path: Path, boot: bool) -> subprocess.CompletedProcess:
    run_dir = tmp_path / ("boot" if boot else "plain")
    run_dir.mkdir()
    (run_dir / "probe_entry.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(run_dir), os.environ.get("PYTHONPATH", "")])}
    env.pop("SLURM_JOB_ID", None)
    head = [sys.executable, "-u", "-m", "hpcrl.jobs.boot"] if boot else [sys.executable]
    proc = subprocess.Popen(
        [*head, "-u", "-m", "probe_entry", str(run_dir / "gate")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "importing").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR2)  # while the "job" is still importing
    (run_dir / "gate").touch()
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigusr2_while_a_job_imports_drains_and_requeues_instead_of_killing_it(tmp_path):
    plain = _run(tmp_path, boot=False)
    assert plain.returncode == -signal.SIGUSR2  # what a job started without boot suffers
    booted = _run(tmp_path, boot=True)
    assert booted.returncode == 0, booted.stderr
    assert booted.stdout.strip() == "set=True requeue=True", booted.stdout
    assert "SIGUSR2 (time limit ahead): draining" in booted.stderr


def test_boot_refuses_a_command_line_without_a_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hpcrl.jobs.boot", "script.py"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.strip().startswith("hpcrl.jobs.boot: expected '-m MODULE"), out.stderr
