"""`view`: the traced program as a dataflow graph, in one self-contained HTML page.

The layout is harvest's own and needs no library: each jaxpr is a column of
cards in program order (a jaxpr is already topologically sorted), each body of
``scan``/``while``/``cond``/``jit``/... a collapsible box inside its parent's
column, and the edges (data dependencies) are drawn by a few lines of inline
JavaScript as curves along the column's left edge, re-routed to a collapsed
box's header. Everything is inline (style, script, histograms as SVG), so the
page works offline, from a file or in a notebook.
"""

from __future__ import annotations

import html
import itertools
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _errors
from ._calling import make_jaxpr
from ._higher_order import bodies as _descriptor_bodies, operands_of
from ._paths import path_str
from ._primitive import sow_p
from ._site import Site

_COUNTER = itertools.count()


class View:
    """A rendered dataflow graph: shows itself in a notebook, or is saved as a page.

    Attributes:
        html: the self-contained HTML fragment (``save`` wraps it in a page).
        sites: the number of sow sites drawn.
        groups: the number of bodies (``scan``, ``cond`` branches, ``jit``, ...) drawn.
    """

    def __init__(self, html: str, sites: int, groups: int) -> None:
        self.html = html
        self.sites = sites
        self.groups = groups

    def _repr_html_(self) -> str:
        return self.html

    def page(self) -> str:
        """The graph as a whole HTML page.

        Returns:
            The page, as a string (no external resources).
        """
        return (
            '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>harvest view</title>'
            f"</head>\n<body>\n{self.html}\n</body></html>\n"
        )

    def save(self, path: str | os.PathLike[str]) -> pathlib.Path:
        """Writes the page to ``path`` (UTF-8).

        Args:
            path: the file to write.

        Returns:
            The path written, as a ``pathlib.Path``.
        """
        out = pathlib.Path(path)
        out.write_text(self.page(), encoding="utf-8")
        return out


def view(
    f: Callable[..., Any],
    *args: Any,
    values: dict[str, Any] | None = None,
    tag: Any = None,
    **kwargs: Any,
) -> View:
    """Draws the dataflow graph of ``f(*args, **kwargs)``, traced as ``reap`` traces it.

    Nodes are the program's sow sites (name, tag, mode) and ops (the
    primitive), each with its output shapes and dtypes; edges are data
    dependencies; the bodies of ``scan``, ``while_loop``, ``cond``, ``jit``,
    ``checkpoint`` and custom derivatives are boxes that open and close
    (click their header). Nothing runs: ``f`` is only traced. Given
    ``values`` -- what ``reap`` returned -- each site it names shows the
    value's mean, standard deviation and a histogram: on the sites of
    ``tag`` (the tag the values were reaped with), or, with no ``tag``, on
    the sites of the one tag that has each name. With
    ``instrument(f, ops=True)`` every op is a site too.

    Args:
        f: the function to trace, as for ``reap``.
        *args: its positional arguments: arrays, ``jax.ShapeDtypeStruct``
            values, or Python values (static, as in ``reap``).
        values: a reaped dict (nested by ``nest`` scopes, or with dotted names)
            whose values are summarised on their sites; None for none.
        tag: the tag ``values`` were reaped with; None (the default) when
            each of their names is sown with one tag only.
        **kwargs: its keyword arguments, as ``args``.

    Returns:
        A ``View``: it displays in a notebook, and ``View.save(path)`` writes a
        self-contained page that opens from a file, offline.

    Raises:
        TypeError: if ``f`` is not callable, or ``values`` is not a dict.
        ValueError: if a name in ``values`` is no site of ``tag`` (a typo),
            or, with no ``tag``, is sown with several tags.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import reap, sow, view
        >>> def f(xs):
        ...     def body(c, x):
        ...         return c + sow(x * c, name="step", mode="append"), None
        ...     return sow(jax.lax.scan(body, 1.0, xs)[0], name="total", mode="strict")
        >>> v = view(f, jnp.arange(3.0), values=reap(f)(jnp.arange(3.0)))
        >>> v.sites, v.groups, "scan[3]" in v.html, "mean" in v.html
        (2, 1, True, True)
    """
    if not callable(f):
        raise TypeError(f"view(f, *args) needs a callable f, got {type(f).__name__}.")
    if values is not None and not isinstance(values, dict):
        raise TypeError(f"view: values must be a dict, as reap returns it, got {values!r}.")
    closed = make_jaxpr(f, args, kwargs)[0]
    graph = _Graph(_flat(values or {}), tag)
    body = graph.jaxpr(closed.jaxpr, {}, inputs=True)
    graph.check_values()
    uid = f"hv{next(_COUNTER)}"
    fragment = (
        f'<div class="harvest-view" id="{uid}"><style>{_STYLE}</style>'
        f'<svg class="hv-edges"></svg>{body}'
        f"<script>{_SCRIPT.replace('__ID__', uid)}</script></div>"
    )
    return View(fragment, graph.sites, graph.groups)


