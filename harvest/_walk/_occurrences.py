"""A name's occurrences: the `Record` a walk reaps, the `Plant` it plants, and
how both are counted and sliced per iteration of a loop (or per shard).

What each step does depends on the site's mode, which these helpers ask
(`site.mode.entries`, `.rows`, ...) rather than naming modes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _errors
from . import _errors as walk_errors
from ._higher_order import UNBOUNDED, Body, bodies, describe
from ._per_example import applied_per_example
from ._primitive import sow_p
from ._site import Site
from ._sow_index import sow_index
from ._steps import Steps


def occurrences(jaxpr: Any, site: Site) -> int:
    """How many entries (collect) or rows (append) of `site` one run of `jaxpr`
    gives, as reap returns them; a cond gives its longest branch's."""
    n = 0
    markers: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            # A record-only sow is a copy, after a batched cond, of a sow in its branches.
            other = Site.of(eqn)
            same = (other.tag, other.path, other.mode) == (site.tag, site.path, site.mode)
            n += same and eqn.params.get("role") != "record_only"
        elif (recount := describe(eqn).recount) is not None:  # `_rules/batched_cond`'s marker
            n = recount(eqn, n, markers)
        else:
            counts = [
                occurrences(b.jaxpr, site) * _repeats(b, site)
                for b in bodies(eqn)
                if (site.tag, site.path) in sow_index(b.jaxpr).names  # else 0: skip the walk
            ]
            n += max(counts, default=0) if describe(eqn).alternatives else sum(counts)
    return n


def varies(jaxpr: Any, site: Site) -> bool:
    """Whether how many times `site` fires in one run of `jaxpr` is known only
    when it runs: a while_loop there sows it."""
    for eqn in jaxpr.eqns:
        for b in bodies(eqn):
            if (b.runs is UNBOUNDED and occurrences(b.jaxpr, site)) or varies(b.jaxpr, site):
                return True
    return False


def static_counts(seen: dict[Any, Any], sites: dict[Any, Site], where: str) -> dict[Any, Any]:
    """`seen` of a body traced apart, whose counts must be Python ints to leave it:
    a count a while_loop made (an array) can only be carried, not returned."""
    for path, n in seen.items():
        if not isinstance(n, int):
            raise walk_errors.index_after_while_in(sites[path], where)
    return seen


def most_count(a: Any, b: Any) -> Any:
    """The larger of two occurrence counts, either maybe an array (see `varies`)."""
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _repeats(body: Body, site: Site) -> int:
    """How often one run of an equation repeats `site`'s occurrences in `body`,
    as reap counts them: rows once per run, other modes once per body."""
    if body.runs == 0:  # a scan of length 0, or runs only where JAX differentiates
        return int(body.stacked_loop and site.mode.entries)
    if site.mode.rows and body.runs is not UNBOUNDED:
        return body.runs
    return 1


# ---------------------------------------------------------------------------
# Records: what a walk reaps for one name.


def _different_shapes(site: Any, shapes: Iterable[Any]) -> ValueError:
    """The error for occurrences of one stacking name with different shapes."""
    return ValueError(
        f"The sow site {site} has mode {site.mode.label}, but its occurrences "
        f"have different shapes ({', '.join(sorted(map(walk_errors.shapes_str, shapes)))}), so they "
        "cannot be stacked into one array. Sow one shape per name (give each shape "
        "its own name), or use mode 'collect', which keeps each occurrence as it is."
    )


