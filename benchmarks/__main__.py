"""`python -m benchmarks`: every comparison, side by side, as ratios.

Prints the ratios and writes them, with the machine's description, to
`docs/benchmarks.md`. `--quick` runs everything at a tiny size (what the tests
do); `--large` adds a 10^5-equation trace and the full patching sweep (several
more minutes); `--output` writes the page elsewhere; `--only SECTION` runs one
section and updates just that part of the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import pathlib
import time

from . import (
    _timing,
    bench_accelerator,
    bench_chains,
    bench_core,
    bench_devices,
    bench_memory,
    bench_models,
    bench_oryx,
    bench_ppl,
    bench_retrace,
    bench_samplers,
    bench_store,
    bench_unharvested,
)

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

# Sections that can run alone (`--only`): module with run(cfg), render(rows), Config, QUICK.
SECTIONS = {
    "accelerator": bench_accelerator,
    "samplers": bench_samplers,
    "unharvested": bench_unharvested,
    "store": bench_store,
    "models": bench_models,
    "memory": bench_memory,
    "ppl": bench_ppl,
    "chains": bench_chains,
    "retrace": bench_retrace,
    "devices": bench_devices,
}

# What each ratio (ours / theirs) should stay under, and at which depths.
TARGETS = {
    "steady": (1.02, None),
    "compile": (1.10, 48),
    "eager": (1.2, None),
    "eager_hand": (1.5, None),
}


def _patching(size):
    """benchmarks.bench_patching's ratios, or None if that module is not there yet."""
    try:
        module = importlib.import_module("benchmarks.bench_patching")
    except ModuleNotFoundError as err:
        if err.name != "benchmarks.bench_patching":
            raise
        return None
    return module.run(size)


def _instrument(size):
    """benchmarks.bench_instrument's ratios (its sizes are tiny and small)."""
    from . import bench_instrument

    size = "tiny" if size == "tiny" else "small"
    return bench_instrument.section(bench_instrument.run(size), size)


def _has(module):
    return importlib.util.find_spec(module) is not None


def _load():
    return f"{os.getloadavg()[0]:.1f}"


# ---------------------------------------------------------------------------
# The page.


def _mlp_table(rows, oryx):
    theirs = {(r["model"], r["layers"]): r for r in (oryx or {}).get("rows", [])}
    lines = [
        "| model | L | steady | compile | eager | eager vs hand-written jit | compiled programs | oryx steady | oryx eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = theirs.get((r["model"], r["layers"]), {})
        oryx_cells = [f"{o[k]:.3g}" if k in o else "—" for k in ("steady", "eager")]
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['steady']:.3f} | {r['compile']:.3f} | {r['eager']:.3f} "
            f"| {r['eager_hand']:.3f} | {r['program']} | {' | '.join(oryx_cells)} |"
        )
    return lines


def _why(name, row):
    """One line on a missed target, from the run's own evidence."""
    ms = lambda k: 1000 * (row[k + "_ours"] - row[k + "_theirs"])  # noqa: E731
    if name == "steady":
        same = (
            "have identical XLA operations"
            if row["program"] == "identical"
            else f"differ only by {row['program']}"
        )
        return f"the compiled programs {same}, so the {ms('steady'):+.3f} ms per call is timing noise rather than harvest"
    if name == "compile":
        return (
            f"{ms('compile'):+.0f} ms on a {1000 * row['compile_theirs']:.0f} ms first call. harvest traces "
            "`f` twice (once to find the sows, once walking the jaxpr) and XLA inlines one nested call "
            "before compiling the same operations: a cost of some milliseconds to tens of milliseconds "
            "that is a larger share of a short compile"
        )
    if name == "eager":  # `jax.jit(f)` returns none of the sown values; the hand-written jit does
        returning = 1000 * (row["eager_hand_theirs"] - row["eager_theirs"])
        return (
            f"{ms(name) * 1000:+.0f} µs per call against `jax.jit(f)`, which returns none of the sown "
            f"values: the hand-written jit returning them takes {returning * 1000:.0f} µs more than "
            f"`jax.jit(f)` as well, and an eager `reap` costs {ms('eager_hand') * 1000:+.0f} µs against it"
        )
    return (
        f"{ms(name) * 1000:+.0f} µs per call: the Python cost of flattening the arguments and "
        "hashing the static key before the cached jit dispatches"
    )


