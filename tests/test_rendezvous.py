"""Probes of the rendezvous a stranger could reach: the learner's process group and the direct
weight path listen on this node's address only, and only the run's key holders get anything
from them: a stranger who finds the port can neither join, nor read weights, nor drop or stall
a generator (CPU, gloo)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq

from hpcrl.core.transport import read_endpoint
from hpcrl.core.wire import encode
from hpcrl.rl.common.distenv import RunStore
from hpcrl.rl.weights.direct import SERVICE, DirectReceiver, DirectSender

from conftest import wait_for
from listeners import WILDCARD, listeners

ROOT = Path(__file__).resolve().parents[1]


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def torch_store_join(host: str, port: int) -> None:
    """What torch's own rendezvous admitted: any client, a join, a goodbye for another member."""
    store = torch.distributed.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
    store.add("joins", 1)
    store.set("leave/1", "1")


def stranger_answered(address: str, server_key: bytes, requests: list[tuple[str, dict]]) -> list[bytes]:
    """Requests in the store's own protocol over CURVE, with keys of the stranger's own (the
    server's public key is no secret); whatever came back within 2 s."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_key
        sock.connect(address)
        for i, (op, body) in enumerate(requests):
            sock.send_multipart(encode(op, body, msg_id=f"probe-{i}"))
        return sock.recv_multipart() if sock.poll(2000) else []
    finally:
        ctx.destroy(0)


def probe(host: str, port: int, address: str, server_key: bytes) -> None:
    with pytest.raises((RuntimeError, OSError)):  # refused, reset or timed out (torch.distributed.DistError): not in
        torch_store_join(host, port)
    answered = stranger_answered(
        address,
        server_key,
        [
            ("add", {"keys": ["joins"], "amount": 1}),  # join
            ("list_keys", {"keys": []}),  # look around
            ("get", {"keys": ["pair/1/0"], "wait_s": 1.0}),  # read a member's address
            ("set", {"keys": ["leave/1"], "value": b"1"}),  # drop a member
        ],
    )
    assert answered == []


def test_the_direct_weight_path_admits_only_the_runs_generators(tmp_path):
    before = listeners()
    sender = DirectSender(tmp_path, "gloo", host="127.0.0.1", timeout_s=600)
    gen = None
    try:
        opened = listeners() - before  # what a port scan of this host finds new
        assert opened and not {addr for addr, _ in opened} & WILDCARD, opened
        gen = DirectReceiver(tmp_path, "gen-0", timeout_s=600)
        assert gen.connected.wait(120)
        ep = read_endpoint(tmp_path, SERVICE)
        for host, port in opened:
            probe(host, port, f"tcp://{host}:{port}", ep.public_key)
        assert sender.store.add("joins", 0) == 1 and len(sender.members) == 1  # nobody else joined
        sender.send(1, state(1))
        version, got = wait_for(gen.take, 120, 0.01, "version 1 at the generator")
        assert version == 1 and torch.equal(got["w"], state(1)["w"])
        gen.release()
        # A member of the run that starts a join and never completes it holds up nobody: the
        # next version reaches the generator long before that join's 600 s timeout.
        member = RunStore(tmp_path, SERVICE, "gen-7")
        try:
            member.add("joins", 1)
            sender.send(2, state(2))
            assert wait_for(lambda: (gen.take() or (0,))[0] == 2, 120, 0.01, "version 2 beside a stuck join")
            gen.release()
            assert len(sender.members) == 1
        finally:
            member.close()
    finally:
        if gen is not None:
            gen.close(timeout_s=60)
        sender.close()


_RANK = """
import sys
import torch
import torch.distributed as dist
from hpcrl.rl.common.distenv import init_process_group, resolve_dist_env
env = resolve_dist_env()
init_process_group(env, "gloo", sys.argv[1])
t = torch.tensor([env.rank + 1.0])
dist.all_reduce(t)
print(t.item(), flush=True)
sys.stdin.readline()  # the test probes the rendezvous meanwhile
t = torch.ones(1)
dist.all_reduce(t)
print(t.item(), flush=True)
dist.destroy_process_group()
"""


def test_the_learners_rendezvous_admits_only_its_ranks(tmp_path):
    ranks = []
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", OMP_NUM_THREADS="1")
    try:
        for rank in range(2):
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "-c", _RANK, str(tmp_path)],
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        assert [p.stdout.readline().strip() for p in ranks] == ["3.0", "3.0"]
        (path,) = (tmp_path / "endpoints").glob("learner-store-*.json")
        ep = read_endpoint(tmp_path, path.stem)
        host, port = ep.address[len("tcp://") :].rsplit(":", 1)
        mine = listeners(ranks[0].pid)
        assert (host, int(port)) in mine and host not in WILDCARD
        assert not any(p == 29555 for _, p in mine)  # MASTER_PORT names no listener
        probe(host, int(port), ep.address, ep.public_key)
        for p in ranks:  # and the ranks go on together
            p.stdin.write("\n")
            p.stdin.flush()
        assert [p.stdout.readline().strip() for p in ranks] == ["2.0", "2.0"]
        assert [p.wait(120) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_the_runs_store_keeps_torch_stores_semantics(tmp_path):
    from hpcrl.rl.common.distenv import StoreServer

    server = StoreServer(tmp_path, "store-test")
    store = RunStore(tmp_path, "store-test", "gen-0", datetime.timedelta(seconds=2))
    try:
        store.set("a", b"1")
        assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert store.compare_set("c", b"", b"x") == b"x" and store.compare_set("c", b"y", b"z") == b"x"
        assert store.compare_set("c", b"x", b"z") == b"z"
        store.append("a", b"2")
        store.multi_set(["m1", "m2"], [b"p", b"q"])
        assert store.multi_get(["a", "m1", "m2"]) == [b"12", b"p", b"q"]
        assert store.check(["a", "n"]) and not store.check(["a", "missing"])
        assert store.num_keys() == 5 and sorted(store.list_keys()) == ["a", "c", "m1", "m2", "n"]
        assert store.delete_key("m1") and not store.delete_key("m1")
        with pytest.raises(torch.distributed.DistStoreError, match="timed out after 2 s waiting for missing"):
            store.get("missing")
        prefixed = torch.distributed.PrefixStore("p", store)  # as torch wraps it
        prefixed.set("k", "v")
        assert store.get("p/k") == b"v"
    finally:
        store.close()
        server.close()
    assert not (tmp_path / "endpoints" / "store-test.json").exists()
