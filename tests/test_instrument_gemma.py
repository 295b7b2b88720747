"""instrument on DeepMind's `gemma` library (Linen): a tiny Gemma 3 config, random weights.

`gemma` is installed by the Makefile with --no-deps (see the `models` extra);
it imports with a stand-in for TensorFlow (`benchmarks.bench_models.import_gemma`
says why). Where it is not installed (the JAX matrix), these tests skip; the
toy model of tests/test_instrument_linen.py reproduces each failure without it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.bench_models import import_gemma
from harvest import add_vector, instrument, patching_sweep, plant, reap, sites

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


def hand_forward(model, params, tokens):
    """Gemma's forward written out from `Transformer.__call__` and `Block.__call__`: its
    norms and attention called as submodules, the feed-forward from its weights. Returns
    the logits and each block part's value, by the name instrument gives it."""
    inner = model.bind(params)
    t = tokens.shape[1]
    positions, mask = jnp.arange(t)[None], jnp.tril(jnp.ones((1, t, t), bool))
    x, values = inner.embedder.encode(tokens), {}
    for i, block in enumerate(inner.blocks):
        name, w = f"layer_{i}", params["params"][f"layer_{i}"]
        normed = block.pre_attention_norm(x)
        qkv = jnp.einsum("BTD,SNDH->SBTNH", normed, w["attn"]["qkv_einsum"]["w"])
        _, attn = block.attn(normed, positions, None, mask)
        after_attn = block.post_attention_norm(attn) + x
        gate = jnp.einsum(
            "...F,NFH->...NH", block.pre_ffw_norm(after_attn), w["mlp"]["gating_einsum"]
        )
        hidden = jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
        mlp = hidden @ w["mlp"]["linear"]
        x = block.post_ffw_norm(mlp) + after_attn
        values |= {
            f"{name}.pre_attention_norm": normed,
            f"{name}.attn.qkv_einsum": qkv,
            f"{name}.attn": attn,
            f"{name}.mlp.Einsum_0": gate,
            f"{name}.mlp.Einsum_1": mlp,
            f"{name}.mlp": mlp,
            name: x,
        }
    values["final_norm"] = inner.final_norm(x)
    return inner.embedder.decode(values["final_norm"]), values


