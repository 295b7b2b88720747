"""oryx.core.ppl's names (`from oryx.core import ppl`), on harvest.ppl.

Replace `from oryx.core import ppl` with `from harvest.compat.oryx import ppl`;
the submodules `transformations` and `effect_handler` are here too.
"""

from . import effect_handler as effect_handler, transformations as transformations
from .effect_handler import make_effect_handler as make_effect_handler
from .transformations import (
    RANDOM_VARIABLE as RANDOM_VARIABLE,
    LogProbFunction as LogProbFunction,
    Program as Program,
    block as block,
    conditional as conditional,
    graph_replace as graph_replace,
    intervene as intervene,
    joint_log_prob as joint_log_prob,
    joint_sample as joint_sample,
    log_prob as log_prob,
    nest as nest,
    plate as plate,
    random_variable as random_variable,
    rv as rv,
    trace as trace,
    trace_log_prob as trace_log_prob,
)

__all__ = [
    "RANDOM_VARIABLE",
    "LogProbFunction",
    "Program",
    "block",
    "conditional",
    "effect_handler",
    "graph_replace",
    "intervene",
    "joint_log_prob",
    "joint_sample",
    "log_prob",
    "make_effect_handler",
    "nest",
    "plate",
    "random_variable",
    "rv",
    "trace",
    "trace_log_prob",
    "transformations",
]
