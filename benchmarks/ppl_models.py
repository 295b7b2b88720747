"""The five trial models of issue 25, each written in harvest.ppl, NumPyro and TFP.

Eight schools (non-centred), a hierarchical logistic regression, a two-component
Gaussian mixture (its assignment enumerated), an AR(1) state-space model drawn
in a `lax.scan` (centred and non-centred), and a changepoint model of counts.
Each `Trial` holds the three writings of one model, its observed data and a
point of its latent space, so that `tests/test_ppl_models.py` compares the
densities and posteriors and `benchmarks/bench_ppl.py` times them.

The data sets are tiny (the tests pay for every NUTS step) and generated here,
deterministically, by NumPy's PCG64 generator from fixed seeds:
`python -m benchmarks.ppl_models` prints them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], np.float32)
SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)
GROUPS, POINTS = 3, 30  # logistic regression: groups, points
STEPS = 12  # AR(1) length
DAYS = 20  # changepoint series length


def logistic_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [POINTS, 2], group of each point, 0/1 outcomes), seed 1."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(POINTS, 2)).astype(np.float32)
    group = np.arange(POINTS) % GROUPS
    logits = np.array([-0.5, 0.0, 0.8])[group] + x @ np.array([1.0, -0.5])
    y = (rng.uniform(size=POINTS) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return x, group, y


def mixture_data() -> np.ndarray:
    """40 points: about 30% around an unknown mean 2.0, the rest around the known -1.0, seed 2."""
    rng = np.random.default_rng(2)
    z = rng.uniform(size=40) < 0.3
    return (np.where(z, 2.0, -1.0) + rng.normal(size=40)).astype(np.float32)


def ar1_data() -> np.ndarray:
    """STEPS noisy observations (sd 0.5) of x_t = 0.7 x_{t-1} + 0.5 e_t, x_{-1} = 0, seed 3."""
    rng = np.random.default_rng(3)
    x, xs = 0.0, []
    for e in rng.normal(size=STEPS):
        x = 0.7 * x + 0.5 * e
        xs.append(x)
    return (np.array(xs) + 0.5 * rng.normal(size=STEPS)).astype(np.float32)


def changepoint_data() -> np.ndarray:
    """DAYS counts: rate 4 before day 8, rate 1 from it, seed 4."""
    rng = np.random.default_rng(4)
    return rng.poisson(np.where(np.arange(DAYS) < 8, 4.0, 1.0)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One model written three ways, with its data and a latent point.

    `harvest` is the program `key -> y`; `numpyro` the model with its
    observation inside (`obs=`); `tfp` a TFP joint distribution whose
    `log_prob` takes the latents and `"y"` (its discrete latents summed out, as
    harvest's enumeration does). `point` holds constrained latent values;
    `means` names the latents whose posterior means the tests compare.
    """

    name: str
    harvest: Callable[..., Any]
    numpyro: Callable[[], None]
    tfp: Any
    observed: dict[str, Any]
    point: dict[str, Any]
    means: tuple[str, ...]


def _tfd() -> Any:
    from harvest.ppl._tfp_shim import import_tfp

    return import_tfp().distributions


def eight_schools() -> Callable[[jax.Array], jax.Array]:
    """A fresh harvest.ppl program of eight schools (non-centred), `key -> y`: the one
    the trial and tests/test_ppl_unconstrained.py share (it needs no NumPyro)."""
    import harvest.ppl as ppl

    tfd = _tfd()
    sigma = jnp.asarray(SCHOOLS_SIGMA)

    def ours(key):
        k_mu, k_tau, k_theta, k_y = jax.random.split(key, 4)
        mu = ppl.random_variable(tfd.Normal(0.0, 5.0), name="mu")(k_mu)
        tau = ppl.random_variable(tfd.HalfCauchy(0.0, 5.0), name="tau")(k_tau)
        tilde = ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 1.0), 8), name="theta_tilde")(
            k_theta
        )
        theta = ppl.deterministic(mu + tau * tilde, name="theta")
        return ppl.random_variable(tfd.Independent(tfd.Normal(theta, sigma), 1), name="y")(k_y)

    return ours


