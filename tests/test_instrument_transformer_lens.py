"""instrument(model, naming="transformer_lens"): TransformerLens's residual-stream names.

The reference is each model's residual stream computed step by step by hand:
its blocks' sublayers called one by one and the residual additions written
out (for NNX, attention written out from its weights too), with a patched
value put in place of a hook where a plant puts it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import harvest, instrument, patching_sweep, plant, reap, sites

nnx = pytest.importorskip("flax.nnx")

B, T, D, H, DH = 2, 5, 8, 2, 4
TOL = dict(rtol=1e-5, atol=1e-5)
STREAM = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 16, rngs=rngs)
        self.down = nnx.Linear(16, D, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


class Block(nnx.Module):
    """GPT-2's block, as TransformerLens's own: pre-norm, attention then MLP."""

    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, qkv_features=H * DH, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    def __init__(self, rngs, layers=2):
        self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def hand_attention(attn, x, z_patch=None):
    """NNX's MultiHeadAttention from its weights: [B, T, D] -> (output, z [B, T, H, DH])."""
    proj = lambda m: jnp.einsum("btd,dhk->bthk", x, m.kernel[...]) + m.bias[...]
    q, k, v = proj(attn.query), proj(attn.key), proj(attn.value)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / np.sqrt(DH), k)
    z = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    z = z if z_patch is None else z_patch
    out = jnp.einsum("bqhd,hdD->bqD", z, attn.out.kernel[...]) + attn.out.bias[...]
    return out, z


def hand_forward(model, x, patch=None):
    """The logits and every TransformerLens value, the stream added up step by step;
    `patch` ({name: value}) puts a value in place of the one computed there."""
    patch, values = patch or {}, {}

    def at(name, value):
        values[name] = patch.get(name, value)
        return values[name]

    for i, block in enumerate(model.blocks):
        n = f"blocks.{i}"
        x = at(f"{n}.hook_resid_pre", x)
        z_patch = patch.get(f"{n}.attn.hook_z")
        attn_out, values[f"{n}.attn.hook_z"] = hand_attention(block.attn, block.ln1(x), z_patch)
        attn_out = at(f"{n}.hook_attn_out", attn_out)
        mid = at(f"{n}.hook_resid_mid", x + attn_out)
        pre = at(f"{n}.mlp.hook_pre", block.mlp.up(block.ln2(mid)))
        mlp_out = at(f"{n}.hook_mlp_out", block.mlp.down(at(f"{n}.mlp.hook_post", nnx.gelu(pre))))
        x = at(f"{n}.hook_resid_post", mid + mlp_out)
    return model.head(x), values


def random(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape)


@pytest.fixture(scope="module")
def gpt():
    return GPT(nnx.Rngs(0))


def test_nnx_names_hold_the_stream_added_up_by_hand(gpt):
    x = random((B, T, D), 1)
    tl = instrument(gpt, naming="transformer_lens")
    np.testing.assert_array_equal(tl(x), gpt(x))  # bit for bit: the names cost no arithmetic
    np.testing.assert_array_equal(jax.jit(tl)(x), jax.jit(gpt)(x))
    logits, by_hand = hand_forward(gpt, x)
    np.testing.assert_allclose(logits, gpt(x), **TOL)  # the hand forward is the model's
    reaped = reap(tl, tag="modules")(x)
    for i in range(2):
        for hook in STREAM:
            name = f"blocks.{i}.{hook}"
            np.testing.assert_allclose(reaped[name], by_hand[name], err_msg=name, **TOL)
    # TransformerLens's names only (its ActivationCache's keys), each with its value.
    assert set(reaped) == {k for k in by_hand if ".attn." not in k}  # no attention=True
    for name in ("blocks.0.mlp.hook_pre", "blocks.1.mlp.hook_post"):
        np.testing.assert_allclose(reaped[name], by_hand[name], err_msg=name, **TOL)
    assert set(reap(instrument(gpt), tag="modules")(x)).isdisjoint(by_hand)  # paths without
    names = [s.name for s in sites(tl, tag="modules")(x)]
    assert names.index("blocks.0.hook_resid_pre") < names.index("blocks.0.hook_resid_mid")
    assert names.index("blocks.0.hook_resid_post") < names.index("blocks.1.hook_resid_pre")


