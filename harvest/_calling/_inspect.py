"""`sites`: every sow a function holds, found by tracing it, never by running it."""

from __future__ import annotations

import dataclasses
import html
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors
from .._walk._higher_order import UNBOUNDED
from .._walk._paths import path_str
from .._walk._rules import batched_lax_map
from .._walk._rules.batched_lax_map import per_element
from .._walk._site import Site
from .._walk._sow_index import sow_index
from ._renamed import arguments_moved
from ._tracing import make_jaxpr


@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """One sow site as ``sites`` describes it.

    Attributes:
        tag: the site's tag.
        name: its name, dotted through ``nest`` scopes (``"layer0.mlp_out"``).
        mode: its mode (``"collect"``, ``"strict"``, ``"append"``, ``"clobber"``,
            or ``"cond_clobber"`` for ``sow_cond``).
        shape: the sown value's shape: a tuple for an array, the same pytree of
            tuples for a pytree.
        dtype: the sown value's dtype (a NumPy dtype; a PRNG key's is JAX's, such as
            ``key<fry>``), or the same pytree of dtypes.
        fires: how many times one call sows here (loop lengths and a
            ``shard_map``'s shards multiplied in, as reap returns one row per
            iteration or shard; inside ``cond``, as if that branch is taken), or
            ``None`` inside a ``while_loop``, whose trip count is not known before
            running.
        where: the path of enclosing primitives, outermost first, e.g.
            ``"jit › scan[12] › cond[1]"``; ``""`` at top level.
        nbytes: the bytes ``reap`` returns for this site per call (its value's
            size times ``fires``), or ``None`` inside a ``while_loop``.
        axes: the name of each axis of the value (a tuple per array, ``None``
            for an unnamed axis), for a Penzai ``NamedArray`` that
            ``instrument`` sows as its data; ``None`` for any other site. The
            table writes such a shape with its names, ``(batch=1, seq=3, embedding=8)``.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import sites, sow
        >>> info = sites(lambda x: sow(x, name="h"))(jnp.zeros(3))[0]
        >>> info.name, info.shape, info.fires, info.nbytes
        ('h', (3,), 1, 12)
    """

    tag: str
    name: str
    mode: str
    shape: Any
    dtype: Any
    fires: int | None
    where: str
    nbytes: int | None = None
    axes: Any = None


class Sites(list[SiteInfo]):
    """A list of `SiteInfo` that prints as a table.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import sites, sow
        >>> found = sites(lambda x: sow(x, name="h", mode="strict"))(jnp.zeros(2))
        >>> print(found)
        tag            name  mode    shape  dtype    fires  bytes  where
        intermediates  h     strict  (2,)   float32  1      8
        >>> found.nbytes()
        8
    """

    COLUMNS = ("tag", "name", "mode", "shape", "dtype", "fires", "bytes", "where")
    _blocks: list[Any]  # set by `sites`: each site's nest-scope keys, for the HTML view

    def names(self) -> list[str]:
        """The distinct names, in program order.

        Returns:
            A list of names, each once (a site sown in several places is one name).
        """
        return list(dict.fromkeys(s.name for s in self))

    def nbytes(self) -> int | None:
        """The bytes a full ``reap`` of these sites returns per call: the size of
        the reaped dict, which the compiled program allocates beside ``f``'s own
        (``reap`` with ``names``/``exclude`` keeps only the sites chosen).

        Returns:
            The sum of every site's ``nbytes``, or ``None`` if a site is inside a
            ``while_loop`` (its count is known only when it runs; with
            ``reap(..., max_steps=N)`` it is at most ``N`` times one iteration's).
        """
        sizes = [s.nbytes for s in self]
        known = [n for n in sizes if n is not None]
        return sum(known) if len(known) == len(sizes) else None

    def _cells(self, info: SiteInfo) -> tuple[str, ...]:
        fires = "unbounded" if info.fires is UNBOUNDED else str(info.fires)
        dtype = jax.tree_util.tree_map(lambda d: d.name, info.dtype)
        nbytes = "unbounded" if info.nbytes is None else str(info.nbytes)
        shape = str(info.shape)
        if isinstance(info.axes, tuple) and isinstance(info.shape, tuple):  # one named array
            # (1, 3, 8) with names ("batch", "seq", None) as (batch=1, seq=3, 8)
            named = (f"{n}={k}" if n else str(k) for k, n in zip(info.shape, info.axes))
            shape = "(" + ", ".join(named) + ")"
        return (info.tag, info.name, info.mode, shape, str(dtype), fires, nbytes, info.where)

    def __str__(self) -> str:
        if not self:
            return "(no sow sites)"
        rows = [self.COLUMNS] + [self._cells(s) for s in self]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return _html_view(self)

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """The program's structure as one self-contained HTML page; written to ``path`` if given.

        Every site sits in its nesting (``jit › scan[12] › cond[1]``), each body a
        collapsible block, with its shape, dtype, mode, tag and fires per call; a
        ``Sites`` value shows the same view in a notebook. For the dataflow graph of
        the whole program, see ``harvest.view``.

        Args:
            path: a file to write the page to (UTF-8), or None to only return it.

        Returns:
            The page, as a string.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from harvest import sites, sow
            >>> def f(xs):
            ...     def body(c, x):
            ...         return c + sow(x * c, name="step", mode="append"), None
            ...     return sow(jax.lax.scan(body, 1.0, xs)[0], name="total", mode="strict")
            >>> page = sites(f)(jnp.zeros(12)).to_html()
            >>> page.startswith("<!DOCTYPE html>"), "scan[12]" in page, "total" in page
            (True, True, True)
        """
        page = (
            '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>harvest sites</title></head>\n'
            f"<body>\n{_html_view(self)}\n</body></html>\n"
        )
        if path is not None:
            pathlib.Path(path).write_text(page, encoding="utf-8")
        return page


