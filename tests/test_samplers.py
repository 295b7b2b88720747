"""Sites inside samplers: a KV-cache decode loop written as `lax.while_loop`.

An NNX decoder, instrumented, is called once per iteration of a greedy decode
loop that stops at an end token (so the trip count is known only when it
runs). Every planted and reaped value is checked against the same decode
written by hand: a Python loop over a forward pass written out from the
model's parameters, with the steering vector added by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import close

from harvest import Steps, add_vector, call_and_reap, instrument, nest, plant, reap, sites, sow

nnx = pytest.importorskip("flax.nnx")
from benchmarks import decoder  # noqa: E402  (needs Flax)

V, D, L, P = 13, 8, 12, 3  # vocabulary, width, buffer length, prompt length
END = 0  # decoding stops once it emits this token
TOL = dict(rtol=2e-5, atol=2e-5)
traces = {"n": 0}


class Decoder(decoder.Decoder):
    """The shared decoder, counting how often JAX traces its step."""

    def __call__(self, token, pos, caches):
        traces["n"] += 1  # runs only while JAX traces the step
        return super().__call__(token, pos, caches)


def prompt_buffer(prompt):
    return jnp.zeros(L, jnp.int32).at[:P].set(jnp.asarray(prompt, jnp.int32))


def decode(model, tokens):
    """Greedy decoding into `tokens` after its first P (the prompt), fed one
    token per iteration; stops at END or when the buffer is full."""

    def running(carry):
        tokens, pos, _ = carry
        return (pos < L - 1) & ((pos < P) | (tokens[pos] != END))

    def step(carry):
        tokens, pos, caches = carry
        logits, caches = model(tokens[pos], pos, caches)
        token = jnp.where(pos + 1 < P, tokens[pos + 1], jnp.argmax(logits).astype(jnp.int32))
        return tokens.at[pos + 1].set(token), pos + 1, caches

    caches = [(jnp.zeros((L, D)), jnp.zeros((L, D))) for _ in range(2)]
    tokens, pos, _ = jax.lax.while_loop(running, step, (tokens, jnp.int32(0), caches))
    return tokens, pos


def hand_decode(model, prompt, steer=lambda layer, step, h: h):
    """The same decode as a Python loop over a forward written out by hand;
    `steer(layer, step, h)` replaces each block's MLP output `h`. Returns the
    tokens, the number of steps and each step's block-0 MLP output."""
    tokens = list(np.asarray(prompt_buffer(prompt)))
    caches = [(np.zeros((L, D)), np.zeros((L, D))) for _ in range(2)]
    mlp0, pos = [], 0
    dense = lambda lin, x: x @ lin.kernel[...] + lin.bias[...]
    while pos < L - 1 and (pos < P or tokens[pos] != END):
        x = model.embed.embedding[...][tokens[pos]]
        for i, block in enumerate(model.blocks):
            keys, values = (c.copy() for c in caches[i])
            keys[pos], values[pos] = dense(block.attn.k, x), dense(block.attn.v, x)
            caches[i] = (keys, values)
            scores = np.where(
                np.arange(L) <= pos, keys @ dense(block.attn.q, x) / np.sqrt(D), -np.inf
            )
            x = x + dense(block.attn.o, jax.nn.softmax(scores) @ values)
            h = steer(i, pos, dense(block.mlp, x))
            if i == 0:
                mlp0.append(np.asarray(h))
            x = x + np.tanh(h)
        logits = dense(model.head, x)
        tokens[pos + 1] = tokens[pos + 1] if pos + 1 < P else int(np.argmax(logits))
        pos += 1
    return np.array(tokens), pos, np.stack(mlp0)


@pytest.fixture(scope="module")
def model():
    return Decoder(V, D, 2, nnx.Rngs(3))


PROMPT = [5, 2, 7]
VEC = 3.0 * jnp.sin(jnp.arange(D, dtype=jnp.float32) + 1.0)


def test_the_decode_runs_as_written_by_hand(model):
    tokens, steps = decode(instrument(model), prompt_buffer(PROMPT))
    want, n, _ = hand_decode(model, PROMPT)
    np.testing.assert_array_equal(tokens, want)
    assert int(steps) == n


def test_add_vector_steers_every_iteration_as_by_hand(model):
    probed = instrument(model)
    steered = plant(decode, tag="modules")(
        {"blocks.0.mlp": add_vector(VEC)}, probed, prompt_buffer(PROMPT)
    )
    want, n, _ = hand_decode(model, PROMPT, lambda i, t, h: h + np.asarray(VEC) if i == 0 else h)
    np.testing.assert_array_equal(steered[0], want)
    assert int(steered[1]) == n
    unsteered, _, _ = hand_decode(model, PROMPT)
    assert (want != unsteered).any()  # the steering changes what is generated


