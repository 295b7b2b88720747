"""Hypothesis settings for the whole suite.

The default profile draws the same examples on every run and keeps no example
database, so a test's verdict depends only on the code, never on what an
earlier run happened to find. `HYPOTHESIS_PROFILE=explore` draws fresh random
examples (and remembers failures in .hypothesis/, which git ignores) for
hunting bugs locally.
"""

import os

from hypothesis import settings

settings.register_profile("deterministic", database=None, derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
