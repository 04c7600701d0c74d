"""One segment: an immutable HDF5 file holding one flush of a writer, checksummed end to end.

    seg = create_segment(tmp, parts, attrs, compression)  # HDF5 structure; uncompressed data not yet in
    info = seg.fill(fd)                                    # data, checksums, header (any thread: no GIL held
                                                           # while it copies); then fsync, rename (writer)
    info = write_segment(tmp, cols, attrs)                 # both at once, for tools and tests
    cols = read_segment(path, expect)                      # hpcrl.rl.store.segment_read: verified
                                                           # before HDF5 parses a byte of it

Format v2. The file opens with a 512-byte HDF5 user block, which HDF5 leaves to the application
(h5py and h5dump read the file as usual), holding the segment header:

    0    magic "HPCRL-SEGMENT\\n\\0\\0"   16 bytes, never the HDF5 signature
    16   format version                 u32 (2)
    20   region count                   u32
    24   file length                    u64
    32   regions, 24 bytes each         offset u64, length u64, CRC-32 u32, kind u8, 3 zero bytes
    508  CRC-32 of bytes 0..507          u32: the segment's checksum, the one its manifest lists

The regions partition the file after the user block: one per uncompressed dataset (contiguous
storage that HDF5 allocates when the structure is written and the writer fills with pwritev
afterwards; kind = its index in ARRAY_NAMES) and one per stretch HDF5 wrote itself (kind 255:
superblock, object headers, the JSON attribute with the row count and the enum tables,
compressed chunks). So every byte is under a CRC-32, every region CRC under the header's, and
a reader checks the header, the file length and the CRC of every byte it uses before HDF5
parses the file: a damaged segment raises SegmentError, it cannot crash HDF5 or hand out
wrong enum names or row counts (v1 checked only the five arrays). Reading needs no HDF5 data
path either: one read of the file, then the arrays are views into it.

Why two steps: the writer runs both on its sync thread, off the thread that encodes (see
`hpcrl.rl.store.writer`); `fill` writes the arrays straight from the batches they arrived in
(no concatenation) with one pwritev, and computes the CRCs without the GIL.

Format v1 segments (checksum over the five arrays in their JSON attribute) still read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import re
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from h5py import h5a, h5d, h5f, h5p, h5s, h5t, h5z

from hpcrl import __version__
from hpcrl.core.files import fsync_path
from hpcrl.rl.record.columns import Columns

SEGMENT_FORMAT = "hpcrl-trajectory-segment"
SEGMENT_FORMAT_VERSION = 2
SEGMENT_RE = re.compile(r"seg-(\d{6,})-(\d{16})\.h5")
SEGMENT_ATTR = "hpcrl_segment"  # JSON: format, version, rows, enum tables, writer, seq, ...
# Token data is the bulk; the two record tables are small and compress poorly, so only
# these take the configured filter.
COMPRESSED = ("tokens", "logprobs", "loss_mask")
CHUNK_BYTES = 8 << 20  # compressed datasets only: the rest is contiguous

HEADER_SIZE = 512  # the HDF5 user block (a power of two >= 512)
MAGIC = b"HPCRL-SEGMENT\n\x00\x00"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
HDF5_BYTES = 255  # region kind: bytes HDF5 wrote
HEAD = struct.Struct("<16sIIQ")
REGION = struct.Struct("<QQIB3x")
CRC_AT = HEADER_SIZE - 4
MAX_REGIONS = (CRC_AT - HEAD.size) // REGION.size
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16

Compression = Literal["none", "gzip", "lzf"]


class SegmentError(Exception):
    """A segment file is unreadable or does not match its checksum/manifest; str() is the reason."""


@dataclass(frozen=True)
class SegmentInfo:  # one segment as listed in a manifest
    name: str
    rows: int
    crc32: int  # v2: the header's CRC (it covers every byte); v1: CRC of the five arrays
    bytes: int  # file size
    flushed_at: float
    min_policy_version: int
    max_policy_version: int
    # The episode numbers it holds lie in [min_episode, max_episode] (-1: not recorded, manifests
    # written before the range was): `hpcrl traj show` opens only the segments that may hold one.
    min_episode: int = -1
    max_episode: int = -1


def segment_name(seq: int, flushed_us: int) -> str:
    return f"seg-{seq:06d}-{flushed_us:016d}.h5"


def parse_segment_name(name: str) -> tuple[int, int] | None:  # (seq, flush time in unix us)
    return (int(m.group(1)), int(m.group(2))) if (m := SEGMENT_RE.fullmatch(name)) else None


# -- CRC-32 ---------------------------------------------------------------------------------------


def _libdeflate_crc32():
    """libdeflate's CRC-32 (PCLMUL: ~10 GB/s here, zlib ~3.6), or None. Same polynomial as
    zlib, so the same values: the file format does not depend on it, only the speed does."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("deflate") or "libdeflate.so.0").libdeflate_crc32
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_uint32
    probe = bytes(range(256)) * 64
    return fn if fn(7, probe, len(probe)) == zlib.crc32(probe, 7) else None


