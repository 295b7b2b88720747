"""`sample_posterior`: NUTS or HMC from BlackJAX on a program's unconstrained density.

harvest owns the program side (which draws are free under `observed`,
`intervene`, `conditional`, `block`; the map onto each support; the
deterministic sites); BlackJAX owns the sampler and its warmup (Stan's window
adaptation of the step size and a diagonal mass matrix), ArviZ the
diagnostics. Chains run one after another under `lax.map` (or side by side
under `vmap`, or a device each: `chain_method`), each with its own warmup;
warmup, sampling and the map back to the model's values are one compiled
program.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._typing import Reaped
from ._support import check_observed_support
from ._unconstrained import site_log_densities, unconstrained
from ._warmup import stan_warmup

KERNELS = ("nuts", "hmc")
CHAIN_METHODS = ("vectorized", "sequential", "parallel")
INITS = ("uniform", "prior")
# How many starts a chain draws before giving up on a finite density (NumPyro's 100).
START_ATTEMPTS = 100


def _require(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"harvest.ppl.{what} needs {module}, which is not installed. Install the inference "
            "extra: pip install 'jax-harvest[infer]' (BlackJAX and ArviZ, pinned to tested versions)."
        ) from error


@dataclasses.dataclass(frozen=True)
class Posterior:
    """Draws from a program's posterior, as ``sample_posterior`` returns them.

    Attributes:
        samples: ``{name: array [chains, draws, ...]}``: every free random
            variable in the model's own (constrained) space and every
            ``deterministic`` site. Scoped names are nested dicts.
        log_density: ``[chains, draws]``: the unconstrained log density of
            each draw (the model's log joint plus the log-Jacobian).
        unconstrained: ``{name: array [chains, draws, ...]}``: the draws as the
            sampler saw them.
        diverging: ``[chains, draws]``: whether the transition diverged.
        acceptance_rate: ``[chains, draws]``: the transition's mean acceptance.
        step_size: ``[chains]``: each chain's step size after warmup.
        observed: ``{name: value}``: the observations the posterior is conditioned on
            (``infer_discrete`` and ``predictive(..., infer_discrete=True)`` read them).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> draws = jax.random.normal(jax.random.key(0), (2, 500))  # two chains of N(0, 1)
        >>> zeros = jnp.zeros((2, 500))
        >>> posterior = ppl.Posterior({"z": draws}, zeros, {"z": draws}, zeros > 0, zeros,
        ...                           jnp.ones(2))
        >>> table = posterior.summary(quantiles=(0.5,))
        >>> list(table.columns)
        ['mean', 'sd', '50%', 'r_hat', 'ess_bulk', 'ess_tail', 'mcse_mean']
        >>> bool(table.loc["z", "r_hat"] < 1.02)
        True
    """

    samples: Reaped
    log_density: jax.Array
    unconstrained: Reaped
    diverging: jax.Array
    acceptance_rate: jax.Array
    step_size: jax.Array
    observed: Reaped = dataclasses.field(default_factory=dict)

    def to_arviz(self) -> Any:
        """The draws as an ``arviz.InferenceData`` (``posterior`` and ``sample_stats`` groups).

        Returns:
            ``arviz.InferenceData`` with every site of ``samples`` (scoped
            names dotted) and the sample statistics ``lp``, ``diverging``,
            ``acceptance_rate``.

        Raises:
            ImportError: if ArviZ is not installed (``pip install 'jax-harvest[infer]'``).
        """
        az = _require("arviz", "Posterior.to_arviz")
        posterior = {name: _numpy(v) for name, v in _flat(self.samples).items()}
        stats = {
            "lp": _numpy(self.log_density),
            "diverging": _numpy(self.diverging),
            "acceptance_rate": _numpy(self.acceptance_rate),
        }
        return az.from_dict(posterior=posterior, sample_stats=stats)

    def summary(
        self, quantiles: Sequence[float] = (0.05, 0.5, 0.95), digits: int | None = 4
    ) -> Any:
        """A table of each site's posterior: mean, sd, quantiles, R-hat, bulk and tail ESS.

        R-hat is ArviZ's rank-normalised split R-hat and the effective sample
        sizes are its bulk and tail ESS (Vehtari et al. 2021). Each element of
        an array-valued site is a row, named as ArviZ names it
        (``theta[0]``).

        Every number is rounded to ``digits`` significant digits (the effective
        sample sizes to whole draws), so a site on a small scale keeps its
        digits and an R-hat of 1.0049 shows as 1.005. (ArviZ 0.x's
        ``az.summary`` rounds to a fixed number of decimals instead: 3, and 2
        for R-hat, which shows 1.0049 as 1.0.)

        Args:
            quantiles: the posterior quantiles to report, each in [0, 1].
            digits: significant digits kept in each number; None keeps them all.

        Returns:
            A ``pandas.DataFrame``, one row per scalar element of each site,
            with columns ``mean``, ``sd``, one per quantile (``5%``...),
            ``r_hat``, ``ess_bulk``, ``ess_tail`` and ``mcse_mean``.

        Raises:
            ImportError: if ArviZ is not installed.
            ValueError: if ``digits`` is not a positive int or None.
        """
        az = _require("arviz", "Posterior.summary")
        if digits is not None and (type(digits) is not int or digits < 1):
            raise ValueError(
                f"Posterior.summary needs `digits` to be a positive int (significant digits kept) or None "
                f"(no rounding), got {digits!r}."
            )
        data = self.to_arviz()
        table = az.summary(data, kind="all", round_to="none")
        table = table[["mean", "sd", "mcse_mean", "ess_bulk", "ess_tail", "r_hat"]]
        stacked = data.posterior.stack(sample=("chain", "draw"))
        for q in quantiles:
            column = []
            for row in table.index:
                name, index = _row_site(row)
                values = stacked[name].values
                column.append(float(jnp.quantile(values[index] if index else values, q)))
            table[f"{100 * q:g}%"] = column
        table = table[
            [
                "mean",
                "sd",
                *[f"{100 * q:g}%" for q in quantiles],
                "r_hat",
                "ess_bulk",
                "ess_tail",
                "mcse_mean",
            ]
        ]
        if digits is None:
            return table
        table = table.copy()
        for column in table.columns:
            whole = column in ("ess_bulk", "ess_tail")  # a count of draws
            values = table[column].to_numpy()
            table[column] = values.round() if whole else _significant(values, digits)
        return table


def _significant(values: Any, digits: int) -> Any:
    """`values` rounded to `digits` significant digits (zeros, NaN and infinities kept)."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    rounded = np.isfinite(x) & (x != 0)
    magnitude = np.floor(np.log10(np.abs(np.where(rounded, x, 1.0))))
    # Scaled so the digits kept are the integer part; a negative power where the
    # number is bigger than its digits (12345 to 4 digits: 1234.5 * 10).
    scale = 10.0 ** (digits - 1 - magnitude)
    return np.where(rounded, np.round(x * scale) / scale, x)


def _row_site(row: str) -> tuple[str, tuple[int, ...]]:
    """ArviZ's row label `theta[0, 1]` as (`theta`, (0, 1))."""
    if "[" not in row:
        return row, ()
    name, rest = row.split("[", 1)
    return name, tuple(int(i) for i in rest.rstrip("]").split(","))


def _numpy(x: Any) -> Any:
    import numpy as np

    return np.asarray(x)


def _flat(tree: Reaped, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def sample_posterior(
    model: Callable[..., Any],
    key: jax.Array,
    *args: Any,
    observed: Mapping[str, Any] | None = None,
    num_samples: int = 1000,
    num_warmup: int = 1000,
    num_chains: int = 4,
    kernel: str = "nuts",
    num_integration_steps: int = 16,
    target_acceptance_rate: float = 0.8,
    init: str = "uniform",
    dense_mass: bool = False,
    max_tree_depth: int = 10,
    progress: bool = False,
    chain_method: str = "sequential",
) -> Posterior:
    """Samples the posterior of the program ``model`` given ``observed``, with BlackJAX.

    The sampler runs on ``unconstrained(model, observed).log_density``, so
    every transformation composes: ``sample_posterior(intervene(model, t=1.0),
    ...)`` samples the posterior under ``do(t=1)``. The defaults are NumPyro's:
    each chain starts where every unconstrained coordinate is uniform in
    (-2, 2) (redrawn, up to 100 times, until the density and its gradient are
    finite), then adapts its step size and mass matrix for ``num_warmup``
    steps by Stan's warmup (BlackJAX's windows, dual averaging and Welford
    estimate, with Stan's step-size search at the start and after each new
    mass matrix), then draws ``num_samples``.

    Args:
        model: the program ``model(key, *args)``.
        key: the PRNG key for the starts, the warmup and the draws.
        *args: the program's own arguments, passed on to every evaluation.
        observed: ``{name: value}``: the observed random variables.
        num_samples: draws kept per chain.
        num_warmup: adaptation steps per chain (discarded).
        num_chains: independent chains, run as ``chain_method`` says.
        kernel: ``"nuts"`` (``blackjax.nuts``) or ``"hmc"`` (``blackjax.hmc``,
            with ``num_integration_steps`` leapfrog steps per transition).
        num_integration_steps: HMC's trajectory length in steps (ignored by NUTS).
        target_acceptance_rate: the acceptance rate the warmup tunes the step size for.
        init: ``"uniform"`` (each unconstrained coordinate uniform in (-2, 2), as
            NumPyro's ``init_to_uniform``) or ``"prior"`` (a draw from the prior).
        dense_mass: adapt a dense mass matrix (the posterior's covariance)
            rather than a diagonal one.
        max_tree_depth: NUTS's largest trajectory, ``2**max_tree_depth`` leapfrog steps.
        progress: print when warmup and sampling start and how far sampling got
            (ten reports per run, from inside the compiled program).
        chain_method: how the chains share the machine, as NumPyro's:
            ``"sequential"`` (the default: one program, the chains one after another
            under ``lax.map``, none waiting for another), ``"vectorized"`` (one
            program, the chains side by side under ``vmap``: NUTS steps them in
            lockstep, each step as long as the longest tree of any chain) or
            ``"parallel"`` (one chain per device under ``pmap``; with fewer devices
            than chains, sequential, with a warning, as in NumPyro). On CPU,
            sequential took half the wall time of vectorized on eight schools and the
            item-response model, and 1.1x on stochastic volatility
            (``benchmarks/bench_chains.py``).

    Returns:
        A ``Posterior``: ``samples`` (constrained, deterministic sites
        included), ``log_density`` and per-draw statistics; ``summary()``
        and ``to_arviz()`` use ArviZ.

    Raises:
        ValueError: for an unknown ``kernel`` or ``init``, a non-positive count, a
            program with nothing left to sample, a non-finite observed value, or no
            start (of 100) where the log density and its gradient are finite.
        ImportError: if BlackJAX is not installed (``pip install 'jax-harvest[infer]'``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     mu = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu")(k1)
        ...     return ppl.random_variable(tfd.Sample(tfd.Normal(mu, 1.0), 3), name="y")(k2)
        >>> posterior = ppl.sample_posterior(
        ...     model, jax.random.key(0), observed={"y": jnp.array([1.0, 2.0, 3.0])},
        ...     num_samples=200, num_warmup=200, num_chains=2)
        >>> posterior.samples["mu"].shape
        (2, 200)
        >>> bool(abs(posterior.samples["mu"].mean() - 1.5) < 0.2)  # exact: N(1.5, 1/4)
        True
    """
    blackjax = _require("blackjax", "sample_posterior")
    if kernel not in KERNELS:
        raise ValueError(
            f"sample_posterior: unknown kernel {kernel!r}. Use one of {', '.join(map(repr, KERNELS))}."
        )
    if chain_method not in CHAIN_METHODS:
        raise ValueError(
            f"sample_posterior: unknown chain_method {chain_method!r}; use one of "
            f"{', '.join(repr(m) for m in CHAIN_METHODS)}."
        )
    if init not in INITS:
        raise ValueError(
            f"sample_posterior: unknown init {init!r}. Use one of {', '.join(map(repr, INITS))}."
        )
    for what, n in (
        ("num_samples", num_samples),
        ("num_warmup", num_warmup),
        ("num_chains", num_chains),
        ("max_tree_depth", max_tree_depth),
    ):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"sample_posterior needs `{what}` to be a positive int, got {n!r}.")
    density = unconstrained(model, observed)
    check_observed_support(model, dict(observed or {}), key, args, {})
    if not jax.eval_shape(density.init, key, *args):
        raise ValueError(
            "sample_posterior: the program has no free continuous random variable left to sample "
            "(every draw is observed, fixed, blocked or enumerated). Score it with joint_log_prob, "
            "or draw from it with predictive."
        )

    def log_density(u: Reaped) -> jax.Array:
        return density.log_density(u, *args)

    if kernel == "nuts":
        algorithm, extra = blackjax.nuts, {"max_num_doublings": max_tree_depth}
    else:
        algorithm, extra = blackjax.hmc, {"num_integration_steps": num_integration_steps}

    def kernel_at(step_size: Any, inverse_mass_matrix: jax.Array) -> Any:
        return algorithm(log_density, step_size, inverse_mass_matrix, **extra).step

    shapes = jax.eval_shape(density.init, key, *args)

    def draw_start(k: jax.Array) -> Reaped:
        if init == "prior":
            prior_draw: Reaped = density.init(k, *args)
            return prior_draw
        # NumPyro's init_to_uniform: each unconstrained coordinate uniform in (-2, 2).
        leaves, tree = jax.tree.flatten(shapes)
        keys = jax.random.split(k, len(leaves))
        drawn = [jax.random.uniform(kl, s.shape, s.dtype, -2.0, 2.0) for kl, s in zip(keys, leaves)]
        uniform_draw: Reaped = jax.tree.unflatten(tree, drawn)
        return uniform_draw

    def finite_at(u: Reaped) -> tuple[jax.Array, jax.Array]:
        value, grad = jax.value_and_grad(log_density)(u)
        finite_grad = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grad)]))
        return jnp.isfinite(value), finite_grad

    def start_of(chain_key: jax.Array) -> Any:
        """The first of up to `START_ATTEMPTS` draws where the density and its gradient are
        finite (as NumPyro's init), or the last draw tried."""
        k_init, _, _ = jax.random.split(chain_key, 3)

        def another(carry: Any) -> Any:
            attempt, _, _, _ = carry
            u = draw_start(jax.random.fold_in(k_init, attempt))
            return (attempt + 1, u, *finite_at(u))

        def looking(carry: Any) -> Any:
            attempt, _, ok, ok_grad = carry
            return (attempt < START_ATTEMPTS) & ~(ok & ok_grad)

        first = draw_start(k_init)
        _, start, ok, ok_grad = jax.lax.while_loop(looking, another, (1, first, *finite_at(first)))
        return start, ok, ok_grad

    chain_keys = jax.random.split(key, num_chains)
    starts, finite, finite_grad = jax.jit(jax.vmap(start_of))(chain_keys)
    _check_start(model, observed, args, starts, finite, finite_grad, init)

    def one_chain(chain_key: jax.Array, start: Reaped) -> Any:
        _, k_warm, k_draw = jax.random.split(chain_key, 3)
        _report(progress, "warmup", 0, num_warmup)
        state, parameters = stan_warmup(
            kernel_at,
            algorithm.init(start, log_density),
            start,
            k_warm,
            num_warmup,
            target_acceptance_rate,
            dense_mass,
        )
        step = kernel_at(parameters["step_size"], parameters["inverse_mass_matrix"])

        def transition(carry: Any, xs: Any) -> Any:
            i, k = xs
            new, info = step(k, carry)
            _report(progress, "sampling", i + 1, num_samples)
            return new, (new.position, new.logdensity, info.is_divergent, info.acceptance_rate)

        xs = (jnp.arange(num_samples), jax.random.split(k_draw, num_samples))
        _, (u, lp, diverging, accept) = jax.lax.scan(transition, state, xs)
        values = jax.vmap(lambda v: density.constrain(v, *args))(u)
        return values, u, lp, diverging, accept, parameters["step_size"]

    values, u, lp, diverging, accept, step_size = _chains(
        one_chain, chain_method, chain_keys, starts
    )
    return Posterior(values, lp, u, diverging, accept, step_size, dict(observed or {}))


