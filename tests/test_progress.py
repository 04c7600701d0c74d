"""What a run shows about itself, on records written here the way the coordinator writes them:
skipped steps and the no-learning-signal warning (jobs/report.py), and the same numbers in
TensorBoard under the Prometheus series' names (core/sinks.py). tests/test_run.py checks both on
a real degenerate run."""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.core.config import load_config
from hpcrl.core.sinks import STATE_NAME, MetricSinks, series
from hpcrl.jobs.report import NO_SIGNAL_STEPS, MetricsFollower, learning_signal, progress_line, status_text


def _row(step: int, reward: float, skipped: bool, prompts: dict | None = None, **kw) -> dict:
    return {
        "step": step,
        "version": 0,
        "reward": reward,
        "skipped": skipped,
        "zero_var_groups": 1.0 if skipped else 0.5,
        "reward_by_prompt": prompts if prompts is not None else {"d:a": reward, "d:b": reward},
        "time": 1000.0 + step,
        **kw,
    }


def _write(run_dir: Path, rows, tail: str = "") -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_skipped_steps_are_counted_and_a_flat_reward_warns_after_n_steps(tmp_path):
    _write(tmp_path, [_row(1, 0.5, False, {"d:a": 0.0, "d:b": 1.0})])
    _write(tmp_path, [_row(k, 0.0, True) for k in range(2, NO_SIGNAL_STEPS + 1)])  # 19 without signal
    follower = MetricsFollower(tmp_path)
    sig = follower.poll()
    assert (sig.steps, sig.skipped, sig.streak, sig.flat_reward, sig.warning) == (20, 19, 19, 0.0, None)
    # The 20th in a row, and a line still being written (not read until whole).
    _write(tmp_path, [_row(NO_SIGNAL_STEPS + 1, 0.0, True)], tail='{"step": 22, "rew')
    sig = follower.poll()
    assert sig.warning == f"no learning signal: every reward 0 for {NO_SIGNAL_STEPS} steps"
    status = {"learner": {"step": 21, "reward": 0.0, "version": 0}, "busy": {}, "traj_per_s": 3.0}
    line = progress_line(status, 300, sig)
    assert "reward 0.000  skipped 20/21" in line and line.endswith(f"| {sig.warning}")
    (tmp_path / "status.json").write_text(json.dumps({**status, "state": "running", "updated": 0}))
    text = status_text(tmp_path, status)
    assert "skipped    20 of 21 steps" in text and f"WARNING    {sig.warning}" in text


def test_solved_or_mixed_flat_groups_and_a_restart_that_redoes_steps(tmp_path):
    _write(tmp_path, [_row(k, 1.0, True) for k in range(1, 26)])
    assert learning_signal(tmp_path).warning == "no learning signal: every reward 1 for 25 steps"
    # A restarted learner redoes steps 21-25 with signal: its reports replace the first ones.
    _write(tmp_path, [_row(k, 0.5, False, {"d:a": 0.0, "d:b": 1.0}) for k in range(21, 26)])
    sig = learning_signal(tmp_path)
    assert (sig.steps, sig.skipped, sig.streak, sig.warning) == (25, 20, 0, None)
    # Groups flat at different rewards: no single reward to name, still no signal.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write(mixed, [_row(k, 0.5, True, {"d:a": 0.0, "d:b": 1.0}) for k in range(1, 21)])
    assert (
        learning_signal(mixed).warning
        == "no learning signal: no group's rewards differed for 20 steps (every advantage 0)"
    )


def test_progress_line_without_metrics_and_with_null_statistics():
    assert progress_line(None, 10).startswith("starting")
    line = progress_line({"learner": {"step": 1, "reward": None}, "busy": {}}, 10)
    assert "reward -" in line and "skipped" not in line


def test_series_are_the_prometheus_names_with_labels_as_path_parts():
    row = {
        "step": 7,
        "version": 3,
        "reward": 0.25,
        "loss": -0.5,
        "ratio_mean": None,  # a skipped update's: left out, not 0
        "skipped": True,
        "reward_by_domain": {"arith/copy": 0.5},
        "busy": {"learner": 0.4},
        "traj_per_s": 12.0,
        "eval/humaneval/pass@1": 0.1,
        "eval/step": 6,
        "reward_by_prompt": {"x": 1.0},
        "time": 5.0,
    }
    assert series(row) == {
        "hpcrl_learner_step": 7.0,
        "hpcrl_policy_version": 3.0,
        "hpcrl_reward": 0.25,
        "hpcrl_learner_loss": -0.5,
        "hpcrl_learner_skipped": 1.0,
        "hpcrl_reward/domain=arith/copy": 0.5,
        "hpcrl_busy_fraction/role=learner": 0.4,
        "hpcrl_trajectories_per_s": 12.0,
        "hpcrl_eval_pass_at_k/domain=humaneval,k=1": 0.1,
        "hpcrl_eval_step": 6.0,
    }


def test_tensorboard_sink_writes_each_row_once_across_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ["metrics.tensorboard=true"]).metrics
    _write(tmp_path, [_row(k, k / 10, False, reward_by_domain={"arith/copy": k / 10}) for k in (1, 2)])
    sinks = MetricSinks(tmp_path, cfg, tmp_path / "metrics.jsonl")
    assert sinks.pump() == 2
    sinks.close()
    _write(tmp_path, [_row(3, 0.3, False)], tail='{"step": 4')
    again = MetricSinks(tmp_path, cfg, tmp_path / "metrics.jsonl")  # a resumed run's driver
    assert again.pump() == 1  # step 3 only: 1 and 2 were written, the torn line waits
    again.close()
    assert json.loads((tmp_path / STATE_NAME).read_text())["offset"] < (tmp_path / "metrics.jsonl").stat().st_size
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("hpcrl_reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.step for e in acc.Scalars("hpcrl_reward/domain=arith/copy")] == [1, 2]
    off = MetricSinks(tmp_path / "none", load_config(None).metrics, tmp_path / "metrics.jsonl")
    assert off.pump() == 0 and not (tmp_path / "none").exists()  # nothing enabled: nothing written
