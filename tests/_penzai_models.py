"""The tiny Penzai model the Penzai test files share.

Imported by them after their `pytest.importorskip("penzai...")`, so it may import
Penzai at the top. A helper module rather than a fixture imported from another test
file: the tests take the fixture's name as a parameter, which would shadow the import.
"""

import jax
from penzai.models.transformer.variants import llamalike_common


def tiny_config(**changes):
    """Penzai's config of a one-block llama-like transformer (width 8, 2 KV heads, 11
    tokens), with `changes` to its fields."""
    fields = dict(
        num_kv_heads=2,
        query_head_multiplier=1,
        embedding_dim=8,
        projection_dim=4,
        mlp_hidden_dim=16,
        num_decoder_blocks=1,
        vocab_size=11,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    return llamalike_common.LlamalikeTransformerConfig(**{**fields, **changes})


def tiny_llamalike():
    """The model of `tiny_config()`, built by Penzai with fixed weights: it compiles in
    about a second."""
    return llamalike_common.build_llamalike_transformer(
        tiny_config(), init_base_rng=jax.random.key(0)
    )
