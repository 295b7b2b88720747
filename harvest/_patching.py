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
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence, SupportsFloat

import jax
import jax.numpy as jnp
import numpy as np

from ._calling import is_array, make_jaxpr, split_nodes
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
def _pytree_dataclass(data: tuple[str, ...], meta: tuple[str, ...] = ()) -> Callable[[type[T]], type[T]]:
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


@_pytree_dataclass(data=("clean", "mask"), meta=("axis",))
class _PatchWhere:
    """`clean` where `mask` holds, `old` elsewhere; a 1-D `mask` runs along `axis`."""

    clean: Any
    mask: Any
    axis: int | None

    def __call__(self, old):
        def patch(c, o):
            return jnp.where(_along(self.mask, self.axis, jnp.ndim(o)), c, o)

        return jax.tree_util.tree_map(patch, self.clean, old)


@_pytree_dataclass(data=("clean", "mask", "which"), meta=("axis",))
class _PatchOccurrence:
    """`_PatchWhere` at occurrence `which` of a site that fires several times;
    `clean` stacks every occurrence's clean value."""

    clean: Any
    mask: Any
    which: Any
    axis: int | None

    def __call__(self, old, index):
        def patch(c, o):
            return jnp.where(_along(self.mask, self.axis, jnp.ndim(o)) & (index == self.which), c[index], o)

        return jax.tree_util.tree_map(patch, self.clean, old)


@_pytree_dataclass(data=("deltas",))
class _AddRow:
    """Adds row `index` of `deltas` to occurrence `index` of a site."""

    deltas: Any

    def __call__(self, old, index):
        return jax.tree_util.tree_map(lambda d, o: (o + d[index]).astype(o.dtype), self.deltas, old)


def _along(mask, axis, ndim):
    """Reshapes a 1-D mask to broadcast along `axis` of an `ndim`-array."""
    if axis is None:
        return mask
    shape = [1] * ndim
    shape[axis] = -1
    return jnp.reshape(mask, shape)


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


def patch_positions(clean: ArrayLike, positions: ArrayLike | Sequence[int], axis: int) -> Callable[[Any], Any]:
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
    return _PatchWhere(clean, mask, axis)


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


# ---------------------------------------------------------------------------
# Results.


@dataclasses.dataclass(frozen=True)
class PatchingResult:
    """The effect of each patch on a metric: `values[i, j]` for site `names[i]` at `positions[j]`.

    An effect is `metric(patched run) - baseline`, where `baseline` is the
    metric of the unpatched corrupted run (estimated, for attribution
    patching). Without a position axis, `values` has shape `[len(names)]` and
    `positions` is `None`. `skipped` lists the sites a sweep without `names=`
    left out (a different size along the swept axis), each with the reason.

    Example:
        >>> import numpy as np
        >>> from harvest import PatchingResult
        >>> r = PatchingResult(np.array([[0.0, 1.0]]), ("h",), np.arange(2), axis=1, baseline=0.5)
        >>> r.values.shape, r.names
        ((1, 2), ('h',))
    """

    values: np.ndarray
    names: tuple[str, ...]
    positions: np.ndarray | None
    axis: int | None
    baseline: float
    measure: str = "effect on metric"  # what `values` measure (a plot's colourbar label)
    skipped: tuple[str, ...] = ()  # sites left out of a sweep without names=, each with the reason

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
        return dataclasses.replace(self, values=self.values / gap, measure="fraction of clean-corrupt gap")

    def _grid(self):
        return self.values if self.positions is not None else self.values[:, None]

    def plot(
        self, ax: Axes | None = None, title: str | None = None, cmap: str = "RdBu_r", vmax: float | None = None, **imshow_kwargs: Any
    ) -> Axes:
        """Draws `values` as a heatmap (sites × positions), centred on zero; returns the axes.

        `vmax` fixes the colour scale (default: the largest magnitude); use
        `PatchingResult.plot_many` to put several results on one scale.

        Example:
            >>> import matplotlib; matplotlib.use("Agg")
            >>> import numpy as np
            >>> from harvest import PatchingResult
            >>> r = PatchingResult(np.eye(2), ("a", "b"), np.arange(2), axis=1, baseline=0.0)
            >>> r.plot(title="effect").get_title()
            'effect'
        """
        return PatchingResult.plot_many([self], ax=ax, titles=[title], cmap=cmap, vmax=vmax, **imshow_kwargs)[0]

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
        return self.clean if self.count is None else jax.tree_util.tree_map(lambda l: l[0], self.clean)

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


