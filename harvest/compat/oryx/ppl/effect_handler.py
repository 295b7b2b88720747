"""oryx.core.ppl.effect_handler's `make_effect_handler`, from harvest.ppl."""

from ....ppl import make_effect_handler as make_effect_handler

__all__ = ["make_effect_handler"]
