"""Random programs: nestings of jit / scan / cond / remat / vmap / while_loop
around sows, run as f, reap(vmap(f)), plant(vmap(f)) and vmap(reap(f)), and
checked against a hand-threaded, unrolled pure-Python reference."""

import itertools

import conftest
import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from jax import lax

from harvest import _jax, call_and_reap, plant, reap, sites, sow

NAMES = ("a", "b", "c")
OPS = (
    lambda x: jnp.sin(x) + 0.25,
    lambda x: x * 0.75 - 0.1,
    lambda x: jnp.tanh(x * 1.5),
)
LENGTH = 2  # scan length, and the least trip count of a while loop
BATCH = 2  # vmap size


def close(a, b):
    conftest.close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Programs: a node is ("sow", op, name) or (kind, [nodes]).


def programs(kinds, leaves=("sow",)):
    # "pair" sows a pytree {"v": op(x), "e": x[:0]}: a dict with a zero-size leaf.
    leaf = st.tuples(st.sampled_from(leaves), st.integers(0, len(OPS) - 1), st.sampled_from(NAMES))

    def wrap(children):
        return st.tuples(st.sampled_from(kinds), st.lists(children, min_size=1, max_size=2))

    # depth <= 3 wrappers
    node = st.recursive(leaf, wrap, max_leaves=5)
    return st.lists(node, min_size=1, max_size=3).filter(lambda p: _depth(p) <= 3)


def _depth(nodes):
    return max((0 if _is_leaf(n) else 1 + _depth(n[1])) for n in nodes)


def _is_leaf(node):
    return node[0] in ("sow", "pair")


def _has(nodes, kind, inside=None):
    """Whether a `kind` node occurs (within an `inside` node, if given)."""
    for n in nodes:
        if _is_leaf(n):
            continue
        if (inside is None and n[0] == kind) or _has(
            n[1], kind, None if n[0] == inside else inside
        ):
            return True
    return False


def _trips(x):
    # A while loop runs LENGTH or LENGTH + 1 times, by its input: per example under vmap.
    return LENGTH + (jnp.sum(x) > 0.0).astype(jnp.int32)


def _pred(x):
    return jnp.sum(x) > 0.0


def _false_branch(x):
    return x * 0.5 - 0.25


def _vmap_inputs(x):
    return jnp.stack([x, x * 0.5 - 0.3])


# The program as a JAX function.


def build(nodes, in_while=False, vmaps=0):
    fns = [build_node(n, in_while, vmaps) for n in nodes]

    def run(x):
        for fn in fns:
            x = fn(x)
        return x

    return run


def _site(node, in_while, vmaps):
    """The name and mode a leaf sows with: inside a while_loop, `clobber` under
    its own name per vmap depth (collect cannot stack a loop of unknown length,
    and a loop carries one shape per name)."""
    name = node[2] if node[0] == "sow" else "p"
    return (f"{name}_w{vmaps}", "clobber") if in_while else (name, "collect")


def build_node(node, in_while, vmaps):
    kind = node[0]
    if _is_leaf(node):
        op, (name, mode) = OPS[node[1]], _site(node, in_while, vmaps)
        if kind == "sow":
            return lambda x: sow(op(x), name=name, mode=mode)
        return lambda x: sow({"v": op(x), "e": x[:0] * 2.0}, name=name, mode=mode)["v"]
    body = build(node[1], in_while or kind == "while", vmaps + (kind == "vmap"))
    if kind == "jit":
        return jax.jit(body)
    if kind == "remat":
        return jax.checkpoint(body)
    if kind == "scan":
        return lambda x: lax.scan(
            lambda c, i: (body(c + 0.1 * i), None), x, jnp.arange(LENGTH, dtype=jnp.float32)
        )[0]
    if kind == "while":

        def loop(x):
            step = lambda c: (c[0] + 1, body(c[1] + 0.1 * c[0]))
            return lax.while_loop(lambda c: c[0] < _trips(x), step, (0, x))[1]

        return loop
    if kind == "cond":
        return lambda x: lax.cond(_pred(x), body, _false_branch, x)
    if kind == "vmap":
        return lambda x: jnp.mean(jax.vmap(body)(_vmap_inputs(x)), axis=0)
    raise AssertionError(kind)


