"""Trajectory transport throughput: the acknowledged CURVE path vs raw pyzmq PUSH/PULL.

    .venv/bin/python bench/transport.py [--count 20000] [--repeat 5] [--flush-every 64]

Every variant moves the same trajectories (synthetic, multi-step, ~4k tokens each) from this
process to a receiver process over TCP on 127.0.0.1; the clock runs from the first send
until the sender knows the last one arrived.

* raw:    PUSH -> PULL, one message per trajectory (a msgpack header and its three arrays,
          encoded before the clock starts), no security, no decoding; the receiver reports
          once it got them all.
* raw+curve: the same with CURVE encryption (no ZAP, no decoding): what the crypto alone costs.
* acked:  TrajectorySender (DEALER, CURVE) -> TrajectoryReceiver (ROUTER, CURVE, ZAP). The
          sender encodes on the clock and sends batches (up to 128 trajectories or 1 MiB per
          message, as Columns); the receiver checks every trajectory (Columns.row_errors),
          deduplicates by id and acknowledges per flush of --flush-every; the clock stops when
          the sender holds no unacknowledged one.
          The receiver's sink keeps trajectories in memory ("flush" = hand back the ids), so
          this times the transport, not the disk; `acked+hdf5` adds the real ShardWriter.

Each variant runs --repeat times, interleaved; medians and the ratio are printed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from hpcrl.core.transport import Node
from hpcrl.core.wire import encode
from hpcrl.rl.record.columns import Columns
from hpcrl.rl.record.synth import synth_trajectory
from hpcrl.rl.store.stream import TrajectoryReceiver, TrajectorySender
from hpcrl.rl.store.writer import FlushResult


class MemorySink:
    """The ShardWriter interface without a disk: a flush acknowledges the buffered ids."""

    def __init__(self, flush_every: int, interval_s: float = 0.05):
        self.flush_every = flush_every
        self.interval_s = interval_s
        self.buffer: list[str] = []
        self.oldest = 0.0
        self.stored: set[str] = set()
        self.total = 0

    def append_columns(self, cols):
        if not self.buffer:
            self.oldest = time.monotonic()
        self.buffer.extend(cols.ids())
        return self.flush() if len(self.buffer) >= self.flush_every else None

    def flush(self):
        if not self.buffer:
            return None
        ids, self.buffer = tuple(self.buffer), []
        self.stored.update(ids)
        self.total += len(ids)
        return FlushResult((), ids, 0, self.total)

    def poll(self):
        return self.flush() if self.seconds_to_flush() == 0.0 else None

    def seconds_to_flush(self):
        return max(0.0, self.interval_s - (time.monotonic() - self.oldest)) if self.buffer else None

    def stored_mask(self, ids):
        return [tid in self.stored for tid in ids]

    def is_pending(self, tid):
        return tid in self.buffer

    def close(self):
        return self.flush()


def payloads(count: int) -> list:
    rng = np.random.default_rng(0)
    return [synth_trajectory(rng, "bench", "gen-0", i) for i in range(count)]


def raw_receiver(port_q, n: int, server_secret: bytes | None = None) -> None:
    ctx = zmq.Context()
    pull, done = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    if server_secret:  # CURVE without ZAP: encryption cost only
        pull.curve_server = True
        pull.curve_secretkey = server_secret
    port_q.put(pull.bind_to_random_port("tcp://127.0.0.1"))
    done.connect(f"tcp://127.0.0.1:{port_q.get()}")
    for _ in range(n):
        pull.recv_multipart(copy=False)
    done.send(b"done")
    done.close(linger=1000)
    ctx.destroy()


def acked_receiver(run_dir: str, flush_every: int, hdf5: bool, ready, stop) -> None:
    from hpcrl.core.config import StoreConfig
    from hpcrl.rl.store.writer import ShardWriter

    sink = (
        ShardWriter(
            Path(run_dir) / "trajectories", "store-0", StoreConfig(flush_every=flush_every, flush_interval_s=0.05)
        )
        if hdf5
        else MemorySink(flush_every)
    )
    with Node(run_dir, "store-0", bind_host="127.0.0.1") as node:
        receiver = TrajectoryReceiver(node, "store", sink)
        ready.set()
        while not stop.is_set():
            receiver.poll_once(0.05)
        sink.close()


def run_raw(frames: list[list], ctx, curve: bool = False) -> float:
    q = ctx.Queue()
    server_public, server_secret = zmq.curve_keypair()
    proc = ctx.Process(target=raw_receiver, args=(q, len(frames), server_secret if curve else None))
    proc.start()
    port = q.get()
    zctx = zmq.Context()
    push, done = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
    if curve:
        push.curve_serverkey = server_public
        push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
    back = done.bind_to_random_port("tcp://127.0.0.1")
    q.put(back)
    push.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.2)  # let the connection come up: the clock is for moving bytes
    t0 = time.perf_counter()
    for f in frames:
        push.send_multipart(f)  # pyzmq's fastest plain call for frames of a few kB
    done.recv()
    dt = time.perf_counter() - t0
    proc.join()
    zctx.destroy(linger=0)
    return dt


def run_acked(trajs: list, flush_every: int, ctx, hdf5: bool = False) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix="hpcrl-bench-transport-"))
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=acked_receiver, args=(str(run_dir), flush_every, hdf5, ready, stop))
    proc.start()
    ready.wait(60)
    try:
        with Node(run_dir, "gen-0") as node:
            sender = TrajectorySender(node, "store", max_unacked=4 * flush_every * 8)
            time.sleep(0.2)  # CURVE handshake done before the clock starts, as for raw
            t0 = time.perf_counter()
            for i, t in enumerate(trajs):
                sender.send(t)
                if i % 16 == 0:
                    sender.pump()
            assert sender.wait_acked(120), f"{sender.unacked} unacknowledged"
            dt = time.perf_counter() - t0
            assert sender.acked == len(trajs) and sender.resent == 0
            sender.close()
    finally:
        stop.set()
        proc.join(60)
        shutil.rmtree(run_dir, ignore_errors=True)
    return dt


def raw_message(traj) -> list:
    """The raw baseline's message for one trajectory: its bytes in the wire layout (the two small
    record tables inside the msgpack header, the three flat arrays as frames of their own), four
    frames as a trajectory took before the wire sent Columns."""
    body, arrays = Columns.encode([traj]).to_wire()
    body["tables"] = [bytes(arrays[0]), bytes(arrays[1])]
    return encode("traj", body, arrays[2:], msg_id=traj.id)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Enough for ~0.3 s of raw traffic: the last partial flush and the connection's ramp-up
    # must not dominate the clock.
    p.add_argument("--count", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--flush-every", type=int, default=64)
    p.add_argument("--with-hdf5", action="store_true", help="also time acked delivery into the real ShardWriter")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    trajs = payloads(args.count)
    frames = [raw_message(t) for t in trajs]
    nbytes = sum(sum(memoryview(f).nbytes for f in fr) for fr in frames)
    print(
        f"{args.count} trajectories, {nbytes / args.count / 1e3:.1f} kB and {len(frames[0])} frames each (avg "
        f"{sum(map(len, frames)) / len(frames):.1f}), {nbytes / 1e6:.1f} MB; ack per {args.flush_every}"
    )
    times: dict[str, list[float]] = {"raw": [], "raw+curve": [], "acked": []}
    if args.with_hdf5:
        times["acked+hdf5"] = []
    for _ in range(args.repeat):
        times["raw"].append(run_raw(frames, ctx))
        times["raw+curve"].append(run_raw(frames, ctx, curve=True))
        times["acked"].append(run_acked(trajs, args.flush_every, ctx))
        if args.with_hdf5:
            times["acked+hdf5"].append(run_acked(trajs, args.flush_every, ctx, hdf5=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'variant':<12} {'median s':>9} {'MB/s':>8} {'traj/s':>8}")
    for k, v in med.items():
        print(f"{k:<12} {v:>9.3f} {nbytes / v / 1e6:>8.1f} {args.count / v:>8.0f}")
    best = {k: min(v) for k, v in times.items()}
    print(
        f"ratio acked CURVE / raw PUSH-PULL   {med['raw'] / med['acked']:.2f}   "
        f"(target >= 0.50; best-of-{args.repeat}: {best['raw'] / best['acked']:.2f})"
    )
    print(f"ratio acked CURVE / raw+CURVE       {med['raw+curve'] / med['acked']:.2f}   (the application layer alone)")
    print(f"ratio raw+CURVE / raw PUSH-PULL     {med['raw'] / med['raw+curve']:.2f}   (encryption alone)")
    if args.with_hdf5:
        print(f"ratio acked+hdf5 / raw PUSH-PULL    {med['raw'] / med['acked+hdf5']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
