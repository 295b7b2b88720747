"""TransformerLens's hook names (`instrument(..., naming="transformer_lens")`).

With the naming asked for, a call sows TransformerLens's names only (the keys of
its ``ActivationCache``; `instrument`'s docstring lists them), not the paths:
``blocks.{i}.hook_resid_pre`` and so on for each block found, numbered in the
model's order, ``hook_embed`` and ``hook_pos_embed`` for the embedding modules
outside the blocks (`_embeddings`). Each is sown where the value is, so a plant
there changes what the block computes with. Three kinds of block are read:

* Penzai: a layer of two ``pz.nn.Residual``, the first holding an attention layer
  (``penzai.models.transformer``'s blocks), or one (attention only); or a
  parallel block, one ``BranchAndAddTogether`` of the identity, the attention's
  branch and the MLP's (GPT-NeoX's, no ``resid_mid``). Every name is a layer's
  input or output; a gated feed-forward's gate gives ``mlp.hook_pre``, its other
  branch ``hook_pre_linear`` (`_add_penzai_mlp`).
* Flax NNX and Equinox: a module with one attention submodule and one named
  ``mlp`` whose forward adds the attention's output to its input (GPT-2's
  ``x = x + attn(ln_1(x))``); or, attention only, a list element with one
  attention submodule. ``resid_mid`` is no submodule's output there, so it is
  sown beside the attention's output as ``resid_pre + attn_out`` (`_resid_mid`).
  A parallel block (GPT-J's) has no ``resid_mid``, which only its forward shows,
  after the attention returned: so where ``resid_mid`` is asked for, the model
  first runs abstractly, sowing nothing, noting the blocks `_check_sequential`
  sees to be parallel (``Names.parallel``). A block seen computing otherwise, a
  cross-attention, or a list element with two attention submodules is refused.
* gemma's ``Block`` (Linen, in a function target), named as it starts to run
  (`gemma_block`): ``resid_mid`` as in NNX, the gated feed-forward's hooks at its
  two einsums, ``hook_embed`` at ``Embedder.encode``'s output.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp

from .. import _jax
from . import _attention
from ._module_paths import is_named, optional

NAMINGS = ("transformer_lens",)  # what `instrument(naming=...)` takes

# What a TransformerLens name looks like: every other site is left out of a call with names.
_TL_NAME = re.compile(r"(hook_embed|hook_pos_embed|blocks\.\d+\.((attn|mlp)\.)?hook_\w+)")
MLP_HOOKS = ("hook_pre", "hook_post")
GATED_HOOKS = ("hook_pre", "hook_pre_linear", "hook_post")  # a gated MLP's (gemma's)
PARALLEL = "<parallel>"  # a block's resid_mid part where it has none (attention beside the MLP)


def is_tl_name(name: str) -> bool:
    """Whether `name` is one of TransformerLens's hook names (an `ActivationCache` key)."""
    return _TL_NAME.fullmatch(name) is not None


