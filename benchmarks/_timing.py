"""Timing helpers shared by the benchmarks, and a description of the machine.

Absolute times on a shared CPU are noise; every benchmark therefore times the
two sides of a comparison interleaved in the same run and reports their
ratio of medians.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax


def block(tree):
    """Waits for every array in `tree`, so a timing covers the computation."""
    return jax.block_until_ready(tree)


def per_call(fn, calls):
    """Mean seconds per call over `calls` back-to-back calls of `fn()`."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    block(out)
    return (time.perf_counter() - start) / calls


def samples(ours, theirs, repeats, calls=1, setup=None):
    """Seconds per call of each side, `repeats` timings each, interleaved.

    Each repeat times `calls` calls of each side after `setup()` (e.g. clearing
    caches), alternating which side goes first so drift hits both equally.
    """
    a, b = [], []
    for r in range(repeats):
        order = [(ours, a), (theirs, b)]
        for fn, out in order if r % 2 == 0 else order[::-1]:
            if setup is not None:
                setup()
            out.append(per_call(fn, calls))
    return a, b


def ratio(ours, theirs, repeats, calls=1, setup=None):
    """Median time of `ours` over median time of `theirs`, interleaved (see `samples`).

    Returns (ratio, median seconds of ours, median seconds of theirs).
    """
    a, b = samples(ours, theirs, repeats, calls, setup)
    ma, mb = statistics.median(a), statistics.median(b)
    return ma / mb, ma, mb


def machine():
    """The CPU model, core count and JAX version, as one line."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, JAX {jax.__version__} ({jax.default_backend()})"