@pytest.mark.parametrize("hook", STREAM)
@pytest.mark.parametrize("layer", [0, 1])
def test_nnx_planting_a_name_is_the_stream_patched_by_hand(gpt, layer, hook):
    x = random((B, T, D), 1)
    name = f"blocks.{layer}.{hook}"
    value = random((B, T, D), 7)
    tl = instrument(gpt, naming="transformer_lens", names=name)
    planted = plant(tl, tag="modules")({name: value}, x)
    logits, by_hand = hand_forward(gpt, x, {name: value})
    np.testing.assert_allclose(planted, logits, **TOL)
    # Every other name, reaped in the same run, holds the stream patched by hand.
    out, reaped = harvest(instrument(gpt, naming="transformer_lens"), tag="modules")(
        {name: value}, x
    )
    np.testing.assert_allclose(out, logits, **TOL)
    for other in (f"blocks.{i}.{h}" for i in range(2) for h in STREAM):
        if other != name:
            np.testing.assert_allclose(reaped[other], by_hand[other], err_msg=other, **TOL)


def test_nnx_sweeps_give_transformer_lens_s_layer_by_position_and_layer_by_head(gpt):
    clean, corrupted = random((B, T, D), 1), random((B, T, D), 2)
    tl = instrument(gpt, naming="transformer_lens", attention=True)
    cache = reap(tl, tag="modules")(clean)
    metric = lambda logits: logits[..., 0].mean()
    base, corrupted_values = hand_forward(gpt, corrupted)
    _, clean_values = hand_forward(gpt, clean)

    def effect(name, index):
        value = corrupted_values[name].at[index].set(clean_values[name][index])
        return metric(hand_forward(gpt, corrupted, {name: value})[0]) - metric(base)

    by_position = patching_sweep(
        tl, cache, (corrupted,), metric, tag="modules", names="blocks.*.hook_resid_pre", axis=1
    )
    assert by_position.names == ("blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre")
    expected = [
        [effect(f"blocks.{l}.hook_resid_pre", (slice(None), p)) for p in range(T)] for l in range(2)
    ]
    np.testing.assert_allclose(by_position.values, expected, **TOL)  # [layer, position]
    by_head = patching_sweep(
        tl, cache, (corrupted,), metric, tag="modules", names="blocks.*.attn.hook_z", axis=2
    )
    expected = [
        [effect(f"blocks.{l}.attn.hook_z", (..., h, slice(None))) for h in range(H)]
        for l in range(2)
    ]
    np.testing.assert_allclose(by_head.values, expected, **TOL)  # [layer, head]


def test_nnx_bad_names_and_models_without_blocks_say_what_is_read(gpt):
    with pytest.raises(ValueError, match="unknown .*'tl'. Use one of 'transformer_lens'"):
        instrument(gpt, naming="tl")
    with pytest.raises(
        ValueError, match="found no transformer block in .*one submodule named `mlp`"
    ):
        instrument(MLP(nnx.Rngs(0)), naming="transformer_lens")  # refused before any call
    with pytest.raises(
        ValueError, match="found no transformer block in .* \\(a function target\\)"
    ):
        instrument(lambda x: x, naming="transformer_lens")(jnp.ones(D))
    eqx = pytest.importorskip("equinox")
    with pytest.raises(ValueError, match="found no transformer block in .* \\(an Equinox model\\)"):
        instrument(eqx.nn.Linear(D, D, key=jax.random.key(0)), naming="transformer_lens")


class Widening(nnx.Module):
    """An attention whose output is wider than the block's input: nothing adds it to the input."""

    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(H, D, out_features=2 * D, decode=False, rngs=rngs)
        self.mlp = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        return self.mlp(self.attn(x))


class WideningModel(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Widening(rngs)])

    def __call__(self, x):
        return self.blocks[0](x)