def _targets(f, clean, corrupted_args, tag, names, axis, caller):
    """The sites to patch, with their clean values, and the size along `axis`."""
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
    size, skipped = None, ()
    if axis is not None:
        sizes = {path_str(t.site.path): _size_along(t.one, axis) for t in targets}
        if chosen is None:
            # Sweep the sites of the most common size; say which were left out.
            counts = collections.Counter(n for n in sizes.values() if n is not None)
            if not counts:
                raise ValueError(f"{caller}: no site has an axis {axis}; sizes: {sizes}.")
            size = counts.most_common(1)[0][0]
            skipped = tuple(
                f"{name}: size {n} along axis {axis}, not {size}" if n is not None else f"{name}: no axis {axis}"
                for name, n in sizes.items()
                if n != size
            )
            targets = [t for t in targets if sizes[path_str(t.site.path)] == size]
        else:
            for t in targets:  # the full message for a bad axis or mismatched leaves
                _axis_size(t.one, axis, f"{caller} at {path_str(t.site.path)!r}")
            if len(set(sizes.values())) != 1:
                raise ValueError(
                    f"{caller}: the sites have different sizes along axis {axis}: {sizes}. "
                    "Sweep sites of one size together (pass names=...)."
                )
            size = next(iter(sizes.values()))
    return targets, size, skipped


def _size_along(value, axis):
    """The size of every leaf along `axis`, or None if they differ or lack that axis."""
    sizes = {jnp.shape(l)[axis] if -jnp.ndim(l) <= axis < jnp.ndim(l) else None for l in jax.tree_util.tree_leaves(value)}
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


def _jit_on_arrays(fn, tree, key):
    """`jax.jit(fn)(tree)`, with `tree`'s non-array leaves (modules' static parts) held static.

    Calls with equal `key` (which says everything `fn` closes over that shapes
    the program) and equal static leaves share one compiled program: only the
    first traces and compiles, later ones with the same shapes just run it.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    traced = [is_array(leaf) for leaf in leaves]
    static = _Compiled((key, treedef, tuple((i, type(l), l) for i, (l, a) in enumerate(zip(leaves, traced)) if not a)))
    arrays = [leaf for leaf, a in zip(leaves, traced) if a]
    try:
        hash(static)
        cached = key is not None and not split_nodes(tree)[2]
    except TypeError:  # an unhashable static leaf
        cached = False
    if not cached:  # compiled for this call only
        return jax.jit(functools.partial(_rebuilt, fn, treedef, leaves, traced))(arrays)
    static.trace = functools.partial(_rebuilt, fn, treedef, leaves, traced)
    try:
        return _run_compiled(static, arrays)
    finally:
        static.trace = None  # the cache keeps the key, not this call's function and arrays


def _rebuilt(fn, treedef, leaves, traced, arrays):
    it = iter(arrays)
    return fn(treedef.unflatten([next(it) if a else leaf for leaf, a in zip(leaves, traced)]))


class _Compiled:
    """`_run_compiled`'s static argument: compared by `key` alone; `trace` is the
    current call's function, read only when JAX traces (a new key or new shapes)."""

    def __init__(self, key):
        self.key = key
        self.trace = None

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Compiled) and self.key == other.key


@functools.partial(jax.jit, static_argnums=0)
def _run_compiled(static, arrays):
    # One jit for every sweep: its cache (bounded, cleared by jax.clear_caches)
    # holds one program per key and set of shapes.
    return static.trace(arrays)


