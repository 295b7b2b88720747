"""Compare scenario results against the golden results recorded from oryx.

Library use::

    from compat.compare import compare, load_golden
    mismatches = compare(results, load_golden())   # [] when everything matches

``results`` is what ``scenarios.run_all`` returns (raw pytrees, with
``scenarios.Raised`` for cases that raised).  ``golden`` is the parsed
``golden/oryx_0.2.9.json`` (the whole file or its ``"scenarios"`` mapping).

Command line (project venv, JAX 0.10.x, needs ``harvest.compat.oryx``)::

    .venv/bin/python compat/compare.py                 # every scenario
    .venv/bin/python compat/compare.py scan_append -v  # some, with details

Rules: same pytree structure (dict keys, tuple vs list, None), same shapes,
same dtype *kind* (float/int/uint/bool/complex: a Python float planted into
oryx comes back as float64 where JAX gives float32), values equal under
``np.allclose(rtol=1e-5, atol=1e-6)`` (exact for bool/int).  A golden error
matches when the same exception class name appears in the raised exception's
MRO (a ``HarvestError(ValueError)`` matches a golden ``ValueError``); messages
are compared only with ``--messages``.  Case-level entries listed in
``known_differences.json`` ({"scenario.case": "why"}) are reported but do
not fail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import scenarios  # noqa: E402
from scenarios import Raised  # noqa: E402

GOLDEN = HERE / "golden" / "oryx_0.2.9.json"
KNOWN = HERE / "known_differences.json"
RTOL, ATOL = 1e-5, 1e-6

__all__ = ["compare", "compare_encoded", "decode", "load_golden", "load_known", "main"]


def load_golden(path: Path = GOLDEN) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def load_known(path: Path = KNOWN) -> dict[str, str]:
    path = Path(path)
    if not path.exists():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def _golden_scenarios(golden) -> dict[str, Any]:
    """Accepts the whole golden file or its scenarios mapping; returns
    {name: encoded result}."""
    if "scenarios" in golden and "format" in golden:
        golden = golden["scenarios"]
    return {
        n: (
            v["result"]
            if isinstance(v, dict) and "result" in v and set(v) <= {"doc", "result"}
            else v
        )
        for n, v in golden.items()
    }


def decode(enc) -> Any:
    """Inverse of ``scenarios.encode`` (errors come back as Raised)."""
    if enc is None:
        return None
    if isinstance(enc, dict):
        if "__error__" in enc:
            return Raised(enc["__error__"], enc.get("message", ""), (enc["__error__"],))
        if "__array__" in enc:
            return np.asarray(enc["value"], dtype=enc["__array__"]).reshape(enc["shape"])
        if "__tuple__" in enc:
            return tuple(decode(v) for v in enc["__tuple__"])
        if "__list__" in enc:
            return [decode(v) for v in enc["__list__"]]
        if "__str__" in enc:
            return enc["__str__"]
        return {k: decode(v) for k, v in enc.items()}
    raise TypeError(f"cannot decode {enc!r}")


def _kind(tree) -> str:
    if isinstance(tree, Raised):
        return f"raised {tree.type_name}"
    if tree is None:
        return "None"
    if isinstance(tree, dict):
        return f"dict{sorted(tree)}"
    if isinstance(tree, (tuple, list)):
        return f"{type(tree).__name__}[{len(tree)}]"
    if isinstance(tree, str):
        return "str"
    a = np.asarray(tree)
    return f"{a.dtype}{list(a.shape)}"


def _short(a: np.ndarray) -> str:
    s = np.array2string(np.asarray(a), precision=6, threshold=12, separator=",").replace("\n", "")
    return s if len(s) < 120 else s[:117] + "..."


def _walk(got, want, path: str, out: list[str], messages: bool) -> None:
    if isinstance(want, Raised):
        if not isinstance(got, Raised):
            out.append(
                f"{path}: oryx raised {want.type_name}({want.message!r}) but got {_kind(got)}"
            )
        elif want.type_name not in (got.mro or (got.type_name,)):
            out.append(
                f"{path}: oryx raised {want.type_name}({want.message!r}) "
                f"but got {got.type_name}({got.message!r})"
            )
        elif messages and got.message != want.message:
            out.append(f"{path}: message {got.message!r} != oryx {want.message!r}")
        return
    if isinstance(got, Raised):
        out.append(
            f"{path}: raised {got.type_name}({got.message!r}) but oryx returned {_kind(want)}"
        )
        return
    if want is None or got is None:
        if not (want is None and got is None):
            out.append(f"{path}: got {_kind(got)}, oryx {_kind(want)}")
        return
    if isinstance(want, dict):
        if not isinstance(got, dict):
            out.append(f"{path}: got {_kind(got)}, oryx {_kind(want)}")
            return
        missing = [k for k in want if k not in got]
        extra = [k for k in got if k not in want]
        if missing or extra:
            out.append(f"{path}: dict keys differ: missing {missing}, extra {extra}")
        for k in want:
            if k in got:
                _walk(got[k], want[k], f"{path}[{k!r}]", out, messages)
        return
    if isinstance(want, (tuple, list)):
        if type(got) is not type(want) or len(got) != len(want):
            out.append(f"{path}: got {_kind(got)}, oryx {_kind(want)}")
            return
        for i, (g, w) in enumerate(zip(got, want)):
            _walk(g, w, f"{path}[{i}]", out, messages)
        return
    if isinstance(want, str):
        if got != want:
            out.append(f"{path}: got {got!r}, oryx {want!r}")
        return
    if isinstance(got, (dict, tuple, list, str)):
        out.append(f"{path}: got {_kind(got)}, oryx {_kind(want)}")
        return
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        out.append(f"{path}: shape {g.shape} != oryx {w.shape}")
        return
    if g.dtype.kind != w.dtype.kind:
        out.append(
            f"{path}: dtype {g.dtype} (kind {g.dtype.kind}) != oryx {w.dtype} (kind {w.dtype.kind})"
        )
        return
    if w.dtype.kind in "fc":
        ok = np.allclose(g, w, rtol=RTOL, atol=ATOL, equal_nan=True)
    else:
        ok = np.array_equal(g, w)
    if not ok:
        out.append(f"{path}: values {_short(g)} != oryx {_short(w)}")


def compare(
    results: dict[str, Any], golden, *, messages: bool = False, require_all: bool = False
) -> list[str]:
    """Returns mismatch strings (empty when ``results`` conform).

    ``results``: {scenario name: raw result} as from ``scenarios.run_all``.
    Scenarios missing from ``golden`` are reported; scenarios in ``golden``
    but not in ``results`` are reported only with ``require_all``.
    """
    gold = _golden_scenarios(golden)
    out: list[str] = []
    for name, got in results.items():
        if name not in gold:
            out.append(f"{name}: no golden result (re-run record_golden.py)")
            continue
        _walk(got, decode(gold[name]), name, out, messages)
    if require_all:
        out.extend(f"{n}: not run" for n in gold if n not in results)
    return out


def compare_encoded(encoded: dict[str, Any], golden, **kw) -> list[str]:
    """Like :func:`compare` for already-encoded results (same JSON form)."""
    return compare({n: decode(v) for n, v in encoded.items()}, golden, **kw)


def _case_of(mismatch: str) -> str:
    """'scen["case"]...: msg' -> 'scen.case'; 'scen: msg' -> 'scen'."""
    head = mismatch.split(":", 1)[0]
    if "[" in head:
        name, rest = head.split("[", 1)
        return name + "." + rest.split("]", 1)[0].strip("'\"")
    return head


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run the oryx conformance scenarios against harvest.compat.oryx"
    )
    ap.add_argument("names", nargs="*", help="scenario names (default: all)")
    ap.add_argument("--golden", type=Path, default=GOLDEN)
    ap.add_argument(
        "--known",
        type=Path,
        default=KNOWN,
        help="JSON {'scenario.case': reason} of accepted differences",
    )
    ap.add_argument(
        "--module",
        default="harvest.compat.oryx",
        help="module under test (default: harvest.compat.oryx)",
    )
    ap.add_argument("--messages", action="store_true", help="also require identical error messages")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run cases in this process instead of forked workers",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--json", type=Path, help="also write this run's encoded results")
    args = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import importlib  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    h = importlib.import_module(args.module)
    golden = load_golden(args.golden)
    known = load_known(args.known)
    gold = _golden_scenarios(golden)
    names = args.names or list(scenarios.SCENARIOS)

    results = scenarios.run_all(
        h, jax, jnp, names=names, verbose=args.verbose, isolate=not args.in_process
    )
    if args.json:
        args.json.write_text(
            json.dumps({n: scenarios.encode(r) for n, r in results.items()}, indent=1)
        )

    passed = failed = accepted = 0
    for name in names:
        mism = compare({name: results[name]}, golden, messages=args.messages)
        n_cases = (
            len(gold.get(name) or {})
            if isinstance(gold.get(name), dict) and "__error__" not in gold[name]
            else 1
        )
        bad_cases = {_case_of(m) for m in mism}
        real = [m for m in mism if _case_of(m) not in known]
        doc = [m for m in mism if _case_of(m) in known]
        n_bad = len({_case_of(m) for m in real})
        failed += n_bad
        accepted += len({_case_of(m) for m in doc})
        passed += max(n_cases - len(bad_cases), 0)
        status = "FAIL" if real else ("ok (documented differences)" if doc else "ok")
        if real or doc or args.verbose:
            print(f"{name}: {status}")
            for m in real:
                print(f"    {m}")
            for m in doc:
                print(f"    [documented: {known[_case_of(m)]}] {m}")
    if scenarios.LEAKS:
        print(f"note: JAX trace state leaked after: {', '.join(scenarios.LEAKS)}")
    if accepted:
        print(f"{accepted} case(s) differ from oryx as documented in {args.known.name}")
    print(f"conformance: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
