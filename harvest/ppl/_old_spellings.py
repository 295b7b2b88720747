"""harvest.ppl's old spellings, still accepted for one release with a DeprecationWarning.

The program is `model` in every function (it was `f` in some), and the key
comes right after it (`predictive` and `infer_discrete` took the posterior
first). Each old call still works and warns with the call to write instead.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


def model_was_f(fn: F) -> F:
    """`fn(model, ...)` that also takes the program as `f=`, its old keyword, with a warning.

    Only a call with no positional argument and no `model=` is an old one, so a
    keyword `f` beside the program (a random variable `intervene` fixes) is left alone."""

    by_name = inspect.signature(fn).parameters["model"].kind != inspect.Parameter.POSITIONAL_ONLY
    instead = f"pass it first, or as {fn.__name__}(model=...)" if by_name else "pass it first"

    @functools.wraps(fn)
    def renamed(*args: Any, **kwargs: Any) -> Any:
        if args or "f" not in kwargs or "model" in kwargs:
            return fn(*args, **kwargs)
        warnings.warn(
            f"{fn.__name__}(f=...) is deprecated: the program is called `model` in every "
            f"harvest.ppl function; {instead}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return fn(kwargs.pop("f"), **kwargs)

    return cast(F, renamed)


def posterior_first(
    caller: str, key: Any, args: tuple[Any, ...], posterior: Any, posterior_type: type
) -> tuple[Any, tuple[Any, ...], Any]:
    """`(key, args, posterior)` of a call `caller(model, key, *args, posterior=...)`, also
    when made in the old order `caller(model, posterior, key, *args)`, with a warning.
    The old order is told apart by its second argument: a `Posterior` or None, never a key."""
    if not (key is None or isinstance(key, posterior_type)):
        return key, args, posterior
    if posterior is not None or not args:
        raise TypeError(
            f"{caller}(model, key, *args, posterior=...) takes the PRNG key second, got "
            f"{type(key).__name__} there; give the key second and the posterior as posterior=."
        )
    old, key, args = key, args[0], args[1:]
    if old is None:
        was, instead = "None", f"{caller}(model, key, *args, ...) (posterior=None is the default)"
    else:
        was, instead = "posterior", f"{caller}(model, key, *args, posterior=posterior, ...)"
    warnings.warn(
        f"{caller}(model, {was}, key, *args) is deprecated: the key comes right after the "
        f"model. Write {instead}.",
        DeprecationWarning,
        stacklevel=3,
    )
    return key, args, old
