"""One spelling per concept (issue 43), and the old spellings for one release.

Each old spelling still works: it warns with a `DeprecationWarning` that names
the new spelling and points at the caller's line, and gives what the new one
gives, checked against a value computed by hand. Passing the old and the new
together is a `TypeError`. Every public module says what it exports.
"""

import importlib
import pathlib
import re
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest
from harvest import (
    call_and_reap,
    capture,
    harvest as harvest_fn,
    instrument,
    patching_sweep,
    plant,
    reap,
    sites,
    sow,
    stream,
    view,
)

X = jnp.array([1.0, 2.0, 3.0])
ROOT = pathlib.Path(__file__).resolve().parent.parent


def two_sites(x):
    a = sow(x + 1.0, name="a", mode="strict")
    b = sow(a * 2.0, name="b", mode="strict")
    return b - 1.0


def close(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def old_spelling(old, new):
    """`pytest.warns` for one old spelling: a DeprecationWarning naming the new
    spelling, raised at the line of this file that used the old one."""
    return pytest.warns(
        DeprecationWarning, match=rf"`{re.escape(old)}` is deprecated.*use `{re.escape(new)}`"
    )


def warned_here(record):
    ours = [w for w in record if "removed in harvest" in str(w.message)]
    assert ours and all(pathlib.Path(w.filename).name == "test_spelling.py" for w in ours)


# By hand: a = x + 1, b = 2a, out = b - 1.
A, B = X + 1.0, (X + 1.0) * 2.0
OUT = B - 1.0


@pytest.mark.parametrize(
    "run,want",
    [
        (lambda **kw: reap(two_sites, **kw)(X), {"a": A}),
        (lambda **kw: call_and_reap(two_sites, **kw)(X), (OUT, {"a": A})),
        (lambda **kw: capture(two_sites, **kw)(X), (OUT, {"a": A})),
        # a planted (b left out by the selection), b computed from it.
        (lambda **kw: plant(two_sites, **kw)({"a": 0.0 * X}, X), 2.0 * 0.0 * X - 1.0),
        (lambda **kw: harvest_fn(two_sites, **kw)({}, X), (OUT, {"a": A})),
    ],
    ids=["reap", "call_and_reap", "capture", "plant", "harvest"],
)
def test_allowlist_and_blocklist_are_names_and_exclude(run, want):
    close(run(names="a"), want)
    close(run(exclude="b"), want)
    with old_spelling("allowlist=", "names=") as record:
        close(run(allowlist="a"), want)
    warned_here(record)
    with old_spelling("blocklist=", "exclude=") as record:
        close(run(blocklist="b"), want)
    warned_here(record)


@pytest.mark.parametrize(
    "make",
    [reap, call_and_reap, capture, plant, harvest_fn, lambda f, **kw: stream(f, print, **kw)],
    ids=["reap", "call_and_reap", "capture", "plant", "harvest", "stream"],
)
def test_old_and_new_together_is_a_type_error(make):
    with pytest.raises(TypeError, match=r"both `allowlist=` and `names=`.*pass `names=` only"):
        make(two_sites, allowlist="a", names="a")
    with pytest.raises(TypeError, match=r"both `blocklist=` and `exclude=`"):
        make(two_sites, blocklist="a", exclude="a")


def test_stream_takes_names_and_exclude():
    seen = []
    stream(two_sites, lambda name, v: seen.append((name, np.asarray(v))), names="a")(X)
    stream(two_sites, lambda name, v: seen.append((name, np.asarray(v))), exclude="a")(X)
    with old_spelling("allowlist=", "names=") as record:
        stream(two_sites, lambda name, v: seen.append((name, np.asarray(v))), allowlist="b")(X)
    warned_here(record)
    jax.effects_barrier()
    assert [n for n, _ in seen] == ["a", "b", "b"]
    close([v for _, v in seen], [A, B, B])


def test_sites_and_view_take_the_arguments_afterwards():
    new = sites(two_sites)(X)
    assert [(s.name, s.shape) for s in new] == [("a", (3,)), ("b", (3,))]
    with old_spelling("sites(f, *args)", "sites(f)(*args)") as record:
        old = sites(two_sites, X)
    warned_here(record)
    assert old == new
    # A keyword of f (not one of sites') goes to f, as before.
    scaled = lambda x, scale=1.0: sow(x * scale, name="s")
    with old_spelling("sites(f, *args)", "sites(f)(*args)"):
        assert sites(scaled, X, scale=2.0, tag="intermediates") == sites(scaled)(X, scale=2.0)
    assert sites(lambda: sow(jnp.ones(2), name="c"))()[0].name == "c"  # no arguments: sites(f)()

    values = reap(two_sites)(X)
    drawn = view(two_sites, values=values)(X)
    with old_spelling("view(f, *args)", "view(f)(*args)") as record:
        old_view = view(two_sites, X, values=values)
    warned_here(record)
    assert (old_view.sites, old_view.groups) == (drawn.sites, drawn.groups) == (2, 0)
    # The page differs only in its element id (a counter).
    strip = lambda page: re.sub(r"hv\d+", "hv", page)
    assert strip(old_view.html) == strip(drawn.html)


def test_sites_with_a_bad_f_or_tag_fails_before_the_arguments():
    with pytest.raises(TypeError, match="callable"):
        sites(3)
    with pytest.raises(TypeError):
        sites(two_sites, tag=7)


def test_sweeps_take_exclude():
    # By hand, on zeros out_i is 1; patching a_i = x_i + 1 (or b_i = 2(x_i + 1)) in
    # makes it 2(x_i + 1) - 1: the sum grows by 2 x_i.
    clean = reap(two_sites)(X)
    zeros = (jnp.zeros(3),)
    full = patching_sweep(two_sites, clean, zeros, jnp.sum, axis=0)
    assert full.names == ("a", "b")
    swept = patching_sweep(two_sites, clean, zeros, jnp.sum, axis=0, exclude="b")
    assert swept.names == ("a",)
    np.testing.assert_allclose(swept.values, [2.0 * X], rtol=1e-6)
    np.testing.assert_allclose(full.values[:1], swept.values)
    both = harvest.attribution_patching(
        two_sites, clean, zeros, jnp.sum, axis=0, names="*", exclude="a"
    )
    assert both.names == ("b",)
    np.testing.assert_allclose(both.values, [2.0 * X], rtol=1e-6)  # linear: exact
    ablated = harvest.ablation_sweep(two_sites, (X,), jnp.sum, exclude=["a"])
    assert ablated.names == ("b",)
    # Zeroing b: out is -1 everywhere, from B - 1.
    np.testing.assert_allclose(np.ravel(ablated.values), [-float(jnp.sum(B))], rtol=1e-6)


nnx = pytest.importorskip("flax.nnx")


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(2, 4, qkv_features=4, decode=False, rngs=rngs)
        self.mlp = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs)])
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blocks[0](x))


