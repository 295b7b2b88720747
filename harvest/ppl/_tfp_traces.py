"""TFP's computations on one draw, traced once per kind of distribution and reused.

Tracing a probabilistic program is mostly tracing TFP: a log density, or the
map of a draw onto its support and that map's log-Jacobian, runs TFP's Python
machinery (bijector caches, nested-structure checks, shape inference) each
time the program is traced — several milliseconds per draw, where the
operations it emits take microseconds to bind. A density's first compile pays
it once per trace, its gradient again, and every fresh closure of the model
again.

So each of those computations is a `jax.jit` of a module-level function whose
static argument is the distribution's *description*: its type and each
constructor argument (`dist.parameters`) that is not an array, recursively for
a distribution of distributions; the arrays are the jit's arguments, and the
distribution is rebuilt from both inside, as TFP's own `copy()` rebuilds it. A
draw from a distribution of the same description and shapes — in the same
program, its gradient, a fresh closure of the same model, another model —
binds the trace JAX cached instead of running TFP's Python again, exactly as a
`jax.numpy` function decorated with `jit` does. Descriptions hold plain values
only (numbers, strings, dtypes, tuples and lists of them); concrete integer
and bool arrays (a sample shape, a number of steps) are described by value, as
TFP may read them while it builds. A distribution given anything else (a
callable, a distribution of another library), or built with
`validate_args=True` (TFP checks concrete arguments as it builds), is called
directly, as it would be without this module. The shape facts a score needs
(`_random_variable._sample_shape`, the shape of `u`) are kept per description
too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_ARRAY = ("array",)
_PLAIN = (type(None), bool, int, float, complex, str)


def _describe(obj: Any, arrays: list[Any]) -> Hashable | None:
    """The static description of `obj` (its arrays appended to `arrays`), or None
    when `obj` holds something that cannot be described by value."""
    if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
        shape_like = _shape_like(obj)
        if shape_like is not None:
            return ("by value", _ByValue(shape_like))
        arrays.append(obj)
        return _ARRAY
    if isinstance(obj, _PLAIN):
        # The type keeps 1, 1.0 and True apart; the repr keeps -0.0 and 0.0 apart.
        return ("plain", type(obj), obj, repr(obj))
    if isinstance(obj, (tuple, list)):
        parts = [_describe(item, arrays) for item in obj]
        return None if any(p is None for p in parts) else (type(obj).__name__, tuple(parts))
    if isinstance(obj, (np.dtype, type)) and _is_dtype(obj):
        return ("dtype", obj)
    parameters = getattr(obj, "parameters", None)
    if not (
        type(obj).__module__.startswith("tensorflow_probability.") and isinstance(parameters, dict)
    ):
        return None
    if parameters.get("validate_args"):
        return None  # TFP checks concrete arguments as it builds: keep them concrete
    items = sorted(parameters.items())
    parts = [_describe(value, arrays) for _, value in items]
    if any(p is None for p in parts):
        return None
    return ("tfp", type(obj), tuple((k, p) for (k, _), p in zip(items, parts)))


def _shape_like(array: Any) -> np.ndarray | None:
    """A concrete integer or bool array (a sample shape, a number of steps) as NumPy's:
    TFP may read its value while it builds, so it stays a value, as it was, rather
    than a traced input. None for any other array."""
    dtype = np.dtype(array.dtype)
    if not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_)):
        return None
    try:
        return np.asarray(array)
    except jax.errors.TracerArrayConversionError:  # traced already: it stays an input
        return None


class _ByValue:
    """A concrete integer or bool array in a description, equal by dtype, shape and bytes."""

    __slots__ = ("value", "key")

    def __init__(self, value: np.ndarray) -> None:
        self.value = value
        self.key = (value.dtype.str, value.shape, value.tobytes())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _is_dtype(obj: Any) -> bool:
    try:
        np.dtype(obj)
    except TypeError:
        return False
    return True


def _rebuild(desc: Any, arrays: Iterator[Any]) -> Any:
    kind = desc[0]
    if kind == "array":
        return next(arrays)
    if kind == "plain":
        return desc[2]
    if kind == "by value":
        return desc[1].value
    if kind == "dtype":
        return desc[1]
    if kind in ("tuple", "list"):
        items = [_rebuild(part, arrays) for part in desc[1]]
        return tuple(items) if kind == "tuple" else items
    return desc[1](**{key: _rebuild(part, arrays) for key, part in desc[2]})


def described(dist: Any) -> tuple[Hashable, list[Any]] | None:
    """`(description, arrays)` of a TFP distribution, or None (call it directly)."""
    arrays: list[Any] = []
    desc = _describe(dist, arrays)
    return None if desc is None else (desc, arrays)


@functools.partial(jax.jit, static_argnums=0)
def _log_prob(desc: Hashable, arrays: list[Any], value: Any) -> Any:
    return _rebuild(desc, iter(arrays)).log_prob(value)


def log_prob(dist: Any, value: Any) -> Any:
    """`dist.log_prob(value)`, from the trace cached for `dist`'s description."""
    found = described(dist)
    if found is None:
        return dist.log_prob(value)
    return _log_prob(found[0], found[1], value)


def _onto_support(dist: Any, u: Any) -> tuple[Any, Any]:
    bijector = dist.experimental_default_event_space_bijector()
    log_det = bijector.forward_log_det_jacobian(u, event_ndims=len(dist.event_shape))
    return bijector.forward(u), jnp.sum(log_det)


@functools.partial(jax.jit, static_argnums=0)
def _onto_support_cached(desc: Hashable, arrays: list[Any], u: Any) -> tuple[Any, Any]:
    return _onto_support(_rebuild(desc, iter(arrays)), u)


def onto_support(dist: Any, u: Any) -> tuple[Any, Any]:
    """`(value, log |d value / du|)`: `u` mapped onto `dist`'s support by its default
    event-space bijector, the log-Jacobian summed, from the trace cached for `dist`."""
    found = described(dist)
    if found is None:
        return _onto_support(dist, u)
    value, log_det = _onto_support_cached(found[0], found[1], u)
    return value, log_det


# Facts about a description at given shapes: {(fact, description, avals): value}.
_FACTS: dict[tuple[Any, ...], Any] = {}
_MAX_FACTS = 4096


def fact(name: str, dist: Any, compute: Callable[[Any], Any]) -> Any:
    """`compute(dist)`, remembered for `dist`'s description and its arrays' shapes
    (for facts fixed by those: shapes, dtypes, whether a bijector exists)."""
    found = described(dist)
    if found is None:
        return compute(dist)
    desc, arrays = found
    key = (name, desc, tuple((np.shape(a), jnp.result_type(a)) for a in arrays))
    if key not in _FACTS:
        if len(_FACTS) >= _MAX_FACTS:
            _FACTS.clear()
        _FACTS[key] = compute(dist)
    return _FACTS[key]
