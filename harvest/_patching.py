"""Activation patching: interventions, a compiled patching sweep, attribution patching.

Every intervention is a callable `old -> new`, planted at a sow site. They are
pytrees (their arrays are leaves, the rest is static), so the plant's compile
cache is keyed by their shapes, not their identity, and they can carry traced
values under `jit` and `vmap`. That is what lets `patching_sweep` run every
(site, position) patch as one vmapped computation over a one-hot selection.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, SupportsFloat

import jax
import jax.numpy as jnp
import numpy as np

from . import _attention
from ._calling import call_merged, is_array, make_jaxpr, split_nodes
from ._inspect import sow_equations
from ._interpreter import NameFilter
from ._paths import nested_dict, path_str
from ._site import Site
from ._sow import DEFAULT_TAG
from ._transforms import plant, reap
from ._typing import NameSelect, Reaped, T, dataclass_transform

if TYPE_CHECKING:
    from jax.typing import ArrayLike
    from matplotlib.axes import Axes

# ---------------------------------------------------------------------------
# Interventions: callables old -> new, usable as planted values.


@dataclass_transform(frozen_default=True)
def _pytree_dataclass(
    data: tuple[str, ...], meta: tuple[str, ...] = ()
) -> Callable[[type[T]], type[T]]:
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))

    return wrap


@_pytree_dataclass(data=())
class _Zero:
    def __call__(self, old):
        return jax.tree_util.tree_map(jnp.zeros_like, old)


@_pytree_dataclass(data=("mean",))
class _Mean:
    mean: Any

    def __call__(self, old):
        def fill(m, o):
            return jnp.broadcast_to(m, o.shape).astype(o.dtype)

        return jax.tree_util.tree_map(fill, self.mean, old)


@_pytree_dataclass(data=("vector", "scale"))
class _AddVector:
    vector: Any
    scale: Any

    def __call__(self, old):
        def add(v, o):
            return (o + self.scale * v).astype(o.dtype)

        return jax.tree_util.tree_map(add, self.vector, old)


@_pytree_dataclass(data=("clean", "mask"), meta=("axes",))
class _PatchWhere:
    """`clean` where `mask` holds, `old` elsewhere; `mask` runs along `axes` (one
    mask axis per swept axis), or is a scalar when `axes` is None."""

    clean: Any
    mask: Any
    axes: tuple[int, ...] | None

    def __call__(self, old: Any) -> Any:
        def patch(c: jax.Array, o: jax.Array) -> jax.Array:
            return jnp.where(_along(self.mask, self.axes, jnp.ndim(o)), c, o)

        return jax.tree_util.tree_map(patch, self.clean, old)


@_pytree_dataclass(data=("fill", "indices"), meta=("axis",))
class _FillAt:
    """`fill(old)` (another intervention) at `indices` along `axis`, `old` elsewhere."""

    fill: Any
    indices: jax.Array
    axis: int

    def __call__(self, old: Any) -> Any:
        def patch(n: jax.Array, o: jax.Array) -> jax.Array:
            mask = jnp.isin(jnp.arange(jnp.shape(o)[self.axis]), self.indices)
            return jnp.where(_along(mask, (self.axis % jnp.ndim(o),), jnp.ndim(o)), n, o)

        return jax.tree_util.tree_map(patch, self.fill(old), old)


@_pytree_dataclass(data=("clean", "mask", "which"), meta=("axes",))
class _PatchOccurrence:
    """`_PatchWhere` at occurrence `which` of a site that fires several times;
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


@_pytree_dataclass(data=("deltas",))
class _AddRow:
    """Adds row `index` of `deltas` to occurrence `index` of a site."""

    deltas: Any

    def __call__(self, old, index):
        return jax.tree_util.tree_map(lambda d, o: (o + d[index]).astype(o.dtype), self.deltas, old)


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


def ablate_zero() -> Callable[[Any], Any]:
    """An intervention replacing the sown value by zeros.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import ablate_zero, plant, sow
        >>> f = lambda x: sow(x + 1.0, name="h", mode="strict") * 2.0
        >>> plant(f)({"h": ablate_zero()}, jnp.ones(2))
        Array([0., 0.], dtype=float32)
    """
    return _Zero()


