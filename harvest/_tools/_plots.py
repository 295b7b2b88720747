"""Heatmap panels for patching results and attention patterns (matplotlib, imported lazily).

Panels share one colour scale, and the figure uses matplotlib's constrained
layout sized from the longest tick label, so long site names never run into a
neighbouring panel or the colourbar; panels that do not fit side by side in
``MAX_WIDTH`` go on more rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import _errors

if TYPE_CHECKING:
    from jax.typing import ArrayLike
    from matplotlib.axes import Axes


# Figures are at most 8.5 inches wide: 850 pixels at matplotlib's default 100 dpi
# (notebooks, savefig), leaving room for a tight bounding box within the 900 px
# the docs allow a figure.
MAX_WIDTH = 8.5


def pyplot() -> Any:
    """``matplotlib.pyplot``, imported lazily (plotting is optional), or an
    ImportError naming the extra that installs it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as cause:
        raise _errors.needs_extra("harvest's plots", "matplotlib", "patching") from cause
    return plt


def _panels(n: int, down: int, across: int, figsize: tuple[float, float]) -> list[Axes]:
    """A figure of ``down`` rows of ``across`` panels; the first ``n`` axes (the rest hidden)."""
    _, grid = pyplot().subplots(down, across, figsize=figsize, squeeze=False, layout="constrained")
    for unused in grid.flat[n:]:
        unused.set_axis_off()
    return list(grid.flat[:n])


