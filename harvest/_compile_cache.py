"""The one compile table: every compiled program harvest keeps, on every path.

Each program is a `jax.jit` kept in one table (`_table`) under one kind of
key, ``(owner, static)``: ``owner`` is whose program it is -- a harvested
function or an eager dispatcher, held weakly so that its programs go when it
is collected, as `jax.jit(f)`'s do, or a string naming a path whose programs
are shared (``"sweep"``, ``"module"``) -- and ``static`` is everything but
the arrays that shapes the program, built by one rule (`_free_variables`: an
immutable value by value, anything else by identity). Arrays are traced, so
each shape of them is one more trace of the same program, bounded by JAX's
own caches. Every path asks the table (`program`):

* the eager walks of each harvested function (`run_per_function`, from `_run_walk`);
* the eager programs of instrumented functions and modules (`_eager_dispatch`);
* the sweeps' and attribution's programs (`compile_program`, from `_patching`),
  keyed by the function's code, metric, sites and axes, not by the arrays it
  reads, so a repeated sweep on new data only runs.

One eviction rule: the table holds at most ``max_programs`` keys in all
(`set_compile_cache`), the least recently used dropped with its programs.
One warning (`note_trace`): once per function code traced more than
``warn_after`` times, or whose calls cannot be keyed at all. One
`clear_caches()` drops every program.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax

from . import _errors, config
from ._free_variables import static_key
from ._interventions import TracedCode, pytree_dataclass
from ._leaves import array_flags
from ._nnx_state import (
    GraphShape,
    call_merged,
    changes_discarded,
    forget_verified_splits,
    holds_graph_nodes,
    split_nodes,
)
from ._stale import Snapshot, checking, fingerprint, in_check, stale

_settings = {"max_programs": 256, "warn_after": 32}


def set_compile_cache(
    max_programs: int | None = None, warn_after: int | None = None
) -> dict[str, int]:
    """Bounds harvest's compile table and sets when it warns; returns the previous settings.

    harvest keeps every compiled program in one table, on every path: each
    harvested function (``reap(f)``, ``plant(f)``, ...) one per compile-cache
    key (its non-array arguments, what it closes over, the plants' shapes),
    each instrumented function or module one per structure, and the sweeps
    (``patching_sweep``, ``attribution_patching``) one per function code,
    metric, sites and axes. ``max_programs`` bounds how many keys the whole
    table holds, over every function and path together; past it, the least
    recently used key is dropped with its programs. A key's jit is traced
    again for each new shape or dtype of its arrays; those traces are JAX's,
    bounded by JAX's own caches. A ``harvest.RecompileWarning`` naming the
    function (file:line) is shown once when the same function's code has been
    traced more than ``warn_after`` times (a new Python number or a fresh
    closure per call), or when a call cannot be keyed at all (an unhashable
    argument).

    Args:
        max_programs: How many keys the table keeps, in all (a positive int;
            default 256). ``None`` leaves it as it is.
        warn_after: How many traces of one function's code for the same
            shapes and structure to allow before warning (a positive int;
            default 32). ``None`` leaves it as it is.

    Returns:
        The settings before the call, as ``{"max_programs": ..., "warn_after": ...}``
        (pass them back as keywords to restore them).

    Raises:
        ValueError: ``max_programs`` or ``warn_after`` is not a positive int.

    Example:
        >>> import harvest
        >>> before = harvest.set_compile_cache(max_programs=8, warn_after=100)
        >>> before
        {'max_programs': 256, 'warn_after': 32}
        >>> _ = harvest.set_compile_cache(**before)
    """
    given = {"max_programs": max_programs, "warn_after": warn_after}
    for name, value in given.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise _errors.bad_cache_setting(name, value)
    before = dict(_settings)
    _settings.update({k: v for k, v in given.items() if v is not None})
    with _lock:
        while len(_table) > _settings["max_programs"]:
            _table.popitem(last=False)[1].dropped = True
    return before


# -- how often each function's code was traced, for the one-time warning --------

# Keyed by (code, shapes, alike), the most recent kept: a long process tracing many
# shapes forgets the oldest counts instead of growing.
_traced: collections.OrderedDict[Any, int] = collections.OrderedDict()
_TRACED_KEPT = 4096
_warned: weakref.WeakSet[Any] = weakref.WeakSet()


def _code(fn: Any) -> Any:
    """The code of the user's function `fn` wraps (not a decorator's wrapper, whose
    code every function it wraps shares: JAX's `api_boundary`, say)."""
    try:
        fn = inspect.unwrap(fn)
    except ValueError:  # a cycle of __wrapped__
        pass
    return getattr(fn, "__code__", None)


def _where(fn: Any) -> str:
    code = _code(fn)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if code is None:
        return name
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


def _warn(message: Warning) -> None:
    """Warns at the user's line: the first frame outside harvest and JAX (a trace
    runs inside JAX, so no fixed stack level reaches the caller)."""
    level, frame = 2, sys._getframe(1)  # level 2: _warn's caller
    while (
        frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INNER
    ):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, stacklevel=level)