@dataclasses.dataclass
class Names:
    """One call's TransformerLens names: which part (by path) each is sown at."""

    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # block -> its resid_pre
    outputs: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # part -> names
    # NNX, Equinox and gemma, where resid_mid is computed: attn_out's part -> (block, name).
    mids: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    hooks: dict[str, str] = dataclasses.field(default_factory=dict)  # attention -> blocks.{i}.attn
    # NNX and Equinox: attention -> its block, for the self-attention check.
    blocks: dict[str, str] = dataclasses.field(default_factory=dict)
    # An MLP's linear maps: mlp path -> (blocks.{i}.mlp, its linear parts' paths).
    mlps: dict[str, tuple[str, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    linears: dict[str, str] = dataclasses.field(default_factory=dict)  # linear part -> its mlp
    called: dict[str, int] = dataclasses.field(default_factory=dict)  # mlp -> linears run so far
    streams: dict[str, Any] = dataclasses.field(default_factory=dict)  # block path -> its input
    # For the structure check: block path -> what its attn_out part received, and returned.
    attention_args: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    attention_out: dict[str, Any] = dataclasses.field(default_factory=dict)
    pairs: set[str] = dataclasses.field(default_factory=set)  # gemma: parts giving (cache, x)
    gated: dict[str, str] = dataclasses.field(default_factory=dict)  # gemma: mlp -> blocks.{i}.mlp
    # NNX and Equinox: the blocks a probe's run (`probing`) saw to be parallel (no resid_mid).
    parallel: set[str] = dataclasses.field(default_factory=set)
    probing: bool = False

    def all_names(self, attention: bool) -> list[str]:
        """Every name these give (the attention hooks' with attention=True)."""
        names = [*self.inputs.values(), *(n for ns in self.outputs.values() for n in ns)]
        names += [name for _, name in self.mids.values()]
        for prefix, linears in self.mlps.values():
            # hook_pre is the first map's output with exactly two maps (of three, a gated
            # MLP's, which one is the gate is not known).
            hooks = MLP_HOOKS if len(linears) == 2 else ("hook_post",)
            names += [f"{prefix}.{h}" for h in hooks]
        names += [f"{prefix}.{h}" for prefix in self.gated.values() for h in GATED_HOOKS]
        if attention:
            names += [f"{alias}.{h}" for alias in self.hooks.values() for h in _attention.HOOKS]
        return names


_KINDS = {
    "nnx": "a Flax NNX model",
    "equinox": "an Equinox model",
    "penzai": "a Penzai model",
    "function": "a function target",
}


def no_transformer_blocks(target: str, kind: str) -> ValueError:
    return ValueError(
        f"instrument(naming='transformer_lens') found no transformer block in {target} "
        f"({_KINDS[kind]}). It reads Flax NNX and Equinox blocks (a module with one attention submodule, "
        "nnx.MultiHeadAttention or eqx.nn.MultiheadAttention, and one submodule named `mlp`; or, "
        "attention only, an element of a list with one attention submodule), Penzai blocks (a "
        "layer of one or two pz.nn.Residual, the first holding the attention) and the gemma "
        "library's Block. Reap the block's own parts by their paths instead (names=None)."
    )


def check_naming(names: Any, kind: str, target: str, inputs: bool) -> None:
    """Raises unless `names` is None, or a naming this module knows for a target of `kind`."""
    if names is None:
        return
    if names not in NAMINGS:
        raise ValueError(
            f"instrument: unknown names={names!r}. Use one of {', '.join(map(repr, NAMINGS))}, or None "
            "for harvest's own names (each part's dotted path)."
        )
    if inputs:
        raise ValueError(
            "instrument(naming='transformer_lens') sows TransformerLens's names only, so inputs=True "
            "has nothing to add: each block's input is blocks.{i}.hook_resid_pre. Pass one of them, "
            "or names=None for the parts' inputs by their paths."
        )


def names_of(parts: list[tuple[str, Any]], kind: str, target: str) -> Names:
    """The TransformerLens names of the blocks among `parts` ((path, module), the
    model's order); raises if there is none, or a block TransformerLens's names
    do not describe."""
    blocks = _penzai_blocks(parts) if kind == "penzai" else _module_blocks(parts, kind)
    if not blocks:
        raise no_transformer_blocks(target, kind)
    table = Names()
    for block in blocks:
        _add(table, *block)
        if kind != "penzai":  # (query, key, value) arguments: checked to be one array
            table.blocks[block[1]] = block[0]
    inside = tuple(b[0] + "." for b in blocks)
    outside = [(p, m) for p, m in parts if not p.startswith(inside) and p not in table.inputs]
    for path, name in _embeddings(outside, kind).items():
        table.outputs.setdefault(path, []).append(name)
    for found in blocks:
        mlp, name = found[4], table.inputs[found[0]].rpartition(".")[0]
        if mlp is not None and kind == "penzai":
            _add_penzai_mlp(table, parts, f"{name}.mlp", mlp)
        elif mlp is not None:
            _add_mlp(table, parts, name, mlp)
    return table


def _add_penzai_mlp(table: Names, parts: list[tuple[str, Any]], prefix: str, delta: str) -> None:
    """Names the MLP hooks of the Penzai feed-forward layer under `delta` (a block's MLP
    branch): ``hook_post`` the output of the sublayer before its last ``Linear`` (or
    ``Affine``); ``hook_pre`` its first one's output, or a gated one's (``BranchAndMultiplyTogether``
    of a group named "gate" and a linear branch) the gate's, ``hook_pre_linear`` the other's."""
    from penzai import pz

    inside = [(p, m) for p, m in parts if p.startswith(delta + ".")]
    found = [(p, m) for p, m in inside if is_named(m, "TransformerFeedForward", "penzai.")]
    if len(found) != 1:
        return
    path, layer = found[0]
    sublayers = layer.sublayers
    linear = (pz.nn.Linear, pz.nn.Affine)  # Affine: a Linear and its bias (GPT-NeoX's)
    if len(sublayers) < 2 or not isinstance(sublayers[-1], linear):
        return
    hooks = {f"{path}.sublayers.{len(sublayers) - 2}": "hook_post"}
    first = sublayers[0]
    if isinstance(first, linear):
        hooks[f"{path}.sublayers.0"] = "hook_pre"
    elif isinstance(first, pz.nn.BranchAndMultiplyTogether) and len(first.branches) == 2:
        gates = [getattr(b, "name", None) == "gate" for b in first.branches]
        for i, branch in enumerate(first.branches):
            at = f"{path}.sublayers.0.branches.{i}"
            if isinstance(getattr(branch, "sublayers", None), list) and branch.sublayers:
                branch, at = branch.sublayers[0], f"{at}.sublayers.0"
            if sum(gates) == 1 and isinstance(branch, pz.nn.Linear):
                hooks[at] = "hook_pre" if gates[i] else "hook_pre_linear"
    for part, hook in hooks.items():
        table.outputs.setdefault(part, []).append(f"{prefix}.{hook}")


def _add(
    table: Names,
    path: str,
    attention: str,
    attn_out: str,
    mid: str | None,
    mlp_out: str | None,
) -> None:
    """Names the next block of `table`: the block at `path`, the parts whose outputs are
    attn_out, resid_mid (None: computed; PARALLEL: none, a parallel block's) and mlp_out
    (None: attention only), its attention at `attention`."""
    name = f"blocks.{len(table.inputs)}"
    table.inputs[path] = f"{name}.hook_resid_pre"
    for part, hook in ((attn_out, "attn_out"), (mlp_out, "mlp_out"), (path, "resid_post")):
        if part is not None:
            table.outputs.setdefault(part, []).append(f"{name}.hook_{hook}")
    # TransformerLens's `attn_only` and `parallel_attn_mlp` blocks have no resid_mid.
    if mid is None and mlp_out is not None:
        table.mids[attn_out] = (path, f"{name}.hook_resid_mid")
    elif mid is not None and mid != PARALLEL:
        table.outputs.setdefault(mid, []).append(f"{name}.hook_resid_mid")
    table.hooks[attention] = f"{name}.attn"


def _add_mlp(table: Names, parts: list[tuple[str, Any]], block: str, mlp: str) -> None:
    """Notes the linear maps of the MLP at `mlp` (of the block named `block`), for its hooks."""
    linears = tuple(p for p, m in parts if p.startswith(mlp + ".") and _is_linear(m))
    if len(linears) < 2:
        return
    table.mlps[mlp] = (f"{block}.mlp", linears)
    for path in linears:
        table.linears[path] = mlp


def _is_linear(module: Any) -> bool:
    """A linear map an MLP is built of: NNX's ``Linear``, ``LinearGeneral``, ``Einsum``,
    Equinox's ``Linear``."""
    nnx, eqx = optional("flax.nnx"), optional("equinox")
    if nnx is not None and isinstance(module, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)):
        return True
    return eqx is not None and isinstance(module, eqx.nn.Linear)


def gemma_block(call: Any, path: str, module: Any) -> None:
    """Names the Linen module at `path` as the next block if it is gemma's `Block`, as it
    starts to run (a function target's modules are known only then). In gemma 3's
    forward, `attn_out` is the post-attention norm's output (the attention's, without
    one), `mlp_out` likewise; the block and its attention return `(cache, x)`."""
    table = call.residual
    if table is None or path in table.inputs or not is_named(module, "Block", "gemma."):
        return
    attn_out = f"{path}.post_attention_norm" if module.use_post_attn_norm else f"{path}.attn"
    mlp_out = f"{path}.post_ffw_norm" if module.use_post_ffw_norm else f"{path}.mlp"
    _add(table, path, f"{path}.attn", attn_out, None, mlp_out)
    table.pairs.update((path, f"{path}.attn"))
    table.gated[f"{path}.mlp"] = table.inputs[path].rpartition(".")[0] + ".mlp"


def gemma_embed(call: Any, module: Any, out: Any) -> Any:
    """`out`, what `module.encode` returned, sown as ``hook_embed`` if `module` is gemma's
    `Embedder` (its table's rows times sqrt(d_model), which TransformerLens's conversion
    folds into its ``W_E``)."""
    is_gemma = is_named(module, "Embedder", "gemma.")
    return call.sow("hook_embed", out) if call.residual is not None and is_gemma else out


def gemma_mlp_output(call: Any, path: str, module: Any, out: Any) -> Any:
    """`out`, the output of the einsum at `path`: if it is the gating einsum of a gemma
    block's feed-forward ([..., 2, d_mlp], gelu's input then the factor it multiplies),
    ``hook_pre`` and ``hook_pre_linear`` (TransformerLens's gate and ``W_in`` branch)."""
    prefix = _gemma_mlp(call, path, module, "gating_einsum")
    hooks = (f"{prefix}.hook_pre", f"{prefix}.hook_pre_linear")
    if prefix is None or not call.select(hooks):
        return out
    gate, linear = (call.sow(hook, out[..., i, :]) for i, hook in enumerate(hooks))
    return jnp.stack([gate, linear], axis=-2)


def gemma_mlp_input(call: Any, path: str, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` of the einsum at `path`, `(equation, x)`: if it is a gemma feed-forward's
    last (`linear`), x (gelu(gate) * linear branch) sown as ``hook_post``."""
    prefix = _gemma_mlp(call, path, module, "linear")
    if prefix is None or len(args) < 2:
        return args
    return (args[0], call.sow(f"{prefix}.hook_post", args[1]), *args[2:])


def _gemma_mlp(call: Any, path: str, module: Any, weight: str) -> str | None:
    """``blocks.{i}.mlp`` if the einsum at `path` is the one holding `weight` in the
    feed-forward of a gemma block this call has named, else None."""
    table: Names | None = call.residual
    if table is None or getattr(module, "weight_name", None) != weight:
        return None
    return table.gated.get(path.rpartition(".")[0])


# (block, its attention, the part whose output is attn_out, the part whose output is
# resid_mid or None where it is computed (PARALLEL: none), the part whose output is mlp_out
# or None), by path.
_Block = tuple[str, str, str, str | None, str | None]


def _is_attention(module: Any, kind: str) -> bool:
    if kind == "equinox":
        return _attention.is_equinox_attention(module)
    return _attention.flax_kind(module) == "nnx"


def _module_blocks(parts: list[tuple[str, Any]], kind: str) -> list[_Block]:
    """(block, attention, attn_out part, None, mlp_out part or None) of each NNX or Equinox
    block; raises for a list element with more than one attention submodule."""
    attentions: dict[str, list[str]] = {}  # parent path -> its attention submodules
    mlps: dict[str, list[str]] = {}  # parent path -> its submodules named mlp
    for path, module in parts:
        parent, _, leaf = path.rpartition(".")
        if _is_attention(module, kind):
            attentions.setdefault(parent, []).append(path)
        if leaf == "mlp":
            mlps.setdefault(parent, []).append(path)
    found: list[_Block] = []
    for path, _ in parts:
        attention, mlp = attentions.get(path, []), mlps.get(path, [])
        listed = path.rpartition(".")[2].isdigit()  # an element of a list of blocks
        if len(attention) > 1 and listed:
            raise ValueError(
                f"instrument(naming='transformer_lens'): the block at {path!r} holds "
                f"{len(attention)} attention modules ({', '.join(map(repr, attention))}), as a "
                "decoder's self- and cross-attention do; TransformerLens's block names describe one. "
                "Reap the block's parts by their paths instead (names=None)."
            )
        if len(attention) == 1 and (len(mlp) == 1 or (not mlp and listed)):  # or attention only
            found.append((path, attention[0], attention[0], None, mlp[0] if mlp else None))
    return found


def _penzai_blocks(parts: list[tuple[str, Any]]) -> list[_Block]:
    """(block, attention, attn_out part, resid_mid part, mlp_out part) of each Penzai block:
    one or two ``Residual`` (the first holding the attention), or a parallel block
    (GPT-NeoX's, ``x + attn(...) + mlp(...)``): one ``BranchAndAddTogether`` of the
    identity, a branch holding the attention and one holding none."""
    from penzai import pz

    attentions = sorted(_attention.penzai_attention_paths(parts))

    def within(part: str) -> list[str]:
        return [a for a in attentions if a.startswith(part + ".")]

    found: list[_Block] = []
    for path, layer in parts:
        sublayers = getattr(layer, "sublayers", None)
        if not isinstance(sublayers, list) or len(sublayers) not in (1, 2):
            continue
        first, second, add = f"{path}.sublayers.0", f"{path}.sublayers.1", sublayers[0]
        if (
            len(sublayers) == 1
            and isinstance(add, pz.nn.BranchAndAddTogether)
            and len(add.branches) == 3
            and isinstance(add.branches[0], pz.nn.Identity)
        ):
            attn, mlp = f"{first}.branches.1", f"{first}.branches.2"
            if len(within(attn)) == 1 and not within(mlp):
                found.append((path, within(attn)[0], attn, PARALLEL, mlp))
        elif all(isinstance(s, pz.nn.Residual) for s in sublayers) and len(within(first)) == 1:
            if len(sublayers) == 1:  # attention only
                found.append((path, within(first)[0], f"{first}.delta", None, None))
            elif not within(second):
                found.append((path, within(first)[0], f"{first}.delta", first, f"{second}.delta"))
    return found


# Each module target's kind of embedding module: (class name, its package).
_EMBEDDINGS = {
    "nnx": ("Embed", "flax.nnx"),
    "equinox": ("Embedding", "equinox."),
    "penzai": ("EmbeddingLookup", "penzai."),
}


def _embeddings(outside: list[tuple[str, Any]], kind: str) -> dict[str, str]:
    """{path: "hook_embed" or "hook_pos_embed"} for the embedding modules outside the
    blocks: one is the token embedding; of two, the one whose name has "pos" (or is
    GPT-2's "wpe") is the positional one. Any other number names none."""

    def positional(path: str) -> bool:
        leaf = path.rpartition(".")[2].lower()
        return "pos" in leaf or leaf == "wpe"

    found = [p for p, m in outside if is_named(m, *_EMBEDDINGS[kind])]
    names = {p: "hook_pos_embed" if positional(p) else "hook_embed" for p in found}
    one_each = len(set(names.values())) == len(names)  # a token embedding, a positional one
    return names if one_each and "hook_embed" in names.values() else {}


# ---------------------------------------------------------------------------
# Sowing the names, from `instrument`'s call of each part.


def part_input(call: Any, path: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` of the part at `path`: a block's first (the stream) sown as resid_pre, the
    last linear map of an MLP's first as its hook_post; a block's other parts checked to
    compute as the names assume (`_check_sequential`)."""
    table = call.residual
    if table is None:
        return args
    given = [a for a in args[:3] if getattr(a, "shape", None) is not None]  # (q, k, v)
    if path in table.blocks and any(a is not given[0] for a in given[1:]):
        raise ValueError(
            f"instrument(naming='transformer_lens'): the attention at {path!r} in the block at "
            f"{table.blocks[path]!r} is given keys or values other than its queries (cross-attention), "
            "which TransformerLens's block names do not describe. Reap the block's parts by their "
            "paths instead (names=None)."
        )
    if table.mids:
        _check_sequential(call, table, path, args)
    if path in table.mlps:
        table.called[path] = 0
    elif path in table.linears and args:  # an MLP's last linear map: its input is hook_post
        mlp = table.linears[path]
        prefix, linears = table.mlps[mlp]
        index = table.called.get(mlp, 0)
        table.called[mlp] = index + 1
        if index != len(linears) - 1:
            return args
        return (call.sow(f"{prefix}.hook_post", args[0]), *args[1:])
    name = table.inputs.get(path)
    if name is None or not args:
        return args
    stream = call.sow(name, args[0])
    table.streams[path] = stream
    table.attention_args.pop(path, None)  # from the block's last call, if it runs again
    table.attention_out.pop(path, None)
    return (stream, *args[1:])


def _check_sequential(call: Any, table: Names, path: str, args: tuple[Any, ...]) -> None:
    """Raises where a block whose resid_mid is computed (NNX, Equinox, gemma) is seen not to
    add its attention's output straight to its input, as `attn_out` and `resid_mid` assume
    (a part takes that output: a norm after attention). After the attention, a part taking
    the block's input or what the attention took marks a parallel block (GPT-J's): noted
    on a probe's run, refused on another if its resid_mid is sown."""
    if path in table.mids:
        table.attention_args[table.mids[path][0]] = args
        return
    block = next((b for b in table.attention_out if path.startswith(b + ".")), None)
    if block is None:
        return
    attention_out = table.attention_out[block]
    earlier = (table.streams.get(block), *table.attention_args.get(block, ()))
    for arg in map(_jax.unbatched, args):  # an Equinox block vmaps its parts over positions
        if arg is attention_out:
            raise ValueError(
                f"instrument(naming='transformer_lens'): the block at {block!r} passes its attention's "
                f"output to {path!r} before adding it to the stream (a norm after attention, as Gemma 2's), "
                "so the attention's output is not what TransformerLens's hook_attn_out and hook_resid_mid "
                "mean. Reap the block's parts by their paths instead (names=None)."
            )
        if block in table.parallel or not any(arg is e for e in earlier if e is not None):
            continue
        if table.probing:
            table.parallel.add(block)
        elif call.select((next(n for b, n in table.mids.values() if b == block),)):
            raise ValueError(
                f"instrument(naming='transformer_lens'): after its attention, the block at {block!r} "
                f"gives {path!r} the block's input (or what the attention took), so its MLP does not "
                "read the stream after attention: a parallel block has no hook_resid_mid. Leave it "
                "out, e.g. exclude='*.hook_resid_mid'."
            )


def part_output(call: Any, path: str, value: Any) -> Any:
    """`value` (the output of the part at `path`; of a gemma block or attention's
    `(cache, x)`, x) sown under its TransformerLens names."""
    table = call.residual
    if table is None:
        return value
    if path in table.pairs and isinstance(value, tuple) and len(value) == 2:
        cache, stream = value
        return (cache, part_output(call, path, stream))
    if path in table.linears:
        mlp = table.linears[path]
        prefix, linears = table.mlps[mlp]
        if len(linears) == 2 and table.called.get(mlp) == 1:  # the first map's output
            value = call.sow(f"{prefix}.hook_pre", value)
    for name in table.outputs.get(path, ()):
        value = call.sow(name, value)
    if path in table.mids:
        block, name = table.mids[path]
        if block not in table.parallel:
            value = _resid_mid(call, table, name, table.streams[block], value)
        table.attention_out[block] = value
    return value


def _resid_mid(call: Any, table: Names, name: str, resid_pre: Any, attn_out: Any) -> Any:
    """The attention's output `attn_out`, with `resid_pre + attn_out` sown as `name` on the way
    (a probe's run only checks the shapes)."""
    if not call.select((name,)) and not table.probing:
        return attn_out
    if getattr(resid_pre, "shape", None) != getattr(attn_out, "shape", None):
        raise ValueError(
            f"instrument(naming='transformer_lens'): {name} is the block's input plus its attention's "
            f"output, but they have shapes {getattr(resid_pre, 'shape', None)} and "
            f"{getattr(attn_out, 'shape', None)}, so this block does not add its attention's output to "
            "its input. Leave the name out with `exclude`, or reap the block's parts by their paths."
        )
    if table.probing:
        return attn_out
    mid = resid_pre + attn_out
    sown = call.sow(name, mid)
    # Unplanted, `sown - mid` is exactly zero, so the block adds what it did (XLA may
    # compile the attention's last product differently for the extra add: gemma's
    # outputs then differ in their last bits). Planted, the block's own
    # `resid_pre + attn_out` gives the planted value, up to rounding.
    return attn_out + (sown - mid)
