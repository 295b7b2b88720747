"""Adversarial cases (issue 23), each against the function without harvest
or the computation threaded by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest
from harvest import plant, reap, sow

# -- item 2: Python state is read as jax.jit reads it ---------------------------


def test_negative_zero_argument_is_not_the_zero_program():
    def f(x, s):
        return sow(x * jnp.copysign(1.0, s), name="h", mode="clobber")

    for s in (0.0, -0.0, 0.0):
        assert float(reap(f)(1.0, s)["h"]) == float(np.copysign(1.0, s))
        assert float(plant(f)({}, 1.0, s)) == float(np.copysign(1.0, s))


def test_closed_over_and_module_level_values_are_read_when_traced():
    """As `jax.jit(f)` reads them: a closed-over number, array or dict and a global,
    rebound after the first call, are not seen until f traces again."""
    global SCALE
    scale, w, params = 2.0, jnp.array([2.0, 3.0]), {"n": 2}

    def f(x):
        return sow(x * scale * w * params["n"] * SCALE, name="h", mode="clobber").sum()

    g, jf = reap(f), jax.jit(f)
    np.testing.assert_allclose(g(1.0)["h"], [8.0, 12.0])
    jf(1.0)
    try:
        scale, w, params, SCALE = 3.0, jnp.array([5.0, 7.0]), {"n": 5}, 3.0
        np.testing.assert_allclose(g(1.0)["h"], [8.0, 12.0])
        np.testing.assert_allclose(g(1.0)["h"].sum(), jf(1.0))
        harvest.clear_caches()
        np.testing.assert_allclose(g(1.0)["h"], [225.0, 315.0])
        np.testing.assert_allclose(plant(f)({"h": jnp.ones(2)}, 1.0), 2.0)
    finally:
        SCALE = 1.0


SCALE = 1.0


class _Config:
    def __init__(self, a):
        self.a = a


def test_mutated_identity_hashed_config_is_read_when_traced():
    # A static argument is compared by `==` (a plain object: by identity), as under
    # `jax.jit`: its attributes are read when f is traced.
    def f(x, cfg):
        return sow(x * cfg.a, name="h", mode="clobber")

    cfg, jf = _Config(2.0), jax.jit(f, static_argnums=1)
    assert float(reap(f)(1.0, cfg)["h"]) == f(1.0, cfg) == jf(1.0, cfg) == 2.0
    cfg.a = 4.0
    assert float(reap(f)(1.0, cfg)["h"]) == jf(1.0, cfg) == 2.0
    harvest.clear_caches()
    assert float(reap(f)(1.0, cfg)["h"]) == f(1.0, cfg) == 4.0
    assert np.signbit(reap(f)(1.0, _Config(-0.0))["h"])


def test_mutated_closed_over_config_is_read_when_traced():
    cfg = _Config(2.0)
    f = _closing_over_config(cfg)
    assert float(reap(f)(1.0)["h"]) == 2.0
    cfg.a = 6.0
    assert float(reap(f)(1.0)["h"]) == 2.0  # its contents: read when f was traced
    harvest.clear_caches()
    assert float(reap(f)(1.0)["h"]) == f(1.0) == 6.0


def _closing_over_config(cfg):
    def f(x):
        return sow(x * cfg.a, name="h", mode="clobber")

    return f


def test_nonlocal_writes_still_reach_the_cell():
    calls = 0

    def f(x):
        nonlocal calls
        calls += 1
        return sow(x * 2.0, name="h", mode="clobber")

    reap(f)(1.0)
    assert calls == 1


def test_closure_through_jit_and_grad():
    w = jnp.array(3.0)

    def f(x):
        return sow(x * w, name="h", mode="clobber") ** 2

    g = jax.grad(lambda x: reap(f)(x)["h"] ** 2)(2.0)
    np.testing.assert_allclose(g, 2 * 6.0 * 3.0)
    np.testing.assert_allclose(jax.jit(reap(f))(2.0)["h"], 6.0)
    w = jnp.array(4.0)
    np.testing.assert_allclose(reap(f)(2.0)["h"], 8.0)


# -- item 8: a tag that matches no site ----------------------------------------


def _two_tags(x):
    a = sow(x, name="a", mode="clobber", tag="params")
    return sow(a * 2.0, name="b", mode="clobber", tag="other")


def test_a_tag_matching_no_site_lists_the_tags_the_function_has():
    with pytest.raises(ValueError, match=r"no sow of tag 'intermediates'.*'other', 'params'"):
        reap(_two_tags)(1.0)
    with pytest.raises(ValueError, match="no sow of tag 'parms'"):
        reap(_two_tags, tag="parms")(1.0)
    assert float(reap(_two_tags, tag="params")(1.0)["a"]) == 1.0


def test_a_function_without_any_sow_still_reaps_nothing():
    assert reap(lambda x: x * 2.0)(1.0) == {}


def test_a_tag_an_inner_harvest_consumed_is_not_a_typo():
    def planted_inside(x):
        return plant(_two_tags, tag="params")({"a": 3.0}, x)

    assert reap(planted_inside, tag="params")(1.0) == {}
    assert float(reap(planted_inside, tag="other")(1.0)["b"]) == 6.0


def test_instrumented_model_reaped_without_the_modules_tag():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(2, 2, 2, 1, key=jax.random.key(0))
    probed = harvest.instrument(model)
    with pytest.raises(ValueError, match="'modules'"):
        reap(probed)(jnp.ones(2))
    with pytest.raises(ValueError, match="no sow of tag 'module'"):
        reap(probed, tag="module")(jnp.ones(2))


def test_compat_oryx_keeps_its_empty_reap():
    from harvest.compat import oryx

    def f(x):
        return oryx.sow(x * 2.0, tag="other", name="b", mode="clobber")

    assert oryx.reap(f, tag="intermediates")(1.0) == {}


# -- item 5: every dotted path names one site ----------------------------------


def _sows_b_h(x):
    return sow(x * 2.0, name="b.h", mode="clobber")


def _sows_h(x):
    return sow(x * 3.0, name="h", mode="clobber")


def test_two_sites_spelled_alike_are_refused():
    def f(x):
        return harvest.nest(harvest.nest(_sows_h, scope="b"), scope="a")(x) + harvest.nest(
            _sows_b_h, scope="a"
        )(x)

    assert f(1.0) == 5.0
    for call in (lambda: reap(f)(1.0), lambda: plant(f)({"a": {"b": {"h": 0.0}}}, 1.0)):
        with pytest.raises(ValueError, match=r"both spelled 'a\.b\.h'.*Rename"):
            call()


def test_a_dotted_nest_scope_is_refused_with_the_way_to_nest():
    with pytest.raises(ValueError, match=r"nest\(nest\(f, scope='b'\), scope='a'\)"):
        harvest.nest(_sows_h, scope="a.b")


def test_a_flat_dotted_name_beside_its_prefix_plants_the_site_it_spells():
    def f(x):
        return sow(x * 2.0, name="a.b", mode="clobber") + 10.0 * sow(x, name="a", mode="clobber")

    # hand-threaded: a.b planted to 0., a stays x
    assert float(plant(f)({"a.b": 0.0}, 1.0)) == 10.0
    assert float(plant(f)({"a": 3.0}, 1.0)) == 2.0 + 30.0


# -- item 6: a scan of length 0 round-trips -------------------------------------


@pytest.mark.parametrize("mode", ["append", "collect", "clobber"])
def test_length_zero_scan_round_trip(mode):
    def f(c0, xs):
        def body(c, x):
            return c + sow(x * 2.0, name="h", mode=mode), c

        return jax.lax.scan(body, c0, xs)

    xs = jnp.zeros((0, 3))
    c0 = jnp.ones(3)
    reaped = reap(f)(c0, xs)
    planted = plant(f)(reaped, c0, xs)
    for got, want in zip(jax.tree_util.tree_leaves(planted), jax.tree_util.tree_leaves(f(c0, xs))):
        np.testing.assert_array_equal(got, want)
        assert got.shape == want.shape
    if mode == "append":
        assert reaped["h"].shape == (0, 3)
    if mode == "collect":
        assert [e.shape for e in reaped["h"]] == [(0, 3)]


# -- item 7: eager-only Python names the user's function -----------------------


def _branches_on_a_value(x):
    if x.sum() > 0:
        return sow(x, name="h", mode="clobber")
    return x


def _casts_to_int(x):
    return sow(x, name="h", mode="clobber") * int(jnp.argmax(x))


@pytest.mark.parametrize("fn", [_branches_on_a_value, _casts_to_int])
def test_eager_only_python_names_the_function_and_says_harvest_traces(fn):
    assert fn(jnp.ones(2)) is not None  # works eagerly
    # JAX's own error (bool or int of a tracer), with the user's function named in it.
    with pytest.raises(jax.errors.ConcretizationTypeError, match=fn.__name__) as info:
        reap(fn)(jnp.ones(2))
    assert fn.__name__ in str(info.value) and "flat_f" not in str(info.value)
    assert "as jax.jit does" in "".join(info.value.__notes__)


# -- item 9: the error gaps ------------------------------------------------------


def _doubles(x):
    return sow(x * 2.0, name="h", mode="clobber")


def _as_uint32(x):
    return sow(x.astype(jnp.uint32), name="h", mode="clobber")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: reap(_doubles, names=3)(1.0), "names= takes names"),
        (lambda: plant(_doubles)({"h": "zero"}, 1.0), r"name='h'.*is a str"),
        (lambda: plant(_doubles)({"h": lambda old: "zero"}, 1.0), r"callable.*name='h'.*is a str"),
        (lambda: plant(_doubles)({"h": lambda a, b, c: a}, 1.0), r"name='h'.*\(old, i\) -> new"),
    ],
)
def test_bad_plants_and_filters_say_what_to_do(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_a_python_number_takes_the_sites_dtype():
    big = plant(_as_uint32)({"h": 2**31}, jnp.ones(()))
    assert big.dtype == jnp.uint32 and int(big) == 2**31 == int(np.uint32(2**31))
    assert float(plant(_doubles)({"h": True}, 1.0)) == 1.0
    assert int(plant(_as_uint32)({"h": np.uint32(3)}, jnp.ones(()))) == 3
    flag = plant(lambda x: sow(x > 0, name="h", mode="clobber"))({"h": False}, jnp.ones(()))
    assert flag.dtype == jnp.bool_ and not bool(flag)


# -- item 10: custom_vmap under vmap never reaps {} ------------------------------


def test_custom_vmap_sow_under_vmap_is_reaped():
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def g(x):
        return sow(jnp.sin(x), name="h", mode="clobber")

    @g.def_vmap
    def _rule(axis_size, in_batched, x):
        return jnp.sin(x), in_batched[0]

    xs = jnp.array([0.1, 0.2, 0.3])
    for reaped in (reap(jax.vmap(g))(xs), jax.vmap(reap(g))(xs)):
        np.testing.assert_allclose(reaped["h"], np.sin(np.asarray(xs)), rtol=1e-6)


# -- item 4: planting inside a custom_vjp around a while_loop --------------------


_RULE_SLOPE = 0.125  # the user's backward rule: d solve / dx, whatever the body does


@jax.custom_vjp
def _halving_solver(x):
    def body(carry):
        i, v = carry
        return i + 1, sow(v * 0.5, name="h", mode="clobber")

    return jax.lax.while_loop(lambda carry: carry[0] < 3, body, (0, x))[1]


_halving_solver.defvjp(lambda x: (_halving_solver(x), None), lambda _, g: (g * _RULE_SLOPE,))


def _uses_solver(x):
    return _halving_solver(x) * x


def test_grad_of_plant_in_a_custom_vjp_while_is_refused_not_silently_the_rules():
    # The user's rule (0.125) describes the unplanted solver: by hand, with h
    # planted to 5 the solver is the constant 5, and d out/dx = 5, not the
    # rule's 0.125 * x + 5. So differentiating through it is an error.
    x = 2.0
    assert float(plant(_uses_solver)({"h": 5.0}, x)) == 5.0 * x
    for planted in (
        lambda x: plant(_uses_solver)({"h": 5.0}, x),
        lambda x: plant(_uses_solver)({"h": lambda v: v * 2.0}, x),
        lambda p: plant(_uses_solver)({"h": p}, 2.0),
    ):
        with pytest.raises(ValueError, match=r"'_halving_solver'.*name='h'.*silently wrong"):
            jax.grad(planted)(x)
    with pytest.raises(ValueError, match=r"'_halving_solver'.*silently wrong"):
        jax.jit(jax.grad(lambda x: plant(_uses_solver)({"h": 5.0}, x)))(x)
    # Reaping keeps working, and grad of the unharvested function is unchanged.
    out, reaped = harvest.harvest(_uses_solver)({}, x)
    assert float(reaped["h"]) == x / 8 and float(out) == float(_uses_solver(x))
    assert float(jax.grad(lambda x: harvest.harvest(_uses_solver)({}, x)[0])(x)) == float(
        jax.grad(_uses_solver)(x)
    )


# -- item 7: non-array outputs pass through, as under equinox.filter_jit ----------


def _mixed_outputs(x, label):
    h = sow(x * 2.0, name="h", mode="clobber")
    return {"label": label, "count": 3, "ratio": 0.5, "none": None, "y": h + 1.0}


@pytest.mark.parametrize("label", ["first", "second"])
def test_non_array_outputs_pass_through_as_themselves(label):
    want = _mixed_outputs(jnp.ones(2), label)
    for _ in range(2):  # the second call reuses the compiled program
        out, reaped = harvest.call_and_reap(_mixed_outputs)(jnp.ones(2), label)
        planted = plant(_mixed_outputs)({"h": jnp.zeros(2)}, jnp.ones(2), label)
        for got in (out, planted):
            assert got["label"] == label and got["none"] is None
            assert type(got["count"]) is int and got["count"] == 3
            assert type(got["ratio"]) is float and got["ratio"] == 0.5
        np.testing.assert_array_equal(out["y"], want["y"])
        np.testing.assert_array_equal(planted["y"], jnp.ones(2))
        np.testing.assert_array_equal(reaped["h"], 2.0 * jnp.ones(2))
    assert plant(lambda x: (sow(x, name="h", mode="clobber"), 3)[1])({"h": 1.0}, 1.0) == 3


# -- item 9: a per-example plant into a site vmap left unbatched ----------------


def _scales(x, c):
    return x * c + jnp.sum(c)


def _vmapped_unbatched_site(xs):
    def per_row(x):
        c = sow(jnp.ones(2), name="c", mode="clobber")  # does not depend on x
        return jax.jit(_scales)(x, c)

    return jax.vmap(per_row)(xs)


def test_a_per_example_plant_batches_a_site_vmap_left_unbatched():
    xs = jnp.arange(6.0).reshape(3, 2)
    plants = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    by_hand = jnp.stack([_scales(x, c) for x, c in zip(xs, plants)])
    for planting in (plant(_vmapped_unbatched_site), jax.jit(plant(_vmapped_unbatched_site))):
        np.testing.assert_allclose(planting({"c": plants}, xs), by_hand)
    # One value for every example, and the round trip, as before.
    np.testing.assert_allclose(
        plant(_vmapped_unbatched_site)({"c": plants[0]}, xs),
        jnp.stack([_scales(x, plants[0]) for x in xs]),
    )
    reaped = reap(_vmapped_unbatched_site)(xs)
    assert reaped["c"].shape == (2,)  # still unbatched when reaped
    np.testing.assert_allclose(
        plant(_vmapped_unbatched_site)(reaped, xs), _vmapped_unbatched_site(xs)
    )
    with pytest.raises(ValueError, match=r"name='c'.*float32\[4, 2\]"):
        plant(_vmapped_unbatched_site)({"c": jnp.ones((4, 2))}, xs)  # 4 is not the batch


def test_grad_of_plant_in_odeint_is_the_planted_adjoint():
    from jax.experimental.ode import odeint

    def decay(k):
        field = lambda y, t, k: sow(-k * y, name="rate", mode="clobber")  # noqa: E731
        return odeint(field, 1.0, jnp.array([0.0, 1.0]), k)[-1]

    k = 0.5
    doubled = plant(decay)({"rate": lambda r: 2.0 * r}, k)
    np.testing.assert_allclose(doubled, np.exp(-2.0 * k), rtol=1e-4)  # y' = -2ky, by hand
    # By hand the derivative is -2 exp(-2k) (the unplanted adjoint gave -exp(-k)).
    grad = jax.grad(lambda k: plant(decay)({"rate": lambda r: 2.0 * r}, k))(k)
    np.testing.assert_allclose(grad, -2.0 * np.exp(-2.0 * k), rtol=1e-4)


def test_float32_matmuls_are_full_precision_on_every_backend():
    # A TPU multiplies float32 matrices in bfloat16 passes unless asked; tests/conftest.py
    # asks for full precision there, so a reaped product matches NumPy's in float64.
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 128, 128)).astype(np.float32)
    product = reap(lambda a, b: sow(a @ b, name="p", mode="clobber"))(a, b)["p"]
    exact = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(np.asarray(product), exact, rtol=1e-5, atol=1e-4)