_INNER = frozenset({"harvest", "jax", "jaxlib", "flax", "contextlib", "functools"})


def note_trace(fn: Any, arrays: Any, alike: Any = None) -> None:
    """Counts one trace of ``fn``'s code for ``arrays`` (their shapes and dtypes) and
    ``alike`` (what else shapes the program, Python values left out): only traces
    that a cached program could have served count, as when a fresh closure of the
    same code or a new Python number comes each call. Warns once past ``warn_after``."""
    code = _code(fn)
    if code is None or in_check():  # a check's fresh trace is not one a program could serve
        return
    shapes = tuple((getattr(a, "shape", ()), str(getattr(a, "dtype", type(a)))) for a in arrays)
    key = (code, shapes, alike)
    try:
        hash(key)
    except TypeError:  # `alike` holds something unhashable: counted by code and shapes alone
        key = (code, shapes, None)
    n = _traced[key] = _traced.pop(key, 0) + 1
    if len(_traced) > _TRACED_KEPT:
        _traced.popitem(last=False)
    if n > _settings["warn_after"] and code not in _warned:
        _warned.add(code)
        _warn(_errors.recompiles(_where(fn), n))


def note_unhashable(fn: Any, leaves: Any) -> None:
    """Warns once per ``fn``'s code that its calls cannot be keyed (``leaves``: the static ones)."""
    code = _code(fn)
    if code is None or code in _warned:
        return
    culprit = next((leaf for leaf in leaves if not _hashable(leaf)), None)
    if culprit is None:  # hashable after all (a function that cannot be weakly referenced)
        return
    _warned.add(code)
    _warn(_errors.unhashable_argument(_where(fn), culprit))


def _hashable(leaf: Any) -> bool:
    try:
        hash(leaf)
    except TypeError:
        return False
    return True


# -- the one table ----------------------------------------------------------------

# Every kept program, on every path, by its key, least recently used first.
_table: collections.OrderedDict[Any, Program] = collections.OrderedDict()
_lock = threading.Lock()
# Owners collected while the table was busy (a collection can run inside a lookup):
# their programs are dropped at the table's next use.
_collected: list[weakref.ref[Any]] = []


class Program:
    """A kept compiled program: its `jax.jit`, its key in the table, and what the
    call running it now hands its trace (`current`: read only when JAX traces, on
    a new key or new shapes, so the key never holds a call's data).

    ``dropped`` turns True when the table drops it (evicted, its owner collected,
    or `clear_caches`), so a caller holding it to skip the lookup (an eager
    dispatcher) knows to look again. In check mode, ``kept`` holds the kept
    program's fingerprint per shapes and ``snapshot`` what the function read
    when it was last checked (see `_stale`).
    """

    __slots__ = ("key", "jitted", "current", "owner", "dropped", "snapshot", "kept", "__weakref__")

    def __init__(self, key: Any) -> None:
        self.key = key
        self.jitted: Any = None
        self.current: Any = None
        self.owner: Any = None
        self.dropped = False
        self.snapshot: Any = None
        self.kept: dict[Any, Any] = {}


