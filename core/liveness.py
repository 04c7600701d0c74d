"""Liveness: the heartbeats components write, and the supervisor's word on which peers are coming back.

    install(run_dir, "gen-0", job_id)       # start_component: heartbeats/gen-0.json, phase "starting"
    beat()                                   # each turn of the component's main loop (main thread only)

    beats = read_heartbeats(run_dir, "learner")              # learner-0.json, learner-1.json, ...
    write_supervision(run_dir, {"coordinator": "starting"})  # the supervisor, every poll
    peer_starting(run_dir, "coordinator")                    # a client: wait for it instead of giving up

A heartbeat is the component's *main loop* turning, not a thread ticking by itself: a learner
rank blocked in a collective whose peer died, a process under SIGSTOP, a deadlock on a stalled
filesystem all stop beating, which squeue cannot see. `beat()` is cheap (it writes at most every
HEARTBEAT_S) and ignores other threads, so a worker thread cannot vouch for a stuck main loop.
The first record (`install`) has phase "starting"; the first `beat()` flips it to "running":
the supervisor gives a starting component `supervise.startup_s` (loading a 70B model, joining
ranks) and a running one `supervise.hang_s` between beats (jobs/restarts.py).

The supervisor writes `supervision.json`: each component's state, "starting" from the moment
it died or was submitted until its main loop runs, then "running". A client that cannot reach
a peer keeps waiting while that file says the peer is starting and the file is fresh (the
supervisor itself is alive): a coordinator waiting in the Slurm queue for an hour costs its
generators nothing. When the file is stale or says "running", clients give up as before.
Heartbeats need no durability (a lost one is rewritten within seconds), so they are renamed
into place without fsync: a slow filesystem must not slow every main loop.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from hpcrl.core.files import atomic_write_json

__all__ = [
    "HEARTBEAT_S",
    "SUPERVISION_NAME",
    "install",
    "beat",
    "current_job_id",
    "read_heartbeats",
    "write_supervision",
    "read_supervision",
    "peer_starting",
]

HEARTBEAT_S = 5.0  # a running component rewrites its heartbeat this often
SUPERVISION_NAME = "supervision.json"
SUPERVISION_FRESH_S = 60.0  # a supervision.json older than this is a dead supervisor's: trust it no more
SUPERVISION_EVERY_S = 10.0  # the supervisor rewrites it at least this often, changed or not


class _Heart:
    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        self.last = 0.0

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.record))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full or stalled filesystem: the next beat tries again; the supervisor judges the gap


_heart: _Heart | None = None


def current_job_id() -> str:
    """This process's job id as the supervisor records it: an array task is `<array>_<task>`."""
    env = os.environ
    if env.get("SLURM_ARRAY_TASK_ID") and env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID") or ""


def install(run_dir: str | os.PathLike, name: str, job_id: str | None = None) -> None:
    """Start this process's heartbeat (phase "starting"); `beat()` is a no-op until this is called."""
    global _heart
    folder = Path(run_dir) / "heartbeats"
    folder.mkdir(exist_ok=True)
    now = time.time()
    record = {
        "name": name,
        "job_id": current_job_id() if job_id is None else job_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": now,
        "time": now,
        "phase": "starting",
        "beats": 0,
    }
    _heart = _Heart(folder / f"{name}.json", record)
    _heart.write()


def beat() -> None:
    """The main loop turned: record it (at most every HEARTBEAT_S; the first beat at once)."""
    heart = _heart
    if heart is None or threading.current_thread() is not threading.main_thread():
        return
    now = time.monotonic()
    if heart.record["phase"] == "running" and now - heart.last < HEARTBEAT_S:
        return
    heart.last = now
    heart.record.update(time=time.time(), phase="running", beats=heart.record["beats"] + 1)
    heart.write()


def read_heartbeats(run_dir: str | os.PathLike, component: str) -> list[dict]:
    """Heartbeats of a component's processes: `<component>.json` or `<component>-<k>.json` (ranks)."""
    out = []
    folder = Path(run_dir) / "heartbeats"
    for path in sorted(folder.glob(f"{component}*.json")):
        stem = path.name[: -len(".json")]
        if stem != component and not (stem.startswith(component + "-") and "-" not in stem[len(component) + 1 :]):
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or damaged: the next write mends it
        if isinstance(rec, dict) and isinstance(rec.get("time"), (int, float)):
            out.append(rec)
    return out


def write_supervision(run_dir: str | os.PathLike, states: dict[str, str], supervisor: str = "") -> None:
    """The supervisor's view: {component: "starting" | "running" | "ended"}, stamped now."""
    atomic_write_json(
        Path(run_dir) / SUPERVISION_NAME,
        {"updated": time.time(), "supervisor": supervisor, "components": dict(states)},
    )


def read_supervision(run_dir: str | os.PathLike) -> dict | None:
    try:
        data = json.loads((Path(run_dir) / SUPERVISION_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("components"), dict) else None


def peer_starting(run_dir: str | os.PathLike | None, component: str) -> bool:
    """True while a live supervisor says `component` is on its way (pending, restarting, loading)."""
    if run_dir is None:
        return False
    data = read_supervision(run_dir)
    if data is None or not isinstance(data.get("updated"), (int, float)):
        return False
    if time.time() - data["updated"] > SUPERVISION_FRESH_S:
        return False
    return data["components"].get(component) == "starting"
