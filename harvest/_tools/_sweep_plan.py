"""Which sites a sweep patches, and the clean value at each: a sweep's plan.

The sweeps (`_patching`) choose among the sites of the corrupted run
(`_site_discovery.sow_sites`) the names, the occurrences of a looped site and
the indices along ``axis`` to patch, and check each clean value against them.
The plan depends on those alone, so a repeated sweep keeps it (`_plans`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from .. import _errors
from .._models import _attention
from .._walk._interpreter import NameFilter
from .._walk._leaves import ARRAY_TYPES
from .._walk._paths import path_str
from .._walk._site import Site
from ._interventions import axis_size
from ._site_discovery import Hashed, _abstract, sow_sites


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


def site_value(reaps, site, what, count=None, checked=False):
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
        raise KeyError(
            f"{what} has no value for {path_str(site.path)!r}. Pass the dict "
            f"`reap(f, tag={site.tag!r})(*clean_args)` returns."
        )
    return node


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a sweep patches, decided by the sites found and the clean values' shapes alone."""

    found: tuple[Any, ...]  # the sites found (`sow_sites`), held: the key holds its identity
    sites: tuple[tuple[Site, int | None], ...]  # each target's site and occurrences (`_Target`)
    size: tuple[int, ...] | None  # the sizes along the swept axes
    skipped: tuple[str, ...]  # the sites left out, each with the reason
    axis_labels: tuple[str, ...] | None  # what each swept axis is
    site_axes: tuple[tuple[int, ...] | None, ...]  # each target's axes, counted from the front
    rows: tuple[str, ...]  # one name per row of the result
    firsts: np.ndarray  # each target's first row, and the number of rows last
    program: Hashed  # what of it shapes a sweep's program, hashed once


def planned(f, clean, corrupted_args, tag, names, axis, caller, exclude):
    """A sweep's swept axes, its batches of (clean, corrupted arguments), and the sites to
    patch in its first batch with their clean values, and the `Plan` they follow, kept
    (`_plan_key`) so that a repeated sweep does not check the clean values again."""
    axes = _swept_axes(axis, caller)
    batches = _dataset(clean, corrupted_args, caller)
    clean, corrupted_args = batches[0]
    if not callable(f):
        raise _errors.needs_callable(caller, f)
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
    found = sow_sites(f, corrupted_args)
    by_name = _by_name(found, tag)
    if not by_name:  # most often instrument's sites swept without tag="modules"
        tags = {site.tag for site, *_ in found}
        if tags:
            tags = sorted(tags, key=str)
            shown = ", ".join(repr(t) for t in tags[:8]) + (", ..." if len(tags) > 8 else "")
            raise ValueError(
                f"{caller}(tag={tag!r}): the function has no sow of tag {tag!r}, but it has sows "
                f"of the tags {shown}. Pass one of those as tag= (instrument's sites are "
                "tag='modules'), the tag clean was reaped with."
            )
    chosen = names
    if names is None:
        names = [n for n in by_name if _lookup_dotted(clean, n) is not _MISSING]
    else:
        names = _select_names(names, list(by_name), tag, caller)
    if exclude is not None:  # as for reap: a name to leave out may be absent
        kept = NameFilter.make(None, exclude)
        names = [n for n in names if kept((n,))]
    if not names:
        raise ValueError(
            f"{caller}: nothing to patch. No name sown with tag {tag!r} has a value in clean; "
            f"names sown with that tag: {list(by_name) or 'none'}."
        )
    given = {name: _lookup_dotted(clean, name) for name in names}  # looked up once
    key = _plan_key(found, tag, chosen is None, axes, caller, given)
    plan = None if key is None else _plans.get(key)
    if plan is not None and plan.found is found:
        values = [site_value(given, s, "clean", count, checked=True) for s, count in plan.sites]
        targets = [_Target(s, v, count) for (s, count), v in zip(plan.sites, values)]
        return axes, batches, targets, plan
    targets, size, skipped = _chosen(by_name, names, chosen, clean, tag, axes, caller)
    axis_labels, site_axes = None, (None,) * len(targets)
    if axes is not None:
        # A looped site's clean value stacks its occurrences: one axis more than one of them.
        ndims = tuple(
            (
                path_str(t.site.path),
                np.ndim(jax.tree_util.tree_leaves(t.clean)[0]) - (t.count is not None),
            )
            for t in targets
        )
        axis_labels = _checked_axes(ndims, axes)
        site_axes = tuple(_axes_counted(n, axes, caller) for _, n in ndims)
    sites = tuple((t.site, t.count) for t in targets)
    firsts = np.cumsum([0] + [1 if t.count is None else t.count for t in targets])
    rows: list[str] = []  # a looped site's occurrences are `name[0]` ... `name[k-1]`
    for t in targets:
        name = path_str(t.site.path)
        rows += [name] if t.count is None else [f"{name}[{j}]" for j in range(t.count)]
    program = Hashed((sites, site_axes, size))
    plan = Plan(found, sites, size, skipped, axis_labels, site_axes, tuple(rows), firsts, program)
    if key is not None:
        _plans[key] = plan
        while len(_plans) > 64:
            _plans.pop(next(iter(_plans)))
    return axes, batches, targets, plan


_plans: dict[Any, Plan] = {}  # the plans of the last sweeps, oldest first


