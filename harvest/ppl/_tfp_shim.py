"""Lets TensorFlow Probability's JAX substrate import on current JAX.

TFP 0.25.0 registers its `Variable` type in the table `pytype_aval_mappings` of
JAX's `xla` interpreter module at import time. JAX moved that table into its core and dropped the old alias,
so `import tensorflow_probability.substrates.jax` fails with an AttributeError
on such a JAX. Putting the alias back is all TFP needs.

Whether the alias is missing is a feature check in the adapter (`harvest._jax`):
on a JAX that still has it, nothing is touched, and nothing JAX defines is ever
replaced. It runs when `harvest.ppl` is imported, where TFP is first needed
(`import harvest` alone leaves JAX as it is), so import harvest.ppl before TFP.
TFP imported first fails in TFP's own import: after `import harvest`, with an
ImportError saying so (`_jax._TfpImportOrder`); before it, with TFP's
AttributeError, where harvest cannot speak. Either way `import harvest.ppl`
afterwards puts the alias back and retries the import itself.

TFP 0.25's `Pad` bijector (inside `SoftmaxCentered`, the Dirichlet's map onto
the simplex) calls `np.reshape(x, newshape=...)`, a keyword NumPy 2.4 removed.
On such a NumPy, `import_tfp` hands that one module a NumPy whose `reshape`
still takes it (`_NumpyWithNewshape`); NumPy itself is left alone.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any

import numpy as np

from .. import _jax

# The versions this shim is tested against, named when the import fails.
TESTED = "tensorflow-probability 0.25.0 with jax/jaxlib 0.8.x, 0.9.x and 0.10.x"
SUBSTRATE = "tensorflow_probability.substrates.jax"
# The TFP module that calls `np.reshape(..., newshape=...)`.
PAD = SUBSTRATE + ".bijectors.pad"


def apply_shim():
    """Restores the alias TFP writes to, if (and only if) this JAX lacks it."""
    _jax.restore_tfp_alias()


def _tfp_import_failed(
    cause: Exception, module: str, tested: str, imported_before: bool
) -> ImportError:
    order = ""
    if imported_before:
        order = (
            " TFP's JAX substrate was imported before harvest.ppl, on a JAX that needs "
            "harvest's compatibility alias for it (see harvest/ppl/_tfp_shim.py), and "
            "importing it again did not recover. Restart the interpreter and import "
            "harvest.ppl before tensorflow_probability."
        )
    return ImportError(
        f"harvest.ppl could not import TensorFlow Probability's JAX substrate ({module}): "
        f"{type(cause).__name__}: {cause}.{order} harvest.ppl needs it (it draws from TFP "
        f"distributions) and is tested with {tested}; install them with "
        "`pip install 'jax-harvest[ppl]'`. The core (sow, reap, plant, instrument) works "
        "without TFP."
    )


def import_tfp():
    """Imports TFP's JAX substrate after the shim, or raises an ImportError that
    says which versions work."""
    imported_before = _jax.tfp_failed_before()
    apply_shim()
    try:
        with warnings.catch_warnings():
            # TFP also reads `jax.core.pytype_aval_mappings`, which JAX deprecates;
            # the warning is about TFP's code, not the user's.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="jax.*")
            warnings.filterwarnings("ignore", message=".*pytype_aval_mappings.*")
            tfp = importlib.import_module(SUBSTRATE)
    except Exception as cause:  # TFP fails in many ways on an untested JAX
        raise _tfp_import_failed(cause, SUBSTRATE, TESTED, imported_before) from cause
    if "newshape" not in inspect.signature(np.reshape).parameters:
        importlib.import_module(PAD).np = _NumpyWithNewshape()
    return tfp


class _NumpyWithNewshape:
    """NumPy as TFP's `Pad` bijector reads it: `reshape` also takes `newshape=`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def reshape(a: Any, shape: Any = None, *, newshape: Any = None, **kwargs: Any) -> Any:
        return np.reshape(a, newshape if shape is None else shape, **kwargs)
