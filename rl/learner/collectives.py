"""Every collective the learner issues itself, with its tensors on the backend's device.

    comm = Collectives(backend_device("nccl", local_rank=3))   # cuda:3; gloo -> cpu
    total, tokens = comm.sum([loss_sum, n_tokens])           # all-reduce of host numbers
    msg = comm.broadcast_object(msg, src=0)
    comm.barrier()

NCCL reduces only CUDA tensors: a CPU tensor handed to it raises at the first step, which a
gloo-only CI never sees. So the learner builds no tensor for a collective itself; it hands host
numbers and objects to this class, which puts them on `device` (the backend's), reduces, and
hands host numbers back. DeepSpeed's own collectives (gradient reduce-scatter, parameter
all-gather) are on the engine's device already. tests/test_learner.py runs a learner step with
`device` set to the meta device and `torch.distributed`'s collectives wrapped to refuse any
tensor from hpcrl's code that is not on it: a CPU tensor given to a device backend fails there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Collectives", "backend_device", "resolve_backend"]

# The device each torch.distributed backend reduces tensors on.
_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ccl": "xpu", "hccl": "npu"}


def resolve_backend(configured: str, device: torch.device) -> str:
    """`learner.dist_backend`, with auto: nccl for a CUDA device, gloo otherwise."""
    if configured != "auto":
        return configured
    return "nccl" if device.type == "cuda" else "gloo"


def backend_device(backend: str, local_rank: int = 0) -> torch.device:
    kind = _BACKEND_DEVICE.get(backend, "cpu")
    return torch.device(kind, local_rank) if kind != "cpu" else torch.device("cpu")


class Collectives:
    def __init__(self, device: torch.device, group=None):
        self.device = torch.device(device)
        self.group = group

    def _tensor(self, values: Sequence[float]) -> torch.Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)

    def _host(self, t: torch.Tensor) -> list[float]:
        return t.cpu().tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks of `values` (host floats)."""
        t = self._tensor(values)
        torch.distributed.all_reduce(t, group=self.group)
        return self._host(t)

    def max(self, values: Sequence[float]) -> list[float]:
        t = self._tensor(values)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return self._host(t)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of rank `src` on every rank (pickled; its size travels on `device` first)."""
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src, group=self.group, device=self._object_device())
        return box[0]

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type != "cpu" else None

    def barrier(self) -> None:
        if self.device.type == "cuda":
            torch.distributed.barrier(group=self.group, device_ids=[self.device.index or 0])
        else:
            torch.distributed.barrier(group=self.group)
