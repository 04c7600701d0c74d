"""The shard writer's sync thread: it makes segments durable and visible, in order, in groups.

    sync = SyncThread("hpcrl-store-w0")
    sync.hand_over(item)        # an InFlight whose HDF5 structure is written (caller's thread)
    item.future.result()        # None: filled, fsynced, renamed, directory fsynced, not fenced
    sync.failed                 # set once one failed: later segments are not renamed
    sync.shutdown()

Each task takes every segment handed over so far as one group: fill them all (data, checksums,
header: `SegmentFile.fill`) and start their writeback, then fsync + rename each in sequence
order, then one directory fsync for the group (one journal commit, not one per segment), then
check the shard's fence (see `hpcrl.rl.store.layout`). Only then does a segment's future say
it may be acknowledged. What can go wrong, and what the writer does with it:

* a failure before a segment's rename: the segment never became visible; it and all later
  ones fail (nothing is renamed after a failure) and the writer takes their batches back;
* the directory fsync fails after renames (`Unproven`): visible but not proven durable;
  never acknowledged, never written again: the writer stops;
* the shard is fenced (`Fenced`): a newer writer took it over; nothing renamed into it now
  counts: the writer stops.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hpcrl.core.files import fsync_path
from hpcrl.rl.record.columns import Columns
from hpcrl.rl.record.flat import EncodeBuffers
from hpcrl.rl.record.trajectory import Trajectory
from hpcrl.rl.store.layout import SegmentInfo, StoreError, is_fenced
from hpcrl.rl.store.segment import create_segment, start_writeback

MAX_INFLIGHT = 4  # segments written but not yet durable, at most


class Unproven(Exception):
    """A segment renamed into place whose directory fsync failed: visible, durability unknown."""


class Fenced(Exception):
    """The shard was fenced by a newer writer: this one's renames there do not count."""

    def __init__(self, shard: Path):
        super().__init__(f"shard {shard.name} is fenced")
        self.shard = shard


class InFlight:
    """A segment handed to the sync thread: its batches (`make`), then its .tmp file and fd."""

    __slots__ = (
        "shard", "make", "info", "index", "tmp", "path", "fd", "ids", "parts", "bufs", "pool", "future", "settled",
    )  # fmt: skip

    def __init__(
        self,
        shard: Path,
        tmp: Path,
        path: Path,
        ids: list[str],
        parts: tuple[list[Columns], list[Trajectory]],
        bufs: EncodeBuffers | None,
        pool: deque,
    ):
        self.shard, self.tmp, self.path, self.fd = shard, tmp, path, -1
        self.make: tuple | None = None  # (batches, attrs, compression) for create_segment
        self.info: SegmentInfo | None = None  # set by the sync thread once filled (it holds the CRC)
        self.index = None  # its entries of the shard's index (hpcrl.rl.store.index.IndexPart)
        # What the segment was made of (batches, loose trajectories): given back if its sync fails.
        self.ids, self.parts = ids, parts
        self.bufs = bufs  # holds the encoded loose trajectories until the segment is filled
        self.pool = pool  # where `bufs` goes back then (a deque: its append is thread-safe)
        self.future: Future = Future()  # the sync thread sets it: None, or why the sync failed
        # Set on the sync thread once `future` is: a lock-free done() for append's hot path.
        self.settled = False

    def write(self) -> None:
        """The whole .tmp file: HDF5 structure, data, checksums, header; writeback started."""
        seg = create_segment(self.tmp, *self.make)  # removes the file itself if it fails
        self.make = None  # drops the references to the batches
        self.fd = os.open(self.tmp, os.O_RDWR)
        self.info = seg.fill(self.fd)
        start_writeback(self.fd)
        if self.bufs is not None:  # its bytes are in the file now: the buffers are free again
            self.pool.append(self.bufs)
            self.bufs = None


class SyncThread:
    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._queue: deque[InFlight] = deque()  # handed over, not yet taken into a group
        self.failed = threading.Event()  # set on the sync thread: later segments stay .tmp

    def hand_over(self, item: InFlight) -> None:
        self._queue.append(item)
        self._pool.submit(self._run)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        """Sync thread: publish every segment handed over so far, as one group, in order.

        Each file is fsynced before its rename; one directory fsync then covers the group's
        renames (one journal commit, not one per segment) before any of them is reported
        done. After one failure nothing else is renamed, so a visible seq is never followed
        by a missing smaller one; the writer takes the failed batches back (`_rebuffer`).
        """
        group: list[InFlight] = []
        while self._queue:
            group.append(self._queue.popleft())  # only this thread pops
        if not group:
            return  # an earlier task took this one's segment into its group
        renamed: list[InFlight] = []
        error: BaseException | None = None
        try:
            for item in group:  # all of the group's files first: their writeback overlaps
                if self.failed.is_set():
                    raise StoreError("an earlier segment failed to sync")
                item.write()
            for item in group:
                os.fsync(item.fd)
                os.rename(item.tmp, item.path)
                renamed.append(item)
                os.close(item.fd)  # here: a system call on the caller's thread costs it the GIL
                item.fd = -1
        except BaseException as exc:  # handed to the writer through the futures
            error = exc
            self.failed.set()
        unproven: BaseException | None = None
        if renamed:
            try:
                fsync_path(renamed[0].shard, directory=True)  # a whole group is in one shard
            except BaseException as exc:
                # Visible but not known durable: never acknowledged, never written again.
                unproven = Unproven(f"its rename is visible but not proven durable: {exc}")
                self.failed.set()
        # The fence check comes after the renames (and their directory fsync): a recovery
        # fences before it lists, so if no fence is seen now, it will list these files.
        try:
            fenced = is_fenced(group[0].shard)
        except BaseException as exc:
            error, unproven, fenced = exc, Unproven(f"cannot check its fence: {exc}"), False
            self.failed.set()
        if fenced:
            self.failed.set()
            renamed, error = [], Fenced(group[0].shard)
        for item in group:
            if item not in renamed:
                item.future.set_exception(error)
            elif unproven is not None:
                item.future.set_exception(unproven)
            else:
                item.future.set_result(None)
            item.settled = True
