"""Interventions: callables `old -> new`, planted at a sow site (ablate, patch, steer).

Every intervention is a pytree (its arrays are leaves, the rest is static), so
the plant's compile cache is keyed by its shapes, not its identity, and it can
carry traced values: `patching_sweep` runs every patch as one vmapped
computation over one-hot selections.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors
from .._typing import T, dataclass_transform
from .._walk._per_example import one_example

if TYPE_CHECKING:
    from jax.typing import ArrayLike


@dataclass_transform(frozen_default=True)
def pytree_dataclass(
    data: tuple[str, ...], meta: tuple[str, ...] = ()
) -> Callable[[type[T]], type[T]]:
    def wrap(cls: Any) -> Any:
        cls = dataclasses.dataclass(frozen=True)(cls)
        return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))

    return wrap


@pytree_dataclass(data=())
class _Zero:
    def __call__(self, old: Any) -> Any:
        return jax.tree_util.tree_map(jnp.zeros_like, old)


@pytree_dataclass(data=("mean",))
class _Mean:
    mean: Any

    def __call__(self, old: Any) -> Any:
        def fill(m: jax.Array, o: jax.Array) -> jax.Array:
            _check_fits(m, o, "ablate_mean's mean", whole=False)
            return jnp.broadcast_to(m, o.shape).astype(o.dtype)

        return jax.tree_util.tree_map(fill, self.mean, old)

    def for_one_example(self, old: Any) -> tuple[Any, Any]:
        return self, _mapped(self, mean=_leading(self.mean, old))


@pytree_dataclass(data=("vector", "scale"))
class AddVector:
    vector: Any
    scale: Any

    def __call__(self, old: Any) -> Any:
        def add(v: jax.Array, o: jax.Array) -> Any:
            _check_fits(v, o, "add_vector's vector", whole=False)
            return (o + self.scale * v).astype(o.dtype)

        return jax.tree_util.tree_map(add, self.vector, old)

    def for_one_example(self, old: Any) -> tuple[Any, Any]:
        return self, _mapped(self, vector=_leading(self.vector, old), scale=None)


@pytree_dataclass(data=("clean", "mask"), meta=("axes",))
class PatchWhere:
    """`clean` where `mask` holds, `old` elsewhere; `mask` runs along `axes` (one
    mask axis per swept axis), or is a scalar when `axes` is None."""

    clean: Any
    mask: Any
    axes: tuple[int, ...] | None

    def __call__(self, old: Any) -> Any:
        def patch(c: jax.Array, o: jax.Array) -> jax.Array:
            _check_fits(c, o, "the clean value to patch in", whole=True)
            return jnp.where(_along(self.mask, self.axes, jnp.ndim(o)), c, o)

        return jax.tree_util.tree_map(patch, self.clean, old)

    def for_one_example(self, old: Any) -> tuple[Any, Any]:
        return _patch_of_one_example(self, old, stacked=False)


@pytree_dataclass(data=("fill", "indices"), meta=("axis", "farthest"))
class _FillAt:
    """`fill(old)` (another intervention) at `indices` along `axis`, `old` elsewhere;
    `farthest` (see `_indices`) is checked when planted, the sown value's shape known."""

    fill: Any
    indices: jax.Array
    axis: int
    farthest: int | None

    def __call__(self, old: Any) -> Any:
        def patch(n: jax.Array, o: jax.Array) -> jax.Array:
            shape = tuple(jnp.shape(o))
            size = shape[self.axis]
            if self.farthest is not None and not -size <= self.farthest < size:
                raise _errors.InterventionMisfit(
                    f"ablate_head: head {self.farthest} is out of range along axis {self.axis} of the sown value, "
                    f"{jnp.result_type(o)}{list(shape)}: its {size} heads are -{size}..{size - 1} (a "
                    "negative one counts from the end, as in NumPy). Pass the head axis and a head it has."
                )
            at = jnp.where(self.indices < 0, self.indices + size, self.indices)
            mask = jnp.isin(jnp.arange(size), at)
            return jnp.where(_along(mask, (self.axis % jnp.ndim(o),), jnp.ndim(o)), n, o)

        return jax.tree_util.tree_map(patch, self.fill(old), old)

    def for_one_example(self, old: Any) -> tuple[Any, Any]:
        # `axis` is an axis of one example, as `f` sows it; only the filling may be per example.
        fill, axes = one_example(self.fill, old)
        return dataclasses.replace(self, fill=fill), _mapped(self, fill=axes, indices=None)


