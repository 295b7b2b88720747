"""Run oryx 0.2.9's own harvest and ppl test modules against ``harvest.compat.oryx``.

    .venv/bin/python compat/run_oryx_tests.py                  # reference + ours
    .venv/bin/python compat/run_oryx_tests.py --reference skip # ours only
    .venv/bin/python compat/run_oryx_tests.py --update-readme  # also rewrite README

Steps (everything lands in a temporary directory, nothing in the repo):

1. ``pip download --no-deps oryx==0.2.9`` and take
   ``oryx/core/interpreters/harvest_test.py`` out of the wheel.
2. Reference run: the unmodified file under the real oryx in ``.oryx-venv``
   (``--reference auto`` runs it when that venv exists, ``build`` creates it
   first with ``oryx_venv.sh``, ``skip`` leaves it out).
3. Rewrite the imports so ``harvest`` is ``harvest.compat.oryx`` (plus two
   shims for names that are not oryx harvest's: ``oryx.internal.test_util``
   and JAX's renamed ``pjit_p``) and run it under this interpreter.
4. Print per-test outcomes side by side, the counts, and the tests that use
   anything beyond oryx harvest's public API.
5. oryx's ppl tests (``transformations_test.py``, ``effect_handler_test.py``)
   run unmodified twice: under real oryx, and under ``oryx_redirect.py``
   (loaded by a conftest.py), which maps oryx's modules to harvest's in
   ``sys.modules``. Their reference outcomes are recorded in
   ``golden/oryx_0.2.9_ppl_tests.json``; known misses are listed as
   ``"oryx_ppl_test:Class.test_name"``.

Both pytest runs use 2 virtual CPU devices (``ShardMapTest`` needs a 1x2
mesh; oryx's ``__main__`` block sets the same flag).  The exit status is 1
when a test that passes under real oryx fails here, unless it is listed in
``known_differences.json`` as ``"oryx_test:Class.test_name": "reason"``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ORYX_VENV = Path(os.environ.get("ORYX_VENV", ROOT / ".oryx-venv"))
README = HERE / "README.md"
KNOWN = HERE / "known_differences.json"
BASELINE = HERE / "golden" / "oryx_0.2.9_tests.json"
ORYX_VERSION = "0.2.9"
TEST_IN_WHEEL = "oryx/core/interpreters/harvest_test.py"
BEGIN, END = "<!-- oryx-tests:begin -->", "<!-- oryx-tests:end -->"
# oryx's ppl tests run unmodified; `oryx_redirect.py` maps oryx's modules to
# harvest's in `sys.modules` (from a conftest.py), so no line is rewritten.
PPL_TESTS_IN_WHEEL = (
    "oryx/core/ppl/transformations_test.py",
    "oryx/core/ppl/effect_handler_test.py",
)
PPL_BASELINE = HERE / "golden" / "oryx_0.2.9_ppl_tests.json"
PPL_BEGIN, PPL_END = "<!-- oryx-ppl-tests:begin -->", "<!-- oryx-ppl-tests:end -->"

PUBLIC = {"sow", "sow_cond", "harvest", "reap", "plant", "call_and_reap", "nest", "sow_p"}

# (pattern, replacement, why).  Each must match exactly once.
REWRITES: list[tuple[str, str, str]] = [
    (
        r"^from oryx\.core\.interpreters import harvest$",
        "from harvest.compat import oryx as harvest",
        "the module under test",
    ),
    (
        r"^from oryx\.internal import test_util$",
        "import types as _types\n"
        "test_util = _types.SimpleNamespace(TestCase=parameterized.TestCase)",
        "oryx.internal.test_util.TestCase is parameterized.TestCase",
    ),
    (
        r"^from jax import ad_checkpoint$",
        "from jax import ad_checkpoint\n"
        "if not hasattr(ad_checkpoint, 'checkpoint'):\n"
        "  import types as _types\n"
        "  ad_checkpoint = _types.SimpleNamespace(checkpoint=jax.checkpoint)",
        "jax.ad_checkpoint.checkpoint was removed in JAX 0.10 (use jax.checkpoint)",
    ),
    (
        r"^from jax\._src import pjit$",
        "import types as _types\n"
        "from jax._src import pjit as _jax_pjit\n"
        "pjit = _types.SimpleNamespace(\n"
        "    pjit_p=getattr(_jax_pjit, 'pjit_p', None) or _jax_pjit.jit_p)",
        "JAX renamed pjit_p to jit_p (JAX-private, not oryx)",
    ),
]


# --------------------------------------------------------------------------


def fetch_test(tmp: Path, pip_python: str) -> Path:
    wheels = tmp / "wheel"
    wheels.mkdir()
    subprocess.run(
        [
            pip_python,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary",
            ":all:",
            f"oryx=={ORYX_VERSION}",
            "-d",
            str(wheels),
        ],
        check=True,
        stderr=subprocess.DEVNULL if not os.environ.get("VERBOSE") else None,
    )
    (whl,) = list(wheels.glob("oryx-*.whl"))
    with zipfile.ZipFile(whl) as z:
        src = z.read(TEST_IN_WHEEL).decode()
        for name in PPL_TESTS_IN_WHEEL:
            (tmp / Path(name).name).write_text(z.read(name).decode())
    out = tmp / "orig_harvest_test.py"
    out.write_text(src)
    return out


def rewrite(src: str, module: str = "harvest.compat.oryx") -> str:
    pkg, _, name = module.rpartition(".")
    rewrites = [
        (REWRITES[0][0], f"from {pkg} import {name} as harvest", REWRITES[0][2])
    ] + REWRITES[1:]
    for pat, rep, why in rewrites:
        new, n = re.subn(pat, lambda _m: rep, src, flags=re.M)
        if n != 1:
            raise SystemExit(
                f"rewrite {pat!r} ({why}) matched {n} times; oryx's test file changed?"
            )
        src = new
    return src


def internals(src: str) -> dict[str, list[str]]:
    """{'Class.test': [reasons]} for tests using more than oryx's public API."""
    tree = ast.parse(src)
    out: dict[str, list[str]] = {}

    def uses(node) -> list[str]:
        found = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                mod, attr = n.value.id, n.attr
                if mod == "harvest" and attr not in PUBLIC:
                    found.add(f"harvest.{attr} (oryx private)")
                elif mod == "harvest" and attr == "sow_p":
                    found.add("harvest.sow_p (inspects jaxpr primitives)")
                elif mod == "pjit":
                    found.add(f"jax._src.pjit.{attr} (JAX private)")
                elif mod == "ad_checkpoint":
                    found.add(
                        "jax.ad_checkpoint.checkpoint (removed in JAX "
                        "0.10; shimmed to jax.checkpoint)"
                    )
                elif mod == "shard_map":
                    found.add("jax.experimental.shard_map on a 1x2 mesh (2 devices)")
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "assertRaisesRegex"
                and len(n.args) > 1
            ):
                try:
                    pattern = ast.literal_eval(n.args[1])
                except ValueError:
                    pattern = ast.unparse(n.args[1])
                found.add(f"matches oryx's error text {pattern!r}")
        return sorted(found)

    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        bases = [ast.unparse(b) for b in cls.bases]
        cls_reasons = []
        if any(b.startswith("test_util.") for b in bases):
            cls_reasons.append("base class oryx.internal.test_util.TestCase (shimmed)")
        setup = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "setUp"]
        setup_uses = uses(setup[0]) if setup else []
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test"):
                reasons = sorted(set(uses(fn)) | set(setup_uses))
                if reasons:
                    out[f"{cls.name}.{fn.name}"] = reasons
        if cls_reasons:
            out.setdefault(f"{cls.name}.* (all tests)", []).extend(cls_reasons)
    return out


