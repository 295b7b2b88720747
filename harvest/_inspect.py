"""`sites`: every sow a function holds, found by tracing it, never by running it."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import jax
import numpy as np

from . import _jax
from ._calling import make_jaxpr
from ._primitive import sow_p
from ._site import Site, path_str

UNBOUNDED = None  # `SiteInfo.fires` inside a while loop


@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """One sow site as `sites` describes it.

    `shape` and `dtype` mirror the sown value: a tuple and a dtype for an array,
    the same pytree of them for a pytree. `fires` is how many times one call
    sows here (loop lengths multiplied in; per branch inside `cond`, counted as
    if that branch is taken), or `None` inside a `while_loop`, whose trip count
    is not known before running. `where` is the path of enclosing primitives,
    outermost first, e.g. `"jit › scan[12] › cond[1]"`; `""` at top level.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import sites, sow
        >>> info = sites(lambda x: sow(x, name="h"), jnp.zeros(3))[0]
        >>> info.name, info.shape, info.fires
        ('h', (3,), 1)
    """

    tag: str
    name: str
    mode: str
    shape: Any
    dtype: Any
    fires: int | None
    where: str


class Sites(list):
    """A list of `SiteInfo` that prints as a table.

    Example:
        >>> import jax.numpy as jnp
        >>> from harvest import sites, sow
        >>> print(sites(lambda x: sow(x, name="h", mode="strict"), jnp.zeros(2)))
        tag            name  mode    shape  dtype    fires  where
        intermediates  h     strict  (2,)   float32  1
    """

    COLUMNS = ("tag", "name", "mode", "shape", "dtype", "fires", "where")

    def names(self):
        """The distinct names, in program order."""
        return list(dict.fromkeys(s.name for s in self))

    def _cells(self, info):
        fires = "unbounded" if info.fires is UNBOUNDED else str(info.fires)
        dtype = jax.tree_util.tree_map(lambda d: d.name, info.dtype)
        return (info.tag, info.name, info.mode, str(info.shape), str(dtype), fires, info.where)

    def __str__(self):
        if not self:
            return "(no sow sites)"
        rows = [self.COLUMNS] + [self._cells(s) for s in self]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def sites(f, *args, tag=None, **kwargs) -> Sites:
    """Lists every sow site of `f(*args, **kwargs)`, without running `f`.

    `f` is traced with `jax.make_jaxpr`: array arguments (or
    `jax.ShapeDtypeStruct`s standing for them) are traced, and every other
    argument reaches `f` as itself, as in `reap`. Each sow equation gives one `SiteInfo`, in program
    order, recursing into `jit`, `scan`, `cond`, `while_loop`, `checkpoint`
    and custom derivatives. `tag=None` lists every tag.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sites, sow
        >>> def f(xs):
        ...     def body(c, x):
        ...         return c + sow(x * c, name="step", mode="append"), None
        ...     return jax.lax.scan(body, 1.0, xs)[0]
        >>> print(sites(jax.jit(f), jax.ShapeDtypeStruct((12,), jnp.float32)))
        tag            name  mode    shape  dtype    fires  where
        intermediates  step  append  ()     float32  12     jit › scan[12]
    """
    if not callable(f):
        raise TypeError(f"sites(f, *args) needs a callable f, got {type(f).__name__}.")
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"sites: tag must be a string or None (every tag), got {tag!r}.")
    found = Sites()
    for eqn, where, fires in sow_equations(make_jaxpr(f, args, kwargs)[0].jaxpr):
        site = Site.of(eqn)
        if tag is None or site.tag == tag:
            found.append(_info(site, where, fires))
    return found


def _info(site: Site, where, fires):
    shape = jax.tree_util.tree_unflatten(site.tree, [a.shape for a in site.avals])
    dtype = jax.tree_util.tree_unflatten(site.tree, [np.dtype(a.dtype) for a in site.avals])
    mode = "sow_cond" if site.mode == "cond_clobber" else site.mode
    return SiteInfo(site.tag, path_str(site.name), mode, shape, dtype, fires, " › ".join(where))


def sow_equations(jaxpr, where=(), fires=1) -> Iterator[tuple[Any, tuple, int | None]]:
    """Yields (sow equation, enclosing labels, firings per call), in program order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            yield eqn, where, fires
            continue
        for label, sub, times in _bodies(eqn):
            inner = None if fires is UNBOUNDED or times is UNBOUNDED else fires * times
            yield from sow_equations(sub, where + (label,), inner)


_LABELS = {
    _jax.jit_p: "jit",
    _jax.remat_p: "checkpoint",
    _jax.custom_jvp_call_p: "custom_jvp",
    _jax.custom_vjp_call_p: "custom_vjp",
}


def _bodies(eqn):
    """(label, body jaxpr, runs of the body per run of `eqn`) for each body."""
    prim = eqn.primitive
    if prim is _jax.cond_p:
        return [(f"cond[{i}]", b.jaxpr, 1) for i, b in enumerate(_jax.cond_branches(eqn))]
    if prim is _jax.scan_p:
        scan = _jax.Scan.of(eqn)
        return [(f"scan[{scan.length}]", scan.body.jaxpr, scan.length)]
    if prim is _jax.while_p:
        return [("while", sub, UNBOUNDED) for sub in _jax.sub_jaxprs(eqn)]
    return [(_LABELS.get(prim, prim.name), sub, 1) for sub in _jax.sub_jaxprs(eqn)]