def test_a_block_that_does_not_add_its_attention_s_output_is_refused():
    tl = instrument(WideningModel(nnx.Rngs(0)), naming="transformer_lens")
    with pytest.raises(ValueError, match="blocks.0.hook_resid_mid is the block's input plus"):
        reap(tl, tag="modules")(random((B, T, D), 1))


class PostNormBlock(Block):
    """Gemma 2's order: a norm on the attention's output before it is added."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.post_attn = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        x = x + self.post_attn(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class ParallelBlock(Block):
    """GPT-J's and GPT-NeoX's parallel block: the MLP reads the block's input too."""

    def __call__(self, x):
        return x + self.attn(self.ln1(x)) + self.mlp(self.ln2(x))


class Stack(nnx.Module):
    def __init__(self, block):
        self.blocks = nnx.List([block])

    def __call__(self, x, times=1):
        for _ in range(times):
            x = self.blocks[0](x)
        return x


def test_a_block_that_norms_its_attention_s_output_is_refused():
    x = random((B, T, D), 1)
    post_norm = instrument(Stack(PostNormBlock(nnx.Rngs(0))), naming="transformer_lens")
    with pytest.raises(ValueError, match="passes its attention's output to 'blocks.0.post_attn'"):
        reap(post_norm, tag="modules")(x)


class DropoutParallelBlock(ParallelBlock):
    """A parallel block whose MLP draws dropout from the block's own random state."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

    def __call__(self, x):
        return x + self.attn(self.ln1(x)) + self.drop(self.mlp(self.ln2(x)))


def test_parallel_blocks_get_transformer_lens_s_names_without_resid_mid():
    # GPT-J's and GPT-NeoX's parallel_attn_mlp: TransformerLens gives no hook_resid_mid.
    x = random((B, T, D), 1)
    parallel = Stack(ParallelBlock(nnx.Rngs(0)))
    tl = instrument(parallel, naming="transformer_lens")
    reaped = reap(tl, tag="modules")(x)
    block = parallel.blocks[0]
    attn_out, mlp_out = block.attn(block.ln1(x)), block.mlp(block.ln2(x))
    expected = {
        "blocks.0.hook_resid_pre": x,
        "blocks.0.hook_attn_out": attn_out,
        "blocks.0.hook_mlp_out": mlp_out,
        "blocks.0.hook_resid_post": x + attn_out + mlp_out,
        "blocks.0.mlp.hook_pre": block.mlp.up(block.ln2(x)),
        "blocks.0.mlp.hook_post": nnx.gelu(block.mlp.up(block.ln2(x))),
    }
    assert set(reaped) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(reaped[name], value, err_msg=name, **TOL)
    np.testing.assert_array_equal(tl(x), parallel(x))
    # A plant of the attention's output reaches the output alone: the MLP reads the input.
    new = random((B, T, D), 2)
    planted = plant(tl, tag="modules")({"blocks.0.hook_attn_out": new}, x)
    np.testing.assert_allclose(planted, x + new + mlp_out, **TOL)
    with pytest.raises(KeyError, match="hook_resid_mid"):
        plant(tl, tag="modules")({"blocks.0.hook_resid_mid": x}, x)
    # Found by a run on a copy: the model's random state is drawn from once per call.
    drawing = Stack(DropoutParallelBlock(nnx.Rngs(0)))
    twin = nnx.clone(drawing)
    reaped = reap(instrument(drawing, naming="transformer_lens"), tag="modules")(x)
    assert "blocks.0.hook_resid_mid" not in reaped
    # (Another dropout mask would differ by the MLP's whole output, not by rounding.)
    np.testing.assert_allclose(reaped["blocks.0.hook_resid_post"], twin(x), **TOL)
    np.testing.assert_allclose(drawing(x), twin(x), **TOL)  # both drew once before


def test_a_block_called_twice_is_checked_per_call():
    # The second call's norm takes the block's new input: not a parallel block.
    stack = Stack(Block(nnx.Rngs(0)))
    x = random((B, T, D), 1)
    reaped = reap(instrument(stack, naming="transformer_lens"), tag="modules")(x, times=2)
    # A site sown twice holds both values, stacked.
    first = stack(x)
    np.testing.assert_allclose(reaped["blocks.0.hook_resid_post"], [first, stack(first)], **TOL)
    block = stack.blocks[0]
    mids = [x + block.attn(block.ln1(x)), first + block.attn(block.ln1(first))]
    np.testing.assert_allclose(reaped["blocks.0.hook_resid_mid"], mids, **TOL)


# ---------------------------------------------------------------------------
# Penzai: a llama-like transformer of two blocks, built by Penzai.


@pytest.fixture(scope="module")
def llama():
    pz = pytest.importorskip("penzai.pz")
    pytest.importorskip("penzai.models.transformer.variants.llamalike_common")
    from _penzai_models import tiny_config
    from penzai.models.transformer.variants import llamalike_common

    config = tiny_config(num_decoder_blocks=2)
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    return pz, model


AXES = ("batch", "seq", "embedding")


def penzai_forward(pz, model, tokens, patch=None):
    """The llama-like model's logits and stream, its layers called one by one: the
    embedding, each block's two residual branches added by hand, the final norm and head."""
    patch, values = patch or {}, {}
    positions = pz.nx.arange("seq", tokens.named_shape["seq"])

    def at(name, value):
        if name in patch:
            value = pz.nx.wrap(patch[name], *AXES)
        values[name] = value.order_as(*AXES).unwrap(*AXES)
        return value

    embed, *blocks, norm, head = model.body.sublayers
    x = embed(tokens, token_positions=positions)
    for i, block in enumerate(blocks):
        n = f"blocks.{i}"
        attention, feed_forward = block.sublayers
        x = at(f"{n}.hook_resid_pre", x)
        attn_out = at(f"{n}.hook_attn_out", attention.delta(x, token_positions=positions))
        mid = at(f"{n}.hook_resid_mid", x + attn_out)
        mlp_out = at(f"{n}.hook_mlp_out", feed_forward.delta(mid, token_positions=positions))
        x = at(f"{n}.hook_resid_post", mid + mlp_out)
    out = head(norm(x, token_positions=positions), token_positions=positions)
    return out.order_as(*out.named_shape).unwrap(*out.named_shape), values


