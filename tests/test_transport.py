"""ZeroMQ layer: envelopes, CURVE + ZAP, bad input, request/reply, PUB/SUB, acked delivery."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from hpcrl.core.rpc import (
    RemoteError,
    Reply,
    RequestClient,
    RequestServer,
    RequestTimeout,
    VersionPublisher,
    VersionSubscriber,
)
from hpcrl.core.transport import Endpoint, Node, RunKeys, TransportError, publish_endpoint, read_endpoint
from hpcrl.core.wire import BadMessage, WireLimits, decode, encode
from hpcrl.rl.record.synth import TINY_SHAPE, synth_trajectory
from hpcrl.rl.store.layout import list_shards, read_segment
from hpcrl.rl.store.stream import TrajectorySender

from conftest import server_thread

REPO = Path(__file__).resolve().parents[1]


def echo(env):
    if env.kind == "boom":
        raise RuntimeError("handler exploded")
    return Reply("echo", {"got": env.body}, [a * 2 for a in env.arrays])


def wait_until(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# -- envelopes ---------------------------------------------------------------------------------


def test_envelope_round_trip_is_zero_copy():
    arrays = [
        np.arange(10, dtype=np.int32),
        np.ones((2, 3), np.float32),
        np.zeros(0, np.uint8),
        np.array([True, False]),
    ]
    frames = encode("k", {"a": [1, "x", None, 2.5, b"raw"]}, arrays, msg_id="m1")
    assert all(f is a for f, a in zip(frames[1:], arrays))  # handed to zmq as-is, no copy
    env = decode(frames)
    assert env.kind == "k" and env.msg_id == "m1" and env.body == {"a": [1, "x", None, 2.5, b"raw"]}
    for got, want in zip(env.arrays, arrays):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert want.size == 0 or np.shares_memory(got, want)


def test_envelope_over_a_real_socket_gives_read_only_views():
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://t")
        b.connect("inproc://t")
        big = np.arange(100_000, dtype=np.int32)
        a.send_multipart(encode("x", None, [big]), copy=False)
        env = decode(b.recv_multipart(copy=False))
        assert np.array_equal(env.arrays[0], big) and not env.arrays[0].flags.writeable
    finally:
        ctx.destroy(0)


def _header(**kw):
    h = {"v": 1, "k": "x", "b": None, "a": []}
    h.update(kw)
    return msgpack.packb(h)


@pytest.mark.parametrize(
    "frames, fragment",
    [
        ([], "empty message"),
        ([b"\xc1\xc1garbage"], "not msgpack"),
        ([msgpack.packb([1, 2])], "not an hpcrl v1 envelope"),
        ([_header(v=2)], "not an hpcrl v1 envelope"),
        ([_header(k=5)], "wrong types"),
        ([_header(a=[["<i4", [2]]])], "announces 1 array(s), message carries 0"),
        ([_header(a=[["<i4", [3]]]), b"12345678"], "do not fill"),
        ([_header(a=[["|O", [1]]]), b"12345678"], "not allowed"),
        ([_header(a=[["<U2", [1]]]), b"12345678"], "not allowed"),
        ([_header(a=[["nonsense", [1]]]), b"1"], "bad dtype"),
        ([_header(a=[["<i4", "x"]]), b"1234"], "bad spec"),
        ([_header(a=[["<i4", [-1]]]), b""], "not allowed"),
        ([msgpack.packb({"v": 1, "k": "x", "b": msgpack.ExtType(1, b"x"), "a": []})], "extension type"),
        ([_header(a=[["V8", [1]]]), b"12345678"], "not allowed"),
        ([b"x"] * 5000, "5000 frames"),
        ([_header(a=[["|u1", [300]]]), b"x" * 300], "oversized"),
    ],
)
def test_decode_rejects_bad_input_with_a_reason(frames, fragment):
    with pytest.raises(BadMessage) as err:
        decode(frames, WireLimits(max_message_bytes=256))
    assert fragment in str(err.value)


def test_encode_refuses_object_and_string_arrays():
    with pytest.raises(TypeError, match="cannot travel"):
        encode("x", None, [np.array([{"a": 1}], dtype=object)])
    with pytest.raises(TypeError, match="cannot travel"):
        encode("x", None, [np.array(["a"])])


def test_no_pickle_anywhere_in_the_message_path(monkeypatch, tmp_path):
    import ast
    import pickle

    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    banned_attrs = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}
    # Every module that touches a socket: the ground floor, the RL side (store stream included)
    # and the sandbox server and client.
    sources = sorted((REPO / "core").glob("*.py")) + sorted((REPO / "rl").rglob("*.py"))
    sources += [REPO / "sandbox" / "server.py", REPO / "sandbox" / "client.py"]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, path.name
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, path.name
            elif isinstance(node, ast.Attribute):
                assert node.attr not in banned_attrs, f"{path.name} uses {node.attr}"
            elif isinstance(node, ast.keyword):
                assert node.arg != "allow_pickle", path.name

    # And at run time: a full acknowledged delivery with pickle unusable.
    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    from hpcrl.core.config import StoreConfig
    from hpcrl.rl.store.stream import TrajectoryReceiver
    from hpcrl.rl.store.writer import ShardWriter

    make = lambda n: TrajectoryReceiver(n, "store", ShardWriter(tmp_path / "t", "s-0", StoreConfig(flush_every=2)))
    with server_thread(tmp_path, "s-0", make):
        with Node(tmp_path, "gen-0") as node:
            settled = []
            sender = TrajectorySender(node, "store", on_settled=lambda *a: settled.append(a))
            rng = np.random.default_rng(0)
            sent = [synth_trajectory(rng, "r", "g", i, TINY_SHAPE) for i in range(4)]
            for traj in sent:
                sender.send(traj)
            assert sender.wait_acked(10)
            # Each trajectory is settled exactly once, as stored, only after its flush.
            assert sorted(settled) == sorted((t.id, True, "") for t in sent)


# -- keys and endpoints ---------------------------------------------------------------------------


def test_run_keys_are_private_stable_and_form_the_allow_list(tmp_path):
    keys = RunKeys(tmp_path)
    a = keys.ensure("gen-0")
    assert keys.ensure("gen-0") == a  # created once, then reused
    b = keys.ensure("store-0")
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "keys" / "gen-0.key_secret").stat().st_mode) == 0o600
    assert keys.allowed() == {a.public, b.public}
    assert a.secret.decode() not in (tmp_path / "keys" / "gen-0.key").read_text()
    os.chmod(tmp_path / "keys" / "gen-0.key_secret", 0o644)
    with pytest.raises(TransportError, match="chmod 600"):
        keys.ensure("gen-0")
    os.chmod(tmp_path / "keys", 0o755)
    with pytest.raises(TransportError, match="chmod 700"):
        keys.ensure("store-0")
    with pytest.raises(TransportError, match="component name"):
        RunKeys(tmp_path / "other").ensure("../evil")


def test_endpoint_discovery(tmp_path):
    ep = publish_endpoint(tmp_path, "store", "tcp://h:1", b"k" * 40)
    assert read_endpoint(tmp_path, "store") == ep
    again = publish_endpoint(tmp_path, "store", "tcp://h:2", b"k" * 40)
    assert read_endpoint(tmp_path, "store").instance == again.instance != ep.instance
    with pytest.raises(TransportError, match="has not published an endpoint"):
        read_endpoint(tmp_path, "missing", timeout_s=0.1)
    (tmp_path / "endpoints" / "broken.json").write_text("{")
    with pytest.raises(TransportError, match="damaged"):
        read_endpoint(tmp_path, "broken")


# -- CURVE, ZAP and bad input on a live server --------------------------------------------------


def test_curve_rejects_unknown_peer_wrong_key_and_plaintext_and_keeps_serving(tmp_path, caplog):
    run = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="hpcrl.transport")
    with server_thread(run, "svc-0", lambda n: RequestServer(n, "echo", echo)) as server:
        ep = read_endpoint(run, "echo")
        frames = encode("hello", {"x": 1}, msg_id="r1")
        # 1. A client whose key is not in this run's keys/ (it belongs to another run).
        with Node(tmp_path / "other-run", "intruder") as intruder:
            sock, _ = intruder.connect(zmq.DEALER, ep)
            sock.send_multipart(frames)
            assert not sock.poll(500)
        assert wait_until(lambda: any("rejected CURVE client key" in r.message for r in caplog.records))
        with Node(run, "gen-1") as node:
            # 2. An allowed client that does not know the server's real key.
            sock, _ = node.connect(zmq.DEALER, Endpoint("echo", ep.address, zmq.curve_keypair()[0], ep.instance))
            sock.send_multipart(frames)
            assert not sock.poll(500)
            assert wait_until(lambda: any("during the CURVE handshake" in r.message for r in caplog.records))
            # 3. No CURVE at all.
            plain = node.ctx.socket(zmq.DEALER)
            plain.connect(ep.address)
            plain.send_multipart(frames)
            assert not plain.poll(300)
            plain.close(0)
            # The server is still there for a legitimate client.
            reply = RequestClient(node, "echo", timeout_s=2).request("hello", {"x": 1}, [np.arange(3)])
            assert reply.body == {"got": {"x": 1}} and reply.arrays[0].tolist() == [0, 2, 4]
        assert server.served == 1


def test_strangers_looping_on_handshakes_are_counted_and_logged_at_a_bounded_rate(tmp_path, caplog):
    """Failed handshakes cost a counter and a line per interval, never a line each: strangers
    trying fresh keys must not fill the run directory's logs."""
    from hpcrl.core.transport import HANDSHAKE_FAILURES

    run = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="hpcrl.transport")
    with server_thread(run, "svc-0", lambda n: RequestServer(n, "echo", echo)) as server:
        ep = read_endpoint(run, "echo")
        before = sum(HANDSHAKE_FAILURES.values())
        ctx = zmq.Context()
        try:
            for _ in range(100):  # a handshake each, with fresh keys
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.curve_serverkey = ep.public_key
                sock.connect(ep.address)
                sock.send_multipart(encode("hello", {}, msg_id="x"), zmq.NOBLOCK)
            assert wait_until(lambda: sum(HANDSHAKE_FAILURES.values()) - before >= 100, 120), HANDSHAKE_FAILURES
        finally:
            ctx.destroy(0)
        with Node(run, "gen-0") as node:  # and the server still serves the run
            assert RequestClient(node, "echo", timeout_s=5).request("hello", 1).body == {"got": 1}
        assert server.served == 1
    lines = [r for r in caplog.records if r.name.startswith("hpcrl.transport") and r.levelno >= logging.INFO]
    assert len(lines) <= 6, [r.getMessage() for r in lines]
    assert any("rejected CURVE client key" in r.getMessage() for r in lines)


