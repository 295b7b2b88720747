"""Checks an installed wheel, run by `make dist` from a venv outside the checkout.

It proves the artifact, not the source tree: `harvest` must come from the venv's
site-packages, carry its type marker and version, and run every docstring example.
"""

import doctest
import importlib
import importlib.metadata
import pathlib
import pkgutil
import sys

import harvest

DISTRIBUTION = "jax-harvest"


def main(checkout):
    where = pathlib.Path(harvest.__file__).resolve()
    if pathlib.Path(checkout).resolve() in where.parents:
        sys.exit(f"harvest was imported from the checkout ({where}), not from the installed wheel")
    assert importlib.metadata.version(DISTRIBUTION) == harvest.__version__, (
        importlib.metadata.version(DISTRIBUTION),
        harvest.__version__,
    )
    assert (where.parent / "py.typed").is_file(), "py.typed is missing from the wheel"

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
