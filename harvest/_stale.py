"""Check mode (``harvest.config.update("check_stale", True)``): is a kept program stale?

Each eager call through a kept compiled program also traces the function
afresh and compares the two programs, bit for bit (`fingerprint`): where they
differ, a value the function reads at trace time -- the contents of an
object it reads by identity (see `_free_variables`) -- changed since the
program was kept, and `StaleValueError` names it. To name it, the contents
of what the function reads are written down (`Snapshot`) whenever a check
passes, and compared with their state when one fails.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _errors
from ._free_variables import names_used
from ._leaves import is_array

_state = threading.local()


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """While a check traces afresh: its trace is not counted for the recompile warning."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def in_check() -> bool:
    return getattr(_state, "on", False)


def fingerprint(closed: Any) -> tuple[str, tuple[Any, ...]]:
    """A closed jaxpr as what decides its results: its text (literals included) and
    each constant's bits, copied (a NumPy constant can change in place after it)."""
    return str(closed.jaxpr), tuple(map(_bits, closed.consts))


def _bits(const: Any) -> Any:
    if is_array(const):
        a = np.asarray(const)
        return (a.dtype.str, a.shape, a.tobytes())
    return (type(const), repr(const))


_MAX_DEPTH = 4  # how deep a value's contents are written down
_MAX_ENTRIES = 2000  # and how many entries, in all


class Snapshot:
    """The contents of what a function reads besides its arguments, flat:
    ``{"cfg.inner.scale": "2.0", ...}``, each root named as the function names it."""

    def __init__(self, fn: Any, roots: list[tuple[str, Any]], user: Any = None) -> None:
        self.fn = fn
        self.user = fn if user is None else user  # the function an error names
        self.entries: dict[str, str] = {}
        code = getattr(fn, "__code__", None)
        self.names = set(names_used(code)) if code is not None else set()
        for name, value in roots:
            self._visit(name, value, 0, set())

    @classmethod
    def of(cls, fn: Any, bound: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Snapshot:
        roots: list[tuple[str, Any]] = []
        code = getattr(fn, "__code__", None)
        if code is not None:
            for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
                with contextlib.suppress(ValueError):  # a cell not yet filled
                    roots.append((name, cell.cell_contents))
            space = fn.__globals__
            roots += [(n, space[n]) for n in names_used(code) if n in space]
            params = list(inspect.signature(fn).parameters)
            roots += [(params[i], a) for i, a in enumerate(args) if i < len(params)]
        user = None
        while bound is not None and bound[0] == "partial":  # what a partial binds
            _, bound, bound_args, bound_kwargs = bound
            roots += [(_arg_name(a, i), a) for i, a in enumerate(bound_args)]
            roots += list(bound_kwargs.items())
            if getattr(fn, "__module__", "").startswith("harvest."):
                # harvest's own wrapper (harvest.ppl's): the error names the user's function.
                user = next((a for a in bound_args if isinstance(a, types.FunctionType)), user)
        if bound is not None and bound[0] == "method":
            roots.append(("self", bound[1]))
        roots += list(kwargs.items())
        return cls(fn, roots, user)

    def _visit(self, path: str, value: Any, depth: int, seen: set[int]) -> None:
        if len(self.entries) >= _MAX_ENTRIES:
            return
        kind = type(value)
        if kind in (int, float, complex, bool, str, bytes, type(None)):
            self.entries[path] = repr(value)
            return
        if kind is np.ndarray:
            self.entries[path] = (
                f"a NumPy array of shape {value.shape} (hash {hash(value.tobytes())})"
            )
            return
        if is_array(value) or id(value) in seen or depth >= _MAX_DEPTH:
            return
        seen = seen | {id(value)}
        if isinstance(value, dict):
            if len(value) > _MAX_ENTRIES:
                self.entries[path] = f"a dict of {len(value)} items (hash {_items_hash(value)})"
                return
            self.entries[path + ".<keys>"] = repr(sorted(map(repr, value)))
            for k, v in value.items():
                self._visit(f"{path}[{k!r}]", v, depth + 1, seen)
        elif isinstance(value, (list, tuple)):
            self.entries[path + ".<len>"] = repr(len(value))
            for i, v in enumerate(value[:_MAX_ENTRIES]):
                self._visit(f"{path}[{i}]", v, depth + 1, seen)
        elif isinstance(value, (set, frozenset)):
            self.entries[path] = repr(sorted(map(repr, value)))
        elif isinstance(value, types.FunctionType):
            # A helper function: its cells and the module-level names it uses.
            for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
                with contextlib.suppress(ValueError):
                    self._visit(f"{path}'s {name}", cell.cell_contents, depth + 1, seen)
            space = value.__globals__
            for name in names_used(value.__code__):
                if name in space and not isinstance(space[name], types.ModuleType):
                    self._visit(f"{path}'s global {name}", space[name], depth + 1, seen)
        elif isinstance(value, (types.ModuleType, type)):
            # A module or class: the attributes the function names.
            for name in sorted(self.names):
                if name in vars(value):
                    self._visit(f"{path}.{name}", vars(value)[name], depth + 1, seen)
        elif hasattr(value, "__dict__"):
            for name, v in list(vars(value).items()):
                self._visit(f"{path}.{name}", v, depth + 1, seen)

    def changes(self, now: Snapshot) -> list[str]:
        """``"name: old -> new (read in f at file:line)"`` for each entry that differs."""
        out = []
        for path in sorted(self.entries.keys() | now.entries.keys()):
            old, new = self.entries.get(path, "(absent)"), now.entries.get(path, "(absent)")
            if old != new:
                out.append(f"{path}: {old} -> {new}{_where_read(self.fn, path)}")
        return out


def _arg_name(value: Any, index: int) -> str:
    """How a change under a partial's argument is named: a function by its name
    (a model ``harvest.ppl`` binds, say), anything else by its place."""
    if isinstance(value, types.FunctionType):
        return value.__name__
    return f"the bound argument {index}"


def _items_hash(value: dict[Any, Any]) -> int:
    try:
        return hash(tuple(value.items()))
    except TypeError:
        return hash(tuple(map(id, value.values())))


def _where_read(fn: Any, path: str) -> str:
    """`` (read in f at file:line)``: the first line of ``fn`` (or code inside it)
    that loads the root name of ``path``; empty if none is found."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    root = path.split(".")[0].split("[")[0].split("'")[0]
    line = _first_load(code, root)
    if line is None:
        return ""
    return f" (read in {fn.__qualname__} at {code.co_filename}:{line})"


_LOADS = frozenset(
    {"LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME", "LOAD_FAST", "LOAD_CLOSURE", "LOAD_ATTR"}
)


def _first_load(code: types.CodeType, name: str) -> int | None:
    line = None
    for ins in dis.get_instructions(code):
        if ins.positions is not None and ins.positions.lineno is not None:
            line = ins.positions.lineno
        if ins.opname.startswith(tuple(_LOADS)) and ins.argval == name:
            return line
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found = _first_load(const, name)
            if found is not None:
                return found
    return None


def stale(where: str, before: Snapshot | None, now: Snapshot | None) -> _errors.StaleValueError:
    """The error for a stale program, naming what changed between ``before`` and ``now``."""
    changes = [] if before is None or now is None else before.changes(now)
    return _errors.stale_value(where, changes)
