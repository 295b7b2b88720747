"""`instrument`: the parts of a model nobody sowed in, as sow sites.

A module target (Flax NNX, Equinox) is read as data: its submodules and their
dotted paths from the root. For the length of one call, each submodule class
in it has its `__call__` wrapped; the wrapper looks the instance up in the
call's own path table (held in a context variable, so other threads and other
calls never see it) and sows the output under that path. The wrappers are
counted per class and removed when the last call using them returns, so the
user's classes and objects are as they were between calls.

NNX transforms (`nnx.scan`, `nnx.vmap`, `nnx.jit`, `nnx.remat`) split a module
and merge it into fresh objects, which no table knows. So for the same call
each NNX submodule also carries its path as a private static attribute; being
static it lands in the graph definition and so on every fresh copy, where the
wrapper reads it (and checks it against the call's table).

A plain function gets its Flax Linen submodule outputs sown through Linen's
own `intercept_methods`; with `ops=True`, any callable also gets every
primitive's output sown (`_op_sites.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _attention, _errors
from ._attention import HOOKS
from ._eager_dispatch import EagerDispatch, EagerModuleDispatch
from ._free_variables import StaticValue, attributes_key, closure_of, globals_read, with_closure
from ._instrument_linen import run_linen
from ._interpreter import NameFilter
from ._leaves import is_array
from ._module_paths import (
    describe,
    frozen_variables,
    is_named_array,
    kind as target_kind,
    penzai_states,
    penzai_variables,
    submodules,
    with_states,
)
from ._op_sites import INSTRUMENT_MODE, sow_ops
from ._primitive import sow_p
from ._sow import non_array
from ._stateful import Stateful, in_flattening_call
from ._typing import NameSelect, P, R

# ---------------------------------------------------------------------------
# Sowing one part's output.


@dataclasses.dataclass
class _Call:
    """One running call of an instrumented target, in one thread."""

    tag: str
    select: NameFilter
    ops: bool
    inputs: bool
    paths: dict  # id(module) -> dotted path, for module targets
    known: frozenset = frozenset()  # the paths of `paths`
    inside: set = dataclasses.field(default_factory=set)  # ids of modules being called now
    scopes: set = dataclasses.field(default_factory=set)  # module paths pushed as named scopes
    parts: list = dataclasses.field(
        default_factory=list
    )  # Equinox (path, submodule): what a rebuilt one may be
    held: list = dataclasses.field(
        default_factory=list
    )  # rebuilt modules in `paths`, kept so their ids stay theirs
    sown: int = 0
    kind: str = "function"  # the target's kind (`_module_paths.kind`)
    attention: bool = False  # sow TransformerLens's hooks on attention modules (`_attention.py`)
    attention_paths: frozenset = frozenset()  # Penzai attention layers, by path
    input_axes: tuple = ()  # the named axes of the call's Penzai arguments, in their order

    def sow(self, path, value, axes=None):
        if self.attention_paths and is_named_array(value):  # hooks are picked by their own names
            value = _attention.penzai_hook(self, path, value)
        if not self.select((path,)):
            return value
        bad = non_array(value)
        if bad is not None:
            raise _errors.module_output_not_an_array(self.tag, path, bad[0] or "its output", bad[1])
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
        args = self.sow_inputs(path, args)
        self.inside.add(id(module))
        try:
            with self.scope(path):
                out = self.run_attention(path, module, method, args, kwargs)
        finally:
            self.inside.discard(id(module))
        return self.sow(path, out)

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
        """With ops=True, a named scope that gives the ops inside the module's path."""
        if not self.ops:
            return contextlib.nullcontext()
        self.scopes.add(path)
        return jax.named_scope(path)


INPUTS = ":in"  # a module's inputs are the site `path + INPUTS`; no path or op name ends so


def _sowable_input(arg: Any) -> bool:
    """An argument whose leaves are all arrays of numbers (not None, a flag, or a PRNG key)."""
    leaves = jax.tree_util.tree_leaves(arg)
    return bool(leaves) and all(
        is_array(x) and not jnp.issubdtype(x.dtype, jax.dtypes.extended) for x in leaves
    )


