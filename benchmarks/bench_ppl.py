"""harvest.ppl against NumPyro on the five trial models: the costs a sampler pays.

Each model of `benchmarks/ppl_models.py` (eight schools, hierarchical logistic
regression, the enumerated mixture, AR(1) centred and non-centred, the
changepoint model) is scored over unconstrained values on both sides:
`harvest.ppl.unconstrained(...).log_density` and NumPyro's `potential_fn` from
`initialize_model`, negated. Four measures, each the ratio harvest / NumPyro,
timed interleaved in one run:

* gradient: a jitted call of the gradient of the log density (steady state);
* first compile of the density, and of its gradient: the first call of
  `jax.jit(log_density)` / `jax.jit(jax.grad(log_density))` on a fresh
  program (tracing, the harvest walks, lowering and XLA's compile);
* first eager score: the first eager `joint_log_prob(model)(values)` of a
  fresh program against NumPyro's first `log_density(model, ...)` call.

NumPyro comes from the `test` extra; without it the section reports nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import jax

from . import _timing

MEASURES = (
    "jitted gradient",
    "first compile of the density",
    "first compile of the gradient",
    "first eager joint log density",
)
# What each ratio (harvest / NumPyro) should stay under (issue 25).
TARGETS = {MEASURES[0]: 1.1, MEASURES[1]: 1.3, MEASURES[2]: 1.3}


@dataclasses.dataclass(frozen=True)
class Config:
    repeats: int = 31  # interleaved timings per side of the steady gradient
    calls: int = 20  # back-to-back gradient calls per timing
    firsts: int = 3  # fresh first-compile and first-eager measurements per side
    models: tuple[str, ...] = (
        "eight schools",
        "logistic regression",
        "mixture",
        "AR(1) centred",
        "AR(1) non-centred",
        "changepoint",
    )


# `make test` pays for the quick run: one model (a fuller run: `python -m benchmarks --only ppl`).
QUICK = Config(repeats=2, calls=2, firsts=1, models=("eight schools",))


def harvest_side(trial):
    """harvest.ppl's unconstrained log density of `trial` (nothing traced yet)."""
    import harvest.ppl as ppl

    return ppl.unconstrained(trial.harvest, observed=trial.observed).log_density


def harvest_start(trial):
    """A start u for `trial` on harvest's side: a prior draw."""
    import harvest.ppl as ppl

    return ppl.unconstrained(trial.harvest, observed=trial.observed).init(jax.random.key(0))


def numpyro_side(trial):
    """The log density over NumPyro's unconstrained params of `trial`, and a start."""
    from numpyro.infer.util import initialize_model

    info = initialize_model(jax.random.key(0), trial.numpyro, dynamic_args=False)
    return lambda p: -info.potential_fn(p), info.param_info.z


def _first(fn):
    start = time.perf_counter()
    _timing.block(fn())
    return time.perf_counter() - start


def _model_rows(name, cfg):
    import harvest.ppl as ppl

    from . import ppl_models

    trial = ppl_models.trial(name)
    ours, u = harvest_side(trial), harvest_start(trial)
    theirs, params = numpyro_side(trial)
    grad_ours, grad_theirs = jax.jit(jax.grad(ours)), jax.jit(jax.grad(theirs))
    _timing.block((grad_ours(u), grad_theirs(params)))
    ratio, a, b = _timing.ratio(
        lambda: grad_ours(u), lambda: grad_theirs(params), cfg.repeats, cfg.calls
    )
    rows = [dict(model=name, measure=MEASURES[0], ratio=ratio, ours=a, theirs=b)]

    firsts = {m: ([], []) for m in MEASURES[1:]}
    for i in range(cfg.firsts):
        fresh = ppl_models.trial(name)  # new functions: nothing of them is cached yet
        # NumPyro's `initialize_model` traces the model once; it is not timed.
        fresh_ours, (fresh_theirs, _) = harvest_side(fresh), numpyro_side(fresh)
        again = ppl_models.trial(name)
        again_ours, (again_theirs, _) = harvest_side(again), numpyro_side(again)
        pairs = (
            (MEASURES[1], lambda: jax.jit(fresh_ours)(u), lambda: jax.jit(fresh_theirs)(params)),
            (
                MEASURES[2],
                lambda: jax.jit(jax.grad(again_ours))(u),
                lambda: jax.jit(jax.grad(again_theirs))(params),
            ),
            (
                MEASURES[3],
                lambda: ppl.joint_log_prob(fresh.harvest)({**fresh.point, **fresh.observed}),
                lambda: ppl_models.numpyro_log_density(fresh, fresh.point),
            ),
        )
        for measure, first_ours, first_theirs in pairs:
            order = [(first_ours, 0), (first_theirs, 1)]
            for fn, side in order if i % 2 == 0 else order[::-1]:
                firsts[measure][side].append(_first(fn))
    for measure, (a_, b_) in firsts.items():
        a, b = min(a_), min(b_)
        rows.append(dict(model=name, measure=measure, ratio=a / b, ours=a, theirs=b))
    return rows


def run(cfg: Config = Config()):
    if importlib.util.find_spec("numpyro") is None:
        return []
    return [row for name in cfg.models for row in _model_rows(name, cfg)]


def render(rows):
    """The section of docs/benchmarks.md, from `run`'s rows."""
    lines = [
        "## harvest.ppl against NumPyro",
        "",
        "The five trial models (`benchmarks/ppl_models.py`) in harvest.ppl and in NumPyro: the",
        "jitted gradient of each side's unconstrained log density (median of interleaved",
        "timings), the first compile of that density and of its gradient, and the first eager",
        "joint log density of a fresh program (fastest of a few fresh runs). Targets (issue 25):",
        "gradient ≤1.1, first compiles ≤1.3, first eager score ≤10 ms on eight schools.",
        "",
        "| model | measure | harvest.ppl (ms) | NumPyro (ms) | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = TARGETS.get(r["measure"])
        if r["measure"] == MEASURES[3] and r["model"] == "eight schools":
            verdict = "met" if r["ours"] <= 0.010 else "**missed** (≤10 ms)"
        elif target is None:
            verdict = ""
        else:
            verdict = "met" if r["ratio"] <= target else f"**missed** (≤{target})"
        lines.append(
            f"| {r['model']} | {r['measure']} | {1e3 * r['ours']:.3f} | {1e3 * r['theirs']:.3f} "
            f"| {r['ratio']:.2f} | {verdict} |"
        )
    if not rows:
        lines.append("| (NumPyro not installed) | | | | | |")
    return lines


if __name__ == "__main__":
    import sys

    for line in render(run(QUICK if "--quick" in sys.argv else Config())):
        print(line)