def _plan_key(found, tag, auto, axes, caller, given):
    """What decides a sweep's `Plan`, hashable (None if it cannot be): the sites found (the
    very tuple `sow_sites` keeps), the tag, the names and whether the sweep chose them, the
    axes, and the structure, types, shapes and dtypes of each chosen clean value in
    ``given`` (`_MISSING` if none; a number's value too)."""
    shapes = tuple(map(_value_shape, given.values()))
    key = (id(found), tag, auto, tuple(given), axes, caller, shapes)
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
        for t in targets if None in sizes.values() else ():
            # The full message for a bad axis, mismatched leaves or an axis given twice.
            for a in axes:
                axis_size(t.one, a, f"{caller} at {path_str(t.site.path)!r}")
            ndim = np.ndim(jax.tree_util.tree_leaves(t.one)[0])
            _axes_counted(ndim, axes, f"{caller} at {path_str(t.site.path)!r}")
        if len(set(sizes.values())) != 1:
            shown = {n: _size_str(z) for n, z in sizes.items()}
            raise ValueError(
                f"{caller}: the sites have different sizes along {where}: {shown}. Sweep sites of "
                "one size together (pass names=...)."
            )
        size = next(iter(sizes.values()))
    return targets, size, skipped


def _by_name(found: tuple[Any, ...], tag: Any) -> dict[str, list[Any]]:
    """The firings of ``tag``'s sites among ``found`` (as `sow_sites` gives them), by dotted
    name; kept for the very tuple `sow_sites` keeps (held: its identity is not reused)."""
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


@functools.lru_cache(maxsize=64)
def _checked_axes(
    ndims: tuple[tuple[str, int], ...], axes: tuple[int, ...]
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
        return list(_selected.__wrapped__(entries, sown, tag, caller))


@functools.lru_cache(maxsize=64)
def _selected(entries, sown, tag, caller):
    # A repeated sweep selects the same names among the same sites: matched once.
    picked = {}
    for entry in entries:
        select = NameFilter.make(entry)
        picked.update(dict.fromkeys(n for n in sown if select((n,))))
    NameFilter.make(list(entries)).check_names(sown, f"{caller}: names=", tag)
    return tuple(picked)


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
        return _Target(site, site_value(clean, site, "clean"))
    if not others and fires == stacked and not site.mode.entries:
        # Once per shard of a shard_map: reap stacks one row per shard whatever the mode.
        return _Target(site, site_value(clean, site, "clean", stacked), stacked)
    if site.mode.rows and all(o[2] is not None for o in occurrences):
        # Fires several times (in a scan, say): one row per occurrence, as reap stacks them.
        count = int(np.shape(jax.tree_util.tree_leaves(_lookup(clean, site, "clean"))[0])[0])
        return _Target(site, site_value(clean, site, "clean", count), count)
    count = "an unbounded number of" if fires is None else str(sum(o[2] or 0 for o in occurrences))
    where = ", ".join(" › ".join(w) or "top level" for _, w, _, _ in occurrences)
    raise ValueError(
        f"{caller}: the site {name!r} (mode {site.mode.label}) fires {count} times per call "
        f"(at {where}); a sweep patches each occurrence of a site sown with "
        "mode 'append' outside while_loops, and otherwise needs sites that fire once. Sow it "
        "with mode='append', give each occurrence its own name (e.g. with nest or "
        "f'layer{i}'), or leave it out with names=."
    )


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


def _axes_counted(ndim: int, axes: tuple[int, ...], what: str) -> tuple[int, ...]:
    """`axes`, each counted from the front of a value with ``ndim`` axes; no axis twice."""
    normal = tuple(a % ndim for a in axes)
    if len(set(normal)) != len(normal):
        raise ValueError(f"{what}: axis {axes} names the same axis twice; sweep each axis once.")
    return normal


def _dataset(clean: Any, corrupted_args: Any, caller: str) -> list[tuple[Any, Any]]:
    """The (clean, corrupted args) pairs a sweep averages over: one, or one per batch of a dataset."""
    if not isinstance(corrupted_args, list):
        return [(clean, corrupted_args)]
    if not isinstance(clean, list) or len(clean) != len(corrupted_args) or not clean:
        given = len(clean) if isinstance(clean, list) else type(clean).__name__ + " as"
        raise TypeError(
            f"{caller}: for a dataset, pass corrupted_args as a non-empty list of argument tuples, "
            "one per batch, and clean as the list of their clean reaps, [reap(f)(*clean_args) for "
            f"clean_args in batches]; got {len(corrupted_args)} argument tuples and {given} clean."
        )
    return list(zip(clean, corrupted_args))


def batch_cleans(
    targets: list[_Target],
    batch_clean: Any,
    axes: tuple[int, ...] | None,
    size: Any,
    caller: str,
    checked: Any = None,
) -> list[Any]:
    """Each target's clean value in one batch of a dataset, checked against the first batch's
    sizes (the first batch's own, `planned` took and checked already)."""
    if batch_clean is checked:
        return [t.clean for t in targets]
    cleans = []
    for t in targets:
        value = site_value(batch_clean, t.site, "clean", t.count)
        one = value if t.count is None else jax.tree_util.tree_map(lambda l: l[0], value)
        if axes is not None and _sizes_along(one, axes) != size:
            raise ValueError(
                f"{caller}: in this batch, {path_str(t.site.path)!r} has sizes "
                f"{_sizes_along(one, axes)} along axis {axes}, not {size} as in the first batch. "
                "Every batch must give the swept axes one size."
            )
        cleans.append(value)
    return cleans
