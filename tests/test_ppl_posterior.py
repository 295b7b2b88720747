"""sample_posterior (BlackJAX NUTS/HMC on harvest's unconstrained density) against an
analytic posterior under do(), against NumPyro's NUTS in the same process, and its
summary against ArviZ and numpy on the same draws."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

blackjax = pytest.importorskip("blackjax")
az = pytest.importorskip("arviz")

tfd = tfp.distributions
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
Y = jnp.array([3.1, 2.4, 3.7])


def scm(key):
    """z -> t -> y and z -> y: a confounded treatment t, outcomes y with an unknown scale s."""
    kz, ks, kt, ky = jax.random.split(key, 4)
    z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(kz)
    s = ppl.random_variable(tfd.HalfNormal(1.0), name="s")(ks)
    t = ppl.random_variable(tfd.Bernoulli(logits=2.0 * z, dtype=jnp.float32), name="t")(kt)
    mean = ppl.deterministic(z + 2.0 * t, name="mean")
    return ppl.random_variable(tfd.Sample(tfd.Normal(mean, s), 3), name="y")(ky)


def _mcse(x):
    """Monte-Carlo standard error of the mean of draws x [chains, draws], by ArviZ's ESS."""
    x = np.asarray(x)
    return float(x.std() / np.sqrt(az.ess(x, method="mean")))


def _exact_means(observed_t):
    """E[z], E[s] given y (and t = 1 observed, or t set to 1 by do()), by quadrature."""
    z, s = jnp.meshgrid(jnp.linspace(-4.0, 5.0, 600), jnp.linspace(1e-3, 6.0, 600))
    log_post = (
        tfd.Normal(0.0, 1.0).log_prob(z)
        + tfd.HalfNormal(1.0).log_prob(s)
        + tfd.Normal(z + 2.0, s).log_prob(Y[:, None, None]).sum(0)
    )
    if observed_t:
        log_post = log_post + tfd.Bernoulli(logits=2.0 * z).log_prob(1.0)
    weights = jax.nn.softmax(log_post.ravel())
    return float(weights @ z.ravel()), float(weights @ s.ravel())


@pytest.fixture(scope="module")
def under_do():
    do_t = ppl.intervene(scm, t=jnp.float32(1.0))
    return ppl.sample_posterior(
        do_t, jax.random.key(0), observed={"y": Y}, num_samples=400, num_warmup=300, num_chains=2
    )


def test_nuts_posterior_under_do_matches_the_exact_one(under_do):
    z, s = under_do.samples["z"], under_do.samples["s"]
    assert z.shape == s.shape == (2, 400)
    assert float(s.min()) > 0.0  # drawn through the softplus onto the support
    exact_z, exact_s = _exact_means(observed_t=False)
    assert abs(float(z.mean()) - exact_z) < 4 * _mcse(z)
    assert abs(float(s.mean()) - exact_s) < 4 * _mcse(s)
    assert int(under_do.diverging.sum()) == 0
    # The deterministic site comes back per draw, computed from that draw.
    np.testing.assert_allclose(under_do.samples["mean"], z + 2.0, rtol=1e-6)
    assert "t" not in under_do.samples  # fixed by do(): not random


def test_conditioning_on_t_is_not_intervening():
    # Observing t = 1 also says that t's cause z is likely positive: the posterior moves up.
    seen = ppl.sample_posterior(
        scm,
        jax.random.key(1),
        observed={"y": Y, "t": jnp.float32(1.0)},
        num_samples=400,
        num_warmup=300,
        num_chains=2,
        kernel="hmc",
    )
    exact_z, _ = _exact_means(observed_t=True)
    z = seen.samples["z"]
    assert abs(float(z.mean()) - exact_z) < 4 * _mcse(z)
    assert exact_z > _exact_means(observed_t=False)[0] + 0.05


