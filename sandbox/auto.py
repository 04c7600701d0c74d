"""The backend a config names: above the backends, as submitit's AutoExecutor sits above its executors.

from hpcrl.sandbox.auto import make_backend
backend = make_backend(cfg.sandbox)     # BwrapBackend (as root: on a free uid of the pool) or ApptainerBackend
"""

from __future__ import annotations

import os

from hpcrl.core.config import SandboxConfig
from hpcrl.sandbox.apptainer import ApptainerBackend
from hpcrl.sandbox.backend import Backend
from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.result import SandboxError
from hpcrl.sandbox.uids import claim_free_uid

__all__ = ["make_backend"]


def make_backend(cfg: SandboxConfig) -> Backend:
    """The backend `cfg` names. bwrap as root runs as a slot uid of the host's pool
    (`sandbox.uid_base`, `sandbox.uid_pool`) that nobody else uses, the backend's until it closes."""
    if cfg.backend == "bwrap":
        if os.geteuid() != 0:  # not root: no slot uids, it runs as us
            return BwrapBackend(memory_fallback=cfg.memory_fallback, start_ahead=cfg.start_ahead)
        claim = claim_free_uid(cfg.uid_base, cfg.uid_pool)
        try:
            return BwrapBackend(uid=claim.uid, memory_fallback=cfg.memory_fallback, start_ahead=cfg.start_ahead)
        finally:
            claim.release()  # the backend holds its own claim on the uid now
    if cfg.backend == "apptainer":
        return ApptainerBackend(
            image=cfg.image,
            apptainer=cfg.apptainer,
            cgroups=cfg.apptainer_cgroups,
            memory_fallback=cfg.memory_fallback,
            seccomp=cfg.apptainer_seccomp,
        )
    raise SandboxError(f"unknown sandbox backend {cfg.backend!r}; choose bwrap or apptainer")
