"""Trajectories in batches (one message per batch, a linger for partial ones, one bad trajectory
rejected alone) and requests sent without waiting (RequestClient.start)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import zmq

from hpcrl.jobs.config import StoreConfig
from hpcrl.jobs.transport import Node, decode, encode
from hpcrl.jobs.transport_rpc import Reply, RequestClient, RequestServer, RequestTimeout
from hpcrl.jobs.transport_traj import TrajectoryReceiver, TrajectorySender
from hpcrl.rl.store_writer import ShardWriter
from hpcrl.rl.synth import TINY_SHAPE, synth_trajectory
from hpcrl.rl.traj_wire import from_wire_batch, to_wire_batch
from hpcrl.rl.trajectory import TrajectoryError
from conftest import server_thread


def trajs(n: int, seed: int = 0, start: int = 0):
    rng = np.random.default_rng(seed)
    return [synth_trajectory(rng, "r", "gen-0", start + i, TINY_SHAPE) for i in range(n)]


def store(run):
    return lambda node: TrajectoryReceiver(node, "store", ShardWriter(run / "trajectories", "store-0",
                                                                      StoreConfig(flush_every=1)))


def test_batch_wire_round_trip_and_one_bad_trajectory_costs_only_itself():
    sent = trajs(5)
    body, arrays = to_wire_batch(sent)
    assert len(arrays) == 3 and len(body["ids"]) == 5
    assert [t for _, t in from_wire_batch(body, arrays)] == sent
    # A NaN in the second trajectory's logprobs fails the batch-wide check: each is then checked alone.
    bad_lp = arrays[1].copy()
    bad_lp[body["n"][0][1]] = np.nan
    out = from_wire_batch(body, [arrays[0], bad_lp, arrays[2]])
    assert [tid for tid, t in out if isinstance(t, TrajectoryError)] == [sent[1].id]
    assert "logprob" in str(out[1][1]) and [t for _, t in out[2:]] == sent[2:]
    # A header that lies about its trajectory's id is that trajectory's error too.
    body2 = dict(body, ids=[*body["ids"][:4], "r/gen-0/999"])
    assert "is not the trajectory's id" in str(from_wire_batch(body2, arrays)[4][1])
    # Inconsistent framing: the whole batch is refused.
    with pytest.raises(TrajectoryError, match="do not hold what n announces"):
        from_wire_batch(dict(body, n=[[1, 1]] * 5), arrays)
    with pytest.raises(TrajectoryError, match="ids, h, n must be lists of one length"):
        from_wire_batch(dict(body, ids=body["ids"][:2]), arrays)


def test_trajectories_travel_in_batches_and_a_partial_batch_leaves_after_its_linger(tmp_path):
    run = tmp_path / "run"
    with server_thread(run, "store-0", store(run)) as receiver, Node(run, "gen-0") as node:
        sender = TrajectorySender(node, "store", batch_max=8, linger_s=0.4)
        for t in trajs(20):
            sender.send(t)
        assert sender.batches == 2  # two full batches left at once; 4 wait for company
        sender.pump()
        assert sender.batches == 2
        time.sleep(0.45)
        sender.pump()
        assert sender.batches == 3
        assert sender.wait_acked(10) and sender.acked == 20
        # One trajectory over batch_bytes travels alone.
        small = TrajectorySender(node, "store", batch_bytes=1, linger_s=60)
        for t in trajs(3, seed=1, start=100):
            small.send(t)
        assert small.batches == 3 and small.wait_acked(10)
        assert receiver.received == 23


def test_a_batch_with_a_bad_trajectory_stores_the_rest_and_rejects_it(tmp_path, caplog):
    run = tmp_path / "run"
    sent = trajs(3)
    body, arrays = to_wire_batch(sent)
    body["h"][1]["truncation"] = "bored"
    caplog.set_level(logging.WARNING, logger="hpcrl.transport")
    with server_thread(run, "store-0", store(run)) as receiver, Node(run, "gen-0") as node:
        raw, _ = node.connect(zmq.DEALER, "store")
        raw.send_multipart(encode("trajs", body, arrays))
        acked, rejected = set(), {}
        deadline = time.monotonic() + 10
        while len(acked) + len(rejected) < 3 and raw.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = decode(raw.recv_multipart())
            for tid in reply.body["ids"]:
                if reply.kind == "ack":
                    acked.add(tid)
                else:
                    rejected[tid] = reply.body["reason"]
        assert acked == {sent[0].id, sent[2].id} and list(rejected) == [sent[1].id]
        assert "truncation" in rejected[sent[1].id]
        # Broken framing: dropped as a whole with a log line, and the receiver goes on.
        raw.send_multipart(encode("trajs", dict(body, n=[[1, 1]] * 3), arrays))
        assert not raw.poll(300)
        sender = TrajectorySender(node, "store")
        sender.send(trajs(1, start=50)[0])
        assert sender.wait_acked(10)
        raw.close(0)
    assert receiver.received == 3 and receiver.dropped == 2
    assert any("do not hold what n announces" in r.message for r in caplog.records)


def test_a_request_sent_without_waiting_is_polled_retried_and_times_out(tmp_path):
    run = tmp_path / "run"
    gate = threading.Event()

    def slow(env):
        gate.wait(5)
        return Reply("done", env.body)

    with server_thread(run, "svc-0", lambda n: RequestServer(n, "slow", slow)), Node(run, "gen-0") as node:
        client = RequestClient(node, "slow", timeout_s=5, retries=0)
        pending = client.start("work", {"x": 1})
        assert pending.poll(0.0) is None  # not answered yet: the caller goes on with its work
        with pytest.raises(RuntimeError, match="still outstanding"):
            client.start("work", {"x": 2})
        gate.set()
        reply = pending.poll(5.0)
        assert reply.kind == "done" and reply.body == {"x": 1}
        with pytest.raises(RuntimeError, match="already taken"):
            pending.poll(0.0)
        assert client.request("work", {"x": 3}).body == {"x": 3}  # the next one may go
        # Nobody answers: each poll past an attempt's deadline retries, the last one raises.
        quiet = RequestClient(node, "slow", timeout_s=0.1, retries=1)
        gate.clear()
        pending = quiet.start("work", {"x": 4})
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="no reply to 'work' after 2 attempt"):
            while pending.poll(0.05) is None:
                pass
        assert 0.15 <= time.monotonic() - t0 < 2
        gate.set()
