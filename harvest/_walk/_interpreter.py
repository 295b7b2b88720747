"""The one walk over a jaxpr that serves reap, plant, harvest and nest.

`interpret(walk, jaxpr, consts, args)` evaluates a jaxpr equation by equation
under whatever trace is current. An equation whose primitive's registration
(`_higher_order.REGISTRY`) has a rule, and whose body holds a sow this walk
cares about, goes to that rule; everything else is re-bound untouched (keeping
its compile cache and custom derivatives). The `Walk` says what to do at each
sow: plant it, reap it, or re-emit it for an outer harvest of another tag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import threading
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .. import _errors, _jax
from . import _errors as walk_errors
from ._evaluator import evaluate
from ._higher_order import describe
from ._occurrences import Element, Record, select_where
from ._paths import path_str
from ._primitive import sow_p
from ._site import Site
from ._sow_index import sites_in


def program_sites(jaxpr, differentiating: bool) -> frozenset[Site]:
    """The sites a walk of `jaxpr` may meet: `sites_in`, and where JAX
    differentiates the call, those of the JVP rules of its custom_jvp calls
    (traced then only: a rule that raises, or that JAX cannot trace before it
    differentiates, must not make an undifferentiated walk fail)."""
    found = sites_in(jaxpr)
    return found.union(*map(rule_sites, _equations(jaxpr))) if differentiating else found


def _equations(jaxpr) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _jax.sub_jaxprs(eqn):
            yield from _equations(sub)


# Sows in a custom_jvp's JVP rule run where the function is differentiated
# (see `_rules/calls`). Calls inside a rule run their own rules only under a
# second derivative, and a rule that calls its own function would nest without
# end, so a rule's rules are not looked into.
_in_rule = threading.local()  # .depth: how many rules the current walk is inside


@contextlib.contextmanager
def inside_rule() -> Iterator[None]:
    _in_rule.depth = getattr(_in_rule, "depth", 0) + 1
    try:
        yield
    finally:
        _in_rule.depth -= 1


def jvp_rule(eqn: Any) -> tuple[_jax.ClosedJaxpr, list[bool]] | None:
    """(the JVP rule of a custom_jvp equation, its output tangents' zero flags),
    or None inside a rule or where the rule cannot be traced."""
    rule = describe(eqn).jvp_rule
    if rule is None or getattr(_in_rule, "depth", 0) > 0:
        return None
    return rule(eqn)


def rule_sites(eqn: Any) -> frozenset[Site]:
    """The sites in the JVP rule of `eqn` (see `jvp_rule`); traces the rule, so
    asked only where JAX differentiates `eqn`."""
    rule = jvp_rule(eqn)
    if rule is None:
        return frozenset()
    with inside_rule():
        return sites_in(rule[0].jaxpr)


# ---------------------------------------------------------------------------
# What a walk does with a sow.


@dataclasses.dataclass(frozen=True)
class NameFilter:
    """`names=`/`exclude=`: exact names, glob patterns, or predicates on names."""

    allow: tuple | None = None
    block: tuple = ()

    @staticmethod
    def make(names=None, exclude=None, spelled=("names=", "exclude=")):
        # `spelled`: the two arguments as the caller's API names them (oryx's differ).
        def norm(items, what):
            if items is None:
                return None
            if isinstance(items, str) or callable(items) or not isinstance(items, Iterable):
                items = (items,)
            items = tuple(items)
            for it in items:
                if not (isinstance(it, str) or callable(it)):
                    raise TypeError(
                        f"{what} takes names, glob patterns or predicates on names; got {it!r}."
                    )
            return items

        return NameFilter(norm(names, spelled[0]), norm(exclude, spelled[1]) or ())

    @staticmethod
    def _hit(items, name):
        return any(
            it(name) if callable(it) else (it == name or fnmatch.fnmatchcase(name, it))
            for it in items
        )

    def check_names(self, names, what, tag):
        """Raises if a string entry of `names=` matches none of `names` (dotted).

        Predicates are not checked: a predicate that selects nothing is how to
        say "this site may be absent" (behind a Python flag, say)."""
        missing = [
            it
            for it in self.allow or ()
            if isinstance(it, str) and not any(self._hit((it,), n) for n in names)
        ]
        if missing:
            listed = _errors.listed(names, str(missing[0]).strip("*?[]"))
            raise ValueError(
                f"{what} {', '.join(map(repr, missing))} matches no sow site of tag {tag!r}. "
                f"Names sown with that tag, in program order: {listed}. Check the spelling, or use a "
                "predicate (lambda name: ...) for a site that may be absent."
            )

    def __call__(self, path):
        name = path_str(path)
        if self.allow is not None and not self._hit(self.allow, name):
            return False
        return not self._hit(self.block, name)


@dataclasses.dataclass(frozen=True)
class Tags:
    """Several tags walked at once, as a `Policy`'s tag: one walk plants and reaps
    them all, each site filed under `(tag, *path)`, where nested walks of one tag
    each would re-bind the whole program once per tag (harvest.ppl's scores)."""

    tags: frozenset


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which sows a walk handles (plants or reaps), and how it re-emits the rest."""

    tag: Hashable | None  # a str, but any hashable under harvest.compat.oryx (as in oryx)
    select: NameFilter = NameFilter()
    prefix: tuple = ()  # `nest`: re-emitted sows get this scope in front
    exclusive: bool = False  # drop sows of other tags instead of re-emitting them
    # Planting, or selecting by string, a name no site has is an error (oryx ignores it).
    strict_names: bool = True
    drop_filtered: bool = False  # oryx: sows of `tag` that `select` filters out vanish
    max_steps: int | None = None  # record this many iterations of each while_loop (`Steps`)

    def __hash__(self):
        # Hashed once: an eager call's key holds the policy, and JAX hashes the key.
        if "_hash" not in self.__dict__:
            fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
            object.__setattr__(self, "_hash", hash(fields))
        return self.__dict__["_hash"]

    def covers(self, tag):
        """Whether sows of `tag` are this walk's (one of them, for a `Tags` walk)."""
        return tag in self.tag.tags if isinstance(self.tag, Tags) else tag == self.tag

    def key(self, site):
        """What the walk files `site` under: its path, with its tag in front for a
        `Tags` walk (whose plants and reaps are ``{tag: {name: value}}``)."""
        return (site.tag, *site.path) if isinstance(self.tag, Tags) else site.path

    def handles(self, site):
        return self.covers(site.tag) and self.select(self.key(site))

    def touches(self, sites):
        if self.prefix or self.exclusive:  # every sow is re-emitted changed, or dropped
            return bool(sites)
        return any((self.drop_filtered and self.covers(s.tag)) or self.handles(s) for s in sites)

    def reemit(self, params):
        """The params to re-emit a sow this walk does not handle with (None: drop it)."""
        if self.exclusive or (self.drop_filtered and self.covers(params["tag"])):
            return None
        if not self.prefix:
            return params
        return dict(params, scope=self.prefix + params["scope"])


def _typed_as_sown(value, site):
    """`value`, each leaf of the site's own shape typed as the site sows it (its
    sharding under Explicit mesh axes, its varying axes inside shard_map): a
    loop's carry must keep one type, and the body's sow gives it that one."""
    leaves = jax.tree_util.tree_leaves(value)
    leaves = [
        _jax.retype(leaf, aval) if jnp.shape(leaf) == aval.shape else leaf
        for leaf, aval in zip(leaves, site.avals)
    ]
    return jax.tree_util.tree_unflatten(site.tree, leaves)


def _vary_like(new, old):
    """A planted value typed as the sown one: varying over the mesh axes it did
    (inside shard_map) and, of its shape, with its sharding over Explicit mesh
    axes, as the program after the sow (a cond's other branch, say) expects."""
    if jnp.shape(new) == jnp.shape(old):
        return _jax.retype(new, old)
    return _jax.pcast_varying(new, _jax.varying_axes(old))


# ---------------------------------------------------------------------------
# The state of a walk over one jaxpr body.


def _sown_twice(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} has mode {site.mode.label} but is sown more than once. "
        + (
            walk_errors.random_variable_modes(site)
            or "Give each occurrence its own name, or use mode 'collect', 'append' or 'clobber'."
        )
    )


class Walk:
    """The state of one walk: plants coming in, records going out.

    A rule for a higher-order primitive makes a `child()` walk for the body it
    re-traces, then folds the child's records back with `absorb`.

    Args:
        policy: which sows the walk handles, and how it re-emits the others.
        plants: the values to plant, ``{path: Plant}``, as seen from this walk.
        reap: whether the walk records the sows it handles and does not plant.
    """

    def __init__(self, policy: Policy, plants: dict, reap: bool = True):
        self.policy = policy
        self.plants = plants  # path -> Plant, as seen from this walk
        self.reap = reap
        self.records: dict[tuple, Record] = {}
        self.seen: dict[tuple, int] = {}  # occurrences so far (entries, or append rows)

    def child(self, carried=None, plants=None):
        """A walk for a body that runs after what this walk has seen so far.

        Args:
            carried: ``{path: (site, value)}`` of clobber-like names to start from (None: none).
            plants: the plants the body sees (None: this walk's, shifted past what it has seen).

        Returns:
            The child ``Walk``, with the same policy and ``reap``.
        """
        if plants is None:
            plants = self.shifted_plants()
        kid = Walk(self.policy, plants, self.reap)
        for path, (site, value) in (carried or {}).items():
            kid.records[path] = Record(site, [value])
        return kid

    def shifted_plants(self):
        """This walk's plants, each shifted past the occurrences this walk has seen.

        Returns:
            ``{path: Plant}`` for a body that runs after what this walk has seen.
        """
        return {p: pl.shift(self.seen.get(p, 0)) for p, pl in self.plants.items()}

    # -- a sow fires -------------------------------------------------------
    def sow(self, site: Site, value, pred=None, role=None, element=None):
        """One sow fires: plants its value if there is a plant, else records it.

        Args:
            site: the sow's site (its tag, name, mode and value's structure).
            value: the sown value (a pytree).
            pred: a boolean array: where it is False the sow did not happen (None: it did).
            role: the sow's role from its params: ``"unplantable"``, ``"rule_replaced"``,
                ``"record_only"``, ``"plant_only"`` or None (an ordinary sow).
            element: a collect sow's ``element`` param (which element of a batched
                ``lax.map`` it sows, recorded so to be merged), or None.

        Returns:
            The value the program goes on with: the planted one, or ``value``.

        Raises:
            ValueError: if a ``"strict"`` name is sown twice, or a plant targets a
                sow whose body a custom rule replaces.
        """
        path = self.policy.key(site)
        if role == "unplantable" and path in self.plants:  # see `_rules/custom_vmap`
            raise ValueError(
                f"Cannot plant {site}: it is sown in a jax.custom_batching.custom_vmap function that runs "
                "under vmap, where JAX runs the function's batching rule instead of its body, so the "
                "planted value would change nothing. Plant outside the vmap (plant(f) inside "
                "jax.vmap), or sow in the batching rule too."
            )
        if role == "rule_replaced" and path in self.plants:  # see `_rules/calls`
            raise ValueError(
                f"Cannot plant {site}: it is sown in the body of a custom_jvp or custom_vjp function "
                "that is differentiated inside the harvested function, where JAX runs the function's "
                "rule (its JVP rule, or its forward) instead of its body, so the planted value would "
                "change nothing. Plant outside the differentiation (jax.grad(plant(f))), or sow in "
                "the rule too."
            )
        if role == "record_only":  # an occurrence counted (and planted) where it was sown
            if path not in self.plants and self.reap:
                self._record(site, value, pred, element)
            return value
        i = self.seen.get(path, 0)
        if site.mode.single and i:
            raise _sown_twice(site)
        plant = self.plants.get(path)
        if plant is not None:
            new = jax.tree_util.tree_map(_vary_like, plant.at(i, value, site), value)
            if pred is not None:
                new = jax.tree_util.tree_map(functools.partial(select_where, pred), new, value)
            value = new
        self.seen[path] = i + 1
        if plant is None and self.reap and role != "plant_only":
            self._record(site, value, pred, element)
        return value

    def _record(self, site, value, pred, element=None):
        if element is not None and site.mode.entries:
            value = Element(value, *element)  # kept apart, merged as lax.map(f, xs) stacks it
        self.records.setdefault(self.policy.key(site), Record(site, [])).add(site, value, pred)

    # -- folding a child's records back -----------------------------------
    def absorb(self, records: dict[tuple, Record], seen: dict[tuple, int]) -> None:
        """Folds a child's records (merged as each name's mode says) and occurrence counts in.

        Args:
            records: the child's records, ``{path: Record}``.
            seen: the child's occurrence counts, ``{path: count}``, added to this walk's.
        """
        for path, rec in records.items():
            mine = self.records.get(path)
            if mine is None:
                self.records[path] = Record(rec.site, list(rec.values))
                continue
            # One mode per name is checked before the walk.
            if rec.site.mode.single:
                raise _sown_twice(rec.site)
            if rec.site.mode.carried:
                mine.values = list(rec.values)
            else:
                mine.values.extend(rec.values)
        for path, n in seen.items():
            self.seen[path] = self.seen.get(path, 0) + n

    def carried(self, sites, where, batch=()):
        """(site, current value) of the reaped clobber-like names among `sites`,
        shaped as the site sows it, since `where` carries one fixed type.

        Args:
            sites: ``{path: Site}`` of the sites the body holds.
            where: the primitive that carries the values (``"scan"``, ``"cond"``, ...),
                named in the error if a value cannot take the site's shapes.
            batch: the leading axes added to every leaf (by a per-example predicate).

        Returns:
            ``{path: (site, value)}``, to pass to ``child(carried=...)``.
        """
        out = {}
        for site in sites.values():
            key = self.policy.key(site)
            if self.reap and site.mode.carried and key not in self.plants:
                rec = self.records.get(key)
                value = site.fit(rec.values[0] if rec else site.zeros(), where, batch)
                out[key] = (site, _typed_as_sown(value, site))
        return out

    def handled_sites(self, jaxprs):
        """The sites of this walk's tag inside `jaxprs`, first one per name.

        Args:
            jaxprs: the jaxprs to search (recursively, with their JVP rules).

        Returns:
            ``{path: Site}`` of the sites this walk's policy handles.
        """
        out = {}
        for j in jaxprs:
            for site in sites_in(j):
                if self.policy.handles(site):
                    out.setdefault(self.policy.key(site), site)
        return out

    def plants_inside(self, jaxprs):
        """Whether this walk plants any site inside `jaxprs`.

        Args:
            jaxprs: the jaxprs to search (recursively).

        Returns:
            True if a handled site there has a plant.
        """
        return any(path in self.plants for path in self.handled_sites(jaxprs))

    def export(self):
        """The records as a pytree of arrays, to carry out of a traced body.

        Returns:
            ``{path: list of recorded values}``.
        """
        return {path: rec.values for path, rec in self.records.items()}

    def absorb_export(self, child, exported, counts) -> None:
        """Folds a child's records, as returned by a traced body, into this walk.

        Args:
            child: the child ``Walk`` that ran inside the body.
            exported: its ``export()``, as the traced body returned it.
            counts: the occurrence counts that are arrays of the body's trace (made
                by a ``while_loop``), as the body returned them; they replace the
                child's.
        """
        records = {p: Record(child.records[p].site, list(v)) for p, v in exported.items()}
        self.absorb(records, {**child.seen, **counts})

    def results(self):
        """What the walk reaped.

        Returns:
            ``{path: value}``, each record's final value (stacked, collected or last).
        """
        return {path: rec.result() for path, rec in self.records.items()}


# ---------------------------------------------------------------------------
# The walk.


def interpret(walk: Walk, jaxpr: _jax.Jaxpr, consts, args):
    """Evaluates `jaxpr` equation by equation, its sows going through `walk`.

    Args:
        walk: the ``Walk`` that plants and records the sows.
        jaxpr: the (open) jaxpr to evaluate.
        consts: the values of its constvars.
        args: the values of its invars.

    Returns:
        The list of the jaxpr's outputs.
    """
    return evaluate(jaxpr, consts, args, functools.partial(_eval_eqn, walk))


def _eval_eqn(walk, eqn, invals):
    if eqn.primitive is sow_p:
        return sow_rule(walk, eqn, invals)
    subs = _jax.sub_jaxprs(eqn)
    how = describe(eqn)
    if how.recount is not None:  # a marker the walk keeps count by
        assert how.rule is not None
        return how.rule(walk, eqn, invals)
    if subs:
        sites = frozenset().union(*(sites_in(j) for j in subs))
        if how.jvp_rule is not None and _jax.differentiating():  # JAX runs the rule, not the body
            sites |= rule_sites(eqn)
        if walk.policy.touches(sites):
            rule = how.rule or (_walk_inlined if how.inlinable else None)
            if rule is None:
                site = next(s for s in sites if walk.policy.touches([s]))
                raise NotImplementedError(
                    f"harvest has no rule for the primitive `{eqn.primitive}`, which holds "
                    f"the sow site {site}. Move the sow outside `{eqn.primitive}`, or "
                    "file an issue naming this primitive."
                )
            return rule(walk, eqn, invals)
    return _jax.rebind(eqn, invals)


def _walk_inlined(walk, eqn, invals):
    """The default rule of a call-like primitive with no custom rule: its one
    body walked where the equation stood, which computes the same."""
    (body,) = describe(eqn).bodies(eqn)
    return interpret(walk, body.jaxpr, body.consts, invals)


def sow_rule(walk, eqn, invals):
    site = Site.of(eqn)
    n = len(eqn.outvars)
    if not walk.policy.handles(site):
        params = walk.policy.reemit(eqn.params)
        return invals[:n] if params is None else sow_p.bind(*invals, **params)
    if not walk.reap and walk.policy.key(site) not in walk.plants:
        # A plant leaves the names it does not plant for an outer harvest.
        return sow_p.bind(*invals, **eqn.params)
    leaves, pred = invals[:n], (invals[n] if len(invals) > n else None)
    value = jax.tree_util.tree_unflatten(site.tree, leaves)
    value = walk.sow(site, value, pred, eqn.params.get("role"), eqn.params.get("element"))
    return jax.tree_util.tree_leaves(value)


# ---------------------------------------------------------------------------
# Re-tracing a body, for rules that re-bind their primitive.


@dataclasses.dataclass
class Retraced:
    """A body re-traced by the walk: `jaxpr` maps `args` to the body's outputs
    followed by the leaves of the child's records.

    Args:
        jaxpr: the re-traced body; its closed-over values are its leading invars.
        args: the values to bind it with (the closed-over values, then the inputs).
        num_consts: how many of ``args`` are closed-over values.
        num_outs: how many of its outputs are the body's own (the rest are records).
        child: the child ``Walk`` that ran inside the body.
        records_tree: the tree structure of the child's exported records, paired with
            the occurrence counts a ``while_loop`` in the body made (arrays).
    """

    jaxpr: _jax.Jaxpr  # closed-over values are leading invars
    args: list
    num_consts: int
    num_outs: int
    child: Walk
    records_tree: Any

    def rebind(self, walk, eqn, param):
        """Binds `eqn`'s primitive again around the re-traced body and finishes.

        For a call-like primitive only (its one body takes the equation's inputs
        and gives its outputs, and no other param counts them): `param`, the param
        holding the body, is replaced by the re-traced jaxpr (closed, with no
        consts, if it held a ``ClosedJaxpr``), which takes ``args``.

        Args:
            walk: the walk the records are folded into.
            eqn: the equation whose body was re-traced.
            param: the name of its param holding the body.

        Returns:
            The body's own outputs (``finish`` of the bind's).
        """
        body = self.jaxpr
        if isinstance(eqn.params[param], _jax.ClosedJaxpr):
            body = _jax.ClosedJaxpr(body, ())
        outs = _jax.bind_with(eqn.primitive, dict(eqn.params, **{param: body}), self.args)
        return self.finish(walk, outs)

    def finish(self, walk, outs):
        """Splits a bind's outputs, folding the records into `walk`.

        Args:
            walk: the walk the body's records are folded into.
            outs: the outputs of binding ``jaxpr`` (the body's, then the records' leaves).

        Returns:
            The body's own outputs.
        """
        outs, rec_leaves = outs[: self.num_outs], outs[self.num_outs :]
        exported, counts = jax.tree_util.tree_unflatten(self.records_tree, rec_leaves)
        walk.absorb_export(self.child, exported, counts)
        return outs


def retrace(walk, jaxpr, consts, invals):
    """Traces `interpret` of `jaxpr` in a child walk into a new jaxpr."""
    holder = {}

    def body(*args):
        child = holder["child"] = walk.child()
        outs = interpret(child, jaxpr, consts, args)
        # Counts a while_loop made are arrays of this trace: they leave it as outputs.
        counts = {p: n for p, n in child.seen.items() if not isinstance(n, int)}
        leaves, holder["tree"] = jax.tree_util.tree_flatten((child.export(), counts))
        return [*outs, *leaves]

    closed = jax.make_jaxpr(body)(*invals)
    open_jaxpr = _jax.consts_as_inputs(closed.jaxpr)
    args, child, tree = [*closed.consts, *invals], holder["child"], holder["tree"]
    return Retraced(open_jaxpr, args, len(closed.consts), len(jaxpr.outvars), child, tree)
