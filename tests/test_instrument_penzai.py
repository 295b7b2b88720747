"""instrument on Penzai models: a tiny llama-like transformer built from Penzai's own config.

References are Penzai itself: the plain model's outputs, its layers called by
hand on reaped inputs, and the model edited by hand with `pz.select` (a layer
that replaces or shifts a sublayer's output inserted where harvest plants).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import (
    add_vector,
    attribution_patching,
    instrument,
    patching_sweep,
    plant,
    reap,
    sites,
)
from harvest._calling._stateful import flattening_call

pz = pytest.importorskip("penzai.pz")
pytest.importorskip("penzai.models.transformer.variants.llamalike_common")

from _penzai_models import tiny_llamalike  # noqa: E402  (it imports Penzai: after the skip)

BLOCK = "body.sublayers.1"  # the first transformer block (sublayer 0 embeds the tokens)
ATTN = "body.sublayers.1.sublayers.0.delta.sublayers.1"  # its pz.nn.Attention


@pytest.fixture(scope="module")
def model():
    return tiny_llamalike()


def tokens(*ids):
    return pz.nx.wrap(jnp.array([ids]), "batch", "seq")


CLEAN, CORRUPT = tokens(1, 2, 3, 4, 5), tokens(1, 2, 7, 4, 5)


@pz.pytree_dataclass
class Shift(pz.nn.Layer):
    """A hand-written edit: adds `vector` (named axes) to its input."""

    vector: pz.nx.NamedArray

    def __call__(self, x, **side_inputs):
        return x + self.vector


@pz.pytree_dataclass
class Const(pz.nn.Layer):
    value: pz.nx.NamedArray

    def __call__(self, x, **side_inputs):
        return self.value


def edited(model, path, layer):
    """`model` with `layer` applied after the sublayer at `path` (a dotted key path)."""
    keys = tuple(path.split("."))
    return (
        pz.select(model)
        .at(lambda m: _get(m, keys))
        .apply(lambda sub: pz.nn.Sequential([sub, layer]))
    )


def _get(node, keys):
    for k in keys:
        node = node[int(k)] if k.isdigit() else getattr(node, k)
    return node


def logits(out):
    """The model's output as [batch, seq, vocabulary] (a reaped site holds its data already)."""
    if isinstance(out, jax.Array):
        return out
    return out.order_as(*out.named_shape).unwrap(*out.named_shape)


def test_outputs_are_bit_identical_eagerly_and_under_jit(model):
    m = instrument(model)
    assert np.array_equal(logits(m(CLEAN)), logits(model(CLEAN)))
    jitted = jax.jit(lambda t: model(t))(CLEAN)
    assert np.array_equal(logits(jax.jit(lambda t: m(t))(CLEAN)), logits(jitted))


def test_a_site_per_layer_named_by_its_key_path(model):
    reaped = reap(instrument(model), tag="modules")(CLEAN)
    # Each name is the key path of a layer: attribute names and list indices, dotted.
    assert all(isinstance(_get(model, name.split(".")), pz.nn.Layer) for name in reaped)
    # Penzai's own key paths of its attention layers name the same sites.
    attention = pz.select(model).at_instances_of(pz.nn.Attention).selected_by_path
    expected = {
        ".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in p) for p in attention
    }
    assert expected == {ATTN} and ATTN in reaped
    assert {BLOCK, "body.sublayers.3", "body"} <= set(reaped)  # the block, the LM head, the body
    # A NamedArray output is sown as its data array, the input's axes (batch, seq) first.
    direct = _get(model, ATTN.split("."))
    assert isinstance(reaped[ATTN], jax.Array) and reaped[ATTN].shape == (1, 5, 8)
    # The reaped block output is the block called by hand on its reaped input.
    with_inputs = reap(instrument(model, inputs=True), tag="modules")(CLEAN)
    block = _get(model, BLOCK.split("."))
    positions = pz.nx.arange("seq", 5)
    residual = pz.nx.wrap(with_inputs[BLOCK + ":in"], "batch", "seq", "embedding")
    by_hand = block(residual, token_positions=positions).unwrap("batch", "seq", "embedding")
    np.testing.assert_allclose(by_hand, with_inputs[BLOCK], rtol=1e-6, atol=1e-6)
    attn_in = reap(instrument(model, inputs=True, names=ATTN + ":in"), tag="modules")(CLEAN)
    named_in = pz.nx.wrap(attn_in[ATTN + ":in"], "batch", "seq", "embedding")
    np.testing.assert_allclose(
        direct(named_in, token_positions=positions).unwrap("batch", "seq", "embedding"),
        reaped[ATTN],
        rtol=1e-6,
        atol=1e-6,
    )