# The hand-threaded reference. It runs every scan iteration and vmap member
# one by one; `idx` holds the (kind, index) of the levels around a sow,
# outermost first. A reaped value lays its axes out as harvest documents:
# enclosing scans first, then vmaps (the batch axis is added at the sow, the
# loop axis when the scan stacks), each group outermost first.


class Ref:
    def __init__(self, plants, outer=0):
        self.plants = plants
        self.outer = outer  # 1 when the whole program runs under vmap
        self.entries = {}  # collect: name -> {k: {"levels": ..., "vals": {idx: value}}}
        self.last = {}  # clobber: name -> {"levels": ..., "vals": {vmap idx: value}}

    def collect(self, name, k, idx, value):
        entry = self.entries.setdefault(name, {}).setdefault(
            k, {"levels": tuple(kind for kind, _ in idx), "vals": {}}
        )
        entry["vals"][tuple(i for _, i in idx)] = value
        if self.plants is not None and name in self.plants:
            return _at(self.plants[name][k], _layout(idx))
        return value

    def clobber(self, name, idx, value):
        vmaps = tuple((kind, i) for kind, i in idx if kind == "vmap")
        rec = self.last.setdefault(name, {"levels": tuple(k for k, _ in vmaps), "vals": {}})
        rec["vals"][tuple(i for _, i in vmaps)] = value
        if self.plants is not None and name in self.plants:
            return _at(self.plants[name], _layout(vmaps))
        return value

    def results(self, zeros_for):
        out = {
            name: tuple(_assemble(es[k]["levels"], es[k]["vals"]) for k in sorted(es))
            for name, es in self.entries.items()
        }
        for name, rec in self.last.items():
            # An example in which the name never fired (its cond not taken) reaps zeros.
            like = jax.tree_util.tree_map(jnp.zeros_like, next(iter(rec["vals"].values())))
            for key in itertools.product(range(BATCH), repeat=len(rec["levels"])):
                rec["vals"].setdefault(key, like)
            out[name] = _assemble(rec["levels"], rec["vals"])
        for name, like in zeros_for.items():  # clobber names that never fired
            out.setdefault(name, jax.tree_util.tree_map(jnp.zeros_like, like))
        return out


def _layout(idx):
    """Indices in harvest's axis order: scans, then vmaps."""
    return tuple(i for k, i in idx if k == "scan") + tuple(i for k, i in idx if k == "vmap")


def _at(tree, index):
    return jax.tree_util.tree_map(lambda l: l[index] if index else l, tree)


def _assemble(levels, vals):
    size = {"scan": LENGTH, "vmap": BATCH}
    order = [j for j, k in enumerate(levels) if k == "scan"] + [
        j for j, k in enumerate(levels) if k == "vmap"
    ]
    if not order:
        return vals[()]

    def stack(prefix):
        if len(prefix) == len(order):
            full = [None] * len(levels)
            for j, i in zip(order, prefix):
                full[j] = i
            return vals[tuple(full)]
        subs = [stack(prefix + (i,)) for i in range(size[levels[order[len(prefix)]]])]
        return jax.tree_util.tree_map(lambda *ls: jnp.stack(ls), *subs)

    return stack(())


def ref_run(ref, nodes, x, counter, idx, in_while=False):
    for node in nodes:
        x = ref_node(ref, node, x, counter, idx, in_while)
    return x