def _eight_schools() -> Trial:
    import numpyro
    import numpyro.distributions as dist

    tfd = _tfd()
    y, sigma = jnp.asarray(SCHOOLS_Y), jnp.asarray(SCHOOLS_SIGMA)
    ours = eight_schools()

    def theirs():
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with numpyro.plate("J", 8):
            tilde = numpyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
            theta = numpyro.deterministic("theta", mu + tau * tilde)
            numpyro.sample("y", dist.Normal(theta, sigma), obs=y)

    joint = tfd.JointDistributionNamed(
        dict(
            mu=tfd.Normal(0.0, 5.0),
            tau=tfd.HalfCauchy(0.0, 5.0),
            theta_tilde=tfd.Sample(tfd.Normal(0.0, 1.0), 8),
            y=lambda mu, tau, theta_tilde: tfd.Independent(
                tfd.Normal(mu + tau * theta_tilde, sigma), 1
            ),
        )
    )
    point = {"mu": 1.0, "tau": 2.0, "theta_tilde": jnp.linspace(-1.0, 1.0, 8)}
    return Trial("eight schools", ours, theirs, joint, {"y": y}, point, ("mu", "tau"))


def _logistic() -> Trial:
    import numpyro
    import numpyro.distributions as dist

    import harvest.ppl as ppl

    tfd = _tfd()
    x, group, y = (jnp.asarray(a) for a in logistic_data())

    def ours(key):
        k_mu, k_sigma, k_a, k_beta, k_y = jax.random.split(key, 5)
        mu_a = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu_a")(k_mu)
        sigma_a = ppl.random_variable(tfd.HalfNormal(1.0), name="sigma_a")(k_sigma)
        a = ppl.random_variable(tfd.Sample(tfd.Normal(mu_a, sigma_a), GROUPS), name="a")(k_a)
        beta = ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 1.0), 2), name="beta")(k_beta)
        logits = a[group] + x @ beta
        return ppl.random_variable(tfd.Bernoulli(logits=logits, dtype=jnp.float32), name="y")(k_y)

    def theirs():
        mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 1.0))
        sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(1.0))
        with numpyro.plate("groups", GROUPS):
            a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
        with numpyro.plate("features", 2):
            beta = numpyro.sample("beta", dist.Normal(0.0, 1.0))
        with numpyro.plate("points", POINTS):
            numpyro.sample("y", dist.Bernoulli(logits=a[group] + x @ beta), obs=y)

    joint = tfd.JointDistributionNamed(
        dict(
            mu_a=tfd.Normal(0.0, 1.0),
            sigma_a=tfd.HalfNormal(1.0),
            a=lambda mu_a, sigma_a: tfd.Sample(tfd.Normal(mu_a, sigma_a), GROUPS),
            beta=tfd.Sample(tfd.Normal(0.0, 1.0), 2),
            y=lambda a, beta: tfd.Independent(tfd.Bernoulli(logits=a[group] + x @ beta), 1),
        )
    )
    point = {"mu_a": 0.2, "sigma_a": 0.7, "a": jnp.array([-0.4, 0.1, 0.6]), "beta": jnp.ones(2)}
    return Trial("logistic regression", ours, theirs, joint, {"y": y}, point, ("mu_a", "beta"))


