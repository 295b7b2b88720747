"""Equinox (and Penzai) modules rebuilt from a part's arrays, named by the part they came from.

Scan over layers in Equinox stacks the layers' arrays and rebuilds one layer per
iteration from a slice of them (`eqx.combine`, or the module passed as `xs`). An
Equinox module carries nothing but its fields, so the rebuilt layer is found by
its structure: same class and static fields, and arrays that are the part's own,
of its shapes (a copy), or of its shapes without a common leading axis (a slice).
"""

from __future__ import annotations

from typing import Any

import jax

from .._walk._leaves import is_array
from ._call import InstrumentCall
from ._module_paths import submodules


def rebuilt_path(call: InstrumentCall, module: Any) -> str | None:
    """The path of the part `module` was rebuilt from, or None if none fits."""
    found = [(p, how) for p, part in call.parts if (how := _rebuilt_from(module, part)) is not None]
    # The very arrays name it; else a slice of a stack (a layer in a scan) is
    # taken before a copy, which only a module passed through jit or
    # checkpoint as an argument would be.
    for how in ("same", "slice", "copy"):
        paths = [p for p, h in found if h == how]
        if paths:
            break
    paths = paths[:1] if how == "same" else paths
    if not paths:
        return None
    if len(paths) > 1:
        if not call.ops and not any(call.select((p,)) for p in paths):
            return None  # not a site whichever it is
        raise ValueError(
            f"instrument(tag={call.tag!r}): a {type(module).__name__} rebuilt from arrays (as eqx.combine "
            f"or jax.lax.scan over stacked layers rebuild one) fits several of the model's submodules: "
            f"{', '.join(map(repr, paths))}, so its name is ambiguous. Leave them out "
            f"(e.g. exclude={paths!r}), or call the submodule itself rather than a "
            "copy passed through a transformation."
        )
    path = paths[0]
    call.held.append(module)
    call.paths[id(module)] = path
    for sub, child in submodules(module, call.kind):  # its submodules are rebuilt with it
        call.paths.setdefault(id(child), f"{path}.{sub}")
    return path


def _rebuilt_from(module: Any, part: Any) -> str | None:
    """How `module` was rebuilt from `part`'s arrays: "same" (the very arrays),
    "copy" (their shapes), "slice" (one row of each), or None if it was not."""
    leaves, part_leaves = jax.tree_util.tree_leaves(module), jax.tree_util.tree_leaves(part)
    tree: Any = jax.tree_util.tree_structure(module)
    if tree != jax.tree_util.tree_structure(part):
        return None
    hows: set[object] = set()
    for a, b in zip(leaves, part_leaves):
        if a is b:
            continue
        if not (is_array(a) and is_array(b)):
            if is_array(a) or is_array(b) or not _equal(a, b):
                return None
        elif a.dtype != b.dtype:
            return None
        elif a.shape == b.shape:
            hows.add("copy")
        elif b.shape[1:] == a.shape:
            hows.add(b.shape[0])
        else:
            return None
    if not hows:
        return "same"
    if len(hows) > 1:  # copies and slices mixed, or slices of stacks of different lengths
        return None
    return "copy" if hows == {"copy"} else "slice"


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # an object whose == is not a plain truth value
        return False
