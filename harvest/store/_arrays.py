"""The storage engine: one zarr v3 array per site, through TensorStore.

TensorStore was chosen over zarr-python by measurement (docs/guides/activation_store.md):
its writes are asynchronous futures, its file driver writes each chunk whole
(a temporary file, `fsync`, a rename: a killed writer leaves no torn chunk),
and it reads and writes faster. The
row axis is created with room for any number of batches (zarr stores no
chunk that was never written) and trimmed to the rows written when a run ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import sys
from collections.abc import Iterator
from typing import Any

from ._manifest import SiteSpec

# Rows the row axis can hold while a run is writing: far beyond any dataset,
# and free, since zarr keeps only the chunks written.
CAPACITY = 2**48


def _tensorstore_unimportable(cause: ImportError, unreadable: list[str]) -> ImportError:
    if unreadable:
        where = ", ".join(repr(p) for p in unreadable)
        return ImportError(
            f"harvest.store could not import TensorStore ({cause}): this process may not "
            f"read {where} on its module path (permission denied), where it may be "
            "installed. Run it as a user who can read them, or install TensorStore where "
            "this user can."
        )
    return ImportError(
        "harvest.store could not import TensorStore, which is installed: "
        f"{type(cause).__name__}: {cause}. That is TensorStore's own failure (the "
        "traceback above shows where); reinstalling it may mend it: "
        "pip install --force-reinstall 'jax-harvest[store]'."
    )


def tensorstore() -> Any:
    """The ``tensorstore`` module. Where it cannot be imported: "install it" only
    where it is missing, else why (a folder of the module path this process may
    not read, or TensorStore's own import error, chained)."""
    try:
        import tensorstore as ts
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == "tensorstore"
        unreadable = _unreadable_path_entries() if missing else []
        if missing and not unreadable:
            raise ImportError(
                "harvest.store writes and reads its arrays with TensorStore: "
                "pip install 'jax-harvest[store]' (or pip install tensorstore)."
            ) from None
        raise _tensorstore_unimportable(e, unreadable) from e
    return ts


def _unreadable_path_entries() -> list[str]:
    """The folders on ``sys.path`` this process may not list (a package there is
    invisible to it, so it looks missing)."""
    out = []
    for entry in sys.path:
        try:
            os.listdir(entry or ".")
        except PermissionError:
            out.append(entry or os.getcwd())
        except OSError:  # absent, or a zip file: nothing hidden by permissions
            continue
    return out


def _spec(path: pathlib.Path, site: SiteSpec, every_chunk: bool = True) -> dict[str, Any]:
    # Every chunk is written, zeros included (zarr's default skips a chunk equal to
    # the fill value), so that reading can treat a missing chunk as the damage it is
    # rather than as zeros. `every_chunk=False` reads a store written before that.
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path / site.key)},
        "store_data_equal_to_fill_value": True,
        "fill_missing_data_reads": not every_chunk,
    }


# TensorStore reports a failure as a ValueError whose message starts with its status
# code, and the OS error under it (if any) as `[os_error_code='28']`.
_STATUS = re.compile(r"^[A-Z_]+: ")
_OS_ERROR = re.compile(r"os_error_code='(\d+)'")


@contextlib.contextmanager
def failures(path: pathlib.Path, doing: str, site: str | None = None) -> Iterator[None]:
    """Turns an OS or TensorStore failure inside into a harvest error naming the
    store, the site and what was being done; every other exception passes."""
    try:
        yield
    except (OSError, ValueError) as error:
        if not isinstance(error, OSError) and not _STATUS.match(str(error)):
            raise
        raise translated(error, path, doing, site) from error


def _io_failed(path: Any, doing: str, site: str | None, code: int | None) -> OSError:
    where = (
        f"site {site!r} of the store at {str(path)!r}" if site else f"the store at {str(path)!r}"
    )
    reason = os.strerror(code) if code else "an I/O error"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        advice = (
            "Free space (or record to another disk); calling record again with the same "
            "arguments resumes from the batches already written."
        )
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        advice = "Use a path you can write to (or make this one writable)."
    else:
        advice = "Check the file system at that path, then try again."
    message = f"harvest.store: {doing} {where} failed: {reason}. {advice}"
    return OSError(code, message) if code else OSError(message)


