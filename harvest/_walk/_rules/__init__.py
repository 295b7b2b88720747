"""One module per family of higher-order primitives; importing registers the rules."""

from . import (  # noqa: F401
    batched_cond,
    batched_lax_map,
    calls,
    cond,
    custom_vmap,
    loops,
    sharding,
    solves,
)
