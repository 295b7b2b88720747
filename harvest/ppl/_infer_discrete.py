"""`infer_discrete`: the enumerated draws, sampled from their posterior.

`sample_posterior` samples the continuous latents of a program whose
discrete draws are summed out (`random_variable(..., enumerate=True)`); the
sum hides which assignment explains the data. For each posterior draw of the
continuous latents, `infer_discrete` draws the enumerated ones from their
conditional posterior given it and the observations: exactly, from the
normalised joint over every assignment (scalar draws) or element by element
(a per-point assignment), and by forward filtering, backward sampling for a
draw made at each step of a scan (`_markov.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._typing import Reaped
from ._old_spellings import posterior_first
from ._posterior import Posterior
from ._unconstrained import discrete_draw


def infer_discrete(
    model: Callable[..., Any],
    key: jax.Array,
    *args: Any,
    posterior: Posterior | None = None,
    observed: Mapping[str, Any] | None = None,
) -> Reaped:
    """Draws the enumerated random variables of ``model`` from their posterior.

    One draw per posterior draw, from the conditional posterior of the
    enumerated draws given that draw's continuous latents and ``observed``:
    exact for scalar draws (over every joint assignment) and per-point ones
    (element by element), and by forward filtering, backward sampling for a
    draw enumerated at each step of a ``lax.scan``.

    Args:
        model: the program ``model(key, *args)`` the posterior was sampled from.
        key: the PRNG key; each posterior draw gets its own split of it.
        *args: the program's own arguments.
        posterior: the ``Posterior`` (``sample_posterior``'s) of its continuous latents
            (required; the old order ``infer_discrete(model, posterior, key, *args)``
            still works for one release, with a DeprecationWarning).
        observed: ``{name: value}``; None: the observations ``posterior`` was sampled with.

    Returns:
        ``{name: array [chains, draws, ...]}`` for each enumerated draw.

    Raises:
        ValueError: if the program has no free enumerated draw.
        TypeError: if ``posterior`` is not a ``Posterior``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def mixture(key):
        ...     k1, k2, k3 = jax.random.split(key, 3)
        ...     scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k1)
        ...     z = ppl.random_variable(tfd.Bernoulli(probs=0.5), name="z", enumerate=True)(k2)
        ...     return ppl.random_variable(tfd.Normal(10.0 * z - 5.0, scale), name="y")(k3)
        >>> posterior = ppl.sample_posterior(mixture, jax.random.key(0), observed={"y": 5.0},
        ...                                  num_samples=100, num_warmup=100, num_chains=1)
        >>> z = ppl.infer_discrete(mixture, jax.random.key(1), posterior=posterior)["z"]
        >>> z.shape, bool(z.mean() > 0.99)  # y = 5 sits on the component at +5
        ((1, 100), True)
    """
    key, args, posterior = posterior_first("infer_discrete", key, args, posterior, Posterior)
    if not isinstance(posterior, Posterior):
        raise TypeError(
            f"infer_discrete: `posterior` must be a Posterior (sample_posterior's), got a "
            f"{type(posterior).__name__}."
        )
    given = dict(posterior.observed if observed is None else observed)
    lead = posterior.log_density.shape
    keys = jax.random.split(key, lead[0] * lead[1]).reshape(lead)

    def one(k: jax.Array, u: Reaped) -> Reaped:
        return discrete_draw(model, given, u, k, *args)

    drawn: Reaped = jax.jit(jax.vmap(jax.vmap(one)))(keys, posterior.unconstrained)
    return drawn