def _file_missing(path: Any, doing: str, site: str | None) -> FileNotFoundError:
    where = (
        f"site {site!r} of the store at {str(path)!r}" if site else f"the store at {str(path)!r}"
    )
    return FileNotFoundError(
        f"harvest.store: {doing} {where}: a file of it is missing (deleted, or not copied "
        "with the rest); its rows are not read as zeros. The store is damaged: copy it again "
        "whole, or record it afresh with record(..., overwrite=True)."
    )


def translated(error: Exception, path: pathlib.Path, doing: str, site: str | None) -> OSError:
    """The harvest error for an OS or TensorStore `error`."""
    text = str(error)
    if isinstance(error, OSError):
        code = error.errno
    else:
        found = _OS_ERROR.search(text)
        code = int(found.group(1)) if found else None
    missing = code == errno.ENOENT or (code is None and text.startswith("NOT_FOUND"))
    if missing:
        return _file_missing(path, doing, site)
    return _io_failed(path, doing, site, code)


def create(
    path: pathlib.Path,
    sites: list[tuple[SiteSpec, tuple[int, ...]]],
    codecs: list[dict[str, Any]] | None,
) -> None:
    """Creates the array of each `(site, chunk shape)` (replacing any there), all at once."""
    futures = [
        tensorstore().open({**_create_spec(site, chunk, codecs), **_spec(path, site)})
        for site, chunk in sites
    ]
    for future in futures:
        future.result()


def check_creatable(
    sites: list[tuple[str, SiteSpec, tuple[int, ...]]], codecs: list[dict[str, Any]] | None
) -> None:
    """Creates each `(name, site, chunk shape)`'s array in memory, before anything is
    written to disk: a dtype zarr cannot hold or a bad `codecs` fails here."""
    ts = tensorstore()
    for name, site, chunk in sites:
        spec = {**_create_spec(site, chunk, codecs), "kvstore": {"driver": "memory"}}
        try:
            ts.open(spec).result()
        except ValueError as error:
            raise ValueError(
                f"record: site {name!r} ({site.dtype}) cannot be stored as a zarr v3 array"
                + (f" with codecs={codecs!r}" if codecs is not None else "")
                + f" ({str(error).split(' [')[0]}). Cast it with `dtype=` (e.g. dtype='float32')"
                + (" or fix `codecs`" if codecs is not None else "")
                + ", or leave the site out with `names=`. Nothing was written."
            ) from None


def _create_spec(
    site: SiteSpec, chunk: tuple[int, ...], codecs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "shape": [CAPACITY, *site.shape],
        "data_type": site.dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        # Chunk files side by side (`c.<row>.0`), not nested (`c/<row>/0`): a new
        # directory per chunk cost 3/4 of the chunk's copy into the page cache
        # (profiled on ext4).
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
    }
    if codecs is not None:
        metadata["codecs"] = codecs
    return {"driver": "zarr3", "metadata": metadata, "create": True, "delete_existing": True}


def exists(path: pathlib.Path, site: SiteSpec) -> bool:
    return (path / site.key / "zarr.json").is_file()


# Reading maps each chunk file into memory rather than `read()`ing it into a
# buffer first: one copy fewer (measured: `batches` 1.4x faster from the page
# cache). A chunk is always replaced by a rename, never rewritten in place, so a
# mapping never sees a chunk change under it; the arrays read are copies.
_READING = {"file_io_mode": {"mode": "memmap"}}


def open_arrays(
    path: pathlib.Path,
    sites: list[SiteSpec],
    rows: int | None = None,
    reading: bool = False,
    every_chunk: bool = True,
) -> list[Any]:
    """The array of each site, its row axis cut to `rows` (None: as stored), opened at once.

    `reading`: only read through them, with chunk files mapped into memory.
    `every_chunk`: the store holds every chunk of its rows (a missing one is an error).
    """
    context = {"context": _READING} if reading else {}
    futures = [
        tensorstore().open({**_spec(path, site, every_chunk), **context, "open": True})
        for site in sites
    ]
    arrays = [future.result() for future in futures]
    return arrays if rows is None else [array[:rows] for array in arrays]


def resize(path: pathlib.Path, sites: list[SiteSpec], rows: int) -> None:
    """Sets each site's row axis to `rows`, all at once; only metadata changes (no chunk)."""
    futures = [
        array.resize(exclusive_max=[rows, *([None] * len(site.shape))], resize_metadata_only=True)
        for site, array in zip(sites, open_arrays(path, sites))
    ]
    for future in futures:
        future.result()
