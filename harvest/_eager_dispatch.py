"""Eager calls of an instrumented function through JAX's own dispatch: one cached `jax.jit`.

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
(`_calling.closure_of`, `globals_read`), in its structure, which is compared
here at each call: a new structure (a value rebound) gets a jit of its own,
replacing the last. The first call traces and compiles once, as harvest's
own path would.

Where `jax.jit` would take an argument otherwise than harvest's convention
does, the call goes harvest's own way, and so does every later call of that
transformed function (this one is then known not to be served):

* a Python number or bool among the leaves, which harvest keeps static and
  `jax.jit` would trace: told, while tracing, by a scalar weak-typed or bool
  value (a JAX array of that kind too, to be safe);
* a leaf that is not an array (a string, a callable), which `jax.jit` refuses
  before it traces;
* an NNX graph node or an object with state of its own (`Stateful`), whose
  state a harvest call writes back to the caller's objects;
* a program that fails after its trace (a primitive without a lowering).

An error raised while tracing the walk (a misspelt ``allowlist`` name, say)
is raised again by harvest's own path, so errors are exactly its own. Plants
holding anything but arrays (callables, numbers) go harvest's own way too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _jax
from ._calling import array_flags, holds_no_nodes, reveal_static
from ._compile_cache import note_trace
from ._paths import nested_dict

NOT_TAKEN: Any = object()  # what a dispatch returns for a call it leaves to harvest's own path

# Where the call being dispatched is: its trace of the walk started, or ended.
_WAITING, _TRACING, _TRACED = range(3)


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
        self.stage = _WAITING  # how far the current call's trace got (a trace runs only on a miss)
        # The function's structure (what it closes over, but arrays) and the jit for it.
        self.structure: Any = None
        self.jitted: Any = None

    def _walk_staged(
        self,
        structure: Any,
        children: list[Any],
        plants: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        self.stage = _TRACING
        f = type(self.f).tree_unflatten(structure, children)
        tree = (f, plants, args, kwargs)
        leaves = jax.tree_util.tree_leaves(tree)
        if any(map(_maybe_a_python_scalar, leaves)) or not holds_no_nodes(tree):
            self.stage = _TRACED
            raise _Refused
        # Traces alike but for the values closed over count together, for the warning.
        alike = (self.policy, self.reap, jax.tree_util.tree_structure((plants, args, kwargs)))
        note_trace(getattr(f, "target", f), leaves, alike)
        out, flat = self.run_walk(f, self.policy, self.reap, plants, args, kwargs, finish=False)
        self.stage = _TRACED
        return (out if self.out else None), flat

    def __call__(self, plants: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.served or not _jax.is_eager() or getattr(jax.config, "jax_disable_jit", False):
            return NOT_TAKEN
        if plants and not all(array_flags(jax.tree_util.tree_leaves(plants))):
            return NOT_TAKEN  # callables and numbers: harvest makes them data its own way
        self.stage = _WAITING
        try:
            # The function is flattened and its structure compared here, not by JAX, whose
            # C++ path hashes and compares a Python node's data at some 50 µs a call more.
            children, structure = self.f.tree_flatten()
            if self.jitted is None or structure != self.structure:
                # A value it closes over rebound: a jit of its own (the last one's programs go).
                self.structure = structure
                self.jitted = jax.jit(functools.partial(self._walk_staged, structure))
            out, flat = self.jitted(children, plants, args, kwargs)
        except Exception:
            # An error of the walk's own trace is raised again by harvest's path; any
            # other failure means this jit cannot serve such calls.
            if self.stage != _TRACING:
                self.served = False
            return NOT_TAKEN
        return reveal_static(out), nested_dict(flat)


def _maybe_a_python_scalar(leaf: Any) -> bool:
    """Whether a traced leaf may have been a Python number or bool: a scalar weak-typed or bool."""
    aval = getattr(leaf, "aval", None)
    if aval is None:
        return True
    return aval.shape == () and (getattr(aval, "weak_type", False) or aval.dtype == np.bool_)
