"""The messages several modules of harvest.store raise; a message raised in one place
sits beside its check."""

from __future__ import annotations

from typing import Any


def site_not_rows(name: str, shape: Any, batch: int, rows: str, sown: Any = None) -> ValueError:
    want = "[examples, ...]" if rows == "examples" else "[examples, positions, ...]"
    stacked = (
        f" (each occurrence {tuple(sown)}, stacked by a loop)"
        if sown is not None and tuple(sown) != tuple(shape)
        else ""
    )
    return ValueError(
        f"record: site {name!r} has shape {tuple(shape)}{stacked}, but rows={rows!r} needs {want} "
        f"with {batch} examples first, as in the batch (taken from the sown value's axis "
        "`example_axis`, 0 unless given; a loop's occurrence axes do not count). Pass "
        "example_axis= (an int, or a dict by site), leave the site out with `names=`"
        + (", or use rows='examples'." if rows == "tokens" else ".")
    )


def bad_option(what: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"harvest.store: `{what}` must be {expected}, got {value!r}.")
