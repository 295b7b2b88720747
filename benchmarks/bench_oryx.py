"""The same MLP scenarios through the real oryx 0.2.9, beside harvest's.

oryx 0.2.9 does not import on the JAX harvest uses, so its half runs in the
oryx venv (`compat/oryx_venv.sh` builds it) as a subprocess running
`oryx_side.py`, which prints its ratios as JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path(__file__).with_name("oryx_side.py")


def venv_python():
    """The oryx venv's python, or None if the venv has not been built."""
    venv = pathlib.Path(os.environ.get("ORYX_VENV", ROOT / ".oryx-venv"))
    python = venv / "bin" / "python"
    return python if python.exists() else None


def run(layers, repeats, calls, width, batch, eager_repeats=3, timeout=900):
    """oryx's ratios per (model, layers), or None if the oryx venv is missing."""
    python = venv_python()
    if python is None:
        return None
    cmd = [
        str(python),
        str(SCRIPT),
        *map(str, layers),
        "--repeats",
        str(repeats),
        "--calls",
        str(calls),
        "--eager-repeats",
        str(eager_repeats),
        "--width",
        str(width),
        "--batch",
        str(batch),
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("PYTHONPATH", None)  # keep this venv's harvest and JAX out of the oryx venv
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"oryx_side.py failed in {python}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