def test_methods(src: str) -> list[str]:
    tree = ast.parse(src)
    return [
        f"{c.name}.{f.name}"
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
    ]


def run_pytest(
    python: str, test_file: Path, extra_env: dict[str, str], label: str
) -> dict[str, tuple[str, str]]:
    """Runs pytest; returns {'Class.test_id': (outcome, short message)}."""
    where = test_file if test_file.is_dir() else test_file.parent
    xml = where / f"{test_file.stem}.{label}.xml"
    ini = where / "pytest.ini"
    ini.write_text("[pytest]\naddopts =\n")
    env = dict(os.environ)
    env.update(extra_env)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    cmd = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-c",
        str(ini),
        "--rootdir",
        str(where),
        f"--junitxml={xml}",
        str(test_file),
    ]
    proc = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    log = where / f"{test_file.stem}.{label}.log"
    log.write_text(proc.stdout + proc.stderr)
    if not xml.exists():
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"{label}: pytest produced no report (exit {proc.returncode})")
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "").split(".")[-1]
        name = f"{cls}.{case.get('name')}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "").strip().splitlines()
                msg = msg[0][:150] if msg else ""
                break
        results[name] = (outcome, msg)
    return results


def method_of(test_id: str, methods: list[str]) -> str:
    """Maps a pytest id (parameterized suffixes) to its 'Class.method'."""
    best = ""
    for m in methods:
        if test_id.startswith(m) and len(m) > len(best):
            best = m
    return best or test_id


