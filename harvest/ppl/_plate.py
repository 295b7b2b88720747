"""`plate`: independent copies of a block of a program, by `vmap` over split keys."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, overload

import jax

from .._typing import P, R
from . import _errors
from ._old_spellings import model_was_f


@overload
def plate(
    model: Callable[Concatenate[Any, P], R], *, name: str, size: int
) -> Callable[Concatenate[Any, P], R]: ...
@overload
def plate(
    model: None = None, *, name: str, size: int
) -> Callable[[Callable[Concatenate[Any, P], R]], Callable[Concatenate[Any, P], R]]: ...
@model_was_f
def plate(model: Callable[..., Any] | None = None, *, name: str, size: int) -> Callable[..., Any]:
    """Draws `size` independent copies of the program `model(key, *args)`.

    The key is split into `size` keys and `model` is mapped over them with
    `jax.vmap(axis_name=name)`, so collectives over `name` work inside. Other
    arguments are shared by every copy. Random variables keep their names
    and gain a leading axis of length `size`: `joint_sample` returns them
    stacked, values for `intervene`, `conditional` and `joint_log_prob` are
    given stacked, and the log density is the sum over the copies (they are
    independent). Use it as `plate(model, name=..., size=...)` or as a decorator
    `@plate(name=..., size=...)`; wrap it in `nest` to scope the names.

    Args:
        model: the program ``model(key, *args)`` to copy; None to use ``plate`` as a
            decorator.
        name: the plate's axis name, for collectives inside ``model``.
        size: how many independent copies to draw (a positive int).

    Returns:
        The plated program ``(key, *args) -> stacked outputs``, or (without ``model``) a
        decorator making one.

    Raises:
        TypeError: if ``name`` is not a non-empty string or ``size`` is not a positive int.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> @ppl.plate(name="data", size=3)
        ... def observations(key, mu):
        ...     return ppl.random_variable(tfd.Normal(mu, 1.0), name="y")(key)
        >>> ppl.joint_sample(observations)(jax.random.key(0), 0.0)["y"].shape
        (3,)
        >>> ppl.joint_log_prob(observations)({"y": jax.numpy.zeros(3)}, 0.0)
        Array(-2.7568154, dtype=float32)
    """
    if not isinstance(name, str) or not name:
        raise _errors.bad_name("plate", name)
    if not isinstance(size, int) or size < 1:
        raise TypeError(f"plate(name={name!r}) needs `size` to be a positive int, got {size!r}.")
    if model is None:
        return functools.partial(plate, name=name, size=size)

    @functools.wraps(model)
    def plated(key: Any, *args: Any, **kwargs: Any) -> Any:
        keys = jax.random.split(key, size)
        return jax.vmap(lambda k: model(k, *args, **kwargs), axis_name=name)(keys)

    return plated
