"""What a type checker tells a user of harvest (checked by mypy in `make lint`, never run).

Each `assert_type` fails the lint if a public signature stops saying it:
`reap(f)` keeps f's parameters, `plant(f)` takes the plants first, and so on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, assert_type

import jax
import jax.numpy as jnp

import harvest
import harvest.ppl as ppl
from harvest.compat import oryx


def f(x: jax.Array, scale: float) -> jax.Array:
    return harvest.sow(x * scale, name="h", mode="strict")


x = jnp.ones(3)

# sow and friends return what they are given.
assert_type(harvest.sow(x, name="h"), jax.Array)
assert_type(harvest.sow((x, 1.0), name="h"), tuple[jax.Array, float])
assert_type(harvest.sow_cond(x, True, name="h"), jax.Array)
assert_type(harvest.perturb(x, name="g"), jax.Array)

# The transformations keep f's parameters and change only what is returned.
# (Assigning to a Callable type checks the parameters; a keyword call checks
# that their names are kept too.)
reaped: Callable[[jax.Array, float], dict[str, Any]] = harvest.reap(f)
assert_type(harvest.reap(f)(x, scale=2.0), dict[str, Any])
assert_type(harvest.call_and_reap(f)(x, 2.0), tuple[jax.Array, dict[str, Any]])
assert_type(harvest.capture(f)(x, 2.0), tuple[jax.Array, dict[str, Any]])
assert_type(harvest.nest(f, scope="s")(x, scale=2.0), jax.Array)
assert_type(harvest.stream(f, print)(x, scale=2.0), jax.Array)
# plant and harvest take the plants first.
planted: Callable[[dict[str, Any], jax.Array, float], jax.Array] = harvest.plant(f)
assert_type(harvest.plant(f)({"h": x}, x, scale=2.0), jax.Array)
assert_type(harvest.harvest(f)({"h": x}, x, 2.0), tuple[jax.Array, dict[str, Any]])
# Name selectors: names, glob patterns, predicates, or several.
harvest.reap(f, names=["h", "blocks.*", lambda name: name.startswith("a")], exclude="g")

# instrument returns something called exactly as the target.
assert_type(harvest.instrument(f)(x, scale=2.0), jax.Array)

# Inspection and patching.
assert_type(harvest.sites(f)(x, 2.0), harvest.Sites)
assert_type(harvest.sites(f)(x, 2.0)[0], harvest.SiteInfo)
assert_type(harvest.sites(f)(x, 2.0).names(), list[str])
result = harvest.patching_sweep(f, {"h": x}, (x, 2.0), jnp.sum, axis=0)
assert_type(result, harvest.PatchingResult)
assert_type(result.normalized(1.0), harvest.PatchingResult)
assert_type(result.names, tuple[str, ...])
assert_type(harvest.attribution_patching(f, {"h": x}, (x, 2.0), jnp.sum), harvest.PatchingResult)
harvest.plant(f)({"h": harvest.ablate_zero()}, x, 2.0)
harvest.plant(f)({"h": harvest.patch_positions(x, [0, 2], axis=0)}, x, 2.0)


# harvest.ppl: a program is model(key, *args); its transformations keep *args.
def normal(key: jax.Array, shift: float) -> jax.Array:
    return jax.random.normal(key) + shift


def model(key: jax.Array, mu: float) -> jax.Array:
    # A sampling function as a random variable keeps its parameters.
    return ppl.random_variable(normal, name="z")(key, shift=mu)


key = jax.random.key(0)
assert_type(ppl.joint_sample(model)(key, mu=0.0), dict[str, Any])
scored: Callable[[dict[str, Any], float], jax.Array] = ppl.joint_log_prob(model)
assert_type(ppl.joint_log_prob(model)({"z": x}, mu=0.0), jax.Array)
assert_type(ppl.log_prob(model)(x, mu=0.0), jax.Array)
assert_type(ppl.trace(model)(key, mu=0.0), tuple[jax.Array, dict[str, Any]])
assert_type(ppl.trace_log_prob(model)(x, {"z": x}, mu=0.0), jax.Array)
assert_type(ppl.intervene(model, z=1.0)(key, mu=0.0), jax.Array)
assert_type(ppl.block(model, ["z"])(key, mu=0.0), jax.Array)
assert_type(ppl.unconstrained(model).log_density, Callable[..., jax.Array])
assert_type(ppl.deterministic(x, name="d"), jax.Array)
# The key comes right after the model, in every call.
assert_type(ppl.predictive(model, key, 0.0, num_samples=2), dict[str, Any])
# plate as a call and as a decorator with arguments.
assert_type(ppl.plate(model, name="data", size=3)(key, mu=0.0), jax.Array)


@ppl.plate(name="data", size=3)
def plated(key: jax.Array, mu: float) -> jax.Array:
    return model(key, mu)


assert_type(plated(key, mu=0.0), jax.Array)
counting = ppl.make_effect_handler({jax.lax.exp_p: lambda n, x, **params: (jnp.exp(x), n + 1)})
assert_type(counting(f)(0, x, scale=2.0), tuple[jax.Array, Any])

# The oryx names keep the same signatures.
assert_type(oryx.reap(f, tag="t")(x, scale=2.0), dict[str, Any])
assert_type(oryx.plant(f, tag="t")({"h": x}, x, 2.0), jax.Array)
assert_type(oryx.sow(x, tag="t", name="h"), jax.Array)