def test_a_callable_taking_the_iteration_index_and_a_constant(model):
    probed = instrument(model)
    # Steer only the generated tokens' steps, from iteration P on.
    late = lambda old, i: jnp.where(i >= P, old - 2.0 * VEC, old)
    got = plant(decode, tag="modules")({"blocks.1.mlp": late}, probed, prompt_buffer(PROMPT))
    hand = lambda i, t, h: h - 2.0 * np.asarray(VEC) if i == 1 and t >= P else h
    np.testing.assert_array_equal(got[0], hand_decode(model, PROMPT, hand)[0])
    const = jnp.linspace(-1.0, 1.0, D)
    got = plant(decode, tag="modules")({"blocks.0.mlp": const}, probed, prompt_buffer(PROMPT))
    hand = lambda i, t, h: np.asarray(const) if i == 0 else h
    np.testing.assert_array_equal(got[0], hand_decode(model, PROMPT, hand)[0])


def test_changing_the_vector_compiles_once(model):
    probed = instrument(model)
    steer = jax.jit(plant(decode, tag="modules"))
    steer({"blocks.0.mlp": add_vector(VEC)}, probed, prompt_buffer(PROMPT))
    before = traces["n"]
    for scale in (0.5, -1.0, 2.0):
        got = steer({"blocks.0.mlp": add_vector(scale * VEC)}, probed, prompt_buffer(PROMPT))
        want = hand_decode(
            model, PROMPT, lambda i, t, h, s=scale: h + s * np.asarray(VEC) if i == 0 else h
        )
        np.testing.assert_array_equal(got[0], want[0])
    assert traces["n"] == before  # no retrace
    # The same without the outer jit: plant's own cache.
    eager = plant(decode, tag="modules")
    eager({"blocks.0.mlp": add_vector(VEC)}, probed, prompt_buffer(PROMPT))
    before = traces["n"]
    eager({"blocks.0.mlp": add_vector(-VEC)}, probed, prompt_buffer(PROMPT))
    assert traces["n"] == before


def test_reap_gives_the_last_iteration_or_every_step(model):
    probed = instrument(model)
    _, n, mlp0 = hand_decode(model, PROMPT)
    last = reap(decode, tag="modules")(probed, prompt_buffer(PROMPT))
    np.testing.assert_allclose(last["blocks.0.mlp"], mlp0[-1], **TOL)
    assert last["blocks.0.attn"][1][0].shape == (L, D)  # a tuple output: the keys cache
    for max_steps in (L, n, 4):
        out, got = jax.jit(call_and_reap(decode, tag="modules", max_steps=max_steps))(
            probed, prompt_buffer(PROMPT)
        )
        rec = got["blocks.0.mlp"]
        assert isinstance(rec, Steps) and rec.values.shape == (max_steps, D)
        assert int(rec.count) == n == int(out[1])
        k = min(n, max_steps)
        np.testing.assert_allclose(rec.values[:k], mlp0[:k], **TOL)
        np.testing.assert_array_equal(rec.values[k:], 0.0)  # steps that did not run
    info = {s.name: s for s in sites(decode, tag="modules")(probed, prompt_buffer(PROMPT))}
    assert info["blocks.0.mlp"].fires is None  # unbounded: inside a while_loop


def test_op_sites_in_the_loop_body(model):
    probed = instrument(lambda tokens: decode(model, tokens), ops=True)
    tokens, n, _ = hand_decode(model, PROMPT)
    got = reap(probed, tag="modules", max_steps=L)(prompt_buffer(PROMPT))
    argmax = [v for k, v in got.items() if k.endswith("argmax:0")]
    assert len(argmax) == 1 and isinstance(argmax[0], Steps)
    assert int(argmax[0].count) == n
    # Each step's argmax is the generated token (for steps past the prompt).
    np.testing.assert_array_equal(argmax[0].values[P - 1 : n], tokens[P : n + 1])
    last = reap(probed, tag="modules")(prompt_buffer(PROMPT))
    name = next(k for k in last if k.endswith("argmax:0"))
    assert int(last[name]) == tokens[n]
    # Planting an op site inside the body: force the token, every iteration.
    forced = plant(probed, tag="modules")({name: jnp.int32(4)}, prompt_buffer(PROMPT))[0]
    assert forced[P:].tolist() == [4] * (L - P)


