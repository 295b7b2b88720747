"""Sow paths: a name under its `nest` scopes, as a tuple, dotted, or nested dicts."""

from __future__ import annotations

import functools
import operator
from typing import Any


def path_str(path: tuple[str, ...]) -> str:
    """The dotted form of a path: ("block", "h") -> "block.h"."""
    return ".".join(path)


@functools.lru_cache(maxsize=256)
def _check_scopes(paths: tuple[tuple[str, ...], ...]) -> None:
    """No path is the scope of another (a call reaping the same sites checks once)."""
    names = set(paths)
    for path in paths:
        for n in range(1, len(path)):
            if path[:n] in names:
                raise ValueError(
                    f"{path_str(path[:n])!r} is both a sown name and a nest scope (holding "
                    f"{path_str(path)!r}), so one would hide the other in the reaped dict. Rename the sow or the scope."
                )


def nested_dict(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """{path: value} as nested dicts, one level per scope: {("b", "h"): v} -> {"b": {"h": v}}."""
    if max(map(len, flat), default=0) == 1:  # no scopes: one level, built at C speed
        return dict(zip(map(operator.itemgetter(0), flat), flat.values()))
    out: dict[str, Any] = {}
    if any(len(path) > 1 for path in flat):
        _check_scopes(tuple(flat))
    for path, value in flat.items():
        d = out
        for key in path[:-1]:
            d = d.setdefault(key, {})
        d[path[-1]] = value
    return out
