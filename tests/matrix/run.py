"""`make test-matrix`: the test suite on every JAX release harvest is tested with.

Each pin file `tests/matrix/jax-<version>.txt` names one release with the
optional dependencies that support it. For each, this builds a venv
`.venv-jax-<version>` (once; again when the pin file changes), runs the suite
there, one release at a time (building the next release's venv meanwhile), and
prints

    version | passed | failed | skipped

It exits non-zero if any release has a failure or an error, so CI fails too.
`--docs` also writes the table into docs/jax_versions.md.

    python tests/matrix/run.py [--only 0.8.3,0.9.2] [--docs] [pytest args...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DOCS = ROOT / "docs" / "jax_versions.md"
# What the matrix leaves to `make test`, which runs it once on the primary release: the
# bench harness's end-to-end runs (`benchmark`: they test the harness, and would add
# minutes per release) and the tests whose verdict does not depend on the JAX release
# (`single_release`: docs, notebooks, text checks; see pyproject.toml's markers).
DESELECT = "not benchmark and not single_release"
BEGIN, END = "<!-- matrix: written by `python tests/matrix/run.py --docs` -->", "<!-- /matrix -->"


def _version_key(v):
    return tuple(int(p) for p in v.split("."))


def releases():
    found = [p.stem.removeprefix("jax-") for p in HERE.glob("jax-*.txt")]
    return sorted(found, key=_version_key)


def _pins(version):
    """The pin file's requirements, with `-r` includes expanded (the venv's stamp)."""
    lines = []
    for line in (HERE / f"jax-{version}.txt").read_text().splitlines():
        if line.startswith("-r "):
            lines += (HERE / line[3:].strip()).read_text().splitlines()
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def ensure_venv(version, python):
    venv = ROOT / f".venv-jax-{version}"
    stamp = venv / ".pins"
    pins = _pins(version)
    if stamp.exists() and stamp.read_text() == pins:
        return venv
    log = ROOT / f".venv-jax-{version}.log"
    print(f"building {venv.name} ...", flush=True)
    start = time.monotonic()
    with open(log, "w") as out:
        steps = [
            [python, "-m", "venv", "--clear", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "-r",
                str(HERE / f"jax-{version}.txt"),
            ],
        ]
        for cmd in steps:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"could not build {venv.name}: {' '.join(cmd)} failed; see {log.name}")
    stamp.write_text(pins)
    print(f"built {venv.name} in {time.monotonic() - start:.0f} s", flush=True)
    return venv


def run_suite(version, venv, pytest_args):
    report = venv / "results.xml"
    report.unlink(missing_ok=True)
    # harvest is imported from the source tree, in this process and in the
    # subprocesses the tests start.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        # two workers, as `make test`: the suite is CPU-bound and CI has 2 cores
        "-n",
        "2",
        # an idle worker takes the other's queued tests, so no long test ends alone
        "--dist",
        "worksteal",
        "-m",
        DESELECT,
        f"--junitxml={report}",
    ]
    start = time.monotonic()
    suite = subprocess.Popen(cmd + pytest_args, cwd=ROOT, env=env)
    # The suite's own CPU time (pytest and its workers), not the venv builds running beside it.
    _, status, usage = os.wait4(suite.pid, 0)
    suite.returncode = os.waitstatus_to_exitcode(status)
    seconds, cpu = time.monotonic() - start, usage.ru_utime + usage.ru_stime
    if not report.exists():
        return dict(version=version, passed=0, failed=1, skipped=0, seconds=seconds, cpu=cpu)
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    for suite in ET.parse(report).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    return dict(
        version=version,
        passed=passed,
        failed=failed,
        skipped=counts["skipped"],
        seconds=seconds,
        cpu=cpu,
    )


def table(rows):
    lines = ["| JAX | passed | failed | skipped |", "|---|---:|---:|---:|"]
    lines += [f"| {r['version']} | {r['passed']} | {r['failed']} | {r['skipped']} |" for r in rows]
    return "\n".join(lines)


def write_docs(rows):
    text = DOCS.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        sys.exit(f"{DOCS} has no {BEGIN} ... {END} block to write the table into")
    DOCS.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table(rows)}\n{END}", text))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="comma-separated versions (default: every pin file)")
    parser.add_argument(
        "--docs", action="store_true", help="write the table into docs/jax_versions.md"
    )
    parser.add_argument(
        "--python",
        default=os.environ.get("PYTHON", "python3"),
        help="the Python that builds the venvs",
    )
    args, pytest_args = parser.parse_known_args(argv)
    versions = releases()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(versions))
        if unknown:
            sys.exit(f"no pin file for {', '.join(unknown)}; known: {', '.join(versions)}")
        versions = [v for v in versions if v in wanted]
    rows = []
    # The next release's venv is built (mostly pip downloading and unpacking) while the
    # current release's suite runs, instead of after it; a failed build stops the run.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as builder:
        building = builder.submit(ensure_venv, versions[0], args.python) if versions else None
        for i, version in enumerate(versions):
            venv = building.result()
            if i + 1 < len(versions):
                building = builder.submit(ensure_venv, versions[i + 1], args.python)
            print(f"== jax {version}", flush=True)
            rows.append(run_suite(version, venv, pytest_args))
    print()
    print(table(rows))
    # CPU time too: on a shared machine the wall time says more about the neighbours.
    print(
        "seconds per release (wall, cpu): "
        + ", ".join(f"{r['version']} {r['seconds']:.0f}, {r['cpu']:.0f}" for r in rows)
    )
    if args.docs:
        write_docs(rows)
    print(
        f"matrix: {sum(r['passed'] for r in rows)} passed, {sum(r['failed'] for r in rows)} failed"
    )
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
