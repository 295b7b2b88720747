"""Every compiled program harvest keeps: bounded, and telling when it keeps compiling.

Two keys, one mechanism (a `jax.jit` per key, its arrays traced, everything
else that shapes the program in the key):

* `jit_per_function`: the walks of each harvested function (`_transforms`),
  held in a dict weakly keyed by the plain Python function, so its programs
  go when the function goes, as `jax.jit(f)`'s do;
* `jit_on_arrays` / `compile_program`: the sweeps' programs, keyed by what
  shapes a program (the function's code, metric, sites, axes) and not by the
  arrays it reads, so a repeated sweep on new data only runs.

Each holds at most `max_programs` keys (least recently used dropped, with
their compiled programs), and warns once per function when it has traced
the same function more than `warn_after` times, or cannot key a call at all.
`jax.clear_caches()` clears the compiled programs.
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

_settings = {"max_programs": 64, "warn_after": 32}


def set_compile_cache(
    max_programs: int | None = None, warn_after: int | None = None
) -> dict[str, int]:
    """Bounds harvest's compile caches and sets when they warn; returns the previous settings.

    Every harvested function (``reap(f)``, ``plant(f)``, ...) keeps one compiled
    walk per compile-cache key (its non-array arguments, what it closes over,
    the plants' shapes), and the sweeps (``patching_sweep``, ...) one program
    per function code, metric, sites and axes. Each cache holds at most
    ``max_programs`` keys (per harvested function for the first, in all for the
    sweeps), dropping the least recently used with its compiled programs; each
    shape of a key's arrays is one more program, bounded by JAX's own caches.
    A ``harvest.RecompileWarning`` naming the function (file:line) is shown
    once when the same function's code has been traced more than
    ``warn_after`` times (a new Python number or a fresh closure per call), or
    when a call cannot be keyed at all (an unhashable argument).

    Args:
        max_programs: How many keys each cache keeps (a positive int; default
            64). ``None`` leaves it as it is.
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
        {'max_programs': 64, 'warn_after': 32}
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
    return before


def max_programs() -> int:
    """How many keys each compile cache keeps (see `set_compile_cache`)."""
    return _settings["max_programs"]


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


# -- dropping them all ------------------------------------------------------------

_generation = [0]  # bumped by `clear_caches`: a memo made before it is not used after


def generation() -> int:
    """How many times `clear_caches` ran: a memo of a compiled program (an eager
    dispatcher's last jit) made at another generation is dropped."""
    return _generation[0]


def clear_caches() -> None:
    """Drops every compiled program harvest keeps, on every path, in one call.

    The eager walks of each harvested function, the instrumented modules'
    eager programs, the sweeps' and attribution's programs and the sweeps'
    sites are all dropped; the next call of each traces and compiles afresh,
    reading the contents of what the function reads (a dict's items, an
    object's attributes) as they are now. JAX's own caches are left alone.

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

    with _jits_lock:
        for programs in list(_jits.values()):
            programs.jits.clear()
        _sweeps.clear()
        _module_programs.clear()
        _generation[0] += 1
    clear_sites()


# -- the walks of each harvested function -------------------------------------

_jits: weakref.WeakKeyDictionary[Callable[..., Any], _Programs] = weakref.WeakKeyDictionary()
_jits_lock = threading.Lock()


class _Programs:
    """One harvested function's compiled walks: a ``jax.jit`` per static key, the
    least recently used dropped past ``max_programs``. Holds the function weakly."""

    def __init__(self, fn: Callable[..., Any], walk_weak: Callable[..., Any]) -> None:
        self.fn = weakref.ref(fn)
        self.walk = functools.partial(walk_weak, self.fn)
        self.jits: collections.OrderedDict[Any, _Program] = collections.OrderedDict()

    def __call__(self, dynamic: Any, static: Any, snapshot: Any = None) -> Any:
        """The walk for ``static`` run on ``dynamic``; in check mode, ``snapshot()``
        writes down what the function reads (see `_stale`)."""
        with _jits_lock:
            entry = self.jits.get(static)
            if entry is None:
                entry = self.jits[static] = _Program(self.walk, static)
                while len(self.jits) > _settings["max_programs"]:
                    self.jits.popitem(last=False)
            else:
                self.jits.move_to_end(entry.static)  # the kept key: found by identity
            # The key is bound, not a static argument JAX would hash and compare
            # again; it is this call's, so a retrace (new shapes) sees values alive now.
            entry.current = static
        out = entry.jitted(dynamic)
        if config.check_stale:
            walk = self.walk
            _check(entry, (dynamic,), lambda d: walk(d, static), self.fn(), snapshot)
        return out


class _Program:
    """A kept compiled program: its `jax.jit`, its key, the key of the call running
    it now, and (in check mode) what the function read when it last checked."""

    __slots__ = ("jitted", "static", "current", "snapshot", "kept")

    def __init__(self, walk: Callable[..., Any], static: Any) -> None:
        # A fresh function per key: JAX's caches hold it weakly, so a dropped
        # key's programs go with it.
        self.static = self.current = static
        self.snapshot: Any = None
        self.kept: dict[Any, Any] = {}  # check mode: the kept program's fingerprint per shapes
        self.jitted = jax.jit(lambda dynamic: walk(dynamic, self.current))


def _check(
    entry: Any, args: tuple[Any, ...], fresh: Callable[..., Any], fn: Any, snapshot: Any
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
        raise stale(_where(fn), entry.snapshot, before)
    entry.snapshot = None if snapshot is None else snapshot()


def jit_per_function(fn: Callable[..., Any], walk_weak: Callable[..., Any]) -> _Programs:
    """``walk_weak(weakref.ref(fn), dynamic, static)`` compiled per ``static``,
    as ``programs(dynamic, static)``: made once per ``fn`` and dropped when ``fn`` is collected."""
    with _jits_lock:
        programs = _jits.get(fn)
        if programs is None:
            programs = _jits[fn] = _Programs(fn, walk_weak)
        return programs


def jit_on_arrays(
    fn: Callable[[Any], Any], tree: Any, key: tuple[Any, ...] | None, owner: Any = None
) -> Any:
    """`jax.jit(fn)(tree)`, with `tree`'s arrays traced and its other leaves static.

    NNX graph nodes in `tree` are split first, so their state is traced too,
    and merged into fresh nodes inside the trace (changes to them are not
    written back: a sweep is a measurement). Calls with equal `key` (which
    says everything `fn` closes over that shapes the program) and equal static
    leaves share one compiled program: only the first traces and compiles,
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
    statics = [l for l, a in zip(leaves, traced) if not a]
    static = _Compiled(
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
    try:
        hash(static)
        cached = key is not None
    except TypeError:  # an unhashable static leaf
        note_unhashable(owner, statics)
        cached = False
    if not cached:
        return jax.jit(rebuilt)(arrays)
    with _jits_lock:
        entry = _sweeps.get(static)
        if entry is None:
            entry = _sweeps[static] = static
            static.jitted = jax.jit(functools.partial(_run_compiled, static))
            while len(_sweeps) > _settings["max_programs"]:
                _sweeps.popitem(last=False)
        else:
            _sweeps.move_to_end(entry)  # the kept key: found by identity
    entry.trace, entry.owner = rebuilt, owner
    try:
        out = entry.jitted(arrays)
        if config.check_stale:
            run = functools.partial(_run_compiled, entry)
            _check(entry, (arrays,), run, owner, lambda: Snapshot.of(owner, None, (), {}))
        return out
    finally:
        entry.trace = entry.owner = None  # the cache keeps the key, not this call's data


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


class _Compiled:
    """A sweep program's key, compared by `key` alone. `jitted` runs it; `trace`
    is the current call's function and `owner` the user's, read only when JAX
    traces (a new key or new shapes)."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.jitted: Any = None
        self.trace: Callable[[Any], Any] | None = None
        self.owner: Any = None
        self.snapshot: Any = None  # check mode: what the function read when it last checked
        self.kept: dict[Any, Any] = {}  # and the kept program's fingerprint per shapes
        self._hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:  # a call hashes its key twice: whether it can, and the lookup
            self._hash = hash(self.key)
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Compiled) and self.key == other.key


# The instrumented modules' eager programs (see `_eager_dispatch.EagerModuleDispatch`),
# by (kind, policy, gives, walk, structure), the most recent last: a model switched
# between training and evaluation keeps both programs, and a fresh transformed
# function finds its own.
_module_programs: collections.OrderedDict[Any, Any] = collections.OrderedDict()


def module_program(key: Any, make: Callable[[], Any]) -> Any:
    """The kept program for ``key`` (`make()` if there is none), most recent last;
    ``key`` unhashable: made and not kept."""
    with _jits_lock:
        try:
            program = _module_programs.pop(key, None)
        except TypeError:  # a definition that cannot be hashed: not kept
            return make()
        if program is None:
            program = make()
        _module_programs[key] = program
        while len(_module_programs) > _settings["max_programs"]:
            _module_programs.popitem(last=False)
    return program


# The sweeps' programs, least recently used first.
_sweeps: collections.OrderedDict[_Compiled, _Compiled] = collections.OrderedDict()


def _run_compiled(static: _Compiled, arrays: list[Any]) -> Any:
    assert static.trace is not None
    note_trace(static.owner, arrays, static.key[1])
    forget_verified_splits()  # the trace runs user code: splits are checked again after it
    return static.trace(arrays)


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
