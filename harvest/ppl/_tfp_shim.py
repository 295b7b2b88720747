"""Lets TensorFlow Probability's JAX substrate import on current JAX.

TFP 0.25.0 registers its `Variable` type in `jax.interpreters.xla.pytype_aval_mappings`
at import time. JAX moved that table into its core (`jax._src.core`) and dropped
the old alias, so `import tensorflow_probability.substrates.jax` fails with an
AttributeError on JAX 0.10. Putting the alias back is all TFP needs.

The shim is guarded: it only adds the alias when it is missing and JAX's core
still has the table, and it never replaces anything JAX defines. It runs when
`harvest.ppl` is imported, so import `harvest.ppl` before TFP.
"""

from __future__ import annotations

import importlib
import warnings

import jax.interpreters.xla
from jax._src import core as _jax_core

# The versions this shim is tested against; see `tfp_error_message`.
TESTED = "tensorflow-probability 0.25.0 with jax/jaxlib 0.10.x"


def apply_shim():
    """Restores `jax.interpreters.xla.pytype_aval_mappings` if JAX lacks it."""
    xla = jax.interpreters.xla
    table = getattr(_jax_core, "pytype_aval_mappings", None)
    if table is not None and not hasattr(xla, "pytype_aval_mappings"):
        xla.pytype_aval_mappings = table


def tfp_error_message(cause):
    return (
        "harvest.ppl could not import TensorFlow Probability's JAX substrate "
        f"(tensorflow_probability.substrates.jax): {type(cause).__name__}: {cause}. "
        f"harvest.ppl is tested with {TESTED}; install them with "
        "`pip install 'harvest[ppl]'`, or use plain sampling functions "
        "(key -> value) instead of TFP distributions."
    )


def import_tfp():
    """Imports TFP's JAX substrate after the shim, or raises an ImportError that
    says which versions work."""
    apply_shim()
    try:
        with warnings.catch_warnings():
            # TFP also reads `jax.core.pytype_aval_mappings`, which JAX deprecates;
            # the warning is about TFP's code, not the user's.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="jax.*")
            warnings.filterwarnings("ignore", message=".*pytype_aval_mappings.*")
            return importlib.import_module("tensorflow_probability.substrates.jax")
    except Exception as cause:  # TFP fails in many ways on an untested JAX
        raise ImportError(tfp_error_message(cause)) from cause