def ref_node(ref, node, x, counter, idx, in_while):
    kind = node[0]
    if _is_leaf(node):
        vmaps = sum(k == "vmap" for k, _ in idx) - ref.outer
        op, (name, mode) = OPS[node[1]], _site(node, in_while, vmaps)
        y = op(x)
        value = y if kind == "sow" else {"v": y, "e": x[:0] * 2.0}
        if mode == "clobber":
            value = ref.clobber(name, idx, value)
        else:
            k = counter.get(name, 0)
            counter[name] = k + 1
            value = ref.collect(name, k, idx, value)
        return value if kind == "sow" else value["v"]
    children = node[1]
    if kind in ("jit", "remat"):
        return ref_run(ref, children, x, counter, idx, in_while)
    if kind == "scan":
        base = dict(counter)
        for i in range(LENGTH):
            c = dict(base)
            x = ref_run(ref, children, x + 0.1 * i, c, idx + (("scan", i),), in_while)
        counter.update(c)
        return x
    if kind == "while":
        for i in range(int(_trips(x))):
            x = ref_run(ref, children, x + 0.1 * i, counter, idx, True)
        return x
    if kind == "cond":
        if bool(_pred(x)):
            return ref_run(ref, children, x, counter, idx, in_while)
        # Not taken: its collect entries exist, as zeros; its clobbers keep their values.
        shadow = Ref(None, ref.outer)
        ref_run(shadow, children, x, counter, idx, in_while)
        for name, es in shadow.entries.items():
            for k, e in es.items():
                for key, v in e["vals"].items():
                    ref.collect(
                        name,
                        k,
                        tuple(zip(e["levels"], key)),
                        jax.tree_util.tree_map(jnp.zeros_like, v),
                    )
        return _false_branch(x)
    if kind == "vmap":
        base, ys = dict(counter), []
        xb = _vmap_inputs(x)
        for b in range(BATCH):
            c = dict(base)
            ys.append(ref_run(ref, children, xb[b], c, idx + (("vmap", b),), in_while))
        counter.update(c)
        return jnp.mean(jnp.stack(ys), axis=0)
    raise AssertionError(kind)


def _clobber_zeros(nodes, x):
    """Zeros shaped like each clobber name's value, for names that never fire."""
    shadow = Ref(None)
    ref_run(shadow, _taken(nodes), x, {}, ())
    return {name: _assemble(r["levels"], r["vals"]) for name, r in shadow.last.items()}


def _taken(nodes):
    """The program with every cond taken and every while run: all sites fire."""
    return [
        n if _is_leaf(n) else (("jit" if n[0] == "cond" else n[0]), _taken(n[1])) for n in nodes
    ]


def reference(nodes, x, plants=None, batch=False):
    """(output, reaps) of the program; `batch`: of its vmap over x's rows."""
    ref = Ref(plants, outer=int(batch))
    if batch:
        outs = [ref_run(ref, nodes, x[b], {}, (("vmap", b),)) for b in range(x.shape[0])]
        zeros = jax.tree_util.tree_map(
            lambda z: jnp.zeros(x.shape[:1] + z.shape), _clobber_zeros(nodes, x[0])
        )
        return jnp.stack(outs), ref.results(zeros)
    return ref_run(ref, nodes, x, {}, ()), ref.results(_clobber_zeros(nodes, x))


# ---------------------------------------------------------------------------

xs = st.lists(
    st.floats(-1.5, 1.5, width=32).filter(lambda v: abs(v) > 1e-3), min_size=2, max_size=2
)
NO_VMAP = ["jit", "scan", "cond", "remat"]
# Deterministic, and no shrinking: each example compiles, so shrinking a failure
# would cost minutes. The smallest known failing programs are in the report.
SETTINGS = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)


def _check_reap(program, x):
    x = jnp.array(x, jnp.float32)
    f = build(program)
    out, reaped = call_and_reap(f)(x)
    ref_out, ref_events = reference(program, x)
    close(out, ref_out)
    close(reaped, ref_events)
    close(f(x), ref_out)


def _check_plant(program, x):
    x = jnp.array(x, jnp.float32)
    f = build(program)
    _, ref_events = reference(program, x)
    plants = jax.tree_util.tree_map(lambda v: v * 0.5 + 1.0, ref_events)
    ref_out, _ = reference(program, x, plants)
    close(plant(f)(plants, x), ref_out)