_STYLE = """
.harvest-sites { font: 13px/1.5 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; color: #222; }
.harvest-sites ul { list-style: none; margin: 0; padding-left: 1.4em; border-left: 1px dotted #bbb; }
.harvest-sites > details > ul { padding-left: 0.4em; border-left: none; }
.harvest-sites summary { cursor: pointer; }
.harvest-sites .body { color: #7a3e9d; font-weight: 600; }
.harvest-sites .name { font-weight: 600; }
.harvest-sites .meta { color: #777; }
.harvest-sites .shape { color: #0b6e4f; }
.harvest-sites .mode { color: #a15c00; }
"""


def _nest_blocks(found: Sites) -> list[Any]:
    """The sites arranged in their bodies: a list of `SiteInfo` and `(label, items)`."""
    blocks = getattr(found, "_blocks", None)
    if blocks is None or len(blocks) != len(found):  # a Sites built by hand: nest by labels
        blocks = [tuple((None, w) for w in s.where.split(" › ")) if s.where else () for s in found]
    root: list[Any] = []
    stack: list[tuple[tuple[Any, ...], list[Any]]] = [((), root)]
    for info, keys in zip(found, blocks):
        while stack[-1][0] != keys[: len(stack[-1][0])]:
            stack.pop()
        for key in keys[len(stack[-1][0]) :]:
            items: list[Any] = []
            stack[-1][1].append((key[1], items))
            stack.append((stack[-1][0] + (key,), items))
        stack[-1][1].append(info)
    return root


def _count(items: list[Any]) -> int:
    return sum(1 if isinstance(it, SiteInfo) else _count(it[1]) for it in items)


def _html_items(items: list[Any], cells: Callable[[SiteInfo], tuple[str, ...]]) -> str:
    out = ["<ul>"]
    for it in items:
        if isinstance(it, SiteInfo):
            tag, name, mode, _, _, fires, _, where = map(html.escape, cells(it))
            out.append(
                f'<li title="{name} ({where or "top level"})"><span class="name">{name}</span> '
                f'<span class="shape">{html.escape(_aval_str(it))}</span> <span class="mode">{mode}</span> '
                f'<span class="meta">× {fires} · {tag}</span></li>'
            )
        else:
            label, kids = it
            n = _count(kids)
            out.append(
                f'<li><details open><summary><span class="body">{html.escape(label)}</span> '
                f'<span class="meta">{n} site{"s" * (n != 1)}</span></summary>'
                f"{_html_items(kids, cells)}</details></li>"
            )
    out.append("</ul>")
    return "".join(out)


def _aval_str(info: SiteInfo) -> str:
    """`float32[2, 3]`, or that per leaf for a pytree value."""
    if isinstance(info.shape, tuple) and all(isinstance(d, int) for d in info.shape):
        return f"{info.dtype.name}{list(info.shape)}"
    shapes = jax.tree_util.tree_leaves(info.shape, is_leaf=lambda x: isinstance(x, tuple))
    dtypes = jax.tree_util.tree_leaves(info.dtype)
    return "(" + ", ".join(f"{d.name}{list(s)}" for s, d in zip(shapes, dtypes)) + ")"