def test_plant_constant_callable_and_add_vector_match_hand_edits(model):
    m = instrument(model)
    zeros = pz.nx.zeros({"batch": 1, "seq": 5, "embedding": 8})
    vector = pz.nx.wrap(jnp.linspace(-1.0, 1.0, 8), "embedding")
    planted = plant(m, tag="modules")({ATTN: jnp.zeros((1, 5, 8))}, CLEAN)
    np.testing.assert_allclose(
        logits(planted), logits(edited(model, ATTN, Const(zeros))(CLEAN)), rtol=1e-6, atol=1e-6
    )
    steered = plant(m, tag="modules")({BLOCK: lambda old: old + vector.unwrap("embedding")}, CLEAN)
    by_hand = logits(edited(model, BLOCK, Shift(vector))(CLEAN))
    np.testing.assert_allclose(logits(steered), by_hand, rtol=1e-6, atol=1e-6)
    # add_vector on a NamedArray site adds along its last data axis (here `embedding`).
    via = plant(m, tag="modules")({BLOCK: add_vector(vector.unwrap("embedding"))}, CLEAN)
    np.testing.assert_allclose(logits(via), by_hand, rtol=1e-6, atol=1e-6)
    # Under jax.jit, the same numbers; a new vector is a new argument, not a new trace.
    jitted = jax.jit(lambda v, t: plant(m, tag="modules")({BLOCK: add_vector(v)}, t))
    np.testing.assert_allclose(
        logits(jitted(vector.unwrap("embedding"), CLEAN)), by_hand, 1e-6, 1e-6
    )


