"""Who holds a shard: the owner's liveness (pid on this host, OWNER.json heartbeat elsewhere).

    why = owner_alive(state, lease_s)   # None: its writer is dead (or lost its lease), recover it
    hold_shard(path); release_shard(path)   # the shards live writers of this process hold

A shard is written by one writer, named in the shard directory's name (host and pid). On the
same host its pid says whether it runs; for this process itself, the registry of shards held
by live ShardWriters does (a stopped or closed writer's shard is free although its pid runs).
On another host the mtime of OWNER.json is the heartbeat: a writer refreshes it at each flush
and at least every lease/3 seconds, so one silent for `lease_s` is presumed dead. Presumed
only: it may be stalled (SIGSTOP, a slow parallel-filesystem fsync) and come back; the fence
(`hpcrl.rl.store.layout`) makes sure that it then cannot publish anything.
"""

from __future__ import annotations

import calendar
import os
import time
from pathlib import Path

import psutil

from hpcrl.rl.store.layout import OWNER_NAME, ShardState, short_host

__all__ = ["owner_alive", "hold_shard", "release_shard"]

_LIVE_SHARDS: set[Path] = set()


def hold_shard(path: Path) -> None:
    _LIVE_SHARDS.add(path.resolve())


def release_shard(path: Path) -> None:
    _LIVE_SHARDS.discard(path.resolve())


def owner_alive(state: ShardState, lease_s: float) -> str | None:
    """Why the shard's writer may still be alive (None: it is dead, the shard may be recovered)."""
    try:
        _, stamp, host, pid, _ = state.name.split(".")
        started = calendar.timegm(time.strptime(stamp.split("u")[0], "%Y%m%dT%H%M%S"))
        pid = int(pid)
    except ValueError:
        return None  # not a name this code makes: no owner to protect
    if host == short_host():
        if pid == os.getpid():
            return "a writer in this process holds it" if state.path.resolve() in _LIVE_SHARDS else None
        try:
            proc = psutil.Process(pid)
            # A pid reused by a process started after the shard cannot be its writer.
            if proc.create_time() <= started + 1 and proc.status() != psutil.STATUS_ZOMBIE:
                return f"pid {pid} on this host is still running"
        except psutil.Error:
            pass
        return None
    owner = state.path / OWNER_NAME
    try:
        beat = (owner if owner.exists() else state.path).stat().st_mtime
    except OSError:
        return None
    age = time.time() - beat
    if age < lease_s:
        return f"host {host} sent a heartbeat {age:.0f} s ago (lease {lease_s:.0f} s)"
    return None
