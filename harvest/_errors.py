"""Every error harvest raises: one function per message.

Each returns the exception for its caller to raise (but `traced_like_jit`: the
note harvest adds to an error JAX raises itself); a function whose name starts
with an underscore builds a part several messages share. Messages about a site
name it as `Site` prints itself: its tag, its name and the file:line of the
user's `sow` call. Each message says what was wrong and what to do instead.
"""

from __future__ import annotations

import difflib
import errno
import os
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np

# -- the arguments of sow and of the transformations ------------------------


def bad_sow_name(what: str, value: Any) -> TypeError:
    return TypeError(f"sow needs `{what}` to be a non-empty string, got {value!r}.")


def not_an_array(name: str, tag: Any, where: str, leaf: Any) -> TypeError:
    return TypeError(
        f"sow(name={name!r}, tag={tag!r}): {where or 'the value'} is a {type(leaf).__name__}, "
        "not an array. Sow only arrays (or pytrees of arrays); keep static "
        "data out of the sown value."
    )


def unknown_mode(name: str, tag: str, mode: Any, public: Iterable[str]) -> ValueError:
    return ValueError(
        f"sow(name={name!r}, tag={tag!r}): unknown mode {mode!r}. "
        f"Use one of {', '.join(map(repr, public))}, or sow_cond for a "
        "conditional clobber."
    )


def bad_predicate(name: str, tag: str, dtype: Any, shape: tuple[int, ...]) -> TypeError:
    return TypeError(
        f"sow_cond(name={name!r}, tag={tag!r}) needs a scalar boolean `pred`, got "
        f"{dtype}{list(shape)}. Reduce it first, e.g. with jnp.any."
    )


def not_callable(f: Any, fn_name: str) -> TypeError:
    return TypeError(
        f"{fn_name}(f) transforms a function, but f is the {type(f).__name__} {f!r}: "
        f"f must be callable. Pass the function itself, as in {fn_name}(f)(*args)."
    )


def bad_tag(tag: Any) -> TypeError:
    return TypeError(f"tag must be a non-empty string, got {tag!r}.")


def bad_nest_scope(scope: Any) -> TypeError:
    return TypeError(f"nest needs `scope` to be a non-empty string, got {scope!r}.")


def plants_not_a_dict(plants: Any, fn_name: str) -> TypeError:
    return TypeError(
        f"{fn_name}(f) returns a function called as g(plants, *args, **kwargs), where "
        f"plants is a dict of sown names to values; its first argument was a "
        f"{type(plants).__name__}."
    )


def bad_filter_entry(what: str, entry: Any) -> TypeError:
    return TypeError(f"{what} takes names, glob patterns or predicates on names; got {entry!r}.")


# -- names --------------------------------------------------------------------


def _listed(names: Iterable[str], near: str, at_most: int = 12) -> str:
    """`names` for a message: all of them, or, when there are many (a large model's
    sites), the count and the three closest to the misspelt `near`."""
    names = list(names)
    if len(names) <= at_most:
        return ", ".join(repr(n) for n in names) or "none"
    close = difflib.get_close_matches(near, names, n=3, cutoff=0.5)
    shown = ", ".join(repr(n) for n in close or names[:3])
    which = "the closest" if close else "the first"
    return f"{len(names)} names, {which} {shown} (`sites(f, *args)` lists them all)"


def no_such_names(missing: list[str], names: list[str], what: str, tag: Any) -> ValueError:
    """Names or patterns (`missing`) that match no site of `tag`."""
    listed = _listed(names, str(missing[0]).strip("*?[]") if missing else "")
    return ValueError(
        f"{what} {', '.join(map(repr, missing))} matches no sow site of tag {tag!r}. "
        f"Names sown with that tag, in program order: {listed}. Check the spelling, or use a "
        "predicate (lambda name: ...) for a site that may be absent."
    )


def planted_twice(name: str) -> ValueError:
    return ValueError(
        f"plants give {name!r} twice (once as a dotted name, once nested). Give it once."
    )


def planted_but_filtered(name: str, tag: Any) -> KeyError:
    return KeyError(
        f"Cannot plant {name!r}: it is sown with tag {tag!r}, but "
        "this plant's allowlist/blocklist leaves it out. Drop it from the blocklist "
        "(or add it to the allowlist), or leave it out of plants."
    )


def planted_unknown(name: str, tag: Any, names: Iterable[str]) -> KeyError:
    listed = _listed(names, name)
    return KeyError(
        f"Cannot plant {name!r}: no sow site of tag {tag!r} has that name. Names sown with that tag: {listed}."
    )


def name_and_scope(name: str, inner: str) -> ValueError:
    return ValueError(
        f"{name!r} is both a sown name and a nest scope (holding {inner!r}), so one would "
        "hide the other in the reaped dict. Rename the sow or the scope."
    )


# -- a site's occurrences -----------------------------------------------------


def modes_differ(site: Any, other: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} uses mode {site.mode.label}, but the same name is sown with "
        f"mode {other.mode.label} at {other.where()}. Use one mode per name."
    )


def sown_twice(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} has mode {site.mode.label} but is sown more than once. "
        + (
            _random_variable_modes(site)
            or "Give each occurrence its own name, or use mode 'collect', 'append' or 'clobber'."
        )
    )


def different_shapes(site: Any, shapes: Iterable[Any]) -> ValueError:
    """The error for occurrences of one stacking name with different shapes."""
    return ValueError(
        f"The sow site {site} has mode {site.mode.label}, but its occurrences "
        f"have different shapes ({', '.join(sorted(map(_shapes_str, shapes)))}), so they "
        "cannot be stacked into one array. Sow one shape per name (give each shape "
        "its own name), or use mode 'collect', which keeps each occurrence as it is."
    )


def carried_shape(site: Any, have: list[Any], targets: list[Any], where: str) -> ValueError:
    return ValueError(
        f"The sow site {site} has mode {site.mode.label} and was sown with shape "
        f"{_shapes_str(have)} before this {where}, which sows it with shape "
        f"{_shapes_str(targets)} and carries one value per name. Sow one shape per "
        "name (give each shape its own name)."
    )


def branch_shapes_differ(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} is sown with different shapes in different branches "
        "of a cond. Sow the same shapes in every branch, or use different names."
    )


def batched_branch_shapes_differ(tag: Any, name: str) -> ValueError:
    return ValueError(
        f"The sow site tag={tag!r}, name={name!r} is sown with different shapes in different "
        "branches of a cond whose predicate vmap batches. Sow the same shapes in every branch, "
        "or use different names."
    )


def stuck_in_batched_branch(site: Any, where: str) -> NotImplementedError:
    """`where`: the primitive the sow sits in (``"while"``, a custom rule's, a user's)."""
    known = {
        "while": "a while_loop",
        "custom_jvp_call": "a custom_jvp function",
        "custom_vjp_call": "a custom_vjp function",
        "custom_vmap_call": "a custom_vmap function",
    }
    if where in known:
        inside = known[where]
        fix = "move the sow out of that body"
    else:
        inside = f"the primitive `{where}`"
        fix = (
            f"if `{where}` runs its one body once on its inputs, register it with "
            "harvest.extend.HigherOrder(..., call=True), so harvest inlines it there; "
            "otherwise give its HigherOrder a `batched_branch` that runs its bodies through "
            "harvest.extend.walk_in_branch (see harvest.extend)"
        )
    return NotImplementedError(
        f"The sow site {site} is inside {inside} within a branch of a cond whose predicate "
        "vmap batches: every branch runs for every example, and harvest cannot carry the value "
        "out of that body to record the taken branch's. Harvest per example instead, "
        f"jax.vmap(reap(f)), or {fix}."
    )


def sown_in_jvp_rule_and_body(site: Any, in_body: Iterable[str]) -> ValueError:
    return ValueError(
        f"The sow site {site} sits in the JVP rule of a custom_jvp function that also sows "
        f"{', '.join(map(repr, in_body))} in its body. Differentiated, JAX runs the rule and not "
        "the body, so these cannot both be reaped or planted. Sow in one of the two (a rule may "
        "call the function itself)."
    )


def _shapes_str(shapes: Iterable[Any]) -> str:
    return " and ".join(str(list(s)) for s in shapes)


# -- plants -------------------------------------------------------------------


def plant_structure(site: Any, what: str, tree: Any) -> ValueError:
    return ValueError(
        f"{what} for the sow site {site} has structure {tree}, but the site sows {site.tree}."
    )


def plant_shape(site: Any, what: str, got: str, expected: str) -> ValueError:
    return ValueError(
        f"{what} for the sow site {site} is {got}, but the site expects {expected}. "
        "Plant a value of the sown shape and dtype (or a callable old -> new)."
    )


def plant_unheld(site: Any, what: str, value: Any, dtype: Any, why: str) -> ValueError:
    if isinstance(value, (int, float, complex)):
        shown = repr(value)
    else:
        shown = f"a {np.asarray(value).dtype}{list(np.shape(value))} array"
    return ValueError(
        f"{what} for the sow site {site} is {shown}, which its dtype {dtype} cannot hold "
        f"({why}); nothing was planted. Plant a value {dtype} holds, or sow a wider dtype "
        "at the site (64-bit ones need jax.config.update('jax_enable_x64', True))."
    )


