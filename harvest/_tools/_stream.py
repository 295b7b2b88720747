"""`stream`: hand each sown value to a host callback as it fires.

Built as a plant: every streamed site is planted with a tap, a callable that
sends the value to the host with `jax.debug.callback`, re-emits the sow (so a
harvest outside `stream` still sees it) and returns the value unchanged. The
walk does the rest, inside `jit`, `scan`, `cond` and `while`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from .. import _errors
from .._calling._inspect import sow_equations
from .._calling._renamed import renamed
from .._calling._tracing import make_jaxpr
from .._calling._transforms import plant
from .._typing import NameSelect, P, R
from .._walk._interpreter import NameFilter
from .._walk._paths import nested_dict, path_str
from .._walk._primitive import sow_p
from .._walk._site import Site
from .._walk._sow import DEFAULT_TAG


@dataclasses.dataclass(frozen=True)
class _Tap:
    """A planted callable: report `old` to the host, then sow it again untouched (hashable
    by value, so the plant's compile cache is hit on every call with the same callback)."""

    callback: Callable[[str, Any], object]
    name: str
    sow_params: tuple[tuple[str, Any], ...]  # the site's sow params, as (key, value) pairs
    # Handed the whole batch under a vmap inside `f`: it re-emits the sow as it
    # was, batch axes leading (see `_per_example.applied_per_example`).
    per_example = False

    def __call__(self, old: Any) -> Any:
        # JAX drops the callback's result; its stub asks for None, ours allows any.
        # Ordered effects are refused over several devices: there, calls come unordered.
        ordered = jax.device_count() == 1
        jax.debug.callback(functools.partial(self.callback, self.name), old, ordered=ordered)  # type: ignore[arg-type]
        leaves, tree = jax.tree_util.tree_flatten(old)
        return jax.tree_util.tree_unflatten(tree, sow_p.bind(*leaves, **dict(self.sow_params)))


@renamed(allowlist="names", blocklist="exclude")
def stream(
    f: Callable[P, R],
    callback: Callable[[str, Any], object],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
) -> Callable[P, R]:
    """Returns ``f``, calling ``callback(name, value)`` on the host as each sow of ``tag`` fires.

    Calls arrive in program order, one per occurrence (once per iteration inside
    ``scan`` and ``while_loop``), also under ``jit`` and ``grad``; under ``vmap``,
    once per batch element. Outputs are unchanged, and a harvest of ``tag``
    outside ``stream`` still sees every sow. ``sow_cond`` sites are not streamed
    (a plant does not see their predicate); they pass through untouched.

    Args:
        f: the function to run, as for ``reap``.
        callback: called as ``callback(name, value)`` on the host, with the dotted
            name and the value as a NumPy array (or pytree of them); its return
            value is ignored.
        tag: which sows to stream; sows of other tags pass through untouched.
        names: if given, stream only these sites (exact names, glob patterns
            or predicates on names), as for ``reap``.
        exclude: sites never to stream, in the same forms as ``names``.

    Returns:
        A function with ``f``'s signature and outputs that streams as it runs.

    Raises:
        TypeError: if ``f`` or ``callback`` is not callable.

    With more than one device, calls are not ordered (JAX orders host
    callbacks on one device only), but each arrives: under a sharded `jit`,
    once per occurrence with the whole value; inside `shard_map`, once per
    shard. To save sites over a dataset on several devices or processes,
    `harvest.store.record` writes each device's shard where it is, without a
    host callback or a gather.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sow, stream
        >>> def f(x):
        ...     def body(c):
        ...         return sow(c * 2.0, name="c", mode="clobber")
        ...     return jax.lax.while_loop(lambda c: c < 10.0, body, x)
        >>> seen = []
        >>> g = stream(f, lambda name, v: seen.append((name, float(v))))
        >>> jax.jit(g)(1.0)
        Array(16., dtype=float32, weak_type=True)
        >>> jax.effects_barrier()  # wait for the host callbacks
        >>> seen
        [('c', 2.0), ('c', 4.0), ('c', 8.0), ('c', 16.0)]
    """
    if not callable(f):
        raise _errors.needs_callable("stream(f, callback)", f)
    if not callable(callback):
        raise _errors.needs_callable("stream(f, callback)", callback, "callback(name, value)")
    select = NameFilter.make(names, exclude)

    @functools.wraps(f)
    def streamed(*args: P.args, **kwargs: P.kwargs) -> R:
        taps: dict[tuple[str, ...], _Tap] = {}
        names: dict[str, None] = {}
        for eqn, _, _ in sow_equations(make_jaxpr(f, args, kwargs)[0].jaxpr):
            site = Site.of(eqn)
            if site.tag == tag:
                names[path_str(site.path)] = None
            if site.tag == tag and not site.mode.has_pred and select(site.path):
                params = tuple(sorted((k, v) for k, v in eqn.params.items() if k != "role"))
                taps[site.path] = _Tap(callback, path_str(site.path), params)
        select.check_names(list(names), "stream: names= entry", tag)
        # Names not tapped are left in place by the plant, for outer harvests.
        return plant(f, tag=tag)(nested_dict(taps), *args, **kwargs)

    return streamed