def test_penzai_names_hold_the_stream_and_plants_patch_it(llama):
    pz, model = llama
    tokens = pz.nx.wrap(jnp.array([[1, 2, 3, 4, 5]]), "batch", "seq")
    logits = lambda out: out.order_as(*out.named_shape).unwrap(*out.named_shape)
    tl = instrument(model, naming="transformer_lens")
    np.testing.assert_array_equal(logits(tl(tokens)), logits(model(tokens)))
    by_hand_logits, by_hand = penzai_forward(pz, model, tokens)
    np.testing.assert_allclose(by_hand_logits, logits(model(tokens)), **TOL)
    reaped = reap(tl, tag="modules")(tokens)
    assert set(by_hand) == {f"blocks.{i}.{h}" for i in range(2) for h in STREAM}
    for name, value in by_hand.items():
        np.testing.assert_allclose(reaped[name], value, err_msg=name, **TOL)
    for seed, name in enumerate(by_hand):
        value = random((1, 5, 8), seed)
        planted = plant(tl, tag="modules")({name: value}, tokens)
        patched = penzai_forward(pz, model, tokens, {name: value})[0]
        np.testing.assert_allclose(logits(planted), patched, err_msg=name, **TOL)


def test_penzai_attention_hooks_are_named_per_block_too(llama):
    pz, model = llama
    tokens = pz.nx.wrap(jnp.array([[1, 2, 3, 4, 5]]), "batch", "seq")
    tl = instrument(model, naming="transformer_lens", attention=True)
    reaped = reap(tl, tag="modules")(tokens)
    by_path = reap(instrument(model, attention=True), tag="modules")(tokens)
    attention = "body.sublayers.2.sublayers.0.delta.sublayers.1"  # the second block's
    for hook in ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"):
        np.testing.assert_array_equal(
            reaped[f"blocks.1.attn.{hook}"], by_path[f"{attention}.{hook}"]
        )
        assert f"{attention}.{hook}" not in reaped  # TransformerLens's names only
    # The scores are what the softmax takes: the pattern is their softmax over keys.
    np.testing.assert_allclose(
        jax.nn.softmax(reaped["blocks.1.attn.hook_attn_scores"], axis=-1),
        reaped["blocks.1.attn.hook_pattern"],
        **TOL,
    )
    # hook_embed is the embedding layer's output: layer 0's resid_pre (no positions here).
    np.testing.assert_array_equal(reaped["hook_embed"], reaped["blocks.0.hook_resid_pre"])
    # The gated MLP's hooks, from its layers called by hand on resid_mid.
    _, stream = penzai_forward(pz, model, tokens)
    mid = pz.nx.wrap(stream["blocks.1.hook_resid_mid"], *AXES)
    norm, feed_forward = model.body.sublayers[2].sublayers[1].delta.sublayers
    (gate, linear), out = feed_forward.sublayers[0].branches, feed_forward.sublayers[1]
    h = norm(mid)
    pre, pre_linear = gate.sublayers[0](h), linear(h)
    post = gate.sublayers[1](pre) * pre_linear
    unwrap = lambda a: a.order_as("batch", "seq", "neurons").unwrap("batch", "seq", "neurons")
    for hook, value in (("hook_pre", pre), ("hook_pre_linear", pre_linear), ("hook_post", post)):
        np.testing.assert_allclose(
            reaped[f"blocks.1.mlp.{hook}"], unwrap(value), err_msg=hook, **TOL
        )
    mlp_out = out(post).order_as(*AXES).unwrap(*AXES)
    np.testing.assert_allclose(mlp_out, stream["blocks.1.hook_mlp_out"], **TOL)
    # Planting under the block's name is planting the hook (checked against hand edits in
    # test_instrument_penzai.py).
    z = random(reaped["blocks.1.attn.hook_z"].shape, 3)
    by_alias = plant(tl, tag="modules")({"blocks.1.attn.hook_z": z}, tokens)
    planted = plant(instrument(model, attention=True), tag="modules")(
        {f"{attention}.hook_z": z}, tokens
    )
    np.testing.assert_array_equal(
        by_alias.unwrap(*by_alias.named_shape), planted.unwrap(*planted.named_shape)
    )
    sweep = patching_sweep(
        tl,
        reaped,
        (tokens,),
        lambda o: o.data_array.mean(),
        tag="modules",
        names="blocks.*.attn.hook_z",
        axis=2,
    )
    assert sweep.values.shape == (2, 2)  # [layer, head]


