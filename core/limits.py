"""The sandbox's section of the config: `Limits` of one sandboxed execution (the one limits type:
config ceilings, requests on the wire and every backend use it) and `SandboxConfig`.

    from hpcrl.core.config import Limits, SandboxConfig     # re-exported there, part of the tree
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from hpcrl.core.schema import ConfigError, check_bounds, spec

__all__ = ["Limits", "SandboxConfig"]


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed execution; as `sandbox.ceiling`, the most a request may ask.

    Built from YAML (the ceiling) or in code (`Limits(wall_s=5)`, a request's limits): both get
    the same checks, from the same field specs. Going over `output_kb` kills the run.
    """

    wall_s: float = spec(10.0, help="wall-clock seconds per execution", gt=0)
    cpu_s: float = spec(10.0, help="CPU seconds per execution", gt=0)
    memory_mb: int = spec(512, help="memory per execution, MiB (no interpreter starts in less than 16)", ge=16)
    pids: int = spec(64, help="processes and threads per execution (the sandbox itself needs 4)", ge=4)
    file_size_mb: int = spec(16, help="largest file an execution may write, MiB", gt=0)
    output_kb: int = spec(1024, help="stdout and stderr each, KiB", gt=0)
    open_files: int = spec(256, help="open file descriptors per process", gt=0)
    work_mb: int = spec(64, help="tmpfs /work, MiB", gt=0)
    tmp_mb: int = spec(64, help="tmpfs /tmp, MiB", gt=0)
    shm_mb: int = spec(16, help="tmpfs /dev/shm, MiB", gt=0)
    inodes: int = spec(4096, help="files, directories and links each of /work, /tmp and /dev/shm may hold", gt=0)
    cpus: float = spec(
        1.0, help="CPU cores an execution may use at once, however many processes (cgroup cpu quota)", gt=0
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"Limits.{f.name}", f"must be a number (got {value!r})")
        check_bounds(self, "Limits")

    def replace(self, **changes: Any) -> Limits:
        return dataclasses.replace(self, **changes)

    def check_within(self, ceiling: Limits, where: str = "limits") -> None:
        """ValueError naming every field over `ceiling` (a sandbox server's `sandbox.ceiling`)."""
        over = [
            f"{where}.{f.name}={getattr(self, f.name)} (ceiling {getattr(ceiling, f.name)})"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) > getattr(ceiling, f.name)
        ]
        if over:
            raise ValueError(
                f"over this sandbox server's ceiling: {', '.join(over)}; ask for less, or raise "
                "sandbox.ceiling in the run's config"
            )

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any, where: str = "limits") -> Limits:
        """From a mapping of field names (missing ones default); ValueError naming unknown keys."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid: {', '.join(sorted(names))}")
        return cls(**data)


@dataclass(frozen=True)
class SandboxConfig:
    backend: Literal["bwrap", "apptainer"] = spec("bwrap", help="isolation backend for executing model code")
    slots: int = spec(2, help="concurrent executions per sandbox server", ge=1)
    servers: int = spec(1, help="sandbox servers a run starts (only when a domain executes code)", ge=1)
    uid_base: int = spec(
        61000,
        help="bwrap as root: first uid of the host's pool of slot uids (each sandbox takes free ones at start); "
        "no account's or group's id",
        ge=1000,
    )
    uid_pool: int = spec(
        1024, help="uids in that pool, shared by every run and user on a host: at least their slots together", ge=1
    )
    memory_fallback: Literal["address_space", "refuse", "data"] = spec(
        "address_space",
        help="no memory cgroup: cap each process's address space (RLIMIT_AS), refuse to run, or data (unsafe)",
    )
    queue: int = spec(
        64, help="requests a sandbox server holds beyond its busy slots; more are refused (backpressure)", ge=0
    )
    start_ahead: bool = spec(
        True,
        help="bwrap: keep each slot's next sandbox started (cgroups, namespaces, mounts), so a run waits only "
        "for its program (~20 ms less each); false: start each on demand, nothing idle",
    )
    image: str = spec(
        "sandbox.sif", help="Apptainer image (backend: apptainer), built by `hpcrl sandbox build-image`", min_len=1
    )
    apptainer: str = spec("apptainer", help="Apptainer executable; 'singularity' on older clusters", min_len=1)
    apptainer_cgroups: bool = spec(
        False, help="pass --memory/--pids-limit/--cpus to apptainer (needs cgroups v2 with systemd delegation)"
    )
    apptainer_seccomp: bool = spec(
        True, help="pass hpcrl's seccomp profile to apptainer (--security seccomp:, needs Apptainer with libseccomp)"
    )
    session_dir: str = spec(
        "/var/tmp/hpcrl-sessions",
        help="where a sandbox server keeps its sessions' workspaces and snapshots (not under /tmp)",
        min_len=1,
    )
    session_idle_s: float = spec(
        600.0, help="a session no operation touched for this many seconds is closed and its files removed", gt=0
    )
    max_sessions: int = spec(64, help="open sessions per sandbox server; more are refused", ge=1)
    max_snapshots: int = spec(
        8, help="snapshots a session may hold at once (all of them together at most its work_mb, on disk)", ge=1
    )
    session_dir_mb: int = spec(
        16384,
        help="disk a sandbox server's sessions may hold under session_dir, MiB (snapshots, on-disk workspaces)",
        ge=1,
    )
    session_tmpfs: bool = spec(
        True,
        help="as root, each session's workspace is a tmpfs (RAM; quota held by the kernel); false: on disk, measured",
    )
    ceiling: Limits = spec(
        factory=lambda: Limits(
            wall_s=300.0,
            cpu_s=300.0,
            memory_mb=8192,
            pids=512,
            file_size_mb=1024,
            output_kb=65536,
            open_files=4096,
            work_mb=4096,
            tmp_mb=4096,
            shm_mb=1024,
            inodes=65536,
            cpus=16.0,
        ),
        help="the most limits a request may ask for; more is refused",
    )

    def validate(self):
        if self.uid_base + self.uid_pool > 2**31:
            yield "uid_pool", f"uid_base + uid_pool must stay below 2^31 (got {self.uid_base} + {self.uid_pool})"
