"""harvest.store: record sites over batches, resume after a kill, read back, reject bad input.

References: `reap` of the same function over the same batches, concatenated by
hand; an uninterrupted run for the killed one.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tensorstore", reason="harvest.store needs the store extra (tensorstore)")
nnx = pytest.importorskip("flax.nnx")

from harvest import nest, reap, sow, store  # noqa: E402

# The model and data the killed subprocess records too: one source, run in both.
WORKLOAD = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from harvest import instrument

    class Block(nnx.Module):
        def __init__(self, width, rngs):
            self.up = nnx.Linear(width, 2 * width, rngs=rngs)
            self.down = nnx.Linear(2 * width, width, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    class Model(nnx.Module):
        def __init__(self, width=8, depth=2, vocab=32, rngs=None):
            self.embed = nnx.Embed(vocab, width, rngs=rngs)
            self.blocks = nnx.List([Block(width, rngs) for _ in range(depth)])

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return x

    def make_model():
        return instrument(Model(rngs=nnx.Rngs(0)))

    def dataset(n=12, batch=4, positions=5):
        rng = np.random.default_rng(0)
        return [rng.integers(0, 32, (batch, positions)).astype(np.int32) for _ in range(n)]
    """
)
_workload: dict = {}
exec(compile(WORKLOAD, "workload", "exec"), _workload)
make_model, dataset = _workload["make_model"], _workload["dataset"]
NAMES = ["blocks.0", "blocks.1"]


def reference(model, data, rows="examples"):
    """Each site's reaped values over the batches, concatenated by hand."""
    per_batch = [reap(model, tag="modules", names=NAMES)(b) for b in data]
    out = {n: np.concatenate([np.asarray(r[n]) for r in per_batch]) for n in NAMES}
    if rows == "tokens":
        out = {n: v.reshape(-1, v.shape[-1]) for n, v in out.items()}
    return out


def chunk_files(path):
    """{relative path: bytes} of every array chunk in the store (files `<site>/c.<i>.<j>`)."""
    root = pathlib.Path(path)
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("*/c.*")) if p.is_file()
    }


@pytest.mark.parametrize("rows", ["examples", "tokens"])
def test_record_then_open_equals_reap_over_the_same_batches(tmp_path, rows):
    model, data = make_model(), dataset()
    s = store.record(
        model, data, tmp_path / "s", tag="modules", names="blocks.?", rows=rows, progress=False
    )
    expected = reference(model, data, rows)
    assert list(s) == NAMES and s.complete
    reopened = store.open(tmp_path / "s")
    for name in NAMES:
        assert reopened[name].shape == expected[name].shape
        assert reopened[name].dtype == np.float32
        np.testing.assert_array_equal(np.asarray(reopened[name]), expected[name])
        np.testing.assert_array_equal(reopened[name][7:13], expected[name][7:13])
    manifest = json.loads((tmp_path / "s" / "zarr.json").read_text())["attributes"]["harvest"]
    assert manifest["batches"] == 12 and manifest["rows"] == rows
    assert manifest["sites"]["blocks.0"]["shape"] == [8] if rows == "tokens" else [5, 8]
    assert manifest["versions"]["jax"] == jax.__version__


def test_dtype_cast_and_codecs(tmp_path):
    model, data = make_model(), dataset(n=3)
    zstd = [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 3}}]
    s = store.record(
        model,
        data,
        tmp_path / "s",
        tag="modules",
        names=NAMES,
        dtype=jnp.bfloat16,
        codecs=zstd,
        progress=False,
    )
    expected = reference(model, data)
    for name in NAMES:
        assert s[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(s[name]), expected[name].astype(jnp.bfloat16))
    meta = json.loads((tmp_path / "s" / "blocks.0" / "zarr.json").read_text())
    assert meta["data_type"] == "bfloat16" and meta["codecs"][-1]["name"] == "zstd"


def test_plain_function_nested_scopes_and_collect_mode(tmp_path):
    def f(x):
        sow(jnp.sin(x), name="s")  # mode 'collect', sown once: a 1-tuple when reaped
        return jnp.cos(x)

    g = lambda x: nest(f, scope="inner")(x) + sow(x, name="x", mode="strict")  # noqa: E731
    data = [np.full((3, 2), i, np.float32) for i in range(4)]
    s = store.record(g, data, tmp_path / "s", progress=False)
    assert list(s) == ["inner.s", "x"]
    np.testing.assert_array_equal(
        np.asarray(s["inner.s"]), np.concatenate([np.asarray(reap(f)(b)["s"][0]) for b in data])
    )


