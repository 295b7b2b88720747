"""`view`: the traced program as a dataflow graph, in one self-contained HTML page.

Python walks the jaxpr into a graph (a node per op, the sites sown on its output
merged in; a node per input; a group per module path and per body) and writes it
into the page as JSON, which lays it out with dagre (vendored in ``_view_static``,
inlined), so it works offline, from a file or in a notebook.
"""

from __future__ import annotations

import importlib.resources
import inspect
import itertools
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors
from .._calling._nnx_state import split_nodes
from .._calling._renamed import arguments_moved
from .._calling._tracing import make_jaxpr
from .._jax import CLOSED_CALLS
from .._models import _call as _call
from .._walk._higher_order import bodies as _descriptor_bodies, operands_of
from .._walk._paths import path_str
from .._walk._primitive import sow_p
from .._walk._site import Site
from ._path_patching import dotted

_COUNTER = itertools.count()


class View:
    """A rendered dataflow graph: shows itself in a notebook, or is saved as a page.

    Attributes:
        html: the self-contained HTML fragment (``save`` wraps it in a page).
        sites: the number of sow sites drawn.
        groups: the number of bodies (``scan``, ``cond`` branches, ``jit``, ...) drawn.
        modules: the number of module groups drawn (one per module path).
    """

    def __init__(self, html: str, sites: int, groups: int, modules: int = 0) -> None:
        self.html = html
        self.sites = sites
        self.groups = groups
        self.modules = modules

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        # Outside a notebook (a script, a REPL) the graph cannot draw itself: say how to see it.
        return (
            f"View(sites={self.sites}, groups={self.groups}, modules={self.modules}): "
            "shown in a notebook; .save(path) writes an HTML page"
        )

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