_active: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "harvest_instrument", default=None
)


# ---------------------------------------------------------------------------
# Wrapping `__call__` of module classes while an instrumented call runs.

_MISSING = object()
_lock = threading.Lock()
_wrapped: dict[type, list] = {}  # class -> [its own __call__ or _MISSING, number of calls using it]


def _wrapper(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        call = _active.get()
        path = None if call is None else _path(call, self)
        if path is None or id(self) in call.inside:  # not ours, or a super().__call__
            return original(self, *args, **kwargs)
        return call.run_module(path, self, original, args, kwargs)

    return __call__


def _path(call, module):
    """`module`'s path in `call`: from the table, or, for a copy an NNX transform
    merged, from the paths its original was marked with."""
    path = call.paths.get(id(module))
    if path is None:
        path = next((p for p in getattr(module, _MARK, ()) if p in call.known), None)
    if path is None and call.parts:
        path = _rebuilt_path(call, module)
    return path


# ---------------------------------------------------------------------------
# Equinox modules rebuilt from a part's arrays.
#
# Scan over layers in Equinox stacks the layers' arrays (`eqx.filter_vmap` of a
# constructor) and, inside `jax.lax.scan`, rebuilds one layer per iteration
# from a slice of them (`eqx.combine`, or the module passed as `xs`). An
# Equinox module carries nothing but its fields, so the rebuilt layer is found
# by its structure: same class and static fields, and arrays that are the
# part's own, or of the part's shapes (a copy made by a transformation), or of
# its shapes without their common leading axis (a slice of a stack).


def _rebuilt_path(call: _Call, module: Any) -> str | None:
    """The path of the part `module` was rebuilt from, or None if none fits."""
    found = [(p, how) for p, part in call.parts if (how := _rebuilt_from(module, part)) is not None]
    # The very arrays name it; else a slice of a stack (a layer in a scan) is
    # taken before a copy, which only a module passed through jit or
    # checkpoint as an argument would be.
    for how in ("same", "slice", "copy"):
        paths = [p for p, h in found if h == how]
        if paths:
            break
    paths = paths[:1] if how == "same" else paths
    if not paths:
        return None
    if len(paths) > 1:
        if not call.ops and not any(call.select((p,)) for p in paths):
            return None  # not a site whichever it is
        raise ValueError(
            f"instrument(tag={call.tag!r}): a {type(module).__name__} rebuilt from arrays (as eqx.combine "
            f"or jax.lax.scan over stacked layers rebuild one) fits several of the model's submodules: "
            f"{', '.join(map(repr, paths))}, so its name is ambiguous. Leave them out with `where` "
            f"(e.g. where=lambda name: name not in {paths!r}), or call the submodule itself rather than a "
            "copy passed through a transformation."
        )
    path = paths[0]
    call.held.append(module)
    call.paths[id(module)] = path
    for sub, child in submodules(module, call.kind):  # its submodules are rebuilt with it
        call.paths.setdefault(id(child), f"{path}.{sub}")
    return path


def _rebuilt_from(module: Any, part: Any) -> str | None:
    """How `module` was rebuilt from `part`'s arrays: "same" (the very arrays),
    "copy" (their shapes), "slice" (one row of each), or None if it was not."""
    leaves, part_leaves = jax.tree_util.tree_leaves(module), jax.tree_util.tree_leaves(part)
    tree: Any = jax.tree_util.tree_structure(module)
    if tree != jax.tree_util.tree_structure(part):
        return None
    hows: set[object] = set()
    for a, b in zip(leaves, part_leaves):
        if a is b:
            continue
        if not (is_array(a) and is_array(b)):
            if is_array(a) or is_array(b) or not _equal(a, b):
                return None
        elif a.dtype != b.dtype:
            return None
        elif a.shape == b.shape:
            hows.add("copy")
        elif b.shape[1:] == a.shape:
            hows.add(b.shape[0])
        else:
            return None
    if not hows:
        return "same"
    if len(hows) > 1:  # copies and slices mixed, or slices of stacks of different lengths
        return None
    return "copy" if hows == {"copy"} else "slice"


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # an object whose == is not a plain truth value
        return False


def _wrap(classes):
    with _lock:
        for cls in classes:
            entry = _wrapped.get(cls)
            if entry is None:
                _wrapped[cls] = [cls.__dict__.get("__call__", _MISSING), 1]
                cls.__call__ = _wrapper(cls.__call__)
            else:
                entry[1] += 1


def _unwrap(classes):
    with _lock:
        for cls in classes:
            entry = _wrapped[cls]
            entry[1] -= 1
            if entry[1] == 0:
                del _wrapped[cls]
                if entry[0] is _MISSING:
                    del cls.__call__
                else:
                    cls.__call__ = entry[0]


# ---------------------------------------------------------------------------
# Marking NNX submodules with their paths while an instrumented call runs.

_MARK = "_harvest_instrument_paths"
_marks: dict[int, tuple] = {}  # id(module) -> (module, {path: number of calls marking it so})


def _mark(parts):
    """Sets each module's mark to the sorted paths every running call gives it.

    Set past NNX's attribute checks, as a static tuple of strings: the graph
    definition (a compile-cache key of `nnx.jit`) then depends on the paths
    only, not on which call runs.
    """
    with _lock:
        for path, module in parts:
            counts = _marks.setdefault(id(module), (module, {}))[1]
            counts[path] = counts.get(path, 0) + 1
            object.__setattr__(module, _MARK, tuple(sorted(counts)))


def _unmark(parts):
    with _lock:
        for path, module in parts:
            counts = _marks[id(module)][1]
            counts[path] -= 1
            if not counts[path]:
                del counts[path]
            if counts:
                object.__setattr__(module, _MARK, tuple(sorted(counts)))
            else:
                del _marks[id(module)]
                object.__delattr__(module, _MARK)


# ---------------------------------------------------------------------------
# The parts of each kind of target.


# ---------------------------------------------------------------------------
# The public callable.


class Instrumented:
    """`target`, callable as before, with its parts sown under `tag`.

    A pytree whose child is the target (for a module), so transformations that
    take it as an argument or bound object trace the model's arrays; for a
    function, its children are what the function closes over and reads from
    its module, as a harvested function's are (`_closure_flat`), so a
    closed-over `variables` dict is traced and an NNX module there split. Only a
    Penzai model can hold state of its own (`_InstrumentedPenzai`); any other
    target is not `Stateful`, so a harvest call looks for no state in it (for a
    Linen function that would be two more walks of every argument's tree).

    A Penzai model's variables are its frozen values when flattened. Called
    with frozen `pz.StateVariable` values (inside a harvest trace, or a jit it
    was passed to), it runs on mutable copies of them, as `pz.variable_jit`
    does, and keeps their new values; a harvest call hands those out of its
    trace and writes them to the caller's variables (`Stateful`).

    Flattening a Penzai layer tree runs Python for every layer, and an eager
    harvest call flattens its parts several times (`jax.jit` once). So while
    harvest flattens a call (`flattening_call`), the model gives the frozen
    model's arrays as direct children, its structure (kept while no variable
    changes) as auxiliary data, and the copy made from them rebuilds the model
    only when it is first used. Any other flatten (`jax.jit`, `pz.select`)
    gives the frozen model itself as the one child, so its layers are seen.
    """

    def __init__(self, target, kind, tag, ops, inputs, select, where, attention=False, leaves=None):
        self._target = target
        # Penzai: (structure, arrays) of the frozen model a plain flatten gave, not rebuilt yet.
        self._leaves = leaves
        self._rebuilt = False  # whether `target` was rebuilt from `_leaves`
        self._kind = kind
        self._tag = tag
        self._ops = ops
        self._inputs = inputs
        self._attention = attention
        self._select = select
        self._where = where
        # Penzai: (the variables, their values, the frozen model's arrays, its structure).
        self._frozen = None
        # A function rebuilt from its closure's flatten: (the function, layout, children).
        self._closed = None
        if leaves is None:
            functools.update_wrapper(self, target, updated=())  # `inspect.signature` shows target's

    @property
    def target(self):
        if self._leaves is not None:
            tree, leaves = self._leaves
            self._target, self._leaves, self._rebuilt = tree.unflatten(leaves), None, True
        return self._target

    @target.setter
    def target(self, value):
        self._target, self._leaves, self._frozen, self._closed = value, None, None, None

    def _static(self):
        return (
            self._kind,
            self._tag,
            self._ops,
            self._inputs,
            self._select,
            self._where,
            self._attention,
        )

    def tree_flatten(self):
        if self._kind == "function":
            if self._closed is not None:  # a copy made from a flatten: flattens as that did
                source, layout, children = self._closed
                return list(children), ("closure", source, self._static(), layout)
            closure = _closure_flat(self._target)
            if closure is not None:
                children, layout = closure
                return children, ("closure", self._target, self._static(), layout)
            if type(self._target) is functools.partial:
                # Its arguments are the call's, as harvest takes a partial's: arrays traced.
                target = self._target
                return [target.args, target.keywords], (
                    "partial",
                    target.func,
                    self._static(),
                    None,
                )
            return (), ("function", self.target, self._static(), _object_key(self.target))
        if (
            self._kind == "penzai"
            and not self._rebuilt
            and (self._leaves is not None or in_flattening_call())
        ):
            tree, leaves = self._leaves if self._leaves is not None else self._frozen_flat()
            return leaves, ("leaves", tree, self._static(), None)
        return self._children(), ("tree", None, self._static(), None)

    def tree_flatten_with_keys(self):
        if self._kind == "function":
            children, aux = self.tree_flatten()
        else:
            children, aux = self._children(), ("tree", None, self._static(), None)
        return [(jax.tree_util.FlattenedIndexKey(i), c) for i, c in enumerate(children)], aux

    def _children(self):
        if self._kind != "penzai":
            return (self.target,)
        # A Penzai `Parameter` is a mutable leaf, hashed by identity: as a
        # static leaf its old value would stay in a compiled program. Frozen,
        # the weights are arrays, traced like any argument. A model with no
        # variable left to freeze (a copy a flatten made) is its own child, so
        # `pz.select(...).at(...)` finds the layers it picked in it.
        target = self.target
        return (frozen_variables(target) if penzai_variables(target) else target,)

    def _frozen_flat(self):
        """The Penzai model's frozen arrays and structure, computed again only when
        one of its variables holds a new value (an eager call flattens the model
        several times)."""
        if self._frozen is None:
            variables = penzai_variables(self.target)
        else:
            variables, values, leaves, tree = self._frozen
            if all(v.value is old for v, old in zip(variables, values)):
                return tree, leaves
        values = [v.value for v in variables]
        leaves, tree = jax.tree_util.tree_flatten(frozen_variables(self.target))
        # Only values of JAX arrays can stand for themselves (a NumPy array changes in place).
        if all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(values)):
            self._frozen = (variables, values, leaves, tree)
        return tree, leaves

    @classmethod
    def tree_unflatten(cls, aux, children):
        form, data, static, layout = aux
        if form == "function":
            return cls(data, *static)
        if form == "partial":
            return cls(functools.partial(data, *children[0], **children[1]), *static)
        if form == "closure":
            copy = cls(_closure_filled(data, layout, children), *static)
            # Its children may be stand-ins (NNX nodes split, tracers): flattened again,
            # it gives them back as children, rather than what its copy's cells hold.
            copy._closed = (data, layout, tuple(children))
            return copy
        if form == "leaves":
            return cls(None, *static, leaves=(data, list(children)))
        return cls(children[0], *static)

    def __repr__(self):
        return (
            f"instrument({describe(self.target)}, tag={self._tag!r}, ops={self._ops}, "
            f"inputs={self._inputs}, attention={self._attention})"
        )

    def __call__(self, *args, **kwargs):
        # One name read: harvest keys each call by the module globals this method's own
        # code reads (so a rebound one is seen), which costs a check per name.
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        call = _Call(
            self._tag,
            self._select,
            self._ops,
            self._inputs,
            {},
            kind=self._kind,
            attention=self._attention,
        )
        if self._kind == "function":
            run = functools.partial(run_linen, call, self.target)
        else:
            parts = submodules(self.target, self._kind)
            names = [n for p, _ in parts for n in ((p, p + INPUTS) if self._inputs else (p,))]
            if self._attention:
                names += [f"{p}.{h}" for p, m in parts if _attention.is_attention(m) for h in HOOKS]
            if (
                self._where is not None
                and not self._ops
                and not any(self._select((n,)) for n in names)
            ):
                raise ValueError(
                    f"instrument: where={self._where!r} selects none of the model's submodules "
                    f"({_sample(names)})."
                )
            # Every module is wrapped (with ops=True its path names the ops inside,
            # whatever `where` selects); `sow` keeps to the selected ones.
            call.paths = {id(m): p for p, m in reversed(parts)}  # a shared module: its first path
            call.known = frozenset(call.paths.values())
            if self._kind == "penzai":
                _refuse_layer_stacks(parts, names, self._select, self._ops)
                if self._attention:
                    call.attention_paths = _attention.penzai_attention_paths(parts)
                named = jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_named_array)
                call.input_axes = tuple(
                    dict.fromkeys(n for a in named if is_named_array(a) for n in a.named_shape)
                )
            marked = (
                [(p, m) for p, m in parts if call.paths[id(m)] == p] if self._kind == "nnx" else []
            )
            if self._kind in ("equinox", "penzai"):  # pytrees: a rebuilt copy is found by structure
                call.parts = [(p, m) for p, m in parts if call.paths[id(m)] == p]
            run = functools.partial(
                _with_modules, call, {type(m) for _, m in parts}, marked, self.target
            )
        if self._ops:
            out = self._sow_ops(run, call, args, kwargs)
        else:
            out = run(*args, **kwargs)
        if not call.sown:
            raise ValueError(self._nothing_sown())
        return out

    def _sow_ops(self, run, call, args, kwargs):
        return sow_ops(run, call, args, kwargs)

    def harvest_eager_dispatch(self, policy, gives, run_walk):
        """How a transformation of this target is called eagerly: a function's
        calls through one `jax.jit` (`_eager_dispatch`); None: harvest's own way."""
        if self._kind == "function":
            return EagerDispatch(self, policy, gives, run_walk)
        if self._kind == "nnx":
            return EagerModuleDispatch(self, policy, gives, run_walk)
        return None

    def _nothing_sown(self):
        if self._where is not None:
            return f"instrument: where={self._where!r} selected nothing that {describe(self.target)} computes."
        if self._kind == "function":
            return (
                f"instrument: {describe(self.target)} applies no Flax Linen module, so it has no module sites. "
                "Pass ops=True to make every primitive's output a site, or instrument the model itself."
            )
        return (
            f"instrument: {describe(self.target)} called none of its submodules, so it has no sites. "
            "Pass ops=True for op sites."
        )