def test_record_again_is_a_no_op_and_more_batches_extend(tmp_path):
    model, data = make_model(), dataset(n=6)
    store.record(model, data[:4], tmp_path / "s", tag="modules", names=NAMES, progress=False)
    before = chunk_files(tmp_path / "s")
    again = store.record(
        model, data[:4], tmp_path / "s", tag="modules", names=NAMES, progress=False
    )
    assert again.rows == 16 and chunk_files(tmp_path / "s") == before
    longer = store.record(model, data, tmp_path / "s", tag="modules", names=NAMES, progress=False)
    np.testing.assert_array_equal(
        np.asarray(longer["blocks.1"]), reference(model, data)["blocks.1"]
    )


CHILD = """
import sys, time
from harvest import store
def slow():
    for i, batch in enumerate(dataset(n=40)):
        print("batch", i, flush=True)
        time.sleep(0.02)
        yield batch
store.record(make_model(), slow(), sys.argv[1], tag="modules", names=NAMES, progress=False)
print("finished", flush=True)
"""


def test_resume_after_sigkill_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    script = WORKLOAD + f"NAMES = {NAMES!r}\n" + CHILD
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(killed)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    for line in child.stdout:
        if line.startswith("batch 25"):  # mid-run: batches are being computed and written
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    partial = store.open(killed)
    assert not partial.complete and 0 < partial.batches_written < 40
    assert partial.manifest.batches == 0
    model, data = make_model(), dataset(n=40)
    resumed = store.record(model, data, killed, tag="modules", names=NAMES, progress=False)
    store.record(model, data, clean, tag="modules", names=NAMES, progress=False)
    assert resumed.complete and resumed.rows == 160
    assert chunk_files(killed) == chunk_files(clean)  # every chunk, byte for byte
    assert (killed / "zarr.json").read_text() == (clean / "zarr.json").read_text()
    for name in NAMES:
        assert (killed / name / "zarr.json").read_text() == (clean / name / "zarr.json").read_text()
    np.testing.assert_array_equal(
        np.asarray(resumed["blocks.1"]), reference(model, data)["blocks.1"]
    )


def test_manifest_mismatch_is_an_error_and_overwrite_starts_afresh(tmp_path):
    model, data = make_model(), dataset(n=3)
    path = tmp_path / "s"
    store.record(model, data, path, tag="modules", names=NAMES, progress=False)
    before = chunk_files(path)
    with pytest.raises(
        ValueError, match="site 'blocks.0.down' recorded now, not stored; .* \\(and 1 more\\)"
    ):
        store.record(model, data, path, tag="modules", progress=False)
    wider = [np.concatenate([b, b], axis=1) for b in data]  # 10 positions, not 5
    with pytest.raises(ValueError, match=r"rows \[5, 8\] float32 stored, \[10, 8\]"):
        store.record(model, wider, path, tag="modules", names=NAMES, progress=False)
    with pytest.raises(ValueError, match="float32 stored.*bfloat16 now"):
        store.record(
            model, data, path, tag="modules", names=NAMES, dtype="bfloat16", progress=False
        )
    assert chunk_files(path) == before
    fresh = store.record(
        model, wider, path, tag="modules", names=NAMES, overwrite=True, progress=False
    )
    assert fresh["blocks.0"].shape == (12, 10, 8)
    np.testing.assert_array_equal(
        np.asarray(fresh["blocks.0"]), reference(model, wider)["blocks.0"]
    )


def test_bad_input_is_a_clear_error_that_writes_nothing(tmp_path):
    model, data = make_model(), dataset(n=3)
    file = tmp_path / "file"
    file.write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="that path is a file"):
            store.record(model, data, file, tag="modules", overwrite=overwrite, progress=False)
    assert file.read_text() == "mine"
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="holds no harvest store"):
        store.record(model, data, stranger, tag="modules", overwrite=True, progress=False)
    assert os.listdir(stranger) == ["notes.txt"]
    with pytest.raises(ValueError, match="'blocks.7' matches no sow site"):
        store.record(model, data, tmp_path / "a", tag="modules", names=["blocks.7"], progress=False)
    with pytest.raises(
        ValueError, match="no sow of tag 'nope', but it has sows of the tags 'modules'"
    ):
        store.record(model, data, tmp_path / "a", tag="nope", progress=False)
    with pytest.raises(ValueError, match="`batches` yielded nothing"):
        store.record(model, [], tmp_path / "a", tag="modules", progress=False)
    with pytest.raises(ValueError, match="rows='tokens' needs"):
        store.record(
            lambda x: sow(x.sum(), name="total", mode="strict"),
            [np.ones((2, 3))],
            tmp_path / "a",
            rows="tokens",
            progress=False,
        )
    with pytest.raises(ValueError, match="`rows` must be"):
        store.record(model, data, tmp_path / "a", rows="words", progress=False)
    assert not (tmp_path / "a").exists()


