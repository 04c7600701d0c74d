"""The DeepSpeed ZeRO-3 learner as real processes (gloo on CPU): a 2-rank step that matches the
same step on one rank, weight publishing by version, checkpoint/resume of model + optimizer, and
bf16 gradients accumulated and reduced in fp32. The batches hold groups sampled hot (another
temperature): the learner scores them under the distribution that drew them (ratio 1).

Each learner rank is its own process (tests/learner_worker.py) with its own timeout: if one rank
dies the other would block in a collective forever.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.core.config import load_config
from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
from hpcrl.rl.domains import load_domains
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.generator import Generator
from hpcrl.rl.weights.shards import WeightStore

WORKER = Path(__file__).with_name("learner_worker.py")
LR = 1e-2  # Adam: every element moves by about lr per step
OVERRIDES = [
    "policy.device=cpu",
    "policy.tiny.hidden_size=32",
    "policy.tiny.num_layers=1",
    "policy.tiny.num_heads=2",
    "policy.tiny.intermediate_size=64",
    "learner.group_size=4",
    "learner.batch_groups=4",
    "learner.micro_batch=4",
    f"learner.lr={LR}",
    # The rate follows the learner's step, a skipped batch's included: held constant here so a run
    # with a skipped batch trains exactly as one without it (the schedules: test_lr_schedule).
    "learner.lr_schedule=constant",
    "learner.keep_weights=5",
    "generators.episodes_in_flight=16",
    "domains=[{name: arith/copy}, {name: arith/max3-retry2}]",
]
# A hang guard, not a speed check: a rank takes ~1-2 min on an idle 2-core machine, several
# times that on a loaded one; a rank stuck in a collective never ends.
TIMEOUT_S = 900


def write_config(tmp: Path) -> Path:
    cfg = load_config(None, OVERRIDES)
    from hpcrl.core.config import dump_config

    path = tmp / "learner.yaml"
    path.write_text(dump_config(cfg))
    return path


def make_batches(cfg_path: Path, n: int) -> list:
    """Real sampled trajectories (generator, tiny policy v0), every third group sampled hot (as
    generators.explore_temperature does a stuck task's); rewards set to alternate inside each
    group, so every group has a learning signal."""
    cfg = load_config(cfg_path)
    policy = Policy.load(cfg.policy, seed=cfg.experiment.seed)
    gen = Generator(cfg.generators, policy, load_domains(cfg.domains), run="t", name="g", seed=0)
    gen.stuck.temperature = lambda ticket, base: 1.6 if ticket.group % 3 == 1 else base
    source = LocalTaskSource(TaskSampler({d.name: 1.0 for d in cfg.domains}, cfg.learner.group_size, seed=0))
    groups: dict = {}
    full: list = []

    def add(t):
        g = groups.setdefault((t.domain, t.task), [])
        g.append(t)
        if len(g) == cfg.learner.group_size:
            full.append(g)

    gen.run(source, add, stop=lambda: len(full) >= n * cfg.learner.batch_groups)
    gen.close()
    assert any(len(t.steps) > 1 for g in full for t in g), "want multi-step episodes in the batch"
    assert any(t.steps[0].temperature == 1.6 for g in full for t in g), "want hot groups in the batch"
    full = [
        [dataclasses.replace(t, final_reward=float((i + j) % 2)).to_dict() for i, t in enumerate(g)]
        for j, g in enumerate(full)
    ]
    k = cfg.learner.batch_groups
    return [full[i * k : (i + 1) * k] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cfg: Path, run_dir: Path, batches: Path, out: Path, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(cfg), str(run_dir), str(batches), str(out), *extra],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], out: Path) -> list[dict]:
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p in procs:
        log = p.stdout.read()
        assert p.returncode == 0, f"learner rank exited {p.returncode}:\n{log[-4000:]}"
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(len(procs))]


def run_ranks(world: int, cfg: Path, run_dir: Path, batches: Path, out: Path, *extra: str) -> list[dict]:
    """launch + finish; on a shared machine another process can take the free port between our
    probe and rank 0's bind: relaunch then (the run dir is untouched until setup succeeds)."""
    for attempt in range(3):
        procs = launch(world, cfg, run_dir, batches, out, *extra)
        try:
            return finish(procs, out)
        except AssertionError as exc:
            if "Address already in use" not in str(exc) or attempt == 2:
                raise


def weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    return WeightStore(run_dir).read(version)


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol), f"{k}: max diff {(a[k] - b[k]).abs().max():.2e}"


