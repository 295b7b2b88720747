"""The kinds of model `instrument` reads as data, and the dotted path of each submodule.

A path is the route from the root to the submodule, one element per step,
joined with dots: an attribute name, a list index or a dict key. NNX models are
walked as graphs (`nnx.iter_graph`); Equinox and Penzai models are pytrees,
walked by their key paths, so a Penzai layer's path is the key path
`pz.select` and `jax.tree_util` give it (``body.sublayers.2.delta``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import jax


def optional(module: str) -> Any:
    """The module named `module`, or None where its library (Flax, Equinox, Penzai),
    which harvest does not require, is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def is_named(obj: Any, name: str, package: str) -> bool:
    """Whether `obj`'s class is called `name` and defined under `package`: for libraries
    (gemma, Penzai's, ...) whose classes harvest recognises without importing them."""
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.startswith(package)


def _leaves(model: Any, types: Any) -> list[Any]:
    # By the leaves' own types: while `pz.select` builds a selection, stand-ins
    # for the selected layers answer `isinstance` checks as if they were them.
    is_leaf = lambda x: issubclass(type(x), types)
    return [x for x in jax.tree_util.tree_leaves(model, is_leaf=is_leaf) if is_leaf(x)]


def _replaced(model: Any, types: Any, new: Any) -> Any:
    is_leaf = lambda x: issubclass(type(x), types)  # as `_leaves`
    return jax.tree_util.tree_map(lambda x: new(x) if is_leaf(x) else x, model, is_leaf=is_leaf)


def penzai_variables(model: Any) -> list[Any]:
    """The variables (`pz.Parameter`, `pz.StateVariable`) of a Penzai model, in tree order."""
    from penzai.core.variables import AbstractVariable

    return _leaves(model, AbstractVariable)


def frozen_variables(model: Any) -> Any:
    """A Penzai model with each variable (`pz.Parameter`, `pz.StateVariable`) replaced by its frozen value."""
    from penzai.core.variables import AbstractVariable

    return _replaced(model, AbstractVariable, lambda x: x.freeze())


def penzai_states(model: Any, frozen: bool) -> dict[Any, Any]:
    """A Penzai model's state variables by slot, in tree order (each once): the
    mutable ones (`pz.StateVariable`), or, with `frozen`, their frozen values."""
    from penzai.core.variables import StateVariable, StateVariableValue

    return {
        x.get_slot(): x for x in _leaves(model, StateVariableValue if frozen else StateVariable)
    }


def with_states(model: Any, states: dict[Any, Any]) -> Any:
    """`model` with each state variable (mutable or frozen) at a slot of `states` replaced by its entry."""
    from penzai.core.variables import StateVariable, StateVariableValue

    types = (StateVariable, StateVariableValue)
    return _replaced(model, types, lambda x: states.get(x.get_slot(), x))


def _bases() -> list[tuple[str, str, Any]]:
    """(kind, library, its module base class, None where not installed) of each model library."""
    nnx, eqx = optional("flax.nnx"), optional("equinox")
    return [
        ("nnx", "Flax NNX", nnx and nnx.Module),
        ("equinox", "Equinox", eqx and eqx.Module),
        ("penzai", "Penzai", getattr(optional("penzai.nn.layer"), "Layer", None)),
    ]


def kind(target: Any) -> str | None:
    """ "nnx", "equinox", "penzai", "function", or None for a target `instrument` cannot take."""
    for name, _, base in _bases():
        if base is not None and isinstance(target, base):
            return name
    return "function" if callable(target) else None


def module_class(target: Any) -> str | None:
    """The library of a module class passed where a model (an instance) belongs:
    "Flax NNX", "Equinox", "Penzai" or "Flax Linen"; None for anything else."""
    if not isinstance(target, type):
        return None
    linen = sys.modules.get("flax.linen")  # no Linen class exists before it is imported
    for _, library, base in [*_bases(), ("linen", "Flax Linen", linen and linen.Module)]:
        if base is not None and issubclass(target, base):
            return library
    return None


def unbound_linen(target: Any) -> bool:
    """Whether `target` is a Flax Linen module not bound to variables (`model`,
    not `model.bind(variables)`): it runs only through `model.apply`."""
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(target, linen.Module) and target.scope is None


def submodules(target: Any, of_kind: str) -> list[tuple[str, Any]]:
    """(dotted path, submodule) for each submodule of a module target, root excluded."""
    if of_kind == "nnx":
        from flax import nnx

        return [
            (".".join(str(k) for k in path), node)
            for path, node in nnx.iter_graph(target)
            if path and isinstance(node, nnx.Module) and not isinstance(node, (nnx.List, nnx.Dict))
        ]
    if of_kind == "equinox":
        return tree_modules(target, optional("equinox").Module)
    return tree_modules(target, optional("penzai.nn.layer").Layer)


def key_str(key: Any) -> str:
    for attr in ("name", "key", "idx"):  # GetAttrKey, DictKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tree_modules(model: Any, module_type: Any) -> list[tuple[str, Any]]:
    """(dotted key path, submodule) for each instance of `module_type` in the pytree `model`."""
    found, seen = [], set()

    def visit(node, prefix):
        children = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and isinstance(x, module_type)
        )[0]
        for key, child in children:
            if isinstance(child, module_type) and id(child) not in seen:
                seen.add(id(child))
                path = prefix + tuple(key_str(k) for k in key)
                found.append((".".join(path), child))
                visit(child, path)

    visit(model, ())
    return found


def describe(target: Any) -> str:
    """A short name for `target` in messages: never its repr, which may print a whole model."""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    owner = getattr(target, "__self__", None)
    if name is not None and owner is not None:
        return f"{type(owner).__name__}.{getattr(target, '__name__', name)}"
    return name if isinstance(name, str) else f"a {type(target).__name__}"
