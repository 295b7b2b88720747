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
    per_batch = [reap(model, tag="modules", allowlist=NAMES)(b) for b in data]
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
    with pytest.raises(ConnectionError):
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
