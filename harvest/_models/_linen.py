"""Flax Linen submodules of a plain function, as sites (`instrument(f)` on a function).

Linen's own `intercept_methods` sees every submodule's `__call__`; the
interceptor sows its output under the module's scope path joined with dots.
Two Linen features need more than that:

* `nn.share_scope(parent, child)` gives `child` its parent's scope: the child is
  named by the parent's path plus its own name (`"layer_0.mlp.Einsum_0"`), so each
  module stays one site of one shape.
* `nn.jit` caches its trace on the module's fingerprint, which does not see the
  interceptor, so a later instrumented trace would reuse an earlier one. During one
  instrumented call every `nn.jit` fingerprint is salted with a number unique to
  that call (one more cache entry per trace, as a new input shape makes). A
  `jax.jit` inside `f` (gemma's sampling loop) is keyed apart the same way, by a
  `jax.make_user_context` value unique to the call, where that context exists.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from collections.abc import Callable
from typing import Any

from .. import _jax
from . import _attention, _transformer_lens
from ._module_paths import optional

_salt: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "harvest_linen_jit_salt", default=None
)
_salts = itertools.count()
_patch_lock = threading.Lock()
_patched = False


def run_linen(call: Any, f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls `f`, sowing for `call` the output of every Linen submodule it applies."""
    nn = optional("flax.linen")
    if nn is None:
        return f(*args, **kwargs)
    _salt_linen_jit()

    def interceptor(next_fun, a, k, context):
        module = context.module
        if context.method_name == "encode":  # gemma's embedding: hook_embed
            return _transformer_lens.gemma_embed(call, module, next_fun(*a, **k))
        path = linen_path(module) if context.method_name == "__call__" else ""
        if not path:
            return next_fun(*a, **k)
        parent = module.parent if call.attention else None
        in_gemma = parent is not None and _attention.is_gemma_attention(parent)
        if in_gemma:
            a = _attention.gemma_input_hook(call, linen_path(parent), module.name, a)
        _transformer_lens.gemma_block(call, path, module)
        a = _transformer_lens.gemma_mlp_input(call, path, module, a)
        if call.attention and _attention.is_gemma_attention(module):
            _attention.refuse_gemma_scores(call, path)
        a = call.sow_inputs(path, _transformer_lens.part_input(call, path, a))
        hooks = contextlib.nullcontext()
        if call.attention and _attention.flax_kind(module) == "linen":
            hooks = _attention.flax_hooks(call, path, module, "linen")
        with call.scope(path), hooks:
            out = next_fun(*a, **k)
        if in_gemma:
            out = _attention.gemma_output_hook(call, linen_path(parent), module.name, out)
        out = _transformer_lens.gemma_mlp_output(call, path, module, out)
        return _transformer_lens.part_output(call, path, call.sow(path, out))

    salt = next(_salts)
    token = _salt.set(salt)
    try:
        with nn.intercept_methods(interceptor), _jax.jit_cache_salted(("harvest.instrument", salt)):
            return f(*args, **kwargs)
    finally:
        _salt.reset(token)


def linen_path(module: Any) -> str:
    """`module`'s site name: its scope path joined with dots; a module sharing its
    parent's scope (`nn.share_scope`) is named under the parent by its own name."""
    parent = getattr(module, "parent", None)
    shares = (
        module.scope is not None
        and getattr(parent, "scope", None) is module.scope
        and isinstance(module.name, str)
    )
    if shares:
        above = linen_path(parent)
        return f"{above}.{module.name}" if above else module.name
    return ".".join(module.path)


def _salt_linen_jit() -> None:
    """Makes `nn.jit`'s module fingerprint include the running call's salt (once per process).

    Reaches Flax's private `flax.linen.transforms._HashableProxy.from_module`,
    behind a feature check: without it, `nn.jit` bodies are traced as Flax caches them.
    """
    global _patched
    with _patch_lock:
        if _patched:
            return
        _patched = True
        from flax.linen import transforms

        proxy = getattr(transforms, "_HashableProxy", None)
        original = getattr(proxy, "from_module", None)
        if proxy is None or original is None or not hasattr(proxy, "__dataclass_fields__"):
            return

        def from_module(cls, module):
            key = original(module)
            salt = _salt.get()
            if salt is None:
                return key
            return cls(key.module_ref, hash((key.hash_key, "harvest.instrument", salt)))

        proxy.from_module = classmethod(from_module)
