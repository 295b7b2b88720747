"""`python -m harvest`: read a small model's intermediates, then patch one.

The model is a three-layer residual MLP with fixed random weights, built here
so the demonstration needs no downloads. It prints what `reap` found at every
sown site, then how the output moves when `plant` swaps one layer's output for
the same layer's output on another input (activation patching).

The command line is argparse's: ``--help``/``-h`` and ``--version`` exit 0,
an unknown flag or command exits 2, and ``demo`` (the default) runs the demo.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from harvest import __version__, nest, plant, reap, sow


def make_model(key, width=16, depth=3):
    keys = jax.random.split(key, depth + 1)
    layers = [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in keys[:depth]]
    head = jax.random.normal(keys[-1], (width,)) / jnp.sqrt(width)

    def block(w, x):
        pre = sow(x @ w, name="pre", mode="strict")
        return x + sow(jax.nn.gelu(pre), name="mlp_out", mode="strict")

    def model(x):
        for i, w in enumerate(layers):
            x = nest(block, scope=f"layer{i}")(w, x)
        return sow(x @ head, name="logit", mode="strict")

    return model


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def demo():
    model = make_model(jax.random.key(0))
    clean = jax.random.normal(jax.random.key(1), (16,))
    corrupted = -clean

    reaped = reap(model)(clean)
    print("What reap(model)(x) found:")
    print(f"  {'site':<20} {'shape':<8} {'mean':>8} {'std':>8}")
    for name, value in _flatten(reaped):
        print(
            f"  {name:<20} {str(list(value.shape)):<8} {float(value.mean()):>8.3f} {float(value.std()):>8.3f}"
        )

    base = float(model(corrupted))
    print(
        f"\nPatching the clean run's layer outputs into the corrupted run (logit {base:+.3f},"
        f" clean {float(model(clean)):+.3f}):"
    )
    print(f"  {'patched site':<20} {'logit':>8} {'change':>8}")
    for i in range(3):
        site = {f"layer{i}": {"mlp_out": reaped[f"layer{i}"]["mlp_out"]}}
        patched = float(plant(model)(site, corrupted))
        print(f"  layer{i}.mlp_out{'':<6} {patched:>+8.3f} {patched - base:>+8.3f}")


def parser():
    cli = argparse.ArgumentParser(
        prog="python -m harvest",
        description="harvest: tag any value inside any JAX function, then reap it out or "
        "plant a replacement in. With no command, runs the demo.",
    )
    cli.add_argument("--version", action="version", version=f"harvest {__version__}")
    cli.add_argument(
        "command",
        nargs="?",
        default="demo",
        choices=["demo"],
        help="demo (the default): read a small residual MLP's intermediates with reap, "
        "then patch one layer at a time with plant",
    )
    return cli


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "demo":
        demo()


if __name__ == "__main__":
    main()
