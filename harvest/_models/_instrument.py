"""`instrument`: the parts of a model nobody sowed in, as sow sites.

A module target (Flax NNX, Equinox, Penzai) is read as data: its submodules and
their dotted paths (`_module_paths.py`); while a call runs, their classes are
wrapped so each call of one is sown under its path (`_classes.py`, `_rebuilt.py`).
A plain function gets its Flax Linen submodules' outputs sown through Linen's
`intercept_methods` (`_linen.py`); with `ops=True` any callable also gets every
primitive's output sown (`_op_sites.py`). The callable returned is an
`Instrumented` (`InstrumentedPenzai` for Penzai); each call makes one
`InstrumentCall` (`_call.py`), which sows the parts.
"""

from __future__ import annotations

from collections.abc import Callable

from .._calling._renamed import renamed
from .._typing import NameSelect, P, R
from .._walk._interpreter import NameFilter
from . import _transformer_lens
from ._instrumented import Instrumented, Options
from ._module_paths import describe, kind as target_kind, module_class, submodules, unbound_linen
from ._penzai import InstrumentedPenzai


def _a_naming(value: object) -> bool:
    """Whether an old ``names=`` value is a naming (now ``naming=``), not a selection."""
    return isinstance(value, str) and value in _transformer_lens.NAMINGS