def plant_complex_into_real(site: Any, what: str, dtype: Any) -> ValueError:
    return ValueError(
        f"{what} for the sow site {site} is a Python complex, and casting it to the site's "
        f"dtype {dtype} would drop any imaginary part unseen (a planted number is traced, so "
        "its value is not known where it is cast); nothing was planted. Plant a real number "
        "(v.real), or sow a complex value at the site."
    )


def plant_count(site: Any, got: int, n: int, what: str) -> ValueError:
    shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in site.avals)
    return ValueError(
        f"The plant for the sow site {site} has {got} {what}, but reap returns "
        f"{n} {what} of {shapes} for it. Plant {n} {what}, as reap returns them, or a "
        "single value (or callable) used at every occurrence."
    )


def plant_runs(site: Any, got: int, n: int, where: str) -> ValueError:
    per = "shard" if where in ("shard_map", "pmap") else "iteration"
    return ValueError(
        f"The plant for the sow site {site} is stacked with {got} rows, but the "
        f"{where} around it has {n} {per}s and reap returns one row per {per}. Plant "
        f"{n} rows, as reap returns them, or a single value (or callable) used at every "
        f"{per}."
    )


def too_few_entries(site: Any, have: int, needed: int) -> ValueError:
    return ValueError(
        f"The plant for the sow site {site} has {have} entries, but the site is sown at "
        f"least {needed} times. Plant one entry per occurrence (as reap returns), or a "
        "single value for all."
    )


def indexed_plant_of_collect_in_loop(site: Any) -> ValueError:
    return ValueError(
        f"The planted callable for the sow site {site} takes an occurrence index, but "
        "the site has mode 'collect' inside a loop, where reap stacks each sow's "
        "iterations into one entry, so occurrences have no single index. Use mode "
        "'append' (one row per iteration), or a callable of the old value alone."
    )


# -- where a sow sits ---------------------------------------------------------


def no_rule(primitive: Any, site: Any) -> NotImplementedError:
    return NotImplementedError(
        f"harvest has no rule for the primitive `{primitive}`, which holds "
        f"the sow site {site}. Move the sow outside `{primitive}`, or "
        "file an issue naming this primitive."
    )


def extend_not_a_descriptor(descriptor: Any) -> TypeError:
    return TypeError(
        "harvest.extend.register: descriptor must be a harvest.extend.HigherOrder, got "
        f"{type(descriptor).__name__}."
    )


def rebind_not_a_call(primitive: Any) -> TypeError:
    return TypeError(f"rebind_call: `{primitive}` is not a call primitive harvest re-binds.")


def extend_rule_not_callable(rule: Any) -> TypeError:
    return TypeError(f"harvest.extend.register: rule must be callable, got {rule!r}.")


def strict_in_loop(site: Any, where: str) -> ValueError:
    every = " (with reap's max_steps=N)" if where == "while_loop" else ""
    return ValueError(
        f"The sow site {site} has mode 'strict' but sits inside a {where}, which "
        "sows it once per iteration. "
        + (
            _random_variable_modes(site)
            or "Use mode 'collect' or 'append' to keep every "
            f"iteration{every}, 'clobber' for the last one, or sow_cond for a chosen one."
        )
    )


def stacked_in_while(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} has mode {site.mode.label} inside a while_loop, whose trip "
        "count is not known until it runs, so its occurrences cannot be stacked into "
        "a fixed-size array. "
        + (
            "Pass max_steps=N to reap (or call_and_reap, harvest) for the first N iterations "
            "and the count, or use "
            if site.mode.public  # harvest.compat.oryx's reap takes no max_steps
            else "Use "
        )
        + "lax.scan (or fori_loop with static bounds), mode 'clobber' for the last "
        "iteration, or sow_cond for a chosen one."
    )


def sow_in_while_cond(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} sits in a while_loop's cond_fun. Sow the value in body_fun instead."
    )


def sow_outside_solve(site: Any, role: str) -> ValueError:
    return ValueError(
        f"The sow site {site} sits in custom_linear_solve's `{role}`, which `solve` "
        "never calls: it runs only inside derivatives, where nothing can be reaped "
        "or planted. Sow in `solve`, or call `matvec` from `solve`."
    )


# -- while loops: per-step records and plants ---------------------------------


def bad_max_steps(value: Any) -> ValueError:
    return ValueError(
        f"max_steps must be a positive int (how many while_loop iterations to record), "
        f"got {value!r}. Leave it None to reap each while_loop's last iteration."
    )


def per_occurrence_plant_in_while(site: Any) -> ValueError:
    return ValueError(
        f"The plant for the sow site {site} holds one value per occurrence, but the site is "
        "inside a while_loop, whose trip count is not known until it runs. Plant a single "
        "value or a callable old -> new (used at every iteration), or a callable "
        "fn(old, i) that picks by the iteration's index, e.g. lambda old, i: rows[i]."
    )


def stacked_in_batched_while(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} has mode {site.mode.label} inside a while_loop whose predicate "
        "vmap batches, so each example runs its own number of iterations. Reap per example "
        "instead: jax.vmap(reap(f))"
        + (
            ", or sow with mode 'clobber' for each example's last iteration."
            if site.mode.public
            else "."
        )
    )


def steps_nested(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} is recorded per step (max_steps) in a while_loop that sits "
        "inside another loop or a cond, which cannot stack a per-step record. Reap "
        "without max_steps (each while_loop's last iteration), or reap inside the outer "
        "loop's body."
    )


def steps_mixed(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} is recorded per step (max_steps) in a while_loop and also "
        "sown outside it, so its occurrences do not make one record. Give the loop's "
        "occurrences their own names, e.g. call the loop body through "
        "harvest.nest(body, scope='decode'), or reap without max_steps."
    )


# -- path patching ------------------------------------------------------------


def path_patching_senders(senders: Any) -> TypeError:
    return TypeError(
        "path_patching needs `senders` as a non-empty dict {site name: planted value}, got "
        f"{type(senders).__name__}. E.g. senders={{'blocks0.z': patch_head(clean_z, 1, axis=2)}}."
    )


def path_patching_args(args: Any) -> TypeError:
    return TypeError(
        f"path_patching needs `corrupted_args` as a tuple of f's arguments, got "
        f"{type(args).__name__}. Write (x,) for a single argument."
    )


def path_patching_no_receivers() -> ValueError:
    return ValueError(
        "path_patching needs `receivers`: the names (or glob patterns) of the sites the "
        "path runs through, e.g. receivers='blocks1.k'."
    )


def path_patching_sender_is_receiver(name: str) -> ValueError:
    return ValueError(
        f"path_patching: the sender {name!r} is also selected by `receivers`. A path runs "
        "from a sender to other sites: select receivers downstream of it."
    )


def handled_inside(primitive: Any, handlers: Any) -> NotImplementedError:
    handled = sorted({str(p) for p in handlers})
    return NotImplementedError(
        f"make_effect_handler: a handled primitive ({', '.join(handled)}) is bound inside "
        f"`{primitive}`, and the handlers' state cannot be threaded through it. Move "
        "the handled operations out of the loop or branch."
    )


def handler_state_changed_structure(primitive: Any, before: Any, after: Any) -> TypeError:
    return TypeError(
        f"make_effect_handler: inside `{primitive}` the handlers changed the state's structure "
        f"from {before} to {after}; a loop or branch carries one structure. Keep the state's "
        "pytree structure fixed (e.g. start from the full dict)."
    )


def jvp_rule_failed(function: str, error: Exception) -> RuntimeError:
    first = (str(error).splitlines() or [""])[0][:200]
    return RuntimeError(
        f"The JVP rule of the custom_jvp function `{function or '?'}` failed while harvest "
        f"traced it to find the sows it holds ({type(error).__name__}: {first}). Fix the rule "
        "(it would fail the same way under jax.jvp), or define it with jax.custom_vjp."
    )


# -- activation patching, sites, effect handlers, NNX state --------------


def bad_positions(positions: Any) -> TypeError:
    return TypeError(
        f"patch_positions needs integer positions (an index or a 1-D sequence), got "
        f"{positions.dtype}{list(positions.shape)}."
    )


def bad_head_axis(axis: Any) -> TypeError:
    return TypeError(f"ablate_head(head, axis): axis must be an int (the head axis), got {axis!r}.")


def bad_heads(heads: Any) -> TypeError:
    return TypeError(
        "ablate_head needs an integer head (or a 1-D sequence of them), got "
        f"{heads.dtype}{list(heads.shape)}."
    )


def index_out_of_range(what: str, index: int, axis: int, shape: tuple[int, ...]) -> IndexError:
    size = shape[axis]
    return IndexError(
        f"{what}: index {index} is out of range along axis {axis} of clean, of shape {shape} "
        f"(indices -{size}..{size - 1}; a negative one counts from the end, as in NumPy). "
        "Pass indices that exist in the sown value."
    )


def head_out_of_range(head: int, axis: int, old: Any) -> InterventionMisfit:
    shape = tuple(jnp.shape(old))
    size = shape[axis]
    return InterventionMisfit(
        f"ablate_head: head {head} is out of range along axis {axis} of the sown value, "
        f"{jnp.result_type(old)}{list(shape)}: its {size} heads are -{size}..{size - 1} (a "
        "negative one counts from the end, as in NumPy). Pass the head axis and a head it has."
    )


