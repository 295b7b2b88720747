"""A sow site's static description: its tag, path, mode, shapes and the line that sowed it."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef

from .. import _jax
from . import _errors
from ._leaves import is_array, is_named_array
from ._modes import MODES, Mode
from ._paths import path_str
from ._primitive import sow_p


@dataclasses.dataclass(frozen=True)
class Site:
    """One `sow` equation: where it files its value, and what it looks like."""

    tag: str
    path: tuple[str, ...]  # the name under its `nest` scopes: ("scope", ..., "name")
    mode: Mode
    tree: PyTreeDef
    avals: tuple[Any, ...]
    vmapped: tuple[int, ...] = ()  # per leaf, how many leading axes are vmap batch axes
    # The sow equation's source_info, and per leaf, its axis names.
    source: Any = dataclasses.field(default=None, compare=False, repr=False)
    axes: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, eqn: Any) -> Site:
        assert eqn.primitive is sow_p
        avals = tuple(v.aval for v in eqn.invars[: len(eqn.outvars)])
        return cls._from(eqn.params, avals, eqn.source_info)

    @classmethod
    def bound(cls, args: tuple[Any, ...], params: dict[str, Any]) -> Site:
        """The site of a `sow_p.bind(*args, **params)` met outside a jaxpr."""
        avals = tuple(jax.typeof(a) for a in args[: params["tree"].num_leaves])
        return cls._from(params, avals, None)

    @classmethod
    def _from(cls, p: dict[str, Any], avals: tuple[Any, ...], source: Any) -> Site:
        return cls(
            p["tag"],
            p["scope"] + (p["name"],),
            MODES[p["mode"]],
            p["tree"],
            avals,
            p.get("vmapped") or (0,) * len(avals),
            source,
            p.get("axes"),
        )

    def _named_data(self, value: Any) -> Any:
        """A Penzai named array planted at a site sown from one (instrument's): its data
        with the axes in the site's order, matched by name; None for anything else."""
        if self.axes is None or len(self.axes) != 1 or not is_named_array(value):
            return None
        names = self.axes[0]
        if None in names or value.positional_shape or set(value.named_shape) != set(names):
            return None
        return value.order_as(*names).data_array

    def where(self) -> str:
        """The file:line of the user's `sow` call that made this site."""
        return _jax.user_location(self.source) or "an unknown line"

    def __str__(self) -> str:
        return f"tag={self.tag!r}, name={path_str(self.path)!r} (sown at {self.where()})"

    def one_occurrence(self, value: Any) -> bool:
        """Whether `value` (an auto record entry) is one occurrence, not rows of them.

        An append record holds only rows; an auto one also holds occurrences
        sown outside any loop, kept as they are.
        """
        if not self.mode.unstacked_once:
            return False
        leaves = jax.tree_util.tree_leaves(value)
        shape = tuple(np.shape(leaves[0])) if leaves else ()
        return not shape or shape[1:] != self.avals[0].shape  # rows have one axis more, in front

    def zeros_shape(self, leading: tuple[int, ...] = ()) -> Any:
        return jax.tree_util.tree_unflatten(
            self.tree, [jax.ShapeDtypeStruct(tuple(leading) + a.shape, a.dtype) for a in self.avals]
        )

    def zeros(self) -> Any:
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.zeros_shape())

    def check_held(self, value: Any, what: str, dtype: Any) -> None:
        """Refuses a host value (a Python number, NumPy data) that casting to the
        leaf's ``dtype`` would change past recognition (see `_unheld`)."""
        why = _unheld(value, dtype)
        if not why:
            return
        if isinstance(value, (int, float, complex)):
            shown = repr(value)
        else:
            shown = f"a {np.asarray(value).dtype}{list(np.shape(value))} array"
        raise ValueError(
            f"{what} for the sow site {self} is {shown}, which its dtype {dtype} cannot hold "
            f"({why}); nothing was planted. Plant a value {dtype} holds, or sow a wider dtype "
            "at the site (64-bit ones need jax.config.update('jax_enable_x64', True))."
        )

    def cast_leaves(self, value: Any) -> list[tuple[Any, str, Any]]:
        """``(leaf, what, dtype)`` for each leaf of a planted ``value`` laid out as
        the site's (one value, or collect's tuple of one per occurrence): the
        dtype the leaf is cast to when planted. Other layouts (rows, a callable)
        give none."""
        if callable(value):
            return []
        if jax.tree_util.tree_structure(value) == self.tree:
            entries = [("the planted value", value)]
        elif self.mode.entries and isinstance(value, tuple):
            entries = [(f"occurrence {i} of the planted value", v) for i, v in enumerate(value)]
        else:
            return []
        return [
            (leaf, what, aval.dtype)
            for what, entry in entries
            if jax.tree_util.tree_structure(entry) == self.tree
            for leaf, aval in zip(jax.tree_util.tree_leaves(entry), self.avals)
        ]

    def check(self, value: Any, what: str, leading: tuple[int, ...] = ()) -> list[Any]:
        """Flattens `value`, or says exactly how it differs from this site."""
        leaves, tree = jax.tree_util.tree_flatten(value)
        if tree != self.tree:
            data = None if leading else self._named_data(value)
            if data is None:
                raise ValueError(
                    f"{what} for the sow site {self} has structure {tree}, but the site sows {self.tree}."
                )
            return self.check(data, what)
        out = []
        for leaf, aval, batch in zip(leaves, self.avals, self.vmapped or (0,) * len(leaves)):
            shape = (*leading, *aval.shape)
            if is_array(leaf) and leaf.shape == shape and leaf.dtype == aval.dtype:
                out.append(leaf)  # an array of the site's shape and dtype: nothing to check or cast
                continue
            array = isinstance(leaf, (jax.Array, np.ndarray, np.generic))
            if not (array or isinstance(leaf, numbers.Number)):
                raise TypeError(
                    f"{what} for the sow site {self} is a {type(leaf).__name__} ({leaf!r:.40}), not an "
                    "array or number. Plant an array of the sown shape and dtype, a Python number, or a "
                    "callable old -> new returning one."
                )
            if not isinstance(leaf, jax.Array) and getattr(leaf, "dtype", None) != aval.dtype:
                # A host value JAX would cast: refused where the cast would change it.
                self.check_held(leaf, what, aval.dtype)
            if isinstance(leaf, bool) or (isinstance(leaf, int) and not -(2**31) <= leaf < 2**31):
                # A Python bool, or an int beyond int32 (no weak type holds them): the site's dtype.
                leaf = jnp.asarray(leaf, aval.dtype)
            if (
                isinstance(leaf, jax.Array)
                and _jax.is_weak(leaf)
                and jnp.issubdtype(jnp.result_type(leaf), jnp.complexfloating)
                and not jnp.issubdtype(aval.dtype, jnp.complexfloating)
            ):
                # A Python complex traced as data: its value is unknown here, and
                # the cast would drop any imaginary part unseen.
                raise ValueError(
                    f"{what} for the sow site {self} is a Python complex, and casting it to the site's "
                    f"dtype {aval.dtype} would drop any imaginary part unseen (a planted number is traced, so "
                    "its value is not known where it is cast); nothing was planted. Plant a real number "
                    "(v.real), or sow a complex value at the site."
                )
            if _jax.is_weak(leaf) and jnp.ndim(leaf) == 0 and jnp.result_type(leaf) != aval.dtype:
                # A Python number takes the site's dtype, as JAX casts one in
                # `x.at[i].set(15.0)` (oryx passes it through: 15.0 into an int site
                # stays a float; a fraction, which the cast would truncate, is refused above).
                leaf = _jax.cast_like(leaf, aval)
            got = jnp.shape(leaf), jnp.result_type(leaf)
            # Under vmap, a value without (some of) the batch axes is one value
            # for every example.
            ndim = len(got[0])
            per_example = (
                len(shape) - batch <= ndim < len(shape) and shape[len(shape) - ndim :] == got[0]
            )
            if (got[0] != shape and not per_example) or got[1] != aval.dtype:
                expected = f"{aval.dtype}{list(shape)}"
                if batch:
                    expected += f" (or {aval.dtype}{list(aval.shape[batch:])} for every example of its vmap)"
                raise ValueError(
                    f"{what} for the sow site {self} is {got[1]}{list(got[0])}, but the site expects "
                    f"{expected}. Plant a value of the sown shape and dtype (or a callable old -> new)."
                )
            out.append(jnp.broadcast_to(leaf, shape) if per_example else leaf)
        return out

    def fit(self, value: Any, where: str, batch: tuple[int, ...] = ()) -> Any:
        """`value` (of this name, from before `where`) broadcast to the shapes this
        site sows, with `batch` in front of the leaves vmap did not batch."""
        leaves = jax.tree_util.tree_leaves(value)
        targets = [
            (a.shape if k >= len(batch) else tuple(batch) + a.shape)
            for a, k in zip(self.avals, self.vmapped or (0,) * len(self.avals))
        ]
        have = [jnp.shape(leaf) for leaf in leaves]
        if len(have) != len(targets) or any(
            len(h) > len(t) or t[len(t) - len(h) :] != h for h, t in zip(have, targets)
        ):
            raise ValueError(
                f"The sow site {self} has mode {self.mode.label} and was sown with shape "
                f"{_errors.shapes_str(have)} before this {where}, which sows it with shape "
                f"{_errors.shapes_str(targets)} and carries one value per name. Sow one shape per "
                "name (give each shape its own name)."
            )
        leaves = [jnp.broadcast_to(leaf, t) for leaf, t in zip(leaves, targets)]
        return jax.tree_util.tree_unflatten(self.tree, leaves)


