"""Backfill rollout processes in a real `hpcrl run` (executor local, scheduler.local_windows):
three rollout generators start in their windows once the learner published weights; one ends by
itself before its window does, one is stopped with SIGTERM (as scancel would) and hands its
episodes back, which the coordinator re-issues at once, one is killed with -9 and its leases
expire. Their trajectories are trained, none twice, and every stored trajectory is accounted for
(trained, dropped, buffered or unread); `hpcrl status --json` lists them with role rollout."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest

from hpcrl.jobs.rollout_plan import ROLLOUT_NAME
from hpcrl.rl.coordinator.report import read_status

from audit import account
from conftest import RUN_GUARD_S, wait_for
from test_run import finish, hpcrl, no_processes_left

LEASE_S = 20.0
UID_BASE = 61640
HERE = Path(__file__).resolve().parent


def _gated_pids(gate: Path) -> set[int]:
    """Processes that hold an episode at the closed gate (gated_quiz.py's log)."""
    try:
        return {int(x) for x in (gate.parent / (gate.name + ".log")).read_text().split()}
    except OSError:
        return set()


def _rollouts(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / ROLLOUT_NAME).read_text())["jobs"]
    except (OSError, ValueError, KeyError):
        return {}


def _produced(run_dir: Path, name: str) -> int:
    g = ((read_status(run_dir) or {}).get("generators") or {}).get(name) or {}
    return int(g.get("stats", {}).get("trajectories", 0))


def _pid(run_dir: Path, name: str) -> int:
    return int(json.loads((run_dir / "rollout" / f"{name}.json").read_text())["pid"])


def _result(run_dir: Path, job_id: str):
    return pickle.loads((run_dir / "submitit" / f"{job_id}_0_result.pkl").read_bytes())


@pytest.mark.slow
def test_rollout_processes_fill_local_windows_and_lose_nothing(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    gate.touch()  # open: episodes run as fast as arith's
    monkeypatch.setenv("HPCRL_GATE", str(gate))  # the generators inherit it
    shutil.copy(HERE / "gated_quiz.py", tmp_path / "gated_quiz.py")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("domains:\n  - name: gated-quiz\n    module: gated_quiz:make_domain\n")
    proc = hpcrl(
        "run",
        str(cfg),
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=100000",
        # One fixed generator with few episodes in flight is the bottleneck, so rollout
        # generators get work (the planner starts them only while flow control has room).
        "generators.episodes_in_flight=16",
        f"coordinator.lease_s={LEASE_S}",
        f"sandbox.uid_base={UID_BASE}",  # the domain steps on the pool: a sandbox server starts
        "scheduler.max_rollout_jobs=3",
        "scheduler.max_rollout_gpus=3",
        "scheduler.plan_interval_s=1",
        "scheduler.prior_s=1",
        "scheduler.rollout_drain_s=3",
        # Window 0 must outlast the learner's first published weights and a rollout start-up on a
        # slow machine; window 1 outlasts the whole test.
        "scheduler.local_windows=[{start_s: 0, length_s: 180, gpus: 1}, {start_s: 0, length_s: 1800, gpus: 2}]",
        "--run-id",
        "bf",
    )
    run_dir = tmp_path / "bf"

    def alive() -> None:
        assert proc.poll() is None, proc.stdout.read()[-3000:]

    def producing() -> bool:
        alive()
        return len(_rollouts(run_dir)) == 3 and all(_produced(run_dir, f"rollout-{i}") > 0 for i in range(3))

    wait_for(producing, 600, what="three rollout generators producing trajectories")
    jobs = _rollouts(run_dir)
    assert [j["window"] for j in jobs.values()] == [0, 1, 1]  # window 1 holds 2 GPUs: two processes

    st = hpcrl("status", str(run_dir), "--json")
    snap = json.loads(finish(st, 300))
    rows = {c["name"]: c for c in snap["components"] if c.get("role") == "rollout"}
    assert set(rows) == {"rollout-0", "rollout-1", "rollout-2"}, snap["components"]
    assert all(r["gpus"] == 1 and r["pid"] and r["window_left_s"] > 0 for r in rows.values()), rows
    assert any(r["trajectories"] > 0 for r in rows.values()), rows

    # rollout-0 ends with its window, before the gate below can hold its episodes (a closed gate
    # would keep its process from exiting until it opens again).
    wait_for(
        lambda: alive() or _rollouts(run_dir)["rollout-0"]["state"] == "ended", 600, what="rollout-0's window to end"
    )

    # Close the gate: every episode in flight stays in flight. Once each victim holds one (its
    # own line in the gate's log), SIGTERM one (as scancel or preemption: it must hand its
    # episodes back) and kill -9 the other (nothing handed back: its leases must expire).
    gate.unlink()
    victims = {"rollout-1": _pid(run_dir, "rollout-1"), "rollout-2": _pid(run_dir, "rollout-2")}
    wait_for(
        lambda: alive() or set(victims.values()) <= _gated_pids(gate),
        300,
        what="both victims holding an episode at the closed gate",
    )
    os.kill(victims["rollout-1"], signal.SIGTERM)
    os.kill(victims["rollout-2"], signal.SIGKILL)

    def handed_back_and_expired() -> bool:
        alive()
        released = [ep for e in _events(run_dir) if e.get("g") == "rollout-1" for ep in e.get("released", [])]
        return bool(released) and bool(_expired(run_dir).get("rollout-2"))

    wait_for(handed_back_and_expired, 300, what="rollout-1's episodes handed back, rollout-2's expired")
    gate.touch()

    def all_ended_and_settled() -> bool:
        alive()
        return all(j["state"] == "ended" for j in _rollouts(run_dir).values()) and not any(
            _held(run_dir, f"rollout-{i}") for i in range(3)
        )

    wait_for(all_ended_and_settled, 300, what="every rollout process ended and every lease it held settled")
    expired = _expired(run_dir)
    step = (read_status(run_dir) or {})["learner"]["step"]
    wait_for(lambda: alive() or read_status(run_dir)["learner"]["step"] >= step + 5, 300, what="5 more steps")
    proc.send_signal(signal.SIGINT)
    out = finish(proc, RUN_GUARD_S)
    assert "Traceback" not in out, out[-3000:]

    jobs = _rollouts(run_dir)
    # rollout-0 stopped leasing and ended itself for its window (whether its exit also beat the
    # window's end, rollout_drain_s later, is up to the machine's speed); rollout-1 by its signal.
    assert _result(run_dir, jobs["rollout-0"]["job_id"])[1]["stopped_by"] == "window"
    assert _result(run_dir, jobs["rollout-1"]["job_id"])[1]["stopped_by"] == "signal"

    # Handed-back episodes are issued again as they are, without waiting out a lease: none of
    # them expires, each is leased again (the gate held everyone in flight until they were back).
    events = _events(run_dir)
    released = {ep: e["t"] for e in events if e.get("g") == "rollout-1" for ep in e.get("released", [])}
    assert released and _held(run_dir, "rollout-1") == 0
    assert "rollout-1" not in expired and "rollout-0" not in expired
    again = {}
    for e in events:
        for ep, _attempt in e.get("leased", []):
            if ep in released and e["t"] >= released[ep] and ep not in again:
                again[ep] = e["t"] - released[ep]
    assert set(again) == set(released), set(released) - set(again)
    # What the killed one held expired after lease_s and went to another generator.
    assert set(expired) <= {"rollout-2"}, expired
    assert expired.get("rollout-2"), expired
    for ep in expired["rollout-2"]:
        assert any(ep in {x for x, _ in e.get("leased", [])} for e in events if e.get("g") != "rollout-2"), ep

    trained, _, stored = account(run_dir)
    by_rollout = {g: sum(f"/{g}/" in i for i in trained) for g in ("rollout-0", "rollout-1", "rollout-2")}
    assert all(by_rollout.values()), by_rollout
    print(
        f"rollout figures: trained from rollout jobs {by_rollout}, handed back {len(released)} "
        f"(re-leased within {max(again.values(), default=0.0):.2f} s), "
        f"expired after kill -9 {len(expired['rollout-2'])}, "
        f"trained {len(trained)} (unique), stored {len(stored)}"
    )
    no_processes_left(run_dir)
    assert not any(_pid_alive(run_dir, f"rollout-{i}") for i in range(3))


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "coordinator" / "leases.jsonl").read_text().splitlines()]