_LIBDEFLATE_CRC32 = _libdeflate_crc32()


def crc32(data, value: int = 0) -> int:
    """zlib.crc32 of a bytes-like object, faster for large ones (the GIL is released either way)."""
    view = memoryview(data)
    if _LIBDEFLATE_CRC32 is None or view.nbytes < 65536:
        return zlib.crc32(view, value)
    return _LIBDEFLATE_CRC32(value, np.frombuffer(view.cast("B"), np.uint8).ctypes.data, view.nbytes)


# -- HDF5 property lists and types (built once: each costs a few µs per call) -----------------


@functools.lru_cache(maxsize=64)
def _h5type(dtype: np.dtype) -> h5t.TypeID:
    return h5t.py_create(dtype, logical=True)


@functools.lru_cache(maxsize=1)
def _fapl() -> h5p.PropFAID:
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_LATEST, h5f.LIBVER_LATEST)
    fapl.set_fclose_degree(h5f.CLOSE_STRONG)
    fapl.set_file_locking(False, True)  # never takes locks, as HDF5_USE_FILE_LOCKING=FALSE does
    fapl.set_cache(0, 0, 0, 0.75)  # no raw-data chunk cache: compressed chunks go straight out
    # Arrays of 4 KiB or more start at a multiple of 64 bytes, so a reader's views into the
    # file's bytes are aligned (the user block is 512, so file offsets are too).
    fapl.set_alignment(4096, 64)
    return fapl


@functools.lru_cache(maxsize=1)
def _fcpl() -> h5p.PropFCID:
    fcpl = h5p.create(h5p.FILE_CREATE)
    fcpl.set_userblock(HEADER_SIZE)
    return fcpl


@functools.lru_cache(maxsize=1)
def _contiguous() -> h5p.PropDCID:
    plist = h5p.create(h5p.DATASET_CREATE)
    plist.set_layout(h5d.CONTIGUOUS)
    plist.set_alloc_time(h5d.ALLOC_TIME_EARLY)  # its place in the file is known at once
    plist.set_fill_time(h5d.FILL_TIME_NEVER)  # every byte is written by fill(): not twice
    return plist


def _filtered(chunk: int, compression: Compression) -> h5p.PropDCID:
    plist = h5p.create(h5p.DATASET_CREATE)
    plist.set_chunk((chunk,))
    plist.set_fill_time(h5d.FILL_TIME_NEVER)
    plist.set_shuffle()
    if compression == "gzip":
        plist.set_deflate(1)  # level 1: most of gzip's gain on token ids at a fraction of the CPU
    else:
        plist.set_filter(h5z.FILTER_LZF, h5z.FLAG_OPTIONAL)
    return plist


def _write_attr(fid: h5f.FileID, name: str, text: str) -> None:
    data = text.encode()
    tid = h5t.C_S1.copy()
    tid.set_size(max(1, len(data)))
    tid.set_strpad(h5t.STR_NULLPAD)
    tid.set_cset(h5t.CSET_UTF8)
    attr = h5a.create(fid, name.encode(), tid, h5s.create(h5s.SCALAR))
    attr.write(np.array(data, dtype=f"S{max(1, len(data))}"), mtype=tid)