def counts(results: dict[str, tuple[str, str]]) -> str:
    c = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for o, _ in results.values():
        c[o] += 1
    s = f"{c['passed']} passed, {c['failed'] + c['error']} failed"
    if c["skipped"]:
        s += f", {c['skipped']} skipped"
    return s


def ensure_absl(tmp: Path) -> dict[str, str]:
    """oryx's tests need absl-py; install it into the temp dir if missing."""
    try:
        import absl  # noqa: F401,PLC0415

        return {}
    except ImportError:
        site = tmp / "site"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(site),
                "absl-py",
            ],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        return {"_EXTRA_PATH": str(site)}


def load_known(prefix: str = "oryx_test:") -> dict[str, str]:
    if not KNOWN.exists():
        return {}
    data = json.loads(KNOWN.read_text())
    return {k[len(prefix) :]: v for k, v in data.items() if k.startswith(prefix)}


def render(ref, ours, methods, internal, known, ref_note) -> str:
    lines = []
    lines.append(
        f"oryx {ORYX_VERSION}'s `harvest_test.py`, extracted from the "
        "wheel at run time. Last run by `compat/run_oryx_tests.py`."
    )
    lines.append("")
    if ref is not None:
        lines.append(f"- Unmodified, real oryx ({ref_note}): **{counts(ref)}**")
    else:
        lines.append(f"- Unmodified, real oryx: not run ({ref_note})")
    if ours is not None:
        lines.append(f"- Rewritten for `harvest.compat.oryx` (project venv): **{counts(ours)}**")
    else:
        lines.append("- Rewritten for `harvest.compat.oryx`: not run")
    lines.append("")
    ids = sorted(set(ref or {}) | set(ours or {}))
    notable = []
    for t in ids:
        r = (ref or {}).get(t, ("-", ""))[0]
        o = (ours or {}).get(t, ("-", ""))[0]
        if r != "passed" or o != "passed":
            msg = ((ours or {}).get(t) or (ref or {}).get(t))[1]
            notable.append((t, r, o, msg))
    if notable:
        lines.append("| test | real oryx | harvest.compat.oryx | note |")
        lines.append("| --- | --- | --- | --- |")
        for t, r, o, msg in notable:
            k = known.get(method_of(t, methods)) or known.get(t)
            note = f"documented: {k}" if k else msg.replace("|", "\\|")[:100]
            lines.append(f"| `{t}` | {r} | {o} | {note} |")
        lines.append("")
    lines.append("Import rewrites applied to the test (test bodies are not edited):")
    lines.append("")
    for _, _, why in REWRITES:
        lines.append(f"- {why}")
    lines.append("")
    lines.append(
        "Tests that use more than oryx harvest's public API, or match oryx's exact error text:"
    )
    lines.append("")
    for t, why in sorted(internal.items()):
        lines.append(f"- `{t}`: {'; '.join(why)}")
    return "\n".join(lines)


def update_readme(text: str, begin: str = BEGIN, end: str = END) -> None:
    body = README.read_text()
    if begin not in body or end not in body:
        raise SystemExit(f"{README} lacks the {begin} / {end} markers")
    pre, rest = body.split(begin, 1)
    _, post = rest.split(end, 1)
    README.write_text(f"{pre}{begin}\n{text}\n{end}{post}")


