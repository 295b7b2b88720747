"""The type aliases the public signatures share (for type checkers; nothing here runs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    ParamSpec,
    TypeAlias,
    TypeVar,
)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform as dataclass_transform
else:

    def dataclass_transform(**kwargs: Any) -> Callable[[T], T]:
        """Marks a dataclass-making decorator for type checkers (`typing`'s from Python 3.11)."""
        return lambda decorator: decorator


# What reap returns: {name: value}, nested dicts under `nest` scopes. A value's
# type depends on the site's mode (a tuple for "collect", an array otherwise).
Reaped: TypeAlias = dict[str, Any]
# What plant takes: the same shape as Reaped, or a single value or a callable
# `old -> new` per name. A dict, not any Mapping: plant checks for one.
Plants: TypeAlias = dict[str, Any]

# A name selector (`names=`, `exclude=`, path patching's roles): an exact name, a
# glob pattern, a predicate on names, or several of those.
NamePattern: TypeAlias = str | Callable[[str], bool]
NameSelect: TypeAlias = NamePattern | Iterable[NamePattern] | None

SowMode: TypeAlias = Literal["collect", "strict", "append", "clobber"]
