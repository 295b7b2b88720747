"""The sweeps: `patching_sweep` (every patch, compiled and vmapped) and `attribution_patching`.

Both find the sites to patch from one trace of the corrupted run (`sites`'
view of the program, so a site in a loop or inside a shard_map is swept once
per occurrence as reap stacks it), patch through `plant`, and run as one
compiled program per configuration (`_compile_cache`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _attention, _errors
from ._compile_cache import compile_program
from ._interpreter import NameFilter
from ._interventions import (
    AddRow,
    AddVector,
    PatchOccurrence,
    PatchWhere,
    axis_size,
)
from ._leaves import ARRAY_TYPES
from ._nnx_state import splits_verified_once
from ._patching_result import PatchingResult
from ._paths import nested_dict, path_str
from ._site import Site
from ._site_discovery import _abstract, sow_sites
from ._sow import DEFAULT_TAG
from ._transforms import plant, reap
from ._typing import NameSelect, Reaped

if TYPE_CHECKING:
    from jax.typing import ArrayLike

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


def _site_value(reaps, site, what, count=None, checked=False):
    """One occurrence's value of `site` from a dict shaped as `reap` returns it
    (all `count` of them, stacked, for a looped site); `checked`: known to fit."""
    node = _lookup(reaps, site, what)
    if count is not None:
        if not checked:
            site.check(node, f"the {what} value", leading=(count,))
        return node
    if site.mode.entries:
        node = node[0] if isinstance(node, tuple) and len(node) == 1 else node
    elif site.mode.rows and not site.mode.unstacked_once:
        node = jax.tree_util.tree_map(lambda l: l[0], node)
    if not checked:
        site.check(node, f"the {what} value")
    return node


def _lookup(reaps, site, what):
    """What `reap` returned for `site`'s name; dotted keys and nested dicts alike."""
    node = _lookup_dotted(reaps, path_str(site.path))
    if node is _MISSING:
        raise _errors.no_value_for_site(what, path_str(site.path), site.tag)
    return node


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a sweep patches, decided by the sites found and the clean values' shapes alone."""

    found: tuple[Any, ...]  # the sites found (`sow_sites`), held: the key holds its identity
    sites: tuple[tuple[Site, int | None], ...]  # each target's site and occurrences (`_Target`)
    size: tuple[int, ...] | None  # the sizes along the swept axes
    skipped: tuple[str, ...]  # the sites left out, each with the reason
    axis_labels: tuple[str, ...] | None  # what each swept axis is
    site_axes: tuple[tuple[int, ...] | None, ...]  # each target's axes, counted from the front
    rows: tuple[str, ...]  # one name per row of the result
    firsts: np.ndarray  # each target's first row, and the number of rows last


def _planned(f, clean, corrupted_args, tag, names, axis, caller):
    """A sweep's swept axes, its batches of (clean, corrupted arguments), and the
    targets and `_Plan` of its first batch."""
    axes = _swept_axes(axis, caller)
    batches = _dataset(clean, corrupted_args, caller)
    targets, plan = _targets(f, batches[0][0], batches[0][1], tag, names, axes, caller)
    return axes, batches, targets, plan