def axis_not_an_int(what: str, axis: Any) -> TypeError:
    return TypeError(f"{what}: axis must be an int, got {axis!r}.")


def axis_out_of_range(what: str, axis: Any, shape: Any) -> ValueError:
    return ValueError(
        f"{what}: axis {axis} is out of range for a value of shape {shape}. "
        "Pass the axis that indexes positions in the sown value."
    )


def leaves_differ_along_axis(what: str, sizes: list[int], axis: Any) -> ValueError:
    return ValueError(f"{what}: the leaves have different sizes {sizes} along axis {axis}.")


def no_value_for_site(what: str, name: str, tag: Any) -> KeyError:
    return KeyError(
        f"{what} has no value for {name!r}. Pass the dict "
        f"`reap(f, tag={tag!r})(*clean_args)` returns."
    )


def needs_callable(call: str, value: Any, argument: str = "f") -> TypeError:
    return TypeError(f"{call} needs a callable {argument}, got {type(value).__name__}.")


def corrupted_args_not_a_tuple(caller: str, corrupted_args: Any) -> TypeError:
    return TypeError(
        f"{caller}: corrupted_args must be the tuple of f's positional arguments, e.g. "
        f"(tokens,), got {type(corrupted_args).__name__}."
    )


def ablation_args_not_a_tuple(args: Any) -> TypeError:
    return TypeError(
        "ablation_sweep: args must be the tuple of f's positional arguments, e.g. (tokens,), "
        f"got {type(args).__name__}."
    )


def unknown_ablation(how: Any, hows: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"ablation_sweep: unknown how={how!r}. Use one of {', '.join(map(repr, hows))}; for "
        "another replacement, pass its values as the clean run's to patching_sweep."
    )


def clean_not_a_dict(caller: str, clean: Any) -> TypeError:
    return TypeError(
        f"{caller}: clean must be the dict reap(f, tag=...)(*clean_args) returns, got "
        f"{type(clean).__name__}."
    )


def nothing_to_patch(caller: str, tag: Any, sown: list[str]) -> ValueError:
    return ValueError(
        f"{caller}: nothing to patch. No name sown with tag {tag!r} has a value in clean; "
        f"names sown with that tag: {sown or 'none'}."
    )


def no_site_has_axes(caller: str, where: str, n_axes: int, sizes: Any) -> ValueError:
    return ValueError(f"{caller}: no site has {'an ' * (n_axes == 1)}{where}; sizes: {sizes}.")


def sizes_differ_along_axes(caller: str, where: str, sizes: dict[str, str]) -> ValueError:
    return ValueError(
        f"{caller}: the sites have different sizes along {where}: {sizes}. Sweep sites of one "
        "size together (pass names=...)."
    )


def sweep_site_fires_often(caller: str, name: str, mode: str, count: str, where: str) -> ValueError:
    return ValueError(
        f"{caller}: the site {name!r} (mode {mode}) fires {count} times per call "
        f"(at {where}); a sweep patches each occurrence of a site sown with "
        "mode 'append' outside while_loops, and otherwise needs sites that fire once. Sow it "
        "with mode='append', give each occurrence its own name (e.g. with nest or "
        "f'layer{i}'), or leave it out with names=."
    )


def metric_not_scalar(shape: Any) -> TypeError:
    return TypeError(
        f"metric(out) must return a scalar, got shape {shape}. Reduce it, e.g. "
        "with jnp.mean over the batch."
    )


def bad_sweep_axis(caller: str, axis: Any) -> TypeError:
    return TypeError(
        f"{caller}: axis must be an int or a non-empty tuple of ints (e.g. axis=(2, 1) for every "
        f"(head, position) pair), got {axis!r}."
    )


def same_axis_twice(what: str, axes: Any) -> ValueError:
    return ValueError(f"{what}: axis {axes} names the same axis twice; sweep each axis once.")


def bad_dataset(caller: str, clean: Any, corrupted_args: list[Any]) -> TypeError:
    given = len(clean) if isinstance(clean, list) else type(clean).__name__ + " as"
    return TypeError(
        f"{caller}: for a dataset, pass corrupted_args as a non-empty list of argument tuples, "
        "one per batch, and clean as the list of their clean reaps, [reap(f)(*clean_args) for "
        f"clean_args in batches]; got {len(corrupted_args)} argument tuples and {given} clean."
    )


def batch_sizes_differ(caller: str, name: str, sizes: Any, axes: Any, first: Any) -> ValueError:
    return ValueError(
        f"{caller}: in this batch, {name!r} has sizes {sizes} along axis {axes}, not {first} as "
        "in the first batch. Every batch must give the swept axes one size."
    )


def bad_batch_size(caller: str, batch_size: Any) -> TypeError:
    return TypeError(
        f"{caller}: batch_size must be a positive int (patches run at once), got {batch_size!r}."
    )


def no_gap_to_normalize(baseline: float) -> ValueError:
    return ValueError(
        f"normalized: the clean metric equals the corrupted baseline ({baseline}), so there "
        "is no gap to normalise by. Pick a metric (or inputs) that tells the two runs apart."
    )


def plot_many_one_axis(shape: Any) -> ValueError:
    return ValueError(
        f"plot_many draws results of one swept axis; this one has values of shape {shape}. "
        "Use result.plot(), which draws one panel per site."
    )


def plot_many_nothing() -> ValueError:
    return ValueError("plot_many needs at least one PatchingResult.")


def plot_many_differ(shapes: list[Any]) -> ValueError:
    return ValueError(
        "plot_many draws results with the same sites and positions; got shapes "
        f"{shapes}. Plot them separately (each with the same vmax)."
    )


def plot_many_titles(titles: int, results: int) -> ValueError:
    return ValueError(f"plot_many: {titles} titles for {results} results.")


def sites_bad_tag(tag: Any) -> TypeError:
    return TypeError(f"sites: tag must be a string or None (every tag), got {tag!r}.")


def bad_handlers(handlers: Any) -> TypeError:
    return TypeError(
        "make_effect_handler takes a dict {primitive: handler(state, *inputs, **params) -> "
        f"(outputs, state)}}; got {handlers!r}."
    )


def nnx_state_from_another_trace(error_type: type[Exception], names: str) -> Exception:
    return error_type(
        f"This harvested call changed the NNX state ({names}) of a model made outside the "
        "jax.jit/jax.grad/... trace it runs in, and NNX forbids writing values of that trace into "
        "it (calling the model directly there fails the same way). Pass the model through the "
        "transformation instead: nnx.jit/nnx.grad, or nnx.split it, nnx.merge it inside and "
        "return nnx.state(model)."
    )


def planted_where_a_batching_rule_ran(site: Any) -> ValueError:
    return ValueError(
        f"Cannot plant {site}: it is sown in a jax.custom_batching.custom_vmap function that runs "
        "under vmap, where JAX runs the function's batching rule instead of its body, so the "
        "planted value would change nothing. Plant outside the vmap (plant(f) inside "
        "jax.vmap), or sow in the batching rule too."
    )


def planted_where_a_derivative_rule_ran(site: Any) -> ValueError:
    return ValueError(
        f"Cannot plant {site}: it is sown in the body of a custom_jvp or custom_vjp function "
        "that is differentiated inside the harvested function, where JAX runs the function's "
        "rule (its JVP rule, or its forward) instead of its body, so the planted value would "
        "change nothing. Plant outside the differentiation (jax.grad(plant(f))), or sow in "
        "the rule too."
    )


def tag_matches_no_site(tag: Any, tags: list[Any], caller: str = "reap") -> ValueError:
    shown = ", ".join(repr(t) for t in tags[:8]) + (", ..." if len(tags) > 8 else "")
    why = (
        "reaping a tag the function never sows is refused rather than returning {}"
        if caller == "reap"
        else "a plant under a tag the function never sows would change nothing"
    )
    return ValueError(
        f"{caller}(tag={tag!r}): the function has no sow of tag {tag!r}, but it has sows of the "
        f"tags {shown}. Pass one of those as tag= (instrument's sites are tag='modules'); {why}."
    )


def never_instrumented(tag: Any, caller: str = "reap") -> ValueError:
    why = "rather than returning {}" if caller == "reap" else "as it would change nothing"
    return ValueError(
        f"{caller}(tag={tag!r}): the function sows nothing, of any tag; refused {why}. "
        f"{tag!r} is the tag instrument sows a model's parts under: pass what instrument "
        f"returns, not the model itself (model = harvest.instrument(model), then "
        f"{caller}(model, tag={tag!r}); for Linen, instrument the function that calls "
        "model.apply)."
    )


def dotted_nest_scope(scope: str) -> ValueError:
    outer, _, inner = scope.rpartition(".")
    return ValueError(
        f"nest(scope={scope!r}): a scope may not contain a dot, since dotted paths name "
        "sites and this one could mean another site. For scopes inside scopes nest twice: "
        f"nest(nest(f, scope={inner!r}), scope={outer!r}); or use another separator ('_')."
    )


