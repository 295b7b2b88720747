"""reap, plant, harvest, call_and_reap and nest: one walk, four faces.

Each is `transform` with a different policy and plants, and a choice of
what the transformed function returns. `run_walk` stages the whole
walk inside a `jax.jit`, so a harvested function called again with the same
shapes is neither re-traced nor re-compiled, and under an outer `jit` it costs
what the hand-written function returning the same values costs.

The jit is made once per underlying Python function and held weakly by it:
its compiled programs live as long as the function does, as `jax.jit(f)`'s
do, so harvesting fresh closures in a loop does not pile up programs. Bound
methods and `functools.partial` are unwrapped to their function; what they
bind (the object, the partial's arguments) is passed as data, its arrays
traced and the rest part of the cache key. Flax NNX graph nodes among that
data are split into a static graph and traced state (see `_calling`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import numbers
import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any, Concatenate, NamedTuple

import jax
import jax.numpy as jnp

from . import _errors, _jax
from ._calling import (
    GraphShape,
    array_flags,
    closure_of,
    flattening_call,
    globals_read,
    holds_no_nodes,
    is_array,
    make_jaxpr,
    reveal_static,
    split_nodes,
    stateful_objects,
    static_key,
    with_closure,
    write_back,
)
from ._compile_cache import jit_per_function, note_trace, note_unhashable
from ._eager_dispatch import NOT_TAKEN
from ._inspect import sow_equations
from ._interpreter import NameFilter, Policy, Tags, Walk, interpret, sites_in
from ._interventions import code_as_data
from ._occurrences import Plant, needs_batched_site, occurrences
from ._paths import nested_dict, path_str
from ._primitive import batching_sites
from ._rules.calls import holds_rule_sows
from ._site import Site
from ._sow import DEFAULT_TAG
from ._typing import NameSelect, P, Plants, R, Reaped


def _is_traced(leaf, data):
    """Arrays are traced (see `_calling`); so are numbers given as planted values
    or held in NNX state, which are data, not configuration: sweeping them does
    not recompile."""
    return is_array(leaf) or (data and isinstance(leaf, numbers.Number) and _traceable(leaf))


def _traceable(number):
    """Whether a Python number traced keeps its value for any site: not a bool
    (it would trace as bool, not the site's dtype) nor an int beyond int32."""
    if isinstance(number, bool):
        return False
    return not isinstance(number, int) or -(2**31) <= number < 2**31


class _Static:
    """Everything about a call that is not an array: the jit cache key, hashed
    once (a call looks it up twice: whether it can be cached, and its program)."""

    __slots__ = (
        "treedef",
        "static_leaves",
        "policy",
        "reap",
        "differentiating",
        "_fields",
        "_hash",
    )

    def __init__(
        self,
        treedef: Any,
        static_leaves: tuple,  # (index, type, leaf, its `static_key`) for each leaf not traced;
        # the type keeps 1, 1.0 and True apart, the key -0.0 and 0.0 and a mutated config
        policy: Policy,
        reap: bool,
        differentiating: bool = False,  # a jvp/linearize outside the call (see `_RunsRules`)
    ) -> None:
        self.treedef, self.static_leaves, self.policy = treedef, static_leaves, policy
        self.reap, self.differentiating = reap, differentiating
        self._fields = (treedef, static_leaves, policy, reap, differentiating)
        self._hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._fields)  # raises TypeError for an unhashable leaf
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._fields == other._fields


# -- the callable, split into a plain function and the data bound to it ------


def _unwrap(f: Any) -> tuple[Any, Any]:
    """(function, bound data) such that `_rewrap(function, data)` behaves as `f`."""
    if isinstance(f, functools.partial):
        fn, inner = _unwrap(f.func)
        return fn, ("partial", inner, f.args, f.keywords)
    if inspect.ismethod(f):
        return f.__func__, ("method", f.__self__)
    if inspect.isfunction(f):
        return f, None
    # Any other callable object (a module, say): its class's __call__ plus itself.
    return type(f).__call__, ("method", f)


def _rewrap(fn, data):
    if data is None:
        return fn
    if data[0] == "method":
        return functools.partial(fn, data[1])
    _, inner, args, keywords = data
    return functools.partial(_rewrap(fn, inner), *args, **keywords)


