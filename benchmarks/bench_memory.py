"""What a full reap costs in memory, and what a fresh lambda plant costs per call.

Memory: a residual MLP sowing every layer's output, run in a fresh process per
variant (the bare forward, a full `reap`, a `reap` with a one-site
`names=`, and a hand-written `jax.jit` returning the same intermediates),
with the default allocator and no trimming, as a user runs it. Two ways:

* as a user sees it: resident memory after the first call (compile included),
  the result held, over the process's resident memory before it;
* the peak of a second call, sampled from a thread every ~0.2 ms, over the
  resident memory just before it.

Each is reported as (variant - bare forward) / the reaped bytes, the bytes
being `sites(f)(...).nbytes()`: 1.0 means a full reap costs exactly what it
returns.

Plants: `plant(f)({"h": lambda o: o + d}, x)` with a fresh lambda and a new
`d` every call (the documented intervention idiom) against the same edit
passed as an array, timed interleaved; and resident memory over a loop of
fresh-lambda calls, which must stay flat.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import jax.numpy as jnp

from harvest import plant, sow

from . import _timing

MEMORY_TARGET = 1.2  # (reap - bare) / reaped bytes
PLANT_TARGET = 3.0  # fresh lambda / array plant, per call
VARIANTS = ("bare", "reap", "reap_one_site", "hand")
NNX_VARIANTS = ("nnx_bare", "nnx_instrumented")  # each against the first of its group


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 16
    width: int = 512
    batch: int = 4096  # each layer's output is batch * width * 4 bytes (8 MiB)
    plant_shape: tuple = (64, 128)  # small: the per-call cost is harvest's, not the math's
    plant_repeats: int = 15
    plant_calls: int = 20
    loop_calls: int = 2000  # fresh-lambda calls whose resident memory must stay flat


QUICK = Config(
    layers=2, width=8, batch=4, plant_shape=(4, 8), plant_repeats=2, plant_calls=2, loop_calls=20
)


# The child process: one variant, measured both ways; prints one JSON line.
_CHILD = r"""
import gc, json, os, sys, threading, time
import jax, jax.numpy as jnp
from harvest import reap, sites, sow

layers, width, batch, variant = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
page = os.sysconf("SC_PAGE_SIZE")

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def f(ws, x):
    for i, w in enumerate(ws):
        x = x + sow(jnp.tanh(x @ w), name=f"layer{i}", mode="strict")
    return x.sum()

def hand(ws, x):
    hs = {}
    for i, w in enumerate(ws):
        hs[f"layer{i}"] = h = jnp.tanh(x @ w)
        x = x + h
    return x.sum(), hs