@dataclasses.dataclass
class Record:
    """The occurrences of one name reaped so far in one walk of a body.

    `values` holds, by mode: collect, one pytree per occurrence; append, chunks
    of occurrences stacked on a leading axis; auto, such chunks and single
    occurrences sown outside any loop, in order; the other modes, one pytree.
    """

    site: Site
    values: list[Any]

    def result(self) -> Any:
        if any(isinstance(v, Steps) for v in self.values):  # a while_loop's per-step record
            if len(self.values) > 1:
                raise ValueError(
                    f"The sow site {self.site} is recorded per step (max_steps) in a while_loop and also "
                    "sown outside it, so its occurrences do not make one record. Give the loop's "
                    "occurrences their own names, e.g. call the loop body through "
                    "harvest.nest(body, scope='decode'), or reap without max_steps."
                )
            return self.values[0]
        mode = self.site.mode
        if mode.entries:
            return tuple(merged_elements(self.site, self.values))
        if len(self.values) == 1 and self.site.one_occurrence(self.values[0]):
            return self.values[0]  # sown once, outside any loop: the value itself
        if mode.rows:
            return self.rows()
        return self.values[0]

    def rows(self) -> Any:
        """An append or auto record's occurrences, stacked on one leading axis."""
        chunks = [
            jax.tree_util.tree_map(lambda l: jnp.expand_dims(l, 0), v)
            if self.site.one_occurrence(v)
            else v
            for v in self.values
        ]
        shapes = {tuple(jnp.shape(l)[1:] for l in jax.tree_util.tree_leaves(c)) for c in chunks}
        if len(shapes) > 1:
            raise _different_shapes(self.site, shapes)
        return jax.tree_util.tree_map(lambda *c: jnp.concatenate(c), *chunks)

    def add(self, site: Site, value: Any, pred: Any = None) -> None:
        """Records one occurrence of the name, fired by `site` (with its
        predicate `pred`, for a mode that has one)."""
        mode = site.mode
        if mode.unstacked_once and self.site.avals != site.avals:
            # A shared module called on different shapes.
            shapes = {tuple(a.shape for a in s.avals) for s in (self.site, site)}
            raise _different_shapes(site, shapes)
        if mode.entries or mode.unstacked_once:  # the latter kept as is: sown once, it reaps so
            self.values.append(value)
        elif mode.rows:
            self.values.append(jax.tree_util.tree_map(lambda l: jnp.expand_dims(l, 0), value))
        else:
            if mode.carried and pred is not None:  # sow_cond, or a record-only clobber
                old = self.values[0] if self.values else site.zeros()
                value = jax.tree_util.tree_map(functools.partial(select_where, pred), value, old)
            self.values = [value]

    def chunk(self) -> Any:
        """One loop body's occurrences, as a loop stacks them: a list of entries
        (collect), the rows (append, auto), or the one value (other modes)."""
        if any(isinstance(v, Steps) for v in self.values):
            raise walk_errors.steps_nested(self.site)
        if self.site.mode.entries:
            return list(self.values)
        if self.site.mode.rows:
            return self.rows()
        return self.result()


class Element(NamedTuple):
    """A collect occurrence sown for one element of a batched `lax.map` (the sow's
    `element` param): `value` for element `j` of a batch of `size`, in the map's
    scan over full batches (`part` "batches": stacked over them by that scan) or
    its remainder; `both`: for a remainder, whether that map ran full batches
    first (None for full batches). A pytree: loops stack its value, keeping
    which element."""

    value: Any
    j: int
    size: int
    part: str
    both: bool | None


jax.tree_util.register_pytree_node(
    Element,
    lambda e: ((e.value,), (e.j, e.size, e.part, e.both)),
    lambda aux, v: Element(v[0], *aux),
)


class _Group(NamedTuple):
    """One entry `lax.map(f, xs)` would give, made of the entries at `batches` (a
    sow's elements in the map's full batches) and `remainder` (in its remainder),
    or, for an entry sown elsewhere, the one at `alone`."""

    batches: tuple[int, ...] = ()
    remainder: tuple[int, ...] = ()
    alone: int | None = None