def test_sites_hold_what_a_hand_written_forward_computes(gemma):
    model, params, tokens = gemma
    f = instrument(lambda p, t: model.apply(p, t).logits)
    np.testing.assert_array_equal(f(params, tokens), logits(model, params, tokens))
    by_hand_logits, by_hand = hand_forward(model, params, tokens)
    np.testing.assert_allclose(by_hand_logits, logits(model, params, tokens), rtol=1e-5, atol=1e-5)
    reaped = reap(f, tag="modules")(params, tokens)
    # FeedForward's two share_scope'd einsums are sites of their own.
    for name, value in by_hand.items():
        np.testing.assert_allclose(reaped[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    assert set(by_hand) <= set(reaped)
    assert sorted(reaped) == sorted(s.name for s in sites(f, tag="modules")(params, tokens))
    with pytest.raises(
        ValueError, match="names= entry 'nope' matches no sow site of tag 'modules'"
    ):
        reap(f, tag="modules", names="nope")(params, tokens)
    # Another length: a fresh trace, whose sites are the hand forward's again.
    longer = jnp.array([[2, 5, 7, 1, 3, 4, 4]])
    np.testing.assert_allclose(
        reap(f, tag="modules")(params, longer)["layer_1"],
        hand_forward(model, params, longer)[1]["layer_1"],
        rtol=1e-5,
        atol=1e-5,
    )


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


def test_steering_gemmas_own_sampling_loop_matches_a_hand_steered_decode(gemma):
    """gemma's `SamplerLoop` (a jitted while_loop over its jitted decode step) steered by
    `add_vector` at one block's MLP output, against the decode written out by hand.

    `gm.text.Sampler.sample` itself tokenizes text on the host (a SentencePiece
    model file), so the traced part it calls is what is instrumented: the prefill
    (`_prefill.prefill`) and the loop (`SamplerLoop.sample`) on token ids.
    """
    from gemma.gm.text import _prefill, _sampler_loop, _sampling, _tokenizer
    from gemma.gm.utils import _types

    model, variables, tokens = gemma
    params, new_tokens, end = variables["params"], 6, 12
    state = _prefill.prefill(
        model=model,
        params=params,
        input=_types.Input(text=tokens, images=None, config=model.config.input_config),
        last_state=None,
        cache_length=16,
        max_out_length=new_tokens,
        rng=jax.random.key(1),
        sharding=None,
    )
    loop = _sampler_loop.SamplerLoop(
        model=model,
        end_tokens=(end,),
        forbidden_tokens=None,
        sampling=_sampling.Greedy(),
        cache_length=16,
        special_tokens=_tokenizer.Gemma3Tokenizer.special_tokens,
    )

    def sample(params, state):
        out = loop.sample(params=params, init_state=state, max_new_tokens=jnp.int32(new_tokens))
        return out.predicted_tokens[0]

    @functools.partial(jax.jit, static_argnames="at")
    def step_by_hand(params, vector, token, position, cache, mask, at):
        """One decode step of the transformer, its last block written out with
        `vector` added to the MLP's output (Gemma's `Block.__call__`), or to the
        block's (`at="block"`)."""
        inner = model.bind({"params": params})
        x = inner.embedder.encode(token[:, None])
        positions = position[:, None]
        new_cache = {}
        for i, block in enumerate(inner.blocks):
            name = f"layer_{i}"
            if i < len(inner.blocks) - 1:
                new_cache[name], x = block(x, positions, cache[name], mask)
                continue
            new_cache[name], attn = block.attn(
                block.pre_attention_norm(x), positions, cache[name], mask
            )
            attn = block.post_attention_norm(attn) + x
            mlp = block.mlp(block.pre_ffw_norm(attn)) + (vector if at == "mlp" else 0.0)
            x = block.post_ffw_norm(mlp) + attn + (vector if at == "block" else 0.0)
        logits = inner.embedder.decode(inner.final_norm(x))[:, 0]
        return jnp.argmax(logits, axis=-1), new_cache

    def decode_by_hand(vector, at="mlp"):
        token, position, cache, out = state.last_token, state.last_token_pos, state.cache, []
        full = state.full_attention_mask
        for step in range(new_tokens):
            mask = full * (jnp.arange(full.shape[-1]) < state.init_cache_length + step + 1)
            token, cache = step_by_hand(
                params, vector, token, position, cache, mask[:, None, :], at
            )
            out.append(int(token[0]))
            position = position + 1
        return out

    probed = instrument(sample)
    # The loop's jax.jit functions now hold a trace made by `sites`; plant traces afresh.
    assert "layer_1.mlp" in [s.name for s in sites(probed, tag="modules")(params, state)]
    steer = plant(probed, tag="modules")
    vector = jnp.linspace(-3.0, 3.0, 8)
    # While sampling, a block returns `(cache, x)` with a cache: one vector is refused,
    # naming the site, and the callable it suggests steers x as the hand decode does.
    with pytest.raises(
        ValueError,
        match=r"'layer_1'.*add_vector's vector is one array.*a tuple of "
        r".*\{'layer_1': lambda out: \(out\[0\], out\[1\] \+ v\)\}",
    ):
        steer({"layer_1": add_vector(vector)}, params, state)
    block_steered = steer({"layer_1": lambda out: (out[0], out[1] + vector)}, params, state)
    np.testing.assert_array_equal(block_steered, decode_by_hand(vector, at="block"))
    outs = []
    for v in (jnp.zeros(8), vector, -vector):  # zeros: gemma's own tokens, and the hand decode's
        want = decode_by_hand(v)
        assert end not in want  # the loop ran every step, as the hand decode does
        np.testing.assert_array_equal(steer({"layer_1.mlp": add_vector(v)}, params, state), want)
        outs.append(want)
    assert outs[1] != outs[2]  # the vector changes the tokens


def test_asking_for_gemmas_scores_alone_says_why_there_are_none(gemma):
    model, params, tokens = gemma
    run = lambda p, t: model.apply(p, t).logits
    for naming, sown in ((None, "layer_0.attn.hook_attn_scores"), ("transformer_lens", None)):
        sown = sown or "blocks.0.attn.hook_attn_scores"
        f = instrument(run, attention=True, naming=naming, names=sown)
        with pytest.raises(
            ValueError, match=f"{sown} is not sown: gemma's Attention at 'layer_0.attn'"
        ) as info:
            reap(f, tag="modules")(params, tokens)
        assert len(str(info.value)) < 600
    # Asked with the rest of the attention's hooks, the scores are left out, the rest sown.
    wide = instrument(run, attention=True, names="layer_0.attn.hook_*")
    reaped = reap(wide, tag="modules")(params, tokens)
    assert sorted(reaped) == [f"layer_0.attn.hook_{h}" for h in ("k", "pattern", "q", "v", "z")]