def _write_filtered(fid: h5f.FileID, name: str, arr: np.ndarray, compression: Compression) -> None:
    n, tid = len(arr), _h5type(arr.dtype)
    # Equal chunks of at most CHUNK_BYTES: a fixed chunk size would leave the last chunk of
    # every dataset mostly empty, and chunks are stored whole.
    n_chunks = max(1, -(-n // max(1, CHUNK_BYTES // arr.dtype.itemsize)))
    chunk = max(1, -(-n // n_chunks))
    space = h5s.create_simple((n,), (h5s.UNLIMITED,))
    ds = h5d.create(fid, name.encode(), tid, space, dcpl=_filtered(chunk, compression))
    try:
        ds.write(h5s.ALL, h5s.ALL, np.ascontiguousarray(arr), mtype=tid)
    finally:
        ds.close()


def _as_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))


# -- writing --------------------------------------------------------------------------------------


@dataclass
class SegmentFile:
    """A segment whose HDF5 structure is written and closed; `fill` writes the rest."""

    tmp: Path
    name: str  # its final name
    length: int  # the file's length once filled
    rows: int
    flushed_at: float
    min_policy_version: int
    max_policy_version: int
    min_episode: int
    max_episode: int
    # (offset, length, kind, pieces): each uncompressed dataset's storage and the arrays, in
    # order, whose bytes fill it (the batches the segment was made of: never concatenated).
    data: list[tuple[int, int, int, list[np.ndarray]]]

    def fill(self, fd: int) -> SegmentInfo:
        """Write the data and the header through `fd` (open for reading and writing); the
        returned info carries the checksum. Any thread may call it: the bulk (one pwritev, the
        CRCs of large buffers) runs without the GIL, and there are few calls that need it back."""
        regions: list[tuple[int, int, int, int]] = []  # (offset, length, crc, kind)
        iov: list[memoryview] = []  # the whole file after the header, in order
        pos = HEADER_SIZE
        for offset, length, kind, pieces in sorted(self.data, key=lambda d: d[0]):
            if offset < pos or offset + length > self.length:
                raise OSError(f"{self.tmp.name}: dataset storage at {offset}+{length} overlaps another region")
            if offset > pos:
                regions.append(_hdf5_region(fd, pos, offset - pos, iov))
            views = [v for v in (_as_bytes(p) for p in pieces) if v.nbytes]
            crc = 0
            for v in views:
                crc = crc32(v, crc)
            regions.append((offset, length, crc, kind))
            iov += views
            pos = offset + length
        if pos < self.length:
            regions.append(_hdf5_region(fd, pos, self.length - pos, iov))
        if len(regions) > MAX_REGIONS:
            raise OSError(f"{self.tmp.name}: {len(regions)} regions do not fit the segment header")
        header = bytearray(HEADER_SIZE)
        HEAD.pack_into(header, 0, MAGIC, SEGMENT_FORMAT_VERSION, len(regions), self.length)
        for i, region in enumerate(regions):
            REGION.pack_into(header, HEAD.size + i * REGION.size, *region)
        crc = zlib.crc32(memoryview(header)[:CRC_AT])
        struct.pack_into("<I", header, CRC_AT, crc)
        # One call writes it all: the header, the data, and HDF5's own bytes again as read
        # (rewriting identical bytes costs less than a system call and a GIL hand-off per region).
        _pwritev_all(fd, [memoryview(header), *iov], 0, self.length)
        return SegmentInfo(
            self.name,
            self.rows,
            crc,
            self.length,
            self.flushed_at,
            self.min_policy_version,
            self.max_policy_version,
            self.min_episode,
            self.max_episode,
        )


def _hdf5_region(fd: int, offset: int, length: int, iov: list[memoryview]) -> tuple[int, int, int, int]:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise OSError(f"short read of {length} bytes at {offset}: {len(data)}")
    iov.append(memoryview(data))
    return (offset, length, crc32(data), HDF5_BYTES)


def _pwritev_all(fd: int, views: list[memoryview], offset: int, length: int) -> None:
    views = [v for v in views if v.nbytes]
    if sum(v.nbytes for v in views) != length - offset:
        raise OSError(f"{length - offset} bytes to write, {sum(v.nbytes for v in views)} bytes of data")
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)  # a short write is resumed where it stopped
        if n <= 0:
            raise OSError(f"pwritev wrote nothing at {offset}")
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def create_segment(
    tmp: Path, parts: Sequence[Columns], attrs: dict[str, Any], compression: Compression = "none"
) -> SegmentFile:
    """Write the HDF5 structure of a segment holding `parts` (in order) to the new file `tmp`
    (`<final name>.tmp`) and close it; `SegmentFile.fill` then writes the data. On any error
    (ENOSPC, an HDF5 error at close) `tmp` is removed and the error raised.

    The low-level h5py API, cached property lists: a flush is a few MB, so fixed costs matter.
    """
    if not parts:
        parts = [Columns.encode([])]
    traj, steps = Columns.tables(parts)
    names = (parts[0].truncation_names, parts[0].sandbox_names)
    if any((p.truncation_names, p.sandbox_names) != names for p in parts):
        raise ValueError("the batches of one segment must share their enum tables")
    arrays = [("traj", traj.dtype, [traj]), ("steps", steps.dtype, [steps])] + [
        (n, getattr(parts[0], n).dtype, [getattr(p, n) for p in parts]) for n in ("tokens", "logprobs", "loss_mask")
    ]
    flushed_at = float(attrs.get("flushed_at", time.time()))
    meta = {
        "format": SEGMENT_FORMAT,
        "format_version": SEGMENT_FORMAT_VERSION,
        "rows": len(traj),
        "truncation_names": list(names[0]),
        "sandbox_names": list(names[1]),
        "compression": compression,
        "hpcrl_version": __version__,
        **attrs,
    }
    data = []
    try:
        fid = h5f.create(os.fsencode(tmp), h5f.ACC_EXCL, fcpl=_fcpl(), fapl=_fapl())  # ACC_EXCL: fail if it exists
    except FileExistsError:
        raise  # not ours to remove
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        for kind, (name, dtype, pieces) in enumerate(arrays):
            n = sum(len(p) for p in pieces)
            tid = _h5type(dtype)
            if tid.get_size() != dtype.itemsize:  # the file type must be the array's bytes
                raise ValueError(f"{name}: HDF5 type of {tid.get_size()} bytes for {dtype.itemsize}-byte items")
            if compression != "none" and name in COMPRESSED and n:
                _write_filtered(fid, name, pieces[0] if len(pieces) == 1 else np.concatenate(pieces), compression)
                continue
            ds = h5d.create(fid, name.encode(), tid, h5s.create_simple((n,), (n,)), dcpl=_contiguous())
            try:
                if n:
                    data.append((ds.get_offset(), n * dtype.itemsize, kind, pieces))
            finally:
                ds.close()
        # One JSON attribute: each HDF5 attribute costs a metadata object; `h5dump -A` shows it.
        _write_attr(fid, SEGMENT_ATTR, json.dumps(meta, sort_keys=True))
    except BaseException:
        try:
            fid.close()
        except Exception:  # the first error is the one to report
            pass
        tmp.unlink(missing_ok=True)
        raise
    try:
        fid.close()  # HDF5 writes its metadata here: ENOSPC or an HDF5 error may surface now
        length = os.stat(tmp).st_size  # HDF5 sets it to the end of its allocations at close
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return SegmentFile(
        tmp,
        tmp.name.removesuffix(".tmp"),
        length,
        len(traj),
        flushed_at,
        int(traj["min_policy_version"].min()) if len(traj) else 0,
        int(traj["max_policy_version"].max()) if len(traj) else 0,
        int(traj["episode"].min()) if len(traj) else -1,
        int(traj["episode"].max()) if len(traj) else -1,
        data,
    )


def write_segment(
    tmp: Path, cols: Columns | Sequence[Columns], attrs: dict[str, Any], compression: Compression = "none"
) -> SegmentInfo:
    """create_segment + fill in this thread: a complete segment file at `tmp` (not yet synced)."""
    seg = create_segment(tmp, [cols] if isinstance(cols, Columns) else cols, attrs, compression)
    try:
        fd = os.open(tmp, os.O_RDWR)
        try:
            return seg.fill(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def publish_segment(tmp: Path, path: Path) -> None:
    """fsync the complete temporary file, rename it to its final name, fsync the directory."""
    fsync_path(tmp)
    os.rename(tmp, path)
    fsync_path(path.parent, directory=True)


def _sync_file_range():
    """libc's sync_file_range (Linux), or None: os does not expose it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint), ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the dirty pages, do not wait


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk now, without waiting (advisory: never fails).

    The sync thread fsyncs segments one after another; a segment written while the previous
    one syncs would otherwise sit in the page cache until its own fsync starts the I/O. Kicked
    off at once, its data reaches the disk meanwhile and its fsync is mostly the journal
    commit (~0.8 ms instead of ~1.0 here, and a shorter tail); with another job on one of two
    cores, the writer then waited ~2 ms per 24 flushes for syncs instead of 7-13 ms. Unlike
    posix_fadvise(DONTNEED) it keeps the pages cached for readers.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