def _groups(marks: list[Any]) -> list[_Group]:
    """The entries of a collect name grouped as `lax.map(f, xs)` gives them, from
    each entry's mark: its `Element` params `(j, size, part, both)`, or None.

    Each sow in `f` gives a run of `size` elements per part, in element order. A
    map's remainder runs (`both`: it ran full batches first) follow its runs of
    full batches at once, one per sow, in the same order: they complete the last
    runs of full batches before them (those of maps just before are further back)."""
    runs: list[tuple[Any, tuple[int, ...]]] = []
    i = 0
    while i < len(marks):
        size = 1 if marks[i] is None else marks[i][1]
        runs.append((marks[i], tuple(range(i, i + size))))
        i += size
    groups: list[_Group] = []
    full: list[int] = []  # the groups of the runs of full batches just before, in sow order
    r = 0
    while r < len(runs):
        mark, run = runs[r]
        if mark is not None and mark[2] == "batches":
            full.append(len(groups))
            groups.append(_Group(batches=run))
            r += 1
            continue
        ends = r
        while ends < len(runs) and _after_full_batches(runs[ends][0]):
            ends += 1
        if 0 < ends - r <= len(full):  # a map's remainder, after its full batches
            for k, g in enumerate(full[len(full) - (ends - r) :]):
                groups[g] = groups[g]._replace(remainder=runs[r + k][1])
        else:  # sown elsewhere, or a map with fewer elements than one batch: its remainder
            groups.append(_Group(alone=run[0]) if mark is None else _Group(remainder=run))
            ends = r + 1
        r, full = ends, []
    return groups


def _after_full_batches(mark: Any) -> bool:
    return mark is not None and tuple(mark[2:]) == ("remainder", True)


def merged_elements(site: Site, entries: list[Any]) -> list[Any]:
    """Collect `entries` with each batched `lax.map`'s per-element ones
    (`Element`) merged into the one entry per sow that `lax.map(f, xs)` stacks:
    element `j` of batch `t` is row `t * size + j`, the remainder's rows after
    the full batches'. Axes in front of the map's (loops around it) stay in front."""
    marks = [e[1:] if isinstance(e, Element) else None for e in entries]
    out = []
    for group in _groups(marks):
        if group.alone is not None:
            out.append(entries[group.alone])
            continue
        parts = [
            _stacked_run(site, [entries[k].value for k in run], batches)
            for run, batches in ((group.batches, True), (group.remainder, False))
            if run
        ]
        leaves = parts[0]
        if len(parts) == 2:  # the remainder's rows after the full batches', on the rows' axis
            leaves = [
                jnp.concatenate([a, b], axis=jnp.ndim(a) - 1 - len(aval.shape))
                for a, b, aval in zip(*parts, site.avals)
            ]
        out.append(jax.tree_util.tree_unflatten(site.tree, leaves))
    return out


def _plant_count(site: Any, got: int, n: int, what: str) -> ValueError:
    shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in site.avals)
    return ValueError(
        f"The plant for the sow site {site} has {got} {what}, but reap returns "
        f"{n} {what} of {shapes} for it. Plant {n} {what}, as reap returns them, or a "
        "single value (or callable) used at every occurrence."
    )


def split_elements(site: Site, marks: list[Any], entries: Any) -> tuple[Any, ...]:
    """The inverse of `merged_elements`: `entries`, one per entry `lax.map(f, xs)`
    gives, split into the entries of the sows a batched `lax.map` unrolls, whose
    `marks` (see `_groups`) the program's sow equations carry, in order."""
    groups = _groups(marks)
    if len(entries) != len(groups):
        raise _plant_count(site, len(entries), len(groups), "entries")
    out: list[Any] = [None] * len(marks)
    for group, entry in zip(groups, entries):
        if group.alone is not None:
            out[group.alone] = entry
            continue
        columns: dict[int, list[Any]] = {k: [] for k in (*group.batches, *group.remainder)}
        for leaf, aval in zip(jax.tree_util.tree_leaves(entry), site.avals):
            axis = jnp.ndim(leaf) - 1 - len(aval.shape)  # the rows' (loops around the map lead)
            full = jnp.shape(leaf)[axis] - len(group.remainder)
            for j, k in enumerate(group.batches):  # rows j, j + size, ...: element j of each batch
                columns[k].append(lax.slice_in_dim(leaf, j, full, len(group.batches), axis))
            for j, k in enumerate(group.remainder):
                columns[k].append(lax.index_in_dim(leaf, full + j, axis, keepdims=False))
        for k, column in columns.items():
            out[k] = jax.tree_util.tree_unflatten(site.tree, column)
    return tuple(out)


