"""harvest.ppl against TensorFlow Probability's own joint distributions."""

import doctest
import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import harvest.ppl as ppl
from harvest.ppl import _block, _plate, _random_variable, _tfp_shim, _transforms, _unconstrained
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd = tfp.distributions
Root = tfd.JointDistributionCoroutine.Root

pytestmark = [
    # TFP's JAX substrate asks for float64 and passes None shapes internally.
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
]
few = settings(max_examples=8, deadline=None)
finite = st.floats(-3.0, 3.0, allow_nan=False, width=32)


# A hierarchical model with scalar, positive, vector-valued and discrete (int)
# variables, once in harvest.ppl and once as a TFP joint distribution.
def hierarchical(key, n_groups=3):
    k_mu, k_scale, k_theta, k_flags = jax.random.split(key, 4)
    mu = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu")(k_mu)
    scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k_scale)
    theta = ppl.random_variable(
        tfd.Independent(tfd.Normal(jnp.full(n_groups, mu), scale), 1), name="theta"
    )(k_theta)
    return ppl.random_variable(tfd.Independent(tfd.Bernoulli(logits=theta), 1), name="flags")(
        k_flags
    )


def hierarchical_tfp(n_groups=3):
    def coroutine():
        mu = yield Root(tfd.Normal(0.0, 1.0))
        scale = yield Root(tfd.HalfNormal(1.0))
        theta = yield tfd.Independent(tfd.Normal(jnp.full(n_groups, mu), scale), 1)
        yield tfd.Independent(tfd.Bernoulli(logits=theta), 1)

    return tfd.JointDistributionCoroutine(coroutine)


ORDER = ("mu", "scale", "theta", "flags")


def as_tuple(values):
    return tuple(values[name] for name in ORDER)


def draw(seed):
    return ppl.joint_sample(hierarchical)(jax.random.key(seed))


def close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-5)


# ---------------------------------------------------------------------------
# joint_sample and joint_log_prob


def test_joint_sample_names_every_variable_with_its_shape_and_dtype():
    values = draw(0)
    assert sorted(values) == sorted(ORDER)
    assert values["theta"].shape == values["flags"].shape == (3,)
    assert values["flags"].dtype == jnp.int32
    assert values["mu"].shape == ()


@few
@given(seed=st.integers(0, 2**16))
def test_joint_log_prob_matches_tfp_joint_distribution(seed):
    values = draw(seed)
    close(ppl.joint_log_prob(hierarchical)(values), hierarchical_tfp().log_prob(as_tuple(values)))


@few
@given(
    mu=finite,
    log_scale=st.floats(-1.0, 1.0, width=32),
    theta=st.lists(finite, min_size=3, max_size=3),
)
def test_grad_of_joint_log_prob_matches_tfp(mu, log_scale, theta):
    values = {
        "mu": jnp.float32(mu),
        "scale": jnp.exp(jnp.float32(log_scale)),
        "theta": jnp.asarray(theta, jnp.float32),
        "flags": jnp.array([0, 1, 1], jnp.int32),
    }
    ours = jax.grad(ppl.joint_log_prob(hierarchical), allow_int=True)(values)
    theirs = jax.grad(lambda v: hierarchical_tfp().log_prob(as_tuple(v)), allow_int=True)(values)
    for name in ("mu", "scale", "theta"):
        close(ours[name], theirs[name], rtol=1e-4)


def test_jit_and_vmap_over_keys_and_over_values():
    keys = jax.random.split(jax.random.key(1), 5)
    values = jax.jit(jax.vmap(ppl.joint_sample(hierarchical)))(keys)
    assert values["theta"].shape == (5, 3)
    scores = jax.jit(jax.vmap(ppl.joint_log_prob(hierarchical)))(values)
    close(scores, jax.vmap(hierarchical_tfp().log_prob)(as_tuple(values)))


def test_joint_sample_follows_the_key():
    a, b = draw(3), draw(3)
    close(a["theta"], b["theta"])
    assert not np.allclose(a["theta"], draw(4)["theta"])


