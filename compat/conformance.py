"""Entry point for ``make conformance``: both oryx conformance checks.

    .venv/bin/python compat/conformance.py

1. ``compare.py``: every scenario under ``harvest.compat.oryx`` against the
   golden results recorded from real oryx 0.2.9 (no network, no old venv).
2. ``run_oryx_tests.py``: oryx 0.2.9's own harvest tests (rewritten to import
   ``harvest.compat.oryx``) and ppl tests (unmodified, under import
   redirection), fetched from PyPI.  The reference run under real oryx
   happens when ``.oryx-venv`` exists (``bash compat/oryx_venv.sh``);
   otherwise the recorded reference outcomes in ``golden/`` are used.  Both
   counts, ours and real oryx's, are written into ``compat/README.md``.

Exit status is non-zero if either check fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> int:
    import compare  # noqa: PLC0415
    import run_oryx_tests  # noqa: PLC0415

    print("== scenarios vs golden oryx 0.2.9 results", flush=True)
    rc1 = compare.main([])
    print("\n== oryx 0.2.9's own harvest and ppl tests", flush=True)
    rc2 = run_oryx_tests.main(["--update-readme"])
    return 1 if (rc1 or rc2) else 0


if __name__ == "__main__":
    sys.exit(main())