def test_instrument_old_keywords():
    model, x = Tiny(nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (1, 3, 4))
    by_hand = {"head": model(x), "blocks.0.mlp": model.blocks[0].mlp(x + model.blocks[0].attn(x))}
    new = reap(instrument(model, names=["head", "blocks.0.mlp"]), tag="modules")(x)
    close(new, by_hand)
    with old_spelling("where=", "names=") as record:
        old = reap(instrument(model, where=["head", "blocks.0.mlp"]), tag="modules")(x)
    warned_here(record)
    close(old, by_hand)
    with old_spelling("target=", "f=") as record:
        old = reap(instrument(target=model, names="head"), tag="modules")(x)
    warned_here(record)
    close(old, {"head": by_hand["head"]})

    post = "blocks.0.hook_resid_post"
    tl = instrument(model, naming="transformer_lens", names=post)
    assert repr(tl).endswith("naming='transformer_lens')")
    close(reap(tl, tag="modules")(x), {post: model.blocks[0](x)})
    with pytest.warns(DeprecationWarning) as record:
        old_tl = instrument(model, names="transformer_lens", where=post)
    warned_here(record)
    assert [re.findall("`([^`]+)`", str(w.message)) for w in record] == [
        # The naming moves first, then where= takes its place.
        ["names='transformer_lens'", "naming='transformer_lens'"],
        ["where=", "names="],
    ]
    close(reap(old_tl, tag="modules")(x), {post: model.blocks[0](x)})
    with pytest.raises(TypeError, match=r"both `where=` and `names=`"):
        instrument(model, where="head", names="head")


def test_record_old_fn_keyword(tmp_path):
    pytest.importorskip("tensorstore")
    data = [np.full((2, 3), float(i), np.float32) for i in range(2)]
    new = harvest.store.record(two_sites, data, tmp_path / "new", progress=False, exclude="b")
    assert sorted(new) == ["a"]
    with old_spelling("fn=", "f=") as record:
        old = harvest.store.record(
            fn=two_sites, batches=data, path=tmp_path / "old", progress=False
        )
    warned_here(record)
    assert sorted(old) == ["a", "b"]
    np.testing.assert_allclose(old["a"][:], np.concatenate(data) + 1.0)
    np.testing.assert_allclose(new["a"][:], old["a"][:])


# --- __all__ ---------------------------------------------------------------------------------

PUBLIC = ["harvest", "harvest.extend", "harvest.config", "harvest.store"]


def _own(module, value):
    """Whether `value` is harvest's (not a name the module imported from elsewhere)."""
    if isinstance(value, types.ModuleType):
        return value.__name__.startswith("harvest")
    owner = getattr(value, "__module__", None)
    if owner is None or typing.get_origin(value) is not None:  # data, or an alias of the module's
        return True
    return owner.startswith("harvest")


@pytest.mark.parametrize("name", PUBLIC)
def test_star_import_exports_exactly_the_public_names(name):
    module = importlib.import_module(name)
    assert module.__all__ == sorted(set(module.__all__), key=module.__all__.index)  # no repeats
    namespace: dict = {}
    exec(f"from {name} import *", namespace)
    exported = set(namespace) - {"__builtins__"}
    assert exported == set(module.__all__)
    assert not exported & {"Any", "Callable", "Sequence", "annotations", "dataclasses"}
    assert all(not n.startswith("_") for n in exported)
    assert all(_own(module, namespace[n]) for n in exported)
    # A subpackage imported by its own name (harvest.ppl, harvest.compat) is bound on its
    # parent by the import system, whichever test imported it first: not an export.
    on_demand = {"ppl", "compat"} if name == "harvest" else set()
    public = {n for n, v in vars(module).items() if n[0] != "_" and _own(module, v)} - on_demand
    assert public <= exported, f"public but not in __all__: {sorted(public - exported)}"


def test_the_api_reference_lists_only_exported_names():
    documented = re.findall(
        r"^\.\. auto(?:function|class|data):: (harvest(?:\.\w+)*)\.(\w+)$",
        (ROOT / "docs" / "api.md").read_text(),
        re.M,
    )
    checked = 0
    for module_name, name in documented:
        if module_name in PUBLIC:
            assert name in importlib.import_module(module_name).__all__, (module_name, name)
            checked += 1
    assert checked > 30
