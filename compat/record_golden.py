"""Record golden scenario results from the REAL oryx 0.2.9 harvest.

Run inside the reference venv (see ``oryx_venv.sh``)::

    bash compat/oryx_venv.sh
    .oryx-venv/bin/python compat/record_golden.py            # all scenarios
    .oryx-venv/bin/python compat/record_golden.py --check    # diff, don't write

It runs every scenario in ``scenarios.py`` through
``oryx.core.interpreters.harvest``, each case in its own forked worker (oryx
leaks JAX trace state when a harvest raises, which would poison later cases),
and writes ``compat/golden/oryx_0.2.9.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GOLDEN = HERE / "golden" / "oryx_0.2.9.json"


def dumps(obj, indent: int = 1, _level: int = 0) -> str:
    """Diffable JSON: one array/error leaf per line, containers indented."""
    pad = " " * (indent * (_level + 1))
    end = " " * (indent * _level)
    if isinstance(obj, dict) and ("__array__" in obj or "__error__" in obj):
        return json.dumps(obj, separators=(", ", ": "))
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent, _level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, list):
        if not obj:
            return "[]"
        items = [pad + dumps(v, indent, _level + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + end + "]"
    return json.dumps(obj)


def build_golden(results, leaks, scenarios_mod) -> dict:
    from importlib import metadata  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jaxlib  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    meta = {
        "source": "oryx.core.interpreters.harvest",
        "oryx": metadata.version("oryx"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "devices": jax.local_device_count(),
        "recorded_with": "compat/record_golden.py (each case in a forked worker)",
        "leaked_trace_state_after": sorted(leaks),
    }
    scen = {}
    for name, result in results.items():
        scen[name] = {
            "doc": scenarios_mod.SCENARIOS[name].doc,
            "result": scenarios_mod.encode(result),
        }
    return {"format": 1, "meta": meta, "scenarios": scen}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="scenario names (default: all)")
    ap.add_argument("--out", type=Path, default=GOLDEN)
    ap.add_argument(
        "--check",
        action="store_true",
        help="compare against the existing golden file, write nothing",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="no forked workers (faster to debug; oryx errors leak)",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import scenarios  # noqa: PLC0415
    from oryx.core.interpreters import harvest as h  # noqa: PLC0415

    results = scenarios.run_all(
        h, jax, jnp, names=args.names or None, verbose=args.verbose, isolate=not args.in_process
    )
    golden = build_golden(results, scenarios.LEAKS, scenarios)

    if args.check:
        import compare  # noqa: PLC0415

        old = json.loads(args.out.read_text())
        problems = compare.compare_encoded(
            {n: v["result"] for n, v in golden["scenarios"].items()}, old, messages=True
        )
        for p in problems:
            print(p)
        print(f"{len(problems)} difference(s) against {args.out}")
        return 1 if problems else 0

    if args.names and args.out.exists():  # partial re-record: merge
        old = json.loads(args.out.read_text())
        old["scenarios"].update(golden["scenarios"])
        old["meta"] = golden["meta"]
        golden = old
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(golden) + "\n")
    n_cases = sum(
        len(r["result"]) if isinstance(r["result"], dict) and "__error__" not in r["result"] else 1
        for r in golden["scenarios"].values()
    )
    n_err = json.dumps(golden["scenarios"]).count('"__error__"')
    print(
        f"wrote {args.out} ({len(golden['scenarios'])} scenarios, "
        f"{n_cases} cases, {n_err} recorded errors)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
