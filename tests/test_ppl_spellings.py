"""One spelling per concept in harvest.ppl: the program is `model`, the key comes right
after it; each old spelling still works for one release, warns with the new one, and
gives the same numbers (same key) as the new one."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.compat.oryx.ppl as oryx_ppl
import harvest.ppl as ppl
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd = tfp.distributions
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
]


def model(key, shift=0.0):
    k1, k2 = jax.random.split(key)
    z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
    return ppl.random_variable(tfd.Normal(z + shift, 0.5), name="x")(k2)


def mixture(key):
    k1, k2, k3 = jax.random.split(key, 3)
    scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k1)
    z = ppl.random_variable(tfd.Bernoulli(probs=0.5), name="z", enumerate=True)(k2)
    return ppl.random_variable(tfd.Normal(10.0 * z - 5.0, scale), name="y")(k3)


def posterior_of_mixture(draws=6):
    """A Posterior of known draws of `mixture`'s scale, one chain (no sampler needed)."""
    u = jnp.linspace(-1.0, 1.0, draws).reshape(1, draws)
    zeros = jnp.zeros((1, draws))
    return ppl.Posterior(
        {"scale": jax.nn.softplus(u)},
        zeros,
        {"scale": u},
        zeros > 0,
        zeros,
        jnp.ones(1),
        {"y": 4.0},
    )


def ours(caught):
    """The one deprecation harvest.ppl raised (TFP may warn inside the same block)."""
    (warning,) = [w for w in caught if "is deprecated" in str(w.message)]
    assert warning.filename == __file__  # it points at the caller's line
    return str(warning.message)