def _stacked_run(site: Site, run: list[Any], batches: bool) -> list[Any]:
    """The leaves of one sow's per-element values as rows, element by element (with
    `batches`, each value stacked over the full batches: rows batch by batch)."""
    leaves = [jax.tree_util.tree_leaves(v) for v in run]
    stacked = []
    for k, aval in enumerate(site.avals):
        column = [element[k] for element in leaves]
        lead = jnp.ndim(column[0]) - len(aval.shape) - batches  # axes of loops around the map
        rows = jnp.stack(column, axis=lead + batches)
        if batches:  # [..., batch, element, ...] -> [..., row, ...]
            rows = rows.reshape(*rows.shape[:lead], -1, *rows.shape[lead + 2 :])
        stacked.append(rows)
    return stacked


def select_where(pred: Any, a: Any, b: Any) -> Any:
    """`where(pred, a, b)` with `pred`'s axes leading: under vmap a sow_cond's
    predicate is batched along the same leading axis as its value."""
    pred = jnp.reshape(pred, jnp.shape(pred) + (1,) * (jnp.ndim(a) - jnp.ndim(pred)))
    return jnp.where(pred, a, b)


def stacked_record(site: Site, chunk: Any) -> Record:
    """The record of a loop that stacked each iteration's `chunk` along a new
    leading axis: entries stay entries, rows of all iterations become one
    run of rows, and anything else is one stacked value."""
    if site.mode.entries:
        return Record(site, list(chunk))
    if site.mode.rows:
        return Record(site, [jax.tree_util.tree_map(_merge_rows, chunk)])
    return Record(site, [chunk])


def _merge_rows(leaf: Any) -> Any:
    """[n, k, *s] -> [n * k, *s]; spelled out, as -1 cannot be inferred for zero-size rows."""
    return leaf.reshape((leaf.shape[0] * leaf.shape[1],) + leaf.shape[2:])


# ---------------------------------------------------------------------------
# Plants: the replacement for each occurrence of a name.


