"""Draws docs/_static/readme_patching.png, the figure of the README's patching job.

    python docs/_static/readme_patching.py

It runs the README's Python blocks (the same model, sweep and plot call the
README shows) and saves the figure the last ``result.plot(...)`` drew, at
100 dpi, so it is narrower than the 900-pixel content column.
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
DPI = 100


def main() -> None:
    import matplotlib.pyplot as plt

    readme = (ROOT / "README.md").read_text()
    namespace: dict = {"__name__": "readme"}
    for block in re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M):
        exec(compile(block, "README.md", "exec"), namespace)
        if "result.plot(" in block:
            break
    figure = plt.gcf()
    width = figure.get_size_inches()[0] * DPI
    assert width <= 900, f"the figure is {width:.0f} px wide; the column holds 900"
    figure.savefig(HERE / "readme_patching.png", dpi=DPI)
    print(f"wrote {HERE / 'readme_patching.png'} ({width:.0f} px wide)")


if __name__ == "__main__":
    main()