# ---------------------------------------------------------------------------
# gemma: DeepMind's library (Linen), a tiny Gemma 3 config with post-norms, random weights.


@pytest.fixture(scope="module")
def gemma():
    from benchmarks.bench_models import import_gemma

    try:
        gm, config, modules = import_gemma()
    except ImportError as error:  # not installed in the JAX matrix (see test_instrument_gemma)
        pytest.skip(f"the gemma library does not import here: {error}")
    settings = dict(num_embed=13, embed_dim=8, hidden_dim=16, num_heads=2, head_dim=4)
    models = {}
    for post_norms in (True, False):
        transformer_config = config.TransformerConfig(
            **settings,
            num_kv_heads=2,
            final_logit_softcap=None,
            use_post_attn_norm=post_norms,
            use_post_ffw_norm=post_norms,
            attention_types=(modules.AttentionType.GLOBAL,) * 2,
        )
        model = gm.nn.Transformer(config=transformer_config, dtype=jnp.float32)
        tokens = jnp.array([[2, 5, 7, 1, 3]])
        models[post_norms] = (model, model.init(jax.random.key(0), tokens), tokens)
    return models


def gemma_forward(model, params, tokens, patch=None):
    """Gemma's logits and stream, from `Block.__call__`: each block's norms and attention
    called one by one, its gated MLP (`FeedForward`) from its weights, the residual
    additions written out."""
    patch, values = patch or {}, {}

    def at(name, value):
        values[name] = patch.get(name, value)
        return values[name]

    inner = model.bind(params)
    t = tokens.shape[1]
    positions, mask = jnp.arange(t)[None], jnp.tril(jnp.ones((1, t, t), bool))
    x = at("hook_embed", inner.embedder.encode(tokens))  # the table's rows times sqrt(d)
    for i, block in enumerate(inner.blocks):
        n, w = f"blocks.{i}", params["params"][f"layer_{i}"]["mlp"]
        x = at(f"{n}.hook_resid_pre", x)
        _, attn = block.attn(block.pre_attention_norm(x), positions, None, mask)
        if block.post_attention_norm is not None:
            attn = block.post_attention_norm(attn)
        mid = at(f"{n}.hook_resid_mid", at(f"{n}.hook_attn_out", attn) + x)
        gate = jnp.einsum("...F,NFH->...NH", block.pre_ffw_norm(mid), w["gating_einsum"])
        pre = at(f"{n}.mlp.hook_pre", gate[..., 0, :])
        post = jax.nn.gelu(pre) * at(f"{n}.mlp.hook_pre_linear", gate[..., 1, :])
        mlp = at(f"{n}.mlp.hook_post", post) @ w["linear"]
        if block.post_ffw_norm is not None:
            mlp = block.post_ffw_norm(mlp)
        x = at(f"{n}.hook_resid_post", at(f"{n}.hook_mlp_out", mlp) + mid)
    return inner.embedder.decode(inner.final_norm(x)), values


