"""Restart budgets that refill, backoff, hangs judged from heartbeats, and clients that wait for a
peer the supervisor is restarting (jobs/restarts.py, core/liveness.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from hpcrl.core import liveness
from hpcrl.core.config import SuperviseConfig
from hpcrl.core.rpc import Reply, RequestClient, RequestServer, RequestTimeout
from hpcrl.core.transport import Node, publish_endpoint
from hpcrl.jobs.restarts import hung, next_restart

from conftest import server_thread, wait_for

CFG = SuperviseConfig(restarts=3, restart_window_s=100.0, backoff_s=2.0, backoff_max_s=5.0, hang_s=60, startup_s=300)


def echo(env):
    return Reply("echo", {"got": env.body})


def test_budget_refills_as_restarts_age_out_and_backoff_doubles_to_its_cap():
    assert next_restart([], 1000.0, CFG) == 1002.0  # first restart: backoff_s
    assert next_restart([990.0], 1000.0, CFG) == 1004.0  # one in the window: doubled
    assert next_restart([980.0, 990.0], 1000.0, CFG) == 1005.0  # 8 s capped at backoff_max_s
    assert next_restart([950.0, 980.0, 990.0], 1000.0, CFG) is None  # three in the last 100 s: spent
    # An hour later the same history is old: the budget is whole again and the backoff starts over.
    assert next_restart([950.0, 980.0, 990.0], 1100.0, CFG) == 1102.0
    # A restart per 40 s, forever, never spends a budget of 3 per 100 s.
    times: list[float] = []
    for k in range(50):
        now = 40.0 * k
        assert next_restart(times, now, CFG) is not None, k
        times.append(now)
    assert next_restart([], 0.0, SuperviseConfig(restarts=0)) is None


def _beat(name="learner-0", job="7", started=100.0, t=100.0, phase="running"):
    return {"name": name, "job_id": job, "pid": 1, "host": "n1", "started": started, "time": t, "phase": phase}


def test_a_job_is_hung_when_a_rank_stops_beating_or_never_gets_going():
    since = 100.0
    ok = [_beat("learner-0", t=950.0), _beat("learner-1", t=955.0)]
    assert hung(ok, "7", since, 2, 1000.0, CFG) is None
    stuck = [_beat("learner-0", t=990.0), _beat("learner-1", t=900.0)]  # rank 1 quiet for 100 s
    why = hung(stuck, "7", since, 2, 1000.0, CFG)
    assert why and "learner-1" in why and "100 s" in why and "hang_s=60" in why
    # One rank died before its first beat and the other waits for it: caught after startup_s.
    alone = [_beat("learner-0", t=390.0)]
    assert hung(alone, "7", since, 2, 399.0, CFG) is None
    why = hung(alone, "7", since, 2, 401.0, CFG)
    assert why and "1 of 2" in why and "startup_s=300" in why
    # Still loading its model (phase "starting") is fine until startup_s, then it is not.
    loading = [_beat(t=110.0, phase="starting")]
    assert hung(loading, "7", since, 1, 399.0, CFG) is None
    assert "0 of 1" in hung(loading, "7", since, 1, 401.0, CFG)
    # Beats of another job, or of this job id's previous run (a requeue), are not this incarnation's.
    old = [_beat(job="6", t=0.0), _beat(started=10.0, t=20.0)]
    assert hung(old, "7", since, 1, 200.0, CFG) is None  # just started: nothing to judge yet
    # hang_s 0 and startup_s 0 turn the checks off.
    assert hung(stuck, "7", since, 2, 1000.0, SuperviseConfig(hang_s=0, startup_s=0)) is None


def test_heartbeats_track_the_main_loop_not_other_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(liveness, "_heart", None)
    liveness.beat()  # not installed: nothing happens
    assert not (tmp_path / "heartbeats").exists()
    liveness.install(tmp_path, "learner-1", job_id="42")
    (first,) = liveness.read_heartbeats(tmp_path, "learner")
    assert first["phase"] == "starting" and first["job_id"] == "42" and first["beats"] == 0

    threading.Thread(target=liveness.beat).start()  # a worker thread cannot vouch for the main loop
    time.sleep(0.1)
    assert liveness.read_heartbeats(tmp_path, "learner")[0]["beats"] == 0
    liveness.beat()
    beat = liveness.read_heartbeats(tmp_path, "learner")[0]
    assert beat["phase"] == "running" and beat["beats"] == 1 and beat["time"] >= first["time"]
    liveness.beat()  # within HEARTBEAT_S: not rewritten
    assert liveness.read_heartbeats(tmp_path, "learner")[0]["beats"] == 1
    monkeypatch.setattr(liveness, "_heart", None)

    for name in ("gen-1", "gen-10", "gen-1x"):
        (tmp_path / "heartbeats" / f"{name}.json").write_text(json.dumps(_beat(name)))
    (tmp_path / "heartbeats" / "gen-2.json").write_text("{trunc")  # being replaced: skipped
    assert [b["name"] for b in liveness.read_heartbeats(tmp_path, "gen-1")] == ["gen-1"]
    assert [b["name"] for b in liveness.read_heartbeats(tmp_path, "gen-2")] == []


def test_peer_starting_trusts_only_a_fresh_supervision_file(tmp_path):
    assert not liveness.peer_starting(tmp_path, "coordinator")  # no supervisor has written
    liveness.write_supervision(tmp_path, {"coordinator": "starting", "store": "running"})
    assert liveness.peer_starting(tmp_path, "coordinator")
    assert not liveness.peer_starting(tmp_path, "store") and not liveness.peer_starting(tmp_path, "gen-0")
    data = json.loads((tmp_path / liveness.SUPERVISION_NAME).read_text())
    data["updated"] -= liveness.SUPERVISION_FRESH_S + 1  # the supervisor died long ago
    (tmp_path / liveness.SUPERVISION_NAME).write_text(json.dumps(data))
    assert not liveness.peer_starting(tmp_path, "coordinator")
    (tmp_path / liveness.SUPERVISION_NAME).write_text("[1, 2")
    assert not liveness.peer_starting(tmp_path, "coordinator")


def test_a_client_waits_for_a_service_the_supervisor_is_restarting(tmp_path):
    run = tmp_path / "run"
    with Node(run, "gen-0") as node:
        dead = node.ctx.socket(zmq.ROUTER)
        port = dead.bind_to_random_port("tcp://127.0.0.1")
        dead.close(0)
        publish_endpoint(run, "echo", f"tcp://127.0.0.1:{port}", node.pair.public)  # the old instance's
        patient = RequestClient(node, "echo", timeout_s=0.1, retries=1, wait_restarting=True)
        # Without a supervisor's word, even a patient client gives up after its retries.
        with pytest.raises(RequestTimeout):
            patient.request("ping", 1)
        liveness.write_supervision(run, {"echo": "starting"})
        impatient = RequestClient(node, "echo", timeout_s=0.1, retries=1)
        with pytest.raises(RequestTimeout):
            impatient.request("ping", 1)  # not every client waits: the learner's must not stall training
        pending = patient.start("ping", 2)
        wait_for(lambda: pending.poll(0.0) is None and pending.attempt >= 1, 10, 0.05, what="the retries to run out")
        assert pending.poll(0.5) is None  # attempt timeouts past the last retry: still waiting, not raised
        with server_thread(run, "svc", lambda n: RequestServer(n, "echo", echo)):
            env = wait_for(lambda: pending.poll(0.05), 30, 0.0, what="the reply from the restarted service")
        assert env.body == {"got": 2}
