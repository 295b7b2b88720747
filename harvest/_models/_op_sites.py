"""Op sites: every primitive's output in a function, sown (`instrument(..., ops=True)`).

The function is traced to a jaxpr once per call and re-evaluated equation by
equation with a sow after each. Loop and branch bodies are re-staged (`scan`,
`while_loop`, `switch`, `checkpoint`) with their ops sown inside, so reap stacks
them as any sow in a loop; `jit` bodies are inlined under their name. Custom
derivatives and other higher-order primitives count as one op; sows already in
the jaxpr are re-bound as they are.

A name is `"<scope>/<primitive>:<n>"`: the `jax.named_scope` stack from the
innermost instrumented module's path on, the primitive (a custom derivative's
or jit's function name), and a count per scope and primitive, in program order.
"""

from __future__ import annotations

import jax

from .. import _jax
from .._calling._nnx_state import split_nodes, write_back
from .._calling._stateful import stateful_objects
from .._calling._tracing import make_jaxpr
from .._walk._evaluator import evaluate
from .._walk._higher_order import describe
from .._walk._leaves import reveal_static
from .._walk._modes import AUTO
from .._walk._primitive import sow_p

# Sown once: the value itself; several times or in a loop: stacked (`instrument`).
INSTRUMENT_MODE = AUTO.name


def sow_ops(f, call, args, kwargs):
    """Runs `f(*args, **kwargs)` with each primitive's output sown for `call`."""
    stateful = stateful_objects((f, args, kwargs))
    (f, args, kwargs), graph, nodes = split_nodes((f, args, kwargs))
    closed, arrays, out_shape = make_jaxpr(f, args, kwargs, graph, return_shape=True)
    outs = _Walk(call).eval(closed.jaxpr, closed.consts, arrays, (), INSTRUMENT_MODE)
    out, changes = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    write_back(nodes, changes, stateful)
    return reveal_static(out)


def _sowable(x):
    dtype = jax.typeof(x).dtype
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and dtype != jax.dtypes.float0


class _Walk:
    def __init__(self, call):
        self.call = call
        self.counts: dict[tuple, int] = {}

    def name(self, scopes, op):
        # A module's path is pushed whole, so it starts the name; the scopes around
        # it (enclosing modules, Linen's own per-module scopes) are dropped.
        starts = [i for i, s in enumerate(scopes) if s in self.call.scopes]
        scope = "/".join(scopes[starts[-1] if starts else 0 :])
        n = self.counts.get((scope, op), 0)
        self.counts[(scope, op)] = n + 1
        return f"{scope}/{op}:{n}" if scope else f"{op}:{n}"

    def eval(self, jaxpr, consts, args, scopes, mode):
        def step(eqn, invals):
            outs = self.eqn(eqn, invals, scopes + _jax.name_scopes(eqn), mode)
            return outs if eqn.primitive.multiple_results else outs[0]

        return evaluate(jaxpr, consts, args, step)

    def eqn(self, eqn, invals, here, mode):
        prim = eqn.primitive
        if prim is sow_p:
            return sow_p.bind(*invals, **eqn.params)
        how = describe(eqn) if _jax.sub_jaxprs(eqn) else None
        if how is not None and how.restage is not None:  # loops, branches, checkpoints

            def staged(body):
                # Ops of a loop's predicate are not sown (a sow may not sit there);
                # a while body's are sown as any op is: reap gives the last
                # iteration, or `max_steps` of them.
                inner = None if body.predicate else mode
                return self.body(lambda *a: self.eval(body.jaxpr, body.consts, a, here, inner))

            outs = how.restage(eqn, invals, staged, ())
        elif how is not None and how.inlinable:  # jit and plain calls: inlined under their name
            (body,) = how.bodies(eqn)
            name = _jax.function_name(eqn)
            inner = here + ((name,) if name is not None else ())
            return self.eval(body.jaxpr, body.consts, invals, inner, mode)
        else:  # first-order ops, and calls with a rule of their own, count as one op
            outs = _jax.rebind(eqn, invals)
        outs = list(outs) if prim.multiple_results else [outs]
        name = _jax.function_name(eqn) if how is not None and how.call else None
        op = name if name is not None else prim.name
        return self.sow(outs, here, op, mode, single=len(eqn.outvars) == 1)

    def body(self, fn):
        """`fn`, naming its ops the same however often JAX traces it."""
        start = None

        def traced(*args):
            nonlocal start
            if start is None:
                start = dict(self.counts)
            else:
                self.counts = dict(start)
            return fn(*args)

        return traced

    def sow(self, outs, here, op, mode, single):
        if mode is None:
            return outs
        name = self.name(here, op)
        keep = [i for i, o in enumerate(outs) if _sowable(o)]
        if not keep or not self.call.select((name,)):
            return outs
        value = outs[0] if single else tuple(outs[i] for i in keep)
        leaves, tree = jax.tree_util.tree_flatten(value)
        sown = jax.tree_util.tree_unflatten(
            tree, sow_p.bind(*leaves, tag=self.call.tag, name=name, scope=(), mode=mode, tree=tree)
        )
        self.call.sown += 1
        if single:
            return [sown]
        outs = list(outs)
        for i, v in zip(keep, sown):
            outs[i] = v
        return outs
