"""sow modes, pytrees, and the reap/plant/harvest/call_and_reap/nest faces, at top level."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from conftest import close
from hypothesis import given, settings, strategies as st

from harvest import call_and_reap, harvest, nest, plant, reap, sow, sow_cond


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    a: jax.Array
    b: jax.Array


X = jnp.array([0.5, -1.0, 2.0], jnp.float32)


def three_sows(mode, tag="intermediates"):
    """Sows `h` three times; returns a function and its hand-threaded reference."""

    def f(x):
        a = sow(x + 1.0, name="h", mode=mode, tag=tag)
        b = sow(a * 2.0, name="h", mode=mode, tag=tag)
        c = sow(b - 3.0, name="h", mode=mode, tag=tag)
        return c * c

    def ref(x, plants=None):
        # plants: list of 3 replacement values (None = keep)
        plants = plants or [None] * 3
        a = x + 1.0
        a = a if plants[0] is None else plants[0]
        b = a * 2.0
        b = b if plants[1] is None else plants[1]
        c = b - 3.0
        c = c if plants[2] is None else plants[2]
        return c * c, (a, b, c)

    return f, ref


# ---------------------------------------------------------------------------
# Modes


def test_collect_reaps_every_occurrence_in_order():
    f, ref = three_sows("collect")
    out, (a, b, c) = ref(X)
    close(reap(f)(X), {"h": (a, b, c)})
    o, r = call_and_reap(f)(X)
    close(o, out)
    close(r, {"h": (a, b, c)})


def test_collect_plant_tuple_single_and_callable():
    f, ref = three_sows("collect")
    p = (jnp.ones(3), jnp.full(3, 2.0), jnp.full(3, -1.0))
    close(plant(f)({"h": p}, X), ref(X, list(p))[0])
    # a single value plants every occurrence
    v = jnp.array([1.0, 2.0, 3.0])
    close(plant(f)({"h": v}, X), ref(X, [v, v, v])[0])
    # a callable is applied to each occurrence's (already planted-upstream) value
    a = (X + 1.0) * 10
    b = (a * 2.0) * 10
    c = (b - 3.0) * 10
    close(plant(f)({"h": lambda old: old * 10}, X), c * c)


def test_strict_single_and_second_raises():
    def f(x):
        return sow(x * 2.0, name="s", mode="strict") + 1.0

    close(reap(f)(X), {"s": X * 2.0})
    close(plant(f)({"s": jnp.zeros(3)}, X), jnp.ones(3))

    def g(x):
        sow(x, name="twice", tag="tg", mode="strict")
        return sow(x + 1.0, name="twice", tag="tg", mode="strict")

    with pytest.raises(
        ValueError, match=r"(?s)(tg.*twice|twice.*tg).*strict|strict.*(tg.*twice|twice.*tg)"
    ):
        reap(g, tag="tg")(X)


def test_append_stacks_on_new_leading_axis():
    f, ref = three_sows("append")
    out, (a, b, c) = ref(X)
    r = reap(f)(X)
    close(r, {"h": jnp.stack([a, b, c])})
    assert r["h"].shape == (3, 3)
    p = jnp.arange(9.0).reshape(3, 3)
    close(plant(f)({"h": p}, X), ref(X, list(p))[0])
    close(plant(f)({"h": lambda old: -old}, X), ref_callable_neg(X))


def ref_callable_neg(x):
    a = -(x + 1.0)
    b = -(a * 2.0)
    c = -(b - 3.0)
    return c * c


def test_clobber_last_wins():
    f, ref = three_sows("clobber")
    out, (a, b, c) = ref(X)
    close(reap(f)(X), {"h": c})
    v = jnp.array([4.0, 5.0, 6.0])
    # a planted clobber value is used at every occurrence
    close(plant(f)({"h": v}, X), ref(X, [v, v, v])[0])
    close(plant(f)({"h": lambda old: old + 1}, X), ((((X + 2.0) * 2.0 + 1.0) - 3.0 + 1.0) ** 2))


def test_sow_cond_top_level():
    def f(x, p1, p2):
        a = sow_cond(x + 1.0, p1, name="k")
        b = sow_cond(a * 3.0, p2, name="k")
        return b + 0.5

    for p1, p2 in [(True, True), (True, False), (False, True), (False, False)]:
        p1a, p2a = jnp.bool_(p1), jnp.bool_(p2)
        a, b = X + 1.0, (X + 1.0) * 3.0
        expected = b if p2 else (a if p1 else jnp.zeros(3))
        close(reap(f)(X, p1a, p2a), {"k": expected})
        v = jnp.array([9.0, 8.0, 7.0])
        pa = v if p1 else X + 1.0
        pb = v if p2 else pa * 3.0
        close(plant(f)({"k": v}, X, p1a, p2a), pb + 0.5)


# ---------------------------------------------------------------------------
# Pytrees and scalars


@pytest.mark.parametrize("mode", ["collect", "strict", "append", "clobber"])
def test_pytree_values(mode):
    def f(x):
        d = sow({"u": x * 2.0, "v": (x + 1.0, jnp.sum(x))}, name="d", mode=mode)
        p = sow(Pair(d["u"], d["v"][0]), name="p", mode=mode)
        return p.a * p.b + d["v"][1]

    u, v0, v1 = X * 2.0, X + 1.0, jnp.sum(X)
    d_ref = {"u": u, "v": (v0, v1)}
    p_ref = Pair(u, v0)
    wrap = {
        "collect": lambda t: (t,),
        "strict": lambda t: t,
        "clobber": lambda t: t,
        "append": lambda t: jax.tree_util.tree_map(lambda l: l[None], t),
    }[mode]
    r = reap(f)(X)
    close(r, {"d": wrap(d_ref), "p": wrap(p_ref)})
    # plant a new pytree
    new_p = Pair(jnp.ones(3), jnp.full(3, 2.0))
    close(plant(f)({"p": wrap(new_p)}, X), jnp.full(3, 2.0) + v1)
    # round trip
    close(plant(f)(r, X), f(X))


def test_python_scalar_sow():
    def f(x):
        k = sow(2.0, name="k", mode="strict")
        return x * k

    r = reap(f)(X)
    close(r, {"k": jnp.float32(2.0)})
    close(plant(f)({"k": jnp.float32(5.0)}, X), X * 5.0)


# ---------------------------------------------------------------------------
# Faces: harvest, call_and_reap, nest


def test_harvest_reaps_what_is_not_planted():
    def f(x):
        a = sow(x + 1.0, name="a", mode="strict")
        b = sow(a * 2.0, name="b", mode="strict")
        c = sow(b * b, name="c", mode="strict")
        return c + a

    va = jnp.array([1.0, 2.0, 3.0])
    out, reaps = harvest(f)({"a": va}, X)
    close(out, (va * 2.0) ** 2 + va)
    close(reaps, {"b": va * 2.0, "c": (va * 2.0) ** 2})
    out, reaps = harvest(f)({}, X)
    a = X + 1.0
    close(out, (a * 2) ** 2 + a)
    close(reaps, {"a": a, "b": a * 2, "c": (a * 2) ** 2})


def test_nest_scopes_names_for_reap_and_plant():
    def layer(x):
        return sow(jnp.tanh(x), name="act", mode="strict") * 2.0

    def f(x):
        h = nest(layer, scope="l1")(x)
        h = nest(layer, scope="l2")(h)
        return sow(h, name="out", mode="strict")

    h1 = jnp.tanh(X)
    h2 = jnp.tanh(h1 * 2.0)
    close(reap(f)(X), {"l1": {"act": h1}, "l2": {"act": h2}, "out": h2 * 2.0})
    v = jnp.array([0.1, 0.2, 0.3])
    close(plant(f)({"l2": {"act": v}}, X), v * 2.0)
    close(plant(f)({"l1": {"act": v}}, X), jnp.tanh(v * 2.0) * 2.0)


def test_nested_nest():
    def inner(x):
        return sow(x + 1.0, name="z", mode="strict")

    def f(x):
        return nest(lambda y: nest(inner, scope="b")(y) * 3.0, scope="a")(x)

    close(reap(f)(X), {"a": {"b": {"z": X + 1.0}}})
    close(plant(f)({"a": {"b": {"z": jnp.ones(3)}}}, X), jnp.full(3, 3.0))


def test_nest_keeps_tags():
    def inner(x):
        sow(x * 2.0, name="z", tag="other", mode="strict")
        return sow(x + 1.0, name="z", mode="strict")

    f = nest(inner, scope="s")
    close(reap(f)(X), {"s": {"z": X + 1.0}})
    close(reap(f, tag="other")(X), {"s": {"z": X * 2.0}})


# ---------------------------------------------------------------------------
# names= / exclude=


def many(x):
    sow(x + 1.0, name="enc.a", mode="strict")
    sow(x + 2.0, name="enc.b", mode="strict")
    sow(x + 3.0, name="dec.a", mode="strict")
    return sow(x + 4.0, name="head", mode="strict")


ALL = {"enc.a": X + 1.0, "enc.b": X + 2.0, "dec.a": X + 3.0, "head": X + 4.0}


@pytest.mark.parametrize(
    "kw,keys",
    [
        (dict(names=["head"]), ["head"]),
        (dict(names="head"), ["head"]),
        (dict(names=["enc.*"]), ["enc.a", "enc.b"]),
        (dict(names=["*.a"]), ["enc.a", "dec.a"]),
        (dict(names=[lambda n: n.startswith("d")]), ["dec.a"]),
        (dict(exclude=["head"]), ["enc.a", "enc.b", "dec.a"]),
        (dict(exclude=["enc.*"]), ["dec.a", "head"]),
        (dict(exclude=[lambda n: "." in n]), ["head"]),
        (dict(names=["enc.*", "head"], exclude=["enc.b"]), ["enc.a", "head"]),
        (dict(names=lambda n: n.startswith("nothing")), []),
    ],
)
def test_names_and_exclude_select_sites(kw, keys):
    assert reap(many, **kw)(X).keys() == set(keys)
    close(reap(many, **kw)(X), {k: ALL[k] for k in keys})
    # call_and_reap filters the same way
    close(call_and_reap(many, **kw)(X)[1], {k: ALL[k] for k in keys})


@pytest.mark.parametrize("selected", ["haed", ["head", "enc.c"], ["nothing*"], ["enc.*", "*.z"]])
@pytest.mark.parametrize("transform", [reap, call_and_reap])
def test_names_strings_that_match_nothing_list_the_names(selected, transform):
    # A typo must not silently reap {}: each string entry has to match a site,
    # and the message lists the names there are, in program order.
    with pytest.raises(ValueError, match=r"matches no sow site.*'enc.a', 'enc.b', 'dec.a', 'head'"):
        transform(many, names=selected)(X)
    # The same under an outer jit (the walk then runs in place).
    with pytest.raises(ValueError, match=r"matches no sow site"):
        jax.jit(transform(many, names=selected))(X)


def test_names_check_is_per_tag_and_spares_predicates_and_exclude():
    def f(x):
        sow(x, name="a", tag="other", mode="strict")
        return sow(x + 1.0, name="b", mode="strict")

    with pytest.raises(ValueError, match=r"'a' matches no sow site of tag 'intermediates'.*: 'b'"):
        reap(f, names="a")(X)
    close(reap(f, tag="other", names="a")(X), {"a": X})
    # A predicate may select nothing (a site behind a Python flag); exclude= may exclude nothing.
    assert reap(f, names=lambda n: n == "a")(X) == {}
    close(reap(f, exclude=["zzz"])(X), {"b": X + 1.0})
    with pytest.raises(ValueError, match=r"'zz\*' matches no sow site"):
        plant(f, names="zz*")({}, X)


def test_plant_respects_exclude_of_unplanted_names():
    def f(x):
        a = sow(x + 1.0, name="a", mode="strict")
        return sow(a * 2.0, name="b", mode="strict")

    # harvest with names=: b not handled -> not reaped
    out, reaps = harvest(f, names=["a"])({}, X)
    close(out, (X + 1.0) * 2.0)
    close(reaps, {"a": X + 1.0})


# ---------------------------------------------------------------------------
# Round trip and tags


@settings(max_examples=20, deadline=None)
@given(
    mode=st.sampled_from(["strict", "append", "collect", "clobber"]),
    vals=st.lists(st.floats(-3, 3, width=32), min_size=3, max_size=3),
)
def test_round_trip(mode, vals):
    x = jnp.array(vals, jnp.float32)

    def f(x):
        a = sow(jnp.sin(x), name="a", mode=mode)
        if mode == "strict":
            return a * 2.0
        b = sow(a * 2.0 + 1.0, name="a", mode=mode)
        return b * b

    close(plant(f)(reap(f)(x), x), f(x))
    # and the round trip through a perturbed reap plants the perturbed values
    r = jax.tree_util.tree_map(lambda l: l + 1.0, reap(f)(x))
    if mode == "strict":
        close(plant(f)(r, x), (jnp.sin(x) + 1.0) * 2.0)
    elif mode == "clobber":
        # the last value is planted at every occurrence
        v = r["a"]
        close(plant(f)(r, x), v * v)
    else:
        last = r["a"][1]  # entry 1 (collect) or row 1 (append)
        close(plant(f)(r, x), last * last)


def test_tags_are_namespaces():
    def f(x):
        a = sow(x + 1.0, name="v", tag="a", mode="strict")
        b = sow(a * 2.0, name="v", tag="b", mode="strict")
        return b + 1.0

    a, b = X + 1.0, (X + 1.0) * 2.0
    close(reap(f, tag="a")(X), {"v": a})
    close(reap(f, tag="b")(X), {"v": b})
    # a tag the function never sows, beside tags it does: a typo, refused (issue 23)
    with pytest.raises(ValueError, match="tags 'a', 'b'"):
        reap(f, tag="c")(X)
    with pytest.raises(ValueError, match="no sow of tag 'intermediates'"):
        reap(f)(X)
    va = jnp.full(3, 10.0)
    vb = jnp.full(3, -5.0)
    # reap(plant(f, "a"), "b"): b sees the planted a
    close(reap(lambda x: plant(f, tag="a")({"v": va}, x), tag="b")(X), {"v": va * 2.0})
    # plant(reap(f, "a"), "b"): the b plant changes nothing that a sees, but goes through
    close(plant(lambda x: reap(f, tag="a")(x), tag="b")({"v": vb}, X), {"v": a})
    # plant b inside, reap a outside, where a's value is used after b: check the output
    close(
        plant(lambda x: call_and_reap(f, tag="a")(x), tag="b")({"v": vb}, X), (vb + 1.0, {"v": a})
    )
    # plant both tags
    close(plant(lambda x: plant(f, tag="a")({"v": va}, x), tag="b")({"v": vb}, X), vb + 1.0)


def test_reaping_same_tag_twice_finds_nothing_second_time():
    def f(x):
        return sow(x * 3.0, name="h", mode="strict") + 1.0

    inner = reap(lambda x: reap(f)(x))(X)
    close(inner, {})
    outer = call_and_reap(lambda x: call_and_reap(f)(x))(X)
    close(outer, ((X * 3.0 + 1.0, {"h": X * 3.0}), {}))
    # a planted sow is gone too
    close(reap(lambda x: plant(f)({"h": jnp.ones(3)}, x))(X), {})


def test_plant_partial_names_keeps_others():
    def f(x):
        a = sow(x + 1.0, name="a", mode="strict")
        b = sow(a * 2.0, name="b", mode="strict")
        return b

    close(plant(f)({"b": jnp.zeros(3)}, X), jnp.zeros(3))
    close(plant(f)({"a": jnp.zeros(3)}, X), jnp.zeros(3) * 2.0)
    close(plant(f)({}, X), (X + 1.0) * 2.0)


def test_kwargs_pass_through():
    def f(x, *, scale):
        return sow(x * scale, name="s", mode="strict")

    close(reap(f)(X, scale=2.0), {"s": X * 2.0})
    close(plant(f)({"s": jnp.ones(3)}, X, scale=2.0), jnp.ones(3))


def test_collect_occurrences_with_different_shapes_round_trip():
    def f(x):
        a = sow(x, name="m")
        b = sow(x[:1] * 2.0, name="m")
        return a.sum() + b.sum()

    r = reap(f)(X)
    close(r, {"m": (X, X[:1] * 2.0)})
    close(plant(f)(r, X), f(X))
    close(plant(f)({"m": (jnp.ones(3), jnp.full(1, 5.0))}, X), jnp.float32(8.0))


def test_collect_plant_of_a_tuple_valued_sow():
    # A tuple shaped like the sown value is one value for every occurrence; a
    # tuple of such tuples gives one per occurrence, as reap returns them.
    def f(x):
        a, b = sow((x, 2.0 * x), name="pair")
        c, d = sow((a + b, a * b), name="pair")
        return c - d

    def ref(x, first, second):
        a, b = first if first is not None else (x, 2.0 * x)
        return second[0] - second[1] if second is not None else (a + b) - a * b

    one = (jnp.float32(10.0), jnp.float32(20.0))
    close(plant(f)({"pair": one}, 1.0), ref(1.0, one, one))
    two = ((jnp.float32(1.0), jnp.float32(2.0)), (jnp.float32(5.0), jnp.float32(3.0)))
    close(plant(f)({"pair": two}, 1.0), ref(1.0, *two))
    close(plant(f)({"pair": reap(f)(1.5)["pair"]}, 1.5), f(1.5))
    with pytest.raises(ValueError, match=r"(?s)'pair'.*has 3 entries.*2 entries"):
        plant(f)({"pair": two + two[:1]}, 1.0)


# ---------------------------------------------------------------------------
# Program order, and dotted names


@settings(max_examples=25, deadline=None)
@given(
    names=st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=1, max_size=6, unique=True),
    inner=st.sampled_from(["plain", "jit", "scan", "cond"]),
)
def test_reaped_dicts_come_in_program_order(names, inner):
    # The reference is the order the sows were written in; jit's dict
    # flattening (which sorts keys) must not leak through.
    def body(x):
        for i, n in enumerate(names):
            x = sow(x + i, name=n, mode="clobber")
        return x

    def wrapped(x):
        if inner == "jit":
            return jax.jit(body)(x)
        if inner == "scan":
            return jax.lax.scan(lambda c, _: (body(c), None), x, None, length=2)[0]
        if inner == "cond":
            return jax.lax.cond(x[0] > 0, body, lambda x: body(x * 2.0), x)
        return body(x)

    def f(x):
        x = sow(x, name="~first", mode="strict")
        x = nest(wrapped, scope="mid")(x)
        return sow(x, name="!last", mode="strict")

    reaped = reap(f)(X)
    assert list(reaped) == ["~first", "mid", "!last"]
    assert list(reaped["mid"]) == names
    assert list(call_and_reap(f)(X)[1]["mid"]) == names
    assert list(harvest(f)({"~first": X}, X)[1]) == ["mid", "!last"]


def test_plants_take_dotted_names_and_nested_dicts_alike():
    def layer(x):
        return sow(x * 2.0, name="resid", mode="strict")

    def f(x):
        x = nest(nest(layer, scope="attn"), scope="blocks1")(x)
        return sow(x + 1.0, name="head", mode="strict")

    five = jnp.full_like(X, 5.0)
    want = five + 1.0
    for plants in [
        {"blocks1.attn.resid": five},
        {"blocks1": {"attn.resid": five}},
        {"blocks1": {"attn": {"resid": five}}},
    ]:
        close(plant(f)(plants, X), want)
        out, reaps = harvest(f)(plants, X)
        close(out, want)
        close(reaps, {"head": want})
    with pytest.raises(ValueError, match="twice"):
        plant(f)({"blocks1.attn.resid": five, "blocks1": {"attn": {"resid": five}}}, X)
    with pytest.raises(KeyError, match=r"'blocks1.attn.res'.*'blocks1.attn.resid', 'head'"):
        plant(f)({"blocks1.attn.res": five}, X)
