"""`python -m harvest`, the README's demo, runs and prints both tables."""

import subprocess
import sys


def test_demo_prints_reaped_sites_and_patching_effects():
    result = subprocess.run(
        [sys.executable, "-m", "harvest"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "What reap(model)(x) found:" in out
    for site in ("layer0.pre", "layer2.mlp_out", "logit"):
        assert site in out
    assert "layer1.mlp_out" in out.split("Patching")[1]
