"""TransformerLens's hook names on attention modules of known kinds (`instrument(..., attention=True)`).

Each attention module at `path` gets six sites, whatever library it comes from:

* `path.hook_q`, `path.hook_k`, `path.hook_v`: queries, keys and values,
  `[..., seq, heads, d_head]`, as their projections give them (before any
  rotary embedding or rescaling, as TransformerLens's);
* `path.hook_attn_scores`: the scores the softmax takes, scaled and masked (with the
  library's large negative number where TransformerLens has -inf),
  `[..., heads, q_pos, k_pos]` (not Gemma's: `refuse_gemma_scores`);
* `path.hook_pattern`: the weights after softmax (before dropout), same layout;
* `path.hook_z`: the weighted sum of values per head, `[..., seq, heads, d_head]`,
  before the output projection.

A hook is sown in that layout and converted back after (a transpose or reshape,
no arithmetic), so a plant there changes exactly what the module computes with.
Each library's own code computes what it exposes; harvest only what none does:

* Linen: its own `dot_product_attention`, run through `attention_fn` with the two
  products it lets a caller choose: q, k, v are its inputs (NNX's too, after
  `normalize_qk`; while decoding k and v are the whole cache), the scores at the
  first product's output (plus Flax's bias and mask), the pattern at the second
  one's input, z at its output.
* NNX: its own `dot_product_attention` where only q, k, v and z are asked for;
  else the pattern from Flax's `dot_product_attention_weights`, the scores from
  `_nnx_scores`, and where Flax takes the fused path (`jax.nn.dot_product_attention`,
  which exposes nothing) its XLA implementation op for op (`_fused_attention`), so
  the output stays bit for bit. In both, Flax's dropout comes after the pattern hook.
* Equinox: `MultiheadAttention.__call__` has no extension point (its scores live
  inside a per-head vmap), so harvest runs its steps itself (`equinox_forward`)
  with Equinox's own projections, weights function, dropout and output projection.
* Penzai's `pz.nn.Attention` and Gemma's `Attention`: their sublayers' outputs
  (and Gemma's `attn_vec_einsum`'s input); nothing copied.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._module_paths import is_named, optional

HOOKS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")


def is_attention(module: Any) -> bool:
    """Whether `instrument(attention=True)` hooks `module` (a submodule of a module target)."""
    return (
        flax_kind(module) is not None
        or is_equinox_attention(module)
        or bool(penzai_attention_paths([("", module)]))
    )


def _hook(call: Any, name: str, value: Any, to_view: Any = None, from_view: Any = None) -> Any:
    """`value`, sown in TransformerLens's layout (`to_view`) and brought back: as `name`,
    or as `blocks.{i}.attn.<hook>` with `naming="transformer_lens"`."""
    if not wanted(call, name):
        return value
    view = value if to_view is None else to_view(value)
    sown = call.sow(hook_name(call, name), view)
    return sown if from_view is None else from_view(sown)


def wanted(call: Any, name: str) -> bool:
    """Whether the attention hook `name` (`<path>.hook_x`) is sown in this call."""
    sown = hook_name(call, name)
    return sown is not None and bool(call.select((sown,)))


def hook_name(call: Any, name: str) -> str | None:
    """The name the attention hook `name` (`<path>.hook_x`) is sown under: itself without
    TransformerLens's names; with them, `blocks.{i}.attn.hook_x` for an attention in a
    block, None (not sown) for any other."""
    table = call.residual
    if table is None:
        return name
    path, _, hook = name.rpartition(".")
    alias = table.hooks.get(path)
    return None if alias is None else f"{alias}.{hook}"


# ---------------------------------------------------------------------------
# Flax: NNX `MultiHeadAttention`, Linen `MultiHeadDotProductAttention`.


def flax_kind(module: Any) -> str | None:
    """ "nnx" or "linen" for Flax's attention modules, else None."""
    nnx, linen = optional("flax.nnx"), optional("flax.linen")
    if nnx is not None and isinstance(module, nnx.MultiHeadAttention):
        return "nnx"
    if linen is not None and isinstance(module, linen.MultiHeadDotProductAttention):
        return "linen"
    return None