def test_vmap_inside_with_per_example_stops(model):
    probed = instrument(model)
    prompts = jnp.stack([prompt_buffer(PROMPT), prompt_buffer([1, 8, 4])])
    batched = lambda m, ps: jax.vmap(lambda t: decode(m, t))(ps)
    last = reap(batched, tag="modules")(probed, prompts)["blocks.0.mlp"]
    for b, prompt in enumerate(([5, 2, 7], [1, 8, 4])):
        np.testing.assert_allclose(last[b], hand_decode(model, prompt)[2][-1], **TOL)
    with pytest.raises(ValueError, match=r"(?s)while_loop.*jax.vmap\(reap\(f\)\)"):
        reap(batched, tag="modules", max_steps=L)(probed, prompts)
    per_example = jax.vmap(reap(decode, tag="modules", max_steps=L), in_axes=(None, 0))
    rec = per_example(probed, prompts)["blocks.0.mlp"]
    for b, prompt in enumerate(([5, 2, 7], [1, 8, 4])):
        _, n, mlp0 = hand_decode(model, prompt)
        assert int(rec.count[b]) == n
        np.testing.assert_allclose(rec.values[b, :n], mlp0, **TOL)


# ---------------------------------------------------------------------------
# The same semantics on hand-written sows.


def doubling(mode, per_iteration=1):
    def f(x):
        def body(c):
            for _ in range(per_iteration):
                c = sow(c * 2.0, name="c", mode=mode)
            return c

        return jax.lax.while_loop(lambda c: c < 10.0, body, x)

    return f


def test_append_and_collect_per_step_records():
    rec = reap(doubling("append"), max_steps=6)(1.0)["c"]
    close(rec.values, jnp.array([2.0, 4.0, 8.0, 16.0, 0.0, 0.0]))
    assert int(rec.count) == 4
    rec = reap(doubling("append", 2), max_steps=3)(1.0)["c"]  # k=2 rows per iteration
    close(rec.values, jnp.array([2.0, 4.0, 8.0, 16.0, 0.0, 0.0]))
    assert int(rec.count) == 2
    rec = reap(doubling("collect"), max_steps=2)(1.0)["c"]  # truncated to the first two
    close(rec.values, (jnp.array([2.0, 4.0]),))
    assert int(rec.count) == 4
    rec = reap(doubling("append"), max_steps=2)(20.0)["c"]  # no iteration at all
    close(rec.values, jnp.zeros(2))
    assert int(rec.count) == 0
    # Carried modes are unchanged by max_steps: the last iteration.
    close(reap(doubling("clobber"), max_steps=2)(1.0), {"c": jnp.array(16.0)})


def test_a_scan_inside_the_body_stacks_its_rows():
    def f(x):
        def body(c):
            return jax.lax.scan(
                lambda a, _: (sow(a + 1.0, name="h", mode="append"), None), c, None, 3
            )[0]

        return jax.lax.while_loop(lambda c: c < 5.0, body, x)

    rec = reap(f, max_steps=3)(0.0)["h"]
    close(rec.values, jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0, 0.0]))
    assert int(rec.count) == 2


def test_errors_name_the_option_that_works():
    with pytest.raises(ValueError, match=r"(?s)'append' inside a while_loop.*max_steps=N"):
        reap(doubling("append"))(1.0)
    with pytest.raises(ValueError, match="max_steps must be a positive int"):
        reap(doubling("append"), max_steps=0)
    for rows in (jnp.ones(1), reap(doubling("append"), max_steps=4)(1.0)["c"]):
        with pytest.raises(ValueError, match=r"one value per occurrence.*fn\(old, i\)"):
            plant(doubling("append"))({"c": rows}, 1.0)

    def in_scan(xs):
        return jax.lax.scan(lambda c, x: (c + doubling("append")(x), None), 0.0, xs)[0]

    in_cond = lambda x, p: jax.lax.cond(p, doubling("append"), lambda x: x, x)
    for f, args in ((in_scan, (jnp.ones(2),)), (in_cond, (1.0, True))):
        with pytest.raises(ValueError, match=r"(?s)per step \(max_steps\).*without max_steps"):
            reap(f, max_steps=4)(*args)

    def also_outside(x):
        return doubling("append")(sow(x, name="c", mode="append"))

    with pytest.raises(ValueError, match=r"(?s)also sown outside.*harvest.nest"):
        reap(also_outside, max_steps=4)(1.0)
    # The way out the message names: the loop's sows under their own scope.
    scoped = lambda x: nest(doubling("append"), scope="loop")(sow(x, name="c", mode="append"))
    got = reap(scoped, max_steps=4)(1.0)
    close(got["c"], jnp.array([1.0]))
    close(got["loop"]["c"].values, jnp.array([2.0, 4.0, 8.0, 16.0]))
