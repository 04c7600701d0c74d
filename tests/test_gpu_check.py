"""bench/gpu_check.py's CPU half (the GPU half differs only in the device): two learner ranks of
the real ZeRO-3 learner on gloo, a weight publish and the decode engine, on a model built here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def test_cpu_half_trains_two_ranks_publishes_and_generates(tmp_path):
    args = ["--cpu", "--gpus", "2", "--steps", "2", "--episodes", "8", "--json", "--dir", str(tmp_path)]
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["device"] == "cpu" and got["ranks"] == 2 and got["backend"] == "gloo", got
    assert got["params"] > 500_000 and got["trajectories_per_s"] > 0 and got["publish_gb_s"] > 0, got
    assert got["gen_tokens"] == 8 * 16, got  # every episode exactly --action tokens: no eos ended one early
    assert got["learner_peak_gb"] > 0 and got["gen_peak_gb"] > 0, got
    # The last publish: one shard per rank.
    latest = max((tmp_path / "run" / "weights").glob("v*"))
    assert sorted(p.name for p in latest.glob("shard-*.safetensors")) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]


def test_without_the_gpus_it_asks_for_it_says_what_to_run(tmp_path):
    if torch.cuda.device_count() >= 1:
        return  # a GPU machine runs the real check
    res = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "gpu_check: 1 GPU(s) asked, torch sees 0; run with --cpu for the CPU half, or --gpus N"
    ]
