"""harvest.ppl: probabilistic programs on TensorFlow Probability, built from sow/reap/plant.

A program is a function `model(key, *args)` whose draws are named with
`random_variable`. `joint_sample`, `trace`, `joint_log_prob`, `log_prob` (by
inversion), `trace_log_prob`, `intervene`, `conditional`, `block` and
`graph_replace` transform it; `deterministic` records a computed value and
`factor` adds a log weight; `unconstrained` gives the density over R^n that
HMC/NUTS need, `sample_posterior` samples it with BlackJAX (a `Posterior`),
`predictive` draws prior and posterior predictives, `counterfactual` answers
twin-world queries with shared noise, and `random_variable(...,
enumerate=True)` sums a discrete draw out (by a forward pass over a scan for
one drawn per step); `infer_discrete` samples such draws from their posterior. `make_effect_handler` builds custom
interpreters; `plate` draws independent copies of a block and `nest` scopes
its names. Importing this module first makes TFP 0.25's JAX substrate
importable on current JAX (see `_tfp_shim.py`).
"""

from ._tfp_shim import import_tfp as _import_tfp

_import_tfp()  # fail here, with the versions that work, rather than at first use

from .._calling._transforms import nest as nest  # noqa: E402
from ._block import block as block  # noqa: E402
from ._counterfactual import (  # noqa: E402
    Counterfactual as Counterfactual,
    counterfactual as counterfactual,
)
from ._effect_handler import make_effect_handler as make_effect_handler  # noqa: E402
from ._infer_discrete import infer_discrete as infer_discrete  # noqa: E402
from ._plate import plate as plate  # noqa: E402
from ._posterior import Posterior as Posterior, sample_posterior as sample_posterior  # noqa: E402
from ._predictive import predictive as predictive  # noqa: E402
from ._random_variable import (  # noqa: E402
    deterministic as deterministic,
    factor as factor,
    random_variable as random_variable,
)
from ._tags import (  # noqa: E402
    DETERMINISTIC as DETERMINISTIC,
    LOG_DENSITY as LOG_DENSITY,
    RANDOM_VARIABLE as RANDOM_VARIABLE,
    UNCONSTRAINED as UNCONSTRAINED,
)
from ._transforms import (  # noqa: E402
    conditional as conditional,
    graph_replace as graph_replace,
    intervene as intervene,
    joint_log_prob as joint_log_prob,
    joint_sample as joint_sample,
    log_prob as log_prob,
    trace as trace,
    trace_log_prob as trace_log_prob,
)
from ._unconstrained import (  # noqa: E402
    Unconstrained as Unconstrained,
    unconstrained as unconstrained,
)

__all__ = [
    "DETERMINISTIC",
    "LOG_DENSITY",
    "RANDOM_VARIABLE",
    "UNCONSTRAINED",
    "Counterfactual",
    "Posterior",
    "Unconstrained",
    "block",
    "conditional",
    "counterfactual",
    "deterministic",
    "factor",
    "graph_replace",
    "infer_discrete",
    "intervene",
    "joint_log_prob",
    "joint_sample",
    "log_prob",
    "make_effect_handler",
    "nest",
    "plate",
    "predictive",
    "random_variable",
    "sample_posterior",
    "trace",
    "trace_log_prob",
    "unconstrained",
]
