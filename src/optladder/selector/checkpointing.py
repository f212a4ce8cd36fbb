"""Checkpoint conversion: the optimizer's ``state_dict`` in one layout, and loading one
saved from any rung.

:func:`state_dict` lays out every group's state in torch's ``Optimizer.state_dict``
layout, each param's state in its rung's format as that rung's reference optimizer
saves it (:func:`checkpoint_states`); :func:`load` checks a saved state dict against the
params, converts each param's state into the format of the rung its group is on, and
replaces the optimizer's state only when every param converted. Before a load, the groups
that follow the decision move to the rung the checkpoint had escalated to, when the user
allows it (:func:`checkpoint_rung`, :func:`checkpoint_reason`).

These functions carry out the checkpoint methods of
:class:`~optladder.selector.optimizer.LadderOptimizer` (``state_dict``,
``load_state_dict``, ``follow_checkpoint``), which run torch's hooks around them; their
docstrings there are the contract.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from optladder.errors import OptladderWarning, user_stacklevel
from optladder.optimizers.adamw import saved_group_keys
from optladder.optimizers.build import ENGINE_KEYS
from optladder.optimizers.checkpoint import (
    PHASE_KEY,
    ROW_ABSMAX_KEYS,
    from_checkpoint_form,
    to_checkpoint_form,
    zero_state,
)
from optladder.optimizers.migrate import (
    BNB_WRAPPED_KEY,
    BNB_WRAPPED_KEYS,
    StateTarget,
    check_param_state,
    check_step_range,
    convert_param_state,
    read_step,
    state_target,
    unwrap_bnb_state,
    wrap_bnb_state,
)
from optladder.optimizers.transaction import deferred_interrupts
from optladder.rungs import GROUP_PIN_ORIGIN, ORIGIN_KEY, REASON_KEY, RUNG_KEY, RUNGS, Rung
from optladder.selector.checks import check_checkpoint_groups, decoupled_mode
from optladder.selector.escalation import move_refused, restore_groups, set_formats, switch
from optladder.sharding import is_dtensor, local_tensor
from optladder.units import format_bytes

if TYPE_CHECKING:
    from optladder.selector.optimizer import LadderOptimizer

logger = logging.getLogger("optladder")

__all__ = [
    "checkpoint_reason",
    "checkpoint_rung",
    "checkpoint_states",
    "follow_checkpoint",
    "load",
    "state_dict",
]

_LADDER_KEYS = (RUNG_KEY, ORIGIN_KEY, REASON_KEY)


def state_dict(opt: LadderOptimizer) -> dict[str, Any]:
    """``opt``'s state dict in torch's layout, each param's state in its checkpoint form
    (see :meth:`LadderOptimizer.state_dict`; the hooks run there).

    Raises:
        ValueError: for 8-bit state of a DTensor param not sharded on dim 0.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    out: dict[str, Any] = {
        "state": {index[id(p)]: st for p, st in opt.state.items() if id(p) in index},
        "param_groups": [  # an 8bit group with AdamW8bit's own keys (saved_group_keys)
            saved_group_keys(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [index[id(p)] for p in g["params"]],
                }
            )
            for g in opt.param_groups
        ],
    }
    out["state"] = checkpoint_states(opt, out["state"])
    return out


def checkpoint_states(opt: LadderOptimizer, states: dict[Any, Any]) -> dict[Any, Any]:
    """Each param's saved state in its checkpoint form
    (:func:`optladder.optimizers.checkpoint.to_checkpoint_form`: sharded 8-bit state
    as DTensors; a plain param's 8-bit state wrapped as bitsandbytes wraps it), and,
    once any param has state, a zero state with ``step`` 0 for each trainable param
    that has none yet (it never had a grad), so every checkpoint of the run has the
    same keys."""
    if not states:
        return states
    out: dict[Any, Any] = {}
    index = 0
    for group in opt.param_groups:
        for p in group["params"]:
            st = states.get(index)
            if not st and p.requires_grad:
                st = zero_state(state_target(opt, group, p), p)
            if st:
                form = to_checkpoint_form(st, p, f"param {index}")
                out[index] = form if is_dtensor(p) else wrap_bnb_state(form)
            index += 1
    return out


