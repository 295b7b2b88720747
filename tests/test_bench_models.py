"""benchmarks/bench_models.py runs end to end at its quick size (no timing is asserted)."""

import pytest

pytestmark = pytest.mark.benchmark  # the bench harness: make test only

pytest.importorskip("penzai")

from benchmarks import bench_models  # noqa: E402


def test_quick_run_renders_a_row_per_model():
    rows = bench_models.run(bench_models.QUICK)
    assert [r["model"] for r in rows] == ["penzai", "gemma"]
    penzai = rows[0]
    assert penzai["skipped"] is None and penzai["hooks"] == 5 and penzai["steady"] > 0
    lines = bench_models.render(rows)
    assert (
        lines[0] == bench_models.HEADING and sum(line.startswith("| penzai") for line in lines) == 1
    )
