"""harvest.view: the traced program's dataflow graph as self-contained HTML.

The graph the page carries (its JSON) is checked against the program without a
browser: a node per op with its sites merged in, inputs named by their pytree
path, a group per body and per module path, edges as data dependencies,
summaries after a reap, nothing fetched from the network. Then the page is
rendered in headless Chromium (installed by `make chromium`) and the layout
dagre drew is read back from the DOM: a drawn node per site, a box per
submodule, edges that follow the dependencies without detours, hover and search.
"""

import collections
import html.parser
import json
import re
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from flax import nnx

from harvest import instrument, nest, reap, sites, sow, view


def program(xs):
    def body(c, x):
        h = sow(x * c, name="step", mode="append")
        return c + h, None

    c = jax.lax.scan(body, 1.0, xs)[0]
    c = jax.lax.cond(c > 0, lambda y: y * 2.0, lambda y: y, c)
    return nest(lambda y: sow(jnp.tanh(y), name="out", mode="strict"), scope="head")(c)


def graph(v):
    """The nodes, groups and edges the page lays out."""
    found = re.search(r'<script type="application/json" class="hv-data">(.*?)</script>', v.html)
    data = json.loads(found.group(1).replace("<\\/", "</"))
    data["by_id"] = {n["id"]: n for n in data["nodes"]}
    data["group"] = {g["id"]: g for g in data["groups"]}
    return data


def site_node(data, name):
    (node,) = [n for n in data["nodes"] if name in [s["name"] for s in n["sites"]]]
    return node


def test_a_node_per_op_with_its_site_merged_a_group_per_body_edges_by_dependency():
    xs = jnp.arange(4.0)
    v = view(program)(xs)
    data = graph(v)
    assert v.sites == len(sites(program)(xs)) == 2
    # `step` is sown on the mul's output and `head.out` on the tanh's: one node each.
    step, out = site_node(data, "step"), site_node(data, "head.out")
    assert step["op"] == "mul" and out["op"] == "tanh" and out["label"] == "head.out"
    plain = [n["label"] for n in data["nodes"] if n["kind"] == "op"]
    assert "tanh" not in plain and plain.count("mul") == 1  # the other mul: cond's branch
    # One group for the scan body, one per cond branch (inside the cond's group).
    bodies = [g for g in data["groups"] if g["kind"] in ("call", "body")]
    labels = sorted(g["label"] for g in bodies)
    assert v.groups == 3 and labels == ["cond", "cond[0]", "cond[1]", "scan[4]"], labels
    assert data["group"][step["group"]]["label"] == "scan[4]"
    # Every edge joins nodes that exist; the mul is fed by the input xs (through the
    # scan body) and the scan's result feeds the cond's branches.
    assert all(a in data["by_id"] and b in data["by_id"] for a, b in data["edges"])
    sources = {data["by_id"][a]["label"] for a, b in data["edges"] if b == step["id"]}
    assert "xs" in sources, sources
    assert step["aval"] == "float32[]" and data["by_id"]["n0"]["aval"] == "float32[4]"


def test_named_calls_start_closed_and_loops_open_whatever_the_release_calls_them():
    # Each primitive's own name decides (remat is "remat2" on the releases we test, not
    # "checkpoint"): jit, checkpoint and custom derivatives are one closed box, a scan open.
    relu = jax.custom_jvp(lambda x: jnp.maximum(x, 0.0))
    relu.defjvp(lambda p, t: (relu(p[0]), t[0] * (p[0] > 0)))

    def f(x):
        x = jax.jit(lambda y: sow(jnp.sin(y), name="a"))(x)
        x = jax.checkpoint(lambda y: sow(jnp.cos(y), name="b"))(x)
        x = jax.lax.scan(lambda c, _: (sow(c * 2.0, name="c"), None), relu(x), None, length=2)[0]
        return x

    calls = {
        g["op"]: g["closed"] for g in graph(view(f)(jnp.ones(3)))["groups"] if g["kind"] == "call"
    }
    expected = {"jit": True, "custom_jvp_call": True, "scan": False}
    assert calls == {
        **expected,
        jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive.name: True,
    }


