"""Reading a store back: lazy arrays by site name, and shuffled minibatches."""

from __future__ import annotations

import operator
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .._typing import NameSelect
from .._walk._interpreter import NameFilter
from . import _arrays, _errors, _manifest, _progress
from ._manifest import Manifest

# How much of the store `batches` holds in memory at once, by default: the
# shuffle mixes rows within this much data (whole chunks, in random order).
BUFFER_BYTES = 64 * 2**20


class StoreArray:
    """One site's rows, read from disk only when indexed (``array[i:j]``, ``np.asarray``).

    ``shape``, ``dtype``, ``ndim`` and ``len`` come from the array's metadata,
    without reading rows. Indexing is numpy's basic indexing, with numpy's
    meaning: ints (negative from the end), slices (clipped to the array, empty
    ones, any step), ``...`` and ``None``; it reads only the rows it selects and
    returns a numpy array. A chunk file missing from the store is an error,
    never rows of zeros.

    Args:
        name: the site's name.
        array: the site's TensorStore array, its row axis cut to the rows written.
        path: the store's directory, for messages.

    Example:
        >>> import tempfile, numpy as np
        >>> from harvest import sow, store
        >>> f = lambda x: sow(x * 2.0, name="h", mode="strict")
        >>> s = store.record(f, [np.ones((3, 2), np.float32)], tempfile.mkdtemp(), progress=False)
        >>> h = s["h"]
        >>> h.shape, len(h), h[1:]
        ((3, 2), 3, array([[2., 2.],
               [2., 2.]], dtype=float32))
        >>> h[-1, ::-1].shape, h[5:9].shape
        ((2,), (0, 2))
    """

    def __init__(self, name: str, array: Any, path: pathlib.Path | None = None):
        self.name = name
        self._array = array
        self._path = path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self._array.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        dtype: np.dtype[Any] = np.dtype(self._array.dtype.numpy_dtype)
        return dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def chunk_rows(self) -> int:
        """Rows per stored chunk (the unit a read fetches)."""
        return int(self._array.chunk_layout.read_chunk.shape[0])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray[Any, Any]:
        box, local = _basic_index(index, self.shape)
        if any(len(range(s.start, s.stop, s.step)) == 0 for s in box):
            rows = np.empty([len(range(s.start, s.stop, s.step)) for s in box], self.dtype)
        else:
            with self._failures("reading"):
                rows = np.asarray(self._array[box].read().result())
        out: np.ndarray[Any, Any] = rows[local]
        return out

    def _failures(self, doing: str) -> Any:
        return _arrays.failures(self._path or pathlib.Path("?"), doing, self.name)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def read_rows(self, start: int, stop: int) -> Any:
        """A future of rows ``start:stop`` (``.result()`` gives the numpy array).

        Args:
            start: the first row to read (as in a slice: negative counts from the
                end, and both ends are clipped to the rows there are).
            stop: the row to stop before.

        Returns:
            A future; its ``.result()`` is the rows as a numpy array.
        """
        ((rows, *_), _) = _basic_index(slice(start, stop), self.shape)
        return _Read(self._array[rows].read(), lambda: self._failures("reading rows of"))

    def __repr__(self) -> str:
        return f"StoreArray({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def _bad_index(index: Any) -> IndexError:
    return IndexError(
        f"StoreArray takes numpy basic indexing (ints, slices, ..., None), got {index!r}. "
        "Read the rows first (np.asarray(array[i:j])), then index the numpy array."
    )