@SETTINGS
@given(program=programs(NO_VMAP), x=xs)
def test_random_programs_reap_jit_scan_cond_remat(program, x):
    _check_reap(program, x)


@SETTINGS
@given(program=programs(NO_VMAP), x=xs)
def test_random_programs_plant_jit_scan_cond_remat(program, x):
    _check_plant(program, x)


# vmap and while_loop inside f, pytree and zero-size values, and f under vmap,
# where a cond's predicate is batched. A sow in a while_loop inside such a cond is
# a documented error when reaped (docs/semantics.md), so those programs are left out.
INSIDE = ["jit", "scan", "cond", "remat", "vmap", "while"]
OUTSIDE = ["jit", "scan", "cond", "remat", "vmap", "while"]


def _loop_in_cond(p):
    return _has(p, "while", inside="cond")


LEAVES = ("sow", "pair")


def _check_vmapped(program, x):
    """reap(vmap(f)) and plant(vmap(f)) against the reference run per example,
    and vmap(reap(f)), whose batch axis comes first."""
    x = jnp.array(x, jnp.float32)
    rows = jnp.stack([x, 0.2 - 0.5 * x])
    f = build(program)
    out, reaped = call_and_reap(jax.vmap(f))(rows)
    ref_out, ref_events = reference(program, rows, batch=True)
    close(out, ref_out)
    close(reaped, ref_events)
    plants = jax.tree_util.tree_map(lambda v: v * 0.5 + 1.0, ref_events)
    close(plant(jax.vmap(f))(plants, rows), reference(program, rows, plants, batch=True)[0])
    per_example = [reference(program, r)[1] for r in rows]
    close(jax.vmap(reap(f))(rows), jax.tree_util.tree_map(lambda *ls: jnp.stack(ls), *per_example))


@SETTINGS
@given(
    program=programs(INSIDE, LEAVES).filter(
        lambda p: not (_has(p, "cond", inside="vmap") and _loop_in_cond(p))
    ),
    x=xs,
)
def test_random_programs_with_vmap_while_and_pytrees_inside(program, x):
    _check_reap(program, x)
    _check_plant(program, x)


@SETTINGS
@given(program=programs(OUTSIDE, LEAVES).filter(lambda p: not _loop_in_cond(p)), x=xs)
def test_random_programs_under_vmap(program, x):
    _check_vmapped(program, x)


# Every program here holds a cond whose predicate vmap batches: f under vmap
# with a cond around its body, and a vmap of a cond inside f.
NO_WHILE = ["jit", "scan", "cond", "remat", "vmap"]


@SETTINGS
@given(program=programs(NO_WHILE, LEAVES).map(lambda p: [("cond", p)]), x=xs)
def test_random_programs_with_a_batched_cond(program, x):
    _check_vmapped(program, x)
    _check_reap([("scan", [("vmap", program)])], x)
    _check_plant([("vmap", program)], x)


# ---------------------------------------------------------------------------
# sites(f) against reap(f): both read one description per primitive
# (harvest/_walk/_higher_order.py), so how often sites says a sow fires is how many
# rows reap returns. Every family of higher-order primitive (jit, closed_call,
# remat, scan, cond, custom_jvp, custom_vjp, custom_linear_solve; shard_map in
# tests/multidevice) wraps the sows, all in mode "append"; so do a scan of
# length 0 (its body never runs: no rows, and the round trip holds) and
# lax.map, without batch_size (a scan) and with one that leaves a remainder
# (sown once per element, a cond's taken branch too; a documented error where
# a loop inside it sows, see `_STEPPED_IN_A_BATCH`).

FAMILIES = [
    "jit",
    "call",
    "remat",
    "scan",
    "scan0",
    "cond",
    "custom_jvp",
    "custom_vjp",
    "solve",
    "map",
    "map_batched",
]


def build_appending(nodes):
    fns = [_appending_node(n) for n in nodes]

    def run(x):
        for fn in fns:
            x = fn(x)
        return x

    return run


