"""The sweeps: `patching_sweep` (every patch, compiled and vmapped) and `attribution_patching`.

Both patch the sites of one trace of the corrupted run (which ones, and with
which clean values, is `_sweep_plan`'s) through `plant`, as one compiled
program per configuration, through the function's one `jax.jit` (`_calling`).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors
from .._calling._jit import compiled_on_arrays, rewrap, unwrap
from .._calling._nnx_state import splits_verified_once
from .._calling._traced_code import TracedCode, can_be_data
from .._calling._transforms import plant, reap
from .._typing import NameSelect, Reaped
from .._walk._paths import nested_dict, path_str
from .._walk._sow import DEFAULT_TAG
from ._interventions import AddRow, AddVector, PatchOccurrence, PatchWhere
from ._result import PatchingResult
from ._sweep_plan import Plan, batch_cleans, planned, site_value

if TYPE_CHECKING:
    from jax.typing import ArrayLike


def _scalar(m):
    if jnp.shape(m) != ():
        raise TypeError(
            f"metric(out) must return a scalar, got shape {jnp.shape(m)}. Reduce it, e.g. "
            "with jnp.mean over the batch."
        )
    return m


def _steps(items: list[Any], progress: bool | None, caller: str) -> Any:
    """`items`, under a tqdm progress bar if `progress` (None: only for several
    steps in a terminal or notebook, and only once the run has taken a second)."""
    auto = progress is None
    if auto:
        progress = len(items) > 1 and _interactive()
    if not progress:
        return items
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]
    except ImportError:
        if auto:
            return items
        raise _errors.needs_extra(f"{caller}(progress=True)", "tqdm", "patching") from None
    return tqdm(items, desc=caller, unit="chunk", delay=1.0 if auto else 0.0, leave=not auto)


def _interactive() -> bool:
    """Whether a person is watching: a terminal on stderr, or a Jupyter kernel."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    if get_ipython is not None and getattr(get_ipython(), "kernel", None) is not None:
        return True
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


