"""One learner rank for tests/test_learner.py, run as its own process (RANK/WORLD_SIZE/MASTER_* set
by the test):

    python tests/learner_worker.py CONFIG RUN_DIR BATCHES.json OUT_PREFIX [--checkpoint-after STEP ...]
        [--device-collectives [--inject-cpu-collective]]

Sets up the learner (resuming if RUN_DIR holds a checkpoint), trains one step per batch in
BATCHES.json (a list of batches, each a list of groups of Trajectory.to_dict records), optionally
checkpoints after each optimizer step named, and writes OUT_PREFIX.<rank>.json with each step's metrics and how
the ZeRO-3 partitioning looked on this rank.

--device-collectives (one rank): the learner's collectives get the meta device as their
"backend device", standing in for NCCL's CUDA, and torch.distributed's collectives refuse any
tensor that hpcrl's code (or this worker's) hands them off that device: the check that a CPU
tensor given to a device backend fails here, without a GPU. DeepSpeed's own collectives pass
through to gloo. --inject-cpu-collective makes the learner all-reduce a CPU tensor itself (the
bug this catches), to prove the check fires.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hpcrl.core.config import load_config
from hpcrl.rl.learner.collectives import Collectives
from hpcrl.rl.learner.learner import Learner
from hpcrl.rl.record.trajectory import Trajectory

CHECKED: list[str] = []
_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.abspath(__file__))
_TRANSPARENT = (os.path.dirname(torch.__file__), os.sep + os.path.join("deepspeed", "comm") + os.sep)


def _caller() -> str | None:
    """File:line of the first frame outside torch and deepspeed.comm, if it is our code."""
    f = sys._getframe(2)
    while f is not None and any(t in f.f_code.co_filename for t in _TRANSPARENT):
        f = f.f_back
    if f is None or "site-packages" in f.f_code.co_filename:
        return None
    path = os.path.realpath(f.f_code.co_filename)
    return f"{path}:{f.f_lineno}" if path.startswith(_OURS[0]) or path == _OURS[1] else None


def check_collectives(expected: str) -> None:
    """Wrap torch.distributed's collectives: tensors from our code must be on `expected`
    (one rank: the operation is then the identity); everything else runs for real."""
    dist = torch.distributed

    def wrap(name):
        real = getattr(dist, name)

        @functools.wraps(real)
        def checked(*args, **kw):
            where = _caller()
            if where is None:
                return real(*args, **kw)
            tensors = [a for a in list(args) + list(kw.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            if name == "broadcast_object_list":
                device = kw.get("device")
                if device is None or torch.device(device).type != expected:
                    raise RuntimeError(f"{name} from {where} without device={expected!r} (the backend's device)")
            for t in tensors:
                if t.device.type != expected:
                    raise RuntimeError(
                        f"{name} from {where}: a {t.device.type} tensor handed to a backend that reduces "
                        f"{expected} tensors only"
                    )
            CHECKED.append(f"{name} {where}")
            return None  # one rank: the collective leaves every value as it is

        setattr(dist, name, checked)

    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "reduce", "gather", "scatter", "broadcast_object_list", "all_gather_object"):  # fmt: skip
        wrap(name)


class MetaCollectives(Collectives):
    """Collectives on the meta device; values are kept aside (one rank: a sum is the value)."""

    def __init__(self):
        super().__init__(torch.device("meta"))
        self._values: dict[int, list[float]] = {}

    def _tensor(self, values):
        t = super()._tensor(values)
        self._values[id(t)] = [float(v) for v in values]
        return t

    def _host(self, t):
        return self._values.pop(id(t))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("run_dir")
    ap.add_argument("batches")
    ap.add_argument("out_prefix")
    ap.add_argument("--checkpoint-after", type=int, nargs="+", default=[])
    ap.add_argument("--device-collectives", action="store_true")
    ap.add_argument("--inject-cpu-collective", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    batches = [[[Trajectory.from_dict(t) for t in g] for g in b] for b in json.load(open(args.batches))]
    learner = Learner(cfg.learner, cfg.policy, args.run_dir, seed=cfg.experiment.seed)
    if args.device_collectives:
        check_collectives("meta")
        learner.comm = MetaCollectives()
        if args.inject_cpu_collective:

            def buggy_sum(values):  # what rl/learner/learner.py did before its collectives had a device
                t = torch.tensor([float(v) for v in values])
                torch.distributed.all_reduce(t)
                return t.tolist()

            learner.comm.sum = buggy_sum
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
    from deepspeed.utils import z3_leaf_module  # after setup: DeepSpeed imported for the device

    # Modules ZeRO-3 fetches whole (learner.gather_per_layer: the decoder layers)
    report["leaf_modules"] = sorted({type(m).__name__ for m in learner.engine.module.modules() if z3_leaf_module(m)})
    report["full_numel"] = sum(p.ds_numel for p in params)
    for batch in batches:
        batch = learner.comm.broadcast_object(batch, src=0)  # as learner_service hands batches out
        m = learner.train_step(batch)
        report["steps"].append(m)
        if learner.step in args.checkpoint_after:
            learner.checkpoint({"store_cursor": {"shard": 7, "offset": 123}})
    report["end_version"] = learner.version
    learner.close()
    report["checked_collectives"] = CHECKED
    with open(f"{args.out_prefix}.{report['rank']}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
