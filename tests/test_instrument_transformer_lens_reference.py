"""instrument(naming="transformer_lens") against TransformerLens itself, hook by hook.

Models from a real checkpoint's code path, with random weights (no download):
a GPT-2 built by Hugging Face `transformers` from a config, ported to Flax NNX here
(GPT-2's own block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`); a Llama and a
GPT-NeoX built the same way, converted by Penzai's own `*_from_huggingface_model`;
and DeepMind's `gemma` library's `Transformer` as Gemma 1, 2 and 3, its params loaded
into Hugging Face's Gemma of that version for TransformerLens to convert. TransformerLens
(2.18) gets the same weights through its own weight conversion into a
`HookedTransformer` (its weights not processed, so its hooks hold the checkpoint's
values). Every hook both give is equal to 1e-4, relative to the hook's scale.

Needs torch, transformers and transformer-lens, which the suite does not install:
`make transformer-lens` adds them to the venv (the gemma tests need `gemma` too, which
the Makefile's venv has). Where they do not import, the tests are skipped, saying which.
"""

import numpy as np
import pytest

from harvest import call_and_reap, instrument

torch = pytest.importorskip("torch", reason="torch is not installed (make transformer-lens)")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (make transformer-lens)"
)
transformer_lens = pytest.importorskip(
    "transformer_lens", reason="transformer-lens is not installed (make transformer-lens)"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

D, HEADS, LAYERS, VOCAB, CTX, D_MLP = 16, 2, 2, 50, 16, 32
TOKENS = np.array([[3, 17, 5, 42, 9, 3, 17, 5, 8, 1], [7, 7, 2, 30, 11, 4, 0, 25, 13, 6]])


def tl_cache(cfg, state_dict, tokens=TOKENS):
    """TransformerLens's `run_with_cache` on `tokens`, its weights `state_dict` loaded
    as they are (no folding or centring): {hook name: NumPy array}."""
    from transformer_lens import HookedTransformer

    model = HookedTransformer(cfg)
    model.load_state_dict(state_dict, strict=False)
    model.eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor(tokens))
    return {k: v.numpy() for k, v in cache.items()}


def assert_hooks_equal(ours, theirs, expected):
    """Every hook in `ours` is one of `theirs`' and equal to 1e-4 relative to its scale;
    `expected` (the names the model must give) are all there."""
    assert set(expected) <= set(ours), sorted(set(expected) - set(ours))
    assert set(ours) <= set(theirs), sorted(set(ours) - set(theirs))
    for name, value in ours.items():
        got, want = np.asarray(value, np.float64), theirs[name].astype(np.float64)
        got = np.broadcast_to(got, want.shape)  # hook_pos_embed: [pos, d_model] here
        if name.endswith("hook_attn_scores"):  # masked entries: -inf there, large here
            causal = np.tril(np.ones(want.shape[-2:], bool))
            assert (got[..., ~causal] < -1e30).all() and np.isneginf(want[..., ~causal]).all()
            got, want = got[..., causal], want[..., causal]
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale, err_msg=name)


def block_names(mlp_hooks):
    attn = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")
    stream = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out")
    return [
        name
        for i in range(LAYERS)
        for name in (
            *(f"blocks.{i}.{h}" for h in (*stream, "hook_resid_post")),
            *(f"blocks.{i}.attn.{h}" for h in attn),
            *(f"blocks.{i}.mlp.{h}" for h in mlp_hooks),
        )
    ]


# ---------------------------------------------------------------------------
# GPT-2: Hugging Face's model, ported to Flax NNX from its weights.