def heatmaps(
    grids: Sequence[np.ndarray],
    *,
    titles: Sequence[str | None],
    row_labels: Sequence[Any],
    col_labels: Iterable[Any] | None,
    xlabel: str,
    ylabel: str | None,
    cmap: str,
    vmin: float,
    vmax: float,
    cbar_label: str,
    ax: Axes | Sequence[Axes] | None = None,
    columns: int = 4,
    colorbar_each: bool = False,
    suptitle: str | None = None,
    **imshow_kwargs: Any,
) -> list[Axes]:
    """Draws each 2-D grid as a panel on one shared scale, `columns` panels a
    row, under `suptitle`; returns the list of axes (one per grid). The scale's
    colourbar is one for all panels, or (`colorbar_each`) one beside each."""
    rows, cols = grids[0].shape
    if ax is None:
        label_width = 0.09 * max((len(str(r)) for r in row_labels), default=0)
        panel = 0.8 + 0.3 * cols
        # As many panels a row as fit in MAX_WIDTH; a panel wider than that alone
        # gets narrower cells instead.
        fit = int((MAX_WIDTH - label_width - 1.2) // panel)
        across = max(1, min(len(grids), columns, fit))
        down = -(-len(grids) // across)
        width = min(MAX_WIDTH, label_width + across * panel + 1.2)
        # Tall enough for the colourbar's label, written along it (a sweep of two
        # layers is a short figure; "fraction of clean-corrupt gap" is not short).
        height = max(down * (1.4 + 0.35 * rows), 0.4 + 0.075 * len(cbar_label))
        axes = _panels(len(grids), down, across, (width, height))
    else:
        across = min(len(grids), columns)
        axes = [cast("Axes", ax)] if len(grids) == 1 else list(cast("Sequence[Axes]", ax))
    for i, (grid, axis) in enumerate(zip(grids, axes)):
        image = axis.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", **imshow_kwargs)
        # Only the first panel of each row names the rows.
        first = i % across == 0
        axis.set_yticks(range(rows), [str(r) for r in row_labels] if first else [""] * rows)
        if col_labels is None:
            axis.set_xticks([])
        else:
            axis.set_xticks(
                range(cols), [str(c) for c in col_labels], rotation=90 if cols > 12 else 0
            )
            axis.set_xlabel(xlabel)
        if ylabel and first:
            axis.set_ylabel(ylabel)
        title = titles[i]
        if title is not None:
            axis.set_title(title)
        if colorbar_each:
            axis.figure.colorbar(
                image, ax=axis, label=cbar_label if i % across == across - 1 else None
            )
    if not colorbar_each:
        axes[0].figure.colorbar(image, ax=axes, label=cbar_label)
    if suptitle is not None:
        axes[0].figure.suptitle(suptitle)
    return axes


def plot_attention(
    pattern: ArrayLike | tuple[ArrayLike],
    tokens: Sequence[str] | None = None,
    *,
    heads: Sequence[int] | None = None,
    title: str | None = None,
    cmap: str = "Blues",
) -> list[Axes]:
    """Draws an attention pattern, one panel per head (query × key), on one scale from 0.

    Cells are square; a long sequence puts two heads a row, a short one four,
    in a figure at most ``MAX_WIDTH`` inches wide, each panel with a colour bar
    as tall as it.

    Args:
        pattern: the pattern, of shape ``[heads, query, key]``; a pattern site as
            ``reap`` returns it is taken too (a ``collect`` 1-tuple, or a leading
            batch axis of size 1, is taken off).
        tokens: the positions' tokens, one per key position; each axis labels
            position ``i`` as ``"i: token"`` (repeated tokens stay apart).
            None numbers the positions.
        heads: which heads to draw, by index; None draws them all.
        title: a title over the whole figure.
        cmap: a matplotlib colour map name.

    Returns:
        The list of matplotlib axes, one per head drawn.

    Raises:
        ValueError: if ``pattern`` is not three-dimensional, or ``tokens`` does
            not have one label per key position.
        ImportError: if matplotlib is not installed (the ``patching`` extra).

    Example:
        >>> import matplotlib; matplotlib.use("Agg")
        >>> import jax, jax.numpy as jnp
        >>> from harvest import plot_attention
        >>> scores = jnp.arange(2 * 3 * 3.0).reshape(2, 3, 3)
        >>> axes = plot_attention(jax.nn.softmax(scores, -1), tokens=["a", "b", "c"])
        >>> [ax.get_title() for ax in axes]
        ['head 0', 'head 1']
        >>> [label.get_text() for label in axes[0].get_xticklabels()]
        ['0: a', '1: b', '2: c']
    """
    if isinstance(pattern, tuple) and len(pattern) == 1:
        pattern = pattern[0]
    array = np.asarray(pattern)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 3:
        raise ValueError(
            f"plot_attention needs a pattern of shape [heads, query, key], got shape {array.shape}. "
            "Index the example to draw, e.g. plot_attention(reaped['pattern'][0][i])."
        )
    heads = range(array.shape[0]) if heads is None else list(heads)
    if tokens is not None and len(tokens) != array.shape[2]:
        raise ValueError(
            f"plot_attention: {len(tokens)} tokens for {array.shape[2]} key positions; pass one token per key "
            "position, or tokens=None."
        )
    # "7: the": a repeated token is told apart by its position.
    keys = [
        str(i) if tokens is None else f"{i}: {tok}"
        for i, tok in enumerate(tokens or [None] * array.shape[2])
    ]
    grids = [array[h] for h in heads]
    queries, positions = array.shape[1], array.shape[2]
    # Square cells, as large as fit (at most 0.3 in) with two panels a row for
    # long sequences, four for short ones; each panel has its own colour bar.
    label_width = 0.07 * max(len(k) for k in keys) + 0.4
    across = min(len(grids), 2 if positions > 12 else 4)
    cell = (MAX_WIDTH - across * (label_width + 1.0)) / (across * positions)
    cell = min(0.3, max(0.1, cell))
    down = -(-len(grids) // across)
    width = min(MAX_WIDTH, across * (label_width + 1.0 + cell * positions))
    height = down * (cell * queries + label_width + 0.5) + (0.3 if title else 0.0)
    axes = heatmaps(
        grids,
        titles=[f"head {h}" for h in heads],
        row_labels=keys[:queries],
        col_labels=keys,
        xlabel="key",
        ylabel="query",
        cmap=cmap,
        vmin=0.0,
        vmax=float(max(np.max(g) for g in grids)) or 1.0,
        cbar_label="attention",
        ax=_panels(len(grids), down, across, (width, height)),
        columns=across,
        colorbar_each=True,
        suptitle=title,
    )
    if cell < 0.2:  # small cells: tick labels to match, so each stays beside its row
        for axis in axes:
            axis.tick_params(labelsize=7)
    return axes
