"""Seconds per policy version for the two weight paths, against the raw transport.

    python bench/weight_sync.py [--hidden 1024 --layers 8 --vocab 32000] [--dtype bfloat16] [--rounds 5] [--json]

A Llama of >= 100M parameters (random init, built here), its weights in the policy dtype and
gathered, as the learner does, into flat host buckets of at most 64M parameters each:

* file_s: the learner's shard write and announcement (`WeightStore.write_shard` +
  `finish_version`) + a generator's `load_if_newer` (map + swap into its model), per version;
  removing old versions, which the store does after announcing, is not timed (nor is the
  plain copy's unlink);
* file_copy_s: the same bytes as one flat buffer written to a file and read back into a tensor
  (what any file path costs at least);
* direct_s: `DirectSender.send` of the buckets to a `DirectReceiver` in another process until
  that process has swapped the version into its model (gloo over loopback on this machine);
* broadcast_raw_s: one flat buffer of the same bytes broadcast over a two-process gloo group;
* swap_s: a background generator's pause for one swap (`last_swap_s`), against memcpy_s, one
  copy of the same bytes in memory; direct_swap_s: the receiving process's swap (part of
  direct_s), direct_send_s: the sending thread's time per version, direct_transfer_ratio: the
  direct path without its swap against the raw broadcast.

Before the rounds, untimed: the direct path's first two versions and the raw broadcast's first,
which touch their receive buffers for the first time (the receiver's two sets; a one-time cost,
reported as direct_warmup_s); the figures are per version of a long run. The four ways run
interleaved, one version of each per round, each path beside its baseline in turns (one first,
then the other), so a busy machine and the page cache's writeback slow them alike; the output
holds the medians of `--rounds` and, with --json, each round's ratios. Files go to --dir
(default: a temporary folder, i.e. the page cache of this machine's disk; a parallel filesystem
is slower to write and faster to read in parallel).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 2  # untimed direct versions first: one into each of the receiver's two buffer sets


def build(hidden: int, layers: int, vocab: int, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      tie_word_embeddings=False)  # fmt: skip
    with torch.device("cpu"):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).to(dtype)


def receiver(run_dir: str, hidden: int, layers: int, vocab: int, dtype_name: str, rounds: int) -> None:
    """Child: receive `rounds` versions directly, swap each into a model, say when done."""
    import torch

    from hpcrl.rl.weights.direct import DirectReceiver, DirectWeights
    from hpcrl.rl.weights.shards import WeightStore

    model = build(hidden, layers, vocab, getattr(torch, dtype_name))
    recv = DirectReceiver(run_dir, "bench", timeout_s=600)
    weights = DirectWeights(WeightStore(run_dir), recv)
    recv.connected.wait(120)
    print("ready", flush=True)
    have = 0
    while have < rounds + WARMUP:
        v = weights.load_if_newer(model, have)
        if v is not None and v > have:
            have = v
            print(f"swapped {v} {weights.last_swap_s:.6f}", flush=True)
        else:
            time.sleep(0.001)
    recv.close()
    os._exit(0)  # the receiving thread is parked in a gloo call; nothing to tear down


def raw_peer(port: int, nbytes: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=600))
    buf = torch.empty(nbytes, dtype=torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for _ in range(rounds + 1):  # one untimed first
        pg.broadcast([buf], opts).wait()
        pg.barrier().wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", help="folder for the files (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.rounds = 3
    if a.child:
        if a.child[0] == "recv":
            receiver(a.child[1], a.hidden, a.layers, a.vocab, a.dtype, a.rounds)
        else:
            raw_peer(int(a.child[1]), int(a.child[2]), a.rounds)
        return 0

    import torch
    import torch.distributed as dist

    from hpcrl.rl.model.policy import full_state_dict
    from hpcrl.rl.weights.direct import DirectSender
    from hpcrl.rl.weights.shards import Bucket, WeightStore

    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    model = build(a.hidden, a.layers, a.vocab, dtype)
    state = full_state_dict(model)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gen_model = build(a.hidden, a.layers, a.vocab, dtype)
    root = Path(a.dir or tempfile.mkdtemp(prefix="hpcrl-wsync-"))
    if a.dir is None:  # ~600 MB per run: gone at exit, an error included
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    child = [sys.executable, __file__, "--hidden", str(a.hidden), "--layers", str(a.layers), "--vocab", str(a.vocab),
             "--dtype", a.dtype, "--rounds", str(a.rounds), "--child"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")

    # As the learner gathers: one flat bucket per chunk of at most 64M parameters.
    buckets = Bucket.pack(state, 1 << 26)
    gathered = {k: v for b in buckets for k, v in b.tensors.items()}
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    back = torch.empty(nbytes, dtype=torch.uint8)

    store, watch = WeightStore(root / "file", keep=2), WeightStore(root / "file")
    bg = WeightStore(root / "file", background=True)
    direct_dir = root / "direct"
    sender = DirectSender(direct_dir, "gloo", host="127.0.0.1", timeout_s=600)
    proc = subprocess.Popen(child + ["recv", str(direct_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    peer = subprocess.Popen(child + ["raw", str(tcp.port), str(nbytes)], env=env)
    pg = dist.ProcessGroupGloo(tcp, 0, 2, datetime.timedelta(seconds=600))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0

    def direct(v: int) -> tuple[float, float]:
        """Send version `v` until the generator has swapped it in: (seconds, its swap's seconds)."""
        t0 = time.perf_counter()
        sender.send(v, buckets)
        line = proc.stdout.readline().split()
        assert line[:2] == ["swapped", str(v)], line
        return time.perf_counter() - t0, float(line[2])

    warmup_s = [direct(v)[0] for v in range(1, WARMUP + 1)]
    pg.broadcast([flat], opts).wait()
    pg.barrier().wait()

    file_s, write_s, read_s, copy_s, copy_write_s, direct_s, direct_swap_s, direct_send_s, raw_s, swap_s, memcpy_s = (
        [] for _ in range(11)
    )
    for v in range(1, a.rounds + 1):

        def file_path(v: int = v) -> None:
            # The learner's write, then a generator's map and swap.
            t0 = time.perf_counter()
            store.write_shard(gathered, v, 0)
            store.finish_version(v, 1, prune=False)  # announced
            t1 = time.perf_counter()
            assert watch.load_if_newer(gen_model, v - 1) == v
            t2 = time.perf_counter()
            store.prune(v)  # after the announcement, like the plain copy's unlink: not timed
            file_s.append(t2 - t0)
            write_s.append(t1 - t0)
            read_s.append(t2 - t1)

        def plain_copy() -> None:
            # The same bytes, plainly: one buffer to a file and back.
            path = root / "plain.bin"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                f.write(flat.numpy().data)
            t1 = time.perf_counter()
            with open(path, "rb") as f:
                f.readinto(back.numpy().data)
            copy_s.append(time.perf_counter() - t0)
            copy_write_s.append(t1 - t0)
            path.unlink()

        def direct_path(v: int = v) -> None:
            # To a generator process that swaps each version into its model.
            took, swap = direct(v + WARMUP)
            direct_s.append(took)
            direct_swap_s.append(swap)
            direct_send_s.append(sender.sent_s)

        def raw_broadcast() -> None:
            # One buffer of the same size.
            t0 = time.perf_counter()
            pg.broadcast([flat], opts).wait()
            pg.barrier().wait()
            raw_s.append(time.perf_counter() - t0)

        # Each way and its baseline in turns, first one then the other: what one step leaves
        # behind (the page cache writing back the files just written) slows both alike.
        steps = [file_path, plain_copy, direct_path, raw_broadcast]
        if v % 2 == 0:
            steps = [plain_copy, file_path, raw_broadcast, direct_path]
        for step in steps:
            step()

        # A background generator's pause (mapped and pre-faulted on its thread) against a memcpy.
        while bg.load_if_newer(gen_model, v - 1) is None:
            time.sleep(0.001)
        swap_s.append(bg.last_swap_s)
        t0 = time.perf_counter()
        back.copy_(flat)
        memcpy_s.append(time.perf_counter() - t0)
    proc.wait(60)
    peer.wait(60)
    sender.close()

    med = statistics.median
    out = {
        "params": params,
        "bytes": nbytes,
        "dtype": a.dtype,
        "file_s": round(med(file_s), 3),
        "file_write_s": round(med(write_s), 3),
        "file_read_swap_s": round(med(read_s), 3),
        "file_copy_s": round(med(copy_s), 3),
        "file_copy_write_s": round(med(copy_write_s), 3),
        "direct_s": round(med(direct_s), 3),
        "direct_swap_s": round(med(direct_swap_s), 3),  # the receiving generator's swap (binds, copies nothing)
        "direct_send_s": round(med(direct_send_s), 3),  # the sending thread's time for the version
        "direct_warmup_s": [round(x, 3) for x in warmup_s],  # the first two versions, untimed above
        "broadcast_raw_s": round(med(raw_s), 3),
        "swap_s": round(med(swap_s), 3),
        "memcpy_s": round(med(memcpy_s), 3),
        "rounds": a.rounds,
        "file_ratio": round(med(file_s) / med(copy_s), 2),
        "direct_ratio": round(med(direct_s) / med(raw_s), 2),
        # Each round's own ratios (both ways ran back to back): the spread a busy machine gives.
        "file_ratio_by_round": [round(x / y, 2) for x, y in zip(file_s, copy_s)],
        "direct_ratio_by_round": [round(x / y, 2) for x, y in zip(direct_s, raw_s)],
        # The same without the receiver's swap (which binds the model to the received buffers).
        "direct_transfer_ratio": round(med([(x - w) / y for x, w, y in zip(direct_s, direct_swap_s, raw_s)]), 2),
    }
    if a.json:
        print(json.dumps(out))
    else:
        gb = nbytes / 1e9
        print(f"{params / 1e6:.0f}M parameters, {gb:.2f} GB in {a.dtype}, median of {a.rounds}")
        for k in ("file_s", "file_copy_s", "direct_s", "broadcast_raw_s", "swap_s", "memcpy_s"):
            print(f"  {k:16s} {out[k]:7.3f} s   {gb / max(out[k], 1e-9):6.2f} GB/s")
        print(
            f"  (file: write {out['file_write_s']:.3f} s, map + swap {out['file_read_swap_s']:.3f} s;"
            f" plain write {out['file_copy_write_s']:.3f} s; direct: send {out['direct_send_s']:.3f} s,"
            f" swap {out['direct_swap_s']:.3f} s)"
        )
        print(
            f"  file / copy {out['file_ratio']:.2f}x (rounds {out['file_ratio_by_round']}),"
            f" direct / broadcast {out['direct_ratio']:.2f}x (rounds {out['direct_ratio_by_round']}),"
            f" without the swap {out['direct_transfer_ratio']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