def test_changed_parameters_are_seen(model):
    """A Penzai parameter is mutable: a reap after a change sees the new weights
    (the model's variables are traced as frozen values, not kept as constants)."""
    m = instrument(model, names="body")
    before = reap(m, tag="modules")(CLEAN)["body"]
    head = [p for p in pz.unbind_params(model)[1] if p.label.endswith("lm_head.weights")][0]
    old = head.value
    try:
        head.value = old * 2.0
        after = reap(m, tag="modules")(CLEAN)["body"]
        np.testing.assert_allclose(logits(after), logits(model(CLEAN)), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(logits(after), 2.0 * logits(before), rtol=1e-5, atol=1e-6)
        # The frozen model's arrays are kept while no variable changes, and taken again when one does.
        with flattening_call():
            kept = m.tree_flatten()
            assert m.tree_flatten()[1][1] is kept[1][1]
            head.value = old
            assert m.tree_flatten()[1][1] is not kept[1][1]
        np.testing.assert_array_equal(logits(reap(m, tag="modules")(CLEAN)["body"]), logits(before))
    finally:
        head.value = old


def test_patching_sweep_and_attribution_on_blocks(model):
    m = instrument(model, names=BLOCK)
    clean = reap(m, tag="modules")(CLEAN)
    metric = lambda out: logits(out)[0, -1, 3]
    result = patching_sweep(m, clean, (CORRUPT,), metric, tag="modules", axis=1)
    assert result.names == (BLOCK,) and result.values.shape == (1, 5)
    # One entry by hand: the clean block output at position 2 only, in the corrupted run.
    block = clean[BLOCK]
    corrupted = reap(m, tag="modules")(CORRUPT)[BLOCK]
    mask = (jnp.arange(5) == 2)[None, :, None]
    mixed = pz.nx.wrap(jnp.where(mask, block, corrupted), "batch", "seq", "embedding")
    base = metric(m(CORRUPT))
    by_hand = metric(edited(model, BLOCK, Const(mixed))(CORRUPT)) - base
    np.testing.assert_allclose(result.values[0, 2], by_hand, rtol=1e-4, atol=1e-5)
    attribution = attribution_patching(m, clean, (CORRUPT,), metric, tag="modules", axis=1)
    assert attribution.values.shape == result.values.shape
    # Linear estimate: (clean - corrupted) . d metric / d site, the gradient taken by hand
    # through the model edited to take the site's value as an argument.
    named = lambda v: pz.nx.wrap(v, "batch", "seq", "embedding")
    grad = jax.grad(lambda v: metric(edited(model, BLOCK, Const(named(v)))(CORRUPT)))(corrupted)
    estimate = ((block - corrupted) * grad).sum(-1)[0]
    np.testing.assert_allclose(attribution.values[0], estimate, rtol=1e-4, atol=1e-6)


def test_op_sites_are_named_under_layer_paths(model):
    names = list(reap(instrument(model, ops=True), tag="modules")(CLEAN))
    assert "body.sublayers.3/dot_general:0" in names  # the lm_head's einsum
    assert any(n.startswith(ATTN + ".query_key_to_attn.sublayers.2/") for n in names)  # softmax
    assert not any(n[0].isdigit() for n in names)  # no positional `1/0/0/...` names


def test_pz_select_still_works_on_the_instrumented_model(model):
    m = instrument(model)
    # Penzai's own selection reaches through the instrumented wrapper and keeps it instrumented.
    softmaxes = pz.select(m).at_instances_of(pz.nn.Softmax)
    assert softmaxes.count() == 1
    assert pz.select(m).at(lambda i: i.target.body.sublayers[1]).count() == 1  # by accessor
    edited_m = softmaxes.apply(lambda s: pz.nn.Sequential([s, pz.nn.Identity()]))
    assert type(edited_m) is type(m)
    np.testing.assert_array_equal(logits(edited_m(CLEAN)), logits(model(CLEAN)))
    assert ATTN + ".query_key_to_attn.sublayers.2.sublayers.0" in reap(edited_m, tag="modules")(
        CLEAN
    )


def test_errors_are_short_and_print_no_model(model):
    with pytest.raises(ValueError, match=r"names='nope\.\*' selects none") as info:
        reap(instrument(model, names="nope.*"), tag="modules")(CLEAN)
    assert len(str(info.value)) < 600 and "Parameter(" not in str(info.value)
    assert "nope" in str(info.value)
    with pytest.raises(ValueError, match="applies no Flax Linen module") as info:
        instrument(lambda t: model(t))(CLEAN)
    assert len(str(info.value)) < 600 and "TransformerLM(" not in str(info.value)
    out = sites(instrument(model), tag="modules")(CLEAN)
    assert BLOCK in [s.name for s in out]


def test_attention_hooks_match_hand_edits(model):
    """hook_q/k/v/z are [batch, seq, heads, projection], hook_pattern [batch, heads, seq, kv_seq];
    planting one equals the model edited by hand to put that value after the sublayer."""
    m = instrument(model, attention=True, names=ATTN + ".*")
    np.testing.assert_array_equal(logits(m(CLEAN)), logits(model(CLEAN)))
    reaped = reap(m, tag="modules")(CLEAN)
    attn = _get(model, ATTN.split("."))
    assert reaped[ATTN + ".hook_q"].shape == (1, 5, 2, 4)
    assert reaped[ATTN + ".hook_pattern"].shape == (1, 2, 5, 5)
    np.testing.assert_allclose(reaped[ATTN + ".hook_pattern"].sum(-1), 1.0, rtol=1e-5)
    where = {
        # Before the rotary embedding and the query's rescaling, as TransformerLens's.
        "hook_q": ("input_to_query.sublayers.0", ("batch", "seq", "heads", "projection")),
        "hook_k": ("input_to_key.sublayers.0", ("batch", "seq", "heads", "projection")),
        "hook_v": ("input_to_value", ("batch", "seq", "heads", "projection")),
        "hook_pattern": ("query_key_to_attn", ("batch", "heads", "seq", "kv_seq")),
        "hook_z": ("attn_value_to_output.sublayers.0", ("batch", "seq", "heads", "projection")),
    }
    assert isinstance(attn, pz.nn.Attention)
    for i, (hook, (sub, axes)) in enumerate(where.items()):
        value = jax.random.uniform(jax.random.key(i), reaped[f"{ATTN}.{hook}"].shape)
        planted = plant(m, tag="modules")({f"{ATTN}.{hook}": value}, CLEAN)
        by_hand = edited(model, f"{ATTN}.{sub}", Const(pz.nx.wrap(value, *axes)))(CLEAN)
        np.testing.assert_allclose(logits(planted), logits(by_hand), rtol=1e-5, atol=1e-5)


def test_sites_show_the_named_axes(model):
    """A NamedArray site is sown as its data, axes in `named_shape` order; `sites` names them."""
    listed = sites(instrument(model), tag="modules")(CLEAN)
    found = {s.name: s for s in listed}
    assert found[BLOCK].axes == ("batch", "seq", "embedding") and found[BLOCK].shape == (1, 5, 8)
    assert found[ATTN + ".input_to_query"].axes == ("batch", "seq", "heads", "projection")
    assert "(batch=1, seq=5, embedding=8)" in str(listed)
    # A site that is no named array has no names.
    plain = sites(instrument(model, attention=True), tag="modules")(CLEAN)
    assert {s.name: s for s in plain}[ATTN + ".hook_q"].axes is None


def test_every_site_orders_the_inputs_axes_first(model):
    """Penzai's embedding lookup returns (embedding, batch, seq) where the blocks return
    (batch, seq, embedding): sown as is, add_vector at the embedding would add along seq
    (silently, when seq is as long as the embedding). Every site puts batch, seq first."""
    square = tokens(1, 2, 3, 4, 5, 6, 7, 8)  # seq == embedding == 8
    listed = {s.name: s for s in sites(instrument(model), tag="modules")(square)}
    embed = "body.sublayers.0"
    assert listed[embed].axes[:2] == ("batch", "seq") and listed[embed].shape == (1, 8, 8)
    assert all(s.axes is None or s.axes[:2] == ("batch", "seq") for s in listed.values())
    vector = pz.nx.wrap(jnp.linspace(-1.0, 1.0, 8), "embedding")
    steered = plant(instrument(model), tag="modules")(
        {embed: add_vector(vector.unwrap("embedding"))}, square
    )
    by_hand = logits(edited(model, embed, Shift(vector))(square))
    np.testing.assert_allclose(logits(steered), by_hand, rtol=1e-6, atol=1e-6)
