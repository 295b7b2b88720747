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
    sites,
    sow,
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


def test_a_penzai_layer_stack_is_refused_rather_than_misnamed():
    # Penzai's LayerStack (llamalike's use_layer_stack=True) scans over unbound copies
    # of its layers: the second tanh was listed under the first one's name, the scaling
    # layer and the stacked body were missing.
    pz = pytest.importorskip("penzai.pz")

    @pz.pytree_dataclass
    class Scale(pz.nn.Layer):
        by: pz.nx.NamedArray

        def __call__(self, x, **side_inputs):
            return x * self.by

    tanh_twice = [pz.nn.Elementwise(jnp.tanh), pz.nn.Elementwise(jnp.tanh)]
    by = pz.nx.wrap(jnp.array([0.5, 2.0]), "blocks")
    stack = pz.nn.LayerStack(
        stacked_sublayers=pz.nn.Sequential([Scale(by), *tanh_twice]),
        stack_axis="blocks",
        stack_axis_size=2,
    )
    model = pz.nn.Sequential([pz.nn.Elementwise(jnp.sin), stack])
    x = pz.nx.wrap(jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "seq", "embedding")
    with pytest.raises(NotImplementedError, match=r"LayerStack at 'sublayers.1'"):
        reap(instrument(model), tag="modules")(x)
    with pytest.raises(NotImplementedError, match=r"LayerStack at 'sublayers.1'"):
        reap(instrument(model, ops=True), tag="modules")(x)
    # Sites outside the stack stay usable, and hold what the model computes.
    outside = instrument(model, names=lambda name: not name.startswith("sublayers.1."))
    cache = reap(outside, tag="modules")(x)
    h = jnp.sin(x.data_array)
    for scale in (0.5, 2.0):
        h = jnp.tanh(jnp.tanh(scale * h))
    assert list(cache) == ["sublayers.0", "sublayers.1"]
    np.testing.assert_allclose(cache["sublayers.1"], h, rtol=1e-6)


def deep(x):
    """Twenty residual sites, as a large model's instrumented blocks give."""
    for i in range(20):
        x = x + sow(jnp.tanh(x), name=f"blocks.{i}.resid", mode="strict")
    return x


def test_a_typo_among_many_sites_names_the_closest_ones_in_a_short_message():
    # A Penzai transformer has 83 sites: the message listed every one (5,091 characters).
    x = jnp.ones(3)
    with pytest.raises(KeyError, match=r"'blocks\.7\.resid_'") as err:
        plant(deep)({"blocks.7.resid_": jnp.zeros(3)}, x)
    message = str(err.value)
    assert "'blocks.7.resid'" in message and "20 names" in message and len(message) < 600
    with pytest.raises(ValueError, match=r"'blocks.7.resid'") as err:
        reap(deep, names="block.7.*")(x)
    assert len(str(err.value)) < 600
    few = lambda x: sow(x, name="h", mode="strict")  # a few names: all of them, as before
    with pytest.raises(KeyError, match=r"Names sown with that tag: 'h'\."):
        plant(few)({"g": x}, x)


def test_penzai_multi_query_attention_gets_its_hooks():
    # num_kv_heads=1 (multi-query, as in Gemma 2B) names the heads "query_heads" and gives
    # keys and values none: attention=True refused it. Keys and values get one KV head.
    pz = pytest.importorskip("penzai.pz")
    from _penzai_models import tiny_config
    from penzai.models.transformer.variants import llamalike_common

    config = tiny_config(num_kv_heads=1, query_head_multiplier=2)
    attn = llamalike_common.build_llamalike_attention("attn", jax.random.key(0), config, 0)
    model = pz.nn.Sequential([attn])  # the hooks are named after the attention's path
    x = pz.nx.wrap(jnp.linspace(-1.0, 1.0, 40).reshape(1, 5, 8), "batch", "seq", "embedding")
    positions = pz.nx.arange("seq", 5)
    hooked = instrument(model, attention=True)
    listed = sites(hooked, tag="modules")(x, token_positions=positions)
    shapes = {info.name: info.shape for info in listed if ".hook_" in info.name}
    assert shapes == {
        "sublayers.0.hook_q": (1, 5, 2, 4),
        "sublayers.0.hook_k": (1, 5, 1, 4),
        "sublayers.0.hook_v": (1, 5, 1, 4),
        "sublayers.0.hook_attn_scores": (1, 2, 5, 5),
        "sublayers.0.hook_pattern": (1, 2, 5, 5),
        "sublayers.0.hook_z": (1, 5, 2, 4),
    }
    # Planting the shared keys (the projection's output, before RoPE, as TransformerLens's
    # hook_k) is the layer edited by hand to put them after input_to_key's projection.
    keys = jax.random.normal(jax.random.key(1), (1, 5, 1, 4))
    plants = {"sublayers.0.hook_k": keys}
    planted = plant(hooked, tag="modules")(plants, x, token_positions=positions)

    @pz.pytree_dataclass
    class Const(pz.nn.Layer):
        value: pz.nx.NamedArray

        def __call__(self, x, **side_inputs):
            return self.value

    shared = Const(pz.nx.wrap(keys[:, :, 0], "batch", "seq", "projection"))
    by_hand = (
        pz.select(model)
        .at(lambda m: m.sublayers[0].input_to_key.sublayers[0])
        .apply(lambda sub: pz.nn.Sequential([sub, shared]))
    )
    expected = jax.jit(lambda x: by_hand(x, token_positions=positions).data_array)(x)
    np.testing.assert_allclose(planted.data_array, expected, rtol=1e-5, atol=1e-6)
    # A Penzai user plants a named array: it is matched by axis names, whatever its order
    # (it was a structure error printing the NamedArray's tree).
    transposed = {
        "sublayers.0.input_to_key.sublayers.0": shared.value.order_as("projection", "seq", "batch")
    }
    named = plant(hooked, tag="modules")(transposed, x, token_positions=positions)
    np.testing.assert_allclose(named.data_array, expected, rtol=1e-5, atol=1e-6)