def test_a_batch_of_another_shape_writes_nothing_of_itself(tmp_path):
    model, data = make_model(), dataset(n=3)
    short = [*data, data[0][:2]]  # the last batch has 2 examples, not 4
    with pytest.raises(ValueError, match="batch 3 gives site 'blocks.0' rows of shape"):
        store.record(model, short, tmp_path / "s", tag="modules", names=NAMES, progress=False)
    kept = store.open(tmp_path / "s")
    assert kept.rows == 12 and not kept.complete
    np.testing.assert_array_equal(np.asarray(kept["blocks.0"]), reference(model, data)["blocks.0"])


def test_open_reads_lazily_and_names_unknown_sites(tmp_path):
    with pytest.raises(FileNotFoundError, match="no harvest store"):
        store.open(tmp_path)
    s = store.record(make_model(), dataset(n=2), tmp_path / "s", tag="modules", progress=False)
    assert len(s["blocks.1"]) == 8 and s["blocks.1"].ndim == 3
    with pytest.raises(KeyError, match="no site 'blocks.9'; it holds: 'blocks.0', "):
        s["blocks.9"]
    with pytest.raises(KeyError, match="no site 'head'"):
        next(s.batches(4, names=["blocks.*", "head"]))


def test_batches_cover_every_row_once_per_epoch_reproducibly(tmp_path):
    def f(x):
        return sow(x * 2.0, name="double", mode="strict") + sow(x, name="x", mode="strict")

    data = [np.arange(10.0 * i, 10.0 * i + 10).reshape(5, 2) for i in range(7)]  # rows 0..34
    s = store.record(f, data, tmp_path / "s", chunk_rows=3, progress=False)
    ids = lambda bs: [b["x"][:, 0] / 2 for b in bs]  # noqa: E731  (row i holds 2i, 2i+1)

    def epochs(**kw):
        return list(s.batches(4, seed=1, epochs=2, buffer_bytes=64, **kw))

    first = epochs()
    assert [len(b["x"]) for b in first] == ([4] * 8 + [3]) * 2  # each epoch ends short
    for epoch in (first[:9], first[9:]):
        rows = np.concatenate(ids(epoch))
        assert sorted(rows.tolist()) == list(range(35))  # every row exactly once
        for b in epoch:  # the sites' rows stay aligned
            np.testing.assert_array_equal(b["double"], 2.0 * b["x"])
    assert not np.array_equal(np.concatenate(ids(first[:9])), np.arange(35))  # shuffled
    assert not np.array_equal(np.concatenate(ids(first[:9])), np.concatenate(ids(first[9:])))
    again = epochs()
    assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(first, again))
    other = list(s.batches(4, seed=2))
    assert not np.array_equal(np.concatenate(ids(other)), np.concatenate(ids(first[:9])))
    in_order = list(s.batches(4, shuffle=False, names="x", drop_remainder=True))
    assert [sorted(b) for b in in_order] == [["x"]] * 8
    np.testing.assert_array_equal(np.concatenate(ids(in_order)), np.arange(32))


def test_progress_bar_counts_rows(tmp_path, capsys):
    pytest.importorskip("tqdm")
    store.record(make_model(), dataset(n=3), tmp_path / "s", tag="modules", progress=True)
    err = capsys.readouterr().err
    assert "record" in err and "12/12" in err and "MiB/s" in err


def test_bfloat16_sites_are_kept_and_writes_in_flight_stay_bounded(tmp_path, monkeypatch):
    from harvest.store import _record

    in_flight = []
    submit = _record._Writer.submit

    def spy(self, index, out):
        submit(self, index, out)
        in_flight.append(len(self.pending))

    monkeypatch.setattr(_record._Writer, "submit", spy)

    def f(x):
        return sow((x * 3.0).astype(jnp.bfloat16), name="h", mode="strict")

    data = [np.full((2, 3), i / 7, np.float32) for i in range(9)]
    s = store.record(f, data, tmp_path / "s", max_pending=1, progress=False)
    assert len(in_flight) == 9 and max(in_flight) <= 1
    assert s["h"].dtype == jnp.bfloat16
    expected = np.concatenate([np.asarray(reap(f)(b)["h"]) for b in data])
    np.testing.assert_array_equal(np.asarray(s["h"]), expected)


def test_a_run_killed_while_laying_out_the_store_resumes(tmp_path):
    # The manifest is written first; a kill before an array exists leaves just that.
    model, data = make_model(), dataset(n=3)
    full = store.record(model, data, tmp_path / "full", tag="modules", names=NAMES, progress=False)
    path = tmp_path / "s"
    path.mkdir()
    manifest = json.loads((tmp_path / "full" / "zarr.json").read_text())
    manifest["attributes"]["harvest"]["batches"] = 0
    (path / "zarr.json").write_text(json.dumps(manifest))
    s = store.record(model, data, path, tag="modules", names=NAMES, progress=False)
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(s[name]), np.asarray(full[name]))


