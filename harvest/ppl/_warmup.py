"""Stan's warmup for BlackJAX's NUTS and HMC, as Stan and NumPyro run it.

BlackJAX's `window_adaptation` starts the step size at 1 and keeps the
window's averaged step size after each mass-matrix update. Stan and NumPyro
instead search for a reasonable step size (double or halve it until one
leapfrog step's acceptance crosses the target) at the start and again after
each new mass matrix, since a new metric changes which step size fits (on
inference-gym's centred eight schools, 7 divergences and bulk ESS 972 become
1 and 1059, as NumPyro's; see the ppl guide). The pieces are BlackJAX's own (its schedule of fast and
slow windows, dual averaging, the Welford mass-matrix estimate with Stan's
regularisation, the step-size search); this module only orders them as Stan does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._typing import Reaped


def flat(position: Reaped) -> jax.Array:
    return ravel_pytree(position)[0]


# `kernel(step_size, inverse_mass_matrix)` -> `step(key, state) -> (state, info)`.
Kernel = Callable[[Any, jax.Array], Callable[..., Any]]


def stan_warmup(
    kernel: Kernel,
    initial_state: Any,
    position: Reaped,
    key: jax.Array,
    num_steps: int,
    target_acceptance_rate: float,
    dense_mass: bool,
) -> tuple[Any, dict[str, jax.Array]]:
    """Runs `num_steps` of warmup from `initial_state`: the last state and the adapted
    `{"step_size", "inverse_mass_matrix"}`, as BlackJAX's kernels take them."""
    from blackjax.adaptation.mass_matrix import (  # type: ignore[import-untyped]
        mass_matrix_adaptation,
    )
    from blackjax.adaptation.step_size import (  # type: ignore[import-untyped]
        dual_averaging_adaptation,
        find_reasonable_step_size,
    )
    from blackjax.adaptation.window_adaptation import (  # type: ignore[import-untyped]
        build_schedule,
    )

    mm_init, mm_update, mm_final = mass_matrix_adaptation(not dense_mass)
    da_init, da_update, _ = dual_averaging_adaptation(target_acceptance_rate)
    with jax.ensure_compile_time_eval():  # the schedule is static: (window kind, window ends)
        schedule = np.asarray(build_schedule(num_steps), dtype=np.int32).reshape(-1, 2)

    def searched(k: jax.Array, state: Any, metric: Any, start: jax.Array) -> Any:
        def kernel_at(step_size: Any) -> Any:
            return kernel(step_size, metric.inverse_mass_matrix)

        size = find_reasonable_step_size(k, kernel_at, state, start, target_acceptance_rate)
        return da_init(size)

    k_first, k_steps = jax.random.split(key)
    metric = mm_init(flat(position).shape[0])
    averaging = searched(k_first, initial_state, metric, jnp.asarray(1.0, jnp.float32))

    def one_step(carry: Any, xs: Any) -> Any:
        state, metric, averaging = carry
        (slow, window_ends), k = xs
        k_step, k_search = jax.random.split(k)
        step_size = jnp.exp(averaging.log_step_size)
        state, info = kernel(step_size, metric.inverse_mass_matrix)(k_step, state)
        averaging = da_update(averaging, info.acceptance_rate)
        metric = jax.lax.cond(
            slow == 1, lambda m: mm_update(m, flat(state.position)), lambda m: m, metric
        )

        def new_metric(carry: Any) -> Any:
            metric, averaging = carry
            metric = mm_final(metric)
            return metric, searched(k_search, state, metric, jnp.exp(averaging.log_step_size))

        metric, averaging = jax.lax.cond(
            window_ends == 1, new_metric, lambda c: c, (metric, averaging)
        )
        return (state, metric, averaging), None

    xs = ((schedule[:, 0], schedule[:, 1]), jax.random.split(k_steps, num_steps))
    (state, metric, averaging), _ = jax.lax.scan(one_step, (initial_state, metric, averaging), xs)
    step_size = jnp.exp(averaging.log_step_size_avg)
    return state, {"step_size": step_size, "inverse_mass_matrix": metric.inverse_mass_matrix}
