"""sample_posterior's defaults on inference-gym targets, against the gym's ground truth.

Each target is written as a harvest.ppl program, its joint density checked
against the gym's own `unnormalized_log_prob` at a prior draw, and its
posterior means checked against the gym's ground truth (long Stan runs)
in Monte-Carlo standard errors, with R-hat and divergences bounded. The bound
on the largest of a target's d z-scores is Bonferroni's at a family-wise 1e-4
(a correct sampler fails it once in ten thousand runs): 4.4 for eight schools'
10 means, 4.9 for stochastic volatility's 103, where a flat 4 failed a correct
chain by chance (4.09 on one processor, under 4 on another).
The centred stochastic volatility model is the one where a chain started
from a prior draw stuck (R-hat 1.55, bulk ESS 7); NumPyro's uniform start
and Stan's step-size search fixed it.

`python tests/test_ppl_inference_gym.py` runs each target with the defaults
(4 chains, 1000 + 1000) beside NumPyro's NUTS and prints the table of the
ppl guide.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import harvest.ppl as ppl
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

gym = pytest.importorskip("inference_gym.using_jax")
az = pytest.importorskip("arviz")
pytest.importorskip("blackjax")
from inference_gym.dynamic.backend_jax.internal import data as gym_data  # noqa: E402

tfd, tfb = tfp.distributions, tfp.bijectors
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SCHOOLS_Y = jnp.array([28, 8, -3, 7, -1, 1, 18, 12], jnp.float32)
SCHOOLS_SD = jnp.array([15, 10, 16, 11, 9, 11, 10, 18], jnp.float32)


def eight_schools(key):
    """The gym's centred eight schools."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    avg = ppl.random_variable(tfd.Normal(0.0, 10.0), name="avg_effect")(k1)
    log_sd = ppl.random_variable(tfd.Normal(5.0, 1.0), name="log_stddev")(k2)
    prior = tfd.Normal(avg * jnp.ones(8), jnp.exp(log_sd) * jnp.ones(8))
    effects = ppl.random_variable(tfd.Independent(prior, 1), name="school_effects")(k3)
    return ppl.random_variable(tfd.Independent(tfd.Normal(effects, SCHOOLS_SD), 1), name="y")(k4)


_BM = gym_data.brownian_motion_missing_middle_observations()
BM_LOCS = np.asarray(_BM["observed_locs"], np.float32)
BM_SEEN = np.flatnonzero(~np.isnan(BM_LOCS))  # the gym marks the 10 missing ones by NaN


def _walk(key, scale):
    def step(x, k):
        x = ppl.random_variable(tfd.Normal(x, scale), name="x", mode="append")(k)
        return x, x

    return jax.lax.scan(step, jnp.float32(0.0), jax.random.split(key, 30))[1]


def brownian_motion(key):
    """30 steps of a random walk with known scales, the middle 10 unobserved."""
    kx, ky = jax.random.split(key)
    x = _walk(kx, float(_BM["innovation_noise_scale"]))
    scale = float(_BM["observation_noise_scale"])
    return ppl.random_variable(tfd.Independent(tfd.Normal(x[BM_SEEN], scale), 1), name="y")(ky)


def brownian_motion_unknown_scales(key):
    ki, ko, kx, ky = jax.random.split(key, 4)
    innovation = ppl.random_variable(tfd.LogNormal(0.0, 2.0), name="innovation_noise_scale")(ki)
    observation = ppl.random_variable(tfd.LogNormal(0.0, 2.0), name="observation_noise_scale")(ko)
    x = _walk(kx, innovation)
    return ppl.random_variable(tfd.Independent(tfd.Normal(x[BM_SEEN], observation), 1), name="y")(
        ky
    )


SV_RETURNS = np.asarray(gym_data.sp500_returns(num_points=100)["centered_returns"], np.float32)


def stochastic_volatility(key):
    """The gym's centred AR(1) log volatility of 100 S&P 500 returns."""
    kp, km, ks, k0, kt, ky = jax.random.split(key, 6)
    to_persistence = tfb.Shift(-1.0)(tfb.Scale(2.0))
    persistence = ppl.random_variable(
        tfd.TransformedDistribution(tfd.Beta(20.0, 1.5), to_persistence),
        name="persistence_of_volatility",
    )(kp)
    mean = ppl.random_variable(tfd.Cauchy(0.0, 5.0), name="mean_log_volatility")(km)
    shock = ppl.random_variable(tfd.HalfCauchy(0.0, 2.0), name="white_noise_shock_scale")(ks)
    first = tfd.Normal(mean, shock / jnp.sqrt(1.0 - persistence**2))
    x0 = ppl.random_variable(first, name="x0")(k0)

    def step(x, k):
        x = ppl.random_variable(
            tfd.Normal(mean + persistence * (x - mean), shock), name="x", mode="append"
        )(k)
        return x, x

    log_volatility = jnp.concatenate(
        [x0[None], jax.lax.scan(step, x0, jax.random.split(kt, 99))[1]]
    )
    return ppl.random_variable(
        tfd.Independent(tfd.Normal(0.0, jnp.exp(log_volatility / 2.0)), 1), name="y"
    )(ky)