@arguments_moved
def view(
    f: Callable[..., Any],
    *,
    values: dict[str, Any] | None = None,
    tag: Any = None,
) -> Callable[..., View]:
    """Returns a function drawing the dataflow graph of ``f`` on its arguments, traced as ``reap`` does.

    ``view(f)(*args, **kwargs)`` draws ``f(*args, **kwargs)``, as every
    transformation is called (the old form ``view(f, x)`` works until harvest
    0.3, with a ``DeprecationWarning``). Nothing runs: ``f`` is only traced.

    Nodes are the program's ops, each with its output shapes and dtypes and
    the sow sites on its output (name, tag, mode), and its inputs, named by
    their path in the arguments (``attn.query.kernel``); edges are data
    dependencies, laid out top to bottom. The ops of an ``instrument``-ed
    model are grouped by module (with or without ``ops=True``), and the bodies
    of ``scan``, ``while_loop``, ``cond``, ``jit``, ``checkpoint`` and custom
    derivatives are groups too, each opening and closing on a click (a named
    call such as ``relu`` starts closed). A model opens on its top-level
    modules; a program without modules, on as many levels as stay small. The
    graph opens fitted to the pane's width (never below half size), hovering a
    node lights its inputs and outputs, and the search box finds nodes by name.
    Given ``values`` (what ``reap`` returned), each site it names shows the
    value's mean, standard deviation and a histogram: the sites of ``tag``, or
    with no ``tag``, of the one tag that has each name (with
    ``instrument(f, ops=True)``, every op is a site).

    Args:
        f: the function to trace, as for ``reap``.
        values: a reaped dict (nested by ``nest`` scopes, or with dotted names)
            whose values are summarised on their sites; None for none.
        tag: the tag ``values`` were reaped with; None (the default) when
            each of their names is sown with one tag only.

    Returns:
        A function taking ``f``'s arguments (arrays, ``jax.ShapeDtypeStruct``
        values, or Python values, static as in ``reap``) and returning a
        ``View``, shown in a notebook or saved as a page (``View.save``).

    Raises:
        TypeError: if ``f`` is not callable, or ``values`` is not a dict.
        ValueError: when the returned function is called: if a name in
            ``values`` is no site of ``tag`` (a typo), or, with no ``tag``, is
            sown with several tags.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import reap, sow, view
        >>> def f(xs):
        ...     def body(c, x):
        ...         return c + sow(x * c, name="step", mode="append"), None
        ...     return sow(jax.lax.scan(body, 1.0, xs)[0], name="total", mode="strict")
        >>> v = view(f, values=reap(f)(jnp.arange(3.0)))(jnp.arange(3.0))
        >>> v.sites, v.groups, "scan[3]" in v.html, "mean" in v.html
        (2, 1, True, True)
        >>> v  # outside a notebook
        View(sites=2, groups=1, modules=0): shown in a notebook; .save(path) writes an HTML page
    """
    if not callable(f):
        raise TypeError(f"view(f) needs a callable f, got {type(f).__name__}.")
    if values is not None and not isinstance(values, dict):
        raise TypeError(f"view: values must be a dict, as reap returns it, got {values!r}.")

    def drawn(*args: Any, **kwargs: Any) -> View:
        params = _positional_names(getattr(f, "_target", f))  # an instrumented model: its own
        (fn, args, kwargs), graph_nodes, _ = split_nodes((f, args, kwargs))
        token = _call.scoped.set(True)  # module boxes with or without ops=True
        try:
            closed, arrays = make_jaxpr(fn, args, kwargs, graph=graph_nodes)
        finally:
            _call.scoped.reset(token)
        names = _input_names(params, (fn, args, kwargs), graph_nodes, arrays)
        graph = _Graph(dotted(values or {}), tag, *_module_paths(closed.jaxpr))
        graph.top(closed.jaxpr, names)
        graph.check_values()
        uid = f"hv{next(_COUNTER)}"
        drawing = {"nodes": graph.nodes, "groups": graph.groups_, "edges": list(graph.edges)}
        data = json.dumps(drawing, ensure_ascii=False, separators=(",", ":"))
        data = data.replace("</", "<\\/")  # no `</script>` inside the script
        style, script = _static("view.css"), _static("view.js").replace("__ID__", uid)
        fragment = (
            f'<div class="harvest-view" id="{uid}"><style>{style}</style>'
            '<div class="hv-bar"><input class="hv-search" type="search" '
            'placeholder="find a node by name" aria-label="find a node by name">'
            '<span class="hv-found"></span><button class="hv-zoom" data-by="0.8">−</button>'
            '<button class="hv-zoom" data-by="1.25">+</button><button class="hv-zoom" data-by="fit">'
            'fit</button><span class="hv-info"></span></div>'
            '<div class="hv-scroll"><svg class="hv-canvas"></svg></div>'
            f'<script type="application/json" class="hv-data">{data}</script>'
            f"<script>(function () {{\n{_static('dagre.min.js')}\n{script}}})();</script>"
            "</div>"
        )
        return View(fragment, graph.sites, graph.bodies, graph.modules)

    return drawn


def _static(name: str) -> str:
    """A file the page inlines, from ``_view_static``: the layout library (dagre, MIT;
    see its ``README.md``), the page's style and its script."""
    return (importlib.resources.files(__package__) / "_view_static" / name).read_text(
        encoding="utf-8"
    )


def _input_names(params: list[str], call: Any, graph_nodes: Any, arrays: list[Any]) -> list[str]:
    """Each traced input's name: its path in the arguments (``x``, ``batch.tokens``),
    in ``f``'s own leaves (an Equinox model: ``layers.0.weight``) or in the NNX
    state (``attn.query.kernel``), matched to the traced leaves by identity, in order."""
    named: list[tuple[str, Any]] = []
    for part, tree in enumerate(call):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            keys = _keys(path)
            if part == 1 and keys and keys[0].isdigit():
                i = int(keys[0])
                keys[0] = params[i] if i < len(params) else f"arg{i}"
            named.append((".".join(keys) or "f", leaf))
    if graph_nodes is not None:
        state = jax.tree_util.tree_flatten_with_path(graph_nodes.state)[0]
        several = len({p[0] for p, _ in state}) > 1
        for path, leaf in state:
            keys = _keys(path[0 if several else 1 :])
            if keys and keys[-1] in ("value", "raw_value"):
                keys.pop()
            named.append((".".join(keys) or "state", leaf))
    out: list[str] = []
    at = 0
    for array in arrays:
        while at < len(named) and named[at][1] is not array:
            at += 1
        out.append(named[at][0] if at < len(named) else f"input {len(out)}")
        at += 1
    return out


