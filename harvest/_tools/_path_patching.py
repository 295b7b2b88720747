"""Path patching (Wang et al., 2022, the IOI paper): a sender's effect through chosen receivers.

Both of its runs are `harvest` and `plant` walks of the same function, so each
compiles once and a second call with new data of the same shapes only runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._calling._transforms import harvest, plant, reap
from .._typing import NameSelect
from .._walk._interpreter import NameFilter
from .._walk._sow import DEFAULT_TAG


def path_patching(
    f: Callable[..., Any],
    senders: dict[str, Any],
    receivers: NameSelect,
    corrupted_args: tuple[Any, ...],
    *,
    freeze: NameSelect = None,
    tag: str = DEFAULT_TAG,
) -> Any:
    """Runs ``f(*corrupted_args)`` with ``senders`` patched along the paths through ``receivers`` only.

    Two passes over ``f(*corrupted_args)``. The first plants ``senders``,
    holds every site ``freeze`` selects (but the senders and receivers) at its
    value in the unpatched run, and reaps the receivers; the second plants
    those receiver values into an otherwise unpatched run, so the sender's
    effect reaches the output through the receivers alone. Freezing the
    components between sender and receivers (every head's output,
    ``freeze="blocks*.z"``) cuts the paths through them; what ``freeze``
    leaves out (a residual stream that sums them, say) carries the effect on.
    A head's output patched from a clean run along the path to the next
    layer's keys: ``path_patching(f, {"blocks0.z": patch_head(clean_z0, 1,
    axis=2)}, "blocks1.k", (corrupted,), freeze="blocks*.z")``.

    Args:
        f: the function to patch, as ``plant`` takes it (a function, an
            instrumented model, a bound method).
        senders: ``{dotted site name: planted value}``: what the first pass
            plants, as ``plant`` takes it (a callable such as ``patch_head``
            patches part of a site).
        receivers: the sites whose values carry the path, selected as by
            ``reap``'s ``names`` (a string that matches no site is an error).
        corrupted_args: the arguments of the run being patched, a tuple.
        freeze: the sites held at their unpatched values in the first pass,
            selected as ``receivers`` are; None freezes nothing (then the
            result is the sender's whole effect on the receivers).
        tag: the tag of the sites.

    Returns:
        ``f``'s output from the second pass: ``f(*corrupted_args)`` with the
        receivers planted. Apply your metric to it.

    Raises:
        TypeError: if ``senders`` is not a non-empty dict of names, or
            ``corrupted_args`` is not a tuple.
        ValueError: if ``receivers`` is None or selects a sender, or a name
            matches no site of ``tag``.

    Example:
        >>> from harvest import sow, path_patching, plant
        >>> def f(x):
        ...     a = sow(x * 2.0, name="a", mode="strict")  # the sender
        ...     b = sow(a + 1.0, name="b", mode="strict")  # a component on the way
        ...     c = sow(a + b, name="c", mode="strict")  # the receiver
        ...     return c * 10.0
        >>> float(plant(f)({"a": 5.0}, 1.0))  # every path from a: through b and directly
        110.0
        >>> float(path_patching(f, {"a": 5.0}, "c", (1.0,), freeze="b"))  # a -> c only
        80.0
    """
    if not isinstance(senders, dict) or not senders or not all(isinstance(n, str) for n in senders):
        raise TypeError(
            "path_patching needs `senders` as a non-empty dict {site name: planted value}, got "
            f"{type(senders).__name__}. E.g. senders={{'blocks0.z': patch_head(clean_z, 1, axis=2)}}."
        )
    if not isinstance(corrupted_args, tuple):
        raise TypeError(
            f"path_patching needs `corrupted_args` as a tuple of f's arguments, got "
            f"{type(corrupted_args).__name__}. Write (x,) for a single argument."
        )
    if receivers is None:
        raise ValueError(
            "path_patching needs `receivers`: the names (or glob patterns) of the sites the "
            "path runs through, e.g. receivers='blocks1.k'."
        )
    to = _entries(receivers)
    receiving = NameFilter.make(to)
    for name in senders:
        if receiving(tuple(name.split("."))):
            raise ValueError(
                f"path_patching: the sender {name!r} is also selected by `receivers`. A path runs "
                "from a sender to other sites: select receivers downstream of it."
            )
    held: dict[str, Any] = {}
    if freeze is not None:
        unpatched = reap(f, tag=tag, names=_entries(freeze), exclude=[*senders, *to])
        held = dotted(unpatched(*corrupted_args))
    first = harvest(f, tag=tag, names=[*to, *senders, *held])
    _, reached = first({**held, **senders}, *corrupted_args)
    return plant(f, tag=tag)(reached, *corrupted_args)


def _entries(select: NameSelect) -> list[Any]:
    if isinstance(select, str) or callable(select):
        return [select]
    return list(select or ())


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A reap's nested dicts as one dict of dotted names."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(dotted(value, name + "."))
        else:
            out[name] = value
    return out
