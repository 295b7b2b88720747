"""`python -m harvest`: read a small model's intermediates, then patch one.

The model, a three-layer residual MLP with fixed random weights, needs no
downloads. The demo prints what `reap` found at every sown site, how the output
moves when `plant` patches one layer's output from another input, and why a
patch can move it away from the clean value (measured with `plant`, too).
Arguments are parsed by `_cli.py` (argparse): ``demo`` is the default command.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from harvest import _cli, nest, plant, reap, sow


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
    clean_logit, base = float(model(clean)), float(model(corrupted))

    reaped = reap(model)(clean)
    print("What reap(model)(x) found:")
    print(f"  {'site':<20} {'shape':<8} {'mean':>8} {'std':>8}")
    for name, value in _flatten(reaped):
        print(
            f"  {name:<20} {str(list(value.shape)):<8} {float(value.mean()):>8.3f} {float(value.std()):>8.3f}"
        )

    print(
        f"\nPatching the clean run's layer outputs into the corrupted run (logit {base:+.3f},"
        f" clean {clean_logit:+.3f}):"
    )
    print(f"  {'patched site':<20} {'logit':>8} {'change':>8}")
    for i in range(3):
        site = {f"layer{i}": {"mlp_out": reaped[f"layer{i}"]["mlp_out"]}}
        patched = float(plant(model)(site, corrupted))
        print(f"  layer{i}.mlp_out{'':<6} {patched:>+8.3f} {patched - base:>+8.3f}")

    # Why a patch can move the logit away from the clean value, measured: the skip
    # connections' own path to the logit, which no layer's patch restores.
    no_layers = {f"layer{i}": {"mlp_out": jnp.zeros_like(clean)} for i in range(3)}
    direct_clean = float(plant(model)(no_layers, clean))
    direct_corrupted = float(plant(model)(no_layers, corrupted))
    print(
        "\nWhy a patch can move the logit away from the clean value: a patch swaps one\n"
        "layer's output, but the skip connections carry the input itself to the logit,\n"
        "and that path stays corrupted. With every layer's output planted to zero the\n"
        f"logit is {direct_clean:+.3f} clean and {direct_corrupted:+.3f} corrupted: the input's "
        f"own path makes\n{direct_clean - direct_corrupted:+.3f} of the "
        f"{clean_logit - base:+.3f} gap. The layers add "
        f"{clean_logit - direct_clean:+.3f} in the clean run and\n"
        f"{base - direct_corrupted:+.3f} in the corrupted one, so a clean layer's "
        "output (and what the\nlayers after it compute from it) can lower the logit rather "
        "than raise it."
    )


def main(argv: Sequence[str] | None = None) -> None:
    _cli.parser().parse_args(argv)  # exits on --help, --version and a bad argument
    demo()  # the only command


if __name__ == "__main__":
    main()
