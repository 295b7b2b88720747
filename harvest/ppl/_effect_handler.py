"""`make_effect_handler`: custom interpreters that thread a state through chosen primitives.

The transformed function is traced to a jaxpr and evaluated equation by
equation (harvest's one evaluator, so each equation keeps its source line and
`jax.named_scope`). An equation whose primitive has a handler runs the handler
instead, `handler(state, *inputs, **params) -> (outputs, new state)`; every
other equation is bound as it was. Bodies that hold a handled primitive are
walked into, as each primitive's descriptor says: calls (`jit`,
`closed_call`, `checkpoint`) in place; `custom_jvp`/`custom_vjp` functions
keep the user's derivative rule for their outputs, as the core walk keeps it
for the calls it reaps in; loops and branches (`scan`, `fori_loop`,
`while_loop`, `cond`, `switch`) are staged again with the state's leaves, as
arrays, carried through every iteration or branch (so a count there comes
back as an array). A handled primitive in a `while_loop`'s predicate, or in a
primitive harvest has no descriptor for, is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Concatenate

import jax
import jax.numpy as jnp

from .. import _jax
from .._jax import sub_jaxprs
from .._typing import P, R
from .._walk._evaluator import bind, evaluate
from .._walk._higher_order import Body, HigherOrder, describe, split_extra
from .._walk._leaves import reveal_static
from .._walk._rules.calls import with_vjp
from ._inverse import trace_program
from ._old_spellings import model_was_f

# handler(state, *inputs, **params) -> (outputs, new state)
Handler = Callable[..., tuple[Any, Any]]


def _holds(jaxpr: _jax.Jaxpr, handlers: dict[Any, Handler]) -> bool:
    return any(
        e.primitive in handlers or any(_holds(j, handlers) for j in sub_jaxprs(e))
        for e in jaxpr.eqns
    )


def _handled_inside(primitive: Any, handlers: Any) -> NotImplementedError:
    handled = sorted({str(p) for p in handlers})
    return NotImplementedError(
        f"make_effect_handler: a handled primitive ({', '.join(handled)}) is bound inside "
        f"`{primitive}`, and the handlers' state cannot be threaded through it. Move "
        "the handled operations out of the loop or branch."
    )


def _eval(
    jaxpr: _jax.Jaxpr,
    consts: Sequence[Any],
    state: Any,
    args: Sequence[Any],
    handlers: dict[Any, Handler],
) -> tuple[list[Any], Any]:
    threaded = [state]  # the state, as the handlers leave it

    def step(eqn: Any, invals: list[Any]) -> Any:
        if eqn.primitive in handlers:
            outs, threaded[0] = handlers[eqn.primitive](threaded[0], *invals, **eqn.params)
            return outs
        if not any(_holds(j, handlers) for j in sub_jaxprs(eqn)):
            return bind(eqn, invals)
        how = describe(eqn)
        if how.inlinable:  # jit, checkpoint and plain calls: walked in place
            (body,) = how.bodies(eqn)
            outs, threaded[0] = _eval(body.jaxpr, body.consts, threaded[0], invals, handlers)
        elif how.custom_rule in ("jvp", "vjp"):
            outs, threaded[0] = _keeping_the_rule(eqn, how, invals, threaded[0], handlers)
        elif how.restage is not None:
            outs, threaded[0] = _carried_through(eqn, how, invals, threaded[0], handlers)
        else:
            raise _handled_inside(eqn.primitive, handlers)
        return outs

    outs = evaluate(jaxpr, consts, args, step)
    return outs, threaded[0]


def _carried_through(
    eqn: Any, how: HigherOrder, invals: list[Any], state: Any, handlers: dict[Any, Handler]
) -> tuple[list[Any], Any]:
    """A loop or branch re-staged with the state's leaves, as arrays, carried through its bodies."""
    leaves, tree = jax.tree_util.tree_flatten(state)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    avals = [jax.typeof(leaf) for leaf in leaves]

    def staged(body: Body) -> Callable[..., list[Any]]:
        def run(*args: Any) -> list[Any]:
            own, carried = split_extra(args, leaves)
            if body.predicate:  # it returns only its predicate: no state can leave it
                if _holds(body.jaxpr, handlers):
                    raise _handled_inside(eqn.primitive, handlers)
                return evaluate(body.jaxpr, body.consts, own, bind)
            state = jax.tree_util.tree_unflatten(tree, carried)
            outs, new = _eval(body.jaxpr, body.consts, state, own, handlers)
            new_leaves, new_tree = jax.tree_util.tree_flatten(new)
            if new_tree != tree:  # type: ignore[operator]  # the stubs give PyTreeDef no __ne__
                raise TypeError(
                    f"make_effect_handler: inside `{eqn.primitive}` the handlers changed the state's structure "
                    f"from {tree} to {new_tree}; a loop or branch carries one structure. Keep the state's "
                    "pytree structure fixed (e.g. start from the full dict)."
                )
            # A carry keeps its type: the handlers' results are cast to the state's.
            return [*outs, *(_jax.cast_like(jnp.asarray(v), a) for v, a in zip(new_leaves, avals))]

        return run

    assert how.restage is not None  # the caller checked
    outs, final = split_extra(how.restage(eqn, invals, staged, leaves), leaves)
    return outs, jax.tree_util.tree_unflatten(tree, final)


