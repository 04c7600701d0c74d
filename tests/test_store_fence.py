"""A writer stalled past its lease is fenced: it cannot publish anything once a newer
writer has recovered its shard, so nothing it acknowledges is ever missing from the store.

The stalled writer is a real process (SIGSTOP, as a debugger, a hung NFS/Lustre call or an
overloaded node would stop it) that runs "on another host" (its hostname is faked, so the
new writer judges it by its heartbeat, not its pid) with a 1 s lease. It stops itself right
before or right after renaming its third segment into place, the test waits until its
heartbeat is older than the lease (a condition, not a fixed time), recovers its shard with a
new writer, and lets it continue.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import numpy as np
import pytest

from hpcrl.core.config import StoreConfig
from hpcrl.rl.record.synth import TINY_SHAPE, synth_trajectory
from hpcrl.rl.store.layout import FENCE_NAME, OWNER_NAME, list_shards, read_segment
from hpcrl.rl.store.reader import StoreReader
from hpcrl.rl.store.writer import ShardWriter

LEASE_S = 1.0
DEADLINE_S = 120.0
N = 40

STALE = textwrap.dedent("""
    import os, signal, socket, sys, threading
    socket.gethostname = lambda: "elsewhere"  # another host: judged by its heartbeat
    import numpy as np
    from hpcrl.core.config import StoreConfig
    from hpcrl.rl.store.layout import StoreError, WriterStopped
    from hpcrl.rl.store.writer import ShardWriter
    from hpcrl.rl.record.synth import TINY_SHAPE, synth_trajectory
    store, when, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def say(*words):  # one write() per line: the sync thread and the main thread both print
        os.write(1, (" ".join(words) + chr(10)).encode())
    def stop():  # this very thread takes the SIGSTOP: it cannot run one more system call first
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    real_rename = os.rename
    def rename(src, dst):  # the sync thread's rename of the third segment stops the process
        third = os.path.basename(str(dst)).startswith("seg-000003-")
        if third and when == "before":
            say("stopping"); stop()
        real_rename(src, dst)
        if third and when == "after":
            say("stopping"); stop()
    os.rename = rename
    rng = np.random.default_rng(0)
    w = ShardWriter(store, "w0", StoreConfig(flush_every=2, flush_interval_s=30.0, flush_idle_s=30.0,
                                             lease_s=%(lease)r))
    def report(r):
        if r:
            say("acked", *r.ids)
    try:  # as the store service does: a StoreError is logged and the next call retries
        for i in range(n):
            try:
                report(w.append(synth_trajectory(rng, "r", "g", i, TINY_SHAPE)))
            except StoreError as exc:
                if isinstance(exc, WriterStopped):
                    raise
                say("error", str(exc)[:200].replace(chr(10), " "))
        sys.stdin.readline()  # a service still running: it closes only when told (never, here)
        for _ in range(5):
            try:
                report(w.close())
                break
            except StoreError as exc:
                if isinstance(exc, WriterStopped):
                    raise
                say("error", str(exc)[:200].replace(chr(10), " "))
    except WriterStopped as exc:
        say("stopped", str(exc).replace(chr(10), " "))
        sys.exit(3)
""") % {"lease": LEASE_S}


def all_trajs():
    rng = np.random.default_rng(0)
    return [synth_trajectory(rng, "r", "g", i, TINY_SHAPE) for i in range(N)]


class Output:
    """The stale writer's stdout, read on a thread so that every wait has a deadline."""

    def __init__(self, proc):
        self.proc, self.lines, self._cond = proc, [], threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # end of output
            self._cond.notify_all()

    def until(self, start: int, done, what: str) -> list[str]:
        """The lines from `start` on, once `done(lines)` holds for them (or the output ends)."""
        deadline = time.monotonic() + DEADLINE_S
        with self._cond:
            while True:
                new = self.lines[start:]
                if None in new or done(new):
                    return [line for line in new if line is not None]
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"the stale writer never printed {what} in {DEADLINE_S:.0f} s: {self.lines[-20:]}")
                self._cond.wait(left)


