"""Runs the multi-device checks in their own process with 8 virtual CPU devices.

XLA_FLAGS must be set before JAX starts, and this session has already started
it with one device, so the checks in tests/multidevice/ run in a subprocess.
"""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


def run_checks(name):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "multidevice" / name),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    return result.stdout


def test_many_device_checks_pass_in_their_own_process():
    run_checks("sharding_checks.py")


def test_store_and_stream_checks_pass_in_their_own_process():
    pytest.importorskip("tensorstore", reason="harvest.store needs the store extra (tensorstore)")
    assert "skipped" not in run_checks("store_checks.py")
