"""sites (structure without running) and stream (host callbacks as sows fire)."""

from html import parser as html_parser

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from harvest import SiteInfo, Sites, nest, reap, sites, sow, sow_cond, stream


def nested_program(xs):
    @jax.jit
    def inner(xs):
        def body(c, x):
            y = jax.lax.cond(
                x > 0, lambda x: sow(x, name="branchy"), lambda x: sow(-x, name="branchy"), x
            )
            return c + sow(y * c, name="step", mode="append"), None

        return jax.lax.scan(body, 1.0, xs)[0]

    z = inner(xs)
    z = jax.lax.while_loop(
        lambda c: c < 100.0, lambda c: sow(c * 2.0, name="grow", mode="clobber"), z + 1.0
    )
    z = jax.checkpoint(lambda z: sow(z, name="ckpt", mode="strict"))(z)
    z = nest(lambda z: sow(z, name="out", mode="strict", tag="other"), scope="head")(z)
    return z


def test_sites_lists_every_site_with_place_and_count():
    found = sites(nested_program)(jax.ShapeDtypeStruct((12,), jnp.float32))
    rows = [(s.tag, s.name, s.mode, s.fires, s.where) for s in found]
    assert rows == [
        ("intermediates", "branchy", "collect", 12, "jit › scan[12] › cond[0]"),
        ("intermediates", "branchy", "collect", 12, "jit › scan[12] › cond[1]"),
        ("intermediates", "step", "append", 12, "jit › scan[12]"),
        ("intermediates", "grow", "clobber", None, "while"),
        ("intermediates", "ckpt", "strict", 1, "checkpoint"),
        ("other", "head.out", "strict", 1, ""),  # nest walks in place when staged
    ]
    assert all(isinstance(s, SiteInfo) and s.shape == () and s.dtype == np.float32 for s in found)
    assert found.names() == ["branchy", "step", "grow", "ckpt", "head.out"]


def test_sites_filters_by_tag_and_prints_a_table():
    found = sites(nested_program, tag="other")(jnp.ones(3))
    assert isinstance(found, Sites) and [s.name for s in found] == ["head.out"]
    table = str(sites(nested_program)(jnp.ones(3)))
    assert table.splitlines()[0].split() == list(Sites.COLUMNS)
    assert "unbounded" in table and "jit › scan[3] › cond[1]" in table
    assert repr(found) == str(found)
    assert str(sites(lambda x: x)(1.0)) == "(no sow sites)"


def test_sites_reports_pytree_shapes_and_runs_nothing():
    calls = []

    def f(x):
        jax.debug.callback(lambda: calls.append(1))
        return sow({"a": x, "b": x.sum()}, name="pair")["a"]

    (info,) = sites(f)(jax.ShapeDtypeStruct((2, 3), jnp.float16))
    assert info.shape == {"a": (2, 3), "b": ()}
    assert info.dtype == {"a": np.float16, "b": np.float16}
    jax.effects_barrier()
    assert calls == []


def test_sites_lists_prng_key_sites_with_jax_s_dtype():
    def f(key, x):
        keys = sow(jax.random.split(key, 4), name="keys")
        pair = sow((key, x), name="pair")
        return pair[1] + jax.random.normal(keys[0])

    key = jax.random.key(0)
    found = sites(f)(key, 1.0)
    keys, pair = found
    reaped = reap(f)(key, 1.0)  # what reap returns, to check the listing against
    (sown,) = reaped["keys"]  # collect: one occurrence
    assert keys.dtype == sown.dtype and str(keys.dtype) == "key<fry>"
    assert keys.shape == sown.shape == (4,)
    assert keys.nbytes == 4 * jax.random.key_data(key).nbytes  # two uint32 words a key
    assert pair.dtype == (key.dtype, np.dtype(np.float32))
    assert "key<fry>" in str(found) and "key&lt;fry&gt;[4]" in found._repr_html_()  # escaped


def test_sites_marks_sow_cond():
    (info,) = sites(lambda x: sow_cond(x, x > 0, name="pos"))(1.0)
    assert info.mode == "sow_cond"


@settings(max_examples=8, deadline=None)
@given(outer=st.integers(1, 5), inner=st.integers(1, 5))
def test_sites_multiplies_nested_scan_lengths(outer, inner):
    def f(xs):
        def outer_body(c, row):
            def inner_body(c, x):
                return c + sow(x, name="x", mode="append"), None

            return jax.lax.scan(inner_body, c, row)[0], None

        return jax.lax.scan(outer_body, 0.0, xs)[0]

    (info,) = sites(f)(jnp.zeros((outer, inner)))
    assert info.fires == outer * inner
    assert info.where == f"scan[{outer}] › scan[{inner}]"


