"""The one loop that evaluates a jaxpr, equation by equation, under the current trace.

Every evaluator in harvest is this loop plus its own per-equation step: the
harvest walk (`_interpreter`), op sites (`_op_sites`), batched branches
(`_rules/batched_cond`), and harvest.ppl's inversion and effect handlers. The
loop owns what they must all get right alike: the environment, literals,
primitives with one result or several, and re-entering each equation's
source location and name stack (so `jax.named_scope`s and error locations
survive the re-trace).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import _jax

# step(eqn, invals) -> what binding `eqn` on `invals` returns (a list for a
# primitive with multiple results, else the one value).
Step = Callable[[Any, list[Any]], Any]


def evaluate(
    jaxpr: _jax.Jaxpr, consts: Sequence[Any], args: Sequence[Any], step: Step
) -> list[Any]:
    """The outputs of `jaxpr` on `args`, each equation evaluated by `step`."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _jax.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _jax.eqn_context(eqn):
            outs = step(eqn, invals)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: Any, invals: list[Any]) -> Any:
    """The step that binds every equation unchanged."""
    return _jax.rebind(eqn, invals)
