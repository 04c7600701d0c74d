"""What a real run measured, as episodes the simulator can replay (`hpcrl sim RUN_DIR`).

    episodes, unreadable = read_measured(run_dir, read_store)

`read_store(path, on_error)` -> (the store's folder, an iterable of column batches) is the
trajectory store's reader, handed in by the caller (slurm/ does not import rl/; `hpcrl sim`
passes rl/store's). Each batch has the store's trajectory table (`domain`, `step_start`,
`n_steps`) and step table (`generate_s`, `env_s`, `sandbox_s`). A turn's GPU time is its
measured generate_s; its sandbox time is the environment step's wall time (env_s, which holds
the sandbox run; sandbox_s where that is larger).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from hpcrl.slurm.sim.trace import MeasuredEpisode

__all__ = ["read_measured", "measured_episodes", "SimInputError"]


class SimInputError(ValueError):
    """A run directory, file or option `hpcrl sim` cannot use (one line, exit 2)."""


def measured_episodes(batches: Iterable) -> list[MeasuredEpisode]:
    """One MeasuredEpisode per stored trajectory with at least one step (pure)."""
    out: list[MeasuredEpisode] = []
    for cols in batches:
        t, steps = cols.traj, cols.steps
        gen = steps["generate_s"].tolist()
        env = np.maximum(steps["env_s"], steps["sandbox_s"]).tolist()
        for domain, first, n in zip(t["domain"].tolist(), t["step_start"].tolist(), t["n_steps"].tolist()):
            if n > 0:
                name = domain.decode() if isinstance(domain, bytes) else str(domain)
                out.append(MeasuredEpisode(name, tuple(gen[first : first + n]), tuple(env[first : first + n])))
    return out


def read_measured(path: str | Path, read_store: Callable) -> tuple[list[MeasuredEpisode], list[str]]:
    """The measured episodes of a run directory or trajectory store, and the segments that could
    not be read. SimInputError when there is nothing to replay."""
    bad: list[str] = []
    store, batches = read_store(path, lambda st, nm, why: bad.append(f"{st.name}/{nm}: {why}"))
    out = measured_episodes(batches)
    if not out:
        why = f"; {len(bad)} unreadable segment(s), first: {bad[0]}" if bad else ""
        raise SimInputError(
            f"{path}: no trajectories to replay (looked for trajectory shards in {store}){why}; "
            "pass a run directory that stored trajectories, or a trace file"
        )
    if not any(sum(m.gen_s) > 0 for m in out):
        raise SimInputError(f"{path}: {len(out)} trajectories, but none recorded any generate_s: nothing to replay")
    return out, bad
