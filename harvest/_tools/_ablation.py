"""`ablation_sweep`: every site (and index along an axis) ablated, in one compiled program.

An ablation is a patch whose "clean" value is zero, or the activation's mean
over the batch: `patching_sweep` with those values, from one reap of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from .._calling._inspect import sites
from .._calling._transforms import reap
from .._typing import NameSelect
from .._walk._sow import DEFAULT_TAG
from ._patching import patching_sweep
from ._result import PatchingResult

if TYPE_CHECKING:
    from jax.typing import ArrayLike

HOWS = ("zero", "mean")


def ablation_sweep(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    metric: Callable[[Any], ArrayLike],
    how: str = "zero",
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
    axis: int | tuple[int, ...] | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
) -> PatchingResult:
    """Ablates each chosen site, one at a time (index by index along ``axis``), and measures the effect.

    An ablated entry is replaced by zero (``how="zero"``) or by its mean over
    the batch, the leading axis of each value sown, in the run on ``args``
    itself (``how="mean"``); every other entry keeps the run's own value. It is
    ``patching_sweep`` with those values as the clean run's: its compiled
    program is reused as that one's, and the result reads the same way.

    With ``names="blocks.*.attn.hook_z"`` and ``axis=2`` on a model
    instrumented with TransformerLens's names, every (layer, head) is ablated
    in one program (TransformerLens's per-head ablation loop): ``values`` are
    ``[layer, head]``; ``axis=1`` on ``"blocks.*.hook_resid_pre"``, (layer,
    position).

    Args:
        f: The model, as for ``patching_sweep``: a function, an NNX or Equinox
            module, or a bound method of one, whose sows of ``tag`` are the sites.
        args: The tuple of ``f``'s positional arguments, e.g. ``(tokens,)``.
        metric: Maps ``f``'s output to a scalar.
        how: ``"zero"`` or ``"mean"`` (the mean over the batch, the leading axis).
        tag: The tag whose sows are the sites (``"modules"`` for ``instrument``'s).
        names: Which sites, as for ``patching_sweep`` (None: every site of ``tag``).
        exclude: Sites never to ablate, as for ``patching_sweep``.
        axis: The axis (or axes) of each site's value to ablate index by index
            (the head axis of ``hook_z``, 2), or None to ablate whole sites.
        batch_size: How many ablations run at once, as for ``patching_sweep``.
        progress: A tqdm bar over chunks, as for ``patching_sweep``.

    Returns:
        A ``PatchingResult`` whose ``values[i, j]`` is ``metric(ablated out) -
        metric(out)`` for row ``names[i]`` at index ``j`` along ``axis`` (its axis
        named, ``"head"`` for ``hook_z``), and whose ``baseline`` is the
        unablated run's metric.

    Raises:
        ValueError: ``how`` is neither ``"zero"`` nor ``"mean"``; or as
            ``patching_sweep`` raises.
        TypeError: ``args`` is not a tuple; or as ``patching_sweep`` raises.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import ablation_sweep, sow
        >>> def f(x):  # x: [batch, heads]; head 1 counts double
        ...     z = sow(x, name="z", mode="strict")
        ...     return (z * jnp.array([1.0, 2.0])).sum()
        >>> x = jnp.array([[1.0, 1.0], [3.0, 3.0]])
        >>> ablation_sweep(f, (x,), lambda out: out, axis=1).values  # [sites, heads]
        array([[-4., -8.]], dtype=float32)
        >>> ablation_sweep(f, (x,), lambda out: out, "mean", axis=1).values  # means 2, 2
        array([[0., 0.]], dtype=float32)
    """
    if how not in HOWS:
        raise ValueError(
            f"ablation_sweep: unknown how={how!r}. Use one of {', '.join(map(repr, HOWS))}; for "
            "another replacement, pass its values as the clean run's to patching_sweep."
        )
    if not isinstance(args, tuple):
        raise TypeError(
            "ablation_sweep: args must be the tuple of f's positional arguments, e.g. (tokens,), "
            f"got {type(args).__name__}."
        )
    reaped = reap(f, tag=tag)(*args)  # compiled once, as the sweep's program
    if how == "zero":
        ablated = jax.tree_util.tree_map(jnp.zeros_like, reaped)
    else:
        ablated = _means(f, args, tag, reaped)
    return patching_sweep(
        f,
        ablated,
        args,
        metric,
        tag=tag,
        names=names,
        exclude=exclude,
        axis=axis,
        batch_size=batch_size,
        progress=progress,
    )


def _means(f: Callable[..., Any], args: tuple[Any, ...], tag: str, reaped: Any) -> Any:
    """The run's `reaped` values, each replaced by its mean over the batch (broadcast back):
    the leading axis of one occurrence (the second of a site sown several times, whose
    occurrences are stacked first)."""
    shapes = {s.name: s.shape for s in sites(f, tag=tag)(*args)}

    def mean(path: Any, value: Any) -> Any:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        one = shapes.get(name)
        lead = jnp.ndim(value) - len(one) if isinstance(one, tuple) else 0
        return jnp.broadcast_to(jnp.mean(value, axis=lead, keepdims=True), jnp.shape(value))

    return jax.tree_util.tree_map_with_path(mean, reaped)