_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "state1", "state2", "absmax1", "absmax2")
"""The keys of a saved state whose values are moments or their block scales (the Adam
layout, bitsandbytes' flat one): all zero in a param that never stepped."""


def _refuse_unstepped_moments(state: dict[str, Any], where: str) -> None:
    """Raise if ``state`` (one param's saved state, ``step`` 0) holds a non-zero moment.

    ``state_dict()`` saves ``step`` 0 with zero moments for a param that never stepped,
    and such a state loads as no state. A non-zero (or NaN) value there, in ``exp_avg``,
    ``exp_avg_sq``, bitsandbytes' float32 ``state1``/``state2`` or a block scale
    ``absmax1``/``absmax2`` (8-bit codes hold a non-zero value only where their block's
    scale is non-zero), would be lost silently; it is refused instead. uint8 codes are
    not read.

    Raises:
        ValueError: naming the param and the key.
    """
    flat = unwrap_bnb_state(state)
    for name in _MOMENT_KEYS:
        value = flat.get(name)
        if not isinstance(value, torch.Tensor) or value.dtype == torch.uint8:
            continue
        if bool(local_tensor(value).ne(0).any()):
            raise ValueError(
                f"{where} of the state_dict has step 0 but a non-zero {name}: a param that "
                "never stepped holds zero moments, and its state loads as none, so these "
                "values would be lost. Set 'step' to the number of steps the moments have "
                "seen, or drop the param's state"
            )