# ---------------------------------------------------------------------------
# intervene and conditional


def hierarchical_with_mu_fixed(key, mu, n_groups=3):
    """`hierarchical` written by hand with mu a constant."""
    _, k_scale, k_theta, k_flags = jax.random.split(key, 4)
    scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k_scale)
    theta = ppl.random_variable(
        tfd.Independent(tfd.Normal(jnp.full(n_groups, mu), scale), 1), name="theta"
    )(k_theta)
    return ppl.random_variable(tfd.Independent(tfd.Bernoulli(logits=theta), 1), name="flags")(
        k_flags
    )


@few
@given(seed=st.integers(0, 2**16), mu=finite)
def test_intervene_equals_the_model_with_a_constant(seed, mu):
    key = jax.random.key(seed)
    mu = jnp.float32(mu)
    fixed = ppl.intervene(hierarchical, mu=mu)
    by_hand = hierarchical_with_mu_fixed
    samples = ppl.joint_sample(fixed)(key)
    assert sorted(samples) == ["flags", "scale", "theta"]
    for name, value in ppl.joint_sample(by_hand)(key, mu).items():
        close(samples[name], value)
    close(fixed(key), by_hand(key, mu))
    close(ppl.joint_log_prob(fixed)(samples), ppl.joint_log_prob(by_hand)(samples, mu))


def test_intervened_variable_no_longer_counts_in_the_density():
    values = draw(5)
    fixed = ppl.intervene(hierarchical, mu=values["mu"])
    rest = {k: v for k, v in values.items() if k != "mu"}
    full = ppl.joint_log_prob(hierarchical)(values)
    close(ppl.joint_log_prob(fixed)(rest), full - tfd.Normal(0.0, 1.0).log_prob(values["mu"]))


def test_intervene_downstream_uses_the_value():
    out = ppl.intervene(hierarchical, theta=jnp.array([-50.0, -50.0, -50.0]))(jax.random.key(0))
    close(out, jnp.zeros(3))  # logits of -50 draw zeros


def test_conditional_takes_values_after_the_arguments():
    key = jax.random.key(2)
    given_mu = ppl.conditional(hierarchical, "mu")
    close(given_mu(key, 1.5), ppl.intervene(hierarchical, mu=1.5)(key))
    both = ppl.conditional(hierarchical, ["mu", "theta"])
    close(both(key, 0.0, jnp.array([-50.0, -50.0, -50.0])), jnp.zeros(3))
    assert ppl.conditional(hierarchical, []) is hierarchical


def test_conditional_under_jit_and_vmap_over_values():
    keys = jax.random.split(jax.random.key(0), 4)
    mus = jnp.linspace(-1.0, 1.0, 4)
    outs = jax.jit(jax.vmap(ppl.conditional(hierarchical, "mu")))(keys, mus)
    for key, mu, out in zip(keys, mus, outs):
        close(out, ppl.intervene(hierarchical, mu=mu)(key))


def test_nested_names_are_dicts_and_dotted_for_conditional():
    def model(key):
        k1, k2 = jax.random.split(key)
        z = ppl.nest(ppl.random_variable(tfd.Normal(0.0, 1.0), name="z"), scope="prior")(k1)
        return ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)

    values = ppl.joint_sample(model)(jax.random.key(0))
    assert set(values) == {"prior", "x"} and set(values["prior"]) == {"z"}
    expected = tfd.Normal(0.0, 1.0).log_prob(values["prior"]["z"]) + tfd.Normal(
        values["prior"]["z"], 1.0
    ).log_prob(values["x"])
    close(ppl.joint_log_prob(model)(values), expected)
    close(
        ppl.conditional(model, "prior.z")(jax.random.key(0), 7.0),
        ppl.intervene(model, prior={"z": 7.0})(jax.random.key(0)),
    )
    assert list(ppl.joint_sample(ppl.intervene(model, prior={"z": 7.0}))(jax.random.key(0))) == [
        "x"
    ]


# ---------------------------------------------------------------------------
# Time series: random variables in lax.scan use mode="append".

T = 6


