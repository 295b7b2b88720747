"""One module per family of higher-order primitives; importing registers the rules."""

from . import calls, cond, loops, sharding, solves  # noqa: F401