def gpt2_nnx(hf):
    """GPT-2 as an NNX module, its weights those of the Hugging Face model `hf`."""
    from flax import nnx

    sd = {k: jnp.asarray(v.detach().numpy()) for k, v in hf.state_dict().items()}
    rngs = nnx.Rngs(0)
    dh = D // HEADS

    def param(module, name, value):
        getattr(module, name)[...] = value

    class MLP(nnx.Module):
        def __init__(self, i):
            self.c_fc, self.c_proj = (
                nnx.Linear(D, D_MLP, rngs=rngs),
                nnx.Linear(D_MLP, D, rngs=rngs),
            )
            for name in ("c_fc", "c_proj"):
                param(getattr(self, name), "kernel", sd[f"transformer.h.{i}.mlp.{name}.weight"])
                param(getattr(self, name), "bias", sd[f"transformer.h.{i}.mlp.{name}.bias"])

        def __call__(self, x):
            return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))  # gelu_new

    class Block(nnx.Module):
        def __init__(self, i):
            p = f"transformer.h.{i}"
            self.ln_1 = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
            self.ln_2 = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
            self.mlp = MLP(i)
            for ln in ("ln_1", "ln_2"):
                param(getattr(self, ln), "scale", sd[f"{p}.{ln}.weight"])
                param(getattr(self, ln), "bias", sd[f"{p}.{ln}.bias"])
            w, b = sd[f"{p}.attn.c_attn.weight"], sd[f"{p}.attn.c_attn.bias"]  # [D, 3D]
            for j, name in enumerate(("query", "key", "value")):
                part = getattr(self.attn, name)
                param(part, "kernel", w[:, j * D : (j + 1) * D].reshape(D, HEADS, dh))
                param(part, "bias", b[j * D : (j + 1) * D].reshape(HEADS, dh))
            param(self.attn.out, "kernel", sd[f"{p}.attn.c_proj.weight"].reshape(HEADS, dh, D))
            param(self.attn.out, "bias", sd[f"{p}.attn.c_proj.bias"])

        def __call__(self, x, mask):
            x = x + self.attn(self.ln_1(x), mask=mask)
            return x + self.mlp(self.ln_2(x))

    class GPT2(nnx.Module):
        def __init__(self):
            self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
            self.wpe = nnx.Embed(CTX, D, rngs=rngs)
            param(self.wte, "embedding", sd["transformer.wte.weight"])
            param(self.wpe, "embedding", sd["transformer.wpe.weight"])
            self.h = nnx.List([Block(i) for i in range(LAYERS)])
            self.ln_f = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
            param(self.ln_f, "scale", sd["transformer.ln_f.weight"])
            param(self.ln_f, "bias", sd["transformer.ln_f.bias"])

        def __call__(self, tokens):
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1]))
            mask = nnx.make_causal_mask(tokens)
            for block in self.h:
                x = block(x, mask)
            return self.wte.attend(self.ln_f(x))  # tied unembedding

    return GPT2()


