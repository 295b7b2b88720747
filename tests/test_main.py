"""`python -m harvest`: the README's demo runs and prints both tables; the CLI's flags behave."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import harvest
from harvest.__main__ import main


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


def cli(capsys, *argv):
    """(exit status, stdout, stderr) of the CLI's `main` on `argv`, in this process: the
    flags' parsing needs no interpreter of its own (the demo test runs `-m harvest`)."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.single_release  # argument parsing; the JAX matrix skips it
def test_help_and_version_exit_0_without_running_the_demo(capsys):
    for flag in ("--help", "-h"):
        code, out, err = cli(capsys, flag)
        assert code == 0, err
        assert out.startswith("usage: python -m harvest") and "demo" in out
        assert "What reap" not in out
    code, out, _ = cli(capsys, "--version")
    assert (code, out.strip()) == (0, f"harvest {harvest.__version__}")


def test_help_version_and_bad_arguments_answer_without_importing_jax(tmp_path):
    # A `jax` on the path first that refuses to be imported: what answers with it
    # there never imported JAX.
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("raise ImportError('jax was imported')\n")
    here = pathlib.Path(harvest.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(here)])}

    def run_poisoned(*argv):
        return subprocess.run(
            [sys.executable, "-m", "harvest", *argv],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip

    answered = run_poisoned("--help")
    assert answered.returncode == 0, answered.stderr[-2000:]
    assert answered.stdout.startswith("usage: python -m harvest") and "demo" in answered.stdout
    version = run_poisoned("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"harvest {harvest.__version__}")
    bad = run_poisoned("nonsense")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    # The demo needs JAX: with the refusing one first, it fails on importing it.
    demo = run_poisoned("demo")
    assert demo.returncode == 1 and "jax was imported" in demo.stderr


@pytest.mark.single_release  # argument parsing; the JAX matrix skips it
def test_unknown_flags_and_commands_exit_2(capsys):
    for argv in (["--bogus"], ["nonsense"]):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and "usage:" in err, argv
        assert "What reap" not in out


def test_demo_says_why_a_patch_moves_the_logit_away_with_numbers_that_add_up():
    out = run().stdout
    header = re.search(r"\(logit ([-+.\d]+), clean ([-+.\d]+)\)", out)
    corrupted, clean = map(float, header.groups())
    why = " ".join(out.split("Why a patch")[1].split())
    numbers = re.search(
        r"logit is ([-+.\d]+) clean and ([-+.\d]+) corrupted: the input's own path makes "
        r"([-+.\d]+) of the ([-+.\d]+) gap. The layers add ([-+.\d]+) in the clean run "
        r"and ([-+.\d]+) in the corrupted one",
        why,
    )
    assert numbers, why
    direct_clean, direct_corrupted, path, gap, layers_clean, layers_corrupted = map(
        float, numbers.groups()
    )
    # With no layer output the model is linear in its input, and the input is negated.
    assert direct_clean == pytest.approx(-direct_corrupted, abs=1e-3)
    assert gap == pytest.approx(clean - corrupted, abs=2e-3)
    assert path == pytest.approx(direct_clean - direct_corrupted, abs=2e-3)
    assert layers_clean == pytest.approx(clean - direct_clean, abs=2e-3)
    assert layers_corrupted == pytest.approx(corrupted - direct_corrupted, abs=2e-3)
    # The explanation holds: the corrupted run's layers push the logit up more.
    assert layers_corrupted > layers_clean
