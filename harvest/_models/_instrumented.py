"""`Instrumented`: the callable `instrument` returns, and how it flattens as a pytree.

A call makes one `InstrumentCall` and runs the target with the sites it selects:
a module target with its submodule classes wrapped (`_classes.py`), a function
through Linen's interceptor (`_linen.py`), with ops=True through the op sites'
trace (`_op_sites.py`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax

from .._walk._interpreter import NameFilter
from . import _attention, _transformer_lens
from ._attention import HOOKS
from ._call import INPUTS, InstrumentCall
from ._classes import with_modules
from ._linen import run_linen
from ._module_paths import describe, submodules
from ._op_sites import sow_ops


def _instrument_nothing_sown(where: Any, kind: str, target: str) -> ValueError:
    if where is not None:
        return ValueError(f"instrument: names={where!r} selected nothing that {target} computes.")
    if kind == "function":
        return ValueError(
            f"instrument: {target} applies no Flax Linen module, so it has no module sites. "
            "For an NNX, Equinox or Penzai model, instrument the model object itself, not a "
            "function that calls it; or pass ops=True to make every primitive's output a site."
        )
    return ValueError(
        f"instrument: {target} called none of its submodules, so it has no sites. "
        "Pass ops=True for op sites."
    )


def _outermost(names: list[str], k: int = 6) -> str:
    if not names:
        return "it has none"
    names = sorted(names, key=lambda n: (n.count("."), n))  # the outermost first
    more = f", ... ({len(names)} in all)" if len(names) > k else ""
    return "they are " + ", ".join(map(repr, names[:k])) + more


class Options(NamedTuple):
    """What `instrument` was asked for: the static part of an `Instrumented`."""

    kind: str  # `_module_paths.kind` of the target
    tag: str
    ops: bool
    inputs: bool
    select: NameFilter  # from `names` and `exclude`
    where: Any  # `names` as given, for messages
    attention: bool
    naming: str | None  # a naming of `_transformer_lens`, or None


@jax.tree_util.register_pytree_with_keys_class
class Instrumented:
    """`target`, callable as before, with its parts sown under `tag`.

    A pytree whose child is a module target, so transformations that take it trace
    the model's arrays; a function target is static, by identity (what it closes
    over is read when traced, as `jax.jit(f)` reads it), but a ``functools.partial``'s
    arguments, which are the call's. Only a Penzai model can hold state of its own
    (`InstrumentedPenzai`, `Stateful`).
    """

    def __init__(self, target: Any, options: Options, leaves: Any = None):
        self._target = target
        # Penzai: (structure, arrays) of the frozen model a plain flatten gave, not rebuilt yet.
        self._leaves = leaves
        self._rebuilt = False  # whether `target` was rebuilt from `_leaves`
        self._opts = options
        # Penzai: (the variables, their values, the frozen model's arrays, its structure).
        self._frozen = None
        if leaves is None:
            functools.update_wrapper(self, target, updated=())  # `inspect.signature` shows target's

    @property
    def target(self):
        if self._leaves is not None:
            tree, leaves = self._leaves
            self._target, self._leaves, self._rebuilt = tree.unflatten(leaves), None, True
        return self._target

    @target.setter
    def target(self, value):
        self._target, self._leaves, self._frozen = value, None, None

    def tree_flatten(self):
        if self._opts.kind != "function":
            return self._children(), ("tree", None, self._opts)
        if type(self._target) is functools.partial:
            # Its arguments are the call's, as harvest takes a partial's: arrays traced.
            target = self._target
            return [target.args, target.keywords], ("partial", target.func, self._opts)
        return (), ("function", _Identity(self.target), self._opts)

    def tree_flatten_with_keys(self):
        children, aux = Instrumented.tree_flatten(self)  # a Penzai model's layers, not its leaves
        return [(jax.tree_util.FlattenedIndexKey(i), c) for i, c in enumerate(children)], aux

    def _children(self):
        return (self.target,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        form, data, options = aux
        if form == "function":
            return cls(data.value, options)
        if form == "partial":
            return cls(functools.partial(data, *children[0], **children[1]), options)
        if form == "leaves":
            return cls(None, options, leaves=(data, list(children)))
        return cls(children[0], options)

    def __repr__(self):
        o = self._opts
        return (
            f"instrument({describe(self.target)}, tag={o.tag!r}, ops={o.ops}, "
            f"inputs={o.inputs}, attention={o.attention}"
            + ("" if o.naming is None else f", naming={o.naming!r}")
            + ")"
        )

    def __call__(self, *args, **kwargs):
        o = self._opts
        call = InstrumentCall(o.tag, o.select, o.ops, o.inputs, kind=o.kind, attention=o.attention)
        if o.kind == "function":
            if o.naming is not None:  # gemma's blocks, named as they run
                call.residual = _transformer_lens.Names()
            run = functools.partial(run_linen, call, self.target)
        else:
            run = self._module_run(call, self.target, args, kwargs)
            if call.residual is not None and o.kind in ("nnx", "equinox"):
                call.residual.parallel = self._parallel_blocks(call.residual, args, kwargs)
        if o.ops:
            out = self._sow_ops(run, call, args, kwargs)
        else:
            out = run(*args, **kwargs)
        if call.residual is not None and not call.residual.inputs:
            raise _transformer_lens.no_transformer_blocks(describe(self.target), o.kind)
        if not call.sown:
            raise _instrument_nothing_sown(o.where, o.kind, describe(self.target))
        return out

    def _module_run(self, call, target, args, kwargs, probe=False):
        """`target` (a module) to be run for `call`: its parts found, named and wrapped
        (`names` checked to select one, unless `call` is a probe, which sows nothing)."""
        o = self._opts
        parts = submodules(target, o.kind)
        if o.naming is not None:  # TransformerLens's names only
            call.residual = _transformer_lens.names_of(parts, o.kind, describe(target))
            names = call.residual.all_names(o.attention)
        else:
            names = [n for p, _ in parts for n in ((p, p + INPUTS) if o.inputs else (p,))]
        if o.attention and o.naming is None:
            names += [f"{p}.{h}" for p, m in parts if _attention.is_attention(m) for h in HOOKS]
        if o.where is not None and not o.ops and not probe:
            if not any(call.select((n,)) for n in names):
                raise ValueError(
                    f"instrument: names={o.where!r} selects none of the model's submodules "
                    f"({_outermost(names)})."
                )
        # Every module is wrapped (with ops=True its path names the ops inside,
        # whatever `names` selects); `sow` keeps to the selected ones.
        call.paths = {id(m): p for p, m in reversed(parts)}  # a shared module: its first path
        call.known = frozenset(call.paths.values())
        self._prepare(call, parts, names, args, kwargs)
        marked = [(p, m) for p, m in parts if call.paths[id(m)] == p] if o.kind == "nnx" else []
        if o.kind in ("equinox", "penzai"):  # pytrees: a rebuilt copy is found by structure
            call.parts = [(p, m) for p, m in parts if call.paths[id(m)] == p]
        return functools.partial(with_modules, call, {type(m) for _, m in parts}, marked, target)

    def _parallel_blocks(self, table, args, kwargs):
        """The NNX or Equinox blocks (by path) whose MLP reads the block's input (GPT-J's:
        no hook_resid_mid), where some `resid_mid` is selected. It is sown before the MLP
        shows which kind a block is, so the model first runs abstractly, sowing nothing
        (an NNX model as a copy, whose writes are lost)."""
        o = self._opts
        if not any(o.select((name,)) for _, name in table.mids.values()):
            return set()
        probe = InstrumentCall(o.tag, NameFilter(allow=()), False, False, kind=o.kind)

        def run():
            target = self.target
            if o.kind == "nnx":  # copied inside the abstract trace, which may write to it
                from flax import nnx

                target = nnx.clone(target)
            run = self._module_run(probe, target, args, kwargs, probe=True)
            probe.residual.probing = True
            return run(*args, **kwargs)

        jax.eval_shape(run)
        return probe.residual.parallel

    def _prepare(self, call, parts, names, args, kwargs):
        """Fills in what `call` needs beyond the paths of `parts` before the model runs
        (nothing here; a Penzai model's call more, `InstrumentedPenzai`)."""

    def _sow_ops(self, run, call, args, kwargs):
        return sow_ops(run, call, args, kwargs)


class _Identity:
    """A function target in a pytree's structure: compared and hashed by identity, as
    `jax.jit` keys the function it is given (a bound method's object may be unhashable)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Identity) and self.value is other.value

    def __hash__(self):
        return id(self.value)
