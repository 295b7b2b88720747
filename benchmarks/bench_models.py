"""Third-party models: reaping a Penzai and a Gemma transformer against their jitted forward.

    python -m benchmarks --only models [--quick]

For each model (random weights, built from the library's own config), the
capture is `reap` of `instrument(model, attention=True)` restricted (`names`)
to every block output and every attention hook; the reference is the model's
forward under `jax.jit`. Three ratios of medians, ours over the reference,
each pair timed interleaved in one run:

* steady: the eager capture called again and again (cached), vs the jitted forward
  with the weights as arguments (Penzai: `pz.freeze_variables(model)`, as the capture
  traces them);
* steady, with a flag (Gemma): the same capture of a function taking a Python
  flag too, a static argument of its one `jax.jit`, vs the same jitted forward;
* steady, inside `jax.jit`: the capture jitted, vs the jitted forward taking the weights
  as the capture does (Penzai: closed over, as constants);
* steady, inside `jax.jit`, against the same forward also returning one array per
  reaped site (of its shape, filled from the output): a forward that returns as
  many arrays as the capture;
* first call: both after `jax.clear_caches()` (trace and compile).

The Gemma row is left out, with the reason, where the `gemma` library does not
import (it is not in harvest's test extras).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from harvest import instrument, reap

from . import _timing

HEADING = "## Third-party models: Penzai and Gemma"


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 64
    heads: int = 4
    blocks: int = 4
    positions: int = 32
    calls: int = 20  # back-to-back calls per timing
    repeats: int = 9  # timings per side
    first_repeats: int = 3


QUICK = Config(width=8, heads=2, blocks=1, positions=4, calls=2, repeats=2, first_repeats=1)


def penzai_case(cfg: Config):
    """((forward, forward on closed-over weights), capture, args) for a llama-like Penzai transformer."""
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=cfg.heads,
        query_head_multiplier=1,
        embedding_dim=cfg.width,
        projection_dim=cfg.width // cfg.heads,
        mlp_hidden_dim=4 * cfg.width,
        num_decoder_blocks=cfg.blocks,
        vocab_size=97,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    tokens = pz.nx.wrap(jnp.arange(cfg.positions)[None] % 97, "batch", "seq")
    blocks = [f"body.sublayers.{i + 1}" for i in range(cfg.blocks)]
    probed = instrument(model, attention=True, names=[*blocks, "*.hook_*"])
    frozen = pz.freeze_variables(
        model
    )  # the weights as arguments, as the eager capture traces them
    with_args = jax.jit(lambda m, t: m(t).data_array)
    plain = lambda t: model(t).data_array  # as the jitted capture sees the weights: constants
    closed = jax.jit(plain)
    forwards = (lambda: with_args(frozen, tokens)), (lambda: closed(tokens)), (plain, (tokens,))
    return forwards, reap(probed, tag="modules"), (tokens,), None


def import_gemma():
    """`gemma`'s model API (`gm`, its config and modules), importing with TensorFlow absent.

    `kauldron.typing`, which gemma's modules import, reads `tensorflow.Tensor` at
    import time to build its TensorFlow array aliases, and nothing else of it on
    the way to a model. TensorFlow (1.9 GB) is not in harvest's extras, so while
    gemma is imported a module holding a bare `Tensor` class stands in for it;
    it is taken out of `sys.modules` after, so nothing else sees it. (This patches
    no JAX private: gemma 3.3.0 imports and runs on JAX 0.10.2 as it is.)
    """
    import importlib.util
    import sys
    import types

    stub = None
    if "tensorflow" not in sys.modules and importlib.util.find_spec("tensorflow") is None:
        stub = types.ModuleType("tensorflow")
        stub.Tensor = type("Tensor", (), {})  # type: ignore[attr-defined]
        sys.modules["tensorflow"] = stub
    try:
        from gemma import gm
        from gemma.gm.nn import _config, _modules

        gm.nn.Transformer  # noqa: B018  (gemma's API is imported lazily: load it now)
    finally:
        if stub is not None and sys.modules.get("tensorflow") is stub:
            del sys.modules["tensorflow"]
    return gm, _config, _modules


def gemma_case(cfg: Config):
    """((forward, forward), capture, args) for a tiny Gemma 3 transformer (`gemma` library)."""
    gm, _config, _modules = import_gemma()

    config = _config.TransformerConfig(
        num_embed=97,
        embed_dim=cfg.width,
        hidden_dim=4 * cfg.width,
        num_heads=cfg.heads,
        head_dim=cfg.width // cfg.heads,
        num_kv_heads=cfg.heads,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(_modules.AttentionType.GLOBAL,) * cfg.blocks,
    )
    model = gm.nn.Transformer(config=config, dtype=jnp.float32)
    tokens = jnp.arange(cfg.positions)[None] % 97
    params = model.init(jax.random.key(0), tokens)
    apply = lambda p, t: model.apply(p, t).logits
    blocks = [f"layer_{i}" for i in range(cfg.blocks)]
    probed = instrument(apply, attention=True, names=[*blocks, "*.hook_*"])
    forward = jax.jit(apply)
    # The jitted capture takes params too.
    forwards = (lambda: forward(params, tokens),) * 2 + ((apply, (params, tokens)),)
    flagged = instrument(
        lambda p, t, logits: model.apply(p, t).logits if logits else model.apply(p, t),
        attention=True,
        names=[*blocks, "*.hook_*"],
    )
    own = reap(flagged, tag="modules")
    return (
        forwards,
        reap(probed, tag="modules"),
        (params, tokens),
        lambda: own(params, tokens, True),
    )


CASES = {"penzai": penzai_case, "gemma": gemma_case}


def returning_as_many(plain, args, like):
    """The jitted forward `plain(*args)` also returning one array per leaf of `like`
    (each its shape and dtype, filled from the output): what returning that many
    arrays costs XLA and JAX, with no capture."""
    shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(like)]

    def forward(*args):
        out = plain(*args).ravel()
        return out, [jnp.full(s, out[i % out.size], d) for i, (s, d) in enumerate(shapes)]

    jitted = jax.jit(forward)
    return lambda: jitted(*args)


def measure(name: str, build, cfg: Config) -> dict:
    (forward, forward_closed, (plain, plain_args)), capture, args, own = build(cfg)
    reaped = capture(*args)  # compiles (each side compiles before it is timed)
    _timing.block((forward(), forward_closed()))
    hooks = sum(1 for n in reaped if ".hook_" in n)
    # q, k, v, z and pattern per block, and the scores where the model exposes them (Penzai)
    assert hooks in (5 * cfg.blocks, 6 * cfg.blocks), sorted(reaped)
    jitted = jax.jit(capture)
    np.testing.assert_allclose(
        np.asarray(jax.tree.leaves(jitted(*args))[0]),
        np.asarray(jax.tree.leaves(reaped)[0]),
        1e-5,
        1e-5,
    )
    steady = _timing.ratio(lambda: capture(*args), forward, cfg.repeats, cfg.calls)[0]
    own_path = None
    if own is not None:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, 1e-5, 1e-5), own(), reaped)
        own_path = _timing.ratio(own, forward, cfg.repeats, cfg.calls)[0]
    inside = _timing.ratio(lambda: jitted(*args), forward_closed, cfg.repeats, cfg.calls)[0]
    many = returning_as_many(plain, plain_args, reaped)
    inside_many = _timing.ratio(lambda: jitted(*args), many, cfg.repeats, cfg.calls)[0]
    rebuilt = build(cfg)  # fresh functions for the first call
    first = _timing.ratio(
        lambda: rebuilt[1](*rebuilt[2]), rebuilt[0][0], cfg.first_repeats, setup=jax.clear_caches
    )[0]
    return {
        "model": name,
        "sites": len(reaped),
        "hooks": hooks,
        "steady": steady,
        "steady_own_path": own_path,
        "steady_jit": inside,
        "steady_jit_many": inside_many,
        "first": first,
        "skipped": None,
    }


def run(cfg: Config = Config()) -> list[dict]:
    """Times every model that imports here; a model that does not is a row with the reason."""
    rows = []
    for name, build in CASES.items():
        try:
            rows.append(measure(name, build, cfg))
        except ImportError as error:
            rows.append({"model": name, "skipped": f"does not import here ({error})"})
    for r in rows:
        print(
            f"models, {r['model']}: "
            + (
                r["skipped"]
                or f"steady {r['steady']:.3g}, in jit {r['steady_jit']:.3g} "
                f"({r['steady_jit_many']:.3g} vs as many outputs), first {r['first']:.3g}"
            )
        )
    return rows


def render(rows: list[dict]) -> list[str]:
    lines = [
        HEADING,
        "",
        "`benchmarks/bench_models.py`: `reap` of `instrument(model, attention=True)` restricted to every",
        "block output and every attention hook (`hook_q/k/v/z/pattern`, and `hook_attn_scores` where the model exposes it), against the model's forward",
        "under `jax.jit`. Ratios of medians, ours over the jitted forward, timed interleaved.",
        "",
        "| model | sites (hooks) | steady | steady, with a Python flag | steady, inside `jax.jit` "
        "| inside `jax.jit`, vs the forward returning as many arrays | first call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["skipped"]:
            lines.append(f"| {r['model']} | — | {r['skipped']} | | | | |")
        else:
            own = "—" if r["steady_own_path"] is None else f"{r['steady_own_path']:.3f}"
            lines.append(
                f"| {r['model']} | {r['sites']} ({r['hooks']}) | {r['steady']:.3f} | {own} | "
                f"{r['steady_jit']:.3f} | {r['steady_jit_many']:.3f} | {r['first']:.3f} |"
            )
    lines += [
        "",
        "Eagerly, an instrumented function (Gemma's `model.apply`) is called through one",
        "`jax.jit` the capture keeps, so JAX flattens the `params` and finds the compiled",
        "program in C++; the own-path column is the same capture called with a Python flag",
        "(static to harvest, so JAX's dispatch cannot serve it): harvest flattening and",
        "keying the call in Python, as every eager Linen call did before.",
        "",
        "Eagerly, a Penzai model is handed to the compiled capture as its frozen arrays, kept from",
        "the last call while no variable holds a new value (one identity check per variable, so a",
        "changed parameter is seen); the reference `jax.jit` call flattens the Penzai layer tree in",
        "Python on every call, which is why the eager capture can be the faster one.",
        "",
        "Inside `jax.jit`, the compiled capture is the model's own program (less what only the",
        "logits need) plus its outputs, which is what is left above 1: it returns 24 arrays",
        "where the forward returns one (each an output buffer for XLA and an array for JAX to",
        "hand back), and per hook one copy into the output's layout, as XLA computes q/k/v/z",
        "and the pattern in the layouts the model's einsums want (Gemma's pattern as",
        "`[B, T, N, S]`, its z with the heads first) while an output is row-major in",
        "TransformerLens's axis order. The next column sets it beside the forward returning as",
        "many arrays of the same shapes, each filled from its output (a small computation per",
        "array): the capture's outputs are arrays the model computes anyway, so it costs less.",
    ]
    return lines
