"""`record`: run a function over a dataset, writing the selected sites to a store."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, Literal

import jax
import numpy as np

from .. import _errors
from .._calling._renamed import renamed
from .._typing import NameSelect
from .._version import __version__
from .._walk._sow import DEFAULT_TAG
from . import _arrays, _errors as store_errors, _manifest, _processes, _progress
from ._manifest import Manifest, SiteSpec
from ._program import program
from ._reader import Store, open_store


def _manifest_mismatch(path: Any, differences: list[str]) -> ValueError:
    shown = "; ".join(differences[:4]) + (
        f" (and {len(differences) - 4} more)" if len(differences) > 4 else ""
    )
    return ValueError(
        f"record: the store at {str(path)!r} was recorded from other sites or shapes: {shown}. "
        "Nothing was written. Record into another path, or pass overwrite=True to start afresh."
    )


@renamed(fn="f")
def record(
    f: Callable[[Any], Any],
    batches: Iterable[Any],
    path: str | pathlib.Path,
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
    rows: Literal["examples", "tokens"] = "examples",
    dtype: Any = None,
    example_axis: int | dict[str, int] = 0,
    codecs: list[dict[str, Any]] | None = None,
    chunk_rows: int | None = None,
    sharding: jax.sharding.Sharding | None = None,
    max_pending: int = 2,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Store:
    """Runs ``f`` over ``batches`` and writes the sites it sows to a store at ``path``.

    Each batch goes through one compiled program (per batch shape) that runs
    ``f(batch)``, reaps the sites of ``tag`` that ``names`` selects (less those
    ``exclude`` names), and casts
    them to ``dtype``. Each site becomes one zarr v3 array (written with
    TensorStore) whose rows are the batch's examples, in order: batch ``i``
    fills rows ``i * len(batch)`` onwards. Writes are asynchronous and overlap
    the next batch's compute; at most ``max_pending`` batches are being written
    at once, so host memory stays bounded however many batches there are.

    The store is resumable: killed at any point (even by SIGKILL), calling
    ``record`` again with the same arguments and the same batches skips the
    batches already written and writes the rest, so the result is the store an
    uninterrupted run writes. An exception from ``batches`` (or Ctrl-C) first
    lets the writes in flight land, the batch already computed included, so
    the store keeps every batch computed before it. A store recorded from
    other sites, shapes or dtypes is an error (nothing is written);
    ``overwrite=True`` starts afresh.

    Across devices, a batch sharded along its examples (``sharding``, or
    arrays already placed) is written shard by shard from the devices that
    hold it, never gathered. Under ``jax.distributed``, every process calls
    ``record`` with its own part of each batch and ``sharding``; each writes
    its own shards of the one store (process 0 lays it out).

    Args:
        f: the function to run, called as ``f(batch)``; a function, or a
            model (an instrumented NNX or Equinox module: its state is traced,
            not baked into the program).
        batches: an iterable of batches, each an array or a pytree of arrays
            whose leading axis is the example axis, every batch of one shape.
            Resuming iterates it again from the start (the batches already
            written are skipped, not recomputed), so it must yield the same
            batches in the same order each time.
        path: the store's directory: new, empty, or an earlier ``record``'s.
        tag: the tag of the sites to record (``instrument`` sows under
            ``"modules"``).
        names: which sites to record: a name, a glob pattern (``"blocks.*"``),
            a predicate on names, or a list of them; None records every site of
            ``tag``. A string that matches no site is an error.
        exclude: sites never to record, in the same forms as ``names``.
        rows: ``"examples"`` keeps one row per example, ``[examples, ...]``;
            ``"tokens"`` flattens the first two axes, ``[examples * positions,
            ...]``, one row per token.
        dtype: cast every site to this dtype on the devices (e.g.
            ``jnp.bfloat16``); None keeps each site's dtype.
        example_axis: the axis of each site's value, as sown (one occurrence, as
            ``harvest.sites`` lists its shape), that holds the batch's examples;
            for ``rows="tokens"`` the next axis holds positions. An int for every
            site (negative counts from the end), or a dict by site name (others:
            0). The axes a loop stacks a site's occurrences on (a scan over
            layers, say) are never the example axis: such a site's rows are
            ``[examples, layers, ...]``.
        codecs: zarr v3 codecs for every array, as JSON (e.g.
            ``[{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 1}}]``);
            None writes raw little-endian bytes.
        chunk_rows: rows per chunk; None makes one chunk of each device's
            shard of a batch, so no two devices ever write one chunk.
        sharding: where to put each batch: numpy batches (on each process, its
            own part) become global arrays with this sharding; None leaves
            batches as they come.
        max_pending: how many batches may be being written at once.
        overwrite: delete the store at ``path`` first and record afresh.
        progress: a tqdm bar of rows written and MB/s; None shows it only in
            a terminal or notebook (and only on process 0).

    Returns:
        The finished store, opened for reading (see ``harvest.store.open``).

    Raises:
        ValueError: ``path`` is a file or a directory that is not a store; the
            store there holds other sites, shapes or dtypes; a site has no
            example axis of the batch's length; a batch's shapes differ from the
            first's; a site's dtype (or ``codecs``) cannot be stored. In each case
            nothing (of that batch) is written.
        TypeError: a site holds PRNG keys (record ``jax.random.key_data`` of them).
        OSError: the disk is full or not writable (the message names the store,
            the site and what to do; a later ``record`` resumes).
        ImportError: TensorStore is not installed (``jax-harvest[store]``).

    Example:
        >>> import tempfile, jax.numpy as jnp, numpy as np
        >>> from harvest import sow, store
        >>> def f(x):
        ...     h = sow(jnp.tanh(x), name="h", mode="strict")
        ...     return sow(2.0 * h, name="y", mode="strict")
        >>> data = [np.full((4, 3), float(i)) for i in range(5)]
        >>> s = store.record(f, data, tempfile.mkdtemp(), progress=False)
        >>> s["h"].shape, s["y"].dtype
        ((20, 3), dtype('float32'))
        >>> bool((s["h"][4:8] == np.tanh(1.0).astype("float32")).all())
        True
    """
    path = pathlib.Path(path)
    _arrays.tensorstore()  # an ImportError now, not after the first batch
    _check_options(rows, chunk_rows, max_pending, example_axis)
    stored = _stored(path, overwrite)
    run = program(f, tag, names, rows, dtype, example_axis, exclude)
    place = _placer(sharding)
    items = iter(batches)
    first = next(items, _END)
    if first is _END:
        raise ValueError(
            "record(fn, batches, path): `batches` yielded nothing. Pass an iterable of "
            "batches (arrays or pytrees of arrays with a leading example axis)."
        )
    first_out = run(place(first))
    if isinstance(example_axis, dict) and (unknown := sorted(example_axis.keys() - first_out)):
        raise KeyError(
            f"record(example_axis={{...}}) names {', '.join(repr(n) for n in unknown)}, "
            f"which {'is' if len(unknown) == 1 else 'are'} not recorded; the sites recorded are "
            f"{', '.join(repr(n) for n in first_out)}. Nothing was written."
        )
    manifest, chunks = _layout(f, tag, rows, first_out, chunk_rows)
    _arrays.check_creatable([(n, s, chunks[n]) for n, s in manifest.sites.items()], codecs)
    if stored is not None:
        if differences := stored.differences(manifest):
            raise _manifest_mismatch(path, differences)
        # Resumed: the batches written before keep the earlier run's promise.
        manifest = dataclasses.replace(manifest, every_chunk=stored.every_chunk)
    processes, me = _processes.count(), _processes.index()
    begin = 0 if stored is None else _progress.start(path, processes, stored.batches)
    if me == 0:
        with _arrays.failures(path, "laying out"):
            _lay_out(path, stored, manifest, chunks, codecs, overwrite)
    _processes.barrier("harvest.store.begin")
    if me != 0:  # every process checks that it computes what process 0 laid out
        laid_out = _manifest.read(path)
        differences = ["no manifest"] if laid_out is None else laid_out.differences(manifest)
        if differences:
            raise _manifest_mismatch(path, differences)

    bar = _bar(progress, me, batches, manifest, begin)
    writer = _Writer(path, manifest, me, begin, max_pending, bar)
    outputs = _outputs(run, place, items, first_out, begin, path)
    try:
        _write_all(outputs, writer, manifest)
    except BaseException:  # Ctrl-C, a failing loader, a bad batch: keep what was written
        writer.drain()
        raise
    total = writer.committer.committed
    _processes.barrier("harvest.store.written")
    if me == 0:
        with _arrays.failures(path, "finishing"):
            _finish(path, manifest, total)
    _processes.barrier("harvest.store.end")
    return open_store(path)


_END = object()


def _check_options(rows: str, chunk_rows: int | None, max_pending: int, example_axis: Any) -> None:
    if rows not in ("examples", "tokens"):
        raise store_errors.bad_option("rows", rows, "'examples' or 'tokens'")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise store_errors.bad_option("chunk_rows", chunk_rows, "a positive int or None")
    if not isinstance(max_pending, int) or max_pending < 1:
        raise store_errors.bad_option("max_pending", max_pending, "a positive int")
    axes = example_axis.items() if isinstance(example_axis, dict) else [("", example_axis)]
    if not all(isinstance(n, str) and type(a) is int for n, a in axes):
        raise store_errors.bad_option(
            "example_axis", example_axis, "an int, or a dict from site names to ints"
        )


def _stored(path: pathlib.Path, overwrite: bool) -> Manifest | None:
    """The manifest to resume from (None: a new store); raises for a path that is no store."""
    with _arrays.failures(path, "opening"):
        stored = _manifest.check_path(path)  # never deletes a file or a stranger's directory
    return None if overwrite else stored


def _placer(sharding: jax.sharding.Sharding | None) -> Callable[[Any], Any]:
    if sharding is None:
        return lambda batch: batch

    def place(batch: Any) -> Any:
        def put(leaf: Any) -> Any:
            if isinstance(leaf, jax.Array):
                return leaf
            return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

        return jax.tree_util.tree_map(put, batch)

    return place


def _row_shape(value: jax.Array, rows: str) -> tuple[int, ...]:
    return tuple(value.shape[1:] if rows == "examples" else value.shape[2:])


def _layout(
    fn: Any, tag: str, rows: str, out: dict[str, jax.Array], chunk_rows: int | None
) -> tuple[Manifest, dict[str, tuple[int, ...]]]:
    """The manifest of what the first batch gave, and each site's chunk shape."""
    sites, chunks, per_batch = {}, {}, {}
    for name, value in out.items():
        per_example = 1 if rows == "examples" else value.shape[1]
        per_batch[name] = value.shape[0] * per_example
        sites[name] = SiteSpec(_row_shape(value, rows), value.dtype.name, SiteSpec.key_for(name))
        shard = next(s for s in value.addressable_shards if s.replica_id == 0)
        local = shard.data.shape[0] * per_example
        chunks[name] = (chunk_rows or local, *_row_shape(shard.data, rows))
    rows_per_batch = next(iter(per_batch.values()))
    for name, n in per_batch.items():
        if n != rows_per_batch:  # tokens: every site needs the same positions
            raise store_errors.site_not_rows(name, out[name].shape, out[name].shape[0], rows)
    manifest = Manifest(
        tag=tag,
        rows=rows,
        rows_per_batch=rows_per_batch,
        sites=sites,
        function=_identity(fn),
        processes=_processes.count(),
        versions={"harvest": __version__, "jax": jax.__version__},
        every_chunk=True,
    )
    return manifest, chunks


