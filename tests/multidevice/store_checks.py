"""harvest.store and stream across 8 virtual CPU devices.

References: the same function reaped on the same sharded batches (bit for bit:
the same per-device programs), and on one device by hand (to rounding).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from harvest import reap, sow, store, stream

pytest.importorskip("tensorstore")
assert jax.device_count() == 8, "run through tests/test_many_devices.py"

MESH = jax.make_mesh((8,), ("data",))
BATCH = NamedSharding(MESH, P("data"))
W = jnp.arange(12.0).reshape(3, 4) / 10.0


def f(x):
    h = sow(jnp.tanh(x @ W), name="h", mode="strict")
    return sow(h.sum(-1), name="y", mode="strict")


DATA = [np.random.default_rng(i).standard_normal((16, 3)).astype(np.float32) for i in range(3)]


def test_record_under_sharded_batches_writes_each_shard_where_it_is(tmp_path, monkeypatch):
    from harvest.store import _record

    submitted = []  # each recorded value's sharding, as the writer gets it
    submit = _record._Writer.submit

    def spy(self, index, out):
        submitted.extend(value.sharding for value in out.values())
        return submit(self, index, out)

    monkeypatch.setattr(_record._Writer, "submit", spy)
    s = store.record(f, DATA, tmp_path / "s", sharding=BATCH, progress=False)
    assert all(sh.spec[0] == "data" for sh in submitted)  # sharded by example, never gathered
    chunks = [n for n in os.listdir(tmp_path / "s" / "h") if n.startswith("c.")]
    assert len(chunks) == 3 * 8  # one chunk per device and batch
    for name in ("h", "y"):
        sharded = np.concatenate(
            [np.asarray(reap(f)(jax.device_put(b, BATCH))[name]) for b in DATA]
        )
        np.testing.assert_array_equal(np.asarray(s[name]), sharded)
        by_hand = np.concatenate([np.tanh(b @ np.asarray(W)) for b in DATA])
        if name == "y":
            by_hand = by_hand.sum(-1)
        np.testing.assert_allclose(np.asarray(s[name]), by_hand, rtol=1e-5, atol=1e-6)


def test_record_of_batches_already_placed_and_tokens(tmp_path):
    placed = [jax.device_put(np.stack([b, b + 1.0], axis=1), BATCH) for b in DATA]  # [16, 2, 3]
    s = store.record(f, placed, tmp_path / "s", names="h", rows="tokens", progress=False)
    expected = np.concatenate([np.asarray(reap(f)(b)["h"]).reshape(32, 4) for b in placed])
    np.testing.assert_array_equal(np.asarray(s["h"]), expected)


def test_stream_runs_under_sharded_jit_and_shard_map():
    x = jax.device_put(DATA[0], BATCH)
    seen = []
    g = jax.jit(stream(f, lambda name, v: seen.append((name, np.asarray(v)))))
    np.testing.assert_array_equal(g(x), jax.jit(f)(x))
    jax.effects_barrier()
    reaped = reap(f)(x)
    assert sorted(n for n, _ in seen) == ["h", "y"]  # once per site, the whole value
    for name, value in seen:
        np.testing.assert_array_equal(value, np.asarray(reaped[name]))

    seen.clear()
    per_shard = jax.shard_map(
        stream(f, lambda name, v: seen.append((name, np.asarray(v)))),
        mesh=MESH,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    jax.jit(per_shard)(x)
    jax.effects_barrier()
    hs = [v for n, v in seen if n == "h"]
    assert len(hs) == 8 and all(v.shape == (2, 4) for v in hs)  # once per shard
    rows = sorted(map(tuple, np.concatenate(hs).tolist()))
    assert rows == sorted(map(tuple, np.asarray(reaped["h"]).tolist()))
