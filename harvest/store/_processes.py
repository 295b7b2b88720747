"""The processes of JAX's multi-controller runtime, as the store needs them.

A store is written by every process (each its own shards) and laid out by
process 0; a barrier orders the two. With one process, the barrier is nothing.
"""

from __future__ import annotations

import jax


def index() -> int:
    return int(jax.process_index())


def count() -> int:
    return int(jax.process_count())


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier called `name`."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
