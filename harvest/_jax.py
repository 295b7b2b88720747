"""The one adapter between harvest and JAX's internals.

Everything harvest needs from JAX beyond its public API lives here, under
harvest's own names: the primitives the rules are registered for, what their
params hold, how to re-bind them, and the few private hooks the engine needs.
The rest of the package imports only this module (and `jax` itself).

Public `jax.extend` names are used where they exist. What differs between the
supported releases is reached by a feature check (`hasattr`, a key present in
params), never by comparing version strings, so one code path follows JAX as it
moves; the releases it is tested on are listed in `docs/jax_versions.md`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import inspect
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax
from jax import lax

# Private modules, only for what jax.extend does not offer.
from jax._src import (
    config as _config,
    core as _src_core,
    effects as _effects,
    linear_util as _lu,
    source_info_util as _src_source_info,
    traceback_util as _traceback_util,
    util as _util,
)
from jax._src.custom_batching import custom_vmap_p as custom_vmap_p
from jax._src.interpreters import ad as _ad, batching as _batching, partial_eval as _pe
from jax._src.lax import lax as _lax_internal
from jax._src.lax.control_flow import loops as _loops
from jax._src.literals import TypedNdArray as _TypedNdArray
from jax._src.shard_map import shard_map_p as shard_map_p
from jax._src.sharding_impls import UNSPECIFIED as _UNSPECIFIED  # type: ignore[attr-defined]  # not re-exported by name
from jax.experimental import jet as _jet
from jax.extend import core as _core, source_info_util
from jax.extend.core import primitives as _primitives
from jax.interpreters import mlir as _mlir, xla as _xla

# ---------------------------------------------------------------------------
# Jaxprs and primitives.

LITERAL_TYPES: tuple[type, ...] = (_TypedNdArray,)  # the values of a jaxpr's literals

Primitive = _core.Primitive
Jaxpr = _core.Jaxpr
ClosedJaxpr = _core.ClosedJaxpr
Literal = _core.Literal
Var = _core.Var
Effect = _effects.Effect  # what jax.extend.core exports as Effect, where it does

jit_p = _primitives.jit_p
remat_p = _primitives.remat_p  # named "checkpoint" or "remat2" depending on the release
closed_call_p = _primitives.closed_call_p
custom_jvp_call_p = _primitives.custom_jvp_call_p
custom_vjp_call_p = _primitives.custom_vjp_call_p
scan_p = _primitives.scan_p
while_p = _primitives.while_p
cond_p = _primitives.cond_p
core_call_p = _primitives.call_p  # a plain call ("core_call")
linear_solve_p = _primitives.linear_solve_p
# The primitives of jax.lax, by their JAX names (`lax.exp_p` is `lax_primitives.exp_p`).
lax_primitives = _primitives
jaxpr_as_fun = _core.jaxpr_as_fun
prune_outputs = _pe.prune_closed_jaxpr_outputs  # (closed, used): only the outputs marked used
consts_as_inputs = _pe.convert_constvars_jaxpr  # constvars turned into leading invars


def sub_jaxprs(eqn) -> list:
    """The open jaxprs held in an equation's params (alone or in a tuple), in params order."""
    return list(_src_core.jaxprs_in_params(eqn.params))


def eval_jaxpr(jaxpr, consts, *args):
    return jaxpr_as_fun(ClosedJaxpr(jaxpr, consts))(*args)


def bind_with(primitive, params, args):
    """Binds `primitive` on `args` with the params stored in a jaxpr equation."""
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # (subfuns, params) in older releases
        subfuns, bind_params = bind_params
        return primitive.bind(*subfuns, *args, **bind_params)
    return primitive.bind(*args, **bind_params)


def rebind(eqn, args):
    """Re-binds an equation's primitive, unchanged, on new inputs."""
    return bind_with(eqn.primitive, eqn.params, args)


