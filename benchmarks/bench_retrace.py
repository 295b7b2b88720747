"""Nothing traced twice: repeated sweeps and eager NNX calls against the compiled work alone.

    python -m benchmarks --only retrace [--quick]

An instrumented NNX transformer (`bench_instrument`'s: `nnx.MultiHeadAttention`
and an MLP per block), every block's output a site. Each pair is timed
interleaved in one run and reported as a ratio of medians (ours over the
reference):

* repeated sweep: `patching_sweep` over every (block, position), called again
  on new data, vs a hand-written `jax.jit(jax.vmap(...))` of the same one-hot
  patches through `plant` on the split state (compiled once, only run). Both
  return before their program finishes (a sweep's result converts to NumPy when
  read), and the timing waits for the last call's; a second row reads every
  call's numbers on the host (`.values`, `np.asarray`) before the next call;
* attribution: a repeated `attribution_patching` call vs the repeated exact
  sweep on the same patches;
* eager capture: `reap(instrument(model))(x)` called again and again vs
  `jax.jit` of the functional forward on the split state, and vs the same
  capture under `jax.jit` on the split state (the compiled work alone, every
  site's output included), at the tiny width and at a realistic one (d=256);
  at the tiny width also against `nnx.jit` of the module called directly,
  with a fresh lambda planted at every call (against one kept lambda: no
  recompile) and with a Python flag among the arguments (a static argument of
  the model's one `jax.jit`);
* steady at the realistic width: the capture under `jax.jit` on the split state
  vs the functional forward (every site's output against the output alone);
* first call at the realistic width: the eager capture after
  `jax.clear_caches()` vs the functional forward's first call likewise;
* the Linen twin at the realistic width: `reap(instrument(model.apply))`
  eager, under `jax.jit` (steady) and on its first call, vs `jax.jit(model.apply)`;
  and eager with a Python flag among the arguments (static).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from harvest import attribution_patching, instrument, patching_sweep, plant, reap

from . import _timing
from .bench_instrument import Transformer

HEADING = "## Nothing traced twice"
TARGETS = {"sweep": 1.05, "attribution": 0.5, "eager": 1.5, "nnx": 1.0, "fresh": 1.2}


@dataclasses.dataclass(frozen=True)
class Config:
    blocks: int = 12
    tiny_width: int = 16
    wide_width: int = 256
    positions: int = 8
    # Timings per side and back-to-back calls per timing: the eager rows are ~1 ms a
    # call, where 7 x 5 calls left their ratio to drift by ~0.2 between runs.
    repeats: int = 15
    calls: int = 20
    first_repeats: int = 3


QUICK = Config(
    blocks=1, tiny_width=8, wide_width=8, positions=2, repeats=1, calls=1, first_repeats=1
)


def metric(out):
    return jnp.sum(out[-1])


def _row(measure, reference, timing, target=None):
    """One table row from `_timing.ratio`'s (ratio, ours, theirs)."""
    ratio, ours, theirs = timing
    return dict(
        measure=measure, reference=reference, ratio=ratio, ours=ours, theirs=theirs, target=target
    )


def _model(width, cfg):
    model = Transformer(width, cfg.blocks, nnx.Rngs(0))
    k1, k2 = jax.random.split(jax.random.key(1))
    shape = (cfg.positions, width)
    return model, jax.random.normal(k1, shape), jax.random.normal(k2, shape)


def sweeps(cfg):
    """The repeated sweep vs its hand-written program, and attribution vs the sweep."""
    model, x_clean, x_corrupt = _model(cfg.tiny_width, cfg)
    probed = instrument(model)
    names = [f"blocks.{i}" for i in range(cfg.blocks)]
    clean = reap(probed, tag="modules")(x_clean)
    graphdef, state = nnx.split(model)
    positions = cfg.positions
    patches = len(names) * positions

    @jax.jit
    def hand(state, cleans, x):
        planted = plant(instrument(nnx.merge(graphdef, state)), tag="modules")

        def one(k):
            row, at = k // positions, k % positions
            here = (jnp.arange(positions) == at)[:, None]
            plants = {
                n: (lambda old, c=c, i=i: jnp.where(here & (row == i), c, old))
                for i, (n, c) in enumerate(zip(names, cleans))
            }
            return metric(planted(plants, x))

        return jax.vmap(one)(jnp.arange(patches)) - metric(planted({}, x))

    cleans = [clean[n] for n in names]

    def sweep():  # the result, still computing: the timing waits for the last
        return patching_sweep(
            probed, clean, (x_corrupt,), metric, tag="modules", names=names, axis=0
        )

    def attribution():
        return attribution_patching(
            probed, clean, (x_corrupt,), metric, tag="modules", names=names, axis=0
        )

    np.testing.assert_allclose(
        sweep().values.ravel(), hand(state, cleans, x_corrupt), rtol=1e-3, atol=1e-4
    )
    attribution().block_until_ready()  # compiled before the timing
    return [
        _row(
            f"repeated `patching_sweep`, {patches} patches",
            "hand-written `jit(vmap(plant))`",
            _timing.ratio(sweep, lambda: hand(state, cleans, x_corrupt), cfg.repeats, cfg.calls),
            TARGETS["sweep"],
        ),
        # Each call's numbers on the host before the next call: both sides wait every time.
        _row(
            f"repeated `patching_sweep`, {patches} patches, `.values` read every call",
            "the same, `np.asarray` of its output every call",
            _timing.ratio(
                lambda: sweep().values,
                lambda: np.asarray(hand(state, cleans, x_corrupt)),
                cfg.repeats,
                cfg.calls,
            ),
        ),
        _row(
            f"repeated `attribution_patching`, {patches} patches",
            "the repeated exact sweep",
            _timing.ratio(attribution, sweep, cfg.repeats, cfg.calls),
            TARGETS["attribution"],
        ),
    ]


