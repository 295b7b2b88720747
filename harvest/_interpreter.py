"""The one walk over a jaxpr that serves reap, plant, harvest and nest.

`interpret(scope, jaxpr, consts, args)` evaluates a jaxpr equation by equation
under whatever trace is current. An equation whose primitive has a rule in
`RULES`, and whose body holds a sow this walk cares about, goes to that rule;
everything else is re-bound untouched (keeping its compile cache and custom
derivatives). The `Scope` says what to do at each sow: plant it, reap it, or
re-emit it for an outer harvest of another tag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import fnmatch
import inspect
import threading
import weakref
from typing import Any, Callable, Hashable, Iterator

import jax
import jax.numpy as jnp
from . import _jax
from ._primitive import sow_p
from ._site import CARRIED_MODES, ROW_MODES, SINGLE_MODES, Record, Site, different_shapes, mode_label, path_str

# primitive -> rule(scope, eqn, invals) -> outvals. Filled in by `_rules/`.
RULES: dict[_jax.Primitive, Callable] = {}


def register(*primitives):
    def deco(rule):
        for p in primitives:
            RULES[p] = rule
        return rule

    return deco


# ---------------------------------------------------------------------------
# Which sows a jaxpr holds, cached per jaxpr object.

# One cache outside custom_jvp rules, one inside (where rules are not looked into).
_tags_caches: "tuple[weakref.WeakKeyDictionary[_jax.Jaxpr, frozenset], ...]" = (
    weakref.WeakKeyDictionary(),
    weakref.WeakKeyDictionary(),
)


def sites_in(jaxpr) -> frozenset:
    """Every (site, enclosing primitive) reachable from `jaxpr`, recursively."""
    cache = _tags_caches[getattr(_in_rule, "depth", 0) > 0]
    try:
        return cache[jaxpr]
    except KeyError:
        pass
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            found.add((Site.of(eqn), None))
        for sub in _jax.sub_jaxprs(eqn):
            for site, _ in sites_in(sub):
                found.add((site, eqn.primitive))
        found |= rule_sites(eqn)
    cache[jaxpr] = result = frozenset(found)
    return result


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
    if eqn.primitive is not _jax.custom_jvp_call_p or getattr(_in_rule, "depth", 0) > 0:
        return None
    return _jax.custom_jvp_rule(eqn)


def rule_sites(eqn: Any) -> frozenset[tuple[Site, Any]]:
    """(site, custom_jvp_call) for each sow in the JVP rule of `eqn` (see `jvp_rule`)."""
    rule = jvp_rule(eqn)
    if rule is None:
        return frozenset()
    with inside_rule():
        return frozenset((site, eqn.primitive) for site, _ in sites_in(rule[0].jaxpr))


# ---------------------------------------------------------------------------
# What a walk does with a sow.


@dataclasses.dataclass(frozen=True)
class NameFilter:
    """allowlist/blocklist: exact names, glob patterns, or predicates on names."""

    allow: tuple | None = None
    block: tuple = ()

    @staticmethod
    def make(allowlist=None, blocklist=None):
        def norm(items, what):
            if items is None:
                return None
            if isinstance(items, str) or callable(items):
                items = (items,)
            items = tuple(items)
            for it in items:
                if not (isinstance(it, str) or callable(it)):
                    raise TypeError(
                        f"{what} takes names, glob patterns or predicates on names; got {it!r}."
                    )
            return items

        return NameFilter(norm(allowlist, "allowlist"), norm(blocklist, "blocklist") or ())

    @staticmethod
    def _hit(items, name):
        return any(it(name) if callable(it) else (it == name or fnmatch.fnmatchcase(name, it)) for it in items)

    def check_allowlist(self, names, what, tag):
        """Raises if a string entry of the allowlist matches none of `names` (dotted).

        Predicates are not checked: a predicate that selects nothing is how to
        say "this site may be absent" (behind a Python flag, say)."""
        missing = [
            it for it in self.allow or () if isinstance(it, str) and not any(self._hit((it,), n) for n in names)
        ]
        if missing:
            raise ValueError(no_such_names(missing, names, what, tag))

    def __call__(self, path):
        name = path_str(path)
        if self.allow is not None and not self._hit(self.allow, name):
            return False
        return not self._hit(self.block, name)


def no_such_names(missing, names, what, tag):
    """The message for names or patterns (`missing`) that match no site of `tag`."""
    listed = ", ".join(repr(n) for n in names) or "none"
    return (
        f"{what} {', '.join(map(repr, missing))} matches no sow site of tag {tag!r}. "
        f"Names sown with that tag, in program order: {listed}. Check the spelling, or use a "
        "predicate (lambda name: ...) for a site that may be absent."
    )


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which sows a walk handles (plants or reaps), and how it re-emits the rest."""

    tag: Hashable | None  # a str, but any hashable under harvest.compat.oryx (as in oryx)
    select: NameFilter = NameFilter()
    prefix: tuple = ()  # `nest`: re-emitted sows get this scope in front
    exclusive: bool = False  # drop sows of other tags instead of re-emitting them
    strict_names: bool = True  # planting, or allowlisting by string, a name no site has is an error (oryx ignores it)
    drop_filtered: bool = False  # oryx: sows of `tag` that `select` filters out vanish

    def handles(self, site):
        return site.tag == self.tag and self.select(site.name)

    def touches(self, sites):
        return any(
            self.prefix or self.exclusive or (self.drop_filtered and s.tag == self.tag) or self.handles(s)
            for s, _ in sites
        )

    def reemit(self, params):
        """The params to re-emit a sow this walk does not handle with (None: drop it)."""
        if self.exclusive or (self.drop_filtered and params["tag"] == self.tag):
            return None
        if not self.prefix:
            return params
        return dict(params, scope=self.prefix + params["scope"])


