"""The tool-call syntax of session episodes: what a model writes to act on its workspace.

An action is free text with tool calls in it; text outside the calls (the model's reasoning) is
ignored. Five tools, written as tags:

    <read path="calc/ops.py"/>                 show a file
    <list/>                                    list the workspace's files
    <write path="calc/ops.py">                 replace (or create) a file with the body
    def add(a, b):
        return a + b
    </write>
    <run>python3 -m unittest -q</run>          run a command in the workspace (argv split as by a
                                               POSIX shell, shlex; no shell: no pipes or globs)
    <run timeout="20">python3 slow.py</run>    ... with its own time limit in seconds
    <submit/>                                  end the episode: the hidden tests decide the reward

Rules: attribute values are double-quoted and cannot contain a double quote; a write's body is
the text between its tags, less the one newline right after the opening tag (so the file above
is two lines, ending in a newline); a body cannot contain its own closing tag. read, list and
submit are self-closing; write and run have a body. Paths are relative to the workspace, with
no '..' (the sandbox server refuses those too). At most `MAX_CALLS` calls per action; submit
must be the last. An action that breaks a rule runs none of its calls: `parse_action` returns
the reason as one line the model can read, never raising.

    parsed = parse_action('<write path="a.py">print(1)\n</write><run>python3 a.py</run>')
    parsed.calls   # (Write(path='a.py', content='print(1)\\n'), Run(argv=('python3', 'a.py'), timeout_s=None))
    parse_action("<delete path='a.py'/>").error   # "tool call 1: unknown tool <delete>; tools: ..."
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

from hpcrl.sandbox.workspace import WorkspaceError, check_path

__all__ = ["MAX_CALLS", "TOOLS", "Write", "Read", "Run", "ListFiles", "Submit", "ToolCall", "Parsed", "parse_action"]

MAX_CALLS = 8
TOOLS = ("write", "read", "run", "list", "submit")
SYNTAX = (
    '<read path="P"/>, <list/>, <write path="P">TEXT</write>, <run>python3 -m unittest -q</run>, '
    '<run timeout="S">ARGV</run>, <submit/>'
)


@dataclass(frozen=True)
class Write:
    path: str
    content: str


@dataclass(frozen=True)
class Read:
    path: str


@dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    timeout_s: float | None = None


@dataclass(frozen=True)
class ListFiles:
    pass


@dataclass(frozen=True)
class Submit:
    pass


ToolCall = Write | Read | Run | ListFiles | Submit


@dataclass(frozen=True)
class Parsed:
    """The calls of an action, or `error` (one line) and no calls."""

    calls: tuple[ToolCall, ...] = ()
    error: str | None = None


# `<name attrs>` or `<name attrs/>`: a tag starts with '<' and a letter, so "a < b" in prose is
# not a call; the attributes are checked separately, to name what is wrong with them.
_OPEN = re.compile(r"<(/?)([A-Za-z][\w-]*)([^<>]*?)(/?)>")
# A tool's name after '<' that no well-formed tag matched (e.g. `<write path="a.py"` with no '>').
_BROKEN = re.compile(r"</?(?:write|read|run|list|submit)\b")
_ATTR = re.compile(r'\s+([A-Za-z_][\w-]*)="([^"]*)"')
_ATTRS = {"write": ({"path"}, set()), "read": ({"path"}, set()), "run": (set(), {"timeout"})}
_BODY = ("write", "run")


class _Bad(ValueError):
    pass


def parse_action(text: str, max_calls: int = MAX_CALLS) -> Parsed:
    """The tool calls in `text`; a malformed action gives `Parsed(error=...)`, never an exception."""
    calls: list[ToolCall] = []
    pos = 0
    try:
        while (m := _OPEN.search(text, pos)) is not None:
            n = len(calls) + 1
            _gap(text[pos : m.start()])
            closing, name, raw, closed = m.group(1) == "/", m.group(2), m.group(3), m.group(4) == "/"
            if closing and name in TOOLS:
                raise _Bad(f"</{name}> closes nothing (its opening tag is missing or malformed)")
            if name not in TOOLS:
                raise _Bad(f"tool call {n}: unknown tool <{name}>; tools: {', '.join(TOOLS)}")
            if calls and isinstance(calls[-1], Submit):
                raise _Bad("<submit/> must be the last tool call of an action")
            if len(calls) >= max_calls:
                raise _Bad(f"more than {max_calls} tool calls in one action; send the rest in the next action")
            attrs = _attributes(n, name, raw)
            if name in _BODY:
                if closed:
                    raise _Bad(f"tool call {n}: <{name}/> needs a body: <{name} ...>...</{name}>")
                end = text.find(f"</{name}>", m.end())
                if end < 0:
                    raise _Bad(f"tool call {n}: unterminated <{name}>; end it with </{name}>")
                body, pos = text[m.end() : end], end + len(name) + 3
            else:
                if not closed:
                    raise _Bad(f"tool call {n}: <{name}> takes no body; write it self-closing, e.g. <{name}{raw}/>")
                body, pos = "", m.end()
            calls.append(_call(n, name, attrs, body))
        _gap(text[pos:])
    except _Bad as exc:
        return Parsed(error=str(exc))
    if not calls:
        return Parsed(error=f"no tool call in the action; use one of: {SYNTAX}")
    return Parsed(tuple(calls))


def _gap(text: str) -> None:
    """Text between calls is the model's own, but not a tool tag that failed to parse."""
    m = _BROKEN.search(text)
    if m:
        line = text[m.start() :].split("\n", 1)[0][:60]
        raise _Bad(f"malformed tool tag {line!r}; e.g. {SYNTAX}")


