"""Draws docs/_static/patching_heatmap.png, the activation patching guide's figure.

    python docs/_static/patching_heatmap.py

It runs the code of docs/guides/activation_patching.md (the same small
transformer, sweeps and results the guide shows), then saves the guide's
side-by-side plot: exact patching and attribution patching, as fractions of
the clean-corrupt gap, on one colour scale.
"""

from __future__ import annotations

import pathlib
import re
import sys

import matplotlib

matplotlib.use("Agg")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # draw with the working tree's harvest


def main() -> None:
    guide = (ROOT / "docs" / "guides" / "activation_patching.md").read_text()
    namespace: dict = {"__name__": "activation_patching_guide"}
    for block in re.findall(r"^```python\n(.*?)^```", guide, re.S | re.M):
        exec(compile(block, "activation_patching.md", "exec"), namespace)
    from harvest import PatchingResult

    axes = PatchingResult.plot_many(
        [namespace["exact"], namespace["estimate"]],
        titles=["activation patching", "attribution patching"],
    )
    figure = axes[0].figure
    figure.suptitle("Which (site, position) carries the clean answer")
    # 100 dpi: narrower than the 900-pixel content column of the docs.
    figure.savefig(HERE / "patching_heatmap.png", dpi=100)


if __name__ == "__main__":
    main()
