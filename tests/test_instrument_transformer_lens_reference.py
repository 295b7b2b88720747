"""instrument(naming="transformer_lens") against TransformerLens itself, hook by hook.

Two models from a real checkpoint's code path, with random weights (no download):
a GPT-2 built by Hugging Face `transformers` from a config, ported to Flax NNX here
(GPT-2's own block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`), and a Llama built
the same way, converted by Penzai's own `llama_from_huggingface_model`. TransformerLens
(2.18) gets the same weights through its own weight conversion into a
`HookedTransformer` (its weights not processed, so its hooks hold the checkpoint's
values). Every hook both give is equal to 1e-4, relative to the hook's scale.

Needs torch, transformers and transformer-lens, which the suite does not install:
`make transformer-lens` adds them to the venv. Where they do not import, the tests
are skipped, saying which.
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


def tl_cache(cfg, state_dict):
    """TransformerLens's `run_with_cache` on TOKENS, its weights `state_dict` loaded
    as they are (no folding or centring): {hook name: NumPy array}."""
    from transformer_lens import HookedTransformer

    model = HookedTransformer(cfg)
    model.load_state_dict(state_dict, strict=False)
    model.eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor(TOKENS))
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