@pytree_dataclass(data=("clean", "mask", "which"), meta=("axes",))
class PatchOccurrence:
    """`PatchWhere` at occurrence `which` of a site that fires several times;
    `clean` stacks every occurrence's clean value."""

    clean: Any
    mask: Any
    which: Any
    axes: tuple[int, ...] | None

    def __call__(self, old: Any, index: jax.Array) -> Any:
        def patch(c: jax.Array, o: jax.Array) -> jax.Array:
            return jnp.where(
                _along(self.mask, self.axes, jnp.ndim(o)) & (index == self.which), c[index], o
            )

        return jax.tree_util.tree_map(patch, self.clean, old)

    def for_one_example(self, old: Any) -> tuple[Any, Any]:
        one, in_axes = _patch_of_one_example(self, old, stacked=True)
        return one, None if in_axes is None else dataclasses.replace(in_axes, which=None)


@pytree_dataclass(data=("deltas",))
class AddRow:
    """Adds row `index` of `deltas` to occurrence `index` of a site."""

    deltas: Any

    def __call__(self, old: Any, index: jax.Array) -> Any:
        return jax.tree_util.tree_map(lambda d, o: (o + d[index]).astype(o.dtype), self.deltas, old)

    def for_one_example(self, old: Any) -> tuple[Any, Any]:
        return self, _mapped(self, deltas=_leading(self.deltas, old, stacked=True))


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return jnp.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _check_fits(array: Any, old: Any, what: str, whole: bool) -> None:
    """Raises unless ``array`` broadcasts to ``old``'s shape (JAX's error would name neither
    the intervention nor the site); ``whole``: it is the whole value, not a vector added."""
    shape = tuple(jnp.shape(array))
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(old)):
        # One array given for a site sown as a tuple (a block's `(cache, x)`).
        leaves = jax.tree_util.tree_leaves(old)
        parts = ", ".join(f"{jnp.result_type(x)}{list(jnp.shape(x))}" for x in leaves)
        # add_vector(v)'s own form; any other intervention is applied to the part.
        change = "{} + v" if what.startswith("add_vector") else "intervention({})"
        example = "lambda out: ..."
        if isinstance(old, tuple) and len(old) > 1:  # the part the array fits, else the last
            fits = [
                i
                for i, x in enumerate(old)
                if hasattr(x, "shape") and _broadcasts(shape, tuple(x.shape))
            ] or [len(old) - 1]
            each = (
                change.format(f"out[{i}]") if i == fits[-1] else f"out[{i}]"
                for i in range(len(old))
            )
            example = f"lambda out: ({', '.join(each)})"
        raise _errors.InterventionMisfit(
            f"{what} is one array, of shape {shape!r}, but the sown value is a "
            f"{type(old).__name__} of {len(leaves)} arrays ({parts}), and which of them it is for "
            f"is not said. Plant a callable that changes the part you mean, e.g. "
            f"{{{_errors.SITE}: {example}}}."
        )
    target = tuple(jnp.shape(old))
    if _broadcasts(shape, target):
        return
    got = f"{jnp.result_type(old)}{list(target)}"
    if whole:
        fix = f"Pass a value of the site's shape, {got}, as reap returns it"
    else:
        last = f" (a vector of shape {target[-1:]!r} runs along its last axis)" if target else ""
        fix = f"Pass an array that broadcasts to {got}{last}"
    raise _errors.InterventionMisfit(
        f"{what} has shape {shape!r}, which does not broadcast to the sown value, {got}. "
        f"{fix}; `sites(f)(*args)` lists each site's shape."
    )