def _targets(rows):
    lines = ["| measure | target | model, L | ratio | verdict |", "|---|---|---|---|---|"]
    misses = []
    for name, (target, depth) in TARGETS.items():
        for r in rows:
            if depth is not None and r["layers"] != depth:
                continue
            ok = r[name] <= target
            lines.append(
                f"| {name} | ≤{target} | {r['model']}, {r['layers']} | {r[name]:.3f} | "
                f"{'met' if ok else '**missed**'} |"
            )
            if not ok:
                misses.append(
                    f"- **{name}, {r['model']}, L={r['layers']}** ({r[name]:.3f} > {target}): {_why(name, r)}."
                )
    return lines, misses


def _trace_table(rows, slope):
    lines = ["| equations | harvest (s) | plain (s) | ratio |", "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['equations']} | {r['ours']:.3f} | {r['theirs']:.3f} | {r['ratio']:.2f} |"
        )
    shape = "linear" if 0.8 <= slope <= 1.25 else "not linear"
    lines += [
        "",
        f"harvest's trace time grows as equations^{slope:.2f} between the two largest "
        f"sizes ({shape}).",
    ]
    return lines


def _patching_lines(patching, size):
    if patching is None:
        return ["`benchmarks/bench_patching.py` is not there yet, so nothing was measured."]
    return [
        f"`benchmarks/bench_patching.py` at size `{size}`: the compiled patching sweep against",
        "Python loops of `plant` calls, compile time included. These ratios are speed-ups (the",
        "loop's time over the sweep's), so above 1 means the sweep was faster. The",
        "`first_call_vs_second` rows time a first call (trace and compile) over a second one with",
        "the same function, names, axis and shapes on other data, which reuses the compiled program;",
        "for `nnx_module_sweep`, the function is an NNX module whose weight changed in place in between.",
        "",
        "| comparison | speed-up |",
        "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in patching.items()),
    ]