def test_value_summaries_after_a_reap_are_the_values_statistics():
    xs = jnp.arange(4.0)
    reaped = reap(program)(xs)
    data = graph(view(program, values=reaped)(xs))
    step = np.asarray(reaped["step"])
    (entry,) = site_node(data, "step")["sites"]
    mean, std = re.fullmatch(r"mean ([-\d.e+]+) · std ([-\d.e+]+)", entry["stats"]["text"]).groups()
    np.testing.assert_allclose([float(mean), float(std)], [step.mean(), step.std()], rtol=1e-3)
    np.testing.assert_array_equal(entry["stats"]["hist"], np.histogram(step, bins=12)[0])


def test_nan_and_inf_are_counted_and_the_finite_values_summarised():
    def f(x):
        return sow(jnp.log(x), name="logs")

    x = jnp.array([-1.0, 0.0, 1.0, 2.0, jnp.inf, 4.0])  # log: nan, -inf, 0, log 2, inf, log 4
    logs = np.log(np.array([1.0, 2.0, 4.0]))  # the finite ones, by hand
    (entry,) = site_node(graph(view(f, values=reap(f)(x))(x)), "logs")["sites"]
    found = re.fullmatch(
        r"mean ([-\d.e+]+) · std ([-\d.e+]+) · 1 nan · 1 inf · 1 -inf", entry["stats"]["text"]
    )
    assert found, entry["stats"]["text"]
    np.testing.assert_allclose(
        list(map(float, found.groups())), [logs.mean(), logs.std()], rtol=1e-3
    )
    np.testing.assert_array_equal(entry["stats"]["hist"], np.histogram(logs, bins=12)[0])
    # Nothing finite: the counts alone, and no histogram.
    nothing = {"logs": jnp.array([jnp.nan, jnp.nan, jnp.inf])}
    (entry,) = site_node(graph(view(f, values=nothing)(x)), "logs")["sites"]
    assert entry["stats"] == {"text": "2 nan · 1 inf", "hist": None}


def test_complex_values_are_summarised_by_their_magnitude_and_say_so():
    def f(x):
        return sow(x * (1.0 + 1.0j), name="z")

    x = jnp.array([3.0, 4.0])
    (entry,) = site_node(graph(view(f, values=reap(f)(x))(x)), "z")["sites"]
    size = np.abs(np.array([3.0, 4.0]) * (1 + 1j))  # by hand: 3 sqrt 2, 4 sqrt 2
    want = f"mean {size.mean():.4g} · std {size.std():.4g} · complex values by |z|"
    assert entry["stats"]["text"] == want


def test_a_prng_key_value_shows_its_dtype_and_shape():
    def f(key, x):
        keys = sow(jax.random.split(key, 3), name="keys")
        return x + jax.random.normal(keys[0])

    key = jax.random.key(0)
    data = graph(view(f, values=reap(f)(key, 1.0))(key, 1.0))
    (entry,) = site_node(data, "keys")["sites"]
    assert entry["stats"] == {"text": "key<fry>[3]", "hist": None}
    raw = jax.random.PRNGKey(0)  # a raw key is uint32 numbers: summarised as numbers
    data = graph(view(f, values=reap(f)(raw, 1.0))(raw, 1.0))
    (entry,) = site_node(data, "keys")["sites"]
    words = np.asarray(jax.random.split(raw, 3), dtype=float)
    assert entry["stats"]["text"] == f"mean {words.mean():.4g} · std {words.std():.4g}"


def test_a_view_printed_outside_a_notebook_says_what_it_holds_and_how_to_save_it(tmp_path):
    def f(xs):
        body = lambda c, x: (c + sow(x * c, name="step", mode="append"), None)  # noqa: E731
        return sow(jax.lax.scan(body, 1.0, xs)[0], name="total", mode="strict")

    v = view(f)(jnp.arange(3.0))
    # What it holds, counted from the program by hand: two sites, one scan body.
    assert repr(v) == (
        "View(sites=2, groups=1, modules=0): shown in a notebook; .save(path) writes an HTML page"
    )
    assert "object at 0x" not in str(v)
    assert v.save(tmp_path / "g.html").read_text(encoding="utf-8") == v.page()


def test_the_page_is_self_contained_with_the_layout_library_inlined():
    v = view(instrument(lambda x: jnp.sin(x) * 2.0, ops=True))(jnp.ones(3))
    assert v.sites == 2  # sin and mul, each an op site
    page = v.page()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "fetches from a network"
    assert "<script src" not in page and "@import" not in page
    assert "dagre" in page and "graphlib" in page  # the vendored library, inline
    with pytest.raises(TypeError, match="callable"):
        view(3)(1.0)
    with pytest.raises(TypeError, match="dict"):
        view(program, values=[1.0])(jnp.ones(2))