def test_summary_is_arviz_s_diagnostics_with_numpy_s_quantiles(under_do):
    table = under_do.summary(quantiles=(0.1, 0.9))
    assert list(table.columns) == [
        "mean",
        "sd",
        "10%",
        "90%",
        "r_hat",
        "ess_bulk",
        "ess_tail",
        "mcse_mean",
    ]
    z = np.asarray(under_do.samples["z"])
    np.testing.assert_allclose(table.loc["z", "mean"], z.mean(), atol=1e-3)
    # Four significant digits: within half a unit of the fourth.
    np.testing.assert_allclose(table.loc["z", "10%"], np.quantile(z, 0.1), rtol=5e-4)
    np.testing.assert_allclose(table.loc["z", "r_hat"], az.rhat(z), atol=0.01)
    np.testing.assert_allclose(table.loc["z", "ess_bulk"], az.ess(z, method="bulk"), rtol=0.01)
    np.testing.assert_allclose(table.loc["z", "ess_tail"], az.ess(z, method="tail"), rtol=0.01)
    assert float(table.loc["z", "r_hat"]) < 1.05
    data = under_do.to_arviz()
    np.testing.assert_array_equal(data.posterior["z"].values, z)
    np.testing.assert_array_equal(data.sample_stats["lp"].values, under_do.log_density)


def test_bad_arguments_say_what_to_use():
    with pytest.raises(ValueError, match="unknown kernel 'mala'"):
        ppl.sample_posterior(scm, jax.random.key(0), kernel="mala")
    with pytest.raises(ValueError, match="`num_chains` to be a positive int"):
        ppl.sample_posterior(scm, jax.random.key(0), num_chains=0)
    with pytest.raises(ValueError, match="unknown init 'median'. Use one of 'uniform', 'prior'"):
        ppl.sample_posterior(scm, jax.random.key(0), init="median")
    with pytest.raises(ValueError, match="`max_tree_depth` to be a positive int"):
        ppl.sample_posterior(scm, jax.random.key(0), max_tree_depth=0)
    everything = {"z": 0.0, "s": 1.0, "t": jnp.float32(1.0), "y": Y}
    with pytest.raises(ValueError, match="no free continuous random variable"):
        ppl.sample_posterior(scm, jax.random.key(0), observed=everything)


def test_posterior_under_do_matches_numpyro_s(under_do):
    numpyro = pytest.importorskip("numpyro")
    dist = pytest.importorskip("numpyro.distributions")

    # The mutilated graph written by hand: t is 1 and has no density. (NumPyro's own `do`
    # keeps the original draw as a discrete latent "t__CF", which its NUTS cannot sample
    # without funsor's enumeration.)
    def numpyro_do_t(y):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("n", 3):
            numpyro.sample("y", dist.Normal(z + 2.0 * 1.0, s), obs=y)

    program = functools.partial(numpyro_do_t, Y)
    mcmc = numpyro.infer.MCMC(
        numpyro.infer.NUTS(program),
        num_warmup=300,
        num_samples=400,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(3))
    theirs = mcmc.get_samples(group_by_chain=True)
    for name in ("z", "s"):
        a, b = under_do.samples[name], theirs[name]
        tolerance = 4 * np.hypot(_mcse(a), _mcse(b))
        assert abs(float(a.mean()) - float(b.mean())) < tolerance, name


@pytest.mark.parametrize("init, dense_mass", [("prior", False), ("uniform", True)])
def test_the_prior_start_and_a_dense_mass_matrix_sample_the_same_posterior(init, dense_mass):
    do_t = ppl.intervene(scm, t=jnp.float32(1.0))
    posterior = ppl.sample_posterior(
        do_t,
        jax.random.key(5),
        observed={"y": Y},
        num_samples=400,
        num_warmup=300,
        num_chains=2,
        init=init,
        dense_mass=dense_mass,
        max_tree_depth=8,
    )
    exact_z, exact_s = _exact_means(observed_t=False)
    z, s = posterior.samples["z"], posterior.samples["s"]
    assert abs(float(z.mean()) - exact_z) < 4 * _mcse(z)
    assert abs(float(s.mean()) - exact_s) < 4 * _mcse(s)


