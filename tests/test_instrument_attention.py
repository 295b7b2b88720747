"""instrument(model, attention=True): TransformerLens's hook_q/k/v/z/pattern on known attention modules.

Each kind's attention is written out by hand from its parameters (`by_hand`),
with the hooked value replaced by hand; planting the same value at the hook
must give the same output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import instrument, plant, reap, sites

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")

T, D, H, DH = 4, 8, 2, 4
HOOKS = ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")
TOL = dict(rtol=1e-5, atol=1e-5)


def by_hand(q, k, v, project_out, mask=None, patch=None):
    """Attention from projected q, k, v ([..., seq, heads, d_head]); `patch` replaces hooks."""
    patch = patch or {}
    q, k, v = (patch.get(f"hook_{n}", a) for n, a in zip("qkv", (q, k, v)))
    logits = jnp.einsum("...qhd,...khd->...hqk", q / np.sqrt(q.shape[-1]), k)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    pattern = patch.get("hook_pattern", jax.nn.softmax(logits, axis=-1))
    z = patch.get("hook_z", jnp.einsum("...hqk,...khd->...qhd", pattern, v))
    return project_out(z), {
        "hook_q": q,
        "hook_k": k,
        "hook_v": v,
        "hook_pattern": pattern,
        "hook_z": z,
    }


def new_value(shape, seed):
    return jax.random.uniform(jax.random.key(seed), shape, minval=-1.0, maxval=1.0)


def check_every_hook(run, plant_run, path, reference, lead=(), planted=HOOKS):
    """Reaped hooks match the hand-written forward; planting each of `planted` matches it patched by hand."""
    reaped = run()
    out, hand = reference()
    for hook in HOOKS:
        got = reaped[f"{path}.{hook}"]
        np.testing.assert_allclose(got, hand[hook], err_msg=hook, **TOL)
    assert reaped[f"{path}.hook_q"].shape == (*lead, T, H, DH)
    assert reaped[f"{path}.hook_pattern"].shape == (*lead, H, T, T)
    for i, hook in enumerate(planted):
        value = new_value(hand[hook].shape, i)
        if hook == "hook_pattern":
            value = jax.nn.softmax(value * 3.0, axis=-1)
        planted = plant_run({f"{path}.{hook}": value})
        np.testing.assert_allclose(planted, reference({hook: value})[0], err_msg=hook, **TOL)


# ---------------------------------------------------------------------------


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.mha = nnx.MultiHeadAttention(H, D, qkv_features=H * DH, decode=False, rngs=rngs)

    def __call__(self, x):
        return self.mha(x)


def flax_projections(p, x):
    proj = lambda name: jnp.einsum("...d,dhk->...hk", x, p[name]["kernel"]) + p[name]["bias"]
    out = lambda z: jnp.einsum("...qhd,hdD->...qD", z, p["out"]["kernel"]) + p["out"]["bias"]
    return proj("query"), proj("key"), proj("value"), out


def test_nnx_multi_head_attention():
    model = NNXModel(nnx.Rngs(0))
    x = new_value((2, T, D), 9)
    p = jax.tree.map(lambda v: v[...], nnx.to_pure_dict(nnx.state(model, nnx.Param)))["mha"]
    probed = instrument(model, attention=True)
    # Flax's fused path, op for op (jax.nn.dot_product_attention's XLA implementation).
    np.testing.assert_array_equal(probed(x), model(x))
    np.testing.assert_array_equal(jax.jit(probed)(x), jax.jit(model)(x))
    reference = lambda patch=None: by_hand(*flax_projections(p, x), patch=patch)
    check_every_hook(
        lambda: reap(probed, tag="modules")(x),
        lambda plants: plant(probed, tag="modules")(plants, x),
        "mha",
        reference,
        lead=(2,),
        planted=("hook_q", "hook_pattern", "hook_z"),  # k and v go the way q goes (Linen: all five)
    )
    # The model is as it was after the call.
    assert model.mha.attention_fn is nnx.dot_product_attention
    names = [s.name for s in sites(probed, tag="modules")(x)]
    assert {"mha.query", "mha.out", "mha"} <= set(names) and "mha.hook_z" in names


class GroupedModel(nnx.Module):
    """Grouped-query attention (2 key/value heads for 4 query heads), optionally with dropout."""

    def __init__(self, rngs, dropout_rate=0.0):
        self.mha = nnx.MultiHeadAttention(
            4, D, qkv_features=4 * DH, num_kv_heads=2, dropout_rate=dropout_rate, rngs=rngs
        )

    def __call__(self, x, mask=None):
        return self.mha(x, mask=mask, deterministic=True, decode=False)


@pytest.mark.parametrize("dropout_rate", [0.0, 0.5])  # Flax's fused path, its unfused one
def test_nnx_grouped_query_attention_is_bit_identical_and_planted_as_by_hand(dropout_rate):
    model = GroupedModel(nnx.Rngs(1), dropout_rate)
    x = new_value((3, 2, T, D), 4)  # two batch axes, which the fused kernel folds into one
    mask = nnx.make_causal_mask(jnp.ones((3, 2, T)))
    probed = instrument(model, attention=True)
    np.testing.assert_array_equal(probed(x, mask), model(x, mask))
    reaped = reap(probed, tag="modules")(x, mask)
    p = jax.tree.map(lambda v: v[...], nnx.to_pure_dict(nnx.state(model, nnx.Param)))["mha"]
    q, k, v, out = flax_projections(p, x)
    repeat = lambda a: jnp.repeat(a, 2, axis=-2)  # each key/value head serves two query heads
    _, hand = by_hand(q, repeat(k), repeat(v), out, mask=mask)
    assert reaped["mha.hook_k"].shape == (3, 2, T, 2, DH)
    for hook in ("hook_q", "hook_pattern", "hook_z"):
        np.testing.assert_allclose(reaped[f"mha.{hook}"], hand[hook], err_msg=hook, **TOL)
    pattern = jax.nn.softmax(new_value(hand["hook_pattern"].shape, 5) * 3.0, axis=-1)
    planted = plant(probed, tag="modules")({"mha.hook_pattern": pattern}, x, mask)
    patched = by_hand(q, repeat(k), repeat(v), out, mask=mask, patch={"hook_pattern": pattern})
    np.testing.assert_allclose(planted, patched[0], **TOL)


class LinenModel(linen.Module):
    @linen.compact
    def __call__(self, x, mask=None):
        return linen.MultiHeadDotProductAttention(H, qkv_features=H * DH, name="attn")(x, mask=mask)


def test_linen_multi_head_dot_product_attention_with_a_mask():
    model = LinenModel()
    x = new_value((2, T, D), 9)
    mask = linen.make_causal_mask(jnp.ones((2, T)))
    variables = model.init(jax.random.key(0), x)
    f = instrument(model.apply, attention=True)
    np.testing.assert_array_equal(f(variables, x, mask), model.apply(variables, x, mask))
    p = variables["params"]["attn"]
    reference = lambda patch=None: by_hand(*flax_projections(p, x), mask=mask, patch=patch)
    check_every_hook(
        lambda: reap(f, tag="modules")(variables, x, mask),
        lambda plants: plant(f, tag="modules")(plants, variables, x, mask),
        "attn",
        reference,
        lead=(2,),
    )


def test_equinox_multihead_attention():
    mha = eqx.nn.MultiheadAttention(H, D, qk_size=DH, vo_size=DH, key=jax.random.key(0))
    x = new_value((T, D), 9)

    def reference(patch=None):
        proj = lambda lin, a: (a @ lin.weight.T).reshape(T, H, DH)  # no biases by default
        out = lambda z: z.reshape(T, H * DH) @ mha.output_proj.weight.T
        q, k, v = proj(mha.query_proj, x), proj(mha.key_proj, x), proj(mha.value_proj, x)
        return by_hand(q, k, v, out, patch=patch)

    # A root attention has no path of its own: wrap it so it sits at "attn".
    model = Holder(mha)
    probed = instrument(model, attention=True)
    np.testing.assert_array_equal(probed(x), model(x))  # the same ops, in the same order
    check_every_hook(
        lambda: reap(probed, tag="modules")(x),
        lambda plants: plant(probed, tag="modules")(plants, x),
        "attn",
        reference,
    )
    # Under jit: the same.
    jitted = jax.jit(lambda a: reap(probed, tag="modules")(a)["attn.hook_pattern"])
    np.testing.assert_allclose(jitted(x), reference()[1]["hook_pattern"], **TOL)


class Holder(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return self.attn(x, x, x)


def test_attention_flag_is_checked_and_custom_attention_fns_say_what_to_do():
    with pytest.raises(TypeError, match="attention"):
        instrument(NNXModel(nnx.Rngs(0)), attention="yes")
    model = NNXModel(nnx.Rngs(0))
    model.mha.attention_fn = lambda *a, **k: nnx.dot_product_attention(*a, **k)
    with pytest.raises(TypeError, match="custom attention_fn") as info:
        reap(instrument(model, attention=True), tag="modules")(jnp.ones((1, T, D)))
    assert len(str(info.value)) < 600


class HeadsHolder(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    process_heads: object = eqx.field(static=True)

    def __call__(self, x):
        return self.attn(x, x, x, process_heads=self.process_heads)


def test_equinox_attention_process_heads_as_equinox_does_and_its_errors_name_the_site():
    mha = eqx.nn.MultiheadAttention(H, D, qk_size=DH, vo_size=DH, key=jax.random.key(0))
    x = new_value((T, D), 9)
    halve = lambda q, k, v: (q / 2, k, v)
    model = HeadsHolder(mha, halve)
    np.testing.assert_allclose(instrument(model, attention=True)(x), model(x), **TOL)
    shrink = HeadsHolder(mha, lambda q, k, v: (q[:, :1], k, v))
    with pytest.raises(ValueError, match="process_heads at 'attn' changed the heads' shapes"):
        instrument(shrink, attention=True)(x)


def equinox_holder():
    mha = eqx.nn.MultiheadAttention(H, D, qk_size=DH, vo_size=DH, key=jax.random.key(0))
    model = Holder(mha)

    def reference(x, patch=None):
        proj = lambda lin, a: (a @ lin.weight.T).reshape(T, H, DH)
        out = lambda z: z.reshape(T, H * DH) @ mha.output_proj.weight.T
        q, k, v = proj(mha.query_proj, x), proj(mha.key_proj, x), proj(mha.value_proj, x)
        return by_hand(q, k, v, out, patch=patch)

    return model, reference


def test_head_by_position_sweep_on_hook_z_matches_hand_patches():
    from harvest import patch_head, patching_sweep

    model, reference = equinox_holder()
    probed = instrument(model, attention=True, names="attn.hook_z")
    clean_x, corrupt_x = new_value((T, D), 1), new_value((T, D), 2)
    clean = reap(probed, tag="modules")(clean_x)
    metric = lambda out: out[-1].sum()
    result = patching_sweep(probed, clean, (corrupt_x,), metric, tag="modules", axis=(-2, -3))
    assert result.values.shape == (1, H, T)
    assert result.axis_labels == ("head", "position")
    z_clean, z_corrupt = reference(clean_x)[1]["hook_z"], reference(corrupt_x)[1]["hook_z"]
    base = metric(reference(corrupt_x)[0])
    for h in range(H):
        for t in range(T):
            mixed = z_corrupt.at[t, h].set(z_clean[t, h])
            by_hand = metric(reference(corrupt_x, {"hook_z": mixed})[0]) - base
            np.testing.assert_allclose(result.values[0, h, t], by_hand, **TOL)
    # patch_head on the hook: head 1 at every position, by hand.
    planted = plant(probed, tag="modules")(
        {"attn.hook_z": patch_head(clean["attn.hook_z"], 1, axis=-2)}, corrupt_x
    )
    mixed = z_corrupt.at[:, 1].set(z_clean[:, 1])
    np.testing.assert_allclose(planted, reference(corrupt_x, {"hook_z": mixed})[0], **TOL)
    import matplotlib

    matplotlib.use("Agg")
    panel = result.plot()[0]
    assert (panel.get_xlabel(), panel.get_ylabel()) == ("position", "head")


def test_a_sweep_over_merged_head_features_names_the_hook_to_use():
    from harvest import patching_sweep

    model, _ = equinox_holder()
    probed = instrument(model, inputs=True, attention=True)
    x = new_value((T, D), 1)
    clean = reap(probed, tag="modules")(x)
    assert clean["attn.output_proj:in"].shape == (T, H * DH)  # heads merged
    metric = lambda out: out.sum()
    with pytest.raises(ValueError, match="'attn.hook_z'") as info:
        patching_sweep(
            probed, clean, (-x,), metric, tag="modules", names="attn.output_proj:in", axis=(1, 0)
        )
    assert len(str(info.value)) < 600
    with pytest.raises(ValueError, match="d_head"):
        patching_sweep(probed, clean, (-x,), metric, tag="modules", names="attn.hook_z", axis=-1)


def test_linen_scores_are_the_masked_product_and_a_plant_gives_its_softmax():
    model = LinenModel()
    x = new_value((2, T, D), 9)
    mask = linen.make_causal_mask(jnp.ones((2, T)))
    variables = model.init(jax.random.key(0), x)
    f = instrument(model.apply, attention=True)
    reaped = reap(f, tag="modules")(variables, x, mask)
    q, k, v, out = flax_projections(variables["params"]["attn"], x)
    logits = jnp.einsum("...qhd,...khd->...hqk", q / np.sqrt(DH), k)
    big_negative = jnp.finfo(jnp.float32).min  # Flax's, where TransformerLens has -inf
    scores = jnp.where(mask, logits, big_negative)
    np.testing.assert_allclose(reaped["attn.hook_attn_scores"], scores, **TOL)
    assert (reaped["attn.hook_attn_scores"] == big_negative).sum() == 2 * H * T * (T - 1) // 2
    # A plant is what the softmax takes: the output is the one its softmax gives.
    planted_scores = jnp.where(mask, new_value(scores.shape, 3) * 3.0, big_negative)
    planted = plant(f, tag="modules")({"attn.hook_attn_scores": planted_scores}, variables, x, mask)
    pattern = jax.nn.softmax(planted_scores, axis=-1)
    expected = by_hand(q, k, v, out, mask=mask, patch={"hook_pattern": pattern})[0]
    np.testing.assert_allclose(planted, expected, **TOL)


class LinenDropout(linen.Module):
    @linen.compact
    def __call__(self, x):
        attn = linen.MultiHeadDotProductAttention(
            H, qkv_features=H * DH, dropout_rate=0.5, deterministic=False, name="attn"
        )
        return attn(x)


def test_linen_dropout_after_the_pattern_hook_as_flax_draws_it():
    model, x = LinenDropout(), new_value((2, T, D), 9)
    variables = model.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(7)}
    f = instrument(lambda v, a: model.apply(v, a, rngs=rngs), attention=True)
    np.testing.assert_array_equal(f(variables, x), model.apply(variables, x, rngs=rngs))
    reaped = reap(f, tag="modules")(variables, x)
    # The pattern is before dropout: each row sums to one.
    np.testing.assert_allclose(reaped["attn.hook_pattern"].sum(-1), 1.0, **TOL)
    _, hand = by_hand(*flax_projections(variables["params"]["attn"], x))
    np.testing.assert_allclose(reaped["attn.hook_pattern"], hand["hook_pattern"], **TOL)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_hooks_outside_the_softmax_leave_flax_s_own_attention_bit_for_bit(kind):
    x = new_value((2, T, D), 9)
    if kind == "nnx":
        model = NNXModel(nnx.Rngs(0))
        p = jax.tree.map(lambda v: v[...], nnx.to_pure_dict(nnx.state(model, nnx.Param)))["mha"]
        path, run, args = "mha", model, (x,)
        probed = instrument(model, attention=True, names=lambda n: n.endswith(("_v", "_z")))
    else:
        model = LinenModel()
        variables = model.init(jax.random.key(0), x)
        p, path, run, args = variables["params"]["attn"], "attn", model.apply, (variables, x)
        probed = instrument(model.apply, attention=True)
    np.testing.assert_array_equal(probed(*args), run(*args))
    reaped = reap(probed, tag="modules")(*args)
    _, hand = by_hand(*flax_projections(p, x))
    for hook in ("hook_v", "hook_z"):
        np.testing.assert_allclose(reaped[f"{path}.{hook}"], hand[hook], err_msg=hook, **TOL)
    z = new_value(hand["hook_z"].shape, 2)
    planted = plant(probed, tag="modules")({f"{path}.hook_z": z}, *args)
    np.testing.assert_allclose(
        planted, by_hand(*flax_projections(p, x), patch={"hook_z": z})[0], **TOL
    )