# Finding the sites and running the program both split an NNX model, with no user code
# between: each split is checked once per call.
@splits_verified_once()
def patching_sweep(
    f: Callable[..., Any],
    clean: Reaped | list[Reaped],
    corrupted_args: tuple[Any, ...] | list[tuple[Any, ...]],
    metric: Callable[[Any], ArrayLike],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
    axis: int | tuple[int, ...] | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
) -> PatchingResult:
    """Patches each clean activation into the corrupted run, one at a time, and measures the effect.

    For every chosen site, and every index along ``axis`` of its sown value if
    ``axis`` is given (e.g. token position), the corrupted run
    ``f(*corrupted_args)`` gets the clean value there and keeps its own
    everywhere else. A site that fires ``k`` times per call (mode ``append`` in
    a ``scan``, e.g. scan-over-layers; any mode once per shard of a
    ``shard_map``, as ``sites`` counts it) gives ``k`` rows, ``name[0]`` ...
    ``name[k-1]``, each patching that occurrence alone; ``axis`` counts the
    axes of one occurrence's value. All patches run as one compiled, vmapped
    computation over one-hot selections.

    The program (``f``'s one ``jax.jit``'s, emptied by ``harvest.clear_caches()``)
    and the sites found are reused by later calls with the same ``f``,
    ``metric``, ``tag``, swept sites, ``axis``, ``batch_size`` and argument
    shapes (and equal non-array arguments): a repeated sweep on new data only
    runs. ``f`` is read as ``jax.jit(f)`` reads it: a module's weights changed
    in place are read at every call; what a plain function closes over, when
    it is traced. The metric is keyed by its code and what it closes over, so
    a fresh lambda each sweep does not recompile.

    A sweep is a measurement: an NNX module that changes its own state when
    called (a ``BatchNorm`` in training mode, an RNG stream) starts every run
    from the state it has, and nothing is written back to it.

    Args:
        f: The model: a function, an NNX or Equinox module, or a bound method
            of one, whose sows of ``tag`` are the sites.
        clean: ``reap(f, tag=tag)(*clean_args)``, the clean run's values. For a
            dataset, the list of one such dict per batch.
        corrupted_args: The tuple of ``f``'s positional arguments for the
            corrupted run, e.g. ``(tokens,)``. For a dataset, a list of such
            tuples, one per batch: the result is the mean over batches.
        metric: Maps ``f``'s output to a scalar (reduce a batch, e.g. with
            ``jnp.mean``).
        tag: The tag whose sows are the sites.
        names: Which sites to sweep: exact names, glob patterns such as
            ``"blocks.*.attn"``, predicates on names, or a list of them (each
            string must match a site). ``None``: every site of ``tag`` with a
            value in ``clean``; then sites whose sizes along ``axis`` differ
            from the most common ones (attention patterns beside the residual
            stream, say) are left out and listed in the result's ``skipped``.
        exclude: Sites never to sweep, in the same forms as ``names`` (a string
            that matches no site is not an error).
        axis: The axis of each site's value to sweep index by index, a tuple
            of axes (``axis=(2, 1)`` on a per-head output ``[batch, positions,
            heads, d_head]`` patches every (head, position) pair, giving values
            of shape ``(sites, heads, positions)``), or ``None`` to patch whole
            sites.
        batch_size: How many patches run at once (the rest follow in chunks
            through the same compiled program); ``None``: all at once.
        progress: ``True`` shows a tqdm bar over chunks and batches; ``None``
            (the default) shows one for a run of several chunks in a terminal
            or notebook that is still going after a second; ``False`` never.

    Returns:
        A ``PatchingResult`` whose ``values[i, j]`` is ``metric(patched out) -
        metric(corrupted out)`` for row ``names[i]`` at index ``j`` along
        ``axis``, and whose ``baseline`` is the corrupted run's metric, returned
        while the program runs (``values`` and ``baseline`` are read when first
        needed).

    Raises:
        TypeError: ``f`` is not callable, ``corrupted_args`` is not a tuple (or
            a list of them), ``clean`` is not a dict (or a matching list),
            ``axis`` or ``batch_size`` is malformed, or ``metric`` does not
            return a scalar.
        ValueError: nothing to patch, a string in ``names`` matches no site,
            the chosen sites differ in size along ``axis``, or a site fires
            several times in a way a sweep cannot patch one by one (mode
            ``collect`` in a loop, or any site in a ``while_loop``).
        KeyError: ``clean`` lacks a value for a chosen site.
        ImportError: ``progress=True`` without tqdm installed.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import patching_sweep, reap, sow
        >>> def f(x):
        ...     h = sow(2.0 * x, name="h", mode="strict")
        ...     return sow(h + 1.0, name="g", mode="strict")
        >>> clean = reap(f)(jnp.array([1.0, 2.0, 3.0]))
        >>> r = patching_sweep(f, clean, (jnp.zeros(3),), jnp.sum, axis=0)
        >>> r.names, r.baseline
        (('h', 'g'), 3.0)
        >>> r.values  # patching h or g at position i adds 2 * (i + 1) to the sum
        array([[2., 4., 6.],
               [2., 4., 6.]], dtype=float32)
        >>> def heads(z):  # z: [positions, heads]; head 1 counts double
        ...     return (sow(z, name="z", mode="strict") * jnp.array([1.0, 2.0])).sum()
        >>> r = patching_sweep(heads, reap(heads)(jnp.ones((3, 2))), (jnp.zeros((3, 2)),), lambda o: o, axis=(1, 0))
        >>> r.values  # (sites, heads, positions)
        array([[[1., 1., 1.],
                [2., 2., 2.]]], dtype=float32)
        >>> def layers(x):  # the same site in each of 2 scanned layers
        ...     step = lambda c, _: (sow(c * 2.0, name="h", mode="append"), None)
        ...     return jax.lax.scan(step, x, None, length=2)[0]
        >>> r = patching_sweep(layers, reap(layers)(jnp.ones(3)), (jnp.zeros(3),), jnp.sum, axis=0)
        >>> r.names, r.values.shape
        (('h[0]', 'h[1]'), (2, 3))
    """
    caller = "patching_sweep"
    setup = planned(f, clean, corrupted_args, tag, names, axis, caller, exclude)
    _, _, targets, plan = setup
    size, site_axes = plan.size, plan.site_axes
    if batch_size is not None and (not isinstance(batch_size, (int, np.integer)) or batch_size < 1):
        raise TypeError(
            f"{caller}: batch_size must be a positive int (patches run at once), got {batch_size!r}."
        )
    cells = 1 if size is None else math.prod(size)  # patches per row
    firsts = plan.firsts  # each target's first row, and the number of rows last
    total = int(firsts[-1]) * cells
    chunk = total if batch_size is None else min(int(batch_size), total)

    def program(
        f: Callable, metric: Callable, operands: tuple[Any, list[Any], tuple]
    ) -> tuple[jax.Array, jax.Array]:
        ks, cleans, args = operands
        planted = plant(f, tag=tag)

        def patched_metric(k: jax.Array) -> jax.Array:
            row, cell = k // cells, k % cells
            here = jnp.ones((), bool) if size is None else (jnp.arange(cells) == cell).reshape(size)
            plants: dict[Any, Callable[..., Any]] = {}
            for t, c, ax, first in zip(targets, cleans, site_axes, firsts):
                if t.count is None:
                    plants[t.site.path] = PatchWhere(c, here & (row == first), ax)
                else:  # row `first + j` patches occurrence j
                    plants[t.site.path] = PatchOccurrence(c, here, row - first, ax)
            return _scalar(metric(planted(nested_dict(plants), *args)))

        # Through the calling convention, as the patched runs: NNX modules are split and merged.
        baseline = _scalar(metric(planted({}, *args)))
        return jax.vmap(patched_metric)(ks) - baseline, baseline

    return _run(setup, program, f, metric, (caller, tag), axis, progress, total, chunk)