def _positional_names(f: Any) -> list[str]:
    """The names of ``f``'s positional parameters, as far as they are known."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in itertools.takewhile(lambda p: p.kind in kinds, params)]


def _keys(path: Any) -> list[str]:
    """A key path as names, without the flat indices a wrapper's flattening adds."""
    out = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            out.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            out.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            out.append(str(key.idx))
    return out


def _module_paths(jaxpr: Any) -> tuple[set[str], set[str]]:
    """The paths ``instrument`` named, and which are modules: an op site's name begins with
    a module's path, also a named scope of its ops (``attn.query/dot_general:0``), or an
    inlined named call's (``log_softmax/exp:0``); without ``ops``, a module's output site is
    named by its path (``attn.query``), the scope its ops ran in."""
    names: set[str] = set()
    scopes: set[str] = set()

    def walk(j: Any) -> None:
        for eqn in j.eqns:
            scopes.update(str(eqn.source_info.name_stack).split("/"))
            if eqn.primitive is sow_p:
                names.add(path_str(Site.of(eqn).path))
            for body in _descriptor_bodies(eqn):
                walk(body.jaxpr)

    walk(jaxpr)
    paths = {n.split("/")[0] for n in names if "/" in n} | (names & scopes)
    return paths, paths & scopes


def _parent_module(path: str, modules: set[str]) -> str | None:
    while "." in path:
        path = path.rpartition(".")[0]
        if path in modules:
            return path
    return None


