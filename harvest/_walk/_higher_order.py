"""What harvest knows about each higher-order primitive, declared once beside its rule.

A `HigherOrder` descriptor says, for one primitive, which bodies an equation of
it holds and how often each runs, and the other facts its fields list; each
family in `_rules/` registers its primitives (`register(p, HigherOrder(...))`)
after their rules. Site listing, occurrence counting, op sites, the calling
convention, batched conds and the PPL evaluators read these descriptors and
name no primitive, so no two tools can disagree about how often a body runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .. import _jax

UNBOUNDED = None  # `Body.runs` of a while loop: its trip count is not known before running


@dataclasses.dataclass(frozen=True)
class Body:
    """One body of an equation, as the rest of harvest sees it.

    Attributes:
        label: the body's name in site listings (``"body"``, ``"branch 1"``, ...).
        jaxpr: the body's (open) jaxpr.
        consts: the values of its constvars.
        runs: how many times one run of the equation runs this body (None: not
            known before running; 0: only where JAX differentiates, or never by itself).
        per_run_stacked: each run's sows, of every mode, are reaped stacked along a
            new leading axis (one row per shard of a shard_map).
        predicate: the body decides whether a loop goes on (no sow may be there).
        stacked_loop: a loop whose iterations reap stacked (a scan): with ``runs`` 0
            it is a loop of length 0, whose sows still reap one empty stack.
        inputs: the positions of the equation's inputs its invars read, in order
            (None: its invars read the equation's last inputs, matched from the end,
            as a scan's consts/carry/xs, a cond's operands or a jit's arguments do).
    """

    label: str
    jaxpr: _jax.Jaxpr
    consts: Sequence[Any] = ()
    runs: int | None = 1
    per_run_stacked: bool = False
    predicate: bool = False
    stacked_loop: bool = False
    inputs: tuple[int, ...] | None = None


# Re-staging: `restage(eqn, invals, staged, extra)` binds the primitive again
# (through its public `lax` function) around bodies that `staged(body)` gives as
# Python callables, and returns the equation's outputs followed by `extra`'s
# final values. `extra` are values an evaluator threads through every body
# beside the primitive's own (a state, say): a staged body takes its own inputs
# then `extra` and returns its own outputs then `extra`'s new values (a loop
# carries them, a branch passes them on); a predicate body takes the same and
# returns only its predicate.
Restage = Callable[
    [Any, list[Any], Callable[[Body], Callable[..., list[Any]]], Sequence[Any]], list[Any]
]
# forwards(eqn, i, position) -> the input of `eqn` its output `i` is a copy of,
# or None; `position(jaxpr, k)` answers the same for output `k` of a body.
Forwards = Callable[[Any, int, Callable[[_jax.Jaxpr, int], int | None]], int | None]


@dataclasses.dataclass(frozen=True)
class HigherOrder:
    """Everything harvest knows about one higher-order primitive (see the module docstring).

    Attributes:
        bodies: ``bodies(eqn) -> [Body]``, the bodies an equation of it holds.
        alternatives: exactly one body runs per call (a cond's branches), so an
            occurrence count is its longest body's.
        call: the one body runs once, on the equation's inputs, and gives its outputs.
        custom_rule: the custom rule inlining its body would drop: ``"jvp"``,
            ``"vjp"``, ``"vmap"`` (custom_vmap's batching rule), or None.
        forwards: ``forwards(eqn, i, position)``, the input its output ``i`` copies
            unchanged, or None (None: no output is known to forward an input).
        restage: ``restage(eqn, invals, staged, extra)``, binding it again around
            bodies another evaluator supplies (None: it cannot be re-staged).
        batched_branch: ``batched_branch(eqn, invals, found, stuck) -> outputs``, how
            its sows leave a branch vmap runs side by side: the equation evaluated
            on ``invals``, each body run through ``extend.walk_in_branch`` (None: a
            call-like primitive's body is inlined; any other's sows stay stuck,
            and reaping one is an error).
        jvp_rule: the traced JVP rule whose sows run where JAX differentiates the
            call (custom_jvp; see ``_interpreter.jvp_rule``), or None.
        rule: ``rule(walk, eqn, invals) -> outputs``, what the reap/plant walk does at
            an equation whose bodies hold a sow it handles (a marker's: at every
            one). None: an ``inlinable`` primitive's body is walked in place; any
            other's is an error naming the primitive.
        recount: for a marker without bodies that moves the occurrence count
            (``_rules/batched_cond``'s): ``recount(eqn, n, state) -> n`` after it,
            ``state`` kept across one jaxpr's markers (None: not a marker).
    """

    bodies: Callable[[Any], list[Body]]
    alternatives: bool = False
    call: bool = False
    custom_rule: str | None = None
    forwards: Forwards | None = None
    restage: Restage | None = None
    batched_branch: Callable[..., list[Any]] | None = None
    jvp_rule: Callable[[Any], tuple[_jax.ClosedJaxpr, list[bool]] | None] | None = None
    rule: Callable[[Any, Any, list[Any]], list[Any]] | None = None
    recount: Callable[[Any, int, dict[Any, Any]], int] | None = None

    @property
    def inlinable(self) -> bool:
        """Whether evaluating its body in place computes the same as binding it."""
        return self.call and self.custom_rule is None


# primitive -> what harvest knows about it: the one table, filled by `register`.
REGISTRY: dict[_jax.Primitive, HigherOrder] = {}


def register(primitive: _jax.Primitive, descriptor: HigherOrder) -> HigherOrder:
    """Registers everything harvest knows about `primitive` in one place; returns `descriptor`."""
    REGISTRY[primitive] = descriptor
    return descriptor


def _unknown_bodies(eqn: Any) -> list[Body]:
    return [Body(eqn.primitive.name, j) for j in _jax.sub_jaxprs(eqn)]


# A primitive nobody declared: its jaxprs, each run once, nothing forwarded or re-staged.
UNKNOWN = HigherOrder(_unknown_bodies)


def describe(eqn: Any) -> HigherOrder:
    """The descriptor of `eqn`'s primitive (`UNKNOWN` if none was declared)."""
    return REGISTRY.get(eqn.primitive, UNKNOWN)


def bodies(eqn: Any) -> list[Body]:
    """The bodies of `eqn` (none for a first-order equation)."""
    return describe(eqn).bodies(eqn) if _jax.sub_jaxprs(eqn) else []


def operands_of(eqn: Any, jaxpr: Any) -> list[Any]:
    """The inputs of `eqn` that its body `jaxpr` reads, matched to the body's
    invars from the end (the whole input list unless the `Body` says which)."""
    body = next((b for b in bodies(eqn) if b.jaxpr is jaxpr), None)
    if body is None or body.inputs is None:
        return list(eqn.invars)
    return [eqn.invars[i] for i in body.inputs]


# ---------------------------------------------------------------------------
# Helpers for declarations.


def split_extra(outs: Sequence[Any], extra: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(a staged body's own outputs, the new values of `extra`) from what it returned."""
    k = len(outs) - len(extra)
    return list(outs[:k]), list(outs[k:])


def call_body(label: str) -> Callable[[Any], list[Body]]:
    """`bodies` of a call-like primitive: its one body, labelled `label`."""

    def one(eqn: Any) -> list[Body]:
        body = _jax.call_body(eqn)
        return [Body(label, body.jaxpr, body.consts)]

    return one


def forwards_through_call(eqn: Any, i: int, position: Callable[..., int | None]) -> int | None:
    """A call's output `i` copies the input its body returns there."""
    return position(_jax.call_body(eqn).jaxpr, i)
