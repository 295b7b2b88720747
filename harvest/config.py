"""harvest's settings, read and set as `jax.config`'s are.

There is one: ``warn_after``, how many times one function's code may be traced
for the same shapes and structure before a ``harvest.RecompileWarning`` says
so (a new Python number or a fresh closure at every call; default 32). The
compiled programs themselves are JAX's, in ``jax.jit``'s cache: JAX bounds it,
and ``harvest.clear_caches()`` clears it.

Example:
    >>> import harvest
    >>> harvest.config.warn_after
    32
    >>> harvest.config.update("warn_after", 100)
    >>> harvest.config.warn_after
    100
    >>> harvest.config.update("warn_after", 32)
"""

from __future__ import annotations

from typing import Any

__all__ = ["update", "warn_after"]

warn_after: int = 32


def update(name: str, value: Any) -> None:
    """Sets one of harvest's settings.

    Args:
        name: The setting: ``"warn_after"``.
        value: Its new value (a positive int).

    Returns:
        None.

    Raises:
        ValueError: ``name`` is not a setting.
        TypeError: ``value`` is not a positive int.

    Example:
        >>> import harvest
        >>> harvest.config.update("warn_after", 32)
    """
    global warn_after
    if name != "warn_after":
        raise ValueError(
            f"harvest.config.update({name!r}, ...): no such setting; there are ['warn_after']."
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(f"harvest.config.update({name!r}, {value!r}): expected a positive int.")
    warn_after = value
