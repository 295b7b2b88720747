"""Draws docs/_static/view_block.png: `view` of an instrumented NNX transformer block.

    python docs/_static/view_block.py

Saves the page `view` writes for a pre-norm block (layer norms, attention, an
MLP) instrumented with ``ops=True``, opens every module, hovers the output of ``attn.query`` (its
inputs light up red, its readers blue) and searches for ``kernel``, then
screenshots it in headless Chromium (``make chromium`` installs it) and crops
the picture around that node to a width that fits the docs' content column.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import PIL.Image
from flax import nnx

from harvest import instrument, view

HERE = pathlib.Path(__file__).resolve().parent
WINDOW = "2200,2000"  # the whole graph at full size, then cropped
CROP = (880, 700)  # px: narrower than the docs' 900-pixel content column

# After the view has drawn itself: open every module (a model opens on its top-level
# structure), hover one node, search, scroll to the attention.
ACT = """
<script>
var root = document.querySelector(".harvest-view");
root.harvestOpen(true, "module");
var target = Array.from(root.querySelectorAll("g.hv-node")).filter(function (g) {
  return g.textContent.indexOf("attn.queryadd") === 0;
})[0];
target.dispatchEvent(new MouseEvent("mouseenter"));
var search = root.querySelector(".hv-search");
search.value = "kernel";
search.dispatchEvent(new Event("input"));
var box = target.getBoundingClientRect();
document.title = Math.round(box.left + box.width / 2) + "," + Math.round(box.top);
</script>
"""


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.relu(self.up(self.ln2(x))))


def main() -> int:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("needs Chromium: make chromium")
    v = view(instrument(Block(8, nnx.Rngs(0)), ops=True))(jnp.ones((5, 8)))
    with tempfile.TemporaryDirectory() as tmp:
        page = pathlib.Path(tmp) / "view.html"
        page.write_text(v.page().replace("</body>", ACT + "</body>"), encoding="utf-8")
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp}/profile", f"--window-size={WINDOW}",
            "--virtual-time-budget=10000", "--hide-scrollbars",
        ]  # fmt: skip
        shot = HERE / "view_block.png"
        run = lambda *extra: subprocess.run(  # noqa: E731
            [browser, *flags, *extra, page.as_uri()],
            capture_output=True, text=True, timeout=180, check=True,
        ).stdout  # fmt: skip
        title = re.search(r"<title>(\d+),(\d+)</title>", run("--dump-dom"))
        x, y = int(title.group(1)), int(title.group(2))
        run(f"--screenshot={shot}")
    left, top = max(0, x - 2 * CROP[0] // 3), max(0, y - 240)
    with PIL.Image.open(shot) as full:
        full.crop((left, top, left + CROP[0], top + CROP[1])).save(shot)
    print(f"wrote {shot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
