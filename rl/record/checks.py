"""Every check a trajectory's values must pass, written once, in the two forms it is applied in.

    check_name(value, "trajectory.run", allow_slash=False)   # one value: returns it or raises
    STEP_RULES["top_p"].check(0.9, "step.top_p")             # TrajectoryError names the field
    STEP_RULES["top_p"].ok(steps_table["top_p"])              # a whole column at once: bool
    batch_ok(traj_table, steps_table, tokens, logprobs, loss_mask)

The Trajectory, Step and SandboxOutcome constructors check one value at a time and name the
field that failed. A store writer takes batches as they arrived on the wire, in columns, and
checks them with the same rules vectorized over the batch (`batch_ok`, `names_ok`); only when a
batch fails are its rows rebuilt one by one by the constructors, which name the culprit. A
bound or rule changed here changes both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SCHEMA_VERSION",
    "TrajectoryError",
    "Rule",
    "STEP_RULES",
    "SANDBOX_RULES",
    "TRAJ_RULES",
    "batch_ok",
    "clip_text",
    "names_ok",
]

# v2: per-step command, tests passed/total and session resumes; the trajectory's fault.
# v3: per-step sampling parameters (temperature, top_p, top_k). Older records read as current
# with the new fields at their defaults: v1/v2 generators recorded the model's own
# log-probabilities (temperature 1, untruncated), which is what those defaults say.
SCHEMA_VERSION = 3

MAX_NAME_LEN = 200
MAX_ID_LEN = 3 * MAX_NAME_LEN + 24  # run/generator/episode
MAX_COMMAND_BYTES = 96  # a step's sandbox command as stored: a label for reading, not the program
MAX_FAULT_BYTES = 200  # the trajectory's infrastructure fault message as stored
CONTROL = re.compile(r"[\x00-\x1f]")
# log p <= 0 in exact arithmetic; samplers working in bf16/fp16 can overshoot a little.
LOGPROB_SLACK = 1e-3
INT32_MAX = int(np.iinfo(np.int32).max)
INT64_MAX = int(np.iinfo(np.int64).max)


class TrajectoryError(ValueError):
    """A trajectory field is invalid; the message names the record, the field and the fix."""


def fail(where: str, msg: str) -> TrajectoryError:
    return TrajectoryError(f"{where}: {msg}")


# -- one value -------------------------------------------------------------------------------


def check_name(value: Any, where: str, allow_slash: bool = True) -> str:
    if not isinstance(value, str) or not value:
        raise fail(where, f"expected a non-empty string (got {value!r})")
    if len(value) > MAX_NAME_LEN:
        raise fail(where, f"at most {MAX_NAME_LEN} characters (got {len(value)})")
    if CONTROL.search(value):
        raise fail(where, f"control characters are not allowed (got {value!r})")
    if not allow_slash and "/" in value:
        raise fail(where, f"'/' is not allowed: it separates the parts of a trajectory id (got {value!r})")
    return value


def check_int(value: Any, where: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(where, f"expected an int (got {type(value).__name__} {value!r})")
    value = int(value)
    if value < lo or value > INT64_MAX:
        raise fail(where, f"must be >= {lo} and fit in int64 (got {value})")
    return value


def check_float(value: Any, where: str, finite: bool = True, ge: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise fail(where, f"expected a number (got {type(value).__name__} {value!r})")
    value = float(value)
    if finite and not math.isfinite(value):
        raise fail(where, f"must be finite (got {value})")
    if ge is not None and value < ge:
        raise fail(where, f"must be >= {ge} (got {value})")
    return value


def frozen(arr: np.ndarray) -> np.ndarray:
    # A view, so the caller's own array keeps its flags; the record's copy cannot be written.
    view = arr.view()
    view.flags.writeable = False
    return view


def check_tokens(value: Any, where: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise fail(where, f"expected a 1-D sequence of token ids (got shape {arr.shape})")
    if arr.size == 0:
        return frozen(np.zeros(0, np.int32))
    if arr.dtype.kind not in "iu":
        raise fail(where, f"token ids must be integers (got dtype {arr.dtype})")
    lo = int(arr.min())
    hi = int(arr.max()) if arr.dtype != np.int32 else 0  # int32 cannot exceed the bound
    if lo < 0 or hi > INT32_MAX:
        raise fail(where, f"token ids must be in 0..{INT32_MAX} (got {lo}..{int(arr.max())})")
    if arr.dtype != np.int32:
        arr = arr.astype(np.int32)
    return frozen(np.ascontiguousarray(arr))


def logprobs_ok(lp: np.ndarray) -> bool:
    """Log-probabilities are finite and <= 0 (up to the sampler's rounding)."""
    return not len(lp) or bool(np.isfinite(lp).all() and lp.max() <= LOGPROB_SLACK)


def mask_ok(mask: np.ndarray) -> bool:
    return not len(mask) or bool(mask.max() <= 1 and mask.min() >= 0)


def tests_ok(passed: Any, total: Any) -> bool:
    """A sandbox run passed at most as many tests as it had (one value or whole columns)."""
    return bool(np.all(np.asarray(passed) <= np.asarray(total)))


def clip_text(text: str, max_bytes: int) -> str:
    """`text` on one line, cut to at most `max_bytes` of UTF-8 (at a character boundary, '...' marking
    a cut): commands and fault messages are stored in fixed-width fields."""
    text = CONTROL.sub(" ", str(text))
    raw = text.encode()
    if len(raw) <= max_bytes:
        return text
    return raw[: max_bytes - 3].decode("utf-8", "ignore") + "..."


# -- numeric fields: one rule, two forms -----------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A numeric field's bounds: an int (>= ge, <= le) or a finite float (>= ge, or in (gt, le])."""

    integer: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def check(self, value: Any, where: str) -> Any:
        """One value: the value (int or float) or TrajectoryError naming `where`."""
        if self.integer:
            v = check_int(value, where, lo=int(self.ge or 0))
            if self.le is not None and v > self.le:
                raise fail(where, f"at most {self.le} (got {v})")
            return v
        v = check_float(value, where, ge=self.ge)
        if self.gt is not None and not self.gt < v <= (math.inf if self.le is None else self.le):
            raise fail(where, f"must be in ({self.gt:g}, {self.le:g}] (got {v})")
        return v

    def ok(self, column: np.ndarray) -> bool:
        """A whole column: does every value pass `check`? (The column's dtype bounds the rest.)"""
        good = np.ones(column.shape, bool) if self.integer else np.isfinite(column)
        if self.ge is not None:
            good &= column >= self.ge
        if self.gt is not None:
            good &= column > self.gt
        if self.le is not None:
            good &= column <= self.le
        return bool(good.all())


# Field -> rule; the steps table stores a sandbox's duration_s as `sandbox_s`, the rest by name.
STEP_RULES = {
    "policy_version": Rule(integer=True, ge=0),
    "reward": Rule(),
    "generate_s": Rule(ge=0.0),
    "env_s": Rule(ge=0.0),
    "temperature": Rule(ge=0.0),
    "top_p": Rule(gt=0.0, le=1.0),
    "top_k": Rule(integer=True, ge=0, le=INT32_MAX),
}
SANDBOX_RULES = {
    "duration_s": Rule(ge=0.0),
    "tests_passed": Rule(integer=True, ge=0, le=INT32_MAX),
    "tests_total": Rule(integer=True, ge=0, le=INT32_MAX),
    "resumes": Rule(integer=True, ge=0, le=255),
}
SANDBOX_COLUMNS = {"duration_s": "sandbox_s"}
TRAJ_RULES = {
    "episode": Rule(integer=True, ge=0),
    "final_reward": Rule(),
    "started_at": Rule(ge=0.0),
    "finished_at": Rule(ge=0.0),
    "schema_version": Rule(integer=True, ge=1, le=SCHEMA_VERSION),
}


# -- a batch in columns ----------------------------------------------------------------------


def batch_ok(
    traj: np.ndarray, steps: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray, loss_mask: np.ndarray
) -> bool:
    """Do all rows of a batch's tables and flat arrays pass every rule above (names apart)?"""
    return (
        all(rule.ok(traj[name]) for name, rule in TRAJ_RULES.items())
        and all(rule.ok(steps[name]) for name, rule in STEP_RULES.items())
        and all(rule.ok(steps[SANDBOX_COLUMNS.get(name, name)]) for name, rule in SANDBOX_RULES.items())
        and tests_ok(steps["tests_passed"], steps["tests_total"])
        and (not len(tokens) or tokens.min() >= 0)
        and logprobs_ok(logprobs)
        and mask_ok(loss_mask)
    )


_GOOD_NAMES: set[bytes] = set()  # table strings that passed the name checks (names recur)


def names_ok(row: np.void, string_fields: tuple[str, ...]) -> bool:
    """One trajectory table row's names pass `check_name` and its id is run/generator/episode."""
    for name in string_fields:
        v = row[name]
        if v not in _GOOD_NAMES:
            try:
                text = v.decode()
            except UnicodeDecodeError:
                return False
            limit = MAX_ID_LEN if name == "id" else MAX_NAME_LEN
            if not 0 < len(text) <= limit or CONTROL.search(text):
                return False
            if name != "id" and len(_GOOD_NAMES) < 65536:
                _GOOD_NAMES.add(v)
    return (
        b"/" not in row["run"]
        and b"/" not in row["generator"]
        and (row["id"] == b"%s/%s/%d" % (row["run"], row["generator"], int(row["episode"])))
    )