# ---------------------------------------------------------------------------
# Plants: the replacement for each occurrence of a name.


@dataclasses.dataclass(frozen=True)
class Plant:
    """A planted value as seen from one scope, starting at its first occurrence.

    `value` is, by the site's mode: collect, a tuple with one entry per
    occurrence; append, leaves stacked on a leading axis; or, for any mode, a
    single value or a callable `old -> new` used at every occurrence. A
    callable that requires a second positional argument is called as
    `value(old, index)`, `index` being the occurrence's position among the
    name's occurrences in one call (its row in reap's stack; traced inside a
    scan); `start` is the index of this scope's first occurrence.
    """

    site: Site
    value: Any
    start: Any = 0

    def per_occurrence(self):
        v, mode = self.value, self.site.mode
        if callable(v):
            return False
        if mode == "collect":
            # A tuple shaped like the sown value is one value; any other tuple
            # holds one entry per occurrence (its count is checked by the walk).
            return isinstance(v, tuple) and jax.tree_util.tree_structure(v) != self.site.tree
        if mode in ROW_MODES:
            leaf, aval = jax.tree_util.tree_leaves(v)[0], self.site.avals[0]
            return jnp.ndim(leaf) == len(aval.shape) + 1
        return False

    def check_count(self, n):
        """A plant given per occurrence needs one entry (collect) or row (append)
        for each of the `n` occurrences that reap would return."""
        if not self.per_occurrence():
            return
        if self.site.mode == "collect":
            got, what = len(self.value), "entries"
        else:
            got, what = jnp.shape(jax.tree_util.tree_leaves(self.value)[0])[0], "rows"
        if got != n:
            shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in self.site.avals)
            raise ValueError(
                f"The plant for the sow site {self.site} has {got} {what}, but reap returns "
                f"{n} {what} of {shapes} for it. Plant {n} {what}, as reap returns them, or a "
                "single value (or callable) used at every occurrence."
            )

    def takes_index(self):
        return callable(self.value) and _takes_index(self.value)

    def starting_at(self, start):
        """The same plant, its occurrences counted from `start`."""
        return Plant(self.site, self.value, start) if self.takes_index() else self

    def shift(self, n):
        """The same plant seen from `n` occurrences later."""
        if not n:
            return self
        if self.takes_index():
            return self.starting_at(self.start + n)
        if not self.per_occurrence():
            return self
        if self.site.mode == "collect":
            return Plant(self.site, self.value[n:])
        return Plant(self.site, jax.tree_util.tree_map(lambda l: l[n:], self.value))

    def at(self, i, old, site):
        """The replacement for occurrence `i` (fired by `site`) given its old value."""
        v = self.value
        if callable(v):
            new = v(old, self.start + i) if self.takes_index() else v(old)
            what = "the value returned by the planted callable"
        elif self.per_occurrence():
            if self.site.mode == "collect":
                if i >= len(v):
                    raise ValueError(
                        f"The plant for the sow site {self.site} has {len(v)} entries, but "
                        f"the site is sown at least {i + 1} times. Plant one entry per "
                        "occurrence (as reap returns), or a single value for all."
                    )
                new = v[i]
            else:
                new = jax.tree_util.tree_map(lambda l: l[i], v)
            what = f"occurrence {i} of the planted value"
        else:
            new = v
            what = "the planted value"
        leaves = site.check(new, what)
        return jax.tree_util.tree_unflatten(site.tree, leaves)


