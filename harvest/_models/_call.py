"""One running call of an instrumented target: sowing each part's output (and inputs).

An `Instrumented` makes one `InstrumentCall` per call and holds it in a context
variable (`active`) for the length of the call, so other threads and calls never
see it. Whoever meets a part of the model (a wrapped module class, Linen's
interceptor, an attention hook) asks it for the part's path and has it sow.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .._walk._interpreter import NameFilter
from .._walk._leaves import is_array, is_named_array
from .._walk._primitive import sow_p
from .._walk._sow import non_array
from . import _attention, _transformer_lens
from ._op_sites import INSTRUMENT_MODE


@dataclasses.dataclass
class InstrumentCall:
    """One running call of an instrumented target, in one thread."""

    tag: str
    select: NameFilter
    ops: bool
    inputs: bool
    paths: dict = dataclasses.field(default_factory=dict)  # id(module) -> its dotted path
    known: frozenset = frozenset()  # the paths of `paths`
    inside: set = dataclasses.field(default_factory=set)  # ids of modules being called now
    scopes: set = dataclasses.field(default_factory=set)  # module paths pushed as named scopes
    # Equinox and Penzai (path, submodule) pairs: what a rebuilt module may be.
    parts: list = dataclasses.field(default_factory=list)
    # Rebuilt modules in `paths`, kept alive so their ids stay theirs.
    held: list = dataclasses.field(default_factory=list)
    sown: int = 0
    kind: str = "function"  # the target's kind (`_module_paths.kind`)
    attention: bool = False  # sow TransformerLens's hooks on attention modules (`_attention.py`)
    # Penzai: {layer: (its attention, the hook)} (`_attention.penzai_hook_paths`).
    penzai_hooks: dict = dataclasses.field(default_factory=dict)
    residual: Any = None  # TransformerLens's names (`_transformer_lens.Names`), if asked for
    input_axes: tuple = ()  # the named axes of the call's Penzai arguments, in their order

    def sow(self, path, value, axes=None):
        if self.penzai_hooks and is_named_array(value):  # hooks are picked by their own names
            value = _attention.penzai_hook(self, path, value)
        if not self.select((path,)):
            return value
        if self.residual is not None and not _transformer_lens.is_tl_name(path):
            return value  # with TransformerLens's names, only theirs
        bad = non_array(value)
        if bad is not None:
            raise TypeError(
                f"instrument(tag={self.tag!r}): the module at {path!r} returned "
                f"{bad[0] or 'its output'} of type {type(bad[1]).__name__}, which is not an array, "
                "so it cannot be a site. Leave that module out (e.g. "
                f"exclude={path!r})."
            )
        if is_named_array(value):
            # A Penzai named array: the site is its data, the call's input axes first (so
            # every site of a model orders batch/seq alike, whatever order a layer's own
            # einsum left), then the layer's others; their names kept for `sites`.
            first = [n for n in self.input_axes if n in value.named_shape]
            value = value.order_as(*first, *(n for n in value.named_shape if n not in first))
            axes = (None,) * len(value.positional_shape) + tuple(value.named_shape)
        leaves, tree = jax.tree_util.tree_flatten(value)
        if not leaves:
            return value
        if len(leaves) == 1 and (isinstance(value, (tuple, list)) or is_named_array(value)):
            # A block's `(cache, x)` with no cache, or a named array: the site is the one array.
            return jax.tree_util.tree_unflatten(tree, [self.sow(path, leaves[0], axes)])
        self.sown += 1
        named = {} if axes is None else {"axes": (axes,)}
        out = sow_p.bind(
            *leaves, tag=self.tag, name=path, scope=(), mode=INSTRUMENT_MODE, tree=tree, **named
        )
        return jax.tree_util.tree_unflatten(tree, out)

    def sow_inputs(self, path: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """With inputs=True, `args` with their array arguments sown as `path + INPUTS`:
        one such argument is the site's value itself, several a tuple of them."""
        name = path + INPUTS
        if not self.inputs or not self.select((name,)):
            return args
        at = [i for i, a in enumerate(args) if _sowable_input(a)]
        if not at:
            return args
        sown = self.sow(name, args[at[0]] if len(at) == 1 else tuple(args[i] for i in at))
        new = list(args)
        for i, value in zip(at, (sown,) if len(at) == 1 else sown):
            new[i] = value
        return tuple(new)

    def run_module(self, path, module, method, args, kwargs):
        """Calls `method` of `module` (at `path`) and sows its output (and, with inputs=True, its inputs)."""
        args = self.sow_inputs(path, _transformer_lens.part_input(self, path, args))
        self.inside.add(id(module))
        try:
            with self.scope(path):
                out = self.run_attention(path, module, method, args, kwargs)
        finally:
            self.inside.discard(id(module))
        return _transformer_lens.part_output(self, path, self.sow(path, out))

    def run_attention(self, path, module, method, args, kwargs):
        """`method(module, *args, **kwargs)`; with attention=True, an attention module's hooks sown too."""
        if self.attention:
            if _attention.is_equinox_attention(module):
                return _attention.equinox_forward(self, path, module, args, dict(kwargs))
            flax_kind = _attention.flax_kind(module)
            if flax_kind is not None:
                with _attention.flax_hooks(self, path, module, flax_kind):
                    return method(module, *args, **kwargs)
        return method(module, *args, **kwargs)

    def scope(self, path):
        """With ops=True (or while `view` traces), a named scope that gives the ops
        inside the module's path."""
        if not self.ops:
            return jax.named_scope(path) if scoped.get() else contextlib.nullcontext()
        self.scopes.add(path)
        return jax.named_scope(path)


INPUTS = ":in"  # a module's inputs are the site `path + INPUTS`; no path or op name ends so


def _sowable_input(arg: Any) -> bool:
    """An argument whose leaves are all arrays of numbers (not None, a flag, or a PRNG key)."""
    leaves = jax.tree_util.tree_leaves(arg)
    return bool(leaves) and all(
        is_array(x) and not jnp.issubdtype(x.dtype, jax.dtypes.extended) for x in leaves
    )


active: contextvars.ContextVar[InstrumentCall | None] = contextvars.ContextVar(
    "harvest_instrument", default=None
)
# Set while `view` traces: each module call is a named scope even without ops=True,
# so the page can group a module's ops in its box (the scopes change no value).
scoped: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "harvest_instrument_scoped", default=False
)
