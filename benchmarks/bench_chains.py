"""NUTS chains that wait for each other, or not: wall time per effective sample.

    python -m benchmarks --only chains [--quick]

`sample_posterior(..., chain_method=...)` on three models, against NumPyro's
NUTS with the same chains, warmup and draws: eight schools, the inference
gym's stochastic volatility (100 S&P 500 returns, a scan) and its synthetic
item-response model (501 parameters, 30,012 answers). Each row is the wall
time of one whole run (trace, compile, warmup, draws) divided by the smallest
bulk effective sample size over the scalar parameters (ArviZ), for
`"vectorized"` (the chains side by side under `vmap`: each NUTS step as long
as the longest tree of any chain) and `"sequential"` (one after another under
`lax.map`), on both sides. `"parallel"` needs a device per chain.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import ppl_models

METHODS = ("vectorized", "sequential")


@dataclasses.dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = ("eight schools", "stochastic volatility", "item response")
    chains: int = 4
    warmup: int = 500
    draws: int = 500


QUICK = Config(models=("eight schools",), chains=2, warmup=20, draws=20)


def _tfd() -> Any:
    from harvest.ppl._tfp_shim import import_tfp

    return import_tfp().distributions


def _gym_data() -> Any:
    import inference_gym.using_jax  # noqa: F401  (makes the JAX backend's data importable)
    from inference_gym.dynamic.backend_jax.internal import data

    return data


def _eight_schools() -> tuple[Any, Any, dict[str, Any]]:
    trial = ppl_models.trial("eight schools")
    return trial.harvest, trial.numpyro, trial.observed


def _stochastic_volatility() -> tuple[Any, Any, dict[str, Any]]:
    import numpyro
    import numpyro.distributions as dist
    from numpyro.contrib.control_flow import scan

    import harvest.ppl as ppl
    from harvest.ppl._tfp_shim import import_tfp

    tfp = import_tfp()
    tfd, tfb = tfp.distributions, tfp.bijectors
    y = jnp.asarray(_gym_data().sp500_returns(num_points=100)["centered_returns"], jnp.float32)

    def ours(key):
        kp, km, ks, k0, kt, ky = jax.random.split(key, 6)
        to_persistence = tfb.Shift(-1.0)(tfb.Scale(2.0))
        p = ppl.random_variable(
            tfd.TransformedDistribution(tfd.Beta(20.0, 1.5), to_persistence), name="persistence"
        )(kp)
        mean = ppl.random_variable(tfd.Cauchy(0.0, 5.0), name="mean")(km)
        shock = ppl.random_variable(tfd.HalfCauchy(0.0, 2.0), name="shock")(ks)
        x0 = ppl.random_variable(tfd.Normal(mean, shock / jnp.sqrt(1.0 - p**2)), name="x0")(k0)

        def step(x, k):
            x = ppl.random_variable(
                tfd.Normal(mean + p * (x - mean), shock), name="x", mode="append"
            )(k)
            return x, x

        xs = jnp.concatenate([x0[None], jax.lax.scan(step, x0, jax.random.split(kt, 99))[1]])
        return ppl.random_variable(
            tfd.Independent(tfd.Normal(0.0, jnp.exp(xs / 2.0)), 1), name="y"
        )(ky)

    def theirs():
        p = 2.0 * numpyro.sample("persistence_beta", dist.Beta(20.0, 1.5)) - 1.0
        mean = numpyro.sample("mean", dist.Cauchy(0.0, 5.0))
        shock = numpyro.sample("shock", dist.HalfCauchy(2.0))
        x0 = numpyro.sample("x0", dist.Normal(mean, shock / jnp.sqrt(1.0 - p**2)))

        def step(x, _):
            x = numpyro.sample("x", dist.Normal(mean + p * (x - mean), shock))
            return x, x

        _, xs = scan(step, x0, None, length=99)
        xs = jnp.concatenate([x0[None], xs])
        numpyro.sample("y", dist.Normal(0.0, jnp.exp(xs / 2.0)), obs=y)

    return ours, theirs, {"y": y}


def _item_response() -> tuple[Any, Any, dict[str, Any]]:
    import numpyro
    import numpyro.distributions as dist

    import harvest.ppl as ppl

    tfd = _tfd()
    d = _gym_data().synthetic_item_response_theory()
    student = jnp.asarray(d["train_student_ids"], jnp.int32)
    question = jnp.asarray(d["train_question_ids"], jnp.int32)
    correct = jnp.asarray(d["train_correct"], jnp.float32)
    students, questions = int(student.max()) + 1, int(question.max()) + 1

    def ours(key):
        km, ka, kd, ky = jax.random.split(key, 4)
        mean = ppl.random_variable(tfd.Normal(0.75, 1.0), name="mean")(km)
        ability = ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 1.0), students), name="ability")(
            ka
        )
        difficulty = ppl.random_variable(
            tfd.Sample(tfd.Normal(0.0, 1.0), questions), name="difficulty"
        )(kd)
        logits = mean + ability[student] - difficulty[question]
        return ppl.random_variable(
            tfd.Independent(tfd.Bernoulli(logits=logits, dtype=jnp.float32), 1), name="y"
        )(ky)

    def theirs():
        mean = numpyro.sample("mean", dist.Normal(0.75, 1.0))
        with numpyro.plate("students", students):
            ability = numpyro.sample("ability", dist.Normal(0.0, 1.0))
        with numpyro.plate("questions", questions):
            difficulty = numpyro.sample("difficulty", dist.Normal(0.0, 1.0))
        logits = mean + ability[student] - difficulty[question]
        with numpyro.plate("answers", len(correct)):
            numpyro.sample("y", dist.Bernoulli(logits=logits), obs=correct)

    return ours, theirs, {"y": correct}


MODELS = {
    "eight schools": _eight_schools,
    "stochastic volatility": _stochastic_volatility,
    "item response": _item_response,
}


def _min_ess(samples: dict[str, Any]) -> float:
    import arviz as az

    data = az.from_dict(posterior={k: np.asarray(v) for k, v in samples.items()})
    ess = az.ess(data, method="bulk")
    return float(min(np.min(ess[k].values) for k in ess.data_vars))


def _ours(model: Any, observed: dict[str, Any], method: str, cfg: Config) -> tuple[float, float]:
    import harvest.ppl as ppl

    start = time.perf_counter()
    posterior = ppl.sample_posterior(
        model,
        jax.random.key(0),
        observed=observed,
        num_chains=cfg.chains,
        num_warmup=cfg.warmup,
        num_samples=cfg.draws,
        chain_method=method,
    )
    jax.block_until_ready(posterior.unconstrained)
    return time.perf_counter() - start, _min_ess(posterior.unconstrained)


def _theirs(model: Any, method: str, cfg: Config) -> tuple[float, float]:
    from numpyro.infer import MCMC, NUTS

    start = time.perf_counter()
    mcmc = MCMC(
        NUTS(model),
        num_warmup=cfg.warmup,
        num_samples=cfg.draws,
        num_chains=cfg.chains,
        chain_method=method,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(0))
    samples = mcmc.get_samples(group_by_chain=True)
    jax.block_until_ready(samples)
    return time.perf_counter() - start, _min_ess(samples)


def run(cfg: Config = Config()) -> list[dict[str, Any]]:
    """One row per model and chain method: each side's seconds, min bulk ESS, s per ESS."""
    needed = ("numpyro", "blackjax", "arviz")
    if any(importlib.util.find_spec(m) is None for m in needed):
        return []
    rows = []
    for name in cfg.models:
        ours, theirs, observed = MODELS[name]()
        for method in METHODS:
            t_ours, ess_ours = _ours(ours, observed, method, cfg)
            t_theirs, ess_theirs = _theirs(theirs, method, cfg)
            rows.append(
                dict(
                    model=name,
                    method=method,
                    ours=t_ours,
                    ess_ours=ess_ours,
                    theirs=t_theirs,
                    ess_theirs=ess_theirs,
                    ratio=(t_ours / ess_ours) / (t_theirs / ess_theirs),
                )
            )
    return rows


def render(rows: list[dict[str, Any]]) -> list[str]:
    """The section of docs/benchmarks.md, from `run`'s rows."""
    lines = [
        "## harvest.ppl's NUTS chains against NumPyro's",
        "",
        "`benchmarks/bench_chains.py`: `sample_posterior` and NumPyro's `MCMC(NUTS)` with the",
        "same chains, warmup and draws, for each `chain_method`. Wall time of a whole run",
        "(compile included) over the smallest bulk ESS of any parameter; ratio: ours over",
        "NumPyro's, in seconds per effective sample.",
        "",
        "| model | chain_method | harvest.ppl (s, ESS) | NumPyro (s, ESS) | s/ESS ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['method']} | {r['ours']:.1f}, {r['ess_ours']:.0f} "
            f"| {r['theirs']:.1f}, {r['ess_theirs']:.0f} | {r['ratio']:.2f} |"
        )
    if not rows:
        lines.append("| (NumPyro, BlackJAX or ArviZ not installed) | | | | |")
    return lines


if __name__ == "__main__":
    import sys

    for line in render(run(QUICK if "--quick" in sys.argv else Config())):
        print(line)
