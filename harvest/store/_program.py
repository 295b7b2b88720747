"""The compiled program that `record` runs per batch: the model, its sites reaped.

One jitted program per batch shape: it runs `fn`, reaps the selected sites
and casts them, so only the recorded arrays leave the devices, still sharded
as the computation left them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _errors
from .._paths import path_str
from .._transforms import call_and_reap, layer_tag, reap
from .._typing import NameSelect

# The tag of the outer harvest transformation that compiles the program; no
# site uses it. Going through harvest (not `jax.jit`) gives `fn` harvest's
# calling convention: an NNX module's state is traced, not baked in.
_COMPILE_TAG = layer_tag("harvest.store.program")


def _flat(reaps: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """{dotted name: value}, out of `nest` scopes' nested dicts."""
    out: dict[str, Any] = {}
    for key, value in reaps.items():
        if isinstance(value, dict):
            out.update(_flat(value, (*prefix, key)))
        else:
            out[path_str((*prefix, key))] = value
    return out


def batch_size(batch: Any) -> int:
    """The leading (example) axis of the batch's first array."""
    for leaf in jax.tree_util.tree_leaves(batch):
        if hasattr(leaf, "shape") and len(leaf.shape) >= 1:
            return int(leaf.shape[0])
    raise _errors.store_batch_without_arrays(type(batch).__name__)


def _step(
    fn: Callable[[Any], Any],
    batch: Any,
    tag: str,
    names: NameSelect,
    rows: str,
    dtype: str | None,
) -> dict[str, jax.Array]:
    examples = batch_size(batch)
    out = {}
    for name, value in _flat(reap(fn, tag=tag, allowlist=names)(batch)).items():
        if isinstance(value, tuple) and len(value) == 1:  # a 'collect' site sown once
            value = value[0]
        if not isinstance(value, jax.Array):
            raise _errors.store_site_not_array(name, value)
        if value.ndim < (1 if rows == "examples" else 2) or value.shape[0] != examples:
            raise _errors.store_site_not_rows(name, value.shape, examples, rows)
        out[name] = value if dtype is None else value.astype(dtype)
    if not out:
        raise _errors.store_no_sites(tag, names)
    return out


def program(
    fn: Callable[[Any], Any], tag: str, names: NameSelect, rows: str, dtype: str | None
) -> Callable[[Any], dict[str, jax.Array]]:
    """`batch -> {site name: [examples, ...] array}`, compiled once per batch shape."""
    compiled = call_and_reap(_step, tag=_COMPILE_TAG)
    if dtype is not None:
        dtype = jnp.dtype(dtype).name
    names = tuple(names) if isinstance(names, list) else names

    def run(batch: Any) -> dict[str, jax.Array]:
        out, _ = compiled(fn, batch, tag, names, rows, dtype)
        return out

    return run