def eager(width, cfg, first=False):
    """The eager capture vs the functional forward under `jax.jit`."""
    model, x, _ = _model(width, cfg)
    capture = reap(instrument(model), tag="modules")
    graphdef, state = nnx.split(model)
    functional = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    np.testing.assert_allclose(capture(x)["head"], functional(state, x), rtol=1e-4, atol=1e-4)
    rows = [
        _row(
            f"eager `reap(instrument(model))(x)`, d={width}",
            "`jax.jit` of the functional forward",
            _timing.ratio(lambda: capture(x), lambda: functional(state, x), cfg.repeats, cfg.calls),
            TARGETS["eager"] if width == cfg.tiny_width else None,
        )
    ]
    if width == cfg.tiny_width:
        by_nnx = nnx.jit(lambda m, x: m(x))
        np.testing.assert_allclose(capture(x)["head"], by_nnx(model, x), rtol=1e-4, atol=1e-4)
        rows.append(
            _row(
                f"eager `reap(instrument(model))(x)`, d={width}",
                "`nnx.jit(lambda m, x: m(x))(model, x)`",
                _timing.ratio(lambda: capture(x), lambda: by_nnx(model, x), cfg.repeats, cfg.calls),
                TARGETS["nnx"],
            )
        )
        # A fresh lambda planted at every call: its code is the key, its array traced.
        planted = plant(instrument(model), tag="modules")
        kept_d = jnp.full((width,), 0.5)
        kept = {"blocks.0": lambda h: h + kept_d}

        def fresh():  # the same array, a new function object each call
            return planted({"blocks.0": lambda h: h + kept_d}, x)

        np.testing.assert_allclose(fresh(), planted(kept, x), rtol=1e-6)
        rows.append(
            _row(
                f"`plant` of a fresh lambda at every call, d={width}",
                "the same plant of one kept lambda",
                _timing.ratio(fresh, lambda: planted(kept, x), cfg.repeats, cfg.calls),
                TARGETS["fresh"],
            )
        )
        # With a Python flag: a static argument of the same one jit.
        flagged = reap(instrument(Flagged(model)), tag="modules")
        np.testing.assert_allclose(
            flagged(x, True)["model.head"], functional(state, x), rtol=1e-4, atol=1e-4
        )
        rows.append(
            _row(
                f"the same, with a Python flag argument, d={width}",
                "`jax.jit` of the functional forward",
                _timing.ratio(
                    lambda: flagged(x, True), lambda: functional(state, x), cfg.repeats, cfg.calls
                ),
            )
        )
    # The same capture compiled by hand on the split state: what is left is harvest's Python.
    jitted = jax.jit(
        lambda state, x: reap(instrument(nnx.merge(graphdef, state)), tag="modules")(x)
    )
    np.testing.assert_allclose(jitted(state, x)["head"], capture(x)["head"], rtol=1e-4, atol=1e-4)
    rows.append(
        _row(
            f"eager `reap(instrument(model))(x)`, d={width}",
            "the same capture under `jax.jit` on the split state",
            _timing.ratio(lambda: capture(x), lambda: jitted(state, x), cfg.repeats, cfg.calls),
        )
    )
    if first:
        # Steady state of the compiled capture: every site's output against the forward alone.
        steady = _timing.ratio(
            lambda: jitted(state, x), lambda: functional(state, x), cfg.repeats, cfg.calls
        )
        first_call = _timing.ratio(
            lambda: reap(instrument(model), tag="modules")(x),
            lambda: jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x),
            cfg.first_repeats,
            setup=jax.clear_caches,
        )
        rows += [
            _row(
                f"steady: the capture under `jax.jit` on the split state, d={width}",
                "`jax.jit` of the functional forward",
                steady,
            ),
            _row(
                f"first call of the capture, d={width}",
                "the functional forward's first call",
                first_call,
            ),
        ]
    return rows


class Flagged(nnx.Module):
    """The model called with a Python flag it ignores (a static argument)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x, flag):
        return self.model(x)


class LinenBlock(linen.Module):
    width: int

    @linen.compact
    def __call__(self, x):
        x = x + linen.MultiHeadDotProductAttention(4, name="attn")(linen.LayerNorm(name="ln1")(x))
        h = linen.Dense(4 * self.width, name="up")(linen.LayerNorm(name="ln2")(x))
        return x + linen.Dense(self.width, name="down")(jax.nn.gelu(h))


class LinenTransformer(linen.Module):
    """The NNX transformer's Linen twin."""

    width: int
    blocks: int

    @linen.compact
    def __call__(self, x):
        for i in range(self.blocks):
            x = LinenBlock(self.width, name=f"blocks_{i}")(x)
        return linen.Dense(10, name="head")(x)