def _rows_by_id(n):
    """The store `_id_sites` records over `n` rows, computed with numpy."""
    ids = np.arange(n, dtype=np.float32)
    return {"id": np.broadcast_to(ids[:, None, None], (n, 2, 3)) + np.arange(6.0).reshape(2, 3)}


def _id_sites(x):
    # Row i holds i + [[0, 1, 2], [3, 4, 5]]; a bfloat16 site rides along (exact below 256).
    sow((x[:, 0, 0] * 0.5).astype(jnp.bfloat16), name="half", mode="strict")
    return sow(x, name="id", mode="strict")


@pytest.mark.parametrize(("batch_size", "buffer_bytes"), [(7, 1), (4, 200), (64, 2**20)])
def test_batches_held_together_are_exactly_the_stored_rows(tmp_path, batch_size, buffer_bytes):
    # Windows of one chunk with leftovers carried over several windows, windows of a few
    # chunks, and one window with a batch larger than the store; every batch is held until
    # the end, so a buffer reused too early would show as wrong rows.
    expected = _rows_by_id(40)["id"]
    data = [expected[i : i + 5].copy() for i in range(0, 40, 5)]
    s = store.record(_id_sites, data, tmp_path / "s", chunk_rows=3, progress=False)
    for shuffle in (True, False):
        got = list(s.batches(batch_size, seed=3, shuffle=shuffle, buffer_bytes=buffer_bytes))
        assert [len(b["id"]) for b in got[:-1]] == [batch_size] * (len(got) - 1)
        rows = np.concatenate([b["id"] for b in got])
        half = np.concatenate([b["half"] for b in got])
        assert rows.dtype == np.float32 and half.dtype == jnp.bfloat16
        order = rows[:, 0, 0].astype(int)
        if not shuffle:
            np.testing.assert_array_equal(order, np.arange(40))
        assert sorted(order.tolist()) == list(range(40))
        np.testing.assert_array_equal(rows, expected[order])
        np.testing.assert_array_equal(half.astype(np.float32), order * 0.5)
    got[0]["id"] += 1.0  # batches (and rows read) are the caller's copies, not the files
    whole = s["id"][:]
    whole += 1.0
    np.testing.assert_array_equal(s["id"][:], expected)


def test_a_loader_failing_mid_pass_keeps_every_batch_computed_and_resumes(tmp_path):
    model, data = make_model(), dataset(n=8)

    def failing():
        yield from data[:5]
        raise ConnectionError("the loader went away")

    path = tmp_path / "s"
    with pytest.raises(ConnectionError, match="the loader went away"):
        store.record(
            model, failing(), path, tag="modules", names=NAMES, max_pending=3, progress=False
        )
    partial = store.open(path)
    expected = reference(model, data)
    assert not partial.complete and partial.batches_written == 5
    np.testing.assert_array_equal(np.asarray(partial["blocks.1"]), expected["blocks.1"][:20])
    resumed = store.record(model, data, path, tag="modules", names=NAMES, progress=False)
    assert resumed.complete
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(resumed[name]), expected[name])


# -- the example axis: from the site's structure, never guessed by size ------------


def _layers(n_layers, batch_first=True):
    """x [examples, width] -> tanh(x * w_l) per layer l, a scan over layers sowing each."""

    def f(x):
        def body(c, w):
            c = jnp.tanh(c * w)
            sow(c if batch_first else c.T, name="h", mode="append")
            sow(c.sum(-1), name="total", mode="append")
            return c, None

        return jax.lax.scan(body, x, jnp.arange(1.0, 1.0 + n_layers))[0]

    return f


def _layers_by_hand(x, n_layers):
    """The scan of `_layers`, in numpy: [examples, layers, width]."""
    out, c = [], x
    for w in np.arange(1.0, 1.0 + n_layers, dtype=np.float32):
        c = np.tanh(c * w)
        out.append(c)
    return np.stack(out, axis=1)


@pytest.mark.parametrize("n_layers", [3, 4])  # 4 layers: as many as the batch's examples
def test_a_scan_over_layers_keeps_examples_as_rows(tmp_path, n_layers):
    rng = np.random.default_rng(0)
    data = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(3)]
    f = _layers(n_layers)
    s = store.record(f, data, tmp_path / "s", progress=False)
    expected = np.concatenate([_layers_by_hand(b, n_layers) for b in data])
    assert s["h"].shape == (12, n_layers, 2) and s["total"].shape == (12, n_layers)
    np.testing.assert_allclose(s["h"][:], expected, rtol=1e-6)
    reaped = [reap(f)(b) for b in data]  # reap stacks layers first: [layers, examples, ...]
    for name in ("h", "total"):
        by_reap = np.concatenate([np.moveaxis(np.asarray(r[name]), 1, 0) for r in reaped])
        np.testing.assert_array_equal(s[name][:], by_reap)