class _Call(NamedTuple):
    """What one call of a harvested function is given, in parts."""

    bound: Any  # what the callable binds (see `_unwrap`)
    plants: Any
    args: tuple
    kwargs: dict
    graph: Any  # the NNX graph nodes' split state (see `_calling`)
    cells: tuple  # what the function closes over (see `_calling.closure_of`)
    globals: tuple  # the module-level values it reads, keyed (see `_calling.globals_read`)


# The parts whose numbers are data, traced rather than static.
_DATA_PARTS = frozenset({"plants", "graph"})


def _traced_leaves(leaves: list[Any], treedef: Any) -> list[bool]:
    """Per leaf of a `_Call` flattened as `leaves` and `treedef`: whether it is traced."""
    traced = array_flags(leaves)
    if all(traced):
        return traced
    start = 0
    for part, child in zip(_Call._fields, treedef.children()):
        end = start + child.num_leaves
        if part in _DATA_PARTS and not all(traced[start:end]):
            traced[start:end] = [
                t or _is_traced(leaf, True) for t, leaf in zip(traced[start:end], leaves[start:end])
            ]
        start = end
    return traced


def _walk(fn, dynamic, static: _Static, staged=False, batched=frozenset()):
    leaves, dyn = [], iter(dynamic)
    static_at = {i: leaf for i, _, leaf, _ in static.static_leaves}
    for i in range(static.treedef.num_leaves):
        leaves.append(static_at[i] if i in static_at else next(dyn))
    call_parts: _Call = jax.tree_util.tree_unflatten(static.treedef, leaves)
    bound, plants, args, kwargs, graph, cells, reads = call_parts
    if isinstance(graph, GraphShape):
        graph = graph.filled(dyn)  # the state's leaves come last

    def call(bound, cells, reads, /, *args, **kwargs):
        # `cells` and `reads` are passed, not closed over, so that NNX nodes among them are merged.
        return _rewrap(with_closure(fn, cells, reads), bound)(*args, **kwargs)

    called = bound[1] if bound is not None and bound[0] == "method" else None
    # Errors name the user's function (a model called: the method that runs it).
    model = callable(called) and fn is type(called).__call__
    call.__wrapped__ = _code_of(called) if model else fn  # type: ignore[attr-defined]

    # Trace with the arrays as inputs and everything else (numbers, flags,
    # strings) closed over, as jit's static arguments would be.
    with _tags_walked_inside() as inner_tags, batching_sites(batched):
        closed, arrays, out_shape = make_jaxpr(
            call, (bound, cells, reads, *args), kwargs, graph, return_shape=True
        )
    if staged and not _lowerable(closed.jaxpr):
        raise _Unlowerable
    if staged and static.differentiating and holds_rule_sows(closed.jaxpr, static.policy):
        raise _RunsRules
    policy = static.policy
    key = policy.key  # a site's path, or (tag, *path) for a walk of several `Tags`
    first: dict[tuple, int] = {}  # key -> rank of its first sow in program order
    for eqn, _, _ in sow_equations(closed.jaxpr):
        first.setdefault(key(Site.of(eqn)), len(first))
    for path in sorted({key(site) for site in sites_in(closed.jaxpr)} - first.keys()):
        first[path] = len(first)  # sown only in a custom_jvp rule: after the others
    handled: dict[tuple, Site] = {}
    filtered = set()
    for site in sites_in(closed.jaxpr):
        if policy.covers(site.tag) and not policy.handles(site):
            filtered.add(key(site))
        if policy.handles(site):
            known = handled.setdefault(key(site), site)
            if known.mode is not site.mode:
                raise _errors.modes_differ(site, known)
    handled = dict(
        sorted(handled.items(), key=lambda item: first[item[0]])
    )  # program order, for messages
    _check_paths_distinct(list(handled) + sorted(filtered - handled.keys(), key=first.__getitem__))
    multi = isinstance(policy.tag, Tags)  # layers' own tags, each checked by the layer
    if static.reap and policy.strict_names and not handled and not filtered and not multi:
        tags = {site.tag for site in sites_in(closed.jaxpr)}
        if tags and policy.tag not in tags | _LAYER_TAGS | inner_tags:
            raise _errors.tag_matches_no_site(policy.tag, sorted(tags, key=str))
    if policy.strict_names:
        tagged = sorted(filtered.union(handled), key=first.__getitem__)
        policy.select.check_allowlist([path_str(p) for p in tagged], "allowlist entry", policy.tag)
    resolved = _resolve_plants(plants, handled, policy, filtered)
    per_example = {(p.site.tag, p.site.path) for p in resolved.values() if _per_example(p)}
    per_example |= {
        (site.tag, site.path)
        for site in sites_in(closed.jaxpr)
        if key(site) in resolved and needs_batched_site(resolved[key(site)], site)
    }
    if per_example and not batched:
        # Sites vmap left unbatched (their value does not depend on the batched
        # input), planted one value per example, and callables planted at sites
        # whose leaves vmap batched apart: traced again with them batched.
        return _walk(fn, dynamic, static, staged, frozenset(per_example))
    for planted in resolved.values():
        planted.check_count(occurrences(closed.jaxpr, planted.site))
    _refuse_batched_lax_map(closed.jaxpr, policy, resolved, static.reap)
    walk = Walk(policy, resolved, static.reap)
    outs = interpret(walk, closed.jaxpr, closed.consts, arrays)
    out, changes = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    results = walk.results()
    return (
        out,
        _InOrder({path: results[path] for path in sorted(results, key=first.__getitem__)}),
        changes,
    )


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