def _targets(f, clean, corrupted_args, tag, names, axes, caller):
    """The sites to patch with their clean values, and the `_Plan` they follow.

    The plan is kept, keyed by everything it is decided from: the sites found
    (the very tuple `sow_sites` keeps for the model's signature), the tag, the
    names chosen and whether they were chosen by the sweep, the axes, and the
    structure, types, shapes and dtypes of the chosen clean values (a number's
    value too). So a repeated sweep does not check the clean values again."""
    if not callable(f):
        raise _errors.needs_callable(caller, f)
    if not isinstance(corrupted_args, tuple):
        raise _errors.corrupted_args_not_a_tuple(caller, corrupted_args)
    if not isinstance(clean, dict):
        raise _errors.clean_not_a_dict(caller, clean)
    found = sow_sites(f, corrupted_args)
    by_name = _by_name(found, tag)
    if not by_name:  # most often instrument's sites swept without tag="modules"
        tags = {site.tag for site, *_ in found}
        if tags:
            raise _errors.sweep_tag_absent(caller, tag, sorted(tags, key=str))
    chosen = names
    if names is None:
        names = [n for n in by_name if _lookup_dotted(clean, n) is not _MISSING]
    else:
        names = _select_names(names, list(by_name), tag, caller)
    if not names:
        raise _errors.nothing_to_patch(caller, tag, list(by_name))
    key = _plan_key(found, tag, chosen is None, names, axes, caller, clean)
    plan = None if key is None else _plans.get(key)
    if plan is not None and plan.found is found:
        values = [_site_value(clean, s, "clean", count, checked=True) for s, count in plan.sites]
        return [_Target(s, v, count) for (s, count), v in zip(plan.sites, values)], plan
    targets, size, skipped = _chosen(by_name, names, chosen, clean, tag, axes, caller)
    axis_labels, site_axes = _swept(targets, axes, caller)
    sites = tuple((t.site, t.count) for t in targets)
    firsts = np.cumsum([0] + [t.rows for t in targets])
    plan = _Plan(
        found, sites, size, skipped, axis_labels, tuple(site_axes), _row_names(targets), firsts
    )
    if key is not None:
        _plans[key] = plan
        while len(_plans) > 64:
            _plans.pop(next(iter(_plans)))
    return targets, plan


_plans: dict[Any, _Plan] = {}  # the plans of the last sweeps, oldest first


def _plan_key(found, tag, auto, names, axes, caller, clean):
    """What decides a sweep's `_Plan` (see `_targets`), hashable; None if it cannot be."""
    shapes = tuple(_value_shape(_lookup_dotted(clean, name)) for name in names)
    key = (id(found), tag, auto, tuple(names), axes, caller, shapes)
    try:
        hash(key)
    except TypeError:  # an unhashable tag (harvest.compat.oryx allows any) or static leaf
        return None
    return key


def _value_shape(value: Any) -> Any:
    """What the checks of a clean value look at: its structure and each leaf's
    type and, for an array, shape and dtype (else the leaf's value)."""
    if type(value) in ARRAY_TYPES:  # the common case, one array: no flatten
        return type(value), _abstract(value)
    leaves, tree = jax.tree_util.tree_flatten(value)
    return tree, tuple((type(leaf), _abstract(leaf)) for leaf in leaves)


def _chosen(by_name, names, chosen, clean, tag, axes, caller):
    """The targets of `names` with their clean values, checked, their sizes along
    `axes`, and the sites skipped (only when the sweep chose the names)."""
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
            raise _errors.no_site_has_axes(caller, where, len(axes), sizes)
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
        for t in targets if None in sizes.values() else ():
            # The full message for a bad axis, mismatched leaves or an axis given twice.
            for a in axes:
                axis_size(t.one, a, f"{caller} at {path_str(t.site.path)!r}")
            _site_axes(t.one, axes, f"{caller} at {path_str(t.site.path)!r}")
        if len(set(sizes.values())) != 1:
            raise _errors.sizes_differ_along_axes(
                caller, where, {n: _size_str(z) for n, z in sizes.items()}
            )
        size = next(iter(sizes.values()))
    return targets, size, skipped


def _by_name(found: tuple[Any, ...], tag: Any) -> dict[str, list[Any]]:
    """The firings of ``tag``'s sites among ``found`` (as `sow_sites` gives them), by dotted name.

    A repeated sweep is handed the very tuple `sow_sites` kept, so this is
    remembered for it (held, so that its identity is not reused)."""
    kept = _by_name_kept.get((id(found), tag))
    if kept is not None and kept[0] is found:
        return kept[1]
    by_name: dict[str, list[Any]] = {}
    for site, where, fires, stacked in found:
        if site.tag == tag:
            by_name.setdefault(path_str(site.path), []).append((site, where, fires, stacked))
    try:
        _by_name_kept[(id(found), tag)] = (found, by_name)
    except TypeError:  # an unhashable tag (harvest.compat.oryx allows any): not kept
        return by_name
    while len(_by_name_kept) > 16:
        _by_name_kept.pop(next(iter(_by_name_kept)))
    return by_name