def _identity(fn: Any) -> str:
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def _lay_out(
    path: pathlib.Path,
    stored: Manifest | None,
    manifest: Manifest,
    chunks: dict[str, tuple[int, ...]],
    codecs: list[dict[str, Any]] | None,
    overwrite: bool,
) -> None:
    """Process 0: a new store's manifest and arrays, or room to grow in an old one's."""
    if stored is None:
        if overwrite and path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        _manifest.write(path, manifest)
        _arrays.create(
            path, [(site, chunks[name]) for name, site in manifest.sites.items()], codecs
        )
    else:
        there = [site for site in stored.sites.values() if _arrays.exists(path, site)]
        _arrays.resize(path, there, _arrays.CAPACITY)
        # Killed between writing the manifest and creating these arrays:
        missing = [(s, chunks[n]) for n, s in stored.sites.items() if s not in there]
        _arrays.create(path, missing, codecs)


def _finish(path: pathlib.Path, manifest: Manifest, batches: int) -> None:
    """Process 0, after every process has written: the count into the manifest, rows trimmed."""
    done = dataclasses.replace(manifest, batches=batches)
    _manifest.write(path, done)
    _arrays.resize(path, list(manifest.sites.values()), batches * manifest.rows_per_batch)
    _progress.clear(path)


def _outputs(
    run: Callable[[Any], dict[str, jax.Array]],
    place: Callable[[Any], Any],
    items: Iterator[Any],
    first_out: dict[str, jax.Array],
    begin: int,
    path: pathlib.Path,
) -> Iterator[tuple[int, dict[str, jax.Array]]]:
    """(index, reaped sites) of every batch from `begin` on, each dispatched when asked for."""
    if begin == 0:
        yield 0, first_out
    else:  # batch 0 ran only to check the manifest; batches 1 .. begin - 1 are skipped
        skipped = sum(1 for _ in itertools.islice(items, begin - 1))
        if skipped < begin - 1:
            raise ValueError(
                f"record: the store at {str(path)!r} already holds {begin} batches, but `batches` "
                f"yielded only {1 + skipped}: it is not the dataset this store was recorded from. "
                "Pass overwrite=True to record it afresh."
            )
    for index, batch in enumerate(items, start=max(begin, 1)):
        out = run(place(batch))
        yield index, out


