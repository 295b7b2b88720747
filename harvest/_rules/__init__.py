"""One module per family of higher-order primitives; importing registers the rules."""

from . import batched_cond, calls, cond, custom_vmap, loops, sharding, solves  # noqa: F401