def test_inputs_are_named_by_their_path_in_the_arguments():
    def f(params, x, *, scale):
        return sow(params["w"] @ x + params["b"], name="h") * scale

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}
    data = graph(view(f)(params, jnp.ones(3), scale=jnp.float32(2.0)))
    inputs = {n["label"]: n["aval"] for n in data["nodes"] if n["kind"] == "input"}
    assert inputs == {
        "params.b": "float32[2]",
        "params.w": "float32[2,3]",
        "x": "float32[3]",
        "scale": "float32[]",
    }


def test_a_while_loop_is_two_groups_whose_inputs_come_from_the_right_operands():
    def f(x, bound):
        body = lambda c: sow(c * 2.0, name="c", mode="clobber") + x
        return jax.lax.while_loop(lambda c: c < bound, body, x)

    v = view(f)(jnp.float32(1.0), jnp.float32(10.0))  # arrays: traced, so they are inputs
    data = graph(v)
    assert v.sites == 1 and v.groups == 2
    labels = {g["label"] for g in data["groups"]}
    assert {"while cond", "while body"} <= labels
    inputs = {n["label"]: n["id"] for n in data["nodes"] if n["kind"] == "input"}
    assert set(inputs) == {"x", "bound"}
    # cond_fun compares the carry with `bound`; `x` never reaches it.
    (lt,) = [n for n in data["nodes"] if n["label"] == "lt"]
    assert data["group"][lt["group"]]["label"] == "while cond"
    into_lt = {a for a, b in data["edges"] if b == lt["id"]}
    assert inputs["bound"] in into_lt and inputs["x"] in into_lt  # x: the carry's start
    into_body = {a for a, b in data["edges"] if b == site_node(data, "c")["id"]}
    assert into_body == {inputs["x"]}


def _two_tags(x):
    a = sow(x * 2.0, name="a", tag="t1")
    return sow(sow(a + 1.0, name="a", tag="t2"), name="c", tag="t1")


def test_values_go_on_the_sites_of_their_tag_only():
    x = jnp.arange(3.0)
    reaped = reap(_two_tags, tag="t2")(x)
    v = view(_two_tags, values=reaped, tag="t2")(x)
    (stats,) = re.findall(r"mean ([-\d.e+]+) · std", v.html)  # the t1 site 'a' gets none
    np.testing.assert_allclose(float(stats), float(np.mean(x * 2.0 + 1.0)), rtol=1e-3)


def test_values_naming_no_site_or_a_name_of_two_tags_raise():
    x = jnp.arange(3.0)
    with pytest.raises(ValueError, match=r"'zz'.*no such sow site of tag 't1'.*'a', 'c'"):
        view(_two_tags, values={"zz": x}, tag="t1")(x)
    with pytest.raises(ValueError, match=r"'c'.*no such sow site of tag 't2'"):
        view(_two_tags, values=reap(_two_tags, tag="t1")(x), tag="t2")(x)
    with pytest.raises(ValueError, match=r"'a'.*tags 't1', 't2'.*tag="):
        view(_two_tags, values=reap(_two_tags, tag="t1")(x))(x)


# --- an NNX transformer block, and a 12-layer model of them -------------------


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


class Stack(nnx.Module):
    def __init__(self, layers, d, rngs):
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return jax.nn.log_softmax(x)


