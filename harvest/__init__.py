"""harvest: tag any value inside any JAX function, then reap it out or plant a replacement in."""

from . import _cli

_cli.answer_early()  # `python -m harvest --help` answers here, before JAX is imported
from . import config as config, extend as extend, store as store
from ._calling._inspect import SiteInfo as SiteInfo, Sites as Sites, sites as sites
from ._calling._jit import RecompileWarning as RecompileWarning, clear_caches as clear_caches
from ._calling._transforms import (
    call_and_reap as call_and_reap,
    harvest as harvest,
    nest as nest,
    plant as plant,
    reap as reap,
)
from ._capture import capture as capture
from ._models._instrument import instrument as instrument
from ._perturb import perturb as perturb
from ._tools._ablation import ablation_sweep as ablation_sweep
from ._tools._interventions import (
    ablate_head as ablate_head,
    ablate_mean as ablate_mean,
    ablate_zero as ablate_zero,
    add_vector as add_vector,
    patch_head as patch_head,
    patch_positions as patch_positions,
)
from ._tools._patching import (
    attribution_patching as attribution_patching,
    patching_sweep as patching_sweep,
)
from ._tools._path_patching import path_patching as path_patching
from ._tools._plots import plot_attention as plot_attention
from ._tools._result import PatchingResult as PatchingResult
from ._tools._stream import stream as stream
from ._tools._view import View as View, view as view
from ._version import __version__ as __version__
from ._walk import _rules  # noqa: F401  (registers the interpreter's rules)
from ._walk._primitive import sow_p as sow_p
from ._walk._sow import sow as sow, sow_cond as sow_cond
from ._walk._steps import Steps as Steps

__all__ = [
    "PatchingResult",
    "RecompileWarning",
    "SiteInfo",
    "Sites",
    "Steps",
    "View",
    "ablate_head",
    "ablate_mean",
    "ablate_zero",
    "ablation_sweep",
    "add_vector",
    "attribution_patching",
    "call_and_reap",
    "capture",
    "clear_caches",
    "config",
    "extend",
    "harvest",
    "instrument",
    "nest",
    "patch_head",
    "patch_positions",
    "patching_sweep",
    "path_patching",
    "perturb",
    "plant",
    "plot_attention",
    "reap",
    "sites",
    "sow",
    "sow_cond",
    "sow_p",
    "store",
    "stream",
    "view",
]