class _Graph:
    """The graph as lists of nodes, groups and edges; each var is mapped to the
    id of the node producing it."""

    def __init__(
        self, values: dict[str, Any], tag: Any, paths: set[str], modules: set[str]
    ) -> None:
        self.values, self.tag = values, tag
        self.modules_named, self.module_paths = paths, modules
        self.tags_of: dict[str, set[Any]] = {}  # each site name drawn: the tags it is sown with
        self.nodes: list[dict[str, Any]] = []
        self.groups_: list[dict[str, Any]] = []
        self.edges: dict[tuple[str, str], None] = {}
        self.module_group: dict[tuple[str | None, str], str] = {}
        self.sites = self.bodies = self.modules = 0

    def top(self, jaxpr: Any, names: list[str]) -> None:
        producers: dict[Any, str] = {}
        for v, name in zip(jaxpr.invars, names):
            group = self._module(None, _parent_module(name, self.modules_named) or "")
            producers[v] = self._node("input", name, [v], group, title=name)
        self.jaxpr(jaxpr, producers, None)

    def _node(self, kind: str, label: str, outs: list[Any], group: str | None, **more: Any) -> str:
        node = f"n{len(self.nodes)}"
        self.nodes.append(
            {"id": node, "kind": kind, "label": label, "aval": _avals(outs), "group": group,
             "sites": [], **more}
        )  # fmt: skip
        return node

    def _group(self, kind: str, label: str, parent: str | None, **more: Any) -> str:
        group = f"g{len(self.groups_)}"
        self.groups_.append({"id": group, "kind": kind, "label": label, "parent": parent, **more})
        return group

    def _module(self, body: str | None, path: str) -> str | None:
        """The group of module ``path`` inside ``body`` (made with its parents), or
        ``body`` for no path."""
        if not path:
            return body
        key = (body, path)
        if key not in self.module_group:
            above = _parent_module(path, self.modules_named)
            parent = self._module(body, above or "")
            short = path[len(above) + 1 :] if above else path
            if path in self.module_paths:
                self.modules += 1
                made = self._group("module", short, parent, path=path)
            else:  # a named call instrument inlined: one node, as a call
                made = self._group("call", short, parent, path=path, closed=True, op="jit")
            self.module_group[key] = made
        return self.module_group[key]

    def _module_of(self, eqn: Any) -> str:
        """The module an equation runs in: ``instrument``'s innermost named scope,
        else its site's module."""
        scopes = str(eqn.source_info.name_stack).split("/")
        inner = [s for s in scopes if s in self.modules_named]  # not einsum's `vmap(...)`
        if inner:
            return inner[-1]
        if eqn.primitive is sow_p:
            name = path_str(Site.of(eqn).path)
            if "/" in name:
                return name.split("/")[0]
            return name if name in self.modules_named else ""
        return ""

    def jaxpr(self, jaxpr: Any, producers: dict[Any, str], body: str | None) -> None:
        local: set[str] = set()
        for eqn in jaxpr.eqns:
            group = self._module(body, self._module_of(eqn))
            sources = [producers[v] for v in eqn.invars if _is_var(v) and v in producers]
            if eqn.primitive is sow_p:
                node = self._site(eqn, producers, group, local)
            elif _descriptor_bodies(eqn):
                node = self._call(eqn, producers, group)
            else:
                node = self._node("op", eqn.primitive.name, eqn.outvars, group)
            for source in sources:
                if source != node:
                    self.edges[(source, node)] = None
            for v in eqn.outvars:
                producers[v] = node
            local.add(node)

    def _site(self, eqn: Any, producers: dict[Any, str], group: str | None, local: set[str]) -> str:
        """The node of the op or call whose output this site sows (one node for both),
        if this jaxpr computed it (``local``); else a node of its own."""
        self.sites += 1
        site = Site.of(eqn)
        name = path_str(site.path)
        self.tags_of.setdefault(name, set()).add(site.tag)
        one = eqn.params["tree"].num_leaves == 1
        value = eqn.invars[0] if one and _is_var(eqn.invars[0]) else None
        source = producers.get(value) if value is not None else None
        node = self.nodes[int(source[1:])] if source else None
        if node is None or node["id"] not in local:  # an input, or read inside a body
            node = self.nodes[int(self._node("site", name, eqn.outvars, group)[1:])]
        elif node["kind"] == "op" and (
            node["group"] is None or "path" not in self.groups_[int(node["group"][1:])]
        ):
            node["group"] = group  # ops=False: the op ran in the module whose output it is
        entry: dict[str, Any] = {
            "name": name,
            "tag": str(site.tag),
            "mode": str(eqn.params["mode"]),
        }
        if name in self.values and self.tag in (None, site.tag):
            entry["stats"] = _summary(self.values[name])
        node["sites"].append(entry)
        if node["kind"] == "op":
            node["op"] = node["label"]
        if node["kind"] == "result":  # a call's output: the call keeps its name
            node["op"], name = node["label"], node["label"]
        node["kind"] = "site"
        if "/" not in name:  # a module's output (or a plain sow) names the node
            node["label"] = name
        return str(node["id"])

    def check_values(self) -> None:
        """Raises unless each name in ``values`` was summarised on the sites of one tag."""
        names = [n for n, tags in self.tags_of.items() if self.tag is None or self.tag in tags]
        missing = [n for n in self.values if n not in names]
        if missing:
            of = "" if self.tag is None else f" of tag {self.tag!r}"
            raise ValueError(
                f"view: values names {', '.join(map(repr, missing))}, but the program has no such sow "
                f"site{of}. Sites{of}: {_errors.listed(names, missing[0])}. Pass what reap returned for this "
                "function and these arguments"
                + ("." if self.tag is None else ", reaped with this tag.")
            )
        for name in self.values:
            if self.tag is None and len(self.tags_of[name]) > 1:
                raise ValueError(
                    f"view: the name {name!r} in values is sown with the tags "
                    f"{', '.join(map(repr, sorted(map(str, self.tags_of[name]))))}, "
                    "so which sites its value belongs to is unclear. Pass the tag values were reaped with "
                    "as view(..., tag=...)."
                )

    def _call(self, eqn: Any, producers: dict[Any, str], group: str | None) -> str:
        """A group for the call (its bodies inside, one group each if several), and
        a node for its result, inside it, fed by what the bodies return."""
        bodies = _descriptor_bodies(eqn)
        kind = eqn.primitive.name
        label = _call_name(eqn) or (bodies[0].label if len(bodies) == 1 else kind)
        closed = kind in CLOSED_CALLS  # named calls start closed; loops and branches open
        if group is not None and self.groups_[int(group[1:])]["label"] == label:
            label, closed = bodies[0].label, False  # the one call a named wrapper holds
        wrap = self._group("call", label, group, closed=closed, op=kind)
        result = self._node("result", label, eqn.outvars, wrap)
        labels = [b.label for b in bodies]
        for b in bodies:
            self.bodies += 1
            role = _param_name(eqn, b.jaxpr)
            name = b.label
            if labels.count(name) > 1 and role:  # while's cond_jaxpr and body_jaxpr
                name = f"{name} {role.removesuffix('_jaxpr')}"
            inner = wrap if len(bodies) == 1 else self._group("body", name, wrap)
            mapped = {
                a: producers[o]
                for a, o in zip(reversed(b.jaxpr.invars), reversed(operands_of(eqn, b.jaxpr)))
                if _is_var(o) and o in producers
            }
            self.jaxpr(b.jaxpr, mapped, inner)
            for v in b.jaxpr.outvars:
                if _is_var(v) and v in mapped:
                    self.edges[(mapped[v], result)] = None
        return result