def ar1(key, rho=0.8):
    def step(previous, k):
        x = ppl.random_variable(tfd.Normal(rho * previous, 1.0), name="x", mode="append")(k)
        return x, x

    return jax.lax.scan(step, 0.0, jax.random.split(key, T))[1]


def ar1_tfp(rho=0.8):
    def coroutine():
        previous = 0.0
        for _ in range(T):
            previous = yield tfd.Normal(rho * previous, 1.0)

    return tfd.JointDistributionCoroutineAutoBatched(coroutine)


@few
@given(seed=st.integers(0, 2**16))
def test_scan_draws_reap_stacked_and_score_like_tfp(seed):
    key = jax.random.key(seed)
    xs = ppl.joint_sample(ar1)(key)["x"]
    assert xs.shape == (T,)
    close(xs, ar1(key))
    close(ppl.joint_log_prob(ar1)({"x": xs}), ar1_tfp().log_prob(tuple(xs)))


def test_scan_draws_plant_stacked():
    path = jnp.arange(T, dtype=jnp.float32)
    close(ppl.intervene(ar1, x=path)(jax.random.key(0)), path)
    assert ppl.joint_sample(ppl.intervene(ar1, x=path))(jax.random.key(0)) == {}


def test_grad_through_scan_matches_tfp():
    xs = ppl.joint_sample(ar1)(jax.random.key(9))["x"]
    ours = jax.grad(lambda x: ppl.joint_log_prob(ar1)({"x": x}))(xs)
    theirs = jax.grad(lambda x: ar1_tfp().log_prob(tuple(x)))(xs)
    close(ours, theirs, rtol=1e-4)


# ---------------------------------------------------------------------------
# log_prob, plate, plain samplers


def test_log_prob_of_a_distribution_and_of_a_single_draw():
    normal = tfd.Normal(1.0, 2.0)
    close(ppl.log_prob(normal)(0.5), normal.log_prob(0.5))
    single = ppl.random_variable(normal, name="y")
    close(ppl.log_prob(single)(0.5), normal.log_prob(0.5))


@pytest.mark.parametrize(
    "wrap", [jax.jit, jax.checkpoint, jax.named_call], ids=["jit", "checkpoint", "named_call"]
)
def test_log_prob_sees_a_draw_through_a_call_primitive(wrap):
    # Calls are recognised by primitive object, not by name (JAX renames them:
    # `checkpoint` is staged as `remat2`), so every call passes the draw through.
    def draw(key, loc):
        k1, k2 = jax.random.split(key)
        return (
            ppl.random_variable(tfd.Normal(loc, 1.0), name="a")(k1),
            ppl.random_variable(tfd.Normal(loc, 2.0), name="b")(k2),
        )

    def model(key):
        return wrap(draw)(key, 0.5)

    def unwrapped(key):
        return draw(key, 0.5)

    value = (0.5, 1.5)
    expected = tfd.Normal(0.5, 1.0).log_prob(0.5) + tfd.Normal(0.5, 2.0).log_prob(1.5)
    close(ppl.log_prob(model)(value), expected)
    close(ppl.log_prob(model)(value), ppl.log_prob(unwrapped)(value))
    # The example: one standard normal draw, scored at 0.
    single = wrap(ppl.random_variable(tfd.Normal(0.0, 1.0), name="x"))
    close(ppl.log_prob(single)(0.0), tfd.Normal(0.0, 1.0).log_prob(0.0))
    close(ppl.log_prob(single)(0.0), -0.9189385)


def test_log_prob_refuses_latents_the_output_depends_on():
    with pytest.raises(ValueError, match="Cannot compute log_prob of function: .* 'mu'"):
        ppl.log_prob(hierarchical)(jnp.zeros(3, jnp.int32))


@ppl.plate(name="data", size=4)
def observations(key, mu):
    return ppl.random_variable(tfd.Normal(mu, 1.0), name="y")(key)


