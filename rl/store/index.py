"""Each shard's index: what a finalized shard holds, read without opening its segments.

    part = index_part(batches)                # per segment, from the batches it was made of
    write_index(shard, [part, ...], segments) # before the manifest: IDS.bin (atomic, fsynced)
    idx = read_index(shard, manifest.segments)  # ShardIndex, or None: read the segments instead

(`hpcrl.rl.store.lease.StoredIds` is a writer's dedup check over these indexes.)

`IDS.bin` holds one record per trajectory of the shard, sorted by a 128-bit hash of its id
(BLAKE2b): the hash, the trajectory's domain (an index into the file's domain list) and its
token count, column by column (so the hashes can be binary-searched in place, memory-mapped),
after a JSON head with the domain list, per-domain sums (trajectories, steps, tokens, and the
steps' generate_s, env_s and sandbox_s) and the rows and checksum of the segments it covers.

The writer builds a shard's index from the batches it flushed, a recovery from the segments it
verified; both write it before the manifest. An index counts only if its rows and checksum
are those of the shard's manifest: a shard finalized before indexes existed, one whose index
is damaged or was replaced by a writer fenced meanwhile, is read segment by segment instead
(slower, never wrong). So a restarted writer opens its dedup check in time proportional to
its number of shards, not to what they hold, and `hpcrl report` sums the heads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcrl.rl.record.columns import Columns
from hpcrl.rl.store.segment import SegmentInfo, crc32

__all__ = [
    "INDEX_NAME",
    "IndexPart",
    "ShardIndex",
    "id_keys",
    "member",
    "index_part",
    "read_index",
    "segments_crc",
    "step_rows",
    "write_index",
]

log = logging.getLogger("hpcrl.store")

INDEX_NAME = "IDS.bin"
_MAGIC = b"HPCRLIDX"
_HEAD = struct.Struct("<8sIIQI4x")  # magic, version, JSON length, records, CRC-32 of the rest
_VERSION = 1
SUMS = ("trajectories", "steps", "tokens", "generate_s", "env_s", "sandbox_s")
_STEP_TIMES = ("generate_s", "env_s", "sandbox_s")


def id_keys(ids: Iterable[str]) -> np.ndarray:
    """The 128-bit keys (S16) of trajectory ids, as every index stores them."""
    return np.array([hashlib.blake2b(t.encode(), digest_size=16).digest() for t in ids], dtype="S16")


def segments_crc(segments: Sequence[SegmentInfo]) -> int:
    """The checksum a shard's manifest gives its segment list (ShardManifest.crc32)."""
    return zlib.crc32(np.array([s.crc32 for s in segments], "<u4").tobytes())