def _write_all(
    outputs: Iterator[tuple[int, dict[str, jax.Array]]], writer: _Writer, manifest: Manifest
) -> None:
    """Writes every batch, each while the next is being computed."""
    previous = None
    try:
        for index, out in outputs:  # dispatching `index`, then copying out `previous`
            wrong = _wrong_shape(out, manifest)
            if previous is not None:
                ready, previous = previous, None
                writer.submit(*ready)
            if wrong is not None:
                writer.drain()
                name, got, expected = wrong
                raise ValueError(
                    f"record: batch {index} gives site {name!r} rows of shape {tuple(got)}, but the "
                    f"store holds rows of shape {tuple(expected)}. Nothing of batch {index} was "
                    f"written (the store keeps its first {writer.committer.committed} batches). Give "
                    "every batch one shape: drop or pad the last, short batch."
                )
            previous = index, out
    except BaseException:  # the loader or the next batch failed: the last batch is still good
        if previous is not None:
            try:
                writer.submit(*previous)
            except Exception:  # it failed too; the first error is the one to report
                pass
        raise
    if previous is not None:
        writer.submit(*previous)
    writer.drain()


def _wrong_shape(
    out: dict[str, jax.Array], manifest: Manifest
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(site, its rows' shape, the store's) for a batch whose shapes differ from the store's."""
    for name, site in manifest.sites.items():
        value = out[name]
        rows = value.shape[0] * (1 if manifest.rows == "examples" else value.shape[1])
        got = (rows, *_row_shape(value, manifest.rows))
        if got != (manifest.rows_per_batch, *site.shape) or value.dtype.name != site.dtype:
            return name, got, (manifest.rows_per_batch, *site.shape)
    return None


class _Writer:
    """Copies each batch's shards to the host and writes them; keeps `max_pending` in flight."""

    def __init__(
        self,
        path: pathlib.Path,
        manifest: Manifest,
        process: int,
        begin: int,
        max_pending: int,
        bar: Any,
    ):
        self.path, self.manifest = path, manifest
        with _arrays.failures(path, "opening for writing"):
            opened = _arrays.open_arrays(path, list(manifest.sites.values()))
            self.committer = _progress.Committer(path, process, begin)
        self.arrays = dict(zip(manifest.sites, opened))
        self.pending: collections.deque[tuple[int, list[tuple[str, Any]], int]] = (
            collections.deque()
        )
        self.max_pending = max_pending
        self.bar = bar
        self.bytes, self.started = 0, time.perf_counter()

    def submit(self, index: int, out: dict[str, jax.Array]) -> None:
        tokens = self.manifest.rows == "tokens"
        base = index * self.manifest.rows_per_batch
        futures, nbytes = [], 0
        for name, value in out.items():
            per_example = value.shape[1] if tokens else 1
            for shard in value.addressable_shards:
                if shard.replica_id != 0:
                    continue  # another device (or process) writes this copy
                data = np.asarray(shard.data)
                start, _, _ = shard.index[0].indices(value.shape[0])
                rest = shard.index[2:] if tokens else shard.index[1:]
                if tokens:
                    if data.shape[1] != value.shape[1]:
                        raise ValueError(
                            f"record(rows='tokens'): site {name!r} is sharded along its position axis, so one "
                            "device's rows are not contiguous tokens. Shard the batch along examples only, or "
                            "use rows='examples'."
                        )
                    data = data.reshape(-1, *data.shape[2:])
                first = base + start * per_example
                target = self.arrays[name][(slice(first, first + data.shape[0]), *rest)]
                # TensorStore keeps a reference to `data` rather than a copy: the
                # array is the device's result (zero-copy on CPU), never modified.
                with _arrays.failures(self.path, f"writing batch {index} to", name):
                    write = target.write(data, can_reference_source_data_indefinitely=True)
                futures.append((name, write.commit))
                nbytes += data.nbytes
        self.pending.append((index, futures, nbytes))
        while self.pending and (
            len(self.pending) > self.max_pending or all(f.done() for _, f in self.pending[0][1])
        ):
            self._land()

    def _land(self) -> None:
        index, futures, nbytes = self.pending.popleft()
        for name, future in futures:
            with _arrays.failures(self.path, f"writing batch {index} to", name):
                future.result()
        with _arrays.failures(self.path, "saving the progress of"):
            self.committer.landed(index)
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(self.manifest.rows_per_batch)
            rate = self.bytes / 2**20 / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{rate:.0f} MiB/s", refresh=False)

    def drain(self) -> None:
        while self.pending:
            self._land()
        with _arrays.failures(self.path, "saving the progress of"):
            self.committer.flush()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _bar(
    progress: bool | None, process: int, batches: Iterable[Any], manifest: Manifest, begin: int
) -> Any:
    auto = progress is None
    if process != 0 or not (progress or (auto and _interactive())):
        return None
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]
    except ImportError:
        if auto:
            return None
        raise _errors.needs_extra("record(progress=True)", "tqdm", "store") from None
    total = len(batches) * manifest.rows_per_batch if isinstance(batches, Sized) else None
    return tqdm(
        total=total,
        initial=begin * manifest.rows_per_batch,
        desc="record",
        unit="rows",
        delay=1.0 if auto else 0.0,
    )


def _interactive() -> bool:
    """Whether a person is watching: a terminal on stderr, or a Jupyter kernel."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    if getattr(shell, "kernel", None) is not None:
        return True
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