def paths_collide(first: tuple[str, ...], second: tuple[str, ...]) -> ValueError:
    def spelled(path: tuple[str, ...]) -> str:
        scopes = f" under nest scopes {list(path[:-1])}" if len(path) > 1 else ""
        return f"name {path[-1]!r}{scopes}"

    return ValueError(
        f"The sites {spelled(first)} and {spelled(second)} are both spelled "
        f"{'.'.join(second)!r} (a dot inside a sown name reads as a nest scope), so a plant "
        "could reach the wrong one. Rename one of the sows, without dots (use '_')."
    )


def traced_like_jit() -> str:
    return (
        "harvest traces the function, as jax.jit does: its arrays are tracers, so Python "
        "control flow on their values (if x.sum() > 0, int(x)) fails as it would under jit. "
        "Use jnp.where / lax.cond, or pass such values as Python numbers (they are static)."
    )


def plant_not_an_array(site: Any, what: str, leaf: Any) -> TypeError:
    return TypeError(
        f"{what} for the sow site {site} is a {type(leaf).__name__} ({leaf!r:.40}), not an "
        "array or number. Plant an array of the sown shape and dtype, a Python number, or a "
        "callable old -> new returning one."
    )


def plant_callable_arity(site: Any, fn: Any) -> TypeError:
    return TypeError(
        f"The planted callable {getattr(fn, '__name__', fn)!r} for the sow site {site} "
        "requires more than two positional arguments. A planted callable takes the old value, "
        "or the old value and the occurrence index: old -> new or (old, i) -> new."
    )


def callable_plant_batched_apart(site: Any) -> ValueError:
    return ValueError(
        f"The planted callable for the sow site {site} would see one example of the vmaps "
        f"around it, but vmap batched its leaves along different axes ({site.vmapped} leading "
        "batch axes), which cannot be paired. This is a bug in harvest: please report it; "
        "meanwhile plant a value, or sow the leaves as separate sites."
    )


# -- harvest.store ----------------------------------------------------------


def store_needs_tensorstore() -> ImportError:
    return ImportError(
        "harvest.store writes and reads its arrays with TensorStore: "
        "pip install 'jax-harvest[store]' (or pip install tensorstore)."
    )


def store_tensorstore_unimportable(cause: ImportError, unreadable: list[str]) -> ImportError:
    if unreadable:
        where = ", ".join(repr(p) for p in unreadable)
        return ImportError(
            f"harvest.store could not import TensorStore ({cause}): this process may not "
            f"read {where} on its module path (permission denied), where it may be "
            "installed. Run it as a user who can read them, or install TensorStore where "
            "this user can."
        )
    return ImportError(
        "harvest.store could not import TensorStore, which is installed: "
        f"{type(cause).__name__}: {cause}. That is TensorStore's own failure (the "
        "traceback above shows where); reinstalling it may mend it: "
        "pip install --force-reinstall 'jax-harvest[store]'."
    )


def store_path_is_file(path: Any) -> ValueError:
    return ValueError(
        f"record(..., path={str(path)!r}): that path is a file. A store is a directory: "
        "pass a new or empty directory, or an existing store's."
    )


def store_path_not_a_store(path: Any) -> ValueError:
    return ValueError(
        f"{str(path)!r} is not empty and holds no harvest store (no zarr.json with a "
        "'harvest' manifest). Pick another directory; nothing there was changed."
    )


def store_not_found(path: Any) -> FileNotFoundError:
    return FileNotFoundError(
        f"harvest.store.open({str(path)!r}): no harvest store there (no zarr.json with a "
        "'harvest' manifest). Record one with harvest.store.record(fn, batches, path)."
    )


def store_no_batches() -> ValueError:
    return ValueError(
        "record(fn, batches, path): `batches` yielded nothing. Pass an iterable of "
        "batches (arrays or pytrees of arrays with a leading example axis)."
    )


def store_batch_without_arrays(batch_type: str) -> TypeError:
    return TypeError(
        f"record(fn, batches, path): a batch is a {batch_type} holding no array. Each "
        "batch must be an array or a pytree of arrays whose leading axis is the example axis."
    )


def store_no_sites(tag: str, names: Any) -> ValueError:
    return ValueError(
        f"record: the function sows no site of tag {tag!r}"
        + (f" that `names={names!r}` selects" if names is not None else "")
        + ", so there is nothing to record. Check the tag (instrument sows under 'modules')."
    )


def store_site_not_array(name: str, value: Any) -> TypeError:
    return TypeError(
        f"record: site {name!r} reaps a {type(value).__name__}, not an array (a site sown "
        "several times under mode 'collect' reaps a tuple). Sow it with mode 'strict' or "
        "'append', or leave it out with `names=`."
    )


def store_site_not_rows(
    name: str, shape: Any, batch: int, rows: str, sown: Any = None
) -> ValueError:
    want = "[examples, ...]" if rows == "examples" else "[examples, positions, ...]"
    stacked = (
        f" (each occurrence {tuple(sown)}, stacked by a loop)"
        if sown is not None and tuple(sown) != tuple(shape)
        else ""
    )
    return ValueError(
        f"record: site {name!r} has shape {tuple(shape)}{stacked}, but rows={rows!r} needs {want} "
        f"with {batch} examples first, as in the batch (taken from the sown value's axis "
        "`example_axis`, 0 unless given; a loop's occurrence axes do not count). Pass "
        "example_axis= (an int, or a dict by site), leave the site out with `names=`"
        + (", or use rows='examples'." if rows == "tokens" else ".")
    )


def store_bad_option(what: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"harvest.store: `{what}` must be {expected}, got {value!r}.")


def store_manifest_mismatch(path: Any, differences: list[str]) -> ValueError:
    shown = "; ".join(differences[:4]) + (
        f" (and {len(differences) - 4} more)" if len(differences) > 4 else ""
    )
    return ValueError(
        f"record: the store at {str(path)!r} was recorded from other sites or shapes: {shown}. "
        "Nothing was written. Record into another path, or pass overwrite=True to start afresh."
    )


def store_batch_shape(index: int, name: str, got: Any, expected: Any, committed: int) -> ValueError:
    return ValueError(
        f"record: batch {index} gives site {name!r} rows of shape {tuple(got)}, but the store "
        f"holds rows of shape {tuple(expected)}. Nothing of batch {index} was written (the store "
        f"keeps its first {committed} batches). Give every batch one shape: drop or pad the "
        "last, short batch."
    )


def store_fewer_batches(path: Any, stored: int, given: int) -> ValueError:
    return ValueError(
        f"record: the store at {str(path)!r} already holds {stored} batches, but `batches` "
        f"yielded only {given}: it is not the dataset this store was recorded from. "
        "Pass overwrite=True to record it afresh."
    )


def store_unknown_name(name: Any, names: Iterable[str]) -> KeyError:
    return KeyError(
        f"the store has no site {name!r}; it holds: {', '.join(repr(n) for n in names)}."
    )


def store_tokens_split(name: str) -> ValueError:
    return ValueError(
        f"record(rows='tokens'): site {name!r} is sharded along its position axis, so one "
        "device's rows are not contiguous tokens. Shard the batch along examples only, or "
        "use rows='examples'."
    )


def store_site_prng_key(name: str, dtype: Any) -> TypeError:
    return TypeError(
        f"record: site {name!r} holds PRNG keys ({dtype}), which a store cannot hold. "
        "Sow their raw data instead, jax.random.key_data(keys) (jax.random.wrap_key_data "
        "turns it back into keys), or leave the site out with `names=`. Nothing was written."
    )


def store_cannot_hold(name: str, dtype: str, codecs: Any, reason: str) -> ValueError:
    return ValueError(
        f"record: site {name!r} ({dtype}) cannot be stored as a zarr v3 array"
        + (f" with codecs={codecs!r}" if codecs is not None else "")
        + f" ({reason.split(' [')[0]}). Cast it with `dtype=` (e.g. dtype='float32')"
        + (" or fix `codecs`" if codecs is not None else "")
        + ", or leave the site out with `names=`. Nothing was written."
    )


def store_example_axis(name: str, axis: Any, sown: Any, rows: str) -> ValueError:
    need = "two axes (examples, then positions)" if rows == "tokens" else "an axis"
    return ValueError(
        f"record: example_axis={axis!r} for site {name!r}, whose value as sown has shape "
        f"{tuple(sown)}: rows={rows!r} needs {need} there. Pass an axis of the sown value "
        "(negative counts from the end), or leave the site out with `names=`."
    )


def store_example_axis_names(unknown: list[str], names: Iterable[str]) -> KeyError:
    return KeyError(
        f"record(example_axis={{...}}) names {', '.join(repr(n) for n in unknown)}, "
        f"which {'is' if len(unknown) == 1 else 'are'} not recorded; the sites recorded are "
        f"{', '.join(repr(n) for n in names)}. Nothing was written."
    )


def store_file_missing(path: Any, doing: str, site: str | None) -> FileNotFoundError:
    where = (
        f"site {site!r} of the store at {str(path)!r}" if site else f"the store at {str(path)!r}"
    )
    return FileNotFoundError(
        f"harvest.store: {doing} {where}: a file of it is missing (deleted, or not copied "
        "with the rest); its rows are not read as zeros. The store is damaged: copy it again "
        "whole, or record it afresh with record(..., overwrite=True)."
    )


