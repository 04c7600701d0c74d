"""Reading a segment: verified before HDF5 parses a byte of it (format v2), or as format v1.

    cols = read_segment(path, expect)                  # SegmentError for damage of any kind
    cols, info = load_segment(path)                    # and its SegmentInfo as found (recovery)
    ids = read_segment(path, fields=("traj",)).ids()   # only what is read is read and checked

See `hpcrl.rl.store.segment` for the format. A full read is one read of the file; the header
CRC, the file length and every region's CRC are checked on those bytes, then HDF5 opens the
file only to name the datasets, and the arrays are views into the bytes read (aligned, read
only). Every failure, whatever raised it (OSError, h5py, numpy), comes out as SegmentError.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import h5py
import numpy as np

from hpcrl.rl.record.columns import Columns, ColumnsError
from hpcrl.rl.record.tables import ARRAY_NAMES, upgrade_tables
from hpcrl.rl.store.segment import (
    CRC_AT,
    HDF5_BYTES,
    HDF5_SIGNATURE,
    HEAD,
    HEADER_SIZE,
    MAGIC,
    MAX_REGIONS,
    REGION,
    SEGMENT_ATTR,
    SEGMENT_FORMAT,
    SEGMENT_FORMAT_VERSION,
    SegmentError,
    SegmentInfo,
    crc32,
    parse_segment_name,
)


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

    With `fields` a subset (e.g. ("traj",)), only those datasets (and HDF5's own bytes) are read
    and checked: for listings and id indexes. Every failure, whatever its kind, is a SegmentError:
    a damaged file must never crash the process that reads it.
    """
    return load_segment(path, expect, fields)[0]


def load_segment(
    path: Path, expect: SegmentInfo | None = None, fields: tuple[str, ...] = ARRAY_NAMES
) -> tuple[Columns, SegmentInfo]:
    """read_segment, and the segment's SegmentInfo as found on disk (recovery lists it)."""
    fields = tuple(fields)
    try:
        return _load(Path(path), expect, fields)
    except SegmentError:
        raise
    except Exception as exc:  # OSError, h5py's errors, numpy's: all are damage here
        raise SegmentError(f"cannot read: {type(exc).__name__}: {exc}") from None


def _load(path: Path, expect: SegmentInfo | None, fields: tuple[str, ...]) -> tuple[Columns, SegmentInfo]:
    if not fields or any(f not in ARRAY_NAMES for f in fields):
        raise ValueError(f"fields must be a non-empty subset of {ARRAY_NAMES}")
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(HEADER_SIZE)
        if head.startswith(HDF5_SIGNATURE):
            fh.close()
            return _load_v1(path, expect, fields, size)
        if not head.startswith(MAGIC):
            raise SegmentError("cannot read: not an hpcrl segment (unknown header)")
        crc, regions = _parse_header(head, size)
        if expect is not None and (expect.crc32 != crc or expect.bytes != size):
            raise SegmentError(
                f"checksum mismatch: header {crc:#010x} and {size} bytes, "
                f"manifest {expect.crc32:#010x} and {expect.bytes} bytes"
            )
        kinds = {ARRAY_NAMES.index(f) for f in fields} | {HDF5_BYTES}
        full = set(fields) == set(ARRAY_NAMES)
        if full:  # one read of the whole file: the arrays become views into it
            buf = np.empty(size, np.uint8)
            buf[:HEADER_SIZE] = np.frombuffer(head, np.uint8)
            _readinto_all(fh, memoryview(buf)[HEADER_SIZE:])
        spans: dict[int, np.ndarray] = {}
        for offset, length, want, kind in regions:
            if kind not in kinds:
                continue
            piece = buf[offset : offset + length] if full else _pread(fh.fileno(), offset, length)
            if crc32(piece) != want:
                what = "HDF5 metadata" if kind == HDF5_BYTES else ARRAY_NAMES[kind]
                raise SegmentError(f"checksum mismatch in {what} at byte {offset} ({length} bytes)")
            if kind != HDF5_BYTES:
                spans[kind] = piece
    # Every byte HDF5 will parse is verified now.
    with h5py.File(path, "r", locking=False) as f:
        meta = segment_meta(f)
        if int(meta.get("format_version", -1)) != SEGMENT_FORMAT_VERSION:
            raise SegmentError(f"header v{SEGMENT_FORMAT_VERSION} but attribute v{meta.get('format_version')}")
        data = {}
        for name in fields:
            if name not in f:
                raise SegmentError(f"datasets missing: {name}")
            ds = f[name]
            kind = ARRAY_NAMES.index(name)
            if ds.ndim != 1:
                raise SegmentError(f"{name}: {ds.ndim}-D, expected 1-D")
            if ds.chunks is not None:  # compressed: HDF5 decodes bytes already checked above
                data[name] = ds[()]
                continue
            nbytes = len(ds) * ds.dtype.itemsize
            span = spans.get(kind)
            if nbytes == 0 and span is None:
                data[name] = np.zeros(0, ds.dtype)
                continue
            if span is None or len(span) != nbytes or ds.id.get_offset() != _offset(regions, kind):
                raise SegmentError(f"{name}: its storage does not match the segment header")
            arr = span.view(ds.dtype)
            data[name] = arr if arr.flags.aligned else arr.copy()
        rows, names = int(meta["rows"]), (tuple(meta["truncation_names"]), tuple(meta["sandbox_names"]))
    for arr in data.values():
        arr.flags.writeable = False  # records decoded from it share this memory
    cols = _columns(data, names)
    if len(cols.traj) != rows:
        raise SegmentError(f"holds {len(cols.traj)} rows, its header says {rows}")
    if expect is not None and expect.rows != rows:
        raise SegmentError(f"holds {rows} rows, the manifest says {expect.rows}")
    if full:
        _validate(cols)
    return cols, _info(path, cols, crc, size)


