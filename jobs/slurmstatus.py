"""One snapshot of a run for `hpcrl status`: its components' Slurm jobs joined with status.json.

    snap = snapshot(run_dir)          # {"run", "state", "step", ..., "warning", "components": [{"name", ...}]}
    print(snapshot_text(snap))
    runs = recent_runs(run_root)      # [{"run", "state", "step", "updated"}], newest first

Slurm is asked twice at most, whatever the number of components: one `squeue` for every job
id of the run, then one `sacct` for the ids that already left the queue. Runs started with
`hpcrl run` (no jobs.json) list their components from the procs files instead.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpcrl.core.metrics import read_endpoints
from hpcrl.jobs.report import domain_lines, learning_signal, next_steps
from hpcrl.rl.coordinator.report import read_status
from hpcrl.slurm import parse, queries
from hpcrl.slurm.command import SlurmCommandError, run_slurm

# hpcrl imports inside functions here would load msgpack, numpy, psutil, submitit, yaml, zmq for every
# importer of this module (start-up speed).

__all__ = ["snapshot", "snapshot_text", "recent_runs"]

_SQUEUE_FIELDS = ("job_id", "state", "nodes", "elapsed", "time_left")


def _squeue(job_ids: list[str]) -> dict[str, dict]:

    if not job_ids:
        return {}
    out = run_slurm(["squeue", "-h", "-r", "-o", "%i|%T|%N|%M|%L", "-j", ",".join(job_ids)], check=False)
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:  # every id has left the queue
            return {}
        raise SlurmCommandError(list(out.argv), out.returncode, out.stderr)
    return {r["job_id"]: r for r in parse.parse_delimited(out.stdout, _SQUEUE_FIELDS)}


def _heartbeats(name: str, status: dict, now: float) -> tuple[float | None, dict]:
    """(seconds since the component last reported, its throughput figures) from status.json."""
    if name == "coordinator":
        return now - float(status.get("updated", now)), {"traj_per_s": status.get("traj_per_s", 0.0)}
    if name == "learner":
        ln = status.get("learner") or {}
        at = ln.get("reported_at")
        step_s = ln.get("step_s")
        return (now - at if at else None), ({"steps_per_s": 1.0 / step_s} if step_s else {})
    g = (status.get("generators") or {}).get(name)
    if g:
        st = g.get("stats", {})
        rate = st.get("trajectories", 0) / st["wall_s"] if st.get("wall_s") else 0.0
        return now - g.get("last_seen", now), {
            "traj_per_s": rate,
            "busy_fraction": st.get("busy_fraction", 0.0),
            "trajectories": st.get("trajectories", 0),
        }
    return None, {}


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _rollout_row(run_dir: Path, name: str, planned: dict, now: float) -> dict:
    """A rollout job's role, GPUs and window left: the deadline it found at start (rollout/<name>.json),
    else the window end it was planned for."""
    own = _json(run_dir / "rollout" / f"{name}.json")
    end = own.get("deadline") or planned.get("window_end")
    if not planned:
        planned = _json(run_dir / "rollout.json").get("jobs", {}).get(name, {})
        end = end or planned.get("window_end")
    return {
        "role": "rollout",
        "gpus": planned.get("gpus"),
        "window_left_s": None if end is None else max(end - now, 0.0),
        "preempted": planned.get("preempted"),  # Slurm's PreemptTime when Slurm preempted it (a scavenger partition)
    }


SBATCH_FILE = "sbatch.json"  # written by `hpcrl sbatch` into the run directory: where its submit.sh is


def prepared(run_dir: Path, jobs: dict | None) -> str | None:
    """The submit.sh `hpcrl sbatch` wrote for this run while none of its jobs is recorded, else None."""
    if jobs:
        return None
    submit = _json(run_dir / SBATCH_FILE).get("submit")
    return str(submit) if submit else None


def _executor_state(run_dir: Path, status: dict, jobs: dict | None) -> tuple[str, str, str | None]:
    """How the run runs, its state (Slurm's word for its jobs, else the coordinator's, else
    'not submitted' for a run `hpcrl sbatch` prepared) and that run's submit.sh."""
    submit = prepared(run_dir, jobs)
    if submit and not status:
        return "slurm", "not submitted", submit
    return ("slurm" if jobs else "local"), (jobs or {}).get("state") or status.get("state") or "unknown", submit


