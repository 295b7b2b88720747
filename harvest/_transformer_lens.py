"""TransformerLens's names for the residual stream (`instrument(..., names="transformer_lens")`).

Each transformer block found in the model, numbered ``i`` in the model's order,
gets TransformerLens's five residual-stream sites, beside the sites harvest
already names by path:

* ``blocks.{i}.hook_resid_pre``: the block's input (the stream it reads);
* ``blocks.{i}.hook_attn_out``: what attention adds to the stream;
* ``blocks.{i}.hook_resid_mid``: the stream after that addition;
* ``blocks.{i}.hook_mlp_out``: what the MLP adds to the stream;
* ``blocks.{i}.hook_resid_post``: the block's output.

With ``attention=True``, the block's attention hooks are also
``blocks.{i}.attn.hook_q`` (and ``_k``, ``_v``, ``_z``, ``_pattern``).

Each is sown where the value is, so a plant there changes what the block
computes with. Three kinds of block are read:

* Penzai: a layer whose sublayers are two ``pz.nn.Residual``, the first holding
  an attention layer (the llama-like blocks of ``penzai.models.transformer``,
  its Gemma's among them). Every name is a layer's input or output.
* Flax NNX: a module with one ``nnx.MultiHeadAttention`` submodule and one
  submodule named ``mlp`` (TransformerLens's own name), whose forward adds the
  attention's output to its input, as GPT-2's ``x = x + attn(ln_1(x))`` does.
  ``resid_mid`` is not a submodule's output there, so it is sown beside the
  attention's output as ``resid_pre + attn_out``; a value planted there moves
  the attention's output by the difference, so the block's own addition gives
  the planted value (up to rounding). That extra addition can change how XLA
  compiles the attention's last product, and so the model's outputs in their
  last bits; leaving ``resid_mid`` out (``where``) keeps them bit for bit. A
  block seen computing otherwise is refused
  (`_check_sequential`): one that hands its attention's output to another
  submodule before adding it, or a parallel block whose MLP reads its input.
* gemma's ``Block`` (Linen, in a function target), named as it starts to run:
  its forward is known (`gemma_block`); ``resid_mid`` is sown as in NNX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _attention, _errors

NAMINGS = ("transformer_lens",)  # what `instrument(names=...)` takes


@dataclasses.dataclass
class Names:
    """One call's TransformerLens names: which site (by path) each is an alias of."""

    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # block -> its resid_pre
    outputs: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # part -> names
    # NNX and gemma, where resid_mid is computed: attn_out's part -> (block, resid_mid name).
    mids: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    hooks: dict[str, str] = dataclasses.field(default_factory=dict)  # attention -> blocks.{i}.attn
    streams: dict[str, Any] = dataclasses.field(default_factory=dict)  # block path -> its input
    # For the structure check: block path -> what its attn_out part received, and returned.
    attention_args: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    attention_out: dict[str, Any] = dataclasses.field(default_factory=dict)
    pairs: set[str] = dataclasses.field(default_factory=set)  # gemma: parts giving (cache, x)

    def all_names(self, attention: bool) -> list[str]:
        """Every name these give (the attention hooks' with attention=True)."""
        names = [*self.inputs.values(), *(n for ns in self.outputs.values() for n in ns)]
        names += [name for _, name in self.mids.values()]
        if attention:
            names += [f"{alias}.{h}" for alias in self.hooks.values() for h in _attention.HOOKS]
        return names


def check_naming(names: Any, kind: str, target: str) -> None:
    """Raises unless `names` is None, or a naming this module knows for a target of `kind`."""
    if names is None:
        return
    if names not in NAMINGS:
        raise _errors.unknown_naming(names, NAMINGS)
    if kind not in ("nnx", "penzai", "function"):
        raise _errors.no_transformer_blocks(target, kind)


def names_of(parts: list[tuple[str, Any]], kind: str, target: str) -> Names:
    """The TransformerLens names of the blocks among `parts` ((path, module), the
    model's order); raises if there is none."""
    blocks = _penzai_blocks(parts) if kind == "penzai" else _nnx_blocks(parts)
    if not blocks:
        raise _errors.no_transformer_blocks(target, kind)
    table = Names()
    for block in blocks:
        _add(table, *block)
    return table