def _flat(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix + (key,)))
        else:
            out[path_str(prefix + (key,))] = value
    return out


class _Graph:
    """Builds the nested HTML; each var is mapped to the id of the node producing it."""

    def __init__(self, values: dict[str, Any], tag: Any) -> None:
        self.values, self.tag = values, tag
        self.tags_of: dict[str, set[Any]] = {}  # each site name drawn: the tags it is sown with
        self.ids = itertools.count()
        self.sites = 0
        self.groups = 0

    def jaxpr(self, jaxpr: Any, producers: dict[Any, str], inputs: bool = False) -> str:
        cards = []
        for i, v in enumerate(jaxpr.invars if inputs else ()):
            node = f"n{next(self.ids)}"
            aval = html.escape(v.aval.str_short())
            cards.append(_card(node, "hv-input", f"input {i}", aval, []))
            producers[v] = node
        for eqn in jaxpr.eqns:
            node = f"n{next(self.ids)}"
            sources = sorted({producers[v] for v in eqn.invars if _is_var(v) and v in producers})
            bodies = [(b.label, b.jaxpr, b.runs) for b in _descriptor_bodies(eqn)]
            if eqn.primitive is sow_p:
                cards.append(self._site(node, eqn, sources))
            elif bodies:
                cards.append(self._group(node, eqn, bodies, producers, sources))
            else:
                cards.append(self._op(node, eqn, sources))
            for v in eqn.outvars:
                producers[v] = node
        return '<div class="hv-col">' + "".join(cards) + "</div>"

    def _op(self, node: str, eqn: Any, sources: list[str]) -> str:
        return _card(node, "hv-op", html.escape(eqn.primitive.name), _avals(eqn), sources)

    def _site(self, node: str, eqn: Any, sources: list[str]) -> str:
        self.sites += 1
        site = Site.of(eqn)
        name = path_str(site.path)
        title = f'<span class="hv-name">{html.escape(name)}</span>'
        meta = f"{html.escape(str(site.tag))} · {html.escape(str(eqn.params['mode']))}"
        extra = f'<div class="hv-meta">{meta}</div>'
        self.tags_of.setdefault(name, set()).add(site.tag)
        if name in self.values and self.tag in (None, site.tag):
            extra += _summary(self.values[name])
        return _card(node, "hv-site", title, _avals(eqn), sources, extra)

    def check_values(self) -> None:
        """Raises unless each name in ``values`` was summarised on the sites of one tag."""
        names = [n for n, tags in self.tags_of.items() if self.tag is None or self.tag in tags]
        missing = [n for n in self.values if n not in names]
        if missing:
            raise _errors.view_values_unmatched(missing, names, self.tag)
        for name in self.values:
            if self.tag is None and len(self.tags_of[name]) > 1:
                raise _errors.view_values_ambiguous(name, sorted(map(str, self.tags_of[name])))

    def _group(
        self,
        node: str,
        eqn: Any,
        bodies: list[tuple[str, Any, int | None]],
        producers: dict[Any, str],
        sources: list[str],
    ) -> str:
        inner: list[str] = []
        labels = [label for label, _, _ in bodies]
        for label, sub, _ in bodies:
            self.groups += 1
            role = _param_name(eqn, sub)
            if labels.count(label) > 1 and role:  # while's cond_jaxpr and body_jaxpr
                label = f"{label} {role.removesuffix('_jaxpr')}"
            mapped = {
                a: producers[b]
                for a, b in zip(reversed(sub.invars), reversed(operands_of(eqn, sub)))
                if _is_var(b) and b in producers
            }
            inner.append(
                f'<details open class="hv-group" data-node="{node}-{len(inner)}">'
                f'<summary><span class="hv-label">{html.escape(label)}</span></summary>'
                f"{self.jaxpr(sub, mapped)}</details>"
            )
        head = _card(node, "hv-op hv-call", html.escape(eqn.primitive.name), _avals(eqn), sources)
        return f'<div class="hv-groupwrap">{head}{"".join(inner)}</div>'


def _param_name(eqn: Any, sub: Any) -> str | None:
    """The name of the parameter of ``eqn`` that holds the body ``sub``."""
    for key, value in eqn.params.items():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if item is sub or getattr(item, "jaxpr", None) is sub:
                return str(key)
    return None


def _is_var(v: Any) -> bool:
    return hasattr(v, "aval") and not hasattr(v, "val")  # a Literal has `val`


def _avals(eqn: Any) -> str:
    shown = [
        v.aval.str_short() if hasattr(v.aval, "str_short") else str(v.aval) for v in eqn.outvars
    ]
    return html.escape(", ".join(shown[:4]) + (", ..." if len(shown) > 4 else ""))