def render(results):
    """The page docs/benchmarks.md, from one run's results."""
    core, oryx = results["core"], results["oryx"]
    targets, misses = _targets(core["mlp"])
    oryx_note = (
        f"The oryx columns ran the same scenarios through oryx 0.2.9 in its own venv (JAX "
        f"{oryx['jax']}), each timed against `jax.jit` in that process: oryx's jitted `reap` vs the "
        "hand-written function, and oryx's eager `reap` (which re-traces on every call) vs `jax.jit(f)`."
        if oryx
        else "The oryx venv (`bash compat/oryx_venv.sh`) was not built, so oryx was not measured."
    )
    return "\n".join(
        [
            "# Benchmarks",
            "",
            "Generated by `make bench` (`python -m benchmarks`); do not edit by hand.",
            "",
            f"Machine: {results['machine']}. Load average {results['load'][0]} at the start of the run, "
            f"{results['load'][1]} at the end; the run took {results['seconds']:.0f} s.",
            "",
            "Every number is a ratio of medians, harvest's time over the reference's, with",
            "both sides timed interleaved in the same run: absolute times on a shared CPU are",
            "noise, ratios are the result. Below 1 means harvest was faster.",
            "",
            "## Residual MLP, every layer's output sown",
            "",
            f"A residual MLP (`x + tanh(x @ W)`, width {results['config'].width}, batch "
            f"{results['config'].batch}), written unrolled (one `strict` sow per layer) and as a",
            "`scan` over stacked weights (one `append` sow).",
            "",
            "- **steady**: `jax.jit(reap(f))` vs a hand-written `jax.jit` function returning",
            "  the same intermediates, both compiled.",
            "- **compile**: the first call of each pair (trace + compile), on fresh functions",
            "  with `jax.clear_caches()` before each call.",
            "- **eager**: `reap(f)(x)` called repeatedly vs `jax.jit(f)(x)`; the next column",
            "  compares it with the jitted hand-written function, which returns the same arrays.",
            "- **compiled programs**: how the XLA operations of `jax.jit(reap(f))` and the",
            "  hand-written function differ after compilation.",
            "",
            oryx_note,
            "",
            *_mlp_table(core["mlp"], oryx),
            "",
            "## Targets",
            "",
            *targets,
            "",
            *(["Every target was met."] if not misses else ["Missed, and why:", "", *misses]),
            "",
            "## Interpreter cost as the program grows",
            "",
            "`jax.make_jaxpr(reap(f))` vs `jax.make_jaxpr(f)` for an unrolled MLP of growing",
            "depth (4 wide, so the time is all tracing). harvest traces `f` once to find the",
            "sows, then walks the jaxpr re-binding every equation: a ratio near 2 is the price.",
            "",
            *_trace_table(core["trace"], core["trace_slope"]),
            "",
            "## Activation patching",
            "",
            *_patching_lines(results["patching"], results["patching_size"]),
            "",
            *results["instrument"],
            "",
            *bench_models.render(results["models"]),
            "",
            *bench_retrace.render(results["retrace"]),
            "",
            *bench_devices.render(results["devices"]),
            "",
            *bench_unharvested.render(results["unharvested"]),
            "",
            *bench_samplers.render(results["samplers"]),
            "",
            *bench_memory.render(results["memory"]),
            "",
            *(
                bench_store.render(results["store"])
                if results["store"] is not None
                else [
                    "## Activations at dataset scale",
                    "",
                    "TensorStore (the store extra) is not installed: not measured.",
                ]
            ),
            "",
            *bench_ppl.render(results["ppl"]),
            "",
            *bench_chains.render(results["chains"]),
            "",
            "## Reading the numbers",
            "",
            *ANALYSIS,
            "",
        ]
    )


ANALYSIS = [
    "- **steady**: under `jit` the walk has already happened at trace time, and XLA",
    "  compiles the same operations either way (the *compiled programs* column), so",
    "  the ratio is 1 up to noise. On a shared 2-core machine that noise is several",
    "  percent per row, in either direction; the load average above says how shared.",
    "- **compile**: the first call pays for tracing twice (`make_jaxpr` of `f`, then",
    "  the walk re-binding every equation: about 2x the plain trace) and for XLA",
    "  inlining the walk's nested `jit` before it compiles the same operations",
    "  (a few ms here). That cost is fixed per program, so it is a few percent of the",
    "  unrolled model's long compile but a larger share for the `scan`, whose XLA",
    "  compile is short and does not grow with L.",
    "- **eager**: an eager `reap(f)(x)` is one call of a cached `jax.jit` keyed by the",
    "  function, the policy and the pytree structure. Against `jax.jit(f)` it can come",
    "  out *below* 1: `f` returns only its output, letting XLA fuse each residual add",
    "  into the next layer's matmul, which on CPU is slower than the library matmul",
    "  it uses when every layer's output is materialised, as both harvest and the",
    "  hand-written function do. The column against the hand-written jit isolates",
    "  harvest's own per-call Python cost (flattening, hashing the static key).",
    "- **oryx**: jitted, oryx's `reap` also compiles to the hand-written program.",
    "  Eager, it re-traces and dispatches every operation on every call, which is why",
    "  its eager ratios are in the tens to hundreds.",
    "- **sows nobody harvests**: outside a harvest a sow carries no effect and lowers",
    "  to nothing, so JAX keeps its C++ dispatch fast path and XLA compiles the same",
    "  program: the ratios are 1 up to noise. (While a sow always carried an effect,",
    "  the same dispatch cost 9-10x and the width-16 step 6.8x.)",
    "- **trace scaling**: the walk costs a roughly constant amount per equation, so",
    "  the ratio stays near 2 and the time grows linearly with the program.",
]


