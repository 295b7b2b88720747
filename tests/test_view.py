"""harvest.view: the traced program's dataflow graph as self-contained HTML.

The structure is checked without a browser (a node per site and op, a box per
body, edges as data dependencies, summaries after a reap, nothing fetched from
the network); then, if Chromium is installed, the page is rendered headless and
the edges the script draws are counted in the rendered DOM.
"""

import html.parser
import os
import re
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import instrument, nest, reap, sites, sow, view


def program(xs):
    def body(c, x):
        h = sow(x * c, name="step", mode="append")
        return c + h, None

    c = jax.lax.scan(body, 1.0, xs)[0]
    c = jax.lax.cond(c > 0, lambda y: y * 2.0, lambda y: y, c)
    return nest(lambda y: sow(jnp.tanh(y), name="out", mode="strict"), scope="head")(c)


class Nodes(html.parser.HTMLParser):
    """Every element with a data-node: (tag, classes, data-from ids)."""

    def __init__(self, text):
        super().__init__()
        self.nodes, self.tags = {}, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if "data-node" in attrs:
            sources = (attrs.get("data-from") or "").split()
            self.nodes[attrs["data-node"]] = (tag, attrs.get("class", "").split(), sources)


def test_a_node_per_site_and_op_a_box_per_body_edges_by_dependency():
    xs = jnp.arange(4.0)
    v = view(program, xs)
    parsed = Nodes(v.html)
    site_nodes = [n for n, (_, cls, _) in parsed.nodes.items() if "hv-site" in cls]
    assert v.sites == len(site_nodes) == len(sites(program, xs)) == 2
    text = v.html
    assert "head.out" in text and ">step<" in text
    groups = [n for n, (tag, _, _) in parsed.nodes.items() if tag == "details"]
    # One box for the scan body, one per cond branch.
    assert v.groups == len(groups) == 3 and "scan[4]" in text and "cond[1]" in text
    # Every edge points at a node that exists, and the site `step` is fed by the mul.
    for _, _, sources in parsed.nodes.values():
        assert all(s in parsed.nodes for s in sources)
    step = next(n for n in site_nodes if "step" in text.split(f'data-node="{n}"')[1][:200])
    (source,) = parsed.nodes[step][2]
    assert "mul" in text.split(f'data-node="{source}"')[1][:200]
    # Shapes and dtypes on the ops.
    assert "float32[]" in text


def test_value_summaries_after_a_reap_are_the_values_statistics():
    xs = jnp.arange(4.0)
    reaped = reap(program)(xs)
    v = view(program, xs, values=reaped)
    step = np.asarray(reaped["step"])
    stats = re.findall(r"mean ([-\d.e+]+) · std ([-\d.e+]+)", v.html)
    assert len(stats) == 2
    np.testing.assert_allclose([float(s) for s in stats[0]], [step.mean(), step.std()], rtol=1e-3)
    assert v.html.count("<rect") == 24  # a 12-bin histogram per summarised site


def test_the_page_is_self_contained_and_ops_of_instrument_are_sites():
    v = view(instrument(lambda x: jnp.sin(x) * 2.0, ops=True), jnp.ones(3))
    assert v.sites == 2  # sin and mul, each an op site
    page = v.page()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "fetches from a network"
    assert "<script src" not in page and "@import" not in page
    with pytest.raises(TypeError, match="callable"):
        view(3, 1.0)
    with pytest.raises(TypeError, match="dict"):
        view(program, jnp.ones(2), values=[1.0])


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    _chromium() is None, reason="Chromium is not installed (apt-get install chromium)"
)
def test_chromium_renders_the_graph_and_draws_its_edges(tmp_path):
    xs = jnp.arange(4.0)
    path = view(program, xs, values=reap(program)(xs)).save(tmp_path / "view.html")
    profile = tempfile.mkdtemp()
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        f"--user-data-dir={profile}", "--window-size=900,700",
    ]  # fmt: skip
    try:
        dom = subprocess.run(
            [_chromium(), *flags, "--dump-dom", path.as_uri()],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
        shot = tmp_path / "view.png"
        subprocess.run(
            [_chromium(), *flags, f"--screenshot={shot}", path.as_uri()],
            capture_output=True, timeout=120, check=True,
        )  # fmt: skip
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    edges = dom.count('class="hv-edge"')
    dependencies = sum(len(s) for _, _, s in Nodes(path.read_text()).nodes.values())
    # The script drew edges (at most one per dependency, fewer where both ends share a box).
    assert 0 < edges <= dependencies, (edges, dependencies)
    assert os.path.getsize(shot) > 5000  # a real picture, not a blank page


def test_a_while_loop_is_two_boxes_whose_inputs_come_from_the_right_operands():
    def f(x, bound):
        body = lambda c: sow(c * 2.0, name="c", mode="clobber") + x
        return jax.lax.while_loop(lambda c: c < bound, body, x)

    v = view(f, jnp.float32(1.0), jnp.float32(10.0))  # arrays: traced, so they are inputs
    assert v.sites == 1 and v.groups == 2
    assert "while cond" in v.html and "while body" in v.html
    parsed = Nodes(v.html)
    inputs = [n for n, (_, cls, _) in parsed.nodes.items() if "hv-input" in cls]
    assert len(inputs) == 2
    # cond_fun compares the carry with `bound` (input 1); `x` (input 0) never reaches it.
    cond_box = v.html.split("while cond")[1].split("while body")[0]
    lt = re.search(r'data-node="(n\d+)" data-from="([^"]*)"><span class="hv-title">lt', cond_box)
    assert lt and inputs[1] in lt.group(2).split()


def _two_tags(x):
    a = sow(x * 2.0, name="a", tag="t1")
    return sow(sow(a + 1.0, name="a", tag="t2"), name="c", tag="t1")


def test_values_go_on_the_sites_of_their_tag_only():
    x = jnp.arange(3.0)
    reaped = reap(_two_tags, tag="t2")(x)
    v = view(_two_tags, x, values=reaped, tag="t2")
    (stats,) = re.findall(r"mean ([-\d.e+]+) · std", v.html)  # the t1 site 'a' gets none
    np.testing.assert_allclose(float(stats), float(np.mean(x * 2.0 + 1.0)), rtol=1e-3)


def test_values_naming_no_site_or_a_name_of_two_tags_raise():
    x = jnp.arange(3.0)
    with pytest.raises(ValueError, match=r"'zz'.*no such sow site of tag 't1'.*'a', 'c'"):
        view(_two_tags, x, values={"zz": x}, tag="t1")
    with pytest.raises(ValueError, match=r"'c'.*no such sow site of tag 't2'"):
        view(_two_tags, x, values=reap(_two_tags, tag="t1")(x), tag="t2")
    with pytest.raises(ValueError, match=r"'a'.*tags 't1', 't2'.*tag="):
        view(_two_tags, x, values=reap(_two_tags, tag="t1")(x))