def test_the_example_axis_under_vmap_collect_tokens_and_when_given(tmp_path):
    rng = np.random.default_rng(1)
    data = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(2)]
    expected = np.concatenate([_layers_by_hand(b, 3) for b in data])
    # A per-example function under vmap, the scan inside it: the vmap axis is the examples.
    per_example = lambda x: _layers(3)(x[None])[0]  # noqa: E731
    s = store.record(jax.vmap(per_example), data, tmp_path / "vmap", names="h", progress=False)
    np.testing.assert_allclose(s["h"][:], expected[:, :, None], rtol=1e-6)

    def vmap_in_the_scan(x):  # the scan over layers outside, a vmap over examples inside
        def body(c, w):
            return jax.vmap(lambda e: sow(jnp.tanh(e * w), name="h", mode="append"))(c), None

        return jax.lax.scan(body, x, jnp.arange(1.0, 4.0))[0]

    s = store.record(vmap_in_the_scan, data, tmp_path / "inside", progress=False)
    np.testing.assert_allclose(s["h"][:], expected, rtol=1e-6)

    def collected(x):  # 'collect', sown once in a scan: a 1-tuple of [layers, examples, ...]
        def body(c, w):
            c = jnp.tanh(c * w)
            return sow(c, name="h"), None

        return jax.lax.scan(body, x, jnp.arange(1.0, 4.0))[0]

    s = store.record(collected, data, tmp_path / "collect", progress=False)
    np.testing.assert_allclose(s["h"][:], expected, rtol=1e-6)

    # Tokens: [examples, positions, width] per layer -> a row per token, [layers, width].
    tokens = [rng.normal(size=(3, 5, 2)).astype(np.float32) for _ in range(2)]
    s = store.record(_layers(3), tokens, tmp_path / "tok", names="h", rows="tokens", progress=False)
    by_hand = np.concatenate([_layers_by_hand(b.reshape(15, 2), 3) for b in tokens])
    np.testing.assert_allclose(s["h"][:], by_hand, rtol=1e-6)

    # A site sown [width, examples]: its example axis given, per site or for all.
    for axis in ({"h": 1, "total": 0}, -1):
        names = ["h"] if axis == -1 else None
        s = store.record(
            _layers(3, batch_first=False),
            data,
            tmp_path / f"t{axis!s:.3}",
            names=names,
            example_axis=axis,
            progress=False,
        )
        np.testing.assert_allclose(s["h"][:], expected, rtol=1e-6)


def test_a_wrong_example_axis_is_a_clear_error_that_writes_nothing(tmp_path):
    data = [np.ones((4, 2), np.float32)]
    with pytest.raises(
        ValueError, match=r"site 'h' has shape \(3, 2, 4\) \(each occurrence \(2, 4\).*example_axis"
    ):
        store.record(_layers(3, batch_first=False), data, tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match=r"example_axis=2 for site 'h'.*shape \(4, 2\)"):
        store.record(_layers(3), data, tmp_path / "a", example_axis=2, progress=False)
    with pytest.raises(ValueError, match="example_axis=1 for site 'h'.*two axes"):
        store.record(
            _layers(3),
            data,
            tmp_path / "a",
            names="h",
            rows="tokens",
            example_axis=1,
            progress=False,
        )
    with pytest.raises(KeyError, match="example_axis=.*names 'hh', which is not recorded"):
        store.record(_layers(3), data, tmp_path / "a", example_axis={"hh": 0}, progress=False)
    with pytest.raises(ValueError, match="`example_axis` must be an int, or a dict from site"):
        store.record(_layers(3), data, tmp_path / "a", example_axis="0", progress=False)
    assert not (tmp_path / "a").exists()


# -- site names, PRNG keys, dtypes: refused or stored, never a raw TensorStore error --


@pytest.mark.parametrize("name", [".progress", "zarr.json", ".", "..", "a/b", "%2E", "é"])
def test_any_site_name_is_stored_apart_from_the_stores_own_files(tmp_path, name):
    import urllib.parse

    def f(x):
        sow(x + 1.0, name="plain", mode="strict")
        return sow(x * 2.0, name=name, mode="strict")

    data = [np.arange(6.0, dtype=np.float32).reshape(2, 3) + i for i in range(3)]
    path = tmp_path / "s"
    s = store.record(f, data, path, progress=False)
    assert s.complete and not (path / ".progress").exists()
    key = s.manifest.sites[name].key
    assert urllib.parse.unquote(key) == name  # reversible
    assert sorted(p.name for p in path.iterdir()) == sorted(["zarr.json", "plain", key])
    again = store.record(f, data, path, progress=False)  # resumes: nothing left to write
    for reopened in (again, store.open(path)):
        np.testing.assert_array_equal(reopened[name][:], np.concatenate(data) * 2.0)
        np.testing.assert_array_equal(reopened["plain"][:], np.concatenate(data) + 1.0)


