"""Inverting a program: from its output back to its draws, with the log-det-Jacobian.

`log_prob(f)(y)` traces `f` with a placeholder key and asks, for every draw
that `y` depends on, which value the draw must have taken for `f` to return
`y`. The walk goes over the program's jaxpr (calls inlined) and repeats two
moves until nothing changes:

* forward: an equation whose inputs are all known is evaluated (the
  distributions' parameters, the densities);
* backward: an equation whose outputs are known and which has an inverse
  rule below gets its unknown input back, and the log-det-Jacobian of the
  inverse (ILDJ, `log |dx/dy|` summed over elements) is added to that input.

The key is never known, so nothing random is recomputed: draws are only
recovered backwards. The log density is then the sum, over the draws `y`
depends on, of each draw's density at its recovered value plus the ILDJ
accumulated on the way back to it. Draws `y` does not depend on integrate
out and are left alone.

Invertible primitives (with the operand that may be unknown; the others must
be known, i.e. computed from the program's arguments and constants):

| primitive | inverse | ILDJ per element |
| --- | --- | --- |
| `exp`, `log` | `log`, `exp` | `-log(y)`, `y` |
| `expm1`, `log1p` | `log1p`, `expm1` | `-log1p(y)`, `y` |
| `tanh` | `atanh` | `-log(1 - y^2)` |
| `logistic` (`jax.nn.sigmoid`) | `log(y) - log1p(-y)` | `-log(y) - log1p(-y)` |
| `logaddexp` with one known operand (`jax.nn.softplus`) | `y + log1p(-exp(c - y))` | `-log1p(-exp(c - y))` |
| `sqrt` | `y^2` | `log(2y)` |
| `neg`, `copy`, `convert_element_type` (float to float) | same | 0 |
| `add`, `sub` (either operand) | subtract / add the known one | 0 |
| `mul` (either operand), `div` (numerator) | divide / multiply by the known one | `-log|c|`, `log|c|` |
| `reshape`, `squeeze`, `broadcast_in_dim` adding unit axes, `transpose` | the reverse reshape / permutation | 0 |
| `cumsum` | differences | 0 |
| `sow` (any tag) | identity | 0 |

An operand that was broadcast (its shape is smaller than the output's) is
not invertible. Anything else stops the walk there; if a draw the output
depends on cannot be reached, `log_prob` raises an error that names the
equations it could not invert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax
from .._calling._tracing import make_jaxpr
from .._walk._evaluator import bind, evaluate
from .._walk._higher_order import describe
from .._walk._primitive import sow_p, tracing_for_harvest


class NotInvertible(Exception):
    """An inverse rule cannot invert this equation with what is known."""


# primitive -> rule(eqn, invals, outvals) -> ({input index: value}, ildj).
# `invals` holds None for unknown inputs; `ildj` is a scalar (summed).
INVERSES: dict[Any, Callable] = {}


def _register(*prims):
    def deco(rule):
        for p in prims:
            INVERSES[p] = rule
        return rule

    return deco


def _unary(prim, inverse, ildj):
    """A rule for `y = prim(x)`: x = inverse(y), per-element ILDJ ildj(y)."""

    def rule(eqn, invals, outvals):
        (y,) = outvals
        return {0: inverse(y)}, jnp.sum(ildj(y))

    INVERSES[prim] = rule


_unary(_jax.lax_primitives.exp_p, jnp.log, lambda y: -jnp.log(y))
_unary(_jax.lax_primitives.log_p, jnp.exp, lambda y: y)
_unary(_jax.lax_primitives.expm1_p, jnp.log1p, lambda y: -jnp.log1p(y))
_unary(_jax.lax_primitives.log1p_p, jnp.expm1, lambda y: y)
_unary(_jax.lax_primitives.tanh_p, jnp.arctanh, lambda y: -jnp.log1p(-jnp.square(y)))
_unary(
    _jax.lax_primitives.logistic_p,
    lambda y: jnp.log(y) - jnp.log1p(-y),
    lambda y: -jnp.log(y) - jnp.log1p(-y),
)
_unary(_jax.lax_primitives.sqrt_p, jnp.square, lambda y: jnp.log(2.0 * y))
_unary(_jax.lax_primitives.neg_p, jnp.negative, lambda y: jnp.zeros_like(y))
_unary(_jax.lax_primitives.copy_p, lambda y: y, lambda y: jnp.zeros_like(y))


@_register(_jax.lax_primitives.convert_element_type_p)
def _convert(eqn, invals, outvals):
    aval = eqn.invars[0].aval
    if not (
        jnp.issubdtype(aval.dtype, jnp.floating)
        and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)
    ):
        raise NotInvertible
    return {0: outvals[0].astype(aval.dtype)}, 0.0


def _the_unknown(eqn, invals):
    """Index of the single unknown operand, which must not have been broadcast."""
    unknown = [i for i, v in enumerate(invals) if v is None]
    if len(unknown) != 1:
        raise NotInvertible
    (i,) = unknown
    if eqn.invars[i].aval.shape != eqn.outvars[0].aval.shape:
        raise NotInvertible
    return i


def _out_sized(c, eqn):
    return jnp.broadcast_to(c, eqn.outvars[0].aval.shape)


@_register(_jax.lax_primitives.add_p)
def _add(eqn, invals, outvals):
    i = _the_unknown(eqn, invals)
    return {i: outvals[0] - invals[1 - i]}, 0.0


@_register(_jax.lax_primitives.sub_p)
def _sub(eqn, invals, outvals):
    i = _the_unknown(eqn, invals)
    y = outvals[0]
    return {i: y + invals[1] if i == 0 else invals[0] - y}, 0.0


@_register(_jax.lax_primitives.mul_p)
def _mul(eqn, invals, outvals):
    i = _the_unknown(eqn, invals)
    c = invals[1 - i]
    return {i: outvals[0] / c}, -jnp.sum(jnp.log(jnp.abs(_out_sized(c, eqn))))


@_register(_jax.lax_primitives.div_p)
def _div(eqn, invals, outvals):
    if _the_unknown(eqn, invals) != 0:
        raise NotInvertible
    c = invals[1]
    return {0: outvals[0] * c}, jnp.sum(jnp.log(jnp.abs(_out_sized(c, eqn))))


@_register(_jax.lax_primitives.reshape_p, _jax.lax_primitives.squeeze_p)
def _reshape(eqn, invals, outvals):
    return {0: jnp.reshape(outvals[0], eqn.invars[0].aval.shape)}, 0.0


@_register(_jax.lax_primitives.broadcast_in_dim_p)
def _broadcast(eqn, invals, outvals):
    aval = eqn.invars[0].aval
    if aval.size != eqn.outvars[0].aval.size:
        raise NotInvertible  # a true broadcast copies values: not a bijection
    return {0: jnp.reshape(outvals[0], aval.shape)}, 0.0


@_register(_jax.lax_primitives.transpose_p)
def _transpose(eqn, invals, outvals):
    return {0: jnp.transpose(outvals[0], np.argsort(eqn.params["permutation"]))}, 0.0


@_register(_jax.lax_primitives.cumsum_p)
def _cumsum(eqn, invals, outvals):
    y, axis = outvals[0], eqn.params["axis"]
    if eqn.params["reverse"]:
        y = jnp.flip(y, axis)
    x = jnp.diff(y, axis=axis, prepend=jnp.zeros_like(jax.lax.slice_in_dim(y, 0, 1, axis=axis)))
    return {0: jnp.flip(x, axis) if eqn.params["reverse"] else x}, 0.0


@_register(sow_p)
def _sow(eqn, invals, outvals):
    return dict(enumerate(outvals)), 0.0


def _logaddexp(eqn, invals, outvals):
    """`y = logaddexp(x, c)` with `c` known (softplus is `logaddexp(x, 0)`)."""
    i = _the_unknown(eqn, invals)
    y, c = outvals[0], invals[1 - i]
    log1m = jnp.log1p(-jnp.exp(c - y))
    return {i: y + log1m}, -jnp.sum(_out_sized(log1m, eqn))


# Calls that are inverted whole rather than inlined, by their name.
INVERTIBLE_CALLS = {"logaddexp": _logaddexp}


# ---------------------------------------------------------------------------
# Inlining: one flat jaxpr, so the walk sees every equation.


def call_body(eqn):
    body = _jax.call_body(eqn)
    return body.jaxpr, body.consts


def is_call(eqn) -> bool:
    """Whether `eqn` runs one body once on its inputs (jit, remat, custom_jvp/vjp, ...)."""
    return bool(_jax.sub_jaxprs(eqn)) and describe(eqn).call


def _kept_whole(eqn):
    # jnp.logaddexp (and so jax.nn.softplus) is a custom_jvp function of that name.
    return (
        is_call(eqn)
        and describe(eqn).custom_rule is not None
        and _jax.body_function_name(eqn) in INVERTIBLE_CALLS
    )


def _inlining(eqn, invals):
    if is_call(eqn) and not _kept_whole(eqn):
        body, body_consts = call_body(eqn)
        return evaluate(body, body_consts, invals, _inlining)
    return bind(eqn, invals)


def trace_program(f, args, kwargs):
    """`make_jaxpr` of `f(*args, **kwargs)` by harvest's calling convention (arrays
    traced, the rest static): (closed jaxpr, output shape, the arrays). The
    jaxpr's outputs are f's, then the NNX state f changed (none in a ppl program)."""
    closed, arrays, (out_shape, _) = make_jaxpr(f, args, kwargs, return_shape=True)
    return closed, out_shape, arrays


def inline_calls(closed: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
    """The same program with jit, closed_call, remat and custom_jvp/vjp bodies inlined."""
    avals = [v.aval for v in closed.jaxpr.invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    with tracing_for_harvest():
        return jax.make_jaxpr(lambda *a: evaluate(closed.jaxpr, closed.consts, a, _inlining))(
            *specs
        )


# ---------------------------------------------------------------------------
# The walk.


@dataclasses.dataclass
class Known:
    """What the walk knows: values and, for values found backwards, their ILDJ."""

    values: dict
    ildj: dict
    stuck: dict  # primitive name -> how often it blocked the way back

    def has(self, v):
        return isinstance(v, _jax.Literal) or v in self.values

    def get(self, v):
        return v.val if isinstance(v, _jax.Literal) else self.values.get(v)

    def ildj_of(self, v):
        return self.ildj.get(v, 0.0) if isinstance(v, _jax.Var) else 0.0


def bind_eqn(eqn, invals):
    """Binds `eqn` where it was staged; a list of its outputs."""
    with _jax.eqn_context(eqn):
        outs = bind(eqn, invals)
    return outs if eqn.primitive.multiple_results else [outs]


def _inverse_rule(eqn):
    if _kept_whole(eqn):
        return INVERTIBLE_CALLS[_jax.body_function_name(eqn)]
    return INVERSES.get(eqn.primitive)


def _outvars(eqn):
    return [v for v in eqn.outvars if isinstance(v, _jax.Var) and type(v).__name__ != "DropVar"]


def propagate(jaxpr: _jax.Jaxpr, known: Known, forward: Callable | None = None):
    """Runs forward and backward moves over `jaxpr` until nothing changes.

    `forward(eqn, invals)`, when given, evaluates an equation forward (default:
    bind it); it lets a caller collect what nested bodies sow.
    """
    forward = forward or bind_eqn
    done = set()
    changed = True
    while changed:
        changed = False
        for eqn in reversed(jaxpr.eqns):
            if id(eqn) in done:
                continue
            outs = _outvars(eqn)
            ins_known = all(known.has(v) for v in eqn.invars)
            outs_known = all(known.has(v) for v in outs)
            if ins_known:
                if not outs_known:
                    vals = forward(eqn, [known.get(v) for v in eqn.invars])
                    for v, val in zip(eqn.outvars, vals):
                        if isinstance(v, _jax.Var) and not known.has(v):
                            known.values[v] = val
                done.add(id(eqn))
                changed = True
            elif outs_known and outs:
                rule = _inverse_rule(eqn)
                invals = [known.get(v) if known.has(v) else None for v in eqn.invars]
                try:
                    if rule is None:
                        raise NotInvertible
                    found, ildj = rule(eqn, invals, [known.get(v) for v in eqn.outvars])
                except NotInvertible:
                    known.stuck[str(eqn.primitive)] = known.stuck.get(str(eqn.primitive), 0) + 1
                    done.add(id(eqn))
                    continue
                carried = sum(known.ildj_of(v) for v in outs) + ildj
                for i, val in found.items():
                    v = eqn.invars[i]
                    if isinstance(v, _jax.Var) and not known.has(v):
                        known.values[v] = val
                        # A sow passes each leaf through on its own.
                        known.ildj[v] = (
                            known.ildj_of(eqn.outvars[i]) if eqn.primitive is sow_p else carried
                        )
                done.add(id(eqn))
                changed = True


def live_vars(jaxpr: _jax.Jaxpr) -> set:
    """The variables the outputs depend on."""
    live = {v for v in jaxpr.outvars if isinstance(v, _jax.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, _jax.Var))
    return live
