"""Capture under a sharded `jax.jit` on 8 devices, against the hand-threaded function.

    python -m benchmarks --only devices [--quick]

XLA's device count is fixed when JAX starts, so the measurement runs in a
subprocess with 8 forced host (CPU) devices. The model is `bench_core`'s
residual MLP, every layer's output sown, its batch sharded over the 8 devices
and its weights replicated: `jax.jit(reap(f))` against a hand-written
`jax.jit` function returning the same intermediates, steady (ratio of medians,
timed interleaved), with the compiled programs' XLA operations compared
(collectives included) and each output's sharding checked to be the
hand-written one's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

DEVICES = 8


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 8
    width: int = 256
    batch: int = 512
    repeats: int = 9
    calls: int = 20


QUICK = Config(layers=2, width=8, batch=16, repeats=1, calls=1)


def measure(cfg: Config) -> dict:
    """Runs in the subprocess: the comparison on this process's devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from harvest import reap

    from . import _timing, bench_core

    mesh = jax.make_mesh((len(jax.devices()),), ("batch",))
    f, hand = bench_core.unrolled()
    ws, x = bench_core.inputs("unrolled", cfg.layers, cfg.width, cfg.batch)
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("batch")))
    ws = jax.device_put(ws, NamedSharding(mesh, PartitionSpec()))
    ours, theirs = jax.jit(reap(f)), jax.jit(hand)
    got, want = ours(ws, x), theirs(ws, x)
    same_sharding = True
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        same_sharding &= a.sharding.is_equivalent_to(b.sharding, a.ndim)
    ratio, ours_s, theirs_s = _timing.ratio(
        lambda: ours(ws, x), lambda: theirs(ws, x), cfg.repeats, cfg.calls
    )
    ops_ours, ops_theirs = bench_core._ops(ours, (ws, x)), bench_core._ops(theirs, (ws, x))
    diff = [f"+{n} {op}" for op, n in sorted((ops_ours - ops_theirs).items())]
    diff += [f"-{n} {op}" for op, n in sorted((ops_theirs - ops_ours).items())]
    return dict(
        devices=len(jax.devices()),
        ratio=ratio,
        ours=ours_s,
        theirs=theirs_s,
        ops=sum(ops_ours.values()),
        program=", ".join(diff) or "identical",
        same_sharding=bool(same_sharding),
        layers=cfg.layers,
        width=cfg.width,
        batch=cfg.batch,
    )


def run(cfg: Config = Config()) -> dict:
    """`measure(cfg)` in a subprocess with 8 forced host devices; its result."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_devices", json.dumps(dataclasses.asdict(cfg))],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the {DEVICES}-device benchmark failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(row: dict) -> list[str]:
    """The section of docs/benchmarks.md, from `run`'s result."""
    return [
        "## Many devices",
        "",
        f"A residual MLP ({row['layers']} layers, width {row['width']}, batch {row['batch']}), "
        f"every layer's output sown, its batch sharded over {row['devices']} forced host devices",
        "and its weights replicated, in its own process. `jax.jit(reap(f))` vs the",
        "hand-written `jax.jit` function returning the same intermediates, timed interleaved.",
        "",
        "| measure | ours (ms) | hand-written (ms) | ratio | compiled programs | ops | same output shardings |",
        "|---|---|---|---|---|---|---|",
        f"| sharded capture, steady | {1e3 * row['ours']:.3f} | {1e3 * row['theirs']:.3f} "
        f"| {row['ratio']:.3f} | {row['program']} | {row['ops']} "
        f"| {'yes' if row['same_sharding'] else 'no'} |",
    ]


if __name__ == "__main__":
    print(json.dumps(measure(Config(**json.loads(sys.argv[1])))))
