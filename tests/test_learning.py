"""The tiny model learns the quick domains by RL: generator + one-rank ZeRO-3 learner taking turns
(hpcrl.rl.learner.inprocess), from scratch, on the default config.yaml. Runs in a subprocess so
DeepSpeed's process group never lives in the pytest process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RUN_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_reward_rises_from_untrained_to_0_8(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.rl.learner.inprocess",
            str(ROOT / "config.yaml"),
            "learner.max_steps=300",
            "--run-dir",
            str(tmp_path / "run"),
            "--metrics",
            str(metrics),
            "--stop-at-reward",
            "0.8",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_GUARD_S,  # a hang guard only
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    rewards = [m["reward"] for m in steps]
    untrained = sum(rewards[:5]) / 5
    # One-digit answers from ~100 tokens: an untrained policy is right ~1% of the time.
    assert untrained < 0.1, rewards[:5]
    assert rewards[-1] >= 0.8, f"reward after {len(rewards)} steps: {rewards[-10:]}"
    assert sum(rewards[-5:]) / 5 > untrained + 0.5, rewards[-5:]
    # every quick domain learned, not one of them
    last = steps[-1]["reward_by_domain"]
    assert len(last) == 3 and min(last.values()) >= 0.5, last
    # on-policy: the learner recomputes the generator's log-probabilities
    assert all(abs(m["ratio_mean"] - 1) < 1e-3 for m in steps)
    print(f"reward {untrained:.3f} -> {rewards[-1]:.3f} in {len(rewards)} steps, {steps[-1]['elapsed_s']:.1f} s")
