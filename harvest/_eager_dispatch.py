"""Eager calls of an instrumented function or NNX module through JAX's own dispatch: one cached `jax.jit`.

Harvest's own path for an eager call (`_transforms.run_walk`) flattens the
call's parts and builds and compares its compile-cache key in Python: for a
Linen model's `variables`, hundreds of arrays in nested dicts, that is some
hundreds of µs a call, where `jax.jit(g)(variables, x)` flattens and matches the
same pytrees in C++ in a few. So a transformation of an instrumented function
(`reap(instrument(model.apply))`; any `instrument(f)` of a function, Linen or
``ops=True``) called while nothing traces runs through a `jax.jit` kept by
the transformed function, whose arguments are the instrumented function's
children, the plants and the call's arguments, and whose body is harvest's
walk staged in place, as under the user's own `jax.jit(reap(f))`. JAX's cache
key holds the trees' structures and the arrays' shapes and dtypes; the
instrumented function's flattening (`Instrumented.tree_flatten`) gives what
the function closes over and the module-level values it reads, its arrays
as children (traced) and its other values, by identity and value
(`_free_variables.closure_of`, `globals_read`), in its structure, which is compared
here at each call: a new structure (a value rebound) gets a jit of its own,
kept in the compile table (`_compile_cache.program`) beside the others. The
first call traces and compiles once, as harvest's own path would.

An instrumented NNX module (`EagerModuleDispatch`) is not flattened as a
pytree (NNX's Python flatten of every node and variable costs more than the
call): it is split as harvest's own path splits it, through the kept split
(`_nnx_state._SplitCache`, whose check at each call sees every attribute of
every node by identity, so weights changed in place are read and any
structural change re-splits), and the jit's arguments are the state's arrays
as one flat tuple, the plants and the call's arguments. The split's graph
and state definitions and the instrumented target's static part are the
structure, compared by identity first (a kept split hands its definitions
back), then by equality in the compile table, whose ``"module"`` programs
every transformed function shares (`_compile_cache.program`): a model switched between training
and evaluation keeps both programs, and ``reap(instrument(model))`` written
afresh at each call, or for another model of the same structure, finds its own. Inside the trace, fresh nodes
are merged from the traced state and walked; what the walk changed or added
in them (RNG counts, batch statistics, ``nnx.Intermediate``s) leaves the jit
as data and is written back to the caller's module after the call
(`_nnx_state.write_back`, as harvest's own path does).

Where `jax.jit` would take an argument otherwise than harvest's convention
does, the call goes harvest's own way, and so does every later call of that
transformed function (this one is then known not to be served):

* a Python number or bool among the leaves, which harvest keeps static and
  `jax.jit` would trace: told, while tracing, by a scalar weak-typed or bool
  value (a JAX array of that kind too, to be safe);
* a leaf that is not an array (a string, a callable), which `jax.jit` refuses
  before it traces;
* an NNX graph node among the arguments or plants, or an object with state
  of its own (`Stateful`), whose state a harvest call writes back to the
  caller's objects (an instrumented module's own state is written back here);
* for a module, a state holding anything but arrays (a Python number in a
  variable, which harvest traces as data), this call only;
* a program that fails after its trace (a primitive without a lowering).

An error raised while tracing the walk (a misspelt ``allowlist`` name, say)
is raised again by harvest's own path, so errors are exactly its own. Plants
holding anything but arrays (callables, numbers) go harvest's own way too.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _jax, config
from ._compile_cache import Program, note_trace, program, touch
from ._leaves import array_flags, reveal_static
from ._nnx_state import call_on_merged, split_of, write_back
from ._paths import nested_dict
from ._stateful import holds_no_nodes

NOT_TAKEN: Any = object()  # what a dispatch returns for a call it leaves to harvest's own path

# Where the call being dispatched is: its trace of the walk started, or ended.
_WAITING, _TRACING, _TRACED = range(3)
_calls = threading.local()  # `stage`: how far this thread's dispatched call traced


class _Refused(Exception):
    """Raised while tracing a call that `jax.jit` took otherwise than harvest would."""


class EagerDispatch:
    """One transformed function's eager calls through one `jax.jit` (see the module's docstring).

    Called as ``dispatch(plants, args, kwargs)``, it returns the walk's
    ``(out, reaps)``, or `NOT_TAKEN` for a call left to harvest's own path.
    """

    def __init__(self, f: Any, policy: Any, gives: str, run_walk: Callable[..., Any]) -> None:
        self.f, self.policy, self.run_walk = f, policy, run_walk
        # What the transformation returns (`_transforms.transform`'s `gives`): the walk
        # reaps only if the reaps are returned, and the output is left to XLA to drop
        # (a model's logits, say) if it is not.
        self.reap, self.out = gives != "out", gives != "reaps"
        self.served = True  # False once a call was found that this jit cannot serve
        # The last call's structure and its program in the compile table (held weakly:
        # the table owns it), so that a call like the last skips the table's lookup.
        # One pair, read once by a call: another thread may replace it meanwhile.
        self.last: tuple[Any, Any] = (None, _no_program)

    def _walk_staged(
        self,
        structure: Any,
        children: list[Any],
        plants: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        f = type(self.f).tree_unflatten(structure, children)
        tree = (f, plants, args, kwargs)
        call = _trace_begins(tree)
        leaves = jax.tree_util.tree_leaves(tree)
        # Traces alike but for the values closed over count together, for the warning.
        alike = (self.policy, self.reap, jax.tree_util.tree_structure((plants, args, kwargs)))
        note_trace(getattr(f, "target", f), leaves, alike)
        out, flat = self.run_walk(f, self.policy, self.reap, plants, args, kwargs, finish=False)
        reaped = _Reaped.of(flat)
        call[0] = _TRACED
        return (out if self.out else None), reaped

    def _starts(self, plants: Any) -> list[int] | None:
        """This thread's call's stage, reset, if this jit may serve a call planting
        ``plants`` (None: harvest's own path)."""
        if (
            not self.served
            or not _jax.is_eager()
            or getattr(jax.config, "jax_disable_jit", False)
            or config.check_stale  # harvest's own path checks each call
        ):
            return None
        if plants and not all(array_flags(jax.tree_util.tree_leaves(plants))):
            return None  # callables and numbers: harvest makes them data its own way
        call: list[int] = _calls.__dict__.setdefault("stage", [_WAITING])
        call[0] = _WAITING
        return call

    def __call__(self, plants: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = self._starts(plants)
        if call is None:
            return NOT_TAKEN
        try:
            # The function is flattened and its structure compared here, not by JAX, whose
            # C++ path hashes and compares a Python node's data at some 50 µs a call more.
            children, structure = self.f.tree_flatten()
            last, held = self.last
            entry = held()
            if entry is None or structure != last or not touch(entry):
                # A value it closes over rebound: the program for that structure.
                entry = program(self, structure, functools.partial(_function_jit, self, structure))
                if entry is None:  # a structure that cannot be hashed: harvest's own path
                    return NOT_TAKEN
                self.last = (structure, weakref.ref(entry))
            out, flat = entry.jitted(children, plants, args, kwargs)
        except Exception:
            # An error of the walk's own trace is raised again by harvest's path; any
            # other failure means this jit cannot serve such calls.
            if call[0] != _TRACING:
                self.served = False
            return NOT_TAKEN
        return (reveal_static(out) if self.out else None), flat.reaps


def _function_jit(dispatch: EagerDispatch, structure: Any, entry: Program) -> Any:
    """The jit of ``dispatch``'s walk for ``structure``, holding ``dispatch`` weakly
    (the table holds the jit, and drops it when ``dispatch`` is collected)."""
    weak = weakref.ref(dispatch)

    def staged(*parts: Any) -> Any:
        alive = weak()
        assert alive is not None, "traced after its transformed function was collected"
        return alive._walk_staged(structure, *parts)

    return jax.jit(staged)


def _no_program() -> None:
    """What `last` holds before a first call: a reference to no program."""
    return None


class _Reaped:
    """A walk's reaps leaving the jit as the dict a caller gets: a pytree whose
    structure holds their paths (in program order) and, when no name is scoped,
    the names, so that JAX's unflattening of the outputs builds the dict (at C
    speed, for one level of names) and no pass over it follows."""

    __slots__ = ("names", "paths", "reaps")

    def __init__(self, paths: tuple[Any, ...], names: tuple[str, ...] | None, values: Any) -> None:
        self.paths, self.names = paths, names
        values = list(values)
        if names is not None:
            self.reaps = dict(zip(names, values))
        else:
            self.reaps = nested_dict(dict(zip(paths, values)))

    @classmethod
    def of(cls, flat: dict[tuple[str, ...], Any]) -> _Reaped:
        """The reaps ``{path: value}`` (a walk's, in program order); the paths of
        nested names are checked here, while tracing."""
        paths = tuple(flat)
        names = tuple(p[0] for p in paths) if all(len(p) == 1 for p in paths) else None
        return cls(paths, names, flat.values())

    def values(self) -> list[Any]:
        if self.names is not None:
            return list(self.reaps.values())
        return [_at(self.reaps, path) for path in self.paths]


def _at(nested: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        nested = nested[key]
    return nested


jax.tree_util.register_pytree_node(
    _Reaped, lambda r: (r.values(), (r.paths, r.names)), lambda aux, v: _Reaped(*aux, v)
)


def _trace_begins(tree: Any) -> list[int]:
    """Marks this thread's dispatched call as tracing and returns its stage; raises
    `_Refused` (marked traced) if ``tree`` holds what `jax.jit` takes otherwise than
    harvest: a leaf that may have been a Python number or bool, or an NNX node."""
    call: list[int] = _calls.stage
    call[0] = _TRACING
    if any(map(_maybe_a_python_scalar, jax.tree_util.tree_leaves(tree))) or not holds_no_nodes(
        tree
    ):
        call[0] = _TRACED
        raise _Refused
    return call


def _maybe_a_python_scalar(leaf: Any) -> bool:
    """Whether a traced leaf may have been a Python number or bool: a scalar weak-typed or bool."""
    aval = getattr(leaf, "aval", None)
    if aval is None:
        return True
    return aval.shape == () and (getattr(aval, "weak_type", False) or aval.dtype == np.bool_)


class EagerModuleDispatch(EagerDispatch):
    """An instrumented NNX module's eager calls through one `jax.jit` per structure.

    The module is split as harvest's own path splits it (the kept split, checked
    at each call, `_nnx_state._SplitCache`), and its state's arrays are the jit's
    first argument: a flat tuple JAX's C++ path flattens and matches. The split's
    graph and state definitions and the instrumented target's static part are
    the structure, compared by identity first; inside the trace, fresh nodes are
    merged from the traced state and an instrumented copy holding them is
    walked, and the state the walk changed or added comes out as data, written
    back to the caller's module after the call, as harvest's own path writes it.
    The jits are shared by every transformed function of the same kind, policy
    and structure (the compile table's ``"module"`` programs), so ``reap(instrument(model))(x)`` written
    afresh at each call, or for another model of that structure, traces once.
    """

    def __init__(self, f: Any, policy: Any, gives: str, run_walk: Callable[..., Any]) -> None:
        super().__init__(f, policy, gives, run_walk)
        # What the program depends on besides the structure.
        self.kind = (type(f), policy, gives, run_walk)

    def __call__(self, plants: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = self._starts(plants)
        if call is None:
            return NOT_TAKEN
        try:
            (module,), aux = self.f.tree_flatten()
            apart = split_of((module,)).apart()
            if apart is None:
                return NOT_TAKEN  # numbers or other values in its state: traced harvest's way
            shape, leaves = apart
            jitted = self._jit_for(shape, aux, module)
            out, reaped, changes = jitted(leaves, plants, args, kwargs)
        except Exception:
            # An error of the walk's own trace is raised again by harvest's path; any
            # other failure means this jit cannot serve such calls.
            if call[0] != _TRACING:
                self.served = False
            return NOT_TAKEN
        if changes is not None:
            write_back((module,), changes)
        return (reveal_static(out) if self.out else None), reaped.reaps

    def _jit_for(self, shape: Any, aux: Any, module: Any) -> Any:
        """The jit for this structure: the last one's if the split is the one it was
        made for (by identity: a kept split gives its definitions back), else by equality."""
        last, held = self.last
        entry = held()
        if (
            entry is not None
            and last[0].graphdef is shape.graphdef
            and last[0].statedef is shape.statedef
            and last[1] == aux
            and touch(entry)
        ):
            return entry.jitted
        key = (*self.kind, shape, aux)
        code = type(module).__call__  # what a recompile warning names: the model's code
        entry = program(
            "module", key, lambda _: jax.jit(functools.partial(_module_walk_staged, key, code))
        )
        if entry is None:  # a definition that cannot be hashed: compiled for this call
            return jax.jit(functools.partial(_module_walk_staged, key, code))
        self.last = ((shape, aux), weakref.ref(entry))
        return entry.jitted


def _module_walk_staged(
    key: Any,
    code: Any,
    leaves: tuple[Any, ...],
    plants: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The walk of an instrumented module merged from ``leaves`` (see `EagerModuleDispatch`)."""
    kind, policy, gives, run_walk, shape, aux = key
    given = (plants, args, kwargs)
    call = _trace_begins(given)
    alike = (policy, gives, shape, aux, jax.tree_util.tree_structure(given))
    note_trace(code, leaves, alike)

    def walk(module: Any) -> Any:
        copy = kind.tree_unflatten(aux, (module,))
        return run_walk(copy, policy, gives != "out", plants, args, kwargs, finish=False)

    (out, flat), changes = call_on_merged(walk, shape.filled(leaves), 1)
    reaped = _Reaped.of(flat)
    call[0] = _TRACED
    # No state changed (a plain forward): nothing to hand out, nothing to write back.
    return (out if gives != "reaps" else None), reaped, (changes if changes.paths else None)
