"""Random programs: nestings of jit / scan / cond / remat / vmap around collect-mode sows,
checked against a hand-threaded, unrolled pure-Python reference."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax import lax

from harvest import call_and_reap, plant, sow

NAMES = ("a", "b", "c")
OPS = (
    lambda x: jnp.sin(x) + 0.25,
    lambda x: x * 0.75 - 0.1,
    lambda x: jnp.tanh(x * 1.5),
)
LENGTH = 2  # scan length
BATCH = 2  # vmap size


def close(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), (a, b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert jnp.shape(x) == jnp.shape(y), (jnp.shape(x), jnp.shape(y))
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Programs: a node is ("sow", op, name) or (kind, [nodes]).


def programs(kinds):
    leaf = st.tuples(st.just("sow"), st.integers(0, len(OPS) - 1), st.sampled_from(NAMES))

    def wrap(children):
        return st.tuples(st.sampled_from(kinds), st.lists(children, min_size=1, max_size=2))

    # depth <= 3 wrappers
    node = st.recursive(leaf, wrap, max_leaves=5)
    return st.lists(node, min_size=1, max_size=3).filter(lambda p: _depth(p) <= 3)


def _depth(nodes):
    return max((0 if n[0] == "sow" else 1 + _depth(n[1])) for n in nodes)


def _pred(x):
    return jnp.sum(x) > 0.0


def _false_branch(x):
    return x * 0.5 - 0.25


def _vmap_inputs(x):
    return jnp.stack([x, x * 0.5 - 0.3])


# The program as a JAX function.


def build(nodes):
    fns = [build_node(n) for n in nodes]

    def run(x):
        for fn in fns:
            x = fn(x)
        return x

    return run


def build_node(node):
    kind = node[0]
    if kind == "sow":
        op, name = OPS[node[1]], node[2]
        return lambda x: sow(op(x), name=name, mode="collect")
    body = build(node[1])
    if kind == "jit":
        return jax.jit(body)
    if kind == "remat":
        return jax.checkpoint(body)
    if kind == "scan":
        return lambda x: lax.scan(lambda c, i: (body(c + 0.1 * i), None), x, jnp.arange(LENGTH, dtype=jnp.float32))[0]
    if kind == "cond":
        return lambda x: lax.cond(_pred(x), body, _false_branch, x)
    if kind == "vmap":
        return lambda x: jnp.mean(jax.vmap(body)(_vmap_inputs(x)), axis=0)
    raise AssertionError(kind)


# The hand-threaded reference. `plants[name][k]` is the k-th collect entry,
# indexed by `idx` (scan iterations and vmap members, outermost first).


def ref_run(nodes, x, plants, counter, idx):
    events = {}
    for node in nodes:
        x, ev = ref_node(node, x, plants, counter, idx)
        for name, vals in ev.items():
            events.setdefault(name, []).extend(vals)
    return x, events


def _stack_events(per_member):
    first = per_member[0]
    return {name: [jnp.stack([m[name][j] for m in per_member]) for j in range(len(vals))] for name, vals in first.items()}


def ref_node(node, x, plants, counter, idx):
    kind = node[0]
    if kind == "sow":
        op, name = OPS[node[1]], node[2]
        y = op(x)
        k = counter.get(name, 0)
        counter[name] = k + 1
        if plants is not None and name in plants:
            y = plants[name][k][idx] if idx else plants[name][k]
        return y, {name: [y]}
    children = node[1]
    if kind in ("jit", "remat"):
        return ref_run(children, x, plants, counter, idx)
    if kind == "scan":
        base, per_iter = dict(counter), []
        for i in range(LENGTH):
            c = dict(base)
            x, ev = ref_run(children, x + 0.1 * i, plants, c, idx + (i,))
            per_iter.append(ev)
        counter.update(c)
        return x, _stack_events(per_iter)
    if kind == "cond":
        y, ev = ref_run(children, x, plants, counter, idx)
        if bool(_pred(x)):
            return y, ev
        return _false_branch(x), jax.tree_util.tree_map(jnp.zeros_like, ev)
    if kind == "vmap":
        base, ys, per_member = dict(counter), [], []
        xb = _vmap_inputs(x)
        for b in range(BATCH):
            c = dict(base)
            y, ev = ref_run(children, xb[b], plants, c, idx + (b,))
            ys.append(y)
            per_member.append(ev)
        counter.update(c)
        return jnp.mean(jnp.stack(ys), axis=0), _stack_events(per_member)
    raise AssertionError(kind)


def reference(nodes, x, plants=None):
    out, events = ref_run(nodes, x, plants, {}, ())
    return out, {name: tuple(v) for name, v in events.items()}


# ---------------------------------------------------------------------------

xs = st.lists(st.floats(-1.5, 1.5, width=32).filter(lambda v: abs(v) > 1e-3), min_size=2, max_size=2)
ALL = ["jit", "scan", "cond", "remat", "vmap"]
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