def store_io_failed(path: Any, doing: str, site: str | None, code: int | None) -> OSError:
    where = (
        f"site {site!r} of the store at {str(path)!r}" if site else f"the store at {str(path)!r}"
    )
    reason = os.strerror(code) if code else "an I/O error"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        advice = (
            "Free space (or record to another disk); calling record again with the same "
            "arguments resumes from the batches already written."
        )
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        advice = "Use a path you can write to (or make this one writable)."
    else:
        advice = "Check the file system at that path, then try again."
    message = f"harvest.store: {doing} {where} failed: {reason}. {advice}"
    return OSError(code, message) if code else OSError(message)


def store_manifest_damaged(path: Any, reason: str) -> ValueError:
    return ValueError(
        f"harvest.store: the manifest of the store at {str(path)!r} (its zarr.json) is "
        f"damaged: {reason}. Copy the store again whole, or record it afresh."
    )


def store_bad_index(index: Any) -> IndexError:
    return IndexError(
        f"StoreArray takes numpy basic indexing (ints, slices, ..., None), got {index!r}. "
        "Read the rows first (np.asarray(array[i:j])), then index the numpy array."
    )


def store_index_out_of_range(index: int, axis: int, size: int) -> IndexError:
    return IndexError(f"index {index} is out of bounds for axis {axis} with size {size}")


def store_too_many_indices(ndim: int, given: int) -> IndexError:
    return IndexError(
        f"too many indices for the store's array: it is {ndim}-dimensional, "
        f"but {given} were indexed"
    )


# -- harvest.ppl ----------------------------------------------------------------


def ppl_bad_name(caller: str, name: Any) -> TypeError:
    return TypeError(f"{caller} needs `name` to be a non-empty string, got {name!r}.")


def ppl_names_not_strings(caller: str, what: str, names: Any) -> TypeError:
    return TypeError(f"{caller} takes {what} as strings, got {names!r}.")


def ppl_random_variable_unnamed() -> TypeError:
    return TypeError(
        "random_variable needs a name, e.g. random_variable(dist, name='x'): "
        "joint_sample, joint_log_prob, intervene and conditional refer to the draw by it."
    )


def ppl_random_variable_mode(name: str, mode: Any) -> ValueError:
    return ValueError(
        f"random_variable(name={name!r}): mode {mode!r} is not supported. Use 'strict' "
        "for one draw, or 'append' for a draw inside lax.scan (draws stack on a "
        "leading axis)."
    )


def ppl_not_a_distribution(name: str, dist: Any) -> TypeError:
    return TypeError(
        f"random_variable(name={name!r}) takes a TFP distribution (from "
        "tensorflow_probability.substrates.jax) or a sampling function key -> value; "
        f"got a {type(dist).__name__}."
    )


def ppl_plate_size(name: str, size: Any) -> TypeError:
    return TypeError(f"plate(name={name!r}) needs `size` to be a positive int, got {size!r}.")


def ppl_values_not_a_dict(fn_name: str, values: Any) -> TypeError:
    return TypeError(
        f"{fn_name} takes the values of random variables as a dict {{name: value}} "
        f"(as joint_sample returns it), got a {type(values).__name__}."
    )


def ppl_observed_not_a_dict(observed: Any) -> TypeError:
    return TypeError(
        f"unconstrained takes observed values as a dict {{name: value}}, got {observed!r}."
    )


def ppl_missing_values(missing: Iterable[str]) -> ValueError:
    return ValueError(
        "joint_log_prob needs a value for every random variable; missing: "
        f"{', '.join(sorted(missing))}. Give them too, fix them "
        "first with intervene/conditional, or (Bernoulli, Categorical) draw them with "
        "enumerate=True to sum them out."
    )


def ppl_drawn_without_density(caller: str, names: Iterable[str]) -> ValueError:
    names = sorted(names)
    if len(names) == 1:
        return ValueError(
            f"{caller}: the random variable {names[0]!r} is drawn by a plain sampling function, "
            "which has no density. Draw it from a TFP distribution, or fix it with "
            "intervene/conditional."
        )
    return ValueError(
        f"{caller}: the random variables {', '.join(names)} were drawn by plain sampling "
        "functions, which have no density. Draw them from a TFP distribution, or fix them "
        "with intervene/conditional."
    )


def ppl_conditional_arity(names: Iterable[str], given: int) -> TypeError:
    return TypeError(
        f"conditional(f, {list(names)}) is called as g(key, *args, *values) with one "
        f"value per name; got {given} positional arguments in all."
    )


def ppl_log_prob_target(f: Any) -> TypeError:
    return TypeError(f"log_prob takes a TFP distribution or a program, got a {type(f).__name__}.")


def ppl_cannot_invert(why: str, stuck: Iterable[str], invertible: str) -> ValueError:
    """log_prob by inversion found no way back from the output to a draw (`why`)."""
    stuck = sorted(stuck)
    where = ""
    if stuck:
        where = (
            " The way back from the output stopped at: "
            + ", ".join(f"`{p}`" for p in stuck)
            + f". Invertible primitives: {invertible}."
        )
    return ValueError(
        f"Cannot compute log_prob of function: {why}.{where} Use joint_log_prob(f) with a value "
        "for every random variable, or return the missing draws from f (e.g. "
        "log_prob(joint_sample(f)))."
    )


def ppl_sample_structure(expected: Any, got: Any) -> ValueError:
    return ValueError(f"log_prob(f) takes a value shaped like f's output, {expected}; got {got}.")


def ppl_numpyro_distribution(name: str, type_name: str) -> TypeError:
    return TypeError(
        f"random_variable(name={name!r}) got NumPyro's {type_name}; harvest.ppl draws from "
        "TensorFlow Probability distributions (tensorflow_probability.substrates.jax), "
        f"e.g. tfd.{type_name}(...), or from a sampling function key -> value."
    )


def ppl_unknown_names(fn_name: str, unknown: Iterable[str], known: Iterable[str]) -> KeyError:
    return KeyError(
        f"{fn_name}: not random variables of the program: {', '.join(unknown)}. Its random "
        f"variables are: {', '.join(sorted(known)) or 'none'}."
    )


def ppl_blocked_draw_scored(fn_name: str, names: Iterable[str]) -> ValueError:
    return ValueError(
        f"{fn_name}: the density depends on {', '.join(names)}, hidden by block. A blocked "
        "draw is integrated out, which harvest can do only where no counted density depends "
        "on it. Fix it with intervene or conditional, or do not block it."
    )


def ppl_no_unconstrained_value(names: Iterable[str]) -> ValueError:
    return ValueError(
        f"unconstrained: no value for {', '.join(names)}. Give every free random variable "
        "(init(key) gives a starting point)."
    )


def ppl_not_free(names: Iterable[str]) -> ValueError:
    return ValueError(
        f"unconstrained: {', '.join(names)} are not free random variables of the program "
        "(they are observed, fixed by intervene or conditional, or blocked). Leave them out of u."
    )


def ppl_discrete_free(names: Iterable[str]) -> ValueError:
    return ValueError(
        f"unconstrained: the random variables {', '.join(names)} are discrete, or drawn by "
        "plain sampling functions, so they cannot be moved to R^n. Give them in `observed`, "
        "fix them with intervene or conditional, or (Bernoulli, Categorical) draw them with "
        "random_variable(..., enumerate=True) to sum them out."
    )


def _random_variable_modes(site: Any) -> str:
    """What a duplicate-name error suggests: random_variable knows only 'strict' and 'append'."""
    if site.tag == "random_variable":
        return (
            "Give each draw its own name, or (inside lax.scan) random_variable(..., "
            "mode='append'), which stacks one draw per iteration."
        )
    return ""


def ppl_tfp_import_failed(
    cause: Exception, module: str, tested: str, imported_before: bool
) -> ImportError:
    order = ""
    if imported_before:
        order = (
            " TFP's JAX substrate was imported before harvest.ppl, on a JAX that needs "
            "harvest's compatibility alias for it (see harvest/ppl/_tfp_shim.py), and "
            "importing it again did not recover. Restart the interpreter and import "
            "harvest.ppl before tensorflow_probability."
        )
    return ImportError(
        f"harvest.ppl could not import TensorFlow Probability's JAX substrate ({module}): "
        f"{type(cause).__name__}: {cause}.{order} harvest.ppl needs it (it draws from TFP "
        f"distributions) and is tested with {tested}; install them with "
        "`pip install 'jax-harvest[ppl]'`. The core (sow, reap, plant, instrument) works "
        "without TFP."
    )


def ppl_needs_extra(module: str, what: str) -> ImportError:
    return ImportError(
        f"harvest.ppl.{what} needs {module}, which is not installed. Install the inference "
        "extra: pip install 'jax-harvest[infer]' (BlackJAX and ArviZ, pinned to tested versions)."
    )


def ppl_unknown_chain_method(method: Any, known: Iterable[str]) -> ValueError:
    return ValueError(
        f"sample_posterior: unknown chain_method {method!r}; use one of "
        f"{', '.join(repr(m) for m in known)}."
    )


