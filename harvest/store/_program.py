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

from .._calling._inspect import sow_equations
from .._calling._tracing import make_jaxpr
from .._calling._transforms import call_and_reap, layer_tag, reap
from .._typing import NameSelect
from .._walk._paths import path_str
from .._walk._site import Site
from . import _errors

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
    raise TypeError(
        f"record(fn, batches, path): a batch is a {type(batch).__name__} holding no array. Each "
        "batch must be an array or a pytree of arrays whose leading axis is the example axis."
    )


ExampleAxis = int | dict[str, int]


def _sown_shapes(fn: Callable[[Any], Any], batch: Any, tag: str) -> dict[str, Any]:
    """{dotted name: the shape of one occurrence of the value sown there}, as the
    program traces it (vmap's batch axes included, a loop's iterations not)."""
    shapes: dict[str, Any] = {}
    for eqn, _, _ in sow_equations(make_jaxpr(fn, (batch,), {})[0].jaxpr):
        site = Site.of(eqn)
        if site.tag == tag:
            shape = jax.tree_util.tree_unflatten(site.tree, [a.shape for a in site.avals])
            shapes.setdefault(path_str(site.path), shape)
    return _flat(shapes)  # a dict sown: one name per entry, as its reaped value


def _examples_first(
    value: jax.Array, sown: tuple[int, ...], axis: int, rows: str
) -> jax.Array | None:
    """`value` (as reaped) with its example axis first, and for tokens its position
    axis second, the axes reap stacked a loop's occurrences on after them; None if
    the value as sown has no such axes.

    `axis` is the example axis of the value as sown, so a scan over layers (whose
    occurrences reap stacks on a leading axis) is never taken for examples,
    whatever its length.
    """
    width = 2 if rows == "tokens" else 1
    if not -len(sown) <= axis < len(sown) or axis % len(sown) + width > len(sown):
        return None
    first = value.ndim - len(sown) + axis % len(sown)  # past the loops' occurrence axes
    return jnp.moveaxis(value, range(first, first + width), range(width))


def _step(
    fn: Callable[[Any], Any],
    batch: Any,
    tag: str,
    names: NameSelect,
    exclude: NameSelect,
    rows: str,
    dtype: str | None,
    example_axis: tuple[int, tuple[tuple[str, int], ...]],
) -> dict[str, jax.Array]:
    examples = batch_size(batch)
    default, per_site = example_axis[0], dict(example_axis[1])
    reaped = _flat(reap(fn, tag=tag, names=names, exclude=exclude)(batch))
    for name, value in reaped.items():
        if isinstance(value, tuple) and len(value) == 1:  # a 'collect' site sown once
            reaped[name] = value = value[0]
        if not isinstance(value, jax.Array):
            raise TypeError(
                f"record: site {name!r} reaps a {type(value).__name__}, not an array (a site sown "
                "several times under mode 'collect' reaps a tuple). Sow it with mode 'strict' or "
                "'append', or leave it out with `names=`."
            )
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"record: site {name!r} holds PRNG keys ({value.dtype}), which a store cannot hold. "
                "Sow their raw data instead, jax.random.key_data(keys) (jax.random.wrap_key_data "
                "turns it back into keys), or leave the site out with `names=`. Nothing was written."
            )
    sown = _sown_shapes(fn, batch, tag) if reaped else {}
    out = {}
    for name, value in reaped.items():
        shape, axis = sown.get(name, value.shape), per_site.get(name, default)
        moved = _examples_first(value, shape, axis, rows)
        if moved is None and (name in per_site or default != 0):
            need = "two axes (examples, then positions)" if rows == "tokens" else "an axis"
            raise ValueError(
                f"record: example_axis={axis!r} for site {name!r}, whose value as sown has shape "
                f"{tuple(shape)}: rows={rows!r} needs {need} there. Pass an axis of the sown value "
                "(negative counts from the end), or leave the site out with `names=`."
            )
        if moved is None or moved.shape[0] != examples:
            raise _errors.site_not_rows(name, value.shape, examples, rows, shape)
        out[name] = moved if dtype is None else moved.astype(dtype)
    if not out:
        raise ValueError(
            f"record: the function sows no site of tag {tag!r}"
            + (f" that `names={names!r}` selects" if names is not None else "")
            + ", so there is nothing to record. Check the tag (instrument sows under 'modules')."
        )
    return out


def program(
    fn: Callable[[Any], Any],
    tag: str,
    names: NameSelect,
    rows: str,
    dtype: str | None,
    example_axis: ExampleAxis = 0,
    exclude: NameSelect = None,
) -> Callable[[Any], dict[str, jax.Array]]:
    """`batch -> {site name: [examples, ...] array}`, compiled once per batch shape."""
    compiled = call_and_reap(_step, tag=_COMPILE_TAG)
    if dtype is not None:
        dtype = jnp.dtype(dtype).name
    names = tuple(names) if isinstance(names, list) else names  # static: hashable
    exclude = tuple(exclude) if isinstance(exclude, list) else exclude
    axes = (
        (0, tuple(sorted(example_axis.items())))
        if isinstance(example_axis, dict)
        else (example_axis, ())
    )

    def run(batch: Any) -> dict[str, jax.Array]:
        out, _ = compiled(fn, batch, tag, names, exclude, rows, dtype, axes)
        return out

    return run
