"""Records the reference posterior mean of `mu` for eight schools (tests/golden/eight_schools.json).

    python tests/golden/record_eight_schools.py

Independent of harvest: the non-centred model's log density is written out by
hand with TFP's distributions, and 16 long HMC chains (step size adapted by
dual averaging) sample it. The golden file keeps the mean, its Monte-Carlo
standard error (from the effective sample size) and the seed.
"""

import json
import pathlib

import jax
import jax.numpy as jnp

from harvest.ppl._tfp_shim import import_tfp

# Only for harvest.ppl's shim (TFP 0.25's JAX substrate needs it on JAX 0.10); a
# statement, so the import sorter keeps it after harvest.ppl.
tfp = import_tfp()

tfd = tfp.distributions
Y = jnp.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = jnp.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
SEED, CHAINS, WARMUP, DRAWS = 20261129, 16, 2000, 10000


def log_density(mu, log_tau, theta_tilde):
    """Non-centred eight schools over (mu, log tau, theta~), with the log-Jacobian of tau = exp."""
    tau = jnp.exp(log_tau)
    theta = mu[..., None] + tau[..., None] * theta_tilde
    return (
        tfd.Normal(0.0, 5.0).log_prob(mu)
        + tfd.HalfCauchy(0.0, 5.0).log_prob(tau)
        + log_tau
        + tfd.Normal(0.0, 1.0).log_prob(theta_tilde).sum(-1)
        + tfd.Normal(theta, SIGMA).log_prob(Y).sum(-1)
    )


def run():
    kernel = tfp.mcmc.DualAveragingStepSizeAdaptation(
        tfp.mcmc.HamiltonianMonteCarlo(log_density, step_size=0.3, num_leapfrog_steps=8),
        num_adaptation_steps=int(0.8 * WARMUP),
    )
    init = [jnp.zeros(CHAINS), jnp.zeros(CHAINS), jnp.zeros((CHAINS, 8))]
    sample = jax.jit(
        lambda key: tfp.mcmc.sample_chain(
            DRAWS, init, kernel=kernel, num_burnin_steps=WARMUP, trace_fn=None, seed=key
        )
    )
    mu = sample(jax.random.key(SEED))[0]
    ess = tfp.mcmc.effective_sample_size(mu, cross_chain_dims=1)
    mean = float(mu.mean())
    return {
        "mu_mean": mean,
        "mu_sd": float(mu.std()),
        "mc_se": float(mu.std() / jnp.sqrt(ess)),
        "seed": SEED,
        "chains": CHAINS,
        "warmup": WARMUP,
        "draws": DRAWS,
        "sampler": "tfp.mcmc HMC (8 leapfrog steps, dual-averaging step size), hand-written density",
    }


if __name__ == "__main__":
    out = pathlib.Path(__file__).with_name("eight_schools.json")
    out.write_text(json.dumps(run(), indent=1) + "\n")
    print(out.read_text())