@few
@given(seed=st.integers(0, 2**16), mu=finite)
def test_plate_draws_independent_copies_and_sums_their_density(seed, mu):
    ys = ppl.joint_sample(observations)(jax.random.key(seed), mu)["y"]
    assert ys.shape == (4,) and len(set(np.asarray(ys).tolist())) == 4
    close(ppl.joint_log_prob(observations)({"y": ys}, mu), tfd.Normal(mu, 1.0).log_prob(ys).sum())


def test_plate_inside_a_model_matches_tfp_sample():
    def model(key):
        k1, k2 = jax.random.split(key)
        mu = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu")(k1)
        return ppl.plate(ppl.random_variable(tfd.Normal(mu, 1.0), name="y"), name="data", size=5)(
            k2
        )

    def reference():
        mu = yield Root(tfd.Normal(0.0, 1.0))
        yield tfd.Sample(tfd.Normal(mu, 1.0), 5)

    values = ppl.joint_sample(model)(jax.random.key(0))
    close(
        ppl.joint_log_prob(model)(values),
        tfd.JointDistributionCoroutine(reference).log_prob((values["mu"], values["y"])),
    )


def test_plain_sampler_samples_and_intervenes_but_is_not_scored():
    def model(key):
        k1, k2 = jax.random.split(key)
        u = ppl.random_variable(jax.random.uniform, name="u")(k1)
        return ppl.random_variable(tfd.Normal(u, 1.0), name="x")(k2)

    values = ppl.joint_sample(model)(jax.random.key(0))
    with pytest.raises(
        ValueError, match="random variable .u. is drawn by a plain sampling function"
    ):
        ppl.joint_log_prob(model)(values)
    close(
        ppl.joint_log_prob(ppl.intervene(model, u=0.5))({"x": 0.0}),
        tfd.Normal(0.5, 1.0).log_prob(0.0),
    )


# ---------------------------------------------------------------------------
# Errors


def test_random_variable_without_name_says_how_to_name_it():
    with pytest.raises(TypeError, match=r"needs a name, e.g. random_variable\(dist, name='x'\)"):
        ppl.random_variable(tfd.Normal(0.0, 1.0))


def test_random_variable_rejects_bad_mode_and_non_distributions():
    with pytest.raises(ValueError, match="'append' for a draw inside lax.scan"):
        ppl.random_variable(tfd.Normal(0.0, 1.0), name="x", mode="clobber")
    with pytest.raises(TypeError, match="TFP distribution .* or a sampling function"):
        ppl.random_variable(3.0, name="x")


def test_unknown_names_list_the_known_ones():
    with pytest.raises(KeyError, match="bogus. Its random variables are: flags, mu, scale, theta"):
        ppl.intervene(hierarchical, bogus=1.0)(jax.random.key(0))
    with pytest.raises(KeyError, match="Its random variables are"):
        ppl.conditional(hierarchical, "nope")(jax.random.key(0), 1.0)


def test_joint_log_prob_names_missing_values():
    with pytest.raises(ValueError, match="missing: flags, scale, theta"):
        ppl.joint_log_prob(hierarchical)({"mu": 0.0})
    with pytest.raises(TypeError, match="as a dict"):
        ppl.joint_log_prob(hierarchical)([0.0])


def test_conditional_counts_its_values():
    with pytest.raises(TypeError, match="one value per name"):
        ppl.conditional(hierarchical, ["mu", "scale"])(jax.random.key(0))


# ---------------------------------------------------------------------------
# The TFP shim


def test_shim_restores_only_the_missing_alias(monkeypatch):
    from harvest import _jax

    if not hasattr(jax.interpreters.xla, "pytype_aval_mappings"):
        pytest.skip("this JAX has neither the alias nor the table TFP 0.25 needs")
    assert not _jax.tfp_needs_alias()  # restored at import, or JAX's own
    sentinel = {}
    monkeypatch.setattr(jax.interpreters.xla, "pytype_aval_mappings", sentinel, raising=False)
    _tfp_shim.apply_shim()
    assert jax.interpreters.xla.pytype_aval_mappings is sentinel  # never replaced
    monkeypatch.delattr(jax.interpreters.xla, "pytype_aval_mappings")
    assert _jax.tfp_needs_alias()
    _tfp_shim.apply_shim()
    assert hasattr(jax.interpreters.xla, "pytype_aval_mappings")