def run(quick=False, large=False):
    cfg = bench_core.QUICK if quick else bench_core.Config()
    if large:
        cfg = dataclasses.replace(cfg, trace_sizes=cfg.trace_sizes + (100_000,))
    size = "tiny" if quick else "full" if large else "small"
    start, load = time.perf_counter(), [_load()]
    results = {"machine": _timing.machine(), "config": cfg, "core": bench_core.run(cfg)}
    results["patching"], results["patching_size"] = _patching(size), size
    results["instrument"] = _instrument(size)
    results["models"] = _run_section(bench_models, quick)
    results["retrace"] = _run_section(bench_retrace, quick)
    results["devices"] = _run_section(bench_devices, quick)
    results["unharvested"] = _run_section(bench_unharvested, quick)
    results["samplers"] = _run_section(bench_samplers, quick)
    results["memory"] = _run_section(bench_memory, quick)
    results["store"] = _run_section(bench_store, quick) if _has("tensorstore") else None
    results["ppl"] = _run_section(bench_ppl, quick)
    results["chains"] = _run_section(bench_chains, quick)
    results["oryx"] = bench_oryx.run(
        cfg.layers, cfg.repeats, cfg.calls, cfg.width, cfg.batch, eager_repeats=1 if quick else 3
    )
    results["load"] = load + [_load()]
    results["seconds"] = time.perf_counter() - start
    return results


def _run_section(module, quick):
    return module.run(module.QUICK if quick else module.Config())


def splice(page, lines):
    """`page` with the section `lines` (starting at its `## ` heading) put in place
    of the section of that heading, or before "## Reading the numbers"."""
    heading, section = lines[0], "\n".join(lines) + "\n\n"
    start = page.find(heading + "\n")
    if start < 0:
        start = end = page.index("## Reading the numbers")
    else:
        end = page.find("\n## ", start + len(heading)) + 1 or len(page)
    return page[:start] + section + page[end:]


def section(page, heading):
    """The lines of `page`'s section under `heading` (up to the next `## `), or []."""
    start = page.find(heading + "\n")
    if start < 0:
        return []
    end = page.find("\n## ", start + len(heading)) + 1 or len(page)
    return page[start:end].rstrip("\n").split("\n")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the code runs")
    parser.add_argument(
        "--large", action="store_true", help="add 10^5 equations and the full patching sweep"
    )
    parser.add_argument("--output", type=pathlib.Path, default=DOC, help="where to write the page")
    parser.add_argument(
        "--only", choices=sorted(SECTIONS), help="run one section; update just it in the page"
    )
    opts = parser.parse_args(argv)
    if opts.only:
        module = SECTIONS[opts.only]
        rows = _run_section(module, opts.quick)
        lines = module.render(rows)
        opts.output.write_text(splice(opts.output.read_text(), lines))
        print("\n".join(lines))
        print(f"Updated that section of {opts.output}")
        return rows
    results = run(opts.quick, opts.large)
    if results["patching"] is None:
        print("benchmarks.bench_patching is missing: activation patching not measured.")
    if results["oryx"] is None:
        print("The oryx venv is missing (bash compat/oryx_venv.sh builds it): oryx not measured.")
    page = render(results)
    if opts.output.exists():  # the accelerator's section comes from its own run (`--only`)
        kept = section(opts.output.read_text(), bench_accelerator.HEADING)
        page = splice(page, kept) if kept else page
    opts.output.write_text(page)
    print(page)
    print(f"Wrote {opts.output}")
    return results


if __name__ == "__main__":
    main()
