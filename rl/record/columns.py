"""Columnar form of a batch of trajectories: two record tables and three flat arrays. It is the
one layout a trajectory has outside a generator: the wire sends it, a shard segment stores it.

    cols = Columns.encode(trajectories)      # what one message carries, what one segment stores
    cols = Columns.encode(batch, bufs)       # flat arrays in reusable EncodeBuffers (writers)
    body, arrays = cols.to_wire()            # the transport's form: the same five arrays
    cols = Columns.from_wire(body, arrays)   # ColumnsError if the framing is broken
    errors = cols.row_errors()               # per row: None, or why that trajectory is refused
    cols.take([0, 2]); Columns.concat([a, b])   # rows out, batches together (offsets re-based)
    cols.crc32()                             # checksum over every byte, in a fixed order
    cols.trajectory(i)                       # back to a Trajectory (arrays are views)

Variable-length token data is never stored one array per trajectory: all steps' tokens are
concatenated into `tokens` (per step: prompt, then action, then observation), and the
action-aligned `logprobs` and `loss_mask` into their own flat arrays. The `steps` table holds
each step's offsets into them and the `traj` table each trajectory's first step and count,
so any one record is a handful of slices. Strings (ids) are fixed-width UTF-8 fields sized
to the longest in the batch, which HDF5 stores without per-row heap objects.

`validate` checks every offset against the array lengths before slicing: a damaged file that
slipped past its checksum still fails loudly instead of yielding garbage. Columns from the wire
are held to more: the layout must be canonical (each record's steps, tokens and actions follow
the previous one's without gaps), which `take` and `concat` keep, and `row_errors` applies
every rule a Trajectory's constructor checks (the same rules, from `checks`), vectorized over
the batch, so a store writer can take a batch as it arrived without rebuilding one Python object per trajectory.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcrl.rl.record.checks import MAX_NAME_LEN, TrajectoryError, batch_ok, names_ok
from hpcrl.rl.record.flat import EncodeBuffers, as_bytes, gather, starts
from hpcrl.rl.record.tables import ARRAY_NAMES, STEP_DTYPE, STRING_FIELDS, TRAJ_NUMERIC, traj_dtype
from hpcrl.rl.record.trajectory import (
    NO_SANDBOX,
    SANDBOX_STATUSES,
    TRUNCATION_REASONS,
    SandboxOutcome,
    Step,
    Trajectory,
    sandbox_unchecked,
)

__all__ = ["Columns", "ColumnsError", "wire_bytes"]


class ColumnsError(ValueError):
    """Stored columns are inconsistent (offsets out of range, unknown codes, wrong dtypes)."""


def wire_bytes(traj: Trajectory) -> int:
    """About the bytes `traj` takes in a message: its arrays and table rows (batch sizing)."""
    n = 96 + STEP_DTYPE.itemsize * len(traj.steps)
    return n + sum(
        4 * (len(s.prompt_tokens) + len(s.observation_tokens)) + 9 * len(s.action_tokens) for s in traj.steps
    )


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
    def encode(cls, trajs: Sequence[Trajectory], buffers: EncodeBuffers | None = None) -> Columns:
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
                    (
                        s.policy_version,
                        s.reward,
                        tok_pos,
                        p,
                        a,
                        o,
                        act_pos,
                        sb_code[s.sandbox.status],
                        s.sandbox.exit_code,
                        s.sandbox.duration_s,
                        s.generate_s,
                        s.env_s,
                        s.sandbox.command.encode(),
                        s.sandbox.tests_passed,
                        s.sandbox.tests_total,
                        s.sandbox.resumes,
                        s.temperature,
                        s.top_p,
                        s.top_k,
                    )
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
                (
                    t.episode,
                    t.final_reward,
                    trunc_code[t.truncation],
                    t.started_at,
                    t.finished_at,
                    start,
                    len(t.steps),
                    n_tok,
                    min(versions),
                    max(versions),
                    t.schema_version,
                    t.fault.encode(),
                )
            )
        # Widths rounded up to a power of two (>= 16) so consecutive batches share one dtype,
        # and the HDF5 type built for it can be reused.
        widths = [
            1 << max(4, (max((len(s[i]) for s in strings), default=1) - 1).bit_length())
            for i in range(len(STRING_FIELDS))
        ]
        traj = np.empty(len(trajs), traj_dtype(widths))
        if trajs:
            for i, name in enumerate(STRING_FIELDS):
                traj[name] = [s[i] for s in strings]
            numeric = np.array(rows, dtype=np.dtype(TRAJ_NUMERIC))
            for name, _ in TRAJ_NUMERIC:
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

        return cls(
            traj,
            steps,
            cat("tokens", tok_parts, tok_pos, np.int32),
            cat("logprobs", lp_parts, act_pos, np.float32),
            cat("loss_mask", mask_parts, act_pos, np.uint8),
        )

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

    # -- the wire ----------------------------------------------------------------------------

    def to_wire(self) -> tuple[dict, list[np.ndarray]]:
        """A message body (ids, string widths, code tables) and the five arrays, the two record
        tables as their raw bytes (the transport carries no structured dtypes)."""
        widths = [self.traj.dtype[n].itemsize for n in STRING_FIELDS]
        body = {"ids": self.ids(), "widths": widths, "names": [list(self.truncation_names), list(self.sandbox_names)]}
        return body, [as_bytes(self.traj), as_bytes(self.steps), self.tokens, self.logprobs, self.loss_mask]

    @classmethod
    def from_wire(cls, body: Any, arrays: Sequence[np.ndarray]) -> Columns:
        """Inverse of `to_wire`, zero-copy; ColumnsError when the framing is broken (then no row
        can be trusted). The rows' values are `row_errors`' business."""
        if type(body) is not dict or set(body) != {"ids", "widths", "names"}:
            raise ColumnsError("batch body must be a mapping with exactly ids, widths, names")
        ids, widths, names = body["ids"], body["widths"], body["names"]
        if type(ids) is not list or not all(type(i) is str for i in ids):
            raise ColumnsError("batch: ids must be a list of strings")
        if (
            type(widths) is not list
            or len(widths) != len(STRING_FIELDS)
            or not all(type(w) is int and 1 <= w <= 4 * MAX_NAME_LEN for w in widths)
        ):
            raise ColumnsError(f"batch: widths must be {len(STRING_FIELDS)} ints in 1..{4 * MAX_NAME_LEN}")
        # Code tables only grow at the end: a sender's that is a prefix of ours decodes as ours.
        ours = (TRUNCATION_REASONS, SANDBOX_STATUSES)
        if (
            type(names) is not list
            or len(names) != 2
            or any(type(n) is not list or tuple(n) != mine[: len(n)] for n, mine in zip(names, ours))
        ):
            raise ColumnsError("batch: its truncation/sandbox code tables are not this hpcrl's; upgrade one side")
        if len(arrays) != 5 or any(a.ndim != 1 for a in arrays):
            raise ColumnsError("batch: expected 5 1-D arrays (traj, steps, tokens, logprobs, loss_mask)")
        tables = []
        for raw, dtype, what in ((arrays[0], traj_dtype(widths), "traj"), (arrays[1], STEP_DTYPE, "steps")):
            if raw.dtype != np.uint8 or len(raw) % dtype.itemsize:
                raise ColumnsError(f"batch: the {what} table is not whole {dtype.itemsize}-byte records")
            tables.append(np.frombuffer(raw, dtype))
        cols = cls(tables[0], tables[1], *arrays[2:])
        if cols.rows != len(ids) or cols.ids() != ids:
            raise ColumnsError(f"batch: its {len(ids)} ids do not name its {cols.rows} records")
        cols.validate(canonical=True)
        return cols

    def row_errors(self) -> list[str | None]:
        """Per row, None or why the trajectory would be refused: every check of the Trajectory and
        Step constructors, plus the columns' own derived fields. Vectorized over the batch; rows
        are looked at one by one only when something is wrong, to name the culprit."""
        derived = self._derived_ok()
        ok = (
            bool(derived.all())
            and batch_ok(self.traj, self.steps, self.tokens, self.logprobs, self.loss_mask)
            and all(self._names_ok(i) for i in range(self.rows))
        )
        return [None] * self.rows if ok else [self._row_error(i, bool(derived[i])) for i in range(self.rows)]

    def _derived_ok(self) -> np.ndarray:
        """Per row: n_tokens and the policy version range agree with the row's steps (canonical
        layout: each row's steps start where the previous row's end)."""
        t, s = self.traj, self.steps
        if not len(t):
            return np.ones(0, bool)
        lens = s["prompt_len"].astype(np.int64) + s["action_len"] + s["obs_len"]
        first, pv = t["step_start"], s["policy_version"]
        return (
            (np.add.reduceat(lens, first) == t["n_tokens"])
            & (np.minimum.reduceat(pv, first) == t["min_policy_version"])
            & (np.maximum.reduceat(pv, first) == t["max_policy_version"])
        )

    def _names_ok(self, i: int) -> bool:
        return names_ok(self.traj[i], STRING_FIELDS)

    def _row_error(self, i: int, derived_ok: bool) -> str | None:
        tid = self.traj[i]["id"].decode(errors="replace")
        try:
            self.trajectory(i)  # the constructors name the field
        except (ColumnsError, TrajectoryError, UnicodeDecodeError) as exc:
            return str(exc)
        if not self._names_ok(i):
            return f"trajectory {tid}: its id does not match run/generator/episode"
        if not derived_ok:
            return f"trajectory {tid}: n_tokens or policy version range does not match its steps"
        return None

    # -- rows in and out -----------------------------------------------------------------------

    def take(self, rows: Sequence[int]) -> Columns:
        """These rows (in this order) as Columns of their own, offsets re-based (arrays copied)."""
        t = self.traj[np.asarray(rows, np.int64)]
        steps = self.steps[gather(t["step_start"], t["n_steps"])]
        lens = steps["prompt_len"].astype(np.int64) + steps["action_len"] + steps["obs_len"]
        act = gather(steps["action_start"], steps["action_len"])
        tokens = self.tokens[gather(steps["token_start"], lens)]
        t["step_start"] = starts(t["n_steps"])
        steps["token_start"], steps["action_start"] = starts(lens), starts(steps["action_len"])
        return Columns(
            t, steps, tokens, self.logprobs[act], self.loss_mask[act], self.truncation_names, self.sandbox_names
        )

    @staticmethod
    def tables(parts: Sequence[Columns]) -> tuple[np.ndarray, np.ndarray]:
        """The record tables (traj, steps) of `parts` concatenated, offsets re-based as if their
        flat arrays were concatenated too: a segment writes those piece by piece, uncopied."""
        if len(parts) == 1:
            return parts[0].traj, parts[0].steps
        widths = [max((p.traj.dtype[n].itemsize for p in parts), default=1) for n in STRING_FIELDS]
        traj = np.empty(sum(p.rows for p in parts), traj_dtype(widths))
        steps = np.concatenate([p.steps for p in parts]) if parts else np.empty(0, STEP_DTYPE)
        row = k = tok = act = 0
        for p in parts:
            n, m = p.rows, len(p.steps)
            for name in traj.dtype.names:
                traj[name][row : row + n] = p.traj[name]
            traj["step_start"][row : row + n] += k
            steps["token_start"][k : k + m] += tok
            steps["action_start"][k : k + m] += act
            row, k, tok, act = row + n, k + m, tok + len(p.tokens), act + len(p.logprobs)
        return traj, steps

    @classmethod
    def concat(cls, parts: Sequence[Columns], buffers: EncodeBuffers | None = None) -> Columns:
        """Several canonical Columns as one, in order (one shared string width per field)."""
        if len(parts) == 1 and buffers is None:
            return parts[0]
        traj, steps = cls.tables(parts)
        if len(parts) == 1:  # the tables are the part's own: copy them, as for several parts
            traj, steps = traj.copy(), steps.copy()

        def cat(name: str, dt) -> np.ndarray:
            arrays = [getattr(p, name) for p in parts]
            out = buffers.take(name, sum(len(a) for a in arrays), dt) if buffers else None
            return np.concatenate(arrays, out=out) if arrays else np.zeros(0, dt)

        return cls(traj, steps, cat("tokens", np.int32), cat("logprobs", np.float32), cat("loss_mask", np.uint8))

    # -- decoding -----------------------------------------------------------------------------

    def validate(self, canonical: bool = False) -> None:
        """Raise ColumnsError unless every offset and code is in range (cheap, vectorized); with
        `canonical`, unless every record's pieces also follow the previous ones' without gaps."""
        t, s = self.traj, self.steps
        if s.dtype != STEP_DTYPE:
            raise ColumnsError(f"steps table has dtype {s.dtype}, expected {STEP_DTYPE}")
        missing = [n for n, _ in TRAJ_NUMERIC + [(f, "") for f in STRING_FIELDS] if n not in (t.dtype.names or ())]
        if missing:
            raise ColumnsError(f"trajectory table lacks field(s) {missing}")
        for name, arr, dt in (
            ("tokens", self.tokens, np.int32),
            ("logprobs", self.logprobs, np.float32),
            ("loss_mask", self.loss_mask, np.uint8),
        ):
            if arr.dtype != dt or arr.ndim != 1:
                raise ColumnsError(f"{name}: expected 1-D {np.dtype(dt)} (got {arr.ndim}-D {arr.dtype})")
        if len(self.logprobs) != len(self.loss_mask):
            raise ColumnsError(
                f"logprobs ({len(self.logprobs)}) and loss_mask ({len(self.loss_mask)}) differ in length"
            )
        if len(t):
            if (
                (t["n_steps"] < 1).any()
                or (t["step_start"] < 0).any()
                or (t["step_start"] + t["n_steps"] > len(s)).any()
            ):
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
        if canonical:
            n = t["n_steps"].astype(np.int64)
            lens = s["prompt_len"].astype(np.int64) + s["action_len"] + s["obs_len"]
            act = s["action_len"].astype(np.int64)
            if (t["step_start"] != starts(n)).any() or int(n.sum()) != len(s):
                raise ColumnsError("trajectory table: records' steps are not back to back")
            if (s["token_start"] != starts(lens)).any() or int(lens.sum()) != len(self.tokens):
                raise ColumnsError("steps table: steps' tokens are not back to back")
            if (s["action_start"] != starts(act)).any() or int(act.sum()) != len(self.logprobs):
                raise ColumnsError("steps table: steps' actions are not back to back")

    def trajectory(self, i: int, trusted: bool = False) -> Trajectory:
        """Row `i` as a Trajectory; token arrays are read-only views into the columns.

        `trusted=True` skips the per-value checks of Trajectory/Step: for columns that passed
        `validate()` and whose bytes were checksummed against what a validating writer stored.
        """
        r = self.traj[i]
        s0, n = int(r["step_start"]), int(r["n_steps"])
        make_step = Step.unchecked if trusted else Step
        steps = []
        rows = self.steps[s0 : s0 + n].tolist()
        for j, (
            pv,
            reward,
            t0,
            p,
            a,
            o,
            a0,
            status,
            code,
            sandbox_s,
            gen_s,
            env_s,
            cmd,
            passed,
            total,
            resumes,
            temp,
            top_p,
            top_k,
        ) in enumerate(rows):
            extra = (cmd.decode(errors="replace"), passed, total, resumes)
            try:
                steps.append(
                    make_step(
                        pv,
                        self.tokens[t0 : t0 + p],
                        self.tokens[t0 + p : t0 + p + a],
                        self.logprobs[a0 : a0 + a],
                        self.loss_mask[a0 : a0 + a],
                        self.tokens[t0 + p + a : t0 + p + a + o],
                        reward,
                        # Most steps ran no sandbox: trusted rows share the one outcome that says so.
                        (
                            NO_SANDBOX
                            if trusted and status == 0 and code == 0 and sandbox_s == 0 and extra == ("", 0, 0, 0)
                            else sandbox_unchecked(self.sandbox_names[status], code, sandbox_s, *extra)
                            if trusted
                            else SandboxOutcome(self.sandbox_names[status], code, sandbox_s, *extra)
                        ),
                        gen_s,
                        env_s,
                        temp,
                        top_p,
                        top_k,
                    )
                )
            except TrajectoryError as exc:
                where = r["id"].decode(errors="replace")
                raise ColumnsError(f"trajectory {where}: {str(exc).replace('step.', f'steps[{j}].', 1)}") from None
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
            fault=r["fault"].decode(errors="replace"),
        )
        try:
            traj = Trajectory.unchecked(tuple(steps), **fields) if trusted else Trajectory(steps=tuple(steps), **fields)
        except (TrajectoryError, UnicodeDecodeError) as exc:
            raise ColumnsError(f"row {i}: {exc}") from None
        if traj.id != r["id"].decode():
            raise ColumnsError(f"row {i}: stored id {r['id'].decode()!r} does not match its fields ({traj.id!r})")
        return traj