def step_rows(start: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Row numbers in a steps table of each trajectory's steps, in order (start, count per row)."""
    n = n.astype(np.int64)
    first = np.zeros(len(n), np.int64)
    np.cumsum(n[:-1], out=first[1:])
    return np.repeat(start.astype(np.int64) - first, n) + np.arange(int(n.sum()))


@dataclass(frozen=True)
class IndexPart:
    """One segment's share of a shard index."""

    keys: np.ndarray  # S16
    domains: np.ndarray  # S (the traj table's domain bytes), one per key
    tokens: np.ndarray  # int64
    sums: dict[str, dict[str, float]]  # domain -> SUMS


def index_part(batches: Sequence[Columns]) -> IndexPart:
    """The index entries of a segment made of `batches`: gathered batch by batch, summed once."""
    ids, domains, tokens, step_domains = [], [], [], []
    times: dict[str, list[np.ndarray]] = {f: [] for f in _STEP_TIMES}
    for cols in batches:
        t, st = cols.traj, cols.steps
        if not len(t):
            continue
        ids += cols.ids()
        domains.append(t["domain"])
        tokens.append(t["n_tokens"])
        rows = step_rows(t["step_start"], t["n_steps"])
        step_domains.append(np.repeat(t["domain"], t["n_steps"].astype(np.int64)))
        for f in _STEP_TIMES:
            times[f].append(st[f][rows])
    if not ids:
        return IndexPart(np.zeros(0, "S16"), np.zeros(0, "S1"), np.zeros(0, np.int64), {})
    dom, tok = np.concatenate(domains), np.concatenate(tokens).astype(np.int64)
    names, inv = np.unique(dom, return_inverse=True)
    k = len(names)
    step_inv = np.searchsorted(names, np.concatenate(step_domains))
    add = {
        "trajectories": np.bincount(inv, minlength=k),
        "steps": np.bincount(step_inv, minlength=k),
        "tokens": np.bincount(inv, tok, k),
        **{f: np.bincount(step_inv, np.concatenate(times[f]), k) for f in _STEP_TIMES},
    }
    sums = {d.decode(): {f: arr[i].item() for f, arr in add.items()} for i, d in enumerate(names)}
    return IndexPart(id_keys(ids), dom, tok, sums)


@dataclass(frozen=True)
class ShardIndex:
    keys: np.ndarray  # S16, sorted (memory-mapped)
    domain: np.ndarray  # uint32 per key: an index into `domains`
    tokens: np.ndarray  # uint32 per key
    domains: tuple[str, ...]
    sums: dict[str, dict[str, float]]  # domain -> SUMS
    rows: int
    crc32: int  # the segments' (segments_crc), which the manifest must match


def write_index(shard: Path, parts: Sequence[IndexPart], segments: Sequence[SegmentInfo]) -> None:
    """The shard's IDS.bin from the parts of `segments` (written, fsynced, renamed into place;
    the caller's manifest and its directory fsync follow). Raises OSError on failure."""
    keys = np.concatenate([p.keys for p in parts]) if parts else np.zeros(0, "S16")
    raw_domains = np.concatenate([p.domains for p in parts]) if parts else np.zeros(0, "S1")
    tokens = np.concatenate([p.tokens for p in parts]) if parts else np.zeros(0, np.int64)
    names, code = np.unique(raw_domains, return_inverse=True)
    order = np.argsort(keys, kind="stable")
    sums: dict[str, dict[str, float]] = {}
    for p in parts:
        for d, acc in p.sums.items():
            tot = sums.setdefault(d, dict.fromkeys(SUMS, 0))
            for f, v in acc.items():
                tot[f] += v
    head = json.dumps(
        {
            "domains": [n.decode() for n in names],
            "sums": sums,
            "rows": int(sum(s.rows for s in segments)),
            "crc32": segments_crc(segments),
        },
        sort_keys=True,
    ).encode()
    head += b" " * (-len(head) % 16)
    body = [
        head,
        np.ascontiguousarray(keys[order]).tobytes(),
        code[order].astype("<u4").tobytes(),
        np.minimum(tokens[order], 2**32 - 1).astype("<u4").tobytes(),
    ]
    crc = 0
    for b in body:
        crc = crc32(b, crc)
    tmp = shard / f".{INDEX_NAME}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(_HEAD.pack(_MAGIC, _VERSION, len(head), len(keys), crc))
            for b in body:
                fh.write(b)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, shard / INDEX_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_index(shard: Path, segments: Sequence[SegmentInfo] | None) -> ShardIndex | None:
    """The index of a finalized shard if it is intact (its CRC) and covers exactly `segments`
    (its manifest's); None: read the segments instead. The records are memory-mapped (the CRC
    check has just brought them into the page cache: 24 bytes per trajectory)."""
    if segments is None:
        return None
    path = shard / INDEX_NAME
    try:
        with open(path, "rb") as fh:
            magic, version, hlen, n, crc = _HEAD.unpack(fh.read(_HEAD.size))
            if magic != _MAGIC or version != _VERSION:
                return None
            head = json.loads(fh.read(hlen))
        size = os.path.getsize(path)
        base = _HEAD.size + hlen
        if size != base + n * 24 or head["rows"] != n:
            return None
        if head["rows"] != sum(s.rows for s in segments) or head["crc32"] != segments_crc(segments):
            return None  # written for another segment list (e.g. by a writer fenced meanwhile)
        if crc32(memoryview(path.read_bytes())[_HEAD.size :]) != crc:
            log.warning("shard %s: index damaged (checksum); reading its segments instead", shard.name)
            return None
        mm = np.memmap(path, dtype=np.uint8, mode="r") if n else np.zeros(base, np.uint8)
        keys = mm[base : base + 16 * n].view("S16")
        domain = mm[base + 16 * n : base + 20 * n].view("<u4")
        tokens = mm[base + 20 * n : base + 24 * n].view("<u4")
        return ShardIndex(keys, domain, tokens, tuple(head["domains"]), head["sums"], n, head["crc32"])
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("shard %s: index unreadable (%s); reading its segments instead", shard.name, exc)
        return None


def member(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    if not len(sorted_keys) or not len(keys):
        return np.zeros(len(keys), bool)
    at = np.searchsorted(sorted_keys, keys).clip(max=len(sorted_keys) - 1)
    return sorted_keys[at] == keys