def _call_name(eqn: Any) -> str | None:
    """A named call's name: ``jit``'s ``name`` (``log_softmax``), or, for a custom
    derivative wrapping one named call (``jax.nn.relu``), that call's."""
    name = eqn.params.get("name")
    if isinstance(name, str):
        return name
    for body in _descriptor_bodies(eqn):
        calls = [e for e in body.jaxpr.eqns if isinstance(e.params.get("name"), str)]
        if len(calls) == 1 and len(body.jaxpr.eqns) == 1:
            return str(calls[0].params["name"])
    return None


def _param_name(eqn: Any, sub: Any) -> str | None:
    """The name of the parameter of ``eqn`` that holds the body ``sub``."""
    for key, value in eqn.params.items():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if item is sub or getattr(item, "jaxpr", None) is sub:
                return str(key)
    return None


def _is_var(v: Any) -> bool:
    return hasattr(v, "aval") and not hasattr(v, "val")  # a Literal has `val`


def _avals(outs: list[Any]) -> str:
    shown = [v.aval.str_short() if hasattr(v.aval, "str_short") else str(v.aval) for v in outs]
    return ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "")


def _summary(value: Any) -> dict[str, Any] | None:
    """The value's mean, standard deviation and 12-bin histogram over its finite numbers
    (a complex one by its magnitude, said so), how many are nan or infinite, and each PRNG
    key's dtype and shape (``key<fry>[3]``), as it has no numbers to summarise."""
    keys, numbers, magnitudes = [], [], []
    for leaf in jax.tree_util.tree_leaves(value):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
            keys.append(f"{dtype}{list(np.shape(leaf))}")
            continue
        array = np.asarray(leaf)
        if np.iscomplexobj(array):
            magnitudes.append("complex values by |z|")
            array = np.abs(array)
        numbers.append(array.astype(float).ravel())
    data = np.concatenate(numbers) if numbers else np.zeros(0)
    finite = data[np.isfinite(data)]
    bad = {"nan": np.isnan(data), "inf": data == np.inf, "-inf": data == -np.inf}
    counts = [f"{int(hit.sum())} {what}" for what, hit in bad.items() if hit.any()]
    stats = [f"mean {finite.mean():.4g} · std {finite.std():.4g}"] if finite.size else []
    text = " · ".join(stats + counts + magnitudes[:1] + keys)
    if not text:
        return None
    hist = np.histogram(finite, bins=12)[0].tolist() if finite.size else None
    return {"text": text, "hist": hist}
