"""Trains docs/_static/induction.npz, the model the activation-patching guide and notebook study.

    python docs/_static/train_induction.py            # about two minutes on one CPU core
    python docs/_static/train_induction.py --check    # retrain and compare with the shipped file

A two-layer, attention-only transformer (two heads per layer, no MLPs, no
layer norm) learns to continue repeated sequences: each training sequence is
random tokens in which a random segment `A` (3 to 12 tokens, at a random
offset) is repeated right after itself, and the loss counts only the
positions inside the repeat, whose next token is whatever followed the
current token the first time. No fixed positional rule solves that, so the
model learns the induction circuit: a previous-token head in layer 0 and
induction heads in layer 1.

Everything is seeded: the same JAX release on the same kind of machine
writes the same weights; another release may differ in the last bits, which
is why the tests check the shipped file's behaviour (the numbers the guide
prints), not a retrained one. The model code here is the one the guide shows.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[2])
)  # this checkout's harvest
from harvest import nest, sow  # noqa: E402  (identities outside a harvest: training ignores them)

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 32, 24, 32, 2, 2
HEAD_WIDTH = WIDTH // HEADS
STEPS, BATCH, LEARNING_RATE, SEED = 1500, 64, 1e-2, 0
WEIGHTS = pathlib.Path(__file__).resolve().parent / "induction.npz"


def init(key):
    keys = iter(jax.random.split(key, 3 + 4 * LAYERS))

    def dense(*shape):
        return jax.random.normal(next(keys), shape) / np.sqrt(shape[-2])

    layers = [
        {w: dense(HEADS, WIDTH, HEAD_WIDTH) for w in "qkv"}
        | {"o": dense(HEADS, HEAD_WIDTH, WIDTH)}
        for _ in range(LAYERS)
    ]
    return {
        "embed": 0.5 * jax.random.normal(next(keys), (VOCAB, WIDTH)),
        "pos": 0.5 * jax.random.normal(next(keys), (SEQ, WIDTH)),
        "unembed": dense(WIDTH, VOCAB),
        "layers": layers,
    }


def attention(x, w):
    """One attention layer: its heads' queries, keys, values, patterns and outputs are sites."""
    q, k, v = (
        sow(jnp.einsum("btd,hde->bthe", x, w[n]), name=n, mode="strict") for n in "qkv"
    )
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(HEAD_WIDTH)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    pattern = sow(
        jax.nn.softmax(jnp.where(causal, scores, -1e9)), name="pattern", mode="strict"
    )
    z = sow(jnp.einsum("bhqk,bkhe->bqhe", pattern, v), name="z", mode="strict")
    return sow(jnp.einsum("bqhe,hed->bqd", z, w["o"]), name="out", mode="strict")


def transformer(params, tokens):
    """tokens: int[batch, SEQ] -> logits [batch, SEQ, VOCAB]."""
    x = sow(params["embed"][tokens] + params["pos"], name="embed", mode="strict")
    for i, w in enumerate(params["layers"]):
        x = x + nest(attention, scope=f"blocks{i}")(x, w)
    return x @ params["unembed"]


def sequence(key):
    k_len, k_start, k_tokens = jax.random.split(key, 3)
    n = jax.random.randint(k_len, (), 3, SEQ // 2 + 1)
    start = jax.random.randint(k_start, (), 0, SEQ - 2 * n + 1)
    pos = jnp.arange(SEQ)
    in_repeat = (pos >= start + n) & (pos < start + 2 * n)
    tokens = jax.random.randint(k_tokens, (SEQ,), 0, VOCAB)[
        jnp.where(in_repeat, pos - n, pos)
    ]
    predictable = in_repeat & (pos < start + 2 * n - 1)  # the next token repeats too
    return tokens, predictable


def batch(key, size):
    return jax.vmap(sequence)(jax.random.split(key, size))


def loss_fn(params, tokens, predictable):
    logp = jax.nn.log_softmax(transformer(params, tokens)[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * predictable[:, :-1]) / jnp.sum(predictable[:, :-1])


def adam_step(state, key, b1=0.9, b2=0.999):
    params, m, v, t = state
    loss, g = jax.value_and_grad(loss_fn)(params, *batch(key, BATCH))
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)

    def update(p, m, v):
        return p - LEARNING_RATE * (m / (1 - b1**t)) / (
            jnp.sqrt(v / (1 - b2**t)) + 1e-8
        )

    return (jax.tree.map(update, params, m, v), m, v, t), loss


# Up to 100 Adam steps in one compiled scan, made once: a second `train` of the same
# length (the tests train twice) reuses the program.
chunk = jax.jit(lambda state, keys: jax.lax.scan(adam_step, state, keys))


def train(steps=STEPS, seed=SEED):
    """The trained parameters, and the last 100 steps' mean loss."""
    params = init(jax.random.key(seed))
    zeros = jax.tree.map(jnp.zeros_like, params)
    state, losses = (params, zeros, zeros, 0), jnp.zeros(0)
    for i in range(0, steps, 100):
        keys = jax.random.split(
            jax.random.fold_in(jax.random.key(seed + 1), i), min(100, steps - i)
        )
        state, losses = chunk(state, keys)
    return state[0], float(losses[-100:].mean())


def accuracy(params, n=1000):
    tokens, predictable = batch(jax.random.key(1234), n)
    correct = jnp.argmax(transformer(params, tokens)[:, :-1], -1) == tokens[:, 1:]
    return float(jnp.sum(correct * predictable[:, :-1]) / jnp.sum(predictable[:, :-1]))


def to_arrays(params):
    """The parameters as flat float32 arrays named `embed`, `pos`, `unembed`, `layers.<i>.<w>`."""
    flat = {k: params[k] for k in ("embed", "pos", "unembed")}
    for i, layer in enumerate(params["layers"]):
        flat |= {f"layers.{i}.{w}": layer[w] for w in "qkvo"}
    return {k: np.asarray(v, np.float32) for k, v in flat.items()}


def load(path=WEIGHTS):
    """The parameters `train` writes, read back from `path`."""
    arrays = np.load(path)
    params = {k: jnp.asarray(arrays[k]) for k in ("embed", "pos", "unembed")}
    params["layers"] = [
        {w: jnp.asarray(arrays[f"layers.{i}.{w}"]) for w in "qkvo"}
        for i in range(LAYERS)
    ]
    return params


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=WEIGHTS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--check", action="store_true", help="compare with the shipped weights"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    params, loss = train(args.steps)
    took = time.perf_counter() - start
    print(
        f"trained {args.steps} steps in {took:.0f}s: loss {loss:.3f}, accuracy {accuracy(params):.1%}"
    )
    if args.check:
        shipped = np.load(WEIGHTS)
        worst = max(
            float(np.abs(shipped[k] - v).max()) for k, v in to_arrays(params).items()
        )
        print(f"largest difference from {WEIGHTS.name}: {worst:.2e}")
        return
    np.savez_compressed(args.out, **to_arrays(params))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