def _html_view(found: Sites) -> str:
    tags = ", ".join(dict.fromkeys(s.tag for s in found)) or "no tags"
    head = f'<span class="body">program</span> <span class="meta">{len(found)} sow sites · {html.escape(tags)}</span>'
    return (
        f'<div class="harvest-sites"><style>{_STYLE}</style><details open><summary>{head}</summary>'
        f"{_html_items(_nest_blocks(found), found._cells)}</details></div>"
    )


@arguments_moved
def sites(f: Callable[..., Any], *, tag: str | None = None) -> Callable[..., Sites]:
    """Returns a function listing every sow site of ``f`` for its arguments, without running ``f``.

    ``sites(f)(*args, **kwargs)`` traces ``f`` with ``jax.make_jaxpr``, its
    arguments taken as ``reap`` takes them (a ``jax.ShapeDtypeStruct`` may stand for
    an array). Each sow equation gives one ``SiteInfo``, in program order, recursing
    into ``jit``, ``scan``, ``cond``, ``while_loop``, ``checkpoint`` and custom
    derivatives. The old form ``sites(f, x)`` still works until harvest 0.3, with
    a ``DeprecationWarning``; ``sites(f)()`` lists a function of no arguments.

    Args:
        f: the function to trace, as for ``reap``.
        tag: list only the sites of this tag; None lists every tag.

    Returns:
        A function taking ``f``'s arguments (arrays, ``jax.ShapeDtypeStruct``
        values, or Python values, static as in ``reap``) and returning a
        ``Sites`` list of ``SiteInfo``, which prints as a table and shows as a
        collapsible tree in a notebook.

    Raises:
        TypeError: if ``f`` is not callable or ``tag`` is neither a string nor None.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sites, sow
        >>> def f(xs):
        ...     def body(c, x):
        ...         return c + sow(x * c, name="step", mode="append"), None
        ...     return jax.lax.scan(body, 1.0, xs)[0]
        >>> print(sites(jax.jit(f))(jax.ShapeDtypeStruct((12,), jnp.float32)))
        tag            name  mode    shape  dtype    fires  bytes  where
        intermediates  step  append  ()     float32  12     48     jit › scan[12]
    """
    if not callable(f):
        raise _errors.needs_callable("sites(f)", f)
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"sites: tag must be a string or None (every tag), got {tag!r}.")

    def listed_sites(*args: Any, **kwargs: Any) -> Sites:
        def traced(plan: Any = None) -> Any:
            with per_element(plan):
                return make_jaxpr(f, args, kwargs)[0].jaxpr

        jaxpr = traced()
        unrolled = batched_lax_map.staged_per_batch(jaxpr, None, traced)
        if unrolled and batched_lax_map.SUPPORTED:  # listed once per element, as reap gives them
            jaxpr = traced(unrolled)
        found = Sites()
        found._blocks = []
        for item in sow_index(jaxpr).listing:
            site = Site.of(item.eqn)
            if tag is None or site.tag == tag:
                found.append(_info(site, item.where, item.fires))
                found._blocks.append(item.blocks)
        return found

    return listed_sites


def _info(site: Site, where: tuple[str, ...], fires: int | None) -> SiteInfo:
    shape = jax.tree_util.tree_unflatten(site.tree, [a.shape for a in site.avals])
    dtype = jax.tree_util.tree_unflatten(site.tree, [_dtype(a.dtype) for a in site.avals])
    size = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in site.avals)
    nbytes = None if fires is UNBOUNDED else size * fires
    axes = None if site.axes is None else jax.tree_util.tree_unflatten(site.tree, list(site.axes))
    mode = site.mode.shown
    return SiteInfo(
        site.tag, path_str(site.path), mode, shape, dtype, fires, " › ".join(where), nbytes, axes
    )


def _dtype(dtype: Any) -> Any:
    """A NumPy dtype, or a PRNG key's dtype as JAX has it (``key<fry>``: NumPy has none)."""
    return dtype if jnp.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype)


def sow_equations(jaxpr: Any) -> Iterator[tuple[Any, tuple[str, ...], int | None]]:
    """Yields (sow equation, enclosing labels, firings per call), in program order."""
    for item in sow_index(jaxpr).listing:
        yield item.eqn, item.where, item.fires


def sow_firings(jaxpr: Any) -> Iterator[tuple[Any, tuple[str, ...], int | None, int]]:
    """As `sow_equations`, plus how many of its firings reap stacks as rows
    whatever the mode: one per shard of each enclosing shard_map (1 elsewhere)."""
    for item in sow_index(jaxpr).listing:
        yield item.eqn, item.where, item.fires, item.stacked
