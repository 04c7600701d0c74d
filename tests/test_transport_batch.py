"""Trajectories in batches (one message per batch, a linger for partial ones, one bad trajectory
rejected alone) and requests sent without waiting (RequestClient.start)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import zmq

from hpcrl.core.config import StoreConfig
from hpcrl.core.rpc import Reply, RequestClient, RequestServer, RequestTimeout
from hpcrl.core.transport import Node
from hpcrl.core.wire import decode, encode
from hpcrl.rl.record.columns import Columns, ColumnsError
from hpcrl.rl.record.synth import TINY_SHAPE, synth_trajectory
from hpcrl.rl.store.stream import TrajectoryReceiver, TrajectorySender
from hpcrl.rl.store.writer import ShardWriter

from conftest import server_thread


def trajs(n: int, seed: int = 0, start: int = 0):
    rng = np.random.default_rng(seed)
    return [synth_trajectory(rng, "r", "gen-0", start + i, TINY_SHAPE) for i in range(n)]


def store(run):
    return lambda node: TrajectoryReceiver(
        node, "store", ShardWriter(run / "trajectories", "store-0", StoreConfig(flush_every=1))
    )


def test_batch_wire_round_trip_and_one_bad_trajectory_costs_only_itself():
    sent = trajs(5)
    body, arrays = Columns.encode(sent).to_wire()
    assert len(arrays) == 5 and body["ids"] == [t.id for t in sent]
    cols = Columns.from_wire(body, arrays)
    assert cols.row_errors() == [None] * 5 and [cols.trajectory(i) for i in range(5)] == sent
    # A NaN in the second trajectory's logprobs fails the batch-wide check: each is then checked alone.
    bad_lp = arrays[3].copy()
    bad_lp[cols.steps["action_start"][cols.traj["step_start"][1]]] = np.nan
    errors = Columns.from_wire(body, [*arrays[:3], bad_lp, arrays[4]]).row_errors()
    assert [i for i, e in enumerate(errors) if e] == [1] and "logprob" in errors[1]
    # Inconsistent framing: the whole batch is refused.
    with pytest.raises(ColumnsError, match="differ in length"):
        Columns.from_wire(body, [*arrays[:3], arrays[3][:-1], arrays[4]])
    with pytest.raises(ColumnsError, match="ids do not name"):
        Columns.from_wire(dict(body, ids=body["ids"][:2]), arrays)


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
    cols = Columns.encode(sent)
    cols.traj["final_reward"][1] = float("inf")
    body, arrays = cols.to_wire()
    caplog.set_level(logging.WARNING, logger="hpcrl.transport")

    def replies(sock, n: int) -> tuple[set, dict]:
        acked, rejected = set(), {}
        deadline = time.monotonic() + 10
        while len(acked) + len(rejected) < n and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = decode(sock.recv_multipart())
            for tid in reply.body["ids"]:
                if reply.kind == "ack":
                    acked.add(tid)
                else:
                    rejected[tid] = reply.body["reason"]
        return acked, rejected

    with server_thread(run, "store-0", store(run)) as receiver, Node(run, "gen-0") as node:
        raw, _ = node.connect(zmq.DEALER, "store")
        raw.send_multipart(encode("trajs", body, arrays))
        acked, rejected = replies(raw, 3)
        assert acked == {sent[0].id, sent[2].id} and list(rejected) == [sent[1].id]
        assert "final_reward" in rejected[sent[1].id]
        # Broken framing: the batch is rejected whole, by its ids (resending it could only fail again).
        others = trajs(2, start=10)
        body2, arrays2 = Columns.encode(others).to_wire()
        raw.send_multipart(encode("trajs", body2, [*arrays2[:2], arrays2[2][:-1], *arrays2[3:]]))
        acked, rejected = replies(raw, 2)
        assert not acked and set(rejected) == {t.id for t in others} and "broken batch" in rejected[others[0].id]
        sender = TrajectorySender(node, "store")
        sender.send(trajs(1, start=50)[0])
        assert sender.wait_acked(10)
        raw.close(0)
    assert receiver.received == 3 and receiver.dropped == 3
    assert any("fall outside the tokens" in r.message for r in caplog.records)


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
