"""The tags a probabilistic program sows under, and the switch `unconstrained` flips.

This module is the bottom of `harvest.ppl`: every other module imports from it
and it imports none of them.

A draw made by `random_variable` sows its value under `RANDOM_VARIABLE` and
the pair `(log density, value)` under `LOG_DENSITY`. While the unconstraining
switch is on, a draw with continuous support is made as
`value = bijector.forward(u)`, with `u` sown under `UNCONSTRAINED` and
`log |d forward / du|` sown under `JACOBIAN`; `unconstrained` decides which of
those count (only the draws that stay free). While the noise-explicit switch
is on (for `counterfactual`), a draw is made from its exogenous noise, sown
under `NOISE`, and the noise that explains the value taken is sown under
`ABDUCED` (see `_mechanisms.py`). `block` re-sows the values it
hides under `BLOCKED`, so the scoring transformations can tell whether a
density depends on a hidden draw. `deterministic` sows under `DETERMINISTIC`.
While the scoring switch is on (`joint_log_prob`, `unconstrained`'s density),
a draw is not sampled at all: a zero of its shape stands in for the sample,
since each value the density reads is planted over it.

Each switch is a trace-state flag built like the core's own "a harvest is
tracing" flag (`harvest._jax.trace_flag`): it is part of JAX's jit cache key,
so a `jax.jit` helper inside the model that was traced with the switch off is
traced afresh with it on, and the traces never mix.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _jax
from .._calling._transforms import layer_tag
from .._walk._sow import sow

RANDOM_VARIABLE = layer_tag("random_variable")
LOG_DENSITY = layer_tag("random_variable_log_density")
DETERMINISTIC = layer_tag("deterministic")
UNCONSTRAINED = layer_tag("random_variable_unconstrained")
JACOBIAN = layer_tag("random_variable_jacobian")
BLOCKED = layer_tag("random_variable_blocked")
NOISE = layer_tag("random_variable_noise")
ABDUCED = layer_tag("random_variable_abduced_noise")
ENUMERATED = layer_tag("random_variable_enumerated")
ENUMERATED_IN_SCAN = layer_tag("random_variable_enumerated_in_scan")
TOTAL = layer_tag("random_variable_total_log_density")
OUTSIDE_SUPPORT = layer_tag("random_variable_outside_support")

_unconstraining = _jax.trace_flag(
    "harvest_ppl_unconstraining",
    "Set by harvest.ppl.unconstrained while it traces a program: draws go through R^n.",
)


def unconstraining() -> Any:
    """A context in which `random_variable` draws continuous variables through `u`."""
    return _unconstraining(True)


def is_unconstraining() -> bool:
    """Whether the unconstraining switch is on (inside `unconstraining()`)."""
    return bool(_unconstraining.value)


_noise_explicit = _jax.trace_flag(
    "harvest_ppl_noise_explicit",
    "Set by harvest.ppl.counterfactual while it traces a program: draws are made from noise.",
)


def noise_explicit() -> Any:
    """A context in which `random_variable` draws through its mechanism (`_mechanisms.py`)."""
    return _noise_explicit(True)


def is_noise_explicit() -> bool:
    """Whether the noise-explicit switch is on (inside `noise_explicit()`)."""
    return bool(_noise_explicit.value)


_checking_support = _jax.trace_flag(
    "harvest_ppl_checking_support",
    "Set by sample_posterior while it checks the observed values: each draw sows, under "
    "OUTSIDE_SUPPORT, where its value lies outside its distribution's support.",
)


def checking_support() -> Any:
    """A context in which `random_variable` sows where its value is outside the support."""
    return _checking_support(True)


def is_checking_support() -> bool:
    """Whether the support-checking switch is on (inside `checking_support()`)."""
    return bool(_checking_support.value)


_scoring = _jax.trace_flag(
    "harvest_ppl_scoring",
    "Set by joint_log_prob and unconstrained while they trace a program: every draw's "
    "value is given, so none is sampled.",
)


def scoring() -> Any:
    """A context in which `random_variable` does not sample: every value it draws is
    replaced (planted, made from `u`, summed out or hidden by `block`) before it is scored."""
    return _scoring(True)


def is_scoring() -> bool:
    """Whether the scoring switch is on (inside `scoring()`)."""
    return bool(_scoring.value)


def sow_density(log_density: Any, value: Any, name: str) -> None:
    """Files a log density (and the value it scores) for joint_log_prob and log_prob."""
    sow((log_density, value), tag=LOG_DENSITY, name=name, mode="collect")


def densities_of(reaped: dict[str, Any]) -> list[jax.Array]:
    """The log densities in what a reap of `LOG_DENSITY` returned, flattened."""
    out: list[jax.Array] = []
    for value in reaped.values():
        if isinstance(value, dict):
            out += densities_of(value)
        else:
            out += [jnp.sum(density) for density, _ in value]
    return out