def _basic_index(index: Any, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[Any, ...]]:
    """numpy's basic indexing of an array of `shape`, as a box to read and an index of it.

    The box holds, per axis, an in-range slice with a positive step (TensorStore
    reads exactly it; it knows no negative indices); indexing the rows read with
    the second part (0 for an int, a reversal for a negative step, None for a new
    axis) gives what numpy gives for `index`.
    """
    items = index if isinstance(index, tuple) else (index,)
    if sum(item is Ellipsis for item in items) > 1:
        raise _bad_index(index)
    used = sum(item is not None and item is not Ellipsis for item in items)
    if used > len(shape):
        raise IndexError(
            f"too many indices for the store's array: it is {len(shape)}-dimensional, "
            f"but {used} were indexed"
        )
    if not any(item is Ellipsis for item in items):
        items = (*items, Ellipsis)
    box: list[slice] = []
    local: list[Any] = []
    for item in items:
        axis = len(box)
        if item is None:
            local.append(None)
        elif item is Ellipsis:
            for _ in range(len(shape) - used):
                box.append(slice(0, shape[len(box)], 1))
                local.append(slice(None))
        elif isinstance(item, slice):
            start, stop, step = item.indices(shape[axis])
            taken = range(start, stop, step)
            if not taken:
                box.append(slice(0, 0, 1))
            else:
                box.append(slice(min(taken[0], taken[-1]), max(taken[0], taken[-1]) + 1, abs(step)))
            local.append(slice(None, None, -1 if step < 0 else 1))
        elif isinstance(item, (bool, np.bool_)) or not hasattr(item, "__index__"):
            raise _bad_index(index)  # arrays, lists, masks: advanced indexing
        else:
            try:
                i = operator.index(item)
            except TypeError:  # an array of more than one element
                raise _bad_index(index) from None
            if not -shape[axis] <= i < shape[axis]:
                raise IndexError(
                    f"index {i} is out of bounds for axis {axis} with size {shape[axis]}"
                )
            i %= shape[axis]
            box.append(slice(i, i + 1, 1))
            local.append(0)
    return tuple(box), tuple(local)


class _Read:
    """A read in flight: `result()` gives its rows, or raises a harvest error."""

    def __init__(self, future: Any, failures: Any):
        self._future, self._failures = future, failures

    def done(self) -> bool:
        return bool(self._future.done())

    def result(self) -> np.ndarray[Any, Any]:
        with self._failures():
            return np.asarray(self._future.result())


def _unknown_name(name: Any, names: Iterable[str]) -> KeyError:
    return KeyError(
        f"the store has no site {name!r}; it holds: {', '.join(repr(n) for n in names)}."
    )


