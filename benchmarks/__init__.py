"""harvest's benchmarks: ratios against hand-written JAX and against oryx.

Run them all with `python -m benchmarks` (or `make bench`); the results are
printed and written to `docs/benchmarks.md`.
"""
