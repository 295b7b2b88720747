"""Import redirection: makes `import oryx...` load harvest's oryx compat modules.

Imported (by the conftest.py that `run_oryx_tests.py` writes next to oryx's
unmodified ppl test files) before the tests, it registers in `sys.modules`:

| oryx module | harvest module |
| --- | --- |
| `oryx.core.interpreters.harvest` | `harvest.compat.oryx` |
| `oryx.core.interpreters.log_prob` | `harvest.compat.oryx.log_prob` |
| `oryx.core.ppl` (+ `.transformations`, `.effect_handler`) | `harvest.compat.oryx.ppl` |
| `oryx.core.primitive` | `harvest.compat.oryx.primitive` |
| `oryx.internal.test_util` | `TestCase` = absl's `parameterized.TestCase` (oryx's adds nothing these tests use) |

Nothing in the test files is edited.
"""

from __future__ import annotations

import sys
import types

from absl.testing import parameterized

import harvest.compat.oryx as harvest_compat
import harvest.compat.oryx.log_prob as log_prob
import harvest.compat.oryx.ppl as ppl
import harvest.compat.oryx.primitive as primitive


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def install():
    test_util = _module("oryx.internal.test_util", TestCase=parameterized.TestCase)
    interpreters = _module("oryx.core.interpreters", harvest=harvest_compat, log_prob=log_prob)
    sys.modules.update(
        {
            "oryx.core.interpreters.harvest": harvest_compat,
            "oryx.core.interpreters.log_prob": log_prob,
            "oryx.core.ppl": ppl,
            "oryx.core.ppl.transformations": ppl.transformations,
            "oryx.core.ppl.effect_handler": ppl.effect_handler,
            "oryx.core.primitive": primitive,
        }
    )
    core = _module("oryx.core", ppl=ppl, primitive=primitive, interpreters=interpreters)
    _module("oryx.internal", test_util=test_util)
    _module("oryx", core=core)


install()