def ppl_unknown_kernel(kernel: Any, kernels: Iterable[str]) -> ValueError:
    return ValueError(
        f"sample_posterior: unknown kernel {kernel!r}. Use one of {', '.join(map(repr, kernels))}."
    )


def ppl_unknown_init(init: Any, inits: Iterable[str]) -> ValueError:
    return ValueError(
        f"sample_posterior: unknown init {init!r}. Use one of {', '.join(map(repr, inits))}."
    )


def ppl_bad_count(what: str, value: Any) -> ValueError:
    return ValueError(f"sample_posterior needs `{what}` to be a positive int, got {value!r}.")


def ppl_bad_summary_digits(value: Any) -> ValueError:
    return ValueError(
        f"Posterior.summary needs `digits` to be a positive int (significant digits kept) or None "
        f"(no rounding), got {value!r}."
    )


def ppl_predictive_infer_discrete_prior() -> ValueError:
    return ValueError(
        "predictive: infer_discrete=True draws the enumerated draws from their posterior, "
        "so it needs a Posterior; with posterior=None every draw is from the prior already."
    )


def ppl_predictive_count(value: Any) -> ValueError:
    return ValueError(
        "predictive(model, key, num_samples=n) draws n runs from the prior and needs "
        f"`num_samples` to be a positive int, got {value!r}; or give a Posterior to predict from."
    )


def ppl_no_mechanism(name: str, type_name: str) -> ValueError:
    return ValueError(
        f"counterfactual: the random variable {name!r} has a {type_name} distribution, which "
        "has no noise mechanism here (location-scale families, Bernoulli, Categorical, and "
        "continuous distributions with a quantile function have one). Fix it with intervene, "
        "or write it as loc + scale * noise with a standard noise draw."
    )


def ppl_counterfactual_do(names: Iterable[str]) -> ValueError:
    return ValueError(
        f"counterfactual needs `do` to name the intervention, {{name: value}}, got {names!r}."
    )


def ppl_enumeration_too_large(names: Iterable[str], size: int, limit: int) -> ValueError:
    return ValueError(
        f"enumerating {', '.join(names)} jointly takes {size} assignments (at most {limit}). "
        "Enumerate fewer draws, or marginalise some by hand."
    )


def ppl_enumeration_mixed(names: Iterable[str]) -> ValueError:
    return ValueError(
        f"cannot enumerate {', '.join(names)} together: one of them has a batch shape. "
        "Enumerate one batched draw (a per-point assignment) or any number of scalar ones."
    )


def ppl_enumeration_in_scan(names: Iterable[str], why: str) -> ValueError:
    return ValueError(
        f"cannot sum out {', '.join(names)}, enumerated inside a scan: {why}. A scan sums "
        "out one enumerated draw per step (mode='append', a scalar Bernoulli or Categorical), "
        "its state carried from step to step; marginalise anything else by hand."
    )


def ppl_nothing_enumerated() -> ValueError:
    return ValueError(
        "infer_discrete: the program has no free enumerated draw to infer. Mark a discrete "
        "draw with random_variable(..., enumerate=True) (and leave it out of `observed`)."
    )


def ppl_infer_discrete_posterior(posterior: Any) -> TypeError:
    return TypeError(
        f"infer_discrete: `posterior` must be a Posterior (sample_posterior's), got a "
        f"{type(posterior).__name__}."
    )


def ppl_not_enumerable(name: str, type_name: str) -> TypeError:
    return TypeError(
        f"random_variable(name={name!r}, enumerate=True) sums the draw out over its support, "
        f"which needs a Bernoulli or Categorical distribution; got a {type_name}."
    )


def ppl_nothing_to_sample() -> ValueError:
    return ValueError(
        "sample_posterior: the program has no free continuous random variable left to sample "
        "(every draw is observed, fixed, blocked or enumerated). Score it with joint_log_prob, "
        "or draw from it with predictive."
    )


def ppl_observed_not_finite(name: str, bad: int, size: int, first: Any) -> ValueError:
    return ValueError(
        f"unconstrained/sample_posterior: the observed value of {name!r} has {bad} non-finite element(s) of "
        f"{size} (the first at index {first}). A NaN or infinite observation makes the log "
        "density NaN everywhere, so a sampler cannot move. Leave missing observations out of "
        "the observed site (observe only the entries you have), or model them as free draws."
    )


def ppl_observed_outside_support(name: str, bad: int, size: int, first: Any) -> ValueError:
    return ValueError(
        f"sample_posterior: the observed value of {name!r} has {bad} element(s) of {size} "
        f"outside the support of its distribution (the first at index {first}). TFP may "
        "still give such a value a finite density, so the posterior would be silently wrong. "
        "Correct the data, or draw the site from a distribution whose support holds it."
    )


def ppl_start_not_finite(
    chain: int, attempts: int, init: str, what: str, sites: dict[str, float]
) -> ValueError:
    at = ", ".join(f"{name!r}: {value}" for name, value in sites.items())
    blame = f" Not finite there: {at}." if at else ""
    tries = f"any of {attempts} starting points" if attempts > 1 else "its starting point"
    return ValueError(
        f"sample_posterior: the {what} of chain {chain} is not finite at {tries} "
        f"(init={init!r}).{blame} Check that each observed value lies in its distribution's "
        "support and the model's parameters are valid there, or start elsewhere "
        "(init='uniform' draws each unconstrained coordinate in (-2, 2), init='prior' from "
        "the prior)."
    )


def needs_extra(what: str, module: str, extra: str) -> ImportError:
    return ImportError(
        f"{what} needs {module}, which is not installed. Install it with "
        f"`pip install 'jax-harvest[{extra}]'` (from a checkout: `pip install -e '.[{extra}]'`)."
    )


# -- harvest.compat.oryx: oryx's own wording, which its users' code may match ---


def oryx_cond_clobber_in_sow() -> ValueError:
    return ValueError("For 'cond_clobber' mode, use `sow_cond`.")


def oryx_unknown_mode(mode: Any) -> ValueError:
    return ValueError(
        f"Unknown sow mode {mode!r}: oryx's modes are 'strict', 'clobber' and 'append'."
    )


def oryx_sow_cond_mode() -> ValueError:
    return ValueError("`sow_cond` only supports 'cond_clobber' mode.")


def oryx_worded(wording: str, error: Exception) -> ValueError:
    """oryx's `wording` of an error, with harvest's message (which says what to do) after it."""
    return ValueError(f"{wording} ({error})")


def oryx_log_prob_not_implemented(f: Any) -> NotImplementedError:
    return NotImplementedError(f"`log_prob` not implemented for type: {type(f)}")


def oryx_log_prob_rule_missing(primitive: Any) -> KeyError:
    return KeyError(
        f"`{primitive}` is in log_prob_registry but has no rule in log_prob_rules; "
        "add one: log_prob_rules[primitive] = rule(incells, outcells, **params)."
    )


def oryx_plate_name(name: Any) -> TypeError:
    return TypeError(f"plate needs `name`, the named axis to draw along, got {name!r}.")


def oryx_random_variable_unnamed(obj: Any) -> ValueError:
    return ValueError(f"Cannot call `random_variable` on {type(obj)} without passing in a name.")


def oryx_random_variable_plate(obj: Any) -> ValueError:
    return ValueError(f"Cannot call `random_variable` on {type(obj)} with a plate.")


def oryx_graph_replace_missing(missing: Iterable[str], draws: Iterable[str]) -> KeyError:
    return KeyError(
        f"graph_replace: {', '.join(missing)} are not random variables of the "
        f"program (or are among its inputs). Its random variables are: "
        f"{', '.join(sorted(draws)) or 'none'}."
    )


# -- instrument ------------------------------------------------------------------


def instrument_bad_target(target: Any) -> TypeError:
    return TypeError(
        f"instrument needs a Flax NNX module, an Equinox module, a Penzai layer or a callable, got a "
        f"{type(target).__name__}. For a Linen model, instrument the function that applies it, "
        "e.g. instrument(lambda x: model.apply(variables, x))."
    )


def instrument_module_class(target: Any, library: str) -> TypeError:
    name = getattr(target, "__name__", repr(target))
    if library == "Flax Linen":
        what = (
            f"instrument the function that applies one: instrument(lambda x: "
            f"{name}(...).apply(variables, x))"
        )
    else:
        what = f"build the model, then instrument it: instrument({name}(...))"
    return TypeError(
        f"instrument got the {library} class {name}, not a model: {what}, passing the "
        "arguments the class takes."
    )


def instrument_unbound_linen(target: Any) -> TypeError:
    name = type(target).__name__
    return TypeError(
        f"instrument got an unbound Flax Linen module ({name}), which runs only through "
        "model.apply with its variables. Instrument the function that applies it: "
        "instrument(lambda x: model.apply(variables, x)), or the bound module "
        "instrument(model.bind(variables))."
    )


def instrument_bad_tag(tag: Any) -> TypeError:
    return TypeError(f"instrument needs `tag` to be a non-empty string, got {tag!r}.")


def instrument_bad_flag(flag: str, value: Any) -> TypeError:
    return TypeError(f"instrument needs `{flag}` to be True or False, got {value!r}.")


