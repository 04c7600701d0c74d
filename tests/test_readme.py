"""The README's quick tour runs as shown.

Every `$ ` line of the README's ```console blocks is run with bash, in order, in a fresh folder
that holds a copy of config.yaml: its `run_root: runs` (relative to the config's folder) is then a
temporary run root, and `~/hpcrl` in the README (the reader's checkout) stands for that folder.
Each command must exit 0, and each line of output the README shows must have its first word in
some line the command printed (numbers, timings and `...` lines aside), so the sample output
stays what the commands print. What must differ from a reader's terminal, and nothing else:

- `eval "$(make -s devcluster-env)"` takes the dev cluster's environment from the
  `slurm_cluster` fixture (the same exports; the tour's folder holds no Makefile);
- a command whose shown output has a `^C` line is sent SIGINT (to its process group, as a
  terminal's Ctrl-C) once its learner is past step 30; it must then exit 1 and print the
  `hpcrl resume` line;
- a command naming a run that an earlier `hpcrl submit --run-id X` started waits first until
  that run has finished (the README says "a few minutes later").

The blocks that use the dev cluster are one test (marked slurm: with HPCRL_REQUIRE_SLURM=1 a
missing Slurm fails it); the others are another, in the same folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RUN_GUARD_S, wait_for

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HOME_CHECKOUT = "~/hpcrl"  # how the README writes the reader's checkout in sample output
INTERRUPT_AFTER_STEP = 30
DEVCLUSTER_ENV = 'eval "$(make -s devcluster-env)"'


def tour_blocks(text: str) -> list[list[tuple[str, list[str]]]]:
    """The README's ```console blocks, each a list of (command, shown output lines)."""
    blocks = []
    for body in re.findall(r"^```console\n(.*?)^```", text, flags=re.S | re.M):
        steps: list[tuple[str, list[str]]] = []
        for line in body.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:].strip(), []))
            elif steps:
                steps[-1][1].append(line)
            elif line.strip():
                raise AssertionError(f"README console block starts with output, not a `$ ` command: {line!r}")
        blocks.append(steps)
    return blocks


def split_tour(text: str):
    """(local blocks, dev-cluster blocks): the dev-cluster tour starts at the block that sets its environment."""
    blocks = tour_blocks(text)
    first = next((i for i, b in enumerate(blocks) if any(cmd == DEVCLUSTER_ENV for cmd, _ in b)), len(blocks))
    return blocks[:first], blocks[first:]


def first_words(lines: list[str]) -> set[str]:
    return {line.split()[0] for line in lines if line.split()}


def check_shown_output(cmd: str, shown: list[str], printed: str, folder: Path) -> None:
    """Every shown line's first word (not a number, `...`, `^C` or a path into the checkout) begins a printed line."""
    words = first_words(printed.replace(str(folder), HOME_CHECKOUT).splitlines())
    for line in shown:
        parts = line.split()
        if not parts or parts[0] in ("...", "^C") or parts[0][0].isdigit():
            continue
        assert parts[0] in words, (
            f"README shows {line!r} under `$ {cmd}`, but no printed line starts with {parts[0]!r}:\n{printed[-3000:]}"
        )


def learner_step(run_dir: Path) -> int:
    try:
        learner = json.loads((run_dir / "status.json").read_text()).get("learner") or {}
    except (OSError, ValueError):
        return 0
    return int(learner.get("step") or 0)


def run_id(cmd: str) -> str | None:
    m = re.search(r"--run-id[ =](\S+)", cmd)
    return m.group(1) if m else None


def wait_finished(folder: Path, rid: str, env: dict[str, str]) -> None:
    def finished():
        out = subprocess.run(
            ["hpcrl", "status", "--json", f"runs/{rid}"], cwd=folder, env=env, capture_output=True, text=True
        )
        if out.returncode != 0:
            return False
        state = json.loads(out.stdout).get("state")
        assert state not in ("failed", "cancelled"), f"run {rid} ended {state}:\n{out.stdout[-2000:]}"
        return state == "finished"

    wait_for(finished, RUN_GUARD_S, interval_s=2.0, what=f"Slurm run {rid} to finish")