@dataclasses.dataclass(frozen=True)
class Plant:
    """A planted value as seen from one walk of a body, starting at its first occurrence.

    `value` is, by the site's mode: collect, a tuple with one entry per
    occurrence; append, leaves stacked on a leading axis; or, for any mode, a
    single value or a callable `old -> new` used at every occurrence. A
    callable that requires a second positional argument is called as
    `value(old, index)`, `index` being the occurrence's position among the
    name's occurrences in one call (its row in reap's stack; traced inside a
    scan); `start` is the index of this walk's first occurrence.
    """

    site: Site
    value: Any
    start: Any = 0

    def per_occurrence(self) -> bool:
        v, mode = self.value, self.site.mode
        if callable(v):
            return False
        if mode.entries:
            # A tuple shaped like the sown value is one value; any other tuple
            # holds one entry per occurrence (its count is checked by the walk).
            return isinstance(v, tuple) and jax.tree_util.tree_structure(v) != self.site.tree
        if mode.rows:
            leaf, aval = jax.tree_util.tree_leaves(v)[0], self.site.avals[0]
            return bool(jnp.ndim(leaf) == len(aval.shape) + 1)
        return False

    def check_count(self, n: int) -> None:
        """A plant given per occurrence needs one entry (collect) or row (append)
        for each of the `n` occurrences that reap would return."""
        if isinstance(self.value, Steps):  # reaped from a while_loop, whose trips vary per call
            raise walk_errors.per_occurrence_plant_in_while(self.site)
        if not self.per_occurrence():
            return
        if self.site.mode.entries:
            got, what = len(self.value), "entries"
        else:
            got, what = jnp.shape(jax.tree_util.tree_leaves(self.value)[0])[0], "rows"
        if got != n:
            raise _plant_count(self.site, got, n, what)

    def takes_index(self) -> bool:
        # A second required positional argument (the occurrence index); parameters with
        # defaults do not count, so `lambda old, c=c: ...` is a callable of old alone.
        return callable(self.value) and _required_positional(self.value) >= 2

    def starting_at(self, start: Any) -> Plant:
        """The same plant, its occurrences counted from `start`."""
        return Plant(self.site, self.value, start) if self.takes_index() else self

    def shift(self, n: int) -> Plant:
        """The same plant seen from `n` occurrences later (an int, or an
        array counted as a while_loop ran)."""
        if isinstance(n, int) and not n:
            return self
        if self.takes_index():
            return self.starting_at(self.start + n)
        if not self.per_occurrence():
            return self
        if self.site.mode.entries:
            return Plant(self.site, self.value[n:])
        return Plant(self.site, jax.tree_util.tree_map(lambda l: l[n:], self.value))

    def at(self, i: int, old: Any, site: Site) -> Any:
        """The replacement for occurrence `i` (fired by `site`) given its old value."""
        v = self.value
        if callable(v):
            if _required_positional(v) > 2:
                raise TypeError(
                    f"The planted callable {getattr(v, '__name__', v)!r} for the sow site {site} "
                    "requires more than two positional arguments. A planted callable takes the old value, "
                    "or the old value and the occurrence index: old -> new or (old, i) -> new."
                )
            return _called(v, old, self.start + i if self.takes_index() else None, site)
        new, what = v, "the planted value"
        if self.per_occurrence():
            what = f"occurrence {i} of the planted value"
            if not self.site.mode.entries:
                new = jax.tree_util.tree_map(lambda l: l[i], v)
            elif i < len(v):
                new = v[i]
            else:
                raise ValueError(
                    f"The plant for the sow site {site} has {len(v)} entries, but the site is sown at "
                    f"least {i + 1} times. Plant one entry per occurrence (as reap returns), or a "
                    "single value for all."
                )
        return jax.tree_util.tree_unflatten(site.tree, site.check(new, what))

    def peel(self, idx: Any, runs: Any, where: str) -> Plant:
        """Row `idx` of a plant stacked along a leading axis (see `_row`); other
        plants as they are, but a callable taking the occurrence index counts
        from row `idx`."""
        if callable(self.value):
            return self.starting_at(self.start + idx)
        row = _row(self.site, self.site, self.value, idx, runs, where)
        return self if row is None else Plant(self.site, row)

    def per_iteration(
        self, idx: Any, body_jaxpr: Any, body_site: Site, runs: Any, where: str
    ) -> Plant:
        """The part of this plant that one iteration (number `idx`) of a loop over
        `body_jaxpr` sees; `body_site` is the name's site in the body (its shape
        may differ from other sites'); `runs` and `where` as for `_row`."""
        site = self.site
        if site.mode.stacks_per_loop:
            return self.peel(idx, runs, where)
        if self.takes_index():
            if site.mode.entries:
                raise _errors.indexed_plant_of_collect_in_loop(site)
            # Iteration `idx` starts `idx` bodies' worth of rows later.
            return self.starting_at(self.start + idx * occurrences(body_jaxpr, site))
        if not self.per_occurrence():
            return self
        n = occurrences(body_jaxpr, site)
        if site.mode.entries:
            # The body's entries come first, each stacked over iterations (or one
            # value for all); entries for later sows are not the body's to slice.
            peeled = [_row(site, body_site, e, idx, runs, where) for e in self.value[:n]]
            entries = tuple(e if r is None else r for e, r in zip(self.value, peeled))
            return Plant(site, entries + self.value[n:])

        def rows(l: Any) -> Any:
            # Fewer rows than one iteration takes: a loop of length 0, whose body
            # is traced but never runs, so any rows of the right shape do.
            if l.shape[0] < n:
                return jnp.zeros((n, *l.shape[1:]), l.dtype)
            return lax.dynamic_slice_in_dim(l, idx * n, n)

        return Plant(site, jax.tree_util.tree_map(rows, self.value))