def program(owner: Any, static: Any, make: Callable[[Program], Any]) -> Program | None:
    """The table's program for ``(owner, static)``, its `jitted` made by
    ``make(program)`` if there is none (the least recently used dropped past
    ``max_programs``); None for a key that cannot be hashed or an owner that
    cannot be held weakly (such a call is not kept).

    ``owner`` says whose program it is: a string naming a path whose programs
    are shared (the sweeps', the instrumented modules'), or an object (a
    harvested function, a dispatcher) held weakly, whose programs go when it is
    collected. ``static`` is everything but arrays that shapes the program."""
    try:
        key = (owner if isinstance(owner, str) else weakref.ref(owner), static)
    except TypeError:  # cannot be held weakly
        return None
    with _lock:
        _drop_collected()
        try:
            entry = _table.get(key)
        except TypeError:  # an unhashable static value
            return None
        if entry is None:
            if not isinstance(owner, str):  # dropped when the owner is collected
                key = (weakref.ref(owner, _on_collected), static)
            entry = _table[key] = Program(key)
            entry.jitted = make(entry)
            while len(_table) > _settings["max_programs"]:
                _table.popitem(last=False)[1].dropped = True
        else:
            _table.move_to_end(entry.key)  # the kept key: found by identity
        return entry


def touch(entry: Program) -> bool:
    """Marks ``entry`` as just used (for the eviction order); False if the table dropped it."""
    with _lock:
        if entry.dropped:
            return False
        _table.move_to_end(entry.key)
        return True


def _on_collected(
    ref: weakref.ref[Any], finalizing: Callable[[], bool] = sys.is_finalizing
) -> None:
    if finalizing():  # the interpreter is exiting (this module's names may be gone)
        return
    _collected.append(ref)
    if _lock.acquire(blocking=False):  # else the table drops them at its next use
        try:
            _drop_collected()
        finally:
            _lock.release()


def _drop_collected() -> None:
    """Drops the programs of the owners collected since the last call (the lock held)."""
    if not _collected:
        return
    gone = set(map(id, _collected))
    _collected.clear()
    for key in [k for k in _table if id(k[0]) in gone]:
        _table.pop(key).dropped = True


def clear_caches() -> None:
    """Drops every compiled program harvest keeps, on every path, in one call.

    Every program in harvest's one compile table -- the eager walks of each
    harvested function, the instrumented functions' and modules' eager
    programs, the sweeps' and attribution's programs -- and the sweeps' sites
    are dropped; the next call of each traces and compiles afresh, reading
    the contents of what the function reads (a dict's items, an object's
    attributes) as they are now (see docs/semantics.md). JAX's own caches are
    left alone (``jax.clear_caches()`` clears those).

    Example:
        >>> import jax.numpy as jnp
        >>> import harvest
        >>> config = {"scale": 2.0}
        >>> f = lambda x: harvest.sow(x * config["scale"], name="y", mode="strict")
        >>> reaped = harvest.reap(f)
        >>> reaped(jnp.ones(2))["y"]
        Array([2., 2.], dtype=float32)
        >>> config["scale"] = 3.0  # a dict's contents are read when f is traced
        >>> harvest.clear_caches()
        >>> reaped(jnp.ones(2))["y"]
        Array([3., 3.], dtype=float32)
    """
    from ._site_discovery import (
        clear_sites,  # imported here: it imports the walk, which imports this
    )

    with _lock:
        for entry in _table.values():
            entry.dropped = True
        _table.clear()
        _collected.clear()
    clear_sites()