def _key(f, *spec):
    """The cache key of a sweep of `f` (held weakly, so the cache does not keep
    it alive), or None (compile for this call only) unless `f` is a plain
    function: a module's or bound method's arrays are baked into the program,
    and they may have changed in place since the last call."""
    return (weakref.ref(f), *spec) if inspect.isfunction(f) else None


def _labels(targets: list[_Target], size: int | None) -> tuple[tuple[str, ...], np.ndarray | None]:
    """One name per row: a looped site's occurrences are `name[0]` ... `name[k-1]`."""
    positions = None if size is None else np.arange(size)
    names: list[str] = []
    for t in targets:
        name = path_str(t.site.path)
        names += [name] if t.count is None else [f"{name}[{j}]" for j in range(t.count)]
    return tuple(names), positions


# ---------------------------------------------------------------------------
# The sweep.


def patching_sweep(
    f: Callable[..., Any],
    clean: Reaped,
    corrupted_args: tuple[Any, ...],
    metric: Callable[[Any], ArrayLike],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    axis: int | None = None,
    batch_size: int | None = None,
) -> PatchingResult:
    """Patches each clean activation into the corrupted run, one at a time, and measures the effect.

    For every site in `names` (exact names, glob patterns such as
    `"blocks.*.attn"`, predicates on names, or a list of them; each string must
    match a site), or by default every site of `tag` with a value in `clean`,
    and, if `axis` is given, every index along that axis of the sown value
    (e.g. token position), the corrupted run `f(*corrupted_args)` gets the
    clean value there and keeps its own everywhere else. Without `names`, the
    sites whose size along `axis` differs from the most common one (attention
    patterns beside the residual stream, say) are left out and listed in the
    result's `skipped`. `clean` is
    `reap(f, tag=tag)(*clean_args)`. All patches run as one compiled, vmapped
    computation over a one-hot selection; `batch_size` bounds how many run at
    once (via `lax.map`) when memory is tight. A site that fires `k` times
    (mode `append` in a `scan`, e.g. scan-over-layers) gives `k` rows,
    `name[0]` ... `name[k-1]`, each patching that occurrence alone; `axis`
    counts the axes of one occurrence's value. `metric` maps `f`'s output to a scalar; each value of the result
    is `metric(patched out) - metric(corrupted out)` (see `PatchingResult`).

    When `f` is a plain function, the compiled program is kept and reused by
    later calls with the same `f`, `metric`, `tag`, swept sites, `axis`,
    `batch_size` and argument shapes (and equal non-array arguments), as
    `jax.jit` reuses its programs (and, as there, arrays `f` closes over are
    read when it first compiles): a repeated sweep on new data only runs. A new
    `metric` or `f` object (a fresh lambda) compiles again; the cache holds `f`
    weakly and is cleared by `jax.clear_caches()`. A module or bound method as
    `f`, or NNX modules among the arguments, compile at every call (their
    weights may change in place); wrap the call in a function taking the
    weights as an argument to reuse the program.

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
        >>> def layers(x):  # the same site in each of 2 scanned layers
        ...     step = lambda c, _: (sow(c * 2.0, name="h", mode="append"), None)
        ...     return jax.lax.scan(step, x, None, length=2)[0]
        >>> r = patching_sweep(layers, reap(layers)(jnp.ones(3)), (jnp.zeros(3),), jnp.sum, axis=0)
        >>> r.names, r.values.shape
        (('h[0]', 'h[1]'), (2, 3))
    """
    targets, size, skipped = _targets(f, clean, corrupted_args, tag, names, axis, "patching_sweep")
    positions = 1 if size is None else size
    axes = [None if axis is None else _normalize_axis(t.one, axis) for t in targets]
    firsts = np.cumsum([0] + [t.rows for t in targets])  # each target's first row
    planted = plant(f, tag=tag)

    def patched_metric(k, cleans, args):
        row, pos = k // positions, k % positions
        plants = {}
        for t, c, ax, first in zip(targets, cleans, axes, firsts):
            here = jnp.ones((), bool) if ax is None else jnp.arange(size) == pos
            if t.count is None:
                plants[t.site.path] = _PatchWhere(c, here & (row == first), ax)
            else:  # row `first + j` patches occurrence j
                plants[t.site.path] = _PatchOccurrence(c, here, row - first, ax)
        return _scalar(metric(planted(nested_dict(plants), *args)))

    def sweep(operands):
        cleans, args = operands
        one = functools.partial(patched_metric, cleans=cleans, args=args)
        ks = jnp.arange(int(firsts[-1]) * positions)
        if batch_size is None:
            patched = jax.vmap(one)(ks)
        else:
            patched = jax.lax.map(one, ks, batch_size=batch_size)
        # Through the calling convention, as the patched runs: NNX modules are split and merged.
        baseline = _scalar(metric(planted({}, *args)))
        return patched - baseline, baseline

    key = _key(f, "patching_sweep", metric, tag, tuple(t.site for t in targets), tuple(axes), size, batch_size)
    values, baseline = _jit_on_arrays(sweep, ([t.clean for t in targets], corrupted_args), key)
    names, labels = _labels(targets, size)
    shape = (len(names),) if size is None else (len(names), size)
    return PatchingResult(np.asarray(values).reshape(shape), names, labels, axis, float(baseline), skipped=skipped)


