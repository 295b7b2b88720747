"""harvest against hand-written JAX on a residual MLP that sows every layer.

Each comparison is a ratio of medians (ours / theirs):

* steady: `jax.jit(reap(f))` vs a hand-written jitted function returning the
  same intermediates, once both are compiled;
* compile: the first call of each (trace + compile), on fresh functions with
  JAX's caches cleared before every call;
* eager: `reap(f)(x)` called again and again vs `jax.jit(f)(x)`, and vs the
  jitted hand-written function (`eager_hand`, the same outputs);
* trace scaling: `jax.make_jaxpr(reap(f))` vs `jax.make_jaxpr(f)` as the
  program grows from 10^2 to 10^4 (optionally 10^5) equations.

Timings on a shared CPU are noisy, so each model also reports whether the two
compiled programs hold the same XLA operations: a fact no noise can blur.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import re

import jax
import jax.numpy as jnp

from harvest import reap, sow

from . import _timing

WIDTH, BATCH = 128, 64


@dataclasses.dataclass(frozen=True)
class Config:
    layers: tuple = (8, 48)
    # Enough samples that the median of a 0.3 ms call moves by about 2%, not 10%.
    repeats: int = 31  # timings per side; the median is kept
    calls: int = 40  # back-to-back calls per steady/eager timing
    compile_repeats: int = 9
    trace_sizes: tuple = (100, 1_000, 10_000)
    width: int = WIDTH
    batch: int = BATCH


QUICK = Config(
    layers=(2,), repeats=2, calls=2, compile_repeats=1, trace_sizes=(30, 60), width=8, batch=4
)


# ---------------------------------------------------------------------------
# The model, written two ways. Each builder returns fresh closures every call,
# so that no cache keyed by function identity can carry over between timings.


def _layer(x, w):
    return jnp.tanh(x @ w)


def unrolled():
    """A Python loop over a list of weights: one sow per layer."""

    def f(ws, x):
        for i, w in enumerate(ws):
            x = x + sow(_layer(x, w), name=f"layer{i}", mode="strict")
        return x

    def hand(ws, x):
        hs = {}
        for i, w in enumerate(ws):
            hs[f"layer{i}"] = h = _layer(x, w)
            x = x + h
        return hs

    return f, hand


def scanned():
    """A `scan` over stacked weights: one sow, stacked along the layer axis."""

    def f(ws, x):
        def body(x, w):
            return x + sow(_layer(x, w), name="layers", mode="append"), None

        return jax.lax.scan(body, x, ws)[0]

    def hand(ws, x):
        def body(x, w):
            h = _layer(x, w)
            return x + h, h

        return {"layers": jax.lax.scan(body, x, ws)[1]}

    return f, hand


MODELS = {"unrolled": unrolled, "scan": scanned}


def inputs(kind, layers, width, batch):
    keys = jax.random.split(jax.random.key(0), layers + 1)
    ws = [jax.random.normal(k, (width, width)) / math.sqrt(width) for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (batch, width))
    return (ws if kind == "unrolled" else jnp.stack(ws)), x


# ---------------------------------------------------------------------------
# The measurements.


def _fresh_caches():
    jax.clear_caches()
    gc.collect()  # so one side does not pay for the other's garbage


def _warm(*fns, args):
    _timing.block([fn(*args) for fn in fns])


def steady(build, args, cfg):
    f, hand = build()
    ours, theirs = jax.jit(reap(f)), jax.jit(hand)
    _warm(ours, theirs, args=args)
    return _timing.ratio(lambda: ours(*args), lambda: theirs(*args), cfg.repeats, cfg.calls)


def first_call(build, args, cfg):
    # A fresh function per call and cleared caches: every call traces and compiles.
    return _timing.ratio(
        lambda: jax.jit(reap(build()[0]))(*args),
        lambda: jax.jit(build()[1])(*args),
        cfg.compile_repeats,
        setup=_fresh_caches,
    )


def eager(build, args, cfg):
    f, _ = build()
    ours, theirs = reap(f), jax.jit(f)
    _warm(ours, theirs, args=args)
    return _timing.ratio(lambda: ours(*args), lambda: theirs(*args), cfg.repeats, cfg.calls)


def eager_hand(build, args, cfg):
    f, hand = build()
    ours, theirs = reap(f), jax.jit(hand)
    _warm(ours, theirs, args=args)
    return _timing.ratio(lambda: ours(*args), lambda: theirs(*args), cfg.repeats, cfg.calls)


MEASURES = {"steady": steady, "compile": first_call, "eager": eager, "eager_hand": eager_hand}


def same_values(build, args):
    """Checks that the two sides of every comparison agree, so we time like with like."""
    f, hand = build()
    got, want = reap(f)(*args), hand(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jnp.allclose(a, b, atol=1e-5), "reap and the hand-written function disagree"


def _ops(jitted, args):
    text = jitted.lower(*args).compile().as_text()
    return collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))


def program_diff(build, args):
    """The XLA operations by which jit(reap(f)) and jit(hand) differ once compiled."""
    f, hand = build()
    ours, theirs = _ops(jax.jit(reap(f)), args), _ops(jax.jit(hand), args)
    extra = [f"+{n} {op}" for op, n in sorted((ours - theirs).items())]
    missing = [f"-{n} {op}" for op, n in sorted((theirs - ours).items())]
    return ", ".join(extra + missing) or "identical"


# ---------------------------------------------------------------------------
# Trace time as the program grows.


def _shapes(layers):
    # Abstract inputs: tracing needs only shapes, and slicing thousands of
    # concrete weights would take longer than the tracing being measured.
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    return [w] * layers, jax.ShapeDtypeStruct((1, 4), jnp.float32)


def equations(layers):
    return len(jax.make_jaxpr(unrolled()[0])(*_shapes(layers)).jaxpr.eqns)


def trace_scaling(cfg):
    """make_jaxpr(reap(f)) vs make_jaxpr(f) for unrolled MLPs of growing size."""
    per_layer = equations(2) - equations(1)
    fixed = equations(1) - per_layer  # the unrolled jaxpr is exactly linear in depth
    rows = []
    for size in cfg.trace_sizes:
        layers = max(1, size // per_layer)
        args = _shapes(layers)
        # Big programs take seconds to trace; fewer repeats keep the run short.
        repeats = max(1, min(cfg.compile_repeats, int(20_000 / size)))
        r, ours, theirs = _timing.ratio(
            lambda: jax.make_jaxpr(reap(unrolled()[0]))(*args),
            lambda: jax.make_jaxpr(unrolled()[0])(*args),
            repeats,
            setup=_fresh_caches,
        )
        rows.append(dict(equations=fixed + per_layer * layers, ratio=r, ours=ours, theirs=theirs))
    return rows, growth(rows)


def growth(rows):
    """Log-log slope of our trace time between the two largest sizes (1 = linear)."""
    if len(rows) < 2:
        return float("nan")
    a, b = rows[-2], rows[-1]
    return math.log(b["ours"] / a["ours"]) / math.log(b["equations"] / a["equations"])


def run(cfg: Config = Config()):
    """Every comparison, for every model and depth in `cfg`."""
    results = []
    for kind, build in MODELS.items():
        for layers in cfg.layers:
            args = inputs(kind, layers, cfg.width, cfg.batch)
            same_values(build, args)
            row = dict(model=kind, layers=layers, program=program_diff(build, args))
            for name, measure in MEASURES.items():
                row[name], row[name + "_ours"], row[name + "_theirs"] = measure(build, args, cfg)
            results.append(row)
    scaling, slope = trace_scaling(cfg)
    return dict(mlp=results, trace=scaling, trace_slope=slope)