def _held(run_dir: Path, name: str) -> int:
    """Episodes the coordinator has leased to `name` and not settled (leases.jsonl): not done,
    handed back, failed or expired."""
    held: set[int] = set()
    for e in _events(run_dir):
        held -= set(e.get("expired", {}).get(name, []))
        if e.get("g") == name:
            held |= {ep for ep, _ in e.get("leased", [])}
            held -= set(e.get("done", [])) | set(e.get("released", [])) | {f[0] for f in e.get("failed", [])}
    return len(held)


def _expired(run_dir: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in _events(run_dir):
        for g, eps in e.get("expired", {}).items():
            out.setdefault(g, []).extend(eps)
    return out


def _pid_alive(run_dir: Path, name: str) -> bool:
    from hpcrl.jobs.rollout_plan import pids

    return bool(pids(run_dir, name))


_LOADING_DOMAIN = """
import os, time
from hpcrl.rl.domains.base import PromptDomain
open(os.environ["HPCRL_TEST_LOADING"], "w").close()  # the rollout job is loading its domains
while True:  # and stays there: a preemption has to find it loading
    time.sleep(0.05)
"""

_ROLLOUT_CHILD = """
import sys, time
from hpcrl.core.config import DomainConfig, GeneratorConfig, PolicyConfig, SchedulerConfig
from hpcrl.jobs.rollout import RolloutComponent
domains = (DomainConfig(name="loading", module="loading_domain:make_domain"),)
RolloutComponent(sys.argv[1], "rollout-0", GeneratorConfig(), PolicyConfig(), domains, (), 0, (sys.argv[2],),
                 deadline=time.time() + 600, sched=SchedulerConfig())()
"""


def test_a_rollout_job_stopped_while_loading_leaves_at_once(tmp_path):
    """SIGTERM (a preemption, scancel) before a rollout job's first lease ends it then and there:
    it holds nothing to hand back, and whoever preempted it waits for its exit."""
    import subprocess
    import sys

    mods, run_dir, loading = tmp_path / "mods", tmp_path / "run", tmp_path / "loading"
    mods.mkdir()
    run_dir.mkdir()
    (mods / "loading_domain.py").write_text(_LOADING_DOMAIN)
    env = dict(os.environ, HPCRL_TEST_LOADING=str(loading))
    cmd = [sys.executable, "-c", _ROLLOUT_CHILD, str(run_dir), str(mods)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(loading.exists, RUN_GUARD_S, what="the rollout job loading its domains")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=RUN_GUARD_S)  # a guard: before the fix it never ended
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "SIGTERM while loading, before the first lease: nothing to hand back" in err, err[-2000:]
