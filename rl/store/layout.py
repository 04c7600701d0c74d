"""On-disk layout of the trajectory store: shards of immutable HDF5 segments, manifests, recovery.

    <store>/                                  e.g. <run_dir>/trajectories
      <writer>.<utc>.<host>.<pid>.<rand>/     one shard, created by exactly one writer (mkdir is exclusive)
        OWNER.json                            who writes it (host, pid); its mtime is the writer's heartbeat
        seg-000001-<flush unix us>.h5         one complete HDF5 file per flush, never modified again
        seg-000002-....h5
        MANIFEST.json                         written last: present = finalized
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

Each segment carries its own row count and CRC-32 (attributes), and a shard's manifest lists
every segment with rows and CRC-32, so a finalized shard is checked against its manifest and
an unfinalized one segment by segment. Recovery (`recover_shard`) verifies each segment,
quarantines what fails with a written reason, and finalizes the shard with status
"recovered": the shard then holds exactly what was flushed up to the kill.

HDF5 file locking plays no part: a file is written by one process under a name no other
writer can produce, and read only after it is complete. Files are opened with
locking=False, so HDF5_USE_FILE_LOCKING=FALSE (as on Lustre/GPFS) changes nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import socket
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np
from h5py import h5a, h5d, h5f, h5p, h5s, h5t, h5z

from hpcrl import __version__
from hpcrl.core.files import atomic_write_json, fsync_path
from hpcrl.rl.store.columns import ARRAY_NAMES, Columns, ColumnsError

log = logging.getLogger("hpcrl.store")

MANIFEST_NAME = "MANIFEST.json"
OWNER_NAME = "OWNER.json"
QUARANTINE_DIR = "quarantine"
SEGMENT_FORMAT = "hpcrl-trajectory-segment"
SEGMENT_FORMAT_VERSION = 1
MANIFEST_FORMAT = "hpcrl-shard-manifest"
WRITER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SEGMENT_RE = re.compile(r"seg-(\d{6,})-(\d{16})\.h5")
# Token data is the bulk; the two record tables are small and compress poorly, so only
# these take the configured filter.
COMPRESSED = ("tokens", "logprobs", "loss_mask")
CHUNK_BYTES = 8 << 20
SEGMENT_ATTR = "hpcrl_segment"  # JSON: format, version, rows, crc32, enum tables, writer, seq, ...

Compression = Literal["none", "gzip", "lzf"]


class SegmentError(Exception):
    """A segment file is unreadable or does not match its checksum/manifest; str() is the reason."""


class StoreError(Exception):
    """The store cannot be used as asked (name in use, bad directory); the message says what to do."""


# -- segments ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentInfo:  # one segment as listed in a manifest
    name: str
    rows: int
    crc32: int
    bytes: int  # file size
    flushed_at: float
    min_policy_version: int
    max_policy_version: int


def segment_name(seq: int, flushed_us: int) -> str:
    return f"seg-{seq:06d}-{flushed_us:016d}.h5"


def parse_segment_name(name: str) -> tuple[int, int] | None:  # (seq, flush time in unix us)
    return (int(m.group(1)), int(m.group(2))) if (m := SEGMENT_RE.fullmatch(name)) else None


def _dcpl(chunk: int, compression: Compression) -> h5p.PropDCID:
    plist = h5p.create(h5p.DATASET_CREATE)
    plist.set_chunk((chunk,))
    # Every byte is written right after creation: pre-filling with zeros would write it twice.
    plist.set_fill_time(h5d.FILL_TIME_NEVER)
    if compression == "gzip":
        plist.set_shuffle()
        plist.set_deflate(1)  # level 1: most of gzip's gain on token ids at a fraction of the CPU
    elif compression == "lzf":
        plist.set_shuffle()
        plist.set_filter(h5z.FILTER_LZF, h5z.FLAG_OPTIONAL)
    return plist


@functools.lru_cache(maxsize=64)
def _h5type(dtype: np.dtype) -> h5t.TypeID:
    return h5t.py_create(dtype, logical=True)


@functools.lru_cache(maxsize=1)
def _fapl() -> h5p.PropFAID:
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_LATEST, h5f.LIBVER_LATEST)
    fapl.set_fclose_degree(h5f.CLOSE_STRONG)
    fapl.set_file_locking(False, True)  # never takes locks, as HDF5_USE_FILE_LOCKING=FALSE does
    # No raw-data chunk cache: chunks go straight to the file instead of via a cache copy.
    fapl.set_cache(0, 0, 0, 0.75)
    return fapl


def _write_attr(fid: h5f.FileID, name: str, text: str) -> None:
    data = text.encode()
    tid = h5t.C_S1.copy()
    tid.set_size(max(1, len(data)))
    tid.set_strpad(h5t.STR_NULLPAD)
    tid.set_cset(h5t.CSET_UTF8)
    attr = h5a.create(fid, name.encode(), tid, h5s.create(h5s.SCALAR))
    attr.write(np.array(data, dtype=f"S{max(1, len(data))}"), mtype=tid)


def _write_dataset(fid: h5f.FileID, name: str, arr: np.ndarray, compression: Compression) -> None:
    # Unfiltered chunks go in with H5Dwrite_chunk: the file type is the array's own dtype, so a
    # chunk's bytes are the array's, and HDF5 skips selection and type conversion (~0.1 ms/flush).
    arr = np.ascontiguousarray(arr)
    n, tid = len(arr), _h5type(arr.dtype)
    # Equal chunks of at most CHUNK_BYTES (a flush is one chunk per dataset): a fixed chunk
    # size would leave the last chunk of every dataset mostly empty, and chunks are stored whole.
    n_chunks = max(1, -(-n // max(1, CHUNK_BYTES // arr.dtype.itemsize)))
    chunk = max(1, -(-n // n_chunks))
    direct = compression == "none" and n > 0 and tid.get_size() == arr.dtype.itemsize
    # A fixed extent where possible: segments never grow, and HDF5 then indexes one chunk
    # without a B-tree. Empty datasets keep an unlimited one (a chunk may not exceed it).
    space = h5s.create_simple((n,), (n,) if direct else (h5s.UNLIMITED,))
    ds = h5d.create(fid, name.encode(), tid, space, dcpl=_dcpl(chunk, compression))
    try:
        for start in range(0, n if direct else 0, chunk):
            part = arr[start : start + chunk]
            if len(part) < chunk:  # the last of several chunks: padded, as HDF5 stores it
                part = np.concatenate([part, np.zeros(chunk - len(part), arr.dtype)])
            ds.write_direct_chunk((start,), part)
        if not direct and n:
            ds.write(h5s.ALL, h5s.ALL, arr, mtype=tid)  # same type object: no conversion search
    finally:
        ds.close()


def write_segment_file(
    tmp: Path, final_name: str, cols: Columns, attrs: dict[str, Any], compression: Compression = "none"
) -> SegmentInfo:
    """Write `cols` to the temporary file `tmp` and close it; `publish_segment` (or the writer's
    pipelined sync thread) makes it visible under `final_name`.

    Written with the low-level h5py API (the high-level one spends ~0.1 ms of Python per
    dataset and attribute), without a chunk cache and with direct chunk writes: a flush is a
    few MB, so fixed costs matter.
    """
    crc = cols.crc32()
    fid = h5f.create(os.fsencode(tmp), h5f.ACC_EXCL, fapl=_fapl())  # ACC_EXCL: fail if it exists
    try:
        for name, arr in cols.arrays():
            _write_dataset(fid, name, arr, compression if name in COMPRESSED else "none")
        meta = {
            "format": SEGMENT_FORMAT,
            "format_version": SEGMENT_FORMAT_VERSION,
            "rows": cols.rows,
            "crc32": crc,
            "truncation_names": list(cols.truncation_names),
            "sandbox_names": list(cols.sandbox_names),
            "compression": compression,
            "hpcrl_version": __version__,
            **attrs,
        }
        # One JSON attribute: each HDF5 attribute costs a metadata object; `h5dump -A` shows it.
        _write_attr(fid, SEGMENT_ATTR, json.dumps(meta, sort_keys=True))
    finally:
        fid.close()
    t = cols.traj
    return SegmentInfo(
        name=final_name,
        rows=cols.rows,
        crc32=crc,
        bytes=tmp.stat().st_size,
        flushed_at=float(attrs.get("flushed_at", time.time())),
        min_policy_version=int(t["min_policy_version"].min()) if cols.rows else 0,
        max_policy_version=int(t["max_policy_version"].max()) if cols.rows else 0,
    )


def publish_segment(tmp: Path, path: Path) -> None:
    """fsync the complete temporary file, rename it to its final name, fsync the directory."""
    fsync_path(tmp)
    os.rename(tmp, path)
    fsync_path(path.parent, directory=True)


def segment_meta(f: h5py.File) -> dict:
    """The JSON attribute of an open segment file; SegmentError if absent or not ours."""
    raw = f.attrs.get(SEGMENT_ATTR)
    if raw is None:
        raise SegmentError(f"not an hpcrl segment (no {SEGMENT_ATTR!r} attribute)")
    try:
        meta = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SegmentError(f"damaged {SEGMENT_ATTR!r} attribute: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != SEGMENT_FORMAT:
        raise SegmentError(f"not an hpcrl segment (format {meta.get('format') if isinstance(meta, dict) else meta!r})")
    return meta


def read_segment(path: Path, expect: SegmentInfo | None = None, fields: tuple[str, ...] = ARRAY_NAMES) -> Columns:
    """Open, checksum and validate a segment; raise SegmentError with the reason otherwise.

    With `fields` a subset (e.g. ("traj",)), only those datasets are read and the checksum
    is not verified: for listings and id indexes, never for data handed to a learner.
    """
    try:
        with h5py.File(path, "r", locking=False) as f:
            meta = segment_meta(f)
            version = int(meta.get("format_version", -1))
            if version > SEGMENT_FORMAT_VERSION:
                raise SegmentError(f"segment format v{version} is newer than this hpcrl reads; upgrade hpcrl")
            missing = [n for n in fields if n not in f]
            if missing:
                raise SegmentError(f"datasets missing: {', '.join(missing)}")
            data = {n: f[n][()] for n in fields}
            for arr in data.values():
                arr.flags.writeable = False  # records decoded from it share this memory
            rows, crc = int(meta["rows"]), int(meta["crc32"])
            trunc, sandbox = tuple(meta["truncation_names"]), tuple(meta["sandbox_names"])
    except SegmentError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise SegmentError(f"cannot read: {exc}") from None
    empty = {
        "traj": np.zeros(0, np.dtype([("id", "S1")])),
        "steps": None,
        "tokens": np.zeros(0, np.int32),
        "logprobs": np.zeros(0, np.float32),
        "loss_mask": np.zeros(0, np.uint8),
    }
    full = fields == ARRAY_NAMES
    cols = Columns(**{n: data.get(n, empty[n]) for n in ARRAY_NAMES}, truncation_names=trunc, sandbox_names=sandbox)
    if len(cols.traj) != rows:
        raise SegmentError(f"holds {len(cols.traj)} rows, its header says {rows}")
    if expect is not None and expect.rows != rows:
        raise SegmentError(f"holds {rows} rows, the manifest says {expect.rows}")
    if full:
        actual = cols.crc32()
        if actual != crc:
            raise SegmentError(f"checksum mismatch: data {actual:#010x}, header {crc:#010x}")
        if expect is not None and expect.crc32 != crc:
            raise SegmentError(f"checksum mismatch: header {crc:#010x}, manifest {expect.crc32:#010x}")
        try:
            cols.validate()
        except ColumnsError as exc:
            raise SegmentError(f"inconsistent columns: {exc}") from None
    return cols


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
        return zlib.crc32(np.array([s.crc32 for s in self.segments], "<u4").tobytes())

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

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def writer(self) -> str:
        return self.path.name.split(".", 1)[0]

    @property
    def finalized(self) -> bool:
        return self.manifest is not None


def read_shard(path: Path) -> ShardState:
    names, tmps = [], []
    for entry in os.listdir(path):
        if entry.endswith(".tmp"):
            tmps.append(entry)
        elif parse_segment_name(entry):
            names.append(entry)
    names.sort(key=lambda n: parse_segment_name(n)[0])
    manifest, error = None, None
    if MANIFEST_NAME in os.listdir(path):
        try:
            manifest = ShardManifest.from_json(json.loads((path / MANIFEST_NAME).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            error = f"unreadable {MANIFEST_NAME}: {exc}"
    return ShardState(path, manifest, names, error, sorted(tmps))


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


def quarantine(store: Path, shard: Path, name: str, reason: str) -> None:
    """Move a file out of the shard (never delete: a human may want it) and record why."""
    qdir = store / QUARANTINE_DIR / shard.name
    qdir.mkdir(parents=True, exist_ok=True)
    (qdir / f"{name}.reason.txt").write_text(reason + "\n")
    os.replace(shard / name, qdir / name)
    log.warning("quarantined %s/%s: %s", shard.name, name, reason)


@dataclass(frozen=True)
class RecoveryReport:
    shard: str
    rows: int
    segments: int
    quarantined: tuple[dict, ...]
    removed: bool  # the shard held nothing and its directory was removed


def finalize_shard(shard: Path, writer: str, segments: list[SegmentInfo], status: str, quarantined=()) -> ShardManifest:
    manifest = ShardManifest(shard.name, writer, status, tuple(segments), time.time(), tuple(quarantined))
    atomic_write_json(shard / MANIFEST_NAME, manifest.to_json(), sort_keys=True)
    return manifest


def recover_shard(store: Path, shard: Path) -> RecoveryReport:
    """Finalize a shard whose writer died: keep every verified segment, quarantine the rest.

    Idempotent: a recovery killed half-way is simply run again.
    """
    state = read_shard(shard)
    if state.finalized:
        return RecoveryReport(shard.name, state.manifest.rows, len(state.manifest.segments), (), False)
    quarantined = []
    for name in state.tmp_files:
        if not name.startswith("seg-"):
            os.unlink(shard / name)  # a half-written OWNER/MANIFEST: metadata rebuilt below
            continue
        reason = "incomplete write: the writer died before renaming it, so it was never acknowledged"
        quarantine(store, shard, name, reason)
        quarantined.append({"name": name, "reason": reason})
    good: list[SegmentInfo] = []
    for name in state.segment_names:
        path = shard / name
        try:
            cols = read_segment(path)
        except SegmentError as exc:
            quarantine(store, shard, name, str(exc))
            quarantined.append({"name": name, "reason": str(exc)})
            continue
        t = cols.traj
        flushed_at = parse_segment_name(name)[1] / 1e6
        good.append(
            SegmentInfo(
                name,
                cols.rows,
                cols.crc32(),
                path.stat().st_size,
                flushed_at,
                int(t["min_policy_version"].min()) if cols.rows else 0,
                int(t["max_policy_version"].max()) if cols.rows else 0,
            )
        )
    if not good and not quarantined:
        (shard / OWNER_NAME).unlink(missing_ok=True)
        try:
            shard.rmdir()
            return RecoveryReport(shard.name, 0, 0, (), True)
        except OSError:
            pass  # something unexpected is in there: keep it and finalize the shard empty
    finalize_shard(shard, state.writer, good, "recovered", quarantined)
    log.info(
        "recovered shard %s: %d segment(s), %d row(s), %d file(s) quarantined",
        shard.name,
        len(good),
        sum(s.rows for s in good),
        len(quarantined),
    )
    return RecoveryReport(shard.name, sum(s.rows for s in good), len(good), tuple(quarantined), False)
