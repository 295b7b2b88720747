"""The type aliases the public signatures share (for type checkers; nothing here runs)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Literal, ParamSpec, TypeAlias, TypeVar, Union

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

# What reap returns: {name: value}, nested dicts under `nest` scopes. A value's
# type depends on the site's mode (a tuple for "collect", an array otherwise).
Reaped: TypeAlias = dict[str, Any]
# What plant takes: the same shape as Reaped, or a single value or a callable
# `old -> new` per name. A dict, not any Mapping: plant checks for one.
Plants: TypeAlias = dict[str, Any]

# A name selector (allowlist, blocklist, `where=`, `names=`): an exact name, a
# glob pattern, a predicate on names, or several of those.
NamePattern: TypeAlias = Union[str, Callable[[str], bool]]
NameSelect: TypeAlias = Union[NamePattern, Iterable[NamePattern], None]

SowMode: TypeAlias = Literal["collect", "strict", "append", "clobber"]