def test_sites_bad_input():
    with pytest.raises(TypeError, match="needs a callable f"):
        sites(3)(1.0)
    with pytest.raises(TypeError, match="tag must be a string"):
        sites(lambda x: x, tag=7)(1.0)


# ---------------------------------------------------------------------------
# stream


def scanned(xs):
    def body(c, x):
        h = sow(jnp.tanh(x + c), name="h", mode="append")
        return c + h, sow(h * 2.0, name="g", mode="append")

    c, ys = jax.lax.scan(body, 0.0, xs)
    return sow(c, name="final", mode="strict") + ys.sum()


def collect(seen):
    return lambda name, value: seen.append((name, np.asarray(value)))


@pytest.mark.parametrize("wrap", [lambda g: g, jax.jit], ids=["eager", "jit"])
def test_stream_reports_every_firing_in_program_order(wrap):
    xs = jnp.linspace(-1.0, 1.0, 4)
    seen = []
    out = wrap(stream(scanned, collect(seen)))(xs)
    jax.effects_barrier()
    np.testing.assert_allclose(out, scanned(xs))
    assert [n for n, _ in seen] == ["h", "g"] * 4 + ["final"]
    reaped = reap(scanned)(xs)
    np.testing.assert_allclose([v for n, v in seen if n == "h"], reaped["h"])
    np.testing.assert_allclose([v for n, v in seen if n == "g"], reaped["g"])


@settings(max_examples=6, deadline=None)
@given(limit=st.floats(2.0, 1000.0), start=st.floats(0.1, 1.5))
def test_stream_inside_while_loop(limit, start):
    def f(x):
        return jax.lax.while_loop(
            lambda c: c < limit, lambda c: sow(c * 2.0, name="c", mode="clobber"), x
        )

    seen = []
    out = jax.jit(stream(f, collect(seen)))(jnp.float32(start))
    jax.effects_barrier()
    expected, c = [], np.float32(start)
    while c < np.float32(limit):
        c = c * np.float32(2.0)
        expected.append(c)
    np.testing.assert_allclose([v for _, v in seen], expected)
    assert out == expected[-1]


def test_stream_selects_names_and_tag():
    xs = jnp.ones(2)
    seen = []
    stream(scanned, collect(seen), exclude="g")(xs)
    jax.effects_barrier()  # host callbacks run asynchronously (a TPU returns first)
    assert {n for n, _ in seen} == {"h", "final"}
    seen.clear()
    stream(scanned, collect(seen), names=lambda n: n.startswith("fin"))(xs)
    jax.effects_barrier()  # host callbacks run asynchronously (a TPU returns first)
    assert [n for n, _ in seen] == ["final"]
    seen.clear()
    stream(scanned, collect(seen), tag="nothing-here")(xs)
    jax.effects_barrier()  # host callbacks run asynchronously (a TPU returns first)
    assert seen == []


def test_stream_keeps_sows_visible_to_an_outer_reap_and_grad():
    xs = jnp.linspace(0.0, 1.0, 3)
    seen = []
    g = stream(scanned, collect(seen))
    reaped, expected = reap(g)(xs), reap(scanned)(xs)
    assert set(reaped) == set(expected)
    for name in expected:
        np.testing.assert_allclose(reaped[name], expected[name], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(g)(xs), jax.grad(scanned)(xs), rtol=1e-6)


def test_stream_nested_names_and_vmap():
    def f(x):
        return nest(lambda x: sow(x + 1.0, name="out", mode="strict"), scope="blk")(x)

    seen = []
    out = jax.vmap(stream(f, collect(seen)))(jnp.arange(3.0))
    jax.effects_barrier()
    np.testing.assert_allclose(out, jnp.arange(3.0) + 1.0)
    # Under vmap the host sees one call per batch element.
    assert sorted(float(v) for _, v in seen) == [1.0, 2.0, 3.0]
    assert {n for n, _ in seen} == {"blk.out"}


def test_stream_passes_sow_cond_sites_through():
    def f(x):
        return sow_cond(x * 3.0, x > 0, name="picked")

    seen = []
    g = stream(f, collect(seen))
    out = float(g(2.0))
    jax.effects_barrier()
    assert out == 6.0 and seen == []
    assert float(reap(g)(2.0)["picked"]) == 6.0


