"""The oryx half of bench_oryx: runs inside the oryx venv (JAX 0.4.38 + oryx 0.2.9).

It times the real oryx `reap` on the same residual MLP as bench_core, eager
and under `jit`, against plain `jax.jit` in the same process, and prints one
JSON object of ratios. It imports only jax and oryx (plus the standard
library), since harvest does not run on that JAX.

Usage: python oryx_side.py LAYERS [LAYERS ...] [--repeats N] [--calls N] [--eager-repeats N] [--width N] [--batch N]
"""

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
from oryx.core.interpreters import harvest

TAG = "intermediates"


def _layer(x, w):
    return jnp.tanh(x @ w)


def unrolled():
    def f(ws, x):
        for i, w in enumerate(ws):
            x = x + harvest.sow(_layer(x, w), tag=TAG, name=f"layer{i}", mode="strict")
        return x

    def hand(ws, x):
        hs = {}
        for i, w in enumerate(ws):
            hs[f"layer{i}"] = h = _layer(x, w)
            x = x + h
        return hs

    return f, hand


def scanned():
    def f(ws, x):
        def body(x, w):
            return x + harvest.sow(_layer(x, w), tag=TAG, name="layers", mode="append"), None

        return jax.lax.scan(body, x, ws)[0]

    def hand(ws, x):
        def body(x, w):
            h = _layer(x, w)
            return x + h, h

        return {"layers": jax.lax.scan(body, x, ws)[1]}

    return f, hand


def inputs(kind, layers, width, batch):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    ws = [jax.random.normal(k, (width, width)) / math.sqrt(width) for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (batch, width))
    return (ws if kind == "unrolled" else jnp.stack(ws)), x


def per_call(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def ratio(ours, theirs, repeats, calls):
    """Median over median, the two sides interleaved (as in benchmarks/_timing.py)."""
    a, b = [], []
    for r in range(repeats):
        order = [(ours, a), (theirs, b)]
        for fn, out in order if r % 2 == 0 else order[::-1]:
            out.append(per_call(fn, calls))
    return statistics.median(a) / statistics.median(b)


def measure(kind, layers, opts):
    f, hand = {"unrolled": unrolled, "scan": scanned}[kind]()
    args = inputs(kind, layers, opts.width, opts.batch)
    reaped = harvest.reap(f, tag=TAG)
    got, want = reaped(*args), hand(*args)
    for k in want:
        assert jnp.allclose(got[k], want[k], atol=1e-5), k
    ours_jit, hand_jit, plain_jit = jax.jit(reaped), jax.jit(hand), jax.jit(f)
    jax.block_until_ready((ours_jit(*args), hand_jit(*args), plain_jit(*args)))
    return {
        "model": kind,
        "layers": layers,
        "steady": ratio(lambda: ours_jit(*args), lambda: hand_jit(*args), opts.repeats, opts.calls),
        # oryx re-traces an eager reap on every call: hundreds of times slower,
        # so fewer timings keep the run short without changing the picture.
        "eager": ratio(lambda: reaped(*args), lambda: plain_jit(*args), opts.eager_repeats, 1),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("layers", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--eager-repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    opts = parser.parse_args()
    rows = [measure(kind, n, opts) for kind in ("unrolled", "scan") for n in opts.layers]
    print(json.dumps({"jax": jax.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