def _add(
    table: Names, path: str, attention: str, attn_out: str, mid: str | None, mlp_out: str
) -> None:
    """Names the next block of `table`: the block at `path`, the parts whose outputs are
    attn_out, resid_mid (None: computed) and mlp_out, its attention at `attention`."""
    name = f"blocks.{len(table.inputs)}"
    table.inputs[path] = f"{name}.hook_resid_pre"
    for part, hook in ((attn_out, "attn_out"), (mlp_out, "mlp_out"), (path, "resid_post")):
        table.outputs.setdefault(part, []).append(f"{name}.hook_{hook}")
    if mid is None:
        table.mids[attn_out] = (path, f"{name}.hook_resid_mid")
    else:
        table.outputs.setdefault(mid, []).append(f"{name}.hook_resid_mid")
    if attention != f"{name}.attn":
        table.hooks[attention] = f"{name}.attn"


def gemma_block(call: Any, path: str, module: Any) -> None:
    """Names the Linen module at `path` as the next block if it is gemma's `Block`, as it
    starts to run (a function target's modules are known only then). Its forward (gemma
    3's `Block.__call__`): `attn_out` is the attention's output after the optional
    post-attention norm, added to the input; `mlp_out` the MLP's after the optional
    post-MLP norm, added to that; the block and its attention return `(cache, x)`."""
    table = call.residual
    cls = type(module)
    if table is None or path in table.inputs or cls.__name__ != "Block":
        return
    if not cls.__module__.startswith("gemma."):
        return
    attn_out = f"{path}.post_attention_norm" if module.use_post_attn_norm else f"{path}.attn"
    mlp_out = f"{path}.post_ffw_norm" if module.use_post_ffw_norm else f"{path}.mlp"
    _add(table, path, f"{path}.attn", attn_out, None, mlp_out)
    table.pairs.update((path, f"{path}.attn"))


# (block, its attention, the part whose output is attn_out, the part whose output is
# resid_mid or None where it is computed, the part whose output is mlp_out), by path.
_Block = tuple[str, str, str, str | None, str]


def _nnx_blocks(parts: list[tuple[str, Any]]) -> list[_Block]:
    """(block, attention, attn_out part, None, mlp_out part) of each NNX block."""
    attentions: dict[str, list[str]] = {}  # parent path -> its attention submodules
    mlps: dict[str, list[str]] = {}  # parent path -> its submodules named mlp
    for path, module in parts:
        parent, _, leaf = path.rpartition(".")
        if _attention.flax_kind(module) == "nnx":
            attentions.setdefault(parent, []).append(path)
        if leaf == "mlp":
            mlps.setdefault(parent, []).append(path)
    found: list[_Block] = []
    for path, _ in parts:
        attention, mlp = attentions.get(path, []), mlps.get(path, [])
        if len(attention) == 1 and len(mlp) == 1:
            found.append((path, attention[0], attention[0], None, mlp[0]))
    return found


def _penzai_blocks(parts: list[tuple[str, Any]]) -> list[_Block]:
    """(block, attention, attn_out part, resid_mid part, mlp_out part) of each Penzai block."""
    from penzai import pz

    attentions = _attention.penzai_attention_paths(parts)
    found: list[_Block] = []
    for path, layer in parts:
        sublayers = getattr(layer, "sublayers", None)
        if not (
            isinstance(sublayers, list)
            and len(sublayers) == 2
            and all(isinstance(s, pz.nn.Residual) for s in sublayers)
        ):
            continue
        first, second = f"{path}.sublayers.0", f"{path}.sublayers.1"
        inside = [a for a in sorted(attentions) if a.startswith(first + ".")]
        if len(inside) == 1 and not any(a.startswith(second + ".") for a in attentions):
            found.append((path, inside[0], f"{first}.delta", first, f"{second}.delta"))
    return found


# ---------------------------------------------------------------------------
# Sowing the names, from `instrument`'s call of each part.