class MLP(nnx.Module):
    def __init__(self, d, rngs):
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class TransformerBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = MLP(d, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nnx.Module):
    """embed -> blocks.i (ln1, attn, ln2, mlp) -> ln_f -> unembed, on tokens."""

    def __init__(self, layers, d=16, vocab=50):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(d, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.unembed = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


TOKENS = jnp.arange(8) % 50


def submodule_paths(model):
    return {
        ".".join(map(str, path))
        for path, node in nnx.iter_graph(model)
        if path and isinstance(node, nnx.Module) and not isinstance(node, nnx.List)
    }


def count_ops(jaxpr):
    """The equations of ``jaxpr`` and of every body inside it."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    total += count_ops(inner)
    return total


def inputs_of(data):
    return [n for n in data["nodes"] if n["kind"] == "input"]


def test_an_nnx_block_groups_its_ops_by_submodule_and_names_its_parameters():
    block = Block(8, nnx.Rngs(0))
    model, x = instrument(block, ops=True), jnp.ones((5, 8))
    v = view(model)(x)
    data = graph(v)
    # A module group per submodule (the model's own list of them), nested by path.
    modules = {g["path"]: g for g in data["groups"] if g["kind"] == "module"}
    assert set(modules) == submodule_paths(block) and v.modules == len(modules)
    assert data["group"][modules["attn.query"]["parent"]]["path"] == "attn"
    # Each site is on exactly one node, and that node lies in its module's group.
    names = [s["name"] for n in data["nodes"] for s in n["sites"]]
    assert sorted(names) == sorted(s.name for s in sites(model)(x)) and v.sites == len(names)
    kernel = site_node(data, "attn.query/dot_general:0")
    assert modules["attn.query"]["id"] == kernel["group"]
    # One node per op: as many as the plain model's program has (each call one
    # node for its result, plus its body's), the sites sown on them merged in.
    plain = jax.make_jaxpr(lambda x: block(x))(x).jaxpr
    ops = [n for n in data["nodes"] if n["kind"] in ("op", "result") or n.get("op")]
    assert len(ops) == count_ops(plain) and len(data["nodes"]) == len(ops) + len(inputs_of(data))
    # Named calls by name, the custom derivative's wrapping hidden.
    assert [g["label"] for g in data["groups"] if g["kind"] == "call"] == ["relu", "jit"]
    assert not [n for n in data["nodes"] if "custom_jvp" in n["label"]]
    # Parameters by their path, with the model's own shapes.
    inputs = {n["label"]: n for n in data["nodes"] if n["kind"] == "input"}
    assert inputs["attn.query.kernel"]["aval"] == "float32[8,2,4]"
    assert block.attn.query.kernel[...].shape == (8, 2, 4)
    assert inputs["x"]["aval"] == "float32[5,8]" and inputs["up.bias"]["aval"] == "float32[32]"
    assert data["group"][inputs["attn.query.kernel"]["group"]]["path"] == "attn.query"


def test_a_twelve_layer_model_names_its_calls_and_groups_every_block():
    stack = Stack(12, 8, nnx.Rngs(0))
    v = view(instrument(stack, ops=True))(jnp.ones((5, 8)))
    data = graph(v)
    modules = {g["path"] for g in data["groups"] if g["kind"] == "module"}
    assert modules == submodule_paths(stack) and len(modules) == 12 * 10
    calls = collections.Counter(g["label"] for g in data["groups"] if g["kind"] == "call")
    assert calls["relu"] == 12 and calls["log_softmax"] == 1


def module_of(data, group):
    """The path of the innermost module group holding ``group`` ("" for none)."""
    while group is not None and data["group"][group]["kind"] != "module":
        group = data["group"][group]["parent"]
    return data["group"][group]["path"] if group else ""


def test_without_ops_each_module_is_a_box_holding_the_ops_it_ran():
    model = Transformer(2)
    plain = view(instrument(model))(TOKENS)
    data = graph(plain)
    modules = {g["path"] for g in data["groups"] if g["kind"] == "module"}
    assert modules == submodule_paths(model) and plain.modules == len(modules) == 25
    # Each op lies in the module that ran it, as instrument(ops=True) names its op
    # site (`blocks.0.attn/dot_general:0`, einsum's `vmap(...)` scope inside included);
    # a call's result (embed's `_take`) is one node there, its ops inlined in op sites.
    calls = {g["id"]: g["label"] for g in data["groups"] if g["kind"] == "call"}
    placed = collections.Counter(
        (n.get("op", n["label"]), module_of(data, n["group"]))
        for n in data["nodes"]
        if n["kind"] in ("op", "site") and n.get("op", "") != calls.get(n["group"])
    )
    op_sites = [s.name for s in sites(instrument(model, ops=True))(TOKENS) if "/" in s.name]
    named = collections.Counter((s.split("/")[-1].split(":")[0], s.split("/")[0]) for s in op_sites)
    assert placed == named and sum(placed.values()) > 190
    # A module's output is a node in its box, named by its path; attn returns what its
    # `out` projection returned: one node with both sites, in the innermost box.
    assert module_of(data, site_node(data, "blocks.1.ln1")["group"]) == "blocks.1.ln1"
    out = site_node(data, "blocks.1.attn")
    assert [e["name"] for e in out["sites"]] == ["blocks.1.attn.out", "blocks.1.attn"]
    assert module_of(data, out["group"]) == "blocks.1.attn.out"
    # The scopes were the view's alone: the model traced afterwards has none.
    traced = jax.make_jaxpr(instrument(model))(TOKENS).eqns
    scopes = {s for e in traced for s in str(e.source_info.name_stack).split("/")}
    assert not scopes & modules and "" in scopes, scopes


# --- in headless Chromium ----------------------------------------------------


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


needs_chromium = pytest.mark.skipif(
    _chromium() is None, reason="Chromium is not installed (make chromium)"
)

# Run after the view has drawn itself: reads the layout back, hovers a node,
# searches, and writes what it saw into the page as JSON.
PROBE = """
<script>
(function () {
  var root = document.querySelector(".harvest-view");
  var OPEN = OPEN_ALL;  // true: every group; "module": every module group
  if (OPEN) root.harvestOpen(true, OPEN === true ? null : OPEN);
  function layout() {
    var nodes = {}, edges = [];
    root.querySelectorAll("g.hv-node").forEach(function (g) {
      var r = g.getBoundingClientRect();  // where it is on the screen
      nodes[g.dataset.node] = {x: +g.dataset.x, y: +g.dataset.y, cls: g.getAttribute("class"),
                               text: g.textContent, screen: [r.left, r.top, r.right, r.bottom]};
    });
    root.querySelectorAll("path.hv-edge").forEach(function (p) {
      edges.push([p.dataset.from, p.dataset.to]);
    });
    var clusters = [];
    root.querySelectorAll("g.hv-cluster").forEach(function (c) { clusters.push(c.dataset.group); });
    return {nodes: nodes, edges: edges, clusters: clusters};
  }
  var pane = root.querySelector(".hv-scroll"), canvas = root.querySelector("svg.hv-canvas");
  var out = {layout: layout(), window: [window.innerWidth, window.innerHeight], pane: {
    width: pane.clientWidth, height: pane.clientHeight, scrollWidth: pane.scrollWidth,
    scrollHeight: pane.scrollHeight, scrollLeft: pane.scrollLeft,
    svg: [+canvas.getAttribute("width"), +canvas.getAttribute("height")],
    graph: [canvas.viewBox.baseVal.width, canvas.viewBox.baseVal.height]}};
  var hover = root.querySelector('g.hv-node[data-node="HOVER"]');
  if (hover) {
    hover.dispatchEvent(new MouseEvent("mouseenter"));
    out.hover = {
      into: root.querySelectorAll("path.hv-edge.hv-in").length,
      out: root.querySelectorAll("path.hv-edge.hv-out").length,
      sources: Array.from(root.querySelectorAll(".hv-src")).map(function (g) { return g.dataset.node; }),
      targets: Array.from(root.querySelectorAll(".hv-dst")).map(function (g) { return g.dataset.node; }),
      info: root.querySelector(".hv-info").textContent
    };
    hover.dispatchEvent(new MouseEvent("mouseleave"));
  }
  var search = root.querySelector(".hv-search");
  search.value = "SEARCH";
  search.dispatchEvent(new Event("input"));
  out.matches = Array.from(root.querySelectorAll(".hv-match")).map(function (g) { return g.dataset.node; });
  out.found = root.querySelector(".hv-found").textContent;
  var pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>
"""


def render(tmp_path, v, hover="", search="", open_all=False, shot=None):
    probe = PROBE.replace("HOVER", hover).replace("SEARCH", search)
    probe = probe.replace("OPEN_ALL", json.dumps(open_all))
    page = tmp_path / "view.html"
    page.write_text(v.page().replace("</body>", probe + "</body>"), encoding="utf-8")
    profile = tempfile.mkdtemp()
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        f"--user-data-dir={profile}", "--window-size=1400,1000", "--virtual-time-budget=20000",
    ]  # fmt: skip
    try:
        dom = subprocess.run(
            [_chromium(), *flags, "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        if shot is not None:
            subprocess.run(
                [_chromium(), *flags, f"--screenshot={shot}", page.as_uri()],
                capture_output=True, timeout=300, check=True,
            )  # fmt: skip
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


def ranks(layout):
    """Each drawn node's rank: the index of its row, top to bottom."""
    ys = sorted({round(n["y"]) for n in layout["nodes"].values()})
    return {k: ys.index(round(n["y"])) for k, n in layout["nodes"].items()}


def edge_lengths(layout):
    """The total rank span of the drawn edges, and the least any layering of the same
    graph could have (min sum(r[b] - r[a]) subject to r[b] - r[a] >= 1 on each edge: a
    linear program whose optimum is integral), and the longest edge of each."""
    rank = ranks(layout)
    nodes = sorted(rank)
    index = {k: i for i, k in enumerate(nodes)}
    cost = np.zeros(len(nodes))
    bound = np.zeros((len(layout["edges"]), len(nodes)))
    for row, (a, b) in enumerate(layout["edges"]):
        cost[index[b]] += 1
        cost[index[a]] -= 1
        bound[row, index[a]], bound[row, index[b]] = 1, -1
    best = scipy.optimize.linprog(
        cost, A_ub=bound, b_ub=-np.ones(len(bound)), bounds=(0, len(nodes)), method="highs"
    )
    assert best.status == 0
    spans = [rank[b] - rank[a] for a, b in layout["edges"]]
    least = [best.x[index[b]] - best.x[index[a]] for a, b in layout["edges"]]
    return sum(spans), round(best.fun), max(spans), round(max(least))


@needs_chromium
def test_chromium_lays_out_an_nnx_block_hovers_and_searches(tmp_path):
    block = Block(8, nnx.Rngs(0))
    model, x = instrument(block, ops=True), jnp.ones((5, 8))
    v = view(model)(x)
    data = graph(v)
    query = site_node(data, "attn.query")
    seen = render(tmp_path, v, hover=query["id"], search="kernel", open_all="module")
    layout = seen["layout"]
    # Every module opened: a drawn node per node of the graph but those inside the
    # closed `relu`; a box per submodule.
    (relu,) = [g["id"] for g in data["groups"] if g["label"] == "relu"]
    inside_relu = [n["id"] for n in data["nodes"] if n["group"] in (relu, *[
        g["id"] for g in data["groups"] if g["parent"] == relu])]  # fmt: skip
    expected = {n["id"] for n in data["nodes"]} - set(inside_relu) | {relu}
    assert set(layout["nodes"]) == expected
    modules = {g["id"] for g in data["groups"] if g["kind"] == "module"}
    assert set(layout["clusters"]) == modules
    assert all(site_node(data, name)["id"] in layout["nodes"] for name in ("ln1", "up", "down"))
    # Edges top to bottom, none longer than it must be by more than two ranks.
    ys = {k: n["y"] for k, n in layout["nodes"].items()}
    assert all(ys[a] < ys[b] for a, b in layout["edges"])
    shown = lambda n: relu if n in inside_relu else n  # noqa: E731
    drawn = {(shown(a), shown(b)) for a, b in data["edges"] if shown(a) != shown(b)}
    assert sorted(map(tuple, layout["edges"])) == sorted(drawn)
    total, least, longest, longest_there = edge_lengths(layout)
    print("block: ranks spanned", total, "least", least, "longest", longest, longest_there)
    assert total <= 1.05 * least and longest <= longest_there + 2
    # Hover on attn.query's output: its two inputs (the kernel's dot_general and the
    # bias's reshape) light up, and its reader.
    into = {a for a, b in data["edges"] if b == query["id"]}
    outof = {b for a, b in data["edges"] if a == query["id"]}
    assert seen["hover"]["into"] == len(into) == 2 and set(seen["hover"]["sources"]) == into
    assert set(seen["hover"]["targets"]) == outof and "attn.query" in seen["hover"]["info"]
    # Search: the six kernels, by name.
    kernels = {n["id"] for n in data["nodes"] if n["label"].endswith(".kernel")}
    assert set(seen["matches"]) == kernels and len(kernels) == 6 and seen["found"] == "6 matches"


@needs_chromium
def test_chromium_lays_out_a_twelve_layer_model_closed_and_open(tmp_path):
    stack = Stack(12, 8, nnx.Rngs(0))
    v = view(instrument(stack, ops=True))(jnp.ones((5, 8)))
    data = graph(v)
    seen = render(tmp_path, v, search="blocks.3.attn")
    layout = seen["layout"]
    # The first view: each block a box, its submodules closed, one node each.
    blocks = {g["id"] for g in data["groups"] if g["kind"] == "module" and "." not in g["path"][7:]}
    assert len(blocks) == 12 and set(layout["clusters"]) == blocks
    closed = [k for k, n in layout["nodes"].items() if "hv-closed" in n["cls"]]
    assert len(closed) == 12 * 6 + 1  # ln1, attn, ln2, up, relu, down; log_softmax
    total, least, longest, longest_there = edge_lengths(layout)
    print("12 closed: ranks spanned", total, "least", least, "longest", longest, longest_there)
    assert total <= 1.05 * least and longest <= longest_there + 2
    # Search finds inside a closed group: the group that holds the match.
    (attn3,) = [g["id"] for g in data["groups"] if g.get("path") == "blocks.3.attn"]
    assert seen["matches"] == [attn3]
    # Every group open: every node drawn, and still no long detours.
    opened = render(tmp_path, v, open_all=True)["layout"]
    assert len(opened["nodes"]) == len(data["nodes"]) > 1000
    total, least, longest, longest_there = edge_lengths(opened)
    print("12 open: ranks spanned", total, "least", least, "longest", longest, longest_there)
    assert total <= 1.05 * least and longest <= longest_there + 2


def first_screen(seen, data):
    """What the first view draws: the module paths of the open boxes and of the
    closed ones, and where each drawn node is on the screen, by name."""
    layout = seen["layout"]
    name = lambda k: data["group"][k].get("path", data["group"][k]["label"])  # noqa: E731
    opened = {name(g) for g in layout["clusters"]}
    closed = {name(k) for k, n in layout["nodes"].items() if "hv-closed" in n["cls"]}
    screen = {
        name(k) if k in data["group"] else data["by_id"][k]["label"]: n["screen"]
        for k, n in layout["nodes"].items()
    }
    return opened, closed, screen


@needs_chromium
@pytest.mark.parametrize("layers, ops", [(2, False), (2, True), (12, False)])
def test_chromium_opens_a_transformer_on_its_map_fitted_on_the_input(tmp_path, layers, ops):
    v = view(instrument(Transformer(layers), ops=ops))(TOKENS)
    seen = render(tmp_path, v)
    opened, closed, screen = first_screen(seen, graph(v))
    # The top-level structure: the blocks open, each of their parts and the modules
    # at the top that hold no others (embed, ln_f, unembed) one closed box each,
    # with or without ops=True.
    parts = {f"blocks.{i}.{p}" for i in range(layers) for p in ("ln1", "attn", "ln2", "mlp")}
    assert opened == {f"blocks.{i}" for i in range(layers)}
    assert closed == parts | {"embed", "ln_f", "unembed"}
    # Fitted to the pane: nothing to scroll sideways, the canvas at a readable size,
    # and the pane as tall as the graph (no scrolling inside it, no blank below).
    pane = seen["pane"]
    assert pane["scrollWidth"] <= pane["width"] and pane["svg"][0] <= pane["width"]
    assert pane["svg"][0] / pane["graph"][0] >= 0.5
    assert pane["scrollHeight"] <= pane["height"] and abs(pane["height"] - pane["svg"][1]) <= 2
    # On the input: every drawn node within the window's width, and the tokens, the
    # embedding and the first block's first parts on the first screen.
    width, height = seen["window"]
    assert all(0 <= r[0] and r[2] <= width for r in screen.values()), screen
    for name in ("tokens", "embed", "blocks.0.ln1", "blocks.0.attn"):
        assert 0 <= screen[name][1] and screen[name][3] <= height, (name, screen[name])


@needs_chromium
def test_chromium_opens_a_wide_program_readable_and_scrolled_to_its_first_input(tmp_path):
    def f(x, ws):  # x meets each of 60 weights: a row of 61 inputs, wider than any pane
        return sum(sow(x * w, name=f"h{i}") for i, w in enumerate(ws))

    v = view(f)(jnp.ones(3), [jnp.full(3, float(i)) for i in range(60)])
    seen = render(tmp_path, v)
    _, _, screen = first_screen(seen, graph(v))
    pane, (width, _) = seen["pane"], seen["window"]
    # Too wide to fit readably: drawn at half size, the pane scrolled to `x`.
    assert pane["svg"][0] / pane["graph"][0] == pytest.approx(0.5, abs=0.01)
    assert pane["scrollWidth"] > pane["width"] and pane["scrollLeft"] > 0
    assert 0 <= screen["x"][0] and screen["x"][2] <= width, screen["x"]
