import jax, jax.numpy as jnp
from harvest import sites, sow, instrument
def f(xs):
    def body(c, x):
        c = jax.lax.cond(x > 0, lambda c: sow(c, name="pos", mode="clobber"), lambda c: sow(-c, name="neg", mode="clobber"), c)
        return c + sow(x * c, name="step", mode="append"), None
    a = jax.lax.scan(body, 1.0, xs)[0]
    b = jax.lax.scan(body, a, xs)[0]
    return sow(b, name="total", mode="strict")
s = sites(jax.jit(f), jnp.zeros(12))
print(s)
s.to_html("/tmp/sites.html")
g = instrument(lambda x: jnp.tanh(x @ x.T).sum(), ops=True)
print(sites(g, jnp.ones((3,3))))
sites(g, jnp.ones((3,3))).to_html("/tmp/ops.html")
