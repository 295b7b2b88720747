"""A repeated sweep: its result read when needed, its plan kept, and still right.

A sweep returns while its program runs (`PatchingResult` converts to NumPy when
first read), and a repeated sweep keeps its plan (the targets, sizes and axes)
keyed by the sites found and the clean values' shapes: every test here checks
the numbers against the model threaded by hand, or the errors against a first
sweep's.
"""

import copy
import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import PatchingResult, attribution_patching, patching_sweep, reap

nnx = pytest.importorskip("flax.nnx")

from test_no_retrace import (  # noqa: E402  (needs flax.nnx)
    Net,
    close,
    data,
    hand_attribution,
    hand_forward,
    hand_sweep,
    metric,
)


def hand_baseline(model, x_corrupt):
    return float(metric(hand_forward(model.w1[...], model.w2[...], x_corrupt)[0]))


@pytest.mark.parametrize("sweep", [patching_sweep, attribution_patching])
def test_a_result_still_computing_reads_as_numpy_everywhere(sweep):
    hand = hand_sweep if sweep is patching_sweep else hand_attribution
    model = Net()
    x_clean, x_corrupt = data()
    expected = hand(model.w1[...], model.w2[...], x_clean, x_corrupt)
    r = sweep(model, reap(model)(x_clean), (x_corrupt,), metric)
    assert "values" not in vars(r)  # returned before the program was waited for
    printed = repr(r)  # printing reads it
    assert "values=array(" in printed and "baseline=" in printed
    assert isinstance(r.values, np.ndarray) and r.values.flags.writeable
    close(r.values, expected)
    assert isinstance(r.baseline, float)
    np.testing.assert_allclose(r.baseline, hand_baseline(model, x_corrupt), rtol=1e-5)
    gap = r.baseline + 2.0
    close(r.normalized(gap).values, expected / 2.0)
    others = [
        sweep(model, reap(model)(x_clean), (x_corrupt,), metric) for _ in range(4)
    ]  # each its own
    assert jax.block_until_ready(others[0]) is others[0] and "values" in vars(others[0])
    close(pickle.loads(pickle.dumps(others[1])).values, expected)
    close(copy.deepcopy(others[2]).values, expected)
    replaced = dataclasses.replace(others[3], measure="m")
    close(replaced.values, expected)
    assert replaced.names == ("a", "b") and replaced.baseline == others[3].baseline
    with pytest.raises(AttributeError, match="no attribute 'valuez'"):
        r.valuez  # noqa: B018


def test_a_sweep_in_steps_waits_for_none_and_matches_one_step():
    model = Net()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    whole = patching_sweep(model, clean, (x_corrupt,), metric, axis=1)
    chunked = patching_sweep(model, clean, (x_corrupt,), metric, axis=1, batch_size=4)
    assert "values" not in vars(chunked)  # no progress bar: every step sent, none waited for
    close(chunked.values, whole.values)
    batches = patching_sweep(model, [clean, clean], [(x_corrupt,), (x_corrupt,)], metric)
    close(batches.values, hand_sweep(model.w1[...], model.w2[...], x_clean, x_corrupt))


def test_a_kept_plan_still_checks_the_clean_values_shapes_and_dtypes():
    model = Net()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    patching_sweep(model, clean, (x_corrupt,), metric)
    for bad in (clean["a"][:, :2], clean["a"].astype(jnp.int32)):
        with pytest.raises(ValueError, match="the clean value for the sow site .* but the site"):
            patching_sweep(model, dict(clean, a=bad), (x_corrupt,), metric)
    with pytest.raises(KeyError, match="has no value for 'a'"):
        patching_sweep(model, {"b": clean["b"]}, (x_corrupt,), metric, names=["a", "b"])


def test_a_kept_plan_follows_the_names_and_the_clean_sites_given():
    model = Net()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    expected = hand_sweep(model.w1[...], model.w2[...], x_clean, x_corrupt)
    close(patching_sweep(model, clean, (x_corrupt,), metric).values, expected)
    only_b = patching_sweep(model, {"b": clean["b"]}, (x_corrupt,), metric)
    assert only_b.names == ("b",)
    close(only_b.values, expected[1:])
    reordered = patching_sweep(model, clean, (x_corrupt,), metric, names=["b", "a"])
    assert reordered.names == ("b", "a")
    close(reordered.values, expected[::-1])
    # Positions: a new sweep axis is a new plan, its values those of each position by hand.
    by_position = patching_sweep(model, clean, (x_corrupt,), metric, axis=1)
    assert by_position.values.shape == (2, 3)
    close(by_position.values.sum(1), expected)  # the metric reads the last position alone


def test_a_second_model_of_the_same_structure_is_swept_with_its_own_weights():
    first, second = Net(seed=0), Net(seed=7)
    x_clean, x_corrupt = data()
    for model in (first, second, first, second):
        r = patching_sweep(model, reap(model)(x_clean), (x_corrupt,), metric)
        close(r.values, hand_sweep(model.w1[...], model.w2[...], x_clean, x_corrupt))
        np.testing.assert_allclose(r.baseline, hand_baseline(model, x_corrupt), rtol=1e-5)


def test_a_result_built_by_hand_is_unchanged():
    r = PatchingResult(np.array([[1.0, 2.0]]), ("h",), np.arange(2), axis=1, baseline=0.5)
    assert vars(r)["baseline"] == 0.5 and r.block_until_ready() is r


def test_a_repeated_sweep_keeps_its_plan_and_a_new_shape_makes_another(monkeypatch):
    from harvest._tools import _sweep_plan

    made = [0]
    real = _sweep_plan._chosen

    def counted(*args):
        made[0] += 1
        return real(*args)

    monkeypatch.setattr(_sweep_plan, "_chosen", counted)
    monkeypatch.setattr(_sweep_plan, "_plans", {})  # none kept from the tests before
    model = Net()
    x_clean, x_corrupt = data()
    for scale in (1.0, 2.0, 3.0):  # new data of the same shapes: one plan
        r = patching_sweep(model, reap(model)(x_clean * scale), (x_corrupt,), metric)
        close(r.values, hand_sweep(model.w1[...], model.w2[...], x_clean * scale, x_corrupt))
    assert made[0] == 1
    x_clean, x_corrupt = data(batch=3)
    r = patching_sweep(model, reap(model)(x_clean), (x_corrupt,), metric)
    close(r.values, hand_sweep(model.w1[...], model.w2[...], x_clean, x_corrupt))
    assert made[0] == 2


def test_a_sweep_inside_a_trace_is_refused_at_the_call_as_before():
    model = Net()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    with pytest.raises(jax.errors.TracerArrayConversionError, match=r"__array__\(\)"):
        jax.jit(lambda x: (patching_sweep(model, clean, (x,), metric), 0)[1])(x_corrupt)