# name: (program, observed, gym target, our draws as the gym's "identity" values)
TARGETS = {
    "eight_schools": (
        eight_schools,
        {"y": SCHOOLS_Y},
        "EightSchools",
        lambda s: {k: s[k] for k in ("avg_effect", "log_stddev", "school_effects")},
    ),
    "brownian_motion": (
        brownian_motion,
        {"y": jnp.asarray(BM_LOCS[BM_SEEN])},
        "BrownianMotionMissingMiddleObservations",
        lambda s: s["x"],
    ),
    "brownian_motion_unknown_scales": (
        brownian_motion_unknown_scales,
        {"y": jnp.asarray(BM_LOCS[BM_SEEN])},
        "BrownianMotionUnknownScalesMissingMiddleObservations",
        lambda s: {
            "innovation_noise_scale": s["innovation_noise_scale"],
            "observation_noise_scale": s["observation_noise_scale"],
            "locs": s["x"],
        },
    ),
    "stochastic_volatility": (
        stochastic_volatility,
        {"y": jnp.asarray(SV_RETURNS)},
        "StochasticVolatilitySP500Small",
        lambda s: {
            "persistence_of_volatility": s["persistence_of_volatility"],
            "mean_log_volatility": s["mean_log_volatility"],
            "white_noise_shock_scale": s["white_noise_shock_scale"],
            "log_volatility": jnp.concatenate([s["x0"][..., None], s["x"]], -1),
        },
    ),
}


def _gym_value(name, target, identity):
    """Our values as the argument of the gym's `unnormalized_log_prob`."""
    if name == "eight_schools":
        return identity
    if name == "brownian_motion":
        return tuple(identity[i] for i in range(30))
    if name == "brownian_motion_unknown_scales":
        scales = (identity["innovation_noise_scale"], identity["observation_noise_scale"])
        return scales + tuple(identity["locs"][i] for i in range(30))
    like = target.prior_distribution().sample(seed=jax.random.PRNGKey(0))
    series = type(like[3])(*[identity["log_volatility"][i] for i in range(100)])
    return type(like)(*[identity[k] for k in list(identity)[:3]], series)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_program_has_the_gym_s_density(name):
    model, observed, target_name, identity = TARGETS[name]
    target = getattr(gym.targets, target_name)()
    draw = ppl.joint_sample(model)(jax.random.key(1))
    ours = ppl.joint_log_prob(model)({**draw, **observed})
    theirs = target.unnormalized_log_prob(_gym_value(name, target, identity(draw)))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def diagnostics(name, samples, diverging):
    """Worst R-hat, smallest bulk ESS, divergences, and the largest |mean - truth| / MCSE
    over every scalar the gym has a ground truth for."""
    _, _, target_name, identity = TARGETS[name]
    truth = getattr(gym.targets, target_name)().sample_transformations["identity"]
    means = truth.ground_truth_mean
    ours = identity(samples)
    pairs = [(ours[k], means[k]) for k in means] if isinstance(means, dict) else [(ours, means)]
    r_hat, ess, z = [], [], []
    for draws, mean in pairs:
        draws = np.asarray(draws).reshape(*np.shape(draws)[:2], -1)
        for i, exact in enumerate(np.ravel(mean)):
            x = draws[..., i]
            r_hat.append(float(az.rhat(x)))
            ess.append(float(az.ess(x)))
            z.append(abs(x.mean() - exact) / float(az.mcse(x)))
    return {
        "r_hat": max(r_hat),
        "ess_bulk": min(ess),
        "divergences": int(np.sum(diverging)),
        "max_z": max(z),
        "z_bound": float(scipy.stats.norm.isf(FAMILY_WISE / (2 * len(z)))),
    }


# How often a correct sampler may fail the z bound: Bonferroni over a target's means.
FAMILY_WISE = 1e-4


# Shorter than the defaults, to fit CI: (chains, warmup, draws) per target.
SHORT = {
    "eight_schools": (2, 500, 500),
    "brownian_motion": (2, 300, 300),
    "stochastic_volatility": (2, 500, 500),
}


