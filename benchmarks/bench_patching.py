"""The compiled patching sweep against Python loops of `plant` calls, compile time included.

    python -m benchmarks.bench_patching [tiny|small|full]

`ablation_sweep` is timed against the same zero-ablations written by hand as one
`jax.jit(jax.vmap(...))` over one-hot selections.

Both loops patch one (layer, position) per `plant` call, on the same model and
data as the sweep. The "naive" loop plants a fresh lambda each time, as one
would write it by hand, so every call traces and compiles; the "cached" loop
plants `patch_positions` interventions, whose arrays are arguments, so it
compiles once per layer and then only dispatches.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from harvest import (
    ablation_sweep,
    attribution_patching,
    patch_positions,
    patching_sweep,
    plant,
    reap,
    sow,
)

SIZES = {  # layers, positions, width, batch
    "tiny": (2, 3, 8, 2),
    "small": (4, 8, 32, 8),
    "full": (6, 16, 64, 16),
}


def _weights(layers, positions, width):
    keys = jax.random.split(jax.random.key(0), 2 * layers + 1)
    mixes = [
        jnp.tril(jax.random.normal(k, (positions, positions))) / positions for k in keys[:layers]
    ]
    weights = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[layers:-1]]
    return mixes, weights, jax.random.normal(keys[-1], (width,))


def make_model(layers, positions, width):
    mixes, weights, readout = _weights(layers, positions, width)

    def model(x):  # [batch, positions, width] -> [batch]
        for i, (mix, w) in enumerate(zip(mixes, weights)):
            x = x + jnp.tanh(jnp.einsum("qk,bkd,de->bqe", mix, x, w))
            x = sow(x, name=f"layer{i}", mode="strict")
        return x[:, -1] @ readout

    return model


def metric(out):
    return jnp.mean(out)


def _timed(fn):
    jax.clear_caches()  # every contender pays its own compiles
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _repeat(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def run(size="small"):
    """Times the sweep and both loops at `size`; prints and returns the speed-up ratios.

    Example:
        >>> ratios = run("tiny")  # doctest: +SKIP
        >>> sorted(ratios)  # doctest: +SKIP
        ['sweep_vs_cached_loop', 'sweep_vs_naive_loop']
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}.")
    layers, positions, width, batch = SIZES[size]
    model = make_model(layers, positions, width)
    k1, k2 = jax.random.split(jax.random.key(1))
    x_clean = jax.random.normal(k1, (batch, positions, width))
    x_corrupt = jax.random.normal(k2, (batch, positions, width))
    clean = reap(model)(x_clean)
    names = [f"layer{i}" for i in range(layers)]

    def sweep():
        return patching_sweep(model, clean, (x_corrupt,), metric, names=names, axis=1).values

    def naive_loop():
        out = []
        for name in names:
            for p in range(positions):
                patch = lambda old, c=clean[name], p=p: old.at[:, p].set(c[:, p])  # noqa: E731
                out.append(metric(plant(model)({name: patch}, x_corrupt)))
        return jnp.stack(out)

    def cached_loop():
        out = []
        for name in names:
            for p in range(positions):
                patch = patch_positions(clean[name], p, axis=1)
                out.append(metric(plant(model)({name: patch}, x_corrupt)))
        return jnp.stack(out)

    baseline = metric(model(x_corrupt))
    np.testing.assert_allclose(sweep().ravel(), naive_loop() - baseline, rtol=1e-4, atol=1e-5)
    seconds = {
        "sweep": _timed(sweep),
        "naive_loop": _timed(naive_loop),
        "cached_loop": _timed(cached_loop),
    }
    ratios = {
        "sweep_vs_naive_loop": seconds["naive_loop"] / seconds["sweep"],
        "sweep_vs_cached_loop": seconds["cached_loop"] / seconds["sweep"],
    }

    def attribution():
        return attribution_patching(model, clean, (x_corrupt,), metric, names=names, axis=1).values

    # A repeated call (same function, names, axis, shapes; new data) reuses the compiled program.
    x_other = x_corrupt * 0.5
    for name, call in [("sweep", sweep), ("attribution", attribution)]:
        first = _timed(call)
        x_corrupt = x_other  # the closures read it at call time: a second call on other data
        again = min(_repeat(call) for _ in range(3))
        ratios[f"{name}_first_call_vs_second"] = first / again
    ratios["nnx_module_sweep_first_call_vs_second"] = _module_reuse(layers, positions, width, batch)
    ratios.update(_ablation(layers, positions, width, x_corrupt))
    print(
        f"patching sweep, {layers} layers x {positions} positions ({size}): "
        + ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
        + " | "
        + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
    )
    return ratios


def _ablation(layers, positions, width, x):
    """`ablation_sweep` (zero, every (layer, position)) against the same ablations written
    by hand as one `jit(vmap)` over one-hot selections: a first call (compile included)
    and a repeated one on new data, each the hand-written time over harvest's."""
    mixes, weights, readout = _weights(layers, positions, width)
    model = make_model(layers, positions, width)
    names = [f"layer{i}" for i in range(layers)]

    @jax.jit
    def by_hand(x):
        def ablated(k):  # zero layer k // positions's output at position k % positions
            h = x
            for i, (mix, w) in enumerate(zip(mixes, weights)):
                h = h + jnp.tanh(jnp.einsum("qk,bkd,de->bqe", mix, h, w))
                hit = (k // positions == i) & (jnp.arange(positions) == k % positions)
                h = jnp.where(hit[None, :, None], 0.0, h)
            return metric(h[:, -1] @ readout)

        return jax.vmap(ablated)(jnp.arange(layers * positions)) - metric(model(x))

    def sweep():
        return ablation_sweep(model, (x,), metric, names=names, axis=1).values

    np.testing.assert_allclose(sweep().ravel(), by_hand(x), rtol=1e-4, atol=1e-5)
    first = {"hand": _timed(lambda: by_hand(x)), "harvest": _timed(sweep)}
    x = x * 0.5  # new data: both only run
    again = {
        "hand": min(_repeat(lambda: by_hand(x)) for _ in range(3)),
        "harvest": min(_repeat(sweep) for _ in range(3)),
    }
    return {
        "hand_jit_vmap_ablation_vs_ablation_sweep_first_call": first["hand"] / first["harvest"],
        "hand_jit_vmap_ablation_vs_ablation_sweep_repeated": again["hand"] / again["harvest"],
    }


def _module_reuse(layers, positions, width, batch):
    """A sweep of an NNX module: a first call over a second after a weight changed in place."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            keys = jax.random.split(jax.random.key(0), layers + 1)
            self.weights = nnx.List(
                [
                    nnx.Param(jax.random.normal(k, (width, width)) / np.sqrt(width))
                    for k in keys[:-1]
                ]
            )
            self.readout = nnx.Param(jax.random.normal(keys[-1], (width,)))

        def __call__(self, x):
            for i, w in enumerate(self.weights):
                x = sow(x + jnp.tanh(x @ w[...]), name=f"layer{i}", mode="strict")
            return x[:, -1] @ self.readout[...]

    model = Model()
    x_clean, x_corrupt = jax.random.normal(jax.random.key(1), (2, batch, positions, width))
    clean = reap(model)(x_clean)

    def sweep():
        return patching_sweep(model, clean, (x_corrupt,), metric, axis=1).values

    first = _timed(sweep)
    again = []
    for _ in range(3):
        model.weights[0][...] = (
            model.weights[0][...] * 1.01
        )  # trained in place: read, not recompiled
        again.append(_repeat(sweep))
    return first / min(again)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "small")