def _run(
    setup: tuple[Any, list[Any], list[Any], Plan],
    program: Callable[..., tuple[jax.Array, jax.Array]],
    f: Callable[..., Any],
    metric: Callable[..., Any],
    spec: tuple[str, str],  # the caller and the tag
    axis: Any,
    progress: bool | None,
    total: int,
    chunk: int | None = None,
) -> PatchingResult:
    """Runs ``program`` on each batch, in chunks of ``chunk`` of the ``total`` patches (their
    indices ``ks``; None: one step, without them); the result is read when first needed."""
    axes, batches, targets, plan = setup
    caller = spec[0]
    steps = [(b, start) for b in range(len(batches)) for start in range(0, total, chunk or total)]
    effects: list[list[tuple[Any, int]]] = [[] for _ in batches]  # each batch's chunks and sizes
    baselines: list[Any] = []
    cleans: list[Any] = []
    last: Any = None
    # Through `f`'s one `jax.jit`; a plain function `metric` is keyed by its code and what it
    # closes over (arrays traced), so a fresh lambda at each sweep does not recompile.
    fn, bound = unwrap(f)
    measure = TracedCode.of(metric) if can_be_data(metric) else metric
    # Each step's program is sent before the last one's result is waited for, and only a
    # progress bar waits at all (so it shows work done); without one, nothing waits until
    # the values are read (at once under a trace, where they are refused).
    shown = _steps(steps, progress, caller)
    for b, start in shown:
        if start == 0:
            cleans = batch_cleans(targets, batches[b][0], axes, plan.size, caller, batches[0][0])
        # The last chunk repeats the last patch.
        ks = None if chunk is None else np.minimum(np.arange(start, start + chunk), total - 1)
        operands = (ks, cleans, batches[b][1])
        values, baseline = compiled_on_arrays(
            fn, _run_program, (bound, measure, operands), (*spec, plan.program), program
        )
        if shown is not steps and last is not None and not isinstance(values, jax.core.Tracer):
            jax.block_until_ready(last)
        last = values
        effects[b].append((values, total - start))
        baselines += [baseline] if start == 0 else []
    size = plan.size
    shape = (len(plan.rows),) + (() if size is None else size)
    labels = None if size is None else tuple(np.arange(n) for n in size)  # fresh: the result's own
    result = PatchingResult._computing(
        functools.partial(_on_host, effects, baselines, shape),
        names=plan.rows,
        positions=labels if labels is None or isinstance(axis, (tuple, list)) else labels[0],
        axis=axis,
        skipped=plan.skipped,
        axis_labels=plan.axis_labels,
    )
    return result.block_until_ready() if isinstance(baselines[0], jax.core.Tracer) else result


def _on_host(
    effects: list[list[tuple[Any, int]]], baselines: list[Any], shape: tuple[int, ...]
) -> tuple[np.ndarray, float]:
    """The values (each batch's chunks joined, each cut to its patches; the mean over
    batches) shaped ``shape``, and the mean baseline, as NumPy: the caller owns them."""
    joined = [np.concatenate([np.asarray(v)[:n] for v, n in chunks]) for chunks in effects]
    mean = joined[0] if len(joined) == 1 else np.mean(joined, 0).astype(joined[0].dtype)
    baseline = np.asarray(baselines[0]) if len(baselines) == 1 else np.mean(baselines)
    return mean.reshape(shape), float(baseline)