def _mixture() -> Trial:
    import numpyro
    import numpyro.distributions as dist

    import harvest.ppl as ppl

    tfd = _tfd()
    y = jnp.asarray(mixture_data())
    n = y.shape[0]

    def ours(key):
        kw, km, kz, ky = jax.random.split(key, 4)
        w = ppl.random_variable(tfd.Beta(1.0, 1.0), name="w")(kw)
        mu = ppl.random_variable(tfd.Normal(0.0, 5.0), name="mu")(km)
        z = ppl.random_variable(
            tfd.Bernoulli(probs=jnp.full(n, w), dtype=jnp.float32), name="z", enumerate=True
        )(kz)
        return ppl.random_variable(tfd.Normal(z * mu - (1.0 - z), 1.0), name="y")(ky)

    def theirs():
        w = numpyro.sample("w", dist.Beta(1.0, 1.0))
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("data", n):
            z = numpyro.sample("z", dist.Bernoulli(w), infer={"enumerate": "parallel"})
            numpyro.sample("y", dist.Normal(jnp.where(z == 1, mu, -1.0), 1.0), obs=y)

    def marginal(w, mu):
        weights = tfd.Categorical(probs=jnp.broadcast_to(jnp.stack([1.0 - w, w]), (n, 2)))
        locs = jnp.broadcast_to(jnp.stack([-1.0, mu]), (n, 2))
        return tfd.Independent(tfd.MixtureSameFamily(weights, tfd.Normal(locs, 1.0)), 1)

    joint = tfd.JointDistributionNamed(
        dict(w=tfd.Beta(1.0, 1.0), mu=tfd.Normal(0.0, 5.0), y=marginal)
    )
    return Trial("mixture", ours, theirs, joint, {"y": y}, {"w": 0.3, "mu": 2.0}, ("w", "mu"))


def _ar1_priors(ppl: Any, tfd: Any, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    k_phi, k_sigma = jax.random.split(key)
    phi = ppl.random_variable(tfd.Uniform(-1.0, 1.0), name="phi")(k_phi)
    sigma = ppl.random_variable(tfd.HalfNormal(1.0), name="sigma")(k_sigma)
    return phi, sigma


def _ar1(centred: bool) -> Trial:
    import numpyro
    import numpyro.distributions as dist
    from numpyro.contrib.control_flow import scan as numpyro_scan

    import harvest.ppl as ppl

    tfd = _tfd()
    y = jnp.asarray(ar1_data())

    def path(phi, sigma, noise):  # x_t = phi x_{t-1} + sigma e_t from x_{-1} = 0
        return jax.lax.scan(lambda x, e: (phi * x + sigma * e,) * 2, jnp.zeros(()), noise)[1]

    if centred:

        def ours(key):
            k_prior, k_x, k_y = jax.random.split(key, 3)
            phi, sigma = _ar1_priors(ppl, tfd, k_prior)

            def step(x, k):
                x = ppl.random_variable(tfd.Normal(phi * x, sigma), name="x", mode="append")(k)
                return x, x

            _, xs = jax.lax.scan(step, jnp.zeros(()), jax.random.split(k_x, STEPS))
            return ppl.random_variable(tfd.Independent(tfd.Normal(xs, 0.5), 1), name="y")(k_y)

        def theirs():
            phi = numpyro.sample("phi", dist.Uniform(-1.0, 1.0))
            sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))

            def step(x, y_t):
                x = numpyro.sample("x", dist.Normal(phi * x, sigma))
                numpyro.sample("y", dist.Normal(x, 0.5), obs=y_t)
                return x, None

            numpyro_scan(step, jnp.zeros(()), y)

        latent = "x"
        states = lambda phi, sigma: tfd.MarkovChain(  # noqa: E731
            tfd.Normal(0.0, sigma), lambda _, x: tfd.Normal(phi * x, sigma), STEPS
        )
        observation = lambda x: tfd.Independent(tfd.Normal(x, 0.5), 1)  # noqa: E731
    else:

        def ours(key):
            k_prior, k_e, k_y = jax.random.split(key, 3)
            phi, sigma = _ar1_priors(ppl, tfd, k_prior)
            noise = ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 1.0), STEPS), name="e")(k_e)
            xs = path(phi, sigma, noise)
            return ppl.random_variable(tfd.Independent(tfd.Normal(xs, 0.5), 1), name="y")(k_y)

        def theirs():
            phi = numpyro.sample("phi", dist.Uniform(-1.0, 1.0))
            sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
            with numpyro.plate("steps", STEPS):
                noise = numpyro.sample("e", dist.Normal(0.0, 1.0))
                numpyro.sample("y", dist.Normal(path(phi, sigma, noise), 0.5), obs=y)

        latent = "e"
        states = lambda: tfd.Sample(tfd.Normal(0.0, 1.0), STEPS)  # noqa: E731
        observation = lambda phi, sigma, e: tfd.Independent(  # noqa: E731
            tfd.Normal(path(phi, sigma, e), 0.5), 1
        )

    joint = tfd.JointDistributionNamed(
        {
            "phi": tfd.Uniform(-1.0, 1.0),
            "sigma": tfd.HalfNormal(1.0),
            latent: states,
            "y": observation,
        }
    )
    point = {"phi": 0.5, "sigma": 0.6, latent: jnp.linspace(-1.0, 1.0, STEPS)}
    name = "AR(1) " + ("centred" if centred else "non-centred")
    return Trial(name, ours, theirs, joint, {"y": y}, point, ("phi", "sigma"))


