#!/usr/bin/env bash
# Build (idempotently) the reference venv that runs the REAL oryx 0.2.9 harvest.
#
# oryx 0.2.9 no longer imports on the JAX the project uses, so the golden
# results and oryx's own harvest tests are produced in this separate venv.
# Re-running is cheap: a stamp file records the pinned set that was installed.
#
# Usage: bash compat/oryx_venv.sh        (prints the venv's python path last)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${ORYX_VENV:-$ROOT/.oryx-venv}"
PYTHON="${PYTHON:-python3}"

# oryx 0.2.9's harvest imports with jax/jaxlib 0.4.38 and TFP 0.25.0 (oryx
# itself pins nothing that new); numpy<2 matches what that jaxlib and TFP were
# built and tested against; pytest and absl-py run oryx's own absltest-based
# test module.
PINS=(
  "jax==0.4.38"
  "jaxlib==0.4.38"
  "tensorflow-probability==0.25.0"
  "oryx==0.2.9"
  "numpy<2"
  "absl-py"
  "pytest"
)
STAMP="$VENV/.oryx-pins"
WANT="$(printf '%s\n' "${PINS[@]}")"

if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
   && "$VENV/bin/python" -c "import oryx.core.interpreters.harvest" >/dev/null 2>&1; then
  echo "oryx venv up to date: $VENV" >&2
else
  echo "building oryx venv: $VENV" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "${PINS[@]}"
  printf '%s\n' "${PINS[@]}" > "$STAMP"
fi

# Verify: the real harvest module imports and a tiny reap works.
JAX_PLATFORMS=cpu "$VENV/bin/python" - <<'PY' >&2
import jax, oryx
from oryx.core.interpreters import harvest
out = harvest.reap(lambda x: harvest.sow(x + 1., tag="t", name="y"), tag="t")(1.)
assert float(out["y"]) == 2.0, out
from importlib.metadata import version
print(f"oryx {version('oryx')} OK on jax {jax.__version__}")
PY
echo "$VENV/bin/python"
