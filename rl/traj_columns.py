"""Columnar form of a batch of trajectories: two record tables and three flat arrays.

    cols = Columns.encode(trajectories)      # what one shard segment stores
    cols = Columns.encode(batch, bufs)       # flat arrays in reusable EncodeBuffers (writers)
    cols.crc32()                             # checksum over every byte, in a fixed order
    cols.trajectory(i)                       # back to a Trajectory (arrays are views)

Variable-length token data is never stored one array per trajectory: all steps' tokens are
concatenated into `tokens` (per step: prompt, then action, then observation), and the
action-aligned `logprobs` and `loss_mask` into their own flat arrays. The `steps` table holds
each step's offsets into them and the `traj` table each trajectory's first step and count,
so any one record is a handful of slices. Strings (ids) are fixed-width UTF-8 fields sized
to the longest in the batch, which HDF5 stores without per-row heap objects.

`decode` checks every offset against the array lengths before slicing: a damaged file that
slipped past its checksum still fails loudly instead of yielding garbage.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hpcrl.rl.trajectory import (
    SANDBOX_STATUSES,
    TRUNCATION_REASONS,
    SandboxOutcome,
    Step,
    Trajectory,
    TrajectoryError,
)

__all__ = ["Columns", "ColumnsError", "EncodeBuffers", "traj_dtype", "STEP_DTYPE", "ARRAY_NAMES"]

_STRING_FIELDS = ("id", "run", "domain", "task", "generator")

STEP_DTYPE = np.dtype(
    [
        ("policy_version", "<i8"),
        ("reward", "<f8"),
        ("token_start", "<i8"),  # into `tokens`: prompt, action, observation back to back
        ("prompt_len", "<i4"),
        ("action_len", "<i4"),
        ("obs_len", "<i4"),
        ("action_start", "<i8"),  # into `logprobs` and `loss_mask`
        ("sandbox_status", "u1"),
        ("sandbox_exit_code", "<i4"),
        ("sandbox_s", "<f8"),
        ("generate_s", "<f8"),
        ("env_s", "<f8"),
    ]
)

_TRAJ_NUMERIC = [
    ("episode", "<i8"),
    ("final_reward", "<f8"),
    ("truncation", "u1"),
    ("started_at", "<f8"),
    ("finished_at", "<f8"),
    ("step_start", "<i8"),
    ("n_steps", "<i4"),
    ("n_tokens", "<i8"),
    ("min_policy_version", "<i8"),
    ("max_policy_version", "<i8"),
    ("schema_version", "<u2"),
]

# Dataset names in the order the checksum covers them.
ARRAY_NAMES = ("traj", "steps", "tokens", "logprobs", "loss_mask")


def traj_dtype(widths: Sequence[int]) -> np.dtype:
    """The trajectory table's dtype, with string fields `widths` bytes wide."""
    return np.dtype([(n, f"S{max(1, w)}") for n, w in zip(_STRING_FIELDS, widths)] + _TRAJ_NUMERIC)


class ColumnsError(ValueError):
    """Stored columns are inconsistent (offsets out of range, unknown codes, wrong dtypes)."""


