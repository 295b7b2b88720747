"""One call of a harvested function: its parts, its key, and the walk that runs it.

`run_walk` takes a call apart (the function, what it binds, the plants, the
arguments, NNX state: arrays traced, the rest static), decides where it runs (in
place under an outer trace, or through the function's one `jax.jit`, see `_jit`),
and `_walk` traces the function, validates its sites against the policy and the
plants, and runs the walk (`_interpreter`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import numbers
import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import _errors, _jax
from .._walk._higher_order import bodies, describe
from .._walk._interpreter import Policy, Tags, Walk, interpret, program_sites
from .._walk._leaves import (
    array_flags,
    hide_static,
    is_graph_node,
    reveal_static,
    static_leaves,
    traced_as_data,
)
from .._walk._occurrences import Plant, needs_batched_site, occurrences, split_elements
from .._walk._paths import nested_dict, path_str
from .._walk._primitive import batching_sites, sow_p
from .._walk._rules import batched_lax_map
from .._walk._rules.batched_lax_map import per_element
from .._walk._rules.calls import holds_rule_sows
from .._walk._site import Site
from .._walk._sow_index import sites_in
from ._inspect import sow_equations
from ._jit import Key, compiled, rewrap, unwrap
from ._nnx_state import rebuilt, split_leaves, state_flags, with_graph, write_back
from ._stateful import Stateful, flattening_call, has_state_of_its_own
from ._traced_code import code_as_data
from ._tracing import make_jaxpr


class _Static(NamedTuple):
    """Everything about a call that is not an array (a `Key`'s fields)."""

    treedef: Any
    static_leaves: tuple  # `static_leaves` of the leaves not traced
    policy: Policy
    reap: bool
    differentiating: bool  # a jvp/linearize outside the call (see `_rule_walks`)


def _walk(fn, dynamic, static: _Static, staged=False, batched=frozenset(), unrolled=frozenset()):
    """The walk of one call: traced, its sites and plants validated, then run.
    Returns (out, reaps in program order, changed NNX state, `_planted_numbers` if staged)."""
    closed, arrays, out_shape, plants, inner_tags = _trace_call(
        fn, dynamic, static, batched, unrolled
    )
    jaxpr, policy = closed.jaxpr, static.policy
    if staged and not _lowerable(jaxpr):
        raise _WalkInPlace(_eager_only)
    if staged and static.differentiating and holds_rule_sows(jaxpr, policy):
        raise _WalkInPlace(_rule_walks)
    order, handled, filtered = _checked_sites(jaxpr, static, plants, inner_tags)
    resolved = _resolve_plants(plants, handled, policy, filtered)
    per_example = {(p.site.tag, p.site.path) for p in resolved.values() if _per_example(p)}
    key = policy.key
    per_example |= {
        (site.tag, site.path)
        for site in sites_in(jaxpr)
        if key(site) in resolved and needs_batched_site(resolved[key(site)], site)
    }
    if per_example and not batched:
        # Sites vmap left unbatched (their value does not depend on the batched
        # input), planted one value per example, and callables planted at sites
        # whose leaves vmap batched apart: traced again with them batched.
        return _walk(fn, dynamic, static, staged, frozenset(per_example), unrolled)

    def retraced(plan):  # the same call, traced again under a batched lax.map's plan
        return _trace_call(fn, dynamic, static, batched, plan)[0].jaxpr

    in_maps = batched_lax_map.staged_per_batch(
        jaxpr, policy.handles, None if unrolled else retraced
    )
    if in_maps and not unrolled and batched_lax_map.SUPPORTED:
        # Sows a batched lax.map stages once per batch: traced again, once per element.
        return _walk(fn, dynamic, static, staged, batched, in_maps)
    if unrolled:
        _refuse_sown_twice_per_element(jaxpr, unrolled)
        resolved = _split_per_element(jaxpr, resolved, key, unrolled)
    for planted in resolved.values():
        planted.check_count(occurrences(jaxpr, planted.site))
    _refuse_batched_lax_map(jaxpr, policy, resolved, static.reap, unrolled)
    walk = Walk(policy, resolved, static.reap)
    outs = interpret(walk, jaxpr, closed.consts, arrays)
    out_tree = jax.tree_util.tree_structure(out_shape)
    out, changes = jax.tree_util.tree_unflatten(out_tree, outs)
    results = walk.results()
    in_order = _InOrder({path: results[path] for path in sorted(results, key=order.__getitem__)})
    return out, in_order, changes, _planted_numbers(dynamic, resolved) if staged else ()


def _planted_numbers(dynamic, resolved) -> tuple[tuple[int, Site, str, Any], ...]:
    """(position in `dynamic`, site, what, dtype) of each traced leaf planted as it is,
    with the dtype it is cast to: a Python number among them is known only at call
    time, so a compiled walk hands these back for `run_walk` to check each call."""
    at = {id(leaf): i for i, leaf in enumerate(dynamic)}  # tracers: distinct objects
    return tuple(
        (at[id(leaf)], planted.site, what, dtype)
        for planted in resolved.values()
        for leaf, what, dtype in planted.site.cast_leaves(planted.value)
        if id(leaf) in at and jnp.ndim(leaf) == 0
    )


def _trace_call(fn, dynamic, static: _Static, batched, unrolled):
    """(the call's closed jaxpr, the arrays it takes, its output's shape, the call's
    plants, the tags inner harvest walks consumed while it was traced)."""
    ((bound, args, kwargs), plants), graph = rebuilt(static.treedef, static.static_leaves, dynamic)

    def call(bound, /, *args, **kwargs):
        # `bound` is passed, not closed over, so that NNX nodes among it are merged.
        return rewrap(fn, bound)(*args, **kwargs)

    called = bound[1] if bound is not None and bound[0] == "method" else None
    # Errors name the user's function (a model called: the method that runs it).
    model = callable(called) and fn is type(called).__call__
    call.__wrapped__ = code_of(called) if model else fn  # type: ignore[attr-defined]

    with _tags_walked_inside() as inner_tags, batching_sites(batched), per_element(unrolled):
        traced = make_jaxpr(call, (bound, *args), kwargs, graph, return_shape=True)
    return (*traced, plants, inner_tags)


def _checked_sites(jaxpr, static: _Static, plants, inner_tags):
    """(each site key's rank in program order, the sites the policy handles, the keys
    of its tag that `names=`/`exclude=` leave out), refusing what names no site."""
    policy = static.policy
    key = policy.key  # a site's path, or (tag, *path) for a walk of several `Tags`
    first: dict[tuple, int] = {}  # key -> rank of its first sow in program order
    for eqn, _, _ in sow_equations(jaxpr):
        first.setdefault(key(Site.of(eqn)), len(first))
    every = program_sites(jaxpr, static.differentiating)
    for path in sorted({key(site) for site in every} - first.keys()):
        first[path] = len(first)  # sown only in a custom_jvp rule: after the others
    handled: dict[tuple, Site] = {}
    filtered = set()
    for site in every:
        if policy.covers(site.tag) and not policy.handles(site):
            filtered.add(key(site))
        if policy.handles(site):
            known = handled.setdefault(key(site), site)
            if known.mode is not site.mode:
                raise ValueError(
                    f"The sow site {site} uses mode {site.mode.label}, but the same name is sown with "
                    f"mode {known.mode.label} at {known.where()}. Use one mode per name."
                )
    handled = dict(sorted(handled.items(), key=lambda item: first[item[0]]))  # program order
    _check_paths_distinct(list(handled) + sorted(filtered - handled.keys(), key=first.__getitem__))
    multi = isinstance(policy.tag, Tags)  # layers' own tags, each checked by the layer
    if (static.reap or plants) and policy.strict_names and not (handled or filtered or multi):
        tags = sorted({site.tag for site in every}, key=str)
        caller = "reap" if static.reap else "plant"
        if tags and policy.tag not in {*tags, *_LAYER_TAGS, *inner_tags}:
            shown = ", ".join(repr(t) for t in tags[:8]) + (", ..." if len(tags) > 8 else "")
            why = (
                "reaping a tag the function never sows is refused rather than returning {}"
                if static.reap
                else "a plant under a tag the function never sows would change nothing"
            )
            raise ValueError(
                f"{caller}(tag={policy.tag!r}): the function has no sow of tag {policy.tag!r}, but "
                f"it has sows of the tags {shown}. Pass one of those as tag= (instrument's sites "
                f"are tag='modules'); {why}."
            )
        if not tags and policy.tag == "modules" and policy.tag not in inner_tags:
            # instrument's tag, and no sow at all: most often a model never passed to instrument.
            why = "rather than returning {}" if static.reap else "as it would change nothing"
            raise ValueError(
                f"{caller}(tag={policy.tag!r}): the function sows nothing, of any tag; refused {why}. "
                f"{policy.tag!r} is the tag instrument sows a model's parts under: pass what instrument "
                f"returns, not the model itself (model = harvest.instrument(model), then "
                f"{caller}(model, tag={policy.tag!r}); for Linen, instrument the function that calls "
                "model.apply)."
            )
    if policy.strict_names:
        tagged = sorted(filtered.union(handled), key=first.__getitem__)
        policy.select.check_names([path_str(p) for p in tagged], "names= entry", policy.tag)
    return first, handled, filtered


def _per_example(plant):
    """Whether `plant` is one value per example of a vmap that left its site
    unbatched: it does not fit the site, but would with one more leading axis."""
    value, site = plant.value, plant.site
    if callable(value) or plant.per_occurrence():
        return False
    leaves, tree = jax.tree_util.tree_flatten(value)
    if tree != site.tree or not any(
        jnp.ndim(leaf) == len(aval.shape) + 1 and jnp.shape(leaf)[1:] == aval.shape
        for leaf, aval in zip(leaves, site.avals)
    ):
        return False
    try:
        site.check(value, "the planted value")
    except (ValueError, TypeError):
        return True
    return False


def _refuse_sown_twice_per_element(jaxpr, unrolled):
    """Refuses a name of a rows mode that a batched `lax.map` unrolled twice per
    element: its rows would come sow by sow within a batch, not element by element
    as `lax.map(f, xs)` gives them."""
    for (tag, path, _), n in _unrolled_per_element(jaxpr, unrolled).items():
        if n > 1:
            site = next(
                site
                for eqn, _, _ in sow_equations(jaxpr)
                if ((site := Site.of(eqn)).tag, site.path) == (tag, path)
            )
            raise ValueError(
                f"The sow site {site} (mode {site.mode.name!r}) is sown more than once per element of "
                "xs inside lax.map(f, xs, batch_size=b). JAX runs f vmapped over a batch, so each "
                "sow fires for the whole batch before the next: its rows would "
                "come sow by sow, not element by element as lax.map(f, xs) gives them. Harvest "
                "lax.map(f, xs) without batch_size, or give each sow its own name."
            )


def _unrolled_per_element(jaxpr, unrolled) -> collections.Counter:
    """How often each vmap of `f` unrolled each rows sow of `unrolled` sites in a
    run of `jaxpr`, per `(tag, path, vmap)` (the `vmap` its `element` params name, see
    `batched_lax_map.element_params`): once per sow equation of its first element;
    a cond as its busiest branch; a batched cond's record-only copies count, its
    branch sows (which carry no vmap) not; bodies that run only where JAX
    differentiates not."""
    counts: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            site, element = Site.of(eqn), eqn.params.get("element")
            if (site.tag, site.path) in unrolled and site.mode.rows and element and not element[0]:
                counts[site.tag, site.path, element[1]] += 1
            continue
        inner = [
            _unrolled_per_element(body.jaxpr, unrolled)
            for body in bodies(eqn)
            if body.runs != 0 or body.stacked_loop
        ]
        if describe(eqn).alternatives:
            counts.update(functools.reduce(operator.or_, inner, collections.Counter()))
        else:
            counts.update(sum(inner, collections.Counter()))
    return counts


def _split_per_element(jaxpr, resolved, key, unrolled):
    """`resolved` with each collect plant given entry by entry, as `lax.map(f, xs)`
    reaps them, split into the entries of the sows a batched `lax.map` unrolls
    once per element (see `_occurrences.split_elements`)."""
    out = dict(resolved)
    for path, planted in resolved.items():
        site = planted.site
        if (site.tag, site.path) not in unrolled or not site.mode.entries:
            continue
        if planted.takes_index():  # `lax.map(f, xs)` sows it in a scan: no single index
            raise _errors.indexed_plant_of_collect_in_loop(site)
        if not planted.per_occurrence():
            continue
        marks = [
            eqn.params.get("element")
            for eqn, _, _ in sow_equations(jaxpr)
            if key(Site.of(eqn)) == path
        ]
        out[path] = Plant(site, split_elements(site, marks, planted.value))
    return out


def _refuse_batched_lax_map(jaxpr, policy, plants, reaping, unrolled):
    """Refuses a sow in `lax.map(f, xs, batch_size=b)` not sown once per element (not
    in `unrolled`: collect's, or on a JAX without trace values): it fires once per batch,
    so only a plant meaning the same for every element (one value) is allowed there."""
    under = batched_lax_map.sown_under_lax_map(jaxpr)
    for eqn, _, _ in sow_equations(jaxpr):
        site = Site.of(eqn)
        if not policy.handles(site) or (site.tag, site.path) in unrolled or id(eqn) not in under:
            continue
        plant = plants.get(policy.key(site))
        if (plant is None and not reaping) or (
            plant is not None and _one_value_per_element(plant.value, site)
        ):
            continue
        what = (
            "reaping it would give batch-shaped occurrences"
            if plant is None
            else "a plant other than one value of the element's shape (rows, or a callable) "
            "would meet batch-shaped occurrences"
        )
        append = (
            "Sow it with mode='append' (harvest sows those once per element, the rows "
            "lax.map(f, xs) gives), harvest"
        )
        raise ValueError(
            f"The sow site {site} runs inside lax.map(f, xs, batch_size=b), which JAX runs as a "
            f"scan over vmapped batches of b elements plus a shorter remainder, so {what} "
            "([b, ...] per batch) that depend on batch_size, not one per element of xs. "
            f"{append if site.mode.entries else 'Harvest'} lax.map(f, xs) without batch_size, "
            "or jax.vmap(f)(xs); planting one value for every element works."
        )


def _one_value_per_element(value, site):
    """Whether `value` is one value shaped as the site's per-element value (its vmap axes left out)."""
    if callable(value):
        return False
    leaves, tree = jax.tree_util.tree_flatten(value)
    return tree == site.tree and all(
        jnp.shape(leaf) == aval.shape[batch:]
        for leaf, aval, batch in zip(leaves, site.avals, site.vmapped or (0,) * len(leaves))
    )


_LAYER_TAGS: set[str] = set()


def layer_tag(tag: str) -> str:
    """Declares ``tag`` one that a layer of harvest reaps whether or not a program sows
    it (harvest.ppl asks every model for its deterministic sites, say), so that a
    program sowing other tags but not this one reaps ``{}`` rather than an error."""
    _LAYER_TAGS.add(tag)
    return tag


_walking = threading.local()


@contextlib.contextmanager
def _tags_walked_inside():
    """Collects the tags of the harvest walks run while tracing a function: a
    tag an inner ``plant`` or ``reap`` consumed has no sites left, not a typo."""
    stack = _walking.__dict__.setdefault("stack", [])
    stack.append(set())
    try:
        yield stack[-1]
    finally:
        stack.pop()


def _check_paths_distinct(paths):
    """Every dotted path names one site: no two sites spell the same (a name
    ``b.h`` under scope ``a`` and a name ``h`` under scopes ``a``, ``b``)."""

    def spelled(path: tuple[str, ...]) -> str:
        scopes = f" under nest scopes {list(path[:-1])}" if len(path) > 1 else ""
        return f"name {path[-1]!r}{scopes}"

    seen = {}
    for path in paths:
        other = seen.setdefault(path_str(path), path)
        if other != path:
            raise ValueError(
                f"The sites {spelled(other)} and {spelled(path)} are both spelled "
                f"{'.'.join(path)!r} (a dot inside a sown name reads as a nest scope), so a plant "
                "could reach the wrong one. Rename one of the sows, without dots (use '_')."
            )


class _InOrder(dict):
    """Reaped values by path, in program order: a pytree whose key order is
    static data, so it survives the jit (which would sort a dict's keys)."""


jax.tree_util.register_pytree_node(
    _InOrder,
    lambda d: (list(d.values()), tuple(d)),
    lambda keys, values: _InOrder(zip(keys, values)),
)


def _alike(static: _Static) -> Any:
    """A walk's key but its Python values (what the recompile warning compares)."""
    kinds = tuple(kind for _, kind, _, _ in static.static_leaves)
    return (static.treedef, kinds, static.policy, static.reap)


def _walk_staged(fn, dynamic, key: Key):
    """The body of ``fn``'s `jax.jit` for a walk (see `_calling.compiled`)."""
    out, flat, changes, numbers_ = _walk(fn, dynamic, key.fields, staged=True)
    # The planted numbers' dtypes leave as structure, known to each call without a device sync.
    return out, flat, changes, hide_static(numbers_)


def run_walk(f, policy, reap, plants, args, kwargs):
    """Runs the walk of `f` under `policy`; returns (out, reaps)."""
    for walked in getattr(_walking, "stack", ()):
        walked.update(policy.tag.tags if isinstance(policy.tag, Tags) else (policy.tag,))
    fn, bound = unwrap(f)
    dynamic, static, nodes, stateful = _taken_apart(bound, policy, reap, plants, args, kwargs)
    # Already being staged (under jit, scan, ..., or a vmap or grad inside one): the
    # outer trace is the cache, and walking in place saves a nested jit for XLA to
    # inline (and, under vmap, batching the walk's jaxpr after the fact).
    in_place = _jax.staged_beneath() or fn in _eager_only
    if in_place or (static.differentiating and fn in _rule_walks):
        out, flat, changes, _ = _walk(fn, dynamic, static)  # its numbers checked as traced
    else:
        try:
            out, flat, changes, planted = compiled(fn, dynamic, Key(_walk_staged, static, _alike))
            # A Python number planted where its site's dtype cannot hold it (-1 into uint8,
            # 1e39 into float32), which the traced cast would wrap silently: refused. Cheap:
            # the numbers are Python values on the host, no device is waited for.
            for position, site, what, dtype in reveal_static(planted) if planted else ():
                if isinstance(dynamic[position], numbers.Number):
                    site.check_held(dynamic[position], what, dtype)
        except _WalkInPlace as walk_in_place:
            # Remember not to try compiling `fn` again (for this reason).
            walk_in_place.remember.add(fn)
            out, flat, changes, _ = _walk(fn, dynamic, static)
    write_back(nodes, changes, stateful)
    return reveal_static(out), nested_dict(flat)


def _taken_apart(bound, policy, reap, plants, args, kwargs):
    """(the traced leaves, the `_Static` key, the NNX nodes split, the `Stateful` objects)
    of one call binding `bound`. What the call is given is flattened once, up
    to its NNX nodes (each a marker, their state's leaves after the plants') and
    `Stateful` objects (flattened through, if any: their state is traced)."""
    given = (bound, args, kwargs)
    with flattening_call():
        leaves, treedef = jax.tree_util.tree_flatten(given, is_leaf=has_state_of_its_own)
        graph, nodes, stateful = None, (), ()
        if any(map(has_state_of_its_own, leaves)):
            stateful = tuple(x for x in leaves if isinstance(x, Stateful))
            if stateful:
                leaves, treedef = jax.tree_util.tree_flatten(given, is_leaf=is_graph_node)
            leaves, graph, nodes = split_leaves(leaves)
        planted, planted_def = jax.tree_util.tree_flatten(code_as_data(plants))
    state = () if graph is None else graph.leaves
    flat = [*leaves, *planted, *state]
    traced = array_flags(leaves) + [*map(traced_as_data, planted)] + state_flags(graph)
    static = _Static(
        with_graph(jax.tree_util.treedef_tuple((treedef, planted_def)), graph),
        () if all(traced) else static_leaves(flat, traced),
        policy,
        reap,
        not _jax.is_eager() and _jax.differentiating(),
    )
    return list(itertools.compress(flat, traced)), static, nodes, stateful


# Functions whose walk cannot be compiled, because they bind a primitive that has
# an implementation but no XLA lowering (oryx's tests define one): walked op by op,
# as JAX runs them outside `jit`.
_eager_only: weakref.WeakSet[Callable] = weakref.WeakSet()
# Functions holding a custom_jvp whose JVP rule sows: differentiated from outside,
# they are walked in place, where JAX calls the rules (see `_rules/calls`); a staged
# walk sees only primals, so no rule runs.
_rule_walks: weakref.WeakSet[Callable] = weakref.WeakSet()


class _WalkInPlace(Exception):
    """Raised while staging a walk that must run in place; `remember` is the set of
    functions (`_eager_only`, `_rule_walks`) that ``fn`` joins."""

    def __init__(self, remember: weakref.WeakSet[Callable]) -> None:
        self.remember = remember


def _lowerable(jaxpr):
    return all(
        _jax.has_lowering(eqn.primitive) and all(_lowerable(j) for j in _jax.sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def _resolve_plants(plants, sites, policy, filtered):
    """Matches a nested {name: value} dict to the sites it plants into.

    `filtered` holds the names of the tag that `names=`/`exclude=` leave out."""
    resolved = {}
    # Dotted paths and nested dicts are interchangeable: {"b.h": v} == {"b": {"h": v}}.
    dotted = {path_str(p): p for p in sites}
    left_out = {path_str(p) for p in filtered}

    def visit(d, prefix):
        for key, value in d.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if name in dotted:
                path = dotted[name]
                if path in resolved:
                    raise ValueError(
                        f"plants give {name!r} twice (once as a dotted name, once nested). Give it once."
                    )
                resolved[path] = Plant(sites[path], value)
            elif isinstance(value, dict) and any(n.startswith(name + ".") for n in dotted):
                visit(value, name)
            elif policy.strict_names:
                # Under a `Tags` walk, names are dotted with their tag in front.
                tag, shown, names = policy.tag, name, list(dotted)
                if isinstance(tag, Tags):
                    tag, _, shown = name.partition(".")
                    names = [n.partition(".")[2] for n in names if n.startswith(tag + ".")]
                if name in left_out:
                    raise KeyError(
                        f"Cannot plant {shown!r}: it is sown with tag {tag!r}, but this plant's "
                        "selection (names=/exclude=; oryx's allowlist/blocklist) leaves it out. "
                        "Select it, or leave it out of plants."
                    )
                raise KeyError(
                    f"Cannot plant {shown!r}: no sow site of tag {tag!r} has that name. Names "
                    f"sown with that tag: {_errors.listed(names, shown)}."
                )

    visit(plants, ())
    return resolved


def code_of(f: Any) -> Any:
    """What runs when `f` is called, to name it: the function `inspect.unwrap(f)` ends
    at, or the `__call__` of the object it ends at (a model, an instrumented one's target)."""
    end = inspect.unwrap(f)
    return end if inspect.isroutine(end) else type(end).__call__
