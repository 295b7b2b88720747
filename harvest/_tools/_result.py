"""`PatchingResult`: what a patching sweep (or attribution patching) returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, SupportsFloat

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclasses.dataclass(frozen=True)
class PatchingResult:
    """The effect of each patch on a metric: `values[i, j]` for site `names[i]` at `positions[j]`.

    An effect is `metric(patched run) - baseline`. A sweep returns its result as
    soon as its program is dispatched, as a JAX call returns its arrays: reading
    ``values`` or ``baseline`` (or anything that reads them: ``normalized``,
    ``plot``, printing) waits for the program and converts its output to NumPy,
    once; ``jax.block_until_ready(result)`` waits explicitly. So a loop of sweeps
    overlaps each call's Python with the previous program's run.

    Args:
        values: The effects: ``[len(names)]`` (whole sites), ``[len(names), size]``
            or ``[len(names), *sizes]`` (several swept axes).
        names: One name per row (a looped site's occurrences are ``name[0]``,
            ``name[1]``, ...).
        positions: The indices along the swept axis, a tuple of them (several
            axes), or ``None``.
        axis: The swept axis (an int), a tuple of axes, or ``None``.
        baseline: The metric of the unpatched corrupted run (estimated, for
            attribution patching).
        measure: What ``values`` measure (a plot's colourbar label).
        skipped: The sites a sweep without ``names=`` left out (a different
            size along the swept axes), each with the reason.
        axis_labels: What each swept axis is (``("head", "position")``), when the
            swept sites say so (attention hooks); plots label their axes with it.

    Example:
        >>> import numpy as np
        >>> from harvest import PatchingResult
        >>> r = PatchingResult(np.array([[0.0, 1.0]]), ("h",), np.arange(2), axis=1, baseline=0.5)
        >>> r.values.shape, r.names
        ((1, 2), ('h',))
    """

    values: np.ndarray
    names: tuple[str, ...]
    positions: Any  # np.ndarray, a tuple of them (several axes), or None
    axis: Any  # int, tuple of ints, or None
    baseline: float
    measure: str = "effect on metric"
    skipped: tuple[str, ...] = ()
    axis_labels: tuple[str, ...] | None = None

    @classmethod
    def _computing(
        cls, finish: Callable[[], tuple[np.ndarray, float]], **fields: Any
    ) -> PatchingResult:
        """A result whose ``values`` and ``baseline`` are ``finish()``'s, called when first
        read; ``fields`` are the others but ``measure``."""
        result = object.__new__(cls)
        for name, value in dict(fields, measure=cls.measure, _finish=finish).items():
            object.__setattr__(result, name, value)
        return result

    def __getattr__(self, name: str) -> Any:
        # Reached only for an attribute not set: the deferred fields of a result
        # still computing. Both are set together, so `finish` runs once.
        finish = self.__dict__.get("_finish")
        if finish is None or name not in ("values", "baseline"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        values, baseline = finish()
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "baseline", baseline)
        self.__dict__.pop("_finish", None)
        return self.__dict__[name]

    def __getstate__(self) -> dict[str, Any]:
        self.block_until_ready()  # a pickle holds the numbers, not the running program
        return dict(self.__dict__)

    def block_until_ready(self) -> PatchingResult:
        """Waits for the sweep's program and converts its output; returns the result itself.

        ``jax.block_until_ready(result)`` calls it; reading ``values`` does the same.

        Returns:
            This result, its ``values`` and ``baseline`` on the host.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from harvest import patching_sweep, reap, sow
            >>> f = lambda x: sow(2.0 * x, name="h", mode="strict").sum()
            >>> r = patching_sweep(f, reap(f)(jnp.ones(2)), (jnp.zeros(2),), lambda o: o, axis=0)
            >>> jax.block_until_ready(r).values
            array([[2., 2.]], dtype=float32)
        """
        self.values  # noqa: B018 -- reading it is the wait
        return self

    def normalized(self, clean_metric: SupportsFloat) -> PatchingResult:
        """The effects as fractions of the clean-corrupt gap: `values / (clean_metric - baseline)`.

        1 means the patch restores the clean run's metric, 0 that it does nothing.

        Args:
            clean_metric: ``metric(f(*clean_args))``.

        Returns:
            A copy whose ``values`` are fractions of the gap.

        Raises:
            ValueError: ``clean_metric`` equals ``baseline`` (no gap).

        Example:
            >>> import numpy as np
            >>> from harvest import PatchingResult
            >>> r = PatchingResult(np.array([[1.0, 3.0]]), ("h",), np.arange(2), axis=1, baseline=1.0)
            >>> r.normalized(clean_metric=5.0).values
            array([[0.25, 0.75]])
        """
        gap = float(clean_metric) - self.baseline
        if gap == 0.0:
            raise ValueError(
                f"normalized: the clean metric equals the corrupted baseline ({self.baseline}), so there "
                "is no gap to normalise by. Pick a metric (or inputs) that tells the two runs apart."
            )
        return dataclasses.replace(
            self, values=self.values / gap, measure="fraction of clean-corrupt gap"
        )

    def plot(
        self,
        ax: Axes | None = None,
        title: str | None = None,
        cmap: str = "RdBu_r",
        vmax: float | None = None,
        xlabel: str | None = None,
        ylabel: str | None = None,
        **imshow_kwargs: Any,
    ) -> Any:
        """Draws `values` as a heatmap (sites × positions), centred on zero; returns the axes.

        A sweep over two axes is drawn as one panel per site (first swept axis
        × second) on one colour scale, and the list of axes is returned
        (``plot_many`` puts several results on one scale). From a script, call
        ``matplotlib.pyplot.show()`` to open the figure (a notebook shows it by
        itself), or save it with ``ax.figure.savefig(path)``.

        Args:
            ax: The matplotlib axes to draw on (``None``: a new figure).
            title: The panel's title (for panels per site: the figure's).
            cmap: A diverging colormap name.
            vmax: The colour scale's bound (default: the largest magnitude).
            xlabel: What the columns are (``"unit"``, say). Default: what the
                swept sites say the axis is (``"position"``, ``"head"`` for
                attention hooks), else ``"index along axis <n>"``.
            ylabel: What the rows are, for two swept axes (default as ``xlabel``).
                With one swept axis the rows are the sites, named by their ticks.
            **imshow_kwargs: Passed to ``imshow``.

        Returns:
            The axes drawn on (a list of them, one per site, for two swept axes);
            ``.figure`` is the figure, to show or save.

        Example:
            >>> import matplotlib; matplotlib.use("Agg")
            >>> import numpy as np
            >>> from harvest import PatchingResult
            >>> r = PatchingResult(np.eye(2), ("a", "b"), np.arange(2), axis=1, baseline=0.0)
            >>> r.plot(title="effect").get_title()
            'effect'
            >>> r.plot(xlabel="unit").get_xlabel()
            'unit'
            >>> heads = PatchingResult(
            ...     np.ones((2, 3, 4)), ("l0", "l1"), (np.arange(3), np.arange(4)), axis=(2, 1), baseline=0.0
            ... )
            >>> [ax.get_title() for ax in heads.plot()]
            ['l0', 'l1']
        """
        if self.values.ndim != 3:
            return PatchingResult.plot_many(
                [self], ax=ax, titles=[title], cmap=cmap, vmax=vmax, xlabel=xlabel, **imshow_kwargs
            )[0]
        from ._plots import heatmaps

        rows, cols = self.positions
        bound = float(np.max(np.abs(self.values))) if vmax is None else float(vmax)
        return heatmaps(
            list(self.values),
            titles=list(self.names),
            row_labels=rows,
            col_labels=cols,
            xlabel=self._axis_label(1) if xlabel is None else xlabel,
            ylabel=self._axis_label(0) if ylabel is None else ylabel,
            cmap=cmap,
            vmin=-(bound or 1.0),
            vmax=bound or 1.0,
            cbar_label=self.measure,
            ax=ax,
            suptitle=title,
            **imshow_kwargs,
        )

    def _axis_label(self, i: int) -> str:
        """What swept axis `i` is: the sites' own name for it where they say, else its index."""
        if self.axis_labels:
            return self.axis_labels[i]
        axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        return f"index along axis {axes[i]}"

    @staticmethod
    def plot_many(
        results: Sequence[PatchingResult],
        titles: Sequence[str | None] | None = None,
        *,
        ax: Axes | Sequence[Axes] | None = None,
        cmap: str = "RdBu_r",
        vmax: float | None = None,
        xlabel: str | None = None,
        **imshow_kwargs: Any,
    ) -> list[Axes]:
        """Draws several results side by side on one colour scale with one colourbar; returns the axes.

        No label overlaps a neighbouring panel or the colourbar. From a script,
        call ``matplotlib.pyplot.show()`` to open the figure (a notebook shows
        it by itself), or save it with ``axes[0].figure.savefig(path)``.

        Args:
            results: Results with the same rows (sites) and columns, each of
                one swept axis at most.
            titles: One title per result (``None``: untitled).
            ax: The axes to draw on, one per result (``None``: a new figure).
            cmap: A diverging colormap name.
            vmax: The shared colour scale's bound (default: the largest magnitude).
            xlabel: What the columns are, as for ``plot``.
            **imshow_kwargs: Passed to ``imshow``.

        Returns:
            The axes, one per result.

        Raises:
            ValueError: no results, results of different shapes or sites, a
                result of two swept axes, or as many titles as results not given.

        Example:
            >>> import matplotlib; matplotlib.use("Agg")
            >>> import numpy as np
            >>> from harvest import PatchingResult
            >>> a = PatchingResult(np.eye(2), ("a", "b"), np.arange(2), axis=1, baseline=0.0)
            >>> b = PatchingResult(3 * np.eye(2), ("a", "b"), np.arange(2), axis=1, baseline=0.0)
            >>> axes = PatchingResult.plot_many([a, b], titles=["exact", "estimate"])
            >>> [ax.images[0].get_clim() for ax in axes]
            [(-3.0, 3.0), (-3.0, 3.0)]
        """
        from ._plots import heatmaps

        results = list(results)
        if not results:
            raise ValueError("plot_many needs at least one PatchingResult.")
        for r in results:
            if r.values.ndim > 2:
                raise ValueError(
                    f"plot_many draws results of one swept axis; this one has values of shape "
                    f"{r.values.shape}. Use result.plot(), which draws one panel per site."
                )
        grids = [r.values if r.positions is not None else r.values[:, None] for r in results]
        if len({g.shape for g in grids}) != 1 or len({r.names for r in results}) != 1:
            raise ValueError(
                "plot_many draws results with the same sites and positions; got shapes "
                f"{[g.shape for g in grids]}. Plot them separately (each with the same vmax)."
            )
        titles = [None] * len(results) if titles is None else list(titles)
        if len(titles) != len(results):
            raise ValueError(f"plot_many: {len(titles)} titles for {len(results)} results.")
        bound = float(max(np.max(np.abs(g)) for g in grids)) if vmax is None else float(vmax)
        first = results[0]
        return heatmaps(
            grids,
            titles=titles,
            row_labels=first.names,
            col_labels=first.positions,
            xlabel=first._axis_label(0) if xlabel is None else xlabel,
            ylabel=None,
            cmap=cmap,
            vmin=-(bound or 1.0),
            vmax=bound or 1.0,
            cbar_label=first.measure,
            ax=ax,
            **imshow_kwargs,
        )