def snapshot(run_dir: str | os.PathLike) -> dict:
    from hpcrl.jobs.launch import read_jobs

    run_dir = Path(run_dir)
    now = time.time()
    status = read_status(run_dir) or {}
    jobs = read_jobs(run_dir)
    ln = status.get("learner") or {}
    executor, state, submit = _executor_state(run_dir, status, jobs)
    snap = {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "executor": executor,
        "state": state,
        "message": (jobs or {}).get("message", "") or (f"prepared by hpcrl sbatch: bash {submit}" if submit else ""),
        "coordinator_state": status.get("state"),
        "status_age_s": now - float(status["updated"]) if "updated" in status else None,
        "step": ln.get("step"),
        "version": ln.get("version"),
        "reward": ln.get("reward"),
        "trajectories": (status.get("counts") or {}).get("completed", 0),
        "traj_per_s": status.get("traj_per_s", 0.0),
        "reward_by_domain": status.get("reward_by_domain") or {},
        # per domain: issued, trained, dropped_stale, trained_turns_mean, started_turns_mean, ...
        "domains": status.get("domains") or {},
        "components": [],
    }
    sig = learning_signal(run_dir)  # skipped steps and a missing learning signal, from metrics.jsonl
    snap.update(skipped_steps=sig.skipped, no_signal_steps=sig.streak, warning=sig.warning)
    urls = read_endpoints(run_dir)
    if jobs is None:
        from hpcrl.jobs.localrun import pids

        for f in sorted((run_dir / "procs").glob("*.json")):
            name = f.stem
            beat, rates = _heartbeats(
                name.removesuffix("-0") if name.startswith(("learner", "store")) else name, status, now
            )
            row = {
                "name": name,
                "job_id": None,
                "state": "RUNNING" if pids(run_dir, name) else "GONE",
                "heartbeat_age_s": beat,
                "metrics_url": urls.get(name),
                **rates,
            }
            if name.startswith("rollout-"):
                row.update(_rollout_row(run_dir, name, {}, now), pid=_json(f).get("pid"))
                row.setdefault("trajectories", 0)
            snap["components"].append(row)
        return snap
    entries = [(name, c) for name, c in jobs["components"].items()]
    if jobs.get("supervisor"):
        entries.append(("supervisor", {**jobs["supervisor"], "restarts": 0}))
    planned = _json(run_dir / "rollout.json").get("jobs", {})  # backfill rollout jobs (jobs/rollout_plan.py)
    entries += [(name, {**r, "restarts": 0}) for name, r in planned.items()]
    ids = [c["job_id"] for _, c in entries]
    queued = _squeue(ids)
    gone = [i for i in ids if i not in queued]
    records = {}
    if gone:
        records = queries.job_records(gone)
    for name, c in entries:
        jid = c["job_id"]
        row = {"name": name, "job_id": jid, "history": c.get("history", [jid]), "restarts": c.get("restarts", 0)}
        if jid in queued:
            q = queued[jid]
            row.update(state=q["state"], node=q["nodes"] or None, elapsed=q["elapsed"], time_left=q["time_left"])
        elif jid in records:
            r = records[jid]
            row.update(
                state=r.state,
                node=",".join(r.nodes) or None,
                elapsed=None if r.elapsed_s is None else _hms(r.elapsed_s),
                time_left=None,
            )
        else:
            row.update(state="UNKNOWN", node=None, elapsed=None, time_left=None)
        beat, rates = _heartbeats(name, status, now)
        # A component's endpoint is its rank 0's (learner-0, store-0) where its processes are numbered.
        row.update(heartbeat_age_s=beat, metrics_url=urls.get(name) or urls.get(f"{name}-0"), **rates)
        if name in planned:
            row.update(_rollout_row(run_dir, name, planned[name], now))
            row.setdefault("trajectories", 0)
            if row["state"] not in ("PENDING", "CONFIGURING", "RUNNING"):
                row["window_left_s"] = 0.0  # it is over (ended, cancelled), whatever was planned
        snap["components"].append(row)
    if snap["state"] in ("submitted", "running") and not queued:
        snap["state"] = "ended"  # no job of the run is left (a hand-submitted or hetjob run has no supervisor)
    return snap


