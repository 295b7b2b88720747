"""A small KV-cache decoder (Flax NNX), one token per call: the model inside the
`while_loop` sampler that `benchmarks/bench_samplers.py` times and
`tests/test_samplers.py` checks against a decode written out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Attention(nnx.Module):
    """Single-head causal attention over a `(keys, values)` cache of `[length, width]`."""

    def __init__(self, width, rngs):
        self.q, self.k, self.v, self.o = (nnx.Linear(width, width, rngs=rngs) for _ in range(4))

    def __call__(self, x, pos, cache):
        keys, values = cache[0].at[pos].set(self.k(x)), cache[1].at[pos].set(self.v(x))
        length, width = keys.shape
        scores = jnp.where(jnp.arange(length) <= pos, keys @ self.q(x) / np.sqrt(width), -jnp.inf)
        return self.o(jax.nn.softmax(scores) @ values), (keys, values)


class Block(nnx.Module):
    def __init__(self, width, rngs):
        self.attn = Attention(width, rngs)
        self.mlp = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x, pos, cache):
        a, cache = self.attn(x, pos, cache)
        x = x + a
        return x + jnp.tanh(self.mlp(x)), cache


class Decoder(nnx.Module):
    """One decode step: the token at `pos` in, next-token logits and the caches out."""

    def __init__(self, vocab, width, blocks, rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, rngs) for _ in range(blocks)])
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, token, pos, caches):
        x = self.embed(token)
        new = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block(x, pos, cache)
            new.append(cache)
        return self.head(x), new
