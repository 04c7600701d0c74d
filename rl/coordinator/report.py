"""What the coordinator tells of the run: `status.json`, the metrics endpoint's view, the timeline.

    read_status(run_dir)          # status.json as a dict, or None while there is none
    coord.write_status()          # rewritten every coordinator.status_every_s, final on exit
    coord.metrics()               # what the coordinator's Prometheus endpoint shows

`RunReport` is the part of the Coordinator that turns its counts, leases and the generators'
and learner's reports into these records; the coordinator's lock guards what it reads.
`metrics.jsonl` (METRICS_NAME) has one line per learner step, written as the learner reports.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hpcrl.core.files import atomic_write_text

__all__ = ["METRICS_NAME", "STATUS_NAME", "RunReport", "atomic_json", "finite_json", "read_status"]

STATUS_NAME = "status.json"
METRICS_NAME = "metrics.jsonl"


def atomic_json(path: Path, data: Any, keep_previous: bool = False) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, default=str), keep_previous=keep_previous)


def read_status(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


class RunReport:
    """The Coordinator's reporting half (a mixin: it reads the Coordinator's own fields)."""

    def throughput(self) -> dict:
        now = time.monotonic()
        window = self.cfg.status_window_s
        while self._done_times and now - self._done_times[0] > window:
            self._done_times.popleft()
        elapsed = min(window, time.time() - self.started) or 1.0
        gens = [g.get("stats", {}) for g in self.generators.values() if not g.get("lost")]
        busy_gen = sum(s.get("busy_fraction", 0.0) for s in gens) / len(gens) if gens else 0.0
        sandbox_slots = max(1, sum(int(s.get("sandbox_slots", 0)) for s in gens)) if gens else 1
        sandbox_busy = sum(s.get("sandbox_s_rate", 0.0) for s in gens) / sandbox_slots
        return {
            "traj_per_s": len(self._done_times) / elapsed,
            "busy": {
                "generator": busy_gen,
                "learner": float(self.learner.get("busy_fraction", 0.0)),
                "sandbox": min(1.0, sandbox_busy),
            },
        }

    def write_status(self, final: bool = False) -> None:
        """`final`: the coordinator is exiting: the run "finished" (the learner reached max_steps)
        or was "stopped" before (cancel, signal); this stays in status.json."""
        self._last_status = time.monotonic()
        if final:
            state = "finished" if int(self.learner.get("step", 0)) >= self.max_steps else "stopped"
        else:
            state = "stopping" if self.stopping else "running"
        status = {
            "state": state,
            "started": self.started,
            "updated": time.time(),
            "learner": {
                k: v for k, v in self.learner.items() if k not in ("reward_by_domain", "reward_by_prompt", "domains")
            },
            "reward_by_domain": self.learner.get("reward_by_domain", {}),
            "domains": self.domains(),
            "generators": self.generators,
            "leases": len(self.leases),
            "queued": len(self.queue),
            "groups_issued": self.groups_issued,
            "counts": dict(self.counts),
            "completed_by_domain": dict(self.done_by_domain),
            **self.throughput(),
        }
        atomic_json(self.run_dir / STATUS_NAME, status)

    def metrics(self) -> dict:
        """What the coordinator's Prometheus endpoint shows (core/metrics.py): the run as it sees it."""
        with self._lock:
            t = self.throughput()
            learner = dict(self.learner)
            gens = {n: g.get("stats", {}) for n, g in self.generators.items() if not g.get("lost")}
            out = {
                "episodes_total:event": dict(self.counts),
                "completed_total:domain": dict(self.done_by_domain),
                "leases": len(self.leases),
                "queued_episodes": len(self.queue),
                "groups_issued_total": self.groups_issued,
                "trajectories_per_s": t["traj_per_s"],
                "busy_fraction:role": dict(t["busy"]),
                "generators": len(gens),
                "generator_version:generator": {n: s.get("version", 0) for n, s in gens.items()},
            }
        for key, name in (("step", "learner_step"), ("version", "policy_version"), ("reward", "reward")):
            if isinstance(learner.get(key), (int, float)):
                out[name] = learner[key]
        for key in ("staleness_max", "wait_s", "step_s", "dropped_groups", "trained_groups"):
            if isinstance(learner.get(key), (int, float)):
                out["learner_" + key] = learner[key]
        if isinstance(learner.get("version"), int) and gens:
            out["generator_staleness_max"] = max(learner["version"] - int(s.get("version", 0)) for s in gens.values())
        if isinstance(learner.get("reward_by_domain"), dict):
            out["reward:domain"] = learner["reward_by_domain"]
        with self._lock:
            domains = self.domains()
        for key in ("issued", "trained", "dropped"):
            out[f"domain_{key}_total:domain"] = {d: r[key] for d, r in domains.items()}
        return out

    def _sample_timeline(self) -> None:
        self._last_timeline = time.monotonic()
        counters = ("wall_s", "busy_s", "weights_s", "source_s", "env_wait_s", "idle_s")  # GeneratorStats, cumulative
        gens = {
            n: {k: float(g["stats"][k]) for k in counters if isinstance(g.get("stats", {}).get(k), (int, float))}
            | {"seen": g["last_seen"], "life": g.get("life")}  # counters as of its last sync, by which process
            for n, g in self.generators.items()
            if not g.get("lost")
        }
        if gens:
            self.timeline.write({"t": time.time(), "gens": gens})