def _chains(one_chain: Callable[..., Any], method: str, keys: jax.Array, starts: Reaped) -> Any:
    """Every chain's `one_chain(key, start)`, stacked on a leading axis, run by `method`."""
    if method == "parallel":
        if len(keys) <= jax.local_device_count():
            return jax.pmap(one_chain)(keys, starts)
        warnings.warn(
            f"sample_posterior: chain_method='parallel' needs a device per chain: "
            f"{len(keys)} chains, {jax.local_device_count()} device(s); running them "
            "sequentially.",
            stacklevel=3,
        )
        method = "sequential"
    if method == "sequential":
        return jax.jit(lambda k, s: jax.lax.map(lambda ks: one_chain(*ks), (k, s)))(keys, starts)
    return jax.jit(jax.vmap(one_chain))(keys, starts)


def _check_start(
    model: Callable[..., Any],
    observed: Mapping[str, Any] | None,
    args: Any,
    starts: Reaped,
    finite: jax.Array,
    finite_grad: jax.Array,
    init: str,
) -> None:
    """Refuses to run a chain from a start where the log density or its gradient is not
    finite (NumPyro refuses too): every transition from there diverges, and the draws
    would be the start repeated. The error names each site's log density at that start."""
    for chain, (ok, ok_grad) in enumerate(zip(finite.tolist(), finite_grad.tolist())):
        if ok and ok_grad:
            continue
        start = jax.tree_util.tree_map(lambda a, i=chain: a[i], starts)
        sites = site_log_densities(model, dict(observed or {}), start, *args)
        report = {name: float(v) for name, v in sites.items() if not jnp.isfinite(v)}
        what = "log density" if not ok else "gradient of the log density"
        at = ", ".join(f"{name!r}: {value}" for name, value in report.items())
        blame = f" Not finite there: {at}." if at else ""
        tries = (
            f"any of {START_ATTEMPTS} starting points"
            if START_ATTEMPTS > 1
            else "its starting point"
        )
        raise ValueError(
            f"sample_posterior: the {what} of chain {chain} is not finite at {tries} "
            f"(init={init!r}).{blame} Check that each observed value lies in its distribution's "
            "support and the model's parameters are valid there, or start elsewhere "
            "(init='uniform' draws each unconstrained coordinate in (-2, 2), init='prior' from "
            "the prior)."
        )


def _report(progress: bool, phase: str, i: Any, total: int) -> None:
    """From inside the compiled run: print `phase i/total` about ten times per phase."""
    if not progress:
        return
    every = max(total // 10, 1)

    def show(i: Any) -> None:
        step = int(jnp.ravel(jnp.asarray(i))[0])
        if step % every == 0 or step == total:
            print(f"harvest.ppl.sample_posterior: {phase} {step}/{total}", flush=True)

    jax.debug.callback(show, i)
