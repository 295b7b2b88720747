"""`log_prob` by inversion: the density of a program's output.

The program is traced with a placeholder key, its calls inlined, and the
inverse walk of `_inverse.py` recovers, from the output, every draw the
output depends on. Each such draw contributes its log density at the
recovered value plus the ILDJ gathered on the way back to it. Where a draw's
density comes from:

* a `random_variable` of a TFP distribution sows `(log density, value)`
  under `LOG_DENSITY`, computed from the value after its own sow, so the
  forward moves of the walk evaluate it once the value is known;
* a `factor` sows `(log weight, ())`: always counted;
* `densities`, a table {primitive: rule}, scores primitives directly
  (oryx's `log_prob_registry`, used by `harvest.compat.oryx`).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp

from .. import _jax
from .._calling._transforms import call_and_reap
from .._jax import sub_jaxprs
from .._walk._paths import path_str
from .._walk._primitive import sow_p
from .._walk._site import Site
from .._walk._sow_index import sites_in
from . import _errors
from ._inverse import (
    INVERSES,
    INVERTIBLE_CALLS,
    Known,
    bind_eqn,
    inline_calls,
    live_vars,
    propagate,
    trace_program,
)
from ._tags import LOG_DENSITY, RANDOM_VARIABLE

# Equations under a `jax.named_scope` of this form belong to a plate over the
# named axis `name` (harvest.compat.oryx's plate): their densities are summed
# over it.
PLATE_SCOPE = "harvest_plate[{}]"


def _plate_axes(eqn):
    if eqn is None:
        return ()
    axes = []
    for part in str(eqn.source_info.name_stack).split("/"):
        if part.startswith("harvest_plate[") and part.endswith("]"):
            axes.append(part[len("harvest_plate[") : -1])
    return tuple(axes)


def _summed(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def _trace(f, key, args, kwargs):
    closed, out_shape, arrays = trace_program(f, (key, *args), kwargs)
    return inline_calls(closed), out_shape, arrays[1:]


def _invertible_names():
    names = sorted({str(p) for p in INVERSES} | set(INVERTIBLE_CALLS))
    return ", ".join(names)


def _cannot_invert(why: str, stuck: Iterable[str], invertible: str) -> ValueError:
    """log_prob by inversion found no way back from the output to a draw (`why`)."""
    stuck = sorted(stuck)
    where = ""
    if stuck:
        where = (
            " The way back from the output stopped at: "
            + ", ".join(f"`{p}`" for p in stuck)
            + f". Invertible primitives: {invertible}."
        )
    return ValueError(
        f"Cannot compute log_prob of function: {why}.{where} Use joint_log_prob(f) with a value "
        "for every random variable, or return the missing draws from f (e.g. "
        "log_prob(joint_sample(f)))."
    )


def _cannot(why, known):
    invertible = _invertible_names() if known.stuck else ""
    return _cannot_invert(why, known.stuck, invertible)


def _holds_draws(eqn, densities):
    """Whether a nested body (scan, cond, ...) draws or scores anything."""
    for sub in sub_jaxprs(eqn):
        if any(site.tag in (RANDOM_VARIABLE, LOG_DENSITY) for site in sites_in(sub)):
            return True
        if densities and any(e.primitive in densities for e in sub.eqns):
            return True
    return False


def log_density(f, sample, args, kwargs, densities=None, plain_samplers_ok=False):
    """log p(sample | args) of the program `f(key, *args, **kwargs)`, by inversion."""
    key = jax.random.PRNGKey(0)
    closed, out_shape, arrays = _trace(f, key, args, kwargs)
    jaxpr = closed.jaxpr
    out_tree = jax.tree_util.tree_structure(out_shape)
    try:
        out_leaves = out_tree.flatten_up_to(sample)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"log_prob(f) takes a value shaped like f's output, {out_tree}; got {jax.tree_util.tree_structure(sample)}."
        ) from error

    known = Known({}, {}, {})
    known.values.update(zip(jaxpr.constvars, closed.consts))
    known.values.update(zip(jaxpr.invars[1:], arrays))
    for var, leaf in zip(jaxpr.outvars, out_leaves):
        if isinstance(var, _jax.Var) and not known.has(var):
            known.values[var] = jnp.asarray(leaf, var.aval.dtype)

    nested = []  # densities sown inside scan/cond/while bodies evaluated forward

    def forward(eqn, invals):
        if not _holds_draws(eqn, densities):
            return bind_eqn(eqn, invals)
        outs, reaped = call_and_reap(lambda *a: bind_eqn(eqn, a), tag=LOG_DENSITY)(*invals)
        nested.append((eqn, reaped))
        return outs

    propagate(jaxpr, known, forward)
    live = live_vars(jaxpr)
    defined_by = {v: e for e in jaxpr.eqns for v in e.outvars}

    total = jnp.zeros((), jnp.float32)
    scored_names = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p and eqn.params["tag"] == LOG_DENSITY:
            scored_names.add(Site.of(eqn).path)
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            site = Site.of(eqn)
            if site.tag == LOG_DENSITY:
                value_vars = [v for v in eqn.invars[1:] if isinstance(v, _jax.Var)]
                if eqn.invars[1:] and not any(v in live for v in value_vars):
                    continue  # a draw the output does not depend on: integrated out
                if not known.has(eqn.invars[0]):
                    raise _cannot(
                        f"the output depends on the random variable {path_str(site.path)!r}, "
                        "whose value cannot be recovered from the output",
                        known,
                    )
                density = _summed(jnp.sum(known.get(eqn.invars[0])), _plate_axes(eqn))
                for v in value_vars:
                    density = density + _summed(known.ildj_of(v), _plate_axes(defined_by.get(v)))
                total = total + density
            elif (
                site.tag == RANDOM_VARIABLE
                and not plain_samplers_ok
                and site.path not in scored_names
                and any(v in live for v in eqn.outvars)
            ):
                raise _errors.drawn_without_density("log_prob", [path_str(site.path)])
        elif densities is not None and eqn.primitive in densities:
            if not any(v in live for v in eqn.outvars):
                continue
            lp = densities[eqn.primitive](eqn, known)
            if lp is None:
                raise _cannot(
                    f"the output depends on a draw of `{eqn.primitive}` it does not determine",
                    known,
                )
            ildj = sum(known.ildj_of(v) for v in eqn.outvars if known.has(v))
            total = total + _summed(lp + ildj, _plate_axes(eqn))
        elif (
            sub_jaxprs(eqn) and _holds_draws(eqn, densities) and any(v in live for v in eqn.outvars)
        ):
            if not any(e is eqn for e, _ in nested):
                raise _cannot(
                    f"the output depends on random variables drawn inside `{eqn.primitive}`, "
                    "which cannot be inverted",
                    known,
                )
    for eqn, reaped in nested:
        for entries in jax.tree_util.tree_leaves(reaped, is_leaf=lambda x: isinstance(x, tuple)):
            for density, _ in entries:
                total = total + _summed(jnp.sum(density), _plate_axes(eqn))
    return total