def _refuse_batched_lax_map(jaxpr, policy, plants, reaping):
    """`lax.map(f, xs, batch_size=b)` runs `f` vmapped over batches of `b`: a sow
    there fires once per batch with a `[b, ...]` value, so what would be reaped,
    or which plant row goes where, depends on `b`. Only a plant that means the
    same for every element (one value, broadcast to each) is allowed."""
    for eqn, _, _ in sow_equations(jaxpr):
        site = Site.of(eqn)
        if not policy.handles(site) or not _jax.staged_by_batched_lax_map(eqn.source_info):
            continue
        plant = plants.get(policy.key(site))
        if plant is None and reaping:
            raise _errors.sown_in_batched_lax_map(site, "reap")
        if plant is not None and not _one_value_per_element(plant.value, site):
            raise _errors.sown_in_batched_lax_map(site, "plant")


def _one_value_per_element(value, site):
    """Whether `value` is one value shaped as the site's per-element value (its vmap axes left out)."""
    if callable(value):
        return False
    leaves, tree = jax.tree_util.tree_flatten(value)
    return tree == site.tree and all(
        jnp.shape(leaf) == aval.shape[batch:]
        for leaf, aval, batch in zip(leaves, site.avals, site.vmapped or (0,) * len(leaves))
    )


# Tags that harvest's own layers reap whether or not a program sows them
# (harvest.ppl asks every model for its deterministic sites, say): reaping
# them finds {} quietly. Each layer declares its own with `layer_tag`.
_LAYER_TAGS: set[str] = set()


