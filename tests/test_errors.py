"""Every error says what went wrong and what to do; no state survives an error."""

import ast
import os
import pathlib
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import close
from jax import lax

import harvest as harvest_module
from harvest import call_and_reap, harvest, nest, plant, reap, sow, sow_cond
from harvest.compat import oryx

X = jnp.array([1.0, 2.0, 3.0], jnp.float32)


def f(x):
    a = sow(x + 1.0, name="alpha", mode="strict", tag="t")
    b = sow(a * 2.0, name="beta", mode="strict", tag="t")
    return b - 1.0


def ok_after():
    """The function still behaves normally after an error."""
    close(reap(f, tag="t")(X), {"alpha": X + 1.0, "beta": (X + 1.0) * 2.0})
    close(plant(f, tag="t")({"alpha": jnp.zeros(3)}, X), jnp.full(3, -1.0))
    close(f(X), (X + 1.0) * 2.0 - 1.0)


def test_plant_unknown_name_lists_existing_names():
    with pytest.raises(KeyError, match=r"(?s)'gamma'.*'alpha'.*'beta'"):
        plant(f, tag="t")({"gamma": X}, X)
    with pytest.raises(KeyError, match=r"(?s)gamma.*alpha"):
        harvest(f, tag="t")({"gamma": X}, X)
    ok_after()


def test_plant_unknown_name_wrong_tag():
    # alpha exists, but not under the default tag: the tags it does sow are named
    with pytest.raises(ValueError, match=r"plant\(tag='intermediates'\).*tags 't'"):
        plant(f)({"alpha": X}, X)
    ok_after()


def test_plant_wrong_shape_names_site_expected_and_got():
    pat = r"(?s)(?=.*alpha)(?=.*float32\[3\])(?=.*float32\[2\])"
    with pytest.raises(ValueError, match=pat):
        plant(f, tag="t")({"alpha": jnp.zeros(2)}, X)
    ok_after()


def test_plant_wrong_dtype_names_site_expected_and_got():
    pat = r"(?s)(?=.*beta)(?=.*float32\[3\])(?=.*int32\[3\])"
    with pytest.raises(ValueError, match=pat):
        plant(f, tag="t")({"beta": jnp.zeros(3, jnp.int32)}, X)
    ok_after()


def counts(tokens):
    ids = sow(tokens.sum() * 2, name="ids", mode="strict", tag="t")
    return ids + 1


def test_a_number_out_of_the_sites_range_names_site_dtype_and_value():
    tokens = jnp.array([1, 2], jnp.int32)
    too_big = r"(?s)(?=.*'ids')(?=.*int32)(?=.*1099511627776)(?=.*range)(?=.*wider dtype)"
    with pytest.raises(ValueError, match=too_big):  # was a bare OverflowError
        plant(counts, tag="t")({"ids": 2**40}, tokens)
    with pytest.raises(ValueError, match=too_big):  # a callable's number, checked as well
        plant(counts, tag="t")({"ids": lambda old: 2**40}, tokens)
    with pytest.raises(ValueError, match=r"(?s)(?=.*'ids')(?=.*uint8)(?=.*-1 is outside)"):
        plant(lambda v: sow(v, name="ids", mode="strict", tag="t"), tag="t")(
            {"ids": lambda old: -1}, jnp.uint8(3)
        )
    with pytest.raises(ValueError, match=r"(?s)(?=.*'alpha')(?=.*complex)(?=.*imaginary)"):
        plant(f, tag="t")({"alpha": 1 + 2j}, X)
    with pytest.raises(ValueError, match=r"(?s)(?=.*'alpha')(?=.*float32)(?=.*1e\+39 is outside)"):
        plant(f, tag="t")({"alpha": lambda old: 1e39}, X)
    # Nothing changed: what fits is planted as JAX casts it (a Python int, a float64
    # NumPy array into a float32 site), against the function written out by hand.
    by_hand = jnp.int32(2**31 - 1) + 1  # counts with the planted value written in
    np.testing.assert_array_equal(plant(counts, tag="t")({"ids": 2**31 - 1}, tokens), by_hand)
    x64 = np.array([0.1, 0.2, 0.3])
    close(plant(f, tag="t")({"alpha": x64}, X), jnp.asarray(x64, jnp.float32) * 2.0 - 1.0)
    ok_after()


