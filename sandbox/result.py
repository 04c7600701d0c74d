"""What came out: `ExecResult`, one type for every backend, and the infrastructure exceptions.

The program's own failures (crash, timeout, memory, a compile error) are *results* with a
`status`; a sandbox that cannot be built or started (bwrap missing, no user namespaces, a
cgroup that will not go away) raises `SandboxError` instead, so a caller never mistakes a
broken machine for a wrong answer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

__all__ = ["Status", "STATUSES", "ExecResult", "SandboxError", "SandboxUnavailable", "lift_bytes", "sink_bytes"]

Status = Literal[
    "ok",
    "nonzero_exit",
    "timeout",
    "cpu_limit",
    "memory_limit",
    "output_limit",
    "killed_by_signal",
    "compile_error",
    "sandbox_error",
]
STATUSES: tuple[str, ...] = get_args(Status)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): missing tool, no namespaces, stuck cgroup."""


class SandboxUnavailable(SandboxError):
    """This backend cannot run on this machine at all; the message says what is missing."""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one execution.

    `exit_code` is set when the program exited by itself (0 for ok), `signal` when a signal
    ended it (SIGKILL for timeout/memory/output kills). `stdout`/`stderr` are bytes, capped at
    `Limits.output_kb` each (`*_truncated` says a cap cut them). `wall_s` is measured outside
    the sandbox; `cpu_s` covers every process of the run; `peak_memory_mb` is the cgroup's peak
    where a memory cgroup is enforced, else the largest single process. Either is None where
    the backend cannot measure it (see the backend's docstring).
    """

    status: Status
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float | None = 0.0
    peak_memory_mb: float | None = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"ExecResult.status: must be one of {', '.join(STATUSES)} (got {self.status!r})")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_wire(self) -> dict[str, Any]:
        """Plain data with bytes kept as bytes (msgpack)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ExecResult:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"exec result: unknown keys {sorted(unknown)}")
        return cls(**data)

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON form: same names, stdout/stderr decoded as UTF-8 (bad bytes become U+FFFD)."""
        d = self.to_wire()
        d["stdout"] = self.stdout.decode("utf-8", "replace")
        d["stderr"] = self.stderr.decode("utf-8", "replace")
        d["wall_s"] = round(self.wall_s, 4)
        d["cpu_s"] = None if self.cpu_s is None else round(self.cpu_s, 4)
        d["peak_memory_mb"] = None if self.peak_memory_mb is None else round(self.peak_memory_mb, 2)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict())

    def summary(self) -> str:
        code = f"exit {self.exit_code}" if self.exit_code is not None else f"signal {self.signal}"
        cpu = "?" if self.cpu_s is None else f"{self.cpu_s * 1000:.1f}"
        peak = "?" if self.peak_memory_mb is None else f"{self.peak_memory_mb:.1f}"
        return f"{self.status} ({code}) wall {self.wall_s * 1000:.1f} ms, cpu {cpu} ms, peak {peak} MiB"


# Bytes this long or longer leave a reply's msgpack header (which the wire caps at 1 MiB, see
# core.transport.WireLimits.max_header_bytes) and travel as frames of their own.
_FRAME_MIN = 4096
_MARK = "$frame"


def lift_bytes(body: Any) -> tuple[Any, list[np.ndarray]]:
    """`body` with every bytes value of 4 KiB or more replaced by {"$frame": k}, and the frames
    (uint8 arrays, not copied): a result's stdout may be up to `output_kb` (64 MiB at the
    default ceiling), which in the header would make the reply undeliverable."""
    frames: list[np.ndarray] = []

    def walk(x: Any) -> Any:
        if isinstance(x, (bytes, bytearray)) and len(x) >= _FRAME_MIN:
            frames.append(np.frombuffer(x, dtype=np.uint8))
            return {_MARK: len(frames) - 1}
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    return walk(body), frames


def sink_bytes(body: Any, arrays: tuple | list) -> Any:
    """Inverse of `lift_bytes` on the receiving side; ValueError on a marker without its frame."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if len(x) == 1 and _MARK in x:
                k = x[_MARK]
                if not isinstance(k, int) or not 0 <= k < len(arrays) or arrays[k].dtype != np.uint8:
                    raise ValueError(f"reply refers to frame {k!r}, which it does not carry")
                return arrays[k].tobytes()
            return {key: walk(v) for key, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(body)
