"""make_effect_handler: per-primitive handlers with a threaded state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl


def test_handlers_replace_primitives_and_thread_state_through_jit():
    def counting_exp(n, x, **params):
        return jnp.exp(x) + 1.0, n + 1

    @jax.jit
    def inner(x):
        return jnp.exp(x)

    def f(x):
        return inner(x) * jnp.exp(x)

    out, n = ppl.make_effect_handler({jax.lax.exp_p: counting_exp})(f)(0, 0.5)
    assert n == 2
    np.testing.assert_allclose(out, (np.exp(0.5) + 1.0) ** 2, rtol=1e-6)


def test_no_handlers_is_the_identity_and_keeps_pytrees():
    f = lambda x: {"a": jnp.sin(x), "b": (x, 2 * x)}  # noqa: E731
    out, state = ppl.make_effect_handler({})(f)("untouched", 1.0)
    assert state == "untouched"
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: np.allclose(a, b), out, f(1.0))
    )


def test_transformed_function_composes_with_jit_and_grad():
    handled = ppl.make_effect_handler({jax.lax.sin_p: lambda s, x, **p: (jnp.cos(x), s + x)})(
        jnp.sin
    )
    np.testing.assert_allclose(jax.jit(handled)(0.0, 0.3)[0], np.cos(0.3), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: handled(0.0, x)[0])(0.3), -np.sin(0.3), rtol=1e-6)


def test_handled_primitive_in_a_while_predicate_is_a_clear_error():
    # The predicate returns only a bool, so no state can leave it.
    def f(x):
        return jax.lax.while_loop(lambda c: jnp.exp(c) < 3.0, lambda c: c + 1.0, x)

    with pytest.raises(NotImplementedError, match="cannot be threaded through"):
        ppl.make_effect_handler({jax.lax.exp_p: lambda s, x, **p: (jnp.exp(x), s)})(f)(None, 0.0)
    with pytest.raises(TypeError, match="takes a dict"):
        ppl.make_effect_handler([jax.lax.exp_p])
