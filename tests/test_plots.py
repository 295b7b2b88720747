"""PatchingResult views (normalized, shared scales, layout) and plot_attention."""

import itertools
import pathlib
import re

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harvest import PatchingResult, patching_sweep, plot_attention, reap, sow  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def result(values, names=None):
    values = np.asarray(values, np.float32)
    names = names or tuple(f"blocks.{i}.attn.hook_result_long_name" for i in range(values.shape[0]))
    return PatchingResult(values, names, np.arange(values.shape[1]), axis=1, baseline=0.5)


def test_plot_from_a_script_says_to_show_the_figure_it_returns(tmp_path):
    # Under a non-interactive backend (a script's), plot draws and shows nothing:
    # its docstring says to call plt.show(), and the figure it returns is saved whole.
    for method in (PatchingResult.plot, PatchingResult.plot_many):
        assert "matplotlib.pyplot.show()" in " ".join(method.__doc__.split())
    r = result([[1.0, -1.0], [0.5, 0.0]])
    ax = r.plot()
    assert ax.figure is plt.gcf()
    path = tmp_path / "sweep.png"
    ax.figure.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(ax.images[0].get_array(), r.values)


def test_normalized_divides_by_the_clean_corrupt_gap_of_a_real_sweep():
    def f(x):
        h = sow(2.0 * x, name="h", mode="strict")
        return sow(h + 1.0, name="g", mode="strict")

    clean_x, corrupt_x = jnp.array([1.0, 2.0, 3.0]), jnp.zeros(3)
    r = patching_sweep(f, reap(f)(clean_x), (corrupt_x,), jnp.sum, axis=0)
    clean_metric, corrupt_metric = float(jnp.sum(f(clean_x))), float(jnp.sum(f(corrupt_x)))
    n = r.normalized(clean_metric)
    np.testing.assert_allclose(n.values, r.values / (clean_metric - corrupt_metric), rtol=1e-6)
    # Each position carries its share of the gap; together they close it.
    np.testing.assert_allclose(n.values.sum(1), [1.0, 1.0], rtol=1e-6)
    assert n.measure == "fraction of clean-corrupt gap" and r.measure == "effect on metric"
    with pytest.raises(ValueError, match="no gap"):
        r.normalized(corrupt_metric)


def test_panels_share_one_scale_and_one_colourbar():
    a, b = result([[1.0, -2.0], [0.5, 0.0]]), result([[4.0, 0.0], [0.0, -1.0]])
    axes = PatchingResult.plot_many([a, b], titles=["a", "b"])
    assert [ax.images[0].get_clim() for ax in axes] == [(-4.0, 4.0), (-4.0, 4.0)]
    fig = axes[0].figure
    assert len(fig.axes) == 3  # two panels and one colourbar
    assert fig.axes[2].get_ylabel() == "effect on metric"
    np.testing.assert_array_equal(axes[1].images[0].get_array(), b.values)
    assert a.plot(vmax=10.0).images[0].get_clim() == (-10.0, 10.0)
    with pytest.raises(ValueError, match="same sites"):
        PatchingResult.plot_many([a, result([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])])