def test_gpt2_in_nnx_gives_transformer_lens_s_hooks():
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=CTX,
        n_embd=D,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=D_MLP,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    cfg = HookedTransformerConfig(
        d_model=D,
        d_head=D // HEADS,
        n_heads=HEADS,
        d_mlp=D_MLP,
        n_layers=LAYERS,
        n_ctx=CTX,
        d_vocab=VOCAB,
        act_fn="gelu_new",
        normalization_type="LN",
        original_architecture="GPT2LMHeadModel",
        eps=1e-5,
    )
    theirs = tl_cache(cfg, convert_gpt2_weights(hf, cfg))
    model = gpt2_nnx(hf)
    with torch.no_grad():
        hf_logits = hf(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(model(jnp.asarray(TOKENS)), hf_logits, rtol=1e-4, atol=1e-4)
    tl = instrument(model, naming="transformer_lens", attention=True)
    _, ours = call_and_reap(tl, tag="modules")(jnp.asarray(TOKENS))
    expected = ["hook_embed", "hook_pos_embed", *block_names(("hook_pre", "hook_post"))]
    assert_hooks_equal(ours, theirs, expected)


# ---------------------------------------------------------------------------
# Llama: Hugging Face's model, converted by Penzai.


def test_llama_in_penzai_gives_transformer_lens_s_hooks():
    pytest.importorskip("penzai.models.transformer.variants.llama")
    from penzai import pz
    from penzai.models.transformer.variants import llama
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=D_MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=CTX,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    if not hasattr(config, "rope_theta"):  # transformers 5 keeps it in rope_parameters
        config.rope_theta = config.rope_parameters["rope_theta"]  # where Penzai reads it
    cfg = HookedTransformerConfig(
        d_model=D,
        d_head=D // HEADS,
        n_heads=HEADS,
        d_mlp=D_MLP,
        n_layers=LAYERS,
        n_ctx=CTX,
        d_vocab=VOCAB,
        act_fn="silu",
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_dim=D // HEADS,
        rotary_adjacent_pairs=False,
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
        eps=1e-5,
    )
    theirs = tl_cache(cfg, convert_llama_weights(hf, cfg))
    model = llama.llama_from_huggingface_model(hf)
    tokens = pz.nx.wrap(jnp.asarray(TOKENS), "batch", "seq")
    with torch.no_grad():
        hf_logits = hf(torch.tensor(TOKENS)).logits.numpy()
    logits = model(tokens)
    axes = ("batch", "seq", "vocabulary")
    np.testing.assert_allclose(logits.order_as(*axes).unwrap(*axes), hf_logits, atol=1e-4)
    tl = instrument(model, naming="transformer_lens", attention=True)
    _, ours = call_and_reap(tl, tag="modules")(tokens)
    expected = ["hook_embed", *block_names(("hook_pre", "hook_pre_linear", "hook_post"))]
    assert_hooks_equal(ours, theirs, expected)


# ---------------------------------------------------------------------------
# GPT-NeoX (parallel blocks): Hugging Face's model, converted by Penzai.


def test_gpt_neox_in_penzai_gives_transformer_lens_s_hooks():
    pytest.importorskip("penzai.models.transformer.variants.gpt_neox")
    from penzai import pz
    from penzai.models.transformer.variants import gpt_neox
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_neox_weights

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=D_MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=CTX,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = transformers.GPTNeoXForCausalLM(config).eval()
    rope = getattr(config, "rope_parameters", None) or {}
    for name, key in (("rotary_emb_base", "rope_theta"), ("rotary_pct", "partial_rotary_factor")):
        if not hasattr(config, name):  # transformers 5 keeps them in rope_parameters
            setattr(config, name, rope[key])  # where Penzai reads them
    d_head = D // HEADS
    cfg = HookedTransformerConfig(
        d_model=D,
        d_head=d_head,
        n_heads=HEADS,
        d_mlp=D_MLP,
        n_layers=LAYERS,
        n_ctx=CTX,
        d_vocab=VOCAB,
        act_fn="gelu",
        normalization_type="LN",
        positional_embedding_type="rotary",
        rotary_dim=int(config.rotary_pct * d_head),
        rotary_base=int(config.rotary_emb_base),
        rotary_adjacent_pairs=False,
        parallel_attn_mlp=True,
        original_architecture="GPTNeoXForCausalLM",
        eps=config.layer_norm_eps,
    )
    if not hasattr(hf, "embed_out"):  # transformers 5 renamed it lm_head; TransformerLens
        hf.__dict__["embed_out"] = hf.lm_head  # 2.18 and Penzai read it by its old name
        weights = hf.state_dict
        hf.state_dict = lambda: {**weights(), "embed_out.weight": hf.lm_head.weight.detach()}
    theirs = tl_cache(cfg, convert_neox_weights(hf, cfg))
    model = gpt_neox.gpt_neox_from_huggingface_model(hf)
    tokens = pz.nx.wrap(jnp.asarray(TOKENS), "batch", "seq")
    tl = instrument(model, naming="transformer_lens", attention=True)
    _, ours = call_and_reap(tl, tag="modules")(tokens)
    expected = [
        n for n in ["hook_embed", *block_names(("hook_pre", "hook_post"))] if "resid_mid" not in n
    ]
    assert_hooks_equal(ours, theirs, expected)


# ---------------------------------------------------------------------------
# Gemma 1, 2 and 3: DeepMind's `gemma` library (Linen); TransformerLens's conversion
# reads its weights from Hugging Face's Gemma model of that version, loaded with them.

GEMMA_TOKENS = np.where(TOKENS == 0, 10, TOKENS)  # gemma masks out its padding id, 0
WINDOW = 4  # the local layers' sliding window, shorter than the tokens


def gemma_model(version):
    """A tiny gemma `Transformer` of `version` (1, 2 or 3), from gemma's own config class,
    each with its version's features, and its params: gemma's init, every leaf then redrawn
    from N(0, 0.3²) (its init's zero norm scales and 0.01 weights make every pattern
    uniform and every norm the identity: a wrong mapping could hide)."""
    from benchmarks.bench_models import import_gemma

    try:
        gm, _config, _modules = import_gemma()
    except ImportError as error:
        pytest.skip(f"the gemma library does not import here: {error}")
    local, full = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL
    by_width = _config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
    sizes = dict(num_embed=VOCAB, embed_dim=D, hidden_dim=D_MLP, head_dim=8)
    if version == 1:  # one qkv einsum (7B's), no post-norms, every layer global
        config = _config.TransformerConfig(
            **sizes,
            num_heads=2,
            num_kv_heads=2,
            final_logit_softcap=None,
            use_post_attn_norm=False,
            use_post_ffw_norm=False,
            attention_types=(full, full),
        )
    elif version == 2:  # grouped keys and values; post-norms, sliding windows, soft caps
        config = _config.TransformerConfig(  # (small enough to bite); 27B's query scale
            **sizes,
            num_heads=4,
            num_kv_heads=2,
            final_logit_softcap=5.0,
            attn_logits_soft_cap=2.0,
            use_post_attn_norm=True,
            use_post_ffw_norm=True,
            attention_types=(local, full),
            sliding_window_size=WINDOW,
            query_pre_attn_norm=by_width,  # (embed_dim / num_heads) ** -0.5, not head_dim's
        )
    else:  # one key-value head (1B's), query-key norms, a RoPE base per kind of layer
        config = _config.TransformerConfig(
            **sizes,
            num_heads=4,
            num_kv_heads=1,
            final_logit_softcap=None,
            use_post_attn_norm=True,
            use_post_ffw_norm=True,
            attention_types=(local, full),
            sliding_window_size=WINDOW,
            use_qk_norm=True,
            local_base_frequency=10_000,
            global_base_frequency=1_000_000,
        )
    model = gm.nn.Transformer(config=config, dtype=jnp.float32)
    params = model.init(jax.random.key(0), jnp.asarray(GEMMA_TOKENS))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    redrawn = [0.3 * jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves)]
    return model, jax.tree.unflatten(tree, redrawn)


