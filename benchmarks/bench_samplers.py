"""Steering inside a sampler: a KV-cache decode loop (`lax.while_loop`) with a vector planted.

    python -m benchmarks --only samplers [--quick]

An NNX decoder, instrumented, is called once per iteration of a greedy
decode loop that checks for an end token (which never comes, so both sides run
every step: steering changes the tokens, not the work). Each pair is timed interleaved in
one run and reported as a ratio of medians (ours over the reference, the same
decode unsteered under `jax.jit`):

* steered, steady, inside `jax.jit`: `plant(decode)` with `add_vector` at one
  block's MLP output, every iteration, on the split model state;
* steered, steady, `plant`'s own cache: the same call made eagerly, against
  `nnx.jit` of the unsteered decode (both split the model object per call);
* per-step record, steady, inside `jax.jit`: `reap(decode, max_steps=L)` of
  every block's MLP output, one row per generated token;
* steered, first call: trace and compile of each side after `jax.clear_caches()`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harvest import add_vector, instrument, plant, reap

from . import _timing
from .decoder import Decoder

TARGET = 1.1


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 64
    blocks: int = 2
    vocab: int = 64
    length: int = 32  # the token buffer: the loop runs at most length - 1 iterations
    repeats: int = 15
    calls: int = 10
    first_repeats: int = 3


QUICK = Config(width=8, blocks=1, vocab=11, length=6, repeats=2, calls=2, first_repeats=1)


def decode(model, tokens, cfg):
    """Greedy decoding after `tokens[0]`, one token per iteration, until the end
    token or a full buffer. The end token is `cfg.vocab`, which argmax never
    gives, so steered and unsteered decodes run the same number of steps."""
    length = tokens.shape[0]

    def running(carry):
        tokens, pos, _ = carry
        return (pos < length - 1) & (tokens[pos] != cfg.vocab)

    def step(carry):
        tokens, pos, caches = carry
        logits, caches = model(tokens[pos], pos, caches)
        return tokens.at[pos + 1].set(jnp.argmax(logits).astype(jnp.int32)), pos + 1, caches

    caches = [(jnp.zeros((length, cfg.width)),) * 2 for _ in range(cfg.blocks)]
    tokens, steps, _ = jax.lax.while_loop(running, step, (tokens, jnp.int32(0), caches))
    return tokens, steps


def run(cfg: Config = Config()):
    """Times each pair; returns rows of (measure, ours, reference, ratio)."""
    model = Decoder(cfg.vocab, cfg.width, cfg.blocks, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros(cfg.length, jnp.int32).at[0].set(1)
    vector = jnp.ones(cfg.width) * 0.5
    steer = {"blocks.0.mlp": add_vector(vector)}

    unsteered = jax.jit(lambda state, t: decode(nnx.merge(graphdef, state), t, cfg))
    steered = jax.jit(
        lambda state, plants, t: plant(decode, tag="modules")(
            plants, instrument(nnx.merge(graphdef, state)), t, cfg
        )
    )
    record = reap(decode, tag="modules", names="blocks.*.mlp", max_steps=cfg.length)
    recorded = jax.jit(lambda state, t: record(instrument(nnx.merge(graphdef, state)), t, cfg))
    probed, eager = instrument(model), plant(decode, tag="modules")
    unsteered_nnx = nnx.jit(decode, static_argnums=2)

    # The pairs do the same work: unsteered tokens agree, and the steered decode
    # equals the decode of a model whose MLP bias carries the vector.
    np.testing.assert_array_equal(unsteered(state, tokens)[0], decode(model, tokens, cfg)[0])
    np.testing.assert_array_equal(
        unsteered_nnx(model, tokens, cfg)[0], decode(model, tokens, cfg)[0]
    )
    hand = decode_steered_by_hand(model, tokens, vector, cfg)
    np.testing.assert_array_equal(steered(state, steer, tokens)[0], hand[0])
    np.testing.assert_array_equal(eager(steer, probed, tokens, cfg)[0], hand[0])
    steps = recorded(state, tokens)["blocks.0.mlp"]
    assert int(steps.count) == int(decode(model, tokens, cfg)[1])

    rows = []

    model_text = (
        f"{cfg.blocks} block{'s' * (cfg.blocks > 1)}, width {cfg.width}, "
        f"up to {cfg.length - 1} greedy steps"
    )

    def pair(measure, ours, theirs, repeats=cfg.repeats, calls=cfg.calls, setup=None):
        r, a, b = _timing.ratio(ours, theirs, repeats, calls, setup)
        rows.append(dict(measure=measure, ours=a, theirs=b, ratio=r, model=model_text))

    pair(
        "steered, steady, inside `jax.jit`",
        lambda: steered(state, steer, tokens),
        lambda: unsteered(state, tokens),
    )
    # Called eagerly, both sides take the model object and split it per call.
    pair(
        "steered, steady, `plant`'s own cache (vs `nnx.jit`)",
        lambda: eager(steer, probed, tokens, cfg),
        lambda: unsteered_nnx(model, tokens, cfg),
    )
    pair(
        "per-step record of every MLP output, steady, inside `jax.jit`",
        lambda: recorded(state, tokens),
        lambda: unsteered(state, tokens),
    )
    pair(
        "steered, first call (trace + compile)",
        lambda: plant(decode, tag="modules")(steer, instrument(model), tokens, cfg),
        lambda: jax.jit(lambda state, t: decode(nnx.merge(graphdef, state), t, cfg))(state, tokens),
        repeats=cfg.first_repeats,
        calls=1,
        setup=jax.clear_caches,
    )
    for r in rows:
        print(f"samplers: {r['measure']}: {r['ratio']:.3f}")
    return rows


def decode_steered_by_hand(model, tokens, vector, cfg):
    """The reference steered decode: the vector added to block 0's MLP bias, which
    adds it to that MLP's output at every iteration."""
    biased = nnx.clone(model)
    biased.blocks[0].mlp.bias[...] = biased.blocks[0].mlp.bias[...] + vector
    return decode(biased, tokens, cfg)


def render(rows):
    """The section of docs/benchmarks.md, from `run`'s rows."""
    lines = [
        "## Steering inside a sampler",
        "",
        f"`benchmarks/bench_samplers.py`: an NNX KV-cache decoder ({rows[0]['model']})",
        "called once per iteration of a",
        "`lax.while_loop` that checks for an end token (never generated, so both sides run",
        "every step), instrumented whole. Ours plants",
        "`add_vector` at block 0's MLP output in every iteration (or records every block's",
        "MLP output per step with `max_steps`); the reference is the same decode, unsteered,",
        "under `jax.jit`. Ratios of medians, timed interleaved.",
        "",
        "| measure | ours (ms) | unsteered (ms) | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        steady = "steady" in r["measure"]
        target = (
            (f"≤{TARGET} ({'met' if r['ratio'] <= TARGET else '**missed**'})") if steady else "-"
        )
        lines.append(
            f"| {r['measure']} | {1e3 * r['ours']:.3f} | {1e3 * r['theirs']:.3f} "
            f"| {r['ratio']:.3f} | {target} |"
        )
    lines += [
        "",
        "Compiled, the per-step record is the decode's own loop plus, per recorded site and",
        "iteration, one in-place write of a row into a buffer the loop carries (`max_steps`",
        "rows and a spare one that iterations past them write, cut off after the loop; XLA",
        "shares the loop's own counter for the row index); after the loop, one copy of each",
        "buffer into its output and the outputs themselves (a buffer and a count per site).",
    ]
    return lines