def test_a_planted_number_is_checked_against_the_sites_dtype_at_every_call():
    # A Python number is traced (a new one does not retrace), so its value is known
    # only when the call is made: each call checks it against the dtype the site
    # had when traced. Before, -1 into uint8 gave 255, 1e39 into float32 inf.
    traces = []

    def small(v):
        traces.append(1)
        return sow(v, name="ids", mode="strict", tag="t") + 1

    planted = plant(small, tag="t")
    u8 = jnp.uint8(3)
    np.testing.assert_array_equal(planted({"ids": 7}, u8), jnp.uint8(8))  # by hand: 7 + 1
    for value in (-1, 256):
        with pytest.raises(ValueError, match=rf"(?s)'ids'.*{value} is outside uint8's range"):
            planted({"ids": value}, u8)
    np.testing.assert_array_equal(planted({"ids": 255}, u8), jnp.uint8(0))  # 255 + 1 wraps, as JAX
    assert len(traces) == 1  # one program: every int above ran (or was refused) through it
    with pytest.raises(ValueError, match=r"(?s)'ids'.*uint8.*nan is no whole number"):
        planted({"ids": float("nan")}, u8)
    with pytest.raises(ValueError, match=r"(?s)'ids'.*float32.*1e\+39 is outside"):
        planted({"ids": 1e39}, jnp.float32(1.0))
    np.testing.assert_array_equal(planted({"ids": -3e38}, jnp.float32(1.0)), jnp.float32(-3e38))
    # collect's entries, each checked against its occurrence.
    twice = lambda v: sow(v, name="c", tag="t") + sow(v, name="c", tag="t")  # noqa: E731
    with pytest.raises(ValueError, match=r"(?s)occurrence 1 of the planted value.*-2 is outside"):
        plant(twice, tag="t")({"c": (1, -2)}, u8)
    np.testing.assert_array_equal(plant(twice, tag="t")({"c": (1, 2)}, u8), jnp.uint8(3))
    ok_after()


def test_a_fraction_planted_into_an_int_site_is_refused_a_whole_float_is_not():
    # The cast would truncate it unseen (1.5 -> 1, -0.5 -> 0, 2.7 -> 2): refused as
    # nan is, at every call of the one program; 2.0 is the whole number 2.
    planted = plant(counts, tag="t")
    tokens = jnp.array([1, 2], jnp.int32)
    np.testing.assert_array_equal(planted({"ids": 2.0}, tokens), jnp.int32(3))  # by hand: 2 + 1
    for value in (1.5, -0.5, 2.7):
        with pytest.raises(ValueError, match=rf"(?s)'ids'.*int32.*{value} is no whole number"):
            planted({"ids": value}, tokens)
    with pytest.raises(ValueError, match=r"(?s)'ids'.*int32.*0\.5 is no whole number"):
        planted({"ids": lambda old: 0.5}, tokens)  # a callable's number as well
    flag = lambda x: sow(x > 0, name="on", mode="strict", tag="t") * 3.0  # noqa: E731
    with pytest.raises(ValueError, match=r"(?s)'on'.*bool.*0\.5 is no whole number"):
        plant(flag, tag="t")({"on": 0.5}, 1.0)
    np.testing.assert_array_equal(plant(flag, tag="t")({"on": 0.0}, 1.0), 0.0)
    # A number traced by an outer jit is unknown here: converted as
    # lax.convert_element_type converts it (docs/semantics.md, "What plant does").
    under_jit = jax.jit(lambda v: planted({"ids": v}, tokens))(2.7)
    np.testing.assert_array_equal(under_jit, jax.lax.convert_element_type(2.7, jnp.int32) + 1)
    ok_after()