def test_oversized_and_malformed_are_dropped_and_server_keeps_serving(tmp_path, caplog):
    run = tmp_path / "run"
    limits = WireLimits(max_message_bytes=64 << 10)
    caplog.set_level(logging.INFO, logger="hpcrl.transport")
    with server_thread(run, "svc-0", lambda n: RequestServer(n, "echo", echo), limits) as server:
        with Node(run, "gen-0") as node:
            ep = read_endpoint(run, "echo")
            big, _ = node.connect(zmq.DEALER, ep)
            big.send_multipart(encode("big", None, [np.zeros(100_000, np.uint8)], msg_id="a"))  # one frame > limit
            # libzmq drops the connection that carried it (ZMQ_MAXMSGSIZE); the monitor logs that.
            assert wait_until(lambda: any("disconnected" in r.message for r in caplog.records))
            bad, _ = node.connect(zmq.DEALER, ep)
            chunks = [np.zeros(40_000, np.uint8)] * 3  # each frame fits, the message does not
            bad.send_multipart(encode("big", None, chunks, msg_id="b"), copy=False)
            bad.send_multipart([b"\xc1 not msgpack"])
            bad.send_multipart([_header(a=[["|O", [1]]]), b"12345678"])
            bad.send_multipart(encode("no id"))
            assert wait_until(lambda: server.dropped >= 4)
            client = RequestClient(node, "echo", timeout_s=2)
            assert client.request("ok", 7).body == {"got": 7}
            with pytest.raises(RemoteError, match="handler exploded"):
                client.request("boom")
            assert client.request("ok", 8).body == {"got": 8}
    text = "\n".join(r.message for r in caplog.records)
    assert "oversized" in text and "not msgpack" in text and "not allowed" in text and "without an id" in text
    assert server.served == 3  # nothing bad reached the handler


