"""The optladder optimizer: one ``torch.optim.Optimizer`` per run whose groups' state is
in their rung's format, and which moves to a cheaper rung when a step runs out of memory.

:class:`LadderOptimizer` is :class:`~optladder.optimizers.adamw.LadderAdamW` (the state
formats of the rungs and their kernels) with the torch contract of the ladder on top
(``step``, ``zero_grad``, ``add_param_group``, ``state_dict``/``load_state_dict`` with
their hooks, AMP's ``grad_scale``/``found_inf``). It steps in two phases (prepare, then commit: see
:mod:`optladder.optimizers.transaction`), so an out-of-memory error in a step leaves
params, moments and step counts as they were; it then moves its state to the next
cheaper rung and retries the step, once per rung. The rest sits in a module of its own:

- :mod:`optladder.selector.escalation`: the ladder, the moves between rungs;
- :mod:`optladder.selector.checkpointing`: ``state_dict`` and its loading, from any rung;
- :mod:`optladder.selector.agreement`: every cross-rank agreement under
  ``torch.distributed`` (every rank agrees on an OOM before any rank commits, so ranks
  never differ in rung or step count).
"""

from __future__ import annotations

import functools
import logging
import operator
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, TypeVar, cast, get_args

import torch

from optladder.compilation import run_eagerly
from optladder.dtype_names import dtype_name
from optladder.oom import describe_error, is_oom
from optladder.optimizers.adamw import LadderAdamW, distinct_grads, unscale_grads_
from optladder.optimizers.build import KERNEL_KEYS
from optladder.optimizers.checked import first_params_only
from optladder.optimizers.fusedstep import refuse_resized
from optladder.optimizers.stepmemo import StepMemo, grad_of, same_objects
from optladder.optimizers.transaction import (
    commit_step,
    deferred_interrupts,
    param_names,
    prepare_step,
    rollback_step,
)
from optladder.policies.decision import Decision, escalation_target
from optladder.policies.footprint import measure_footprint
from optladder.rungs import (
    FLOAT32_MATH_DTYPES,
    GROUP_PIN_ORIGIN,
    ORIGIN_KEY,
    REASON_KEY,
    RUNG_KEY,
    RUNGS,
    Origin,
    Rung,
    current_origin,
    group_pin,
)
from optladder.selector import checkpointing, escalation
from optladder.selector.agreement import (
    STEP_FAILED,
    STEP_OK,
    STEP_OUT_OF_MEMORY,
    agree_any,
    agree_step,
)
from optladder.selector.checks import (
    check_groups,
    check_max_retries,
    check_new_group,
    check_params_for_rung,
    check_pins,
    refuse_meta_params,
)
from optladder.selector.escalation import Escalation
from optladder.units import format_bytes

logger = logging.getLogger("optladder")

_PARAMS = operator.itemgetter("params")
_NBYTES = operator.attrgetter("nbytes")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous

__all__ = [
    "LadderOptimizer",
    "OptimizerOutOfMemoryError",
    "PartialStepError",
]

_PIN_REASON = "pinned by its param group"
_FOLLOWING_ORIGINS = frozenset(get_args(Origin))
"""The ``"rung_origin"`` marks of groups that follow the decision (a decision's origin)."""

_Method = TypeVar("_Method", bound=Callable[..., Any])


class OptimizerOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory, and the ladder cannot move further down (last rung, a rung fixed
    by ``rung=``, or retries used up). The original error is chained as ``__cause__``.

    Attributes:
        rung: the rung the optimizer is on.
        needed_bytes: the optimizer-state bytes of that rung (from the footprint).
        free_bytes: free memory seen when the rung was chosen, in bytes.
    """

    def __init__(self, message: str, rung: Rung, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.rung = rung
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class PartialStepError(RuntimeError):
    """A step's commit failed after it had written some params (it should not: the
    commit allocates nothing and every check runs before it). The step is not retried:
    that would step the written params twice. The original error is chained.

    Attributes:
        stepped: group numbers (places in ``param_groups``) whose params were stepped:
            every kernel call that steps them had finished.
        partly: group numbers some of whose params may have been stepped: the failing
            kernel call steps some of them (one call steps many groups: torch's fused
            calls, the C kernel's table), or calls that step others had not run.
        not_stepped: group numbers not touched (no call that steps them had begun;
            groups without grads).
    """

    def __init__(
        self, message: str, stepped: list[int], partly: list[int], not_stepped: list[int]
    ) -> None:
        super().__init__(message)
        self.stepped = stepped
        self.partly = partly
        self.not_stepped = not_stepped


def _on_the_optimizer(method: _Method) -> _Method:
    """Run ``method`` on the optladder optimizer that a framework's wrapper stands for.

    Lightning's ``LightningOptimizer`` is an instance of a subclass of the optimizer's
    class that holds the optimizer as ``_optimizer`` and reads missing attributes from
    it: a method that changes attributes (``zero_grad``'s count, a move's groups and
    decision) must run on the optimizer itself, or its writes land on the wrapper and
    the optimizer Lightning steps never sees them."""

    @functools.wraps(method)
    def on_the_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = self.__dict__.get("_optimizer")
        if isinstance(inner, LadderOptimizer) and inner is not self:
            self = inner
        return method(self, *args, **kwargs)

    return cast(_Method, on_the_optimizer)


class LadderOptimizer(LadderAdamW):
    """AdamW whose groups' state is in their rung's format, climbing down the ladder when
    a step runs out of memory: one ``torch.optim.Optimizer`` that owns its
    ``param_groups``, its ``defaults`` and its ``state``.

    The state formats and kernels are :class:`~optladder.optimizers.adamw.LadderAdamW`'s
    (the fp32, bf16 and 8bit rungs are its three formats; each group's ``"rung"`` says
    which); this class adds the ladder: a step in two phases (prepare, then commit: see
    :mod:`optladder.optimizers.transaction`) that on an out-of-memory error converts the
    state of the groups that follow the decision to the next cheaper rung in place and
    retries; checkpoints in one layout whatever the rungs; the agreement of every rank
    under ``torch.distributed``. The object, its group dicts and its ``state`` dict stay
    the same when the rung changes, so references held by LR schedulers and trainers
    stay valid. Each param group records ``"rung"``, ``"rung_origin"`` and
    ``"rung_reason"``, saved in ``state_dict()``.

    Param groups that pin their own rung (``{"params": emb, "rung": "fp32"}``, as
    bitsandbytes users keep embeddings in 32-bit state; see
    :func:`optladder.rungs.group_pin`) keep their state in that rung's format and never
    move: an out-of-memory step escalates the other groups, those that follow the
    decision. ``rung`` and ``decision`` describe the groups that follow the decision;
    the decision's state bytes include the pinned groups'.

    Built by :class:`optladder.AdamW` (``choose_optimizer``), which decides the rung and
    readies the groups (:func:`optladder.selector.choose.decide_and_build`).

    Args:
        param_groups: every param group in the user's order (the order of
            ``param_groups`` and of ``state_dict()``): those that follow ``decision``,
            checked for its rung and in its state format
            (:func:`optladder.optimizers.build.rung_options`), and groups that pin
            their rung, which are checked here.
        pins: per group of ``param_groups``, the rung it pins
            (:func:`optladder.rungs.group_pin`), or None when it follows the decision.
        decision: the :class:`optladder.Decision` that chose the rung.
        hyperparams: ``LadderAdamW``'s hyperparameters and options (``lr``, ``betas``,
            ``eps``, ``weight_decay``, ``decoupled_weight_decay``, ``seed``,
            ``rounding``, ``param_rounding``), checked already (not checked again).
        options: ``LadderAdamW``'s options for the decided rung (``moment_dtype``,
            ``torch_fused``; :func:`~optladder.optimizers.build.rung_options`).
        max_retries: escalations allowed within one ``step()`` call, ``>= 0``.
        on_escalate: called with each :class:`Escalation`, after the move and before the
            retry.
        defaults: the optimizer's ``defaults`` (torch's meaning: what ``add_param_group``
            fills in), fixed here for the whole run whatever rung the state moves to.

    Raises:
        ValueError: a pinned group whose params its rung cannot take (naming the group
            by its place in ``param_groups``).

    Attributes:
        decision: the decision behind the current rung.
        rung: the current rung of the groups that follow the decision.
        engine: the optimizer itself (kept so that code written when the rungs were
            separate engines runs).
        pinned_engines: per pinned rung, the optimizer itself.
        escalations: the moves made so far.
        last_step_skipped: whether the last ``torch.amp.GradScaler.step(opt)`` skipped
            the step for an inf/NaN grad (keep an LR scheduler in step with
            ``if not opt.last_step_skipped: scheduler.step()``).
    """

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """False: ``torch.amp.GradScaler`` unscales and checks the grads itself and calls
        :meth:`step` only when every grad is finite, as for torch's foreach AdamW.

        So a skipped step is visible to whatever watches ``step()`` being called:
        accelerate's ``AcceleratedOptimizer.step_was_skipped`` (and with it the Hugging
        Face Trainer's scheduler), and torch's LR-scheduler order check; and Lightning
        clips AMP grads (it refuses to for optimizers that unscale in ``step()``). The
        fused alternative (True, as torch's fused AdamW) runs ``step()`` on an overflow
        too, which those wrappers count as a step (huggingface/accelerate#4242).

        ``GradScaler.step`` reads this attribute once, before it decides whether to
        step; that read records that a scaler step began, and :attr:`last_step_skipped`
        is True until :meth:`step` runs. Only a read from a ``GradScaler``'s own ``step``
        (its frame's ``self`` is a ``torch.amp.GradScaler``, subclasses included) counts:
        other readers (Lightning's clipping check, ``inspect.getmembers``, a debugger) had
        turned a stepped optimizer's ``last_step_skipped`` True and counted a step request.
        """
        caller = sys._getframe(1)
        if caller.f_code.co_name == "step" and isinstance(
            caller.f_locals.get("self"), torch.amp.GradScaler
        ):
            self._scaler_step_began = True
            self._step_requests += 1
        return False

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``GradScaler.step(opt)`` skipped the step (an inf/NaN grad),
        or the last :meth:`step` was handed a nonzero ``found_inf``."""
        return self._skipped or self._scaler_step_began

    @last_step_skipped.setter
    def last_step_skipped(self, value: bool) -> None:
        self._skipped = bool(value)
        self._scaler_step_began = False

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        decision: Decision,
        *,
        pins: Sequence[Rung | None],
        hyperparams: Mapping[str, Any],
        options: Mapping[str, Any],
        max_retries: int = 2,
        on_escalate: Callable[[Escalation], None] | None = None,
        defaults: Mapping[str, Any],
    ) -> None:
        check_max_retries(max_retries)
        self._built = False  # add_param_group: torch's __init__ adds the groups below
        # id(param) -> (a weak reference to it, the rung its group pins), for every param
        # of a group that pins its rung (the format its state is in); see _group_pin
        self._pin_rungs: dict[int, tuple[weakref.ref[torch.Tensor], Rung]] = {}
        self._decision = decision
        self.max_retries = max_retries
        self.on_escalate = on_escalate
        self.escalations: list[Escalation] = []
        self.last_step_skipped = False
        self._steps = 0
        self._commits = 0
        self._zero_grad_calls = 0
        self._step_requests = 0
        # the params (flat, all groups), their byte counts and whether each was
        # contiguous when _check_params last passed
        self._checked_params: tuple[
            list[torch.Tensor] | None, list[int] | None, list[bool] | None
        ] = (None, None, None)
        self.partial_step: PartialStepError | None = None
        self._warned: set[tuple[Rung, str]] = set()
        self._memo: StepMemo | None = None  # what passed the step checks
        self._names: tuple[tuple[int, ...], dict[int, str]] = ((), {})
        order = list(param_groups)
        following: list[dict[str, Any]] = []
        for gi, (group, pin) in enumerate(zip(order, pins, strict=True)):
            if pin is None:
                following.append(group)
            else:
                self._check_pinned(gi, group, pin)
                _mark_pinned([group], pin)
        self._mark_groups(following, decision)
        # the following groups' params passed construction's checks and the rung's
        # (rung_options): torch's per-param checks read each one's first param only
        with first_params_only(following):  # the hyperparameters checked once, before
            super().__init__(order, **hyperparams, **options, checked=True)
        # LadderAdamW's hook wrapping 8bit state for its own state_dict: this class lays
        # out every state itself (checkpointing.state_dict), and runs only users' hooks
        self._optimizer_state_dict_post_hooks.clear()
        self.defaults = dict(defaults)
        self._record_pins()
        self._built = True
        self._params_checked()
        self._warn_unfused()

    # ------------------------------------------------------------------ plumbing
    def _check_pinned(self, gi: int, group: dict[str, Any], rung: Rung) -> None:
        """Refuse a group (at place ``gi`` among all groups) that pins ``rung`` whose
        params that rung cannot take.

        Raises:
            ValueError: ``"param group {gi} pins {rung}: ..."``, naming the param.
        """
        try:
            check_params_for_rung(group["params"], rung, f"group {gi}")
        except ValueError as exc:
            raise ValueError(f"param group {gi} pins {rung}: {exc}") from None

    def _group_pin(self, group: Mapping[str, Any]) -> Rung | None:
        """The rung ``group`` pins, or None when it follows the decision.

        A pin belongs to the group dict, whatever is done to it that torch accepts: the
        group's first param's recorded pin (:meth:`_record_pins`: every param of a
        pinned group has one, so it holds when the dicts are replaced by copies,
        ``opt.param_groups[:] = [dict(g) for g in opt.param_groups]``, or a param is
        popped), else the group's own mark (``"rung_origin": "group"``, which dict
        copies and ``load_state_dict`` keep: a group whose params were all replaced, or
        that has none). The record wins over the group's ``"rung"``, so that a
        ``"rung"`` edited by hand is caught (:meth:`_check_group_rungs`), not followed.
        A group marked as following the decision (an origin of ``Decision.origin``) pins
        nothing whatever its first param's record says (a param moved by hand from a
        pinned group to the front of a following group, before the next step's
        :meth:`_record_pins`).
        """
        params = group["params"]
        if params and current_origin(group.get(ORIGIN_KEY)) not in _FOLLOWING_ORIGINS:
            first = params[0]
            entry = self._pin_rungs.get(id(first))
            if entry is not None and entry[0]() is first:  # not another tensor at its address
                return entry[1]
        if group.get(ORIGIN_KEY) == GROUP_PIN_ORIGIN and group.get(RUNG_KEY) in RUNGS:
            return cast(Rung, group[RUNG_KEY])
        return None

    def _group_pins(self) -> list[Rung | None]:
        """Per group of ``param_groups``, the rung it pins or None (:meth:`_group_pin`)."""
        groups = self.param_groups
        if not self._pin_rungs and all(g.get(ORIGIN_KEY) != GROUP_PIN_ORIGIN for g in groups):
            return [None] * len(groups)  # the common case: no pins
        return [self._group_pin(g) for g in groups]

    def _record_pins(self) -> None:
        """Record the pin of every param of each pinned group (:meth:`_group_pin`):
        at construction, when a group is added, and when the params changed."""
        record: dict[int, tuple[weakref.ref[torch.Tensor], Rung]] = {}
        for group, pin in zip(self.param_groups, self._group_pins()):
            if pin is not None:
                for p in group["params"]:
                    record[id(p)] = (weakref.ref(p), pin)
        self._pin_rungs = record

    def _following_groups(self) -> list[dict[str, Any]]:
        """The groups that follow the decision (those that pin no rung), in order."""
        pins = self._group_pins()
        return [g for g, pin in zip(self.param_groups, pins) if pin is None]

    def _group_rung(self, group: Mapping[str, Any]) -> Rung:
        """The rung ``group``'s state is on: the rung it pins, or the decision's."""
        return self._group_pin(group) or self._decision.rung

    @staticmethod
    def _mark_groups(groups: list[dict[str, Any]], decision: Decision) -> None:
        reason = decision.reasons[-1] if decision.reasons else decision.origin
        for group in groups:
            group[RUNG_KEY] = decision.rung
            group[ORIGIN_KEY] = decision.origin
            group[REASON_KEY] = reason

    @property
    def engine(self) -> LadderOptimizer:
        """The optimizer itself: every rung is a state format of it (kept so that code
        written when the rungs were separate engines, ``opt.engine.param_groups``, runs)."""
        return self

    @property
    def pinned_engines(self) -> dict[Rung, LadderOptimizer]:
        """Per rung that a group pins, the optimizer itself (a new dict; empty without
        pins). Kept, as :attr:`engine` is."""
        return dict.fromkeys((r for r in self._group_pins() if r is not None), self)

    @property
    def decision(self) -> Decision:
        """The :class:`optladder.Decision` behind the current rung."""
        return self._decision

    @property
    def rung(self) -> Rung:
        """The current rung: ``"fp32"``, ``"bf16"`` or ``"8bit"``."""
        return self._decision.rung

    @property
    def device(self) -> str:
        """The device whose memory the decision gated."""
        return self._decision.capabilities.device

    @run_eagerly
    @_on_the_optimizer
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (torch's semantics) after the same checks as
        ``choose_optimizer`` (hyperparameters, duplicates, params the rung cannot take);
        the decision's footprint and state bytes are updated.

        The group's state is in the current rung's format, or, when it pins a rung
        (``param_group["rung"]``), in that rung's.

        Values the group leaves out are ``defaults``' (torch's semantics), including
        values set in ``opt.defaults`` by hand after construction.

        Raises:
            ValueError: naming the param or option, what was found and what is allowed;
                a pinned rung that is disabled or unavailable.
        """
        if not self._built:  # torch.optim.Optimizer.__init__ adds construction's groups,
            LadderAdamW.add_param_group(self, param_group)  # checked there
            return
        group = check_new_group(param_group)
        for key, value in self.defaults.items():  # torch fills what the group leaves out
            if key not in KERNEL_KEYS:  # (before the checks); optladder picks the kernel
                group.setdefault(key, value)
        params = group["params"]
        if ("param_names" in group) != ("param_names" in self.param_groups[0]):
            have = "named" if "param_names" in self.param_groups[0] else "unnamed"
            raise ValueError(
                f"this optimizer's params are {have}; the new group's must be too (torch's "
                "rule: named params in every group or in none)"
            )
        decoupled = bool(self.defaults.get("decoupled_weight_decay", True))
        check_groups([*self.param_groups, group], decoupled)
        refuse_meta_params([group], first_group=len(self.param_groups))
        gi = len(self.param_groups)
        pin = group_pin(group, f"param group {gi}")
        # the new params are in no group (check_groups): a pin recorded for one (taken
        # out of a pinned group since the last step) is stale, and the group's own
        # "rung" says where it goes
        recorded, new = self._pin_rungs, set(map(id, params))
        self._pin_rungs = {k: v for k, v in recorded.items() if k not in new}
        try:
            self._add_checked_group(gi, group, pin)
        except BaseException:
            self._pin_rungs = recorded
            raise

    def _add_checked_group(self, gi: int, group: dict[str, Any], pin: Rung | None) -> None:
        """:meth:`add_param_group`'s install of ``group`` (checked, at place ``gi``), on
        the rung it pins (``pin``) or the decision's; the footprint updated."""
        params = group["params"]
        with deferred_interrupts():  # Ctrl-C waits until the group is added everywhere
            if pin is None:
                check_params_for_rung(params, self.rung)
                self._mark_groups([group], self._decision)
                LadderAdamW.add_param_group(self, group)
            else:
                check_pins([*self.param_groups, group], self._decision)
                self._check_pinned(gi, group, pin)
                _mark_pinned([group], pin)
                try:
                    LadderAdamW.add_param_group(self, group)
                except ValueError as exc:
                    raise ValueError(f"param group {gi} pins {pin}: {exc}") from None
                self._record_pins()
            footprint = measure_footprint(self.param_groups)
            self._decision = self._decision.model_copy(
                update={"footprint": footprint, "state_bytes": dict(footprint.state_bytes)}
            )
        # the next step checks all params again (the new group's and any edit since)

    @property
    def committed_steps(self) -> int:
        """How many steps began writing params (their commit started), failed commits
        included: :class:`optladder.Ladder` compares it before and after a train step
        and never reruns a train step in which it changed."""
        return self._commits

    @property
    def step_requests(self) -> int:
        """How many optimizer steps were asked for: :meth:`step` calls and
        ``torch.amp.GradScaler.step`` calls (which skip :meth:`step` on an inf/NaN grad;
        a scaler step that goes on counts twice). :class:`optladder.Ladder` compares it
        before and after a train step: one that asked for a step ends its grads' use
        (they were stepped or skipped), one that did not may be a micro-batch whose
        grads the next call adds into."""
        return self._step_requests

    @property
    def zero_grad_calls(self) -> int:
        """How many times :meth:`zero_grad` ran (Ladder tells a train step that starts
        from fresh grads from one that accumulates into earlier ones)."""
        return self._zero_grad_calls

    @run_eagerly
    @_on_the_optimizer
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of all params (to None by default, as torch does)."""
        self._zero_grad_calls += 1
        torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)

    # ------------------------------------------------------------------ stepping
    @run_eagerly
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimizer step; on out-of-memory, escalate one rung and retry it.

        The closure (optional) runs once, before the step; a retry reuses its grads.

        Inside ``torch.compile`` the step runs eagerly (a graph break; see
        :mod:`optladder.compilation`), as do ``zero_grad``, ``add_param_group``,
        ``state_dict`` and ``load_state_dict``.

        Under ``torch.amp.GradScaler`` the scaler unscales the grads and calls this only
        when they are finite (see :attr:`_step_supports_amp_scaling`). A caller that sets
        ``grad_scale``/``found_inf`` on the optimizer itself, as the scaler does for
        torch's fused optimizers, gets them honoured: on a nonzero ``found_inf`` nothing
        changes, step counts included (``last_step_skipped`` becomes True); otherwise the
        grads are unscaled in place after the prepare phase, and the step commits. Each
        distinct grad memory is divided once, also when params share a grad tensor or
        hold views of the same elements (torch's fused AdamW would divide such a grad
        once per param: see :func:`optladder.optimizers.adamw.distinct_grads`).

        Under ``torch.distributed`` one all-reduce before the commit
        (:func:`~optladder.selector.agreement.agree_step`) tells every rank whether any
        rank ran out of memory and which rungs the ranks are on: every rank then rolls
        back and moves to the rung below the most escalated rank's, or, with no OOM but
        ranks on different rungs (one moved alone outside a step, as
        :class:`optladder.Ladder` does), the ranks behind follow (not counted in
        ``max_retries``); the step is then retried on every rank.

        Returns:
            The closure's loss, or None.

        Raises:
            OptimizerOutOfMemoryError: out of memory with no rung left to move to (the
                original error chained), the rung fixed by ``rung=``, or ``max_retries``
                used up; a move down that failed here or on another rank (every rank
                raises then).
            RuntimeError: whatever the all-reduce raised (a peer died, a timeout); the
                state the step made is dropped first.
            ValueError: before anything changes: a group's options, grads or step counts
                the rung cannot take (naming them), a group's ``"rung"`` edited by
                hand, or (with ``grad_scale`` set) grads that share some of their memory
                but not all.
        """
        self._step_requests += 1
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        self.last_step_skipped = found_inf is not None and bool(found_inf.item() != 0)
        if self.last_step_skipped:
            return loss  # an overflow step changes nothing, step counts included
        # before anything is prepared: it may refuse (grads that partly share memory)
        unscale = None if grad_scale is None else (self._grads_to_unscale(), grad_scale)
        retries = 0
        while True:
            failure = self._two_phase_step(retries, unscale)
            if failure is None:
                return loss
            # Outside any except block: the failed attempt's frames and tensors are gone.
            reason, rung, follow = failure
            if not follow:
                retries += 1
            self._escalate_on_every_rank(reason, rung, follow)

    def _escalate_on_every_rank(self, reason: str, rung: Rung, follow: bool) -> None:
        """Escalate (to ``rung`` itself when ``follow``, else one rung below it), then
        agree with the other ranks that every rank's move succeeded: if one failed, every
        rank raises, so that none steps on alone and waits for the others forever.

        Raises:
            OptimizerOutOfMemoryError: this rank's move failed (its own error), or
                another rank's did (this rank may have moved: the message says where).
        """
        error: BaseException | None = None
        try:
            if follow:
                if rung != self.rung:  # this rank is behind
                    escalation.escalate(self, reason, target=rung)
            else:
                escalation.escalate(self, reason, after=rung)
        except BaseException as exc:
            error = exc
        if not agree_any(error is not None, self.device):
            return
        if error is not None:
            raise error
        raise self.out_of_memory_error(
            f"{reason}; another rank could not move down the ladder, so every rank stops "
            f"here (this rank is on {self.rung} now, the other may not be: resume every "
            "rank from a checkpoint)"
        )

    def _check_group_rungs(self, pins: list[Rung | None] | None = None) -> None:
        """Refuse a group whose ``"rung"`` entry was edited by hand: its state is in the
        format of the rung it pins or the decision's, and a step or a checkpoint under another name
        would contradict it (a checkpoint saying bf16 beside float32 moments). ``pins``:
        :meth:`_group_pins`, when the caller has them.

        Raises:
            ValueError: naming the group, the value found and the rung its state is on.
        """
        groups = self.param_groups
        if pins is None:
            pins = self._group_pins()
        if all(g.get(RUNG_KEY) == self.rung for g in groups) and not any(pins):
            return  # the common case
        for gi, (group, pin) in enumerate(zip(groups, pins)):
            rung = pin or self.rung
            found = group.get(RUNG_KEY)
            if found != rung:
                raise ValueError(
                    f"param group {gi} has rung={found!r}, but its state is on the "
                    f"{rung} rung: a group's rung is not edited by hand. Give a group "
                    "its own rung when it is added ({'params': ..., 'rung': 'fp32'} to "
                    "choose_optimizer or add_param_group), or move every group that "
                    f"follows the decision with opt.migrate_to(rung, reason); set "
                    f"param_groups[{gi}]['rung'] = {rung!r} back to go on"
                )

    def _check_params(self, pins: list[Rung | None]) -> None:
        """Construction's param checks again when the params changed since they last
        passed: a group's ``"params"`` list edited by hand (a param appended twice, or
        one of a dtype or layout the group's rung cannot take) or a param's ``.data``
        replaced (``module.to(dtype)``, ``module.to(memory_format=...)``, a resize) after
        its state was made. Once per step, in C: every param's identity, byte count and
        contiguity against the last ones checked (a new size, a dtype of another width,
        another memory format; what keeps all three keeps the state's fit: a param given
        other memory of the same size and layout is stepped there). When they changed,
        the step memo is dropped too, so the next prepare checks every grad
        and lays out every moment again.

        Raises:
            ValueError: what construction would say of the params (a param listed twice,
                params sharing memory, a dtype the rung cannot take), or a
                grad or state tensor of another size than its param
                (:func:`~optladder.optimizers.fusedstep.refuse_resized`), with a note
                that the params changed; nothing is changed.

        ``pins``: :meth:`_group_pins`.
        """
        flat = list(chain.from_iterable(map(_PARAMS, self.param_groups)))
        sizes = list(map(_NBYTES, flat))
        layouts = self._layouts(flat, pins)
        seen, seen_sizes, seen_layouts = self._checked_params
        if seen is not None and same_objects(flat, seen):
            if seen_sizes is None:  # as construction checked them
                self._checked_params = (flat, sizes, layouts)
                return
            if sizes == seen_sizes and layouts == seen_layouts:
                return
        names = self._group_names()
        try:
            decoupled = bool(self.defaults.get("decoupled_weight_decay", True))
            check_groups(self.param_groups, decoupled)
            refuse_meta_params(self.param_groups)
            for gi, (group, pin) in enumerate(zip(self.param_groups, pins)):
                rung = pin or self.rung
                check_params_for_rung(group["params"], rung, f"group {gi}")
            grads = [list(map(grad_of, g["params"])) for g in self.param_groups]
            refuse_resized(self, grads, names)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (the params changed since the last step: a group's params list was "
                "edited, or a param's .data replaced, e.g. by module.to(dtype))"
            ) from None
        # what passed the step checks before may hold for these params no more (a
        # channels_last param's moments are laid out again, its grads checked again)
        self._memo = None
        self._record_pins()  # the pins of params added to a pinned group, none of removed ones
        self._checked_params = (flat, sizes, layouts)

    def _params_checked(self) -> None:
        """Record the params as construction checked them, so :meth:`_check_params` has
        nothing to do until they change. Their sizes and layouts are read at the first
        step (no state exists before it that a change could misfit), so construction
        reads each param no more than it did."""
        flat = list(chain.from_iterable(map(_PARAMS, self.param_groups)))
        self._checked_params = (flat, None, None)

    def _layouts(self, flat: list[torch.Tensor], pins: list[Rung | None]) -> list[bool]:
        """Whether each param is contiguous, where a group is in the fp32 format (whose
        torch kernels pair a param's elements with its moments' by memory order; the
        other formats step any layout): empty otherwise. ``pins``: :meth:`_group_pins`."""
        if self.rung != "fp32" and "fp32" not in pins:
            return []
        return list(map(_IS_CONTIGUOUS, flat))

    def _grads_to_unscale(self) -> list[torch.Tensor]:
        """The grads to divide by ``grad_scale``: each distinct grad memory once
        (:func:`~optladder.optimizers.adamw.distinct_grads`).

        Raises:
            ValueError: grads that share some of their memory but not all, naming them.
        """
        per_group = [list(map(grad_of, g["params"])) for g in self.param_groups]
        grads = [g for gs in per_group for g in gs if g is not None]
        return distinct_grads(grads, param_names(self.param_groups, per_group, None))

    def _two_phase_step(
        self, retries: int, unscale: tuple[list[torch.Tensor], torch.Tensor] | None
    ) -> tuple[str, Rung, bool] | None:
        """Prepare, agree with the other ranks, commit. Returns None when
        the step committed; otherwise, with nothing committed, ``(reason, rung,
        follow)``: escalate below ``rung`` (an out-of-memory error on some rank; ``rung``
        is the most escalated rank's), or, when ``follow``, move to ``rung`` itself
        (another rank moved there outside a step)."""
        names = self._group_names()
        created: list[torch.Tensor] | None = None  # the state the prepare created
        error: BaseException | None = None
        status = STEP_OK
        try:
            pins = self._group_pins()
            self._check_group_rungs(pins)
            self._check_params(pins)
            if self._memo is None:
                self._memo = StepMemo()
            created = prepare_step(self, names, self._memo)
        except BaseException as exc:  # the prepare rolled itself back
            error = exc
            status = STEP_OUT_OF_MEMORY if is_oom(exc) else STEP_FAILED
        mine = RUNGS.index(self.rung)
        try:
            # every rank takes part, also one whose prepare failed: none waits for it
            worst, furthest, nearest = agree_step(status, mine, self.device)
        except BaseException:  # a peer died or timed out: nothing of this step stays
            if created is not None:
                rollback_step(self, created, self._memo)
            raise
        if worst == STEP_OK and furthest == nearest:
            self._commit(unscale)
            self._warn_unfused()
            return None
        if created is not None:  # this rank prepared, another did not
            rollback_step(self, created, self._memo)
        if status == STEP_FAILED:
            assert error is not None
            raise error
        if worst == STEP_FAILED:
            raise RuntimeError(
                "optladder: another rank's optimizer step failed before any rank committed "
                "(see that rank's error); nothing of this step was committed on this rank"
            )
        oom = worst == STEP_OUT_OF_MEMORY
        if not oom:  # a rank moved down alone (Ladder, after a forward OOM): all follow
            return (
                f"another rank moved to the {RUNGS[furthest]} rung outside the optimizer "
                "step (optladder.Ladder, after an out-of-memory error in its forward or "
                "backward); every rank steps on one rung",
                RUNGS[furthest],
                True,
            )
        message = describe_error(error) if error is not None else "another rank ran out of memory"
        furthest_rung = RUNGS[furthest]
        start = self._decision
        if furthest != mine:
            start = start.model_copy(update={"rung": furthest_rung})
        target, why_not = escalation_target(start)
        if target is None or retries >= self.max_retries:
            if target is not None:
                why_not = (
                    f"{retries} escalations in this step already (max_retries={self.max_retries})"
                )
            raise self.out_of_memory_error(
                f"out of memory in the optimizer step ({message}); {why_not}"
            ) from error
        if error is not None:
            error.__traceback__ = None
        del error
        return (
            f"out of memory in the optimizer step on {self.rung} ({message})",
            furthest_rung,
            False,
        )

    def _group_names(self) -> dict[int, str]:
        """``id(group) -> "group {place}"`` for messages, kept while the groups are."""
        key = tuple(map(id, self.param_groups))
        if self._names[0] != key:
            self._names = (key, {gid: f"group {gi}" for gi, gid in enumerate(key)})
        return self._names[1]

    def _commit(self, unscale: tuple[list[torch.Tensor], torch.Tensor] | None) -> None:
        """Run the commit (it allocates nothing), with Ctrl-C held back until it is
        done, after dividing the grads of ``unscale`` (the distinct grads,
        :meth:`_grads_to_unscale`) by its ``grad_scale``, when given. Should it fail
        anyway, record which groups it had stepped, which it may have partly stepped and
        which it had not touched (``partial_step``, from the engine's
        :attr:`~optladder.optimizers.adamw.LadderAdamW.commit_outcome`) and raise
        :class:`PartialStepError` (a KeyboardInterrupt or other ``BaseException`` is
        re-raised as it is, after the record)."""
        self._commits += 1  # before the first write: Ladder must never rerun this step
        done = False
        self.commit_outcome = None
        try:
            with deferred_interrupts():
                if unscale is not None:
                    unscale_grads_(*unscale)
                commit_step(self, self._memo)
                done = True
        except BaseException as exc:
            if done:  # Ctrl-C held back until the step was whole
                self._steps += 1
                self.partial_step = None
                raise
            # what the engine's commit had written (nothing when it did not begin)
            outcome: tuple[list[int], list[int], list[int]] = self.commit_outcome or (
                [],
                [],
                list(range(len(self.param_groups))),
            )
            stepped, partly, not_stepped = outcome
            written = (
                "after it had written params"
                if stepped or partly
                else "before it wrote any param (the grads may be unscaled)"
            )
            error = PartialStepError(
                f"the optimizer step failed in its commit ({describe_error(exc)}) {written}: "
                f"param groups {stepped} were stepped, {partly} may be partly stepped, "
                f"{not_stepped} were not. The step is not retried (that would step the "
                "written params twice); resume from a checkpoint to continue exactly.",
                stepped,
                partly,
                not_stepped,
            )
            self.partial_step = error
            logger.error("optladder: %s", error)
            if isinstance(exc, Exception):
                raise error from exc
            raise
        self._steps += 1
        self.partial_step = None

    def out_of_memory_error(self, message: str) -> OptimizerOutOfMemoryError:
        """The error to raise when out of memory with nowhere to go: ``message`` plus the
        current rung's state bytes and the free bytes seen when it was chosen."""
        needed = self._decision.state_bytes[self.rung]
        free = self._decision.free_memory
        return OptimizerOutOfMemoryError(
            f"{message}. The {self.rung} rung's state needs {needed:,} bytes "
            f"({format_bytes(needed)}); {free:,} bytes ({format_bytes(free)}) were free "
            "when it was chosen.",
            self.rung,
            needed,
            free,
        )

    def _warn_unfused(self) -> None:
        """Log each distinct reason for leaving the fused path once per optimizer and
        rung: the decision's, and those of params the last step stepped eagerly (each
        under the rung of its param's group), but for params of a dtype optladder's
        kernels do not step on the decision's rung when the decision is not fused: its
        reason names those dtypes already (``float64 params run the eager path``), so a
        float64 param on the bf16 rung is one line, not that and the kernel's word for
        it (``param dtype torch.float64: the CPU kernel steps ...``)."""
        reasons: list[tuple[Rung, str]] = []
        named = None  # the rung whose unfused dtypes the decision's reason names
        if not self._decision.fused:
            reasons.append((self.rung, self._decision.unfused_reason or ""))
            named = self.rung
        eager = self.eager_reasons  # by param index over all groups
        if eager:
            groups = self.param_groups
            pins = self._group_pins()
            params = [(p, pin or self.rung) for g, pin in zip(groups, pins) for p in g["params"]]
            said: set[tuple[Rung, str]] = set()
            for i, reason in eager.items():
                if i >= len(params):
                    said.add((self.rung, reason))
                    continue
                p, rung = params[i]
                if rung != named or dtype_name(p.dtype) in FLOAT32_MATH_DTYPES:
                    said.add((rung, reason))
            reasons += sorted(said)
        for rung, reason in reasons:
            if (rung, reason) not in self._warned:
                self._warned.add((rung, reason))
                logger.warning("optladder: %s rung not on the fused path: %s", rung, reason)

    # ------------------------------------------------------------------ moving
    @_on_the_optimizer
    def escalate(self, reason: str) -> Escalation:
        """Move the state to the next cheaper rung (one rung), in place.

        Raises:
            OptimizerOutOfMemoryError: if there is no rung to move to, or the move itself
                ran out of memory (the message says so; the rung stays, and the state is
                as before, or names the params an 8-bit move rounded).
        """
        return escalation.escalate(self, reason)

    @_on_the_optimizer
    def migrate_to(
        self, rung: Rung, reason: str, origin: str = "escalated", *, force: bool = False
    ) -> None:
        """Move the groups that follow the decision to ``rung`` and convert their params'
        state there, keeping this object, the param-group dicts (per-group
        hyperparameters, a tensor lr included), param order and per-param step counts.
        Every rung is a state format of this optimizer: the state is converted in place
        and nothing is built. Groups that pin their rung stay where they are.

        On failure (an OOM while converting) the groups are put back and every param gets
        its state back, and the error is re-raised. Moving up (to a wider format) keeps
        the old state until the move is done, so that is exact; moving down (escalating)
        frees each param's old state as soon as its new one exists, to need at most one
        param's new state in extra memory, so the params converted before the failure
        are converted back and keep the narrower format's rounding (see
        :func:`optladder.optimizers.migrate.migrate_states`).

        Args:
            rung: the target rung.
            reason: why, in a sentence (recorded in the decision's reasons).
            origin: ``"escalated"`` or ``"checkpoint"`` (``Decision.origin``).
            force: move even from a rung fixed by ``rung=`` or onto a rung the user
                disabled (``=0``) or that is unavailable; without it those raise.

        Raises:
            ValueError: an unknown rung or origin; a fixed rung or a disabled or
                unavailable target without ``force``.
        """
        escalation.migrate(self, rung, reason, origin, force=force)

    # ------------------------------------------------------------------ checkpoints
    @run_eagerly
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state in one layout, whatever the rungs and pins: torch's
        ``Optimizer.state_dict`` layout over every group (state keyed by the param's place
        over all groups, groups in order with their ``"params"`` as those places), each
        group recording its rung, how it was reached and why.

        Each param's state is in its rung's format, as the reference optimizer of that
        rung saves it, so a checkpoint continues in it (:meth:`load_state_dict` of
        ``torch.optim.AdamW`` for fp32 groups, ``bitsandbytes.optim.AdamW8bit`` for 8bit
        groups): the Adam layout (``step``, ``exp_avg``, ``exp_avg_sq``) on fp32 and bf16,
        bitsandbytes' layout on 8bit, its tensors under ``"__bnb_optimizer_quant_state__"``
        as bitsandbytes' own ``state_dict`` wraps them; a group that pins its rung is laid
        out as the same state following the decision would be. For DTensor params (FSDP2),
        the checkpoint form of :mod:`optladder.optimizers.checkpoint`: DTensors whose global
        shapes do not depend on the world size (8-bit codes laid out like the param, block
        scales per row), so ``torch.distributed.checkpoint`` saves every rank's shard and
        ``get_optimizer_state_dict(..., full_state_dict=True)`` gathers whole moments. Once
        any param has state, a trainable param without state (no grad yet) is saved as a
        zero state with ``step`` 0, which loads as no state.

        Hooks registered with ``register_state_dict_pre_hook``/``_post_hook`` run as
        torch runs them.

        Raises:
            ValueError: for 8-bit state of a DTensor param not sharded on dim 0; for a
                group whose ``"rung"`` was edited by hand (the checkpoint would say one
                rung beside state of another).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._check_group_rungs()
        state_dict = checkpointing.state_dict(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @run_eagerly
    @_on_the_optimizer
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict`` saved from any rung into this optimizer.

        If this optimizer's rung was chosen by the policy and the checkpoint's rung was
        reached by escalation, the optimizer first moves to the checkpoint's rung (a
        resumed run must not run out of memory again). Otherwise (a rung fixed by
        ``rung=``, or a checkpoint from a policy choice) the checkpoint's state is
        converted into this optimizer's rung. Groups that pin their rung keep it: their
        state is converted into it, whatever the checkpoint had. bf16 moments stay
        bfloat16, 8-bit state stays uint8 codes with float32 absmax, ``step`` lands where
        the rung's format keeps it, and this optimizer's kernel flags (``fused``,
        ``foreach``) are kept. Sharded 8-bit state saved per row (by :meth:`state_dict` under FSDP2)
        loads exactly when its blocks are this rank's blocks, and is requantized
        otherwise (another world size; see :mod:`optladder.optimizers.checkpoint`). A
        saved state with ``step`` 0 (a param that had not stepped) loads as no state.
        Hyperparameters (lr, betas, eps, weight_decay, a scheduler's ``initial_lr``, the
        bf16 seed) come from the checkpoint.

        Hooks registered with ``register_load_state_dict_pre_hook``/``_post_hook`` run as
        torch runs them (a pre-hook may return a replacement ``state_dict``).

        Raises:
            ValueError: if the checkpoint does not fit the params (group count, param
                count, element count or shape), its state is malformed (missing keys,
                wrong dtypes, absmax of the wrong length, sparse tensors) or cannot be
                carried exactly (NaN or infinite moments, a step that is not a whole
                number, state keys of another optimizer such as amsgrad's or NAdam's),
                its groups were written by another optimizer (NAdam, RAdam, ...) or decay
                the other way (Adam into AdamW or the reverse, with weight decay), or its
                hyperparameters or options are out of range; the optimizer is left
                unchanged.
        """
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch does before its hooks
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        checkpointing.load(self, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def follow_checkpoint(self, param_groups: Sequence[dict[str, Any]]) -> Rung | None:
        """Deprecated: ``dcp.load(..., planner=optladder.DCPLoadPlanner())`` loads a
        checkpoint of any rung without it (see the README). Kept so that code written
        for the old recipe runs: it still moves, before a load, to the rung a checkpoint
        had escalated to, by the rule of :meth:`load_state_dict` (which does this
        itself), and warns (``FutureWarning``).

        Args:
            param_groups: the checkpoint's ``state_dict()["param_groups"]`` (only their
                ``"rung"`` and ``"rung_origin"`` entries are read).

        Returns:
            The rung moved to, or None when the optimizer stays.

        Raises:
            ValueError: if ``param_groups`` is not a list of dicts, one per group of this
                optimizer, or a group is malformed (a ``"rung"`` that is not a rung, an
                unknown ``"rung_origin"``, options out of range, another optimizer's
                groups, weight decay of the other mode); nothing moves then.
        """
        warnings.warn(
            "optladder: follow_checkpoint is deprecated and no longer needed: load with "
            "dcp.load(state, checkpoint_id=path, planner=optladder.DCPLoadPlanner()), then "
            "set_optimizer_state_dict(model, opt, state['optim']), which moves to the "
            "checkpoint's rung as load_state_dict does",
            FutureWarning,
            stacklevel=2,
        )
        return checkpointing.follow_checkpoint(self, param_groups)

    def __getstate__(self) -> dict[str, Any]:
        """Refused: the optimizer holds kernel tables, step plans and scratch buffers that
        point into its state's memory, which a copy could not share. Save
        ``state_dict()`` and load it into a new optimizer.

        Raises:
            TypeError: always (``pickle``, ``copy.deepcopy``).
        """
        raise TypeError(
            f"an optladder {type(self).__name__} cannot be pickled or deep-copied; save "
            "opt.state_dict() and load it into a new one (load_state_dict)"
        )

    def __repr__(self) -> str:
        """torch's optimizer repr (every group's options but ``params``, keys sorted,
        ``rung`` among them) after a header with the rung, whether it is fused, and per
        pinned rung its number of groups: ``AdamW (rung='bf16', fused, pinned fp32: 1
        group\nParameter Group 0 ...)``."""
        fused = "fused" if self.decision.fused else "not fused"
        pins = [r for r in self._group_pins() if r is not None]
        pinned = "".join(
            f", pinned {rung}: {n} group{'s' * (n != 1)}"
            for rung, n in ((r, pins.count(r)) for r in dict.fromkeys(pins))
        )
        name = type(self).__name__
        groups = torch.optim.Optimizer.__repr__(self).removeprefix(f"{name} (")
        return f"{name} (rung={self.rung!r}, {fused}{pinned}{groups}"


def _mark_pinned(groups: list[dict[str, Any]], rung: Rung) -> None:
    """Record in each group that it pins ``rung`` (the form :func:`group_pin` reads)."""
    for group in groups:
        group[RUNG_KEY] = rung
        group[ORIGIN_KEY] = GROUP_PIN_ORIGIN
        group[REASON_KEY] = _PIN_REASON