def _check(
    entry: Program, args: tuple[Any, ...], fresh: Callable[..., Any], fn: Any, snapshot: Any
) -> None:
    """Check mode: raises `StaleValueError` if ``entry``'s kept program for ``args``
    differs from ``fresh`` traced now (see `_stale`)."""
    shapes = tuple(
        (getattr(a, "shape", None), str(getattr(a, "dtype", "")))
        for a in jax.tree_util.tree_leaves(args)
    )
    kept = entry.kept.get(shapes)
    if kept is None:  # JAX's kept trace (none is made afresh), its constants' bits copied now
        kept = entry.kept[shapes] = fingerprint(entry.jitted.trace(*args).jaxpr)
    # What the function reads, written down before the fresh trace and after it, so that
    # what its own trace changes (a counter it updates) is not named as the culprit.
    before = None if snapshot is None else snapshot()
    with checking():
        now = fingerprint(jax.make_jaxpr(fresh)(*args))
    if now != kept:
        raise stale(_where(fn if before is None else before.user), entry.snapshot, before)
    entry.snapshot = None if snapshot is None else snapshot()


# -- the walks of each harvested function -------------------------------------


def run_per_function(
    fn: Callable[..., Any],
    walk_weak: Callable[..., Any],
    dynamic: Any,
    static: Any,
    snapshot: Any = None,
) -> Any:
    """``walk_weak(weakref.ref(fn), dynamic, static)``, compiled once per ``fn`` and
    ``static`` in the table (dropped when ``fn`` is collected, as `jax.jit(fn)`'s
    programs are); in check mode, ``snapshot()`` writes down what ``fn`` reads."""
    weak = weakref.ref(fn)
    entry = program(fn, static, lambda made: _walk_jit(made, weak, walk_weak))
    assert entry is not None, "`run_walk` walks an unkeyable call in place"
    # The key is bound, not a static argument JAX would hash and compare again; it
    # is this call's, so a retrace (new shapes) sees the values alive now.
    entry.current = static
    out = entry.jitted(dynamic)
    if config.check_stale:
        _check(entry, (dynamic,), lambda d: walk_weak(weak, d, static), fn, snapshot)
    return out


def _walk_jit(entry: Program, weak: Any, walk_weak: Callable[..., Any]) -> Any:
    # A fresh function per key: JAX's caches hold it weakly, so a dropped key's
    # programs go with it. It holds ``fn`` only weakly.
    return jax.jit(lambda dynamic: walk_weak(weak, dynamic, entry.current))


# -- the sweeps' programs ---------------------------------------------------------


def jit_on_arrays(
    fn: Callable[[Any], Any], tree: Any, key: tuple[Any, ...] | None, owner: Any = None
) -> Any:
    """`jax.jit(fn)(tree)`, with `tree`'s arrays traced and its other leaves static.

    NNX graph nodes in `tree` are split first, so their state is traced too,
    and merged into fresh nodes inside the trace (changes to them are not
    written back: a sweep is a measurement). Calls with equal `key` (which
    says everything `fn` closes over that shapes the program) and equal static
    leaves share one program in the table: only the first traces and compiles,
    later ones with the same shapes just run it. `key=None` compiles for this
    call only. `owner` is the function the warnings name.
    """
    tree, graph, _ = split_nodes(tree)
    state: tuple[Any, ...] = ()
    apart = None if graph is None else graph.apart()
    if apart is not None:
        graph, state = apart  # a model's state goes straight to the traced arrays
    leaves, treedef = jax.tree_util.tree_flatten((tree, graph))
    traced = array_flags(leaves)
    static = _Hashed(
        (
            key,
            treedef,
            tuple(
                (i, type(l), static_key(l)) for i, (l, a) in enumerate(zip(leaves, traced)) if not a
            ),
        )
    )
    arrays = [*itertools.compress(leaves, traced), *state]
    rebuilt = functools.partial(_rebuilt, fn, treedef, leaves, traced)
    entry = None if key is None else program("sweep", static, _sweep_jit)
    if entry is None:
        if key is not None:  # an unhashable static leaf
            note_unhashable(owner, [l for l, a in zip(leaves, traced) if not a])
        return jax.jit(rebuilt)(arrays)
    entry.current, entry.owner = rebuilt, owner
    try:
        out = entry.jitted(arrays)
        if config.check_stale:
            run = functools.partial(_run_sweep, entry)
            _check(entry, (arrays,), run, owner, lambda: Snapshot.of(owner, None, (), {}))
        return out
    finally:
        entry.current = entry.owner = None  # the table keeps the key, not this call's data