def test_stream_bad_input():
    with pytest.raises(TypeError, match="needs a callable f"):
        stream(None, print)
    with pytest.raises(TypeError, match="callable callback"):
        stream(scanned, "print")
    with pytest.raises(TypeError, match="names="):
        stream(scanned, print, names=[3])
    with pytest.raises(ValueError, match=r"stream: names= entry 'fni\*' matches no sow site"):
        stream(scanned, print, names="fni*")(jnp.ones(3))


# ---------------------------------------------------------------------------
# The HTML structure view


class _Outline(html_parser.HTMLParser):
    """Reads a `Sites` HTML view back as nested (label, [items]) and site lines."""

    def __init__(self):
        super().__init__()
        self.root = []
        self.stack = [self.root]
        self.span = None
        self.line = None

    def handle_starttag(self, tag, attrs):
        if tag == "details":
            self.stack[-1].append(["?", []])
            self.stack.append(self.stack[-1][-1][1])
        elif tag == "span":
            self.span = dict(attrs).get("class")
        elif tag == "li":
            self.line = {}

    def handle_endtag(self, tag):
        if tag == "details":
            self.stack.pop()
        elif tag == "li" and self.line:
            self.stack[-1].append(
                (self.line["name"], self.line["shape"], self.line["mode"], self.line["meta"])
            )
            self.line = None
        elif tag == "span":
            self.span = None

    def handle_data(self, data):
        if self.span == "body" and len(self.stack) > 1:
            parent = self.stack[-2][-1]
            parent[0] = data
        elif self.span and self.line is not None and self.span in ("name", "shape", "mode", "meta"):
            self.line[self.span] = data


def _outline(page):
    parser = _Outline()
    parser.feed(page)
    (program,) = parser.root
    return program


def test_html_view_nests_each_site_in_its_body():
    def f(xs):
        def body(c, x):
            c = jax.lax.cond(
                x > 0,
                lambda c: sow(c, name="pos", mode="clobber"),
                lambda c: sow(-c, name="neg", mode="clobber"),
                c,
            )
            return c + sow(x * c, name="step", mode="append"), None

        a = jax.lax.scan(body, 1.0, xs)[0]
        b = jax.lax.scan(body, a, xs[:3])[0]  # a second scan: its own block
        return sow(jnp.stack([b, b]), name="total", mode="strict")

    found = sites(jax.jit(f))(jnp.zeros(12))

    def scan(n):
        return [
            f"scan[{n}]",
            [
                ["cond[0]", [("neg", "float32[]", "clobber", f"× {n} · intermediates")]],
                ["cond[1]", [("pos", "float32[]", "clobber", f"× {n} · intermediates")]],
                ("step", "float32[]", "append", f"× {n} · intermediates"),
            ],
        ]

    want = [
        "program",
        [["jit", [scan(12), scan(3), ("total", "float32[2]", "strict", "× 1 · intermediates")]]],
    ]
    assert _outline(found.to_html()) == want
    assert _outline(found._repr_html_()) == want


def test_html_view_writes_a_page_and_escapes_names(tmp_path):
    found = sites(lambda x: sow(x, name="<b>&", tag="t&t") * 2.0)(jnp.zeros((2, 3), jnp.int32))
    page = found.to_html(tmp_path / "view.html")
    assert (tmp_path / "view.html").read_text(encoding="utf-8") == page
    assert _outline(page) == ["program", [("<b>&", "int32[2, 3]", "collect", "× 1 · t&t")]]
    assert "<b>&" not in page


def test_html_view_shows_every_op_of_an_instrumented_function():
    from harvest import instrument

    def f(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c) * 2.0, None), x, None, length=4)[0].sum()

    found = sites(instrument(f, ops=True))(jnp.ones(3))
    outline = _outline(found.to_html())
    (block,) = [it for it in outline[1] if isinstance(it, list)]
    assert block[0] == "scan[4]"
    assert [line[0] for line in block[1]] == ["tanh:0", "mul:0"]
    assert [line[0] for line in outline[1] if isinstance(line, tuple)] == [
        s.name for s in found if s.where == ""
    ]


def test_html_view_of_a_hand_built_sites_nests_by_labels():
    info = lambda name, where: SiteInfo("t", name, "strict", (2,), np.dtype("float32"), 3, where)  # noqa: E731
    found = Sites([info("a", "jit › scan[3]"), info("b", "jit"), info("c", "")])
    want = [
        "program",
        [
            [
                "jit",
                [
                    ["scan[3]", [("a", "float32[2]", "strict", "× 3 · t")]],
                    ("b", "float32[2]", "strict", "× 3 · t"),
                ],
            ],
            ("c", "float32[2]", "strict", "× 3 · t"),
        ],
    ]
    assert _outline(found.to_html()) == want
