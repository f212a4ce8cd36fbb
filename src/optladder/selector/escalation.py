"""The ladder: moving the param groups that follow the decision from one rung to another.

An escalation moves them one rung cheaper after an out-of-memory step
(:func:`escalate`); a checkpoint load may move them to the rung the checkpoint had
reached (:mod:`optladder.selector.checkpointing`). The fp32, bf16 and 8bit rungs are three state
formats of the one optimizer (:class:`~optladder.optimizers.adamw.LadderAdamW`'s): a move
(:func:`migrate`) flips the groups' ``"rung"`` and converts their state in place
(:func:`optladder.optimizers.migrate.migrate_states`: largest param first, one param's
new state at a time), building nothing. Each move records why in the decision
(:func:`switch`). The optimizer object, its group dicts and its ``state`` dict
stay the same. Groups that pin their rung never move. What the user's word forbids (a
rung fixed by ``rung=``, a disabled or unavailable rung) is :func:`move_refused`.

These functions carry out the moves of
:class:`~optladder.selector.optimizer.LadderOptimizer`, whose methods ``escalate`` and
``migrate_to`` call them (their docstrings there are the contract); they read and update
its decision, groups, state and escalations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optladder.oom import describe_error, is_oom
from optladder.optimizers.migrate import migrate_states, read_step, rung_step_limit, state_target
from optladder.optimizers.transaction import deferred_interrupts
from optladder.policies.decision import (
    Decision,
    allowed_rungs,
    escalation_target,
    fixed_reason,
)
from optladder.rungs import RUNGS, Rung, parse_rung
from optladder.selector.checks import check_params_for_rung

if TYPE_CHECKING:
    from optladder.optimizers.adamw import LadderAdamW
    from optladder.selector.optimizer import LadderOptimizer

logger = logging.getLogger("optladder")

__all__ = [
    "Escalation",
    "escalate",
    "migrate",
    "move_refused",
    "restore_groups",
    "set_formats",
    "steps_refusal",
    "switch",
]


@dataclass(frozen=True)
class Escalation:
    """One move down the ladder.

    Attributes:
        from_rung: the rung left.
        to_rung: the rung reached.
        reason: why, in a sentence.
        step: optimizer steps committed before the move.
    """

    from_rung: Rung
    to_rung: Rung
    reason: str
    step: int


def escalate(
    opt: LadderOptimizer, reason: str, *, after: Rung | None = None, target: Rung | None = None
) -> Escalation:
    """Move ``opt``'s state one rung cheaper, record the move in ``opt.escalations``, log
    it and call ``opt.on_escalate`` (see :meth:`LadderOptimizer.escalate`).

    Args:
        opt: the optimizer.
        reason: why, in a sentence.
        after: find the next rung below this one instead of below ``opt.rung`` (another
            rank is further down the ladder already: every rank moves to one rung).
        target: move straight to this rung (to follow another rank that moved there).

    Raises:
        OptimizerOutOfMemoryError: no rung to move to, or the move ran out of memory.
    """
    if target is not None:
        refusal = steps_refusal(opt, target)
        if refusal is not None:
            raise opt.out_of_memory_error(f"{reason}; {refusal}")
    else:
        start = opt._decision
        if after is not None and after != opt.rung:
            start = start.model_copy(update={"rung": after})
        target, why_not = escalation_target(start)
        passed: list[str] = []
        while target is not None:  # a rung that cannot step from these counts cannot help
            refusal = steps_refusal(opt, target)
            if refusal is None:
                break
            passed.append(refusal)
            target, why_not = escalation_target(opt._decision.model_copy(update={"rung": target}))
        if target is None:
            raise opt.out_of_memory_error(f"{reason}; {'; '.join([*passed, why_not])}")
    event = Escalation(opt.rung, target, reason, opt._steps)
    try:
        with deferred_interrupts():  # Ctrl-C waits until the move is whole and recorded
            opt.migrate_to(target, reason, origin="escalated")
            opt.escalations.append(event)
    except BaseException as exc:
        if not is_oom(exc):
            raise
        rounded, lost = getattr(exc, "rounded", None), getattr(exc, "lost", None)
        said = (
            [
                f"params {rounded} (index over all groups) were converted back with the "
                f"{target} format's rounding"
            ]
            if rounded
            else []
        )
        if lost:
            said.append(
                f"params {lost} lost their state (the way back ran out of memory too: they "
                "start again from zero moments and step 0)"
            )
        state = "; ".join(said) or "every param's state is exactly as before"
        raise opt.out_of_memory_error(
            f"{reason}; escalating {opt.rung} -> {target} ran out of memory too "
            f"({describe_error(exc)}): the optimizer stays on {opt.rung} and {state}"
        ) from exc
    logger.warning(
        "optladder: %s; escalated %s -> %s after %d steps",
        reason,
        event.from_rung,
        event.to_rung,
        event.step,
    )
    if opt.on_escalate is not None:
        opt.on_escalate(event)
    return event


def migrate(opt: LadderOptimizer, rung: Rung, reason: str, origin: str, *, force: bool) -> None:
    """Move the groups of ``opt`` that follow the decision to ``rung``, converting their
    state; on failure put their group dicts back and re-raise (see
    :meth:`LadderOptimizer.migrate_to`).

    Raises:
        ValueError: an unknown rung or origin; a refused move without ``force``.
    """
    rung = parse_rung(rung, "rung")  # as choose_optimizer's rung=: "BF16" is bf16
    if origin not in ("escalated", "checkpoint"):
        raise ValueError(f"origin must be 'escalated' or 'checkpoint', got {origin!r}")
    if rung == opt.rung:
        return
    if not force:
        why = move_refused(opt._decision, rung)
        if why is not None:
            raise ValueError(f"cannot move to {rung}: {why} (pass force=True to move anyway)")
    following = opt._following_groups()
    ids = {id(g) for g in following}
    for gi, group in enumerate(opt.param_groups):
        if id(group) in ids:  # named by its place among all groups
            check_params_for_rung(group["params"], rung, f"group {gi}")
    refusal = steps_refusal(opt, rung)
    if refusal is not None:
        raise ValueError(f"cannot move to {rung}: {refusal}")
    saved_groups = [dict(g) for g in following]
    opt._memo = None  # it holds the state dicts the move drops
    params = [p for g in following for p in g["params"]]
    # messages name params by their index over all groups (pinned groups stay)
    places = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    source_specs = {id(p): state_target(opt, g, p) for g in following for p in g["params"]}
    # Ctrl-C waits until the move is done: between the conversion and the merge below,
    # the moved params' state is only in the converted dict, which an interrupt would drop
    with deferred_interrupts():
        try:
            set_formats(opt, following, rung)
            group_of = {id(p): g for g in following for p in g["params"]}
            converted: dict[torch.Tensor, Any] = {}  # merged into the state once whole
            migrate_states(
                opt,
                opt.state,
                converted,
                params,
                lambda p: source_specs[id(p)],
                lambda p: state_target(opt, group_of[id(p)], p),
                keep_source=RUNGS.index(rung) < RUNGS.index(opt.rung),
                places=places,
            )
        except BaseException:
            restore_groups(following, saved_groups)
            raise
        opt.state.update(converted)
        switch(opt, rung, reason, origin)


def set_formats(opt: LadderAdamW, following: list[dict[str, Any]], rung: Rung) -> None:
    """Put the groups that follow the decision (``following``) in ``rung``'s state
    format (:meth:`~optladder.optimizers.adamw.LadderAdamW.set_format`: their ``"rung"``
    and the format's group keys), before their state is converted; nothing is built.
    The caller restores the groups' items on failure (:func:`restore_groups`)."""
    for group in following:
        opt.set_format(group, rung)


def steps_refusal(opt: LadderOptimizer, rung: Rung) -> str | None:
    """Why the groups of ``opt`` that follow the decision cannot move to ``rung``: a
    param whose step count is past what ``rung`` steps from
    (:func:`optladder.optimizers.migrate.rung_step_limit`), named by its place; or None.
    """
    place = {id(g): gi for gi, g in enumerate(opt.param_groups)}
    for group in opt._following_groups():
        for pi, p in enumerate(group["params"]):
            st = opt.state.get(p)
            if not st or "step" not in st:
                continue
            step = read_step(st)
            limit, why = rung_step_limit(rung, p.device.type)
            if step > limit:
                return (
                    f"param {pi} of group {place[id(group)]} has step {step}, past the "
                    f"{rung} rung's [0, {limit:,}] ({why})"
                )
    return None


def switch(opt: LadderOptimizer, rung: Rung, reason: str, origin: str) -> None:
    """Record in ``opt``'s decision that the groups that follow it are on ``rung`` now,
    and why (their state is in that rung's format already)."""
    caps = opt._decision.capabilities
    fused = caps.fused.get(rung, False)
    opt._decision = opt._decision.model_copy(
        update={
            "rung": rung,
            "origin": origin,
            "fits": opt._decision.state_bytes[rung] <= opt._decision.budget_bytes,
            "reasons": (*opt._decision.reasons, f"{reason}: moved to {rung}"),
            "fused": fused,
            "unfused_reason": None if fused else caps.unfused_reasons.get(rung),
        }
    )
    opt._mark_groups(opt._following_groups(), opt._decision)
    opt._warn_unfused()
    _empty_cache(opt.device)


def move_refused(decision: Decision, rung: Rung) -> str | None:
    """Why the user's word forbids moving ``decision``'s optimizer to ``rung``, or None."""
    fixed = fixed_reason(decision)
    if fixed is not None:
        return fixed
    allowed, excluded = allowed_rungs(decision.footprint, decision.capabilities, decision.overrides)
    return None if allowed[rung] else excluded[rung]


def restore_groups(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """Put back the items of each group dict (same dict objects)."""
    for group, items in zip(groups, saved):
        group.clear()
        group.update(items)


def _empty_cache(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
