"""`InstrumentedPenzai`: an instrumented Penzai model, whose state variables a harvest call threads.

Called with frozen `pz.StateVariable` values (inside a harvest trace, or a jit
it was passed to), the model runs on mutable copies of them, as
`pz.variable_jit` does, and keeps their new values; a harvest call hands those
out of its trace and writes them to the caller's variables (`Stateful`).

Flattening a Penzai layer tree runs Python for every layer, and an eager
harvest call flattens several times. So inside `flattening_call` the model's
children are the frozen model's arrays, its structure (kept while no variable
changes) the auxiliary data, and the copy made from them rebuilds the model only
when first used. Any other flatten (`jax.jit`, `pz.select`) gives the frozen
model itself as the one child, so its layers are seen.
"""

from __future__ import annotations

import jax

from .._calling._stateful import Stateful, in_flattening_call
from .._walk._leaves import is_named_array
from . import _attention
from ._instrumented import Instrumented
from ._module_paths import frozen_variables, penzai_states, penzai_variables, with_states
from ._op_sites import sow_ops


@jax.tree_util.register_pytree_with_keys_class
class InstrumentedPenzai(Instrumented, Stateful):
    """An instrumented Penzai model: its `pz.StateVariable`s are state a harvest call threads."""

    def tree_flatten(self):
        if not self._rebuilt and (self._leaves is not None or in_flattening_call()):
            tree, leaves = self._leaves if self._leaves is not None else self._frozen_flat()
            return leaves, ("leaves", tree, self._opts)
        return super().tree_flatten()

    def _children(self):
        # A Penzai `Parameter` is a mutable leaf, hashed by identity: as a
        # static leaf its old value would stay in a compiled program. Frozen,
        # the weights are arrays, traced like any argument. A model with no
        # variable left to freeze (a copy a flatten made) is its own child, so
        # `pz.select(...).at(...)` finds the layers it picked in it.
        target = self.target
        return (frozen_variables(target) if penzai_variables(target) else target,)

    def _frozen_flat(self):
        """The Penzai model's frozen arrays and structure, computed again only when
        one of its variables holds a new value (an eager call flattens the model
        several times)."""
        if self._frozen is None:
            variables = penzai_variables(self.target)
        else:
            variables, values, leaves, tree = self._frozen
            if all(v.value is old for v, old in zip(variables, values)):
                return tree, leaves
        values = [v.value for v in variables]
        leaves, tree = jax.tree_util.tree_flatten(frozen_variables(self.target))
        # Only values of JAX arrays can stand for themselves (a NumPy array changes in place).
        if all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(values)):
            self._frozen = (variables, values, leaves, tree)
        return tree, leaves

    def _prepare(self, call, parts, names, args, kwargs):
        """Refuses sites under a `LayerStack`; notes the attention layers and the call's named axes."""
        _refuse_layer_stacks(parts, names, self._opts.select, self._opts.ops)
        if self._opts.attention:
            call.penzai_hooks = _attention.penzai_hook_paths(parts)
        named = jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_named_array)
        call.input_axes = tuple(
            dict.fromkeys(n for a in named if is_named_array(a) for n in a.named_shape)
        )

    def __call__(self, *args, **kwargs):
        frozen = penzai_states(self.target, frozen=True)
        if not frozen:
            return super().__call__(*args, **kwargs)
        # A traced copy: the model writes its state variables, so it runs on
        # mutable copies, and keeps what they hold after (for the next call,
        # and for `harvest_state`).
        live = {slot: value.unfreeze_as_copy() for slot, value in frozen.items()}
        self.target = with_states(self.target, live)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self.target = with_states(self.target, {slot: v.freeze() for slot, v in live.items()})

    def _sow_ops(self, run, call, args, kwargs):
        """With ops=True, the op sites' own trace of the model takes its state
        variables' values as inputs and gives their new values as outputs, which
        the variables hold after (as the module sites' call leaves them)."""
        states = list(penzai_states(self.target, frozen=False).values())
        if not states:
            return sow_ops(run, call, args, kwargs)

        def load(values):
            for variable, value in zip(states, values):
                variable.value = value

        def threaded(values, *args, **kwargs):
            load(values)
            return run(*args, **kwargs), [variable.value for variable in states]

        before = [variable.value for variable in states]
        try:
            out, after = sow_ops(threaded, call, (before, *args), kwargs)
        finally:  # the trace left its own tracers in the variables
            load(before)
        load(after)
        return out

    def harvest_state(self):
        return tuple(penzai_states(self.target, frozen=True).values()) or None

    def harvest_write_state(self, state):
        for variable, value in zip(penzai_states(self.target, frozen=False).values(), state):
            variable.update(value)


def _refuse_layer_stacks(parts, names, select, ops):
    """Penzai's `LayerStack` scans over unbound copies of its layers, which the
    table of paths cannot tell apart (their parameters are slots, and layers
    without parameters all look alike): sites under one would be misnamed or
    missed, so selecting one is an error rather than silently wrong names."""
    from penzai.nn.layer_stack import LayerStack

    for path, module in parts:
        if isinstance(module, LayerStack):
            inside = [n for n in names if n.startswith(path + ".") and select((n,))]
            if inside or ops:
                what = "op sites"
                if inside:
                    what = f"sites inside it ({', '.join(map(repr, inside[:2]))}, ...)"
                raise NotImplementedError(
                    f"instrument: the Penzai model runs a pz.nn.LayerStack at {path!r} (use_layer_stack=True), "
                    f"whose layers run as unbound copies that harvest cannot name yet, so {what} would be "
                    f"misnamed or missed. Build the model without a layer stack (use_layer_stack=False), or "
                    f"select sites outside it, e.g. names=lambda name: not name.startswith({path + '.'!r})."
                )