@splits_verified_once()  # as patching_sweep
def attribution_patching(
    f: Callable[..., Any],
    clean: Reaped | list[Reaped],
    corrupted_args: tuple[Any, ...] | list[tuple[Any, ...]],
    metric: Callable[[Any], ArrayLike],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
    axis: int | tuple[int, ...] | None = None,
    progress: bool | None = None,
) -> PatchingResult:
    """The first-order estimate of every patch ``patching_sweep`` would make, from one backward pass.

    The effect of patching site ``s`` (at position ``p``) is estimated as
    ``sum((clean_s - corrupt_s) * d metric / d s)`` over the patched entries,
    with the gradient taken on the corrupted run (with respect to zero offsets
    planted at every site, so through every downstream path): exact when
    ``metric ∘ f`` is linear in the activation, a first-order Taylor
    approximation otherwise. The compile cache and the handling of NNX state
    are ``patching_sweep``'s.

    Args:
        f: The model, as for ``patching_sweep``.
        clean: ``reap(f, tag=tag)(*clean_args)``, or a list of them (one per batch).
        corrupted_args: The corrupted run's positional arguments, or a list of
            such tuples (one per batch: the result is the mean over batches).
        metric: Maps ``f``'s output to a scalar.
        tag: The tag whose sows are the sites.
        names: Which sites, as for ``patching_sweep``.
        exclude: Sites never to estimate, as for ``patching_sweep``.
        axis: The axis (or tuple of axes) of each site's value to estimate
            index by index, or ``None`` for whole sites.
        progress: A tqdm bar over batches, as for ``patching_sweep``.

    Returns:
        A ``PatchingResult`` of the estimated effects, shaped as
        ``patching_sweep``'s, with ``baseline`` the corrupted run's metric
        (returned while the program runs, as ``patching_sweep``'s).

    Raises:
        TypeError: malformed ``f``, ``clean``, ``corrupted_args`` or ``axis``,
            or a ``metric`` that does not return a scalar.
        ValueError: nothing to patch, or sites a sweep cannot patch one by one
            (as for ``patching_sweep``).
        KeyError: ``clean`` lacks a value for a chosen site.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import attribution_patching, reap, sow
        >>> def f(x):
        ...     h = sow(2.0 * x, name="h", mode="strict")
        ...     return sow(h + 1.0, name="g", mode="strict")
        >>> clean = reap(f)(jnp.array([1.0, 2.0, 3.0]))
        >>> attribution_patching(f, clean, (jnp.zeros(3),), jnp.sum, axis=0).values
        array([[2., 4., 6.],
               [2., 4., 6.]], dtype=float32)
    """
    caller = "attribution_patching"
    setup = planned(f, clean, corrupted_args, tag, names, axis, caller, exclude)
    _, _, targets, plan = setup
    patched = frozenset(path_str(t.site.path) for t in targets)

    def program(
        f: Callable, metric: Callable, operands: tuple[None, list[Any], tuple]
    ) -> tuple[jax.Array, jax.Array]:
        _, cleans, args = operands
        planted = plant(f, tag=tag)
        reaped = reap(f, tag=tag, names=patched.__contains__)(*args)
        corrupts = [site_value(reaped, t.site, "corrupted", t.count) for t in targets]

        def metric_of(offsets: list[Any]) -> jax.Array:
            plants = {
                t.site.path: AddVector(d, jnp.ones(())) if t.count is None else AddRow(d)
                for t, d in zip(targets, offsets)
            }
            return _scalar(metric(planted(nested_dict(plants), *args)))

        zeros = [jax.tree_util.tree_map(jnp.zeros_like, c) for c in corrupts]
        baseline, grads = jax.value_and_grad(metric_of)(zeros)
        effects = []
        for t, c, k, g, ax in zip(targets, cleans, corrupts, grads, plan.site_axes):
            if t.count is None:
                effects.append(_contract(c, k, g, ax)[None])
            else:  # one row per occurrence
                effects.append(jax.vmap(functools.partial(_contract, axes=ax))(c, k, g))
        return jnp.concatenate(effects), baseline

    return _run(setup, program, f, metric, (caller, tag), axis, progress, int(plan.firsts[-1]))


def _run_program(fn: Any, tree: Any, program: Callable[[Any, Any, Any], Any]) -> Any:
    bound, measure, operands = tree
    return program(rewrap(fn, bound), measure, operands)


def _contract(clean: Any, corrupt: Any, grad: Any, axes: tuple[int, ...] | None) -> jax.Array:
    """sum((clean - corrupt) * grad) over every axis but `axes` (kept, in that order), and over leaves."""

    def leaf(c: jax.Array, k: jax.Array, g: jax.Array) -> jax.Array:
        product = (c - k) * g
        if axes is None:
            return jnp.sum(product)
        moved = jnp.moveaxis(product, axes, tuple(range(len(axes))))
        return jnp.sum(moved.reshape(moved.shape[: len(axes)] + (-1,)), -1)

    return jnp.asarray(
        sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(leaf, clean, corrupt, grad)))
    )
