"""Every error harvest raises about a sow or a plant: one function per message.

Each returns the exception for its caller to raise. Messages about a site name
it as `Site` prints itself: its tag, its name and the file:line of the user's
`sow` call. Each message says what was wrong and what to do instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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


def no_such_names(missing: list[str], names: list[str], what: str, tag: Any) -> str:
    """The message for names or patterns (`missing`) that match no site of `tag`."""
    listed = ", ".join(repr(n) for n in names) or "none"
    return (
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
    listed = ", ".join(repr(n) for n in names) or "none"
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
        "Give each occurrence its own name, or use mode 'collect', 'append' or 'clobber'."
    )


def different_shapes(site: Any, shapes: Iterable[Any]) -> ValueError:
    """The error for occurrences of one stacking name with different shapes."""
    return ValueError(
        f"The sow site {site} has mode {site.mode.label}, but its occurrences "
        f"have different shapes ({', '.join(sorted(map(shapes_str, shapes)))}), so they "
        "cannot be stacked into one array. Sow one shape per name (give each shape "
        "its own name), or use mode 'collect', which keeps each occurrence as it is."
    )


def carried_shape(site: Any, have: list[Any], targets: list[Any], where: str) -> ValueError:
    return ValueError(
        f"The sow site {site} has mode {site.mode.label} and was sown with shape "
        f"{shapes_str(have)} before this {where}, which sows it with shape "
        f"{shapes_str(targets)} and carries one value per name. Sow one shape per "
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


def stuck_in_batched_branch(site: Any) -> NotImplementedError:
    return NotImplementedError(
        f"The sow site {site} is inside a while_loop or a custom derivative (custom_jvp, custom_vjp) "
        "within a branch of a cond whose predicate vmap batches: every branch runs for every example, "
        "and harvest cannot carry the value out of that body to record the taken branch's. Harvest per "
        "example instead, jax.vmap(reap(f)), or move the sow out of that body."
    )


def sown_in_jvp_rule_and_body(site: Any, in_body: Iterable[str]) -> ValueError:
    return ValueError(
        f"The sow site {site} sits in the JVP rule of a custom_jvp function that also sows "
        f"{', '.join(map(repr, in_body))} in its body. Differentiated, JAX runs the rule and not "
        "the body, so these cannot both be reaped or planted. Sow in one of the two (a rule may "
        "call the function itself)."
    )


def shapes_str(shapes: Iterable[Any]) -> str:
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


def plant_count(site: Any, got: int, n: int, what: str) -> ValueError:
    shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in site.avals)
    return ValueError(
        f"The plant for the sow site {site} has {got} {what}, but reap returns "
        f"{n} {what} of {shapes} for it. Plant {n} {what}, as reap returns them, or a "
        "single value (or callable) used at every occurrence."
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


def strict_in_loop(site: Any, where: str) -> ValueError:
    every = " (with reap's max_steps=N)" if where == "while_loop" else ""
    return ValueError(
        f"The sow site {site} has mode 'strict' but sits inside a {where}, which "
        f"sows it once per iteration. Use mode 'collect' or 'append' to keep every "
        f"iteration{every}, 'clobber' for the last one, or sow_cond for a chosen one."
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
