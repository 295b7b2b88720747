"""harvest.ppl against NumPyro on the same model: the costs a sampler pays.

Eight schools (non-centred), written once in harvest.ppl (TFP distributions)
and once in NumPyro, each side's density over unconstrained values
(`harvest.ppl.unconstrained(...).log_density`; NumPyro's `potential_fn` from
`initialize_model`, negated). Three measures, each as the ratio harvest /
NumPyro, timed interleaved in one run:

* gradient: a jitted call of the gradient of the log density (steady state);
* first compile: the first call of `jax.jit(jax.grad(log_density))` on a fresh
  function (tracing, the harvest walks, lowering and XLA's compile);
* first eager score: the first eager `joint_log_prob(model)(values)` of a fresh
  program against NumPyro's first `log_density(model, ...)` call.

NumPyro comes from the `test` extra; without it the section reports nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import jax
import jax.numpy as jnp

from . import _timing

Y = jnp.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = jnp.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


@dataclasses.dataclass(frozen=True)
class Config:
    repeats: int = 51  # interleaved timings per side of the steady gradient
    calls: int = 20  # back-to-back gradient calls per timing
    firsts: int = 5  # fresh first-compile and first-eager measurements per side


QUICK = Config(repeats=2, calls=2, firsts=1)


def harvest_side():
    """(model, unconstrained log density, a start u) on harvest.ppl."""
    import harvest.ppl as ppl
    from harvest.ppl._tfp_shim import import_tfp

    tfd = import_tfp().distributions

    def eight_schools(key):
        k_mu, k_tau, k_theta, k_y = jax.random.split(key, 4)
        mu = ppl.random_variable(tfd.Normal(0.0, 5.0), name="mu")(k_mu)
        tau = ppl.random_variable(tfd.HalfCauchy(0.0, 5.0), name="tau")(k_tau)
        tilde = ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 1.0), 8), name="theta_tilde")(
            k_theta
        )
        theta = ppl.deterministic(mu + tau * tilde, name="theta")
        return ppl.random_variable(tfd.Independent(tfd.Normal(theta, SIGMA), 1), name="y")(k_y)

    density = ppl.unconstrained(eight_schools, observed={"y": Y})
    u = {"mu": jnp.array(1.0), "tau": jnp.array(0.5), "theta_tilde": jnp.zeros(8)}
    return eight_schools, density.log_density, u


def numpyro_side():
    """(model, log density over NumPyro's unconstrained params, a start) on NumPyro."""
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer.util import initialize_model

    def eight_schools():
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with numpyro.plate("J", 8):
            tilde = numpyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
            theta = numpyro.deterministic("theta", mu + tau * tilde)
            numpyro.sample("y", dist.Normal(theta, SIGMA), obs=Y)

    info = initialize_model(jax.random.key(0), eight_schools, dynamic_args=False)
    params = {"mu": jnp.array(1.0), "tau": jnp.array(0.5), "theta_tilde": jnp.zeros(8)}
    return eight_schools, lambda p: -info.potential_fn(p), params


def _first(fn):
    start = time.perf_counter()
    _timing.block(fn())
    return time.perf_counter() - start


def run(cfg: Config = Config()):
    if importlib.util.find_spec("numpyro") is None:
        return []
    import numpyro.infer.util as numpyro_util

    import harvest.ppl as ppl

    model, ours, u = harvest_side()
    their_model, theirs, params = numpyro_side()
    grad_ours, grad_theirs = jax.jit(jax.grad(ours)), jax.jit(jax.grad(theirs))
    _timing.block((grad_ours(u), grad_theirs(params)))
    ratio, a, b = _timing.ratio(
        lambda: grad_ours(u), lambda: grad_theirs(params), cfg.repeats, cfg.calls
    )
    rows = [dict(measure="jitted gradient", ratio=ratio, ours=a, theirs=b)]

    compile_ours, compile_theirs = [], []
    eager_ours, eager_theirs = [], []
    values = {"mu": 1.0, "tau": 2.0, "theta_tilde": jnp.zeros(8), "y": Y}
    latents = {k: v for k, v in values.items() if k != "y"}
    for _ in range(cfg.firsts):
        fresh, fresh_ours, _ = harvest_side()
        _, fresh_theirs, _ = numpyro_side()
        compile_ours.append(_first(lambda: jax.jit(jax.grad(fresh_ours))(u)))
        compile_theirs.append(_first(lambda: jax.jit(jax.grad(fresh_theirs))(params)))
        eager_ours.append(_first(lambda: ppl.joint_log_prob(fresh)(values)))
        eager_theirs.append(
            _first(lambda: numpyro_util.log_density(their_model, (), {}, latents)[0])
        )
    for measure, a_, b_ in (
        ("first compile of the gradient", compile_ours, compile_theirs),
        ("first eager joint log density", eager_ours, eager_theirs),
    ):
        a, b = min(a_), min(b_)
        rows.append(dict(measure=measure, ratio=a / b, ours=a, theirs=b))
    return rows


def render(rows):
    """The section of docs/benchmarks.md, from `run`'s rows."""
    lines = [
        "## harvest.ppl against NumPyro",
        "",
        "Eight schools (non-centred) in harvest.ppl and in NumPyro: the jitted gradient of",
        "each side's unconstrained log density (median of interleaved timings), the first",
        "compile of that gradient and the first eager joint log density of a fresh program",
        "(fastest of a few fresh runs).",
        "",
        "| measure | harvest.ppl (ms) | NumPyro (ms) | ratio |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['measure']} | {1e3 * r['ours']:.3f} | {1e3 * r['theirs']:.3f} | {r['ratio']:.2f} |"
        )
    if not rows:
        lines.append("| (NumPyro not installed) | | | |")
    return lines


if __name__ == "__main__":
    import sys

    for line in render(run(QUICK if "--quick" in sys.argv else Config())):
        print(line)
