"""What a fresh user meets first: models written as their libraries' own docs write
them (Flax NNX, Equinox, Linen, Penzai), probed with `instrument`, steered, swept,
and given bad input. Each test pins a fix found by walking the docs word for word;
numbers are checked against the model run by hand, without harvest.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import (
    ablate_mean,
    add_vector,
    attribution_patching,
    instrument,
    patch_positions,
    patching_sweep,
    plant,
    reap,
)

nnx = pytest.importorskip("flax.nnx")


class _Count(nnx.Variable):
    pass


class TutorialMLP(nnx.Module):
    """The MLP of Flax's "NNX basics" page: a call counter, dropout, batch norm."""

    def __init__(self, din, dmid, dout, *, rngs):
        self.count = _Count(jnp.array(0))
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.1, rngs=rngs)
        self.bn = nnx.BatchNorm(dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        self.count[...] += 1
        x = nnx.gelu(self.dropout(self.bn(self.linear1(x))))
        return self.linear2(x)


@pytest.fixture
def mlp():
    model = TutorialMLP(2, 16, 5, rngs=nnx.Rngs(0))
    model.eval()
    return model


X = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)


def by_hand(model, x, steer):
    """The tutorial MLP's forward with `steer` applied to the batch norm's output."""
    return model.linear2(nnx.gelu(steer(model.bn(model.linear1(x)))))


def test_add_vector_steers_an_nnx_tutorial_model_as_by_hand(mlp):
    v = jnp.linspace(-1.0, 1.0, 16)
    steered = plant(instrument(mlp), tag="modules")({"bn": add_vector(v, scale=2.0)}, X)
    np.testing.assert_allclose(steered, by_hand(mlp, X, lambda h: h + 2.0 * v), rtol=1e-6)


@pytest.mark.parametrize(
    "intervention, what",
    [
        (add_vector(jnp.ones(15)), "add_vector's vector has shape (15,)"),
        (ablate_mean(jnp.ones(7)), "ablate_mean's mean has shape (7,)"),
        (patch_positions(jnp.ones((2, 16)), [0], axis=0), "clean value to patch in"),
    ],
)
def test_an_intervention_that_does_not_fit_names_the_site_and_changes_nothing(
    mlp, intervention, what
):
    # JAX's own broadcasting error named neither the intervention nor the site.
    probed = instrument(mlp)
    for run in (plant(probed, tag="modules"), jax.jit(plant(probed, tag="modules"))):
        with pytest.raises(ValueError, match=r"name='bn'") as err:
            run({"bn": intervention}, X)
        message = str(err.value)
        assert what in message and "float32[3, 16]" in message and len(message) < 600
    assert int(mlp.count[...]) == 0  # the failed calls ran nothing
    np.testing.assert_allclose(probed(X), mlp(X))


@pytest.mark.parametrize("sweep", [patching_sweep, attribution_patching])
def test_a_sweep_without_tag_modules_says_to_pass_it(mlp, sweep):
    # reap said so already; the sweeps said "nothing to patch ... names sown with that tag: none".
    probed = instrument(mlp)
    clean = reap(probed, tag="modules")(X)
    with pytest.raises(ValueError, match=r"no sow of tag 'intermediates'.*tag='modules'"):
        sweep(probed, clean, (-X,), lambda out: out.sum(), axis=-1)
    swept = sweep(probed, clean, (-X,), lambda out: out.sum(), tag="modules", names="bn", axis=-1)
    unit = 3  # patching one unit of the batch norm's output, by hand
    h = mlp.bn(mlp.linear1(-X))
    patched = by_hand(mlp, -X, lambda h: h.at[:, unit].set(clean["bn"][:, unit]))
    exact = patched.sum() - mlp(-X).sum()
    if sweep is patching_sweep:
        np.testing.assert_allclose(swept.values[0, unit], exact, rtol=1e-5)
    else:  # the gradient at the corrupted run times the clean - corrupted difference
        grad = jax.grad(lambda h: by_hand(mlp, -X, lambda _: h).sum())(h)
        estimate = ((clean["bn"] - h) * grad)[:, unit].sum()
        np.testing.assert_allclose(swept.values[0, unit], estimate, rtol=1e-5)
