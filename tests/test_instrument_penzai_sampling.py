"""instrument on Penzai's sampling mode: a KV-cached decode (`KVCachingTransformerLM`).

The model writes `pz.StateVariable`s (each attention's key/value cache, the
cache's end index, the tokens seen) at every call. References are Penzai
itself: the same sampling model run by `pz.variable_jit` (outputs and the cache
state compared bit for bit), the model edited by hand with `pz.select` before it
is converted to sampling mode, and the uncached model on the whole sequence.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import (
    add_vector,
    attribution_patching,
    call_and_reap,
    instrument,
    patching_sweep,
    plant,
    reap,
    sites,
)

pz = pytest.importorskip("penzai.pz")
pytest.importorskip("penzai.models.transformer.variants.llamalike_common")
sampling_mode = pytest.importorskip("penzai.models.transformer.sampling_mode")

from _penzai_models import tiny_llamalike  # noqa: E402  (it imports Penzai: after the skip)
from test_instrument_penzai import _get, edited  # noqa: E402  (the same hand edits, after the skip)

BLOCK = "body.sublayers.1"  # the first transformer block
ATTN = "body.sublayers.1.sublayers.0.delta.sublayers.1"  # its KVCachingAttention in sampling mode
CACHE = 8


@pytest.fixture(scope="module")
def model():
    return tiny_llamalike()


def sampler(model):
    """A fresh sampling-mode model (its own, empty cache) of `model`."""
    return sampling_mode.KVCachingTransformerLM.from_uncached(
        model, cache_len=CACHE, batch_axes={"batch": 1}
    )


def tokens(*ids):
    return pz.nx.wrap(jnp.array([ids], jnp.int32), "batch", "seq")


STEPS = (tokens(1, 2, 3), tokens(4), tokens(5))  # a prompt, then one token per call
by_penzai = pz.variable_jit(lambda m, t: m(t))  # Penzai's own jitted stateful call


def data(out):
    return out if isinstance(out, jax.Array) else out.unwrap(*out.named_shape)


def state(sampling_model):
    """The sampling model's state variables' values, as arrays in tree order."""
    frozen = pz.unbind_state_vars(sampling_model, freeze=True)[1]
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(frozen)]


def assert_same_state(a, b):
    sa, sb = state(a), state(b)
    assert len(sa) == len(sb) == 4  # the kv cache's keys and values, end index, previous tokens
    for x, y in zip(sa, sb):
        np.testing.assert_array_equal(x, y)


@pz.pytree_dataclass
class Shift(pz.nn.Layer):
    vector: jax.Array

    def __call__(self, x, **side_inputs):
        return x + pz.nx.wrap(self.vector, "embedding")


@pz.pytree_dataclass
class Const(pz.nn.Layer):
    value: pz.nx.NamedArray

    def __call__(self, x, **side_inputs):
        return self.value


@pz.pytree_dataclass
class Zeros(pz.nn.Layer):
    def __call__(self, x, **side_inputs):
        return jax.tree_util.tree_map(jnp.zeros_like, x)


@pz.pytree_dataclass
class Traced(pz.nn.Layer):
    """The identity, counting in TRACES each time JAX traces it."""

    def __call__(self, x, **side_inputs):
        TRACES.append(1)
        return x


TRACES: list = []


@pz.pytree_dataclass
class Double(pz.nn.Layer):
    def __call__(self, x, **side_inputs):
        return x * 2.0


def test_reap_through_a_cached_decode_matches_penzai_and_its_cache(model):
    ref, mine = sampler(model), sampler(model)
    m = instrument(mine)
    plain = instrument(model, names=BLOCK)
    blocks = []
    for step in STEPS:
        out, reaped = call_and_reap(m, tag="modules")(step)
        expected = by_penzai(ref, step)
        np.testing.assert_array_equal(data(out), data(expected))
        assert_same_state(mine, ref)  # the cache written back, as Penzai's own call leaves it
        blocks.append(reaped[BLOCK])
    assert int(mine.cache_end_index.value) == 5
    # The cached block outputs are the uncached model's on the whole sequence.
    whole = reap(plain, tag="modules")(tokens(1, 2, 3, 4, 5))[BLOCK]
    np.testing.assert_allclose(jnp.concatenate(blocks, 1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["constant", "callable", "add_vector"])
def test_plants_at_a_layer_during_the_decode_match_the_edited_model(model, how):
    vector = jnp.linspace(-1.0, 1.0, 8)
    layer, plants = {
        "constant": (Zeros(), lambda n: {ATTN: jnp.zeros((1, n, 8))}),
        "callable": (Double(), lambda n: {BLOCK: lambda old: old * 2.0}),
        "add_vector": (Shift(vector), lambda n: {BLOCK: add_vector(vector)}),
    }[how]
    where = ATTN if how == "constant" else BLOCK
    ref, mine = sampler(edited(model, where, layer)), sampler(model)
    m = instrument(mine)
    for step in STEPS:  # the prompt, then one token per call, each planted
        out = plant(m, tag="modules")(plants(step.named_shape["seq"]), step)
        np.testing.assert_allclose(data(out), data(by_penzai(ref, step)), rtol=1e-6, atol=1e-6)
        for x, y in zip(state(mine), state(ref)):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_attention_hooks_over_the_cache(model):
    """hook_k/v hold the new tokens' keys and values; hook_pattern runs over every
    position of the cache; planting the pattern equals the edited sampling model."""
    m = instrument(sampler(model), attention=True, names=ATTN + ".hook_*")
    reaped = reap(m, tag="modules")(STEPS[0])
    assert reaped[ATTN + ".hook_k"].shape == (1, 3, 2, 4)  # [batch, seq, heads, d_head]
    pattern = reaped[ATTN + ".hook_pattern"]
    assert pattern.shape == (1, 2, 3, CACHE)  # [batch, heads, q_pos, k_pos over the cache]
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.asarray(pattern)[..., 3:] == 0.0)  # 3 positions written: the rest masked
    value = jax.nn.softmax(jax.random.normal(jax.random.key(0), pattern.shape), axis=-1)
    fresh = instrument(sampler(model), attention=True, names=ATTN + ".hook_*")  # an empty cache
    out = plant(fresh, tag="modules")({ATTN + ".hook_pattern": value}, STEPS[0])
    hand = (
        pz.select(sampler(model))
        .at(lambda s: _get(s, (*ATTN.split("."), "query_key_to_attn")))
        .apply(
            lambda sub: pz.nn.Sequential(
                [sub, Const(pz.nx.wrap(value, "batch", "heads", "seq", "kv_seq"))]
            )
        )
    )
    np.testing.assert_allclose(data(out), data(by_penzai(hand, STEPS[0])), rtol=1e-5, atol=1e-5)


def greedy(logits):
    return pz.nx.nmap(jnp.argmax)(logits.untag("vocabulary"))[{"seq": -1}]


def test_steered_decode_loops_give_the_hand_steered_tokens(model):
    """Greedy decoding with a steering vector: a Python loop of harvest calls (compiled
    once, the cache written back each step, as Penzai's sampler loops) and a
    `lax.while_loop` under `jax.jit` (the state unbound and bound Penzai's way) give
    the tokens of the model with the vector added by hand."""
    vector = 3.0 * jnp.sin(jnp.arange(8.0))
    n = 4

    hand = sampler(edited(model, BLOCK, Shift(vector)))
    token, expected = greedy(by_penzai(hand, STEPS[0])), []
    for _ in range(n):
        expected.append(int(token.unwrap("batch")[0]))
        token = greedy(by_penzai(hand, token[{"seq": None}]))

    TRACES.clear()
    counted = pz.select(model).at(lambda m: m.body.sublayers).apply(lambda l: [*l, Traced()])
    mine = sampler(counted)
    steer = plant(instrument(mine), tag="modules")
    token, got = greedy(steer({BLOCK: add_vector(vector)}, STEPS[0])), []
    for _ in range(n):
        got.append(int(token.unwrap("batch")[0]))
        token = greedy(steer({BLOCK: add_vector(vector)}, token[{"seq": None}]))
    assert got == expected
    assert len(TRACES) == 2  # the prompt's shape, then one token's: each step compiled once
    assert int(mine.cache_end_index.value) == 3 + n

    unbound, frozen = pz.unbind_state_vars(sampler(model), freeze=True)

    @jax.jit
    def decode(frozen, vector):
        def call(frozen, t):
            live = [v.unfreeze_as_copy() for v in frozen]
            out = plant(instrument(pz.bind_variables(unbound, live)), tag="modules")(
                {BLOCK: add_vector(vector)}, t
            )
            return greedy(out), [v.freeze() for v in live]

        token, frozen = call(frozen, STEPS[0])

        def body(carry):
            i, token, frozen, out = carry
            out = out.at[i].set(token.unwrap("batch")[0])
            token, frozen = call(frozen, token[{"seq": None}])
            return i + 1, token, frozen, out

        carry = (0, token, frozen, jnp.zeros(n, jnp.int32))
        return jax.lax.while_loop(lambda c: c[0] < n, body, carry)[3]

    assert list(np.asarray(decode(frozen, vector))) == expected


def test_sites_leave_the_cache(model):
    mine = sampler(model)
    listed = {s.name: s for s in sites(instrument(mine), tag="modules")(STEPS[0])}
    assert listed[BLOCK].axes == ("batch", "seq", "embedding")
    ops = {s.name for s in sites(instrument(mine, ops=True), tag="modules")(STEPS[0])}
    assert SILU + "/silu/mul:0" in ops and BLOCK in ops
    assert int(mine.cache_end_index.value) == 0  # listing sites runs nothing


# The gate's activation (`pz.nn.Elementwise(jax.nn.silu)`) of the first block's MLP.
SILU = "body.sublayers.1.sublayers.1.delta.sublayers.1.sublayers.0.branches.0.sublayers.1"


def test_op_sites_through_a_cached_decode_match_penzai_and_a_hand_patched_op(model):
    """ops=True on the sampling model: the op trace carries the state in and out, so
    reaping leaves outputs and cache as Penzai's own call does, and doubling the
    activation's op at each step equals the model with that layer doubled by hand."""
    op = SILU + "/silu/mul:0"
    ref, mine = sampler(model), sampler(model)
    m = instrument(mine, ops=True, names=[op, BLOCK])
    hand, patched = sampler(edited(model, SILU, Double())), sampler(model)
    steer = plant(instrument(patched, ops=True, names=op), tag="modules")
    for step in STEPS:
        out, reaped = call_and_reap(m, tag="modules")(step)
        np.testing.assert_array_equal(data(out), data(by_penzai(ref, step)))
        assert_same_state(mine, ref)
        n = step.named_shape["seq"]
        assert reaped[op].shape == (1, n, 16)  # [batch, seq, neurons]
        assert reaped[BLOCK].shape == (1, n, 8)
        out = steer({op: lambda old: 2.0 * old}, step)
        np.testing.assert_allclose(data(out), data(by_penzai(hand, step)), rtol=1e-6, atol=1e-6)
        for x, y in zip(state(patched), state(hand)):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    assert int(mine.cache_end_index.value) == int(patched.cache_end_index.value) == 5


def test_patching_sweep_over_a_cached_prompt_leaves_the_cache(model):
    clean_prompt, corrupt_prompt = tokens(1, 2, 3), tokens(1, 7, 3)
    clean_out, clean = call_and_reap(instrument(sampler(model), names=BLOCK), tag="modules")(
        clean_prompt
    )
    fresh = sampler(model)
    metric = lambda out: data(out)[0, -1, 3]
    result = patching_sweep(
        instrument(fresh, names=BLOCK), clean, (corrupt_prompt,), metric, tag="modules", axis=1
    )
    assert_same_state(fresh, sampler(model))  # a sweep measures: the cache is left as it was
    # By hand: with one block, the last position's logits read only the block's output
    # there, so patching an earlier position changes nothing, and patching the last gives
    # the clean run's logits (the corrupted run by Penzai itself, on a fresh cache).
    by_hand = metric(clean_out) - metric(by_penzai(sampler(model), corrupt_prompt))
    assert result.names == (BLOCK,)
    np.testing.assert_allclose(result.values[0], [0.0, 0.0, by_hand], rtol=1e-5, atol=1e-6)


@pz.pytree_dataclass
class Offset(pz.nn.Layer):
    delta: pz.nx.NamedArray

    def __call__(self, x, **side_inputs):
        return x + self.delta


def test_attribution_over_a_cached_prompt_is_the_hand_taken_gradient(model):
    """attribution_patching on the sampling model: (clean - corrupted) times the
    gradient of the metric w.r.t. a zero offset after the block, taken by hand
    through a fresh sampling model with that offset layer (its own empty cache)."""
    clean_prompt, corrupt_prompt = tokens(1, 2, 3), tokens(1, 7, 3)
    clean = reap(instrument(sampler(model), names=BLOCK), tag="modules")(clean_prompt)
    corrupted = reap(instrument(sampler(model), names=BLOCK), tag="modules")(corrupt_prompt)
    metric = lambda out: data(out)[0, -1, 3]
    fresh = sampler(model)
    result = attribution_patching(
        instrument(fresh, names=BLOCK), clean, (corrupt_prompt,), metric, tag="modules", axis=1
    )
    assert_same_state(fresh, sampler(model))  # measured from the empty cache, left so

    def offset_metric(delta):
        offset = Offset(pz.nx.wrap(delta, "batch", "seq", "embedding"))
        return metric(sampler(edited(model, BLOCK, offset))(corrupt_prompt))

    grad = jax.jit(jax.grad(offset_metric))(jnp.zeros((1, 3, 8)))  # compiled: 8x faster than eager
    estimate = ((clean[BLOCK] - corrupted[BLOCK]) * grad).sum(-1)[0]
    assert np.abs(estimate).max() > 1e-3  # the positions differ: a test that can fail
    np.testing.assert_allclose(result.values[0], estimate, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(result.baseline, metric(by_penzai(sampler(model), corrupt_prompt)))
