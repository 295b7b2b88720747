"""A sow nobody harvests costs nothing: the same jitted program with and without sows.

Users leave `sow` calls in their models for good, so a program holding sows
but run without any harvest must dispatch and run as fast as the program
without them. Two programs, each timed interleaved against its sow-free twin:

* dispatch: `jax.jit(f)` on tiny arrays, where the call is all dispatch
  overhead (an effect in the program would take JAX off its C++ fast path);
* sgd step: a jitted SGD step (value and gradient of a squared loss) of a
  4-layer tanh MLP, every hidden layer sown, at widths 16 and 64.

Both programs do the same work, so any interference from other processes on
a shared CPU is pure noise: the ratio compares the fastest timing of each side
(each timing is short, so many are clean); the ratio of medians is shown
beside it. Next to each ratio: whether the two programs lower to the same
StableHLO text, and whether the jaxpr of the sowing program carries any effect.
"""

from __future__ import annotations

import dataclasses
import re
import statistics

import jax
import jax.numpy as jnp

from harvest import sow

from . import _timing

TARGET = 1.05


@dataclasses.dataclass(frozen=True)
class Config:
    # Many short timings: on a shared CPU a burst of load then spoils a few
    # samples of either side, which the median discards.
    repeats: int = 201  # timings per side
    dispatch_calls: int = 50  # back-to-back calls per timing (a call is some µs)
    step_calls: int = 10
    widths: tuple = (16, 64)
    batch: int = 32
    layers: int = 4


QUICK = Config(repeats=2, dispatch_calls=3, step_calls=2, widths=(16,), batch=4, layers=2)


def _identity(x, *, name):
    return x


def dispatch_fn(sowing):
    """f(x, y): three small ops, each output sown (or not)."""
    tag = sow if sowing else _identity

    def f(x, y):
        a = tag(x + y, name="a")
        b = tag(a * 2.0, name="b")
        c = tag(jnp.sin(b), name="c")
        return tag(c - x, name="d")

    return f


def dispatch_args():
    return jnp.ones(4), jnp.full(4, 2.0)


def step_fn(sowing, layers):
    """A jitted SGD step of an MLP whose hidden layers are sown (or not)."""
    tag = sow if sowing else _identity

    def loss(params, x, y):
        for i, (w, b) in enumerate(params[:-1]):
            x = tag(jnp.tanh(x @ w + b), name=f"h{i}")
        w, b = params[-1]
        return jnp.mean((x @ w + b - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def step_args(width, batch, layers):
    keys = jax.random.split(jax.random.key(0), layers + 2)
    params = [
        (jax.random.normal(k, (width, width)) / jnp.sqrt(width), jnp.zeros(width))
        for k in keys[:layers]
    ]
    return (
        params,
        jax.random.normal(keys[-2], (batch, width)),
        jax.random.normal(keys[-1], (batch, width)),
    )


def _hlo(jitted, args):
    # Location metadata names the source lines, which differ; the operations do not.
    text = jitted.lower(*args).as_text()
    return re.sub(r"loc\([^\n]*", "", text)


def facts(build, args):
    """(same lowered program?, effects of the sowing jaxpr) for one comparison."""
    ours, theirs = jax.jit(build(True)), jax.jit(build(False))
    same = _hlo(ours, args) == _hlo(theirs, args)
    return same, jax.make_jaxpr(build(True))(*args).effects


def compare(build, args, calls, cfg):
    ours, theirs = jax.jit(build(True)), jax.jit(build(False))
    for a, b in zip(jax.tree.leaves(ours(*args)), jax.tree.leaves(theirs(*args))):
        assert jnp.array_equal(a, b), "the sowing program computes something else"
    a, b = _timing.samples(lambda: ours(*args), lambda: theirs(*args), cfg.repeats, calls)
    same, effects = facts(build, args)
    return dict(
        ratio=min(a) / min(b),
        median=statistics.median(a) / statistics.median(b),
        ours=min(a),
        theirs=min(b),
        same_program=same,
        effects=sorted(map(repr, effects)),
    )


def run(cfg: Config = Config()):
    rows = [
        dict(
            measure="dispatch, tiny arrays, 4 sows",
            **compare(dispatch_fn, dispatch_args(), cfg.dispatch_calls, cfg),
        )
    ]
    for width in cfg.widths:
        args = step_args(width, cfg.batch, cfg.layers)
        build = lambda sowing: step_fn(sowing, cfg.layers)  # noqa: E731
        rows.append(
            dict(
                measure=f"SGD step, {cfg.layers}-layer tanh MLP, width {width}",
                **compare(build, args, cfg.step_calls, cfg),
            )
        )
    return rows


def render(rows):
    """The section of docs/benchmarks.md, from `run`'s rows."""
    lines = [
        "## Sows nobody harvests",
        "",
        "The same jitted program with and without its sows, nothing harvested: a sow",
        "outside a harvest must cost nothing. `dispatch` calls `jax.jit(f)` on 4-element",
        "arrays, so the time is all dispatch; `SGD step` is a jitted value-and-gradient",
        "step of an MLP with every hidden layer sown. *same program* says whether both",
        "lower to the same StableHLO; *effects* lists the effects on the sowing jaxpr",
        "(any effect would take JAX off its fast C++ dispatch path). Both sides do the",
        "same work, so the ratio compares each side's fastest timing (the cost with the",
        "least interference from other processes); the ratio of medians, which that",
        "interference moves, is shown beside it.",
        "",
        "| measure | with sows, fastest (µs) | without, fastest (µs) | ratio | target | ratio of medians | same program | effects |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = "met" if r["ratio"] <= TARGET else "**missed**"
        lines.append(
            f"| {r['measure']} | {1e6 * r['ours']:.1f} | {1e6 * r['theirs']:.1f} | {r['ratio']:.3f} "
            f"| ≤{TARGET} ({verdict}) | {r['median']:.3f} | {'yes' if r['same_program'] else 'no'} "
            f"| {', '.join(r['effects']) or 'none'} |"
        )
    return lines