def test_prng_key_sites_are_refused_up_front_and_leave_nothing(tmp_path):
    def keys(x):
        k = jax.vmap(jax.random.key)(x[:, 0].astype(jnp.uint32))
        return sow(k, name="k", mode="strict")

    def key_data(x):
        return sow(jax.random.key_data(keys(x)), name="k_data", mode="strict")

    data = [np.arange(8.0).reshape(4, 2) + i for i in range(2)]
    path = tmp_path / "s"
    with pytest.raises(TypeError, match=r"site 'k' holds PRNG keys.*jax.random.key_data"):
        store.record(keys, data, path, progress=False)
    assert not path.exists()
    s = store.record(key_data, data, path, names="k_data", progress=False)  # no overwrite
    expected = np.concatenate([np.asarray(reap(key_data)(b)["k_data"]) for b in data])
    np.testing.assert_array_equal(s["k_data"][:], expected)
    assert s["k_data"].dtype == np.uint32


def test_a_dtype_or_codecs_zarr_cannot_hold_is_refused_before_writing(tmp_path):
    f = lambda x: sow(x.astype(jnp.uint4), name="u", mode="strict")  # noqa: E731
    data = [np.ones((2, 3), np.float32)]
    with pytest.raises(ValueError, match=r"site 'u' \(uint4\) cannot be stored.*dtype="):
        store.record(f, data, tmp_path / "a", progress=False)
    g = lambda x: sow(x, name="x", mode="strict")  # noqa: E731
    with pytest.raises(ValueError, match="site 'x' .* with codecs=.*fix `codecs`"):
        store.record(g, data, tmp_path / "a", codecs=[{"name": "zstdd"}], progress=False)
    assert not (tmp_path / "a").exists()
    s = store.record(f, data, tmp_path / "a", dtype="uint8", progress=False)
    np.testing.assert_array_equal(s["u"][:], np.ones((2, 3), np.uint8))


# -- StoreArray indexing: numpy basic indexing, checked against numpy ---------------