class _InstrumentedPenzai(Instrumented, Stateful):
    """An instrumented Penzai model: its `pz.StateVariable`s are state a harvest call threads."""

    def _call(self, *args, **kwargs):
        frozen = penzai_states(self.target, frozen=True)
        if not frozen:
            return super()._call(*args, **kwargs)
        # A traced copy: the model writes its state variables, so it runs on
        # mutable copies, and keeps what they hold after (for the next call,
        # and for `harvest_state`).
        live = {slot: value.unfreeze_as_copy() for slot, value in frozen.items()}
        self.target = with_states(self.target, live)
        try:
            return super()._call(*args, **kwargs)
        finally:
            self.target = with_states(self.target, {slot: v.freeze() for slot, v in live.items()})

    def _sow_ops(self, run, call, args, kwargs):
        """With ops=True, the op sites' own trace of the model takes its state
        variables' values as inputs and gives their new values as outputs, which
        the variables hold after (as the module sites' call leaves them)."""
        states = list(penzai_states(self.target, frozen=False).values())
        if not states:
            return sow_ops(run, call, args, kwargs)

        def threaded(values, *args, **kwargs):
            for variable, value in zip(states, values):
                variable.value = value
            return run(*args, **kwargs), [variable.value for variable in states]

        before = [variable.value for variable in states]
        try:
            out, after = sow_ops(threaded, call, (before, *args), kwargs)
        finally:  # the trace left its own tracers in the variables
            for variable, value in zip(states, before):
                variable.value = value
        for variable, value in zip(states, after):
            variable.value = value
        return out

    def harvest_state(self):
        return tuple(penzai_states(self.target, frozen=True).values()) or None

    def harvest_write_state(self, state):
        for variable, value in zip(penzai_states(self.target, frozen=False).values(), state):
            variable.update(value)