class EncodeBuffers:
    """Reusable storage for the flat arrays of `Columns.encode`, for code that encodes batch
    after batch and is done with each Columns before encoding the next (a shard writer).

    Why: fresh MB-sized arrays per batch can be fresh pages. With HDF5's per-file
    allocations in between, glibc often handed the freed heap top back to the kernel after a
    flush, and a writer then took ~500 page faults per flush of 64 trajectories (~0.25 ms, a
    tenth of its CPU). Columns encoded with buffers are views into them, valid until the next
    encode with the same buffers.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def take(self, name: str, n: int, dtype) -> np.ndarray:
        buf = self._arrays.get(name)
        if buf is None or len(buf) < n:
            # Headroom: age-triggered flushes and long episodes vary the size a little.
            buf = self._arrays[name] = np.empty(max(n + n // 4, 2 * len(buf) if buf is not None else 0), dtype)
        return buf[:n]


@dataclass(frozen=True)
class Columns:
    traj: np.ndarray  # structured, traj_dtype
    steps: np.ndarray  # structured, STEP_DTYPE
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    loss_mask: np.ndarray  # uint8
    truncation_names: tuple[str, ...] = TRUNCATION_REASONS
    sandbox_names: tuple[str, ...] = SANDBOX_STATUSES

    # -- encoding -----------------------------------------------------------------------------

    @classmethod
    def encode(cls, trajs: Sequence[Trajectory], buffers: EncodeBuffers | None = None) -> "Columns":
        n_steps = sum(len(t.steps) for t in trajs)
        steps = np.empty(n_steps, STEP_DTYPE)
        tok_parts: list[np.ndarray] = []
        lp_parts: list[np.ndarray] = []
        mask_parts: list[np.ndarray] = []
        rows = []
        strings = []
        tok_pos = act_pos = k = 0
        trunc_code = {n: i for i, n in enumerate(TRUNCATION_REASONS)}
        sb_code = {n: i for i, n in enumerate(SANDBOX_STATUSES)}
        step_rows = []
        for t in trajs:
            start, n_tok = k, 0
            for s in t.steps:
                p, a, o = len(s.prompt_tokens), len(s.action_tokens), len(s.observation_tokens)
                step_rows.append(
                    (s.policy_version, s.reward, tok_pos, p, a, o, act_pos,
                     sb_code[s.sandbox.status], s.sandbox.exit_code, s.sandbox.duration_s, s.generate_s, s.env_s)
                )
                tok_parts += (s.prompt_tokens, s.action_tokens, s.observation_tokens)
                lp_parts.append(s.action_logprobs)
                mask_parts.append(s.loss_mask)
                tok_pos += p + a + o
                act_pos += a
                n_tok += p + a + o
                k += 1
            versions = [s.policy_version for s in t.steps]
            strings.append(tuple(x.encode() for x in (t.id, t.run, t.domain, t.task, t.generator)))
            rows.append(
                (t.episode, t.final_reward, trunc_code[t.truncation], t.started_at, t.finished_at, start, len(t.steps),
                 n_tok, min(versions), max(versions), t.schema_version)
            )
        # Widths rounded up to a power of two (>= 16) so consecutive batches share one dtype,
        # and the HDF5 type built for it can be reused.
        widths = [1 << max(4, (max((len(s[i]) for s in strings), default=1) - 1).bit_length())
                  for i in range(len(_STRING_FIELDS))]
        traj = np.empty(len(trajs), traj_dtype(widths))
        if trajs:
            for i, name in enumerate(_STRING_FIELDS):
                traj[name] = [s[i] for s in strings]
            numeric = np.array(rows, dtype=np.dtype(_TRAJ_NUMERIC))
            for name, _ in _TRAJ_NUMERIC:
                traj[name] = numeric[name]
        if step_rows:
            steps[:] = np.array(step_rows, dtype=STEP_DTYPE)

        def cat(name, parts, n, dt):
            if buffers is None:
                return np.concatenate(parts) if parts else np.zeros(0, dt)
            out = buffers.take(name, n, dt)
            if parts:
                np.concatenate(parts, out=out)
            return out

        return cls(traj, steps, cat("tokens", tok_parts, tok_pos, np.int32),
                   cat("logprobs", lp_parts, act_pos, np.float32), cat("loss_mask", mask_parts, act_pos, np.uint8))

    # -- properties -----------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.traj)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in ARRAY_NAMES)

    def arrays(self) -> list[tuple[str, np.ndarray]]:
        return [(n, getattr(self, n)) for n in ARRAY_NAMES]

    def ids(self) -> list[str]:
        return [b.decode() for b in self.traj["id"]]

    def crc32(self) -> int:
        """CRC-32 over every array's bytes, in ARRAY_NAMES order (the manifest's checksum)."""
        crc = 0
        for _, arr in self.arrays():
            crc = zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"), crc)
        return crc

    # -- decoding -----------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ColumnsError unless every offset and code is in range (cheap, vectorized)."""
        t, s = self.traj, self.steps
        if s.dtype != STEP_DTYPE:
            raise ColumnsError(f"steps table has dtype {s.dtype}, expected {STEP_DTYPE}")
        missing = [n for n, _ in _TRAJ_NUMERIC + [(f, "") for f in _STRING_FIELDS] if n not in (t.dtype.names or ())]
        if missing:
            raise ColumnsError(f"trajectory table lacks field(s) {missing}")
        for name, arr, dt in (("tokens", self.tokens, np.int32), ("logprobs", self.logprobs, np.float32),
                              ("loss_mask", self.loss_mask, np.uint8)):
            if arr.dtype != dt or arr.ndim != 1:
                raise ColumnsError(f"{name}: expected 1-D {np.dtype(dt)} (got {arr.ndim}-D {arr.dtype})")
        if len(self.logprobs) != len(self.loss_mask):
            raise ColumnsError(f"logprobs ({len(self.logprobs)}) and loss_mask ({len(self.loss_mask)}) differ in length")
        if len(t):
            if (t["n_steps"] < 1).any() or (t["step_start"] < 0).any() or (t["step_start"] + t["n_steps"] > len(s)).any():
                raise ColumnsError("trajectory table: step ranges fall outside the steps table")
            if (t["truncation"] >= len(self.truncation_names)).any():
                raise ColumnsError("trajectory table: unknown truncation code")
        if len(s):
            lens = s["prompt_len"].astype(np.int64) + s["action_len"] + s["obs_len"]
            if (s["prompt_len"] < 0).any() or (s["action_len"] < 0).any() or (s["obs_len"] < 0).any():
                raise ColumnsError("steps table: negative lengths")
            if (s["token_start"] < 0).any() or (s["token_start"] + lens > len(self.tokens)).any():
                raise ColumnsError("steps table: token ranges fall outside the tokens array")
            if (s["action_start"] < 0).any() or (s["action_start"] + s["action_len"] > len(self.logprobs)).any():
                raise ColumnsError("steps table: action ranges fall outside logprobs/loss_mask")
            if (s["sandbox_status"] >= len(self.sandbox_names)).any():
                raise ColumnsError("steps table: unknown sandbox status code")

    def trajectory(self, i: int, trusted: bool = False) -> Trajectory:
        """Row `i` as a Trajectory; token arrays are read-only views into the columns.

        `trusted=True` skips the per-value checks of Trajectory/Step: for columns that passed
        `validate()` and whose bytes were checksummed against what a validating writer stored.
        """
        r = self.traj[i]
        s0, n = int(r["step_start"]), int(r["n_steps"])
        make_step = Step._trusted if trusted else Step
        steps = []
        for (pv, reward, t0, p, a, o, a0, status, code, sandbox_s, gen_s, env_s) in self.steps[s0 : s0 + n].tolist():
            steps.append(make_step(
                pv,
                self.tokens[t0 : t0 + p],
                self.tokens[t0 + p : t0 + p + a],
                self.logprobs[a0 : a0 + a],
                self.loss_mask[a0 : a0 + a],
                self.tokens[t0 + p + a : t0 + p + a + o],
                reward,
                SandboxOutcome(self.sandbox_names[status], code, sandbox_s),
                gen_s,
                env_s,
            ))
        fields = dict(
            run=r["run"].decode(),
            domain=r["domain"].decode(),
            task=r["task"].decode(),
            episode=int(r["episode"]),
            generator=r["generator"].decode(),
            final_reward=float(r["final_reward"]),
            truncation=self.truncation_names[r["truncation"]],
            started_at=float(r["started_at"]),
            finished_at=float(r["finished_at"]),
            schema_version=int(r["schema_version"]),
        )
        try:
            traj = Trajectory._trusted(tuple(steps), **fields) if trusted else Trajectory(steps=tuple(steps), **fields)
        except (TrajectoryError, UnicodeDecodeError) as exc:
            raise ColumnsError(f"row {i}: {exc}") from None
        if traj.id != r["id"].decode():
            raise ColumnsError(f"row {i}: stored id {r['id'].decode()!r} does not match its fields ({traj.id!r})")
        return traj