def instrument_where_selects_no_submodule(where: Any, names: list[str]) -> ValueError:
    return ValueError(
        f"instrument: where={where!r} selects none of the model's submodules ({_outermost(names)})."
    )


def _outermost(names: list[str], k: int = 6) -> str:
    if not names:
        return "it has none"
    names = sorted(names, key=lambda n: (n.count("."), n))  # the outermost first
    more = f", ... ({len(names)} in all)" if len(names) > k else ""
    return "they are " + ", ".join(map(repr, names[:k])) + more


def instrument_nothing_sown(where: Any, kind: str, target: str) -> ValueError:
    if where is not None:
        return ValueError(f"instrument: where={where!r} selected nothing that {target} computes.")
    if kind == "function":
        return ValueError(
            f"instrument: {target} applies no Flax Linen module, so it has no module sites. "
            "For an NNX, Equinox or Penzai model, instrument the model object itself, not a "
            "function that calls it; or pass ops=True to make every primitive's output a site."
        )
    return ValueError(
        f"instrument: {target} called none of its submodules, so it has no sites. "
        "Pass ops=True for op sites."
    )


def instrument_rebuilt_ambiguous(tag: str, type_name: str, paths: list[str]) -> ValueError:
    return ValueError(
        f"instrument(tag={tag!r}): a {type_name} rebuilt from arrays (as eqx.combine "
        f"or jax.lax.scan over stacked layers rebuild one) fits several of the model's submodules: "
        f"{', '.join(map(repr, paths))}, so its name is ambiguous. Leave them out with `where` "
        f"(e.g. where=lambda name: name not in {paths!r}), or call the submodule itself rather than a "
        "copy passed through a transformation."
    )


# -- instrument(attention=True) ----------------------------------------------


def custom_attention_fn(path: str, cls: str) -> TypeError:
    return TypeError(
        f"instrument(attention=True): the {cls} at {path!r} has a custom attention_fn, so harvest "
        "cannot say where its pattern is. Use Flax's default attention_fn there, or leave the "
        "hooks out (attention=False) and reap its submodules and ops (ops=True) instead."
    )


def equinox_attention_arguments(path: str, unexpected: list[str]) -> TypeError:
    return TypeError(
        f"instrument(attention=True): the Equinox MultiheadAttention at {path!r} got arguments "
        f"it does not take: {unexpected}. Call it with (query, key_, value, mask=None, *, key, "
        "inference, deterministic, process_heads) as Equinox 0.13 defines it."
    )


def equinox_mask_shape(mask: Any, logits: Any) -> ValueError:
    return ValueError(
        f"instrument(attention=True): an Equinox attention's mask has shape {tuple(mask)}; it "
        f"must be (query_seq_length, kv_seq_length) = {tuple(logits)}, as Equinox requires."
    )


def equinox_process_heads_shape(path: str, before: Any, after: Any) -> ValueError:
    return ValueError(
        f"instrument(attention=True): process_heads at {path!r} changed the heads' shapes from "
        f"{before} to {after}; it must keep each of q, k and v's shape (as Equinox requires)."
    )


def unknown_naming(names: Any, known: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"instrument: unknown names={names!r}. Use one of {', '.join(map(repr, known))}, or None "
        "for harvest's own names (each part's dotted path)."
    )


_KINDS = {
    "nnx": "a Flax NNX model",
    "equinox": "an Equinox model",
    "penzai": "a Penzai model",
    "function": "a function target",
}


def no_transformer_blocks(target: str, kind: str) -> ValueError:
    return ValueError(
        f"instrument(names='transformer_lens') found no transformer block in {target} "
        f"({_KINDS.get(kind, kind)}). It reads Flax NNX and Equinox blocks (a module with one attention submodule, "
        "nnx.MultiHeadAttention or eqx.nn.MultiheadAttention, and one submodule named `mlp`; or, "
        "attention only, an element of a list with one attention submodule), Penzai blocks (a "
        "layer of one or two pz.nn.Residual, the first holding the attention) and the gemma "
        "library's Block. Reap the block's own parts by their paths instead (names=None)."
    )


def transformer_lens_inputs() -> ValueError:
    return ValueError(
        "instrument(names='transformer_lens') sows TransformerLens's names only, so inputs=True "
        "has nothing to add: each block's input is blocks.{i}.hook_resid_pre. Pass one of them, "
        "or names=None for the parts' inputs by their paths."
    )


def transformer_lens_two_attentions(block: str, attentions: list[str]) -> ValueError:
    return ValueError(
        f"instrument(names='transformer_lens'): the block at {block!r} holds "
        f"{len(attentions)} attention modules ({', '.join(map(repr, attentions))}), as a "
        "decoder's self- and cross-attention do; TransformerLens's block names describe one. "
        "Reap the block's parts by their paths instead (names=None)."
    )


def transformer_lens_cross_attention(block: str, attention: str) -> ValueError:
    return ValueError(
        f"instrument(names='transformer_lens'): the attention at {attention!r} in the block at "
        f"{block!r} is given keys or values other than its queries (cross-attention), which "
        "TransformerLens's block names do not describe. Reap the block's parts by their paths "
        "instead (names=None)."
    )


def attention_output_not_added(block: str, part: str) -> ValueError:
    return ValueError(
        f"instrument(names='transformer_lens'): the block at {block!r} passes its attention's "
        f"output to {part!r} before adding it to the stream (a norm after attention, as Gemma 2's), "
        "so the attention's output is not what TransformerLens's hook_attn_out and hook_resid_mid "
        "mean. Reap the block's parts by their paths instead (names=None)."
    )


def parallel_block(block: str, part: str) -> ValueError:
    return ValueError(
        f"instrument(names='transformer_lens'): after its attention, the block at {block!r} "
        f"gives {part!r} the block's input (or what the attention took), so its MLP does not read "
        "the stream after attention: a parallel block has no hook_resid_mid. Leave it out, e.g. "
        "where=lambda name: not name.endswith('hook_resid_mid')."
    )


def residual_shapes(name: str, resid_pre: Any, attn_out: Any) -> ValueError:
    return ValueError(
        f"instrument(names='transformer_lens'): {name} is the block's input plus its attention's "
        f"output, but they have shapes {getattr(resid_pre, 'shape', None)} and "
        f"{getattr(attn_out, 'shape', None)}, so this block does not add its attention's output to "
        "its input. Leave the name out with `where`, or reap the block's parts by their paths."
    )


def penzai_attention_axes(path: str, hook: str, named_shape: Any) -> ValueError:
    return ValueError(
        f"instrument(attention=True): the Penzai attention at {path!r} gives {hook} the named axes "
        f"{dict(named_shape)}; its hooks need 'seq', 'kv_seq' (pattern) or 'projection' (q, k, v, z) "
        "and a head axis ('heads', 'head_groups', 'query_heads_per_group', 'query_heads'). Name its "
        "axes so, or pass "
        "attention=False."
    )


def merged_head_axis(name: str, axis: Any, hook: str) -> ValueError:
    return ValueError(
        f"The sweep's axis={axis!r} on {name!r} indexes its last dimension, which holds every head's "
        f"features merged (heads x d_head), so it would sweep features, not heads. Sweep {hook!r} "
        f"(shaped [..., seq, heads, d_head], from instrument(model, attention=True)) with axis=(-2, -3) "
        "for every (head, position) pair."
    )


def d_head_axis(name: str, axes: Any) -> ValueError:
    return ValueError(
        f"The sweep's axis={axes!r} on {name!r} indexes its last dimension, d_head (features within "
        "a head), not heads or positions. Its layout is [..., seq, heads, d_head]: use axis=(-2, -3) "
        "for every (head, position) pair, or axis=-2 for heads."
    )


def plot_attention_shape(shape: Any) -> ValueError:
    return ValueError(
        f"plot_attention needs a pattern of shape [heads, query, key], got shape {shape}. "
        "Index the example to draw, e.g. plot_attention(reaped['pattern'][0][i])."
    )


def plot_attention_tokens(n_tokens: int, n_keys: int) -> ValueError:
    return ValueError(
        f"plot_attention: {n_tokens} tokens for {n_keys} key positions; pass one token per key "
        "position, or tokens=None."
    )


class RecompileWarning(UserWarning):
    """harvest keeps tracing and compiling the same function: each call pays for it."""


def recompiles(where: str, n: int) -> RecompileWarning:
    return RecompileWarning(
        f"harvest has traced and compiled {where} {n} times for the same shapes. A static "
        "argument changes between calls (a new Python number or other non-array argument: pass it "
        "as an array to trace it), or a fresh function each call (harvest it once, outside the "
        "loop), as jax.jit would retrace. Shown once per function; harvest.config.update("
        "'warn_after', n) sets when."
    )


def unhashable_argument(where: str, leaf: Any) -> RecompileWarning:
    return RecompileWarning(
        f"harvest traces and compiles {where} at every call: a non-array argument of type "
        f"{type(leaf).__name__} cannot be hashed, so jax.jit cannot keep a program for it (it "
        "would refuse it as a static argument). Make it hashable (a tuple instead of a list, a "
        "frozen dataclass) or pass its numbers as arrays. Shown once per function."
    )


def bad_config_name(name: Any, known: list[str]) -> ValueError:
    return ValueError(f"harvest.config.update({name!r}, ...): no such setting; there are {known}.")


