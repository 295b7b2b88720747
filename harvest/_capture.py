"""`capture`: the functional-sow proposal's transform, over the core."""

from __future__ import annotations

from collections.abc import Callable

from ._calling._renamed import renamed
from ._calling._transforms import call_and_reap
from ._typing import NameSelect, P, R, Reaped
from ._walk._sow import DEFAULT_TAG


@renamed(allowlist="names", blocklist="exclude")
def capture(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
) -> Callable[P, tuple[R, Reaped]]:
    """Returns a function that runs ``f`` and also returns what it sowed.

    ``capture(f)(*args)`` gives ``(out, collected)``, where ``collected`` maps each
    name to a tuple of its sown values in call order (for the default
    ``"collect"`` mode), nested by ``nest`` scopes. It is ``call_and_reap`` with the
    default tag, as proposed for Flax's functional ``sow``.

    Args:
        f: the function to run, as for ``reap``; a differentiated function
            (``jax.grad(loss)``) gives the cotangents its ``perturb`` sites sow.
        tag: which sows to collect; sows of other tags pass through untouched.
        names: if given, collect only these sites (exact names, glob patterns
            or predicates on names).
        exclude: sites never to collect, in the same forms as ``names``.

    Returns:
        A function taking ``f``'s arguments and returning ``(output, collected)``.

    Raises:
        ValueError: when the returned function is called, as for ``reap``.
        TypeError: if ``f`` is not callable, or ``tag`` is not a non-empty string.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import sow, capture
        >>> def f(x):
        ...     y = sow(x + 1.0, name="features")
        ...     sow(y * 2.0, name="features")
        ...     return y.sum()
        >>> out, collected = capture(f)(jnp.ones(2))
        >>> out, collected["features"]
        (Array(4., dtype=float32), (Array([2., 2.], dtype=float32), Array([4., 4.], dtype=float32)))
    """
    return call_and_reap(f, tag=tag, names=names, exclude=exclude)