class Store(Mapping[str, StoreArray]):
    """A recorded store: ``store[name]`` is a site's rows as a ``StoreArray``.

    Made by ``harvest.store.open`` and returned by ``record``. A mapping from
    site names to arrays: ``len(store)`` counts sites, ``store.rows`` the rows
    each holds, ``store.manifest`` what was recorded. A store whose recording
    was interrupted holds the batches written for good so far
    (``store.complete`` is False until ``record`` finishes it).

    Args:
        path: the store's directory.
        manifest: its manifest (``zarr.json``'s ``"harvest"`` attributes).
        batches: how many batches to expose: those every writer completed.

    Example:
        >>> import tempfile, numpy as np
        >>> from harvest import sow, store
        >>> def f(x):
        ...     return sow(x + 1.0, name="a", mode="strict") * sow(x, name="b", mode="strict")
        >>> s = store.record(f, [np.zeros((2, 4), np.float32)] * 3, tempfile.mkdtemp(), progress=False)
        >>> sorted(s), s.rows, s.complete, s.manifest.batches
        (['a', 'b'], 6, True, 3)
    """

    def __init__(self, path: pathlib.Path, manifest: Manifest, batches: int):
        self.path = path
        self.manifest = manifest
        self.batches_written = batches
        self.rows = batches * manifest.rows_per_batch
        # A finished run moved its count into the manifest and removed the progress files.
        self.complete = manifest.batches > 0 and not (path / _progress.FOLDER).exists()
        with _arrays.failures(path, "opening"):
            opened = _arrays.open_arrays(
                path, list(manifest.sites.values()), self.rows, True, manifest.every_chunk
            )
        self._arrays = {name: StoreArray(name, a, path) for name, a in zip(manifest.sites, opened)}

    def __getitem__(self, name: str) -> StoreArray:
        try:
            return self._arrays[name]
        except KeyError:
            raise _unknown_name(name, self._arrays) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, rows={self.rows}, sites={list(self._arrays)})"

    def batches(
        self,
        batch_size: int,
        *,
        seed: int = 0,
        names: NameSelect = None,
        shuffle: bool = True,
        epochs: int = 1,
        drop_remainder: bool = False,
        buffer_bytes: int = BUFFER_BYTES,
    ) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
        """Minibatches ``{name: rows}`` over the store, every row once per epoch.

        Shuffling permutes the chunks, reads about ``buffer_bytes`` of them at
        a time (the next read overlapping the current batches) and permutes
        the rows among them; the same ``seed`` gives the same batches. Every
        site's rows come in the same order, so row ``i`` of each belongs to
        the same example or token.

        Args:
            batch_size: rows per batch.
            seed: the shuffle's seed; epoch ``e`` uses ``(seed, e)``.
            names: the sites to read: a name, a glob pattern, a predicate, or a
                list of them (None: every site).
            shuffle: False reads rows in order.
            epochs: how many passes over the store.
            drop_remainder: leave out each epoch's last, smaller batch.
            buffer_bytes: how much to read and shuffle at once.

        Returns:
            An iterator of dicts from site name to a ``[batch_size, ...]`` numpy array.

        Raises:
            KeyError: a name in ``names`` is not a site of the store.
            ValueError: ``batch_size`` or ``epochs`` is not a positive int.

        Example:
            >>> import tempfile, numpy as np
            >>> from harvest import sow, store
            >>> f = lambda x: sow(x * 1.0, name="x", mode="strict")
            >>> s = store.record(f, [np.arange(8.0).reshape(4, 2) + 8 * i for i in range(3)],
            ...                  tempfile.mkdtemp(), progress=False)
            >>> seen = np.concatenate([b["x"][:, 0] for b in s.batches(5, seed=0)])
            >>> sorted(seen.tolist()) == list(range(0, 24, 2))
            True
        """
        for what, n in (("batch_size", batch_size), ("epochs", epochs)):
            if not isinstance(n, int) or n < 1:
                raise _errors.bad_option(what, n, "a positive int")
        arrays = [self[name] for name in self._select(names)]
        block = max(a.chunk_rows for a in arrays)
        row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in arrays)
        window = max(1, buffer_bytes // max(row_bytes * block, 1))
        blocks = -(-self.rows // block)
        for epoch in range(epochs):
            rng = np.random.default_rng([seed, epoch])
            order = rng.permutation(blocks) if shuffle else np.arange(blocks)
            windows = [order[i : i + window] for i in range(0, blocks, window)]
            yield from self._epoch(
                arrays, windows, block, rng if shuffle else None, batch_size, drop_remainder
            )

    def _select(self, names: NameSelect) -> list[str]:
        if names is None:
            return list(self._arrays)
        select = NameFilter.make(names, None)
        for entry in select.allow or ():  # a string matching no site is a typo, not a choice
            if isinstance(entry, str) and not any(
                NameFilter.make(entry, None)((name,)) for name in self._arrays
            ):
                raise _unknown_name(entry, self._arrays)
        return [name for name in self._arrays if select((name,))]

    def _epoch(
        self,
        arrays: list[StoreArray],
        windows: list[np.ndarray[Any, Any]],
        block: int,
        rng: np.random.Generator | None,
        batch_size: int,
        drop_remainder: bool,
    ) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
        # Each window's chunks are decoded by TensorStore straight into one buffer per
        # site, after room for the last window's leftover rows (fewer than a batch), so
        # leftovers join the next window without concatenating it. Shuffled batches are
        # gathered out of the buffer (fresh arrays), so two buffers serve every window in
        # turn (one read while the other is served) and memory is not faulted in again;
        # in order, batches are views of a fresh buffer per window, never copied.
        spare = min(batch_size - 1, self.rows)
        room = spare + max((len(w) for w in windows), default=0) * block
        reused = [_Buffers(arrays, room) for _ in range(2)] if rng is not None else []
        names = [a.name for a in arrays]

        def read(k: int) -> tuple[_Buffers, list[Any], int]:
            buffers = reused[k % 2] if reused else _Buffers(arrays, room)
            return (buffers, *buffers.fill(arrays, _spans(windows[k], block, self.rows), spare))

        carry: list[np.ndarray[Any, Any]] = []
        reads = [read(0)] if windows else []
        for k in range(len(windows)):
            if k + 1 < len(windows):  # the next window is read while this one is served
                reads.append(read(k + 1))
            buffers, futures, end = reads.pop(0)
            for name, future in futures:
                with _arrays.failures(self.path, "reading", name):
                    future.result()
            begin = spare - (len(carry[0]) if carry else 0)
            pool = buffers.rows(begin, end)
            for target, rows in zip(pool, carry):
                target[: len(rows)] = rows
            n = end - begin
            full = n // batch_size * batch_size
            if rng is not None:
                order = rng.permutation(n)
                for i in range(0, full, batch_size):
                    take = order[i : i + batch_size]
                    yield {name: np.take(p, take, axis=0) for name, p in zip(names, pool)}
                carry = [np.take(p, order[full:], axis=0) for p in pool]
            else:
                for i in range(0, full, batch_size):
                    yield {name: p[i : i + batch_size] for name, p in zip(names, pool)}
                carry = [p[full:] for p in pool]
        if carry and len(carry[0]) and not drop_remainder:
            yield dict(zip(names, carry))


class _Buffers:
    """One host buffer per site, a window of rows each, with TensorStore views to fill them."""

    def __init__(self, arrays: list[StoreArray], rows: int):
        self.data = [np.empty((rows, *a.shape[1:]), a.dtype) for a in arrays]
        ts = _arrays.tensorstore()
        self.views = [ts.array(d, copy=False, write=True) for d in self.data]

    def fill(
        self, arrays: list[StoreArray], spans: list[tuple[int, int]], at: int
    ) -> tuple[list[tuple[str, Any]], int]:
        """Futures copying each site's rows in `spans` to rows `at` onwards; the end row."""
        futures = []
        for array, view in zip(arrays, self.views):
            end = at
            for start, stop in spans:
                copy = view[end : end + stop - start].write(array._array[start:stop])
                futures.append((array.name, copy))
                end += stop - start
        return futures, end

    def rows(self, begin: int, end: int) -> list[np.ndarray[Any, Any]]:
        return [d[begin:end] for d in self.data]


def _spans(window: np.ndarray[Any, Any], block: int, rows: int) -> list[tuple[int, int]]:
    """The row ranges of a window's chunks, in order: one copy each, which TensorStore
    runs in parallel (neighbours merged into one copy ran slower, measured)."""
    return [(b * block, min((b + 1) * block, rows)) for b in sorted(int(b) for b in window)]


def open_store(path: str | pathlib.Path) -> Store:
    """Opens the store at ``path`` for reading; nothing is read until indexed.

    Args:
        path: a directory written by ``harvest.store.record``.

    Returns:
        The ``Store``: sites by name, each a lazily read ``StoreArray``.

    Raises:
        FileNotFoundError: ``path`` holds no harvest store.

    Example:
        >>> import tempfile, numpy as np
        >>> from harvest import sow, store
        >>> where = tempfile.mkdtemp()
        >>> _ = store.record(lambda x: sow(x + 1.0, name="y", mode="strict"),
        ...                  [np.zeros((2, 3))], where, progress=False)
        >>> s = store.open(where)
        >>> s["y"], len(s["y"])
        (StoreArray('y', shape=(2, 3), dtype=float32), 2)
    """
    path = pathlib.Path(path)
    with _arrays.failures(path, "opening"):
        manifest = _manifest.read(path) if path.is_dir() else None
    if manifest is None:
        raise FileNotFoundError(
            f"harvest.store.open({str(path)!r}): no harvest store there (no zarr.json with a "
            "'harvest' manifest). Record one with harvest.store.record(fn, batches, path)."
        )
    with _arrays.failures(path, "opening"):
        batches = _progress.start(path, manifest.processes, manifest.batches)
    return Store(path, manifest, batches)