def _along(mask: jax.Array, axes: tuple[int, ...] | None, ndim: int) -> jax.Array:
    """Reshapes a mask with one axis per entry of `axes` to broadcast along
    those axes of an `ndim`-array (a scalar mask when `axes` is None)."""
    if axes is None:
        return mask
    order = sorted(range(len(axes)), key=lambda i: axes[i])
    shape = [1] * ndim
    for i in order:
        shape[axes[i]] = mask.shape[i]
    return jnp.reshape(jnp.transpose(mask, order), shape)


def _leading(data: Any, old: Any, stacked: bool = False) -> Any:
    """vmap's in_axes for ``data`` (shaped as ``old``, or a prefix of its pytree) under the
    vmap axis leading ``old``: mapped for a leaf holding that axis too (after the occurrences
    it stacks, if ``stacked``), None for one value shared by every example."""
    extra = int(stacked)

    def axis(d: Any, o: Any) -> int | None:
        whole = jnp.ndim(jax.tree_util.tree_leaves(o)[0]) + extra
        return extra if jnp.ndim(d) == whole else None

    return jax.tree_util.tree_map(axis, data, old)


def _shared(axes: Any) -> bool:
    """Whether in_axes map nothing (`tree_leaves` drops the Nones)."""
    return not jax.tree_util.tree_leaves(axes)


def _mapped(intervention: Any, **axes: Any) -> Any:
    """in_axes for ``intervention``, its data fields given by ``axes``; None if nothing is mapped."""
    if all(_shared(a) for a in axes.values()):
        return None
    return dataclasses.replace(intervention, **axes)


def _patch_of_one_example(patch: Any, old: Any, stacked: bool) -> tuple[Any, Any]:
    """(``patch`` for one example of ``old``, its in_axes): ``clean`` mapped where it holds the
    vmap axis leading ``old``, and the mask with it along that axis if swept (``axes`` then
    counted for one example); ``(patch, None)`` if ``clean`` is shared."""
    clean = _leading(patch.clean, old, stacked)
    if _shared(clean):
        return patch, None
    mask, axes = None, patch.axes
    if axes is not None:
        mask, axes = (axes.index(0) if 0 in axes else None), tuple(a - 1 for a in axes if a)
    in_axes = dataclasses.replace(patch, clean=clean, mask=mask, axes=axes)
    return dataclasses.replace(patch, axes=axes), in_axes


def ablate_zero() -> Callable[[Any], Any]:
    """An intervention replacing the sown value by zeros.

    Returns:
        A callable ``old -> zeros_like(old)`` (a pytree), to plant at a site.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import ablate_zero, plant, sow
        >>> f = lambda x: sow(x + 1.0, name="h", mode="strict") * 2.0
        >>> plant(f)({"h": ablate_zero()}, jnp.ones(2))
        Array([0., 0.], dtype=float32)
    """
    return _Zero()


def ablate_mean(mean: ArrayLike) -> Callable[[Any], Any]:
    """An intervention replacing the sown value by ``mean``, broadcast to its shape.

    Args:
        mean: The replacement, broadcast to the sown value's shape (and cast to
            its dtype); typically the site's value averaged over a reference
            batch, e.g. ``reap(f)(xs)["h"].mean(0)``. It is data: another mean
            of the same shape reuses the compiled plant.

    Returns:
        A callable ``old -> mean`` (a pytree), to plant at a site.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import ablate_mean, plant, sow
        >>> f = lambda x: sow(x, name="h", mode="strict") * 2.0
        >>> plant(f)({"h": ablate_mean(jnp.array([1.0, 3.0]))}, jnp.zeros((2, 2)))
        Array([[2., 6.],
               [2., 6.]], dtype=float32)
    """
    return _Mean(mean)


