"""Sow paths: a name under its `nest` scopes, as a tuple, dotted, or nested dicts."""

from __future__ import annotations

from typing import Any

from . import _errors


def path_str(path: tuple[str, ...]) -> str:
    """The dotted form of a path: ("block", "h") -> "block.h"."""
    return ".".join(path)


def nested_dict(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """{path: value} as nested dicts, one level per scope: {("b", "h"): v} -> {"b": {"h": v}}."""
    out: dict[str, Any] = {}
    for path in flat:
        for n in range(1, len(path)):
            if path[:n] in flat:
                raise _errors.name_and_scope(path_str(path[:n]), path_str(path))
    for path, value in flat.items():
        d = out
        for key in path[:-1]:
            d = d.setdefault(key, {})
        d[path[-1]] = value
    return out
