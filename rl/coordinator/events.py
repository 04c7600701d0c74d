"""The coordinator's two append-only logs of what happened, for `hpcrl traj trace` and `hpcrl plot`.

    log = JsonLines(run_dir / LEASES_NAME)
    log.write({"t": time.time(), "g": "gen-0", "leased": [[17, 0], [18, 0]]})
    for rec in read_jsonl(run_dir / LEASES_NAME): ...

`coordinator/leases.jsonl`: one line per sync that changed a lease, and per expiry or restore:
`leased` [[episode, attempt]], `done` [episode], `failed` [[episode, reason]], `released`
[episode] (a generator handed unfinished work back), `expired` {generator: [episode]} (silent
past lease_s), `orphaned` [episode] (held by a generator process that died, issued again when a
new process of that name first synced), `requeued` [episode] (in flight when a coordinator died,
issued again by its successor). About 30 bytes per episode over its life.

`coordinator/timeline.jsonl`: every `timeline_every_s`, each live generator's cumulative
seconds (wall, sampling, weight loads, coordination, waiting on environments, idle) as its last
sync (`seen`) reported them; a plot differences consecutive samples (a restarted generator's
counters start again from 0).

Both are diagnostics, not state: lines are flushed to the OS as written but not fsynced, so a
machine crash can lose the last seconds; a torn last line is skipped on reading. Nothing
recovers from them, and a run without them (an older run) still traces and plots what it can.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["LEASES_NAME", "TIMELINE_NAME", "JsonLines", "read_jsonl"]

LEASES_NAME = "coordinator/leases.jsonl"
TIMELINE_NAME = "coordinator/timeline.jsonl"


class JsonLines:
    """An append-only JSON-lines file, opened lazily, one write() per record."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = None

    def write(self, rec: dict[str, Any]) -> None:
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)  # line-buffered: each record reaches the OS whole
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """The records of `path` (none if it does not exist); a line that is not JSON is skipped
    (a writer killed mid-line leaves one torn line; after a restart it is not the last)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec
