"""The judge's side of the function-call harness: call requests out, strictly parsed answers in.

The sandbox's side (the driver and its encoder) is `pyharness.py`, which runs inside the
sandbox and so cannot import this. Answers are untrusted: `loads` + `decode` accept only the
tagged plain types `pyharness.encode` produces and build fresh values from them.
"""

from __future__ import annotations

import binascii
import json
import marshal

from hpcrl.sandbox.pyharness import MAX_DEPTH, CodecError, encode

__all__ = ["CodecError", "decode", "load_request", "loads", "request"]

_SPECIAL_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def decode(data, depth: int = 0):
    """Tagged form -> plain value, strictly: anything unexpected raises CodecError."""
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    t = type(data)
    if data is None or t is bool or t is str or t is int or t is float:
        return data
    if t is list:
        return [decode(v, depth + 1) for v in data]
    if t is not dict or len(data) != 1:
        raise CodecError(f"malformed value of type {t.__name__}")
    ((tag, body),) = data.items()
    if tag == "i" and type(body) is str:
        try:
            return int(body)
        except ValueError:
            raise CodecError("malformed int") from None
    if tag == "x" and body in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[body]
    if tag == "b" and type(body) is str:
        try:
            return binascii.a2b_base64(body.encode("ascii"), strict_mode=True)
        except (ValueError, UnicodeEncodeError):
            raise CodecError("malformed bytes") from None
    if type(body) is not list:
        raise CodecError(f"malformed {tag!r} value")
    items = [decode(v, depth + 1) for v in body] if tag != "d" else None
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(_hashable(items))
    if tag == "f":
        return frozenset(_hashable(items))
    if tag == "c" and len(items) == 2 and all(type(v) in (int, float) for v in items):
        return complex(items[0], items[1])
    if tag == "d":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise CodecError("malformed dict item")
            key = decode(pair[0], depth + 1)
            try:
                out[key] = decode(pair[1], depth + 1)
            except TypeError:
                raise CodecError("unhashable dict key") from None
        return out
    raise CodecError(f"unknown tag {tag!r}")


def _hashable(items):
    try:
        for v in items:
            hash(v)
    except TypeError:
        raise CodecError("unhashable set item") from None
    return items


def loads(line: bytes):
    """Parse one answer line strictly (bare NaN/Infinity refused; floats arrive tagged)."""

    def no_constants(name):
        raise CodecError(f"bare {name} is not allowed")

    try:
        return json.loads(line, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"malformed message: {exc}") from None


def request(rid: int, fn: str, args: list) -> bytes:
    """A call request line. marshal is fine in this direction: the judge writes, the driver reads."""
    if not fn.isidentifier():
        raise CodecError(f"bad function name {fn!r}")
    encode(args)  # refuse anything but plain data, as for answers
    return f"{rid} {fn} ".encode() + marshal.dumps(args).hex().encode() + b"\n"


def load_request(source: str) -> bytes:
    """The first line to the driver: the candidate's source."""
    return b"load " + marshal.dumps(str(source)).hex().encode() + b"\n"