def _unheld(value: Any, dtype: Any) -> str | None:
    """Why a site of ``dtype`` cannot hold ``value`` (a Python number or NumPy
    data, cast to ``dtype`` when planted), or None when it can.

    Refused: a number out of ``dtype``'s range (``2**40`` into int32, ``-1``
    into uint8, ``1e39`` into float32), nan, infinity or a fraction into an
    integer site (the cast would truncate 1.5 to 1 unseen; 2.0 is 2) and an
    imaginary part into a real one, which the cast would change past
    recognition. Kept, as JAX casts: a float64 rounded to float32.
    """
    if isinstance(value, bool) or jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    whole = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)
    if isinstance(value, int):  # any size: NumPy holds none beyond 64 bits
        lo = hi = value
    else:
        data = np.asarray(value)
        if data.dtype.kind not in "iufc" or data.size == 0:
            return None
        if data.dtype.kind == "c":
            bad = data[data.imag != 0]
            if bad.size:
                return f"{bad.flat[0]} has an imaginary part, which the cast would drop"
            data = data.real
        if data.dtype.kind == "f":
            if whole and not np.isfinite(data).all():
                return f"{data[~np.isfinite(data)].flat[0]} is no whole number"
            if whole and (data != np.trunc(data)).any():
                return f"{data[data != np.trunc(data)].flat[0]} is no whole number"
            data = data[np.isfinite(data)]
            if data.size == 0:
                return None
        lo, hi = data.min().item(), data.max().item()
    low: float
    high: float
    if jnp.issubdtype(dtype, jnp.bool_):
        low, high = 0, 1
    elif jnp.issubdtype(dtype, jnp.integer):
        low, high = int(jnp.iinfo(dtype).min), int(jnp.iinfo(dtype).max)
    elif jnp.issubdtype(dtype, jnp.floating):
        high = float(jnp.finfo(dtype).max)
        low = -high
    else:
        return None
    out = lo if lo < low else hi if hi > high else None
    if out is None:
        return None
    return f"{out} is outside {np.dtype(dtype).name}'s range, {low} to {high}"
