"""Old spellings of arguments, accepted for one release with a `DeprecationWarning`.

One implementation for every renamed keyword (issue 43: one spelling per
concept): the warning names the new spelling and points at the caller's line,
and passing the old and the new spelling together is a `TypeError`.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, cast

from .._typing import P, R

REMOVED_IN = "0.3"  # the release that drops the old spellings


def warn_renamed(fn_name: str, old: str, new: str, stacklevel: int) -> None:
    """Warns that ``fn_name``'s ``old`` is now spelled ``new``; ``stacklevel`` counts
    from the caller of `warn_renamed` (1: that caller's line)."""
    warnings.warn(
        f"{fn_name}: `{old}` is deprecated and will be removed in harvest {REMOVED_IN}; "
        f"use `{new}` instead.",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def renamed(
    **old_to_new: str | tuple[str, Callable[[Any], bool]],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: the function also takes each old keyword of ``old_to_new`` as
    its new one, with a `DeprecationWarning` pointing at the caller's line. A
    ``(new, when)`` pair renames only a value for which ``when`` is true (an old
    keyword that is also a new one, with another meaning). Renames apply in
    order. It must be the outermost decorator, so that the warning points at
    the caller."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def accepting_old(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                new, when = (new, None) if isinstance(new, str) else new
                if old not in kwargs or (when is not None and not when(kwargs[old])):
                    continue
                if new in kwargs:
                    raise TypeError(
                        f"{fn.__name__}() got both `{old}=` and `{new}=`; `{old}=` is the old "
                        f"spelling of `{new}=`: pass `{new}=` only."
                    )
                # With a `when`, only that value is deprecated: the warning shows it.
                value = "" if when is None else repr(kwargs[old])
                warn_renamed(f"{fn.__name__}()", f"{old}={value}", f"{new}={value}", 2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return accepting_old

    return decorate


def arguments_moved(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn(f, *, options) -> g`` (``g`` called with ``f``'s arguments, as every
    transformation's result is) also called the old way, ``fn(f, *args, **kwargs)``:
    the arguments after ``f``, and the keywords that are none of ``fn``'s options,
    go to ``g`` at once, with a `DeprecationWarning`. It must be the outermost
    decorator, so that the warning points at the caller."""
    options = [
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]

    @functools.wraps(fn)
    def accepting_old(f: Any, *args: Any, **kwargs: Any) -> Any:
        own = {name: kwargs.pop(name) for name in options if name in kwargs}
        g: Any = fn(f, **own)
        if not args and not kwargs:
            return g
        name = fn.__name__
        warn_renamed(f"{name}()", f"{name}(f, *args)", f"{name}(f)(*args)", stacklevel=2)
        return g(*args, **kwargs)

    return cast("Callable[P, R]", accepting_old)  # the signature shown is fn's (the new)