@contextlib.contextmanager
def flax_hooks(call: Any, path: str, module: Any, kind: str) -> Iterator[None]:
    """For the length of the block, `module.attention_fn` sows the five hooks."""
    from flax.linen import dot_product_attention as linen_default
    from flax.nnx.nn.attention import dot_product_attention as nnx_default

    default = linen_default if kind == "linen" else nnx_default
    original = module.attention_fn
    if getattr(original, "__wrapped__", None) is default:  # already hooked (a nested call)
        yield
        return
    if original is not default:
        raise TypeError(
            f"instrument(attention=True): the {type(module).__name__} at {path!r} has a custom "
            "attention_fn, so harvest cannot say where its pattern is. Use Flax's default "
            "attention_fn there, or leave the hooks out (attention=False) and reap its "
            "submodules and ops (ops=True) instead."
        )
    hooked = _linen_attention(call, path) if kind == "linen" else _nnx_attention(call, path)
    thread = threading.get_ident()

    @functools.wraps(original)
    def attention_fn(*args, **kwargs):
        # An NNX module is shared: another thread calling it meanwhile gets Flax's own.
        run = hooked if threading.get_ident() == thread else original
        return run(*args, **kwargs)

    # A Flax module is frozen (Linen) or checks its attributes (NNX): set past both, and put back.
    object.__setattr__(module, "attention_fn", attention_fn)
    try:
        yield
    finally:
        object.__setattr__(module, "attention_fn", original)


def _qkv(call: Any, path: str, *qkv: Any) -> tuple[Any, ...]:
    """Queries, keys and values, hooked."""
    return tuple(_hook(call, f"{path}.hook_{n}", x) for n, x in zip("qkv", qkv))


def _dropout(weights, rng, rate, broadcast, ndim, dtype):
    """Flax's attention dropout, as `dot_product_attention_weights` applies it."""
    keep_prob = 1.0 - rate
    shape = tuple([1] * (ndim - 2)) + weights.shape[-2:] if broadcast else weights.shape
    keep = jax.random.bernoulli(rng, keep_prob, shape)
    return weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))