def _takes_index(fn):
    """Whether a planted callable requires a second positional argument (the
    occurrence index). Parameters with defaults do not count, so the idiom
    `lambda old, c=c: ...` stays a callable of the old value alone."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: old -> new
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params) >= 2


def _select(pred, a, b):
    """`where(pred, a, b)` with `pred`'s axes leading: under vmap a sow_cond's
    predicate is batched along the same leading axis as its value."""
    pred = jnp.reshape(pred, jnp.shape(pred) + (1,) * (jnp.ndim(a) - jnp.ndim(pred)))
    return jnp.where(pred, a, b)


def _vary_like(new, old):
    """Inside shard_map, a planted value must vary over the mesh axes the sown one did."""
    return _jax.pcast_varying(new, _jax.varying_axes(old))


# ---------------------------------------------------------------------------
# A scope: one walk over one jaxpr body.


class Scope:
    """The state of one walk: plants coming in, records going out.

    A rule for a higher-order primitive makes a `child()` scope for the body it
    re-traces, then folds the child's records back with `absorb`.
    """

    def __init__(self, policy: Policy, plants: dict, reap: bool = True):
        self.policy = policy
        self.plants = plants  # path -> Plant, as seen from this scope
        self.reap = reap
        self.records: dict[tuple, Record] = {}
        self.seen: dict[tuple, int] = {}  # occurrences so far (entries, or append rows)

    def child(self, carried=None, plants=None):
        """A scope for a body that runs after what this scope has seen so far.

        `carried` maps clobber-like names to (site, value) to start from;
        `plants` overrides the plants the body sees.
        """
        if plants is None:
            plants = self.shifted_plants()
        kid = Scope(self.policy, plants, self.reap)
        for path, (site, value) in (carried or {}).items():
            kid.records[path] = Record(site, [value])
        return kid

    def shifted_plants(self):
        return {p: pl.shift(self.seen.get(p, 0)) for p, pl in self.plants.items()}

    # -- a sow fires -------------------------------------------------------
    def sow(self, site: Site, value, pred=None, role=None):
        path = site.name
        known = self.records.get(path)
        if known is not None and known.site.mode != site.mode:
            raise ValueError(
                f"The sow site {site} uses mode {mode_label(site.mode)}, but the same name was "
                f"sown with mode {mode_label(known.site.mode)} earlier. Use one mode per name."
            )
        if role == "record_only":  # an occurrence counted (and planted) where it was sown
            if path not in self.plants and self.reap:
                self._record(site, value, pred)
            return value
        i = self.seen.get(path, 0)
        if site.mode in SINGLE_MODES and i:
            raise ValueError(
                f"The sow site {site} has mode {mode_label(site.mode)} but is sown more than once. "
                "Give each occurrence its own name, or use mode 'collect', 'append' or "
                "'clobber'."
            )
        plant = self.plants.get(path)
        if plant is not None:
            new = jax.tree_util.tree_map(_vary_like, plant.at(i, value, site), value)
            if pred is not None:
                new = jax.tree_util.tree_map(functools.partial(_select, pred), new, value)
            value = new
        self.seen[path] = i + 1
        if plant is None and self.reap and role != "plant_only":
            self._record(site, value, pred)
        return value

    def _record(self, site, value, pred):
        path, mode = site.name, site.mode
        rec = self.records.setdefault(path, Record(site, []))
        if mode == "collect":
            rec.values.append(value)
        elif mode == "append":
            rec.values.append(jax.tree_util.tree_map(lambda l: jnp.expand_dims(l, 0), value))
        elif mode == "auto":
            if rec.site.avals != site.avals:  # a shared module called on different shapes
                raise different_shapes(site, {tuple(a.shape for a in s.avals) for s in (rec.site, site)})
            rec.values.append(value)  # kept as is: sown once, it reaps unstacked
        elif mode in CARRIED_MODES and pred is not None:
            old = rec.values[0] if rec.values else site.zeros()
            rec.values = [jax.tree_util.tree_map(functools.partial(_select, pred), value, old)]
        else:
            rec.values = [value]

    # -- folding a child's records back -----------------------------------
    def absorb(self, records: dict[tuple, Record], seen: dict[tuple, int]):
        for path, rec in records.items():
            mine = self.records.get(path)
            if mine is None:
                self.records[path] = Record(rec.site, list(rec.values))
                continue
            if mine.site.mode != rec.site.mode:
                raise ValueError(
                    f"The sow site {rec.site} uses mode {mode_label(rec.site.mode)}, but the same "
                    f"name was sown with mode {mode_label(mine.site.mode)} elsewhere. Use one mode per name."
                )
            if rec.site.mode in SINGLE_MODES:
                raise ValueError(
                    f"The sow site {rec.site} has mode {mode_label(rec.site.mode)} but is sown more than once. "
                    "Give each occurrence its own name, or use mode 'collect', 'append' or 'clobber'."
                )
            if rec.site.mode in CARRIED_MODES:
                mine.values = list(rec.values)
            else:
                mine.values.extend(rec.values)
        for path, n in seen.items():
            self.seen[path] = self.seen.get(path, 0) + n

    def carried(self, sites, where, batch=()):
        """(site, current value) of the reaped clobber-like names among `sites`,
        shaped as the site sows it, since `where` carries one fixed type. `batch`:
        the leading axes a loop with a per-example predicate adds to every leaf."""
        out = {}
        for site in sites.values():
            if self.reap and site.mode in CARRIED_MODES and site.name not in self.plants:
                rec = self.records.get(site.name)
                value = rec.values[0] if rec else site.zeros()
                out[site.name] = (site, site.fit(value, where, batch))
        return out

    def handled_sites(self, jaxprs):
        """The sites of this walk's tag inside `jaxprs`, first one per name."""
        out = {}
        for j in jaxprs:
            for site, _ in sites_in(j):
                if self.policy.handles(site):
                    out.setdefault(site.name, site)
        return out

    def plants_inside(self, jaxprs):
        return any(path in self.plants for path in self.handled_sites(jaxprs))

    def export(self):
        """The records as a pytree of arrays, to carry out of a traced body."""
        return {path: rec.values for path, rec in self.records.items()}

    def absorb_export(self, child, exported):
        """Folds a child's records, as returned by a traced body, into this scope."""
        records = {p: Record(child.records[p].site, list(v)) for p, v in exported.items()}
        self.absorb(records, child.seen)

    def results(self):
        return {path: rec.result() for path, rec in self.records.items()}


