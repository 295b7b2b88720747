"""Names of random variables: nested dicts of values and the dotted paths into them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from .._calling._transforms import reap
from .._typing import Reaped
from ._tags import RANDOM_VARIABLE


@dataclasses.dataclass(frozen=True)
class Among:
    """An allowlist predicate that compares by value, so equal name sets share
    one entry of the core's cache."""

    names: frozenset[str]

    def __call__(self, name: str) -> bool:
        return name in self.names


@dataclasses.dataclass(frozen=True)
class AmongUnderAnyTag:
    """`Among` for a walk of several tags, whose names come dotted with their tag in
    front (`"tag.name"`): whether the name, under whichever tag, is among `names`."""

    names: frozenset[str]

    def __call__(self, name: str) -> bool:
        return name.partition(".")[2] in self.names


def dotted_paths(tree: Reaped, prefix: tuple[str, ...] = ()) -> set[str]:
    """Every key path of a nested dict, as dotted names ("scope.x")."""
    paths = set()
    for key, value in tree.items():
        path = prefix + (key,)
        paths.add(".".join(path))
        if isinstance(value, dict):
            paths |= dotted_paths(value, path)
    return paths


def leaf_paths(tree: Reaped, prefix: tuple[str, ...] = ()) -> list[str]:
    """The dotted names of a nested dict's non-dict entries."""
    out: list[str] = []
    for key, value in tree.items():
        path = prefix + (key,)
        out += leaf_paths(value, path) if isinstance(value, dict) else [".".join(path)]
    return out


def at_paths(tree: Reaped, paths: set[str], prefix: tuple[str, ...] = ()) -> list[Any]:
    """The entries of a nested dict whose dotted names are among `paths`."""
    out: list[Any] = []
    for key, value in tree.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            out += at_paths(value, paths, path)
        elif ".".join(path) in paths:
            out.append(value)
    return out


def restricted(tree: Reaped, names: set[str], prefix: tuple[str, ...] = ()) -> Reaped:
    """The part of a nested dict whose leaves' dotted names are among `names`."""
    out: Reaped = {}
    for key, value in tree.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            inner = restricted(value, names, path)
            if inner:
                out[key] = inner
        elif ".".join(path) in names:
            out[key] = value
    return out


def merged(a: Reaped, b: Reaped) -> Reaped:
    """Nested dicts `a` and `b` merged scope by scope (`b` wins on a clash)."""
    out = dict(a)
    for key, value in b.items():
        inner = out.get(key)
        both = isinstance(value, dict) and isinstance(inner, dict)
        out[key] = merged(inner, value) if both else value  # type: ignore[arg-type]
    return out


def nested(names: Any, values: Any) -> Reaped:
    """`{dotted name: value}` pairs as nested dicts, one level per scope."""
    out: Reaped = {}
    for name, value in zip(names, values):
        *scopes, leaf = name.split(".")
        d = out
        for scope in scopes:
            d = d.setdefault(scope, {})
        d[leaf] = value
    return out


def random_variables_of(f: Callable[..., Any], args: Any, kwargs: Any) -> list[str]:
    """The dotted names of the random variables `f(*args, **kwargs)` draws (from shapes alone)."""
    return leaf_paths(jax.eval_shape(reap(f, tag=RANDOM_VARIABLE), *args, **kwargs))


def check_drawn(
    caller: str, f: Callable[..., Any], requested: Iterable[str], args: Any, kwargs: Any
) -> None:
    """Raises the error naming `caller` if a name in `requested` is no random variable of
    `f(*args, **kwargs)`: what a plant's `KeyError` meant, said in the program's terms."""
    known = random_variables_of(f, args, kwargs)
    unknown = sorted(set(requested) - set(known))
    if unknown:
        raise KeyError(
            f"{caller}: not random variables of the program: {', '.join(unknown)}. Its random "
            f"variables are: {', '.join(sorted(known)) or 'none'}."
        )


def density_leaves(densities: Reaped, prefix: str = "") -> list[tuple[str, jax.Array]]:
    """`(dotted name, log density)` of every density in a reap of `LOG_DENSITY`."""
    out: list[tuple[str, jax.Array]] = []
    for key, value in densities.items():
        name = prefix + key
        if isinstance(value, dict):
            out += density_leaves(value, name + ".")
        elif isinstance(value, tuple):
            out += [(name, jnp.asarray(density)) for density, _ in value]
        else:
            out.append((name, jnp.asarray(value)))
    return out