@contextlib.contextmanager
def eqn_context(eqn):
    """Re-enters the source location, name stack and context an equation was staged under."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        yield


def name_scopes(eqn) -> tuple:
    """The `jax.named_scope` names on the name stack an equation was staged under."""
    return tuple(s.name for s in eqn.source_info.name_stack.stack if type(s).__name__ == "Scope")


def function_name(eqn):
    """The function name JAX recorded for a jit or custom-derivative equation, or None."""
    name = eqn.params.get("name")
    return name if isinstance(name, str) else None


def user_location(source_info: Any) -> str | None:
    """The file:line of the user's code that staged an equation (its innermost
    frame outside JAX and harvest), or None where JAX kept no traceback."""
    summary = source_info_util.summarize(source_info) if source_info is not None else ""
    found = re.match(r"(.*?):(\d+)(?::\d+)? \(", summary)
    return f"{found.group(1)}:{found.group(2)}" if found else None


class Frame(NamedTuple):
    """One frame of the traceback JAX records for an equation."""

    file_name: str
    function_name: str
    line: int


def recorded_frames(source_info: Any) -> list[Frame]:
    """The traceback JAX recorded for an equation (`eqn.source_info`), innermost
    frame first; empty where JAX kept none. It stops at the nearest call from C++
    (a jit's or a cached trace's entry): a body's equations show the body's frames."""
    traceback = getattr(source_info, "traceback", None)
    if traceback is None:
        return []
    return [Frame(f.file_name, f.function_name, f.line_num) for f in traceback.frames]


class LaxMap(NamedTuple):
    """The lines where `lax.map(f, xs, batch_size=b)` calls `jax.vmap(f)`: in its scan
    over full batches, for the remainder alone, and for the remainder after batches."""

    file_name: str
    batches: frozenset[int]
    alone: int
    after: int
    codes: tuple[Any, ...]  # of `lax.map` and of its scan's body


def recorded_in_lax_map(source_info: Any) -> bool:
    """Cheaply, whether JAX recorded an equation as staged in `lax.map` (or its scan's body)."""
    layout = lax_map_layout()
    traceback = getattr(source_info, "traceback", None)
    if traceback is None:
        return False
    return layout is None or any(code in layout.codes for code in traceback.raw_frames()[0])


def _vmap_lines(code: Any) -> list[int]:
    """The lines of `code` (not of the functions it defines) that name `vmap`."""
    lines, line = [], code.co_firstlineno
    for instruction in dis.get_instructions(code):
        positions = getattr(instruction, "positions", None)  # from Python 3.11
        line = (positions.lineno if positions else instruction.starts_line) or line
        if instruction.argval == "vmap":
            lines.append(line)
    return lines


@functools.cache
def lax_map_layout() -> LaxMap | None:
    """How this JAX's `lax.map` calls `vmap` (read from its code, once), or None where it
    is not the scan-then-remainder harvest knows (a sow under it is then refused)."""
    code = inspect.unwrap(_loops.map).__code__
    bodies = [c for c in code.co_consts if inspect.iscode(c) and "vmap" in c.co_names]
    own = sorted(_vmap_lines(code))
    if len(bodies) != 1 or len(own) != 2:
        return None
    batches = frozenset(_vmap_lines(bodies[0]))
    return LaxMap(code.co_filename.replace(os.sep, "/"), batches, own[0], own[1], (code, bodies[0]))


_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def is_jax_frame(frame: Frame) -> bool:
    """Whether `frame` runs JAX's own code."""
    return os.path.abspath(frame.file_name).startswith(_JAX_DIR)


def is_vmap_call(frame: Frame) -> bool:
    """Whether `frame` is a `jax.vmap`-wrapped function's call (one per vmap)."""
    return frame.file_name.replace(os.sep, "/").endswith("jax/_src/api.py") and (
        frame.function_name in ("vmap_f", "vmap.<locals>.vmap_f")
    )


def lax_map_part(frames: Sequence[Frame], i: int) -> tuple[str, bool | None] | None:
    """For the vmap call at `frames[i]`: ``("batches", None)`` where `lax.map` runs
    it over a full batch in its scan, ``("remainder", both)`` where over the
    remainder (`both`: after full batches), None where no batched `lax.map` calls
    it. Where this JAX's `lax.map` is not the one harvest knows, ``("unknown",
    None)`` for any call from it, so that its sows are refused."""
    layout = lax_map_layout()
    for caller in frames[i + 1 :]:
        path = caller.file_name.replace(os.sep, "/")
        if path.endswith("jax/_src/traceback_util.py"):  # JAX's API wrapper
            continue
        if layout is None:
            in_map = path.endswith("jax/_src/lax/control_flow/loops.py")
            return ("unknown", None) if in_map and caller.function_name.startswith("map") else None
        if path != layout.file_name:
            return None
        if caller.line in layout.batches:
            return ("batches", None)
        if caller.line in (layout.alone, layout.after):
            return ("remainder", caller.line == layout.after)
        return None
    return None


def traces_a_loop(frames: Sequence[Frame]) -> bool:
    """Whether `frames` pass through a `lax.scan` or `lax.while_loop` tracing its body."""
    return any(
        f.file_name.replace(os.sep, "/").endswith("jax/_src/lax/control_flow/loops.py")
        and f.function_name in ("scan", "while_loop")
        for f in frames
    )


# `api_boundary(fn)`: `fn`, its errors' tracebacks filtered of hidden frames, as JAX's API does.
api_boundary = _traceback_util.api_boundary
# harvest's frames are hidden like JAX's: tracebacks and source lines point at the user's code.
for _hides in (_traceback_util, _src_source_info):
    _hides.register_exclusion(os.path.dirname(os.path.abspath(__file__)) + os.sep)


def differentiating() -> bool:
    """True while a jvp or linearize trace is current, or under the current trace
    with no staging trace between: a custom_jvp bound now has its rule called now."""
    trace = _src_core.trace_ctx.trace
    while trace is not None and not isinstance(trace, _pe.DynamicJaxprTrace):
        if isinstance(trace, _DIFFERENTIATING):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


_DIFFERENTIATING = (_ad.JVPTrace, _ad.LinearizeTrace)


def is_staging() -> bool:
    """True while the current trace stages a jaxpr (under jit, scan, make_jaxpr, ...)."""
    return isinstance(_src_core.trace_ctx.trace, _pe.DynamicJaxprTrace)


def is_eager() -> bool:
    """True while no transformation traces: what is called now runs on concrete arrays."""
    return type(_src_core.trace_ctx.trace) is _src_core.EvalTrace


def staged_beneath() -> bool:
    """True while a staging trace is current or under it (`jit(grad(f))` traces `f`
    under a JVP trace over a jaxpr trace): what is traced now is cached by the outer jit."""
    trace = _src_core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# ---------------------------------------------------------------------------
# What the params of each higher-order primitive hold.


def call_body(eqn) -> ClosedJaxpr:
    """The body of a call-like equation (a `HigherOrder` with `call`), as a closed jaxpr."""
    p = eqn.params
    body = next(p[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in p)
    return body if isinstance(body, ClosedJaxpr) else ClosedJaxpr(body, ())


def body_function_name(eqn) -> str:
    """The Python name of the function a call-like equation's body was traced from ("" if unknown)."""
    debug = getattr(call_body(eqn).jaxpr, "debug_info", None)
    return (getattr(debug, "func_name", None) or "").split(" ")[0]


def custom_num_consts(eqn) -> int:
    """How many leading inputs of a custom_jvp/custom_vjp equation are its
    closure-converted constants (0 where JAX does not record it)."""
    return eqn.params.get("num_consts", 0)


def is_weak(x: Any) -> bool:
    """Whether `x` is weakly typed: a Python number, or a value traced from one."""
    weak = getattr(getattr(x, "aval", None), "weak_type", False)
    return isinstance(x, (bool, int, float, complex)) or bool(weak)


def unbatched(x: Any) -> Any:
    """`x` outside the `jax.vmap`s it is traced in: the value the vmapped function was
    given, so an argument inside a vmap is known for the array outside it."""
    while isinstance(x, _batching.BatchTracer):
        x = x.val
    return x


def cast_like(x: Any, aval: Any) -> Any:
    """`x` converted to `aval`'s dtype and weak type (a loop carry must keep both)."""
    return _lax_internal._convert_element_type(x, aval.dtype, weak_type=aval.weak_type)


def custom_jvp_rule(eqn: Any) -> tuple[ClosedJaxpr, list[bool]] | None:
    """A custom_jvp equation's JVP rule traced for nonzero tangents (a jaxpr from
    (primals, tangents), constants left out, to (primal outputs, nonzero output tangents)),
    and which output tangents are symbolic zeros; None if it cannot be traced here.
    JAX memoizes the trace: a later `jax.jvp` of the equation reuses it."""
    n = len(eqn.invars) - custom_num_consts(eqn)
    try:
        jaxpr, consts, out_zeros = eqn.params["jvp_jaxpr_fun"].call_wrapped(*([False] * n))
    except _RULE_TRACES_ONLY_WHERE_DIFFERENTIATED:
        # A rule that branches in Python on a primal's value, or leaks a tracer, traces
        # only where JAX differentiates with values at hand: nothing the walk can see.
        return None
    except Exception as error:
        first = (str(error).splitlines() or [""])[0][:200]
        raise RuntimeError(
            f"The JVP rule of the custom_jvp function `{body_function_name(eqn) or '?'}` failed while harvest "
            f"traced it to find the sows it holds ({type(error).__name__}: {first}). Fix the rule "
            "(it would fail the same way under jax.jvp), or define it with jax.custom_vjp."
        ) from error
    return ClosedJaxpr(jaxpr, consts), list(out_zeros)


_RULE_TRACES_ONLY_WHERE_DIFFERENTIATED = (
    jax.errors.ConcretizationTypeError,  # and its TracerBoolConversionError
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.UnexpectedTracerError,
)


def _fresh_copy(fun: Any) -> Any:
    """A `lu.WrappedFun` like `fun`, its transformations applied again with empty
    stores: calling it leaves `fun`'s own stores (its output tree) to JAX."""
    new = _lu.wrap_init(fun.f, dict(fun.params), debug_info=fun.debug_info)
    for (gen, args), store in reversed(list(zip(fun.transforms, fun.stores))):
        new = new.wrap(gen, args, None if store is None else type(store)())
    return new


def _traced(make: Any, avals: list[Any], debug_info: Any) -> ClosedJaxpr | None:
    """`make()` (a function) traced on `avals` into a closed jaxpr, or None where it cannot be."""
    try:
        wrapped = _lu.wrap_init(make(), debug_info=debug_info)
        jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, avals)
    except Exception:  # a function JAX would trace only with values at hand, say
        return None
    return ClosedJaxpr(jaxpr, consts)


def on_custom_rule_run(hook: Any) -> None:
    """Calls `hook(primals, body, rule)` where a jvp or linearize trace runs a custom_jvp's
    JVP rule (or a custom_vjp's forward rule) in place of its body: `body()` and `rule()`
    trace fresh copies of both on the primals (and tangents) into closed jaxprs (or None)."""
    for trace_type in _DIFFERENTIATING:
        for method, on_jvp in (
            ("process_custom_jvp_call", True),
            ("process_custom_vjp_call", False),
        ):
            setattr(trace_type, method, _calling_hook(getattr(trace_type, method), on_jvp, hook))


def _calling_hook(original: Any, on_jvp: bool, hook: Any) -> Any:
    def process(self, primitive, fun, rule, *rest, **params):
        tracers = rest[0] if on_jvp else rest[1]  # after a custom_vjp's bwd
        try:
            pairs = [self.to_primal_tangent_pair(t) for t in tracers]
        except Exception:
            return original(self, primitive, fun, rule, *rest, **params)
        primals = [p for p, _ in pairs]
        nonzero = [type(t) is not _ad.Zero for _, t in pairs]
        if any(nonzero):
            avals = [_src_core.typeof(x) for x in primals]

            def body() -> ClosedJaxpr | None:
                return _traced(lambda: _fresh_copy(fun).call_wrapped, avals, fun.debug_info)

            def rule_jaxpr() -> ClosedJaxpr | None:
                if on_jvp:  # (primals, tangents), every tangent given
                    tangents = [a.to_tangent_aval() for a in avals]
                    return _traced(
                        lambda: _fresh_copy(rule).call_wrapped, avals + tangents, rule.debug_info
                    )

                def forward() -> Any:  # a custom_vjp's: (primal, whether it has a tangent) pairs
                    copy = _fresh_copy(rule)
                    return lambda *xs: copy.call_wrapped(
                        *[y for x, nz in zip(xs, nonzero) for y in (x, nz)]
                    )

                return _traced(forward, avals, rule.debug_info)

            with _src_core.set_current_trace(self.parent_trace):  # where the primals live
                hook(primals, body, rule_jaxpr)
        return original(self, primitive, fun, rule, *rest, **params)

    return process


def rebind_call(eqn, jaxpr, args, num_consts, num_extra_outs):
    """Binds the call primitive of `eqn` around a new body `jaxpr`, which takes
    `num_consts` closed-over values before the call's inputs and returns
    `num_extra_outs` values after its outputs; the call keeps everything else
    (a jit its shardings and name, a remat its policy)."""
    p = eqn.params
    if eqn.primitive is jit_p:
        k, m = num_consts, num_extra_outs
        params = dict(
            p,
            jaxpr=ClosedJaxpr(jaxpr, ()),
            in_shardings=(_UNSPECIFIED,) * k + tuple(p["in_shardings"]),
            in_layouts=(None,) * k + tuple(p["in_layouts"]),
            donated_invars=(False,) * k + tuple(p["donated_invars"]),
            out_shardings=tuple(p["out_shardings"]) + (_UNSPECIFIED,) * m,
            out_layouts=tuple(p["out_layouts"]) + (None,) * m,
        )
    elif eqn.primitive is remat_p:
        params = dict(p, jaxpr=jaxpr)
    elif eqn.primitive is closed_call_p:
        params = dict(p, call_jaxpr=ClosedJaxpr(jaxpr, ()))
    else:
        raise TypeError(f"rebind_call: `{eqn.primitive}` is not a call primitive harvest re-binds.")
    return bind_with(eqn.primitive, params, args)


class _Params:
    """A view of an equation's params: each field holds the param of its name (or `_param`'s)."""

    _param: ClassVar[dict[str, str]] = {"body": "jaxpr"}

    @classmethod
    def of(cls, eqn):
        return cls(*(eqn.params[cls._param.get(f.name, f.name)] for f in dataclasses.fields(cls)))


@dataclasses.dataclass(frozen=True)
class Remat(_Params):
    """A `checkpoint` equation's params: its open body and what `jax.checkpoint` was given."""

    body: Jaxpr
    prevent_cse: bool
    policy: Any


@dataclasses.dataclass(frozen=True)
class LinearSolve(_Params):
    """A `custom_linear_solve` equation's params: the jaxprs (matvec, vecmat,
    solve, transpose_solve; None where not given) and their const counts."""

    jaxprs: Any
    const_lengths: Any

    def __iter__(self):
        return iter((self.jaxprs, self.const_lengths))


@dataclasses.dataclass(frozen=True)
class Scan(_Params):
    """A `scan` equation's params: `body` maps (consts, carry, x) to (carry, y)."""

    body: ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


@dataclasses.dataclass(frozen=True)
class While(_Params):
    """A `while` equation's params: its inputs are cond consts, body consts, carry."""

    _param = {"cond": "cond_jaxpr", "body": "body_jaxpr"}
    cond: ClosedJaxpr
    body: ClosedJaxpr
    cond_nconsts: int
    body_nconsts: int


def bind_while(cond: ClosedJaxpr, body: ClosedJaxpr, carry):
    """Binds `while_p` itself: unlike `lax.while_loop`, it takes a `cond` that
    gives one bool per example, as JAX stages a vmapped loop."""
    return while_p.bind(
        *cond.consts,
        *body.consts,
        *carry,
        cond_nconsts=len(cond.consts),
        cond_jaxpr=ClosedJaxpr(consts_as_inputs(cond.jaxpr), ()),
        body_nconsts=len(body.consts),
        body_jaxpr=ClosedJaxpr(consts_as_inputs(body.jaxpr), ()),
    )


def cond_branches(eqn) -> tuple:
    """A `cond` equation's branches (closed jaxprs); its first input is the index."""
    return tuple(eqn.params["branches"])


@dataclasses.dataclass(frozen=True)
class ShardMap:
    """A `shard_map` equation's params; `axes` are the manual mesh axes in mesh order."""

    mesh: Any
    body: Jaxpr
    axes: tuple
    in_specs: tuple
    out_specs: tuple
    check_vma: bool

    @classmethod
    def of(cls, eqn):
        p = eqn.params
        # The axes this shard_map makes manual: `newly_manual_axes` from 0.10.1, `manual_axes` before.
        manual = p["newly_manual_axes"] if "newly_manual_axes" in p else p["manual_axes"]
        axes = tuple(a for a in p["mesh"].axis_names if a in manual)
        return cls(
            p["mesh"], p["jaxpr"], axes, tuple(p["in_specs"]), tuple(p["out_specs"]), p["check_vma"]
        )

    @property
    def shards(self):
        """How many shards the manual axes split the mesh into."""
        return math.prod(self.mesh.shape[a] for a in self.axes)


# ---------------------------------------------------------------------------
# Values varying over manual mesh axes (inside shard_map).


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which `x` may differ from shard to shard."""
    return varying_of(jax.typeof(x))


def pcast_varying(x, axes):
    """`x` marked as varying over `axes` too (it must be, to be stacked along them)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def varying_of(shape: Any) -> frozenset:
    """The manual mesh axes a ShapeDtypeStruct or aval varies over."""
    mat = getattr(shape, "manual_axis_type", None)  # from 0.10; `vma` before
    return frozenset(mat.varying if mat is not None else getattr(shape, "vma", None) or ())


def _explicit_spec(shape: Any) -> Any:
    """The PartitionSpec of `shape` where it names an Explicit mesh axis, else None."""
    sharding = getattr(shape, "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    named = [a for part in spec if part for a in (part if isinstance(part, tuple) else (part,))]
    return spec if any(types.get(a) == jax.sharding.AxisType.Explicit for a in named) else None


def mesh_typed(shape: Any) -> bool:
    """Whether a ShapeDtypeStruct's type names mesh axes (varying, or Explicit sharding)."""
    return bool(varying_of(shape)) or _explicit_spec(shape) is not None


def retype(x: Any, like: Any, axes: Any = ()) -> Any:
    """`x` typed as `like` (a ShapeDtypeStruct or array), as a `cond` branch's outputs must
    agree: resharded to its Explicit sharding, varying over its manual mesh axes and `axes`."""
    if isinstance(like, jax.Array):
        like = jax.typeof(like)
    spec = _explicit_spec(like)
    if spec is not None and _explicit_spec(jax.typeof(x)) != spec:
        x = jax.sharding.reshard(x, spec)
    return pcast_varying(x, tuple(varying_of(like) | frozenset(axes)))


# ---------------------------------------------------------------------------
# Registering a new primitive's rules.

register_lowering = _mlir.register_lowering
lower_fun = _mlir.lower_fun
instantiate_zeros = _ad.instantiate_zeros


def has_lowering(primitive) -> bool:
    """Whether `primitive` can be compiled by XLA (on any platform)."""
    return primitive in _mlir._lowerings or any(
        primitive in t for t in _mlir._platform_specific_lowerings.values()
    )


# The tables of a primitive's rules, set as `jvp_rules[primitive] = rule`.
jvp_rules = _ad.primitive_jvps
transpose_rules = _ad.primitive_transposes
jet_rules: dict[Any, Any] = _jet.jet_rules  # typed by JAX after its first entry
# `rule(args, dims, **params) -> (outs, out_dims)`, JAX's classic batching signature.
plain_batching_rules = _batching.primitive_batchers


_IN_TRACE_KEY = dict(include_in_jit_key=True, include_in_trace_context=True)


def trace_flag(name, help):
    """A boolean context flag (default False) in jit's cache key and the trace context: a
    function traced with it off is traced afresh with it on. `state(True)` enters it."""
    return _config.bool_state(name, False, help, **_IN_TRACE_KEY)


def trace_value(name, help):
    """A context value (default None; hashable) that, like `trace_flag`, is part of
    jit's cache key and of the trace context; `state(v)` is a context manager."""
    return _config.string_or_object_state(name, None, help, **_IN_TRACE_KEY)


def register_batching(primitive, rule):
    """`rule(axis_data, args, dims)`; `axis_data` goes to `bdim_at_front`."""
    _batching.fancy_primitive_batchers[primitive] = rule


def wrap_batching(primitive, wrapper):
    """Replaces `primitive`'s batching rule by `wrapper(jax_rule, axis_data, args, dims, **params)`,
    which may delegate to JAX's own rule, `jax_rule(axis_data, args, dims, **params)`."""
    jax_rule = _batching.fancy_primitive_batchers[primitive]
    _batching.fancy_primitive_batchers[primitive] = lambda *a, **p: wrapper(jax_rule, *a, **p)


def bdim_at_front(x, dim, axis_data):
    """`x` with its batch axis (`dim`, or None if unbatched: broadcast) moved to the front."""
    return _batching.bdim_at_front(x, dim, axis_data.size, axis_data.explicit_mesh_axis)


def allow_effect(effect_type):
    """Lets `effect_type` through lowering, control flow, custom derivatives,
    remat, and partial eval (which would otherwise drop its equation)."""
    for allowed in (
        _effects.lowerable_effects,
        _effects.control_flow_allowed_effects,
        _effects.custom_derivatives_allowed_effects,
        _effects.remat_allowed_effects,
        _effects.partial_eval_kept_effects,
    ):
        allowed.add_type(effect_type)


# ---------------------------------------------------------------------------
# TensorFlow Probability's JAX substrate.


def tfp_needs_alias() -> bool:
    """True if JAX lacks `jax.interpreters.xla.pytype_aval_mappings` (TFP 0.25 writes to it)."""
    return not hasattr(_xla, "pytype_aval_mappings")


# TFP's JAX substrate, whose import fails on a JAX without the alias, and its JAX
# backend, which a failed import of the substrate leaves in sys.modules.
TFP_SUBSTRATE = "tensorflow_probability.substrates.jax"
TFP_BACKEND = "tensorflow_probability.python.internal.backend.jax"
tfp_failed_before_alias = False  # the alias was restored after a TFP import failed for lack of it


def tfp_failed_before() -> bool:
    """Whether a TFP import failed for lack of the alias (now, or before it was restored)."""
    partly_imported = any(m.startswith(TFP_BACKEND) for m in sys.modules)
    return tfp_failed_before_alias or (tfp_needs_alias() and partly_imported)


def restore_tfp_alias() -> None:
    """Puts `jax.interpreters.xla.pytype_aval_mappings` back as an alias of JAX's table."""
    global tfp_failed_before_alias
    if tfp_needs_alias():
        tfp_failed_before_alias = tfp_failed_before()
        _xla.pytype_aval_mappings = _src_core.pytype_aval_mappings  # type: ignore[attr-defined]  # the alias JAX dropped


class _TfpImportOrder:
    """An import finder for TFP's JAX substrate on a JAX without the alias: the import
    runs, its AttributeError turned into an ImportError that says to import harvest.ppl first."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TFP_SUBSTRATE or not tfp_needs_alias():
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ExplainedTfpLoader(spec.loader)
                return spec
        return None


class _ExplainedTfpLoader:
    """TFP's own loader, with its failure for lack of the alias explained."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # create_module, get_source, ...: TFP's loader's
        return getattr(self.loader, name)

    def exec_module(self, module: Any) -> None:
        try:
            self.loader.exec_module(module)
        except AttributeError as cause:
            if "pytype_aval_mappings" not in str(cause):
                raise
            raise ImportError(
                f"{TFP_SUBSTRATE} (TFP 0.25) writes to jax.interpreters.xla.pytype_aval_mappings, "
                f"which this JAX ({jax.__version__}) no longer has. Import harvest.ppl before "
                "TensorFlow Probability: it puts that alias back (only where it is missing); in this "
                "interpreter, `import harvest.ppl` now recovers (it retries TFP's import). Without "
                "harvest.ppl, restore it yourself before importing TFP: "
                "jax.interpreters.xla.pytype_aval_mappings = jax._src.core.pytype_aval_mappings."
            ) from cause


# JAX is left as it is (harvest.ppl restores the alias, see harvest/ppl/_tfp_shim.py):
# this only makes TFP, imported before harvest.ppl on a JAX without it, say so.
if not any(isinstance(finder, _TfpImportOrder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _TfpImportOrder())


# ---------------------------------------------------------------------------
# A context in every `jax.jit`'s cache key, and JAX's cache clearing.

# `jit_cache_salted(salt)`: a context under which every `jax.jit` inside is traced afresh
# for `salt` (a hashable). Made once, at import: adding user contexts is not thread-safe.
jit_cache_salted = jax.make_user_context(None)
# `clear_with_jax(cache, what)`: `jax.clear_caches()` clears `cache` too (held weakly).
clear_with_jax = _util.register_cache


# The call primitives `harvest.view` draws closed, as one node named for the call
# (jit, custom derivatives, checkpoint); loops and branches it draws open. Read from
# the primitives, so a release that renames one (remat is "remat2") keeps it closed.
CLOSED_CALLS = frozenset(
    p.name for p in (jit_p, closed_call_p, custom_jvp_call_p, custom_vjp_call_p, remat_p)
)
