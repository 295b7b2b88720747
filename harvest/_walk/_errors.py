"""The messages several modules of the walk raise (a message raised in one place sits
beside its check), and the parts of messages they share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def random_variable_modes(site: Any) -> str:
    """What a duplicate-name error suggests: random_variable knows only 'strict' and 'append'."""
    if site.tag == "random_variable":
        return (
            "Give each draw its own name, or (inside lax.scan) random_variable(..., "
            "mode='append'), which stacks one draw per iteration."
        )
    return ""


def shapes_str(shapes: Iterable[Any]) -> str:
    return " and ".join(str(list(s)) for s in shapes)


def per_occurrence_plant_in_while(site: Any) -> ValueError:
    return ValueError(
        f"The plant for the sow site {site} holds one value per occurrence, but the site is "
        "inside a while_loop, whose trip count is not known until it runs. Plant a single "
        "value or a callable old -> new (used at every iteration), or a callable "
        "fn(old, i) that picks by the iteration's index, e.g. lambda old, i: rows[i]."
    )


def steps_nested(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} is recorded per step (max_steps) in a while_loop that sits "
        "inside another loop or a cond, which cannot stack a per-step record. Reap "
        "without max_steps (each while_loop's last iteration), or reap inside the outer "
        "loop's body."
    )


def index_after_while_in(site: Any, where: str) -> ValueError:
    return ValueError(
        f"The plant for the sow site {site} is a callable fn(old, i), and the site is inside a "
        f"while_loop within a {where}, so how many occurrences come before a later one is known "
        "only per run of that while_loop, which harvest cannot count there. Plant a callable "
        "old -> new (no index), or move the while_loop out of the " + where + "."
    )
