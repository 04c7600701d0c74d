"""The GPU check: ZeRO-3 learner steps on NCCL with 1-2 GPUs, generation tokens/s,
weight-publish GB/s and peak memory, for a model of ~1B parameters built here. A few minutes on
a GPU machine; `--cpu` runs the same code on the CPU (gloo) with a small model, which CI runs
(tests/test_gpu_check.py), so the GPU half differs only in the device.

    python bench/gpu_check.py [--gpus 1] [--hidden 2048 --layers 16 --vocab 32000] [--json]   # a GPU machine
    python bench/gpu_check.py --cpu [--json]                                                   # its CPU half

1. A random Llama (bfloat16 on GPU, float32 on CPU) and a byte-level BPE tokenizer trained on
   local text, saved with `save_pretrained` (rl/model/models.py `build_tiny_hf`).
2. learner: `--gpus` processes (one per GPU: RANK, LOCAL_RANK, WORLD_SIZE), each the real
   `Learner` (DeepSpeed ZeRO-3, `dist_backend: auto`: NCCL on GPU, gloo on CPU) training
   `--steps` optimizer steps on synthetic trajectories of the model's vocabulary (rl/record/synth.py),
   then publishing its weights (gather + shard write, `ShardPublisher.flush`). Reported: the
   median step seconds after the first, trajectories/s, the publish's GB/s (policy-dtype bytes
   of the whole model over the publish's seconds), and the peak memory of rank 0
   (torch.cuda.max_memory_allocated on GPU, the process's peak RSS on CPU).
3. generate: the policy loaded from the saved folder on one device, `--episodes` single-turn
   episodes of `--action` tokens through the decode engine; tokens/s, peak memory; then the
   memory cap of a generator on GPU shards (`shard_cap`: ok, or what went wrong).

Each part runs in its own process(es), so peak memory is the part's own. Exit 0 with the JSON
line; a failed part exits 1 naming it and where its log is.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPU_SHAPE = {"hidden": 2048, "layers": 16, "vocab": 32000, "prompt": 256, "action": 128}  # ~1.0B parameters
CPU_SHAPE = {"hidden": 128, "layers": 2, "vocab": 2048, "prompt": 32, "action": 16}


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _overrides(a, model_dir: Path) -> list[str]:
    return [
        f"policy.path={model_dir}",
        f"policy.device={'cpu' if a.cpu else 'cuda'}",
        f"policy.dtype={'float32' if a.cpu else 'bfloat16'}",
        f"learner.group_size={a.group_size}",
        f"learner.batch_groups={a.batch_groups}",
        f"learner.micro_batch={a.micro_batch}",
    ]


def learner_rank(a, model_dir: Path, run_dir: Path) -> None:
    """Child: one learner rank, `--steps` steps, then one publish; rank 0 prints its figures."""
    import numpy as np
    import torch

    from hpcrl.core.config import load_config
    from hpcrl.rl.learner.learner import Learner
    from hpcrl.rl.record.synth import SynthShape, synth_trajectory

    cfg = load_config(None, _overrides(a, model_dir))
    learner = Learner(cfg.learner, cfg.policy, run_dir, seed=0)
    learner.setup()
    shape = SynthShape(steps=(1, 2), first_prompt=(a.prompt // 2, a.prompt), later_prompt=(0, 1),
                       action=(a.action // 2, a.action), observation=(0, 1), vocab=a.vocab)  # fmt: skip
    rng = np.random.default_rng(1)  # the same batches on every rank: rank 0's are the ones trained
    step_s = []
    for _ in range(a.steps):
        groups = [
            [synth_trajectory(rng, "check", "g", g * a.group_size + i, shape) for i in range(a.group_size)]
            for g in range(a.batch_groups)
        ]
        _sync(learner.device)
        t0 = time.perf_counter()
        learner.train_step(groups)
        _sync(learner.device)
        step_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    learner.publish()
    learner.publisher.flush()
    publish_s = time.perf_counter() - t0
    peak = _peak_bytes(learner.device)
    params = sum(p.ds_numel for p in learner.engine.module.parameters())
    backend = torch.distributed.get_backend()
    elem = 4 if a.cpu else 2
    learner.close()
    if learner.rank == 0:
        mid = statistics.median(step_s[1:] or step_s)
        print(json.dumps({
            "params": params, "ranks": learner.world, "device": learner.device.type,
            "backend": backend, "step_s": round(mid, 4),
            "trajectories_per_s": round(a.batch_groups * a.group_size / mid, 1),
            "publish_s": round(publish_s, 3), "publish_gb_s": round(params * elem / publish_s / 1e9, 3),
            "learner_peak_gb": round(peak / 1e9, 3),
        }), flush=True)  # fmt: skip


def generate(a, model_dir: Path) -> None:
    """Child: the decode engine on the saved policy, single-turn episodes of exactly --action tokens."""
    import torch

    from hpcrl.core.config import PolicyConfig
    from hpcrl.rl.model.policy import Policy
    from hpcrl.rl.rollout.engine import DecodeEngine, SamplingSpec

    torch.manual_seed(0)
    policy = Policy.load(
        PolicyConfig(path=str(model_dir), device="cpu" if a.cpu else "cuda", dtype="float32" if a.cpu else "bfloat16"),
        seed=0,
    )
    policy.eos_ids = frozenset()  # fixed lengths: no eos ends an action early
    engine = DecodeEngine(policy, seed=0)
    spec = SamplingSpec(temperature=1.0)
    gen = torch.Generator().manual_seed(0)

    def rollout() -> int:
        for i in range(a.episodes):
            ids = torch.randint(3, a.vocab, (a.prompt,), generator=gen).tolist()
            engine.submit(i, ids, a.action, spec)
        tokens = 0
        while engine.busy:
            for _, sample in engine.step():
                tokens += len(sample.tokens)
        return tokens

    rollout()  # warm-up: kernels, allocator pools
    _sync(policy.device)
    t0 = time.perf_counter()
    tokens = rollout()
    _sync(policy.device)
    wall = time.perf_counter() - t0
    out = {"gen_tokens": tokens, "gen_tokens_per_s": round(tokens / wall, 1),
           "gen_peak_gb": round(_peak_bytes(policy.device) / 1e9, 3)}  # fmt: skip
    out["shard_cap"] = _shard_cap(policy.device)
    print(json.dumps(out), flush=True)


def _shard_cap(device) -> str:
    """A generator on GPU shards caps its memory (rl/model/policy.py cap_gpu_memory): after capping at
    half the GPU, a tenth of it still allocates and six tenths must fail."""
    import torch

    from hpcrl.rl.model.policy import cap_gpu_memory

    if device.type != "cuda" or not cap_gpu_memory(0.5):
        return "no GPU"
    total = torch.cuda.get_device_properties(device).total_memory
    small = torch.empty(int(0.1 * total), dtype=torch.uint8, device=device)
    try:
        torch.empty(int(0.6 * total), dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return "ok"
    finally:
        del small
    return "FAILED: 60% of the GPU allocated under a 50% cap"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_part(name: str, cmds: list[tuple[list[str], dict]], logs: Path, timeout_s: float) -> dict:
    """Start every command of a part at once (the ranks of one job), wait, and parse rank 0's line."""
    procs = []
    for i, (cmd, env) in enumerate(cmds):
        log = open(logs / f"{name}.{i}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True), log))
    out = []
    deadline = time.monotonic() + timeout_s
    for p, log in procs:
        try:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            why = f"gpu_check: {name} did not finish within {timeout_s:.0f} s; see {logs}/{name}.*.log"
            raise SystemExit(why) from None
        log.close()
        if p.returncode != 0:
            for q, _ in procs:
                q.kill()
            raise SystemExit(f"gpu_check: {name} failed (exit {p.returncode}); see {log.name}")
        out.append(stdout)
    lines = [ln for ln in out[0].splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"gpu_check: {name} printed no result; see {logs}/{name}.0.log")
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU half: gloo, float32, a small model")
    ap.add_argument("--gpus", type=int, default=1, help="learner ranks, one per GPU (CPU: processes)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--steps", type=int, default=4, help="learner steps (the first is not timed)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-groups", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, help="prompt tokens (learner: up to; generate: exactly)")
    ap.add_argument("--action", type=int, help="action tokens (learner: up to; generate: exactly)")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="limit for each part")
    ap.add_argument("--dir", help="working folder (default: a temporary one, removed at the end)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=("learner", "generate"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    for k, v in (CPU_SHAPE if a.cpu else GPU_SHAPE).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.child == "learner":
        learner_rank(a, Path(a.model_dir), Path(a.dir))
        return 0
    if a.child == "generate":
        generate(a, Path(a.model_dir))
        return 0

    import torch

    if not a.cpu and torch.cuda.device_count() < a.gpus:
        print(f"gpu_check: {a.gpus} GPU(s) asked, torch sees {torch.cuda.device_count()}; "
              "run with --cpu for the CPU half, or --gpus N", file=sys.stderr)  # fmt: skip
        return 2
    from hpcrl.rl.model.models import build_tiny_hf

    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="hpcrl-gpucheck-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        model_dir = root / "model"
        build_tiny_hf(model_dir, "llama", a.vocab, hidden=a.hidden, layers=a.layers, heads=max(1, a.hidden // 64),
                      kv_heads=max(1, a.hidden // 256), intermediate=int(a.hidden * 2.75), max_context=4096,
                      max_chars=1_000_000)  # fmt: skip
        result: dict = {"device": "cpu" if a.cpu else torch.cuda.get_device_name(0), "build_s": 0.0}
        result["build_s"] = round(time.perf_counter() - t0, 1)
        base = [sys.executable, __file__, "--model-dir", str(model_dir)]
        for k in ("hidden", "layers", "vocab", "steps", "group_size", "batch_groups", "micro_batch", "prompt",
                  "action", "episodes"):  # fmt: skip
            base += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
        base += ["--cpu"] if a.cpu else []
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(a.gpus))
        if a.cpu:
            env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        ranks = [
            (base + ["--child", "learner", "--dir", str(root / "run")], dict(env, RANK=str(r), LOCAL_RANK=str(r)))
            for r in range(a.gpus)
        ]
        result.update(_run_part("learner", ranks, root, a.timeout_s))
        result.update(_run_part("generate", [(base + ["--child", "generate"], env)], root, a.timeout_s))
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>20}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
