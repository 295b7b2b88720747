"""benchmarks/bench_store.py runs end to end at its quick size, and what it records is right.

No timing is asserted. Every store the benchmark writes is checked as it is
written: the model's rows against `reap` of the same model over the same
batches, bit for bit; the write-path rows against the rows it was given.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.benchmark  # the bench harness: make test only

pytest.importorskip("tensorstore", reason="harvest.store needs the store extra (tensorstore)")
pytest.importorskip("flax.nnx")

from benchmarks import __main__ as bench, bench_store  # noqa: E402
from harvest import reap, store  # noqa: E402


def _checked_record(record, checked):
    """`store.record`, each store it returns compared with its reference first."""

    def spy(fn, batches, path, **options):
        batches = list(batches)
        s = record(fn, batches, path, **options)
        if options.get("tag") == "modules":  # the model: rows are reap's, one per token
            names = options["names"]
            for name in names:
                reaped = [
                    np.asarray(reap(fn, tag="modules", names=names)(b)[name]) for b in batches
                ]
                expected = np.concatenate([r.reshape(-1, r.shape[-1]) for r in reaped])
                np.testing.assert_array_equal(s[name][:], expected, strict=True)
        else:  # the write path alone: the rows it was given, sown as they are
            for k, name in enumerate(s):
                expected = np.concatenate([b[f"site{k}"] for b in batches])
                np.testing.assert_array_equal(s[name][:], expected, strict=True)
        checked.append(options.get("tag", "write path"))
        return s

    return spy


def test_quick_store_section_updates_just_that_section(tmp_path, monkeypatch):
    checked: list[str] = []
    monkeypatch.setattr(store, "record", _checked_record(store.record, checked))
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Targets\n\nkept\n\n## Reading the numbers\n\nkept too\n")
    result = bench.main(["--quick", "--only", "store", "--output", str(page)])
    text = page.read_text()
    assert text.count("## Activations at dataset scale") == 1 and "kept too" in text
    cfg = bench_store.QUICK
    assert "modules" in checked and "write path" in checked  # both kinds of store checked
    assert result["rows"] == cfg.batches * cfg.batch * cfg.positions  # every row read once
    rates = [v for k, v in result.items() if k.endswith(("_mib_s", "ratio"))]
    assert len(rates) == 9 and all(np.isfinite(rates)) and min(rates) > 0  # each one measured
    assert sorted(result["rss"]) == sorted(cfg.rss_batches)
    assert "| record vs bare forward" in text and "| peak RSS" in text
    assert "| the write path alone" in text and "TensorStore `read()` of every chunk" in text