def _sweep_jit(entry: Program) -> Any:
    return jax.jit(functools.partial(_run_sweep, entry))


def _run_sweep(entry: Program, arrays: list[Any]) -> Any:
    assert entry.current is not None
    note_trace(entry.owner, arrays, entry.key[1].key[1])
    forget_verified_splits()  # the trace runs user code: splits are checked again after it
    return entry.current(arrays)


def _rebuilt(
    fn: Callable[[Any], Any], treedef: Any, leaves: list[Any], traced: list[bool], arrays: list[Any]
) -> Any:
    it = iter(arrays)
    tree, graph = treedef.unflatten([next(it) if a else leaf for leaf, a in zip(leaves, traced)])
    if isinstance(graph, GraphShape):
        graph = graph.filled(it)  # the state's arrays come last
    if graph is None:
        return fn(tree)
    # Fresh NNX nodes holding the traced state; what the program changes in them is dropped.
    tree = call_merged(lambda t: t, (tree,), {}, graph)[0]
    with changes_discarded():
        return fn(tree)


class _Hashed:
    """A key whose hash is computed once: a call hashes its key twice (the lookup,
    then moving it to the end), and a sweep's key is deep."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: Any) -> None:
        self.key = key
        self._hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.key)  # raises TypeError for an unhashable leaf
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hashed) and self.key == other.key


@pytree_dataclass(data=("self",), meta=("func",))
class _BoundMethod:
    """A bound method whose `self` is a pytree (an Equinox module, say), as a pytree: its arrays are data."""

    func: Callable[..., Any]
    self: Any

    def __call__(self, *args: Any) -> Any:
        return self.func(self.self, *args)


def compile_program(
    program: Callable[[Any, Any, Any], Any],
    f: Callable[..., Any],
    metric: Callable[..., Any],
    operands: Any,
    spec: tuple[Any, ...],
) -> Any:
    """`program(f, metric, operands)`, compiled once per `spec` and shapes (see `jit_on_arrays`).

    A plain function `f` or `metric` is data, as a `TracedCode`: keyed by its
    code and the static values it reads, the arrays it closes over (or reads
    from its module) traced, so a sweep after such an array changes reads the
    new one, and a fresh closure of the same code reuses the program. A module
    -- an NNX graph node, a pytree such as an Equinox module, or a bound method
    of either -- is data: its arrays are traced, so weights changed in place
    (or a new module of the same structure) reuse the program and are read at
    every call. Any other callable `f` compiles for this call only.
    """
    owner = getattr(f, "__func__", type(f).__call__)  # what the warnings name
    measure = TracedCode.of(metric) if inspect.isfunction(metric) else metric
    if inspect.isfunction(f):
        return jit_on_arrays(
            lambda tree: program(tree[0].function(), tree[1], tree[2]),
            (TracedCode.of(f), measure, operands),
            ("code", *spec),
            f,
        )
    nodes = holds_graph_nodes(f)  # told without splitting them (split once, below)
    if inspect.ismethod(f) and not nodes and not _is_leaf(f.__self__):
        f = _BoundMethod(f.__func__, f.__self__)
    if nodes or not _is_leaf(f):
        return jit_on_arrays(
            lambda tree: program(*tree), (f, measure, operands), ("module", *spec), owner
        )
    return jit_on_arrays(lambda tree: program(f, *tree), (measure, operands), None)


def _is_leaf(x: Any) -> bool:
    """Whether ``x`` is a pytree leaf (compared by identity: ``==`` on an array is elementwise)."""
    leaves = jax.tree_util.tree_leaves(x)
    return len(leaves) == 1 and leaves[0] is x
