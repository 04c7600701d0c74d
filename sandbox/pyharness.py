"""Function-call harness for judging candidates: a value codec and the in-sandbox driver.

This file is copied into the sandbox and run there as

    python3 -S -B main.py     # stdin: the candidate, then call requests; stdout: answers (JSON lines)

so it stays small and imports only built-in modules (json alone would add ~5 ms to every
judged program, and so would `site`). The judge (hpcrl.sandbox.judge) imports `encode`.

The judge first sends `load <hex of marshal(payload)>`: the candidate arrives on the channel,
so a harness sandbox can be started before the candidate is known (see `warm.py`). The payload
is the candidate's source (one Python file, run as a module of its own), or a mapping:

    {"files": [[path, text], ...],   written under /work (the driver's directory, on sys.path)
     "main": source or None,         run as the single-file candidate is
     "imports": [module, ...],       imported now, so a package that does not load says so
     "exec": argv or None}           instead of serving calls here: run argv (a compiled
                                     driver, harness_wire.c_driver) on the channel

The driver answers `ready` or `load_error`. Then requests (judge -> sandbox, trusted) are
`<id> <function> <hex of marshal(args)>` lines, the function a name the candidate's source
defines or a dotted `package.module.function` of its files, and `exit` ends the program at once
(status 0). Answers (sandbox -> judge, untrusted) are JSON lines written by a small encoder here
and parsed in the judge by `json` plus `judge.decode`, which accepts tagged plain types only
(None, bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset): whatever the
candidate returns, the judge gets a freshly built plain value, never the candidate's object,
so an overridden `__eq__` or `__repr__` cannot reach the comparison.

The driver moves the channel off fds 0/1 before the candidate is loaded (its prints go to
stderr, its stdin reads see EOF). The candidate can still reach the channel (it is the same
process); all it can put there is a value, which the judge checks like any other answer.
"""

import binascii
import marshal
import os
import sys

MAX_DEPTH = 64


class CodecError(ValueError):
    """A value that is not plain data, or a malformed encoding."""


def encode(value, depth: int = 0):
    """Plain value -> JSON-able tagged form. Raises CodecError for anything else."""
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -(2**53) < value < 2**53 else {"i": str(value)}
    if t is float:
        return value if value - value == 0.0 else {"x": repr(value)}  # nan and inf are not JSON
    if t is list:
        return [encode(v, depth + 1) for v in value]
    if t is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [encode(v, depth + 1) for v in value]}
    if t is bytes:
        return {"b": binascii.b2a_base64(value, newline=False).decode()}
    if t is complex:
        return {"c": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise CodecError(f"cannot send a {t.__name__} across the sandbox boundary (plain data only)")


_ESCAPES = {i: f"\\u{i:04x}" for i in range(32)}
_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\t"): "\\t"})


def to_json(obj) -> str:
    """JSON text of an `encode`d value (no json import: see the module docstring)."""
    t = type(obj)
    if obj is None:
        return "null"
    if t is bool:
        return "true" if obj else "false"
    if t is int:
        return str(obj)
    if t is float:
        return repr(obj)
    if t is str:
        return '"' + obj.translate(_ESCAPES) + '"'
    if t is list:
        return "[" + ",".join(to_json(v) for v in obj) + "]"
    if t is dict:
        return "{" + ",".join(to_json(k) + ":" + to_json(v) for k, v in obj.items()) + "}"
    raise CodecError(f"not encodable: {t.__name__}")


def dumps(obj) -> bytes:
    # backslashreplace: a lone surrogate becomes the JSON escape \udcxx, which parses back to it.
    return to_json(obj).encode("utf-8", "backslashreplace") + b"\n"


# -- the driver (runs inside the sandbox) ----------------------------------------------------


def _add_packages() -> None:
    """What `site` would add (the judge starts python with -S to save its start-up), minus .pth files."""
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for d in (
        f"/usr/local/lib/{ver}/dist-packages",
        "/usr/lib/python3/dist-packages",
        f"{sys.prefix}/lib/{ver}/site-packages",
    ):
        if os.path.isdir(d) and d not in sys.path:
            sys.path.append(d)


def _write_files(files) -> None:
    for path, text in files:
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"bad path {path!r}")
        if len(parts) > 1:
            os.makedirs("/".join(parts[:-1]), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    sys.path_importer_cache.clear()  # the directory's listing changed since start-up


def _function(namespace: dict, name: str):
    """The candidate's function `name`: a top-level name of its source, or `pkg.mod.func`."""
    if "." not in name:
        return namespace.get(name)
    module, _, attr = name.rpartition(".")
    __import__(module)
    return getattr(sys.modules[module], attr, None)


def _serve() -> None:
    _exit = os._exit
    chan_in = os.fdopen(os.dup(0), "rb")
    chan_out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # the candidate's prints go to stderr, not into the channel
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)

    def send(msg) -> None:
        chan_out.write(dumps(msg))

    # The candidate arrives on the channel, so this sandbox can be started before it is known.
    first = chan_in.readline().split()
    if len(first) != 2 or first[0] != b"load":
        send({"fatal": "expected: load <hex of marshal(payload)>"})
        return
    payload = marshal.loads(bytes.fromhex(first[1].decode()))
    if type(payload) is str:
        payload = {"main": payload}
    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        _write_files(payload.get("files") or ())
        if payload.get("exec"):
            os.dup2(chan_in.fileno(), 0)  # nothing is buffered past the load line: the judge waits
            os.dup2(chan_out.fileno(), 1)
            os.execvp(payload["exec"][0], payload["exec"])
        source = payload.get("main")
        if source is not None:
            path = "/work/candidate.py"
            try:
                with open(path, "w") as fh:  # for tracebacks with source lines; the work dir is the sandbox's
                    fh.write(source)
            except OSError:
                pass
            exec(compile(source, path, "exec"), namespace)  # inside the sandbox
        for module in payload.get("imports") or ():
            __import__(module)
    except BaseException as exc:  # a failing candidate is a result, reported as such
        send({"load_error": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    send({"ready": True})
    for line in chan_in:
        if line == b"exit\n":
            _exit(0)  # captured before the candidate loaded: no finalization, whatever it patched
        try:
            rid_text, fn, payload = line.split()
            rid = int(rid_text)
            fn = fn.decode()
            args = marshal.loads(bytes.fromhex(payload.decode()))
        except (ValueError, EOFError, TypeError) as exc:
            send({"fatal": f"bad request: {exc}"})
            return
        try:
            func = _function(namespace, fn)
            if not callable(func):
                raise NameError(f"name {fn!r} is not defined by the candidate")
            value = func(*args)
            send({"id": rid, "value": encode(value)})
        except BaseException as exc:  # the candidate's exception is its answer
            send({"id": rid, "error": type(exc).__name__, "message": str(exc)[:2000]})


if __name__ == "__main__":
    _add_packages()
    _serve()