def add_vector(vector: ArrayLike, scale: ArrayLike = 1.0) -> Callable[[Any], Any]:
    """An intervention adding ``scale * vector`` to the sown value (activation steering).

    Args:
        vector: The direction to add, broadcast to the sown value's shape. Under
            a ``vmap`` inside ``f``, a vector shaped as ``reap`` returns the site
            (batch axes leading) adds each example its own.
        scale: How much of it to add (a number or a scalar array; data, so a
            sweep over scales compiles once).

    Returns:
        A callable ``old -> old + scale * vector`` (a pytree; the result keeps
        ``old``'s dtype), to plant at a site.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import add_vector, plant, sow
        >>> f = lambda x: sow(x, name="h", mode="strict")
        >>> plant(f)({"h": add_vector(jnp.array([1.0, 0.0]), scale=3.0)}, jnp.ones(2))
        Array([4., 1.], dtype=float32)
    """
    return AddVector(vector, jnp.asarray(scale))


def patch_positions(
    clean: ArrayLike, positions: ArrayLike | Sequence[int], axis: int
) -> Callable[[Any], Any]:
    """An intervention taking ``clean`` at ``positions`` along ``axis``, the old value elsewhere.

    Args:
        clean: A value of the site's shape, e.g. its value reaped from a clean run.
            Under a ``vmap`` inside ``f``, shaped as ``reap`` returns the site
            (batch axes leading), it gives each example its own; of one
            example's shape, it is shared by every example.
        positions: An index, or a 1-D sequence of indices, along ``axis``; a
            negative one counts from the end, as in NumPy.
        axis: The axis of ``clean`` that ``positions`` index (negative counts
            from the end); along a batch axis, the examples patched whole.

    Returns:
        A callable ``old -> new`` (a pytree), to plant at a site.

    Raises:
        TypeError: ``axis`` is not an int, or ``positions`` are not integers
            (an index or a 1-D sequence).
        ValueError: ``axis`` is out of range for ``clean``, or ``clean``'s
            leaves differ in size along it.
        IndexError: a position is past either end of ``clean`` along ``axis``.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import patch_positions, plant, sow
        >>> f = lambda x: sow(x, name="h", mode="strict")
        >>> plant(f)({"h": patch_positions(jnp.ones((2, 4)), [1, 3], axis=1)}, jnp.zeros((2, 4)))
        Array([[0., 1., 0., 1.],
               [0., 1., 0., 1.]], dtype=float32)
    """
    return _patch_along(clean, positions, axis, "patch_positions")


def _patch_along(clean: Any, positions: Any, axis: int, what: str) -> PatchWhere:
    size = axis_size(clean, axis, f"{what}(clean, ..., axis)")
    shape = tuple(jnp.shape(jax.tree_util.tree_leaves(clean)[0]))
    axis %= len(shape)
    positions, far = _indices(
        positions, "patch_positions needs integer positions (an index or a 1-D sequence)"
    )
    if far is not None and not -size <= far < size:
        raise IndexError(
            f"{what}: index {far} is out of range along axis {axis} of clean, of shape {shape} "
            f"(indices -{size}..{size - 1}; a negative one counts from the end, as in NumPy). "
            "Pass indices that exist in the sown value."
        )
    positions = jnp.where(positions < 0, positions + size, positions)  # as NumPy counts
    return PatchWhere(clean, jnp.isin(jnp.arange(size), positions), (axis,))


def _indices(indices: Any, needs: str) -> tuple[jax.Array, int | None]:
    """``indices`` as a 1-D integer array (else a TypeError saying what it ``needs``), and
    the one needing the largest axis (`i + 1` entries for `i >= 0`, `-i` for a negative
    one): static, so that one past the end is refused; None if traced or empty."""
    indices = jnp.atleast_1d(jnp.asarray(indices))
    if not jnp.issubdtype(indices.dtype, jnp.integer) or indices.ndim != 1:
        raise TypeError(f"{needs}, got {indices.dtype}{list(indices.shape)}.")
    if isinstance(indices, jax.core.Tracer):
        return indices, None
    values = [int(i) for i in np.asarray(indices).tolist()]
    return indices, max(values, key=lambda i: i + 1 if i >= 0 else -i, default=None)


