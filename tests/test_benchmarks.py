"""The benchmarks run end to end at a tiny size, so they cannot rot. No timing is asserted."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import __main__ as bench, _timing, bench_core, bench_models, bench_oryx, bench_ppl

pytestmark = pytest.mark.benchmark  # deselected by `make test-fast`


def test_quick_run_writes_the_page(tmp_path):
    page = tmp_path / "benchmarks.md"
    results = bench.main(["--quick", "--output", str(page)])
    text = page.read_text()
    for heading in (
        "# Benchmarks",
        "## Targets",
        "## Interpreter cost",
        "## Activation patching",
        "## Probing an unmodified model",
        "## Nothing traced twice",
        "## Many devices",
        "## Steering inside a sampler",
        "## Memory of a full reap",
    ):
        assert heading in text
    assert "JAX" in text and "cores" in text
    rows = results["core"]["mlp"]
    assert {(r["model"], r["layers"]) for r in rows} == {("unrolled", 2), ("scan", 2)}
    for r in rows:
        assert all(r[m] > 0 for m in bench_core.MEASURES)
    assert len(results["core"]["trace"]) == len(bench_core.QUICK.trace_sizes)
    memory = results["memory"]["memory"]
    assert memory["reaped"] == 2 * 4 * 8 * 4  # two layers of a [4, 8] float32 output
    variants = [r["variant"] for r in memory["rows"]]
    assert variants[:4] == ["bare", "reap", "reap_one_site", "hand"]
    assert variants[4:] in ([], ["nnx_bare", "nnx_instrumented"])  # the NNX pair needs flax
    assert results["memory"]["plants"]["ratio"] > 0
    # The sections that have no test of their own: each would run its quick size again.
    patching = results["patching"]
    assert patching and all(r > 0 for r in patching.values())
    models = results["models"]
    assert [r["model"] for r in models] == ["penzai", "gemma"]
    assert sum(line.startswith("| penzai") for line in bench_models.render(models)) == 1
    assert bench_models.HEADING in text
    if importlib.util.find_spec("penzai") is not None:
        penzai = models[0]
        assert penzai["skipped"] is None and penzai["hooks"] == 6 and penzai["steady"] > 0

    assert "## harvest.ppl against NumPyro" in text
    if results["ppl"]:  # NumPyro is installed: the ratios for the quick run's model
        # (the quick run starts no fresh process: the last measure is the full run's)
        assert [(r["model"], r["measure"]) for r in results["ppl"]] == [
            ("eight schools", m) for m in bench_ppl.MEASURES[:-1]
        ]
        assert all(r["ratio"] > 0 for r in results["ppl"])
    assert "## harvest.ppl's NUTS chains against NumPyro's" in text
    if results["chains"]:  # NumPyro, BlackJAX and ArviZ are installed
        assert [(r["model"], r["method"]) for r in results["chains"]] == [
            ("eight schools", "vectorized"),
            ("eight schools", "sequential"),
        ]
        assert all(r["ratio"] > 0 for r in results["chains"])
    if bench_oryx.venv_python() is not None:  # the oryx side ran too
        assert [(r["model"], r["layers"]) for r in results["oryx"]["rows"]] == [
            ("unrolled", 2),
            ("scan", 2),
        ]


@pytest.mark.parametrize("kind", sorted(bench_core.MODELS))
def test_models_match_hand_written_and_compile_alike(kind):
    args = bench_core.inputs(kind, 3, 8, 2)
    bench_core.same_values(bench_core.MODELS[kind], args)  # asserts
    assert bench_core.program_diff(bench_core.MODELS[kind], args) in ("identical", "+1 bitcast")


def test_ratio_interleaves_and_takes_medians():
    calls = []
    r, ours, theirs = _timing.ratio(lambda: calls.append("a"), lambda: calls.append("b"), repeats=4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert r == ours / theirs


def test_only_one_section_updates_just_that_section(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Targets\n\nkept\n\n## Reading the numbers\n\nkept too\n")
    rows = bench.main(["--quick", "--only", "unharvested", "--output", str(page)])
    assert [r["same_program"] for r in rows] == [True] * len(rows)
    assert all(r["effects"] == [] and r["ratio"] > 0 for r in rows)
    first = page.read_text()
    assert first.count("## Sows nobody harvests") == 1
    assert (
        first.index("## Targets")
        < first.index("## Sows nobody harvests")
        < first.index("## Reading")
    )
    bench.main(
        ["--quick", "--only", "unharvested", "--output", str(page)]
    )  # replaces, does not add
    again = page.read_text()
    assert again.count("## Sows nobody harvests") == 1 and "kept\n" in again and "kept too" in again
