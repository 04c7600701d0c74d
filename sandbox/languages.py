"""The language registry: how each language is compiled and run inside a sandbox.

    lang = get_language("cpp")          # unknown names raise, listing what exists
    register(Language(name="ruby", main_file="main.rb", run=("ruby", "main.rb"), tools=("ruby",)))

Commands are argv lists run inside the sandbox with PATH=/usr/local/bin:/usr/bin:/bin and the
working directory /work, where the spec's files are. A compiled language compiles in its own
sandbox run under `compile_limits`; the compile command writes diagnostics to stderr and the
binary to stdout (`cat`), because that sandbox's tmpfs vanishes with it. The binary is then
copied into the run sandbox as /work/<artifact>.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

from hpcrl.core.config import Limits

__all__ = ["Language", "register", "get_language", "languages", "available_languages"]

# Compilers need more room than the programs they build: g++ on <iostream> peaks near 200 MiB.
COMPILE_LIMITS = Limits(
    wall_s=30.0,
    cpu_s=30.0,
    memory_mb=1024,
    pids=32,
    file_size_mb=64,
    output_kb=64 * 1024,
    work_mb=64,
    tmp_mb=256,
    shm_mb=16,
)


@dataclass(frozen=True)
class Language:
    name: str
    main_file: str
    run: tuple[str, ...]
    tools: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    artifact: str | None = None
    compile_limits: Limits = field(default=COMPILE_LIMITS)
    # Address space the runtime reserves at start and never touches: allowed on top of the
    # memory limit where RLIMIT_AS stands in for a memory cgroup (backend.rlimit_args).
    address_space_mb: int = 0

    def __post_init__(self) -> None:
        if (self.compile is None) != (self.artifact is None):
            raise ValueError(f"language {self.name!r}: compile and artifact go together")

    @property
    def compiled(self) -> bool:
        return self.compile is not None

    def present(self, which: Callable[[str], str | None] = shutil.which) -> bool:
        """Whether every tool exists on this host (the bwrap backend binds the host's /usr)."""
        return all(which(t) for t in self.tools)


_REGISTRY: dict[str, Language] = {}


def register(lang: Language) -> Language:
    if lang.name in _REGISTRY:
        raise ValueError(f"language {lang.name!r} is already registered; pick another name")
    _REGISTRY[lang.name] = lang
    return lang


def get_language(name: str) -> Language:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown language {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def languages() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def available_languages(which: Callable[[str], str | None] = shutil.which) -> tuple[str, ...]:
    return tuple(n for n in sorted(_REGISTRY) if _REGISTRY[n].present(which))


def _compile_sh(cmd: str, artifact: str) -> tuple[str, ...]:
    # Diagnostics to stderr, the binary to stdout: the only way out of the compile sandbox.
    return ("sh", "-c", f"{cmd} -o /tmp/{artifact} 1>&2 && exec cat /tmp/{artifact}")


# -B: no .pyc writes into the (size-capped) work dir; not -I, which would drop /work from sys.path.
register(Language(name="python", main_file="main.py", run=("python3", "-B", "main.py"), tools=("python3",)))
register(Language(name="bash", main_file="main.sh", run=("bash", "main.sh"), tools=("bash",)))
# V8 reserves ~750 MiB of address space before running anything (node 20: it does not start under less).
register(Language(name="node", main_file="main.js", run=("node", "main.js"), tools=("node",), address_space_mb=1024))
register(
    Language(
        name="c",
        main_file="main.c",
        run=("./prog",),
        tools=("gcc", "sh", "cat"),
        compile=_compile_sh("gcc -O2 -pipe -std=gnu17 main.c -lm", "prog"),
        artifact="prog",
    )
)
register(
    Language(
        name="cpp",
        main_file="main.cpp",
        run=("./prog",),
        tools=("g++", "sh", "cat"),
        compile=_compile_sh("g++ -O2 -pipe -std=gnu++17 main.cpp", "prog"),
        artifact="prog",
    )
)
