"""`perturb`: sow the gradient that flows back into a value."""

from __future__ import annotations

import functools

import jax

from ._sow import DEFAULT_TAG, _check_name, sow


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _perturb(value, name, tag):
    return value


def _perturb_fwd(value, name, tag):
    return value, None


def _perturb_bwd(name, tag, _, cotangent):
    # The backward rule is traced into the gradient's jaxpr, so this sow is an
    # ordinary site there: `reap(jax.grad(f))` finds it.
    return (sow(cotangent, name=name, tag=tag),)


_perturb.defvjp(_perturb_fwd, _perturb_bwd)


def perturb(value, *, name, tag=DEFAULT_TAG):
    """Identity on `value`; under differentiation, sows the cotangent reaching it.

    Reap a differentiated function (`reap(jax.grad(loss))`) to read the gradient
    with respect to this intermediate value. The gradient itself is unchanged.
    Inside `scan`, one cotangent per iteration is sown, stacked and aligned with
    the forward iterations.

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
    return _perturb(value, name, tag)
