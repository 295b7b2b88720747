"""Observed values outside their distribution's support are refused before sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl
from harvest.ppl._support import check_observed_support, outside
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd = tfp.distributions
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
]


def waits_model(key):
    k1, k2 = jax.random.split(key)
    rate = ppl.random_variable(tfd.HalfNormal(1.0), name="rate")(k1)
    return ppl.random_variable(tfd.Sample(tfd.Exponential(rate), 3), name="waits")(k2)


def test_an_observation_outside_the_support_is_refused_naming_site_and_index():
    pytest.importorskip("blackjax")
    waits = jnp.array([1.0, -2.0, 0.5])
    # TFP's density is a formula, finite there: the silent answer the check prevents.
    assert np.isfinite(tfd.Exponential(1.0).log_prob(-2.0))
    with pytest.raises(
        ValueError, match=r"'waits' has 1 element\(s\) of 3 outside .* index \(1,\)"
    ):
        ppl.sample_posterior(waits_model, jax.random.key(0), observed={"waits": waits})
    scoped = ppl.nest(waits_model, scope="s")
    with pytest.raises(ValueError, match=r"'s.waits' has 1 element"):
        ppl.sample_posterior(scoped, jax.random.key(0), observed={"s": {"waits": waits}})


def test_a_draw_in_a_scan_is_checked_step_by_step():
    pytest.importorskip("blackjax")

    def walk(key):
        rate = ppl.random_variable(tfd.HalfNormal(1.0), name="rate")(key)

        def step(carry, k):
            return carry, ppl.random_variable(tfd.Poisson(rate), name="n", mode="append")(k)

        return jax.lax.scan(step, 0.0, jax.random.split(key, 4))[1]

    with pytest.raises(ValueError, match=r"'n' has 2 element\(s\) of 4 .* index \(2,\)"):
        ppl.sample_posterior(
            walk, jax.random.key(0), observed={"n": jnp.array([1.0, 0.0, 2.5, -1.0])}
        )


@pytest.mark.parametrize(
    ("dist", "value", "expected"),
    [
        (tfd.Exponential(1.0), [0.0, 1e-3, -1e-3, 5.0], [False, False, True, False]),
        (tfd.Beta(2.0, 2.0), [0.3, 1.5, -0.1], [False, True, True]),
        (tfd.Normal(0.0, 1.0), [1e30, -3.0], [False, False]),
        (tfd.Bernoulli(probs=0.3), [0, 1, 2], [False, False, True]),
        (tfd.Categorical(probs=jnp.ones(3) / 3), [0, 3, 2, -1], [False, True, False, True]),
        (tfd.Poisson(3.0), [0.0, 1.5, -1.0, 7.0], [False, True, True, False]),
        (tfd.Binomial(4.0, probs=0.5), [0.0, 4.0, 5.0], [False, False, True]),
        # An event-shaped support: one flag per event (the simplex, a row each).
        (tfd.Dirichlet(jnp.ones(3)), [[0.2, 0.3, 0.5], [0.5, 0.7, 0.1]], [False, True]),
    ],
)
def test_which_elements_are_outside_the_support(dist, value, expected):
    np.testing.assert_array_equal(outside(dist, jnp.asarray(value)), expected)


def test_values_inside_the_support_pass_the_check():
    waits = jnp.array([1.0, 0.0, 0.5])  # 0 is on the boundary: in the support
    check_observed_support(waits_model, {"waits": waits}, jax.random.key(0), (), {})
    scoped = ppl.nest(waits_model, scope="s")
    check_observed_support(scoped, {"s": {"waits": waits}}, jax.random.key(0), (), {})


def test_an_unknown_observed_name_is_named_in_the_program_s_terms():
    with pytest.raises(KeyError, match="not random variables of the program: wait"):
        check_observed_support(waits_model, {"wait": jnp.ones(3)}, jax.random.key(0), (), {})
