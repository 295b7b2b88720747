"""`harvest.store`: recording activations over a dataset, and reading them back.

    python -m benchmarks --only store [--quick]

Four comparisons, each measured side by side in one run:

* record vs forward: `store.record` of two residual-stream sites of an NNX
  model over a list of token batches, against the bare jitted forward
  (`nnx.jit`) over the same batches; timings interleaved, ratio of medians,
  in wall time and in the process's CPU time (steadier on a loaded machine);
* write rate vs disk: the activation bytes `record` wrote per second, against
  the same number of bytes written by plain `write` + `fsync` calls to files
  of one chunk each (what the disk takes, without TensorStore or JAX); and the
  write path alone: `record` of those same rows under a function that only
  sows its input, interleaved with the plain writes;
* peak RSS: a fresh process records N batches from a generator, for two N;
  its peak resident memory above what it held before `record`, over the bytes
  of one batch's recorded activations, must not grow with N;
* read rate vs TensorStore and vs disk: `store.batches` over every row
  (shuffled, one epoch per seed; and in order), against TensorStore's own
  `read()` of every chunk of the same arrays (all reads in flight at once,
  chunk files mapped as the store's reader maps them: the library the store
  reads through at its fastest, into fresh arrays, unshuffled), and against
  reading the store's chunk files whole with plain `read` calls; after one
  untimed epoch, interleaved, medians.

Both sides of each write `fsync` every chunk file (TensorStore's default);
both sides of each read come from the page cache (the store was just written).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

TARGET = 1.1  # record over the bare forward


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 128
    depth: int = 4
    batch: int = 16
    positions: int = 128
    batches: int = 40
    repeats: int = 5
    rss_batches: tuple[int, int] = (20, 160)


QUICK = Config(width=16, depth=4, batch=4, positions=8, batches=4, repeats=1, rss_batches=(2, 4))

NAMES = ["blocks.1", "blocks.3"]

# The model and data, as source: the RSS runs execute it in fresh processes.
MODEL = """
import jax, numpy as np
from flax import nnx
from harvest import instrument


class Block(nnx.Module):
    def __init__(self, width, rngs):
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Model(nnx.Module):
    def __init__(self, width, depth, rngs):
        self.embed = nnx.Embed(1024, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, rngs) for _ in range(depth)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


def make_model(width, depth):
    return instrument(Model(width, depth, nnx.Rngs(0)))


def token_batches(n, batch, positions):
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield rng.integers(0, 1024, (batch, positions), dtype=np.int32)
"""

RSS_CHILD = """
import json, sys, tempfile
from harvest import store
n, width, depth, batch, positions = map(int, sys.argv[1:6])
model = make_model(width, depth)
# Compile first (one batch into a scratch store), so the peak below is record's own.
scratch = tempfile.TemporaryDirectory()  # removed when the process ends
store.record(model, token_batches(1, batch, positions), scratch.name + "/warm", tag="modules",
             names=NAMES, rows="tokens", progress=False)
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
before = status("VmRSS")
store.record(model, token_batches(n, batch, positions), scratch.name + "/run", tag="modules",
             names=NAMES, rows="tokens", progress=False)
print(json.dumps({"before_kib": before, "peak_kib": status("VmHWM")}))
"""


def _namespace():
    namespace = {"NAMES": NAMES}
    exec(compile(MODEL, "bench_store.MODEL", "exec"), namespace)
    return namespace


def _raw_write(directory, chunks):
    """Seconds to write `chunks` (bytes objects) to one file each, each `fsync`ed as
    TensorStore's file driver does by default."""
    directory.mkdir()
    start = time.perf_counter()
    for i, chunk in enumerate(chunks):
        with open(directory / str(i), "wb") as f:
            f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def _raw_read(files):
    start = time.perf_counter()
    total = 0
    for file in files:
        with open(file, "rb") as f:
            total += len(f.read())
    return time.perf_counter() - start, total


def _tensorstore_read(arrays):
    """Seconds for TensorStore to read every chunk of `arrays`, one `read()` each, all in
    flight at once, and the bytes read."""
    start = time.perf_counter()
    futures = []
    for array in arrays:
        chunk = array.chunk_layout.read_chunk.shape[0]
        futures += [array[i : i + chunk].read() for i in range(0, array.shape[0], chunk)]
    total = sum(f.result().nbytes for f in futures)
    return time.perf_counter() - start, total


def _rss(cfg, n):
    script = MODEL + f"NAMES = {NAMES!r}\n" + RSS_CHILD
    root = pathlib.Path(__file__).resolve().parent.parent
    args = [str(v) for v in (n, cfg.width, cfg.depth, cfg.batch, cfg.positions)]
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(cfg: Config = Config()):
    """The section's measurements, as one dict (the stores written are removed)."""
    with tempfile.TemporaryDirectory(prefix="bench_store_") as work:
        return _measure(cfg, pathlib.Path(work))


