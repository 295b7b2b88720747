"""instrument on DeepMind's `gemma` library (Linen): a tiny Gemma 3 config, random weights.

`gemma` is installed by the Makefile with --no-deps (see the `models` extra);
it imports with a stand-in for TensorFlow (`benchmarks.bench_models.import_gemma`
says why). Where it is not installed (the JAX matrix), these tests skip; the
toy model of tests/test_instrument_linen.py reproduces each failure without it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.bench_models import import_gemma
from harvest import instrument, patching_sweep, plant, reap, sites

try:
    gm, _config, _modules = import_gemma()
except ImportError as error:
    pytest.skip(f"the gemma library does not import here: {error}", allow_module_level=True)


@pytest.fixture(scope="module")
def gemma():
    config = _config.TransformerConfig(
        num_embed=13,
        embed_dim=8,
        hidden_dim=16,
        num_heads=2,
        head_dim=4,
        num_kv_heads=2,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(_modules.AttentionType.GLOBAL,) * 2,
    )
    model = gm.nn.Transformer(config=config, dtype=jnp.float32)
    tokens = jnp.array([[2, 5, 7, 1, 3]])
    params = model.init(jax.random.key(0), tokens)
    return model, params, tokens


def logits(model, params, tokens):
    return model.apply(params, tokens).logits


def test_every_trace_has_the_sites_and_outputs_are_identical(gemma):
    model, params, tokens = gemma
    f = instrument(lambda p, t: model.apply(p, t).logits)
    np.testing.assert_array_equal(f(params, tokens), logits(model, params, tokens))
    names = [s.name for s in sites(f, params, tokens, tag="modules")]
    # FeedForward's two share_scope'd einsums are sites of their own.
    assert {"layer_0.mlp.Einsum_0", "layer_0.mlp.Einsum_1", "layer_0.mlp", "layer_1"} <= set(names)
    reaped = reap(f, tag="modules")(params, tokens)  # after sites(): still every site
    assert set(reaped) == set(names)
    with pytest.raises(ValueError):
        reap(f, tag="modules", allowlist="nope")(params, tokens)
    longer = jnp.array([[2, 5, 7, 1, 3, 4, 4]])
    assert reap(f, tag="modules")(params, longer)["layer_1"].shape == (1, 7, 8)


def test_plant_block_output_matches_a_hand_patched_forward(gemma):
    model, params, tokens = gemma
    f = instrument(lambda p, t: model.apply(p, t).logits)
    reaped = reap(f, tag="modules")(params, tokens)
    # `layer_0` returns `(cache, x)` with no cache: reaped and planted as x.
    assert reaped["layer_0"].shape == (1, 5, 8)
    zeros = jnp.zeros((1, 5, 8))
    planted = plant(f, tag="modules")({"layer_0": zeros}, params, tokens)
    # By hand: the rest of the model (layer_1, final norm, tied decoder) from zeros.
    inner = model.bind(params)
    positions = jnp.arange(5)[None]
    mask = jnp.tril(jnp.ones((1, 5, 5), bool))
    _, x = inner.blocks[1](zeros, positions, None, mask)
    by_hand = inner.embedder.decode(inner.final_norm(x))
    np.testing.assert_allclose(planted, by_hand, rtol=1e-5, atol=1e-5)
    clean = reaped
    result = patching_sweep(
        f, clean, (params, tokens[:, ::-1]), lambda o: o[0, -1, 0], tag="modules"
    )
    assert len(result.names) == len(clean)


def test_attention_hooks(gemma):
    model, params, tokens = gemma
    f = instrument(lambda p, t: model.apply(p, t).logits, attention=True)
    np.testing.assert_array_equal(f(params, tokens), logits(model, params, tokens))
    reaped = reap(f, tag="modules")(params, tokens)
    attn = "layer_0.attn"
    for hook in ("hook_q", "hook_k", "hook_v", "hook_z"):
        assert reaped[f"{attn}.{hook}"].shape == (1, 5, 2, 4), hook
    pattern = reaped[f"{attn}.hook_pattern"]
    assert pattern.shape == (1, 2, 5, 5)
    # Gemma's own [B, T, N, S] weights (its `attention_weights` identity), as [B, N, T, S].
    np.testing.assert_array_equal(pattern, reaped[f"{attn}.attention_weights"].swapaxes(1, 2))
    uniform = jnp.tril(jnp.ones((1, 2, 5, 5))) / jnp.arange(1, 6)[:, None]
    planted = plant(f, tag="modules")({f"{attn}.hook_pattern": uniform}, params, tokens)
    same = plant(f, tag="modules")(
        {f"{attn}.attention_weights": uniform.swapaxes(1, 2)}, params, tokens
    )
    np.testing.assert_allclose(planted, same, rtol=1e-6)
    # z = 0: the attention's output (the einsum of z, no bias) is 0.
    no_z = plant(f, tag="modules")({f"{attn}.hook_z": jnp.zeros((1, 5, 2, 4))}, params, tokens)
    no_out = plant(f, tag="modules")({attn: jnp.zeros((1, 5, 8))}, params, tokens)
    np.testing.assert_allclose(no_z, no_out, rtol=1e-6, atol=1e-6)