def test_a_dirichlet_posterior_is_the_conjugate_dirichlet():
    alpha, counts = jnp.array([1.0, 2.0, 3.0]), jnp.array([2.0, 3.0, 5.0])

    def model(key):
        kp, ky = jax.random.split(key)
        p = ppl.random_variable(tfd.Dirichlet(alpha), name="p")(kp)
        return ppl.random_variable(tfd.Multinomial(10.0, probs=p), name="y")(ky)

    posterior = ppl.sample_posterior(
        model,
        jax.random.key(4),
        observed={"y": counts},
        num_samples=500,
        num_warmup=300,
        num_chains=2,
    )
    exact = tfd.Dirichlet(alpha + counts)  # Dirichlet-multinomial conjugacy
    p = np.asarray(posterior.samples["p"])
    assert p.shape == (2, 500, 3)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    for i in range(3):
        assert abs(p[..., i].mean() - float(exact.mean()[i])) < 4 * _mcse(p[..., i]), i
        np.testing.assert_allclose(p[..., i].std(), exact.stddev()[i], rtol=0.15)
    assert int(posterior.diverging.sum()) == 0


def _draws_on_many_scales():
    """A Posterior made of draws written down (no sampler): a site on the scale 1e-5, one whose
    fourth chain is shifted (R-hat about 1.005), and a vector site on the scales 1e-6 and 1e3."""
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    samples = {
        "small": 3e-5 * jax.random.normal(k1, (4, 500)) + 2e-5,
        "shift": jax.random.normal(k2, (4, 500)) + jnp.array([0.0, 0.0, 0.0, 0.25])[:, None],
        "theta": jax.random.normal(k3, (4, 500, 2)) * jnp.array([1e-6, 1e3]),
    }
    zeros = jnp.zeros((4, 500))
    return ppl.Posterior(samples, zeros, {}, zeros > 0, zeros, jnp.ones(4))


def test_summary_keeps_four_significant_digits_of_arviz_s_numbers():
    posterior = _draws_on_many_scales()
    table = posterior.summary(quantiles=(0.05, 0.95))
    raw = az.summary(posterior.to_arviz(), kind="all", round_to="none")
    stacked = posterior.to_arviz().posterior.stack(sample=("chain", "draw"))
    assert sorted(table.index) == ["shift", "small", "theta[0]", "theta[1]"]
    for row in table.index:
        name, _, index = row.partition("[")
        values = stacked[name].values
        values = values[int(index.rstrip("]"))] if index else values
        reference = {
            **{c: raw.loc[row, c] for c in ("mean", "sd", "r_hat", "mcse_mean")},
            "5%": np.quantile(values, 0.05),
            "95%": np.quantile(values, 0.95),
        }
        for column, value in reference.items():
            expected = float(f"{value:.4g}")  # Python's own rounding to 4 significant digits
            np.testing.assert_allclose(table.loc[row, column], expected, rtol=1e-12, err_msg=row)
        for column in ("ess_bulk", "ess_tail"):
            assert table.loc[row, column] == round(raw.loc[row, column])
    # What ArviZ's own rounding (to decimals) loses, the table keeps.
    shown = az.summary(posterior.to_arviz(), kind="all")
    assert shown.loc["shift", "r_hat"] == 1.0 and table.loc["shift", "r_hat"] == 1.005
    assert shown.loc["small", "mean"] == 0.0 and table.loc["small", "mean"] != 0.0


def test_summary_digits_none_is_arviz_s_numbers_unrounded():
    posterior = _draws_on_many_scales()
    table = posterior.summary(quantiles=(0.5,), digits=None)
    raw = az.summary(posterior.to_arviz(), kind="all", round_to="none")
    for column in ("mean", "sd", "r_hat", "ess_bulk", "ess_tail", "mcse_mean"):
        np.testing.assert_array_equal(table[column], raw.loc[table.index, column])
    with pytest.raises(ValueError, match="`digits` to be a positive int"):
        posterior.summary(digits=0)
