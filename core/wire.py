"""The wire form of a message: a msgpack envelope and zero-copy numpy frames; never pickle.

    frames = encode("exec", {"lang": "py"}, arrays=[tokens], msg_id="r-1")
    send_frames(sock, frames)           # one multipart message (big arrays zero-copy)
    env = decode(frames, limits)        # Envelope(kind, body, arrays, msg_id); raises BadMessage
    # frame 0: msgpack {"v": 1, "k": kind, "b": body, "i": msg_id, "a": [[dtype, shape], ...]}
    # frames 1..n: the raw bytes of each array, sent without a copy, received as read-only views

No sockets are made here: `hpcrl.core.transport` holds the keys, endpoints and the Node that
sends and receives these frames over CURVE. `WireLimits` bounds what `decode` accepts and
what the Node's sockets queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

__all__ = ["BadMessage", "Envelope", "WireLimits", "decode", "encode", "send_frames"]

ENVELOPE_VERSION = 1
_ALLOWED_KINDS = "biuf"  # bool, ints, floats: no object, string or void dtypes on the wire


class BadMessage(ValueError):
    """An inbound message is malformed, oversized or not allowed; str() is the reason to log."""


@dataclass(frozen=True)
class WireLimits:
    max_message_bytes: int = 256 << 20  # per frame (ZMQ_MAXMSGSIZE) and per message (decode)
    max_frames: int = 4096
    max_header_bytes: int = 1 << 20
    sndhwm: int = 1000  # messages queued per peer before send blocks / EAGAIN
    rcvhwm: int = 1000
    heartbeat_ivl_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    heartbeat_ttl_s: float = 10.0
    linger_s: float = 1.0


@dataclass(frozen=True)
class Envelope:
    kind: str
    body: Any
    arrays: tuple[np.ndarray, ...] = ()
    msg_id: str | None = None


def encode(kind: str, body: Any = None, arrays: Sequence[np.ndarray] = (), msg_id: str | None = None) -> list:
    """Frames for one message: a msgpack header, then each array's bytes (not copied)."""
    out = []
    specs = []
    for i, arr in enumerate(arrays):
        if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if arr.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"array {i}: dtype {arr.dtype} cannot travel; use bool, int or float arrays")
        specs.append([arr.dtype.str, list(arr.shape)])
        out.append(arr)
    header = {"v": ENVELOPE_VERSION, "k": kind, "b": body, "a": specs}
    if msg_id is not None:
        header["i"] = msg_id
    return [msgpack.packb(header, use_bin_type=True), *out]


def _no_ext(code: int, data: bytes) -> Any:
    raise BadMessage(f"msgpack extension type {code} is not accepted")


_DTYPES: dict[str, np.dtype] = {}  # wire dtype strings seen and accepted (a few recur)


def _wire_dtype(spec: str) -> np.dtype:
    """The dtype for a wire spec string, or BadMessage."""
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError) as exc:
        raise BadMessage(f"bad dtype {spec!r}: {exc}") from None
    if dtype.kind not in _ALLOWED_KINDS or dtype.hasobject or dtype.shape:
        raise BadMessage(f"dtype {dtype} not allowed")
    if len(_DTYPES) < 256:
        _DTYPES[spec] = dtype
    return dtype


def decode(frames: Sequence[Any], limits: WireLimits = WireLimits()) -> Envelope:
    """Parse and check one message; arrays are zero-copy read-only views of the frames.

    This runs once per trajectory on the store writer, so it avoids per-frame allocations
    (numpy reads zmq.Frame and bytes through the buffer protocol directly).
    """
    n = len(frames)
    if not n:
        raise BadMessage("empty message")
    if n > limits.max_frames:
        raise BadMessage(f"{n} frames (limit {limits.max_frames})")
    if not all(type(f) in (zmq.Frame, bytes) for f in frames):
        frames = [memoryview(f) for f in frames]  # anything else with a buffer (arrays, memoryviews)
    sizes = [memoryview(f).nbytes if type(f) is memoryview else len(f) for f in frames]
    total = sum(sizes)
    if total > limits.max_message_bytes:
        raise BadMessage(f"oversized: {total} bytes (limit {limits.max_message_bytes})")
    if sizes[0] > limits.max_header_bytes:
        raise BadMessage(f"header of {sizes[0]} bytes (limit {limits.max_header_bytes})")
    try:
        # ext_hook refuses every extension type and timestamp=1 turns msgpack's one built-in
        # extension into a float: the result holds only maps, lists, str, bytes, numbers.
        header = msgpack.unpackb(frames[0], raw=False, ext_hook=_no_ext, strict_map_key=False, timestamp=1)
    except BadMessage:
        raise
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise BadMessage(f"header is not msgpack: {type(exc).__name__}: {exc}") from None
    if type(header) is not dict or header.get("v") != ENVELOPE_VERSION:
        raise BadMessage(f"not an hpcrl v{ENVELOPE_VERSION} envelope")
    kind, body, specs, msg_id = header.get("k"), header.get("b"), header.get("a"), header.get("i")
    if type(kind) is not str or type(specs) is not list or not (msg_id is None or type(msg_id) is str):
        raise BadMessage("envelope fields k (str), a (list), i (str) have wrong types")
    if len(specs) != n - 1:
        raise BadMessage(f"header announces {len(specs)} array(s), message carries {n - 1}")
    arrays = []
    for i, spec in enumerate(specs):
        if type(spec) is not list or len(spec) != 2 or type(spec[1]) is not list:
            raise BadMessage(f"array {i}: bad spec {spec!r}")
        dtype = _DTYPES.get(spec[0]) if type(spec[0]) is str else None
        if dtype is None:
            try:
                dtype = _wire_dtype(spec[0])
            except BadMessage as exc:
                raise BadMessage(f"array {i}: {exc}") from None
        shape = spec[1]
        if len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:
            count = shape[0]
        elif len(shape) <= 8 and all(type(d) is int and d >= 0 for d in shape):
            count = math.prod(shape)
        else:
            raise BadMessage(f"array {i}: shape {shape} not allowed")
        if count * dtype.itemsize != sizes[i + 1]:
            raise BadMessage(f"array {i}: {sizes[i + 1]} bytes do not fill {dtype} {shape}")
        arr = np.frombuffer(frames[i + 1], dtype=dtype)
        # Read-only: the memory may be the sender's own (inproc) or zmq's receive buffer.
        arr.flags.writeable = False
        arrays.append(arr if len(shape) == 1 else arr.reshape(shape))
    return Envelope(kind, body, tuple(arrays), msg_id)


_MORE = int(zmq.SNDMORE)
ZERO_COPY_MIN_BYTES = 1 << 16


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Send one multipart message. Frames of 64 KiB and more go zero-copy; smaller ones are
    copied by libzmq, which costs less than tracking them (pyzmq's own copy_threshold rule),
    and flags stay plain ints (pyzmq's send_multipart spends microseconds on enum ops per frame).
    Raises zmq.Again (nothing sent) if `flags` has NOBLOCK and the message cannot be queued."""
    flags = int(flags)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        size = f.nbytes if isinstance(f, (np.ndarray, memoryview)) else len(f)
        sock.send(f, flags | _MORE if i < last else flags, copy=size < ZERO_COPY_MIN_BYTES)
