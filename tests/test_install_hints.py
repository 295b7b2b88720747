"""Every error that tells a user to install something names the distribution, `jax-harvest[...]`.

The index's `harvest` is an unrelated package, so a hint naming `harvest[ppl]`
(or a bare dependency) sends a user to the wrong place or half-way.
"""

import pathlib
import re
import sys

import pytest

from harvest import _errors
from harvest.ppl import _tfp_shim

pytestmark = pytest.mark.single_release  # message text; the JAX matrix skips it

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "harvest"


def test_every_pip_install_in_the_package_names_a_jax_harvest_extra():
    hints = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for match in re.finditer(r"pip install[^`\"\n]*", path.read_text()):
            hints.append((path.relative_to(PACKAGE.parent), match.group()))
    assert hints, "the scan found no install hints at all"
    wrong = [(str(p), h) for p, h in hints if not re.search(r"jax-harvest\[|-e '\.\[", h)]
    assert not wrong, wrong


def test_the_tfp_message_names_jax_harvest_ppl():
    cause = ModuleNotFoundError("No module named 'x'")
    message = str(_tfp_shim._tfp_import_failed(cause, _tfp_shim.SUBSTRATE, _tfp_shim.TESTED, False))
    assert "pip install 'jax-harvest[ppl]'" in message and "'harvest[ppl]'" not in message
    # The import failed, so TFP cannot be had: no hint to use what needs it.
    assert "instead of TFP" not in message


def test_plots_without_matplotlib_name_the_patching_extra(monkeypatch):
    from harvest._tools import _plots

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import fails
    with pytest.raises(ImportError, match=re.escape("pip install 'jax-harvest[patching]'")):
        _plots.pyplot()
    assert "jax-harvest[store]" in str(_errors.needs_extra("x", "tensorstore", "store"))