_by_name_kept: dict[Any, tuple[tuple[Any, ...], dict[str, list[Any]]]] = {}


def _swept(
    targets: list[_Target], axes: tuple[int, ...] | None, caller: str
) -> tuple[tuple[str, ...] | None, list[tuple[int, ...] | None]]:
    """(what each swept axis is, each target's `axes` counted from the front), after
    the head-axis check: both come from the sites' names and ranks alone."""
    if axes is None:
        return _checked_axes((), None), [None] * len(targets)
    # A looped site's clean value stacks its occurrences: one axis more than one of them.
    ndims = tuple(
        (
            path_str(t.site.path),
            np.ndim(jax.tree_util.tree_leaves(t.clean)[0]) - (t.count is not None),
        )
        for t in targets
    )
    return _checked_axes(ndims, axes), [_axes_counted(n, axes, caller) for _, n in ndims]


@functools.lru_cache(maxsize=64)
def _checked_axes(
    ndims: tuple[tuple[str, int], ...], axes: tuple[int, ...] | None
) -> tuple[str, ...] | None:
    """Raises if ``axes`` would index merged head features (see `_attention`); else what each
    swept axis is. Both depend on the names and ranks alone: a repeated sweep asks once."""
    swept = [(name, np.empty((0,) * ndim)) for name, ndim in ndims]
    _attention.check_swept_axes(swept, axes)
    return _attention.axis_labels(swept, axes)