def _measure(cfg, work):
    import jax
    import tensorstore as ts
    from flax import nnx

    from harvest import sow, store

    ns = _namespace()
    model = ns["make_model"](cfg.width, cfg.depth)
    data = list(ns["token_batches"](cfg.batches, cfg.batch, cfg.positions))
    forward = nnx.jit(lambda m, tokens: m(tokens))

    def bare():
        return [forward(model, tokens) for tokens in data]

    def recorded():
        return store.record(
            model, data, work / "store", tag="modules", names=NAMES, rows="tokens", progress=False
        )

    def fresh():  # each record pass writes a new store; deleting the last one is not timed
        shutil.rmtree(work / "store", ignore_errors=True)

    jax.block_until_ready(bare())  # compile both sides first
    recorded()
    walls, cpus = {"record": [], "forward": []}, {"record": [], "forward": []}
    sides = [("record", recorded), ("forward", lambda: jax.block_until_ready(bare()))]
    for r in range(cfg.repeats):  # interleaved, alternating which side goes first
        for side, fn in sides if r % 2 == 0 else sides[::-1]:
            fresh()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            walls[side].append(time.perf_counter() - wall)
            cpus[side].append(time.process_time() - cpu)
    ours, theirs = statistics.median(walls["record"]), statistics.median(walls["forward"])
    ratio = ours / theirs
    cpu_ratio = statistics.median(cpus["record"]) / statistics.median(cpus["forward"])
    fresh()
    recorded()

    s = store.open(work / "store")
    written = sum(a.dtype.itemsize * int(np.prod(a.shape)) for a in s.values())
    chunk_bytes = written // (len(s) * cfg.batches)
    chunks = [np.random.default_rng(i).bytes(chunk_bytes) for i in range(len(s) * cfg.batches)]
    # The write path alone: `record` of the very rows it wrote, under a function that
    # only sows its input (a copy onto the device and back, no model).
    per_batch = s.manifest.rows_per_batch
    activations = [
        {f"site{k}": s[name][i * per_batch : (i + 1) * per_batch] for k, name in enumerate(s)}
        for i in range(cfg.batches)
    ]

    def sow_all(batch):
        return [sow(x, name=name, mode="strict") for name, x in batch.items()]

    def write_path():
        store.record(sow_all, activations, work / "rows", progress=False)

    write_path()  # compile
    write_paths, raw_writes = [], []
    for _ in range(cfg.repeats):  # interleaved, medians
        for leftover in ("rows", "raw"):
            shutil.rmtree(work / leftover, ignore_errors=True)
        start = time.perf_counter()
        write_path()
        write_paths.append(time.perf_counter() - start)
        raw_writes.append(_raw_write(work / "raw", chunks))
    write_alone, raw_write = statistics.median(write_paths), statistics.median(raw_writes)

    rows_per_batch = 4096 if cfg.batch * cfg.positions >= 4096 else cfg.positions
    keys = [site.key for site in s.manifest.sites.values()]
    files = [p for key in keys for p in (work / "store" / key).glob("c.*")]

    def epoch(seed, shuffle=True):
        batches = s.batches(rows_per_batch, seed=seed, shuffle=shuffle)
        return sum(len(b[NAMES[0]]) for b in batches)

    # The same arrays, opened as the store's reader opens them: chunk files mapped.
    mapped = {"file_io_mode": {"mode": "memmap"}}
    arrays = [
        ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": str(work / "store" / key)},
                "context": mapped,
            }
        ).result()
        for key in keys
    ]
    rows = epoch(0)  # warm: TensorStore's thread pools, the page cache
    _raw_read(files)
    _tensorstore_read(arrays)
    epoch(0, shuffle=False)
    reads, ordered_reads, raw_reads, ts_reads = [], [], [], []
    for seed in range(1, 1 + cfg.repeats):  # interleaved, medians
        start = time.perf_counter()
        epoch(seed)
        reads.append(time.perf_counter() - start)
        start = time.perf_counter()
        epoch(seed, shuffle=False)
        ordered_reads.append(time.perf_counter() - start)
        raw_time, raw_bytes = _raw_read(files)
        raw_reads.append(raw_time)
        ts_time, ts_bytes = _tensorstore_read(arrays)
        ts_reads.append(ts_time)
    read, raw_read = statistics.median(reads), statistics.median(raw_reads)
    ts_read, ordered_read = statistics.median(ts_reads), statistics.median(ordered_reads)

    batch_bytes = written // cfg.batches
    rss = {n: _rss(cfg, n) for n in cfg.rss_batches}
    return {
        "config": cfg,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "record_s": ours,
        "forward_s": theirs,
        "written_mib": written / 2**20,
        "write_mib_s": written / 2**20 / ours,
        "disk_write_mib_s": written / 2**20 / raw_write,
        "write_alone_mib_s": written / 2**20 / write_alone,
        "rows": rows,
        "read_mib_s": written / 2**20 / read,
        "read_rows_s": rows / read,
        "ordered_read_mib_s": written / 2**20 / ordered_read,
        "disk_read_mib_s": raw_bytes / 2**20 / raw_read,
        "tensorstore_read_mib_s": ts_bytes / 2**20 / ts_read,
        "batch_mib": batch_bytes / 2**20,
        "rss": {n: (r["peak_kib"] - r["before_kib"]) * 1024 / batch_bytes for n, r in rss.items()},
        "rss_peak_mib": {n: r["peak_kib"] / 1024 for n, r in rss.items()},
    }


