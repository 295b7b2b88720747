"""A sow site's static description, and how its occurrences accumulate."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef

from . import _jax
from ._primitive import sow_p

LOOP_MODES = ("collect", "append", "auto", "stack")  # occurrences that stack along a loop's axis
ROW_MODES = ("append", "auto")  # occurrences counted as rows of one leading axis
SINGLE_MODES = ("strict", "stack")  # at most one occurrence per scope
CARRIED_MODES = ("clobber", "cond_clobber")  # one value, threaded through loops


def path_str(path):
    return ".".join(path)


def mode_label(mode):
    """A mode as the user wrote it, for error messages (three modes are internal names)."""
    labels = {"cond_clobber": "'sow_cond'", "stack": "'append' (harvest.compat.oryx's)", "auto": "'auto' (instrument's)"}
    return labels.get(mode, repr(mode))


@dataclasses.dataclass(frozen=True)
class Site:
    """One `sow` equation: where it files its value, and what it looks like."""

    tag: str
    name: tuple  # a path: ("scope", ..., "name") once `nest` has scoped it
    mode: str
    tree: PyTreeDef
    avals: tuple
    vmapped: tuple = ()  # per leaf, how many leading axes are vmap batch axes

    @classmethod
    def of(cls, eqn):
        assert eqn.primitive is sow_p
        p = eqn.params
        n = len(eqn.outvars)
        path = p["scope"] + (p["name"],)
        avals = tuple(v.aval for v in eqn.invars[:n])
        return cls(p["tag"], path, p["mode"], p["tree"], avals, p.get("vmapped") or (0,) * n)

    def __str__(self):
        return f"tag={self.tag!r}, name={path_str(self.name)!r}"

    def one_occurrence(self, value):
        """Whether `value` (an auto record entry) is one occurrence, not rows of them.

        An append record holds only rows; an auto one also holds occurrences
        sown outside any loop, kept as they are.
        """
        if self.mode != "auto":
            return False
        leaves = jax.tree_util.tree_leaves(value)
        shape = tuple(np.shape(leaves[0])) if leaves else ()
        return not leaves or len(shape) != len(self.avals[0].shape) + 1 or shape[1:] != self.avals[0].shape

    def zeros_shape(self, leading=()):
        return jax.tree_util.tree_unflatten(
            self.tree, [jax.ShapeDtypeStruct(tuple(leading) + a.shape, a.dtype) for a in self.avals]
        )

    def zeros(self, leading=()):
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.zeros_shape(leading))

    def check(self, value, what, leading=()):
        """Flattens `value`, or says exactly how it differs from this site."""
        leaves, tree = jax.tree_util.tree_flatten(value)
        if tree != self.tree:
            raise ValueError(
                f"{what} for the sow site {self} has structure {tree}, but the site "
                f"sows {self.tree}."
            )
        out = []
        for leaf, aval, batch in zip(leaves, self.avals, self.vmapped or (0,) * len(leaves)):
            if _jax.is_weak(leaf) and jnp.ndim(leaf) == 0 and jnp.result_type(leaf) != aval.dtype:
                # A Python number takes the site's dtype, as JAX casts one in
                # `x.at[i].set(15.0)` (oryx passes it through: 15.5 into an int site stays 15.5).
                leaf = _jax.cast_like(leaf, aval)
            shape = tuple(leading) + aval.shape
            got = jnp.shape(leaf), jnp.result_type(leaf)
            # Under vmap, a value without (some of) the batch axes is one value
            # for every example.
            ndim = len(got[0])
            per_example = len(shape) - batch <= ndim < len(shape) and shape[len(shape) - ndim :] == got[0]
            if (got[0] != shape and not per_example) or got[1] != aval.dtype:
                raise ValueError(
                    f"{what} for the sow site {self} is {got[1]}{list(got[0])}, but the "
                    f"site expects {aval.dtype}{list(shape)}{self._per_example(aval, batch)}. "
                    "Plant a value of the sown shape and dtype (or a callable old -> new)."
                )
            out.append(jnp.broadcast_to(leaf, shape) if per_example else leaf)
        return out

    def fit(self, value, where, batch=()):
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
                f"The sow site {self} has mode {mode_label(self.mode)} and was sown with shape "
                f"{_shapes_str(have)} before this {where}, which sows it with shape "
                f"{_shapes_str(targets)} and carries one value per name. Sow one shape per "
                "name (give each shape its own name)."
            )
        leaves = [jnp.broadcast_to(leaf, t) for leaf, t in zip(leaves, targets)]
        return jax.tree_util.tree_unflatten(self.tree, leaves)

    @staticmethod
    def _per_example(aval, batch):
        return f" (or {aval.dtype}{list(aval.shape[batch:])} for every example of its vmap)" if batch else ""


def _shapes_str(shapes):
    return " and ".join(str(list(s)) for s in shapes)


@dataclasses.dataclass
class Record:
    """The occurrences of one name reaped so far in one scope.

    `values` holds, by mode: collect, one pytree per occurrence; append, chunks
    of occurrences stacked on a leading axis; auto, such chunks and single
    occurrences sown outside any loop, in order; the other modes, one pytree.
    """

    site: Site
    values: list[Any]

    def result(self):
        mode = self.site.mode
        if mode == "collect":
            return tuple(self.values)
        if len(self.values) == 1 and self.site.one_occurrence(self.values[0]):
            return self.values[0]  # sown once, outside any loop: the value itself
        if mode in ROW_MODES:
            return self.rows()
        return self.values[0]

    def rows(self):
        """An append or auto record's occurrences, stacked on one leading axis."""
        chunks = [
            jax.tree_util.tree_map(lambda l: jnp.expand_dims(l, 0), v) if self.site.one_occurrence(v) else v
            for v in self.values
        ]
        shapes = {tuple(jnp.shape(l)[1:] for l in jax.tree_util.tree_leaves(c)) for c in chunks}
        if len(shapes) > 1:
            raise different_shapes(self.site, shapes)
        return jax.tree_util.tree_map(lambda *c: jnp.concatenate(c), *chunks)


def different_shapes(site, shapes):
    """The error for occurrences of one stacking name with different shapes."""
    return ValueError(
        f"The sow site {site} has mode {mode_label(site.mode)}, but its occurrences "
        f"have different shapes ({', '.join(sorted(map(_shapes_str, shapes)))}), so they "
        "cannot be stacked into one array. Sow one shape per name (give each shape "
        "its own name), or use mode 'collect', which keeps each occurrence as it is."
    )