def _appending_node(node):
    if _is_leaf(node):
        op, name = OPS[node[1]], node[2]
        return lambda x: sow(op(x), name=name, mode="append")
    kind, body = node[0], build_appending(node[1])
    if kind == "call":
        return lambda x: _jax.bind_with(
            _jax.closed_call_p, {"call_jaxpr": jax.make_jaxpr(body)(x)}, [x]
        )[0]
    if kind == "custom_jvp":
        fn = jax.custom_jvp(body)
        fn.defjvp(lambda primals, tangents: (primals[0], tangents[0]))  # never run here
        return fn
    if kind == "custom_vjp":
        fn = jax.custom_vjp(body)
        fn.defvjp(lambda x: (body(x), None), lambda _, g: (g,))
        return fn
    if kind == "solve":  # `solve` runs once per call: its sows fire once
        return lambda x: lax.custom_linear_solve(
            lambda v: v, x, lambda _, b: body(b), symmetric=True
        )
    return _wrapped(kind, body)


def _map_inputs(x):
    return jnp.stack([x - 0.1 * i for i in range(LENGTH + 1)])


def _wrapped(kind, body):
    if kind == "jit":
        return jax.jit(body)
    if kind == "remat":
        return jax.checkpoint(body)
    if kind == "scan":
        return lambda x: lax.scan(lambda c, _: (body(c), None), x, None, length=LENGTH)[0]
    if kind == "scan0":
        return lambda x: lax.scan(lambda c, _: (body(c), None), x, None, length=0)[0]
    if kind in ("map", "map_batched"):
        # LENGTH + 1 elements: batches of LENGTH leave a remainder of one.
        batch_size = LENGTH if kind == "map_batched" else None
        return lambda x: lax.map(body, _map_inputs(x), batch_size=batch_size).mean(axis=0)
    if kind == "cond":  # the false branch sows nothing: reap's rows are the true branch's
        return lambda x: lax.cond(_pred(x), body, _false_branch, x)
    raise AssertionError(kind)


# The kinds that, inside a batched lax.map, harvest cannot sow once per element.
_STEPPED_IN_A_BATCH = ("scan", "scan0", "map", "map_batched")


def _sown_twice_per_element(nodes):
    """Whether a batched lax.map's body sows one name more than once (its loops
    being refused already, every node in it runs once per element; the cond's
    false branch sows nothing)."""
    for n in nodes:
        if _is_leaf(n):
            continue
        if n[0] == "map_batched":
            names = [leaf[2] for leaf in _leaves(n[1])]
            if len(names) > len(set(names)):
                return True
        if _sown_twice_per_element(n[1]):
            return True
    return False


def _leaves(nodes):
    for n in nodes:
        if _is_leaf(n):
            yield n
        else:
            yield from _leaves(n[1])


@SETTINGS
@given(program=programs(FAMILIES), x=xs)
def test_random_programs_sites_fire_as_often_as_reap_returns_rows(program, x):
    x = jnp.array(x, jnp.float32)
    f = build_appending(program)
    if any(_has(program, kind, inside="map_batched") for kind in _STEPPED_IN_A_BATCH):
        # Known limits (never a silent answer): a loop inside lax.map(batch_size=b)
        # runs each step for the whole batch, so its sows cannot come element by
        # element (refused, naming lax.map).
        with pytest.raises(ValueError, match="lax.map"):
            reap(f)(x)
        return
    if _sown_twice_per_element(program):
        # Refused too: an append name sown twice per element would come sow by sow
        # within a batch, not element by element as lax.map(f, xs) gives it.
        with pytest.raises(ValueError, match="more than once per element"):
            reap(f)(x)
        return
    fires = {}
    for info in sites(f)(x):
        fires[info.name] = fires.get(info.name, 0) + info.fires
    reaped = reap(f)(x)
    assert fires == {name: rows.shape[0] for name, rows in reaped.items()}
    # plant takes exactly that many rows back, and gives f's output.
    close(plant(f)(reaped, x), f(x))
