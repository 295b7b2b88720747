"""Checks an installed wheel, run by `make dist` from a venv outside the checkout.

It proves the artifact, not the source tree: `harvest` must come from the venv's
site-packages, carry its type marker and version, expose its types to a checker
(mypy, from the `test` extra, run on a small usage file against the installed
copy) and run every docstring example.
"""

import doctest
import importlib
import importlib.metadata
import pathlib
import pkgutil
import subprocess
import sys
import tempfile
import textwrap

import harvest

DISTRIBUTION = "jax-harvest"

# Correct use must check clean; the `# E:` lines must be errors. Without the
# wheel's annotations (or py.typed) mypy would see Any everywhere and report
# neither the assert_type mismatches nor the wrong argument.
USAGE = textwrap.dedent(
    """
    from typing import Any, assert_type

    import jax
    import jax.numpy as jnp

    import harvest


    def f(x: jax.Array, scale: float) -> jax.Array:
        return harvest.sow(x * scale, name="h", mode="strict")


    x = jnp.ones(3)
    assert_type(harvest.reap(f)(x, scale=2.0), dict[str, Any])
    assert_type(harvest.plant(f)({"h": x}, x, 2.0), jax.Array)
    harvest.reap(f)(x, "two")  # E: arg-type
    """
)


def check_types():
    with tempfile.TemporaryDirectory() as tmp:
        usage = pathlib.Path(tmp, "usage.py")
        usage.write_text(USAGE)
        run = subprocess.run(
            [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", str(pathlib.Path(tmp, "cache")), str(usage)],
            capture_output=True,
            text=True,
            cwd=tmp,
        )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    wanted = [n for n, line in enumerate(USAGE.splitlines(), start=1) if "# E: " in line]
    got = [int(line.split(":")[1]) for line in errors]
    if got != wanted or not all(line.endswith("[arg-type]") for line in errors):
        sys.exit(f"mypy on the installed package: expected errors on lines {wanted}, got:\n{run.stdout}{run.stderr}")
    print(f"mypy sees the installed package's types ({len(USAGE.splitlines())}-line usage file)")


def main(checkout):
    where = pathlib.Path(harvest.__file__).resolve()
    if pathlib.Path(checkout).resolve() in where.parents:
        sys.exit(f"harvest was imported from the checkout ({where}), not from the installed wheel")
    assert importlib.metadata.version(DISTRIBUTION) == harvest.__version__, (
        importlib.metadata.version(DISTRIBUTION),
        harvest.__version__,
    )
    assert (where.parent / "py.typed").is_file(), "py.typed is missing from the wheel"
    check_types()

    names = ["harvest"] + [m.name for m in pkgutil.walk_packages(harvest.__path__, prefix="harvest.")]
    failed = attempted = 0
    for name in sorted(names):
        result = doctest.testmod(
            importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        )
        failed += result.failed
        attempted += result.attempted
    print(f"installed {DISTRIBUTION} {harvest.__version__} from {where.parent}")
    print(f"{len(names)} modules imported, {attempted} docstring examples run, {failed} failed")
    sys.exit(1 if failed or not attempted else 0)


if __name__ == "__main__":
    main(sys.argv[1])
