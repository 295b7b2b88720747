"""`counterfactual`: "what would have happened under do(...), given what was seen", with one model.

Abduction, action, prediction (Pearl), on twin worlds that share every
draw's exogenous noise (`_mechanisms.py` says which distributions have a
noise mechanism, and which noise):

1. abduction: the latents are drawn from their posterior given `observed`
   (NUTS through `sample_posterior`; nothing to sample when every draw is
   observed). For each posterior draw, the factual program runs with every
   value planted, and each draw files the noise that explains its value
   (exactly, for location-scale families; drawn from the value's interval,
   for discrete ones);
2. action: the program under `intervene(model, **do)`;
3. prediction: that program runs with every draw's noise planted, so each
   draw downstream of the intervention is recomputed from its own noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import Partial

from .._calling._transforms import call_and_reap, plant
from .._typing import Reaped
from ._names import check_drawn, leaf_paths, restricted
from ._posterior import sample_posterior
from ._tags import ABDUCED, DETERMINISTIC, NOISE, RANDOM_VARIABLE, noise_explicit
from ._transforms import intervene
from ._unconstrained import unconstrained


@dataclasses.dataclass(frozen=True)
class Counterfactual:
    """Both worlds of a counterfactual query, one row per sample.

    Attributes:
        factual: ``{name: [n, ...]}``: the world that was seen: the latents'
            posterior draws, the observed values and the ``deterministic`` sites.
        counterfactual: ``{name: [n, ...]}``: every draw and ``deterministic``
            site in the world under the intervention, with the noise shared.
        noise: ``{name: [n, ...]}``: each draw's exogenous noise, as abduced.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> def scm(key):
        ...     kx, ky = jax.random.split(key)
        ...     x = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="x")(kx)
        ...     return ppl.random_variable(tfp.distributions.Normal(x, 1.0), name="y")(ky)
        >>> worlds = ppl.counterfactual(scm, jax.random.key(0), observed={"x": 0.0, "y": 1.0},
        ...                             do={"x": 2.0}, num_samples=1)
        >>> worlds.factual["y"], worlds.noise["y"], worlds.counterfactual["y"]
        (Array([1.], dtype=float32, weak_type=True), Array([1.], dtype=float32), Array([3.], dtype=float32))
    """

    factual: Reaped
    counterfactual: Reaped
    noise: Reaped


def _factual(
    model: Callable[..., Any], values: Reaped, key: Any, *args: Any
) -> tuple[Reaped, Reaped]:
    """The factual world: every value planted; `(deterministic sites, abduced noise)`."""
    planted = Partial(plant(model, tag=RANDOM_VARIABLE), values)
    (_, recorded), noise = call_and_reap(call_and_reap(planted, tag=DETERMINISTIC), tag=ABDUCED)(
        key, *args
    )
    return recorded, noise


def _predicted(
    program: Callable[..., Any], noise: Reaped, key: Any, *args: Any
) -> tuple[Reaped, Reaped]:
    """The world of `program` with every draw's noise planted: `(draws, deterministic sites)`."""
    from_noise = Partial(plant(program, tag=NOISE), noise)
    (_, recorded), draws = call_and_reap(
        call_and_reap(from_noise, tag=DETERMINISTIC), tag=RANDOM_VARIABLE
    )(key, *args)
    return draws, recorded


def _rows(tree: Reaped, n: int) -> Reaped:
    rows: Reaped = jax.tree_util.tree_map(lambda v: jnp.broadcast_to(v, (n, *jnp.shape(v))), tree)
    return rows


def counterfactual(
    model: Callable[..., Any],
    key: jax.Array,
    *args: Any,
    observed: Mapping[str, Any],
    do: Mapping[str, Any],
    num_samples: int = 1000,
    num_warmup: int = 1000,
    num_chains: int = 4,
    kernel: str = "nuts",
) -> Counterfactual:
    """Answers "what would the draws have been under ``do``, given ``observed``?".

    One model, twin worlds: the factual world (as observed, its latents
    inferred) and the world under ``intervene(model, **do)``, sharing every
    draw's exogenous noise. Draws downstream of the intervention are
    recomputed from their own noise; draws upstream of it keep their values.

    Args:
        model: the program ``model(key, *args)``.
        key: the PRNG key for the posterior, the abduction and the prediction.
        *args: the program's own arguments.
        observed: ``{name: value}``: what was seen in the factual world.
        do: ``{name: value}``: the intervention of the counterfactual world.
        num_samples: posterior draws per chain (or, when every draw is
            observed, abductions of the discrete draws' noise).
        num_warmup: warmup steps per chain for the posterior of the latents.
        num_chains: chains for the posterior of the latents (4, as in ``sample_posterior``).
        kernel: ``"nuts"`` or ``"hmc"``, as in ``sample_posterior``.

    Returns:
        A ``Counterfactual``: ``factual``, ``counterfactual`` and ``noise``,
        each ``{name: [n, ...]}``.

    Raises:
        ValueError: if ``do`` is empty or names a variable the model does not draw
            (checked before anything is sampled), or a draw has no noise mechanism
            (``_mechanisms.py`` lists the distributions that have one).
        ImportError: if latents must be sampled and BlackJAX is not installed.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def scm(key):  # y = x + noise
        ...     kx, ky = jax.random.split(key)
        ...     x = ppl.random_variable(tfd.Normal(0.0, 1.0), name="x")(kx)
        ...     return ppl.random_variable(tfd.Normal(x, 1.0), name="y")(ky)
        >>> seen = {"x": 1.0, "y": 1.5}  # so y's noise was 0.5
        >>> worlds = ppl.counterfactual(scm, jax.random.key(0), observed=seen, do={"x": 3.0},
        ...                             num_samples=4)
        >>> worlds.counterfactual["y"]  # 3.0 + the same noise
        Array([3.5, 3.5, 3.5, 3.5], dtype=float32)
    """
    observed, do = dict(observed), dict(do)
    if not do:
        raise ValueError(
            f"counterfactual needs `do` to name the intervention, {{name: value}}, got {do!r}."
        )
    k_posterior, k_worlds = jax.random.split(key)
    # Names first: a typo would otherwise surface only after the whole abduction run.
    check_drawn("counterfactual", model, list(do), (k_posterior, *args), {})
    if unconstrained(model, observed).init(k_posterior, *args):
        posterior = sample_posterior(
            model,
            k_posterior,
            *args,
            observed=observed,
            num_samples=num_samples,
            num_warmup=num_warmup,
            num_chains=num_chains,
            kernel=kernel,
        )
        drawn = restricted(posterior.samples, set(leaf_paths(posterior.unconstrained)))
        latents = jax.tree_util.tree_map(lambda v: v.reshape(-1, *v.shape[2:]), drawn)
        n = num_chains * num_samples
    else:
        latents, n = {}, num_samples
    action = intervene(model, **do)

    def twin_worlds(k: jax.Array, latent: Reaped) -> tuple[Reaped, Reaped, Reaped, Reaped]:
        with noise_explicit():
            recorded, noise = _factual(model, {**latent, **observed}, k, *args)
            draws, predicted = _predicted(action, noise, k, *args)
        return recorded, noise, draws, predicted

    keys = jax.random.split(k_worlds, n)
    recorded, noise, draws, predicted = jax.jit(jax.vmap(twin_worlds))(keys, latents)
    factual = {**latents, **_rows(observed, n), **recorded}
    world = {**draws, **_rows(do, n), **predicted}
    return Counterfactual(factual, world, noise)