def patch_head(clean: ArrayLike, head: int | ArrayLike, axis: int) -> Callable[[Any], Any]:
    """An intervention patching one attention head, at every position: ``clean``
    at index ``head`` along the head axis ``axis``, the old value elsewhere
    (``patching_sweep(..., axis=head_axis)`` patches every head in turn).

    Args:
        clean: A value of the site's shape, e.g. a per-head output ``z``
            ``[positions, heads, d_head]`` reaped from a clean run.
        head: The head's index along ``axis`` (or a 1-D sequence of heads),
            counted as ``positions`` are. It is data: planting another head
            reuses the compiled plant.
        axis: The head axis of ``clean`` (counted as for ``patch_positions``).

    Returns:
        A callable ``old -> new`` (a pytree), to plant at a site.

    Raises:
        TypeError: ``axis`` is not an int, or ``head`` is not an integer (or a
            1-D sequence of them).
        ValueError: ``axis`` is out of range for ``clean``.
        IndexError: ``head`` is past either end of ``clean`` along ``axis``.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import patch_head, plant, sow
        >>> f = lambda z: sow(z, name="z", mode="strict")  # z: [positions, heads]
        >>> plant(f)({"z": patch_head(jnp.ones((3, 2)), 1, axis=1)}, jnp.zeros((3, 2)))
        Array([[0., 1.],
               [0., 1.],
               [0., 1.]], dtype=float32)
    """
    return _patch_along(clean, head, axis, "patch_head")


def ablate_head(
    head: int | ArrayLike | Sequence[int], axis: int, mean: ArrayLike | None = None
) -> Callable[[Any], Any]:
    """An intervention ablating one attention head, at every position: zeros
    (or ``mean``, broadcast) at index ``head`` along the head axis ``axis``.

    Args:
        head: The head's index along ``axis``, or a sequence of heads (a
            negative one counts from the end). A head past either end is
            refused when planted, the site's shape known, so how far the heads
            reach is part of the compile cache key: a loop over heads compiles
            once per head (``patching_sweep(..., axis=head_axis)`` runs them
            all in one program). Heads traced under ``jax.vmap`` are not checked.
        axis: The head axis of the sown value; under a ``vmap`` inside ``f``,
            of one example, as ``f`` sows it (or counted from the end).
        mean: What to put there instead of zeros: the shape of one head's
            slice, or broadcastable to it (e.g. the site's value averaged over a
            reference batch, taken at that head). ``None``: zeros.

    Returns:
        A callable ``old -> new`` (a pytree), to plant at a site.

    Raises:
        TypeError: ``axis`` is not an int, or ``head`` is not an integer (or a
            1-D sequence of them).
        ValueError: when planted, ``head`` is past either end of the site's
            ``axis`` (the message names the site and its shape).

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import ablate_head, plant, sow
        >>> f = lambda z: sow(z, name="z", mode="strict")  # z: [positions, heads]
        >>> plant(f)({"z": ablate_head(0, axis=1)}, jnp.ones((3, 2)))
        Array([[0., 1.],
               [0., 1.],
               [0., 1.]], dtype=float32)
    """
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(
            f"ablate_head(head, axis): axis must be an int (the head axis), got {axis!r}."
        )
    heads, farthest = _indices(
        head, "ablate_head needs an integer head (or a 1-D sequence of them)"
    )
    return _FillAt(_Zero() if mean is None else _Mean(mean), heads, int(axis), farthest)


def axis_size(value: Any, axis: Any, what: str) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{what}: axis must be an int, got {axis!r}.")
    sizes = set()
    for leaf in jax.tree_util.tree_leaves(value):
        ndim = jnp.ndim(leaf)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{what}: axis {axis} is out of range for a value of shape {jnp.shape(leaf)}. "
                "Pass the axis that indexes positions in the sown value."
            )
        sizes.add(jnp.shape(leaf)[axis])
    if len(sizes) != 1:
        raise ValueError(
            f"{what}: the leaves have different sizes {sorted(sizes)} along axis {axis}."
        )
    return sizes.pop()
