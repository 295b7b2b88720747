"""harvest.store: activations at dataset scale.

``record(f, batches, path)`` runs a function over a dataset and writes the
sites it sows to a directory of zarr v3 arrays (through TensorStore), one row
per example or per token: asynchronously, resumably after a kill, from every
device and every process that holds a shard. ``open(path)`` reads it back:
sites by name as lazily read arrays, and ``store.batches(...)`` as shuffled
minibatches for training a probe or a sparse autoencoder.

Needs the ``store`` extra: ``pip install 'jax-harvest[store]'``.
"""

from ._reader import Store as Store, StoreArray as StoreArray, open_store as open
from ._record import record as record

__all__ = ["Store", "StoreArray", "open", "record"]
