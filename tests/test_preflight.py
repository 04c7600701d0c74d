"""Mistakes a user makes on the first day end in one line naming the fix, before any component
starts (jobs/checks.py, `hpcrl validate` and the start of `hpcrl run` / `submit`); arguments go
where users put them; and a component that fails twice at start stops the run with its error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.core.config import load_config
from hpcrl.jobs.checks import check_sinks
from hpcrl.jobs.supervise import error_line

from conftest import RUN_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


def hpcrl(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from hpcrl.rl.model.models import build_tiny_hf

    return build_tiny_hf(tmp_path_factory.mktemp("tiny"), vocab=512, hidden=16, layers=1, heads=2, kv_heads=1,
                         intermediate=32, max_context=256, max_chars=200_000)  # fmt: skip


def _copy(model: Path, dest: Path, drop: tuple[str, ...]) -> Path:
    shutil.copytree(model, dest)
    for pattern in drop:
        for f in dest.glob(pattern):
            f.unlink()
    return dest


def _mistakes(tmp_path: Path, tiny: Path) -> list[tuple[list[str], dict, str]]:
    (tmp_path / "a-file").write_text("")
    return [
        (["domains=[{name: arithm/max2}]"], {}, "unknown domain family 'arithm' (did you mean 'arith'?)"),
        (["domains=[{name: arith/max9x}]"], {}, "arith: unknown variant 'max9x'"),
        (["domains=[{name: stdlib-repair}]"], {"HPCRL_CACHE_DIR": str(tmp_path / "cache")},
         "build it once with `hpcrl domains build stdlib-repair`"),
        (["policy.path=/nonexistent"], {}, "policy.path '/nonexistent': no such folder"),
        ([f"policy.path={tmp_path}"], {}, "no config.json there"),
        ([f"policy.path={_copy(tiny, tmp_path / 'no-tok', ('tokenizer*',))}"], {}, "its tokenizer does not load"),
        ([f"policy.path={_copy(tiny, tmp_path / 'no-weights', ('*.safetensors',))}"], {}, "no weights there"),
        ([f"experiment.run_root={tmp_path / 'a-file' / 'runs'}"], {}, "a-file is not a folder; set experiment"),
        (["domains=[{name: synth}]"], {"PATH": str(Path(sys.executable).parent)},
         "not found on PATH: install bubblewrap and util-linux"),
        (["domains=[{name: synth}]", "sandbox.backend=apptainer"], {"PATH": str(Path(sys.executable).parent)},
         "'apptainer' is not on PATH: `module load apptainer`, or sandbox.backend: bwrap"),
    ]  # fmt: skip


def test_each_mistake_is_one_line_naming_the_fix_before_anything_starts(tmp_path, tiny_model):
    runs = tmp_path / "runs"
    for overrides, env, fix in _mistakes(tmp_path, tiny_model):
        for verb in ("validate", "run"):
            # The run id goes before an override: where users put it, not where argparse wanted it.
            extra = ["--run-id", "x"] if verb == "run" else []
            r = hpcrl(verb, "config.yaml", *extra, f"experiment.run_root={runs}", *overrides, env=env)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, (verb, overrides, r.stdout, r.stderr)
            assert r.stderr.startswith(f"hpcrl {verb}: error: ") and fix in r.stderr, (verb, overrides, r.stderr)
            assert "Traceback" not in r.stderr and not runs.exists(), (verb, overrides)
    ok = hpcrl("validate", "config.yaml", f"policy.path={tiny_model}")
    assert ok.returncode == 0 and "config OK" in ok.stdout, ok.stderr


def test_optional_metric_packages_are_named_when_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    cfg = load_config(None, ["metrics.tensorboard=true"]).metrics
    assert check_sinks(cfg) == (
        "metrics.tensorboard is true but the tensorboard package is not installed: "
        "pip install tensorboard, or set metrics.tensorboard: false"
    )
    cfg = load_config(None, ["metrics.wandb.mode=offline"]).metrics
    assert "pip install wandb, or set metrics.wandb.mode: disabled" in check_sinks(cfg)
    assert check_sinks(load_config(None).metrics) is None


def test_overrides_anywhere_after_config_and_stray_arguments_in_one_line():
    import yaml

    r = hpcrl("validate", "config.yaml", "learner.lr=1", "--print", "learner.lr=2e-4", "learner.max_steps=7")
    assert r.returncode == 0, r.stderr
    learner = yaml.safe_load(r.stdout)["learner"]
    assert (learner["lr"], learner["max_steps"]) == (2e-4, 7)  # in the order given
    r = hpcrl("run", "config.yaml", "--runid", "x")
    assert r.returncode == 2 and r.stderr == (
        "hpcrl run: error: unrecognized argument '--runid'; did you mean --run-id? `hpcrl run` takes --run-id, "
        "--timeout-min, --quiet (KEY=VALUE overrides go after CONFIG)\n"
    )
    r = hpcrl("run", "learner.lr=1e-4", "config.yaml")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "give the config file first" in r.stderr and "`hpcrl run config.yaml learner.lr=1e-4`" in r.stderr
    r = hpcrl("logs", "a", "b", "c")
    assert r.returncode == 2 and r.stderr == (
        "hpcrl logs: error: unrecognized argument 'c'; `hpcrl logs` takes --config, --follow, --lines, --all\n"
    )


def test_error_line_is_the_exception_not_submitits_advice():
    trace = (
        "Job (task=0) failed during processing with trace:\n----------------------\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    raise ValueError('a')\n"
        "FileNotFoundError: policy.path 'x': no config.json there\n\n----------------------\n"
        "You can check full logs with 'job.stderr(0)' and 'job.stdout(0)'or at paths:\n  - /r/1_0_log.err\n"
        "  - /r/1_0_log.out"
    )
    assert error_line(trace) == "FileNotFoundError: policy.path 'x': no config.json there"
    assert (
        error_line("job 4 ended without a result (killed by signal 9)")
        == "job 4 ended without a result (killed by signal 9)"
    )
    assert error_line("") == "ended without saying why"


def test_submit_checks_partitions_and_gres_before_submitting(slurm_cluster, tmp_path):
    runs = tmp_path / "runs"
    for overrides, fix in [
        (["slurm.learner.partition=gpux"], "slurm.learner.partition 'gpux': no such partition on this cluster"),
        (["slurm.learner.gpus_per_node=8", "slurm.learner.tasks_per_node=8"],
         "slurm.learner.gpus_per_node 8: partition gpu has nodes with at most 4 GPUs (GRES gpu)"),
        (["slurm.generator.mem_gb=4096"], "slurm.generator.mem_gb 4096: partition gpu's nodes have at most"),
        (["slurm.learner.nodes=9"], "slurm.learner.nodes 9: partition gpu has 2 node(s)"),
        (["domains=[{name: synth}]", "sandbox.backend=apptainer", f"sandbox.image={tmp_path / 'no.sif'}"],
         f"sandbox.image {tmp_path / 'no.sif'} does not exist: build it with `hpcrl sandbox build-image"),
    ]:  # fmt: skip
        for verb in ("validate", "submit"):
            r = hpcrl(verb, "config.yaml", "executor=slurm", f"experiment.run_root={runs}", *overrides)
            assert r.returncode == 2 and r.stderr.count("\n") == 1 and fix in r.stderr, (verb, overrides, r.stderr)
            assert not runs.exists()
    ok = hpcrl("validate", "config.yaml", "executor=slurm")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
def test_a_component_that_fails_twice_at_start_stops_the_run_with_its_error_and_log(tmp_path, tiny_model):
    """Weights that do not load pass the checks (they are not read there) and fail every
    learner and generator at start: the run stops at the second same failure, in one line."""
    broken = _copy(tiny_model, tmp_path / "broken", ())
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    r = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path / 'runs'}",
        f"policy.path={broken}",
        "domains=[{name: arith/copy}]",
        "--run-id",
        "broken",
        "--quiet",
        timeout=RUN_GUARD_S,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    (fail,) = [ln for ln in out.splitlines() if ln.startswith("hpcrl run: ")]
    name = fail.split()[2]
    assert name in ("learner", "gen-0") and " failed twice at start: " in fail, fail
    log = fail.rsplit("(log: ", 1)[1].rstrip(")")
    assert Path(log).is_file() and Path(log).parent == tmp_path / "runs" / "broken" / "submitit", fail
    assert "Traceback" not in out and "job.stderr" not in out and "restarting it in" in out, out[-3000:]
    run = tmp_path / "runs" / "broken"
    assert f"hpcrl resume {run}" in out and f"hpcrl logs {run} {name}" in out, out[-2000:]
    logs = hpcrl("logs", str(run), name)
    assert logs.returncode == 0 and "Traceback" in logs.stdout, logs.stderr  # the whole story is in its log