def gemma_in_hugging_face(version, config, params):
    """Hugging Face's Gemma of `version` for gemma's `config`, holding `params` (gemma's
    names and layouts mapped to Hugging Face's by hand)."""
    local = type(config.attention_types[0]).LOCAL_SLIDING
    rope = {"rope_type": "default"}
    shared = dict(
        vocab_size=config.num_embed,
        hidden_size=config.embed_dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=CTX,
    )
    later = dict(  # Gemma 2 and 3: queries scaled by query_pre_attn_scalar ** -0.5
        query_pre_attn_scalar=round(config.query_pre_attn_scalar() ** -2),
        sliding_window=config.sliding_window_size,
        layer_types=[
            "sliding_attention" if t == local else "full_attention" for t in config.attention_types
        ],
        final_logit_softcapping=config.final_logit_softcap,
        attn_logit_softcapping=config.attn_logits_soft_cap,
    )
    if version == 1:
        hf_config = transformers.GemmaConfig(
            **shared, rope_parameters={**rope, "rope_theta": config.global_base_frequency}
        )
        hf_class = transformers.GemmaForCausalLM
    elif version == 2:
        hf_config = transformers.Gemma2Config(
            **shared,
            **later,
            rope_parameters={**rope, "rope_theta": config.global_base_frequency},
        )
        hf_class = transformers.Gemma2ForCausalLM
    else:
        hf_config = transformers.Gemma3TextConfig(
            **shared,
            **later,
            rope_parameters={
                "sliding_attention": {**rope, "rope_theta": config.local_base_frequency},
                "full_attention": {**rope, "rope_theta": config.global_base_frequency},
            },
        )
        hf_class = transformers.Gemma3ForCausalLM
    hf_config._attn_implementation = "eager"  # soft-capped scores
    w = params["params"]
    sd = {"model.embed_tokens.weight": w["embedder"]["input_embedding"]}
    sd["model.norm.weight"] = w["final_norm"]["scale"]  # both scale by (1 + w)
    norms = {"input_layernorm": "pre_attention_norm"}
    if version == 1:  # Gemma 1's post_attention_layernorm is the MLP's input norm
        norms["post_attention_layernorm"] = "pre_ffw_norm"
    else:
        norms["post_attention_layernorm"] = "post_attention_norm"
        norms["pre_feedforward_layernorm"] = "pre_ffw_norm"
        norms["post_feedforward_layernorm"] = "post_ffw_norm"
    for i in range(config.num_layers):
        layer, hf = w[f"layer_{i}"], f"model.layers.{i}"
        attn = layer["attn"]
        if "qkv_einsum" in attn:  # [3, N, D, H]
            q, k, v = attn["qkv_einsum"]["w"]
        else:  # [N, D, H] and [2, K, D, H]
            q, (k, v) = attn["q_einsum"]["w"], attn["kv_einsum"]["w"]
        for name, x in (("q", q), ("k", k), ("v", v)):  # [N, D, H] -> [(N H), D]
            sd[f"{hf}.self_attn.{name}_proj.weight"] = x.transpose(0, 2, 1).reshape(-1, D)
        sd[f"{hf}.self_attn.o_proj.weight"] = attn["attn_vec_einsum"]["w"].reshape(-1, D).T
        if config.use_qk_norm:
            sd[f"{hf}.self_attn.q_norm.weight"] = attn["_query_norm"]["scale"]
            sd[f"{hf}.self_attn.k_norm.weight"] = attn["_key_norm"]["scale"]
        gate, up = layer["mlp"]["gating_einsum"]  # [D, F] each: gelu's input, the other
        sd[f"{hf}.mlp.gate_proj.weight"], sd[f"{hf}.mlp.up_proj.weight"] = gate.T, up.T
        sd[f"{hf}.mlp.down_proj.weight"] = layer["mlp"]["linear"].T
        for theirs, ours in norms.items():
            sd[f"{hf}.{theirs}.weight"] = layer[ours]["scale"]
    hf_model = hf_class(hf_config).eval()
    state = {k: torch.tensor(np.array(v)) for k, v in sd.items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    hf_model.tie_weights()  # the unembedding is the embedding, in both
    return hf_model


@pytest.mark.parametrize("version", [1, 2, 3])
def test_gemma_gives_transformer_lens_s_hooks(version):
    """gemma 3.3.0's `Transformer` as Gemma 1, 2 and 3. TransformerLens 2.18 represents
    each of these; not Gemma 3's linear RoPE scaling (4B to 27B: `global_scale_factor=8`),
    which it lacks, so the tiny Gemma 3 has the 270M and 1B's (none)."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gemma_weights

    model, params = gemma_model(version)
    config = model.config
    hf = gemma_in_hugging_face(version, config, params)
    logits = model.apply(params, jnp.asarray(GEMMA_TOKENS)).logits
    with torch.no_grad():
        hf_logits = hf(torch.tensor(GEMMA_TOKENS)).logits.numpy()
    scale = np.abs(hf_logits).max()
    np.testing.assert_allclose(logits, hf_logits, rtol=0, atol=1e-4 * scale)
    kinds = ["local" if t.name == "LOCAL_SLIDING" else "global" for t in config.attention_types]
    cfg = HookedTransformerConfig(
        d_model=D,
        d_head=config.head_dim,
        n_heads=config.num_heads,
        n_key_value_heads=config.num_kv_heads,
        d_mlp=D_MLP,
        n_layers=LAYERS,
        n_ctx=CTX,
        d_vocab=VOCAB,
        act_fn="gelu_pytorch_tanh",  # Flax's nn.gelu: the tanh approximation
        normalization_type="RMS",
        final_rms=True,
        gated_mlp=True,
        positional_embedding_type="rotary",
        rotary_dim=config.head_dim,
        rotary_adjacent_pairs=False,  # gemma rotates the halves' pairs
        rotary_base=config.global_base_frequency,
        rotary_base_local=config.local_base_frequency if version == 3 else None,
        attn_scale=1 / config.query_pre_attn_scalar(),  # scores divided by it
        use_normalization_before_and_after=version > 1,
        use_qk_norm=config.use_qk_norm,
        use_local_attn="local" in kinds,
        window_size=config.sliding_window_size,
        attn_types=kinds,
        attn_scores_soft_cap=config.attn_logits_soft_cap or -1.0,
        output_logits_soft_cap=config.final_logit_softcap or -1.0,
        original_architecture=type(hf).__name__,
        eps=1e-6,
    )
    theirs = tl_cache(cfg, convert_gemma_weights(hf, cfg), GEMMA_TOKENS)
    tl = instrument(
        lambda p, t: model.apply(p, t).logits, naming="transformer_lens", attention=True
    )
    _, ours = call_and_reap(tl, tag="modules")(params, jnp.asarray(GEMMA_TOKENS))
    # Not given on gemma: hook_attn_scores (its scores are no sublayer's output), the
    # norms' ln1/ln2(_post)/q_norm/k_norm.hook_scale and hook_normalized, hook_rot_q/k.
    names = block_names(("hook_pre", "hook_pre_linear", "hook_post"))
    expected = ["hook_embed", *(n for n in names if not n.endswith("hook_attn_scores"))]
    assert_hooks_equal(ours, theirs, expected)
