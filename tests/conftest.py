"""Hypothesis settings for the whole suite, and `close`, the pytree comparison tests share.

The default profile draws the same examples on every run and keeps no example
database, so a test's verdict depends only on the code, never on what an
earlier run happened to find. `HYPOTHESIS_PROFILE=explore` draws fresh random
examples (and remembers failures in .hypothesis/, which git ignores) for
hunting bugs locally.

On a TPU, float32 matmuls run at full precision (`jax_default_matmul_precision`
"highest"), so the suite's CPU tolerances hold on CPU, GPU and TPU alike.

`make test-fast` sets two caps: `HARVEST_MAX_EXAMPLES=N` runs every property
test with at most N examples (including those that set their own count), and
`HARVEST_MAX_CASES=N` keeps at most N cases of each parametrized test (the
first, the last and evenly spaced ones between), so every test still runs. It
also deselects the `slow` marker, which `SLOW` puts here on whole files and
single tests (one list, rather than a line in each file).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings

settings.register_profile("deterministic", database=None, derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


# Files (every test in them) and single tests (`file::name`) marked `slow`: each is a long
# end-to-end run whose modules other, faster tests (or the docstring examples) also reach.
# `make test` and the matrix run them.
SLOW = {
    "test_instrument_gemma.py": "builds and runs DeepMind's gemma model",
    "test_instrument_penzai_sampling.py": "KV-cached Penzai decodes (test_instrument_penzai stays)",
    "test_ppl_posterior.py": "BlackJAX NUTS chains (the docstring examples sample too)",
    "test_ppl_counterfactual.py": "BlackJAX NUTS chains (the docstring examples run it too)",
    "test_ppl_inference_gym.py": "BlackJAX NUTS on three inference-gym targets (some 40 s)",
    "test_store_multiprocess.py": "two writer processes and a SIGKILL",
    "test_typing.py": "a mypy run (make lint runs mypy on the package)",
    "test_ppl_bench.py": "the bench harness's two densities, against NumPyro",
    "test_ppl_unconstrained.py::test_hmc_on_the_unconstrained_density_recovers_the_recorded_"
    "posterior_mean": "an HMC chain",
    "test_robustness.py::test_threads_calling_harvested_functions_get_correct_results": (
        "400 calls from 8 threads"
    ),
    "test_patching.py::test_progress_bar_over_chunks": "a chunked sweep per progress option",
    "test_patching.py::test_a_dataset_sweep_is_the_mean_of_per_batch_hand_results": (
        "a sweep over a dataset of batches"
    ),
    "test_many_devices.py": "8-device checks in their own processes",
    "test_instrument_attention.py": "hooks on four libraries' attention (the Penzai hooks stay)",
    "test_store.py::test_resume_after_sigkill_is_bit_identical_to_an_uninterrupted_run": (
        "a recording process killed and resumed"
    ),
    "test_autodiff.py::test_grad_of_odeint_with_a_sow_in_the_vector_field": "an ODE solve under grad",
    "test_autodiff.py::test_grad_of_a_plant_inside_odeint_is_the_hand_threaded_adjoint": (
        "ODE solves under grad and jit(grad)"
    ),
    "test_autodiff.py::test_grad_of_a_plant_inside_odeint_of_a_number_or_a_callable_and_"
    "under_harvest": "ODE solves under grad",
    "test_ppl_predictive.py": "predictive runs over many draws (its docstring examples stay)",
    "test_induction_model.py::test_the_shipped_weights_solve_the_task_and_are_small": (
        "a 200-sequence forward of the guide's model"
    ),
}


def pytest_configure(config):
    # A TPU multiplies float32 matrices in reduced precision by default (bfloat16
    # passes); the suite compares against float32 references computed on the CPU,
    # so on a TPU it asks for full precision, as CPUs and GPUs compute by default.
    if jax.default_backend() == "tpu":
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_itemcollected(item):
    name = getattr(item, "originalname", item.name)
    if item.path.name in SLOW or f"{item.path.name}::{name}" in SLOW:
        item.add_marker("slow")


def pytest_collection_modifyitems(config, items):
    cases = os.environ.get("HARVEST_MAX_CASES")
    if cases:
        kept = _fewer_cases(items, int(cases))
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    cap = os.environ.get("HARVEST_MAX_EXAMPLES")
    if not cap:
        return
    for item in items:
        test = getattr(item, "obj", None)
        # A test's own @settings win over any profile, so the cap rewrites them: Hypothesis
        # keeps them on the test function under this (long-stable) attribute.
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is not None and own.max_examples > int(cap):
            test._hypothesis_internal_use_settings = settings(own, max_examples=int(cap))


def _fewer_cases(items, most):
    """At most `most` cases of each parametrized test function, spread over its cases."""
    by_function = {}
    for item in items:
        function = (item.path, getattr(item, "originalname", item.name))
        by_function.setdefault(function, []).append(item)
    keep = set()
    for cases in by_function.values():
        step = max(1, len(cases) - 1) / max(1, most - 1)
        keep.update(id(cases[round(i * step)]) for i in range(min(most, len(cases))))
    return [item for item in items if id(item) in keep]


# A TPU's transcendental functions (sin, exp, tanh) agree with a CPU's to four or five
# digits: a comparison of two programs that compute them in another order uses this.
TRANSCENDENTAL_RTOL = 2e-4 if jax.default_backend() == "tpu" else 1e-5


def close(a, b, rtol=1e-5, atol=1e-6):
    """Asserts that pytrees `a` and `b` match: same structure, same leaf shapes,
    values equal within `rtol`/`atol`. Test modules import it (`from conftest import close`)."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), (a, b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert jnp.shape(x) == jnp.shape(y), (jnp.shape(x), jnp.shape(y))
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