for _cls in (Instrumented, _InstrumentedPenzai):
    jax.tree_util.register_pytree_with_keys(
        _cls, _cls.tree_flatten_with_keys, _cls.tree_unflatten, flatten_func=_cls.tree_flatten
    )


_CHILD = object()  # in a closure's layout: the value is a child, not held in the structure


def _closure_flat(target):
    """(children, layout) of what a function target closes over and reads from its
    module, as harvest takes a plain function's (`closure_of`, `globals_read`): arrays,
    containers of them and NNX nodes as children, every other value `StaticValue` in the
    layout, so the compile-cache key sees a value rebound; None for a target that
    is not a plain function or reads nothing (a bound method's object is the key)."""
    if not inspect.isfunction(target):
        return None
    cells, reads = closure_of(target), globals_read(target)
    if not cells and not reads:
        return None
    values = (*cells, *(value for _, value in reads))
    held = tuple(v if isinstance(v, StaticValue) else _CHILD for v in values)
    children = [v for v in values if not isinstance(v, StaticValue)]
    return children, (len(cells), tuple(name for name, _ in reads), held)


def _object_key(target):
    """What a target that is not a plain function is compared by beside itself: the
    object of a bound method, or a callable object, by which object each of its
    attributes is (`_free_variables.attributes_key`), so an attribute rebound (a
    new weight array) re-traces."""
    return attributes_key(target.__self__ if inspect.ismethod(target) else target)


