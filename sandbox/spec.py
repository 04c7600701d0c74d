"""What to execute: `ExecSpec` (language, files, stdin, argv, limits), shared by every backend.

    spec = ExecSpec(language="python", files=(SourceFile("main.py", b"print(1)"),),
                    limits=Limits(wall_s=5, memory_mb=256))

A spec is plain data (frozen, bytes for file contents and stdin) so it can cross a process or
network boundary unchanged; `to_wire`/`from_wire` give the msgpack/JSON-able form. Validation
happens at construction: a bad spec raises `ValueError` naming the field, never a half-run.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from hpcrl.core.config import Limits
from hpcrl.sandbox.languages import get_language

__all__ = ["Limits", "SourceFile", "ExecSpec"]

_PATH_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*")


@dataclass(frozen=True)
class SourceFile:
    """One file copied into the sandbox's /work. `path` is relative, e.g. `main.py` or `pkg/util.py`."""

    path: str
    data: bytes
    executable: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            object.__setattr__(self, "data", self.data.encode())
        if not isinstance(self.data, (bytes, bytearray)):
            raise ValueError(f"SourceFile {self.path!r}: data must be bytes or str (got {type(self.data).__name__})")
        norm = posixpath.normpath(self.path) if isinstance(self.path, str) else ""
        if not isinstance(self.path, str) or not _PATH_RE.fullmatch(self.path) or norm != self.path:
            raise ValueError(
                f"SourceFile path {self.path!r}: must be a relative path of letters, digits, '_', '.', '+', '-' "
                "(no '..', no leading '/' or '.'), e.g. 'main.py'"
            )


@dataclass(frozen=True)
class ExecSpec:
    """One execution: `files` land in /work (the working directory), `argv` follows the program.

    `language` names an entry of `hpcrl.sandbox.languages` (python, c, cpp, bash, node). The
    language's main file (e.g. `main.py`) must be among `files`. `compile_limits` bounds the
    compile step of compiled languages (None: the language's defaults).
    """

    language: str
    files: tuple[SourceFile, ...]
    stdin: bytes = b""
    argv: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    compile_limits: Limits | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.language, str) or not self.language:
            raise ValueError(f"ExecSpec.language: must be a language name such as 'python' (got {self.language!r})")
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "argv", tuple(self.argv))
        if isinstance(self.stdin, str):
            object.__setattr__(self, "stdin", self.stdin.encode())
        if not isinstance(self.stdin, (bytes, bytearray)):
            raise ValueError(f"ExecSpec.stdin: must be bytes or str (got {type(self.stdin).__name__})")
        if not self.files:
            raise ValueError("ExecSpec.files: at least one source file is needed")
        seen = set()
        for f in self.files:
            if not isinstance(f, SourceFile):
                raise ValueError(f"ExecSpec.files: items must be SourceFile (got {type(f).__name__})")
            if f.path in seen:
                raise ValueError(f"ExecSpec.files: {f.path!r} listed twice")
            seen.add(f.path)
        for a in self.argv:
            if not isinstance(a, str) or "\0" in a:
                raise ValueError(f"ExecSpec.argv: items must be strings without NUL (got {a!r})")
        size = sum(len(f.data) for f in self.files)
        if size > self.limits.work_mb * 1024 * 1024:
            raise ValueError(
                f"ExecSpec.files: {size} bytes do not fit the {self.limits.work_mb} MiB work dir; raise limits.work_mb"
            )

    @classmethod
    def single(cls, language: str, source: str | bytes, **kw: Any) -> ExecSpec:
        """A one-file program under the language's main file name."""

        return cls(language=language, files=(SourceFile(get_language(language).main_file, source),), **kw)

    def to_wire(self) -> dict:
        return {
            "language": self.language,
            "files": [[f.path, bytes(f.data), f.executable] for f in self.files],
            "stdin": bytes(self.stdin),
            "argv": list(self.argv),
            "limits": self.limits.to_wire(),
            "compile_limits": self.compile_limits.to_wire() if self.compile_limits else None,
        }

    @classmethod
    def from_wire(cls, data: Any) -> ExecSpec:
        """Inverse of `to_wire`; raises ValueError (naming the key) on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"exec spec: expected a mapping (got {type(data).__name__})")
        unknown = set(data) - {"language", "files", "stdin", "argv", "limits", "compile_limits"}
        if unknown:
            raise ValueError(f"exec spec: unknown keys {sorted(unknown)}")
        try:
            files = tuple(SourceFile(str(p), d, bool(x)) for p, d, x in data.get("files") or ())
            return cls(
                language=data.get("language"),
                files=files,
                stdin=data.get("stdin") or b"",
                argv=tuple(data.get("argv") or ()),
                limits=Limits.from_wire(data.get("limits"), "limits"),
                compile_limits=Limits.from_wire(data["compile_limits"], "compile_limits")
                if data.get("compile_limits")
                else None,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"exec spec: {exc}") from None
