"""The manifest: what a store holds, as JSON in the root group's `zarr.json`.

The store's root directory is a zarr v3 group whose attributes carry, under
`"harvest"`, everything needed to check a later `record` against it and to
read it back: the tag, the row layout, each site's per-row shape and dtype and
where its array lives, the number of batches written, and the harvest and JAX
versions that wrote it. Plain JSON: opening a store runs nobody's code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import urllib.parse
from typing import Any

FORMAT = 1  # bumped when the layout changes incompatibly
MANIFEST = "zarr.json"


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """One recorded site: its per-row shape and dtype, and its array's directory."""

    shape: tuple[int, ...]
    dtype: str
    key: str

    @staticmethod
    def key_for(name: str) -> str:
        """The directory of site `name`'s array: the name itself where a file name can
        hold it, percent-encoded (reversibly: `urllib.parse.unquote`) elsewhere.

        Names of the store's own files never come out: a leading dot (`.progress`,
        `.`, `..`, temporary files) and the manifest's name `zarr.json` are encoded too.
        """
        key = urllib.parse.quote(name, safe="._-")
        if key.startswith("."):
            key = "%2E" + key[1:]
        return "zarr%2Ejson" if key == MANIFEST else key


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a store holds. `batches` counts the batches a finished run wrote."""

    tag: str
    rows: str  # "examples" or "tokens"
    rows_per_batch: int
    sites: dict[str, SiteSpec]
    function: str
    versions: dict[str, str]
    processes: int = 1  # how many processes wrote it (resume reads their progress)
    batches: int = 0
    # Every chunk of its rows is on disk, zeros included, so a missing one is damage;
    # False for a store written before harvest wrote them all.
    every_chunk: bool = False

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["format"] = FORMAT
        out["sites"] = {
            name: {"shape": list(s.shape), "dtype": s.dtype, "key": s.key}
            for name, s in self.sites.items()
        }
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        sites = {
            name: SiteSpec(tuple(s["shape"]), s["dtype"], s["key"])
            for name, s in data["sites"].items()
        }
        fields = {f.name for f in dataclasses.fields(cls)} - {"sites"}
        return cls(sites=sites, **{k: data[k] for k in fields if k in data})

    def differences(self, other: Manifest) -> list[str]:
        """How `other` (a new run's) disagrees with this (the stored) manifest."""
        out = [
            f"{what} {mine!r} stored, {theirs!r} now"
            for what, mine, theirs in [
                ("tag", self.tag, other.tag),
                ("rows", self.rows, other.rows),
                ("rows per batch", self.rows_per_batch, other.rows_per_batch),
            ]
            if mine != theirs
        ]
        for name in sorted(self.sites.keys() - other.sites.keys()):
            out.append(f"site {name!r} stored, not recorded now")
        for name in sorted(other.sites.keys() - self.sites.keys()):
            out.append(f"site {name!r} recorded now, not stored")
        for name in sorted(self.sites.keys() & other.sites.keys()):
            mine, theirs = self.sites[name], other.sites[name]
            if (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
                out.append(
                    f"site {name!r} has rows {list(mine.shape)} {mine.dtype} stored, "
                    f"{list(theirs.shape)} {theirs.dtype} now"
                )
        return out


def _manifest_damaged(path: Any, reason: str) -> ValueError:
    return ValueError(
        f"harvest.store: the manifest of the store at {str(path)!r} (its zarr.json) is "
        f"damaged: {reason}. Copy the store again whole, or record it afresh."
    )


def read(path: pathlib.Path) -> Manifest | None:
    """The manifest of the store at `path`, or None if there is none."""
    try:
        group = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        raise _manifest_damaged(path, f"not JSON ({error})") from None
    data = group.get("attributes", {}).get("harvest") if isinstance(group, dict) else None
    if data is None:
        return None
    try:
        manifest = Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise _manifest_damaged(path, f"{type(error).__name__}: {error}") from None
    for name, site in manifest.sites.items():
        # A site's array lives in a directory of the store's own, never elsewhere.
        if "/" in site.key or site.key.startswith(".") or site.key == MANIFEST:
            raise _manifest_damaged(path, f"site {name!r} has key {site.key!r}")
    return manifest


def write(path: pathlib.Path, manifest: Manifest) -> None:
    """Writes the manifest atomically: a reader sees the old one or the new one."""
    group = {"zarr_format": 3, "node_type": "group", "attributes": {"harvest": manifest.to_json()}}
    replace_text(path / MANIFEST, json.dumps(group, indent=1))


def replace_text(target: pathlib.Path, text: str) -> None:
    """Writes `text` to `target` through a temporary file and a rename (atomic on POSIX)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)


def check_path(path: pathlib.Path) -> Manifest | None:
    """The manifest at `path` if it holds a store; None if it is new or empty; else an error."""
    if path.is_file():
        raise ValueError(
            f"record(..., path={str(path)!r}): that path is a file. A store is a directory: "
            "pass a new or empty directory, or an existing store's."
        )
    manifest = read(path)
    # Hidden files are a killed run's temporary manifest: the directory is still new.
    if manifest is None and path.is_dir() and any(p.name[:1] != "." for p in path.iterdir()):
        raise ValueError(
            f"{str(path)!r} is not empty and holds no harvest store (no zarr.json with a "
            "'harvest' manifest). Pick another directory; nothing there was changed."
        )
    return manifest