def test_a_failing_tfp_import_names_the_working_versions(monkeypatch):
    def broken(name):
        raise AttributeError("module 'jax' has no attribute 'something_new'")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(
        ImportError, match="tested with tensorflow-probability 0.25.0 with jax/jaxlib 0.8.x"
    ):
        _tfp_shim.import_tfp()


def test_a_tfp_import_that_failed_before_harvest_is_named(monkeypatch):
    from harvest import _jax

    def broken(name):
        raise AttributeError(
            "module 'jax.interpreters.xla' has no attribute 'pytype_aval_mappings'"
        )

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(_jax, "tfp_needs_alias", lambda: True)
    monkeypatch.setitem(sys.modules, "tensorflow_probability.python.internal.backend.jax.nest", sys)
    with pytest.raises(ImportError, match="imported before harvest.ppl.*import harvest.ppl before"):
        _tfp_shim.import_tfp()
    monkeypatch.setattr(_jax, "tfp_needs_alias", lambda: False)  # restored by harvest.ppl...
    monkeypatch.setattr(_jax, "tfp_failed_before_alias", True)  # ...after TFP had failed
    with pytest.raises(ImportError, match="imported before harvest"):
        _tfp_shim.import_tfp()


def _run(code):
    """What `code` prints in a fresh interpreter."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_import_harvest_leaves_jax_interpreters_xla_as_it_was():
    code = (
        "import jax.interpreters.xla as xla\n"
        "before = dict(vars(xla))\n"
        "import harvest\n"
        "after = dict(vars(xla))\n"
        "print(sorted(after.keys() ^ before.keys()), [k for k in before if after[k] is not before[k]])\n"
    )
    assert _run(code) == ["[]", "[]"]  # no attribute added, removed or replaced


def test_tfp_after_plain_import_harvest_says_to_import_harvest_ppl_first():
    """`import harvest` alone leaves the alias missing: TFP's import then fails with
    harvest's ImportError (not TFP's AttributeError), and harvest.ppl recovers it."""
    code = (
        "import jax.interpreters.xla as xla\n"
        "needs = not hasattr(xla, 'pytype_aval_mappings')\n"
        "import harvest\n"
        "try:\n"
        "    import tensorflow_probability.substrates.jax\n"
        "    said = 'nothing'\n"
        "except ImportError as e:\n"
        "    said = 'ImportError' if 'Import harvest.ppl before' in str(e) else repr(e)\n"
        "import harvest.ppl\n"
        "import tensorflow_probability.substrates.jax as tfp\n"
        "print(needs, said.replace(' ', '_'), tfp.distributions.Normal(0.0, 1.0).log_prob(0.0))\n"
    )
    needs, said, value = _run(code)
    assert said == ("ImportError" if needs == "True" else "nothing")
    assert value == "-0.9189385"


def test_tfp_imported_before_harvest_recovers_after_harvest_ppl():
    """TFP first fails inside TFP's own import (harvest is not loaded yet to speak);
    after `import harvest.ppl`, the same import succeeds."""
    code = (
        "import jax.interpreters.xla as xla\n"
        "needs = not hasattr(xla, 'pytype_aval_mappings')\n"
        "try:\n"
        "    import tensorflow_probability.substrates.jax\n"
        "    failed = False\n"
        "except AttributeError:\n"
        "    failed = True\n"
        "import harvest.ppl\n"
        "from harvest import _jax\n"
        "import tensorflow_probability.substrates.jax as tfp\n"
        "print(needs, failed, _jax.tfp_failed_before_alias, tfp.distributions.Normal(0.0, 1.0).log_prob(0.0))\n"
    )
    needs, failed, recorded, value = _run(code)
    # TFP failed exactly where JAX lacked the alias, and harvest noticed.
    assert needs == failed == recorded
    assert value == "-0.9189385"


def test_tfp_imports_in_a_fresh_interpreter_after_harvest_ppl():
    import subprocess

    code = "import harvest.ppl; import tensorflow_probability.substrates.jax as tfp; print(tfp.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.25.0"


# ---------------------------------------------------------------------------
# Docstring examples


@pytest.mark.parametrize(
    "module",
    [ppl, _random_variable, _transforms, _plate, _block, _unconstrained],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


# ---------------------------------------------------------------------------
# trace, block, graph_replace, deterministic


def chain(key):
    k1, k2, k3 = jax.random.split(key, 3)
    z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
    x = ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
    ppl.deterministic(x - z, name="step")
    return ppl.random_variable(tfd.Normal(x, 1.0), name="y")(k3)


def chain_by_hand(key):
    k1, k2, k3 = jax.random.split(key, 3)
    z = tfd.Normal(0.0, 1.0).sample(seed=k1)
    x = tfd.Normal(z, 1.0).sample(seed=k2)
    return z, x, tfd.Normal(x, 1.0).sample(seed=k3)


def test_trace_returns_the_output_the_draws_and_deterministic_sites():
    key = jax.random.key(3)
    out, sites = ppl.trace(chain)(key)
    z, x, y = chain_by_hand(key)
    assert sorted(sites) == ["step", "x", "y", "z"]
    close(out, y)
    close(sites["step"], x - z)
    assert sorted(ppl.joint_sample(chain)(key)) == ["x", "y", "z"]  # deterministic is not random
    expected = sum(tfd.Normal(m, 1.0).log_prob(v) for m, v in ((0.0, z), (z, x), (x, y)))
    close(ppl.trace_log_prob(chain)(out, sites), expected)


def test_block_hides_draws_from_every_transformation():
    key = jax.random.key(4)
    blocked = ppl.block(chain, ["x"])
    assert sorted(ppl.joint_sample(blocked)(key)) == ["y", "z"]
    close(blocked(key), chain(key))  # still drawn, just invisible
    with pytest.raises(KeyError, match="not random variables of the program: x"):
        ppl.intervene(blocked, x=0.0)(key)


def test_block_rejects_a_name_the_program_does_not_draw():
    with pytest.raises(KeyError, match="block: not random variables of the program: muu"):
        ppl.joint_sample(ppl.block(chain, ["muu"]))(jax.random.key(0))


def test_scoring_a_name_the_program_does_not_draw_names_the_transformation():
    values = {"z": 0.0, "x": 0.0, "y": 0.0, "yy": 1.0}
    with pytest.raises(KeyError, match=r"joint_log_prob: not random .*: yy\. .*: x, y, z\."):
        ppl.joint_log_prob(chain)(values)
    with pytest.raises(KeyError, match=r"unconstrained: not random .*: yy\. .*: x, y, z\."):
        ppl.unconstrained(chain, observed={"yy": 1.0}).init(jax.random.key(0))


def scm(key):
    k1, k2, k3 = jax.random.split(key, 3)
    z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
    x = ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
    return ppl.random_variable(tfd.Normal(x + z, 1.0), name="y")(k3)


def test_scoring_a_blocked_latent_is_an_error_not_a_placeholder_draw():
    # x and y depend on z: their marginal needs an integral over z, which harvest does not do.
    with pytest.raises(ValueError, match="depends on z, hidden by block"):
        ppl.joint_log_prob(ppl.block(scm, ["z"]))({"x": 0.5, "y": 1.0})
    with pytest.raises(ValueError, match="depends on z, hidden by block"):
        ppl.unconstrained(ppl.block(scm, ["z"]), observed={"y": 1.0}).log_density({"x": 0.5})


def test_a_blocked_leaf_is_integrated_out_exactly():
    marginal = tfd.Normal(0.0, 1.0).log_prob(1.0) + tfd.Normal(1.0, 1.0).log_prob(0.5)
    close(ppl.joint_log_prob(ppl.block(scm, ["y"]))({"z": 1.0, "x": 0.5}), marginal)
    posterior = ppl.unconstrained(ppl.block(scm, ["y"]), observed={"x": 0.5})
    close(posterior.log_density({"z": jnp.array(1.0)}), marginal)


def test_duplicate_draw_names_suggest_the_modes_random_variable_has():
    def twice(key):
        a = ppl.random_variable(tfd.Normal(0.0, 1.0), name="a")(key)
        return ppl.random_variable(tfd.Normal(a, 1.0), name="a")(key)

    def in_scan(key):
        step = lambda c, k: (c + ppl.random_variable(tfd.Normal(0.0, 1.0), name="a")(k), None)
        return jax.lax.scan(step, 0.0, jax.random.split(key, 3))[0]

    for program in (twice, in_scan):
        with pytest.raises(ValueError, match="mode='append'") as error:
            ppl.joint_sample(program)(jax.random.key(0))
        assert "clobber" not in str(error.value)


def test_a_numpyro_distribution_is_refused_with_what_to_use():
    dist = pytest.importorskip("numpyro.distributions")
    with pytest.raises(TypeError, match="TensorFlow Probability distributions"):
        ppl.random_variable(dist.Normal(0.0, 1.0), name="q")


def test_graph_replace_reexpresses_the_program_between_draws():
    key = jax.random.key(5)
    _, x, y = chain_by_hand(key)
    z_to_y = ppl.graph_replace(chain, "z", "y")
    zx_to_y = ppl.graph_replace(chain, ["z", "x"], "y")
    sampled_y = z_to_y(key, 0.0)
    assert sorted(ppl.joint_sample(z_to_y)(key, 0.0)) == ["x", "y"]
    close(zx_to_y(key, 0.0, 1.0), 1.0 + (y - x))  # the same noise, around the given x
    # p(y | z) has the latent x: its density is the joint one of (x, y) given z.
    values = ppl.joint_sample(z_to_y)(key, 0.0)
    close(
        ppl.log_prob(ppl.graph_replace(chain, "z", ["x", "y"]))([values["x"], sampled_y], 0.0),
        tfd.Normal(0.0, 1.0).log_prob(values["x"])
        + tfd.Normal(values["x"], 1.0).log_prob(sampled_y),
    )
    with pytest.raises(KeyError, match="not random variables of the program"):
        ppl.graph_replace(chain, "z", "nope")(key, 0.0)


def test_graph_replace_keeps_the_other_draws_connected_and_random():
    key = jax.random.key(6)
    z_to_y = ppl.graph_replace(chain, "z", "y")
    # Intervening on the kept x moves y, as in the original program.
    close(ppl.intervene(z_to_y, x=100.0)(key, 0.0), ppl.intervene(chain, z=0.0, x=100.0)(key))
    assert float(ppl.intervene(z_to_y, x=100.0)(key, 0.0)) > 90.0
    # Planted values of x and y are what joint_log_prob scores.
    expected = tfd.Normal(0.0, 1.0).log_prob(1.0) + tfd.Normal(1.0, 1.0).log_prob(3.0)
    close(ppl.joint_log_prob(z_to_y)({"x": 1.0, "y": 3.0}, 0.0), expected)


def test_graph_replace_keeps_a_draw_s_append_mode():
    def walk(key):
        def step(c, k):
            return c + ppl.random_variable(tfd.Normal(c, 1.0), name="s", mode="append")(k), None

        k1, k2 = jax.random.split(key)
        start = ppl.random_variable(tfd.Normal(0.0, 1.0), name="start")(k1)
        end = jax.lax.scan(step, start, jax.random.split(k2, 3))[0]
        return ppl.random_variable(tfd.Normal(end, 1.0), name="obs")(key)

    g = ppl.graph_replace(walk, "start", "obs")
    assert ppl.joint_sample(g)(jax.random.key(0), 0.0)["s"].shape == (3,)
    close(
        ppl.joint_log_prob(g)({"s": jnp.zeros(3), "obs": 0.5}, 0.0),
        ppl.joint_log_prob(walk)({"start": 0.0, "s": jnp.zeros(3), "obs": 0.5})
        - tfd.Normal(0.0, 1.0).log_prob(0.0),
    )
