"""Probing an unmodified model: `instrument` on a small NNX transformer against its `nnx.jit` forward.

    python -m benchmarks.bench_instrument [tiny|small] [--write]

Three pairs, each timed interleaved in one run and reported as a ratio of
medians (ours over the reference):

* capture, steady: `reap(instrument(model))(x)`, every submodule's output
  returned, called again and again, vs `nnx.jit(forward)(model, x)`, and vs
  `jax.jit` of the functional forward on the split state (no graph traversal
  per call, so only the compiled work and dispatch);
* capture, first call: the same two calls on fresh functions after
  `jax.clear_caches()` (trace + compile);
* capture inside `jax.jit`, steady: the capture of the merged state under
  `jax.jit` vs the functional forward;
* forward, steady: `nnx.jit` of the instrumented model's forward (no harvest)
  vs `nnx.jit` of the model's own forward: the price of being instrumented.

`--write` puts this section into docs/benchmarks.md in place of the one there.
"""

from __future__ import annotations

import pathlib
import re
import sys

import jax
import numpy as np
from flax import nnx

from harvest import instrument, reap

from . import _timing

SIZES = {  # width, positions, blocks, steady calls, repeats
    "tiny": (16, 8, 2, 3, 3),
    "small": (64, 32, 4, 50, 9),
}
HEADING = "## Probing an unmodified model"
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


class Block(nnx.Module):
    def __init__(self, width, rngs):
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, width, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    def __init__(self, width, blocks, rngs):
        self.blocks = nnx.List([Block(width, rngs) for _ in range(blocks)])
        self.head = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def forward(model, x):
    return model(x)


def probed_forward(model, x):
    return instrument(model)(x)


def run(size="small"):
    """Times the three pairs at `size`; prints and returns the ratios (ours / reference).

    Example:
        >>> ratios = run("tiny")  # doctest: +SKIP
        >>> sorted(ratios)  # doctest: +SKIP
        ['capture_first_call', 'capture_jitted_vs_functional', 'capture_steady', 'capture_steady_vs_functional', 'forward_steady', 'sites']
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}.")
    width, positions, blocks, calls, repeats = SIZES[size]
    model = Transformer(width, blocks, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (positions, width))
    probed = instrument(model)
    capture = reap(probed, tag="modules")
    jitted, probed_jitted = nnx.jit(forward), nnx.jit(probed_forward)

    reaped = capture(x)  # compiles; the values check the pair does the same work
    np.testing.assert_allclose(reaped["head"], jitted(model, x), rtol=1e-5, atol=1e-5)
    assert np.array_equal(probed_jitted(model, x), jitted(model, x))

    graphdef, state = nnx.split(model)
    functional = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    steady = _timing.ratio(lambda: capture(x), lambda: jitted(model, x), repeats, calls)[0]
    steady_functional = _timing.ratio(
        lambda: capture(x), lambda: functional(state, x), repeats, calls
    )[0]
    jitted_capture = jax.jit(
        lambda state, x: reap(instrument(nnx.merge(graphdef, state)), tag="modules")(x)
    )
    steady_jitted = _timing.ratio(
        lambda: jitted_capture(state, x), lambda: functional(state, x), repeats, calls
    )[0]
    first = _timing.ratio(
        lambda: reap(instrument(model), tag="modules")(x),
        lambda: nnx.jit(forward)(model, x),
        max(3, repeats // 3),
        setup=jax.clear_caches,
    )[0]
    forward_steady = _timing.ratio(
        lambda: probed_jitted(model, x), lambda: jitted(model, x), repeats, calls
    )[0]
    ratios = {
        "sites": len(reaped),
        "capture_steady": steady,
        "capture_steady_vs_functional": steady_functional,
        "capture_jitted_vs_functional": steady_jitted,
        "capture_first_call": first,
        "forward_steady": forward_steady,
    }
    print(
        f"instrument, {blocks} blocks of width {width} ({size}): "
        + ", ".join(f"{k} {v:.3g}" for k, v in ratios.items())
    )
    return ratios


def section(ratios, size):
    """This benchmark's part of docs/benchmarks.md."""
    width, positions, blocks, _, _ = SIZES[size]
    return [
        HEADING,
        "",
        f"`benchmarks/bench_instrument.py` at size `{size}`: a pre-norm NNX transformer "
        f"({blocks} blocks of `nnx.MultiHeadAttention` and an MLP, width {width}, {positions} positions)",
        f"with no `sow` in it, instrumented whole: {ratios['sites']} submodule outputs become sites. "
        "Ratios of medians, ours over the `nnx.jit` forward, timed interleaved.",
        "",
        "| measure | ours | reference | ratio |",
        "|---|---|---|---|",
        f"| capture, steady | `reap(instrument(model))(x)`, all sites | `nnx.jit(forward)(model, x)` | {ratios['capture_steady']:.3f} |",
        f"| capture, steady | `reap(instrument(model))(x)` | `jax.jit` of the functional forward on `nnx.split` state | {ratios['capture_steady_vs_functional']:.3f} |",
        f"| capture, steady, inside `jax.jit` | `reap(instrument(nnx.merge(graphdef, state)))(x)` | the functional forward | {ratios['capture_jitted_vs_functional']:.3f} |",
        f"| capture, first call | `reap(instrument(model))(x)` after `jax.clear_caches()` | `nnx.jit(forward)(model, x)` likewise | {ratios['capture_first_call']:.3f} |",
        f"| forward, steady | `nnx.jit` of the instrumented forward | `nnx.jit` of the forward | {ratios['forward_steady']:.3f} |",
        "",
        "`nnx.jit` walks the model's graph in Python on every call, which a cached `reap`",
        "does not (it checks the split it kept and hands the state's arrays to one `jax.jit`),",
        "so against `nnx.jit` the capture comes out faster. Against the functional `jax.jit`",
        "forward, the eager capture pays that check (every attribute of every submodule, by",
        "identity) and one output buffer per site per call; inside `jax.jit` that Python",
        "is gone and the capture costs what the forward costs, every submodule's output",
        "included. The instrumented forward compiles to the model's own program (its sows",
        "carry no effect and lower to nothing), so its ratio is 1 up to noise. The first call",
        "traces the model, walks the jaxpr and compiles, against one trace and compile.",
    ]


def write(lines, doc=DOC):
    """Replaces this section of `doc` (or appends it before 'Reading the numbers')."""
    text = doc.read_text()
    block = "\n".join(lines) + "\n\n"
    pattern = re.compile(re.escape(HEADING) + r"\n.*?(?=^## )", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.replace("## Reading the numbers", block + "## Reading the numbers")
    doc.write_text(text)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--write"]
    size = args[0] if args else "small"
    lines = section(run(size), size)
    print("\n".join(lines))
    if "--write" in sys.argv:
        write(lines)
        print(f"Wrote {DOC}")