def assert_same_training(w0: dict, a: dict, b: dict, lr: float) -> None:
    """Two runs made the same updates from w0, up to float summation order.

    A fixed atol is machine-dependent: Adam divides by sqrt(v) + eps, so an element whose
    gradient is near eps (cancelling terms) moves by a visibly different amount when the
    reduce-scatter sums in another order (2e-5 seen on one machine, below 1e-6 elsewhere). A
    sharding bug moves whole tensors by the size of an update, so compare against that: the
    difference is a tiny fraction of the update's norm, and no element is off by 5% of one
    Adam step (lr)."""
    assert a.keys() == b.keys() == w0.keys()
    for k in a:
        diff, update = (a[k] - b[k]), (b[k] - w0[k])
        assert diff.abs().max() < 0.05 * lr, f"{k}: max diff {diff.abs().max():.2e} vs lr {lr}"
        if update.norm() > 0:
            assert diff.norm() / update.norm() < 1e-3, f"{k}: diff/update norm {diff.norm() / update.norm():.2e}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("learner")
    cfg = write_config(tmp)
    batches = tmp / "batches.json"
    batches.write_text(json.dumps(make_batches(cfg, 2)))
    return tmp, cfg, batches


def test_two_rank_zero3_step_matches_one_rank(setup):
    tmp, cfg, batches = setup
    two, one = tmp / "two", tmp / "one"
    r1 = run_ranks(1, cfg, one, batches, tmp / "out1")
    r2 = run_ranks(2, cfg, two, batches, tmp / "out2")

    assert [r["world"] for r in r2] == [2, 2] and r1[0]["world"] == 1
    assert all(r["partitioned"] for r in r2), "ZeRO-3 should shard every parameter across the two ranks"
    assert r2[0]["local_numel"] < r2[0]["full_numel"] and r1[0]["local_numel"] == r1[0]["full_numel"]
    for step2, step1 in zip(r2[0]["steps"], r1[0]["steps"]):
        # Each rank saw half the rows; the reported statistics are global and agree with one rank.
        assert step2["action_tokens"] == step1["action_tokens"] > 0
        assert step2["loss"] == pytest.approx(step1["loss"], abs=1e-5)
        assert step2["reward"] == step1["reward"] == 0.5
    first = r2[0]["steps"][0]
    # behaviour logprobs = learner's v0, the hot groups' scored at their temperature too
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and first["ratio_max"] < 1 + 1e-3
    assert first["staleness_max"] == 0 and first["version"] == 1

    # Published versions 0, 1, 2 exist; training moved the weights; both layouts agree.
    w0, w2 = weights(two, 0), weights(two, 2)
    assert any(not torch.equal(w0[k], w2[k]) for k in w0)
    assert_same_training(w0, w2, weights(one, 2), lr=LR)
    assert_close(w0, weights(one, 0), atol=0)  # same seed, same initial model


