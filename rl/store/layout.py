"""On-disk layout of the trajectory store: shards of immutable HDF5 segments, manifests, recovery.

    <store>/                                  e.g. <run_dir>/trajectories
      <writer>.<utc>.<host>.<pid>.<rand>/     one shard, created by exactly one writer (mkdir is exclusive)
        OWNER.json                            who writes it (host, pid); its mtime is the writer's heartbeat
        seg-000001-<flush unix us>.h5         one complete HDF5 file per flush, never modified again
        seg-000002-....h5                     (a sequence number names at most one file, ever)
        FENCE.json                            a newer writer took the shard over (recovery)
        MANIFEST.json                         written last, created once, never replaced: present = finalized
      quarantine/<shard>/<file> + <file>.reason.txt

Why this shape (crash consistency)
----------------------------------
HDF5 updates its metadata (object headers, chunk indexes, superblock) in place, in an order
the library chooses, and flushes it at times the metadata cache chooses. A process killed in
the middle of an append or of H5Fflush can therefore leave a file whose previously flushed
content is unreadable or silently wrong (a new extent with old chunk indexes reads fill
values). No amount of flushing makes one appended HDF5 file crash safe; only a second copy
(a journal) could, at twice the bytes written.

So an HDF5 file is never modified once visible. Each flush writes a whole segment file
under a `.tmp` name, closes it, fsyncs it, renames it to its final name and fsyncs the
directory; only then does the writer acknowledge the flush. POSIX rename is atomic, so
every `seg-*.h5` that any process can see was completely written and synced before it got
that name, whatever moment a SIGKILL lands:

* during an append (records only in memory, not acknowledged): nothing on disk changes;
* while a segment is written or synced: only a `.tmp` file exists, never acknowledged; the
  next recovery moves it to quarantine, no reader ever opens a `.tmp`;
* between the rename and the acknowledgement: a complete segment that the sender will
  resend; the writer service keeps it and drops the resent copies by trajectory id;
* while MANIFEST.json is written: the same `.tmp` rule applies; recovery writes it again;
* with the writer's pipeline (ShardWriter syncs segment k on a background thread while the
  next one is written): every segment is in one of the states above, and renames happen in
  sequence order, so a visible segment is never followed by a missing earlier one.

Each segment carries a header (format v2, `hpcrl.rl.store.segment`) whose CRC-32s cover every
byte of the file, the enum tables and the row count included, and a shard's manifest lists
every segment with rows, size and that checksum, so a finalized shard is checked against its
manifest and an unfinalized one segment by segment, before HDF5 parses anything. Recovery
(`recover_shard`) verifies each segment, quarantines what fails with a written reason, and
finalizes the shard with status "recovered": the shard then holds exactly what was flushed
up to the kill. Damage of any kind is a SegmentError: recovery quarantines the file, a
reader rejects it and goes on, neither can be made to crash by it.

Fencing a writer that lost its lease
------------------------------------
A writer on another host is presumed dead when its heartbeat (OWNER.json's mtime) is older
than `store.lease_s`; on this host, when its pid is gone. Presumed only: SIGSTOP, a hung
parallel-filesystem call or an overloaded node can stall a writer past its lease and let it
continue later, with renames in flight. Without a fence, a newer writer would list the shard,
write its manifest, and the old one would then rename segments into it and acknowledge them:
not in the manifest, never read, acknowledged data lost. The protocol that prevents it:

* a recovery first creates FENCE.json (O_CREAT|O_EXCL, fsynced, directory fsynced), and only
  then lists the shard (`recover_shard`);
* a writer acknowledges a segment only if, after its rename and the directory fsync, it does
  not see FENCE.json (one stat per group of segments);
* so if the writer saw no fence, its rename preceded the fence, which preceded the listing:
  the recovery lists the segment and its manifest keeps it. If it saw the fence, it
  acknowledges nothing and stops (WriterStopped), and its senders resend to the newer writer,
  whose dedup index (every manifest of the name) acknowledges at once what is stored;
* a manifest is created with link(2), never replaced: whoever finalizes first decides, the
  other one learns it was fenced (a writer) or reads that manifest (a recovery);
* a recovery that finds the shard empty removes it; a writer whose shard directory is gone
  counts as fenced too. A writer checks the fence at its heartbeat too, so an idle one stops
  within lease/3 of being fenced.

The only trace a fenced writer can leave is a segment it renamed after the listing: never
acknowledged, outside the manifest (readers ignore it), moved to quarantine by the next
writer of the name. A shard has just two generations, its writer and the one recovery that
fences it, because a new writer never writes into an old shard: it creates its own. The
argument needs a filesystem whose namespace operations are seen in one order by all clients
(local filesystems, Lustre, GPFS); an NFS client that caches a negative lookup of FENCE.json
could miss the fence.

A failed directory fsync after renames is the other case where a visible segment is not
known durable: the writer never acknowledges it and never writes its rows again (a rewrite
could duplicate them); it stops, and the next writer's recovery and dedup sort it out.

HDF5 file locking plays no part: a file is written by one process under a name no other
writer can produce, and read only after it is complete. Files are opened with
locking=False, so HDF5_USE_FILE_LOCKING=FALSE (as on Lustre/GPFS) changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hpcrl.core.files import atomic_write_bytes, fsync_path
from hpcrl.rl.store.index import IndexPart, index_part, segments_crc, write_index
from hpcrl.rl.store.segment import (
    SEGMENT_FORMAT_VERSION,
    SegmentError,
    SegmentInfo,
    parse_segment_name,
    publish_segment,
    segment_name,
    write_segment,
)
from hpcrl.rl.store.segment_read import load_segment, read_segment, segment_meta

# The segment names are re-exported: `layout` is where callers look for the on-disk shape.
__all__ = [
    "FENCE_NAME",
    "MANIFEST_NAME",
    "OWNER_NAME",
    "QUARANTINE_DIR",
    "SEGMENT_FORMAT_VERSION",
    "SegmentError",
    "SegmentInfo",
    "ShardManifest",
    "ShardState",
    "StoreError",
    "WriterStopped",
    "RecoveryReport",
    "fence_shard",
    "finalize_shard",
    "is_fenced",
    "list_shards",
    "load_segment",
    "new_shard_dir",
    "parse_segment_name",
    "publish_segment",
    "quarantine",
    "read_segment",
    "read_shard",
    "recover_shard",
    "segment_meta",
    "segment_name",
    "short_host",
    "write_segment",
]

log = logging.getLogger("hpcrl.store")

MANIFEST_NAME = "MANIFEST.json"
OWNER_NAME = "OWNER.json"
FENCE_NAME = "FENCE.json"
QUARANTINE_DIR = "quarantine"
MANIFEST_FORMAT = "hpcrl-shard-manifest"
WRITER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class StoreError(Exception):
    """The store cannot be used as asked (name in use, bad directory); the message says what to do."""


class WriterStopped(StoreError):
    """The writer stopped for good: it can no longer prove what is durable (a failed directory
    fsync after renames) or lost its shard to a newer writer. It acknowledges nothing more;
    restart it (a new writer recovers the shard and deduplicates what its senders resend)."""


# -- manifests and shard listing ----------------------------------------------------------------


@dataclass(frozen=True)
class ShardManifest:
    shard: str
    writer: str
    status: Literal["closed", "recovered"]
    segments: tuple[SegmentInfo, ...]
    finalized_at: float
    quarantined: tuple[dict, ...] = ()

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def crc32(self) -> int:
        """The shard's checksum: CRC-32 over its segments' CRCs in order (each covers its data)."""
        return segments_crc(self.segments)

    def to_json(self) -> dict:
        return {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "shard": self.shard,
            "writer": self.writer,
            "status": self.status,
            "rows": self.rows,
            "crc32": self.crc32,
            "bytes": sum(s.bytes for s in self.segments),
            "finalized_at": self.finalized_at,
            "segments": [asdict(s) for s in self.segments],
            "quarantined": list(self.quarantined),
        }

    @classmethod
    def from_json(cls, data: Any) -> ShardManifest:
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError("not an hpcrl shard manifest")
        m = cls(
            shard=data["shard"],
            writer=data["writer"],
            status=data["status"],
            segments=tuple(SegmentInfo(**s) for s in data["segments"]),
            finalized_at=float(data["finalized_at"]),
            quarantined=tuple(data.get("quarantined", ())),
        )
        if m.rows != data["rows"] or m.crc32 != data["crc32"]:
            raise ValueError("totals do not match the segment list")
        return m


@dataclass
class ShardState:
    """A shard as found on disk: its manifest if finalized, else the visible segments."""

    path: Path
    manifest: ShardManifest | None
    segment_names: list[str]  # visible seg-*.h5 in seq order
    manifest_error: str | None = None
    tmp_files: list[str] = field(default_factory=list)
    fenced: bool = False  # FENCE.json: a newer writer took the shard over (see fence_shard)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def unlisted(self) -> list[str]:
        """Segment files of a finalized shard its manifest does not list (a fenced writer's)."""
        if self.manifest is None:
            return []
        listed = {s.name for s in self.manifest.segments}
        return [n for n in self.segment_names if n not in listed]

    @property
    def writer(self) -> str:
        return self.path.name.split(".", 1)[0]

    @property
    def finalized(self) -> bool:
        return self.manifest is not None


def read_shard(path: Path) -> ShardState:
    names, tmps = [], []
    entries = os.listdir(path)
    for entry in entries:
        if entry.endswith(".tmp"):
            tmps.append(entry)
        elif parse_segment_name(entry):
            names.append(entry)
    names.sort(key=lambda n: parse_segment_name(n)[0])
    manifest, error = None, None
    if MANIFEST_NAME in entries:
        try:
            manifest = ShardManifest.from_json(json.loads((path / MANIFEST_NAME).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            error = f"unreadable {MANIFEST_NAME}: {exc}"
    return ShardState(path, manifest, names, error, sorted(tmps), FENCE_NAME in entries)


def list_shards(store: Path, skip: frozenset[str] | set[str] = frozenset()) -> list[ShardState]:
    """Every shard directory under `store` (not quarantine), oldest name first; the shards named
    in `skip` (a reader's finalized ones: they never change) are not read again."""
    if not store.is_dir():
        return []
    out = []
    for entry in sorted(os.listdir(store)):
        if entry in skip:
            continue
        p = store / entry
        if entry != QUARANTINE_DIR and p.is_dir() and WRITER_NAME_RE.fullmatch(entry.split(".", 1)[0]):
            out.append(read_shard(p))
    return out


def short_host() -> str:
    """This host's name as it appears in shard names (no dots: they separate the name's parts)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:32] or "host"


def new_shard_dir(store: Path, writer: str) -> Path:
    """Create a shard directory whose name no other writer can produce (mkdir is exclusive)."""
    host = short_host()
    now = time.time()
    # Microseconds in the stamp so one writer's shards sort in creation order.
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"u{int(now % 1 * 1e6):06d}"
    for _ in range(8):
        path = store / f"{writer}.{stamp}.{host}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        fsync_path(store, directory=True)
        return path
    raise StoreError(f"could not create a unique shard directory in {store}")


# -- quarantine and recovery ------------------------------------------------------------------


def quarantine(store: Path, shard: Path, name: str, reason: str) -> bool:
    """Move a file out of the shard (never delete: a human may want it) and record why; False if
    it is gone meanwhile (a fenced writer renamed or removed its own .tmp)."""
    qdir = store / QUARANTINE_DIR / shard.name
    qdir.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(shard / name, qdir / name)
    except FileNotFoundError:
        return False
    (qdir / f"{name}.reason.txt").write_text(reason + "\n")
    log.warning("quarantined %s/%s: %s", shard.name, name, reason)
    return True


def fence_shard(shard: Path) -> None:
    """Fence the shard's writer (see the module docstring): FENCE.json is created exclusively and
    made durable before the caller lists the shard. Idempotent (an existing fence stays)."""
    try:
        fd = os.open(shard / FENCE_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    try:
        os.write(fd, json.dumps({"by_host": socket.gethostname(), "by_pid": os.getpid(), "at": time.time()}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(shard, directory=True)


def is_fenced(shard: Path) -> bool:
    """Whether a newer writer took the shard over: it fenced it, or recovered it and removed it."""
    return os.path.exists(shard / FENCE_NAME) or not os.path.isdir(shard)


@dataclass(frozen=True)
class RecoveryReport:
    shard: str
    rows: int
    segments: int
    quarantined: tuple[dict, ...]
    removed: bool  # the shard held nothing and its directory was removed


def finalize_shard(
    shard: Path, writer: str, segments: list[SegmentInfo], status: str, quarantined=(), *, replace: bool = False
) -> ShardManifest:
    """Write the shard's manifest. It is created, never replaced (FileExistsError if there is one:
    whoever finalized first decided), unless `replace` (only for an unreadable one)."""
    manifest = ShardManifest(shard.name, writer, status, tuple(segments), time.time(), tuple(quarantined))
    data = (json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n").encode()
    if replace:
        atomic_write_bytes(shard / MANIFEST_NAME, data)
        return manifest
    tmp = shard / f".{MANIFEST_NAME}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, shard / MANIFEST_NAME)  # atomic and exclusive: complete, and only once
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(shard, directory=True)
    return manifest


def write_index_or_warn(shard: Path, parts: list[IndexPart], segments: list[SegmentInfo]) -> None:
    """The shard's index before its manifest; one that cannot be written costs speed, not data
    (readers of an unindexed shard read its segments), so it is logged, not raised."""
    try:
        write_index(shard, parts, segments)
    except OSError as exc:
        log.warning("shard %s: index not written (%s); its segments are read instead", shard.name, exc)


def recover_shard(store: Path, shard: Path) -> RecoveryReport:
    """Finalize a shard whose writer died (or lost its lease): fence it, keep every verified
    segment, quarantine the rest. Idempotent: a recovery killed half-way is simply run again.
    A finalized, fenced shard is tidied: files its fenced writer published after the recovery
    listed the shard (never acknowledged, see the module docstring) go to quarantine.
    """
    state = read_shard(shard)
    if not state.finalized:
        fence_shard(shard)  # before the listing below: the writer cannot acknowledge after it
        state = read_shard(shard)
    if state.finalized:
        late = "published by its writer after it was fenced, so never acknowledged (its rows were resent)"
        tidied = tuple(
            {"name": n, "reason": late} for n in state.unlisted if state.fenced and quarantine(store, shard, n, late)
        )
        return RecoveryReport(shard.name, state.manifest.rows, len(state.manifest.segments), tidied, False)
    quarantined = []
    for name in state.tmp_files:
        if not name.startswith("seg-"):
            (shard / name).unlink(missing_ok=True)  # a half-written OWNER/MANIFEST: rebuilt below
            continue
        reason = "incomplete write: the writer died before renaming it, so it was never acknowledged"
        if quarantine(store, shard, name, reason):
            quarantined.append({"name": name, "reason": reason})
    good: list[SegmentInfo] = []
    parts = []
    for name in state.segment_names:
        try:
            cols, info = load_segment(shard / name)
            good.append(info)
            parts.append(index_part([cols]))
        except SegmentError as exc:
            quarantine(store, shard, name, str(exc))
            quarantined.append({"name": name, "reason": str(exc)})
    if not good and not quarantined:
        (shard / OWNER_NAME).unlink(missing_ok=True)
        (shard / FENCE_NAME).unlink(missing_ok=True)  # a fenced writer finds its shard gone: fenced too
        try:
            shard.rmdir()
            return RecoveryReport(shard.name, 0, 0, (), True)
        except OSError:
            pass  # something unexpected is in there: keep it and finalize the shard empty
    write_index_or_warn(shard, parts, good)
    try:
        finalize_shard(shard, state.writer, good, "recovered", quarantined, replace=state.manifest_error is not None)
    except FileExistsError:  # its writer finalized it after the fence, first: its manifest stands
        return recover_shard(store, shard)
    log.info(
        "recovered shard %s: %d segment(s), %d row(s), %d file(s) quarantined",
        shard.name,
        len(good),
        sum(s.rows for s in good),
        len(quarantined),
    )
    return RecoveryReport(shard.name, sum(s.rows for s in good), len(good), tuple(quarantined), False)