def test_store_array_indexing_is_numpy_basic_indexing(tmp_path):
    expected = np.arange(10 * 3 * 4, dtype=np.float32).reshape(10, 3, 4)
    data = [expected[i : i + 2] for i in range(0, 10, 2)]
    s = store.record(
        lambda x: sow(x * 1.0, name="h", mode="strict"),
        data,
        tmp_path / "s",
        chunk_rows=3,
        progress=False,
    )
    h = s["h"]
    fixed = [
        -1, 2, np.int64(-10), slice(2, 10), slice(3, 1), slice(-3, None), slice(None, None, -1),
        slice(8, 2, -3), slice(100, 200), slice(-100, 3), slice(None, None, 4), (),
        Ellipsis, (Ellipsis, 1), (None, 2), (-3, slice(None), -1), (slice(1, 9, 4), None, ...),
        (..., slice(None, None, -2)), (1, 2, 3), (slice(0, 0), 0), (None, ..., None),
        (slice(7, None, -2), slice(-1, None), np.int32(1)), np.array(4),
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    ends, steps = [None, *range(-14, 14)], [None, -5, -2, -1, 1, 2, 3, 7]

    def drawn_slice():  # starts and stops past either end, any step
        start, stop, step = rng.choice(ends), rng.choice(ends), rng.choice(steps)
        return slice(*(None if v is None else int(v) for v in (start, stop, step)))

    drawn = [tuple(drawn_slice() for _ in range(rng.integers(1, 4))) for _ in range(200)]
    for index in fixed + drawn:
        got, want = h[index], expected[index]
        assert got.shape == want.shape and got.dtype == want.dtype, index
        np.testing.assert_array_equal(got, want, err_msg=repr(index))
    for start, stop in [(-3, 100), (4, 2), (0, 10), (-100, -8)]:
        np.testing.assert_array_equal(h.read_rows(start, stop).result(), expected[start:stop])
    with pytest.raises(IndexError, match="index 10 is out of bounds for axis 0 with size 10"):
        h[10]
    with pytest.raises(IndexError, match="index -5 is out of bounds for axis 1 with size 3"):
        h[0, -5]
    with pytest.raises(IndexError, match=r"too many indices.*3-dimensional, but 4"):
        h[0, 0, 0, 0]
    for advanced in ([1, 2], np.array([1, 2]), expected > 3, 1.0, True, (Ellipsis, Ellipsis)):
        with pytest.raises(IndexError, match="takes numpy basic indexing"):
            h[advanced]


# -- failures of the disk: harvest errors naming the store, never zeros -----------------


def test_a_missing_chunk_or_array_is_an_error_never_zeros(tmp_path):
    f = lambda x: sow(jax.nn.relu(x), name="h", mode="strict")  # noqa: E731
    data = [np.full((2, 3), v, np.float32) for v in (1.0, -1.0, 2.0)]  # batch 1: all zeros
    path = tmp_path / "s"
    s = store.record(f, data, path, progress=False)
    np.testing.assert_array_equal(s["h"][:], np.maximum(np.concatenate(data), 0))
    chunks = sorted((path / "h").glob("c.*"))
    assert [c.name for c in chunks] == ["c.0.0", "c.1.0", "c.2.0"]  # the zeros too
    chunks[1].unlink()
    s = store.open(path)
    message = r"reading site 'h' of the store at .*: a file of it is missing.*overwrite=True"
    with pytest.raises(FileNotFoundError, match=message):
        s["h"][:]
    np.testing.assert_array_equal(s["h"][4:], [[2.0] * 3] * 2)  # the other chunks still read
    with pytest.raises(FileNotFoundError, match="rows of site 'h' .* a file of it is missing"):
        s["h"].read_rows(0, 6).result()
    with pytest.raises(FileNotFoundError, match=message):
        list(s.batches(2))
    import shutil

    shutil.rmtree(path / "h")
    with pytest.raises(FileNotFoundError, match=r"opening the store at .*: a file of it is"):
        store.open(path)


def test_a_store_written_before_every_chunk_was_kept_still_reads(tmp_path):
    # Such a store has no chunk where a batch was all zeros: there, zeros are its rows.
    f = lambda x: sow(jax.nn.relu(x), name="h", mode="strict")  # noqa: E731
    data = [np.full((2, 3), v, np.float32) for v in (1.0, -1.0, 2.0)]
    path = tmp_path / "s"
    store.record(f, data, path, progress=False)
    (path / "h" / "c.1.0").unlink()
    group = json.loads((path / "zarr.json").read_text())
    del group["attributes"]["harvest"]["every_chunk"]
    (path / "zarr.json").write_text(json.dumps(group))
    np.testing.assert_array_equal(store.open(path)["h"][:], np.maximum(np.concatenate(data), 0))


def test_a_damaged_manifest_is_a_clear_error(tmp_path):
    path = tmp_path / "s"
    store.record(
        lambda x: sow(x * 1.0, name="h", mode="strict"), [np.ones((2, 2))], path, progress=False
    )
    group = json.loads((path / "zarr.json").read_text())
    group["attributes"]["harvest"]["sites"]["h"]["key"] = "../elsewhere"
    (path / "zarr.json").write_text(json.dumps(group))
    with pytest.raises(ValueError, match=r"manifest .* is damaged: site 'h' has key '../elsew"):
        store.open(path)
    (path / "zarr.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest .* is damaged: not JSON"):
        store.open(path)


FULL_DISK = """
import resource, signal, sys
import numpy as np
from harvest import sow, store
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
def batches():
    for i in range(6):
        if i == 3:  # files may grow no larger than a few rows from now on: the disk is full
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        yield np.full((4, 1024), float(i), np.float32)
try:
    store.record(lambda x: sow(x * 2.0, name="h", mode="strict"), batches(), sys.argv[1],
                 progress=False)
except OSError as e:
    print(type(e).__name__, e.errno, e, sep="|")
"""


def test_a_full_disk_is_a_clear_error_and_record_resumes_after_it(tmp_path):
    path = tmp_path / "s"
    child = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    kind, code, message = child.stdout.strip().splitlines()[-1].split("|")
    assert kind == "OSError" and int(code) == 27  # EFBIG
    assert f"the store at {str(path)!r} failed: File too large" in message
    assert "resumes from the batches already written" in message
    assert "OUT_OF_RANGE" not in message and "tensorstore" not in message.lower()
    partial = store.open(path)
    assert not partial.complete and partial.batches_written <= 3
    data = [np.full((4, 1024), float(i), np.float32) for i in range(6)]
    s = store.record(lambda x: sow(x * 2.0, name="h", mode="strict"), data, path, progress=False)
    assert s.complete
    np.testing.assert_array_equal(s["h"][:], np.concatenate(data) * 2.0)


def test_a_path_through_a_file_is_an_os_error_naming_the_store(tmp_path):
    (tmp_path / "file").write_text("mine")
    path = tmp_path / "file" / "s"
    with pytest.raises(OSError, match=r"opening the store at .*file/s' failed: Not a directory"):
        store.record(
            lambda x: sow(x, name="h", mode="strict"), [np.ones((2, 2))], path, progress=False
        )
    assert (tmp_path / "file").read_text() == "mine"


def read_then_extend(path):
    """Reads the store at `path`, then tries to extend it: the lines a read-only
    store's test expects (what was read, then the error's kind, errno and message)."""
    lines = ["read " + str(store.open(path)["h"][:].tolist())]
    data = [np.full((2, 3), float(i), np.float32) for i in range(4)]
    try:
        store.record(lambda x: sow(x * 2.0, name="h", mode="strict"), data, path, progress=False)
    except OSError as e:
        lines.append("|".join(map(str, (type(e).__name__, e.errno, e))))
    return lines


# Root is not bound by file modes: a child process becomes nobody to meet them. It
# first records, reads, extends and fails to write a scratch store, so that all it
# imports (TensorStore, JAX's compiler, the standard library) is imported while it
# can still read them wherever they live (a clone in a folder only its owner may
# enter, a Python under /root).
AS_NOBODY = """
import os, sys, tempfile
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_store import read_then_extend
from harvest import sow, store
scratch = tempfile.mkdtemp()
store.record(lambda x: sow(x * 2.0, name="h", mode="strict"), [np.ones((2, 3), np.float32)],
             scratch + "/s", progress=False)
read_then_extend(scratch + "/s")
open(scratch + "/file", "w").close()
try:
    store.record(lambda x: sow(x, name="h", mode="strict"), [np.ones((2, 3))], scratch + "/file/s",
                 progress=False)
except OSError:
    pass
os.setgid(65534)
os.setuid(65534)
print("\\n".join(read_then_extend(sys.argv[1])), flush=True)
"""


def test_a_store_that_cannot_be_written_is_read_and_a_clear_error_to_extend():
    import shutil
    import tempfile

    root = pathlib.Path(tempfile.mkdtemp())  # not under pytest's tmp_path: nobody may enter it
    try:
        path = root / "s"
        data = [np.full((2, 3), float(i), np.float32) for i in range(2)]
        store.record(lambda x: sow(x * 2.0, name="h", mode="strict"), data, path, progress=False)
        for p in [path, *path.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        root.chmod(0o755)
        if os.getuid() != 0:
            lines = read_then_extend(path)
        else:
            here = str(pathlib.Path(__file__).resolve().parent)
            child = subprocess.run(
                [sys.executable, "-c", AS_NOBODY, str(path), here],
                capture_output=True, text=True, timeout=300,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )  # fmt: skip
            lines = child.stdout.strip().splitlines()
            assert len(lines) == 2, child.stderr[-3000:]
        assert lines[0] == "read " + str((np.concatenate(data) * 2.0).tolist())
        kind, code, message = lines[-1].split("|")
        assert kind == "PermissionError" and int(code) == 13
        assert f"the store at {str(path)!r} failed: Permission denied." in message
        assert "Use a path you can write to" in message
        assert store.open(path).rows == 4  # unchanged
    finally:
        for p in [root, *root.rglob("*")]:
            p.chmod(0o755)
        shutil.rmtree(root)


def test_the_import_guard_says_install_only_where_tensorstore_is_missing(tmp_path, monkeypatch):
    from harvest.store import _arrays

    # Missing (None in sys.modules: Python's "cannot be imported"): how to install it.
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(ImportError, match=r"pip install 'jax-harvest\[store\]'"):
        _arrays.tensorstore()
    # Installed, but its import fails: that failure, chained, and no "install it".
    (tmp_path / "tensorstore").mkdir()
    (tmp_path / "tensorstore" / "__init__.py").write_text(
        "raise ImportError('libtensorstore.so: cannot open shared object file')\n"
    )
    monkeypatch.delitem(sys.modules, "tensorstore")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="which is installed: ImportError: libtensorstore") as e:
        _arrays.tensorstore()
    assert "pip install 'jax-harvest[store]'" not in str(e.value)  # only a reinstall
    assert "cannot open shared object" in str(e.value.__cause__)


# After its imports, as nobody (root reads every folder), with `tensorstore` unimportable
# and a folder it may not read first on its module path.
LOCKED_PATH = """
import os, sys
from harvest.store import _arrays
sys.modules["tensorstore"] = None
sys.path.insert(0, sys.argv[1])
if os.getuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
try:
    _arrays.tensorstore()
except ImportError as e:
    print(e, flush=True)
"""


def test_the_import_guard_names_a_folder_of_the_module_path_it_may_not_read(tmp_path):
    locked = tmp_path / "locked"  # pytest's folders: only their owner may enter them
    locked.mkdir(mode=0o700)
    if os.getuid() != 0:
        locked.chmod(0)
    try:
        child = subprocess.run(
            [sys.executable, "-c", LOCKED_PATH, str(locked)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        locked.chmod(0o700)
    message = child.stdout
    assert f"this process may not read {str(locked)!r}" in message, child.stderr[-3000:]
    assert message.startswith("harvest.store could not import TensorStore (import of")
    assert "pip install" not in message
