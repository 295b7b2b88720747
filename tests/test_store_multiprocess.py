"""harvest.store under JAX's multi-controller runtime: 2 processes x 4 CPU devices, gloo.

Each process feeds its half of every batch; both write their shards of one
store, killed mid-run and started again. The reference is this one process's
`reap` of the same model over the same examples, two at a time as each device
computes them, and the store must equal it bit for bit.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorstore", reason="harvest.store needs the store extra (tensorstore)")
pytest.importorskip("flax.nnx")

from test_store import NAMES, WORKLOAD, dataset, make_model  # noqa: E402

from harvest import reap, store  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHILD = """
import os, sys, time
path, processes, pid, port, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
import jax
if processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=pid
    )
from jax.sharding import NamedSharding, PartitionSpec as P
from harvest import store
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
half = 16 // processes
def local_batches():
    for i, batch in enumerate(dataset(n=6, batch=16)):
        print("batch", i, flush=True)
        time.sleep(delay)
        yield batch[pid * half:(pid + 1) * half]  # this process's examples of the batch
store.record(make_model(), local_batches(), path, tag="modules", names="blocks.*",
             sharding=NamedSharding(mesh, P("data")), progress=False)
print("finished", flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(path, processes, delay=0.0):
    devices = 8 // processes
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    port, script = free_port(), WORKLOAD + CHILD
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                script,
                str(path),
                str(processes),
                str(i),
                str(port),
                str(delay),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]


def finish(children):
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-3000:]
        assert "finished" in out


def test_two_processes_write_one_store_equal_to_one_process_even_after_a_kill(tmp_path):
    path = tmp_path / "multi"
    killed = launch(path, 2, delay=0.2)
    for line in killed[0].stdout:
        if line.startswith("batch 3"):
            break
    for child in killed:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    partial = store.open(path)
    assert not partial.complete and partial.batches_written < 6
    finish(launch(path, 2))  # resumed: each process from where both had written
    s = store.open(path)
    assert s.complete and s.rows == 6 * 16 and s.manifest.processes == 2
    assert sorted(s) == sorted(
        NAMES + ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
    )
    model = make_model()
    for name in NAMES:
        by_device = [
            reap(model, tag="modules", names=[name])(batch[i : i + 2])[name]
            for batch in dataset(n=6, batch=16)
            for i in range(0, 16, 2)
        ]
        np.testing.assert_array_equal(np.asarray(s[name]), np.concatenate(by_device))
        assert s[name].chunk_rows == 2  # one chunk per device's shard