# `names=` was the naming scheme and is now the selection: the old naming moves first.
@renamed(names=("naming", _a_naming), where="names", target="f")
def instrument(
    f: Callable[P, R],
    *,
    tag: str = "modules",
    ops: bool = False,
    inputs: bool = False,
    names: NameSelect = None,
    exclude: NameSelect = None,
    attention: bool = False,
    naming: str | None = None,
) -> Callable[P, R]:
    """Returns ``f`` with its parts sown under ``tag``, for models nobody instrumented by hand.

    The result is called exactly as ``f`` is and returns the same values
    (bit for bit; outside a harvest every sow is the identity), but ``reap``,
    ``plant``, ``harvest``, ``sites``, ``stream`` and the patching sweeps see sites:

    * a Flax NNX or Equinox module, or a Penzai layer: the output of every
      submodule (layer) call, named by its dotted path from the root
      (``"blocks.0.attn"``, ``"head"``; list indices and dict keys are elements);
    * a plain function: the output of every Flax Linen submodule it applies,
      named by the Linen scope path joined with dots (``"blocks_0.attn"``);
    * with ``ops=True``, any callable: also every primitive's output, named
      ``"<scope>/<primitive>:<n>"`` from the ``jax.named_scope`` stack (module
      paths included) and a counter per scope and primitive; ops inside ``scan``,
      ``cond``, ``jit`` and ``checkpoint`` are sites too;
    * with ``inputs=True``, module targets and Linen: also each submodule call's
      array arguments, ``"<path>:in"`` (one argument: the array itself; several:
      a tuple of them; flags, None and PRNG keys left out), which a plant replaces;
    * with ``attention=True`` or ``naming="transformer_lens"``: TransformerLens's
      hook sites or names (below).

    A site sown once holds the value itself; one sown k times (a shared module,
    a layer inside ``scan``) holds the k values stacked on a leading axis, and
    takes plants of either shape. A Penzai model's variables are traced as their
    frozen values; each ``pz.StateVariable`` it writes (a KV cache of Penzai's
    sampling mode) gets its new value after each harvest call, as the model's
    own call would leave it.

    Args:
        f: the model: a Flax NNX module, an Equinox module, a Penzai layer
            (``pz.nn.Layer``), or any callable (for Linen, the function that calls
            ``model.apply``; any function with ``ops=True``).
        tag: the tag the sites are sown under; pass the same ``tag`` to ``reap``,
            ``plant`` and ``sites``.
        ops: also sow every primitive's output (``"<scope>/<primitive>:<n>"``).
        inputs: also sow each submodule call's array arguments (``"<path>:in"``).
        names: which sites to sow, picked before anything is traced: a name, a
            glob pattern, a predicate on names, or a list of them (None: all).
        exclude: sites not to sow, spelt as ``names`` (None: none), as in ``reap``.
        attention: also give each attention module of a known kind (NNX
            ``MultiHeadAttention``, Linen ``MultiHeadDotProductAttention``, Equinox
            ``MultiheadAttention``, Penzai ``pz.nn.Attention``, Gemma's ``Attention``)
            TransformerLens's sites ``"<path>.hook_q"``, ``.hook_k``, ``.hook_v``,
            ``.hook_z`` (``[..., seq, heads, d_head]``), ``.hook_attn_scores`` (the
            scaled, masked scores; not Gemma's) and ``.hook_pattern``
            (the post-softmax weights, ``[..., heads, q_pos, k_pos]``).
        naming: ``"transformer_lens"``: TransformerLens's hook names instead of the
            paths (the keys of its ``ActivationCache``, nothing else). The ``i``-th
            transformer block (an NNX or Equinox module with one attention
            submodule and one submodule named ``mlp`` whose forward adds the
            attention's output to its input; attention only, a list element with
            one attention submodule; a Penzai layer of one or two
            ``pz.nn.Residual``; gemma's ``Block`` in a function target) gets
            ``"blocks.{i}.hook_resid_pre"`` (its input), ``.hook_attn_out`` and
            ``.hook_mlp_out`` (what attention and the MLP add to the stream),
            ``.hook_resid_mid`` (the stream between them, not in a parallel
            block), ``.hook_resid_post`` (its output) and ``.mlp.hook_pre`` /
            ``.mlp.hook_post`` (its MLP's hidden layer; a gated MLP's, Penzai's or
            gemma's, ``.mlp.hook_pre_linear`` too); the model ``"hook_embed"`` and
            ``"hook_pos_embed"``; with ``attention=True``, ``"blocks.{i}.attn.hook_q"``
            and so on. A module target's blocks are found, or refused, here. Where
            ``resid_mid`` is no part's output (NNX, Equinox, gemma without
            post-attention norm), sowing it can change the outputs in their last
            bits (leave it out with ``names`` to keep them bit for bit). None:
            harvest's own names.

    Returns:
        A callable with ``f``'s signature and outputs (a pytree, so it can
        be passed through ``jax.jit``) whose parts are sites of ``tag``.

    Raises:
        TypeError: if ``f`` is none of the kinds above (a module class rather
            than a model built from it, or a Linen module not bound to its
            variables, included), ``tag`` is not a non-empty string, or
            ``ops``/``inputs``/``attention`` is not a bool.
        ValueError: if ``naming`` is not None or ``"transformer_lens"``, the
            model has no transformer block of the kinds above, a block holds two
            attention modules, or ``naming`` is given with ``inputs=True``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from harvest import instrument, reap, plant
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.layers = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])
        ...     def __call__(self, x):
        ...         return self.layers[1](nnx.relu(self.layers[0](x)))
        >>> model = instrument(MLP(nnx.Rngs(0)))
        >>> {k: v.shape for k, v in reap(model, tag="modules")(jnp.ones(2)).items()}
        {'layers.0': (3,), 'layers.1': (1,)}
        >>> plant(model, tag="modules")({"layers.1": jnp.zeros(1)}, jnp.ones(2))
        Array([0.], dtype=float32)
        >>> list(reap(instrument(MLP(nnx.Rngs(0)), names="layers.1"), tag="modules")(jnp.ones(2)))
        ['layers.1']
    """
    kind = target_kind(f)
    if kind is None:
        raise TypeError(
            f"instrument needs a Flax NNX module, an Equinox module, a Penzai layer or a callable, got a "
            f"{type(f).__name__}. For a Linen model, instrument the function that applies it, "
            "e.g. instrument(lambda x: model.apply(variables, x))."
        )
    library = module_class(f)
    if library is not None:  # callable, but calling it builds a model
        name = getattr(f, "__name__", repr(f))
        what = f"build the model, then instrument it: instrument({name}(...))"
        if library == "Flax Linen":
            apply = f"{name}(...).apply(variables, x)"
            what = f"instrument the function that applies one: instrument(lambda x: {apply})"
        raise TypeError(
            f"instrument got the {library} class {name}, not a model: {what}, passing the "
            "arguments the class takes."
        )
    if unbound_linen(f):  # callable, but only inside model.apply
        name = type(f).__name__
        raise TypeError(
            f"instrument got an unbound Flax Linen module ({name}), which runs only through "
            "model.apply with its variables. Instrument the function that applies it: "
            "instrument(lambda x: model.apply(variables, x)), or the bound module "
            "instrument(model.bind(variables))."
        )
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"instrument needs `tag` to be a non-empty string, got {tag!r}.")
    for flag, value in (("ops", ops), ("inputs", inputs), ("attention", attention)):
        if not isinstance(value, bool):
            raise TypeError(f"instrument needs `{flag}` to be True or False, got {value!r}.")
    select = NameFilter.make(names, exclude)
    if isinstance(names, list):
        names = tuple(names)
    cls = InstrumentedPenzai if kind == "penzai" else Instrumented
    _transformer_lens.check_naming(naming, kind, describe(f), inputs)
    if naming is not None and kind != "function":  # a model's blocks are known now
        _transformer_lens.names_of(submodules(f, kind), kind, describe(f))
    return cls(f, Options(kind, tag, ops, inputs, select, names, attention, naming))
