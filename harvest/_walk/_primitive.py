"""The `sow` primitive: an identity that leaves a named marker in a jaxpr.

Every rule here is the identity on values. The marker matters only to the
interpreter (`_interpreter.py`), which finds it by walking a jaxpr. Two details
make it survive the journey there:

* While a harvest traces the function it will walk (`tracing_for_harvest`), a
  sow carries an effect, so a bare `sow` whose result is unused is not removed
  by dead-code elimination or partial evaluation (`grad` of a `scan`, say)
  before the walk sees it. Everywhere else it carries none: any effect in a
  jitted program turns off JAX's fast C++ dispatch path, and a sow nobody
  harvests must cost nothing. Whether a harvest is tracing is part of JAX's
  trace-cache key, so a `jax.jit` traced outside a harvest (its bare sows
  maybe dropped) is traced afresh, with the effect, inside one.
* Its JVP re-binds it on primals only: a tangent is never sown, so `reap` of a
  differentiated function sees each forward value once. Likewise under
  `jax.experimental.jet` only the primal is sown.

Outside a harvest a sow is the identity for every JAX transformation. Under
`jax.linear_transpose` the transposed function computes no forward value, so
the site sows what does flow through it: the cotangent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .. import _jax
from ._modes import MODES

# The `mode` param names a mode of `_modes.MODES`.
# `vmapped` (absent: none) counts, per leaf, the leading axes that vmaps
# around the sow put in front, so one per-example plant can be broadcast.
# `role` (absent: both) splits a sow in a branch that vmap runs for every
# example (see `_rules/batched_cond.py`): "plant_only" takes plants where it
# stands; "record_only", sown after the branches' outputs are selected per
# example, records and carries a trailing operand saying whether the taken
# branch sowed the value (for `sow_cond`, also whether `pred` held).
# `axes` (absent: none) names, per leaf, each axis (a str, or None for an
# unnamed one): Penzai's named axes, which `sites` shows.
# `element` (absent: none) is `(j, size, part, both)` on a collect sow sown
# once per element of a batched `lax.map` (see `_rules/batched_lax_map.py`):
# element `j` of a batch of `size`, in its scan of full batches or its
# remainder (`part`), and for a remainder whether that map ran full batches
# first (`both`; None for full batches); and
# `(j, vmap)` on an `append` sow unrolled there: element `j` of the `jax.vmap`
# call numbered `vmap`, counted to refuse a name sown twice per element.
# `vmaps` (absent: not counted) numbers, innermost first, the `jax.vmap` calls
# that batched the sow while harvest looked for a batched `lax.map`'s (see
# `_rules/batched_lax_map.py`).


class SowEffect(_jax.Effect):
    """Marks `sow` as effectful, while a harvest traces, so dead-code elimination keeps it."""

    def __hash__(self):
        return hash(type(self))

    def __eq__(self, other):
        return type(self) is type(other)

    def __repr__(self):
        return "Sow"


sow_effect = SowEffect()
_jax.allow_effect(SowEffect)

_harvest_tracing = _jax.trace_flag(
    "harvest_tracing", "Set by harvest while it traces a function to walk; gives `sow` its effect."
)


def tracing_for_harvest():
    """A context in which traced sows carry their effect: wrap the tracing of
    every function a harvest will walk (or search for sows) in it."""
    return _harvest_tracing(True)


def tracing_a_harvest() -> bool:
    """Whether a harvest is tracing now (inside `tracing_for_harvest`)."""
    return bool(_harvest_tracing.value)


# The (tag, path) of the sites that `vmap` batches even where their value does not
# depend on the batched input: a plant holding one value per example asks for it
# (see `_transforms`). Part of jit's cache key, so no trace is reused across.
_batched_sites = _jax.trace_value(
    "harvest_batched_sites", "Sites harvest batches under every vmap around them."
)


def batching_sites(sites: frozenset) -> Any:
    """A context in which traced sows of `sites`, ``{(tag, path)}``, are batched
    by every vmap around them (their value broadcast), so a plant can hold one
    value per example."""
    if _batched_sites is None:
        return contextlib.nullcontext()
    return _batched_sites(sites or None)


def _batched_here(tag: Any, path: tuple) -> bool:
    sites = _batched_sites.value if _batched_sites is not None else None
    return sites is not None and (tag, path) in sites


# A handler every `sow_p.bind` consults first, set while a custom_vjp's backward
# rule re-runs a body with plants in it (see `_rules/calls`): the sows it
# plants bind as the plant applied, before any transformation sees them, so
# the rule differentiates the planted function. Part of jit's cache key, so
# no jitted function inside the rule reuses a trace made without it.
_bind_handler = _jax.trace_value(
    "harvest_sow_bind_handler", "What harvest binds a sow as, inside a custom_vjp's rule."
)

# Whether this JAX lets harvest set one (else a plant there is refused, see `_rules/calls`).
BIND_HANDLERS = _bind_handler is not None


def sows_bound_by(handler: Callable[[tuple, dict], Any]) -> Any:
    """A context in which each `sow_p.bind(*args, **params)` first asks
    ``handler(args, params)`` for its outputs (None: bind as usual)."""
    assert _bind_handler is not None
    return _bind_handler(handler)


class _SowPrimitive(_jax.Primitive):
    def bind(self, *args: Any, **params: Any) -> Any:
        handler = _bind_handler.value if _bind_handler is not None else None
        if handler is not None:
            with _bind_handler(None):  # what the handler binds is bound as usual
                out = handler(args, params)
            if out is not None:
                return out
        return super().bind(*args, **params)


sow_p = _SowPrimitive("sow")
sow_p.multiple_results = True


def _has_pred(mode, role=None):
    # `sow_cond` sites, and record-only sows, carry a predicate as a trailing operand.
    return MODES[mode].has_pred or role == "record_only"


def _sow_impl(*args, mode, role=None, **_):
    return list(args[:-1] if _has_pred(mode, role) else args)


def _sow_abstract_eval(*avals, mode, role=None, **_):
    outs = avals[:-1] if _has_pred(mode, role) else avals
    # `instrument`'s sows replace a value that flows on, so they are never bare
    # and need no effect to survive, even while a harvest traces.
    return list(outs), (
        {sow_effect} if _harvest_tracing.value and not MODES[mode].replaces_value else set()
    )


def _sow_lowering(ctx, *args, mode, role=None, **_):
    return list(args[:-1] if _has_pred(mode, role) else args)


def _sow_jvp(primals, tangents, **params):
    out = sow_p.bind(*primals, **params)
    if _has_pred(params["mode"], params.get("role")):
        tangents = tangents[:-1]
    return out, [_jax.instantiate_zeros(t) for t in tangents]


def _sow_transpose(cts, *args, **params):
    # Only the sown leaves are linear; a sow_cond predicate is a known primal.
    pred = list(args[-1:]) if _has_pred(params["mode"], params.get("role")) else []
    out = sow_p.bind(*[_jax.instantiate_zeros(ct) for ct in cts], *pred, **params)
    return [*out, *(None for _ in pred)]


def _sow_jet(primals, series, **params):
    out = sow_p.bind(*primals, **params)
    return out, series[: len(out)]


def _sow_batch(
    axis_data,
    args,
    dims,
    *,
    tag,
    name,
    scope,
    mode,
    tree,
    vmapped=(),
    role=None,
    axes=None,
    element=None,
    vmaps=None,
):
    # Batched leaves get the batch axis in front, so a value reaped from a
    # vmapped function leads with it; unbatched leaves stay unbatched, so sow
    # never changes what vmap (or jacfwd, hessian) sees.
    if (_has_pred(mode, role) and dims[-1] is not None) or (
        any(d is None for d in dims) and _batched_here(tag, scope + (name,))
    ):
        # A batched predicate picks per example (or a plant is given per example),
        # so every leaf becomes per example.
        args = [_jax.bdim_at_front(a, d, axis_data) for a, d in zip(args, dims)]
        dims = [0] * len(args)
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    n = tree.num_leaves
    vmapped = tuple(k + (d is not None) for k, d in zip(vmapped or (0,) * n, dims))
    extra = {} if role is None else {"role": role}
    if element is not None:
        # A sow a batched `lax.map` unrolled, batched again by a vmap around the
        # map: still that element's (the vmap's axis leads, as around any loop).
        extra["element"] = element
    if vmaps is not None:
        extra["vmaps"] = vmaps
    if axes is not None:  # the batch axis in front has no name
        extra["axes"] = tuple(
            names if d is None else (None, *names) for names, d in zip(axes, dims)
        )
    out = sow_p.bind(
        *args, tag=tag, name=name, scope=scope, mode=mode, tree=tree, vmapped=vmapped, **extra
    )
    return out, [None if d is None else 0 for d in dims[:n]]


sow_p.def_impl(_sow_impl)
sow_p.def_effectful_abstract_eval(_sow_abstract_eval)
_jax.register_lowering(sow_p, _sow_lowering)
_jax.jvp_rules[sow_p] = _sow_jvp
_jax.transpose_rules[sow_p] = _sow_transpose
_jax.jet_rules[sow_p] = _sow_jet
_jax.register_batching(sow_p, _sow_batch)
