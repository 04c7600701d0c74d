"""The record tables' layout: the dtypes of the trajectory and step tables of this schema
version, the order of a segment's arrays, and the upgrade of an older version's tables.

    traj_dtype(widths)          # the trajectory table, string fields `widths` bytes wide
    STEP_DTYPE                  # one row per step: offsets into the flat arrays, outcome, timings
    upgrade_tables(traj, steps) # older tables (read from old files) in these dtypes, new fields at defaults

`columns` builds and checks batches in these dtypes; `segment_read` upgrades what it reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcrl.rl.record.checks import MAX_COMMAND_BYTES, MAX_FAULT_BYTES

__all__ = ["ARRAY_NAMES", "STEP_DTYPE", "STRING_FIELDS", "TRAJ_NUMERIC", "traj_dtype", "upgrade_tables"]

STRING_FIELDS = ("id", "run", "domain", "task", "generator")

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
        # Schema v2 (v1 tables are upgraded on read, these at their defaults):
        ("sandbox_command", f"S{MAX_COMMAND_BYTES}"),  # UTF-8, NUL-padded
        ("tests_passed", "<i4"),
        ("tests_total", "<i4"),
        ("resumes", "u1"),
        # Schema v3: the sampling parameters the action was drawn with (older tables: 1, 1, 0).
        ("temperature", "<f8"),
        ("top_p", "<f8"),
        ("top_k", "<i4"),
    ]
)
# What an upgraded table's new step fields hold where 0 is not the default.
_STEP_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}

TRAJ_NUMERIC = [
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
    ("fault", f"S{MAX_FAULT_BYTES}"),  # schema v2; UTF-8, NUL-padded
]

# Dataset names in the order the checksum covers them.
ARRAY_NAMES = ("traj", "steps", "tokens", "logprobs", "loss_mask")


def traj_dtype(widths: Sequence[int]) -> np.dtype:
    """The trajectory table's dtype, with string fields `widths` bytes wide."""
    return np.dtype([(n, f"S{max(1, w)}") for n, w in zip(STRING_FIELDS, widths)] + TRAJ_NUMERIC)


def upgrade_tables(traj: np.ndarray, steps: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Tables of an older schema (v1, v2 files) in this one's dtypes: fields they lack take their
    defaults (0, "", and temperature 1, top_p 1: what their generators sampled log-probabilities
    under). Tables already current are returned as they are, uncopied."""
    if steps is not None and steps.dtype != STEP_DTYPE and steps.dtype.names:
        new = np.zeros(len(steps), STEP_DTYPE)
        for name, value in _STEP_DEFAULTS.items():
            new[name] = value
        for name in steps.dtype.names:
            if name in STEP_DTYPE.names:
                new[name] = steps[name]
        steps = new
    names = traj.dtype.names or ()
    if len(names) > 1 and "fault" not in names:  # (the empty table of a reader without rows has only id)
        dt = np.dtype([(n, traj.dtype[n]) for n in names] + [("fault", f"S{MAX_FAULT_BYTES}")])
        new = np.zeros(len(traj), dt)
        for name in names:
            new[name] = traj[name]
        traj = new
    return traj, steps