def _linen_attention(call: Any, path: str) -> Callable[..., Any]:
    """Linen's own `dot_product_attention`, given the two products it lets a caller choose
    (`qk_attn_weights_einsum`, `attn_weights_value_einsum`): harvest's compute Flax's
    default product and hook around it, the scores and pattern at the first one's
    output and the second one's input, z at its output."""
    from flax import linen
    from flax.linen.dtypes import promote_dtype

    signature = inspect.signature(linen.dot_product_attention)

    def attention_fn(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        query, key, value = promote_dtype(a["query"], a["key"], a["value"], dtype=a["dtype"])
        a["query"], a["key"], a["value"] = _qkv(call, path, query, key, value)
        # Flax takes a precision or the two products, not both: harvest's apply the precision.
        plain = functools.partial(
            jnp.einsum,
            precision=a.pop("precision"),
            _dot_general=a.pop("einsum_dot_general") or jax.lax.dot_general,
        )
        qk = a["qk_attn_weights_einsum"] or plain
        wv = a["attn_weights_value_einsum"] or plain
        dropout = (a["dropout_rng"], a["dropout_rate"], a["broadcast_dropout"])
        drops = not a["deterministic"] and a["dropout_rate"] > 0.0
        a["dropout_rate"] = 0.0  # Flax's dropout comes after the pattern hook, in `weighted`
        bias, mask, dtype = a["bias"], a["mask"], a["query"].dtype

        def scores(spec, q, k):
            logits = qk(spec, q, k)
            if not wanted(call, f"{path}.hook_attn_scores"):
                return logits
            # What Flax's softmax takes: the product, its bias and its mask, as Flax adds them.
            masked = logits if bias is None else logits + bias
            if mask is not None:
                masked = jnp.where(mask, masked, jnp.finfo(dtype).min)
            sown = _hook(call, f"{path}.hook_attn_scores", masked)
            # Unplanted the difference is zero; planted, Flax's own bias and mask after this
            # give the planted scores (up to rounding) where nothing masks them.
            return logits + jnp.where(jnp.isfinite(masked), sown - masked, 0)

        def weighted(spec, weights, v):
            weights = _hook(call, f"{path}.hook_pattern", weights)
            if drops:
                weights = _dropout(weights, *dropout, a["key"].ndim, dtype)
            return _hook(call, f"{path}.hook_z", wv(spec, weights, v))

        a["qk_attn_weights_einsum"], a["attn_weights_value_einsum"] = scores, weighted
        return linen.dot_product_attention(**a)

    return attention_fn


def _nnx_attention(call: Any, path: str) -> Callable[..., Any]:
    """NNX's own `dot_product_attention` where only q, k, v and z are asked for (its inputs
    and output); otherwise its unfused path with the pattern hooked (Flax's
    `dot_product_attention_weights`, or harvest's scores and softmax where the scores are
    asked for), or, where Flax takes the fused path, `_fused_attention`."""
    from flax import nnx
    from flax.nnx.nn import attention as nnx_attention

    default = nnx_attention.dot_product_attention
    signature = inspect.signature(default)

    def attention_fn(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        qkv = a["promote_dtype"]((a["query"], a["key"], a["value"]), dtype=a["dtype"])
        query, key, value = _qkv(call, path, *qkv)
        a.update(query=query, key=key, value=value)
        scores = wanted(call, f"{path}.hook_attn_scores")
        if not scores and not wanted(call, f"{path}.hook_pattern"):
            return _hook(call, f"{path}.hook_z", default(**a))
        bias, mask, is_causal, module = a["bias"], a["mask"], a["is_causal"], a["module"]
        if a["dropout_rate"] == 0.0 and module is None:  # where Flax calls the fused attention
            return _fused_attention(call, path, query, key, value, bias, mask, is_causal)
        dtype, precision = query.dtype, a["precision"]
        if scores:
            logits = _nnx_scores(query, key, bias, mask, is_causal, dtype, precision)
            logits = _hook(call, f"{path}.hook_attn_scores", logits)
            weights = jax.nn.softmax(logits).astype(dtype)
            if module:
                module.sow(nnx.Intermediate, "attention_weights", weights)
        else:  # Flax's, its dropout left for after the hook
            weights = nnx_attention.dot_product_attention_weights(
                **{n: a[n] for n in ("query", "key", "bias", "mask", "dtype", "precision")},
                module=module,
                promote_dtype=a["promote_dtype"],
                is_causal=is_causal,
            )
        weights = _hook(call, f"{path}.hook_pattern", weights)
        if not a["deterministic"] and a["dropout_rate"] > 0.0:
            drop = (a["dropout_rng"], a["dropout_rate"], a["broadcast_dropout"], key.ndim, dtype)
            weights = _dropout(weights, *drop)
        q_heads, v_heads = weights.shape[-3], value.shape[-2]
        if q_heads == v_heads:
            z = jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)
            return _hook(call, f"{path}.hook_z", z)
        # Grouped-query attention, contracted per group of query heads as Flax does.
        grouped = weights.reshape(*weights.shape[:-3], v_heads, -1, *weights.shape[-2:])
        z = jnp.einsum(
            "...hgqk,...kh1d->...qhgd", grouped, value[..., None, :], precision=precision
        )
        merged = lambda x: x.reshape(*x.shape[:-3], q_heads, x.shape[-1])
        return merged(_hook(call, f"{path}.hook_z", z, merged, lambda x: x.reshape(z.shape)))

    return attention_fn


def _nnx_scores(query, key, bias, mask, is_causal, dtype, precision):
    """The scaled, masked scores NNX's ``dot_product_attention_weights`` takes the softmax
    of, ``[..., heads, q_pos, k_pos]`` (grouped-query heads merged, as there)."""
    from flax.nnx.nn.attention import combine_masks

    q_heads, k_heads = query.shape[-2], key.shape[-2]
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    if q_heads != k_heads:
        grouped = query.reshape(query.shape[:-2] + (k_heads, q_heads // k_heads, query.shape[-1]))
        logits = jnp.einsum(
            "...qhgd,...kh1d->...hgqk", grouped, key[..., None, :], precision=precision
        )
        logits = logits.reshape(logits.shape[:-4] + (q_heads, *logits.shape[-2:]))
    else:
        logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    if bias is not None:
        logits = logits + bias
    if mask is not None or is_causal:
        masks = [m for m in [mask] if m is not None]
        if is_causal:
            causal = jnp.tril(jnp.ones(logits.shape[-2:], dtype=dtype))
            masks.append(jnp.broadcast_to(causal, mask.shape if mask is not None else logits.shape))
        logits = jnp.where(combine_masks(*masks, dtype=dtype), logits, jnp.finfo(dtype).min)
    return logits


def _fused_attention(call, path, query, key, value, bias, mask, is_causal):
    """What NNX's ``dot_product_attention`` computes through ``jax.nn.dot_product_attention``
    (its XLA implementation) when no weights are asked for: the same ops in the same order,
    so the outputs are bit-identical, with the pattern and z hooked between them."""
    shape = query.shape
    if query.ndim > 4:  # Flax folds every batch axis into one, as the fused kernel wants
        fold = lambda a: None if a is None else a.reshape((-1, *a.shape[-3:]))
        query, key, value, bias, mask = map(fold, (query, key, value, bias, mask))
    four = lambda a: None if a is None else jnp.expand_dims(a, tuple(range(4 - a.ndim)))
    query, key, value, bias = map(four, (query, key, value, bias))
    mask = None if mask is None else four(mask.astype(bool))
    b, t, n, h = query.shape
    k_heads, g = key.shape[-2], query.shape[-2] // key.shape[-2]

    def grouped(a):  # [B, N or 1, T, S] -> [B, K, G, T, S], as JAX groups query heads
        if a is None:
            return None
        if a.shape[1] == 1:
            return jnp.broadcast_to(a[:, :, None], (a.shape[0], 1, g, *a.shape[2:]))
        return a.reshape(a.shape[0], k_heads, g, *a.shape[2:])

    def scores(q, bias, mask):  # one query head of each group: [B, T, K, H] -> [B, K, T, S]
        logits = jnp.einsum(
            "BTNH,BSNH->BNTS",
            q,
            key,
            precision=_SOFTMAX_INPUT_PRECISION.get(q.dtype),
            preferred_element_type=jnp.promote_types(q.dtype, jnp.float32),
        )
        logits *= jnp.array(1.0 / np.sqrt(h), dtype=logits.dtype)
        if bias is not None:
            logits = (logits + bias).astype(logits.dtype)
        keep = None if mask is None else jnp.ones_like(logits, dtype=bool) & mask
        if is_causal:
            causal = jnp.tril(jnp.ones(logits.shape[-2:], dtype=bool))[None, None]
            keep = causal & (True if keep is None else keep)
        if keep is not None:
            big = min(jnp.finfo(logits.dtype).max, jnp.finfo(jnp.float32).max)
            logits = jnp.where(keep, logits, jnp.asarray(-0.7 * big, dtype=logits.dtype))
        return logits

    softmax = lambda logits: jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(key.dtype)
    q = query.reshape(b, t, k_heads, g, h)
    # The hooks see the caller's batch axes: [B, K, G, T, S] -> [..., N, T, S], and back.
    to_view = lambda p: p.reshape(*shape[:-3], n, *p.shape[-2:])
    from_view = lambda p: p.reshape(b, k_heads, g, *p.shape[-2:])
    if wanted(call, f"{path}.hook_attn_scores"):
        logits = jax.vmap(scores, in_axes=(3, 2, 2), out_axes=2)(q, grouped(bias), grouped(mask))
        logits = _hook(call, f"{path}.hook_attn_scores", logits, to_view, from_view)
        probs = softmax(logits)
    else:  # as Flax computes it, softmax inside the map over groups: bit for bit
        weights = lambda q, bias, mask: softmax(scores(q, bias, mask))
        probs = jax.vmap(weights, in_axes=(3, 2, 2), out_axes=2)(q, grouped(bias), grouped(mask))
    pattern = _hook(call, f"{path}.hook_pattern", probs, to_view, from_view)
    z = jax.vmap(lambda p: jnp.einsum("BNTS,BSNH->BTNH", p, value), in_axes=2, out_axes=3)(pattern)
    z = _hook(call, f"{path}.hook_z", z, lambda z: z.reshape(shape))
    return z.reshape(shape)


# The einsum precision JAX's attention gives half-precision queries (float32 accumulation).
_SOFTMAX_INPUT_PRECISION = {
    jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
    jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32,
}


# ---------------------------------------------------------------------------
# Equinox `MultiheadAttention`: its forward, with the hooks.


def is_equinox_attention(module: Any) -> bool:
    eqx = optional("equinox")
    return eqx is not None and isinstance(module, eqx.nn.MultiheadAttention)


def equinox_forward(call: Any, path: str, module: Any, args: tuple, kwargs: dict) -> Any:
    """`module(*args, **kwargs)` computed as Equinox 0.13's `MultiheadAttention.__call__` does,
    with the hooks sown on the way (per-head work vmapped over heads, as there)."""
    from equinox.nn._attention import dot_product_attention_weights

    query, key_, value, mask = (*args, None)[:4]
    mask = kwargs.pop("mask", mask)
    key = kwargs.pop("key", None)
    inference = kwargs.pop("inference", None)
    if kwargs.pop("deterministic", None) is not None:
        inference = True if inference is None else inference
    process_heads = kwargs.pop("process_heads", None)
    if kwargs:
        raise TypeError(
            f"instrument(attention=True): the Equinox MultiheadAttention at {path!r} got arguments "
            f"it does not take: {sorted(kwargs)}. Call it with (query, key_, value, mask=None, *, key, "
            "inference, deterministic, process_heads) as Equinox 0.13 defines it."
        )
    seq = query.shape[0]
    projections = (module.query_proj, module.key_proj, module.value_proj)
    q, k, v = _qkv(call, path, *map(module._project, projections, (query, key_, value)))
    if process_heads is not None:
        shapes = (q.shape, k.shape, v.shape)
        q, k, v = process_heads(q, k, v)
        if (q.shape, k.shape, v.shape) != shapes:
            raise ValueError(
                f"instrument(attention=True): process_heads at {path!r} changed the heads' shapes from "
                f"{shapes} to {q.shape, k.shape, v.shape}; it must keep each of q, k and v's shape "
                "(as Equinox requires)."
            )
    mask_axis = 0 if mask is not None and mask.ndim == 3 else None
    if wanted(call, f"{path}.hook_attn_scores"):
        logits = jax.vmap(_equinox_scores, in_axes=(1, 1, mask_axis))(q, k, mask)
        logits = _hook(call, f"{path}.hook_attn_scores", logits)  # [heads, q_pos, k_pos]
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(logits.dtype, jnp.float32)
        weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
    else:
        weights = jax.vmap(dot_product_attention_weights, in_axes=(1, 1, mask_axis))(q, k, mask)
    weights = _hook(call, f"{path}.hook_pattern", weights)  # [heads, q_pos, k_pos]
    if module.dropout is not None:
        keys = None if key is None else jax.random.split(key, q.shape[1])
        drop = lambda w, k_: module.dropout(w, key=k_, inference=inference)
        weights = jax.vmap(drop, in_axes=(0, None if keys is None else 0))(weights, keys)
    per_head = lambda w, v_: jnp.einsum("sS,Sd->sd", w, v_)
    z = jax.vmap(per_head, in_axes=(0, 1), out_axes=1)(weights, v)
    z = _hook(call, f"{path}.hook_z", z)
    return jax.vmap(module.output_proj)(z.reshape(seq, -1))


def _equinox_scores(query: Any, key: Any, mask: Any) -> Any:
    """The scaled, masked scores Equinox's ``dot_product_attention_weights`` takes the
    softmax of, for one head: ``[q_seq, kv_seq]``."""
    logits = jnp.einsum("sd,Sd->sS", query / math.sqrt(query.shape[-1]), key)
    if mask is not None:
        if mask.shape != logits.shape:
            raise ValueError(
                f"instrument(attention=True): an Equinox attention's mask has shape {tuple(mask.shape)}; it "
                f"must be (query_seq_length, kv_seq_length) = {tuple(logits.shape)}, as Equinox requires."
            )
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return logits


# ---------------------------------------------------------------------------
# Penzai `pz.nn.Attention`: hooks at its sublayers' outputs (named axes).

_SEQ, _KV_SEQ, _PROJECTION = "seq", "kv_seq", "projection"
# Penzai's own names; "query_heads" is multi-query attention's (num_kv_heads=1), whose
# keys and values have no head axis: their hooks get one of size 1, as one KV head.
_HEAD_AXES = ("heads", "head_groups", "query_heads_per_group", "query_heads")


def penzai_attention_paths(parts: list[tuple[str, Any]]) -> frozenset[str]:
    """The paths of Penzai's attention layers: `pz.nn.Attention`, and `KVCachingAttention`
    (sampling mode), whose sublayers are the same; its keys and values are the new
    tokens', its pattern over every position of the cache."""
    penzai = optional("penzai.nn.attention")
    kinds = () if penzai is None else (penzai.Attention, penzai.KVCachingAttention)
    return frozenset(p for p, m in parts if type(m) in kinds)


def penzai_hook_paths(parts: list[tuple[str, Any]]) -> dict[str, tuple[str, str]]:
    """{path of the layer whose output a hook is: (its attention's path, the hook)} for
    each Penzai attention: q and k at their projection's output (the first sublayer of
    ``input_to_query``/``input_to_key`` where that is a ``Linear`` or ``Affine``: before
    the rotary embedding and rescaling), v at ``input_to_value``'s, the scores at the
    output of the sublayer before ``query_key_to_attn``'s closing ``Softmax`` (after the
    mask and any soft cap), the pattern at ``query_key_to_attn``'s, z at the first
    sublayer of ``attn_value_to_output``."""
    from penzai import pz

    attentions = penzai_attention_paths(parts)
    found: dict[str, tuple[str, str]] = {}
    for path, layer in parts:
        if path not in attentions:
            continue
        for part, hook in (("input_to_query", "hook_q"), ("input_to_key", "hook_k")):
            sublayers = getattr(getattr(layer, part), "sublayers", None)
            first = sublayers[0] if isinstance(sublayers, list) and sublayers else None
            at = ".sublayers.0" if isinstance(first, (pz.nn.Linear, pz.nn.Affine)) else ""
            found[f"{path}.{part}{at}"] = (path, hook)
        found[f"{path}.input_to_value"] = (path, "hook_v")
        found[f"{path}.query_key_to_attn"] = (path, "hook_pattern")
        found[f"{path}.attn_value_to_output.sublayers.0"] = (path, "hook_z")
        sublayers = getattr(layer.query_key_to_attn, "sublayers", None)
        if isinstance(sublayers, list) and len(sublayers) > 1:
            scores = f"{path}.query_key_to_attn.sublayers.{len(sublayers) - 2}"
            if isinstance(sublayers[-1], pz.nn.Softmax):
                found[scores] = (path, "hook_attn_scores")
    return found


def penzai_hook(call: Any, path: str, value: Any) -> Any:
    """`value` (the output of the sublayer at `path`), hooked if `path` is one of an attention's parts."""
    if path not in call.penzai_hooks:
        return value
    parent, which = call.penzai_hooks[path]
    from penzai import pz

    names = list(value.named_shape)
    heads = [n for n in _HEAD_AXES if n in names]
    per_key = which in ("hook_pattern", "hook_attn_scores")  # [..., heads, q_pos, k_pos]
    inner = [_SEQ, _KV_SEQ] if per_key else [_SEQ, _PROJECTION]
    shared = which in ("hook_k", "hook_v")  # keys and values may be shared by every head
    if (not heads and not shared) or any(n not in names for n in inner):
        raise ValueError(
            f"instrument(attention=True): the Penzai attention at {parent!r} gives {which} the named axes "
            f"{dict(value.named_shape)}; its hooks need 'seq', 'kv_seq' (pattern) or 'projection' (q, k, v, z) "
            "and a head axis ('heads', 'head_groups', 'query_heads_per_group', 'query_heads'). Name "
            "its axes so, or pass attention=False."
        )
    batch = [n for n in names if n not in heads and n not in inner]
    order = [*batch, *heads, *inner] if per_key else [*batch, _SEQ, *heads, _PROJECTION]
    at = len(batch) + (0 if per_key else 1)
    head_sizes = [value.named_shape[n] for n in heads]

    def to_view(named):
        data = named.order_as(*order).unwrap(*order)
        return data.reshape(data.shape[:at] + (-1,) + data.shape[at + len(heads) :])

    def from_view(data):
        split = data.reshape(data.shape[:at] + tuple(head_sizes) + data.shape[at + 1 :])
        return pz.nx.wrap(split, *order)

    return _hook(call, f"{parent}.{which}", value, to_view, from_view)


# ---------------------------------------------------------------------------
# Gemma's `Attention` (Linen): hooks at its submodules' inputs and outputs.


def is_gemma_attention(module: Any) -> bool:
    return is_named(module, "Attention", "gemma.")


def refuse_gemma_scores(call: Any, path: str) -> None:
    """Raises where `names` asks for the scores of the Gemma attention at `path` and not its
    pattern: gemma computes them inside `Attention.__call__`, where no submodule's input or
    output holds them (harvest would have to copy that forward). A wider `names` (or none)
    gives the other hooks, without the scores."""
    scores = f"{path}.hook_attn_scores"
    if wanted(call, scores) and not wanted(call, f"{path}.hook_pattern"):
        raise ValueError(
            f"instrument(attention=True): {hook_name(call, scores)} is not sown: gemma's "
            f"Attention at {path!r} computes its scores inside its own __call__, where no "
            "submodule holds them. Its hook_pattern is their softmax; leave the scores out of "
            "`names`."
        )


def gemma_output_hook(call: Any, path: str, name: str, out: Any) -> Any:
    """The output of the submodule `name` of the Gemma attention at `path`, hooked."""
    if name == "qkv_einsum":  # [3, B, T, N, H]
        return jnp.stack(_qkv(call, path, out[0], out[1], out[2]))
    if name == "q_einsum":
        return _hook(call, f"{path}.hook_q", out)
    if name == "kv_einsum":  # [2, B, S, K, H]
        return jnp.stack([_hook(call, f"{path}.hook_{n}", out[i]) for i, n in enumerate("kv")])
    if name == "attention_weights":  # [B, T, N, S]: the pattern wants [B, N, T, S]
        swap = lambda a: jnp.swapaxes(a, -3, -2)
        return _hook(call, f"{path}.hook_pattern", out, swap, swap)
    return out


def gemma_input_hook(call: Any, path: str, name: str, args: tuple) -> tuple:
    """The arguments of the submodule `name` of the Gemma attention at `path`, hooked:
    `attn_vec_einsum(eqn, z)` receives z, [B, T, N, H]."""
    if name != "attn_vec_einsum" or len(args) < 2:
        return args
    return (args[0], _hook(call, f"{path}.hook_z", args[1]), *args[2:])


# ---------------------------------------------------------------------------
# Sweeps over heads: which axis is which, and axes that would sweep features.

_HEAD_SHAPED = {"hook_q", "hook_k", "hook_v", "hook_z"}  # [..., seq, heads, d_head]
_LABELS = {
    "head_shaped": {-3: "position", -2: "head", -1: "d_head"},
    "hook_pattern": {-3: "head", -2: "query position", -1: "key position"},
    "stream": {-2: "position", -1: "d_model"},  # [..., pos, d_model]
    "neurons": {-2: "position", -1: "neuron"},  # an MLP's hidden layer: [..., pos, d_mlp]
}
# TransformerLens's names of the residual stream and what is added to it.
_STREAM = {
    "hook_resid_pre",
    "hook_resid_mid",
    "hook_resid_post",
    "hook_attn_out",
    "hook_mlp_out",
    "hook_embed",
    "hook_pos_embed",
}
# Equinox's MultiheadAttention projects to, and from, every head's features merged.
_MERGED = {
    ".query_proj": "hook_q",
    ".key_proj": "hook_k",
    ".value_proj": "hook_v",
    ".output_proj:in": "hook_z",
}


def _family(name: str) -> str | None:
    leaf = name.rpartition(".")[2]
    if leaf in _HEAD_SHAPED:
        return "head_shaped"
    if leaf in _STREAM:
        return "stream"
    if name.endswith((".mlp.hook_pre", ".mlp.hook_post")):
        return "neurons"
    return "hook_pattern" if leaf in ("hook_pattern", "hook_attn_scores") else None


def _ndim(value: Any) -> int:
    return int(jnp.ndim(jax.tree_util.tree_leaves(value)[0]))


def check_swept_axes(swept: list[tuple[str, Any]], axes: tuple[int, ...] | None) -> None:
    """Raises if a sweep's `axes` would index merged head features, or a hook's d_head axis.

    `swept` holds (name, one occurrence's value) for each swept site.
    """
    if axes is None:
        return
    for name, value in swept:
        ndim = _ndim(value)
        negative = {a - ndim if a >= 0 else a for a in axes}
        hook = next((h for s, h in _MERGED.items() if name.endswith(s)), None)
        if hook is not None and -1 in negative:
            hook = name.removesuffix(":in").rpartition(".")[0] + "." + hook
            raise ValueError(
                f"The sweep's axis={axes!r} on {name!r} indexes its last dimension, which holds every head's "
                f"features merged (heads x d_head), so it would sweep features, not heads. Sweep "
                f"{hook!r} (shaped [..., seq, heads, d_head], from instrument(model, "
                "attention=True)) with axis=(-2, -3) for every (head, position) pair."
            )
        if _family(name) == "head_shaped" and -1 in negative:
            raise ValueError(
                f"The sweep's axis={axes!r} on {name!r} indexes its last dimension, d_head (features within "
                "a head), not heads or positions. Its layout is [..., seq, heads, d_head]: use axis=(-2, -3) "
                "for every (head, position) pair, or axis=-2 for heads."
            )


def axis_labels(
    swept: list[tuple[str, Any]], axes: tuple[int, ...] | None
) -> tuple[str, ...] | None:
    """What each swept axis is ("head", "position", ...) when every swept site is one kind of
    hook, else None."""
    if axes is None or not swept:
        return None
    families = {_family(n) for n, _ in swept}
    ndims = {_ndim(v) for _, v in swept}
    if len(families) != 1 or None in families or len(ndims) != 1:
        return None
    table, ndim = _LABELS[families.pop() or ""], ndims.pop()
    labels = [table.get(a - ndim if a >= 0 else a) for a in axes]
    return None if None in labels else tuple(str(label) for label in labels)
