"""`capture`: the functional-sow proposal's transform, over the core."""

from __future__ import annotations

from collections.abc import Callable

from ._sow import DEFAULT_TAG
from ._transforms import call_and_reap
from ._typing import NameSelect, P, R, Reaped


def capture(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    allowlist: NameSelect = None,
    blocklist: NameSelect = None,
) -> Callable[P, tuple[R, Reaped]]:
    """Returns a function that runs `f` and also returns what it sowed.

    `capture(f)(*args)` gives `(out, collected)`, where `collected` maps each
    name to a tuple of its sown values in call order (for the default
    `"collect"` mode), nested by `nest` scopes. It is `call_and_reap` with the
    default tag, as proposed for Flax's functional `sow`.

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
    return call_and_reap(f, tag=tag, allowlist=allowlist, blocklist=blocklist)
