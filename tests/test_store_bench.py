"""benchmarks/bench_store.py runs end to end at its quick size (no timing is asserted)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.benchmark  # the bench harness: make test only

pytest.importorskip("tensorstore", reason="harvest.store needs the store extra (tensorstore)")
pytest.importorskip("flax.nnx")

from benchmarks import __main__ as bench, bench_store  # noqa: E402


def test_quick_store_section_updates_just_that_section(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Targets\n\nkept\n\n## Reading the numbers\n\nkept too\n")
    result = bench.main(["--quick", "--only", "store", "--output", str(page)])
    text = page.read_text()
    assert text.count("## Activations at dataset scale") == 1 and "kept too" in text
    cfg = bench_store.QUICK
    assert result["rows"] == cfg.batches * cfg.batch * cfg.positions  # every row read once
    assert result["ratio"] > 0 and result["write_mib_s"] > 0 and result["read_mib_s"] > 0
    assert result["write_alone_mib_s"] > 0 and result["ordered_read_mib_s"] > 0
    assert result["tensorstore_read_mib_s"] > 0
    assert sorted(result["rss"]) == sorted(cfg.rss_batches)
    assert "| record vs bare forward" in text and "| peak RSS" in text
    assert "| the write path alone" in text and "TensorStore `read()` of every chunk" in text