def _attributes(n: int, name: str, raw: str) -> dict[str, str]:
    required, optional = _ATTRS.get(name, (set(), set()))
    attrs: dict[str, str] = {}
    rest = raw
    for a in _ATTR.finditer(raw):
        if a.group(1) in attrs:
            raise _Bad(f"tool call {n}: <{name}> repeats the attribute {a.group(1)}")
        attrs[a.group(1)] = a.group(2)
        rest = rest.replace(a.group(0), "", 1)
    if rest.strip():
        raise _Bad(f'tool call {n}: <{name}> has malformed attributes {rest.strip()!r}; write name="value"')
    unknown = set(attrs) - required - optional
    if unknown:
        takes = ", ".join(sorted(required | optional)) or "no attributes"
        raise _Bad(f"tool call {n}: <{name}> has no attribute {sorted(unknown)[0]!r}; it takes {takes}")
    missing = required - set(attrs)
    if missing:
        raise _Bad(f'tool call {n}: <{name}> needs {sorted(missing)[0]}="..."')
    if "path" in attrs:
        try:
            check_path(attrs["path"])
        except WorkspaceError as exc:
            raise _Bad(f"tool call {n}: <{name}> {exc}") from None
    return attrs


def _call(n: int, name: str, attrs: dict[str, str], body: str) -> ToolCall:
    if name == "write":
        # The newline after the opening tag is layout, not content: files start on the next line.
        return Write(attrs["path"], body[1:] if body.startswith("\n") else body)
    if name == "read":
        return Read(attrs["path"])
    if name == "list":
        return ListFiles()
    if name == "submit":
        return Submit()
    try:
        argv = tuple(shlex.split(body))
    except ValueError as exc:  # an unclosed quote
        raise _Bad(f"tool call {n}: <run> command cannot be split into arguments: {exc}") from None
    if not argv:
        raise _Bad(f"tool call {n}: <run> has no command; e.g. <run>python3 -m unittest -q</run>")
    if "\0" in body:
        raise _Bad(f"tool call {n}: <run> command contains a NUL character")
    timeout = None
    if "timeout" in attrs:
        try:
            timeout = float(attrs["timeout"])
        except ValueError:
            timeout = math.nan
        if not 0 < timeout < math.inf:
            raise _Bad(f'tool call {n}: <run timeout="{attrs["timeout"]}"> must be a positive number of seconds')
    return Run(argv, timeout)