# -- request / reply --------------------------------------------------------------------------------


def test_request_retries_are_idempotent(tmp_path):
    run = tmp_path / "run"
    calls = Counter()

    def slow(env):
        calls[env.msg_id] += 1
        if calls[env.msg_id] == 1:
            time.sleep(0.5)  # longer than the client's timeout: it retries meanwhile
        return Reply("done", calls[env.msg_id])

    with server_thread(run, "svc-0", lambda n: RequestServer(n, "slow", slow)) as server:
        with Node(run, "gen-0") as node:
            reply = RequestClient(node, "slow", timeout_s=0.2, retries=5).request("work")
    assert reply.body == 1 and list(calls.values()) == [1]  # ran once, the retry got the replay
    assert server.replayed >= 1


def test_request_timeout_names_service_and_attempts(tmp_path):
    with Node(tmp_path, "gen-0") as node:
        dead = node.ctx.socket(zmq.ROUTER)
        port = dead.bind_to_random_port("tcp://127.0.0.1")
        dead.close(0)
        publish_endpoint(tmp_path, "ghost", f"tcp://127.0.0.1:{port}", node.pair.public)
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match=r"ghost at tcp://127.0.0.1:\d+: no reply to 'ping' after 3 attempt"):
            RequestClient(node, "ghost", timeout_s=0.15, retries=2).request("ping")
        assert 0.4 <= time.monotonic() - t0 < 3
        with pytest.raises(TransportError, match="has not published"):
            RequestClient(node, "never", discover_timeout_s=0.1).request("ping")


