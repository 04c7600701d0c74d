"""The learner's per-step diagnostics (rl/learner/diagnostics.py), the diagnostics plot `hpcrl run`
writes (jobs/diagnostics.py), and the store refresh that no longer re-reads finalized shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hpcrl.jobs.diagnostics import moving_average, write_diagnostics_png
from hpcrl.rl.learner.diagnostics import batch_diagnostics
from hpcrl.rl.record.trajectory import Step, Trajectory

EOS = 2


def traj(task: str, episode: int, reward: float, action=(20, EOS), version=0, prompt=(1, 10)) -> Trajectory:
    step = Step(
        policy_version=version,
        prompt_tokens=list(prompt),
        action_tokens=list(action),
        action_logprobs=[-0.5] * len(action),
        loss_mask=[1] * len(action),
        observation_tokens=[],
        reward=reward,
    )
    return Trajectory(
        run="r", domain="d", task=task, episode=episode, generator="g", steps=(step,), final_reward=reward
    )


def test_batch_diagnostics_on_a_hand_made_batch():
    groups = [
        [traj("a", 0, 1.0, version=5), traj("a", 1, 0.0, action=(20, 21, 22), version=4)],  # variance
        [traj("b", 2, 0.0, prompt=(1, 11), version=5), traj("b", 3, 0.0, prompt=(1, 11), version=5)],  # none
    ]
    adv = torch.tensor([0.7071, -0.7071, 0.0, 0.0])
    d = batch_diagnostics(groups, adv, version=5, eos_ids={EOS}, decode=lambda ids: "".join(chr(60 + i) for i in ids))
    assert d["zero_var_groups"] == 0.5 and d["stuck_groups"] == 0.5  # b: wrong every time, below the mean
    assert d["group_reward_std"] == pytest.approx(np.std([1.0, 0.0], ddof=1) / 2)
    assert d["adv_nonzero"] == 0.5 and d["adv_max"] == pytest.approx(0.7071) and d["adv_min"] == pytest.approx(-0.7071)
    assert d["adv_abs_mean"] == pytest.approx(0.7071 / 2)
    assert d["staleness_hist"] == {"0": 3, "1": 1}
    assert d["completion_len"] == pytest.approx((2 + 3 + 2 + 2) / 4)
    assert d["eos_fraction"] == 0.75  # the 3-token answer ran into the length limit
    assert d["reward_by_prompt"] == {"d:=F": 0.5, "d:=G": 0.0}
    json.dumps(d)  # goes to metrics.jsonl as it is


def test_diagnostics_png_from_metrics(tmp_path):
    rng = np.random.default_rng(0)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, 121):
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "reward": min(1.0, s / 100 + rng.normal(0, 0.05)),
                        "reward_by_domain": {"x": 0.5, "y": 0.6},
                        "entropy": 2.0 - s / 100,
                        "entropy_first": 1.5,
                        "zero_var_groups": 0.8 - s / 200,
                        "adv_nonzero": 0.2,
                        "adv_abs_mean": 0.3,
                        "adv_min": -1.0,
                        "adv_max": 2.0,
                        "ratio_min": 0.9 if s % 7 else float("nan"),
                        "ratio_mean": 1.0,
                        "ratio_max": 1.1,
                        "clip_fraction": 0.01,
                        "staleness_hist": {"0": 200, "1": 56},
                        "completion_len": 3.0,
                        "eos_fraction": 0.4,
                        "skipped": s == 3,
                        "reward_by_prompt": {f"sum:{s % 13}+1=": 0.5, "sum:0+0=": 1.0},
                    }
                )
                + "\n"
            )
    out = write_diagnostics_png(tmp_path)
    assert out == tmp_path / "diagnostics.png" and out.stat().st_size > 20_000
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.1}) + "\n")
    assert write_diagnostics_png(tmp_path / "old") is None  # metrics of an hpcrl without diagnostics
    assert moving_average([1.0, float("nan"), 3.0, 5.0], 2) == [1.0, 1.0, 3.0, 4.0]


def test_reader_refresh_skips_finalized_shards(tmp_path, monkeypatch):
    from hpcrl.core.config import StoreConfig
    from hpcrl.rl.record.synth import SynthShape, synth_trajectory
    from hpcrl.rl.store import layout
    from hpcrl.rl.store.reader import StoreReader
    from hpcrl.rl.store.writer import ShardWriter

    shape = SynthShape(first_prompt=(5, 10), later_prompt=(2, 4), action=(3, 6), observation=(0, 4))
    rng = np.random.default_rng(0)
    cfg = StoreConfig(flush_every=2, flush_interval_s=30.0, flush_idle_s=30.0, compression="none", shard_max_rows=4)
    with ShardWriter(tmp_path, "w0", cfg) as w:
        for i in range(8):  # two finalized shards
            w.append(synth_trajectory(rng, "r", "g", i, shape))
    reader = StoreReader(tmp_path)
    assert len(reader.next_batch(100).trajectories) == 8
    reads = []
    real = layout.read_shard
    monkeypatch.setattr("hpcrl.rl.store.layout.read_shard", lambda p: reads.append(p) or real(p))
    reader.refresh()
    assert reads == []  # nothing of a finalized shard is read again
    with ShardWriter(tmp_path, "w1", cfg) as w:
        w.append(synth_trajectory(rng, "r", "g", 8, shape))
        w.flush()
        reads.clear()  # the writer lists the store when it starts
        reader.refresh()
        assert [p.name.split(".")[0] for p in reads] == ["w1"]  # only the new, live shard
        assert len(reader.next_batch(10).trajectories) == 1
