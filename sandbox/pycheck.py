"""The checker: trusted test code (`check(candidate)`) in a bounded process of its own.

The judge (hpcrl.sandbox.judge) starts this as

    python -I -S -B -c <this file>      # under prlimit: address space, CPU seconds, file size

with a wall deadline it enforces from outside, so a test working on what the candidate returned
(a catastrophic regex, `range(10**12)`, `bytearray(2**40)`) costs at most the judge's limits and
never the judge's own process. Its channel is its stdin/stdout, moved off fds 0/1 before the
test loads (the test's prints go to stderr). Lines both ways are `<verb> <hex of marshal(x)>`:

    judge -> checker:  load {path, prelude, test, entry_point, name}
                       value V          the candidate's answer to the last call
                       raise (T, M)     the candidate raised an exception of type name T
                       abort REASON     no usable answer (timeout, exit, garbage): the test fails
    checker -> judge:  ready            the test loaded and defines check()
                       judge_error MSG  the test itself is broken (not the candidate's fault)
                       call [NAME, ARGS] call the candidate's function NAME with these positional arguments
                       done REASON      "passed", or "failed: ..."

The test's `check(candidate)` gets the task's entry point as `candidate`; it may also call
`function("name")` (in its namespace) for another function of the candidate's: `pkg.mod.func`
of a Python package, `func` of a C library. Values arrive here as plain data the judge decoded
from the candidate's answer and rebuilt, never the candidate's objects. An exception of the
candidate's becomes a `CandidateError` (also an instance of the builtin type it names, so
`except ValueError` in a test works), except the iteration protocol's StopIteration and
StopAsyncIteration, which become a plain CandidateError: a candidate raising StopIteration
must not end `all(map(candidate, cases))` early as a pass.
The judge decides the verdict (a test that swallows an abort still fails); this only reports.
Imports nothing but built-in modules: it starts in a few milliseconds, and `warm` starts it ahead.
"""

import builtins
import marshal
import os
import sys

# Exceptions the language itself treats as control flow: never rebuilt as themselves.
_CONTROL_FLOW = ("StopIteration", "StopAsyncIteration")


class CandidateError(Exception):
    """An exception the candidate raised, rebuilt from its type name and message alone."""

    type_name = "Exception"


class _Abort(BaseException):
    """No usable answer from the candidate. BaseException: `except Exception` in a test cannot swallow it."""


class _Broken(BaseException):
    """The test misuses the harness (keyword arguments, non-plain values): the judge's error."""


_classes = {}


def candidate_error(name: str, message: str) -> CandidateError:
    """A CandidateError for the candidate's exception `name`: also of that builtin type where the
    type is an Exception outside the iteration protocol (or of its nearest constructible base)."""
    cls = _classes.get(name)
    if cls is None:
        cls = CandidateError
        base = getattr(builtins, name, None)
        if isinstance(base, type) and issubclass(base, Exception) and name not in _CONTROL_FLOW:
            for b in base.__mro__:
                if b is Exception or not issubclass(b, Exception) or issubclass(b, BaseExceptionGroup):
                    break
                try:
                    made = type(f"Candidate{b.__name__}", (CandidateError, b), {"type_name": name})
                    made("probe")
                except TypeError:  # constructors that want more than a message (UnicodeDecodeError)
                    continue
                cls = made
                break
        if cls is CandidateError:
            cls = type("CandidateError", (CandidateError,), {"type_name": name})
        _classes[name] = cls
    return cls(message)


def _line(verb: str, value) -> bytes:
    return verb.encode() + b" " + marshal.dumps(value).hex().encode() + b"\n"


def _parse(line: bytes):
    verb, _, payload = line.rstrip(b"\n").partition(b" ")
    return verb.decode(), marshal.loads(bytes.fromhex(payload.decode()))


class _Channel:
    """The calls of every proxy go one at a time over the judge's channel; one abort ends them all."""

    def __init__(self, send, recv):
        self.send, self.recv = send, recv
        self.aborted = None


class _Proxy:
    def __init__(self, channel: _Channel, name: str):
        self._channel, self._name = channel, name

    @property
    def aborted(self):
        return self._channel.aborted

    def __call__(self, *args, **kwargs):
        ch = self._channel
        if ch.aborted is not None:
            raise _Abort(ch.aborted)
        if kwargs:
            raise _Broken("keyword arguments are not supported by the function harness")
        try:
            ch.send(_line("call", [self._name, list(args)]))
        except ValueError as exc:  # marshal refuses what is not plain data
            raise _Broken(f"test passes a non-plain argument: {exc}") from None
        verb, payload = _parse(ch.recv())
        if verb == "value":
            return payload
        if verb == "raise":
            raise candidate_error(str(payload[0]), str(payload[1]))
        ch.aborted = str(payload)
        raise _Abort(ch.aborted)


def _verdict(check, proxy) -> str:
    try:
        check(proxy)
    except _Abort as exc:
        return f"failed: {exc}"
    except AssertionError as exc:
        return f"failed: assertion {str(exc)[:200]}".rstrip()
    except CandidateError as exc:
        return f"failed: the candidate raised {type(exc).type_name}: {str(exc)[:200]}"
    except MemoryError:
        return "failed: the test ran out of memory on the candidate's values"
    except RecursionError:
        return "failed: RecursionError in the test"
    except _Broken:
        raise
    except BaseException as exc:  # anything else out of check() is a failed test
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    if proxy.aborted is not None:  # a test that swallowed the abort still fails
        return f"failed: {proxy.aborted}"
    return "passed"


def main() -> None:
    _exit = os._exit
    chan_in = os.fdopen(os.dup(0), "rb")
    chan_out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # the test's prints go to stderr, not into the channel
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)

    def recv() -> bytes:
        line = chan_in.readline()
        if not line:
            _exit(3)  # the judge is gone
        return line

    verb, task = _parse(recv())
    if verb != "load":
        _exit(3)
    sys.path[:] = list(task["path"])
    name = task["name"]
    namespace = {"__name__": "__judge__", "CandidateError": CandidateError}
    try:
        exec(compile(task["prelude"], f"<{name} prelude>", "exec"), namespace)  # trusted test code
        exec(compile(task["test"], f"<{name} test>", "exec"), namespace)
    except BaseException as exc:
        chan_out.write(_line("judge_error", f"{name}: the test code does not load: {type(exc).__name__}: {exc}"))
        _exit(0)
    check = namespace.get("check")
    if not callable(check):
        chan_out.write(_line("judge_error", f"{name}: the test code defines no check(candidate)"))
        _exit(0)
    channel = _Channel(chan_out.write, recv)
    proxy = _Proxy(channel, task["entry_point"])
    if task["entry_point"].isidentifier():
        namespace[task["entry_point"]] = proxy
    namespace.setdefault("function", lambda name: _Proxy(channel, str(name)))
    chan_out.write(_line("ready", True))
    try:
        reason = _verdict(check, proxy)
    except _Broken as exc:
        chan_out.write(_line("judge_error", f"{name}: {exc}"))
        _exit(0)
    chan_out.write(_line("done", reason))
    _exit(0)  # no interpreter shutdown: whatever the test left behind does not run


if __name__ == "__main__":
    main()