def layer_tag(tag: str) -> str:
    """Declares ``tag`` one that a layer of harvest reaps speculatively, so that a
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


def _note_walked(tag):
    for tags in getattr(_walking, "stack", ()):
        tags.add(tag)


def _check_paths_distinct(paths):
    """Every dotted path names one site: no two sites spell the same (a name
    ``b.h`` under scope ``a`` and a name ``h`` under scopes ``a``, ``b``)."""
    spelled = {}
    for path in paths:
        other = spelled.setdefault(path_str(path), path)
        if other != path:
            raise _errors.paths_collide(other, path)


class _InOrder(dict):
    """Reaped values by path, in program order: a pytree whose key order is
    static data, so it survives the jit (which would sort a dict's keys)."""


jax.tree_util.register_pytree_node(
    _InOrder,
    lambda d: (list(d.values()), tuple(d)),
    lambda keys, values: _InOrder(zip(keys, values)),
)


def _walk_weak(fn_ref, dynamic, static):
    # Traces alike but for Python values (a new number, a fresh closure) count together.
    alike = (
        static.treedef,
        tuple(kind for _, kind, _, _ in static.static_leaves),
        static.policy,
        static.reap,
    )
    note_trace(fn_ref(), dynamic, alike)
    return _walk(fn_ref(), dynamic, static, staged=True)


def run_walk(f, policy, reap, plants, args, kwargs, finish=True):
    """Runs the walk of `f` under `policy`; returns (out, reaps). With `finish=False`,
    as the compiled walk gives them: `out` with its static leaves wrapped, the reaps
    flat and in program order (pytrees a `jax.jit` can return; see `_eager_dispatch`)."""
    for tag in policy.tag.tags if isinstance(policy.tag, Tags) else (policy.tag,):
        _note_walked(tag)
    fn, bound = _unwrap(f)
    with flattening_call():
        cells, reads = closure_of(fn), globals_read(fn)
        if holds_no_nodes((bound, args, kwargs, cells, reads)):
            stateful, graph, nodes = (), None, ()
        else:
            stateful = stateful_objects((bound, args, kwargs))
            # NNX nodes the function closes over or reads from its module are split as arguments are.
            (bound, args, kwargs, cells, reads), graph, nodes = split_nodes(
                (bound, args, kwargs, cells, reads)
            )
        state: tuple[Any, ...] = ()
        apart = None if graph is None else graph.apart()
        if apart is not None:
            graph, state = apart  # a model's state goes straight to the traced leaves
        call_parts = _Call(bound, code_as_data(plants), args, kwargs, graph, cells, reads)
        leaves, treedef = jax.tree_util.tree_flatten(call_parts)
        traced = _traced_leaves(leaves, treedef)
    dynamic = [*itertools.compress(leaves, traced), *state]
    static = _Static(
        treedef,
        tuple(
            (i, type(leaves[i]), leaves[i], static_key(leaves[i]))
            for i in itertools.compress(range(len(leaves)), map(operator.not_, traced))
        ),
        policy,
        reap,
        _jax.differentiating(),
    )
    if _jax.staged_beneath() or (static.differentiating and fn in _rule_walks):
        # Already being staged (under jit, scan, ..., or a vmap or grad inside one):
        # the outer trace is the cache, and walking in place saves a nested jit for
        # XLA to inline (and, under vmap, batching the walk's jaxpr after the fact).
        out, flat, changes = _walk(fn, dynamic, static)
    else:
        try:
            hash(static)
            jitted = (
                functools.partial(_walk, fn)
                if fn in _eager_only
                else jit_per_function(fn, _walk_weak)
            )
        except TypeError:
            # An unhashable non-array argument (a mutable config object, say), or
            # a function that cannot be weakly referenced: still correct, just
            # traced at every call, with nothing cached that could go stale.
            note_unhashable(fn, [leaf for _, _, leaf, _ in static.static_leaves])
            jitted = functools.partial(_walk, fn)
        try:
            out, flat, changes = jitted(dynamic, static)
        except _Unlowerable:
            # `f` binds a primitive that has an implementation but no XLA lowering
            # (oryx's tests define one): run the walk op by op, as JAX runs `f`
            # itself outside `jit`, and remember not to try compiling it again.
            _eager_only.add(fn)
            out, flat, changes = _walk(fn, dynamic, static)
        except _RunsRules:
            _rule_walks.add(fn)
            out, flat, changes = _walk(fn, dynamic, static)
    write_back(nodes, changes, stateful)
    if not finish:
        return out, flat
    return reveal_static(out), nested_dict(flat)


# Functions whose walk cannot be compiled, because they bind a primitive
# without a lowering; they are walked eagerly.
_eager_only: weakref.WeakSet[Callable] = weakref.WeakSet()


class _Unlowerable(Exception):
    """Raised while staging the walk of a function that cannot be compiled."""


# Functions holding a custom_jvp whose JVP rule sows: differentiated from
# outside, they are walked in place, where JAX calls the rules (see `_rules/calls`).
_rule_walks: weakref.WeakSet[Callable] = weakref.WeakSet()


class _RunsRules(Exception):
    """Raised while staging, under a jvp or grad of the call, the walk of a function
    whose custom_jvp rules sow: a staged walk sees only primals, so no rule runs."""


def _lowerable(jaxpr):
    return all(
        _jax.has_lowering(eqn.primitive) and all(_lowerable(j) for j in _jax.sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def _resolve_plants(plants, sites, policy, filtered):
    """Matches a nested {name: value} dict to the sites it plants into.

    `filtered` holds the names of the tag that the allowlist/blocklist leaves out."""
    if plants is None:
        return {}
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
                    raise _errors.planted_twice(name)
                resolved[path] = Plant(sites[path], value)
            elif isinstance(value, dict) and any(n.startswith(name + ".") for n in dotted):
                visit(value, name)
            elif policy.strict_names and name in left_out:
                name, tag, _ = _as_sown(name, policy, ())
                raise _errors.planted_but_filtered(name, tag)
            elif policy.strict_names:
                raise _errors.planted_unknown(*_as_sown(name, policy, dotted))

    visit(plants, ())
    return resolved


def _as_sown(name, policy, names):
    """(name, tag, the tag's names) for a message about planting `name`: under a
    `Tags` walk, names are dotted with their tag in front."""
    if not isinstance(policy.tag, Tags):
        return name, policy.tag, names
    tag, _, rest = name.partition(".")
    return rest, tag, [n.partition(".")[2] for n in names if n.startswith(tag + ".")]


def _check_callable(f, fn_name):
    if not callable(f):
        raise _errors.not_callable(f, fn_name)


def _policy(tag, allowlist, blocklist, max_steps=None):
    if not isinstance(tag, str) or not tag:
        raise _errors.bad_tag(tag)
    if max_steps is not None and (
        isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
    ):
        raise _errors.bad_max_steps(max_steps)
    return Policy(tag, NameFilter.make(allowlist, blocklist), max_steps=max_steps)


def _check_plants_arg(plants, fn_name):
    if not isinstance(plants, dict):
        raise _errors.plants_not_a_dict(plants, fn_name)


def _plants_first(g: Any, f: Callable[..., Any]) -> Callable[..., Any]:
    """Gives `g(plants, *args, **kwargs)` its true signature: `f`'s with `plants`
    in front, so `jax.jit(g, static_argnums=..., donate_argnames=...)` picks the
    arguments the user means (functools.wraps alone would report `f`'s)."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to report
        return g
    taken = set(sig.parameters)
    name = "plants"
    while name in taken:
        name = "_" + name
    first = inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
    g.__signature__ = sig.replace(parameters=[first, *sig.parameters.values()])
    return g


# What a transformed function returns, from the walk's (out, reaps).
_GIVES: dict[str, Callable[[tuple[Any, Any]], Any]] = {
    "out": lambda result: result[0],
    "reaps": lambda result: result[1],
    "both": lambda result: result,
}


def transform(
    f: Callable,
    fn_name: str,
    policy: Policy,
    *,
    takes_plants: bool,
    gives: str,
    reword: Callable[[ValueError], ValueError | None] | None = None,
) -> Callable:
    """`f` walked under `policy`: the function the transformation `fn_name` returns.

    With `takes_plants` it is called as `g(plants, *args, **kwargs)`, else as
    `g(*args, **kwargs)`. It returns `gives` of the walk: `"out"`, `"reaps"` or
    `"both"` (`(out, reaps)`); the walk reaps only if the reaps are returned.
    `reword` maps an error of the walk to the one to raise instead (None: as is).
    """
    _check_callable(f, fn_name)
    reap, pick = gives != "out", _GIVES[gives]
    # A target that JAX's own dispatch can call eagerly (an instrumented function) says so.
    dispatcher = getattr(type(f), "harvest_eager_dispatch", None)
    dispatch = None if dispatcher is None else dispatcher(f, policy, gives, run_walk)

    def run(plants: Any, args: tuple, kwargs: dict) -> Any:
        try:
            result = NOT_TAKEN if dispatch is None else dispatch(plants, args, kwargs)
            if result is NOT_TAKEN:
                result = run_walk(f, policy, reap, plants, args, kwargs)
            return pick(result)
        except ValueError as error:
            better = reword(error) if reword is not None else None
            if better is None:
                raise
            raise better from error

    if not takes_plants:

        @functools.wraps(f)
        def transformed(*args: Any, **kwargs: Any) -> Any:
            return run({}, args, kwargs)

        return _jax.api_boundary(_unwrapped_to_code(transformed, f))

    @functools.wraps(f)
    def transformed_with_plants(plants: Any, *args: Any, **kwargs: Any) -> Any:
        _check_plants_arg(plants, fn_name)
        return run(plants, args, kwargs)

    return _plants_first(_jax.api_boundary(_unwrapped_to_code(transformed_with_plants, f)), f)


def _unwrapped_to_code(g: Any, f: Any) -> Any:
    """`g` (`functools.wraps(f)`), its `__wrapped__` leading past a model -- a callable
    pytree holding arrays, such as an instrumented or Equinox module -- to the method
    that runs it: `inspect.unwrap`, which names the traced function in JAX's errors,
    still ends at the user's code, and Equinox does not take `g` for a transformed
    callable hiding parameters (`eqx.filter_jit(reap(model))` warned). The signature
    shown stays `f`'s."""
    if inspect.isroutine(inspect.unwrap(f)) or not any(map(is_array, jax.tree_util.tree_leaves(f))):
        return g
    try:
        g.__signature__ = inspect.signature(f)
    except (TypeError, ValueError):  # no signature to show
        pass
    g.__wrapped__ = _code_of(f)
    return g


def _code_of(f: Any) -> Any:
    """What runs when `f` is called, to name it: the function `inspect.unwrap(f)` ends
    at, or the `__call__` of the object it ends at (a model, an instrumented one's target)."""
    end = inspect.unwrap(f)
    return end if inspect.isroutine(end) else type(end).__call__


def reap(
    f: Callable[P, Any],
    *,
    tag: str = DEFAULT_TAG,
    allowlist: NameSelect = None,
    blocklist: NameSelect = None,
    max_steps: int | None = None,
) -> Callable[P, Reaped]:
    """Returns a function with ``f``'s signature that returns ``{name: value}`` of ``f``'s sows.

    How occurrences accumulate is decided by each site's mode (see ``sow``):
    under the default ``"collect"``, each value is a tuple of occurrences, so
    sow with ``mode="strict"`` to reap a site sown once as a plain array.
    Nested ``nest`` scopes come back as nested dicts. Names come in program
    order (by first occurrence), at every level; under an outer ``jax.jit``,
    JAX returns any dict with its keys sorted.

    Inside a ``lax.while_loop``, whose trip count is known only when it runs,
    ``instrument``'s sites give the last iteration's value, as ``clobber`` does;
    ``max_steps=N`` records the first ``N`` iterations instead: each name sown
    in the loop's body with a stacking mode (``collect``, ``append``,
    ``instrument``'s) comes back as ``harvest.Steps(values, count)``, ``values``
    shaped as a ``scan`` of ``N`` iterations would reap it and ``count`` the
    iterations that ran.

    Arguments are taken as ``equinox.filter_jit`` takes them, here and in every
    other transformation: JAX and NumPy arrays are traced; every other leaf
    (Python numbers, bools, None, strings, callables, enums, configs) reaches
    ``f`` as itself and is part of the compile-cache key, so a new value
    re-traces (a loop over many distinct Python floats compiles once per float;
    pass such a number as an array to trace it). Flax NNX modules, as ``f``,
    its ``self`` or arguments, are split and merged as ``nnx.jit`` does, so the
    call leaves their state (batch statistics, RNG counters, intermediates)
    as a direct call would.

    Args:
        f: the function to run: any JAX-traceable callable (a function, a bound
            method, an NNX or Equinox module, an ``instrument``-ed model).
        tag: which sows to read; sows of other tags pass through untouched.
        allowlist: if given, read only these names: exact names, glob patterns
            (``"blocks.*"``) or predicates on names. A string that matches no site
            of ``tag`` is an error listing the names there are (a predicate may
            match nothing).
        blocklist: names never to read, in the same forms as ``allowlist``.
        max_steps: if given (a positive int), record the first ``max_steps``
            iterations of each ``while_loop`` as ``harvest.Steps``; ``None`` keeps
            each while_loop's last iteration of ``instrument``'s sites.

    Returns:
        A function taking ``f``'s arguments and returning the dict of reaped
        values (``f``'s own output is discarded; see ``call_and_reap``).

    Raises:
        ValueError: when the returned function is called: a name in
            ``allowlist`` that no site has, a ``strict`` site sown twice, or a sow
            where its mode cannot be honoured (e.g. ``append`` in a ``while_loop``
            without ``max_steps``); at once, a ``max_steps`` that is not a positive int.
        TypeError: if ``f`` is not callable, or ``tag`` is not a non-empty string.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sow, reap
        >>> def f(x):
        ...     h = sow(jnp.tanh(x), name="h", mode="strict")
        ...     return 2.0 * h
        >>> reap(f)(jnp.zeros(2))
        {'h': Array([0., 0.], dtype=float32)}
        >>> jax.jit(reap(f))(jnp.zeros(2))["h"].shape
        (2,)
        >>> def g(x, n, training=False):  # Python values stay Python values
        ...     for i in range(n):
        ...         x = sow(x + 1.0, name=f"step{i}", mode="strict")
        ...     return x * 0.5 if training else x
        >>> sorted(reap(g)(jnp.zeros(2), 3, training=True))
        ['step0', 'step1', 'step2']
    """
    return transform(
        f, "reap", _policy(tag, allowlist, blocklist, max_steps), takes_plants=False, gives="reaps"
    )


def call_and_reap(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    allowlist: NameSelect = None,
    blocklist: NameSelect = None,
    max_steps: int | None = None,
) -> Callable[P, tuple[R, Reaped]]:
    """Like ``reap``, but the function returns ``(f's output, {name: value})``.

    Args:
        f: the function to run, as for ``reap``.
        tag: which sows to read; sows of other tags pass through untouched.
        allowlist: if given, read only these names (exact names, glob patterns or
            predicates on names), as for ``reap``.
        blocklist: names never to read, in the same forms as ``allowlist``.
        max_steps: how many iterations of each ``while_loop`` to record, as for
            ``reap``.

    Returns:
        A function taking ``f``'s arguments and returning ``(output, reaped)``.

    Raises:
        ValueError: when the returned function is called, as for ``reap``.
        TypeError: if ``f`` is not callable, or ``tag`` is not a non-empty string.

    Example:
        >>> from harvest import sow, call_and_reap
        >>> f = lambda x: sow(x + 1.0, name="y", mode="strict") * 3.0
        >>> call_and_reap(f)(1.0)
        (Array(6., dtype=float32, weak_type=True), {'y': Array(2., dtype=float32, weak_type=True)})
    """
    return transform(
        f,
        "call_and_reap",
        _policy(tag, allowlist, blocklist, max_steps),
        takes_plants=False,
        gives="both",
    )


def plant(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    allowlist: NameSelect = None,
    blocklist: NameSelect = None,
) -> Callable[Concatenate[Plants, P], R]:
    """Returns ``g(plants, *args, **kwargs)``: ``f`` with the planted sows replaced.

    ``plants`` maps names to replacement values, shaped as ``reap`` returns them
    (a tuple per ``collect`` name, a stacked array per ``append`` name), or to a
    single value used at every occurrence, or to a callable ``old -> new`` (an
    intervention: ablate, add a vector, patch a slice). A callable that
    requires a second positional argument is called as ``fn(old, index)``, with
    the occurrence's row in what ``reap`` returns for the name (traced inside a
    ``scan``). Names under ``nest`` scopes are given as nested dicts or as dotted
    paths (``{"block.h": v}`` is ``{"block": {"h": v}}``).

    Args:
        f: the function to run, as for ``reap``.
        tag: which sows may be replaced; sows of other tags pass through untouched.
        allowlist: if given, only these names may be planted (exact names, glob
            patterns or predicates on names).
        blocklist: names never to plant, in the same forms as ``allowlist``.

    Returns:
        A function taking ``plants`` first, then ``f``'s arguments, and returning
        ``f``'s output with the plants in place.

    Raises:
        ValueError: when the returned function is called: planting a name no
            site of ``tag`` has (the message lists the names there are), or a
            replacement whose shape does not match the site.
        TypeError: if ``f`` is not callable, ``tag`` is not a non-empty string,
            or ``plants`` is not a dict.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sow, plant
        >>> def f(x):
        ...     h = sow(x + 1.0, name="h", mode="strict")
        ...     return h * 10.0
        >>> plant(f)({"h": 0.5}, 1.0)
        Array(5., dtype=float32, weak_type=True)
        >>> plant(f)({"h": lambda h: -h}, 1.0)
        Array(-20., dtype=float32, weak_type=True)
        >>> def g(xs):  # a callable taking a second argument sees the occurrence index
        ...     step = lambda c, x: (c + sow(x, name="x", mode="append"), None)
        ...     return jax.lax.scan(step, 0.0, xs)[0]
        >>> plant(g)({"x": lambda old, i: jnp.where(i == 2, 0.0, old)}, jnp.ones(4))
        Array(3., dtype=float32)
    """
    return transform(f, "plant", _policy(tag, allowlist, blocklist), takes_plants=True, gives="out")


def harvest(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    allowlist: NameSelect = None,
    blocklist: NameSelect = None,
    max_steps: int | None = None,
) -> Callable[Concatenate[Plants, P], tuple[R, Reaped]]:
    """Returns ``g(plants, *args, **kwargs) -> (out, reaps)``: plant and reap in one walk.

    Args:
        f: the function to run, as for ``reap``.
        tag: which sows to plant and read; sows of other tags pass through.
        allowlist: if given, only these names are planted or read (exact names,
            glob patterns or predicates on names).
        blocklist: names never planted or read, in the same forms as ``allowlist``.
        max_steps: how many iterations of each ``while_loop`` to record, as for
            ``reap``.

    Returns:
        A function taking ``plants`` first (as for ``plant``), then ``f``'s
        arguments, and returning ``(output, reaps)``, where ``reaps`` holds the
        names of ``tag`` that were not planted.

    Raises:
        ValueError: when the returned function is called, as for ``reap`` and
            ``plant``.
        TypeError: if ``f`` is not callable, ``tag`` is not a non-empty string,
            or ``plants`` is not a dict.

    Example:
        >>> from harvest import sow, harvest
        >>> def f(x):
        ...     a = sow(x + 1.0, name="a", mode="strict")
        ...     b = sow(a * 2.0, name="b", mode="strict")
        ...     return b
        >>> out, reaps = harvest(f)({"a": 10.0}, 1.0)
        >>> out, reaps["b"]
        (Array(20., dtype=float32, weak_type=True), Array(20., dtype=float32, weak_type=True))
    """
    return transform(
        f, "harvest", _policy(tag, allowlist, blocklist, max_steps), takes_plants=True, gives="both"
    )


def harvest_tags(
    f: Callable[P, R], tags: Any, allowlist: NameSelect = None
) -> Callable[Concatenate[Plants, P], tuple[R, Reaped]]:
    """``harvest`` of several tags in one walk (for harvest's layers, not public):
    ``g(plants, *args, **kwargs) -> (out, reaps)`` with plants and reaps keyed
    ``{tag: {name: value}}``. One walk re-binds the program once, where nesting
    one ``harvest`` per tag re-binds it once per tag; sows of other tags, and those
    ``allowlist`` leaves out (it sees names dotted with their tag, ``"tag.name"``),
    pass through."""
    policy = Policy(Tags(frozenset(tags)), NameFilter.make(allowlist))
    return transform(f, "harvest", policy, takes_plants=True, gives="both")


def nest(f: Callable[P, R], *, scope: str) -> Callable[P, R]:
    """Puts every name sown inside ``f`` (of any tag) under ``scope``.

    Reaped values come back as ``{scope: {name: value}}``, and plants are given
    the same way. Nesting ``nest`` nests the dicts.

    Args:
        f: the function whose sows to scope.
        scope: the key the names go under (a non-empty string).

    Returns:
        A function with ``f``'s signature and output, whose sites are named
        ``scope.name``.

    Raises:
        TypeError: if ``f`` is not callable, or ``scope`` is not a non-empty string.

    Example:
        >>> from harvest import sow, reap, nest
        >>> def layer(x):
        ...     return sow(x * 2.0, name="out", mode="strict")
        >>> def f(x):
        ...     return nest(layer, scope="l2")(nest(layer, scope="l1")(x))
        >>> reaped = reap(f)(1.0)
        >>> reaped["l1"]
        {'out': Array(2., dtype=float32, weak_type=True)}
        >>> reaped["l2"]
        {'out': Array(4., dtype=float32, weak_type=True)}
    """
    _check_callable(f, "nest")
    if not isinstance(scope, str) or not scope:
        raise _errors.bad_nest_scope(scope)
    if "." in scope:
        raise _errors.dotted_nest_scope(scope)
    return transform(f, "nest", Policy(None, prefix=(scope,)), takes_plants=False, gives="out")