ws = [jnp.full((width, width), 1.0 / width) for _ in range(layers)]
x = jnp.ones((batch, width))
if variant.startswith("nnx"):  # an instrumented NNX model's module sites
    from flax import nnx
    from harvest import instrument

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.linear(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            for i in range(layers):  # attributes, not nnx.List: every flax 0.12
                setattr(self, f"block{i}", Block(rngs))

        def __call__(self, x):
            for i in range(layers):
                x = getattr(self, f"block{i}")(x)
            return x.sum()

    model = Net(nnx.Rngs(0))
    graph, state = nnx.split(model)
    bare = jax.jit(lambda state, x: nnx.merge(graph, state)(x))
    probed = reap(instrument(model), tag="modules")
    run = {"nnx_bare": lambda ws, x: bare(state, x), "nnx_instrumented": lambda ws, x: probed(x)}[variant]
    reaped = sites(instrument(model), tag="modules")(x).nbytes()
else:
    run = {
        "bare": jax.jit(f),
        "reap": reap(f),
        "reap_one_site": reap(f, names=["layer0"]),
        "hand": jax.jit(hand),
    }[variant]
    reaped = sites(f)(ws, x).nbytes()

class Peak:
    def __enter__(self):
        self.top, self.done = resident(), False
        self.thread = threading.Thread(target=self.sample)
        self.thread.start()
        return self
    def sample(self):
        while not self.done:
            self.top = max(self.top, resident())
            time.sleep(0.0002)
    def __exit__(self, *exc):
        self.done = True
        self.thread.join()

gc.collect()
before = resident()
out = jax.block_until_ready(run(ws, x))
held = resident() - before
del out
gc.collect()
start = resident()
with Peak() as peak:
    out = jax.block_until_ready(run(ws, x))
print(json.dumps(dict(held=held, peak=peak.top - start, reaped=reaped)))
"""


def _child(variant, cfg):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cfg.layers), str(cfg.width), str(cfg.batch), variant],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=root,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(cfg):
    """Per variant: bytes held after a first call and a second call's peak, each over
    what it was before, and both over the bare forward per reaped byte."""
    groups = [VARIANTS] + ([NNX_VARIANTS] if importlib.util.find_spec("flax") else [])
    rows = []
    for group in groups:
        got = {v: _child(v, cfg) for v in group}
        base = got[group[0]]
        for v in group:
            rows.append(
                dict(
                    variant=v,
                    reaped=got[v]["reaped"],
                    held=got[v]["held"],
                    peak=got[v]["peak"],
                    held_ratio=(got[v]["held"] - base["held"]) / got[v]["reaped"],
                    peak_ratio=(got[v]["peak"] - base["peak"]) / got[v]["reaped"],
                )
            )
    return dict(reaped=rows[0]["reaped"], rows=rows)


def _resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plants(cfg):
    """A fresh lambda plant vs the same edit as an array, per call; resident growth
    over `loop_calls` fresh-lambda calls."""

    def f(x):
        return sow(jnp.tanh(x), name="h", mode="strict").sum()

    g, x = plant(f), jnp.ones(cfg.plant_shape)
    deltas = [jnp.full(x.shape, float(i)) for i in range(8)]
    edited = [jnp.tanh(x) + d for d in deltas]  # the same edits, as arrays
    state = {"i": 0}

    def fresh_lambda():
        d = deltas[state["i"] % 8]
        state["i"] += 1
        return g({"h": lambda o: o + d}, x)

    def as_array():
        new = edited[state["i"] % 8]
        state["i"] += 1
        return g({"h": new}, x)

    _timing.block((fresh_lambda(), as_array()))
    ratio, ours, theirs = _timing.ratio(fresh_lambda, as_array, cfg.plant_repeats, cfg.plant_calls)
    for _ in range(min(50, cfg.loop_calls)):
        _timing.block(fresh_lambda())
    before = _resident()
    for _ in range(cfg.loop_calls):
        _timing.block(fresh_lambda())
    return dict(ratio=ratio, ours=ours, theirs=theirs, grown=_resident() - before)


def run(cfg: Config = Config()):
    """Both measurements at the sizes of `cfg`."""
    return dict(config=cfg, memory=memory(cfg), plants=plants(cfg))


_NAMES = {
    "bare": "bare forward (`jax.jit(f)`)",
    "reap": "full `reap(f)`",
    "reap_one_site": "`reap(f, names=['layer0'])`",
    "hand": "hand-written `jax.jit` returning every layer",
    "nnx_bare": "NNX model, bare (`jax.jit` of the split forward)",
    "nnx_instrumented": "NNX model, `reap(instrument(model), tag='modules')`",
}


def render(results):
    """The section of docs/benchmarks.md, from `run`'s results."""
    cfg, mem, pl = results["config"], results["memory"], results["plants"]
    mib = 2**20
    full = next(r for r in mem["rows"] if r["variant"] == "reap")
    verdict = "met" if full["held_ratio"] <= MEMORY_TARGET else "**missed**"
    lines = [
        "## Memory of a full reap, and fresh lambda plants",
        "",
        f"A residual MLP of {cfg.layers} layers (width {cfg.width}, batch {cfg.batch}), every",
        f"layer's output sown: a full reap returns {mem['reaped'] / mib:.1f} MiB",
        "(`sites(f)(...).nbytes()`). Each variant runs in a fresh process, default allocator, no",
        "trimming. *held*: resident memory after the first call (compile included), the result",
        "held, over the process before it, as a user sees it. *peak*: a second call's peak,",
        "sampled from a thread, over the resident memory just before it. The ratios are",
        "(variant - bare forward) / a full reap's bytes: 1.0 is exactly the reaped bytes.",
        "",
        "The same blocks as an NNX model, `instrument`-ed, reaping every module's output",
        "(`tag='modules'`), are measured against the NNX model's bare jitted forward.",
        "",
        "| variant | reaped (MiB) | held (MiB) | peak (MiB) | held over bare / reaped | peak over bare / reaped |",
        "|---|---|---|---|---|---|",
        *(
            f"| {_NAMES[r['variant']]} | {r['reaped'] / mib:.1f} | {r['held'] / mib:.1f} "
            f"| {r['peak'] / mib:.1f} | {r['held_ratio']:.2f} | {r['peak_ratio']:.2f} |"
            for r in mem["rows"]
        ),
        "",
        f"Target: a full reap's held memory over the bare forward ≤{MEMORY_TARGET}x the reaped "
        f"bytes: {full['held_ratio']:.2f} ({verdict}).",
        "",
        "`plant(f)({'h': lambda o: o + d}, x)` with a fresh lambda and a new `d` every call, vs",
        "the same edit passed as an array (interleaved, ratio of medians), and resident memory",
        f"over {cfg.loop_calls} more fresh-lambda calls:",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| fresh lambda / array plant, per call | {pl['ratio']:.2f} "
        f"({1e3 * pl['ours']:.2f} vs {1e3 * pl['theirs']:.2f} ms) | ≤{PLANT_TARGET} "
        f"({'met' if pl['ratio'] <= PLANT_TARGET else '**missed**'}) |",
        f"| resident growth over {cfg.loop_calls} calls | {pl['grown'] / mib:.1f} MiB | flat |",
    ]
    return lines
