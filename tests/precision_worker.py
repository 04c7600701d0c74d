"""One rank of tests/test_learner.py's bf16 test, run as its own process (RANK/WORLD_SIZE/MASTER_* set
by the test):

    python tests/precision_worker.py OUT.json MICRO_STEPS

Builds the learner's DeepSpeed ZeRO-3 engine (hpcrl's config, `rl/learner/dsconfig.py`, and its policy
head) three times over the same tiny model, whose weights are rounded to bf16 once so that all
three start from the same values: in float32 (the reference), in bf16 as hpcrl configures it,
and in bf16 with DeepSpeed's own defaults (gradients accumulated and reduced in bf16). Each takes
MICRO_STEPS micro-batches of this rank's data into one accumulated gradient, as a learner step
does; rank 0 writes each run's accumulated full gradient error against the float32 one, and the
dtypes the engine actually used.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hpcrl.core.config import load_config
from hpcrl.rl.learner.dsconfig import deepspeed_config, import_deepspeed
from hpcrl.rl.model.logprobs import PolicyHead
from hpcrl.rl.model.policy import build_policy_model, load_tokenizer

BASE = [
    "policy.device=cpu",
    "policy.tiny.hidden_size=64",
    "policy.tiny.num_layers=1",
    "policy.tiny.num_heads=2",
    "policy.tiny.intermediate_size=128",
    "learner.micro_batch=1",
]
RUNS = {
    "fp32": ["policy.dtype=float32"],
    "bf16": ["policy.dtype=bfloat16"],
    "bf16_accumulated_in_bf16": [
        "policy.dtype=bfloat16",
        "learner.deepspeed={data_types: {grad_accum_dtype: bf16}, communication_data_type: bf16}",
    ],
}


def main() -> None:
    out_path, micro_steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    ds = import_deepspeed(torch.device("cpu"))
    from deepspeed.utils import safe_get_full_grad

    ds.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data, the same in every run
    cfg0 = load_config(None, BASE)
    vocab = len(load_tokenizer(cfg0.policy))
    data = [torch.randint(3, vocab, (1, 24), generator=gen) for _ in range(micro_steps)]
    report: dict = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for name, extra in RUNS.items():
        cfg = load_config(None, BASE + extra)
        model = build_policy_model(cfg.policy, load_tokenizer(cfg.policy), seed=0).float()
        with torch.no_grad():  # the same starting values in every run: bf16-representable
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        config = deepspeed_config(cfg.learner, cfg.policy, micro_steps)
        engine, *_ = ds.initialize(
            model=PolicyHead(model, zero3=True),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            config=config,
        )
        for k, ids in enumerate(data):
            engine.set_gradient_accumulation_boundary(k == micro_steps - 1)
            lp = engine(ids, torch.ones_like(ids))[0]
            engine.backward(lp.float().sum() / (micro_steps * ids.numel()), scale_wrt_gas=False)
            if k < micro_steps - 1:
                engine.step()
        # The accumulated, reduced gradient, before the optimizer consumes it (every rank gathers).
        grads[name] = {n: safe_get_full_grad(p).double().clone() for n, p in engine.module.named_parameters()}
        engine.step()
        report[name] = {
            "grad_accum_dtype": str(engine.optimizer.gradient_accumulation_dtype),
            "communication_data_type": str(engine.communication_data_type),
            "config": {k: config.get(k) for k in ("data_types", "communication_data_type")},
        }
        engine.destroy()
    ref = grads["fp32"]
    for name in RUNS:
        num = sum(float((grads[name][n] - ref[n]).norm() ** 2) for n in ref) ** 0.5
        den = sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
        report[name]["rel_error"] = num / den
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
