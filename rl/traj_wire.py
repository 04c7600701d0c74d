"""Wire form of a Trajectory for the transport: a msgpack-able header and three flat arrays.

    header, arrays = to_wire(traj)        # arrays: tokens int32, logprobs float32, loss_mask uint8
    traj = from_wire(header, arrays)      # TrajectoryError on anything malformed

The header holds the scalar fields and one row per step:
    [policy_version, reward, sandbox_status, sandbox_exit_code, sandbox_s, generate_s, env_s,
     prompt_len, action_len, observation_len]
`tokens` concatenates each step's prompt, action and observation tokens; `logprobs` and
`loss_mask` concatenate the action-aligned arrays. Three frames per trajectory rather than five
per step: per-frame costs (a send call, a CURVE box, a receive call) dominate the path at a few
kB per array. `to_wire` makes one contiguous copy per array kind; the transport then sends
those arrays without copying them again, and `from_wire` returns steps whose arrays are
read-only views of the received frames.

`from_wire` runs once per trajectory on the store writer, so the common case (everything
valid) is checked with a few vectorized reductions over the three arrays; only when that
fails does it rebuild each Step through the validating constructor, to name the culprit.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from hpcrl.rl.trajectory import (
    _CONTROL,
    _INT64_MAX,
    _LOGPROB_SLACK,
    _SCALAR_FIELDS,
    MAX_NAME_LEN,
    SANDBOX_STATUSES,
    SCHEMA_VERSION,
    TRUNCATION_REASONS,
    SandboxOutcome,
    Step,
    Trajectory,
    TrajectoryError,
    _sandbox_trusted,
)

__all__ = ["to_wire", "from_wire"]

_ROW = 10  # values per step row


def to_wire(traj: Trajectory) -> tuple[dict[str, Any], list[np.ndarray]]:
    header: dict[str, Any] = {k: getattr(traj, k) for k in _SCALAR_FIELDS}
    header["steps"] = [
        [s.policy_version, s.reward, s.sandbox.status, s.sandbox.exit_code, s.sandbox.duration_s, s.generate_s,
         s.env_s, len(s.prompt_tokens), len(s.action_tokens), len(s.observation_tokens)]
        for s in traj.steps
    ]
    tokens = np.concatenate([a for s in traj.steps for a in (s.prompt_tokens, s.action_tokens, s.observation_tokens)])
    logprobs = np.concatenate([s.action_logprobs for s in traj.steps])
    mask = np.concatenate([s.loss_mask for s in traj.steps])
    return header, [tokens, logprobs, mask]


def _fail(msg: str) -> TrajectoryError:
    return TrajectoryError(f"trajectory (wire): {msg}")


def from_wire(header: Any, arrays: Sequence[np.ndarray]) -> Trajectory:
    if type(header) is not dict or type(header.get("steps")) is not list:
        raise _fail("header must be a mapping with a 'steps' list")
    extra = set(header) - set(_SCALAR_FIELDS) - {"steps"}
    if extra:
        raise _fail(f"unknown field(s) {sorted(extra)}")
    rows = header["steps"]
    if len(arrays) != 3:
        raise _fail(f"expected 3 arrays (tokens, logprobs, loss_mask) (got {len(arrays)})")
    tokens, logprobs, mask = arrays
    if any(a.ndim != 1 for a in arrays):
        raise _fail("arrays must be 1-D")
    n_tok = n_act = 0
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != _ROW:
            raise _fail(f"steps[{i}]: expected {_ROW} values")
        lens = row[7:]
        if not all(type(x) is int and x >= 0 for x in lens):
            raise _fail(f"steps[{i}]: lengths must be ints >= 0 (got {lens})")
        n_tok += lens[0] + lens[1] + lens[2]
        n_act += lens[1]
    if len(tokens) != n_tok or len(logprobs) != n_act or len(mask) != n_act:
        raise _fail(f"steps announce {n_tok} tokens and {n_act} action values; arrays hold "
                    f"{len(tokens)}, {len(logprobs)} logprobs, {len(mask)} mask values")
    fields = {k: header[k] for k in _SCALAR_FIELDS if k in header}
    if _arrays_ok(tokens, logprobs, mask) and all(_row_ok(r) for r in rows) and _scalars_ok(fields):
        steps = []
        t = a0 = 0
        mask = mask.view(np.uint8)
        for pv, reward, status, code, dur, gen_s, env_s, p, a, o in rows:
            steps.append(Step._trusted(
                pv, tokens[t:t + p], tokens[t + p:t + p + a], logprobs[a0:a0 + a], mask[a0:a0 + a],
                tokens[t + p + a:t + p + a + o], float(reward), _sandbox_trusted(status, code, float(dur)),
                float(gen_s), float(env_s)))
            t += p + a + o
            a0 += a
        return Trajectory._trusted(tuple(steps), **fields)
    return _slow(rows, tokens, logprobs, mask, fields)


def _arrays_ok(tokens: np.ndarray, logprobs: np.ndarray, mask: np.ndarray) -> bool:
    if tokens.dtype != np.int32 or logprobs.dtype != np.float32 or mask.dtype not in (np.uint8, np.bool_):
        return False
    if len(tokens) and tokens.min() < 0:
        return False
    if len(logprobs) and not (np.isfinite(logprobs).all() and logprobs.max() <= _LOGPROB_SLACK):
        return False
    return not (len(mask) and mask.view(np.uint8).max() > 1)


def _row_ok(row: list) -> bool:
    pv, reward, status, code, dur, gen_s, env_s = row[:7]
    if type(pv) is not int or not 0 <= pv <= _INT64_MAX or status not in SANDBOX_STATUSES:
        return False
    if type(code) is not int or not -(2**31) <= code < 2**31:
        return False
    if type(reward) not in (int, float) or not math.isfinite(reward):
        return False
    return all(type(x) in (int, float) and 0 <= x < math.inf for x in (dur, gen_s, env_s))


def _scalars_ok(f: dict) -> bool:
    """The header's scalar fields pass every Trajectory check (fast path, no messages)."""
    if len(f) != len(_SCALAR_FIELDS):
        return False
    names = (f["run"], f["generator"], f["domain"], f["task"])
    if not all(type(v) is str and 0 < len(v) <= MAX_NAME_LEN and not _CONTROL.search(v) for v in names):
        return False
    if "/" in f["run"] or "/" in f["generator"]:
        return False
    ep, sv = f["episode"], f["schema_version"]
    if type(ep) is not int or not 0 <= ep <= _INT64_MAX or type(sv) is not int or sv != SCHEMA_VERSION:
        return False
    if f["truncation"] not in TRUNCATION_REASONS:
        return False
    fr, t0, t1 = f["final_reward"], f["started_at"], f["finished_at"]
    return all(type(x) in (int, float) and math.isfinite(x) for x in (fr, t0, t1)) and t0 >= 0 and t1 >= 0


def _slow(rows: list, tokens: np.ndarray, logprobs: np.ndarray, mask: np.ndarray, fields: dict) -> Trajectory:
    """The validating constructors, step by step: either a valid Trajectory (e.g. int64 token
    ids, which Step converts) or a TrajectoryError that names the step and field."""
    steps = []
    t = a0 = 0
    for i, (pv, reward, status, code, dur, gen_s, env_s, p, a, o) in enumerate(rows):
        try:
            steps.append(Step(pv, tokens[t:t + p], tokens[t + p:t + p + a], logprobs[a0:a0 + a], mask[a0:a0 + a],
                              tokens[t + p + a:t + p + a + o], reward, SandboxOutcome(status, code, dur), gen_s, env_s))
        except TrajectoryError as exc:
            raise _fail(f"steps[{i}]: {exc}") from None
        t += p + a + o
        a0 += a
    try:
        return Trajectory(steps=tuple(steps), **fields)
    except TypeError as exc:
        raise _fail(str(exc)) from None