def _size_str(sizes: tuple[int, ...]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else str(sizes)


def _sizes_along(value: Any, axes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The size of every leaf along each of `axes`, or None if the leaves differ,
    lack one of the axes, or two of `axes` are the same axis."""
    sizes = set()
    for leaf in jax.tree_util.tree_leaves(value):
        shape = np.shape(leaf)  # numpy's reads the attribute; jnp's goes through its dtype rules
        ndim = len(shape)
        if not all(-ndim <= a < ndim for a in axes) or len({a % ndim for a in axes}) != len(axes):
            return None
        sizes.add(tuple(shape[a] for a in axes))
    return sizes.pop() if len(sizes) == 1 else None


def _select_names(names, sown, tag, caller):
    """The names `names=` selects (exact names, globs, predicates, or a list of
    them), in the order of its entries, each entry's matches in program order."""
    entries = tuple(names) if isinstance(names, (list, tuple)) else (names,)
    try:
        return list(_selected(entries, tuple(sown), tag, caller))
    except TypeError:  # an unhashable entry: matched afresh
        return _matched(entries, sown, tag, caller)


@functools.lru_cache(maxsize=64)
def _selected(entries, sown, tag, caller):
    # A repeated sweep selects the same names among the same sites: matched once.
    return tuple(_matched(entries, sown, tag, caller))


def _matched(entries, sown, tag, caller):
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
    (site, where, fires, stacked), *others = occurrences
    if not others and fires == 1:
        return _Target(site, _site_value(clean, site, "clean"))
    if not others and fires == stacked and not site.mode.entries:
        # Once per shard of a shard_map: reap stacks one row per shard whatever the mode.
        return _Target(site, _site_value(clean, site, "clean", stacked), stacked)
    if site.mode.rows and all(o[2] is not None for o in occurrences):
        # Fires several times (in a scan, say): one row per occurrence, as reap stacks them.
        count = int(np.shape(jax.tree_util.tree_leaves(_lookup(clean, site, "clean"))[0])[0])
        return _Target(site, _site_value(clean, site, "clean", count), count)
    total = sum(o[2] or 0 for o in occurrences)
    count = "an unbounded number of" if fires is None else str(total)
    raise _errors.sweep_site_fires_often(
        caller, name, site.mode.label, count, _where_str(occurrences)
    )


def _where_str(occurrences):
    return ", ".join(" › ".join(w) or "top level" for _, w, _, _ in occurrences)


def _scalar(m):
    if jnp.shape(m) != ():
        raise _errors.metric_not_scalar(jnp.shape(m))
    return m


def _swept_axes(axis: Any, caller: str) -> tuple[int, ...] | None:
    """A sweep's `axis` argument as a tuple of axes (None: whole sites)."""
    if axis is None:
        return None
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    if not axes or any(not isinstance(a, (int, np.integer)) or isinstance(a, bool) for a in axes):
        raise _errors.bad_sweep_axis(caller, axis)
    return tuple(int(a) for a in axes)


def _site_axes(value: Any, axes: tuple[int, ...] | None, what: str) -> tuple[int, ...] | None:
    """`axes`, each counted from the front of `value`'s leaves; no axis twice."""
    if axes is None:
        return None
    return _axes_counted(np.ndim(jax.tree_util.tree_leaves(value)[0]), axes, what)


def _axes_counted(ndim: int, axes: tuple[int, ...] | None, what: str) -> tuple[int, ...] | None:
    """`axes`, each counted from the front of a value with ``ndim`` axes; no axis twice."""
    if axes is None:
        return None
    normal = tuple(a % ndim for a in axes)
    if len(set(normal)) != len(normal):
        raise _errors.same_axis_twice(what, axes)
    return normal


def _row_names(targets: list[_Target]) -> tuple[str, ...]:
    """One name per row (a looped site's occurrences are `name[0]` ... `name[k-1]`)."""
    names: list[str] = []
    for t in targets:
        name = path_str(t.site.path)
        names += [name] if t.count is None else [f"{name}[{j}]" for j in range(t.count)]
    return tuple(names)


def _positions(size: tuple[int, ...] | None, axis: Any) -> Any:
    """The indices along the swept axis (a tuple of them, one per axis, for several
    axes): fresh arrays each call, as the result's own."""
    if size is None:
        return None
    labels = tuple(np.arange(n) for n in size)
    return labels if isinstance(axis, (tuple, list)) else labels[0]


def _dataset(clean: Any, corrupted_args: Any, caller: str) -> list[tuple[Any, Any]]:
    """The (clean, corrupted args) pairs a sweep averages over: one, or one per batch of a dataset."""
    if not isinstance(corrupted_args, list):
        return [(clean, corrupted_args)]
    if not isinstance(clean, list) or len(clean) != len(corrupted_args) or not clean:
        raise _errors.bad_dataset(caller, clean, corrupted_args)
    return list(zip(clean, corrupted_args))


def _batch_cleans(
    targets: list[_Target],
    batch_clean: Any,
    axes: tuple[int, ...] | None,
    size: Any,
    caller: str,
    checked: Any = None,
) -> list[Any]:
    """Each target's clean value in one batch of a dataset, checked against the first batch's
    sizes (the first batch's own, `_targets` took and checked already)."""
    if batch_clean is checked:
        return [t.clean for t in targets]
    cleans = []
    for t in targets:
        value = _site_value(batch_clean, t.site, "clean", t.count)
        one = value if t.count is None else jax.tree_util.tree_map(lambda l: l[0], value)
        if axes is not None and _sizes_along(one, axes) != size:
            raise _errors.batch_sizes_differ(
                caller, path_str(t.site.path), _sizes_along(one, axes), axes, size
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
        raise _errors.needs_extra(f"{caller}(progress=True)", "tqdm", "patching") from None
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


def _splits_checked_once(sweep: Callable[..., PatchingResult]) -> Callable[..., PatchingResult]:
    """``sweep`` checking each NNX split once per call: finding the sites and
    running the program both split the model, with no user code between."""

    @functools.wraps(sweep)
    def checked_once(*args: Any, **kwargs: Any) -> PatchingResult:
        with splits_verified_once():
            return sweep(*args, **kwargs)

    return checked_once


@_splits_checked_once
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

    For every chosen site, and every index along ``axis`` of its sown value if
    ``axis`` is given (e.g. token position), the corrupted run
    ``f(*corrupted_args)`` gets the clean value there and keeps its own
    everywhere else. A site that fires ``k`` times per call (mode ``append`` in
    a ``scan``, e.g. scan-over-layers; any mode once per shard of a
    ``shard_map``, as ``sites`` counts it) gives ``k`` rows, ``name[0]`` ...
    ``name[k-1]``, each patching that occurrence alone; ``axis`` counts the
    axes of one occurrence's value. All patches run as one compiled, vmapped
    computation over one-hot selections.

    The compiled program is kept and reused by later calls with the same
    ``f``, ``metric``, ``tag``, swept sites, ``axis``, ``batch_size`` and
    argument shapes (and equal non-array arguments): a repeated sweep on new
    data only runs. A plain function ``f`` is keyed by its code and the values
    it reads, the arrays it closes over (or reads from its module) traced, so a
    sweep after such an array changes reads the new one, and a fresh closure of
    the same code does not compile again; a module (NNX or Equinox) or a bound
    method of one is data: weights changed in place are read at every call,
    without compiling again. The cache holds ``f`` weakly, keeps at most
    ``set_compile_cache``'s ``max_programs`` programs, and is cleared by
    ``jax.clear_caches()``. The sites to patch are found once per key as well
    (``f``, argument shapes and dtypes, an NNX module's graph definition,
    non-array values, what ``f`` closes over), so a repeated sweep does not
    trace ``f`` again.

    A sweep is a measurement: an NNX module that changes its own state when
    called (a counter, a ``BatchNorm`` in training mode, an RNG stream) has
    the baseline and every patched run start from the state it has, and
    nothing they change is written back to it.

    Args:
        f: The model: a function, an NNX or Equinox module, or a bound method
            of one, whose sows of ``tag`` are the sites.
        clean: ``reap(f, tag=tag)(*clean_args)``, the clean run's values. For a
            dataset, the list of one such dict per batch.
        corrupted_args: The tuple of ``f``'s positional arguments for the
            corrupted run, e.g. ``(tokens,)``. For a dataset, a list of such
            tuples, one per batch: the result is the mean over batches.
        metric: Maps ``f``'s output to a scalar (reduce a batch, e.g. with
            ``jnp.mean``).
        tag: The tag whose sows are the sites.
        names: Which sites to sweep: exact names, glob patterns such as
            ``"blocks.*.attn"``, predicates on names, or a list of them (each
            string must match a site). ``None``: every site of ``tag`` with a
            value in ``clean``; then sites whose sizes along ``axis`` differ
            from the most common ones (attention patterns beside the residual
            stream, say) are left out and listed in the result's ``skipped``.
        axis: The axis of each site's value to sweep index by index, a tuple
            of axes (``axis=(2, 1)`` on a per-head output ``[batch, positions,
            heads, d_head]`` patches every (head, position) pair, giving values
            of shape ``(sites, heads, positions)``), or ``None`` to patch whole
            sites.
        batch_size: How many patches run at once (the rest follow in chunks
            through the same compiled program); ``None``: all at once.
        progress: ``True`` shows a tqdm bar over chunks and batches; ``None``
            (the default) shows one for a run of several chunks in a terminal
            or notebook that is still going after a second; ``False`` never.

    Returns:
        A ``PatchingResult`` whose ``values[i, j]`` is ``metric(patched out) -
        metric(corrupted out)`` for row ``names[i]`` at index ``j`` along
        ``axis``, and whose ``baseline`` is the corrupted run's metric. It is
        returned while the program runs (in one step; several steps wait for
        each): ``values`` and ``baseline`` are converted to NumPy when first read.

    Raises:
        TypeError: ``f`` is not callable, ``corrupted_args`` is not a tuple (or
            a list of them), ``clean`` is not a dict (or a matching list),
            ``axis`` or ``batch_size`` is malformed, or ``metric`` does not
            return a scalar.
        ValueError: nothing to patch, a string in ``names`` matches no site,
            the chosen sites differ in size along ``axis``, or a site fires
            several times in a way a sweep cannot patch one by one (mode
            ``collect`` in a loop, or any site in a ``while_loop``).
        KeyError: ``clean`` lacks a value for a chosen site.
        ImportError: ``progress=True`` without tqdm installed.

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
    axes, batches, targets, plan = _planned(f, clean, corrupted_args, tag, names, axis, caller)
    size, site_axes = plan.size, plan.site_axes
    if batch_size is not None and (not isinstance(batch_size, (int, np.integer)) or batch_size < 1):
        raise _errors.bad_batch_size(caller, batch_size)
    cells = 1 if size is None else int(np.prod(size))  # patches per row
    firsts = plan.firsts  # each target's first row
    total = int(firsts[-1]) * cells
    chunk = total if batch_size is None else min(int(batch_size), total)

    def program(
        f: Callable, metric: Callable, operands: tuple[Any, list[Any], tuple]
    ) -> tuple[jax.Array, jax.Array]:
        ks, cleans, args = operands
        planted = plant(f, tag=tag)

        def patched_metric(k: jax.Array) -> jax.Array:
            row, cell = k // cells, k % cells
            here = jnp.ones((), bool) if size is None else (jnp.arange(cells) == cell).reshape(size)
            plants: dict[Any, Callable[..., Any]] = {}
            for t, c, ax, first in zip(targets, cleans, site_axes, firsts):
                if t.count is None:
                    plants[t.site.path] = PatchWhere(c, here & (row == first), ax)
                else:  # row `first + j` patches occurrence j
                    plants[t.site.path] = PatchOccurrence(c, here, row - first, ax)
            return _scalar(metric(planted(nested_dict(plants), *args)))

        # Through the calling convention, as the patched runs: NNX modules are split and merged.
        baseline = _scalar(metric(planted({}, *args)))
        return jax.vmap(patched_metric)(ks) - baseline, baseline

    spec = (caller, tag, tuple(t.site for t in targets), tuple(site_axes), size)
    steps = [(b, start) for b in range(len(batches)) for start in range(0, total, chunk)]
    effects: list[list[tuple[Any, int]]] = [[] for _ in batches]  # each batch's chunks and sizes
    baselines: list[Any] = []
    cleans: list[Any] = []
    for b, start in _steps(steps, progress, caller):
        if start == 0:
            cleans = _batch_cleans(targets, batches[b][0], axes, size, caller, batches[0][0])
        ks = np.minimum(
            np.arange(start, start + chunk), total - 1
        )  # the last chunk repeats the last patch
        values, baseline = compile_program(program, f, metric, (ks, cleans, batches[b][1]), spec)
        if _waits(len(steps), baseline):
            values, baseline = np.asarray(values), np.asarray(baseline)
        effects[b].append((values, total - start))
        baselines += [baseline] if start == 0 else []
    return _result(plan, axis, effects, baselines, wait=_waits(len(steps), baselines[0]))


def _waits(steps: int, baseline: Any) -> bool:
    """Whether a sweep converts each step's output at once: for several steps (so a
    progress bar shows the work done), or inside a trace (refused there, as before)."""
    return steps > 1 or isinstance(baseline, jax.core.Tracer)


def _on_host(
    effects: list[list[tuple[Any, int]]], baselines: list[Any], shape: tuple[int, ...]
) -> tuple[np.ndarray, float]:
    """The values (each batch's chunks joined, each cut to its patches; the mean over
    batches) shaped ``shape``, and the mean baseline, as NumPy: the caller owns them."""
    joined = [np.concatenate([np.asarray(v)[:n] for v, n in chunks]) for chunks in effects]
    mean = joined[0] if len(joined) == 1 else np.mean(joined, 0).astype(joined[0].dtype)
    baseline = np.asarray(baselines[0]) if len(baselines) == 1 else np.mean(baselines)
    return mean.reshape(shape), float(baseline)


def _result(
    plan: _Plan, axis: Any, effects: list[list[tuple[Any, int]]], baselines: list[Any], wait: bool
) -> PatchingResult:
    """A sweep's result, its values those of ``effects`` and ``baselines`` (see
    `_on_host`): read when first needed (the program still running), or now if ``wait``."""
    size = plan.size
    shape = (len(plan.rows),) + (() if size is None else size)
    finish = functools.partial(_on_host, effects, baselines, shape)
    result = PatchingResult._computing(
        finish,
        plan.rows,
        _positions(size, axis),
        axis,
        skipped=plan.skipped,
        axis_labels=plan.axis_labels,
    )
    return result.block_until_ready() if wait else result


# ---------------------------------------------------------------------------
# Attribution patching.


@_splits_checked_once
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
    """The first-order estimate of every patch ``patching_sweep`` would make, from one backward pass.

    The effect of patching site ``s`` (at position ``p``) is estimated as
    ``sum((clean_s - corrupt_s) * d metric / d s)`` over the patched entries,
    with the gradient taken on the corrupted run. It is exact when ``metric ∘
    f`` is linear in the activation, and a first-order Taylor approximation
    otherwise. The corrupted activations and the gradients come from one
    compiled function; the gradient is taken with respect to zero offsets
    planted at every site (``old + delta``), which is exactly ``d metric / d
    activation`` including every downstream path. The compile cache is
    ``patching_sweep``'s, and so is the handling of NNX state: the run starts
    from the module's state, and what it changes is not written back.

    Args:
        f: The model, as for ``patching_sweep``.
        clean: ``reap(f, tag=tag)(*clean_args)``, or a list of them (one per batch).
        corrupted_args: The corrupted run's positional arguments, or a list of
            such tuples (one per batch: the result is the mean over batches).
        metric: Maps ``f``'s output to a scalar.
        tag: The tag whose sows are the sites.
        names: Which sites, as for ``patching_sweep``.
        axis: The axis (or tuple of axes) of each site's value to estimate
            index by index, or ``None`` for whole sites.
        progress: A tqdm bar over batches, as for ``patching_sweep``.

    Returns:
        A ``PatchingResult`` of the estimated effects, shaped as
        ``patching_sweep``'s, with ``baseline`` the corrupted run's metric
        (returned while the program runs, as ``patching_sweep``'s).

    Raises:
        TypeError: malformed ``f``, ``clean``, ``corrupted_args`` or ``axis``,
            or a ``metric`` that does not return a scalar.
        ValueError: nothing to patch, or sites a sweep cannot patch one by one
            (as for ``patching_sweep``).
        KeyError: ``clean`` lacks a value for a chosen site.

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
    axes, batches, targets, plan = _planned(f, clean, corrupted_args, tag, names, axis, caller)
    size, site_axes = plan.size, plan.site_axes
    patched = frozenset(path_str(t.site.path) for t in targets)

    def program(
        f: Callable, metric: Callable, operands: tuple[list[Any], tuple]
    ) -> tuple[jax.Array, jax.Array]:
        cleans, args = operands
        planted = plant(f, tag=tag)
        reaped = reap(f, tag=tag, allowlist=patched.__contains__)(*args)
        corrupts = [_site_value(reaped, t.site, "corrupted", t.count) for t in targets]

        def metric_of(offsets: list[Any]) -> jax.Array:
            plants = {
                t.site.path: AddVector(d, jnp.ones(())) if t.count is None else AddRow(d)
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

    spec = (caller, tag, tuple(t.site for t in targets), tuple(site_axes))
    effects: list[list[tuple[Any, int]]] = []
    baselines: list[Any] = []
    for c, args in _steps(batches, progress, caller):
        cleans = _batch_cleans(targets, c, axes, size, caller, batches[0][0])
        values, baseline = compile_program(program, f, metric, (cleans, args), spec)
        if _waits(len(batches), baseline):
            values, baseline = np.asarray(values), np.asarray(baseline)
        effects.append([(values, len(values))])
        baselines.append(baseline)
    return _result(plan, axis, effects, baselines, wait=_waits(len(batches), baselines[0]))


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