def _row(site: Site, shaped: Site, value: Any, idx: Any, runs: Any, where: str) -> Any:
    """Row `idx` of `value` if each leaf has a leading axis more than `shaped`'s,
    else None. `runs`, where known, is how many rows it must have (one per
    iteration of a scan, or shard of a shard_map, `where`): each reads its row at
    a traced index, which past the end would read the last row, and rows past
    `runs` would be dropped, so another count is refused."""
    leaves = jax.tree_util.tree_leaves(value)
    if not all(jnp.ndim(l) > len(a.shape) for l, a in zip(leaves, shaped.avals)):
        return None
    wrong = [jnp.shape(leaf)[0] for leaf in leaves if jnp.shape(leaf)[0] != runs]
    if runs is not UNBOUNDED and wrong:
        per = "shard" if where in ("shard_map", "pmap") else "iteration"
        raise ValueError(
            f"The plant for the sow site {site} is stacked with {wrong[0]} rows, but the "
            f"{where} around it has {runs} {per}s and reap returns one row per {per}. Plant "
            f"{runs} rows, as reap returns them, or a single value (or callable) used at every "
            f"{per}."
        )
    # A stack of 0 rows: a loop of length 0, whose body never runs.
    return jax.tree_util.tree_map(
        lambda l: l[idx] if l.shape[0] else jnp.zeros(l.shape[1:], l.dtype), value
    )


def _called(fn: Callable[..., Any], old: Any, index: Any, site: Site) -> Any:
    """A planted callable's value at `site`, given its old value (and the occurrence
    `index`, None for a callable of the old value alone). Under vmap it sees one
    example, as `f` does: it is applied per example, vmapped over the site's batch axes."""
    batch = _batch_axes(site)

    def call(fn: Any, old: Any, index: Any, left: int) -> Any:
        # `left`: the vmap axes still leading `old` (all of them, for a callable that opts out).
        new = fn(old) if index is None else fn(old, index)
        what = "the value returned by the planted callable"
        if left < batch:
            what += (
                " for one example of the vmap around the sow (a planted callable sees "
                "one example, as the function does)"
            )
        one = _one_example(site, batch - left)
        return jax.tree_util.tree_unflatten(one.tree, one.check(new, what))

    try:
        return applied_per_example(fn, old, index, batch, call)
    except _errors.InterventionMisfit as err:
        message = str(err).replace(_errors.SITE, repr(".".join(site.path)))
        raise ValueError(
            f"The intervention planted at the sow site {site} does not fit it: {message}"
        ) from None


def _batch_axes(site: Site) -> int:
    """How many leading vmap axes every leaf of `site` has (see `needs_batched_site`)."""
    counts = set(site.vmapped or (0,))
    if len(counts) > 1:  # `_transforms` traces such a site again with its leaves batched alike
        raise ValueError(
            f"The planted callable for the sow site {site} would see one example of the vmaps "
            f"around it, but vmap batched its leaves along different axes ({site.vmapped} leading "
            "batch axes), which cannot be paired. This is a bug in harvest: please report it; "
            "meanwhile plant a value, or sow the leaves as separate sites."
        )
    return counts.pop()


def _one_example(site: Site, batch: int) -> Site:
    """`site` as one example of the `batch` vmap axes leading its leaves sees it."""
    if not batch:
        return site
    return dataclasses.replace(
        site,
        avals=tuple(a.update(shape=a.shape[batch:]) for a in site.avals),
        vmapped=(0,) * len(site.avals),
        axes=None if site.axes is None else tuple(names[batch:] for names in site.axes),
    )


def needs_batched_site(plant: Plant, site: Site) -> bool:
    """Whether a callable `plant` at `site` needs every vmap around the sow to batch
    all its leaves: one leaf's vmap axes cannot be paired with another's when
    different vmaps batched them, and the callable takes one example of all."""
    fn = plant.value
    return (
        callable(fn)
        and getattr(fn, "per_example", True) is not False
        and len(site.vmapped) > 1
        and any(site.vmapped)
    )


def _required_positional(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: old -> new
        return 1
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params)
