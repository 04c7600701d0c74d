"""`hpcrl run config.yaml policy.path=DIR` with real Hugging Face models built here (Llama and
Qwen2, random init, byte-level BPE of 8k tokens trained on local text, ChatML template):
every component a local job, chat-message prompts and a feedback turn, and the policy learns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpcrl.rl.model.models import build_tiny_hf

from conftest import RUN_GUARD_S
from test_run import finish, hpcrl

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hpcrl_run_learns_with_a_local_hugging_face_model(tmp_path, arch):
    model = build_tiny_hf(tmp_path / "model", arch=arch, vocab=8192, max_chars=1_500_000)
    shutil.copy(HERE / "bpe_domains.py", tmp_path / "bpe_domains.py")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("domains:\n  - name: digits\n    module: bpe_domains:make_domain\n")
    proc = hpcrl(
        "run",
        str(cfg),
        f"policy.path={model}",
        f"experiment.run_root={tmp_path / 'runs'}",
        "learner.max_steps=40",
        "learner.batch_groups=8",
        "learner.lr=1e-2",
        "generators.episodes_in_flight=64",
        "--run-id",
        "hf",
    )
    out = finish(proc, RUN_GUARD_S)
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "runs" / "hf"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, rewards
    resolved = (run_dir / "config.resolved.yaml").read_text()
    assert f"path: {model}" in resolved