def test_plant_callable_returning_wrong_shape():
    with pytest.raises(ValueError, match=r"(?s)(?=.*alpha)(?=.*float32\[3\])(?=.*float32\[1\])"):
        plant(f, tag="t")({"alpha": lambda a: a[:1]}, X)
    ok_after()


def test_plant_wrong_structure():
    def g(x):
        return sow({"a": x, "b": x}, name="d", mode="strict")["a"]

    with pytest.raises(ValueError, match=r"(?s)'d'.*structure"):
        plant(g)({"d": {"a": X}}, X)
    close(plant(g)({"d": {"a": X * 0, "b": X}}, X), X * 0)


def test_plant_wrong_shape_in_scan():
    def g(xs):
        return lax.scan(lambda c, x: (c + sow(x, name="v", mode="append"), None), 0.0, xs)[0]

    with pytest.raises(ValueError, match=r"(?s)(?=.*'v')(?=.*float32\[\])(?=.*int32)"):
        plant(g)({"v": jnp.zeros(3, jnp.int32)}, X)
    close(plant(g)({"v": jnp.ones(3)}, X), jnp.float32(3.0))


def test_collect_plant_too_few_entries():
    def g(x):
        a = sow(x, name="c")
        return sow(a * 2.0, name="c")

    with pytest.raises(ValueError, match=r"(?s)'c'.*1 entr"):
        plant(g)({"c": (X,)}, X)
    close(plant(g)({"c": (X, X * 5)}, X), X * 5)


def test_unknown_mode():
    with pytest.raises(ValueError, match=r"(?s)(?=.*'bogus')(?=.*'collect')(?=.*name='n')"):
        sow(X, name="n", mode="bogus")
    with pytest.raises(ValueError, match=r"bogus"):
        reap(lambda x: sow(x, name="n", mode="bogus"))(X)
    close(reap(lambda x: sow(x, name="n", mode="clobber"))(X), {"n": X})


@pytest.mark.parametrize("leaf", ["a string", object(), None.__class__])
def test_non_array_leaf(leaf):
    with pytest.raises(TypeError, match=r"(?s)(?=.*'bad')(?=.*array)"):
        sow({"ok": X, "x": leaf}, name="bad")
    with pytest.raises(TypeError, match=r"(?s)\['x'\].*array"):
        reap(lambda x: sow({"ok": x, "x": leaf}, name="bad"))(X)
    close(reap(lambda x: sow({"ok": x}, name="bad"))(X), {"bad": ({"ok": X},)})


def test_strict_sown_twice_names_tag_and_name():
    def g(x):
        sow(x, name="once", tag="tt", mode="strict")
        return sow(x * 2.0, name="once", tag="tt", mode="strict")

    with pytest.raises(ValueError, match=r"(?s)(?=.*'tt')(?=.*'once')(?=.*strict)"):
        reap(g, tag="tt")(X)
    with pytest.raises(ValueError, match=r"(?s)(?=.*'tt')(?=.*'once')"):
        plant(g, tag="tt")({"once": X}, X)
    # under another tag the strict sites are untouched
    close(plant(g)({}, X), X * 2.0)
    close(g(X), X * 2.0)
    ok_after()


def test_strict_sown_twice_across_jit_boundary():
    inner = jax.jit(lambda x: sow(x, name="s", mode="strict"))

    def g(x):
        return inner(inner(x))

    with pytest.raises(ValueError, match=r"(?s)'s'.*strict"):
        reap(g)(X)


def test_strict_in_scan():
    def g(xs):
        return lax.scan(lambda c, x: (c + sow(x, name="it", mode="strict"), None), 0.0, xs)[0]

    with pytest.raises(
        ValueError, match=r"(?s)(?=.*'it')(?=.*scan)(?=.*strict)(?=.*(collect|append))"
    ):
        reap(g)(X)
    ok_after()