@pytest.mark.parametrize("name", sorted(SHORT))
def test_posterior_means_are_the_gym_s_ground_truth(name):
    model, observed, _, _ = TARGETS[name]
    chains, warmup, draws = SHORT[name]
    posterior = ppl.sample_posterior(
        model,
        jax.random.key(0),
        observed=observed,
        num_chains=chains,
        num_warmup=warmup,
        num_samples=draws,
    )
    result = diagnostics(name, posterior.samples, posterior.diverging)
    assert result["max_z"] < result["z_bound"], result
    assert result["r_hat"] < 1.05, result
    assert result["divergences"] <= 0.01 * chains * draws, result


def _numpyro_models():
    import numpyro
    import numpyro.distributions as dist

    def np_eight_schools():
        avg = numpyro.sample("avg_effect", dist.Normal(0.0, 10.0))
        log_sd = numpyro.sample("log_stddev", dist.Normal(5.0, 1.0))
        prior = dist.Normal(avg, jnp.exp(log_sd)).expand([8]).to_event(1)
        effects = numpyro.sample("school_effects", prior)
        numpyro.sample("y", dist.Normal(effects, SCHOOLS_SD).to_event(1), obs=SCHOOLS_Y)

    def observe_walk(x, scale):
        seen = dist.Normal(x[BM_SEEN], scale).to_event(1)
        numpyro.sample("y", seen, obs=BM_LOCS[BM_SEEN])

    def np_brownian_motion():
        walk = dist.GaussianRandomWalk(float(_BM["innovation_noise_scale"]), num_steps=30)
        observe_walk(numpyro.sample("x", walk), float(_BM["observation_noise_scale"]))

    def np_brownian_motion_unknown_scales():
        innovation = numpyro.sample("innovation_noise_scale", dist.LogNormal(0.0, 2.0))
        observation = numpyro.sample("observation_noise_scale", dist.LogNormal(0.0, 2.0))
        observe_walk(numpyro.sample("x", dist.GaussianRandomWalk(innovation, 30)), observation)

    def np_stochastic_volatility():
        to_persistence = dist.transforms.AffineTransform(-1.0, 2.0)
        p = numpyro.sample(
            "persistence_of_volatility",
            dist.TransformedDistribution(dist.Beta(20.0, 1.5), to_persistence),
        )
        mean = numpyro.sample("mean_log_volatility", dist.Cauchy(0.0, 5.0))
        shock = numpyro.sample("white_noise_shock_scale", dist.HalfCauchy(2.0))
        flat = dist.ImproperUniform(dist.constraints.real, (), (100,))
        lv = numpyro.sample("log_volatility", flat)
        first = dist.Normal(mean, shock / jnp.sqrt(1 - p**2), validate_args=False)
        rest = dist.Normal(mean + p * (lv[:-1] - mean), shock)
        numpyro.factor("ar1", first.log_prob(lv[0]) + rest.log_prob(lv[1:]).sum())
        numpyro.sample("y", dist.Normal(0.0, jnp.exp(lv / 2)).to_event(1), obs=SV_RETURNS)

    return {
        "eight_schools": np_eight_schools,
        "brownian_motion": np_brownian_motion,
        "brownian_motion_unknown_scales": np_brownian_motion_unknown_scales,
        "stochastic_volatility": np_stochastic_volatility,
    }


def _numpyro_as_ours(name, samples):
    if name != "stochastic_volatility":
        return samples
    lv = samples["log_volatility"]
    return {**samples, "x0": lv[..., 0], "x": lv[..., 1:]}


def _table(seed=0):
    """One run per target with sample_posterior's defaults and NumPyro's NUTS defaults."""
    import numpyro

    models = _numpyro_models()
    row = "| {} | {} | {:.3f} | {:.0f} | {} | {:.1f} |"
    print("| target | sampler | max R-hat | min bulk ESS | divergences | max \\|z\\| |")
    print("|---|---|---|---|---|---|")
    for name, (model, observed, _, _) in TARGETS.items():
        ours = ppl.sample_posterior(model, jax.random.key(seed), observed=observed)
        d = diagnostics(name, ours.samples, ours.diverging)
        print(row.format(name, "harvest", *d.values()), flush=True)
        mcmc = numpyro.infer.MCMC(
            numpyro.infer.NUTS(models[name]),
            num_warmup=1000,
            num_samples=1000,
            num_chains=4,
            chain_method="vectorized",
            progress_bar=False,
        )
        mcmc.run(jax.random.key(seed))
        theirs = _numpyro_as_ours(name, mcmc.get_samples(group_by_chain=True))
        diverging = mcmc.get_extra_fields(group_by_chain=True)["diverging"]
        d = diagnostics(name, theirs, diverging)
        print(row.format(name, "NumPyro", *d.values()), flush=True)


if __name__ == "__main__":
    _table(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