def ablate_mean(mean: ArrayLike) -> Callable[[Any], Any]:
    """An intervention replacing the sown value by `mean`, broadcast to its shape.

    `mean` is typically the site's value averaged over a reference batch, e.g.
    `reap(f)(xs)["h"].mean(0)`.

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
    """An intervention adding `scale * vector` to the sown value (activation steering).

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import add_vector, plant, sow
        >>> f = lambda x: sow(x, name="h", mode="strict")
        >>> plant(f)({"h": add_vector(jnp.array([1.0, 0.0]), scale=3.0)}, jnp.ones(2))
        Array([4., 1.], dtype=float32)
    """
    return _AddVector(vector, jnp.asarray(scale))


def patch_positions(
    clean: ArrayLike, positions: ArrayLike | Sequence[int], axis: int
) -> Callable[[Any], Any]:
    """An intervention taking `clean` at `positions` along `axis`, the old value elsewhere.

    `clean` has the site's shape (e.g. its value reaped from a clean run);
    `positions` is an index or a sequence of indices along `axis`.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import patch_positions, plant, sow
        >>> f = lambda x: sow(x, name="h", mode="strict")
        >>> plant(f)({"h": patch_positions(jnp.ones((2, 4)), [1, 3], axis=1)}, jnp.zeros((2, 4)))
        Array([[0., 1., 0., 1.],
               [0., 1., 0., 1.]], dtype=float32)
    """
    size = _axis_size(clean, axis, "patch_positions(clean, positions, axis)")
    axis = _normalize_axis(clean, axis)
    positions = jnp.atleast_1d(jnp.asarray(positions))
    if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.ndim != 1:
        raise TypeError(
            f"patch_positions needs integer positions (an index or a 1-D sequence), got "
            f"{positions.dtype}{list(positions.shape)}."
        )
    mask = jnp.isin(jnp.arange(size), positions)
    return _PatchWhere(clean, mask, (axis,))


def patch_head(clean: ArrayLike, head: int | ArrayLike, axis: int) -> Callable[[Any], Any]:
    """An intervention patching one attention head, at every position: `clean`
    at index `head` along the head axis `axis`, the old value elsewhere.

    `clean` has the site's shape, e.g. a per-head output `z` `[positions,
    heads, d_head]` reaped from a clean run. `head` is data, not part of the
    compile cache key: planting another head reuses the compiled plant.
    `patching_sweep(..., axis=head_axis)` patches every head in turn.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import patch_head, plant, sow
        >>> f = lambda z: sow(z, name="z", mode="strict")  # z: [positions, heads]
        >>> plant(f)({"z": patch_head(jnp.ones((3, 2)), 1, axis=1)}, jnp.zeros((3, 2)))
        Array([[0., 1.],
               [0., 1.],
               [0., 1.]], dtype=float32)
    """
    return patch_positions(clean, head, axis)


def ablate_head(
    head: int | ArrayLike | Sequence[int], axis: int, mean: ArrayLike | None = None
) -> Callable[[Any], Any]:
    """An intervention ablating one attention head, at every position: zeros
    (or `mean`, broadcast) at index `head` along the head axis `axis`.

    `head` may also be a sequence of heads. `mean` has the shape of one head's
    slice, or broadcasts to it (e.g. the site's value averaged over a reference
    batch, taken at that head). `head` is data, so ablating another head reuses
    the compiled plant.

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
    heads = jnp.atleast_1d(jnp.asarray(head))
    if not jnp.issubdtype(heads.dtype, jnp.integer) or heads.ndim != 1:
        raise TypeError(
            f"ablate_head needs an integer head (or a 1-D sequence of them), got {heads.dtype}{list(heads.shape)}."
        )
    return _FillAt(_Zero() if mean is None else _Mean(mean), heads, int(axis))


def _axis_size(value, axis, what):
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


def _normalize_axis(value, axis):
    return axis % jnp.ndim(jax.tree_util.tree_leaves(value)[0])


def _swept_axes(axis: Any, caller: str) -> tuple[int, ...] | None:
    """A sweep's `axis` argument as a tuple of axes (None: whole sites)."""
    if axis is None:
        return None
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    if not axes or any(not isinstance(a, (int, np.integer)) or isinstance(a, bool) for a in axes):
        raise TypeError(
            f"{caller}: axis must be an int or a non-empty tuple of ints (e.g. axis=(2, 1) for every "
            f"(head, position) pair), got {axis!r}."
        )
    return tuple(int(a) for a in axes)


def _site_axes(value: Any, axes: tuple[int, ...] | None, what: str) -> tuple[int, ...] | None:
    """`axes`, each counted from the front of `value`'s leaves; no axis twice."""
    if axes is None:
        return None
    normal = tuple(_normalize_axis(value, a) for a in axes)
    if len(set(normal)) != len(normal):
        raise ValueError(f"{what}: axis {axes} names the same axis twice; sweep each axis once.")
    return normal


# ---------------------------------------------------------------------------
# Results.


@dataclasses.dataclass(frozen=True)
class PatchingResult:
    """The effect of each patch on a metric: `values[i, j]` for site `names[i]` at `positions[j]`.

    An effect is `metric(patched run) - baseline`, where `baseline` is the
    metric of the unpatched corrupted run (estimated, for attribution
    patching). Without a position axis, `values` has shape `[len(names)]` and
    `positions` is `None`. A sweep over several axes (`axis=(2, 1)`, say) has
    `values` of shape `[len(names), *sizes]` and `positions` holds one array of
    indices per swept axis. `skipped` lists the sites a sweep without `names=`
    left out (a different size along the swept axes), each with the reason.

    Example:
        >>> import numpy as np
        >>> from harvest import PatchingResult
        >>> r = PatchingResult(np.array([[0.0, 1.0]]), ("h",), np.arange(2), axis=1, baseline=0.5)
        >>> r.values.shape, r.names
        ((1, 2), ('h',))
    """

    values: np.ndarray
    names: tuple[str, ...]
    positions: Any  # np.ndarray, a tuple of them (several axes), or None
    axis: Any  # int, tuple of ints, or None
    baseline: float
    measure: str = "effect on metric"  # what `values` measure (a plot's colourbar label)
    skipped: tuple[str, ...] = ()  # sites left out of a sweep without names=, each with the reason
    # What each swept axis is ("head", "position"), when the swept sites say (attention hooks).
    axis_labels: tuple[str, ...] | None = None

    def normalized(self, clean_metric: SupportsFloat) -> PatchingResult:
        """The effects as fractions of the clean-corrupt gap: `values / (clean_metric - baseline)`.

        1 means the patch restores the clean run's metric, 0 that it does
        nothing. `clean_metric` is `metric(f(*clean_args))`.

        Example:
            >>> import numpy as np
            >>> from harvest import PatchingResult
            >>> r = PatchingResult(np.array([[1.0, 3.0]]), ("h",), np.arange(2), axis=1, baseline=1.0)
            >>> r.normalized(clean_metric=5.0).values
            array([[0.25, 0.75]])
        """
        gap = float(clean_metric) - self.baseline
        if gap == 0.0:
            raise ValueError(
                f"normalized: the clean metric equals the corrupted baseline ({self.baseline}), so there "
                "is no gap to normalise by. Pick a metric (or inputs) that tells the two runs apart."
            )
        return dataclasses.replace(
            self, values=self.values / gap, measure="fraction of clean-corrupt gap"
        )

    def _grid(self) -> np.ndarray:
        if self.values.ndim > 2:
            raise ValueError(
                f"plot_many draws results of one swept axis; this one has values of shape {self.values.shape}. "
                "Use result.plot(), which draws one panel per site."
            )
        return self.values if self.positions is not None else self.values[:, None]

    def plot(
        self,
        ax: Axes | None = None,
        title: str | None = None,
        cmap: str = "RdBu_r",
        vmax: float | None = None,
        **imshow_kwargs: Any,
    ) -> Any:
        """Draws `values` as a heatmap (sites × positions), centred on zero; returns the axes.

        A sweep over two axes is drawn as one panel per site (first swept axis
        × second), all on one colour scale; then the list of axes is returned.
        `vmax` fixes the colour scale (default: the largest magnitude); use
        `PatchingResult.plot_many` to put several results on one scale.

        Example:
            >>> import matplotlib; matplotlib.use("Agg")
            >>> import numpy as np
            >>> from harvest import PatchingResult
            >>> r = PatchingResult(np.eye(2), ("a", "b"), np.arange(2), axis=1, baseline=0.0)
            >>> r.plot(title="effect").get_title()
            'effect'
            >>> heads = PatchingResult(
            ...     np.ones((2, 3, 4)), ("l0", "l1"), (np.arange(3), np.arange(4)), axis=(2, 1), baseline=0.0
            ... )
            >>> [ax.get_title() for ax in heads.plot()]
            ['l0', 'l1']
        """
        if self.values.ndim == 3:
            return self._plot_panels(ax, title, cmap, vmax, **imshow_kwargs)
        return PatchingResult.plot_many(
            [self], ax=ax, titles=[title], cmap=cmap, vmax=vmax, **imshow_kwargs
        )[0]

    def _plot_panels(
        self, ax: Any, title: str | None, cmap: str, vmax: float | None, **imshow_kwargs: Any
    ) -> Any:
        from ._plots import heatmaps

        rows, cols = self.positions
        bound = float(np.max(np.abs(self.values))) if vmax is None else float(vmax)
        axes = heatmaps(
            list(self.values),
            titles=list(self.names),
            row_labels=rows,
            col_labels=cols,
            xlabel=self.axis_labels[1] if self.axis_labels else f"axis {self.axis[1]}",
            ylabel=self.axis_labels[0] if self.axis_labels else f"axis {self.axis[0]}",
            cmap=cmap,
            vmin=-(bound or 1.0),
            vmax=bound or 1.0,
            cbar_label=self.measure,
            ax=ax,
            **imshow_kwargs,
        )
        if title is not None:
            axes[0].figure.suptitle(title)
        return axes

    @staticmethod
    def plot_many(
        results: Sequence[PatchingResult],
        titles: Sequence[str | None] | None = None,
        *,
        ax: Axes | Sequence[Axes] | None = None,
        cmap: str = "RdBu_r",
        vmax: float | None = None,
        **imshow_kwargs: Any,
    ) -> list[Axes]:
        """Draws several results side by side on one colour scale with one colourbar; returns the axes.

        The results must have the same rows (sites) and columns; the figure is
        laid out so no label overlaps a neighbouring panel or the colourbar.

        Example:
            >>> import matplotlib; matplotlib.use("Agg")
            >>> import numpy as np
            >>> from harvest import PatchingResult
            >>> a = PatchingResult(np.eye(2), ("a", "b"), np.arange(2), axis=1, baseline=0.0)
            >>> b = PatchingResult(3 * np.eye(2), ("a", "b"), np.arange(2), axis=1, baseline=0.0)
            >>> axes = PatchingResult.plot_many([a, b], titles=["exact", "estimate"])
            >>> [ax.images[0].get_clim() for ax in axes]
            [(-3.0, 3.0), (-3.0, 3.0)]
        """
        from ._plots import heatmaps

        results = list(results)
        if not results:
            raise ValueError("plot_many needs at least one PatchingResult.")
        grids = [r._grid() for r in results]
        if len({g.shape for g in grids}) != 1 or len({r.names for r in results}) != 1:
            raise ValueError(
                "plot_many draws results with the same sites and positions; got shapes "
                f"{[g.shape for g in grids]}. Plot them separately (each with the same vmax)."
            )
        titles = [None] * len(results) if titles is None else list(titles)
        if len(titles) != len(results):
            raise ValueError(f"plot_many: {len(titles)} titles for {len(results)} results.")
        bound = float(max(np.max(np.abs(g)) for g in grids)) if vmax is None else float(vmax)
        first = results[0]
        return heatmaps(
            grids,
            titles=titles,
            row_labels=first.names,
            col_labels=first.positions,
            xlabel=f"position (axis {first.axis})",
            ylabel=None,
            cmap=cmap,
            vmin=-(bound or 1.0),
            vmax=bound or 1.0,
            cbar_label=first.measure,
            ax=ax,
            **imshow_kwargs,
        )


# ---------------------------------------------------------------------------
# Which sites a sweep patches, and the clean value at each.


@dataclasses.dataclass(frozen=True)
class _Target:
    site: Site
    clean: Any  # one occurrence's value; for a looped site, every occurrence's, stacked
    count: int | None = None  # occurrences of a looped site (None: it fires once)

    @property
    def one(self):
        """The value of one occurrence (the first), the site's shape."""
        return (
            self.clean if self.count is None else jax.tree_util.tree_map(lambda l: l[0], self.clean)
        )

    @property
    def rows(self):
        return 1 if self.count is None else self.count


def _site_value(reaps, site, what, count=None):
    """One occurrence's value of `site` from a dict shaped as `reap` returns it
    (all `count` of them, stacked, for a looped site)."""
    node = _lookup(reaps, site, what)
    if count is not None:
        site.check(node, f"the {what} value", leading=(count,))
        return node
    if site.mode.entries:
        node = node[0] if isinstance(node, tuple) and len(node) == 1 else node
    elif site.mode.rows and not site.mode.unstacked_once:
        node = jax.tree_util.tree_map(lambda l: l[0], node)
    site.check(node, f"the {what} value")
    return node


def _lookup(reaps, site, what):
    """What `reap` returned for `site`'s name; dotted keys and nested dicts alike."""
    node = _lookup_dotted(reaps, path_str(site.path))
    if node is _MISSING:
        raise KeyError(
            f"{what} has no value for {path_str(site.path)!r}. Pass the dict "
            f"`reap(f, tag={site.tag!r})(*clean_args)` returns."
        )
    return node


def _targets(f, clean, corrupted_args, tag, names, axes, caller):
    """The sites to patch, with their clean values, their sizes along `axes`, and the sites skipped."""
    if not callable(f):
        raise TypeError(f"{caller} needs a callable f, got {type(f).__name__}.")
    if not isinstance(corrupted_args, tuple):
        raise TypeError(
            f"{caller}: corrupted_args must be the tuple of f's positional arguments, e.g. "
            f"(tokens,), got {type(corrupted_args).__name__}."
        )
    if not isinstance(clean, dict):
        raise TypeError(
            f"{caller}: clean must be the dict reap(f, tag=...)(*clean_args) returns, got "
            f"{type(clean).__name__}."
        )
    by_name: dict[str, list] = {}
    for eqn, where, fires in sow_equations(make_jaxpr(f, corrupted_args, {})[0].jaxpr):
        site = Site.of(eqn)
        if site.tag == tag:
            by_name.setdefault(path_str(site.path), []).append((site, where, fires))
    chosen = names
    if names is None:
        names = [n for n in by_name if _lookup_dotted(clean, n) is not _MISSING]
    else:
        names = _select_names(names, list(by_name), tag, caller)
    if not names:
        raise ValueError(
            f"{caller}: nothing to patch. No name sown with tag {tag!r} has a value in clean; "
            f"names sown with that tag: {list(by_name) or 'none'}."
        )
    targets = [_target(by_name, name, clean, tag, caller) for name in names]
    if axes is None:
        return targets, None, ()
    sizes = {path_str(t.site.path): _sizes_along(t.one, axes) for t in targets}
    where = "axis " + str(axes[0]) if len(axes) == 1 else f"axes {axes}"
    skipped: tuple[str, ...] = ()
    if chosen is None:
        # Sweep the sites of the most common size; say which were left out.
        counts = collections.Counter(n for n in sizes.values() if n is not None)
        if not counts:
            raise ValueError(
                f"{caller}: no site has {'an ' * (len(axes) == 1)}{where}; sizes: {sizes}."
            )
        size = counts.most_common(1)[0][0]
        skipped = tuple(
            f"{name}: size {_size_str(n)} along {where}, not {_size_str(size)}"
            if n is not None
            else f"{name}: no {where}"
            for name, n in sizes.items()
            if n != size
        )
        targets = [t for t in targets if sizes[path_str(t.site.path)] == size]
    else:
        for t in targets:  # the full message for a bad axis or mismatched leaves
            for a in axes:
                _axis_size(t.one, a, f"{caller} at {path_str(t.site.path)!r}")
            _site_axes(t.one, axes, f"{caller} at {path_str(t.site.path)!r}")
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"{caller}: the sites have different sizes along {where}: "
                f"{ {n: _size_str(z) for n, z in sizes.items()} }. Sweep sites of one size together (pass names=...)."
            )
        size = next(iter(sizes.values()))
    return targets, size, skipped


def _size_str(sizes: tuple[int, ...]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else str(sizes)


def _sizes_along(value: Any, axes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The size of every leaf along each of `axes`, or None if the leaves differ,
    lack one of the axes, or two of `axes` are the same axis."""
    sizes = set()
    for leaf in jax.tree_util.tree_leaves(value):
        ndim = jnp.ndim(leaf)
        if not all(-ndim <= a < ndim for a in axes) or len({a % ndim for a in axes}) != len(axes):
            return None
        sizes.add(tuple(jnp.shape(leaf)[a] for a in axes))
    return sizes.pop() if len(sizes) == 1 else None


def _select_names(names, sown, tag, caller):
    """The names `names=` selects (exact names, globs, predicates, or a list of
    them), in the order of its entries, each entry's matches in program order."""
    entries = names if isinstance(names, (list, tuple)) else [names]
    picked = {}
    for entry in entries:
        select = NameFilter.make(entry)
        picked.update(dict.fromkeys(n for n in sown if select((n,))))
    NameFilter.make(list(entries)).check_allowlist(sown, f"{caller}: names=", tag)
    return list(picked)


_MISSING = object()


def _lookup_dotted(tree, name):
    """`tree`'s value for the dotted `name`, its keys dotted paths or nested dicts alike."""
    if not isinstance(tree, dict):
        return _MISSING
    if name in tree:
        return tree[name]
    for key, value in tree.items():
        if isinstance(key, str) and name.startswith(key + "."):
            found = _lookup_dotted(value, name[len(key) + 1 :])
            if found is not _MISSING:
                return found
    return _MISSING


def _target(by_name, name, clean, tag, caller):
    occurrences = by_name[name]
    (site, where, fires), *others = occurrences
    if not others and fires == 1:
        return _Target(site, _site_value(clean, site, "clean"))
    if site.mode.rows and all(o[2] is not None for o in occurrences):
        # Fires several times (in a scan, say): one row per occurrence, as reap stacks them.
        count = int(np.shape(jax.tree_util.tree_leaves(_lookup(clean, site, "clean"))[0])[0])
        return _Target(site, _site_value(clean, site, "clean", count), count)
    total = sum(o[2] or 0 for o in occurrences)
    count = "an unbounded number of" if fires is None else str(total)
    raise ValueError(
        f"{caller}: the site {name!r} (mode {site.mode.label}) fires {count} times per call "
        f"(at {_where_str(occurrences)}); a sweep patches each occurrence of a site sown with "
        "mode 'append' outside while_loops, and otherwise needs sites that fire once. Sow it "
        "with mode='append', give each occurrence its own name (e.g. with nest or "
        "f'layer{i}'), or leave it out with names=."
    )


def _where_str(occurrences):
    return ", ".join(" › ".join(w) or "top level" for _, w, _ in occurrences)


def _scalar(m):
    if jnp.shape(m) != ():
        raise TypeError(
            f"metric(out) must return a scalar, got shape {jnp.shape(m)}. Reduce it, e.g. "
            "with jnp.mean over the batch."
        )
    return m


def _jit_on_arrays(fn: Callable[[Any], Any], tree: Any, key: tuple[Any, ...] | None) -> Any:
    """`jax.jit(fn)(tree)`, with `tree`'s arrays traced and its other leaves static.

    NNX graph nodes in `tree` are split first, so their state is traced too,
    and merged into fresh nodes inside the trace (changes to them are not
    written back: a sweep is a measurement). Calls with equal `key` (which
    says everything `fn` closes over that shapes the program) and equal static
    leaves share one compiled program: only the first traces and compiles,
    later ones with the same shapes just run it. `key=None` compiles for this
    call only.
    """
    tree, graph, _ = split_nodes(tree)
    leaves, treedef = jax.tree_util.tree_flatten((tree, graph))
    traced = [is_array(leaf) for leaf in leaves]
    static = _Compiled(
        (
            key,
            treedef,
            tuple((i, type(l), l) for i, (l, a) in enumerate(zip(leaves, traced)) if not a),
        )
    )
    arrays = [leaf for leaf, a in zip(leaves, traced) if a]
    rebuilt = functools.partial(_rebuilt, fn, treedef, leaves, traced)
    try:
        hash(static)
        cached = key is not None
    except TypeError:  # an unhashable static leaf
        cached = False
    if not cached:
        return jax.jit(rebuilt)(arrays)
    static.trace = rebuilt
    try:
        return _run_compiled(static, arrays)
    finally:
        static.trace = None  # the cache keeps the key, not this call's function and arrays


def _rebuilt(
    fn: Callable[[Any], Any], treedef: Any, leaves: list[Any], traced: list[bool], arrays: list[Any]
) -> Any:
    it = iter(arrays)
    tree, graph = treedef.unflatten([next(it) if a else leaf for leaf, a in zip(leaves, traced)])
    if graph is not None:  # fresh NNX nodes holding the traced state
        tree = call_merged(lambda t: t, (tree,), {}, graph)[0]
    return fn(tree)


class _Compiled:
    """`_run_compiled`'s static argument: compared by `key` alone; `trace` is the
    current call's function, read only when JAX traces (a new key or new shapes)."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.trace: Callable[[Any], Any] | None = None

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Compiled) and self.key == other.key


@functools.partial(jax.jit, static_argnums=0)
def _run_compiled(static: _Compiled, arrays: list[Any]) -> Any:
    # One jit for every sweep: its cache (bounded, cleared by jax.clear_caches)
    # holds one program per key and set of shapes.
    assert static.trace is not None
    return static.trace(arrays)


@_pytree_dataclass(data=("self",), meta=("func",))
class _BoundMethod:
    """A bound method whose `self` is a pytree (an Equinox module, say), as a pytree: its arrays are data."""

    func: Callable[..., Any]
    self: Any

    def __call__(self, *args: Any) -> Any:
        return self.func(self.self, *args)


def _compile(
    program: Callable[[Any, Any], Any], f: Callable, operands: Any, spec: tuple[Any, ...]
) -> Any:
    """`program(f, operands)`, compiled once per `spec` and shapes (see `_jit_on_arrays`).

    A plain function `f` is part of the key (held weakly, so the cache does not
    keep it alive), as under `jax.jit`. A module -- an NNX graph node, a pytree
    such as an Equinox module, or a bound method of either -- is data: its
    arrays are traced, so weights changed in place (or a new module of the
    same structure) reuse the program and are read at every call. Any other
    callable compiles for this call only.
    """
    if inspect.isfunction(f):
        return _jit_on_arrays(lambda ops: program(f, ops), operands, (weakref.ref(f), *spec))
    if (
        inspect.ismethod(f)
        and not split_nodes(f)[2]
        and jax.tree_util.tree_leaves(f.__self__) != [f.__self__]
    ):
        f = _BoundMethod(f.__func__, f.__self__)
    if split_nodes(f)[2] or jax.tree_util.tree_leaves(f) != [f]:
        return _jit_on_arrays(lambda tree: program(*tree), (f, operands), ("module", *spec))
    return _jit_on_arrays(lambda ops: program(f, ops), operands, None)


def _labels(
    targets: list[_Target], size: tuple[int, ...] | None, axis: Any
) -> tuple[tuple[str, ...], Any]:
    """One name per row (a looped site's occurrences are `name[0]` ... `name[k-1]`),
    and the indices along the swept axis (a tuple of them, one per axis, for several axes)."""
    names: list[str] = []
    for t in targets:
        name = path_str(t.site.path)
        names += [name] if t.count is None else [f"{name}[{j}]" for j in range(t.count)]
    if size is None:
        return tuple(names), None
    labels = tuple(np.arange(n) for n in size)
    return tuple(names), labels if isinstance(axis, (tuple, list)) else labels[0]


def _dataset(clean: Any, corrupted_args: Any, caller: str) -> list[tuple[Any, Any]]:
    """The (clean, corrupted args) pairs a sweep averages over: one, or one per batch of a dataset."""
    if not isinstance(corrupted_args, list):
        return [(clean, corrupted_args)]
    if not isinstance(clean, list) or len(clean) != len(corrupted_args) or not clean:
        raise TypeError(
            f"{caller}: for a dataset, pass corrupted_args as a non-empty list of argument tuples, one per "
            "batch, and clean as the list of their clean reaps, [reap(f)(*clean_args) for clean_args in "
            f"batches]; got {len(corrupted_args)} argument tuples and "
            f"{len(clean) if isinstance(clean, list) else type(clean).__name__ + ' as'} clean."
        )
    return list(zip(clean, corrupted_args))


def _batch_cleans(
    targets: list[_Target], batch_clean: Any, axes: tuple[int, ...] | None, size: Any, caller: str
) -> list[Any]:
    """Each target's clean value in one batch of a dataset, checked against the first batch's sizes."""
    cleans = []
    for t in targets:
        value = _site_value(batch_clean, t.site, "clean", t.count)
        one = value if t.count is None else jax.tree_util.tree_map(lambda l: l[0], value)
        if axes is not None and _sizes_along(one, axes) != size:
            raise ValueError(
                f"{caller}: in this batch, {path_str(t.site.path)!r} has sizes {_sizes_along(one, axes)} along "
                f"axis {axes}, not {size} as in the first batch. Every batch must give the swept axes one size."
            )
        cleans.append(value)
    return cleans


def _steps(items: list[Any], progress: bool | None, caller: str) -> Any:
    """`items`, under a tqdm progress bar if `progress` (None: only for several
    steps in a terminal or notebook, and only once the run has taken a second)."""
    auto = progress is None
    if auto:
        progress = len(items) > 1 and _interactive()
    if not progress:
        return items
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]
    except ImportError:
        if auto:
            return items
        raise ImportError(
            f"{caller}(progress=True) draws its bar with tqdm: pip install tqdm."
        ) from None
    return tqdm(items, desc=caller, unit="chunk", delay=1.0 if auto else 0.0, leave=not auto)


def _interactive() -> bool:
    """Whether a person is watching: a terminal on stderr, or a Jupyter kernel."""
    ipython = sys.modules.get("IPython")
    shell = (
        ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    )
    if getattr(shell, "kernel", None) is not None:
        return True
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


# ---------------------------------------------------------------------------
# The sweep.


def patching_sweep(
    f: Callable[..., Any],
    clean: Reaped | list[Reaped],
    corrupted_args: tuple[Any, ...] | list[tuple[Any, ...]],
    metric: Callable[[Any], ArrayLike],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    axis: int | tuple[int, ...] | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
) -> PatchingResult:
    """Patches each clean activation into the corrupted run, one at a time, and measures the effect.

    For every site in `names` (exact names, glob patterns such as
    `"blocks.*.attn"`, predicates on names, or a list of them; each string must
    match a site), or by default every site of `tag` with a value in `clean`,
    and, if `axis` is given, every index along that axis of the sown value
    (e.g. token position), the corrupted run `f(*corrupted_args)` gets the
    clean value there and keeps its own everywhere else. `clean` is
    `reap(f, tag=tag)(*clean_args)`. `metric` maps `f`'s output to a scalar;
    each value of the result is `metric(patched out) - metric(corrupted out)`
    (see `PatchingResult`).

    `axis` may be a tuple: `axis=(2, 1)` on a per-head output `[batch,
    positions, heads, d_head]` patches every (head, position) pair, giving
    values of shape `(sites, heads, positions)`. Without `names`, the sites
    whose sizes along the swept axes differ from the most common ones
    (attention patterns beside the residual stream, say) are left out and
    listed in the result's `skipped`. A site that fires `k` times (mode
    `append` in a `scan`, e.g. scan-over-layers) gives `k` rows, `name[0]` ...
    `name[k-1]`, each patching that occurrence alone; `axis` counts the axes of
    one occurrence's value.

    All patches run as one compiled, vmapped computation over one-hot
    selections; `batch_size` bounds how many run at once (the rest follow in
    chunks through the same compiled program). To average over a dataset, pass
    `corrupted_args` as a list of argument tuples (one per batch) and `clean`
    as the list of their clean reaps: the result is the mean over batches.
    `progress=True` shows a tqdm bar over chunks and batches; by default
    (`None`) a bar appears for a run of several chunks in a terminal or
    notebook that is still going after a second.

    The compiled program is kept and reused by later calls with the same `f`,
    `metric`, `tag`, swept sites, `axis`, `batch_size` and argument shapes (and
    equal non-array arguments): a repeated sweep on new data only runs. A plain
    function `f` is part of the key, as under `jax.jit` (a fresh lambda
    compiles again, and arrays it closes over are read when it first
    compiles); a module (NNX or Equinox) or a bound method of one is data:
    weights changed in place are read at every call, without compiling again.
    The cache holds `f` weakly and is cleared by `jax.clear_caches()`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import patching_sweep, reap, sow
        >>> def f(x):
        ...     h = sow(2.0 * x, name="h", mode="strict")
        ...     return sow(h + 1.0, name="g", mode="strict")
        >>> clean = reap(f)(jnp.array([1.0, 2.0, 3.0]))
        >>> r = patching_sweep(f, clean, (jnp.zeros(3),), jnp.sum, axis=0)
        >>> r.names, r.baseline
        (('h', 'g'), 3.0)
        >>> r.values  # patching h or g at position i adds 2 * (i + 1) to the sum
        array([[2., 4., 6.],
               [2., 4., 6.]], dtype=float32)
        >>> def heads(z):  # z: [positions, heads]; head 1 counts double
        ...     return (sow(z, name="z", mode="strict") * jnp.array([1.0, 2.0])).sum()
        >>> r = patching_sweep(heads, reap(heads)(jnp.ones((3, 2))), (jnp.zeros((3, 2)),), lambda o: o, axis=(1, 0))
        >>> r.values  # (sites, heads, positions)
        array([[[1., 1., 1.],
                [2., 2., 2.]]], dtype=float32)
        >>> def layers(x):  # the same site in each of 2 scanned layers
        ...     step = lambda c, _: (sow(c * 2.0, name="h", mode="append"), None)
        ...     return jax.lax.scan(step, x, None, length=2)[0]
        >>> r = patching_sweep(layers, reap(layers)(jnp.ones(3)), (jnp.zeros(3),), jnp.sum, axis=0)
        >>> r.names, r.values.shape
        (('h[0]', 'h[1]'), (2, 3))
    """
    caller = "patching_sweep"
    axes = _swept_axes(axis, caller)
    batches = _dataset(clean, corrupted_args, caller)
    targets, size, skipped = _targets(f, batches[0][0], batches[0][1], tag, names, axes, caller)
    swept = [(path_str(t.site.path), t.one) for t in targets]  # for the head-axis check and labels
    _attention.check_swept_axes(swept, axes)
    if batch_size is not None and (not isinstance(batch_size, (int, np.integer)) or batch_size < 1):
        raise TypeError(
            f"{caller}: batch_size must be a positive int (patches run at once), got {batch_size!r}."
        )
    site_axes = [_site_axes(t.one, axes, caller) for t in targets]
    cells = 1 if size is None else int(np.prod(size))  # patches per row
    firsts = np.cumsum([0] + [t.rows for t in targets])  # each target's first row
    total = int(firsts[-1]) * cells
    chunk = total if batch_size is None else min(int(batch_size), total)

    def program(f: Callable, operands: tuple[Any, list[Any], tuple]) -> tuple[jax.Array, jax.Array]:
        ks, cleans, args = operands
        planted = plant(f, tag=tag)

        def patched_metric(k: jax.Array) -> jax.Array:
            row, cell = k // cells, k % cells
            here = jnp.ones((), bool) if size is None else (jnp.arange(cells) == cell).reshape(size)
            plants: dict[Any, Callable[..., Any]] = {}
            for t, c, ax, first in zip(targets, cleans, site_axes, firsts):
                if t.count is None:
                    plants[t.site.path] = _PatchWhere(c, here & (row == first), ax)
                else:  # row `first + j` patches occurrence j
                    plants[t.site.path] = _PatchOccurrence(c, here, row - first, ax)
            return _scalar(metric(planted(nested_dict(plants), *args)))

        # Through the calling convention, as the patched runs: NNX modules are split and merged.
        baseline = _scalar(metric(planted({}, *args)))
        return jax.vmap(patched_metric)(ks) - baseline, baseline

    spec = (caller, metric, tag, tuple(t.site for t in targets), tuple(site_axes), size)
    steps = [(b, start) for b in range(len(batches)) for start in range(0, total, chunk)]
    effects: list[list[np.ndarray]] = [[] for _ in batches]  # each batch's chunks
    baselines: list[np.ndarray] = []
    cleans: list[Any] = []
    for b, start in _steps(steps, progress, caller):
        if start == 0:
            cleans = _batch_cleans(targets, batches[b][0], axes, size, caller)
        ks = np.minimum(
            np.arange(start, start + chunk), total - 1
        )  # the last chunk repeats the last patch
        values, baseline = _compile(program, f, (ks, cleans, batches[b][1]), spec)
        effects[b].append(np.asarray(values)[: total - start])
        baselines += [np.asarray(baseline)] if start == 0 else []
    names_, labels = _labels(targets, size, axis)
    shape = (len(names_),) + (() if size is None else size)
    mean = np.mean([np.concatenate(chunks) for chunks in effects], 0).astype(effects[0][0].dtype)
    return PatchingResult(
        mean.reshape(shape),
        names_,
        labels,
        axis,
        float(np.mean(baselines)),
        skipped=skipped,
        axis_labels=_attention.axis_labels(swept, axes),
    )


# ---------------------------------------------------------------------------
# Attribution patching.


def attribution_patching(
    f: Callable[..., Any],
    clean: Reaped | list[Reaped],
    corrupted_args: tuple[Any, ...] | list[tuple[Any, ...]],
    metric: Callable[[Any], ArrayLike],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    axis: int | tuple[int, ...] | None = None,
    progress: bool | None = None,
) -> PatchingResult:
    """The first-order estimate of every patch `patching_sweep` would make, from one backward pass.

    The effect of patching site `s` (at position `p`) is estimated as
    `sum((clean_s - corrupt_s) * d metric / d s)` over the patched entries,
    with the gradient taken on the corrupted run. It is exact when `metric ∘ f`
    is linear in the activation, and a first-order Taylor approximation
    otherwise. The corrupted activations and the gradients come from one
    compiled function; the gradient is taken with respect to zero offsets
    planted at every site (`old + delta`), which is exactly d metric / d
    activation including every downstream path. Arguments (a tuple `axis`,
    a dataset of batches, `progress` over batches) and the compile cache as in
    `patching_sweep`.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import attribution_patching, reap, sow
        >>> def f(x):
        ...     h = sow(2.0 * x, name="h", mode="strict")
        ...     return sow(h + 1.0, name="g", mode="strict")
        >>> clean = reap(f)(jnp.array([1.0, 2.0, 3.0]))
        >>> attribution_patching(f, clean, (jnp.zeros(3),), jnp.sum, axis=0).values
        array([[2., 4., 6.],
               [2., 4., 6.]], dtype=float32)
    """
    caller = "attribution_patching"
    axes = _swept_axes(axis, caller)
    batches = _dataset(clean, corrupted_args, caller)
    targets, size, skipped = _targets(f, batches[0][0], batches[0][1], tag, names, axes, caller)
    swept = [(path_str(t.site.path), t.one) for t in targets]  # for the head-axis check and labels
    _attention.check_swept_axes(swept, axes)
    site_axes = [_site_axes(t.one, axes, caller) for t in targets]
    patched = frozenset(path_str(t.site.path) for t in targets)

    def program(f: Callable, operands: tuple[list[Any], tuple]) -> tuple[jax.Array, jax.Array]:
        cleans, args = operands
        planted = plant(f, tag=tag)
        reaped = reap(f, tag=tag, allowlist=patched.__contains__)(*args)
        corrupts = [_site_value(reaped, t.site, "corrupted", t.count) for t in targets]

        def metric_of(offsets: list[Any]) -> jax.Array:
            plants = {
                t.site.path: _AddVector(d, jnp.ones(())) if t.count is None else _AddRow(d)
                for t, d in zip(targets, offsets)
            }
            return _scalar(metric(planted(nested_dict(plants), *args)))

        zeros = [jax.tree_util.tree_map(jnp.zeros_like, c) for c in corrupts]
        baseline, grads = jax.value_and_grad(metric_of)(zeros)
        effects = []
        for t, c, k, g, ax in zip(targets, cleans, corrupts, grads, site_axes):
            if t.count is None:
                effects.append(_contract(c, k, g, ax)[None])
            else:  # one row per occurrence
                effects.append(jax.vmap(functools.partial(_contract, axes=ax))(c, k, g))
        return jnp.concatenate(effects), baseline

    spec = (caller, metric, tag, tuple(t.site for t in targets), tuple(site_axes))
    results = [
        _compile(program, f, (_batch_cleans(targets, c, axes, size, caller), args), spec)
        for c, args in _steps(batches, progress, caller)
    ]
    names_, labels = _labels(targets, size, axis)
    values = np.mean([np.asarray(v) for v, _ in results], 0)
    return PatchingResult(
        values,
        names_,
        labels,
        axis,
        float(np.mean([b for _, b in results])),
        skipped=skipped,
        axis_labels=_attention.axis_labels(swept, axes),
    )


def _contract(clean: Any, corrupt: Any, grad: Any, axes: tuple[int, ...] | None) -> jax.Array:
    """sum((clean - corrupt) * grad) over every axis but `axes` (kept, in that order), and over leaves."""

    def leaf(c: jax.Array, k: jax.Array, g: jax.Array) -> jax.Array:
        product = (c - k) * g
        if axes is None:
            return jnp.sum(product)
        moved = jnp.moveaxis(product, axes, tuple(range(len(axes))))
        return jnp.sum(moved.reshape(moved.shape[: len(axes)] + (-1,)), -1)

    return jnp.asarray(
        sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(leaf, clean, corrupt, grad)))
    )