def acked_in(lines: list[str]) -> list[str]:
    return [tid for line in lines if line.startswith("acked") for tid in line.split()[1:]]


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_writer_stalled_past_its_lease_cannot_publish_after_it_is_fenced(tmp_path, when):
    """Before: the stale writer renamed its segment into the recovered shard and acknowledged
    it (and the ones after); the new writer's manifest did not list them, so the reader never
    returned them: acknowledged data lost."""
    store = tmp_path / "store"
    env = {**os.environ, "HDF5_USE_FILE_LOCKING": "FALSE"}
    stale = subprocess.Popen(
        [sys.executable, "-c", STALE, str(store), when, str(N)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out = Output(stale)
    try:
        first = out.until(0, lambda lines: "stopping" in lines, "its stop")
        acked = acked_in(first)
        [shard] = list_shards(store)
        owner = shard.path / OWNER_NAME
        wait_until(lambda: time.time() - owner.stat().st_mtime > LEASE_S, "the stale writer's lease to expire")
        new = ShardWriter(
            store, "w0", StoreConfig(flush_every=2, flush_interval_s=30.0, flush_idle_s=30.0, lease_s=LEASE_S)
        )
        assert [r.shard for r in new.recovered] == [shard.name]  # the lease expired: recovered
        assert (shard.path / FENCE_NAME).exists()
        new.close()
        stale.send_signal(signal.SIGCONT)
        # It runs on until it stops by itself (fenced), or acknowledges 10 more (the defect).
        rest = out.until(
            len(first),
            lambda lines: bool(lines) and (lines[-1].startswith("stopped") or len(acked_in(lines)) >= 10),
            "that it stopped, or 10 more acknowledgements",
        )
        acked += acked_in(rest)
        if rest and rest[-1].startswith("stopped"):
            stale.wait(DEADLINE_S)  # it exits by itself
    finally:
        if stale.poll() is None:
            stale.kill()  # it crashes after it acknowledged: what it acknowledged must be stored
        stale.wait(DEADLINE_S)
    stored = {t.id for t in StoreReader(store)}
    lost = [tid for tid in acked if tid not in stored]
    assert not lost, f"acknowledged by the fenced writer but not in the store: {lost}"
    assert rest[-1].startswith("stopped") and "fenced" in rest[-1] and stale.returncode == 3, rest
    # Its senders resend everything unacknowledged to the writer that replaced it: each
    # trajectory is then stored exactly once.
    final = ShardWriter(
        store, "w0", StoreConfig(flush_every=2, flush_interval_s=30.0, flush_idle_s=30.0, lease_s=LEASE_S)
    )
    for t in all_trajs():
        if t.id not in acked:
            final.append(t)
    final.close()
    ids: Counter[str] = Counter()
    for state in list_shards(store):
        assert state.finalized, state.name
        assert [s.name for s in state.manifest.segments] == state.segment_names, "a file outside the manifest"
        for name in state.segment_names:
            ids.update(read_segment(state.path / name).ids())
    assert sorted(ids) == sorted(t.id for t in all_trajs()) and set(ids.values()) == {1}


def test_a_writer_elsewhere_within_its_lease_keeps_its_shard(tmp_path):
    """The lease decides across hosts: a writer on another host whose heartbeat is fresh keeps
    its shard (the name is refused, nothing is fenced); once it is older than the lease, the
    shard is fenced and recovered."""
    from hpcrl.rl.store.layout import StoreError

    shard = tmp_path / "w0.20261203T000000u000000.elsewhere.12345.abcd1234"
    shard.mkdir()
    (shard / OWNER_NAME).write_text("{}")
    with pytest.raises(StoreError, match="heartbeat"):
        ShardWriter(tmp_path, "w0", StoreConfig(lease_s=60.0))
    assert not (shard / FENCE_NAME).exists()  # refused before fencing anything
    old = time.time() - 120
    os.utime(shard / OWNER_NAME, (old, old))
    w = ShardWriter(tmp_path, "w0", StoreConfig(lease_s=60.0))
    assert [r.shard for r in w.recovered] == [shard.name] and w.recovered[0].removed  # empty: removed
    w.close()
