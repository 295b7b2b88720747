"""The messages raised from more than one layer, and the helpers they share.

A message raised in one place sits beside its check; one that several modules of
a layer raise, in that layer's `_errors.py`. Each function returns the exception
for its caller to raise; each message says what was wrong and what to do instead,
and names a site as `Site` prints itself (its tag, name and the user's file:line).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def bad_sow_name(what: str, value: Any) -> TypeError:
    return TypeError(f"sow needs `{what}` to be a non-empty string, got {value!r}.")


def needs_callable(call: str, value: Any, argument: str = "f") -> TypeError:
    return TypeError(f"{call} needs a callable {argument}, got {type(value).__name__}.")


def needs_extra(what: str, module: str, extra: str) -> ImportError:
    return ImportError(
        f"{what} needs {module}, which is not installed. Install it with "
        f"`pip install 'jax-harvest[{extra}]'` (from a checkout: `pip install -e '.[{extra}]'`)."
    )


def indexed_plant_of_collect_in_loop(site: Any) -> ValueError:
    return ValueError(
        f"The planted callable for the sow site {site} takes an occurrence index, but "
        "the site has mode 'collect' inside a loop, where reap stacks each sow's "
        "iterations into one entry, so occurrences have no single index. Use mode "
        "'append' (one row per iteration), or a callable of the old value alone."
    )


def listed(names: Iterable[str], near: str) -> str:
    """`names` for a message: all of them, or, when there are many (a large model's
    sites), the count and the three closest to the misspelt `near`."""
    names = list(names)
    if len(names) <= 12:
        return ", ".join(repr(n) for n in names) or "none"
    close = difflib.get_close_matches(near, names, n=3, cutoff=0.5)
    shown = ", ".join(repr(n) for n in close or names[:3])
    which = "the closest" if close else "the first"
    return f"{len(names)} names, {which} {shown} (`sites(f)(*args)` lists them all)"


class InterventionMisfit(ValueError):
    """An intervention's array does not fit the sown value it was given; the
    walk, which knows the site, re-raises it naming that site."""


SITE = "<site>"  # in an InterventionMisfit: where the site's name goes once it is known