# ---------------------------------------------------------------------------
# The walk.


def _read(env, v):
    return v.val if isinstance(v, _jax.Literal) else env[v]


def interpret(scope: Scope, jaxpr: _jax.Jaxpr, consts, args):
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        with _jax.eqn_context(eqn):
            outs = _eval_eqn(scope, eqn, invals)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


def _eval_eqn(scope, eqn, invals):
    if eqn.primitive is sow_p:
        return sow_rule(scope, eqn, invals)
    subs = _jax.sub_jaxprs(eqn)
    if not subs and eqn.primitive in RULES:  # a marker the walk keeps count by
        return RULES[eqn.primitive](scope, eqn, invals)
    if subs:
        sites = frozenset().union(*(sites_in(j) for j in subs), rule_sites(eqn))
        if scope.policy.touches(sites):
            rule = RULES.get(eqn.primitive)
            if rule is None:
                site = next(s for s, _ in sites if scope.policy.touches([(s, None)]))
                raise NotImplementedError(
                    f"harvest has no rule for the primitive `{eqn.primitive}`, which holds "
                    f"the sow site {site}. Move the sow outside `{eqn.primitive}`, or "
                    "file an issue naming this primitive."
                )
            return rule(scope, eqn, invals)
    return _jax.rebind(eqn, invals)


def sow_rule(scope, eqn, invals):
    site = Site.of(eqn)
    n = len(eqn.outvars)
    if not scope.policy.handles(site):
        params = scope.policy.reemit(eqn.params)
        return invals[:n] if params is None else sow_p.bind(*invals, **params)
    if not scope.reap and site.name not in scope.plants:
        # A plant leaves the names it does not plant for an outer harvest.
        return sow_p.bind(*invals, **eqn.params)
    leaves, pred = invals[:n], (invals[n] if len(invals) > n else None)
    value = jax.tree_util.tree_unflatten(site.tree, leaves)
    value = scope.sow(site, value, pred, eqn.params.get("role"))
    return jax.tree_util.tree_leaves(value)


# ---------------------------------------------------------------------------
# Re-tracing a body, for rules that re-bind their primitive.


@dataclasses.dataclass
class Retraced:
    """A body re-traced by the walk: `jaxpr` maps `args` to the body's outputs
    followed by the leaves of the child's records."""

    jaxpr: _jax.Jaxpr  # closed-over values are leading invars
    args: list
    num_consts: int
    num_outs: int
    child: Scope
    records_tree: Any

    def finish(self, scope, outs):
        """Splits a bind's outputs, folding the records into `scope`."""
        outs, rec_leaves = outs[: self.num_outs], outs[self.num_outs :]
        scope.absorb_export(self.child, jax.tree_util.tree_unflatten(self.records_tree, rec_leaves))
        return outs


def retrace(scope, jaxpr, consts, invals):
    """Traces `interpret` of `jaxpr` in a child scope into a new jaxpr."""
    holder = {}

    def body(*args):
        child = holder["child"] = scope.child()
        outs = interpret(child, jaxpr, consts, args)
        leaves, holder["tree"] = jax.tree_util.tree_flatten(child.export())
        return [*outs, *leaves]

    closed = jax.make_jaxpr(body)(*invals)
    open_jaxpr = _jax.consts_as_inputs(closed.jaxpr)
    return Retraced(
        open_jaxpr, [*closed.consts, *invals], len(closed.consts), len(jaxpr.outvars), holder["child"], holder["tree"]
    )