def _closure_filled(target, layout, children):
    """`target` closing over and reading the values a `_closure_flat` layout and its children give."""
    n, names, held = layout
    given = iter(children)
    values = [next(given) if h is _CHILD else h for h in held]
    return with_closure(target, tuple(values[:n]), tuple(zip(names, values[n:])))


def _refuse_layer_stacks(parts, names, select, ops):
    """Penzai's `LayerStack` scans over unbound copies of its layers, which the
    table of paths cannot tell apart (their parameters are slots, and layers
    without parameters all look alike): sites under one would be misnamed or
    missed, so selecting one is an error rather than silently wrong names."""
    from penzai.nn.layer_stack import LayerStack

    for path, module in parts:
        if isinstance(module, LayerStack):
            inside = [n for n in names if n.startswith(path + ".") and select((n,))]
            if inside or ops:
                raise _errors.penzai_layer_stack(path, inside[:2])


def _sample(names, k=6):
    if not names:
        return "it has none"
    names = sorted(names, key=lambda n: (n.count("."), n))  # the outermost first
    more = f", ... ({len(names)} in all)" if len(names) > k else ""
    return "they are " + ", ".join(map(repr, names[:k])) + more


def _with_modules(call, classes, marked, model, *args, **kwargs):
    _wrap(classes)
    _mark(marked)
    token = _active.set(call)
    try:
        return model(*args, **kwargs)
    finally:
        _active.reset(token)
        _unmark(marked)
        _unwrap(classes)