def load(opt: LadderOptimizer, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into ``opt``: every check and conversion first, then the
    commit, which allocates nothing (see :meth:`LadderOptimizer.load_state_dict`; the
    hooks run there). On failure ``opt`` is left unchanged.

    Raises:
        ValueError: the checkpoint does not fit the params, or is malformed.
    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(groups, list) or not isinstance(saved_state, dict):
        raise ValueError("state_dict must have a 'param_groups' list and a 'state' dict")
    check_checkpoint_groups(groups, decoupled_mode(opt))
    live_groups = opt.param_groups
    if len(groups) != len(live_groups):
        raise ValueError(
            f"the state_dict has {len(groups)} param groups; this optimizer has {len(live_groups)}"
        )
    pairs: list[tuple[Any, torch.Tensor]] = []
    listed_in: dict[Any, int] = {}
    for gi, (saved, live) in enumerate(zip(groups, live_groups)):
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(
                f"param group {gi} of the state_dict has {len(saved['params'])} params; "
                f"this optimizer's has {len(live['params'])}"
            )
        for key in saved["params"]:
            if key in listed_in:  # its state would go to two live params
                raise ValueError(
                    f"param group {gi} of the state_dict lists param {key!r}, which param "
                    f"group {listed_in[key]} lists too; state_dict() lists each param once"
                )
            listed_in[key] = gi
        pairs += zip(saved["params"], live["params"])
    unknown = saved_state.keys() - {key for key, _ in pairs}
    if unknown:
        hint = (
            " (torch.distributed.checkpoint puts the non-tensor values of an int-keyed "
            "state, such as bitsandbytes' step, under string keys: save "
            "get_optimizer_state_dict(model, opt) instead of opt.state_dict())"
            if all(isinstance(k, str) and k.isdigit() for k in unknown)
            else ""
        )
        raise ValueError(
            f"the state_dict's state has entries for no param of its param groups: "
            f"{sorted(map(repr, unknown))[:5]}{hint}"
        )
    loaded: dict[Any, dict[str, Any]] = {}  # key -> state in a layout convert reads
    live_groups_of = [g for g in opt.param_groups for _ in g["params"]]
    for pi, (key, p) in enumerate(pairs):
        if key not in saved_state:
            continue
        st = saved_state[key]
        _check_containers(st, f"param {pi}")
        st = _detached(st)
        group = live_groups_of[pi]
        st = _one_form(st, _live_form(state_target(opt, group, p), p), f"param {pi}")
        if st:
            st = from_checkpoint_form(st, p, f"param {pi}")
            check_param_state(st, p, f"param {pi}")
            if read_step(st) > 0:
                loaded[key] = st
            else:  # step 0: saved for a param that never stepped, so its moments are zero
                _refuse_unstepped_moments(st, f"param {pi}")
    # the groups' values, copied as torch copies them (a tensor lr of the checkpoint's
    # would be shared with every optimizer loaded from it, and a scheduler sets it in place)
    options = [
        {
            name: copy.deepcopy(value)
            for name, value in saved.items()
            if name != "params" and name not in ENGINE_KEYS and name not in _LADDER_KEYS
        }
        for saved in groups
    ]
    move_to = checkpoint_rung(opt, groups)
    saved_groups = [dict(g) for g in live_groups]
    try:
        if move_to is not None:  # the live state is replaced below: nothing to migrate
            set_formats(opt, opt._following_groups(), move_to)
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        group_of_param = [g for g in live_groups for _ in g["params"]]
        for pi, ((key, p), group) in enumerate(zip(pairs, group_of_param)):
            saved_param_state = loaded.get(key)
            if saved_param_state:
                flat = unwrap_bnb_state(saved_param_state)
                if "step" in flat:
                    where = f"param {pi} of the state_dict"
                    check_step_range(read_step(flat), opt, p, where, group)
                target = state_target(opt, group, p)
                new_state[p] = convert_param_state(saved_param_state, p, target, copy=True)
                _refuse_overflow(new_state[p], flat, f"param {pi} of the state_dict")
    except BaseException:
        restore_groups(live_groups, saved_groups)
        raise
    # Commit: nothing below allocates; Ctrl-C waits until it is whole.
    with deferred_interrupts():
        for values, live in zip(options, live_groups):
            live.update(values)
        opt._memo = None  # it holds the state dicts being replaced
        opt.release_tables()  # its kernel tables point into the state being replaced
        opt.state.clear()
        opt.state.update(new_state)
        if move_to is not None:
            switch(opt, move_to, checkpoint_reason(opt, move_to), "checkpoint")


def _check_containers(state: object, where: str) -> None:
    """Refuse one param's saved state whose containers are not the layout's: the state
    itself not a dict (``None`` or ``[]`` had loaded as no state, the moments lost; a
    tensor failed on its truth value), or bitsandbytes' wrapped tensors not under a dict.

    Args:
        state: the saved state of one param (``state_dict["state"][key]``).
        where: names the param in messages, e.g. ``"param 3"``.

    Raises:
        ValueError: naming the param, the container and the type found.
    """
    if not isinstance(state, dict):
        raise ValueError(
            f"{where}: its state must be a dict (an empty one for no state), got "
            f"{type(state).__name__}"
        )
    wrapped = state.get(BNB_WRAPPED_KEY, {})
    if not isinstance(wrapped, dict):
        raise ValueError(
            f"{where}: its state's {BNB_WRAPPED_KEY!r} must be a dict of tensors, as "
            f"bitsandbytes' state_dict() wraps them, got {type(wrapped).__name__}"
        )


def _detached(state: dict[Any, Any]) -> dict[Any, Any]:
    """One param's saved state (a dict, bitsandbytes' wrapped tensors under a dict) with
    every tensor detached from autograd: views of the same memory, so nothing is copied
    here. Moments saved with ``requires_grad=True`` were otherwise copied with their
    history into the live state, which then held tensors that are not graph leaves (and
    that ``copy.deepcopy`` refuses)."""
    return {
        k: v.detach() if isinstance(v, torch.Tensor) else _detached(v) if isinstance(v, dict) else v
        for k, v in state.items()
    }


_ADAM_KEYS = frozenset({"exp_avg", "exp_avg_sq"})
_ROW_KEYS = frozenset({PHASE_KEY, *ROW_ABSMAX_KEYS})
_FORM_KEYS = {
    "adam": _ADAM_KEYS,
    "rows": _ROW_KEYS | {"state1", "state2", "qmap1", "qmap2"},
    "flat": BNB_WRAPPED_KEYS,
    "wrapped": frozenset({BNB_WRAPPED_KEY}),
}
"""The top-level keys of each form one param's state is saved in: the Adam layout,
the row form of sharded 8-bit state, bitsandbytes' layout (flat, as a DTensor param's
float32 state and old checkpoints save it), and the same wrapped as bitsandbytes'
``state_dict()`` wraps it."""
_FORM_NAMES = {
    "adam": "the Adam layout",
    "rows": "the row form of sharded 8-bit state",
    "flat": "bitsandbytes' layout",
    "wrapped": f"bitsandbytes' layout under {BNB_WRAPPED_KEY!r}",
}


def _live_form(target: StateTarget, p: torch.Tensor) -> str:
    """The form :func:`state_dict` saves ``p``'s state in, when it is laid out as
    ``target``."""
    if target.layout == "adam":
        return "adam"
    if is_dtensor(p):
        return "rows" if target.quantize else "flat"
    return "wrapped"


def _forms(state: dict[Any, Any]) -> list[str]:
    """The forms whose keys ``state`` holds at its top level (the row form's codes count
    for it alone; bitsandbytes' flat block scales beside them are a second form)."""
    top = set(state)
    rows = bool(top & _ROW_KEYS)
    found = []
    if top & _ADAM_KEYS:
        found.append("adam")
    if rows:
        found.append("rows")
    if top & ({"absmax1", "absmax2"} if rows else BNB_WRAPPED_KEYS):
        found.append("flat")
    if state.get(BNB_WRAPPED_KEY):
        found.append("wrapped")
    return found


def _one_form(state: dict[Any, Any], live: str, where: str) -> dict[Any, Any]:
    """One param's saved state in one form.

    No optimizer saves two forms (``state_dict()`` writes one per param, as torch and
    bitsandbytes do), but torch's ``set_optimizer_state_dict(..., full_state_dict=True)``
    loads a checkpoint into the live optimizer's own state dict (its template) and keeps
    the template's keys the checkpoint lacks: a checkpoint of another form arrives beside
    this param's live form. That form's keys are then the template's and are dropped.
    (The row form was read and the rest ignored: an unsharded 8bit run's full state dict
    loaded into FSDP2 as the template's zero moments, with no error.)

    Args:
        state: the param's saved state (a dict).
        live: the form this param's state is saved in now (:func:`_live_form`).
        where: names the param in messages, e.g. ``"param 3"``.

    Returns:
        ``state`` itself when it holds one form, else a new dict without the live form's
        keys.

    Raises:
        ValueError: two forms of which neither is the live one, or whose keys overlap
            (the row form and bitsandbytes' flat layout share the codes' names), or
            more than two; naming the forms and their keys.
    """
    found = _forms(state)
    if len(found) < 2:
        return state
    if len(found) == 2 and live in found and {"rows", "flat"} != set(found):
        drop = _FORM_KEYS[live]
        return {k: v for k, v in state.items() if k not in drop}
    listed = "; ".join(
        f"{_FORM_NAMES[form]} ({', '.join(sorted(map(str, set(state) & _FORM_KEYS[form])))})"
        for form in found
    )
    raise ValueError(
        f"{where}: its state holds the keys of {len(found)} forms: {listed}, and which values "
        "are the checkpoint's cannot be told. One optimizer saves one form; torch's "
        "set_optimizer_state_dict with full_state_dict=True loads a checkpoint into this "
        f"optimizer's own state dict, which is in {_FORM_NAMES[live]} for this param, and "
        "keeps the keys the checkpoint lacks. Load it into an optimizer on the rung and "
        "sharding it was saved from, or save and load it with torch.distributed.checkpoint "
        "and optladder.DCPLoadPlanner, which loads any rung into any rung"
    )


def _refuse_overflow(converted: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """Refuse a param's converted state that holds a non-finite value. The saved values
    were checked finite (:func:`~optladder.optimizers.migrate.check_param_state`), so
    they were past the largest finite value of the dtype the rung keeps them in: float64
    moments past float32's, float32 ones past bfloat16's (3.3895e38), or 8-bit block
    scales (float32) of such moments.

    Args:
        converted: the param's state in its rung's layout.
        saved: the param's saved state (unwrapped), to name the moment and its largest
            magnitude.
        where: names the param in messages, e.g. ``"param 3 of the state_dict"``.

    Raises:
        ValueError: naming the saved moment, its largest magnitude, the dtype it is
            kept in and that dtype's largest finite value.
    """
    for name, t in converted.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        local = local_tensor(t)
        if bool(torch.isfinite(local).all()):
            continue
        second = name in ("exp_avg_sq", "state2", "absmax2")
        source = (
            ("state2" if second else "state1")
            if "state1" in saved
            else ("exp_avg_sq" if second else "exp_avg")
        )
        moment = saved.get(source)
        largest = (
            f"up to {float(local_tensor(moment).abs().max()):.4g} in magnitude"
            if isinstance(moment, torch.Tensor) and moment.is_floating_point()
            else "(decoded with its code book and block scales) past that dtype's range"
        )
        raise ValueError(
            f"{where}: {source} holds values {largest}; this param's rung keeps "
            f"them as {t.dtype} ({name}), whose largest finite value is "
            f"{torch.finfo(t.dtype).max:.4g}, so they would become infinite: allowed are "
            "values within that range"
        )


def checkpoint_rung(opt: LadderOptimizer, groups: list[dict[str, Any]]) -> Rung | None:
    """The rung to move to before loading a checkpoint with these param groups: the
    rung its decided groups (the first that does not pin its rung) had reached, when
    they had escalated (or followed a checkpoint), this optimizer's rung was not
    fixed or forced, and the user allows that rung; otherwise None."""
    first = next((g for g in groups if g.get(ORIGIN_KEY) != GROUP_PIN_ORIGIN), {})
    saved = next((r for r in RUNGS if first.get(RUNG_KEY) == r), None)
    if (
        saved is None
        or saved == opt.rung
        or first.get(ORIGIN_KEY) not in ("escalated", "checkpoint")
        or opt._decision.origin not in ("policy", "escalated", "checkpoint")
    ):
        return None
    return saved if move_refused(opt._decision, saved) is None else None


def follow_checkpoint(opt: LadderOptimizer, param_groups: Sequence[dict[str, Any]]) -> Rung | None:
    """Move ``opt`` to the rung a checkpoint with these ``param_groups`` had escalated to,
    by the rule of :func:`checkpoint_rung` (see :meth:`LadderOptimizer.follow_checkpoint`).

    Returns:
        The rung moved to, or None when the optimizer stays.

    Raises:
        ValueError: ``param_groups`` is not one dict per group of ``opt``, or a group is
            malformed; nothing moves then.
    """
    if not isinstance(param_groups, Sequence) or not all(isinstance(g, dict) for g in param_groups):
        raise ValueError(
            f"param_groups must be a list of dicts (a state_dict's 'param_groups'), got "
            f"{type(param_groups).__name__}"
        )
    if len(param_groups) != len(opt.param_groups):
        raise ValueError(
            f"the checkpoint has {len(param_groups)} param groups; this optimizer has "
            f"{len(opt.param_groups)}"
        )
    check_checkpoint_groups(list(param_groups), decoupled_mode(opt), need_params=False)
    target = checkpoint_rung(opt, list(param_groups))
    if target is not None:
        opt.migrate_to(target, checkpoint_reason(opt, target), origin="checkpoint")
    return target


def checkpoint_reason(opt: LadderOptimizer, rung: Rung) -> str:
    """Why the optimizer moves to a checkpoint's ``rung``, for the decision's reasons;
    warns (``UserWarning`` and a log line) when the local policy would not pick that
    rung: it is wider than the current one or over the memory gate here."""
    reason = f"the checkpoint had escalated to {rung}"
    d = opt._decision
    state, gate = d.state_bytes[rung], d.budget_bytes
    if RUNGS.index(rung) < RUNGS.index(d.rung) or state > gate:
        reason += (
            f" (the local policy chose {d.rung}: {rung} state {state:,} bytes "
            f"({format_bytes(state)}) against a gate of {gate:,} bytes "
            f"({format_bytes(gate)}){', over it' if state > gate else ''}; moved as the "
            "checkpoint asks. To keep the local rung, build the optimizer with rung=, "
            "which fixes it)"
        )
        warnings.warn(
            f"optladder: loading moves the optimizer to {rung}: {reason}",
            OptladderWarning,
            stacklevel=user_stacklevel(),
        )
        logger.warning("optladder: %s", reason)
    return reason
