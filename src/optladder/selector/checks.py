"""Checks of param groups shared by ``choose_optimizer``, ``add_param_group`` and
``load_state_dict``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from optladder.columns import ParamColumns, plain_types
from optladder.dtype_names import dtype_name
from optladder.optimizers.adamw import validate_group_hyperparams
from optladder.optimizers.build import KERNEL_KEYS
from optladder.optimizers.migrate import foreign_group_reason
from optladder.policies.decision import Decision, allowed_rungs
from optladder.policies.footprint import normalize_param_groups
from optladder.rungs import (
    PARAM_DTYPES,
    RUNG_ACCEPTS,
    Rung,
    group_pin,
    param_refusal,
)
from optladder.selector.overlap import first_shared_memory, self_overlaps
from optladder.sharding import is_dtensor, local_tensor


def _rungs_of(dtype: str) -> str:
    rungs = [rung for rung, accepts in RUNG_ACCEPTS.items() if dtype in accepts.dtypes]
    return " and ".join(rungs)


_PARTIAL_DTYPES = ", ".join(
    f"{dtype} on {_rungs_of(dtype)} only"
    for dtype in PARAM_DTYPES
    if not all(dtype in accepts.dtypes for accepts in RUNG_ACCEPTS.values())
)
"""The dtypes some rungs refuse, and the rungs that take them, for the message of a
param no rung steps (from :data:`optladder.rungs.RUNG_ACCEPTS`)."""


def check_group_options(group: Mapping[str, Any]) -> None:
    """Refuse per-group options that no rung keeps (instead of silently dropping them),
    and an out-of-range bf16 seed or a ``rounding`` / ``param_rounding`` mode other than
    exactly ``"stochastic"`` or ``"nearest"``; see
    :func:`optladder.optimizers.adamw.validate_group_hyperparams`, which also runs
    before every step.

    Raises:
        ValueError: naming the option, its value and what is allowed.
    """
    validate_group_hyperparams(group)


def check_max_retries(max_retries: object) -> None:
    """Raise unless ``max_retries`` is an integer ``>= 0`` (a bool is not a count).

    Raises:
        ValueError: naming ``max_retries``, its value and what is allowed.
    """
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")


def check_param_collections(model_or_params: object) -> object:
    """Refuse params given in a ``set`` (torch refuses them too: a set has no order, so
    param order, and with it checkpoints, would change between runs), at the top or as
    a group's ``"params"``, however the groups come (a list, a generator, a dict's
    values).

    Returns:
        ``model_or_params``, with an iterable other than a list or tuple (a generator,
        which can be read once) read into a list: the caller normalizes what was
        checked.

    Raises:
        TypeError: naming where the set was found.
    """
    advice = "a set has no order, so checkpoints would not match between runs; pass a list"
    if isinstance(model_or_params, set | frozenset):
        raise TypeError(f"model_or_params is a set; {advice}")
    if isinstance(model_or_params, Iterable) and not isinstance(
        model_or_params, list | tuple | Mapping | str | bytes | torch.Tensor | torch.nn.Module
    ):
        model_or_params = list(model_or_params)
    if isinstance(model_or_params, list | tuple) and not plain_types(model_or_params):
        for gi, group in enumerate(model_or_params):
            if isinstance(group, Mapping) and isinstance(group.get("params"), set | frozenset):
                raise TypeError(f"param group {gi}['params'] is a set; {advice}")
    return model_or_params


def check_new_group(param_group: object) -> dict[str, Any]:
    """Check the argument of ``add_param_group`` as torch does, and return a new group
    dict whose ``"params"`` is a list of tensors.

    ``(name, param)`` pairs (``named_parameters()``) become ``"params"`` and
    ``"param_names"``, as torch keeps them. torch's kernel flags
    (:data:`~optladder.optimizers.build.KERNEL_KEYS`: ``fused``, ``foreach``,
    ``capturable``, as a copy of another optimizer's group holds them) are left out:
    the group takes its engine's, as groups given at construction do.

    Raises:
        TypeError: ``param_group`` is not a dict, or its ``"params"`` is a set.
        ValueError: ``"params"`` is missing, empty, or holds something other than tensors.
    """
    if not isinstance(param_group, Mapping):
        raise TypeError(
            f"param_group must be a dict with a 'params' entry (as torch's add_param_group "
            f"takes), got {type(param_group).__name__}; wrap it: {{'params': [...]}}"
        )
    group = {k: v for k, v in param_group.items() if k not in KERNEL_KEYS}
    if "params" not in group:
        keys = ", ".join(map(repr, group)) or "no keys"
        raise ValueError(
            f"param_group is missing its 'params' key (it holds {keys}); add_param_group takes a "
            "dict whose 'params' is a non-empty list of tensors: {'params': [...], ...}"
        )
    params = group.get("params")
    if isinstance(params, set | frozenset):
        raise TypeError(
            "param_group['params'] is a set; a set has no order, so checkpoints would not "
            "match between runs; pass a list"
        )
    params = [params] if isinstance(params, torch.Tensor) else list(params or [])
    group["params"] = params
    if any(isinstance(p, tuple) for p in params):  # (name, param) pairs, as torch takes
        group = normalize_param_groups([group])[0]
        params = group["params"]
    need = "param_group['params'] must be a non-empty list of tensors"
    if not params:
        raise ValueError(f"{need}; got an empty list")
    bad = next((i for i, p in enumerate(params) if not isinstance(p, torch.Tensor)), None)
    if bad is not None:
        raise ValueError(f"{need}; param {bad} is a {type(params[bad]).__name__}")
    return group


def check_groups(
    groups: list[dict[str, Any]],
    decoupled_weight_decay: bool,
    columns: ParamColumns | None = None,
) -> None:
    """Refuse what the rungs would silently get wrong: per-group options no rung keeps,
    out-of-range per-group hyperparameters, a pinned ``"rung"`` that is not a rung, a
    param listed twice or params that share memory (each would be stepped, so shared
    elements get more than one update: the same view, overlapping slices of one buffer,
    a tensor beside a reshaped view of it), expanded views (stride 0) and other views
    whose elements overlap, sparse params, non-leaf tensors and params of a dtype no rung
    steps (:data:`optladder.rungs.PARAM_DTYPES`: float8 and integer dtypes are refused).

    Args:
        groups: all param groups (for ``add_param_group``: the live ones plus the new).
        decoupled_weight_decay: the optimizer's mode; a group may not ask for the other.
        columns: the :class:`optladder.columns.ParamColumns` of ``groups``, to share the
            attributes read here with later checks; default read here.

    Raises:
        ValueError: naming the group or param, what was found and what is allowed.
    """
    for gi, group in enumerate(groups):
        if group.get("decoupled_weight_decay", decoupled_weight_decay) != decoupled_weight_decay:
            raise ValueError(
                f"param group {gi} sets decoupled_weight_decay={group['decoupled_weight_decay']!r}"
                f"; pass decoupled_weight_decay={group['decoupled_weight_decay']!r} to "
                "choose_optimizer instead (one mode per optimizer)"
            )
        group_pin(group, f"param group {gi}")
        try:
            check_group_options(group)
        except ValueError as exc:
            raise ValueError(f"param group {gi}: {exc}") from None
    if _params_pass(ParamColumns(groups) if columns is None else columns):
        return
    seen: dict[int, str] = {}
    named: list[tuple[torch.Tensor, str]] = []
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            where = f"param {pi} of group {gi}"
            if id(p) in seen:
                raise ValueError(f"{where} is the same tensor as {seen[id(p)]}; list it once")
            seen[id(p)] = where
            if p.layout != torch.strided:
                raise ValueError(
                    f"{where} is a sparse tensor (layout {p.layout}); the rungs step dense "
                    "params (torch.strided): optimize a dense tensor (.to_dense())"
                )
            if not (p.is_leaf or p.retains_grad):  # torch.optim's own rule
                raise ValueError(
                    f"{where} is not a leaf tensor (it is computed from others); optimize leaf "
                    "params such as nn.Parameter"
                )
            if dtype_name(p.dtype) not in PARAM_DTYPES:
                raise ValueError(
                    f"{where} has dtype {p.dtype}; the rungs step {', '.join(PARAM_DTYPES)} "
                    f"params ({_PARTIAL_DTYPES})"
                )
            if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
                raise ValueError(
                    f"{where} is an expanded view (a stride of 0): its elements share memory. "
                    "Optimize a real tensor (.contiguous())"
                )
            if self_overlaps(local_tensor(p)):
                raise ValueError(
                    f"{where} is a view whose elements overlap in memory (shape "
                    f"{tuple(p.shape)}, stride {p.stride()}); optimize a real tensor "
                    "(.contiguous())"
                )
            named.append((p, where))
    clash = first_shared_memory(named)
    if clash is not None:
        raise ValueError(clash)


def _params_pass(columns: ParamColumns) -> bool:
    """Whether the param checks of :func:`check_groups` pass for ``columns``' params,
    read in bulk (each param once, in one pass; the memory check sorts byte ranges,
    O(n log n)) for the common case: plain dense contiguous leaf tensors of allowed
    dtypes, each listed once, whose memory does not overlap. False means "check param by
    param" (which names what is wrong), not that a check failed.

    Sparse and mkldnn params fail :attr:`ParamColumns.disjoint` (they have no data
    pointer), so the layout needs no pass of its own; a dense tensor (contiguous, or a
    permutation of it: :func:`optladder.columns.dense`) has no stride of 0 over more
    than one element and no overlapping elements; disjoint non-empty byte ranges mean no
    param is listed twice.
    """
    return (
        columns.plain
        and columns.leaves
        and columns.dtype_names <= _PARAM_DTYPES
        and columns.disjoint
    )


_PARAM_DTYPES = frozenset(PARAM_DTYPES)


def decoupled_mode(engine: torch.optim.Optimizer) -> bool:
    """Whether ``engine`` decays the AdamW way (decoupled) rather than Adam's (coupled),
    as its defaults say (torch's Adam/AdamW and :class:`LadderAdamW` keep it there)."""
    return bool(engine.defaults.get("decoupled_weight_decay", True))


def check_checkpoint_groups(
    groups: list[Any], decoupled_weight_decay: bool, *, need_params: bool = True
) -> None:
    """Check a checkpoint's param groups before anything moves or loads: dicts with a
    ``"params"`` list, hyperparameters and options in range (``rounding`` exactly), a
    ``"rung"``/``"rung_origin"`` that is a rung/an origin, groups that another optimizer
    wrote (:func:`optladder.optimizers.migrate.foreign_group_reason`), and weight decay of
    the other mode: a coupled-decay checkpoint (torch ``Adam``, ``decoupled_weight_decay``
    False) with ``weight_decay > 0`` into a decoupled-decay optimizer (AdamW), or the
    reverse, which construction refuses too (with ``weight_decay == 0`` the two are the
    same update).

    Args:
        groups: the checkpoint's ``state_dict()["param_groups"]``.
        decoupled_weight_decay: the live optimizer's mode.
        need_params: whether each group must hold its ``"params"`` list (not for
            :meth:`LadderOptimizer.follow_checkpoint`, which reads the rung entries only).

    Raises:
        ValueError: ``"param group {i} of the state_dict: ..."``, naming the key, its
            value and what is allowed.
    """
    for gi, saved in enumerate(groups):
        where = f"param group {gi} of the state_dict"
        if not isinstance(saved, dict):
            raise ValueError(f"{where} must be a dict, got {type(saved).__name__}")
        if need_params and not isinstance(saved.get("params"), list):
            raise ValueError(f"{where} has no 'params' list")
        foreign = foreign_group_reason(saved)  # first: its options may be its own kind
        if foreign is not None:
            raise ValueError(f"{where}: {foreign}")
        try:
            validate_group_hyperparams(saved)
            group_pin(saved, "its")
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        mode = saved.get("decoupled_weight_decay", decoupled_weight_decay)
        if not isinstance(mode, bool):
            raise ValueError(
                f"{where}: 'decoupled_weight_decay' must be True or False, got {mode!r}"
            )
        if mode != decoupled_weight_decay and saved.get("weight_decay", 0.0):
            saved_kind, live_kind = ("AdamW", "Adam") if mode else ("Adam", "AdamW")
            raise ValueError(
                f"{where} decays the {saved_kind} way (decoupled_weight_decay={mode}, "
                f"weight_decay={saved['weight_decay']!r}) but this optimizer decays the "
                f"{live_kind} way; build it with decoupled_weight_decay={mode} to load "
                "this checkpoint"
            )


def check_pins(groups: list[dict[str, Any]], decision: Decision) -> None:
    """Refuse group pins the run cannot honour: a pinned rung the user disabled (``=0``)
    or the device cannot run, and pins that leave no trainable param to follow the
    decision (fix the whole optimizer's rung with ``rung=`` instead).

    Args:
        groups: all param groups.
        decision: the decision for the groups that follow it.

    Raises:
        ValueError: naming the group, its rung and why it cannot be used.
    """
    pins = [group_pin(group, f"param group {gi}") for gi, group in enumerate(groups)]
    if any(pins):  # (no pin, nothing to allow: the common case builds no rung table)
        # A pinned group's own params are checked against its rung where its engine is built.
        real = decision.footprint.model_copy(update={"has_complex": False, "dtypes": ()})
        allowed, excluded = allowed_rungs(real, decision.capabilities, decision.overrides)
        for gi, pin in enumerate(pins):
            if pin is not None and not allowed[pin]:
                raise ValueError(
                    f"param group {gi} pins the {pin} rung, which cannot be used: {excluded[pin]}"
                )
    following = (p for g, pin in zip(groups, pins) if pin is None for p in g["params"])
    if not any(p.requires_grad for p in following):
        raise ValueError(
            "every trainable param is in a param group that pins its rung "
            "(param_group['rung']), so none follows the decision; leave at least one group "
            "of trainable params unpinned, or fix the whole optimizer's rung with rung= / "
            "OPTLADDER_RUNG"
        )


def check_params_for_rung(
    params: list[torch.Tensor],
    rung: Rung,
    group: str = "the new group",
    columns: ParamColumns | None = None,
) -> None:
    """Refuse params ``rung`` cannot step exactly: the rules of
    :data:`optladder.rungs.RUNG_ACCEPTS` (complex params on fp32 only, float64 ones not
    on 8bit; DTensor params not on bf16). Every rung is a state format of one optimizer
    (:class:`LadderAdamW`), which takes what the rung takes: its fp32 format steps
    float64 and complex params on torch's kernels, its 8bit format steps a
    non-contiguous param through a contiguous copy.

    Args:
        params: the params of one group.
        rung: the rung they would join.
        group: names the group in messages, e.g. ``"group 2"``.
        columns: the :class:`optladder.columns.ParamColumns` of ``params`` (attributes
            read once for several checks); default read here.

    Raises:
        ValueError: naming the param, its dtype and what is allowed.
    """
    columns = ParamColumns.of(params) if columns is None else columns
    if columns.plain and _rung_takes(columns, rung):
        return  # read in bulk; else param by param, naming the first refused
    for pi, p in enumerate(params):
        name = f"param {pi} of {group}"
        refusal = param_refusal(rung, dtype_name(p.dtype), sharded=is_dtensor(p))
        if refusal is not None:
            kind = f"is complex ({p.dtype})" if p.is_complex() else f"has dtype {p.dtype}"
            raise ValueError(f"{name} {kind}; {refusal}")


def _rung_takes(columns: ParamColumns, rung: Rung) -> bool:
    """The rules of :func:`check_params_for_rung` for plain params, once per distinct
    dtype: True when all pass (False: check param by param)."""
    names = columns.dtype_names
    return all(param_refusal(rung, name, sharded=False) is None for name in names)


def refuse_meta_params(
    groups: list[dict[str, Any]], first_group: int = 0, columns: ParamColumns | None = None
) -> None:
    """Raise if a param is on the meta device: it holds no values, and materializing a
    meta model (``model.to_empty(device=...)``) makes new Parameters, so the optimizer's
    params would never move (torch's optimizers step them silently; we refuse at
    construction and in ``add_param_group``).
    To plan for a meta model, use :func:`optladder.measure_footprint` and
    :func:`optladder.decide` (or ``optladder plan``), which allocate nothing.

    Args:
        groups: the param groups to check.
        first_group: the place of ``groups[0]`` among the optimizer's groups (for
            messages).
        columns: the :class:`optladder.columns.ParamColumns` of ``groups``, if read
            already: plain params are off the meta device.

    Raises:
        ValueError: naming the first such param by group and place.
    """
    if columns is not None and columns.plain:
        return
    for gi, group in enumerate(groups, start=first_group):
        for pi, p in enumerate(group["params"]):
            if p.is_meta:
                raise ValueError(
                    f"param {pi} of group {gi} (shape {tuple(p.shape)}) is on the meta device: "
                    "it holds no values, and model.to_empty(device=...) makes new Parameters "
                    "that this optimizer does not hold, so its steps would update nothing. "
                    "Build the optimizer after materializing the model (choose_optimizer("
                    "model, ...) after model.to_empty(...) and the weights' init)"
                )