def render_ppl(ref, ours, known, ref_note) -> str:
    files = ", ".join(f"`{Path(n).name}`" for n in PPL_TESTS_IN_WHEEL)
    lines = [
        f"oryx {ORYX_VERSION}'s {files}, extracted from the wheel at run "
        "time and run unmodified: under real oryx, and under import "
        "redirection to `harvest.compat.oryx` (`compat/oryx_redirect.py`, "
        "loaded by a conftest.py; no line of the tests is edited). Last run "
        "by `compat/run_oryx_tests.py`.",
        "",
    ]
    lines.append(
        f"- Real oryx ({ref_note}): **{counts(ref)}**"
        if ref is not None
        else f"- Real oryx: not run ({ref_note})"
    )
    lines.append(
        f"- `harvest.compat.oryx` (project venv): **{counts(ours)}**"
        if ours is not None
        else "- `harvest.compat.oryx`: not run"
    )
    notable = [
        t
        for t in sorted(set(ref or {}) | set(ours or {}))
        if (ref or {}).get(t, ("passed",))[0] != "passed"
        or (ours or {}).get(t, ("passed",))[0] != "passed"
    ]
    if notable:
        lines += [
            "",
            "| test | real oryx | harvest.compat.oryx | note |",
            "| --- | --- | --- | --- |",
        ]
        for t in notable:
            r = (ref or {}).get(t, ("-", ""))
            o = (ours or {}).get(t, ("-", ""))
            note = known.get(t)
            note = f"documented: {note}" if note else (o[1] or r[1]).replace("|", "\\|")[:100]
            lines.append(f"| `{t}` | {r[0]} | {o[0]} | {note} |")
    return "\n".join(lines)