def bad_config_value(name: str, value: Any) -> TypeError:
    return TypeError(f"harvest.config.update({name!r}, {value!r}): expected a positive int.")


def ppl_enumeration_unfactored(
    name: str, batch: tuple[int, ...], varying: list[tuple[str, tuple[int, ...]]]
) -> ValueError:
    which = ", ".join(f"{n!r} (shape {shape})" for n, shape in varying)
    return ValueError(
        f"cannot enumerate {name!r} element by element: its value changes the density of "
        f"{which}, which is not shaped like the draw's batch {batch}, so the sum over "
        f"{name!r} does not factor by element. Give that distribution the batch shape {batch} "
        "(e.g. tfd.Normal(loc, scale) rather than tfd.Independent(...)), or marginalise by hand."
    )


def index_after_while_in(site: Any, where: str) -> ValueError:
    return ValueError(
        f"The plant for the sow site {site} is a callable fn(old, i), and the site is inside a "
        f"while_loop within a {where}, so how many occurrences come before a later one is known "
        "only per run of that while_loop, which harvest cannot count there. Plant a callable "
        "old -> new (no index), or move the while_loop out of the " + where + "."
    )


def plant_differentiated_in_custom_vjp(site: Any, fn_name: str, reason: str) -> ValueError:
    where = f"the custom_vjp function {fn_name!r}" if fn_name else "a custom_vjp function"
    what, why, fix = {
        "occurrence": (
            "a plant per occurrence (rows, entries, or a callable taking the index)",
            "its backward rule re-runs the body as often as it needs (not the body's occurrences)",
            "Plant one value, or a callable old -> new, used at every occurrence",
        ),
        "value": (
            "a planted value that is itself differentiated",
            "its backward rule, re-run with the plant in place, gives no derivative for it",
            "Plant a value that does not depend on what you differentiate (jax.lax.stop_gradient)",
        ),
        "rule": (
            "a value planted",
            "its backward rule does not re-run the planted sow (it was written for the "
            "unplanted function)",
            "Write the planted computation into the function the rule differentiates",
        ),
    }[reason]
    return ValueError(
        f"Cannot differentiate through {where} with {what} at {site} inside it: its body holds "
        f"a while_loop, which autodiff cannot reverse, and {why}, so the gradient would be "
        f"silently wrong. {fix}, or plant outside the custom_vjp function."
    )


def sown_in_loop_in_batched_lax_map(tag: Any, scope: tuple[str, ...], name: str) -> ValueError:
    return ValueError(
        f"The sow site tag={tag!r}, name={'.'.join((*scope, name))!r} runs in a loop (scan, "
        "while_loop, fori_loop) inside lax.map(f, xs, batch_size=b), which runs each step of "
        "that loop for the whole batch at once, so its occurrences cannot be reaped or planted "
        "in element order, as lax.map(f, xs) gives them. Use lax.map without batch_size (or "
        "jax.vmap) around this function while you harvest it."
    )


def sown_twice_per_element_in_batched_lax_map(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} (mode {site.mode.name!r}) is sown more than once per element of "
        "xs inside lax.map(f, xs, batch_size=b). JAX runs f vmapped over a batch, so each "
        "sow fires for the whole batch before the next: its rows would "
        "come sow by sow, not element by element as lax.map(f, xs) gives them. Harvest "
        "lax.map(f, xs) without batch_size, or give each sow its own name."
    )


def sown_in_batched_lax_map(site: Any, action: str) -> ValueError:
    what = {
        "reap": "reaping it would give batch-shaped occurrences",
        "plant": "a plant other than one value of the element's shape (rows, or a callable) "
        "would meet batch-shaped occurrences",
    }[action]
    return ValueError(
        f"The sow site {site} runs inside lax.map(f, xs, batch_size=b), which JAX runs as a "
        f"scan over vmapped batches of b elements plus a shorter remainder, so {what} "
        "([b, ...] per batch) that depend on batch_size, not one per element of xs. "
        + (
            "Sow it with mode='append' (harvest sows those once per element, the rows "
            "lax.map(f, xs) gives), harvest lax.map(f, xs) without batch_size, or "
            "jax.vmap(f)(xs); planting one value for every element works."
            if site.mode.entries
            else "Harvest lax.map(f, xs) without batch_size, or jax.vmap(f)(xs); planting one "
            "value for every element works."
        )
    )


def module_output_not_an_array(tag: str, path: str, part: str, value: Any) -> TypeError:
    return TypeError(
        f"instrument(tag={tag!r}): the module at {path!r} returned {part} of type "
        f"{type(value).__name__}, which is not an array, so it cannot be a site. Leave that "
        f"module out with `where` (e.g. where=lambda name: name != {path!r})."
    )


# -- interventions that do not fit the value they are planted on ---------------


class InterventionMisfit(ValueError):
    """An intervention's array does not fit the sown value it was given; the
    walk, which knows the site, re-raises it naming that site."""


def intervention_misfit(
    what: str, shape: tuple[int, ...], old: Any, whole: bool
) -> InterventionMisfit:
    target = tuple(jnp.shape(old))
    got = f"{jnp.result_type(old)}{list(target)}"
    if whole:
        fix = f"Pass a value of the site's shape, {got}, as reap returns it"
    else:
        last = f" (a vector of shape {target[-1:]!r} runs along its last axis)" if target else ""
        fix = f"Pass an array that broadcasts to {got}{last}"
    return InterventionMisfit(
        f"{what} has shape {shape!r}, which does not broadcast to the sown value, {got}. "
        f"{fix}; `sites(f, *args)` lists each site's shape."
    )


def intervention_on_structure(
    what: str, shape: tuple[int, ...], old: Any, leaves: list[Any]
) -> InterventionMisfit:
    parts = ", ".join(f"{jnp.result_type(x)}{list(jnp.shape(x))}" for x in leaves)
    kind = type(old).__name__
    # add_vector(v)'s own form; any other intervention is applied to the part.
    change = "{} + v" if what.startswith("add_vector") else "intervention({})"
    example = "lambda out: ..."
    if isinstance(old, tuple) and len(old) > 1:  # the part the array fits, else the last
        fits = [
            i for i, x in enumerate(old) if hasattr(x, "shape") and _broadcasts(shape, x.shape)
        ] or [len(old) - 1]
        each = (
            change.format(f"out[{i}]") if i == fits[-1] else f"out[{i}]" for i in range(len(old))
        )
        example = f"lambda out: ({', '.join(each)})"
    return InterventionMisfit(
        f"{what} is one array, of shape {tuple(shape)!r}, but the sown value is a {kind} of "
        f"{len(leaves)} arrays ({parts}), and which of them it is for is not said. Plant a "
        f"callable that changes the part you mean, e.g. {{{_SITE}: {example}}}."
    )


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return jnp.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


_SITE = "<site>"  # in an InterventionMisfit: where the site's name goes once it is known


def intervention_misfit_at(site: Any, err: Exception) -> ValueError:
    message = str(err).replace(_SITE, repr(".".join(site.path)))
    return ValueError(f"The intervention planted at the sow site {site} does not fit it: {message}")


def sweep_tag_absent(caller: str, tag: Any, tags: list[str]) -> ValueError:
    shown = ", ".join(repr(t) for t in tags[:8]) + (", ..." if len(tags) > 8 else "")
    return ValueError(
        f"{caller}(tag={tag!r}): the function has no sow of tag {tag!r}, but it has sows of the "
        f"tags {shown}. Pass one of those as tag= (instrument's sites are tag='modules'), the "
        "tag clean was reaped with."
    )


def penzai_layer_stack(path: str, inside: list[str]) -> NotImplementedError:
    what = f"sites inside it ({', '.join(map(repr, inside))}, ...)" if inside else "op sites"
    return NotImplementedError(
        f"instrument: the Penzai model runs a pz.nn.LayerStack at {path!r} (use_layer_stack=True), "
        f"whose layers run as unbound copies that harvest cannot name yet, so {what} would be "
        f"misnamed or missed. Build the model without a layer stack (use_layer_stack=False), or "
        f"select sites outside it, e.g. where=lambda name: not name.startswith({path + '.'!r})."
    )


def view_needs_callable(f: Any) -> TypeError:
    return TypeError(f"view(f, *args) needs a callable f, got {type(f).__name__}.")


def view_values_not_a_dict(values: Any) -> TypeError:
    return TypeError(f"view: values must be a dict, as reap returns it, got {values!r}.")


def view_values_unmatched(missing: list[str], names: list[str], tag: Any) -> ValueError:
    of = "" if tag is None else f" of tag {tag!r}"
    return ValueError(
        f"view: values names {', '.join(map(repr, missing))}, but the program has no such sow "
        f"site{of}. Sites{of}: {_listed(names, missing[0])}. Pass what reap returned for this "
        "function and these arguments" + ("." if tag is None else ", reaped with this tag.")
    )


def view_values_ambiguous(name: str, tags: list[str]) -> ValueError:
    return ValueError(
        f"view: the name {name!r} in values is sown with the tags {', '.join(map(repr, tags))}, "
        "so which sites its value belongs to is unclear. Pass the tag values were reaped with "
        "as view(..., tag=...)."
    )
