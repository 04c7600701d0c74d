"""The backend a config names: above the backends, as submitit's AutoExecutor sits above its executors.

from hpcrl.sandbox.auto import make_backend
backend = make_backend(cfg.sandbox, slot=0)     # BwrapBackend(uid=uid_base + slot) or ApptainerBackend
"""

from __future__ import annotations

from hpcrl.core.config import SandboxConfig
from hpcrl.sandbox.apptainer import ApptainerBackend
from hpcrl.sandbox.backend import Backend
from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.result import SandboxError

__all__ = ["make_backend"]


def make_backend(cfg: SandboxConfig, slot: int = 0) -> Backend:
    """The backend `cfg` names, for slot `slot` (each slot its own host uid on bwrap)."""
    if cfg.backend == "bwrap":
        return BwrapBackend(uid=cfg.uid_base + slot, memory_fallback=cfg.memory_fallback)
    if cfg.backend == "apptainer":
        return ApptainerBackend(
            image=cfg.image,
            apptainer=cfg.apptainer,
            cgroups=cfg.apptainer_cgroups,
            memory_fallback=cfg.memory_fallback,
            seccomp=cfg.apptainer_seccomp,
        )
    raise SandboxError(f"unknown sandbox backend {cfg.backend!r}; choose bwrap or apptainer")
