"""`predictive`: prior and posterior predictive draws of every site of a program.

The prior predictive is `trace(model)` over fresh keys. The posterior
predictive runs the program once per posterior draw with that draw's latent
values planted (by `intervene`) and everything else drawn afresh, so the
observed variables are predicted and every `deterministic` site is
recomputed. The program given may differ from the one the posterior came
from by an intervention: `predictive(intervene(model, t=0.0), key,
posterior=posterior)` predicts under do(t=0) from what was learnt without it. Latents that the
given program no longer draws (an intervention on one of them) keep the
intervened value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._typing import Reaped
from ._infer_discrete import infer_discrete as _infer_discrete
from ._names import leaf_paths, merged, random_variables_of, restricted
from ._old_spellings import posterior_first
from ._posterior import Posterior
from ._transforms import intervene, trace


def _sites(model: Callable[..., Any], key: jax.Array, args: tuple[Any, ...]) -> Reaped:
    return trace(model)(key, *args)[1]


def predictive(
    model: Callable[..., Any],
    key: jax.Array,
    *args: Any,
    posterior: Posterior | None = None,
    num_samples: int | None = None,
    infer_discrete: bool = False,
) -> Reaped:
    """Draws every site of ``model`` from its prior, or from its posterior predictive.

    With ``posterior=None``, ``num_samples`` independent runs of the program:
    every random variable and ``deterministic`` site, stacked on a leading
    axis. With a ``Posterior`` (from ``sample_posterior``), one run per
    posterior draw, shaped ``[chains, draws, ...]``: the posterior's latent
    values are planted, every other draw (the observed variables, say) is
    made afresh and every ``deterministic`` site is recomputed. ``model`` may
    be the posterior's program under an ``intervene``: latents it fixes keep
    their intervened values.

    An enumerated draw (``random_variable(..., enumerate=True)``) is summed
    out by the sampler, so the posterior holds no value of it: by default
    each run draws it afresh from its *prior* given the continuous draws,
    not from its posterior given the data. ``infer_discrete=True`` plants,
    instead, a draw from its conditional posterior given the continuous draws
    and the observations the posterior was sampled with (``infer_discrete``).

    Args:
        model: the program ``model(key, *args)``.
        key: the PRNG key; each run gets its own split of it.
        *args: the program's own arguments.
        posterior: the ``Posterior`` to predict from, or ``None`` for the prior.
            (The old order ``predictive(model, posterior, key, *args)`` still works
            for one release, with a DeprecationWarning.)
        num_samples: how many prior runs (only with ``posterior=None``).
        infer_discrete: draw the enumerated draws from their posterior (see above)
            rather than their prior; needs ``posterior``.

    Returns:
        ``{name: array}`` for every site (scoped names as nested dicts).

    Raises:
        ValueError: without a posterior, if ``num_samples`` is not a positive int or
            ``infer_discrete`` is asked.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     ppl.deterministic(2.0 * z, name="twice")
        ...     return ppl.random_variable(tfd.Normal(z, 0.1), name="y")(k2)
        >>> prior = ppl.predictive(model, jax.random.key(0), num_samples=1000)
        >>> sorted(prior), prior["y"].shape
        (['twice', 'y', 'z'], (1000,))
        >>> bool(jnp.all(prior["twice"] == 2.0 * prior["z"]))
        True
    """
    key, args, posterior = posterior_first("predictive", key, args, posterior, Posterior)
    if posterior is None:
        if infer_discrete:
            raise ValueError(
                "predictive: infer_discrete=True draws the enumerated draws from their posterior, "
                "so it needs a Posterior; with posterior=None every draw is from the prior already."
            )
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(
                "predictive(model, key, num_samples=n) draws n runs from the prior and needs "
                f"`num_samples` to be a positive int, got {num_samples!r}; or give a Posterior to predict from."
            )
        keys = jax.random.split(key, num_samples)
        prior: Reaped = jax.jit(jax.vmap(lambda k: _sites(model, k, args)))(keys)
        return prior
    lead = posterior.log_density.shape
    still_random = set(random_variables_of(model, (key, *args), {}))
    latents = set(leaf_paths(posterior.unconstrained)) & still_random
    values = restricted(posterior.samples, latents)
    if infer_discrete:
        key, k_discrete = jax.random.split(key)
        values = merged(values, _infer_discrete(model, k_discrete, *args, posterior=posterior))
    keys = jax.random.split(key, lead[0] * lead[1]).reshape(lead)

    def one(k: jax.Array, draw: Reaped) -> Reaped:
        return {**draw, **_sites(intervene(model, **draw), k, args)}

    predicted: Reaped = jax.jit(jax.vmap(jax.vmap(one)))(keys, values)
    return predicted
