"""Module classes patched while an instrumented call runs, so each submodule call is sown.

For the length of one call, each submodule class of a module target has its
`__call__` wrapped; the wrapper looks the instance up in the running call's path
table (`_call.active`) and sows the output under that path. The wrappers are
counted per class and removed when the last call using them returns.

NNX transforms (`nnx.scan`, `nnx.vmap`, `nnx.jit`, `nnx.remat`) merge a module
into fresh objects no table knows, so for the call each NNX submodule also
carries its path as a private static attribute, which lands in the graph
definition and so on every copy. An Equinox or Penzai module rebuilt from a
part's arrays is found by its structure (`_rebuilt.py`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from ._call import InstrumentCall, active
from ._rebuilt import rebuilt_path

_MISSING = object()
_lock = threading.Lock()  # guards both tables below: calls in other threads wrap and mark too
_wrapped: dict[type, list] = {}  # class -> [its own __call__ or _MISSING, number of calls using it]


def with_modules(
    call: InstrumentCall, classes: set[type], marked: list, model: Any, *args, **kwargs
):
    """Calls `model(*args, **kwargs)` with `classes` wrapped, `marked` (NNX (path,
    module) pairs) marked with their paths, and `call` the running call."""
    _wrap(classes, 1)
    _mark(marked, 1)
    token = active.set(call)
    try:
        return model(*args, **kwargs)
    finally:
        active.reset(token)
        _mark(marked, -1)
        _wrap(classes, -1)


def _wrapper(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        call = active.get()
        path = None if call is None else _path(call, self)
        if path is None or id(self) in call.inside:  # not ours, or a super().__call__
            return original(self, *args, **kwargs)
        return call.run_module(path, self, original, args, kwargs)

    return __call__


def _path(call, module):
    """`module`'s path in `call`: from the table, or, for a copy an NNX transform
    merged, from the paths its original was marked with."""
    path = call.paths.get(id(module))
    if path is None:
        path = next((p for p in getattr(module, _MARK, ()) if p in call.known), None)
    if path is None and call.parts:
        path = rebuilt_path(call, module)
    return path


def _wrap(classes, step):
    """Counts `step` (1 or -1) more calls using each class's wrapper: the first wraps
    the class, the last puts its own `__call__` back."""
    with _lock:
        for cls in classes:
            if cls not in _wrapped:
                _wrapped[cls] = [cls.__dict__.get("__call__", _MISSING), 0]
                cls.__call__ = _wrapper(cls.__call__)
            entry = _wrapped[cls]
            entry[1] += step
            if entry[1] == 0:
                del _wrapped[cls]
                if entry[0] is _MISSING:
                    del cls.__call__
                else:
                    cls.__call__ = entry[0]


# NNX submodules marked with their paths.

_MARK = "_harvest_instrument_paths"
_marks: dict[int, tuple] = {}  # id(module) -> (module, {path: number of calls marking it so})


def _mark(parts, step):
    """Counts `step` (1 or -1) more calls marking each module with its path; its mark is
    the sorted paths of every running call, set past NNX's attribute checks as a static
    tuple of strings, so the graph definition (a compile-cache key of `nnx.jit`) depends
    on the paths only, not on which call runs."""
    with _lock:
        for path, module in parts:
            counts = _marks.setdefault(id(module), (module, {}))[1]
            counts[path] = counts.get(path, 0) + step
            if not counts[path]:
                del counts[path]
            if counts:
                object.__setattr__(module, _MARK, tuple(sorted(counts)))
            else:
                del _marks[id(module)]
                object.__delattr__(module, _MARK)
