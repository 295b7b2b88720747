import time, gc, weakref
import jax, jax.numpy as jnp
from harvest import sow, reap, patching_sweep, attribution_patching
def make():
    def f(x, w):
        for i in range(4):
            x = sow(jnp.tanh(x @ w), name=f"l{i}", mode="strict")
        return x
    return f
f = make()
w = jax.random.normal(jax.random.key(0), (16, 16)); x = jax.random.normal(jax.random.key(1), (8, 16))
clean = reap(f)(x, w)
metric = lambda y: y.sum()
for fn in (patching_sweep, attribution_patching):
    ts = []
    for i in range(3):
        t = time.perf_counter(); r = fn(f, clean, (x * 0.5, w), metric, axis=0); ts.append(time.perf_counter() - t)
    print(fn.__name__, ["%.3f" % t for t in ts], ts[0] / ts[1])
r2 = patching_sweep(f, clean, (x * 0.3, w), metric, axis=0)
print(r2.values[0, :3])
import numpy as np
from harvest import plant, patch_positions
print([float(metric(plant(f)({"l0": patch_positions(clean["l0"], p, axis=0)}, x * 0.3, w)) - metric(f(x * 0.3, w))) for p in range(3)])
ref = weakref.ref(f); del f, r, r2; gc.collect(); print("f collected:", ref() is None)
