"""`make docs-check`: screenshots of the built pages in headless Chromium, checked.

    python docs/_static/docs_check.py docs/_build/html [--out DIR]

Each page (the index, the quick start, every guide and notebook, the
reference pages) is opened in headless Chromium, at the width of a laptop
window, with a small script added to a copy of it that measures, once the
page has loaded:

* code clipped: a code block whose content is wider than the block (its
  line ends would hide behind a scrollbar; a notebook's printed output and
  the API reference's docstring examples, the package's own lines, may
  scroll instead);
* tables clipped: a table wider than the box that shows it (its last columns
  would hide behind a scrollbar a reader may never see) or than the column;
* figures: an image wider than 900 px, or one drawn at less than 3/4 of its
  own width (squeezed, so its tick labels shrink below readable);
* test markers a reader would see (``# not-run``);
* anything wider than the page's content column.

A screenshot of each page is saved (``--out``, default
``docs/_build/screenshots``) for a person to look at. Exits 1, listing every
problem, if any page has one. Needs Chromium (Debian: ``apt-get install
chromium``).
"""

from __future__ import annotations

import argparse
import html
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

MAX_FIGURE = 900  # px: the content column of the book theme at this window width
SQUEEZE = 0.75  # an image drawn narrower than this fraction of its width is squeezed
WINDOW = "1280,2400"
MARKERS = ["# not-run"]
PAGES = [
    "index",
    "quickstart",
    "how_it_works",
    "semantics",
    "api",
    "guides/*",
    "notebooks/*",
]

# Added to each page's copy: measures after load, writes JSON into the DOM.
PROBE = """
<script>
window.addEventListener("load", function () {
  var problems = [];
  var column = document.querySelector("article") || document.body;
  var edge = column.getBoundingClientRect().right;
  function start(el) { return el.textContent.trim().split("\\n")[0].slice(0, 60); }
  function scrolls(el) { return /auto|scroll/.test(getComputedStyle(el).overflowX); }
  // The box that shows `el`: the nearest scrolling ancestor inside the column, or itself.
  function box(el) {
    for (var e = el; e && e !== column; e = e.parentElement) if (scrolls(e)) return e;
    return el;
  }
  column.querySelectorAll("div.highlight pre, pre.literal-block").forEach(function (pre, i) {
    var wide = pre.scrollWidth > pre.clientWidth + 1;
    // A notebook's printed output (a wide `sites()` table) may scroll, and so may a
    // docstring's example in the API reference (the source's lines, up to the package's
    // 100 columns); the pages' own code may not.
    var mayScroll = pre.closest(".cell_output, .output, dl.py");
    if (wide && !(mayScroll && scrolls(pre))) {
      problems.push("code block " + i + " is clipped (" + pre.scrollWidth + " px of content in " +
        pre.clientWidth + " px): " + start(pre));
    }
  });
  column.querySelectorAll("table").forEach(function (table, i) {
    var shown = box(table);
    if (shown.scrollWidth > shown.clientWidth + 1 || shown.getBoundingClientRect().right > edge + 1) {
      problems.push("table " + i + " is clipped (" + shown.scrollWidth + " px of columns in " +
        shown.clientWidth + " px; its last columns hide): " + start(table));
    }
  });
  column.querySelectorAll("img").forEach(function (img) {
    var name = img.getAttribute("src").slice(0, 60);
    if (img.naturalWidth > MAX_FIGURE) {
      problems.push("figure " + name + " is " + img.naturalWidth + " px wide (at most MAX_FIGURE)");
    }
    if (img.naturalWidth && img.clientWidth < SQUEEZE * img.naturalWidth) {
      problems.push("figure " + name + " is squeezed to " + img.clientWidth + " of its " +
        img.naturalWidth + " px");
    }
  });
  var text = column.innerText;
  MARKERS.forEach(function (m) {
    if (text.indexOf(m) >= 0) problems.push("the test marker '" + m + "' is visible");
  });
  if (column.scrollWidth > column.clientWidth + 1) {
    var widest = null;
    column.querySelectorAll("*").forEach(function (el) {
      if (!widest || el.getBoundingClientRect().right > widest.getBoundingClientRect().right) {
        widest = el;
      }
    });
    problems.push("the content is " + column.scrollWidth + " px wide in a " +
      column.clientWidth + " px column, widest: <" + widest.tagName.toLowerCase() + "> " +
      start(widest));
  }
  var out = document.createElement("pre");
  out.id = "docs-check-result";
  out.textContent = JSON.stringify(problems);
  document.body.appendChild(out);
  out.style.display = "none";
});
</script>
"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        sys.exit("docs-check needs Chromium: apt-get install chromium (Debian)")
    return found


def browse(browser: str, page: pathlib.Path, *args: str) -> str:
    profile = tempfile.mkdtemp(prefix="docs-check-")
    try:
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            f"--user-data-dir={profile}", f"--window-size={WINDOW}",
            "--virtual-time-budget=10000", "--hide-scrollbars",
        ]  # fmt: skip
        done = subprocess.run(
            [browser, *flags, *args, page.resolve().as_uri()],
            capture_output=True, text=True, timeout=180, check=True,
        )  # fmt: skip
        return done.stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def pages(root: pathlib.Path) -> list[pathlib.Path]:
    found: list[pathlib.Path] = []
    for pattern in PAGES:
        found += sorted(root.glob(f"{pattern}.html"))
    return found


def check(root: pathlib.Path, out: pathlib.Path) -> dict[str, list[str]]:
    browser = chromium()
    out.mkdir(parents=True, exist_ok=True)
    probe = PROBE.replace("MAX_FIGURE", str(MAX_FIGURE)).replace(
        "SQUEEZE", str(SQUEEZE)
    )
    probe = probe.replace("MARKERS", json.dumps(MARKERS))
    report = {}
    for page in pages(root):
        name = page.relative_to(root).with_suffix("").as_posix()
        probed = page.with_name(f".docs-check-{page.name}")
        probed.write_text(page.read_text().replace("</body>", probe + "</body>"))
        try:
            dom = browse(browser, probed, "--dump-dom")
            browse(
                browser,
                page,
                f"--screenshot={out / (name.replace('/', '--') + '.png')}",
            )
        finally:
            probed.unlink()
        found = re.search(r'<pre id="docs-check-result"[^>]*>(.*?)</pre>', dom, re.S)
        if found is None:
            report[name] = [
                "the page did not finish loading (no result from the probe)"
            ]
        else:
            report[name] = json.loads(html.unescape(found.group(1)))
    return report


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(
        prog="docs_check.py", description=__doc__.split("\n")[0]
    )
    cli.add_argument(
        "html", type=pathlib.Path, help="the built site (docs/_build/html)"
    )
    cli.add_argument(
        "--out", type=pathlib.Path, default=None, help="where screenshots go"
    )
    args = cli.parse_args(argv)
    out = args.out or args.html.parent / "screenshots"
    report = check(args.html, out)
    bad = {page: problems for page, problems in report.items() if problems}
    for page, problems in report.items():
        print(f"{'FAIL' if problems else 'ok  '} {page}")
        for problem in problems:
            print(f"       {problem}")
    print(
        f"{len(report)} pages checked, {len(bad)} with problems; screenshots in {out}"
    )
    return 1 if bad or not report else 0


if __name__ == "__main__":
    sys.exit(main())