def test_collect_in_while_points_to_scan_and_sow_cond():
    def g(x):
        return lax.while_loop(lambda c: c[0] < 10.0, lambda c: sow(c * 2.0, name="w"), x)

    with pytest.raises(ValueError, match=r"(?s)(?=.*'w')(?=.*while_loop)(?=.*scan)(?=.*sow_cond)"):
        reap(g)(X)
    ok_after()


def test_strict_in_while():
    def g(x):
        return lax.while_loop(
            lambda c: c[0] < 10.0, lambda c: sow(c * 2.0, name="w", mode="strict"), x
        )

    with pytest.raises(ValueError, match=r"(?s)(?=.*'w')(?=.*while_loop)(?=.*strict)"):
        reap(g)(X)


def test_plants_not_a_dict():
    with pytest.raises(TypeError, match=r"(?s)plants.*dict.*list"):
        plant(f, tag="t")([X], X)
    with pytest.raises(TypeError, match=r"(?s)plants.*dict.*Array"):
        harvest(f, tag="t")(X)
    ok_after()


def test_mixed_modes_for_one_name():
    def g(x):
        sow(x, name="m", mode="collect")
        return sow(x, name="m", mode="append")

    with pytest.raises(ValueError, match=r"(?s)'m'.*(collect|append).*(collect|append)"):
        reap(g)(X)


def test_sow_cond_needs_scalar_bool():
    with pytest.raises(TypeError, match=r"(?s)(?=.*'sc')(?=.*scalar boolean)"):
        sow_cond(X, X > 0, name="sc")
    with pytest.raises(TypeError, match=r"scalar boolean"):
        sow_cond(X, jnp.float32(1.0), name="sc")


def test_bad_name_tag_scope_and_filters():
    with pytest.raises(TypeError, match=r"name"):
        sow(X, name="")
    with pytest.raises(TypeError, match=r"tag"):
        sow(X, name="a", tag=3)
    with pytest.raises(TypeError, match=r"tag"):
        reap(f, tag=None)
    with pytest.raises(TypeError, match=r"scope"):
        nest(f, scope="")
    with pytest.raises(TypeError, match=r"names="):
        reap(f, names=[3])


def test_error_under_outer_jit_leaves_no_state():
    g = jax.jit(plant(f, tag="t"))
    with pytest.raises(ValueError, match=r"alpha"):
        g({"alpha": jnp.zeros(2)}, X)
    close(g({"alpha": jnp.zeros(3)}, X), jnp.full(3, -1.0))
    o, r = call_and_reap(f, tag="t")(X)
    close(o, (X + 1.0) * 2.0 - 1.0)


def test_a_name_that_is_also_a_nest_scope_is_an_error_not_a_lost_value():
    inner = nest(lambda x: sow(x, name="a", mode="strict"), scope="y")

    def f(x):
        return sow(inner(x) * 2.0, name="y", mode="strict")

    with pytest.raises(ValueError, match="'y' is both a sown name and a nest scope"):
        reap(f)(1.0)
    assert float(f(1.0)) == 2.0  # nothing left behind


@pytest.mark.parametrize("rows", [2, 4])
def test_append_plant_with_wrong_row_count_in_scan(rows):
    def g(x):
        return lax.scan(
            lambda c, _: (sow(c, name="h", mode="append") + 1.0, None), x, None, length=3
        )[0]

    with pytest.raises(ValueError, match=rf"(?s)'h'.*has {rows} rows.*3 rows of float32\[\]"):
        plant(g)({"h": jnp.arange(float(rows))}, 0.0)
    # Hand-threaded: row t replaces iteration t's carry, the result is the last row + 1.
    close(plant(g)({"h": jnp.array([5.0, 6.0, 7.0])}, 0.0), jnp.float32(8.0))


