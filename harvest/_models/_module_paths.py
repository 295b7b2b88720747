"""The kinds of model `instrument` reads as data, and the dotted path of each submodule.

A path is the route from the root to the submodule, one element per step,
joined with dots: an attribute name, a list index or a dict key. NNX models are
walked as graphs (`nnx.iter_graph`); Equinox and Penzai models are pytrees,
walked by their key paths, so a Penzai layer's path is the key path
`pz.select` and `jax.tree_util` give it (``body.sublayers.2.delta``).
"""

from __future__ import annotations

import sys
from typing import Any

import jax


def _nnx() -> Any:
    try:
        from flax import nnx
    except ImportError:  # Flax is optional
        return None
    return nnx


def _eqx() -> Any:
    try:
        import equinox
    except ImportError:  # Equinox is optional
        return None
    return equinox


def penzai_layer() -> type | None:
    """Penzai's layer base class, or None if Penzai is not installed."""
    try:
        from penzai.nn.layer import Layer
    except ImportError:  # Penzai is optional
        return None
    return Layer


def penzai_variables(model: Any) -> list[Any]:
    """The variables (`pz.Parameter`, `pz.StateVariable`) of a Penzai model, in tree order."""
    from penzai.core.variables import AbstractVariable

    is_variable = lambda x: issubclass(type(x), AbstractVariable)
    leaves = jax.tree_util.tree_leaves(model, is_leaf=is_variable)
    return [x for x in leaves if is_variable(x)]


def frozen_variables(model: Any) -> Any:
    """A Penzai model with each variable (`pz.Parameter`, `pz.StateVariable`) replaced by its frozen value."""
    from penzai.core.variables import AbstractVariable

    # By the leaves' own types: while `pz.select` builds a selection, stand-ins
    # for the selected layers answer `isinstance` checks as if they were them.
    is_variable = lambda x: issubclass(type(x), AbstractVariable)
    leaves, tree = jax.tree_util.tree_flatten(model, is_leaf=is_variable)
    return jax.tree_util.tree_unflatten(tree, [x.freeze() if is_variable(x) else x for x in leaves])


def penzai_states(model: Any, frozen: bool) -> dict[Any, Any]:
    """A Penzai model's state variables by slot, in tree order (each once): the
    mutable ones (`pz.StateVariable`), or, with `frozen`, their frozen values."""
    from penzai.core.variables import StateVariable, StateVariableValue

    want = StateVariableValue if frozen else StateVariable
    is_state = lambda x: issubclass(type(x), want)
    leaves = jax.tree_util.tree_leaves(model, is_leaf=is_state)
    return {x.get_slot(): x for x in leaves if is_state(x)}


def with_states(model: Any, states: dict[Any, Any]) -> Any:
    """`model` with each state variable (mutable or frozen) at a slot of `states` replaced by its entry."""
    from penzai.core.variables import StateVariable, StateVariableValue

    is_state = lambda x: issubclass(type(x), (StateVariable, StateVariableValue))
    return jax.tree_util.tree_map(
        lambda x: states.get(x.get_slot(), x) if is_state(x) else x, model, is_leaf=is_state
    )


def kind(target: Any) -> str | None:
    """ "nnx", "equinox", "penzai", "function", or None for a target `instrument` cannot take."""
    nnx, eqx, layer = _nnx(), _eqx(), penzai_layer()
    if nnx is not None and isinstance(target, nnx.Module):
        return "nnx"
    if eqx is not None and isinstance(target, eqx.Module):
        return "equinox"
    if layer is not None and isinstance(target, layer):
        return "penzai"
    if callable(target):
        return "function"
    return None


def module_class(target: Any) -> str | None:
    """The library of a module class passed where a model (an instance) belongs:
    "Flax NNX", "Equinox", "Penzai" or "Flax Linen"; None for anything else."""
    if not isinstance(target, type):
        return None
    linen = sys.modules.get("flax.linen")  # no Linen class exists before it is imported
    nnx, eqx, layer = _nnx(), _eqx(), penzai_layer()
    bases: list[tuple[str, Any]] = [
        ("Flax NNX", nnx and nnx.Module),
        ("Equinox", eqx and eqx.Module),
        ("Penzai", layer),
        ("Flax Linen", linen and linen.Module),
    ]
    for library, base in bases:
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
        return nnx_modules(target)
    if of_kind == "equinox":
        return tree_modules(target, _eqx().Module)
    return tree_modules(target, penzai_layer())


def nnx_modules(model: Any) -> list[tuple[str, Any]]:
    nnx = _nnx()
    return [
        (".".join(str(k) for k in path), node)
        for path, node in nnx.iter_graph(model)
        if path and isinstance(node, nnx.Module) and not isinstance(node, (nnx.List, nnx.Dict))
    ]


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