def part_input(call: Any, path: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` of the part at `path`: a block's first (the stream) sown as resid_pre; an
    NNX block's other parts checked to compute as the names assume (`_check_sequential`)."""
    table = call.residual
    if table is None:
        return args
    if table.mids:
        _check_sequential(call, table, path, args)
    name = table.inputs.get(path)
    if name is None or not args:
        return args
    stream = call.sow(name, args[0])
    table.streams[path] = stream
    table.attention_args.pop(path, None)  # from the block's last call, if it runs again
    table.attention_out.pop(path, None)
    return (stream, *args[1:])


def _check_sequential(call: Any, table: Names, path: str, args: tuple[Any, ...]) -> None:
    """Raises where a block whose resid_mid is computed (NNX, gemma) is seen not to add
    its attention's output straight to its input, then run its MLP on the sum, which
    `attn_out` and `resid_mid` assume: a part that takes the attention's output (a norm
    after attention in an NNX block; gemma's Block names its own as attn_out), or, after the
    attention, a part that takes the block's input or what the attention took (a
    parallel block, GPT-J's, whose MLP does not read `resid_mid`)."""
    if path in table.mids:
        table.attention_args[table.mids[path][0]] = args
        return
    block = next((b for b in table.attention_out if path.startswith(b + ".")), None)
    if block is None:
        return
    attention_out = table.attention_out[block]
    earlier = (table.streams.get(block), *table.attention_args.get(block, ()))
    for arg in args:
        if arg is attention_out:
            raise _errors.attention_output_not_added(block, path)
        if any(arg is e for e in earlier if e is not None) and call.select(
            (table.mids[_attention_of(table, block)][1],)
        ):
            raise _errors.parallel_block(block, path)


def _attention_of(table: Names, block: str) -> str:
    return next(a for a, (b, _) in table.mids.items() if b == block)


def part_output(call: Any, path: str, value: Any) -> Any:
    """`value` (the output of the part at `path`, sown under `path`) sown under its
    TransformerLens names too."""
    table = call.residual
    if table is None:
        return value
    if path in table.pairs and isinstance(value, tuple) and len(value) == 2:
        cache, stream = value
        return (cache, _stream_output(call, table, path, stream))
    return _stream_output(call, table, path, value)


def _stream_output(call: Any, table: Names, path: str, value: Any) -> Any:
    """`value`, the stream's part that the part at `path` gives, sown under its names."""
    for name in table.outputs.get(path, ()):
        value = call.sow(name, value)
    if path in table.mids:
        block, name = table.mids[path]
        value = _resid_mid(call, name, table.streams[block], value)
        table.attention_out[block] = value
    return value


def _resid_mid(call: Any, name: str, resid_pre: Any, attn_out: Any) -> Any:
    """The attention's output `attn_out`, with `resid_pre + attn_out` sown as `name` on the way."""
    if not call.select((name,)):
        return attn_out
    if getattr(resid_pre, "shape", None) != getattr(attn_out, "shape", None):
        raise _errors.residual_shapes(name, resid_pre, attn_out)
    mid = resid_pre + attn_out
    sown = call.sow(name, mid)
    # Unplanted, `sown - mid` is exactly zero, so the block adds what it did (XLA may
    # compile the attention's last product differently for the extra add: gemma's
    # outputs then differ in their last bits). Planted, the block's own
    # `resid_pre + attn_out` gives the planted value, up to rounding.
    return attn_out + (sown - mid)


def wanted(call: Any, name: str) -> bool:
    """Whether the attention hook `name` is sown: selected under its own name or its alias."""
    alias = hook_alias(call, name)
    return bool(call.select((name,)) or (alias is not None and call.select((alias,))))


def hook_alias(call: Any, name: str) -> str | None:
    """`blocks.{i}.attn.hook_x` for the attention hook `name` (`<path>.hook_x`), if any."""
    table = call.residual
    if table is None:
        return None
    path, _, hook = name.rpartition(".")
    alias = table.hooks.get(path)
    return None if alias is None else f"{alias}.{hook}"