def render(r):
    """The section of docs/benchmarks.md, from `run`'s result."""
    cfg = r["config"]
    verdict = "met" if r["ratio"] <= TARGET else "**missed**"
    (n1, x1), (n2, x2) = sorted(r["rss"].items())
    # Memory held per batch would add one batch's worth per extra batch.
    per_batch = (x2 - x1) / (n2 - n1)
    flat = "flat" if per_batch < 0.1 else "**growing**"
    return [
        "## Activations at dataset scale",
        "",
        f"`harvest.store.record` of an NNX model's residual stream after blocks 1 and 3 (width "
        f"{cfg.width}, {cfg.batch} sequences of {cfg.positions} tokens per batch, one row per "
        f"token: {r['batch_mib']:.1f} MiB of activations per batch), over {cfg.batches} batches "
        "held in memory, against the bare `nnx.jit` forward over the same batches. The write and",
        "read rates sit beside what the disk does with the same bytes through plain `write` +",
        "`fsync` / `read` calls (one file per chunk; TensorStore too `fsync`s each chunk, and",
        "reads come from the page cache, as the store was just written), and the read rate",
        "beside TensorStore's own `read()` of every chunk of the same arrays, all in flight at",
        "once, chunk files mapped into memory as the store's reader maps them (what the library",
        "`batches` reads through does unshuffled, into fresh arrays; `batches` also shuffles).",
        "Peak RSS: a fresh process records N",
        "batches from a generator; its peak resident memory above its memory before `record`,",
        "in units of one batch's activations.",
        "",
        "| measure | harvest | reference | ratio | target |",
        "|---|---|---|---|---|",
        f"| record vs bare forward (s per pass) | {r['record_s']:.3f} | {r['forward_s']:.3f} | "
        f"{r['ratio']:.3f} | ≤{TARGET} ({verdict}) |",
        f"| the same, CPU time of the process (all threads) | | | {r['cpu_ratio']:.3f} | — |",
        f"| write rate (MiB/s): record vs plain writes | {r['write_mib_s']:.0f} | "
        f"{r['disk_write_mib_s']:.0f} | {r['write_mib_s'] / r['disk_write_mib_s']:.3f} | — |",
        f"| the write path alone (MiB/s): `record` of the same rows, no model | "
        f"{r['write_alone_mib_s']:.0f} | {r['disk_write_mib_s']:.0f} | "
        f"{r['write_alone_mib_s'] / r['disk_write_mib_s']:.3f} | — |",
        f"| read rate (MiB/s): `batches` vs TensorStore `read()` of every chunk | "
        f"{r['read_mib_s']:.0f} | {r['tensorstore_read_mib_s']:.0f} | "
        f"{r['read_mib_s'] / r['tensorstore_read_mib_s']:.3f} | — |",
        f"| the same, `batches(shuffle=False)` | {r['ordered_read_mib_s']:.0f} | "
        f"{r['tensorstore_read_mib_s']:.0f} | "
        f"{r['ordered_read_mib_s'] / r['tensorstore_read_mib_s']:.3f} | — |",
        f"| read rate (MiB/s): `batches` vs plain reads | {r['read_mib_s']:.0f} | "
        f"{r['disk_read_mib_s']:.0f} | {r['read_mib_s'] / r['disk_read_mib_s']:.3f} | — |",
        f"| peak RSS over one batch's activations, N={n2} vs N={n1} | {x2:.1f} | {x1:.1f} | "
        f"{x2 / max(x1, 1e-9):.2f} | {flat}: {per_batch:+.3f} batches per extra batch |",
        "",
        f"`batches` served {r['read_rows_s']:,.0f} rows/s ({r['rows']} rows in batches of up to "
        "4096). The write rate is the recorded bytes over the whole `record` pass, compute "
        "included: when it is far below the disk's, recording is compute-bound and the ratio "
        "against the forward is what it costs. The write path alone is `record` of the same "
        "rows (numpy, one batch's rows per batch) under a function that only sows its input: "
        "TensorStore, the `fsync`s and harvest's bookkeeping, with no model to wait for.",
    ]