def _parse_header(head: bytes, size: int) -> tuple[int, list[tuple[int, int, int, int]]]:
    if len(head) < HEADER_SIZE:
        raise SegmentError(f"truncated: {size} bytes, shorter than the segment header")
    (crc,) = struct.unpack_from("<I", head, CRC_AT)
    if zlib.crc32(head[:CRC_AT]) != crc:
        raise SegmentError("checksum mismatch in the segment header")
    _, version, n, length = HEAD.unpack_from(head, 0)
    if version != SEGMENT_FORMAT_VERSION:
        raise SegmentError(f"segment format v{version} is not one this hpcrl reads (v1, v2); upgrade hpcrl")
    if length != size:
        raise SegmentError(f"truncated or extended: {size} bytes, its header says {length}")
    if not 0 < n <= MAX_REGIONS:
        raise SegmentError(f"damaged header: {n} regions")
    regions, pos = [], HEADER_SIZE
    for i in range(n):
        offset, rlen, rcrc, kind = REGION.unpack_from(head, HEAD.size + i * REGION.size)
        if offset != pos or rlen <= 0 or not (kind == HDF5_BYTES or kind < len(ARRAY_NAMES)):
            raise SegmentError(f"damaged header: region {i} at {offset}+{rlen} (kind {kind})")
        regions.append((offset, rlen, rcrc, kind))
        pos += rlen
    if pos != size:
        raise SegmentError(f"damaged header: its regions end at {pos}, the file at {size}")
    return crc, regions


def _offset(regions, kind: int) -> int | None:
    return next((offset for offset, _, _, k in regions if k == kind), None)


def _readinto_all(fh, view: memoryview) -> None:
    while view.nbytes:
        n = fh.readinto(view)
        if not n:
            raise SegmentError("truncated while reading")
        view = view[n:]


def _pread(fd: int, offset: int, length: int) -> np.ndarray:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise SegmentError(f"truncated while reading {length} bytes at {offset}")
    return np.frombuffer(data, np.uint8)


_EMPTY = {
    "traj": lambda: np.zeros(0, np.dtype([("id", "S1")])),
    "steps": lambda: None,
    "tokens": lambda: np.zeros(0, np.int32),
    "logprobs": lambda: np.zeros(0, np.float32),
    "loss_mask": lambda: np.zeros(0, np.uint8),
}


def _columns(data: dict[str, np.ndarray], names: tuple[tuple[str, ...], tuple[str, ...]]) -> Columns:
    arrays = {n: data[n] if n in data else _EMPTY[n]() for n in ARRAY_NAMES}
    # Segments written before schema v2 hold narrower tables: read as v2, new fields defaulted.
    arrays["traj"], arrays["steps"] = upgrade_tables(arrays["traj"], arrays["steps"])
    return Columns(
        **arrays,
        truncation_names=names[0],
        sandbox_names=names[1],
    )


def _validate(cols: Columns) -> None:
    try:
        cols.validate()
    except ColumnsError as exc:
        raise SegmentError(f"inconsistent columns: {exc}") from None


def _info(path: Path, cols: Columns, crc: int, size: int) -> SegmentInfo:
    parsed = parse_segment_name(path.name)
    t = cols.traj
    pv = len(t) and "min_policy_version" in (t.dtype.names or ())
    return SegmentInfo(
        path.name,
        cols.rows,
        crc,
        size,
        parsed[1] / 1e6 if parsed else 0.0,
        int(t["min_policy_version"].min()) if pv else 0,
        int(t["max_policy_version"].max()) if pv else 0,
        int(t["episode"].min()) if len(t) else -1,
        int(t["episode"].max()) if len(t) else -1,
    )


def _load_v1(path: Path, expect: SegmentInfo | None, fields: tuple[str, ...], size: int):
    """Format v1: five datasets and a JSON attribute whose CRC-32 covers the arrays only."""
    with h5py.File(path, "r", locking=False) as f:
        meta = segment_meta(f)
        if int(meta.get("format_version", -1)) != 1:
            raise SegmentError(f"v1 layout but attribute v{meta.get('format_version')}")
        missing = [n for n in fields if n not in f]
        if missing:
            raise SegmentError(f"datasets missing: {', '.join(missing)}")
        data = {n: f[n][()] for n in fields}
        rows, crc = int(meta["rows"]), int(meta["crc32"])
        names = (tuple(meta["truncation_names"]), tuple(meta["sandbox_names"]))
    for arr in data.values():
        arr.flags.writeable = False
    cols = _columns(data, names)
    if len(cols.traj) != rows:
        raise SegmentError(f"holds {len(cols.traj)} rows, its header says {rows}")
    if expect is not None and expect.rows != rows:
        raise SegmentError(f"holds {rows} rows, the manifest says {expect.rows}")
    if set(fields) == set(ARRAY_NAMES):
        # Over the arrays as stored: the columns' tables may be upgraded copies (schema v1).
        actual = 0
        for name in ARRAY_NAMES:
            actual = zlib.crc32(memoryview(np.ascontiguousarray(data[name])).cast("B"), actual)
        if actual != crc:
            raise SegmentError(f"checksum mismatch: data {actual:#010x}, header {crc:#010x}")
        if expect is not None and expect.crc32 != crc:
            raise SegmentError(f"checksum mismatch: header {crc:#010x}, manifest {expect.crc32:#010x}")
        _validate(cols)
    return cols, _info(path, cols, crc, size)
