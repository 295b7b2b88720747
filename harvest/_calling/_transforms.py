"""reap, plant, harvest, call_and_reap and nest: one walk, four faces.

Each is `transform` with a different policy and plants, and a choice of what
the transformed function returns; `_run_walk` runs one call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any, Concatenate

import jax

from .. import _jax
from .._typing import NameSelect, P, Plants, R, Reaped
from .._walk._interpreter import NameFilter, Policy, Tags
from .._walk._leaves import is_array
from .._walk._sow import DEFAULT_TAG
from ._renamed import renamed
from ._run_walk import code_of, layer_tag as layer_tag, run_walk


def _check_callable(f, fn_name):
    if not callable(f):
        raise TypeError(
            f"{fn_name}(f) transforms a function, but f is the {type(f).__name__} {f!r}: "
            f"f must be callable. Pass the function itself, as in {fn_name}(f)(*args)."
        )


def _policy(tag, names, exclude, max_steps=None):
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"tag must be a non-empty string, got {tag!r}.")
    if max_steps is not None and (
        isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
    ):
        raise ValueError(
            f"max_steps must be a positive int (how many while_loop iterations to record), "
            f"got {max_steps!r}. Leave it None to reap each while_loop's last iteration."
        )
    return Policy(tag, NameFilter.make(names, exclude), max_steps=max_steps)


def _plants_first(g: Any, f: Callable[..., Any]) -> Callable[..., Any]:
    """Gives `g(plants, *args, **kwargs)` its true signature: `f`'s with `plants`
    in front, so `jax.jit(g, static_argnums=..., donate_argnames=...)` picks the
    arguments the user means (functools.wraps alone would report `f`'s)."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to report
        return g
    name = "plants"
    while name in sig.parameters:
        name = "_" + name
    first = inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
    g.__signature__ = sig.replace(parameters=[first, *sig.parameters.values()])
    return g


def transform(
    f: Callable,
    fn_name: str,
    policy: Policy,
    *,
    takes_plants: bool,
    gives: str,
    reword: Callable[[ValueError], ValueError | None] | None = None,
) -> Callable:
    """`f` walked under `policy`: the function the transformation `fn_name` returns,
    called as `g(plants, *args, **kwargs)` with `takes_plants`, else `g(*args, **kwargs)`,
    and returning `gives` of the walk: `"out"`, `"reaps"` or `"both"` (`(out, reaps)`).
    `reword` maps an error of the walk to the one to raise instead (None: as is)."""
    _check_callable(f, fn_name)

    def run(plants: Any, args: tuple, kwargs: dict) -> Any:
        try:
            out, reaps = run_walk(f, policy, gives != "out", plants, args, kwargs)
        except ValueError as error:
            better = reword(error) if reword is not None else None
            if better is None:
                raise
            raise better from error
        return {"out": out, "reaps": reaps, "both": (out, reaps)}[gives]

    if not takes_plants:

        @functools.wraps(f)
        def transformed(*args: Any, **kwargs: Any) -> Any:
            return run({}, args, kwargs)

        return _jax.api_boundary(_unwrapped_to_code(transformed, f))

    @functools.wraps(f)
    def transformed_with_plants(plants: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(plants, dict):
            raise TypeError(
                f"{fn_name}(f) returns a function called as g(plants, *args, **kwargs), where "
                f"plants is a dict of sown names to values; its first argument was a "
                f"{type(plants).__name__}."
            )
        return run(plants, args, kwargs)

    return _plants_first(_jax.api_boundary(_unwrapped_to_code(transformed_with_plants, f)), f)


def _unwrapped_to_code(g: Any, f: Any) -> Any:
    """`g` (`functools.wraps(f)`), its `__wrapped__` leading past a model (a callable
    pytree holding arrays) to the method that runs it, keeping `f`'s signature: JAX's
    errors still name the user's code, and Equinox does not take `g` for a callable
    hiding parameters (`eqx.filter_jit(reap(model))` warned)."""
    if inspect.isroutine(inspect.unwrap(f)) or not any(map(is_array, jax.tree_util.tree_leaves(f))):
        return g
    with contextlib.suppress(TypeError, ValueError):  # no signature to show
        g.__signature__ = inspect.signature(f)
    g.__wrapped__ = code_of(f)
    return g


@renamed(allowlist="names", blocklist="exclude")
def reap(
    f: Callable[P, Any],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
    max_steps: int | None = None,
) -> Callable[P, Reaped]:
    """Returns a function with ``f``'s signature that returns ``{name: value}`` of ``f``'s sows.

    How occurrences accumulate is decided by each site's mode (see ``sow``):
    under the default ``"collect"``, each value is a tuple of occurrences, so
    sow with ``mode="strict"`` to reap a site sown once as a plain array.
    Nested ``nest`` scopes come back as nested dicts. Names come in program
    order (by first occurrence), at every level; under an outer ``jax.jit``,
    JAX returns any dict with its keys sorted.

    Inside a ``lax.while_loop`` (trip count unknown until it runs),
    ``instrument``'s sites give the last iteration's value, as ``clobber`` does;
    with ``max_steps=N``, each name sown there with a stacking mode (``collect``,
    ``append``, ``instrument``'s) comes back as ``harvest.Steps(values, count)``:
    the first ``N`` iterations, as a ``scan`` of ``N`` would reap them, and how
    many ran.

    An eager call reads what ``jax.jit(f)`` reads, here and in every other
    transformation: the arguments at every call (arrays traced, every other
    leaf static: a new value re-traces), and what else ``f`` reads (closures,
    globals, attributes) when it is traced. Flax NNX modules are split and
    merged as ``nnx.jit`` does, so their state is left as a direct call leaves it.

    Args:
        f: the function to run: any JAX-traceable callable (a function, a bound
            method, an NNX or Equinox module, an ``instrument``-ed model).
        tag: which sows to read; sows of other tags pass through untouched.
        names: if given, read only these sites: exact names, glob patterns
            (``"blocks.*"``), predicates on names, or a list of them. A string that
            matches no site of ``tag`` is an error listing the names there are (a
            predicate may match nothing).
        exclude: sites never to read, in the same forms as ``names``.
        max_steps: if given (a positive int), record the first ``max_steps``
            iterations of each ``while_loop`` as ``harvest.Steps``; ``None`` keeps
            each while_loop's last iteration of ``instrument``'s sites.

    Returns:
        A function taking ``f``'s arguments and returning the dict of reaped
        values (``f``'s own output is discarded; see ``call_and_reap``).

    Raises:
        ValueError: when the returned function is called: a name in
            ``names`` that no site has, a ``strict`` site sown twice, or a sow
            where its mode cannot be honoured (e.g. ``append`` in a ``while_loop``
            without ``max_steps``); at once, a ``max_steps`` that is not a positive int.
        TypeError: if ``f`` is not callable, or ``tag`` is not a non-empty string.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sow, reap
        >>> def f(x):
        ...     h = sow(jnp.tanh(x), name="h", mode="strict")
        ...     return 2.0 * h
        >>> reap(f)(jnp.zeros(2))
        {'h': Array([0., 0.], dtype=float32)}
        >>> jax.jit(reap(f))(jnp.zeros(2))["h"].shape
        (2,)
        >>> def g(x, n, training=False):  # Python values stay Python values
        ...     for i in range(n):
        ...         x = sow(x + 1.0, name=f"step{i}", mode="strict")
        ...     return x * 0.5 if training else x
        >>> sorted(reap(g)(jnp.zeros(2), 3, training=True))
        ['step0', 'step1', 'step2']
        >>> sorted(reap(g, names="step*", exclude="step2")(jnp.zeros(2), 3))
        ['step0', 'step1']
    """
    policy = _policy(tag, names, exclude, max_steps)
    return transform(f, "reap", policy, takes_plants=False, gives="reaps")


@renamed(allowlist="names", blocklist="exclude")
def call_and_reap(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
    max_steps: int | None = None,
) -> Callable[P, tuple[R, Reaped]]:
    """Like ``reap``, but the function returns ``(f's output, {name: value})``.

    Args:
        f: the function to run, as for ``reap``.
        tag: which sows to read; sows of other tags pass through untouched.
        names: if given, read only these sites (exact names, glob patterns or
            predicates on names), as for ``reap``.
        exclude: sites never to read, in the same forms as ``names``.
        max_steps: how many iterations of each ``while_loop`` to record (``reap``).

    Returns:
        A function taking ``f``'s arguments and returning ``(output, reaped)``.

    Raises:
        ValueError: when the returned function is called, as for ``reap``.
        TypeError: if ``f`` is not callable, or ``tag`` is not a non-empty string.

    Example:
        >>> from harvest import sow, call_and_reap
        >>> f = lambda x: sow(x + 1.0, name="y", mode="strict") * 3.0
        >>> call_and_reap(f)(1.0)
        (Array(6., dtype=float32, weak_type=True), {'y': Array(2., dtype=float32, weak_type=True)})
    """
    policy = _policy(tag, names, exclude, max_steps)
    return transform(f, "call_and_reap", policy, takes_plants=False, gives="both")


@renamed(allowlist="names", blocklist="exclude")
def plant(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
) -> Callable[Concatenate[Plants, P], R]:
    """Returns ``g(plants, *args, **kwargs)``: ``f`` with the planted sows replaced.

    ``plants`` maps names to replacement values, shaped as ``reap`` returns them
    (a tuple per ``collect`` name, a stacked array per ``append`` name), or to a
    single value used at every occurrence, or to a callable ``old -> new`` (an
    intervention: ablate, add a vector, patch a slice). A callable that
    requires a second positional argument is called as ``fn(old, index)``, with
    the occurrence's row in what ``reap`` returns for the name (traced inside a
    ``scan``). Names under ``nest`` scopes are given as nested dicts or as dotted
    paths (``{"block.h": v}`` is ``{"block": {"h": v}}``).

    Planting back what ``reap`` returned gives ``f``'s output, but for a
    ``clobber`` or ``sow_cond`` name firing more than once per call: ``reap`` keeps
    the last, which ``plant`` puts at every occurrence (docs/semantics.md).

    Args:
        f: the function to run, as for ``reap``.
        tag: which sows may be replaced; sows of other tags pass through untouched.
        names: if given, only these sites may be planted (exact names, glob
            patterns or predicates on names).
        exclude: sites never to plant, in the same forms as ``names``.

    Returns:
        A function taking ``plants`` first, then ``f``'s arguments, and returning
        ``f``'s output with the plants in place.

    Raises:
        ValueError: when the returned function is called: planting a name no
            site of ``tag`` has (the message lists the names there are), or a
            replacement whose shape does not match the site.
        TypeError: if ``f`` is not callable, ``tag`` is not a non-empty string,
            or ``plants`` is not a dict.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sow, plant
        >>> def f(x):
        ...     h = sow(x + 1.0, name="h", mode="strict")
        ...     return h * 10.0
        >>> plant(f)({"h": 0.5}, 1.0)
        Array(5., dtype=float32, weak_type=True)
        >>> plant(f)({"h": lambda h: -h}, 1.0)
        Array(-20., dtype=float32, weak_type=True)
        >>> def g(xs):  # a callable taking a second argument sees the occurrence index
        ...     step = lambda c, x: (c + sow(x, name="x", mode="append"), None)
        ...     return jax.lax.scan(step, 0.0, xs)[0]
        >>> plant(g)({"x": lambda old, i: jnp.where(i == 2, 0.0, old)}, jnp.ones(4))
        Array(3., dtype=float32)
    """
    return transform(f, "plant", _policy(tag, names, exclude), takes_plants=True, gives="out")


@renamed(allowlist="names", blocklist="exclude")
def harvest(
    f: Callable[P, R],
    *,
    tag: str = DEFAULT_TAG,
    names: NameSelect = None,
    exclude: NameSelect = None,
    max_steps: int | None = None,
) -> Callable[Concatenate[Plants, P], tuple[R, Reaped]]:
    """Returns ``g(plants, *args, **kwargs) -> (out, reaps)``: plant and reap in one walk.

    Args:
        f: the function to run, as for ``reap``.
        tag: which sows to plant and read; sows of other tags pass through.
        names: if given, only these sites are planted or read (exact names,
            glob patterns or predicates on names).
        exclude: sites never planted or read, in the same forms as ``names``.
        max_steps: how many iterations of each ``while_loop`` to record (``reap``).

    Returns:
        A function taking ``plants`` first (as for ``plant``), then ``f``'s
        arguments, and returning ``(output, reaps)``, where ``reaps`` holds the
        names of ``tag`` that were not planted.

    Raises:
        ValueError: when the returned function is called, as for ``reap`` and
            ``plant``.
        TypeError: if ``f`` is not callable, ``tag`` is not a non-empty string,
            or ``plants`` is not a dict.

    Example:
        >>> from harvest import sow, harvest
        >>> def f(x):
        ...     a = sow(x + 1.0, name="a", mode="strict")
        ...     b = sow(a * 2.0, name="b", mode="strict")
        ...     return b
        >>> out, reaps = harvest(f)({"a": 10.0}, 1.0)
        >>> out, reaps["b"]
        (Array(20., dtype=float32, weak_type=True), Array(20., dtype=float32, weak_type=True))
    """
    policy = _policy(tag, names, exclude, max_steps)
    return transform(f, "harvest", policy, takes_plants=True, gives="both")


def harvest_tags(
    f: Callable[P, R], tags: Any, names: NameSelect = None
) -> Callable[Concatenate[Plants, P], tuple[R, Reaped]]:
    """``harvest`` of several tags in one walk (for harvest's layers, not public), plants
    and reaps keyed ``{tag: {name: value}}``: the program is re-bound once, not once
    per tag. Sows of other tags, and those ``names`` leaves out (it sees names dotted
    with their tag, ``"tag.name"``), pass through."""
    policy = Policy(Tags(frozenset(tags)), NameFilter.make(names))
    return transform(f, "harvest", policy, takes_plants=True, gives="both")


def nest(f: Callable[P, R], *, scope: str) -> Callable[P, R]:
    """Puts every name sown inside ``f`` (of any tag) under ``scope``.

    Reaped values come back as ``{scope: {name: value}}``, and plants are given
    the same way. Nesting ``nest`` nests the dicts.

    Args:
        f: the function whose sows to scope.
        scope: the key the names go under (a non-empty string).

    Returns:
        A function with ``f``'s signature and output, whose sites are named
        ``scope.name``.

    Raises:
        TypeError: if ``f`` is not callable, or ``scope`` is not a non-empty string.

    Example:
        >>> from harvest import sow, reap, nest
        >>> def layer(x):
        ...     return sow(x * 2.0, name="out", mode="strict")
        >>> def f(x):
        ...     return nest(layer, scope="l2")(nest(layer, scope="l1")(x))
        >>> reaped = reap(f)(1.0)
        >>> reaped["l1"]
        {'out': Array(2., dtype=float32, weak_type=True)}
        >>> reaped["l2"]
        {'out': Array(4., dtype=float32, weak_type=True)}
    """
    _check_callable(f, "nest")
    if not isinstance(scope, str) or not scope:
        raise TypeError(f"nest needs `scope` to be a non-empty string, got {scope!r}.")
    if "." in scope:
        outer, _, inner = scope.rpartition(".")
        raise ValueError(
            f"nest(scope={scope!r}): a scope may not contain a dot, since dotted paths name "
            "sites and this one could mean another site. For scopes inside scopes nest twice: "
            f"nest(nest(f, scope={inner!r}), scope={outer!r}); or use another separator ('_')."
        )
    return transform(f, "nest", Policy(None, prefix=(scope,)), takes_plants=False, gives="out")