def _hms(s: int) -> str:
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _num(v, fmt: str, missing: str = "-") -> str:
    return missing if v is None else format(v, fmt)


def snapshot_text(snap: dict) -> str:
    lines = [
        f"run        {snap['run']}  ({snap['executor']}, {snap['state']}"
        + (f": {snap['message']}" if snap.get("message") else "")
        + ")",
        f"learner    step {_num(snap['step'], 'd')}  policy version {_num(snap['version'], 'd')}  "
        f"reward {_num(snap['reward'], '.3f')}  trajectories {snap['trajectories']}  "
        f"{snap['traj_per_s']:.1f} traj/s  (status {_num(snap['status_age_s'], '.0f', '?')} s old)",
    ]
    if snap.get("skipped_steps"):
        lines.append(f"skipped    {snap['skipped_steps']} steps (every advantage 0: no update)")
    if snap.get("warning"):
        lines.append(f"WARNING    {snap['warning']}")
    for d, r in sorted(snap["reward_by_domain"].items()):
        lines.append(f"  reward {d:<28} {r:.3f}")
    lines += domain_lines(snap.get("domains") or {})
    lines.append(
        f"{'component':<12} {'job':<10} {'state':<11} {'node':<6} {'elapsed':>9} {'left':>9} "
        f"{'restarts':>8} {'heartbeat':>9}  throughput"
    )
    for c in snap["components"]:
        rate = ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in c.items()
            if k in ("traj_per_s", "steps_per_s", "busy_fraction")
        )
        lines.append(
            f"{c['name']:<12} {c.get('job_id') or '-'!s:<10} {c['state']:<11} {c.get('node') or '-'!s:<6} "
            f"{c.get('elapsed') or '-'!s:>9} {c.get('time_left') or '-'!s:>9} {c.get('restarts', 0):>8} "
            f"{_num(c.get('heartbeat_age_s'), '.0f'):>7} s  {rate}"
            + (
                f"  rollout: {c.get('gpus') or 0} GPU, window left {_num(c.get('window_left_s'), '.0f')} s, "
                f"{c.get('trajectories', 0)} trajectories"
                + (f", preempted by Slurm at {c['preempted']}" if c.get("preempted") else "")
                if c.get("role") == "rollout"
                else ""
            )
        )
    if snap["state"] in ("failed", "cancelled"):
        first = (snap.get("message") or "").split(" ", 1)[0]  # "gen-0 failed twice at start: ..."
        lines.append(next_steps(snap["run_dir"], first if first in {c["name"] for c in snap["components"]} else None))
    return "\n".join(lines)


def recent_runs(run_root: str | os.PathLike, limit: int = 20) -> list[dict]:
    """Runs under run_root, newest first, from their files only (no Slurm query)."""
    from hpcrl.jobs.launch import read_jobs

    root = Path(run_root)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if (p / "config.resolved.yaml").exists()]
    runs.sort(key=lambda p: (p / "config.resolved.yaml").stat().st_mtime, reverse=True)
    out = []
    for p in runs[:limit]:
        try:
            status = json.loads((p / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        try:
            jobs = read_jobs(p)
        except (OSError, ValueError):
            jobs = None
        executor, state, _ = _executor_state(p, status, jobs)
        out.append(
            {
                "run": p.name,
                "run_dir": str(p),
                "executor": executor,
                "state": state,
                "step": (status.get("learner") or {}).get("step"),
                "updated": status.get("updated"),
            }
        )
    return out