def assert_no_overlaps(fig):
    """No label or drawing area of one axes overlaps another's, and all stay inside the figure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = []  # (owner, bbox) of every label and every axes' drawing area
    for i, ax in enumerate(fig.axes):
        if not ax.axison:
            continue
        boxes.append((i, ax.get_window_extent(renderer)))
        for label in [
            *ax.get_yticklabels(),
            *ax.get_xticklabels(),
            ax.title,
            ax.xaxis.label,
            ax.yaxis.label,
        ]:
            if label.get_text():
                boxes.append((i, label.get_window_extent(renderer)))
    for (i, box), (j, other) in itertools.combinations(boxes, 2):
        if i != j:
            assert not box.overlaps(other), (i, j, box, other)
    for _, box in boxes:
        assert fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1


@pytest.mark.parametrize("measure", ["effect on metric", "fraction of clean-corrupt gap"])
def test_a_two_layer_sweep_s_colourbar_label_fits_in_the_figure(measure):
    # [layer, position] of a two-layer model: a short, wide figure.
    r = result(np.linspace(-1.0, 1.0, 2 * 65).reshape(2, 65))
    r = r if measure == "effect on metric" else r.normalized(-0.5)
    fig = r.plot().figure
    fig.canvas.draw()
    label = fig.axes[-1].yaxis.label
    assert label.get_text() == measure
    box = label.get_window_extent(fig.canvas.get_renderer())
    assert fig.bbox.y0 - 1 <= box.y0 and box.y1 <= fig.bbox.y1 + 1, (box, fig.bbox)
    assert_no_overlaps(fig)


@pytest.mark.parametrize("positions,panels", [(3, 1), (20, 2), (40, 3)])
def test_no_label_overlaps_another_panel_or_the_colourbar(positions, panels):
    rng = np.random.default_rng(0)
    names = tuple(f"blocks.{i}.attn.{'z' * (3 * i)}" for i in range(6))
    results = [result(rng.normal(size=(6, positions)), names) for _ in range(panels)]
    axes = PatchingResult.plot_many(results, titles=[f"panel {i}" for i in range(panels)])
    assert_no_overlaps(axes[0].figure)


def test_plot_attention_draws_each_head_on_one_scale():
    scores = jax.random.normal(jax.random.key(0), (1, 3, 4, 4))
    pattern = jax.nn.softmax(scores, -1)
    axes = plot_attention((pattern,), tokens=["The", "cat", "sat", "."], heads=[0, 2])
    assert [ax.get_title() for ax in axes] == ["head 0", "head 2"]
    np.testing.assert_allclose(axes[1].images[0].get_array(), np.asarray(pattern[0, 2]))
    top = float(jnp.max(pattern[0, jnp.array([0, 2])]))
    assert [ax.images[0].get_clim() for ax in axes] == [(0.0, pytest.approx(top))] * 2
    labels = ["0: The", "1: cat", "2: sat", "3: ."]
    assert [t.get_text() for t in axes[0].get_xticklabels()] == labels
    assert [t.get_text() for t in axes[0].get_yticklabels()] == labels
    with pytest.raises(ValueError, match=r"\[heads, query, key\]"):
        plot_attention(pattern[0, 0])
    with pytest.raises(ValueError, match="3 tokens for 4 key positions"):
        plot_attention(pattern[0], tokens=["a", "b", "c"])


@pytest.mark.parametrize("sites", [2, 6])
def test_a_head_by_position_sweep_draws_one_panel_per_site_on_one_scale(sites):
    def f(z):  # z: [sites, positions, heads]
        out = 0.0
        for i in range(sites):
            out += jnp.sum(sow(z[i], name=f"blocks.{i}.attn.z", mode="strict") ** 2) * (i + 1)
        return out

    z = jax.random.normal(jax.random.key(0), (sites, 5, 3))
    r = patching_sweep(f, reap(f)(z), (z * 0.0,), lambda o: o, axis=(1, 0))
    assert r.values.shape == (sites, 3, 5)
    axes = r.plot(title="heads x positions")
    assert [ax.get_title() for ax in axes] == list(r.names)
    bound = float(np.max(np.abs(r.values)))
    for ax, values in zip(axes, r.values):
        np.testing.assert_array_equal(ax.images[0].get_array(), values)
        assert ax.images[0].get_clim() == pytest.approx((-bound, bound))
    assert axes[0].get_ylabel() == "index along axis 1"
    assert axes[0].get_xlabel() == "index along axis 0"
    figure = axes[0].figure
    assert len(figure.axes) >= sites + 1  # panels (and unused cells), one colourbar
    # The figure fits the docs' column: at most 900 px at matplotlib's 100 dpi.
    assert figure.get_size_inches()[0] <= 8.5
    assert_no_overlaps(axes[0].figure)
    with pytest.raises(ValueError, match="one panel per site"):
        PatchingResult.plot_many([r])


def test_the_readme_figures_are_drawn_by_scripts_and_linked_relatively():
    # No public address exists yet: each image is a path in this repository (it renders
    # in a checkout and on a forge), naming a file that a script here draws.
    root = pathlib.Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert images
    for url in images:
        assert not url.startswith(("http://", "https://", "/")), url
        local = root / url
        assert local.stat().st_size > 0
        script = local.with_suffix(".py").read_text()
        assert local.name in script


def test_many_wide_panels_wrap_into_rows_no_wider_than_the_column():
    # 16 positions, 6 sites: side by side this was ~2,400 px wide, squeezed by the page.
    r = result(np.random.default_rng(0).normal(size=(6, 3, 16)), names=[f"s{i}" for i in range(6)])
    r = PatchingResult(r.values, r.names, (np.arange(3), np.arange(16)), axis=(2, 1), baseline=0.0)
    axes = r.plot()
    figure = axes[0].figure
    assert figure.get_size_inches()[0] <= 8.5
    rows = {round(ax.get_position().y0, 3) for ax in axes}
    assert len(rows) > 1  # wrapped onto several rows
    assert_no_overlaps(figure)


def test_axes_are_labelled_by_what_they_are_or_as_the_caller_names_them():
    r = result([[1.0, 2.0]])
    assert r.plot().get_xlabel() == "index along axis 1"  # harvest does not know what it is
    assert r.plot(xlabel="unit").get_xlabel() == "unit"
    heads = PatchingResult(
        np.ones((1, 2, 3)), ("z",), (np.arange(2), np.arange(3)), axis=(2, 1), baseline=0.0,
        axis_labels=("head", "position"),
    )  # fmt: skip
    (panel,) = heads.plot()
    assert (panel.get_ylabel(), panel.get_xlabel()) == ("head", "position")
    (panel,) = heads.plot(ylabel="attention head")
    assert panel.get_ylabel() == "attention head"


def test_plot_attention_of_a_long_sequence_is_a_readable_figure():
    # 24 positions, two heads: one row of square panels, each with its own colour bar as
    # tall as it, rows and columns labelled "index: token".
    tokens = ["the", "cat"] * 12
    pattern = jax.nn.softmax(jax.random.normal(jax.random.key(0), (2, 24, 24)), -1)
    axes = plot_attention(pattern, tokens=tokens)
    figure = axes[0].figure
    width, height = figure.get_size_inches()
    assert width <= 8.5 and height <= 5.0, (width, height)
    bars = [ax for ax in figure.axes if ax not in axes]
    assert len(bars) == 2
    figure.canvas.draw()
    for panel, bar in zip(axes, bars):
        p, b = panel.get_position(), bar.get_position()
        assert b.height == pytest.approx(p.height, rel=0.02) and b.x0 > p.x1
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert labels[7] == "7: cat" and labels[8] == "8: the" and len(set(labels)) == 24
    assert_no_overlaps(figure)