@pytest.mark.parametrize("mode", ["append", "collect"])
def test_top_level_plant_with_wrong_occurrence_count(mode):
    def g(x):
        return sow(x, name="h", mode=mode) * sow(x + 1.0, name="h", mode=mode)

    what = "rows" if mode == "append" else "entr"
    for n in (1, 3):
        value = (
            jnp.arange(float(n)) if mode == "append" else tuple(jnp.float32(i) for i in range(n))
        )
        with pytest.raises(ValueError, match=rf"(?s)'h'.*has {n} {what}.*2 {what}"):
            plant(g)({"h": value}, 1.0)
    two = jnp.array([2.0, 3.0]) if mode == "append" else (jnp.float32(2.0), jnp.float32(3.0))
    close(plant(g)({"h": two}, 1.0), jnp.float32(6.0))


@pytest.mark.parametrize(
    "make", [reap, call_and_reap, plant, harvest, lambda f: nest(f, scope="s")]
)
@pytest.mark.parametrize("f", [3, "abc", None])
def test_f_must_be_callable(make, f):
    with pytest.raises(TypeError, match="f must be callable"):
        make(f)
    with pytest.raises(TypeError, match="f must be callable"):
        oryx.plant(f, tag="t")


def test_planting_a_filtered_out_name_says_so():
    f = lambda x: sow(x, name="pair") + sow(x, name="other")
    with pytest.raises(KeyError, match=r"'pair'.*is sown with tag 'intermediates'.*blocklist"):
        plant(f, exclude="pair")({"pair": 1.0}, 1.0)
    with pytest.raises(KeyError, match=r"'pair'.*allowlist"):
        plant(f, names="other")({"pair": 1.0}, 1.0)


def test_append_occurrences_of_different_shapes_name_the_site():
    def f(x):
        return (
            sow(x, name="h", mode="append").sum() + sow(jnp.ones(2), name="h", mode="append").sum()
        )

    with pytest.raises(
        ValueError, match=r"(?s)name='h'.*'append'.*different shapes \(\[2\], \[3\]\)"
    ):
        reap(f)(jnp.ones(3))
    # associative_scan calls its combine function on ever shorter slices.
    g = lambda xs: lax.associative_scan(lambda a, b: sow(a + b, name="h", mode="append"), xs)
    with pytest.raises(ValueError, match=r"(?s)name='h'.*different shapes"):
        reap(g)(jnp.arange(4.0))


def test_compat_append_in_while_names_the_mode_as_written():
    f = lambda x: lax.while_loop(
        lambda c: c < 3.0, lambda c: oryx.sow(c, tag="t", name="a", mode="append") + 1.0, x
    )
    with pytest.raises(
        ValueError, match=r"mode 'append' \(harvest.compat.oryx's\) inside a while_loop"
    ) as err:
        oryx.reap(f, tag="t")(0.0)
    assert "'stack'" not in str(err.value)


@pytest.mark.parametrize("name", [3, "", None])
def test_compat_sow_with_a_name_that_is_not_a_string_says_so(name):
    # Was: "sequence item 0: expected str instance, int found" from inside reap.
    for sown in (
        lambda x: oryx.sow(x, tag="t", name=name),
        lambda x: oryx.sow_cond(x, x > 0, tag="t", name=name),
    ):
        with pytest.raises(TypeError, match="sow needs `name` to be a non-empty string"):
            oryx.reap(sown, tag="t")(1.0)


def test_a_duplicate_strict_sow_names_the_users_file_and_line():
    def twice(x):
        sow(x, name="h", mode="strict")
        return sow(x, name="h", mode="strict")

    second = twice.__code__.co_firstlineno + 2
    with pytest.raises(ValueError, match="sown more than once") as err:
        reap(twice)(1.0)
    assert f"name='h' (sown at {__file__}:{second})" in str(err.value)


def test_scan_errors_name_the_sow_inside_the_body():
    def body(c, x):
        return c + sow(x, name="x", mode="strict"), None

    line = body.__code__.co_firstlineno + 1
    with pytest.raises(ValueError, match=rf"sown at {re.escape(__file__)}:{line}\).*inside a scan"):
        reap(lambda xs: lax.scan(body, 0.0, xs)[0])(X)


