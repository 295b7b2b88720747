"""The public signatures catch misuse: mypy reports each mistake in a wrong snippet.

tests/typing/usage.py (checked by `make lint`) says what a user is told on
correct code; this checks the other half, that wrong code is an error, so a
signature loosened to `Callable[..., Any]` fails here.
"""

import pathlib
import re
import textwrap

import pytest

pytestmark = pytest.mark.single_release  # type checking; the JAX matrix skips it

mypy_api = pytest.importorskip("mypy.api", reason="mypy is in the `test` extra")
ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each line ending in `# E: code ...` must be reported with exactly those error
# codes, and no other line may be reported.
WRONG = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp

    import harvest
    import harvest.ppl as ppl


    def f(x: jax.Array, scale: float) -> jax.Array:
        return x * scale


    def sampler(key: jax.Array) -> jax.Array:
        return jax.random.normal(key)


    x = jnp.ones(3)
    harvest.reap(f)(x, "two")  # E: arg-type
    harvest.reap(f)(x, 2.0, 3)  # E: call-arg
    h: jax.Array = harvest.reap(f)(x, 2.0)  # E: assignment
    harvest.plant(f)(x, 2.0)  # E: arg-type call-arg
    harvest.plant(f)({"h": x}, x, scale="two")  # E: arg-type
    out, reaps = harvest.call_and_reap(f)(x, 2.0)
    reaps.shape  # E: attr-defined
    harvest.harvest(f)({"h": x}, x)  # E: call-arg
    harvest.nest(f, scope="s")(x)  # E: call-arg
    harvest.sow(x, name="h", mode="stack")  # E: arg-type
    harvest.sow(x)  # E: call-arg
    harvest.reap(f, names=[1])  # E: list-item
    harvest.reap(f, allowlist="h")  # E: call-arg
    harvest.instrument(f)(x, scale="two")  # E: arg-type
    ppl.random_variable(sampler)  # E: call-overload
    ppl.plate(sampler, name="data")  # E: call-overload
    ppl.joint_sample(f)(x, "two")  # E: arg-type
    ppl.joint_log_prob(f)({"z": x}, x)  # E: arg-type
    """
)


def test_mypy_reports_each_misuse(tmp_path):
    path = tmp_path / "wrong.py"
    path.write_text(WRONG)
    # The options `make lint` checks the package with (pyproject's), and its cache, which
    # `make test` has just filled: only the snippet is checked anew, not harvest and JAX
    # (mypy re-checks any module whose source or options changed since). Errors in other
    # files, were there any, do not match the pattern below. An unchanged snippet's errors
    # come from the cache, under the path of the run that wrote them: the file name is matched.
    stdout, stderr, _ = mypy_api.run(
        [
            str(path),
            "--strict",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
        ]
    )
    assert not stderr, stderr
    reported = {
        (int(m.group(1)), m.group(2))
        for m in re.finditer(
            rf"^\S*\b{re.escape(path.name)}:(\d+): error: .*\[([a-z-]+)\]$", stdout, re.M
        )
    }
    expected = {
        (number, code)
        for number, line in enumerate(WRONG.splitlines(), start=1)
        if (m := re.search(r"# E: ([a-z -]+)$", line))
        for code in m.group(1).split()
    }
    assert reported == expected, stdout
