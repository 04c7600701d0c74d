"""Filesystem faults under the shard writer: a failed directory fsync, ENOSPC, an HDF5
error at close. Whatever fails, nothing unproven is acknowledged, no sequence number names two
files, nothing is stored twice or lost, and the writer never ends up unusable by accident."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hpcrl.core.config import StoreConfig
from hpcrl.rl.record.synth import SynthShape, synth_trajectory
from hpcrl.rl.store.layout import StoreError, list_shards, parse_segment_name, read_segment
from hpcrl.rl.store.reader import StoreReader
from hpcrl.rl.store.writer import ShardWriter, WriterStopped

SMALL = SynthShape(first_prompt=(20, 60), later_prompt=(2, 8), action=(10, 60), observation=(0, 40))


def make(n: int, start: int = 0):
    rng = np.random.default_rng(start)
    return [synth_trajectory(rng, "r", "g", start + i, SMALL) for i in range(n)]


def cfg(**kw) -> StoreConfig:
    return StoreConfig(
        **{"flush_every": 2, "flush_interval_s": 30.0, "flush_idle_s": 30.0, "shard_max_rows": 10_000, **kw}
    )


def deliver(store: Path, trajs, config: StoreConfig, on_writer=None, attempts: int = 6) -> set[str]:
    """What a sender does: send everything, keep what is unacknowledged, and on a StoreError
    flush again; when the writer says it stopped, start a new one (same name) and resend.
    Returns the acknowledged ids."""
    acked: set[str] = set()
    pending = list(trajs)
    for _ in range(attempts):
        w = ShardWriter(store, "w0", config)
        if on_writer:
            on_writer(w)
        try:
            for t in pending:
                if r := w.append(t):
                    acked.update(r.ids)
            for _ in range(attempts):
                try:
                    if r := w.close():
                        acked.update(r.ids)
                    break
                except WriterStopped:
                    raise
                except StoreError:
                    continue  # "kept in memory ... flush again"
            else:
                raise AssertionError("the writer never closed")
            return acked
        except WriterStopped:
            pending = [t for t in pending if t.id not in acked]
    raise AssertionError("no writer got the trajectories stored")


def check_store(store: Path, acked: set[str], expected: set[str]) -> None:
    """Each sequence number names one file per shard, no trajectory is in two visible segments,
    everything acknowledged (and, once delivered, everything) is read back exactly once."""
    seen: Counter[str] = Counter()
    for state in list_shards(store):
        seqs = [parse_segment_name(n)[0] for n in state.segment_names]
        assert len(seqs) == len(set(seqs)), f"{state.name}: a sequence number names two files: {state.segment_names}"
        assert state.finalized, state.name
        for name in state.segment_names:  # listed or not: a later recovery would list them all
            seen.update(read_segment(state.path / name).ids())
    assert not [i for i, c in seen.items() if c > 1], "stored twice"
    got = [t.id for t in StoreReader(store)]
    assert len(got) == len(set(got)) and set(got) == expected and acked <= set(got)


def test_failed_directory_fsync_reuses_no_sequence_number_and_duplicates_nothing(tmp_path, monkeypatch):
    """The renames of a group are done, the directory fsync after them fails: those segments are
    visible but not proven durable. Before: the writer took their records back, reused their
    sequence numbers for the rewrite, and the shard held two seg-000001 files (one of them
    skipped by the reader, both listed after a crash)."""
    import hpcrl.rl.store.sync as sync_mod

    real = sync_mod.fsync_path
    failures = {"left": 1}

    def fsync_path(path, directory=False):
        if directory and failures["left"] and any(Path(path).glob("seg-*.h5")):
            failures["left"] -= 1
            raise OSError(errno.EIO, "injected: directory fsync failed")
        return real(path, directory)

    monkeypatch.setattr(sync_mod, "fsync_path", fsync_path)
    trajs = make(7)
    acked = deliver(tmp_path, trajs, cfg())
    assert failures["left"] == 0
    check_store(tmp_path, acked, {t.id for t in trajs})


def test_a_stopped_writer_refuses_everything_and_hands_its_shard_over(tmp_path, monkeypatch):
    import hpcrl.rl.store.sync as sync_mod

    real = sync_mod.fsync_path
    monkeypatch.setattr(
        sync_mod,
        "fsync_path",
        lambda path, directory=False: (
            (_ for _ in ()).throw(OSError(errno.EIO, "injected"))
            if directory and any(Path(path).glob("seg-*.h5"))
            else real(path, directory)
        ),
    )
    w = ShardWriter(tmp_path, "w0", cfg())
    trajs = make(4)
    w.append(trajs[0])
    with pytest.raises(WriterStopped, match="not proven durable"):
        w.append(trajs[1])
        w.flush()
    for call in (lambda: w.append(trajs[2]), w.flush, w.poll, w.close):
        with pytest.raises(WriterStopped):
            call()
    assert w.total_rows == 0  # nothing acknowledged
    monkeypatch.setattr(sync_mod, "fsync_path", real)
    w2 = ShardWriter(tmp_path, "w0", cfg())  # same process: the stopped writer's shard is free
    assert [r.rows for r in w2.recovered] == [2]  # the visible, unproven segment is kept...
    assert w2.is_stored(trajs[0].id) and w2.append(trajs[1]) is None  # ...and its rows deduplicated
    w2.close()


def test_failed_sync_before_the_rename_takes_the_batches_back_under_new_numbers(tmp_path, monkeypatch):
    """A segment that never became visible: its records go back to the buffer; its sequence
    number is not used again (a number names at most one file, ever)."""
    import threading

    import hpcrl.rl.store.sync as sync_mod

    real = sync_mod.create_segment

    def first_fails(tmp, *args):
        if tmp.name.startswith("seg-000001-"):
            raise OSError(errno.EIO, "injected: the first segment cannot be written")
        return real(tmp, *args)

    monkeypatch.setattr(sync_mod, "create_segment", first_fails)
    w = ShardWriter(tmp_path, "w0", cfg())
    trajs = make(6)
    gate = threading.Event()
    w._sync._pool.submit(gate.wait)  # hold the sync thread so two segments queue behind it
    assert [w.append(t) for t in trajs[:4]] == [None] * 4
    gate.set()
    with pytest.raises(StoreError, match="4 record\\(s\\) kept in memory \\(none acknowledged\\)"):
        w.flush()
    for t in trajs[4:]:
        w.append(t)
    assert w.flush().ids == tuple(t.id for t in trajs)
    w.close()
    [state] = list_shards(tmp_path)
    assert [parse_segment_name(s.name)[0] for s in state.manifest.segments] == [3, 4]
    assert [t.id for t in StoreReader(tmp_path)] == [t.id for t in trajs]
    assert not list(tmp_path.rglob("*.tmp"))


# -- ENOSPC and HDF5 errors ------------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "1m"):
    """A tmpfs of `size` mounted at `path` for the test (root only: skips otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave: int) -> None:
    """Fill the filesystem of `path` with one file, then give `leave` bytes back."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\1" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    try:
        while True:  # the last few KiB
            os.write(fd, b"\1" * 4096)
    except OSError:
        pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    os.close(fd)


def test_enospc_anywhere_leaves_the_writer_usable_and_nothing_behind(tmp_path, caplog):
    """A full disk at every point a flush can hit it (HDF5's create, the data, a rotation's
    manifest or the next shard's OWNER.json), found by leaving 0..96 KiB free: the writer
    raises StoreError only, leaves no .tmp behind, and once space is back stores everything
    exactly once with every shard finalized. Before: ENOSPC in a rotation left the writer
    without a shard (TypeError on every later call, close impossible, rows never stored)."""
    trajs = make(40)
    for leave in range(0, 100 * 1024, 4096):
        with small_tmpfs(tmp_path / f"mnt-{leave}") as mnt:
            store = mnt / "store"
            w = ShardWriter(store, "w0", cfg(flush_every=4, shard_max_rows=8))
            fill(mnt / "filler", leave)
            acked: set[str] = set()
            failures = 0
            for t in trajs:
                try:
                    if r := w.append(t):
                        acked.update(r.ids)
                except StoreError:
                    failures += 1
            for _ in range(2):
                try:
                    if r := w.flush():
                        acked.update(r.ids)
                except StoreError:
                    failures += 1
                # Nothing in flight after flush(): any .tmp left now would stay for good.
                assert not list(store.rglob("*.tmp")), f"{leave} bytes free: a failed flush left a .tmp behind"
            (mnt / "filler").unlink()
            for _ in range(3):  # the first call may still report the failure it collects
                try:
                    if r := w.close():
                        acked.update(r.ids)
                    break
                except StoreError:
                    continue
            assert w.closed, f"{leave} bytes free: the writer could not close once space was back"
            assert failures, f"{leave} bytes free: the disk never filled"
            check_store(store, acked, {t.id for t in trajs})
            assert not list(store.rglob("*.tmp")) and not list(store.rglob(".*"))


def test_an_hdf5_error_at_close_leaves_no_tmp_and_keeps_the_records(tmp_path):
    """HDF5 extends a segment to its allocated end when it closes the file; under a file-size
    limit that fails inside H5Fclose. Before: h5py's RuntimeError came out as it was and the
    .tmp stayed forever. Now: StoreError, no .tmp, and the records are written once it can."""
    script = textwrap.dedent(f"""
        import resource, signal, numpy as np
        from pathlib import Path
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit makes the call fail instead
        from hpcrl.core.config import StoreConfig
        from hpcrl.rl.store.layout import StoreError
        from hpcrl.rl.store.writer import ShardWriter
        from hpcrl.rl.record.synth import SynthShape, synth_trajectory
        shape = SynthShape(first_prompt=(20, 60), later_prompt=(2, 8), action=(10, 60), observation=(0, 40))
        rng = np.random.default_rng(0)
        store = Path({str(tmp_path / "store")!r})
        w = ShardWriter(store, "w0", StoreConfig(flush_every=8))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
        try:
            for i in range(8):
                w.append(synth_trajectory(rng, "r", "g", i, shape))
            w.flush()
        except StoreError as exc:
            print("StoreError", "RuntimeError" in str(exc))
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        print("tmp", len(list(store.rglob("*.tmp"))))
        print("closed", w.close().total_rows)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["StoreError", "True", "tmp", "0", "closed", "8"], done.stdout
    assert len(list(StoreReader(tmp_path / "store"))) == 8


def test_a_failed_directory_fsync_after_the_manifest_is_retried_not_taken_for_a_fence(tmp_path, monkeypatch):
    """The manifest is linked in, the directory fsync after it fails: close raises, and the next
    close finds the manifest there. It is this writer's own: it redoes the fsync and closes,
    instead of reading the manifest as a newer writer's fence and stopping."""
    import hpcrl.rl.store.layout as layout_mod

    real = layout_mod.fsync_path
    failures = {"left": 1}

    def fsync_path(path, directory=False):
        if directory and failures["left"] and (Path(path) / "MANIFEST.json").exists():
            failures["left"] -= 1
            raise OSError(errno.EIO, "injected: directory fsync after the manifest failed")
        return real(path, directory)

    monkeypatch.setattr(layout_mod, "fsync_path", fsync_path)
    w = ShardWriter(tmp_path, "w0", cfg())
    trajs = make(4)
    acked = set()
    for t in trajs:
        if r := w.append(t):
            acked.update(r.ids)
    with pytest.raises(StoreError, match="failed"):
        w.close()
    assert failures["left"] == 0
    if r := w.close():  # not WriterStopped
        acked.update(r.ids)
    check_store(tmp_path, acked, {t.id for t in trajs})