def linen_eager(width, cfg):
    """The Linen twin: the eager capture vs `jax.jit(model.apply)`, steady and first call."""
    model = LinenTransformer(width, cfg.blocks)
    x = jax.random.normal(jax.random.key(1), (cfg.positions, width))
    variables = model.init(jax.random.key(0), x)
    capture = reap(instrument(model.apply), tag="modules")
    forward = jax.jit(model.apply)
    np.testing.assert_allclose(
        capture(variables, x)["head"], forward(variables, x), rtol=1e-4, atol=1e-4
    )
    eager_call = _timing.ratio(
        lambda: capture(variables, x), lambda: forward(variables, x), cfg.repeats, cfg.calls
    )
    # With a Python flag: a static argument of the same one jit.
    flagged = reap(instrument(lambda v, a, flag: model.apply(v, a)), tag="modules")
    np.testing.assert_allclose(
        flagged(variables, x, True)["head"], forward(variables, x), rtol=1e-4, atol=1e-4
    )
    own_path = _timing.ratio(
        lambda: flagged(variables, x, True), lambda: forward(variables, x), cfg.repeats, cfg.calls
    )
    jitted = jax.jit(reap(instrument(model.apply), tag="modules"))
    np.testing.assert_allclose(
        jitted(variables, x)["head"], forward(variables, x), rtol=1e-4, atol=1e-4
    )
    steady = _timing.ratio(
        lambda: jitted(variables, x), lambda: forward(variables, x), cfg.repeats, cfg.calls
    )
    first_call = _timing.ratio(
        lambda: reap(instrument(model.apply), tag="modules")(variables, x),
        lambda: jax.jit(model.apply)(variables, x),
        cfg.first_repeats,
        setup=jax.clear_caches,
    )
    return [
        _row(
            f"Linen: eager `reap(instrument(model.apply))(variables, x)`, d={width}",
            "`jax.jit(model.apply)`",
            eager_call,
        ),
        _row(
            f"Linen: the same, with a Python flag argument, d={width}",
            "`jax.jit(model.apply)`",
            own_path,
        ),
        _row(
            f"Linen: steady, `jax.jit(reap(instrument(model.apply)))`, d={width}",
            "`jax.jit(model.apply)`",
            steady,
        ),
        _row(
            f"Linen: first call of the capture, d={width}",
            "`jax.jit(model.apply)`'s first call",
            first_call,
        ),
    ]


def run(cfg: Config = Config()) -> list[dict]:
    """Every row of this section (see the module's docstring).

    Example:
        >>> rows = run(QUICK)  # doctest: +SKIP
    """
    return [
        *sweeps(cfg),
        *(eager(cfg.tiny_width, cfg) if cfg.tiny_width != cfg.wide_width else []),
        *eager(cfg.wide_width, cfg, first=True),
        *linen_eager(cfg.wide_width, cfg),
    ]


def render(rows: list[dict]) -> list[str]:
    """The section of docs/benchmarks.md, from `run`'s rows."""
    lines = [
        HEADING,
        "",
        "A repeated sweep finds its sites without tracing the model again, and an eager",
        "call of an unchanged NNX module reuses its split graph. An instrumented NNX",
        "transformer (`nnx.MultiHeadAttention` and an MLP per block), every block's output",
        "a site, swept over every (block, position). Ratios of medians, timed interleaved.",
        "A sweep returns while its program runs, as the hand-written `jit` does (its result",
        "converts to NumPy when read), so the first row times twenty back-to-back calls of each",
        "side and waits for the last; the second row reads every call's numbers on the host",
        "(`.values`; `np.asarray` of the hand-written output) before the next call.",
        "What a sweep adds is Python per call, most of it the check that the module's",
        "structure is unchanged (so weights or layers changed in place are seen), which the",
        "hand-written program, handed the split state once, does not make.",
        "The eager rows run after the sweeps, whose model has the same structure as theirs:",
        "as for a user holding two such models, both splits share one graph definition, so",
        "the compile-cache lookup compares it by identity (before, node by node: some 3 ms a call).",
        "An eager call of an instrumented NNX module runs through the one `jax.jit` of its class's",
        "`__call__`: the kept split, checked at each call, hands the state's arrays over as traced",
        "arguments, and the state the call changes is written back after it; the flag row adds a",
        "Python flag, a static argument of the same jit.",
        "",
        "| measure | reference | ours (ms) | reference (ms) | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["target"] is None:
            target = "—"
        else:
            target = f"≤{r['target']} ({'met' if r['ratio'] <= r['target'] else '**missed**'})"
        lines.append(
            f"| {r['measure']} | {r['reference']} | {1e3 * r['ours']:.2f} | {1e3 * r['theirs']:.2f} "
            f"| {r['ratio']:.3f} | {target} |"
        )
    return lines