def test_request_finds_a_restarted_server(tmp_path):
    run = tmp_path / "run"
    with server_thread(run, "svc-0", lambda n: RequestServer(n, "echo", echo)):
        with Node(run, "gen-0") as node:
            client = RequestClient(node, "echo", timeout_s=0.3, retries=10)
            assert client.request("a", 1).body == {"got": 1}
    result = {}
    with Node(run, "gen-0") as node:
        client = RequestClient(node, "echo", timeout_s=0.3, retries=10)
        client._socket(fresh=False)  # connected to the old, dead address
        t = threading.Thread(target=lambda: result.setdefault("r", client.request("b", 2)))
        t.start()
        time.sleep(0.4)
        with server_thread(run, "svc-1", lambda n: RequestServer(n, "echo", echo)):
            t.join(10)
    assert result["r"].body == {"got": 2}


# -- policy versions ----------------------------------------------------------------------------------


def test_policy_versions_reach_late_subscribers_and_garbage_is_dropped(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="hpcrl.transport")
    with Node(tmp_path, "learner", bind_host="127.0.0.1") as lnode, Node(tmp_path, "gen-0") as gnode:
        pub = VersionPublisher(lnode, republish_s=0.05)
        for v in (1, 2, 3):
            pub.publish(v, {"step": v * 10})
        sub = VersionSubscriber(gnode)  # joins after the announcements
        assert wait_until(lambda: (pub.tick(), sub.poll(0.02))[1] == 3)
        assert sub.info["step"] == 30
        pub.publish(4)
        assert sub.wait_for(4, 5)
        raw, _ = lnode.bind(zmq.PUB, "policy-raw")
        sub2 = VersionSubscriber(gnode, "policy-raw")

        def send_both():
            raw.send_multipart([b"policy", b"\xc1 garbage"])
            raw.send_multipart([b"policy", *encode("policy_version", {"version": 9})])
            return sub2.poll(0.02) == 9

        assert wait_until(send_both)
    assert any("policy subscriber: dropped a message" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="policy version"):
        pub.publish(-1)


# -- acknowledged trajectory delivery -------------------------------------------------------------


def _start_service(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parent / "store_service.py"),
            str(run),
            "--bind-host",
            "127.0.0.1",
            "--flush-every",
            "8",
            "--flush-interval",
            "0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    return proc