def test_per_layer_gathering_trains_exactly_as_per_submodule_gathering(setup):
    """learner.gather_per_layer (the default) makes each decoder layer a ZeRO-3 leaf module: its
    parameters are fetched whole, its submodules get no hooks. Only when parameters are gathered
    changes: the same batches give the same weights as gathering submodule by submodule."""
    from hpcrl.core.config import dump_config

    tmp, _, batches = setup
    per_module = tmp / "per-module.yaml"
    per_module.write_text(dump_config(load_config(None, OVERRIDES + ["learner.gather_per_layer=false"])))
    layer = run_ranks(1, setup[1], tmp / "leaf", batches, tmp / "leaf-out")[0]
    module = run_ranks(1, per_module, tmp / "noleaf", batches, tmp / "noleaf-out")[0]
    assert layer["leaf_modules"] == ["LlamaDecoderLayer"] and module["leaf_modules"] == []
    for a, b in zip(layer["steps"], module["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["action_tokens"] == b["action_tokens"] > 0
    assert_close(weights(tmp / "leaf", 0), weights(tmp / "noleaf", 0), atol=0)
    assert_same_training(weights(tmp / "noleaf", 0), weights(tmp / "leaf", 2), weights(tmp / "noleaf", 2), lr=LR)


def test_shared_prompt_packing_trains_exactly_as_one_row_per_trajectory(setup):
    """learner.share_prompt (the default) runs each group's common prompt once, its members'
    own tokens masked from each other (rl/learner/packing.py), and gives whole groups to each rank: the
    same loss, statistics and update as one row per trajectory, on one rank and on two."""
    from hpcrl.core.config import dump_config

    tmp, cfg, batches = setup
    rows_cfg = tmp / "rows.yaml"
    rows_cfg.write_text(dump_config(load_config(None, OVERRIDES + ["learner.share_prompt=false"])))
    packed = run_ranks(1, cfg, tmp / "packed", batches, tmp / "packed-out")[0]
    packed2 = run_ranks(2, cfg, tmp / "packed2", batches, tmp / "packed2-out")[0]
    rows = run_ranks(1, rows_cfg, tmp / "rows", batches, tmp / "rows-out")[0]
    for a, a2, b in zip(packed["steps"], packed2["steps"], rows["steps"]):
        assert a["action_tokens"] == a2["action_tokens"] == b["action_tokens"] > 0
        for key in ("loss", "ratio_mean", "entropy", "clip_fraction"):
            assert a[key] == pytest.approx(b[key], abs=1e-5) and a2[key] == pytest.approx(b[key], abs=1e-5), key
    w0 = weights(tmp / "rows", 0)
    assert_same_training(w0, weights(tmp / "packed", 2), weights(tmp / "rows", 2), lr=LR)
    assert_same_training(w0, weights(tmp / "packed2", 2), weights(tmp / "rows", 2), lr=LR)


def test_token_budget_micro_batches_train_as_one_pass(setup):
    """learner.micro_batch_tokens cuts each rank's rows by their padded length: how many micro-
    batches a step takes follows the batch (the ranks agree on the most, a short rank runs empty
    ones), and the last is DeepSpeed's accumulation boundary whatever its configured count. The
    update is the one-pass update."""
    from hpcrl.core.config import dump_config

    tmp, _, batches = setup
    paths = {}
    for name, extra in {"one": ["learner.micro_batch_tokens=0"], "budget": ["learner.micro_batch_tokens=48"]}.items():
        paths[name] = tmp / f"{name}-pass.yaml"
        paths[name].write_text(dump_config(load_config(None, [*OVERRIDES, "learner.micro_batch=16", *extra])))
    one = run_ranks(1, paths["one"], tmp / "one-pass", batches, tmp / "one-pass-out")[0]
    budget = run_ranks(2, paths["budget"], tmp / "budget", batches, tmp / "budget-out")
    assert [m["micro_batches"] for m in one["steps"]] == [1, 1]
    counts = [[m["micro_batches"] for m in r["steps"]] for r in budget]
    assert counts[0] == counts[1] and min(counts[0]) >= 2, counts
    for a, b in zip(budget[0]["steps"], one["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["action_tokens"] == b["action_tokens"] > 0
    w0 = weights(tmp / "one-pass", 0)
    assert_same_training(w0, weights(tmp / "budget", 2), weights(tmp / "one-pass", 2), lr=LR)


def test_checkpoint_resume_restores_model_and_optimizer(setup):
    tmp, cfg, batches = setup
    run = tmp / "resume"
    # First life: step 1, checkpoint, step 2 (published as v2), then the process ends ("dies").
    first = run_ranks(2, cfg, run, batches, tmp / "life1", "--checkpoint-after", "1")
    assert first[0]["end_version"] == 2
    w_after_2 = weights(run, 2)
    w_after_1 = weights(run, 1)

    # Second life resumes from the step-1 checkpoint and trains only batch 2 again.
    only_second = tmp / "batch2.json"
    only_second.write_text(json.dumps(json.loads(batches.read_text())[1:]))
    second = run_ranks(2, cfg, run, only_second, tmp / "life2")
    r = second[0]
    assert r["start_step"] == 1 and r["resumed_extra"] == {"store_cursor": {"shard": 7, "offset": 123}}
    # Versions only grow: v2 was announced already, so the resumed policy is published as v3 ...
    assert r["start_version"] == 3 and r["end_version"] == 4
    assert_close(weights(run, 3), w_after_1, atol=0)
    # ... and the same second step from the restored model and optimizer gives the same weights.
    assert_close(weights(run, 4), w_after_2, atol=1e-6)


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(setup):
    """A truncated shard in the newest checkpoint and a garbage DeepSpeed `latest`: the learner
    resumes from the previous whole checkpoint (rl/learner/checkpoints.py) instead of failing every restart."""
    tmp, cfg, batches = setup
    run = tmp / "damaged"
    first = run_ranks(1, cfg, run, batches, tmp / "dmg1", "--checkpoint-after", "1", "2")[0]
    assert first["end_version"] == 2
    tags = sorted(p for p in (run / "checkpoints").glob("step*"))
    assert [t.name for t in tags] == ["step00000001", "step00000002"]
    shard = max((p for p in tags[1].rglob("*.pt")), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (run / "checkpoints" / "latest").write_bytes(b"\xff\x00")
    only_second = tmp / "dmg-batch2.json"
    only_second.write_text(json.dumps(json.loads(batches.read_text())[1:]))
    r = run_ranks(1, cfg, run, only_second, tmp / "dmg2")[0]
    assert r["start_step"] == 1 and r["resumed_extra"] == {"store_cursor": {"shard": 7, "offset": 123}}
    assert r["start_version"] == 3  # versions still only grow
    assert_close(weights(run, 4), weights(run, 2), atol=1e-6)  # step 2 again, from the restored step 1


def test_a_batch_without_signal_leaves_weights_and_optimizer_untouched(setup):
    """skip_empty_steps: every advantage 0 (all rewards equal) -> no update, no Adam step, no new
    version; training goes on exactly as if the batch had never come."""
    tmp, cfg, batches = setup
    b1, b2 = json.loads(batches.read_text())
    flat = [[dict(t, final_reward=1.0) for t in g] for g in b1]
    with_flat, without = tmp / "with_flat.json", tmp / "without.json"
    with_flat.write_text(json.dumps([b1, flat, b2]))
    without.write_text(json.dumps([b1, b2]))
    a = run_ranks(1, cfg, tmp / "skip_a", with_flat, tmp / "skip_a")[0]
    b = run_ranks(1, cfg, tmp / "skip_b", without, tmp / "skip_b")[0]
    skipped = a["steps"][1]
    assert skipped["skipped"] and skipped["step"] == 2 and skipped["version"] == 1
    assert skipped["zero_var_groups"] == 1.0 and skipped["adv_nonzero"] == 0.0
    assert [s["skipped"] for s in b["steps"]] == [False, False] and a["end_version"] == b["end_version"] == 2
    # The entropy bonus (on by default) would have moved the weights on that batch; it did not.
    assert_close(weights(tmp / "skip_a", 2), weights(tmp / "skip_b", 2), atol=0)
    assert a["steps"][2]["loss"] == pytest.approx(b["steps"][1]["loss"], abs=1e-7)


def test_every_collective_of_the_learner_is_on_its_backends_device(setup):
    """NCCL reduces CUDA tensors only; CI has gloo. With the meta device standing in for the
    backend's device, a learner step, publish, checkpoint and close hand torch.distributed no
    tensor of hpcrl's off that device, and the bug this guards against is caught."""
    tmp, cfg, batches = setup
    r = run_ranks(1, cfg, tmp / "meta", batches, tmp / "meta-out", "--device-collectives", "--checkpoint-after", "1")[0]
    assert len(r["steps"]) == 2 and r["steps"][0]["action_tokens"] > 0
    kinds = {c.split()[0] for c in r["checked_collectives"]}
    assert kinds == {"all_reduce", "broadcast_object_list"}, r["checked_collectives"]
    assert all("rl/learner/collectives.py" in c for c in r["checked_collectives"]), r["checked_collectives"]
    with pytest.raises(AssertionError, match="a cpu tensor handed to a backend that reduces meta tensors only"):
        run_ranks(1, cfg, tmp / "meta-bug", batches, tmp / "meta-bug-out", "--device-collectives",
                  "--inject-cpu-collective")  # fmt: skip


def test_hf_model_bf16_checkpointing_and_reference_kl_on_two_ranks(setup, tmp_path):
    """A Qwen2 folder (tied embeddings: the head's weight is the embedding's, used outside
    lm_head's forward) on two ZeRO-3 ranks in bf16 with activation checkpointing and a KL
    penalty to the reference model, itself sharded the same way."""
    from hpcrl.core.config import dump_config
    from hpcrl.rl.model.models import build_tiny_hf

    _, _, batches = setup
    model = build_tiny_hf(tmp_path / "qwen2", arch="qwen2", vocab=1024, max_chars=300_000)
    extra = [
        f"policy.path={model}",
        "policy.dtype=bfloat16",
        "learner.algorithm.beta=0.5",
        "learner.activation_checkpointing=true",
        "learner.logit_chunk_tokens=16",
    ]
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(dump_config(load_config(None, OVERRIDES + extra)))
    r = run_ranks(2, cfg, tmp_path / "run", batches, tmp_path / "out")
    steps = r[0]["steps"]
    assert all(x["partitioned"] for x in r) and r[0]["local_numel"] < r[0]["full_numel"]
    assert steps[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert steps[1]["ref_kl"] > 0 and all(math.isfinite(s["loss"]) and s["entropy"] > 0 for s in steps)
    w0, w2 = weights(tmp_path / "run", 0), weights(tmp_path / "run", 2)
    assert all(t.dtype == torch.bfloat16 for t in w2.values())  # published in the policy dtype
    assert "lm_head.weight" not in w2 and any(not torch.equal(w0[k], w2[k]) for k in w0)


def test_bf16_gradients_are_accumulated_and_reduced_in_fp32(tmp_path):
    """policy.dtype bfloat16: the learner's DeepSpeed config has ZeRO-3 sum the micro-batches'
    gradients and reduce them across ranks in fp32 (DeepSpeed's recommendation; its default is
    the model's bf16). The accumulated gradient of 32 micro-batches on two ranks is closer to the
    fp32 model's than with DeepSpeed's default (same bf16 weights, same data)."""
    port, out = free_port(), tmp_path / "precision.json"
    worker = Path(__file__).with_name("precision_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(out), "32"],
            env=dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                HF_HUB_OFFLINE="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p in procs:
        assert p.returncode == 0, p.stdout.read()[-4000:]
    r = json.loads(out.read_text())
    assert r["bf16"]["grad_accum_dtype"] == r["bf16"]["communication_data_type"] == "torch.float32"
    assert r["bf16_accumulated_in_bf16"]["grad_accum_dtype"] == "torch.bfloat16"
    assert r["fp32"]["rel_error"] == 0.0 and 0 < r["bf16"]["rel_error"]
    assert r["bf16"]["rel_error"] < 0.7 * r["bf16_accumulated_in_bf16"]["rel_error"], r
