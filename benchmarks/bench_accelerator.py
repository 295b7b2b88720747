"""On an accelerator: harvest on the backend JAX picks (a TPU, where one is lent).

    python -m benchmarks --only accelerator [--quick]

Run where JAX's default backend is an accelerator; `make bench` on a CPU keeps
the section the page already has (CI has no accelerator). Each pair is timed
interleaved in one run, ratio of medians (ours over the reference):

* capture of a GPT-2-small-sized transformer written in JAX (12 blocks, width
  768, 12 heads, 1,024 positions, batch 4), every block's residual stream and
  attention pattern sown: `jax.jit(reap(f))` vs the same forward threaded by
  hand to return the same arrays (same values, bit for bit, checked), and vs
  the bare forward (returning the patterns costs the same either way);
* `instrument` of an NNX transformer of that width: every submodule's output,
  under `jax.jit`, vs the forward threaded by hand to return the same outputs;
* the repeated and the first `patching_sweep` over every (block, position) vs
  a hand-written `jax.jit(jax.vmap(...))` of the same patches (bench_retrace's);
* `store.record` of two residual sites vs the jitted forward returning them,
  each batch's arrays brought to the host with `jax.device_get`;
* eager call overhead: `reap(instrument(model))(x)` called again and again vs
  `jax.jit` of the functional forward, and vs `nnx.jit` (bench_retrace's).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harvest import instrument, reap, sow

from . import _timing, bench_retrace

HEADING = "## On an accelerator"


@dataclasses.dataclass(frozen=True)
class Config:
    blocks: int = 12
    width: int = 768
    heads: int = 12
    positions: int = 1024
    batch: int = 4
    repeats: int = 7
    calls: int = 5
    store_batches: int = 8


QUICK = Config(
    blocks=2, width=16, heads=2, positions=8, batch=2, repeats=1, calls=1, store_batches=2
)


def _params(cfg):
    keys = iter(jax.random.split(jax.random.key(0), 4 * cfg.blocks + 1))
    d = cfg.width

    def w(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[0])

    layers = [
        {"qkv": w((d, 3 * d)), "out": w((d, d)), "up": w((d, 4 * d)), "down": w((4 * d, d))}
        for _ in range(cfg.blocks)
    ]
    return {"layers": layers, "head": w((d, 256))}


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _block(layer, x, heads, keep):
    """One pre-norm block; `keep(name, value)` is where the capture reads."""
    b, t, d = x.shape
    q, k, v = jnp.split(_norm(x) @ layer["qkv"], 3, -1)
    split = lambda a: a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    pattern = keep("pattern", jax.nn.softmax(jnp.where(causal, scores, -1e9), -1))
    z = (pattern @ split(v)).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + z @ layer["out"]
    return keep("resid", x + jax.nn.gelu(_norm(x) @ layer["up"]) @ layer["down"])


def _gpt(params, x, heads, keep):
    for i, layer in enumerate(params["layers"]):
        x = _block(layer, x, heads, lambda name, v, i=i: keep(f"{name}{i}", v))
    return x @ params["head"]


def gpt_pair(cfg):
    """(sown forward, hand-threaded forward, bare forward) of the GPT-2-sized model."""

    def sown(params, x):
        return _gpt(params, x, cfg.heads, lambda n, v: sow(v, name=n, mode="strict"))

    def hand(params, x):
        kept = {}

        def keep(name, value):
            kept[name] = value
            return value

        _gpt(params, x, cfg.heads, keep)
        return kept

    def bare(params, x):
        return _gpt(params, x, cfg.heads, lambda n, v: v)

    return sown, hand, bare


def _row(measure, reference, timing):
    ratio, ours, theirs = timing
    return dict(measure=measure, reference=reference, ratio=ratio, ours=ours, theirs=theirs)


def capture(cfg):
    sown, hand, bare = gpt_pair(cfg)
    params = _params(cfg)
    x = jax.random.normal(jax.random.key(1), (cfg.batch, cfg.positions, cfg.width))
    ours, theirs, alone = jax.jit(reap(sown)), jax.jit(hand), jax.jit(bare)
    got, want = ours(params, x), theirs(params, x)
    _timing.block(alone(params, x))
    assert list(got) == list(want)
    assert all(np.array_equal(got[k], want[k]) for k in want), "not bitwise equal"
    same_hlo = (
        ours.lower(params, x).compile().as_text() == theirs.lower(params, x).compile().as_text()
    )
    patterns = sum(v.nbytes for k, v in got.items() if k.startswith("pattern")) / 2**30
    run = lambda f: lambda: f(params, x)  # noqa: E731
    rows = [
        _row(
            f"`jax.jit(reap(f))`, {cfg.blocks} blocks, d={cfg.width}, every residual and pattern",
            "the forward threaded by hand (same values, bitwise)"
            + ("; same compiled program" if same_hlo else ""),
            _timing.ratio(run(ours), run(theirs), cfg.repeats, cfg.calls),
        ),
        _row(
            f"the same capture ({patterns:.2f} GiB of attention patterns returned)",
            "the bare forward",
            _timing.ratio(run(ours), run(alone), cfg.repeats, cfg.calls),
        ),
        _row(
            "the hand-threaded forward, the same arrays returned",
            "the bare forward",
            _timing.ratio(run(theirs), run(alone), cfg.repeats, cfg.calls),
        ),
    ]
    return rows


class _Block(nnx.Module):
    def __init__(self, width, heads, rngs):
        self.ln = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.down(jax.nn.gelu(self.up(x)))


class _Model(nnx.Module):
    def __init__(self, cfg, rngs):
        self.blocks = nnx.List([_Block(cfg.width, cfg.heads, rngs) for _ in range(cfg.blocks)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def instrumented(cfg):
    model = _Model(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (cfg.batch, cfg.positions // 4, cfg.width))
    graphdef, state = nnx.split(model)

    @jax.jit
    def ours(state, x):
        return reap(instrument(nnx.merge(graphdef, state)), tag="modules")(x)

    @jax.jit
    def theirs(state, x):
        m, kept = nnx.merge(graphdef, state), {}
        for i, block in enumerate(m.blocks):
            p = f"blocks.{i}"
            h = kept[p + ".ln"] = block.ln(x)
            q = kept[p + ".attn.query"] = block.attn.query(h)
            k = kept[p + ".attn.key"] = block.attn.key(h)
            v = kept[p + ".attn.value"] = block.attn.value(h)
            a = kept[p + ".attn.out"] = block.attn.out(nnx.dot_product_attention(q, k, v))
            kept[p + ".attn"] = a
            x = x + a
            u = kept[p + ".up"] = block.up(x)
            dn = kept[p + ".down"] = block.down(jax.nn.gelu(u))
            x = kept[p] = x + dn
        return kept

    got, want = ours(state, x), theirs(state, x)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
    return [
        _row(
            f"`jax.jit(reap(instrument(model)))`, NNX, {cfg.blocks} blocks, every submodule",
            "the NNX forward threaded by hand",
            _timing.ratio(lambda: ours(state, x), lambda: theirs(state, x), cfg.repeats, cfg.calls),
        )
    ]


def recorded(cfg):
    from harvest import store

    from .bench_store import _namespace

    space = _namespace()
    width, depth = min(cfg.width, 512), 4
    model = space["make_model"](width, depth)
    batches = list(space["token_batches"](cfg.store_batches, cfg.batch, cfg.positions // 4))
    names = space["NAMES"]
    graphdef, state = nnx.split(model.target)

    @jax.jit
    def forward(state, tokens):
        return reap(instrument(nnx.merge(graphdef, state)), tag="modules", names=names)(tokens)

    def by_hand():
        for tokens in batches:
            jax.device_get(forward(state, tokens))

    folder = tempfile.TemporaryDirectory()
    runs = iter(range(10**6))

    def ours():
        store.record(
            model,
            batches,
            f"{folder.name}/{next(runs)}",
            tag="modules",
            names=names,
            rows="tokens",
            progress=False,
        )

    ours()
    by_hand()
    return [
        _row(
            f"`store.record` of {len(names)} residual sites, {len(batches)} batches",
            "the jitted forward + `jax.device_get` of the same arrays",
            _timing.ratio(ours, by_hand, max(3, cfg.repeats // 2)),
        )
    ]


def run(cfg: Config = Config()) -> list[dict]:
    """Every row of this section, on JAX's default backend.

    Example:
        >>> rows = run(QUICK)  # doctest: +SKIP
    """
    retrace = bench_retrace.Config(
        blocks=cfg.blocks,
        tiny_width=min(cfg.width, 256),
        wide_width=min(cfg.width, 256),
        positions=min(cfg.positions, 64),
        repeats=cfg.repeats,
        calls=cfg.calls,
        first_repeats=1,
    )
    rows = [*capture(cfg), *instrumented(cfg), *bench_retrace.sweeps(retrace)]
    rows += recorded(cfg)
    rows += bench_retrace.eager(retrace.tiny_width, retrace)
    device = jax.devices()[0]
    return [
        {"device": f"{device.device_kind} ({jax.default_backend()}), JAX {jax.__version__}"},
        *rows,
    ]


def render(rows: list[dict]) -> list[str]:
    """The section of docs/benchmarks.md, from `run`'s rows."""
    device, rows = rows[0]["device"], rows[1:]
    return [
        HEADING,
        "",
        f"One run of `python -m benchmarks --only accelerator` on {device}. `make bench` on a",
        "CPU keeps this section as it is (CI has no accelerator). Ratios of medians, timed",
        "interleaved; see `benchmarks/bench_accelerator.py` for what each row runs. Returning",
        "the attention patterns costs what it costs hand-written code: compare the second and",
        "third rows against the bare forward.",
        "",
        "| measure | reference | ours (ms) | reference (ms) | ratio |",
        "|---|---|---|---|---|",
        *(
            f"| {r['measure']} | {r['reference']} | {1000 * r['ours']:.3g} | "
            f"{1000 * r['theirs']:.3g} | {r['ratio']:.3f} |"
            for r in rows
        ),
    ]