def test_ack_and_resend_across_a_writer_kill_loses_and_duplicates_nothing(tmp_path):
    run = tmp_path / "run"
    rng = np.random.default_rng(0)
    trajs = [synth_trajectory(rng, "r", "gen-0", i, TINY_SHAPE) for i in range(400)]
    service = _start_service(run)
    try:
        with Node(run, "gen-0") as node:
            sender = TrajectorySender(node, "store", resend_after_s=5.0)
            for t in trajs[:200]:
                sender.send(t)
                sender.pump()
            assert wait_until(lambda: (sender.pump(), sender.acked)[1] >= 100, 20)
            service.send_signal(signal.SIGKILL)  # mid-stream: some flushed, some buffered, some in flight
            service.wait()
            for t in trajs[200:300]:
                sender.send(t)  # queued while the writer is down
            service = _start_service(run)
            for t in trajs[300:]:
                sender.send(t)
                sender.pump()
            assert sender.wait_acked(30), f"{sender.unacked} never acknowledged"
            assert sender.acked == 400 and not sender.rejected
    finally:
        service.send_signal(signal.SIGTERM)
        assert service.wait(30) == 0
    ids = Counter()
    for state in list_shards(run / "trajectories"):
        assert state.finalized
        for info in state.manifest.segments:
            ids.update(read_segment(state.path / info.name, info).ids())
    assert set(ids) == {t.id for t in trajs}
    assert max(ids.values()) == 1, "a trajectory was stored twice"


def test_invalid_trajectory_is_rejected_and_receiver_keeps_serving(tmp_path, caplog):
    from hpcrl.core.config import StoreConfig
    from hpcrl.rl.record.columns import Columns
    from hpcrl.rl.store.stream import TrajectoryReceiver
    from hpcrl.rl.store.writer import ShardWriter

    run = tmp_path / "run"
    rng = np.random.default_rng(1)
    good = synth_trajectory(rng, "r", "gen-0", 1, TINY_SHAPE)
    cols = Columns.encode([synth_trajectory(rng, "r", "gen-0", 2, TINY_SHAPE)])
    cols.traj["schema_version"][0] = 99
    body, arrays = cols.to_wire()
    caplog.set_level(logging.WARNING, logger="hpcrl.transport")
    make = lambda n: TrajectoryReceiver(
        n,
        "store",
        ShardWriter(
            run / "trajectories",
            "store-0",
            StoreConfig(flush_every=1),
        ),
    )
    with server_thread(run, "store-0", make) as receiver:
        with Node(run, "gen-0") as node:
            raw, _ = node.connect(zmq.DEALER, "store")
            raw.send_multipart(encode("traj", {"steps": []}, msg_id="r/gen-0/3"))  # no such kind: dropped
            raw.send_multipart(encode("trajs", body, arrays))
            assert raw.poll(5000)
            reply = decode(raw.recv_multipart())
            assert reply.kind == "reject" and reply.body["ids"] == ["r/gen-0/2"]
            assert "upgrade hpcrl" in reply.body["reason"]
            sender = TrajectorySender(node, "store")
            sender.send(good)
            assert sender.wait_acked(10)
        assert receiver.dropped == 2 and receiver.received == 1
    assert any("unexpected kind 'traj'" in r.message for r in caplog.records)


def test_unknown_keys_cost_a_stat_not_a_rescan_and_newcomers_are_admitted(tmp_path):
    from hpcrl.core.transport import _AllowList

    keys = RunKeys(tmp_path)
    keys.ensure("coordinator")
    allow = _AllowList(keys, rescan_s=3600)
    strangers = [zmq.curve_keypair()[0] for _ in range(200)]
    assert not any(allow.callback("hpcrl", k) for k in strangers)
    assert allow.scans == 1  # keys/ did not change: 200 unknown keys, no directory read
    newcomer = keys.ensure("gen-7")  # written before it connects, as every component does
    # Directory mtimes tick coarsely (ext4: a few ms): on a fast machine the key may land in the
    # tick of the last scan. Touch the folder until its stamp moves, as later writes would.
    while allow._dir_stamp() == allow._stamp:
        (keys.dir / ".tick").touch()
        (keys.dir / ".tick").unlink()
    assert allow.callback("hpcrl", newcomer.public) and allow.scans == 2
    assert not allow.callback("hpcrl", strangers[0]) and allow.scans == 2