def instrument(
    target: Callable[P, R],
    *,
    tag: str = "modules",
    ops: bool = False,
    inputs: bool = False,
    where: NameSelect = None,
    attention: bool = False,
) -> Callable[P, R]:
    """Returns ``target`` with its parts sown under ``tag``, for models nobody instrumented by hand.

    The result is called exactly as ``target`` is and returns the same values
    (bit for bit; outside a harvest every sow is the identity), but ``reap``,
    ``plant``, ``harvest``, ``sites``, ``stream`` and the patching sweeps see sites:

    * a Flax NNX or Equinox module, or a Penzai layer: the output of every
      submodule (layer) call, named by its dotted path from the root
      (``"blocks.0.attn"``, ``"head"``); list indices and dict keys are path
      elements;
    * a plain function: the output of every Flax Linen submodule it applies,
      named by the Linen scope path joined with dots (``"blocks_0.attn"``);
    * with ``ops=True``, any callable: also every primitive's output, named
      ``"<scope>/<primitive>:<n>"`` from the ``jax.named_scope`` stack (module
      paths included) and a counter per scope and primitive; ops inside ``scan``,
      ``cond``, ``jit`` and ``checkpoint`` are sites too;
    * with ``inputs=True``, module targets and Linen: also each submodule call's
      array arguments, named ``"<path>:in"`` (one argument: the array itself;
      several: a tuple of them; flags, None and PRNG keys are left out).
      Planting there replaces what the submodule receives.
    * with ``attention=True``: TransformerLens's hook sites on each attention
      module of a known kind (below).

    A site sown once holds the value itself; one sown k times (a shared module,
    a layer inside ``scan``) holds the k values stacked on a leading axis, and
    takes plants of either shape.

    A Penzai model's variables are traced as their frozen values; each
    ``pz.StateVariable`` it writes (a KV cache of Penzai's sampling mode) is
    given its new value after each harvest call, as the model's own call would
    leave it.

    Args:
        target: the model: a Flax NNX module, an Equinox module, a Penzai layer
            (``pz.nn.Layer``), or any callable (for Linen, the function that calls
            ``model.apply``; any function with ``ops=True``).
        tag: the tag the sites are sown under; pass the same ``tag`` to ``reap``,
            ``plant`` and ``sites``.
        ops: also sow every primitive's output (``"<scope>/<primitive>:<n>"``).
        inputs: also sow each submodule call's array arguments (``"<path>:in"``).
        where: which sites to sow, picked before anything is traced: a name, a
            glob pattern, a predicate on names, or a list of them (None: all).
        attention: also give each attention module of a known kind (NNX
            ``MultiHeadAttention``, Linen ``MultiHeadDotProductAttention``, Equinox
            ``MultiheadAttention``, Penzai ``pz.nn.Attention``, Gemma's ``Attention``)
            TransformerLens's sites ``"<path>.hook_q"``, ``.hook_k``, ``.hook_v``,
            ``.hook_z`` (``[..., seq, heads, d_head]``) and ``.hook_pattern`` (the
            post-softmax weights, ``[..., heads, q_pos, k_pos]``).

    Returns:
        A callable with ``target``'s signature and outputs (a pytree, so it can
        be passed through ``jax.jit``) whose parts are sites of ``tag``.

    Raises:
        TypeError: if ``target`` is none of the kinds above, ``tag`` is not a
            non-empty string, or ``ops``/``inputs``/``attention`` is not a bool.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from harvest import instrument, reap, plant
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.layers = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])
        ...     def __call__(self, x):
        ...         return self.layers[1](nnx.relu(self.layers[0](x)))
        >>> model = instrument(MLP(nnx.Rngs(0)))
        >>> {k: v.shape for k, v in reap(model, tag="modules")(jnp.ones(2)).items()}
        {'layers.0': (3,), 'layers.1': (1,)}
        >>> plant(model, tag="modules")({"layers.1": jnp.zeros(1)}, jnp.ones(2))
        Array([0.], dtype=float32)
    """
    kind = target_kind(target)
    if kind is None:
        raise TypeError(
            f"instrument needs a Flax NNX module, an Equinox module, a Penzai layer or a callable, got a "
            f"{type(target).__name__}. For a Linen model, instrument the function that applies it, "
            "e.g. instrument(lambda x: model.apply(variables, x))."
        )
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"instrument needs `tag` to be a non-empty string, got {tag!r}.")
    if not isinstance(ops, bool):
        raise TypeError(f"instrument needs `ops` to be True or False, got {ops!r}.")
    if not isinstance(inputs, bool):
        raise TypeError(f"instrument needs `inputs` to be True or False, got {inputs!r}.")
    if not isinstance(attention, bool):
        raise TypeError(f"instrument needs `attention` to be True or False, got {attention!r}.")
    select = NameFilter.make(where)
    if isinstance(where, list):
        where = tuple(where)
    cls = _InstrumentedPenzai if kind == "penzai" else Instrumented
    return cls(target, kind, tag, ops, inputs, select, where, attention)