def run_interrupted(cmd: str, folder: Path, env: dict[str, str]) -> str:
    """Run `cmd` and press Ctrl-C (SIGINT to its process group) once its learner is past the step; its output."""
    rid = run_id(cmd)
    assert rid, f"an interrupted command needs --run-id to be watched: {cmd}"
    log = folder / f"{rid}.console"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", cmd], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for(
            lambda: proc.poll() is not None or learner_step(folder / "runs" / rid) > INTERRUPT_AFTER_STEP,
            RUN_GUARD_S,
            what=f"{rid}'s learner past step {INTERRUPT_AFTER_STEP}",
        )
        assert proc.poll() is None, f"`{cmd}` ended before it could be interrupted:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=RUN_GUARD_S)
    printed = log.read_text()
    assert rc == 1 and "hpcrl resume" in printed, f"`{cmd}` after Ctrl-C: exit {rc}\n{printed[-3000:]}"
    assert "Traceback" not in printed, f"`{cmd}` after Ctrl-C:\n{printed[-3000:]}"
    # Stopped in order: the learner saved where it was (a resume goes on from there, not step 0).
    saved = [int(p.name[len("step") :]) for p in (folder / "runs" / rid / "checkpoints").glob("step*")]
    assert max(saved, default=0) > INTERRUPT_AFTER_STEP, f"checkpoints {sorted(saved)} after Ctrl-C\n{printed[-3000:]}"
    return printed


def run_block(block, folder: Path, env: dict[str, str], submitted: set[str], request) -> None:
    for cmd, shown in block:
        if cmd == DEVCLUSTER_ENV:
            env.update(request.getfixturevalue("slurm_cluster"))
            continue
        for rid in submitted:
            if f"runs/{rid}" in cmd:
                wait_finished(folder, rid, env)
        t0 = time.monotonic()
        if "^C" in (line.strip() for line in shown):
            printed = run_interrupted(cmd, folder, env)
        else:
            res = subprocess.run(
                ["bash", "-c", cmd],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=RUN_GUARD_S,
            )
            printed = res.stdout + res.stderr
            assert res.returncode == 0, f"`{cmd}` exited {res.returncode}:\n{printed[-3000:]}"
        check_shown_output(cmd, shown, printed, folder)
        if cmd.startswith("hpcrl submit") and (rid := run_id(cmd)):
            submitted.add(rid)
        print(f"{time.monotonic() - t0:7.1f} s  $ {cmd}")


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """The tour's folder (config.yaml copied in), its environment and the Slurm runs it submitted."""
    folder = tmp_path_factory.mktemp("tour").resolve()
    shutil.copy(ROOT / "config.yaml", folder / "config.yaml")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    assert shutil.which("hpcrl", path=env["PATH"]), "the hpcrl command is not next to this Python"
    yield folder, env, set()
    # A Slurm run left behind by a failed test would hold the dev cluster's GPUs.
    for run in (folder / "runs").glob("*"):
        if (run / "jobs.json").exists():
            subprocess.run(["hpcrl", "cancel", str(run)], cwd=folder, env=env, capture_output=True, timeout=120)


def test_the_readme_has_a_tour_on_this_machine_and_on_the_dev_cluster():
    local_blocks, cluster_blocks = split_tour(README.read_text())
    local = [cmd for b in local_blocks for cmd, _ in b]
    cluster = [cmd for b in cluster_blocks for cmd, _ in b]
    for verb in ("run", "resume", "status", "plot", "eval", "logs"):
        assert any(c.startswith(f"hpcrl {verb} ") for c in local), f"the local tour has no `hpcrl {verb}`"
    for verb in ("sbatch", "submit", "status"):
        assert any(c.startswith(f"hpcrl {verb} ") for c in cluster), f"the dev-cluster tour has no `hpcrl {verb}`"


def test_the_local_tour_runs_as_shown(tour, request):
    folder, env, submitted = tour
    for block in split_tour(README.read_text())[0]:
        run_block(block, folder, env, submitted, request)


@pytest.mark.slurm
def test_the_dev_cluster_tour_runs_as_shown(tour, request):
    folder, env, submitted = tour
    env = dict(env)
    for block in split_tour(README.read_text())[1]:
        run_block(block, folder, env, submitted, request)
