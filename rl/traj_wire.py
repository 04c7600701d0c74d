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
    NO_SANDBOX,
    SANDBOX_STATUSES,
    SCHEMA_VERSION,
    TRUNCATION_REASONS,
    SandboxOutcome,
    Step,
    Trajectory,
    TrajectoryError,
    _sandbox_trusted,
)

__all__ = ["to_wire", "from_wire", "to_wire_batch", "from_wire_batch", "wire_bytes"]

_ROW = 10  # values per step row


def to_wire(traj: Trajectory) -> tuple[dict[str, Any], list[np.ndarray]]:
    """One trajectory's header and three arrays (a batch of one; see `to_wire_batch`)."""
    body, arrays = to_wire_batch([traj])
    return body["h"][0], arrays


def to_wire_batch(trajs: Sequence[Trajectory]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Several trajectories as one message body and three arrays: their ids, headers and array
    lengths, and each kind of array concatenated over the whole batch (one copy, no
    per-trajectory concatenation)."""
    headers, sizes, tok, lp, mask = [], [], [], [], []
    for t in trajs:
        header = {k: getattr(t, k) for k in _SCALAR_FIELDS}
        rows = []
        n_tok = n_act = 0
        for s in t.steps:
            p, a, o = len(s.prompt_tokens), len(s.action_tokens), len(s.observation_tokens)
            rows.append([s.policy_version, s.reward, s.sandbox.status, s.sandbox.exit_code, s.sandbox.duration_s,
                         s.generate_s, s.env_s, p, a, o])
            tok += (s.prompt_tokens, s.action_tokens, s.observation_tokens)
            lp.append(s.action_logprobs)
            mask.append(s.loss_mask)
            n_tok += p + a + o
            n_act += a
        header["steps"] = rows
        headers.append(header)
        sizes.append([n_tok, n_act])
    body = {"ids": [t.id for t in trajs], "h": headers, "n": sizes}
    arrays = [np.concatenate(parts) if parts else np.zeros(0, dt)
              for parts, dt in ((tok, np.int32), (lp, np.float32), (mask, np.uint8))]
    return body, arrays


def wire_bytes(traj: Trajectory) -> int:
    """The bytes `traj`'s arrays take on the wire (tokens int32, logprobs float32, mask uint8)."""
    return sum(4 * (len(s.prompt_tokens) + len(s.action_tokens) + len(s.observation_tokens)) + 5 * len(s.action_tokens)
               for s in traj.steps)


def from_wire_batch(body: Any, arrays: Sequence[np.ndarray]) -> list[tuple[str, Trajectory | TrajectoryError]]:
    """Inverse of `to_wire_batch`: (id, trajectory or the error that names what is wrong with it)
    per trajectory, so that one bad trajectory costs only itself. A batch whose framing is
    inconsistent (counts, lengths, array kinds) raises TrajectoryError as a whole."""
    if type(body) is not dict or set(body) != {"ids", "h", "n"}:
        raise _fail("batch body must be a mapping with exactly ids, h, n")
    ids, headers, sizes = body["ids"], body["h"], body["n"]
    if not (type(ids) is list and type(headers) is list and type(sizes) is list) or not (
            len(ids) == len(headers) == len(sizes)):
        raise _fail("batch: ids, h, n must be lists of one length")
    if len(arrays) != 3 or any(a.ndim != 1 for a in arrays):
        raise _fail("batch: expected 3 1-D arrays (tokens, logprobs, loss_mask)")
    tokens, logprobs, mask = arrays
    for i, (tid, n) in enumerate(zip(ids, sizes)):
        if type(tid) is not str or not 0 < len(tid) <= 3 * MAX_NAME_LEN + 24:
            raise _fail(f"batch: ids[{i}] is not a trajectory id")
        if type(n) is not list or len(n) != 2 or not all(type(x) is int and x >= 0 for x in n):
            raise _fail(f"batch: n[{i}] must be [tokens, actions] counts")
    n_act = sum(n[1] for n in sizes)
    if sum(n[0] for n in sizes) != len(tokens) or n_act != len(logprobs) or n_act != len(mask):
        raise _fail("batch: the arrays do not hold what n announces")
    # One vectorized check over the whole batch; only if it fails is each trajectory checked alone.
    checked = _arrays_ok(tokens, logprobs, mask)
    out: list[tuple[str, Trajectory | TrajectoryError]] = []
    t = a = 0
    for tid, header, (nt, na) in zip(ids, headers, sizes):
        part = [tokens[t:t + nt], logprobs[a:a + na], mask[a:a + na]]
        t, a = t + nt, a + na
        try:
            traj = _from_wire(header, part, arrays_checked=checked)
            if traj.id != tid:
                raise _fail(f"id {tid!r} is not the trajectory's id {traj.id!r}")
            out.append((tid, traj))
        except TrajectoryError as exc:
            out.append((tid, exc))
    return out


def _fail(msg: str) -> TrajectoryError:
    return TrajectoryError(f"trajectory (wire): {msg}")


def from_wire(header: Any, arrays: Sequence[np.ndarray]) -> Trajectory:
    return _from_wire(header, arrays, arrays_checked=False)


_HEADER_KEYS = frozenset(_SCALAR_FIELDS) | {"steps"}


def _from_wire(header: Any, arrays: Sequence[np.ndarray], arrays_checked: bool) -> Trajectory:
    if type(header) is not dict or type(header.get("steps")) is not list:
        raise _fail("header must be a mapping with a 'steps' list")
    if not header.keys() <= _HEADER_KEYS:
        raise _fail(f"unknown field(s) {sorted(set(header) - _HEADER_KEYS)}")
    rows = header["steps"]
    if len(arrays) != 3:
        raise _fail(f"expected 3 arrays (tokens, logprobs, loss_mask) (got {len(arrays)})")
    tokens, logprobs, mask = arrays
    if tokens.ndim != 1 or logprobs.ndim != 1 or mask.ndim != 1:
        raise _fail("arrays must be 1-D")
    n_tok = n_act = 0
    rows_ok = True
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != _ROW:
            raise _fail(f"steps[{i}]: expected {_ROW} values")
        p, a, o = row[7], row[8], row[9]
        if not (type(p) is int and type(a) is int and type(o) is int and p >= 0 and a >= 0 and o >= 0):
            raise _fail(f"steps[{i}]: lengths must be ints >= 0 (got {row[7:]})")
        n_tok += p + a + o
        n_act += a
        rows_ok = rows_ok and _row_ok(row)
    if len(tokens) != n_tok or len(logprobs) != n_act or len(mask) != n_act:
        raise _fail(f"steps announce {n_tok} tokens and {n_act} action values; arrays hold "
                    f"{len(tokens)}, {len(logprobs)} logprobs, {len(mask)} mask values")
    fields = {k: header[k] for k in _SCALAR_FIELDS if k in header}
    if rows_ok and (arrays_checked or _arrays_ok(tokens, logprobs, mask)) and _scalars_ok(fields):
        steps = []
        t = a0 = 0
        if mask.dtype != np.uint8:
            mask = mask.view(np.uint8)
        for pv, reward, status, code, dur, gen_s, env_s, p, a, o in rows:
            # Most steps ran no sandbox: share the one immutable outcome that says so.
            sandbox = (NO_SANDBOX if status == "none" and code == 0 and dur == 0
                       else _sandbox_trusted(status, code, float(dur)))
            steps.append(Step._trusted(
                pv, tokens[t:t + p], tokens[t + p:t + p + a], logprobs[a0:a0 + a], mask[a0:a0 + a],
                tokens[t + p + a:t + p + a + o], float(reward), sandbox, float(gen_s), float(env_s)))
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


_GOOD_NAMES: set[str] = set()  # strings that passed the name checks


def _scalars_ok(f: dict) -> bool:
    """The header's scalar fields pass every Trajectory check (fast path, no messages)."""
    if len(f) != len(_SCALAR_FIELDS):
        return False
    for v in (f["run"], f["generator"], f["domain"], f["task"]):
        if type(v) is not str:
            return False
        if v not in _GOOD_NAMES:
            if not (0 < len(v) <= MAX_NAME_LEN and not _CONTROL.search(v)):
                return False
            if len(_GOOD_NAMES) < 65536:  # names recur (one run, a few generators and domains)
                _GOOD_NAMES.add(v)
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
