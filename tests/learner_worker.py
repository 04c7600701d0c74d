"""One learner rank for tests/test_learner.py, run as its own process (RANK/WORLD_SIZE/MASTER_* set
by the test):

    python tests/learner_worker.py CONFIG RUN_DIR BATCHES.json OUT_PREFIX [--checkpoint-after N]

Sets up the learner (resuming if RUN_DIR holds a checkpoint), trains one step per batch in
BATCHES.json (a list of batches, each a list of groups of Trajectory.to_dict records), optionally
checkpoints after step N, and writes OUT_PREFIX.<rank>.json with each step's metrics and how
the ZeRO-3 partitioning looked on this rank.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hpcrl.core.config import load_config
from hpcrl.rl.learner import Learner
from hpcrl.rl.trajectory import Trajectory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("run_dir")
    ap.add_argument("batches")
    ap.add_argument("out_prefix")
    ap.add_argument("--checkpoint-after", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    batches = [[[Trajectory.from_dict(t) for t in g] for g in b] for b in json.load(open(args.batches))]
    learner = Learner(cfg.learner, cfg.policy, args.run_dir, seed=cfg.experiment.seed)
    extra = learner.setup()
    report = {
        "rank": learner.rank,
        "world": learner.world,
        "resumed_extra": extra,
        "start_step": learner.step,
        "start_version": learner.version,
        "steps": [],
    }
    params = list(learner.engine.module.parameters())
    report["partitioned"] = all(
        hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in params if p.ds_numel >= 64
    )
    report["local_numel"] = sum(p.ds_tensor.numel() for p in params)
    report["full_numel"] = sum(p.ds_numel for p in params)
    for i, batch in enumerate(batches, 1):
        m = learner.train_step(batch)
        report["steps"].append(m)
        if i == args.checkpoint_after:
            learner.checkpoint({"store_cursor": {"shard": 7, "offset": 123}})
    report["end_version"] = learner.version
    learner.close()
    with open(f"{args.out_prefix}.{report['rank']}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