def test_a_failing_reap_shows_only_the_users_frames():
    harvest_dir = os.path.dirname(os.path.abspath(harvest_module.__file__))
    with pytest.raises(ValueError, match=r"(?s)(?=.*alpha)(?=.*float32\[5\])") as err:
        reap(lambda x: plant(f, tag="t")({"alpha": jnp.zeros(5)}, x))(X)
    files = [frame.filename for frame in traceback.extract_tb(err.value.__traceback__)]
    assert files and not [name for name in files if name.startswith(harvest_dir)], files


# -- a message sits beside its check ------------------------------------------

# A message raised in one place is written where it is raised. An `_errors.py` holds only
# what several places share: a layer's (`harvest/ppl/_errors.py`) what two of its modules
# use, the base `harvest/_errors.py` what two layers use.


def _layer(module):
    """A module's layer: its top folder under the package, or "base" for a top-level one."""
    parts = module.split("/")
    return parts[1] if len(parts) > 2 else "base"


def _errors_users(package):
    """{(errors module, name): the modules that use that top-level name of it}, for every
    `_errors.py` of `package`, each module named by its path from the package's parent."""
    root = package.parent
    names = {}
    for path in sorted(package.rglob("_errors.py")):
        for node in ast.parse(path.read_text()).body:
            targets = getattr(node, "targets", [node])
            for target in targets:
                name = getattr(target, "name", getattr(target, "id", None))
                if name and not name.startswith("_"):
                    names[path.relative_to(root).as_posix(), name] = set()
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        bound = {}  # local name -> the `_errors.py` it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                here = path.parent
                for _ in range(node.level - 1):
                    here = here.parent
                source = here.joinpath(*(node.module or "").split(".") if node.module else ())
                for alias in node.names:
                    if alias.name == "_errors":
                        bound[alias.asname or "_errors"] = source / "_errors.py"
                    elif source.name == "_errors":
                        errors = source.with_suffix(".py").relative_to(root).as_posix()
                        names.get((errors, alias.name), set()).add(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                errors = bound.get(node.value.id)
                if errors is not None and errors.exists():
                    key = (errors.relative_to(root).as_posix(), node.attr)
                    names.get(key, set()).add(module)
    return names


def _used_once(package):
    """The `_errors.py` names used too narrowly: a base one by fewer than two layers, a
    layer's by fewer than two modules (a message used once belongs beside its check)."""
    narrow = []
    for (errors, name), users in sorted(_errors_users(package).items()):
        spread = {_layer(m) for m in users} if _layer(errors) == "base" else users
        if len(spread) < 2:
            narrow.append(f"{errors}: {name} ({', '.join(sorted(users)) or 'unused'})")
    return narrow


def test_every_shared_message_is_shared():
    package = pathlib.Path(harvest_module.__file__).parent
    narrow = _used_once(package)
    assert not narrow, (
        "names of an _errors.py used too narrowly: write a message used in one module beside "
        "its check, and move one used by one layer into that layer's _errors.py: "
        + "; ".join(narrow)
    )


def test_the_shared_message_check_flags_a_message_used_once(tmp_path):
    # The check above must be able to fail.
    package = tmp_path / "pkg"
    (package / "_walk").mkdir(parents=True)
    (package / "_errors.py").write_text("def both(): ...\ndef walk_only(): ...\n")
    (package / "_walk" / "_errors.py").write_text("def shared(): ...\ndef once(): ...\n")
    (package / "_walk" / "_a.py").write_text(
        "from .. import _errors\nfrom . import _errors as walk_errors\n"
        "_errors.both(); _errors.walk_only(); walk_errors.shared(); walk_errors.once()\n"
    )
    (package / "_walk" / "_b.py").write_text(
        "from .._errors import walk_only\nfrom ._errors import shared\n"
    )
    (package / "_c.py").write_text("from . import _errors\n_errors.both()\n")
    assert _used_once(package) == [
        "pkg/_errors.py: walk_only (pkg/_walk/_a.py, pkg/_walk/_b.py)",
        "pkg/_walk/_errors.py: once (pkg/_walk/_a.py)",
    ]
