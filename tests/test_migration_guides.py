"""The migration guides' Python blocks run as written."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.single_release  # documentation; the JAX matrix skips it

GUIDES = pathlib.Path(__file__).parent.parent / "docs" / "guides"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(name):
    return BLOCK.findall((GUIDES / name).read_text())


@pytest.mark.parametrize(
    "name,index",
    [
        (n, i)
        for n in ("migrating_from_oryx.md", "migrating_from_flax.md")
        for i in range(len(_blocks(n)))
    ],
)
def test_guide_block_runs(name, index):
    exec(compile(_blocks(name)[index], f"{name}[{index}]", "exec"), {})
