"""Draws the activation-patching guide's figures.

    python docs/_static/patching_heatmap.py

It runs the code of docs/guides/activation_patching.md (the trained model of
docs/_static/induction.npz, the sweeps and results the guide shows), then
saves:

* patching_heatmap.png: exact patching and attribution patching, as
  fractions of the clean-corrupt gap, side by side on one colour scale;
* induction_heads.png: the heads × positions sweep of each head's output;
* induction_attention.png: layer 1's attention pattern on the first prompt.
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
    from harvest import PatchingResult, plot_attention

    axes = PatchingResult.plot_many(
        [namespace["exact"], namespace["estimate"]],
        titles=["activation patching", "attribution patching"],
        xlabel="position",
    )
    figure = axes[0].figure
    figure.suptitle("Which (site, position) carries the clean answer")
    # 100 dpi: narrower than the 900-pixel content column of the docs.
    figure.savefig(HERE / "patching_heatmap.png", dpi=100)
    axes = namespace["heads"].plot(
        title="fraction of the gap restored, per head and position",
        ylabel="head",
        xlabel="position",
    )
    axes[0].figure.savefig(HERE / "induction_heads.png", dpi=100)
    axes = plot_attention(
        namespace["clean"]["blocks1"]["pattern"][0],
        tokens=namespace["first"],
        title="layer 1: the induction heads (first prompt)",
    )
    axes[0].figure.savefig(HERE / "induction_attention.png", dpi=100)


if __name__ == "__main__":
    main()
