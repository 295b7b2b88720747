"""harvest's settings, read and set as `jax.config`'s are.

``harvest.config.update("check_stale", True)`` (or the environment variable
``HARVEST_CHECK_STALE=1``, read at import) makes each eager call of a
harvested function also trace it afresh and compare that program, bit for
bit, with the compiled one harvest kept; where they differ it raises
``harvest.StaleValueError`` naming the value that changed and where the
function reads it. Like ``jax_check_tracer_leaks``, it is a debugging aid:
each call traces again (the function's Python side effects run twice).

Example:
    >>> import harvest
    >>> harvest.config.check_stale
    False
    >>> harvest.config.update("check_stale", True)
    >>> harvest.config.check_stale
    True
    >>> harvest.config.update("check_stale", False)
"""

from __future__ import annotations

import os
from typing import Any

from . import _errors

_FALSE = frozenset({"", "0", "false", "no", "off"})

check_stale: bool = os.environ.get("HARVEST_CHECK_STALE", "").strip().lower() not in _FALSE


def update(name: str, value: Any) -> None:
    """Sets one of harvest's settings.

    Args:
        name: The setting: ``"check_stale"``.
        value: Its new value (``True`` or ``False``).

    Raises:
        ValueError: ``name`` is not a setting.
        TypeError: ``value`` is not a bool.

    Example:
        >>> import harvest
        >>> harvest.config.update("check_stale", False)
    """
    global check_stale
    if name != "check_stale":
        raise _errors.bad_config_name(name, ["check_stale"])
    if not isinstance(value, bool):
        raise _errors.bad_config_value(name, value)
    check_stale = value