# ---------------------------------------------------------------------------
# Attribution patching.


def attribution_patching(
    f: Callable[..., Any],
    clean: Reaped,
    corrupted_args: tuple[Any, ...],
    metric: Callable[[Any], ArrayLike],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    axis: int | None = None,
) -> PatchingResult:
    """The first-order estimate of every patch `patching_sweep` would make, from one backward pass.

    The effect of patching site `s` (at position `p`) is estimated as
    `sum((clean_s - corrupt_s) * d metric / d s)` over the patched entries,
    with the gradient taken on the corrupted run. It is exact when `metric ∘ f`
    is linear in the activation, and a first-order Taylor approximation
    otherwise. The corrupted activations and the gradients come from one
    compiled function; the gradient is taken with respect to zero offsets
    planted at every site (`old + delta`), which is exactly d metric / d
    activation including every downstream path. Arguments as in
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
    targets, size, skipped = _targets(f, clean, corrupted_args, tag, names, axis, "attribution_patching")
    axes = [None if axis is None else _normalize_axis(t.one, axis) for t in targets]
    patched = frozenset(path_str(t.site.path) for t in targets)
    planted = plant(f, tag=tag)

    def estimate(operands):
        cleans, args = operands
        reaped = reap(f, tag=tag, allowlist=patched.__contains__)(*args)
        corrupts = [_site_value(reaped, t.site, "corrupted", t.count) for t in targets]

        def metric_of(offsets):
            plants = {
                t.site.path: _AddVector(d, jnp.ones(())) if t.count is None else _AddRow(d)
                for t, d in zip(targets, offsets)
            }
            return _scalar(metric(planted(nested_dict(plants), *args)))

        zeros = [jax.tree_util.tree_map(jnp.zeros_like, c) for c in corrupts]
        baseline, grads = jax.value_and_grad(metric_of)(zeros)
        effects = []
        for t, c, k, g, ax in zip(targets, cleans, corrupts, grads, axes):
            if t.count is None:
                effects.append(_contract(c, k, g, ax)[None])
            else:  # one row per occurrence
                effects.append(jax.vmap(functools.partial(_contract, axis=ax))(c, k, g))
        return jnp.concatenate(effects), baseline

    key = _key(f, "attribution_patching", metric, tag, tuple(t.site for t in targets), tuple(axes))
    values, baseline = _jit_on_arrays(estimate, ([t.clean for t in targets], corrupted_args), key)
    names, labels = _labels(targets, size)
    return PatchingResult(np.asarray(values), names, labels, axis, float(baseline), skipped=skipped)


def _contract(clean, corrupt, grad, axis):
    """sum((clean - corrupt) * grad) over every axis but `axis`, and over leaves."""

    def leaf(c, k, g):
        product = (c - k) * g
        if axis is None:
            return jnp.sum(product)
        return jnp.sum(jnp.moveaxis(product, axis, 0).reshape(product.shape[axis], -1), 1)

    return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(leaf, clean, corrupt, grad)))