@pytest.mark.parametrize("post_norms", [True, False])
def test_gemma_names_hold_the_stream_and_plants_patch_it(gemma, post_norms):
    model, params, tokens = gemma[post_norms]
    forward = lambda p, t: model.apply(p, t).logits
    tl = instrument(forward, naming="transformer_lens")
    if post_norms:  # resid_mid is a part's output: every name costs no arithmetic
        np.testing.assert_array_equal(tl(params, tokens), forward(params, tokens))
    else:  # resid_mid is sown beside the attention's product, which XLA may compile anew
        np.testing.assert_allclose(
            tl(params, tokens), forward(params, tokens), rtol=1e-6, atol=1e-7
        )
        no_mid = instrument(forward, naming="transformer_lens", names=lambda n: "mid" not in n)
        np.testing.assert_array_equal(no_mid(params, tokens), forward(params, tokens))
    logits, by_hand = gemma_forward(model, params, tokens)
    np.testing.assert_allclose(logits, model.apply(params, tokens).logits, **TOL)
    reaped = reap(tl, tag="modules")(params, tokens)
    mlp = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")
    hooks = [f"blocks.{i}.{h}" for i in range(2) for h in (*STREAM, *mlp)]
    assert set(reaped) == set(by_hand) == {"hook_embed", *hooks}
    for name, value in by_hand.items():
        np.testing.assert_allclose(reaped[name], value, err_msg=name, **TOL)
    for seed, name in enumerate(by_hand):
        value = random(by_hand[name].shape, seed)
        planted = plant(tl, tag="modules")({name: value}, params, tokens)
        patched = gemma_forward(model, params, tokens, {name: value})[0]
        np.testing.assert_allclose(planted, patched, err_msg=name, **TOL)


def test_a_function_without_gemma_blocks_is_refused():
    linen = pytest.importorskip("flax.linen")
    dense = linen.Dense(3)
    variables = dense.init(jax.random.key(0), jnp.ones(2))
    tl = instrument(lambda x: dense.apply(variables, x), naming="transformer_lens")
    with pytest.raises(ValueError, match="found no transformer block in"):
        tl(jnp.ones(2))


# ---------------------------------------------------------------------------
# Attention-only blocks, Equinox blocks, attention scores, and refusals at instrument time.


class AttnOnlyBlock(nnx.Module):
    """TransformerLens's `attn_only` block, with a dropout rate so NNX takes its unfused path."""

    def __init__(self, rngs, dropout=0.0):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            H, D, qkv_features=H * DH, dropout_rate=dropout, decode=False, rngs=rngs
        )

    def __call__(self, x):
        return x + self.attn(self.ln1(x), deterministic=True)