def _keeping_the_rule(
    eqn: Any, how: HigherOrder, invals: list[Any], state: Any, handlers: dict[Any, Handler]
) -> tuple[list[Any], Any]:
    """A custom_jvp/vjp call whose body holds a handled primitive: the body is
    evaluated with the handlers, and its outputs keep the user's derivative rule
    (as the core walk keeps it for the calls it reaps in); the state's array
    leaves are differentiated by ordinary autodiff of the handled body."""
    (body,) = how.bodies(eqn)
    leaves, tree = jax.tree_util.tree_flatten(state)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    k, n = len(arrays), len(eqn.outvars)
    left: dict[str, Any] = {}  # the new state's tree and its leaves that are not arrays

    def run(*xs: Any) -> list[Any]:
        given = dict(zip(arrays, xs[:k]))
        start = jax.tree_util.tree_unflatten(tree, [given.get(i, l) for i, l in enumerate(leaves)])
        outs, new = _eval(body.jaxpr, body.consts, start, xs[k:], handlers)
        new_leaves, left["tree"] = jax.tree_util.tree_flatten(new)
        left["static"] = {i: v for i, v in enumerate(new_leaves) if not isinstance(v, jax.Array)}
        return [*outs, *(v for v in new_leaves if isinstance(v, jax.Array))]

    def original(*xs: Any) -> Any:
        return _jax.rebind(eqn, xs)

    wrap = _with_rule_jvp if how.custom_rule == "jvp" else with_vjp
    results = wrap(run, original, k, n, _jax.custom_num_consts(eqn))(
        *(leaves[i] for i in arrays), *invals
    )
    outs, dynamic = list(results[:n]), iter(results[n:])
    static = left["static"]
    new_leaves = [
        static[i] if i in static else next(dynamic) for i in range(left["tree"].num_leaves)
    ]
    return outs, jax.tree_util.tree_unflatten(left["tree"], new_leaves)


def _with_rule_jvp(
    body: Callable[..., list[Any]], original: Callable[..., Any], k: int, n: int, nconsts: int
) -> Callable[..., list[Any]]:
    """`body` (k state leaves, then the call's inputs -> n outputs, then the new
    state's array leaves) under a custom_jvp: the outputs are the handled body's,
    their tangents the user's rule's, the state's tangents autodiff of the body."""

    @jax.custom_jvp
    def wrapped(*xs: Any) -> list[Any]:
        return list(body(*xs))

    @wrapped.defjvp
    def wrapped_jvp(primals: Any, tangents: Any) -> tuple[list[Any], list[Any]]:
        results = body(*primals)
        _, out_dots = jax.jvp(original, primals[k:], tangents[k:])
        _, state_dots = jax.jvp(lambda *xs: body(*xs)[n:], primals, tangents)
        return results, [*out_dots, *state_dots]

    return wrapped


def make_effect_handler(
    handlers: dict[Any, Handler],
) -> Callable[[Callable[P, R]], Callable[Concatenate[Any, P], tuple[R, Any]]]:
    """Returns a transformation `model -> g(state, *args) -> (model's output, final state)`.

    `handlers` maps JAX primitives to `handler(state, *inputs, **params)`
    returning `(outputs, new state)` (a list of outputs for primitives with
    several). Primitives without a handler run as usual. The state is any
    Python value or pytree; it stays a Python value unless a handler makes it
    an array.

    Args:
        handlers: a dict from JAX primitives (``jax.lax.exp_p``, say) to
            ``handler(state, *inputs, **params) -> (outputs, new state)``.

    Returns:
        A transformation taking ``model`` (any function; the program's name, as in every
        harvest.ppl function) to ``g(state, *args) -> (model's output, final state)``.

    Raises:
        TypeError: if ``handlers`` is not a dict of callables.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> def count_exp(n, x, **params):  # params: the primitive's, e.g. exp's accuracy
        ...     return jnp.exp(x), n + 1
        >>> counting = ppl.make_effect_handler({jax.lax.exp_p: count_exp})
        >>> counting(lambda x: jnp.exp(jnp.exp(x)))(0, 0.0)
        (Array(2.7182817, dtype=float32, weak_type=True), 2)
    """
    if not isinstance(handlers, dict) or not all(callable(h) for h in handlers.values()):
        raise TypeError(
            "make_effect_handler takes a dict {primitive: handler(state, *inputs, **params) -> "
            f"(outputs, state)}}; got {handlers!r}."
        )

    @model_was_f
    def transform(model: Callable[P, R]) -> Callable[Concatenate[Any, P], tuple[R, Any]]:
        def handled(state: Any, /, *args: P.args, **kwargs: P.kwargs) -> tuple[R, Any]:
            closed, out_shape, arrays = trace_program(model, args, kwargs)
            outs, state = _eval(closed.jaxpr, closed.consts, state, arrays, handlers)
            out = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
            return reveal_static(out), state

        return handled

    return transform
