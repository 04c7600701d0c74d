"""The shards one writer holds: open the next, keep its owner heartbeat, retire it, finalize it.

`ShardLifecycle` is the ShardWriter's shard-handling half (a mixin over the writer's own
fields: `store`, `writer`, the open `_shard` and its segments, the retired `_unfinalized`).
Each step may fail (a full disk, a refused directory) and is retried at the next flush; what
a step leaves behind is always a state a recovery understands (`hpcrl.rl.store.layout`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from hpcrl.core.files import atomic_write_json, fsync_path, read_json
from hpcrl.rl.store.index import read_index
from hpcrl.rl.store.layout import (
    MANIFEST_NAME,
    OWNER_NAME,
    StoreError,
    finalize_shard,
    is_fenced,
    new_shard_dir,
    write_index_or_warn,
)
from hpcrl.rl.store.lease import hold_shard, release_shard

__all__ = ["ShardLifecycle"]

log = logging.getLogger("hpcrl.store")


class ShardLifecycle:
    """Open, heartbeat, retire and finalize the writer's shards (see the module docstring)."""

    def _open_shard(self) -> None:
        """Open the next shard; StoreError (nothing left behind) if the filesystem refuses."""
        try:
            shard = new_shard_dir(self.store, self.writer)
        except (OSError, StoreError) as exc:
            raise StoreError(f"cannot open a new shard in {self.store}: {exc}") from exc
        try:
            atomic_write_json(
                shard / OWNER_NAME,
                {"writer": self.writer, "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()},
            )
        except OSError as exc:
            try:
                shard.rmdir()  # empty: atomic_write_json removes its own temporary file
            except OSError:
                pass  # an empty shard without an owner: the next recovery removes it
            raise StoreError(f"cannot open a new shard in {self.store}: {exc}") from exc
        self._shard, self._segments, self._parts, self._shard_rows, self._seq = shard, [], [], 0, 0
        hold_shard(shard)
        self._last_beat = time.monotonic()

    def _ensure_shard(self) -> None:
        if self._shard is None:
            self._open_shard()

    def _heartbeat(self) -> None:
        self._last_beat = time.monotonic()
        if self._shard is None:
            return
        try:
            os.utime(self._shard / OWNER_NAME)
        except OSError as exc:
            log.warning("heartbeat on %s failed: %s", self._shard, exc)

    def _retire(self) -> None:
        """The open shard, all of it durable, waits for its manifest; no shard is open after."""
        if self._shard is not None:
            self._unfinalized.append((self._shard, self._segments, self._parts))
            self._shard, self._segments, self._parts, self._shard_rows, self._seq = None, [], [], 0, 0

    def _finalize_retired(self) -> None:
        """Write the manifest of each retired shard (an empty one is removed); StoreError if one
        cannot be written: it stays retired, its segments durable and readable, and is retried."""
        while self._unfinalized:
            shard, segments, parts = self._unfinalized[0]
            if is_fenced(shard):  # a newer writer finalized it (its manifest lists our segments)
                self._fenced(shard)
            try:
                if segments:
                    write_index_or_warn(shard, parts, segments)
                    finalize_shard(shard, self.writer, segments, "closed")
                else:
                    (shard / OWNER_NAME).unlink(missing_ok=True)
                    shard.rmdir()
            except FileExistsError:
                if not self._own_manifest(shard):  # fenced and finalized between the check and here
                    self._fenced(shard)
                # else: ours, from an attempt whose directory fsync failed; that fsync is redone
                try:
                    fsync_path(shard, directory=True)
                except OSError as exc:
                    raise StoreError(f"finalizing shard {shard.name} failed: {exc}; retried at the next flush") from exc
            except OSError as exc:
                raise StoreError(
                    f"finalizing shard {shard.name} failed: {exc}; its {sum(s.rows for s in segments)} row(s) "
                    "are durable, the manifest is written at the next flush or close"
                ) from exc
            release_shard(shard)
            self._unfinalized.pop(0)
            if segments and self._stored is not None and (idx := read_index(shard, segments)) is not None:
                self._stored.seal(idx.keys)  # searched in place from now on, not held in a set

    def _own_manifest(self, shard: Path) -> bool:
        """Whether the shard's manifest is this writer's own closing one (not a recovery's)."""
        try:
            m = read_json(shard / MANIFEST_NAME)
        except (OSError, ValueError):
            return False
        return not is_fenced(shard) and m.get("writer") == self.writer and m.get("status") == "closed"