def same(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


KEY = jax.random.key(3)
VALUES = {"z": 0.3, "x": -0.2}

# (function, its other arguments by name, how to call what it returns)
TRANSFORMS = {
    "joint_sample": (ppl.joint_sample, {}, lambda g: g(KEY, 1.0)),
    "trace": (ppl.trace, {}, lambda g: g(KEY, 1.0)),
    "joint_log_prob": (ppl.joint_log_prob, {}, lambda g: g(VALUES, 1.0)),
    "log_prob": (ppl.log_prob, {}, lambda g: g(0.7, 1.0)),
    "trace_log_prob": (ppl.trace_log_prob, {}, lambda g: g(-0.2, VALUES, 1.0)),
    "conditional": (ppl.conditional, {"names": "z"}, lambda g: g(KEY, 1.0, 0.4)),
    "block": (ppl.block, {"names": "z"}, lambda g: ppl.joint_sample(g)(KEY, 1.0)),
    "graph_replace": (
        ppl.graph_replace,
        {"input_names": "z", "output_names": "x"},
        lambda g: g(KEY, 1.0, 0.4),
    ),
    "unconstrained": (ppl.unconstrained, {}, lambda g: g.log_density({"z": 0.1, "x": 0.2}, 1.0)),
    "plate": (
        lambda *a, **k: ppl.plate(*a, name="copies", size=3, **k),
        {},
        lambda g: ppl.joint_sample(g)(KEY, 1.0),
    ),
}


def _log_prob_model(key, shift=0.0):  # log_prob inverts: the output is the one draw
    return ppl.random_variable(tfd.Normal(shift, 0.5), name="x")(key)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_the_old_keyword_f_warns_names_model_and_gives_the_same_result(name):
    transform, rest, use = TRANSFORMS[name]
    program = _log_prob_model if name == "log_prob" else model
    new = use(transform(program, *rest.values()))
    by_name = use(transform(model=program, **rest))
    with pytest.warns(DeprecationWarning, match=r"\(f=\.\.\.\) is deprecated.*`model`") as caught:
        old = use(transform(f=program, **rest))
    ours(caught)
    same(old, new)
    same(by_name, new)


def test_intervene_takes_the_program_first_so_any_variable_name_can_be_fixed():
    def named(key):
        k1, k2, k3 = jax.random.split(key, 3)
        f = ppl.random_variable(tfd.Normal(0.0, 1.0), name="f")(k1)
        m = ppl.random_variable(tfd.Normal(f, 1.0), name="model")(k2)
        return ppl.random_variable(tfd.Normal(m, 1.0), name="y")(k3)

    fixed = ppl.intervene(named, f=2.0, model=3.0)
    assert sorted(ppl.joint_sample(fixed)(KEY)) == ["y"]
    np.testing.assert_allclose(
        ppl.joint_log_prob(fixed)({"y": 3.5}), tfd.Normal(3.0, 1.0).log_prob(3.5), rtol=1e-6
    )
    with pytest.warns(DeprecationWarning, match=r"intervene\(f=\.\.\.\).*pass it first\.$"):
        old = ppl.intervene(f=model, z=1.5)
    same(ppl.joint_sample(old)(KEY), ppl.joint_sample(ppl.intervene(model, z=1.5))(KEY))


def test_make_effect_handlers_transformation_takes_model():
    counting = ppl.make_effect_handler({jax.lax.exp_p: lambda n, x, **p: (jnp.exp(x), n + 1)})

    def twice(x):
        return jnp.exp(jnp.exp(x))

    new = counting(twice)(0, 0.5)
    assert new[1] == 2 and new == counting(model=twice)(0, 0.5)
    with pytest.warns(DeprecationWarning, match="`model`"):
        assert counting(f=twice)(0, 0.5) == new


def test_every_program_argument_is_model():
    functions = [ppl.sample_posterior, ppl.counterfactual, ppl.predictive, ppl.infer_discrete]
    functions += [ppl.intervene, ppl.make_effect_handler({})]
    functions += [
        transform for transform, _, _ in TRANSFORMS.values() if transform.__name__ != "<lambda>"
    ]
    functions.append(ppl.plate)
    for fn in functions:
        assert next(iter(inspect.signature(fn).parameters)) == "model", fn


def test_predictive_takes_the_key_second_and_the_old_orders_warn_with_the_new_call():
    posterior = posterior_of_mixture()
    key = jax.random.key(5)
    new_prior = ppl.predictive(mixture, key, num_samples=4)
    with pytest.warns(DeprecationWarning) as caught:
        old_prior = ppl.predictive(mixture, None, key, num_samples=4)
    message = ours(caught)
    assert "predictive(model, None, key, *args) is deprecated" in message
    assert "predictive(model, key, *args, ...) (posterior=None is the default)" in message
    same(old_prior, new_prior)

    new = ppl.predictive(mixture, key, posterior=posterior, infer_discrete=True)
    with pytest.warns(DeprecationWarning) as caught:
        old = ppl.predictive(mixture, posterior, key, infer_discrete=True)
    assert "predictive(model, key, *args, posterior=posterior, ...)" in ours(caught)
    same(old, new)
    assert new["y"].shape == (1, 6)


def test_infer_discrete_takes_the_key_second_and_the_old_order_warns_with_the_new_call():
    posterior = posterior_of_mixture()
    key = jax.random.key(6)
    new = ppl.infer_discrete(mixture, key, posterior=posterior)
    expected = "infer_discrete(model, key, *args, posterior=posterior, ...)"
    with pytest.warns(DeprecationWarning, match=re.escape(expected)) as caught:
        old = ppl.infer_discrete(mixture, posterior, key)
    ours(caught)
    same(old, new)
    # y = 4 sits on the component at +5 for every scale here: P(z = 1 | y) > 0.98.
    assert new["z"].shape == (1, 6) and bool(jnp.all(new["z"] == 1))


def test_a_posterior_in_both_places_is_refused():
    posterior = posterior_of_mixture()
    with pytest.raises(TypeError, match="takes the PRNG key second"):
        ppl.predictive(mixture, posterior, jax.random.key(0), posterior=posterior)
    with pytest.raises(TypeError, match="takes the PRNG key second"):
        ppl.infer_discrete(mixture, posterior)  # the old order without its key


@pytest.mark.parametrize("module", [ppl, oryx_ppl], ids=lambda m: m.__name__)
def test_star_import_exports_exactly_the_public_names(module):
    namespace = {}
    exec(f"from {module.__name__} import *", namespace)
    exported = set(namespace) - {"__builtins__"}
    public = {name for name in vars(module) if not name.startswith("_")}
    assert exported == set(module.__all__) == public
    assert len(module.__all__) == len(exported)  # no name listed twice
