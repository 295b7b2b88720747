"""`sow` and `sow_cond`: the calls that tag a value inside any JAX function."""

from __future__ import annotations

import numbers
from collections.abc import Hashable
from typing import Any

import jax

from .. import _errors
from .._typing import SowMode, T
from ._leaves import is_array
from ._modes import COND_CLOBBER, PUBLIC_MODES
from ._primitive import sow_p

DEFAULT_TAG = "intermediates"


def _check_name(name: object, tag: object) -> None:
    for what, value in (("name", name), ("tag", tag)):
        if not isinstance(value, str) or not value:
            raise _errors.bad_sow_name(what, value)


def non_array(value: Any) -> tuple[str, Any] | None:
    """(where in `value`, leaf) for its first leaf that is not an array, or None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if not (is_array(leaf) or isinstance(leaf, numbers.Number)):
            return jax.tree_util.keystr(path), leaf
    return None


def bind_sow(value: T, *extra: Any, name: str, tag: Hashable, mode: str) -> T:
    """Binds `sow_p` on the leaves of `value` (then `extra` operands: a mode's
    predicate) and returns `value` as the sow returns it."""
    bad = non_array(value)
    if bad is not None:
        where, leaf = bad
        raise TypeError(
            f"sow(name={name!r}, tag={tag!r}): {where or 'the value'} is a {type(leaf).__name__}, "
            "not an array. Sow only arrays (or pytrees of arrays); keep static "
            "data out of the sown value."
        )
    leaves, tree = jax.tree_util.tree_flatten(value)
    out = sow_p.bind(*leaves, *extra, tag=tag, name=name, scope=(), mode=mode, tree=tree)
    sown: T = jax.tree_util.tree_unflatten(tree, out)
    return sown


def sow(value: T, *, name: str, tag: str = DEFAULT_TAG, mode: SowMode = "collect") -> T:
    """Tags ``value`` as ``name`` under ``tag`` and returns it unchanged.

    Outside a harvest, ``sow`` is the identity (it lowers to nothing under ``jit``).
    Inside ``reap``, ``plant`` or ``harvest`` of the same ``tag``, the value is read
    out or replaced.

    Args:
        value: the value to tag: an array or any pytree of arrays.
        name: the site's name, the key under which ``reap`` returns the value and
            ``plant`` looks up a replacement (inside ``nest``, relative to its scope).
        tag: the namespace; only a harvest of the same tag sees this site.
        mode: how several occurrences of ``name`` accumulate: ``"collect"`` (a
            tuple of every occurrence), ``"strict"`` (at most one), ``"append"``
            (stacked on a new leading axis) or ``"clobber"`` (the last wins).

    Returns:
        ``value`` itself, or its planted replacement inside a ``plant`` of ``tag``.

    Raises:
        ValueError: if ``mode`` is not one of the four (a ``strict`` name sown
            twice raises when harvested).
        TypeError: if ``name`` or ``tag`` is not a non-empty string, or ``value``
            holds a leaf that is not an array.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import sow, reap
        >>> def f(x):
        ...     y = sow(x * 2.0, name="double")
        ...     return y + 1.0
        >>> f(1.0)
        3.0
        >>> reap(f)(1.0)["double"]
        (Array(2., dtype=float32, weak_type=True),)
    """
    _check_name(name, tag)
    if mode not in PUBLIC_MODES:
        raise ValueError(
            f"sow(name={name!r}, tag={tag!r}): unknown mode {mode!r}. "
            f"Use one of {', '.join(map(repr, PUBLIC_MODES))}, or sow_cond for a "
            "conditional clobber."
        )
    return bind_sow(value, name=name, tag=tag, mode=mode)


def sow_cond(value: T, pred: Any, *, name: str, tag: str = DEFAULT_TAG) -> T:
    """Sows ``value`` only where the scalar boolean ``pred`` is true.

    The reaped value is the last occurrence whose ``pred`` held (zeros if none
    did), which is how to keep one chosen iteration of a loop. A planted value
    replaces ``value`` where ``pred`` holds and leaves it alone elsewhere.

    Args:
        value: the value to tag: an array or any pytree of arrays.
        pred: a scalar boolean (a traced ``jnp.bool_`` is fine) saying whether this
            occurrence counts.
        name: the site's name, as for ``sow``.
        tag: the namespace; only a harvest of the same tag sees this site.

    Returns:
        ``value``, or its planted replacement where ``pred`` holds.

    Raises:
        TypeError: if ``pred`` is not a scalar boolean, ``name`` or ``tag`` is
            not a non-empty string, or ``value`` holds a leaf that is not an array.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sow_cond, reap
        >>> def f(xs):
        ...     def body(c, x):
        ...         sow_cond(x, x > 2.0, name="last_big")
        ...         return c, None
        ...     return jax.lax.scan(body, 0.0, xs)[0]
        >>> reap(f)(jnp.array([1.0, 3.0, 5.0, 2.0]))["last_big"]
        Array(5., dtype=float32)
    """
    _check_name(name, tag)
    pred = jax.numpy.asarray(pred)
    if pred.shape != () or pred.dtype != bool:
        raise TypeError(
            f"sow_cond(name={name!r}, tag={tag!r}) needs a scalar boolean `pred`, got "
            f"{pred.dtype}{list(pred.shape)}. Reduce it first, e.g. with jnp.any."
        )
    return bind_sow(value, pred, name=name, tag=tag, mode=COND_CLOBBER.name)
