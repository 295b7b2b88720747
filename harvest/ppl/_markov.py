"""A draw enumerated at each step of a `lax.scan`, summed out by a forward pass.

A hidden Markov model is a scan whose step draws the state `z[t]` (a scalar
`Bernoulli` or `Categorical`, `mode="append"`, `enumerate=True`) from the
state carried in from step `t - 1`, then scores what it observes given
`z[t]`. Summing over every joint assignment takes `K**T` terms; the forward
algorithm takes `T` steps of `K x K`, which needs each step's factor as a
function of `(z[t-1], z[t])` alone (the Markov property: the carry holds the
state, nothing else the draws changed; the model's promise, as NumPyro's
`markov` is).

Those factors come from the program itself, run `K * K` times side by side
under `vmap`: run `(j, k)` plants the path `j, k, j, k, ...`, so at an odd
step `t` it holds `(z[t-1], z[t]) = (j, k)` and at an even one `(k, j)`;
together the runs give every step's factor at every pair of states. A density
of the scan's length `T` (the per-step densities, stacked) is step `t`'s
factor; any other density must not depend on the draw (it is found batched
under that `vmap` otherwise, and refused). The forward pass, and the backward
sampling of `infer_discrete`, are then scans of their own over the `T`
factors: linear in the length, under `jit`, `grad` and `vmap`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from .._typing import Reaped
from . import _errors
from ._names import density_leaves, nested

if TYPE_CHECKING:
    from ._enumerate import Support


def chain_factors(
    densities: Callable[[Reaped], Reaped], name: str, support: Support
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(start [K], steps [T, K, K], rest)`: `start[k]` the log factor of step 0 at
    `z[0] = k`, `steps[t, j, k]` that of step `t` at `(z[t-1], z[t]) = (j, k)`, `rest` the
    densities that do not depend on the draw."""
    size, (length,), dtype = support.size, support.batch, support.dtype
    odd = jnp.arange(length) % 2 == 1

    def run(j: jax.Array, k: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        path = jnp.where(odd, k, j).astype(dtype)
        found = density_leaves(densities(nested([name], [path])))
        per_step = [d for _, d in found if d.shape[:1] == (length,)]
        step = sum((jnp.sum(d.reshape(length, -1), axis=1) for d in per_step), jnp.zeros(length))
        return step, [jnp.sum(d) for _, d in found if d.shape[:1] != (length,)]

    states = jnp.arange(size)
    pair = jax.vmap(jax.vmap(run, (None, 0), (0, None)), (0, None), (0, None))
    try:
        factors, rest = pair(states, states)  # factors[j, k, t]
    except ValueError:
        raise _errors.enumeration_in_scan(
            [name],
            f"a density not shaped like the scan's {length} steps depends on {name!r}",
        ) from None
    start = jnp.diagonal(factors[:, :, 0])
    # At odd steps run (j, k) holds (z[t-1], z[t]) = (j, k); at even ones (k, j).
    by_step = jnp.moveaxis(factors, -1, 0)
    steps = jnp.where(odd[:, None, None], by_step, jnp.swapaxes(by_step, 1, 2))
    return start, steps, sum(rest, jnp.zeros(()))


def forward(start: jax.Array, steps: jax.Array) -> jax.Array:
    """`alpha [T, K]`: `alpha[t, k]` the log of the summed factors of steps `0..t` over
    the paths that end in state `k` at step `t`."""

    def step(alpha: jax.Array, factor: jax.Array) -> tuple[jax.Array, jax.Array]:
        new = jax.nn.logsumexp(alpha[:, None] + factor, axis=0)
        return new, new

    _, rest = jax.lax.scan(step, start, steps[1:])
    return jnp.concatenate([start[None], rest])


def backward_sample(key: jax.Array, alpha: jax.Array, steps: jax.Array) -> jax.Array:
    """A path `z [T]` from the posterior the factors define (forward filtering, backward
    sampling): `z[T-1]` from `alpha[T-1]`, then each `z[t]` given `z[t+1]`."""
    length = alpha.shape[0]
    keys = jax.random.split(key, length)
    last = jax.random.categorical(keys[-1], alpha[-1])

    def step(after: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
        k, a, factor = xs  # alpha[t], steps[t + 1]
        z = jax.random.categorical(k, a + factor[:, after])
        return z, z

    _, earlier = jax.lax.scan(step, last, (keys[:-1], alpha[:-1], steps[1:]), reverse=True)
    return jnp.concatenate([earlier, last[None]])