def _card(node: str, kind: str, title: str, avals: str, sources: list[str], extra: str = "") -> str:
    return (
        f'<div class="hv-node {kind}" data-node="{node}" data-from="{" ".join(sources)}">'
        f'<span class="hv-title">{title}</span> <span class="hv-aval">{avals}</span>{extra}</div>'
    )


def _summary(value: Any) -> str:
    leaves = [np.asarray(v, dtype=float).ravel() for v in _leaves(value)]
    data = np.concatenate(leaves) if leaves else np.zeros(0)
    if data.size == 0:
        return ""
    counts, _ = np.histogram(data, bins=12)
    peak = max(int(counts.max()), 1)
    bars = "".join(
        f'<rect x="{i * 5}" y="{16 - 16 * c / peak:.1f}" width="4" height="{16 * c / peak:.1f}"/>'
        for i, c in enumerate(counts)
    )
    return (
        f'<div class="hv-stats">mean {data.mean():.4g} · std {data.std():.4g} '
        f'<svg class="hv-hist" width="60" height="16">{bars}</svg></div>'
    )


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


_STYLE = """
.harvest-view { position: relative; font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace;
  color: #222; padding-left: 28px; max-width: 100%; overflow-x: auto; }
.harvest-view .hv-edges { position: absolute; left: 0; top: 0; pointer-events: none;
  overflow: visible; }
.harvest-view .hv-col { display: flex; flex-direction: column; gap: 4px; }
.harvest-view .hv-node { border: 1px solid #ccd; border-radius: 4px; padding: 2px 6px;
  background: #fafaff; width: fit-content; max-width: 100%; }
.harvest-view .hv-input { border-style: dotted; }
.harvest-view .hv-site { border-color: #0b6e4f; background: #eefaf4; }
.harvest-view .hv-name { font-weight: 600; color: #0b6e4f; }
.harvest-view .hv-op .hv-title { color: #334; }
.harvest-view .hv-aval { color: #777; }
.harvest-view .hv-meta, .harvest-view .hv-stats { color: #a15c00; }
.harvest-view .hv-hist { vertical-align: middle; fill: #0b6e4f; }
.harvest-view .hv-group { border: 1px dashed #7a3e9d; border-radius: 4px; padding: 2px 6px;
  margin: 2px 0 2px 14px; }
.harvest-view .hv-group > summary { cursor: pointer; color: #7a3e9d; font-weight: 600; }
.harvest-view .hv-groupwrap { display: flex; flex-direction: column; gap: 2px; }
"""

# Draws each edge from the node producing a value to each node using it (both, or
# the closed box hiding either, by their nearest visible element), as a curve
# bulging left of the column, and redraws when a box opens or closes.
_SCRIPT = """
(function () {
  var root = document.getElementById("__ID__");
  var svg = root.querySelector("svg.hv-edges");
  var NS = "http://www.w3.org/2000/svg";
  function shown(el) {
    var box = el.parentElement && el.parentElement.closest("details:not([open])");
    while (box) {
      el = box.querySelector("summary");
      box = box.parentElement && box.parentElement.closest("details:not([open])");
    }
    return el;
  }
  function draw() {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var base = root.getBoundingClientRect();
    svg.setAttribute("width", root.scrollWidth);
    svg.setAttribute("height", root.scrollHeight);
    var seen = {};
    root.querySelectorAll("[data-from]").forEach(function (to) {
      to.getAttribute("data-from").split(" ").forEach(function (id) {
        if (!id) return;
        var from = root.querySelector('[data-node="' + id + '"]');
        if (!from) return;
        var a = shown(from), b = shown(to);
        if (a === b) return;
        var key = a.dataset.node + ">" + b.dataset.node + (a.tagName + b.tagName);
        if (seen[key]) return;
        seen[key] = true;
        var ra = a.getBoundingClientRect(), rb = b.getBoundingClientRect();
        var x1 = ra.left - base.left, y1 = ra.top + ra.height / 2 - base.top;
        var x2 = rb.left - base.left, y2 = rb.top + rb.height / 2 - base.top;
        var bend = Math.min(26, 6 + Math.abs(y2 - y1) / 8);
        var path = document.createElementNS(NS, "path");
        path.setAttribute("d", "M" + x1 + "," + y1 + " C" + (x1 - bend) + "," + y1 + " " +
          (x2 - bend) + "," + y2 + " " + x2 + "," + y2);
        path.setAttribute("fill", "none");
        path.setAttribute("stroke", "#99a");
        path.setAttribute("class", "hv-edge");
        svg.appendChild(path);
      });
    });
  }
  root.querySelectorAll("details").forEach(function (d) {
    d.addEventListener("toggle", draw);
  });
  window.addEventListener("resize", draw);
  draw();
})();
"""
