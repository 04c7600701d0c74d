"""Named registries (domains, rewards, algorithms): registering a name twice raises, and asking
for an unknown name says which names exist.

    ALGORITHMS = Registry("algorithm")
    @ALGORITHMS.register("grpo")
    class GRPO: ...
    ALGORITHMS.get("grpo")          # the class
    ALGORITHMS.get("grpp")          # UnknownName: unknown algorithm 'grpp' (did you mean 'grpo'?);
                                    # registered: grpo, reinforce
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry", "UnknownName", "DuplicateName"]

T = TypeVar("T")


class UnknownName(LookupError):
    """No entry of that name; the message lists the registered ones."""


class DuplicateName(ValueError):
    """A second registration under a name already taken."""


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """`REG.register("x", obj)`, or as a decorator `@REG.register("x")`."""
        if not isinstance(name, str) or not name or "/" in name or any(c.isspace() for c in name):
            raise ValueError(f"{self.kind} name {name!r}: must be a non-empty string without '/' or spaces")

        def add(item: T) -> T:
            if name in self._items:
                prev = self._items[name]
                where = getattr(prev, "__module__", None) or type(prev).__module__
                raise DuplicateName(f"{self.kind} {name!r} is already registered (by {where}); choose another name")
            self._items[name] = item
            return item

        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            pass
        close = difflib.get_close_matches(str(name), list(self._items), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownName(
            f"unknown {self.kind} {name!r}{hint}; registered: {', '.join(sorted(self._items)) or '(none)'}"
        )

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._items))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
