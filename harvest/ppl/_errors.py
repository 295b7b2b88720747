"""The messages several modules of harvest.ppl raise; a message raised in one place
sits beside its check."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def bad_name(caller: str, name: Any) -> TypeError:
    return TypeError(f"{caller} needs `name` to be a non-empty string, got {name!r}.")


def names_not_strings(caller: str, what: str, names: Any) -> TypeError:
    return TypeError(f"{caller} takes {what} as strings, got {names!r}.")


def drawn_without_density(caller: str, names: Iterable[str]) -> ValueError:
    names = sorted(names)
    if len(names) == 1:
        return ValueError(
            f"{caller}: the random variable {names[0]!r} is drawn by a plain sampling function, "
            "which has no density. Draw it from a TFP distribution, or fix it with "
            "intervene/conditional."
        )
    return ValueError(
        f"{caller}: the random variables {', '.join(names)} were drawn by plain sampling "
        "functions, which have no density. Draw them from a TFP distribution, or fix them "
        "with intervene/conditional."
    )


def enumeration_in_scan(names: Iterable[str], why: str) -> ValueError:
    return ValueError(
        f"cannot sum out {', '.join(names)}, enumerated inside a scan: {why}. A scan sums "
        "out one enumerated draw per step (mode='append', a scalar Bernoulli or Categorical), "
        "its state carried from step to step; marginalise anything else by hand."
    )