@pytest.mark.parametrize("dropout", [0.0, 0.5])  # NNX's fused attention, then its unfused path
def test_attention_only_blocks_get_their_names_and_scores(dropout):
    model = Stack(AttnOnlyBlock(nnx.Rngs(0), dropout))
    x = random((B, T, D), 1)
    tl = instrument(model, naming="transformer_lens", attention=True)
    reaped = reap(tl, tag="modules")(x)
    hooks = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")
    want = {"blocks.0.hook_resid_pre", "blocks.0.hook_attn_out", "blocks.0.hook_resid_post"}
    assert set(reaped) == want | {f"blocks.0.attn.{h}" for h in hooks}
    block = model.blocks[0]
    attn_out, z = hand_attention(block.attn, block.ln1(x))
    np.testing.assert_allclose(reaped["blocks.0.hook_attn_out"], attn_out, **TOL)
    np.testing.assert_allclose(reaped["blocks.0.attn.hook_z"], z, **TOL)
    np.testing.assert_allclose(reaped["blocks.0.hook_resid_post"], x + attn_out, **TOL)
    q, k = reaped["blocks.0.attn.hook_q"], reaped["blocks.0.attn.hook_k"]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DH)
    np.testing.assert_allclose(reaped["blocks.0.attn.hook_attn_scores"], scores, **TOL)
    # Planting scores changes the pattern as the softmax of the planted scores.
    planted = random(scores.shape, 5)
    _, after = harvest(tl, tag="modules")({"blocks.0.attn.hook_attn_scores": planted}, x)
    np.testing.assert_allclose(
        after["blocks.0.attn.hook_pattern"], jax.nn.softmax(planted, axis=-1), **TOL
    )
    np.testing.assert_array_equal(tl(x), model(x))  # unharvested, the same numbers


class CrossAttentionBlock(Block):
    def __call__(self, x):
        x = x + self.attn(self.ln1(x), x)  # keys and values from another stream
        return x + self.mlp(self.ln2(x))


class DecoderBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)
        self.cross = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)

    def __call__(self, x, memory):
        return x + self.cross(x + self.attn(x), memory)


def test_blocks_names_do_not_describe_are_refused_naming_the_block():
    x = random((B, T, D), 1)
    with pytest.raises(ValueError, match="block at 'blocks.0' holds 2 attention modules"):
        instrument(Stack(DecoderBlock(nnx.Rngs(0))), naming="transformer_lens")  # no call needed
    cross = instrument(Stack(CrossAttentionBlock(nnx.Rngs(0))), naming="transformer_lens")
    with pytest.raises(ValueError, match="'blocks.0.attn' in the block at 'blocks.0' is given"):
        cross(x)
    with pytest.raises(ValueError, match="inputs=True has nothing to add"):
        instrument(Stack(Block(nnx.Rngs(0))), naming="transformer_lens", inputs=True)


def test_equinox_blocks_with_an_mlp_get_every_name():
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.key(0), 4)

    class EqxBlock(eqx.Module):  # one sequence: [T, D]
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __call__(self, x):
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class EqxGPT(eqx.Module):
        blocks: list

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    def block(key):
        a, m = jax.random.split(key)
        mlp = eqx.nn.MLP(D, D, 16, depth=1, activation=jax.nn.gelu, key=m)
        attn = eqx.nn.MultiheadAttention(H, D, key=a)
        return EqxBlock(eqx.nn.LayerNorm(D), attn, eqx.nn.LayerNorm(D), mlp)

    model = EqxGPT([block(k) for k in keys[:2]])
    x = random((T, D), 1)
    reaped = reap(instrument(model, naming="transformer_lens"), tag="modules")(x)
    by_hand = {}
    for i, b in enumerate(model.blocks):
        n = f"blocks.{i}"
        by_hand[f"{n}.hook_resid_pre"] = x
        h = jax.vmap(b.ln1)(x)
        attn_out = by_hand[f"{n}.hook_attn_out"] = b.attn(h, h, h)
        mid = by_hand[f"{n}.hook_resid_mid"] = x + attn_out
        up, down = b.mlp.layers
        pre = by_hand[f"{n}.mlp.hook_pre"] = jax.vmap(up)(jax.vmap(b.ln2)(mid))
        post = by_hand[f"{n}.mlp.hook_post"] = jax.nn.gelu(pre)
        mlp_out = by_hand[f"{n}.hook_mlp_out"] = jax.vmap(down)(post)
        x = by_hand[f"{n}.hook_resid_post"] = mid + mlp_out
    assert set(reaped) == set(by_hand)
    for name, value in by_hand.items():
        np.testing.assert_allclose(reaped[name], value, err_msg=name, **TOL)


