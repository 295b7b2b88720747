"""Sow modes: each declared once, with the properties the walk and its rules ask about.

A mode lives at the site (the sow equation's `mode` param, a string) and decides
how the occurrences of one name accumulate. Rules never compare mode names:
they ask a `Mode` (a `Site`'s `mode`) what it does.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, eq=False)
class Mode:
    """How one mode's occurrences accumulate (one instance per mode; compared by identity)."""

    name: str  # the sow equation's `mode` param
    label: str  # as the user wrote it, for messages
    shown: str  # as `harvest.sites` lists it
    public: bool = False  # accepted by `harvest.sow(mode=...)`
    entries: bool = False  # reaped as a tuple, one entry per occurrence
    rows: bool = False  # reaped as rows of one leading axis, one per occurrence
    unstacked_once: bool = False  # sown once outside any loop, reaped as the value itself
    single: bool = False  # at most one occurrence per walk of a body
    carried: bool = False  # one value, threaded through loops and branches (the last wins)
    stacks_in_loops: bool = False  # a loop stacks its iterations' occurrences along a new axis
    stacks_per_loop: bool = False  # one stacked chunk per enclosing loop (oryx's append)
    has_pred: bool = False  # the sow carries a trailing predicate operand
    replaces_value: bool = False  # its result always flows on, so it needs no effect to survive DCE

    def __repr__(self) -> str:
        return f"Mode({self.name!r})"


COLLECT = Mode("collect", "'collect'", "collect", public=True, entries=True, stacks_in_loops=True)
STRICT = Mode("strict", "'strict'", "strict", public=True, single=True)
APPEND = Mode("append", "'append'", "append", public=True, rows=True, stacks_in_loops=True)
CLOBBER = Mode("clobber", "'clobber'", "clobber", public=True, carried=True)
# `sow_cond`: a clobber that keeps the value only where its predicate holds.
COND_CLOBBER = Mode("cond_clobber", "'sow_cond'", "sow_cond", carried=True, has_pred=True)
# oryx's "append": one occurrence per body, stacked once per enclosing loop level.
ORYX_APPEND = Mode(
    "oryx_append",
    "'append' (harvest.compat.oryx's)",
    "oryx_append",
    single=True,
    stacks_in_loops=True,
    stacks_per_loop=True,
)
# `instrument`'s sites: the value itself when sown once outside any loop, else
# every occurrence stacked on a leading axis, as "append" does.
AUTO = Mode(
    "auto",
    "'auto' (instrument's)",
    "auto",
    rows=True,
    unstacked_once=True,
    stacks_in_loops=True,
    replaces_value=True,
)

MODES: dict[str, Mode] = {
    m.name: m for m in (COLLECT, STRICT, APPEND, CLOBBER, COND_CLOBBER, ORYX_APPEND, AUTO)
}
PUBLIC_MODES: tuple[str, ...] = tuple(m.name for m in MODES.values() if m.public)
# harvest.compat.oryx's `sow(mode=...)`: oryx's names for the core's modes.
ORYX_MODES: dict[str, Mode] = {"strict": STRICT, "clobber": CLOBBER, "append": ORYX_APPEND}
