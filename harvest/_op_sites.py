"""Op sites: every primitive's output in a function, sown (`instrument(..., ops=True)`).

The function is traced to a jaxpr once per call, and the jaxpr re-evaluated
equation by equation with a sow after each one. Loop and branch bodies are
re-staged through `lax.scan`, `lax.while_loop`, `lax.switch` and
`jax.checkpoint` with their ops sown inside, so reap stacks them as it stacks
any sow in a loop; `jit` bodies are inlined under their name. Custom
derivatives (e.g. `jax.nn.relu`) and other higher-order primitives count as one
op and are re-bound untouched. Sows already in the jaxpr are re-bound as they
are, never sown again.

A name is `"<scope>/<primitive>:<n>"`: the `jax.named_scope` stack from the
innermost instrumented module's path on (each pushes its whole path), the primitive (a custom derivative's or
jit's function name), and a count per scope and primitive, in program order.
"""

from __future__ import annotations

import jax
from jax import lax

from . import _jax
from ._calling import make_jaxpr, split_nodes, write_back
from ._modes import AUTO
from ._primitive import sow_p

INSTRUMENT_MODE = (
    AUTO.name
)  # once: the value itself; several times or in a loop: stacked (`instrument`)
INLINED = frozenset({_jax.jit_p, _jax.closed_call_p, _jax.core_call_p})
CUSTOM = frozenset({_jax.custom_jvp_call_p, _jax.custom_vjp_call_p})


def sow_ops(f, call, args, kwargs):
    """Runs `f(*args, **kwargs)` with each primitive's output sown for `call`."""
    (f, args, kwargs), graph, nodes = split_nodes((f, args, kwargs))
    closed, arrays, out_shape = make_jaxpr(f, args, kwargs, graph, return_shape=True)
    outs = _Walk(call).eval(closed.jaxpr, closed.consts, arrays, (), INSTRUMENT_MODE)
    out, changes = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    write_back(nodes, changes)
    return out


def _scope_str(scopes, module_paths):
    # A module's path is pushed whole, so it starts the name; the scopes around
    # it (enclosing modules, Linen's own per-module scopes) are dropped.
    starts = [i for i, s in enumerate(scopes) if s in module_paths]
    return "/".join(scopes[starts[-1] if starts else 0 :])


def _sowable(x):
    dtype = jax.typeof(x).dtype
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and dtype != jax.dtypes.float0


class _Walk:
    def __init__(self, call):
        self.call = call
        self.counts: dict[tuple, int] = {}

    def name(self, scopes, op):
        scope = _scope_str(scopes, self.call.scopes)
        n = self.counts.get((scope, op), 0)
        self.counts[(scope, op)] = n + 1
        return f"{scope}/{op}:{n}" if scope else f"{op}:{n}"

    def eval(self, jaxpr, consts, args, scopes, mode):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return v.val if isinstance(v, _jax.Literal) else env[v]

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            here = scopes + _jax.name_scopes(eqn)
            with _jax.eqn_context(eqn):
                outs = self.eqn(eqn, invals, here, mode)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, invals, here, mode):
        prim, p = eqn.primitive, eqn.params
        if prim is sow_p:
            return sow_p.bind(*invals, **p)
        if prim in INLINED:
            body = _jax.call_body(eqn)
            name = _jax.function_name(eqn)
            inner = here + ((name,) if name is not None else ())
            return self.eval(body.jaxpr, body.consts, invals, inner, mode)
        if prim is _jax.remat_p:
            remat = _jax.Remat.of(eqn)
            fn = self.body(lambda *a: self.eval(remat.body, (), a, here, mode))
            return jax.checkpoint(fn, prevent_cse=remat.prevent_cse, policy=remat.policy)(*invals)
        if prim is _jax.scan_p:
            outs = self.scan(_jax.Scan.of(eqn), invals, here, mode)
        elif prim is _jax.while_p:
            outs = self.while_loop(_jax.While.of(eqn), invals, here, mode)
        elif prim is _jax.cond_p:
            branches = [
                self.body(lambda *ops, b=b: self.eval(b.jaxpr, b.consts, ops, here, mode))
                for b in _jax.cond_branches(eqn)
            ]
            outs = lax.switch(invals[0], branches, *invals[1:])
        else:
            outs = _jax.rebind(eqn, invals)
        outs = (
            list(outs)
            if prim.multiple_results or prim in (_jax.scan_p, _jax.while_p, _jax.cond_p)
            else [outs]
        )
        name = _jax.function_name(eqn) if prim in CUSTOM else None
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

    def scan(self, p, invals, here, mode):
        body, nc, ncarry = p.body, p.num_consts, p.num_carry
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]

        @self.body
        def step(carry, x):
            outs = self.eval(body.jaxpr, body.consts, [*consts, *carry, *x], here, mode)
            return outs[:ncarry], outs[ncarry:]

        carry, ys = lax.scan(
            step, list(init), list(xs), length=p.length, reverse=p.reverse, unroll=p.unroll
        )
        return [*carry, *ys]

    def while_loop(self, p, invals, here, mode):
        cond, body = p.cond, p.body
        ncc, nbc = p.cond_nconsts, p.body_nconsts
        cconsts, bconsts, init = invals[:ncc], invals[ncc : ncc + nbc], invals[ncc + nbc :]
        # Ops of cond_fun are not sown (a sow may not sit there); body ops are
        # sown as any op is: reap gives the last iteration, or `max_steps` of them.
        return lax.while_loop(
            lambda c: self.eval(cond.jaxpr, cond.consts, [*cconsts, *c], here, None)[0],
            self.body(lambda c: self.eval(body.jaxpr, body.consts, [*bconsts, *c], here, mode)),
            list(init),
        )
