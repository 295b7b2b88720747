"""`python -m harvest`: the README's demo runs and prints both tables; the CLI's flags behave."""

import subprocess
import sys

import pytest

import harvest


def run(*argv):
    return subprocess.run(
        [sys.executable, "-m", "harvest", *argv], capture_output=True, text=True, timeout=300
    )


def test_demo_prints_reaped_sites_and_patching_effects():
    result = run()  # `demo` is the default command
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "What reap(model)(x) found:" in out
    for site in ("layer0.pre", "layer2.mlp_out", "logit"):
        assert site in out
    assert "layer1.mlp_out" in out.split("Patching")[1]


@pytest.mark.single_release  # argument parsing; the JAX matrix skips it
def test_help_and_version_exit_0_without_running_the_demo():
    for flag in ("--help", "-h"):
        result = run(flag)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: python -m harvest") and "demo" in result.stdout
        assert "What reap" not in result.stdout
    result = run("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"harvest {harvest.__version__}")


@pytest.mark.single_release  # argument parsing; the JAX matrix skips it
def test_unknown_flags_and_commands_exit_2():
    for argv in (["--bogus"], ["nonsense"]):
        result = run(*argv)
        assert result.returncode == 2 and "usage:" in result.stderr, argv
        assert "What reap" not in result.stdout
