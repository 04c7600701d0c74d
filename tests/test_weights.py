"""Weight sync: sharded versions in the policy dtype written by every rank off the training
step, generators reading on a thread and pausing only for the swap, and the direct path over a
process group of its own (gloo here, NCCL on GPUs)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading
import time

import pytest
import torch

from hpcrl.core.config import PolicyConfig, TinyModelConfig
from hpcrl.rl.model.policy import Policy, copy_state, full_state_dict
from hpcrl.rl.weights.direct import DirectReceiver, DirectSender, DirectWeights
from hpcrl.rl.weights.shards import Bucket, ShardPublisher, WeightStore, owned_names, read_shard, write_shard_file

from conftest import wait_for

TINY = PolicyConfig(
    tiny=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_context=64), device="cpu"
)


def state_of(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in full_state_dict(Policy.load(TINY, seed=seed).model).items()}


def test_owned_names_split_contiguously_by_size():
    parts = owned_names(["a", "b", "c", "d"], [100, 1, 1, 100], 2)
    assert parts == [["a", "b"], ["c", "d"]]  # 101 and 101 elements
    assert owned_names(["a"], [5], 3) == [["a"], [], []]


def test_every_rank_writes_its_shard_and_rank0_announces_when_all_are_there(tmp_path):
    state = state_of(0, torch.bfloat16)
    names = list(state)
    parts = owned_names(names, [state[n].numel() for n in names], 2)
    store = WeightStore(tmp_path, keep=2)
    gate = threading.Event()
    real = store.write_shard

    def slow_write(st, version, rank):  # rank 1's filesystem is slow
        if rank == 1:
            gate.wait(30)
        return real(st, version, rank)

    store.write_shard = slow_write
    pubs = [ShardPublisher(store, r, 2) for r in range(2)]
    for r, pub in enumerate(pubs):
        pub.submit(5, {n: state[n] for n in parts[r]})  # returns at once: the training step goes on
    wait_for(lambda: (store.version_dir(5) / "shard-00000.done").exists(), 30, 0.01, "rank 0's shard")
    assert store.latest() is None  # rank 1's shard is missing: nothing announced yet
    gate.set()
    for pub in pubs:
        pub.flush()
    assert store.latest()[0] == 5
    got = WeightStore(tmp_path).read(5)
    assert got.keys() == state.keys() and all(got[k].dtype == torch.bfloat16 for k in got)
    assert all(torch.equal(got[k], state[k]) for k in state)
    for v in (6, 7):
        store.publish(state, v)
    assert sorted(p.name for p in (tmp_path / "weights").glob("v*")) == ["v00000006", "v00000007"]


def test_a_resumed_learner_discards_a_previous_lifes_half_published_version(tmp_path):
    """A learner killed mid-publish leaves rank 1's shard and marker of v4 but no announcement;
    its next life publishes v4 again. Without the discard, rank 0 would index that stale shard
    beside its new one: generators would load two models in one."""
    old, new = state_of(0), state_of(1)
    names = list(old)
    parts = owned_names(names, [old[n].numel() for n in names], 2)
    store = WeightStore(tmp_path, keep=3)
    store.publish(old, 3)
    store.write_shard({n: old[n] for n in parts[1]}, 4, 1)  # the dead life's rank 1, never announced
    assert store.latest()[0] == 3
    store.discard_above(3)  # what the resumed rank 0 does before anyone writes again
    assert not store.version_dir(4).exists() and store.version_dir(3).exists()
    pubs = [ShardPublisher(store, r, 2) for r in range(2)]
    pubs[0].submit(4, {n: new[n] for n in parts[0]})
    wait_for(lambda: (store.version_dir(4) / "shard-00000.done").exists(), 30, 0.01, "rank 0's shard")
    assert store.latest()[0] == 3  # rank 0 waits for the new life's rank 1, not the old shard
    pubs[1].submit(4, {n: new[n] for n in parts[1]})
    for pub in pubs:
        pub.flush()
    got = WeightStore(tmp_path).read(4)
    assert all(torch.equal(got[k], new[k]) for k in new)


def test_shards_are_safetensors_written_from_the_buckets_and_mapped_back(tmp_path):
    """A shard is written from the gathered buffers' own memory and read as views of a private
    map: the safetensors library reads ours and we read its; writing a view never reaches the
    file; a truncated shard is refused rather than mapped (a read past a map's end is a SIGBUS)."""
    from safetensors.torch import load_file, save_file

    state = {
        "w": torch.randn(3, 5).bfloat16(),
        "ids": torch.arange(7),
        "empty": torch.ones(0, 4),
        "s": torch.tensor(2.5),
    }
    bucket = Bucket([(k, v.dtype, v.shape) for k, v in state.items()])
    for k, v in state.items():
        bucket.tensors[k].copy_(v)
    write_shard_file(tmp_path / "ours.safetensors", bucket.tensors, {"format": "pt"})
    assert all(torch.equal(v, state[k]) for k, v in load_file(tmp_path / "ours.safetensors").items())
    save_file(state, tmp_path / "theirs.safetensors")
    for name in ("ours", "theirs"):
        got, _ = read_shard(tmp_path / f"{name}.safetensors")
        assert got.keys() == state.keys() and all(
            torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items()
        )
    got["w"].add_(1)
    assert torch.equal(read_shard(tmp_path / "theirs.safetensors")[0]["w"], state["w"])
    data = (tmp_path / "ours.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="damaged"):
        read_shard(tmp_path / "cut.safetensors")


def test_background_reader_swaps_without_blocking(tmp_path):
    WeightStore(tmp_path).publish(state_of(1), 3)
    policy = Policy.load(TINY, seed=0)
    watch = WeightStore(tmp_path, background=True)
    got = [watch.load_if_newer(policy.model, have=2)]
    assert got[0] is None  # the read started on a thread; sampling goes on meanwhile
    got.append(wait_for(lambda: watch.load_if_newer(policy.model, have=2), 30, 0.01, "staged weights"))
    assert got[1] == 3 and watch.last_swap_s > 0
    assert all(torch.equal(v, full_state_dict(policy.model)[k]) for k, v in state_of(1).items())
    assert watch.load_if_newer(policy.model, have=3) is None


def test_direct_path_sends_each_version_to_every_generator(tmp_path):
    sender = DirectSender(tmp_path, "gloo", host="127.0.0.1", timeout_s=60)
    receivers = [DirectReceiver(tmp_path, f"gen-{i}", timeout_s=60) for i in range(2)]
    late = None
    try:
        for r in receivers:
            assert r.connected.wait(30)
        want = state_of(2, torch.bfloat16)
        sender.send(1, want)
        sender.flush()
        for r in receivers:
            version, got = wait_for(r.take, 30, 0.01, "version 1")
            assert version == 1 and all(torch.equal(got[k], want[k]) and got[k].dtype == torch.bfloat16 for k in want)
            r.release()
        # A generator that leaves is let go by the sender (its thread ends, though it waited in a
        # broadcast); the others keep receiving; a new one can join.
        receivers[0].close(timeout_s=60)
        assert not receivers[0]._thread.is_alive()
        wait_for(lambda: len(sender.members) == 1, 30, 0.01, "the sender letting gen-0 go")
        late = DirectReceiver(tmp_path, "gen-9", timeout_s=60)
        assert late.connected.wait(30)
        policy = Policy.load(TINY, seed=0)
        weights = DirectWeights(WeightStore(tmp_path), late)
        sender.send(2, state_of(3))
        sender.flush()
        assert wait_for(lambda: weights.load_if_newer(policy.model, have=1), 30, 0.01, "direct v2") == 2
        assert all(torch.equal(v, full_state_dict(policy.model)[k]) for k, v in state_of(3).items())
        assert wait_for(lambda: (receivers[1].take() or (0,))[0] == 2, 30, 0.01, "v2 at gen-1")
        receivers[1].release()
        # The learner closing says goodbye: each receiver leaves its pair and waits for the next
        # learner, whose first version it then gets.
        sender.close()
        wait_for(lambda: not late.connected.is_set() and not receivers[1].connected.is_set(), 30, 0.01, "goodbye")
        sender = DirectSender(tmp_path, "gloo", host="127.0.0.1", timeout_s=60)
        assert late.connected.wait(30) and receivers[1].connected.wait(30)
        sender.send(3, state_of(4))
        sender.flush()
        assert wait_for(lambda: weights.load_if_newer(policy.model, have=2), 30, 0.01, "v3 from a new learner") == 3
    finally:
        # Nothing left to interpreter teardown: a gloo pair destroyed there aborted pytest at exit.
        for r in [*receivers, late]:
            if r is not None:
                r.close(timeout_s=60)
                assert not r._thread.is_alive()
        sender.close()


def test_direct_streams_buckets_and_an_aborted_or_unannounced_version_is_never_staged(tmp_path):
    sender = DirectSender(tmp_path, "gloo", host="127.0.0.1", timeout_s=60)
    recv = DirectReceiver(tmp_path, "gen-0", timeout_s=60)
    try:
        assert recv.connected.wait(30)
        one, two = state_of(5, torch.bfloat16), state_of(6, torch.bfloat16)
        names = list(one)
        parts = (names[:2], names[2:])
        layout = [[(n, one[n].dtype, one[n].shape) for n in part] for part in parts]
        feed = sender.stream(1, layout)
        feed.put(Bucket.of({n: one[n] for n in names[:2]}))
        feed.abort()  # the gather failed after one bucket: the receiver drops it
        feed = sender.stream(2, layout)
        feed.put(Bucket.of({n: one[n] for n in parts[1]}))  # not the bucket announced: dropped too
        feed.close()
        feed = sender.stream(3, layout)
        for part in parts:  # buckets go out as they are put
            feed.put(Bucket.of({n: two[n] for n in part}))
        feed.close()
        sender.flush()
        version, got = wait_for(recv.take, 30, 0.01, "version 3")
        assert version == 3 and got.keys() == two.keys() and all(torch.equal(got[k], two[k]) for k in two)
    finally:
        recv.close(timeout_s=60)
        sender.close()


def _equal(model, state) -> bool:
    have = full_state_dict(model)
    return have.keys() == state.keys() and all(torch.equal(have[k], v) for k, v in state.items())


def _inside(model, buffers) -> bool:
    """Every parameter's memory lies in one of `buffers` (it is a view, not a copy)."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
    return all(any(a <= p.data_ptr() < z for a, z in spans) for p in model.parameters())


def test_direct_swap_binds_the_model_to_the_received_set_and_never_shows_a_partial_version(tmp_path):
    """Each version lands in the set of buffers the model does not use; the swap makes the
    parameters views of it (no copy; tied ones stay one tensor); the next version takes the
    other set. Half a version in, the model still holds the previous one, and over many
    versions no buffer is added."""
    sender = DirectSender(tmp_path, "gloo", host="127.0.0.1", timeout_s=60)
    recv = DirectReceiver(tmp_path, "gen-0", timeout_s=60)
    model = Policy.load(TINY, seed=0).model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # TINY ties them
    weights = DirectWeights(WeightStore(tmp_path), recv)
    try:
        assert recv.connected.wait(30)
        names = list(state_of(0))
        parts = (names[:3], names[3:])
        prev, live, ptrs = None, [], []
        for v in range(1, 7):
            want = state_of(10 + v)
            feed = sender.stream(v, [[(n, want[n].dtype, want[n].shape) for n in part] for part in parts])
            first = Bucket.of({n: want[n] for n in parts[0]})
            feed.put(first)
            if prev is not None:  # the first bucket is in; the model still reads the previous version
                other = recv._sets[1 - recv._live]
                landed = lambda other=other, first=first: other and torch.equal(other[0], first.buffer)
                wait_for(landed, 30, 0.01, f"v{v}'s first bucket")
                assert _equal(model, prev) and not _inside(model, other)
            feed.put(Bucket.of({n: want[n] for n in parts[1]}))
            feed.close()
            assert wait_for(lambda v=v: weights.load_if_newer(model, v - 1), 30, 0.01, f"v{v}") == v
            assert _equal(model, want) and model.lm_head.weight is model.model.embed_tokens.weight
            assert _inside(model, recv._sets[recv._live])
            live.append(recv._live)
            ptrs.append(sorted(b.data_ptr() for s in recv._sets for b in s))
            prev = want
        assert live == [0, 1, 0, 1, 0, 1]
        assert all(p == ptrs[1] and len(p) == 4 for p in ptrs[1:])  # two sets of two buckets, reused
    finally:
        recv.close(timeout_s=60)
        sender.close()


def test_sharing_swap_copies_what_it_cannot_bind_and_changes_nothing_on_a_mismatch():
    model = Policy.load(TINY, seed=0).model
    before = full_state_dict(model)
    bad = state_of(1)
    last = list(bad)[-1]
    bad[last] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        copy_state(model, bad, "v1", share=True)
    assert _equal(model, before)  # checked before anything was bound
    half = state_of(2, torch.bfloat16)  # another dtype than the model's: copied and converted
    copy_state(model, half, "v2", share=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert _equal(model, {k: v.float() for k, v in half.items()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_direct_on_a_gpu_receives_on_the_device_and_binds_there(tmp_path):
    """The receive sets are on the generator's GPU and the swap binds the model there."""
    cuda = torch.device("cuda")
    sender = DirectSender(tmp_path, "gloo", device=cuda, host="127.0.0.1", timeout_s=60)
    recv = DirectReceiver(tmp_path, "gen-0", device=cuda, timeout_s=60)
    model = Policy.load(TINY, seed=0).model.to(cuda)
    weights = DirectWeights(WeightStore(tmp_path), recv)
    try:
        assert recv.connected.wait(30)
        for v in (1, 2, 3):
            want = state_of(20 + v)
            sender.send(v, want)
            assert wait_for(lambda v=v: weights.load_if_newer(model, v - 1), 30, 0.01, f"v{v}") == v
            assert all(b.device.type == "cuda" for s in recv._sets for b in s)
            assert _inside(model, recv._sets[recv._live]) and _equal(model, want)
    finally:
        recv.close(timeout_s=60)
        sender.close()


@pytest.mark.parametrize("sync", ["file", "direct"])
def test_learner_publishes_with_either_path(tmp_path, sync):
    """A one-rank learner in a subprocess publishes v0.. as shards; with direct a receiver here gets them."""
    import subprocess
    import sys

    from hpcrl.core.config import dump_config, load_config

    cfg = tmp_path / "c.yaml"
    overrides = ["policy.device=cpu", "policy.tiny.hidden_size=32", "policy.tiny.num_heads=2"]
    cfg.write_text(dump_config(load_config(None, [*overrides, f"policy.weight_sync={sync}"])))
    recv = DirectReceiver(tmp_path / "run", "gen-0", timeout_s=60) if sync == "direct" else None
    code = (
        "import sys; from hpcrl.core.config import load_config; from hpcrl.rl.learner.learner import Learner\n"
        "c = load_config(sys.argv[1]); l = Learner(c.learner, c.policy, sys.argv[2], seed=0); l.setup()\n"
        "import time; t = time.time() + 60\n"
        "while l.direct is not None and not l.direct.members and time.time() < t:\n"
        "    time.sleep(0.05)\n"
        "l.version = 1; l.publish(); l.close()\n"
    )
    done = threading.Event()

    def release_v0():  # a receiver that joined before setup's publish gets v0 first: let v1 in
        while not done.is_set():
            got = recv.take()
            if got is not None and got[0] < 1:
                recv.release()
            time.sleep(0.01)

    releaser = threading.Thread(target=release_v0, daemon=True) if recv is not None else None
    if releaser is not None:
        releaser.start()
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, "-c", code, str(cfg), str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = WeightStore(tmp_path / "run")
    if releaser is not None:
        wait_for(lambda: (g := recv.take()) is not None and g[0] == 1, 30, 0.01, "direct version 1")
        done.set()
        releaser.join()
    assert store.latest()[0] == 1 and store.read(0).keys() == store.read(1).keys()
    if recv is not None:
        got = wait_for(recv.take, 30, 0.01, "direct version")
        assert got[0] == 1 and got[1].keys() == store.read(1).keys()
        recv.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
