"""The flat arrays of a batch in columns: where back-to-back pieces start, gathering ranges out of
them, and reusable storage for encoding batch after batch (`EncodeBuffers`)."""

from __future__ import annotations

import numpy as np

__all__ = ["EncodeBuffers", "as_bytes", "gather", "starts"]


def starts(lengths: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum: where each of back-to-back pieces of these lengths starts."""
    out = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=out[1:])
    return out


def gather(first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the ranges [first, first + length) one after another (for numpy fancy indexing)."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, np.int64)
    return np.repeat(first.astype(np.int64) - starts(lengths), lengths) + np.arange(total)


def as_bytes(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).view(np.uint8).reshape(-1)


class EncodeBuffers:
    """Reusable storage for the flat arrays of `Columns.encode`, for code that encodes batch
    after batch and is done with each Columns before encoding the next (a shard writer).

    Why: fresh MB-sized arrays per batch can be fresh pages. With HDF5's per-file
    allocations in between, glibc often handed the freed heap top back to the kernel after a
    flush, and a writer then took ~500 page faults per flush of 64 trajectories (~0.25 ms, a
    tenth of its CPU). Columns encoded with buffers are views into them, valid until the next
    encode with the same buffers.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def take(self, name: str, n: int, dtype) -> np.ndarray:
        buf = self._arrays.get(name)
        if buf is None or len(buf) < n:
            # Headroom: age-triggered flushes and long episodes vary the size a little.
            buf = self._arrays[name] = np.empty(max(n + n // 4, 2 * len(buf) if buf is not None else 0), dtype)
        return buf[:n]