def run_ppl_tests(args, tmp: Path) -> int:
    """oryx's ppl tests: unmodified, under real oryx and under redirection."""
    names = [Path(n).name for n in PPL_TESTS_IN_WHEEL]
    ref, ref_note = None, ""
    oryx_py = ORYX_VENV / "bin" / "python"
    if args.reference != "skip" and oryx_py.exists():
        ref_dir = tmp / "reference_ppl"
        ref_dir.mkdir()
        for n in names:
            shutil.copy(tmp / n, ref_dir / n)
        ref = run_pytest(str(oryx_py), ref_dir, {}, "reference")
        ref_note = "jax 0.4.38, .oryx-venv"
        PPL_BASELINE.write_text(
            json.dumps(
                {
                    "note": f"outcomes of oryx {ORYX_VERSION}'s unmodified ppl tests "
                    f"({', '.join(names)}) under real oryx ({ref_note}), "
                    "written by compat/run_oryx_tests.py",
                    "tests": {t: o for t, (o, _) in sorted(ref.items())},
                },
                indent=1,
            )
            + "\n"
        )
    elif PPL_BASELINE.exists():
        base = json.loads(PPL_BASELINE.read_text())
        ref = {t: (o, "") for t, o in base["tests"].items()}
        ref_note = f"recorded in {PPL_BASELINE.relative_to(ROOT)}"
    else:
        ref_note = f"{oryx_py} missing; run compat/oryx_venv.sh"
    if ref is not None:
        print(f"real oryx {ORYX_VERSION} ppl tests: {counts(ref)} ({ref_note})")

    ours = None
    if args.ours == "run":
        ours_dir = tmp / "ours_ppl"
        ours_dir.mkdir()
        for n in names:
            shutil.copy(tmp / n, ours_dir / n)
        shutil.copy(HERE / "oryx_redirect.py", ours_dir / "oryx_redirect.py")
        (ours_dir / "conftest.py").write_text("import oryx_redirect  # noqa: F401\n")
        extra = ensure_absl(tmp)
        path = [str(ROOT)] + ([extra.pop("_EXTRA_PATH")] if extra else [])
        pp = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
        ours = run_pytest(sys.executable, ours_dir, {"PYTHONPATH": pp}, "ours")

    known = load_known("oryx_ppl_test:")
    regressions = []
    for t in sorted(set(ref or {}) | set(ours or {})):
        r = (ref or {}).get(t, ("-", ""))
        o = (ours or {}).get(t, ("-", ""))
        if args.verbose or r[0] not in ("passed", "-") or o[0] not in ("passed", "-"):
            print(f"  {t:<75} oryx={r[0]:<7} ours={o[0]:<7} {o[1] or r[1]}"[:220])
        if ours is not None and o[0] != "passed" and r[0] in ("passed", "-") and t not in known:
            regressions.append(t)
    if args.update_readme:
        update_readme(render_ppl(ref, ours, known, ref_note), PPL_BEGIN, PPL_END)
    if ours is not None:
        if regressions:
            print(f"{len(regressions)} ppl test(s) pass under real oryx but fail here")
        print(f"oryx_ppl_tests: {counts(ours)}")
    return 1 if regressions else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--reference",
        choices=["auto", "build", "skip"],
        default="auto",
        help="run the unmodified test under real oryx in .oryx-venv",
    )
    ap.add_argument("--ours", choices=["run", "skip"], default="run")
    ap.add_argument(
        "--module",
        default="harvest.compat.oryx",
        help="module the rewritten test imports as `harvest` "
        "(e.g. oryx.core.interpreters.harvest to check the "
        "rewrite itself inside .oryx-venv)",
    )
    ap.add_argument("--update-readme", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="oryx-tests-"))
    try:
        pip_python = sys.executable
        orig = fetch_test(tmp, pip_python)
        src = orig.read_text()
        methods = test_methods(src)
        internal = internals(src)

        ref, ref_note = None, ""
        oryx_py = ORYX_VENV / "bin" / "python"
        if args.reference == "build":
            subprocess.run(["bash", str(HERE / "oryx_venv.sh")], check=True)
        if args.reference != "skip" and oryx_py.exists():
            ref_dir = tmp / "reference"
            ref_dir.mkdir()
            ref_file = ref_dir / "harvest_test.py"
            shutil.copy(orig, ref_file)
            ref = run_pytest(str(oryx_py), ref_file, {}, "reference")
            ver = subprocess.run(
                [str(oryx_py), "-c", "import jax; print(jax.__version__)"],
                capture_output=True,
                text=True,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )
            ref_note = f"jax {ver.stdout.strip()}, .oryx-venv"
            print(f"real oryx {ORYX_VERSION} (unmodified test): {counts(ref)}")
            BASELINE.write_text(
                json.dumps(
                    {
                        "note": f"outcomes of oryx {ORYX_VERSION}'s unmodified "
                        "harvest_test.py under real oryx (" + ref_note + "), "
                        "written by compat/run_oryx_tests.py",
                        "tests": {t: o for t, (o, _) in sorted(ref.items())},
                    },
                    indent=1,
                )
                + "\n"
            )
        elif BASELINE.exists():
            base = json.loads(BASELINE.read_text())
            ref = {t: (o, "") for t, o in base["tests"].items()}
            ref_note = f"recorded in {BASELINE.relative_to(ROOT)}"
            print(f"real oryx {ORYX_VERSION}: {counts(ref)} ({ref_note})")
        else:
            ref_note = (
                "skipped"
                if args.reference == "skip"
                else f"{oryx_py} missing; run compat/oryx_venv.sh"
            )
            print(f"real oryx: {ref_note}")

        ours = None
        if args.ours == "run":
            ours_dir = tmp / "ours"
            ours_dir.mkdir()
            ours_file = ours_dir / "harvest_test.py"
            ours_file.write_text(rewrite(src, args.module))
            extra = ensure_absl(tmp)
            path = [str(ROOT)] + ([extra.pop("_EXTRA_PATH")] if extra else [])
            pp = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
            ours = run_pytest(sys.executable, ours_file, {"PYTHONPATH": pp}, "ours")

        known = load_known()
        regressions = []
        collect_err = [
            t for t, (o, _) in (ours or {}).items() if t.split(".")[-1] in ("", "harvest_test")
        ]
        if ours is not None and collect_err:
            print(f"ours: the rewritten module did not import: {ours[collect_err[0]][1]}")
        for t in sorted(set(ref or {}) | set(ours or {})):
            r = (ref or {}).get(t, ("-", ""))
            o = (ours or {}).get(t, ("-", ""))
            if (
                args.verbose
                or r[0] not in ("passed", "-")
                or (o[0] not in ("passed", "-") and not collect_err)
            ):
                print(f"  {t:<75} oryx={r[0]:<7} ours={o[0]:<7} {o[1] or r[1]}"[:220])
            if ours is not None and o[0] != "passed" and r[0] in ("passed", "-"):
                if method_of(t, methods) not in known and t not in known:
                    regressions.append(t)
        print("tests using more than oryx harvest's public API (or matching its error text):")
        for t, why in sorted(internal.items()):
            print(f"  {t}: {'; '.join(why)}")

        text = render(ref, ours, methods, internal, known, ref_note)
        if args.update_readme:
            update_readme(text)
            print(f"updated {README}")
        if ours is not None:
            if regressions:
                print(f"{len(regressions)} test(s) pass under real oryx but fail here")
            # The plain closing line CI-style runners read.
            c = counts(ours)
            print(f"oryx_tests: {c}")
        print("\n== oryx 0.2.9's own ppl tests (unmodified, import redirection)", flush=True)
        rc_ppl = run_ppl_tests(args, tmp)
        return 1 if (regressions or rc_ppl) else 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
