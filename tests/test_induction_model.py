"""The trained model the activation-patching guide studies, and `path_patching` on it.

The shipped weights (docs/_static/induction.npz) must solve the task (every
number the guide prints from them is compared with the page by
tests/test_docs.py); the training script that wrote them must be deterministic;
and `path_patching` must equal the same path patched by hand: the model's
forward written out in NumPy from its weights, run twice with the sender,
the frozen sites and then the receivers substituted by hand.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import patch_head, patch_positions, path_patching, reap, sow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "_static" / "train_induction.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_induction", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ti = _script()


@pytest.mark.single_release  # the guide's model on JAX alone; the JAX matrix skips it
def test_the_shipped_weights_solve_the_task_and_are_small():
    assert SCRIPT.with_name("induction.npz").stat().st_size < 5 * 2**20
    params = ti.load()
    assert ti.accuracy(params, n=200) > 0.9


@pytest.mark.slow  # trains twice
@pytest.mark.single_release  # the guide's training script on JAX alone; the JAX matrix skips it
def test_training_is_deterministic():
    a, loss_a = ti.train(steps=2)
    b, loss_b = ti.train(steps=2)
    assert loss_a == loss_b
    for key, value in ti.to_arrays(a).items():
        np.testing.assert_array_equal(value, ti.to_arrays(b)[key])
    assert sorted(ti.to_arrays(a)) == sorted(np.load(SCRIPT.with_name("induction.npz")).files)


# ---------------------------------------------------------------------------
# Path patching against two passes written by hand.


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def hand_forward(params, tokens, swap=None, record=None):
    """The model's forward in NumPy; `swap(name, value)` replaces a value by
    name ("embed", "z0", "k1", ...), and `record` collects every one."""
    swap = swap or (lambda name, value: value)
    record = {} if record is None else record
    p = jax.tree_util.tree_map(np.asarray, params)

    def site(name, value):
        record[name] = value = swap(name, value)
        return value

    x = site("embed", p["embed"][np.asarray(tokens)] + p["pos"])
    causal = np.tril(np.ones((ti.SEQ, ti.SEQ), bool))
    for i, w in enumerate(p["layers"]):
        q, k, v = (site(f"{n}{i}", np.einsum("btd,hde->bthe", x, w[n])) for n in "qkv")
        scores = np.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(ti.HEAD_WIDTH)
        pattern = softmax(np.where(causal, scores, -1e9))
        z = site(f"z{i}", np.einsum("bhqk,bkhe->bqhe", pattern, v))
        x = x + np.einsum("bqhe,hed->bqd", z, w["o"])
    return x @ p["unembed"]


@pytest.fixture(scope="module")
def prompts():
    pos = jnp.arange(ti.SEQ)
    repeat = jnp.where((pos >= 10) & (pos < 18), pos - 8, pos)
    clean = jax.random.randint(jax.random.key(0), (4, ti.SEQ), 0, ti.VOCAB)[:, repeat]
    return ti.load(), clean, clean.at[:, 6].add(1) % ti.VOCAB


def two_passes_by_hand(params, corrupted, sender, receiver, frozen=()):
    unpatched = {}
    hand_forward(params, corrupted, record=unpatched)
    first = {}

    def pass_one(name, value):
        if name in sender:
            return sender[name](value)
        return unpatched[name] if name in frozen else value

    hand_forward(params, corrupted, pass_one, first)
    return hand_forward(params, corrupted, lambda n, v: first[n] if n == receiver else v)


def test_path_patching_equals_two_passes_by_hand(prompts):
    params, clean_tokens, corrupt_tokens = prompts
    run = lambda tokens: ti.transformer(params, tokens)
    clean = reap(run)(clean_tokens)
    clean_by_hand = {}
    hand_forward(params, clean_tokens, record=clean_by_hand)
    np.testing.assert_allclose(clean["blocks0"]["z"], clean_by_hand["z0"], rtol=1e-4, atol=1e-5)

    # The previous-token head's clean output, along the path to layer 1's keys.
    head = lambda z: np.where(np.arange(ti.HEADS)[:, None] == 1, clean_by_hand["z0"], z)
    got = path_patching(
        run,
        {"blocks0.z": patch_head(clean["blocks0"]["z"], 1, axis=2)},
        "blocks1.k",
        (corrupt_tokens,),
    )
    want = two_passes_by_hand(params, corrupt_tokens, {"z0": head}, "k1")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # It is not the head's whole effect: through the values alone it is another number.
    through_v = path_patching(
        run,
        {"blocks0.z": patch_head(clean["blocks0"]["z"], 1, axis=2)},
        "blocks1.v",
        (corrupt_tokens,),
    )
    np.testing.assert_allclose(
        through_v,
        two_passes_by_hand(params, corrupt_tokens, {"z0": head}, "v1"),
        rtol=1e-4,
        atol=1e-4,
    )
    assert np.abs(np.asarray(got) - np.asarray(through_v)).max() > 1.0

    # The embedding at position 6, to layer 1's keys, with layer 0's heads frozen.
    token = lambda e: np.where(np.arange(ti.SEQ)[:, None] == 6, clean_by_hand["embed"], e)
    got = path_patching(
        run,
        {"embed": patch_positions(clean["embed"], [6], axis=1)},
        "blocks1.k",
        (corrupt_tokens,),
        freeze=["blocks0.z", "blocks1.z"],  # blocks1.z is downstream: freezing it changes nothing
    )
    want = two_passes_by_hand(params, corrupt_tokens, {"embed": token}, "k1", frozen={"z0"})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    unfrozen = two_passes_by_hand(params, corrupt_tokens, {"embed": token}, "k1")
    assert np.abs(want - unfrozen).max() > 1.0  # freezing cut a path that matters


def test_path_patching_compiles_once_and_runs_under_jit():
    traces = []  # a list, keyed by identity: a dict or number f changes would re-trace it

    def f(x):
        traces.append(None)
        a = sow(x * 2.0, name="a", mode="strict")
        b = sow(a + 1.0, name="b", mode="strict")
        return sow(a * b, name="c", mode="strict") + b

    # Pass 1: a=5, b frozen at 2x+1, c = 5 * b; pass 2 plants c into the unpatched run.
    for x in (1.0, 2.0, 3.0):
        out = path_patching(f, {"a": 5.0}, "c", (jnp.float32(x),), freeze="b")
        assert float(out) == 5.0 * (2 * x + 1) + (2 * x + 1)
    assert len(traces) == 3  # three walks (freeze, pass 1, pass 2), each traced once
    path_patching(f, {"a": 5.0}, "c", (jnp.float32(4.0),), freeze="b")
    assert len(traces) == 3
    jitted = jax.jit(lambda x, s: path_patching(f, {"a": s}, "c", (x,), freeze="b"))
    assert float(jitted(jnp.float32(1.0), jnp.float32(5.0))) == 18.0


def test_path_patching_errors():
    f = lambda x: sow(sow(x, name="a", mode="strict") + 1.0, name="b", mode="strict")
    with pytest.raises(TypeError, match="non-empty dict"):
        path_patching(f, ["a"], "b", (1.0,))
    with pytest.raises(TypeError, match=r"tuple.*\(x,\)"):
        path_patching(f, {"a": 1.0}, "b", 1.0)
    with pytest.raises(ValueError, match="needs `receivers`"):
        path_patching(f, {"a": 1.0}, None, (1.0,))
    with pytest.raises(ValueError, match="also selected by `receivers`"):
        path_patching(f, {"a": 1.0}, "*", (1.0,))
    with pytest.raises(ValueError, match="'nope'"):
        path_patching(f, {"a": 1.0}, "nope", (1.0,))


# ---------------------------------------------------------------------------
# The same model as an NNX and an Equinox module, read with TransformerLens's names.


def tl_by_hand(params, tokens):
    """Every TransformerLens hook of the attention-only model, from its weights in NumPy."""
    p = jax.tree_util.tree_map(np.asarray, params)
    tokens = np.asarray(tokens)
    cache = {"hook_embed": p["embed"][tokens], "hook_pos_embed": p["pos"]}
    x = cache["hook_embed"] + p["pos"]
    causal = np.tril(np.ones((ti.SEQ, ti.SEQ), bool))
    for i, w in enumerate(p["layers"]):
        n = f"blocks.{i}"
        cache[f"{n}.hook_resid_pre"] = x
        for h in "qkv":
            cache[f"{n}.attn.hook_{h}"] = np.einsum("btd,hde->bthe", x, w[h])
        q, k, v = (cache[f"{n}.attn.hook_{h}"] for h in "qkv")
        scores = np.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(ti.HEAD_WIDTH)
        cache[f"{n}.attn.hook_attn_scores"] = scores  # compared where causal only
        pattern = cache[f"{n}.attn.hook_pattern"] = softmax(np.where(causal, scores, -1e9))
        z = cache[f"{n}.attn.hook_z"] = np.einsum("bhqk,bkhe->bqhe", pattern, v)
        attn_out = cache[f"{n}.hook_attn_out"] = np.einsum("bqhe,hed->bqd", z, w["o"])
        x = cache[f"{n}.hook_resid_post"] = x + attn_out
    return x @ p["unembed"], cache


def nnx_induction(params):
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):  # TransformerLens's attn_only block: no MLP, no norm
        def __init__(self, w):
            self.attn = nnx.MultiHeadAttention(
                ti.HEADS, ti.WIDTH, use_bias=False, decode=False, rngs=nnx.Rngs(0)
            )
            for name, h in (("query", "q"), ("key", "k"), ("value", "v")):
                getattr(self.attn, name).kernel[...] = jnp.transpose(w[h], (1, 0, 2))
            self.attn.out.kernel[...] = w["o"]

        def __call__(self, x, mask):  # two arguments: blocks.0:in would be a tuple
            return x + self.attn(x, mask=mask)

    class Induction(nnx.Module):
        def __init__(self, params):
            self.embed = nnx.Embed(ti.VOCAB, ti.WIDTH, rngs=nnx.Rngs(0))
            self.embed.embedding[...] = params["embed"]
            self.pos_embed = nnx.Embed(ti.SEQ, ti.WIDTH, rngs=nnx.Rngs(0))
            self.pos_embed.embedding[...] = params["pos"]
            self.blocks = nnx.List([Block(w) for w in params["layers"]])
            self.unembed = nnx.Linear(ti.WIDTH, ti.VOCAB, use_bias=False, rngs=nnx.Rngs(0))
            self.unembed.kernel[...] = params["unembed"]

        def __call__(self, tokens):
            x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
            mask = jnp.tril(jnp.ones((ti.SEQ, ti.SEQ), bool))
            for block in self.blocks:
                x = block(x, mask)
            return self.unembed(x)

    return Induction(params)


def equinox_induction(params):
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        attn: eqx.nn.MultiheadAttention

        def __call__(self, x, mask):  # one sequence, as Equinox's modules are written
            return x + self.attn(x, x, x, mask=mask)

    def block(w):
        attn = eqx.nn.MultiheadAttention(ti.HEADS, ti.WIDTH, key=jax.random.key(0))
        merged = lambda a: jnp.transpose(a, (0, 2, 1)).reshape(ti.WIDTH, ti.WIDTH)  # [h e, d]
        attn = eqx.tree_at(
            lambda a: (a.query_proj.weight, a.key_proj.weight, a.value_proj.weight),
            attn,
            tuple(merged(w[h]) for h in "qkv"),
        )
        out = w["o"].reshape(ti.WIDTH, ti.WIDTH).T
        return Block(eqx.tree_at(lambda a: a.output_proj.weight, attn, out))

    class Induction(eqx.Module):
        embed: eqx.nn.Embedding
        pos_embed: eqx.nn.Embedding
        blocks: list
        unembed: eqx.nn.Linear

        def __call__(self, tokens):  # [batch, seq]: each sequence on its own
            return jax.vmap(self.one)(tokens)

        def one(self, tokens):
            x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos_embed)(jnp.arange(ti.SEQ))
            mask = jnp.tril(jnp.ones((ti.SEQ, ti.SEQ), bool))
            for b in self.blocks:
                x = b(x, mask)
            return jax.vmap(self.unembed)(x)

    unembed = eqx.nn.Linear(ti.WIDTH, ti.VOCAB, use_bias=False, key=jax.random.key(0))
    return Induction(
        eqx.nn.Embedding(weight=params["embed"]),
        eqx.nn.Embedding(weight=params["pos"]),
        [block(w) for w in params["layers"]],
        eqx.tree_at(lambda u: u.weight, unembed, params["unembed"].T),
    )


BUILDERS = {"nnx": nnx_induction, "equinox": equinox_induction}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_transformer_lens_names_on_the_attention_only_model_equal_the_hand_computation(
    prompts, kind
):
    from harvest import instrument

    params, clean_tokens, _ = prompts
    model = BUILDERS[kind](params)
    logits, by_hand = tl_by_hand(params, clean_tokens)
    np.testing.assert_allclose(model(clean_tokens), logits, rtol=1e-4, atol=1e-4)
    tl = instrument(model, naming="transformer_lens", attention=True)
    cache = reap(tl, tag="modules")(clean_tokens)
    assert set(cache) == set(by_hand)  # TransformerLens's names only, every one of them
    causal = np.tril(np.ones((ti.SEQ, ti.SEQ), bool))
    for name, want in by_hand.items():
        got = np.asarray(cache[name])
        if name.endswith("hook_attn_scores"):  # masked entries: each library's large negative
            assert (got[..., ~causal] < -1e30).all(), name
            got, want = got[..., causal], want[..., causal]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_ablation_sweep_on_the_attention_only_model_equals_ablating_each_head_by_hand(
    prompts, kind
):
    from harvest import ablation_sweep, instrument

    params, clean_tokens, _ = prompts
    tl = instrument(BUILDERS[kind](params), naming="transformer_lens", attention=True)
    # The induction metric: the log-probability of the repeated tokens, in the repeat.
    nll = lambda logits: (
        -jnp.mean(
            jnp.take_along_axis(
                jax.nn.log_softmax(logits[:, 10:17]), clean_tokens[:, 11:18, None], -1
            )
        )
    )
    _, cache = tl_by_hand(params, clean_tokens)
    for how in ("zero", "mean"):
        swept = ablation_sweep(
            tl, (clean_tokens,), nll, how, tag="modules", names="blocks.*.attn.hook_z", axis=2
        )
        assert swept.names == ("blocks.0.attn.hook_z", "blocks.1.attn.hook_z")
        assert swept.axis_labels == ("head",)
        base = np.asarray(nll(hand_forward(params, clean_tokens)))
        np.testing.assert_allclose(swept.baseline, base, rtol=1e-5, atol=1e-5)
        for layer in range(ti.LAYERS):
            for head in range(ti.HEADS):
                z = cache[f"blocks.{layer}.attn.hook_z"]
                fill = 0.0 if how == "zero" else z.mean(0, keepdims=True)
                ablated = lambda name, value, layer=layer, head=head, fill=fill: (
                    np.where(np.arange(ti.HEADS)[:, None] == head, fill, value)
                    if name == f"z{layer}"
                    else value
                )
                want = nll(hand_forward(params, clean_tokens, ablated)) - base
                np.testing.assert_allclose(
                    swept.values[layer, head], want, rtol=1e-4, atol=1e-4, err_msg=(how, layer)
                )
    # The circuit: every head raises the loss when ablated; the previous-token head (layer
    # 0, head 1, the one the path patching above follows) most, as both induction heads
    # of layer 1 read it (each alone is partly redundant with the other).
    zero = ablation_sweep(tl, (clean_tokens,), nll, tag="modules", names="*hook_z", axis=2)
    assert (zero.values > 0.1).all()
    assert np.unravel_index(np.argmax(zero.values), zero.values.shape) == (0, 1)
    assert zero.values[0, 1] > 1.0


def test_ablation_sweep_traces_the_model_as_often_for_every_head_as_for_one_layer(prompts):
    from harvest import ablation_sweep

    params, clean_tokens, corrupt_tokens = prompts
    traces = []

    def counted(tokens):
        traces.append(None)
        return ti.transformer(params, tokens)

    metric = lambda logits: logits[:, -1].mean()
    ablation_sweep(counted, (clean_tokens,), metric, names="blocks0.q", axis=2)  # finds sites
    counts = []
    for names in ("blocks0.z", "blocks*.z"):  # 2 heads, then 4
        before = len(traces)
        ablation_sweep(counted, (clean_tokens,), metric, names=names, axis=2)
        counts.append(len(traces) - before)
    assert counts[0] == counts[1]  # one program for every (layer, head), not one per head
    before = len(traces)
    again = ablation_sweep(counted, (corrupt_tokens,), metric, names="blocks*.z", axis=2)
    assert len(traces) == before  # new data of the same shapes only runs
    assert again.values.shape == (2, ti.HEADS)
