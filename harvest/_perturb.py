"""`perturb`: sow the gradient that flows back into a value."""

from __future__ import annotations

import functools
from typing import Any, cast

import jax

from ._typing import T
from ._walk._sow import DEFAULT_TAG, _check_name, sow


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _perturb(value: Any, name: str, tag: str) -> Any:
    return value


def _perturb_fwd(value: Any, name: str, tag: str) -> tuple[Any, None]:
    return value, None


def _perturb_bwd(name: str, tag: str, _: None, cotangent: Any) -> tuple[Any]:
    # The backward rule is traced into the gradient's jaxpr, so this sow is an
    # ordinary site there: `reap(jax.grad(f))` finds it.
    return (sow(cotangent, name=name, tag=tag),)


_perturb.defvjp(_perturb_fwd, _perturb_bwd)


def perturb(value: T, *, name: str, tag: str = DEFAULT_TAG) -> T:
    """Identity on ``value``; under differentiation, sows the cotangent reaching it.

    Reap a differentiated function (``reap(jax.grad(loss))``) to read the gradient
    with respect to this intermediate value. The gradient itself is unchanged.
    Inside ``scan``, one cotangent per iteration is sown, stacked and aligned with
    the forward iterations.

    Args:
        value: the intermediate whose cotangent to record: an array or a pytree.
        name: the name under which the cotangent is sown (in ``collect`` mode).
        tag: the namespace of that sow.

    Returns:
        ``value``, unchanged (forward and backward).

    Raises:
        TypeError: if ``name`` or ``tag`` is not a non-empty string.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import perturb, capture
        >>> def loss(x):
        ...     h = perturb(x * 3.0, name="grad_h")
        ...     return jnp.sum(h ** 2)
        >>> grad, collected = capture(jax.grad(loss))(jnp.array([1.0, 2.0]))
        >>> collected["grad_h"][0]  # d loss / d h = 2 h
        Array([ 6., 12.], dtype=float32)
        >>> grad  # d loss / d x = 3 * 2 h, unchanged by perturb
        Array([18., 36.], dtype=float32)
    """
    _check_name(name, tag)
    return cast(T, _perturb(value, name, tag))