def test_penzai_parallel_blocks_have_no_resid_mid():
    pytest.importorskip("penzai.models.transformer.variants.gpt_neox")
    from penzai import pz
    from penzai.models.transformer.variants import gpt_neox

    config = gpt_neox.GPTNeoXTransformerConfig(
        num_attention_heads=2,
        embedding_dim=8,
        projection_dim=4,
        mlp_hidden_dim=16,
        num_decoder_blocks=2,
        vocab_size=11,
        activation_fn="gelu_exact",
        rope_subset_size=2,
        rope_wavelength=10_000,
        layernorm_epsilon=1e-5,
        parameter_dtype=jnp.float32,
        activation_dtype=jnp.float32,
    )
    model = gpt_neox.build_gpt_neox_transformer(config, init_base_rng=jax.random.key(0))
    tokens = pz.nx.wrap(jnp.array([[1, 2, 3, 4, 5]]), "batch", "seq")
    reaped = reap(instrument(model, naming="transformer_lens"), tag="modules")(tokens)
    positions = pz.nx.arange("seq", 5)
    unwrap = lambda a: a.order_as(*AXES).unwrap(*AXES)
    embed, *blocks = model.body.sublayers[:3]
    x = embed(tokens, token_positions=positions)
    for i, block in enumerate(blocks):
        _, attention, mlp = block.sublayers[0].branches
        attn_out = attention(x, token_positions=positions)
        mlp_out = mlp(x, token_positions=positions)
        for hook, value in (
            ("hook_resid_pre", x),
            ("hook_attn_out", attn_out),
            ("hook_mlp_out", mlp_out),
            ("hook_resid_post", x + attn_out + mlp_out),
        ):
            np.testing.assert_allclose(reaped[f"blocks.{i}.{hook}"], unwrap(value), **TOL)
        x = x + attn_out + mlp_out
        assert f"blocks.{i}.hook_resid_mid" not in reaped  # as TransformerLens's parallel_attn_mlp
        assert {f"blocks.{i}.mlp.hook_pre", f"blocks.{i}.mlp.hook_post"} <= set(reaped)


def test_equinox_parallel_blocks_have_no_resid_mid():
    eqx = pytest.importorskip("equinox")
    a, m = jax.random.split(jax.random.key(0))

    class EqxParallel(eqx.Module):  # GPT-J's: one norm, read by both branches
        ln: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        mlp: eqx.nn.MLP

        def __call__(self, x):
            h = jax.vmap(self.ln)(x)
            return x + self.attn(h, h, h) + jax.vmap(self.mlp)(h)

    class Holder(eqx.Module):
        blocks: list

        def __call__(self, x):
            return self.blocks[0](x)

    mlp = eqx.nn.MLP(D, D, 16, depth=1, activation=jax.nn.gelu, key=m)
    block = EqxParallel(eqx.nn.LayerNorm(D), eqx.nn.MultiheadAttention(H, D, key=a), mlp)
    model, x = Holder([block]), random((T, D), 1)
    reaped = reap(instrument(model, naming="transformer_lens"), tag="modules")(x)
    h = jax.vmap(block.ln)(x)
    attn_out, mlp_out = block.attn(h, h, h), jax.vmap(block.mlp)(h)
    assert "blocks.0.hook_resid_mid" not in reaped
    np.testing.assert_allclose(reaped["blocks.0.hook_attn_out"], attn_out, **TOL)
    np.testing.assert_allclose(reaped["blocks.0.hook_mlp_out"], mlp_out, **TOL)
    np.testing.assert_allclose(reaped["blocks.0.hook_resid_post"], x + attn_out + mlp_out, **TOL)