def _changepoint() -> Trial:
    import numpyro
    import numpyro.distributions as dist

    import harvest.ppl as ppl

    tfd = _tfd()
    y = jnp.asarray(changepoint_data())
    days = jnp.arange(DAYS, dtype=jnp.float32)

    def rate(early, late, switch):  # a smooth switch, so the gradient sees the changepoint
        return early + (late - early) * jax.nn.sigmoid(days - switch)

    def ours(key):
        k_e, k_l, k_s, k_y = jax.random.split(key, 4)
        early = ppl.random_variable(tfd.Exponential(0.5), name="early")(k_e)
        late = ppl.random_variable(tfd.Exponential(0.5), name="late")(k_l)
        switch = ppl.random_variable(tfd.Uniform(0.0, float(DAYS)), name="switch")(k_s)
        return ppl.random_variable(tfd.Poisson(rate(early, late, switch)), name="y")(k_y)

    def theirs():
        early = numpyro.sample("early", dist.Exponential(0.5))
        late = numpyro.sample("late", dist.Exponential(0.5))
        switch = numpyro.sample("switch", dist.Uniform(0.0, float(DAYS)))
        with numpyro.plate("days", DAYS):
            numpyro.sample("y", dist.Poisson(rate(early, late, switch)), obs=y)

    joint = tfd.JointDistributionNamed(
        dict(
            early=tfd.Exponential(0.5),
            late=tfd.Exponential(0.5),
            switch=tfd.Uniform(0.0, float(DAYS)),
            y=lambda early, late, switch: tfd.Independent(
                tfd.Poisson(rate(early, late, switch)), 1
            ),
        )
    )
    point = {"early": 3.0, "late": 1.5, "switch": 9.0}
    return Trial("changepoint", ours, theirs, joint, {"y": y}, point, ("early", "late", "switch"))


BUILDERS: dict[str, Callable[[], Trial]] = {
    "eight schools": _eight_schools,
    "logistic regression": _logistic,
    "mixture": _mixture,
    "AR(1) centred": lambda: _ar1(centred=True),
    "AR(1) non-centred": lambda: _ar1(centred=False),
    "changepoint": _changepoint,
}


def trial(name: str) -> Trial:
    """A fresh `Trial` (new functions, so nothing is cached yet) of the model `name`."""
    return BUILDERS[name]()


def numpyro_log_density(t: Trial, latents: dict[str, Any]) -> jax.Array:
    """NumPyro's log joint of `t` at `latents` (discrete latents enumerated by funsor)."""
    if t.name == "mixture":
        from numpyro.contrib.funsor import enum, log_density

        # One plate: the enumerated dimension goes to its left.
        return log_density(enum(t.numpyro, first_available_dim=-2), (), {}, latents)[0]
    from numpyro.infer.util import log_density

    return log_density(t.numpyro, (), {}, latents)[0]


if __name__ == "__main__":
    np.set_printoptions(precision=3, suppress=True)
    print("logistic regression:", *logistic_data(), sep="\n")
    print("mixture:", mixture_data())
    print("AR(1):", ar1_data())
    print("changepoint:", changepoint_data())
