"""oryx's harvest API (`oryx.core.interpreters.harvest`) on harvest's core.

Replace `from oryx.core import harvest` with
`from harvest.compat import oryx as harvest` and nothing else changes: the
names, argument names, defaults and return shapes are oryx's. The differences
that remain are listed in the migration guide (docs/guides/migrating_from_oryx.md).

Example:
    >>> from harvest.compat import oryx as harvest
    >>> def f(x):
    ...     y = harvest.sow(x + 1.0, tag="t", name="y")
    ...     return y * 2.0
    >>> harvest.reap(f, tag="t")(1.0)
    {'y': Array(2., dtype=float32, weak_type=True)}
    >>> harvest.plant(f, tag="t")({"y": 10.0}, 1.0)
    Array(20., dtype=float32, weak_type=True)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Concatenate

import jax

from ... import _errors
from ..._calling._transforms import nest as nest, transform
from ..._typing import P, Plants, R, Reaped, T
from ..._walk._interpreter import NameFilter, Policy
from ..._walk._modes import COND_CLOBBER, ORYX_MODES
from ..._walk._primitive import sow_p as sow_p
from ..._walk._sow import bind_sow

__all__ = ["sow", "sow_cond", "reap", "plant", "harvest", "call_and_reap", "nest", "sow_p"]
# oryx.core.ppl lives at harvest.compat.oryx.ppl (imported on demand: it needs TFP).


def sow(value: T, *, tag: Hashable, name: str, mode: str = "strict", key: Any = None) -> T:
    """Tags ``value`` with ``name`` under ``tag`` (oryx's signature).

    Args:
        value: the value to tag: an array or a pytree of arrays.
        tag: the namespace (any hashable, as in oryx).
        name: the site's name.
        mode: oryx's mode: ``"strict"`` (sown at most once), ``"clobber"`` (the
            last occurrence wins) or ``"append"`` (stacked, in a loop).
        key: accepted for oryx's signature and unused (a jaxpr keeps sows in
            program order without it).

    Returns:
        ``value``, or its planted replacement.

    Raises:
        ValueError: for a mode oryx does not have, or ``"cond_clobber"`` (use
            ``sow_cond``).
        TypeError: if ``name`` is not a non-empty string.

    Example:
        >>> from harvest.compat import oryx as harvest
        >>> harvest.reap(lambda x: harvest.sow(x, tag="t", name="x"), tag="t")(3.0)
        {'x': Array(3., dtype=float32, weak_type=True)}
    """
    del key  # oryx ties `key` in for ordering; a jaxpr keeps sows in program order anyway
    _check_name(name)
    if mode == COND_CLOBBER.name:
        raise ValueError("For 'cond_clobber' mode, use `sow_cond`.")
    if mode not in ORYX_MODES:
        raise ValueError(
            f"Unknown sow mode {mode!r}: oryx's modes are 'strict', 'clobber' and 'append'."
        )
    return bind_sow(value, name=name, tag=tag, mode=ORYX_MODES[mode].name)


def _check_name(name: Any) -> None:
    """oryx names its sites by strings; any other name would fail deep inside a reap."""
    if not isinstance(name, str) or not name:
        raise _errors.bad_sow_name("name", name)


def sow_cond(
    value: T, pred: Any, *, tag: Hashable, name: str, mode: str = "cond_clobber", key: Any = None
) -> T:
    """Tags ``value`` only where ``pred`` is true; reaped as zeros if it never was.

    Args:
        value: the value to tag: an array or a pytree of arrays.
        pred: a scalar boolean saying whether this occurrence counts.
        tag: the namespace (any hashable, as in oryx).
        name: the site's name.
        mode: must be ``"cond_clobber"`` (oryx's only mode for ``sow_cond``).
        key: accepted for oryx's signature and unused.

    Returns:
        ``value``, or its planted replacement where ``pred`` holds.

    Raises:
        ValueError: if ``mode`` is not ``"cond_clobber"``.
        TypeError: if ``name`` is not a non-empty string.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest.compat import oryx as harvest
        >>> f = lambda x: harvest.sow_cond(x, x > 0, tag="t", name="pos")
        >>> harvest.reap(f, tag="t")(-2.0)
        {'pos': Array(0., dtype=float32)}
    """
    del key
    _check_name(name)
    if mode != COND_CLOBBER.name:
        raise ValueError("`sow_cond` only supports 'cond_clobber' mode.")
    return bind_sow(value, jax.numpy.asarray(pred), name=name, tag=tag, mode=COND_CLOBBER.name)


# oryx's wording for the errors its own tests match, in front of the core's
# message (which says what to do instead): (the core's message, oryx's).
_ORYX_WORDING = (
    (
        re.compile(
            r"The sow site tag=.*?, name='([^']*)' \(sown at .*?\) has mode '\w+' but is sown more than once"
        ),
        "Variable has already been reaped: {}",
    ),
    (
        re.compile(
            r"The sow site tag=.*?, name='([^']*)' \(sown at .*?\) has mode 'strict' but sits inside a scan"
        ),
        "Cannot use strict mode for '{}' inside `scan`.",
    ),
    (
        re.compile(
            r"The sow site tag=.*?, name='([^']*)' \(sown at .*?\) has mode '\w+' "
            r"(?:inside a while_loop|but sits inside a while_loop)"
        ),
        "Must use clobber or cond_clobber mode for '{}' inside of a `while_loop`.",
    ),
)


def _in_oryx_words(error: ValueError) -> ValueError | None:
    for pattern, wording in _ORYX_WORDING:
        found = pattern.search(str(error))
        if found:
            return ValueError(f"{wording.format(found.group(1))} ({error})")
    return None


def _policy(
    tag: Hashable, allowlist: Iterable[str] | None, blocklist: Iterable[str], exclusive: bool
) -> Policy:
    # As in oryx, a sow of `tag` that the allowlist/blocklist filters out is
    # removed: enclosing transformations of `tag` do not see it either.
    select = NameFilter.make(allowlist, tuple(blocklist), spelled=("allowlist", "blocklist"))
    return Policy(tag, select, exclusive=exclusive, strict_names=False, drop_filtered=True)


def call_and_reap(
    f: Callable[P, R],
    *,
    tag: Hashable,
    allowlist: Iterable[str] | None = None,
    blocklist: Iterable[str] = frozenset(),
    exclusive: bool = False,
) -> Callable[P, tuple[R, Reaped]]:
    """Returns a function giving ``(f's output, {name: sown value})``.

    Args:
        f: the function to run.
        tag: the tag whose sows are harvested (any hashable, as in oryx).
        allowlist: if given, only these names are harvested (exact names).
        blocklist: names never harvested. As in oryx, a sow of ``tag`` that
            ``allowlist``/``blocklist`` filter out is removed, so enclosing
            transformations of ``tag`` do not see it either.
        exclusive: drop sows of other tags instead of passing them through.

    Returns:
        A function taking ``f``'s arguments and returning ``(output, reaped)``.

    Example:
        >>> from harvest.compat import oryx as harvest
        >>> f = lambda x: harvest.sow(x * 2.0, tag="t", name="y") + 1.0
        >>> harvest.call_and_reap(f, tag="t")(1.0)
        (Array(3., dtype=float32, weak_type=True), {'y': Array(2., dtype=float32, weak_type=True)})
    """
    policy = _policy(tag, allowlist, blocklist, exclusive)
    return transform(
        f, "call_and_reap", policy, takes_plants=False, gives="both", reword=_in_oryx_words
    )


def reap(
    f: Callable[P, Any],
    *,
    tag: Hashable,
    allowlist: Iterable[str] | None = None,
    blocklist: Iterable[str] = frozenset(),
    exclusive: bool = False,
) -> Callable[P, Reaped]:
    """Returns a function giving ``{name: sown value}`` for the sows of ``tag`` in ``f``.

    Args:
        f: the function to run.
        tag: the tag whose sows are harvested (any hashable, as in oryx).
        allowlist: if given, only these names are harvested (exact names).
        blocklist: names never harvested. As in oryx, a sow of ``tag`` that
            ``allowlist``/``blocklist`` filter out is removed, so enclosing
            transformations of ``tag`` do not see it either.
        exclusive: drop sows of other tags instead of passing them through.

    Returns:
        A function taking ``f``'s arguments and returning the reaped dict.

    Example:
        >>> from harvest.compat import oryx as harvest
        >>> harvest.reap(lambda x: harvest.sow(x, tag="t", name="x") * 2.0, tag="t")(1.0)
        {'x': Array(1., dtype=float32, weak_type=True)}
    """
    policy = _policy(tag, allowlist, blocklist, exclusive)
    return transform(f, "reap", policy, takes_plants=False, gives="reaps", reword=_in_oryx_words)


def harvest(
    f: Callable[P, R],
    *,
    tag: Hashable,
    allowlist: Iterable[str] | None = None,
    blocklist: Iterable[str] = frozenset(),
    exclusive: bool = False,
) -> Callable[Concatenate[Plants, P], tuple[R, Reaped]]:
    """Returns ``g(plants, *args) -> (out, reaps)``: plant some sows, reap the others.

    Args:
        f: the function to run.
        tag: the tag whose sows are harvested (any hashable, as in oryx).
        allowlist: if given, only these names are harvested (exact names).
        blocklist: names never harvested. As in oryx, a sow of ``tag`` that
            ``allowlist``/``blocklist`` filter out is removed, so enclosing
            transformations of ``tag`` do not see it either.
        exclusive: drop sows of other tags instead of passing them through.

    Returns:
        A function taking ``plants`` (``{name: value}``) first, then ``f``'s
        arguments, and returning ``(output, reaps)`` for the names not planted.

    Example:
        >>> from harvest.compat import oryx as harvest
        >>> def f(x):
        ...     a = harvest.sow(x, tag="t", name="a")
        ...     return harvest.sow(a + 1.0, tag="t", name="b")
        >>> harvest.harvest(f, tag="t")({"a": 5.0}, 1.0)
        (Array(6., dtype=float32, weak_type=True), {'b': Array(6., dtype=float32, weak_type=True)})
    """
    policy = _policy(tag, allowlist, blocklist, exclusive)
    return transform(f, "harvest", policy, takes_plants=True, gives="both", reword=_in_oryx_words)


def plant(
    f: Callable[P, R],
    *,
    tag: Hashable,
    allowlist: Iterable[str] | None = None,
    blocklist: Iterable[str] = frozenset(),
    exclusive: bool = False,
) -> Callable[Concatenate[Plants, P], R]:
    """Returns ``g(plants, *args)``: ``f`` with the named sows of ``tag`` replaced.

    Args:
        f: the function to run.
        tag: the tag whose sows are harvested (any hashable, as in oryx).
        allowlist: if given, only these names are harvested (exact names).
        blocklist: names never harvested. As in oryx, a sow of ``tag`` that
            ``allowlist``/``blocklist`` filter out is removed, so enclosing
            transformations of ``tag`` do not see it either.
        exclusive: drop sows of other tags instead of passing them through.

    Returns:
        A function taking ``plants`` (``{name: value}``) first, then ``f``'s
        arguments, and returning ``f``'s output with the plants in place.

    Example:
        >>> from harvest.compat import oryx as harvest
        >>> f = lambda x: harvest.sow(x, tag="t", name="x") * 2.0
        >>> harvest.plant(f, tag="t")({"x": 4.0}, 1.0)
        Array(8., dtype=float32, weak_type=True)
    """
    policy = _policy(tag, allowlist, blocklist, exclusive)
    return transform(f, "plant", policy, takes_plants=True, gives="out", reword=_in_oryx_words)
