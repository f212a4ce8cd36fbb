"""The optladder optimizer: one object per run that delegates to the current rung.

The class holds the torch contract (``step``, ``zero_grad``, ``add_param_group``,
``state_dict``/``load_state_dict`` with their hooks, AMP's ``grad_scale``/``found_inf``)
and the engines of the rungs. It steps in two phases (prepare, then commit: see
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
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, TypeVar, cast

import torch

from optladder.compilation import run_eagerly
from optladder.oom import describe_error, is_oom
from optladder.optimizers.adamw import LadderAdamW, distinct_grads, unscale_grads_
from optladder.optimizers.fusedstep import refuse_resized
from optladder.optimizers.migrate import is_bnb_engine
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
    GROUP_PIN_ORIGIN,
    ORIGIN_KEY,
    REASON_KEY,
    RUNG_KEY,
    RUNGS,
    Rung,
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
_FILLED_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "seed",
    "rounding",
    "param_rounding",
)
"""The ``defaults`` that :meth:`LadderOptimizer.add_param_group` fills into a new group
that leaves them out, when they were changed by hand since construction (the engines
fill construction's values; torch's kernel flags stay the engine's)."""
_MISSING = object()


def _same_value(a: object, b: object) -> bool:
    """Whether two ``defaults`` values are the same (a tensor lr: the same object)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # an object whose == raises: changed
        return False


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
        stepped: group numbers (places in ``param_groups``) whose params were stepped.
        partly: group numbers of the engine that failed: some of their params may have
            been stepped.
        not_stepped: group numbers not touched.
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
    it: a method that changes attributes (``zero_grad``'s count, a move's engine and
    decision) must run on the optimizer itself, or its writes land on the wrapper and
    the optimizer Lightning steps never sees them."""

    @functools.wraps(method)
    def on_the_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = self.__dict__.get("_optimizer")
        if isinstance(inner, LadderOptimizer) and inner is not self:
            self = inner
        return method(self, *args, **kwargs)

    return cast(_Method, on_the_optimizer)


class LadderOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that runs the current rung's engine and climbs down the
    ladder when a step runs out of memory.

    The dicts in ``param_groups`` are the engines' own group dicts, and ``state`` is the
    one dict every engine keeps its state in, so an LR scheduler or a trainer that edits
    ``opt.param_groups[i]["lr"]`` edits the engine's group. The object stays the same
    when the rung changes, so references held by schedulers and trainers stay valid.
    Each param group records ``"rung"``, ``"rung_origin"`` and ``"rung_reason"``, saved
    in ``state_dict()``.

    Param groups that pin their own rung (``{"params": emb, "rung": "fp32"}``, as
    bitsandbytes users keep embeddings in 32-bit state; see
    :func:`optladder.rungs.group_pin`) keep their state in that rung's format and never
    move: an out-of-memory step escalates the other groups, those that follow the
    decision. The fp32, bf16 and 8bit rungs are three state formats of one engine
    (:class:`~optladder.optimizers.adamw.LadderAdamW`): a group pinning one of them is a
    group of that engine whatever the others are on. ``rung``, ``engine`` and
    ``decision`` describe the groups that follow the
    decision (``engine`` may hold pinned groups too); the decision's state bytes include
    the pinned groups'.

    Args:
        engine: the optimizer of the groups that follow the decision (built by
            :func:`optladder.optimizers.build_engine`).
        decision: the :class:`optladder.Decision` that chose its rung.
        param_groups: every param group in the user's order (the order of
            ``param_groups`` and of ``state_dict()``): ``engine``'s group dicts, and
            groups that pin their rung, which join ``engine`` in their rung's state
            format.
        max_retries: escalations allowed within one ``step()`` call, ``>= 0``.
        on_escalate: called with each :class:`Escalation`, after the move and before the
            retry.
        defaults: the optimizer's ``defaults`` (torch's meaning: what ``add_param_group``
            fills in), fixed here for the whole run whatever rung the state moves to.

    Raises:
        ValueError: if ``param_groups`` lacks a group of ``engine``, or holds a group
            that neither ``engine`` holds nor pins a rung; a pinned group the rung's
            engine cannot take (naming the group by its place in ``param_groups``).

    Attributes:
        decision: the decision behind the current rung.
        rung: the current rung of the groups that follow the decision.
        engine: their optimizer.
        pinned_engines: per pinned rung, the optimizer of the groups that pin it (the
            engine itself: every rung is a state format of it).
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
        engine: LadderAdamW,
        decision: Decision,
        *,
        param_groups: Sequence[dict[str, Any]],
        max_retries: int = 2,
        on_escalate: Callable[[Escalation], None] | None = None,
        defaults: Mapping[str, Any],
    ) -> None:
        check_max_retries(max_retries)
        self._engine: LadderAdamW | None = None
        self._pinned: dict[Rung, LadderAdamW] = {}
        # id(group) -> the rung it pins, for every group that pins one
        self._pin_rungs: dict[int, Rung] = {}
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
        self._numbered: tuple[Any, ...] = ()  # what _number_params last numbered
        order = list(param_groups)
        held = {id(g) for g in engine.param_groups}
        if not held <= {id(g) for g in order}:
            raise ValueError("param_groups must hold every group dict of the engine")
        pinned: dict[Rung, list[tuple[int, dict[str, Any]]]] = {}
        for gi, group in enumerate(order):
            if id(group) not in held:
                pin = group_pin(group, f"param group {gi}")
                if pin is None:
                    raise ValueError(
                        f"param group {gi} is not one of the engine's groups and pins no rung"
                    )
                pinned.setdefault(pin, []).append((gi, group))
        self._mark_groups(engine.param_groups, decision)
        super().__init__(engine.param_groups, engine.defaults)
        self.defaults = dict(defaults)
        # what the engines fill into a group added without a value: add_param_group
        # fills what the user changed in self.defaults since (torch's semantics)
        self._built_defaults = dict(defaults)
        self.param_groups = order
        self.state = engine.state
        self._attach(engine)
        for pin, indexed in pinned.items():  # one engine per rung, over all its groups
            for (gi, _), held_group in zip(indexed, self._add_pinned(pin, indexed)):
                order[gi] = held_group
        self._params_checked()
        self._warn_unfused()

    # ------------------------------------------------------------------ plumbing
    def _add_pinned(
        self, rung: Rung, indexed: list[tuple[int, dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        """Put groups that pin ``rung`` (each with its place among all groups) on the
        engine, in that rung's state format (every rung is a state format of the one
        engine); returns the engine's dicts of those groups.

        Raises:
            ValueError: ``"param group {gi} pins {rung}: ..."`` when the engine cannot
                take a group's params; nothing is changed then.
        """
        engine = self.engine
        groups = [group for _, group in indexed]
        for gi, group in indexed:
            try:
                check_params_for_rung(group["params"], rung, engine, f"group {gi}")
            except ValueError as exc:
                raise ValueError(f"param group {gi} pins {rung}: {exc}") from None
        places = ", ".join(str(gi) for gi, _ in indexed)
        label = (
            f"param group {places} pins {rung}"
            if len(indexed) == 1
            else (f"param groups {places} pin {rung}")
        )
        try:
            _mark_pinned(groups, rung)
            for group in groups:
                engine.add_param_group(group)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
        held = engine.param_groups[-len(groups) :]
        self._pinned[rung] = engine
        self._pin_rungs.update((id(group), rung) for group in held)
        return held

    def _engines(self, engine: torch.optim.Optimizer | None = None) -> list[torch.optim.Optimizer]:
        """The engine of the groups that follow the decision, then the pinned engines
        (each once: the fp32 and bf16 rungs share one engine)."""
        engines = [self.engine if engine is None else engine, *self._pinned.values()]
        return list({id(e): e for e in engines}.values())

    def _following_groups(self) -> list[dict[str, Any]]:
        """The groups that follow the decision (those that pin no rung), in order."""
        pins = self._pin_rungs
        return [g for g in self.param_groups if id(g) not in pins]

    def _group_rung(self, group: Mapping[str, Any]) -> Rung:
        """The rung ``group``'s state is on: the rung it pins, or the decision's."""
        return self._pin_rungs.get(id(group), self._decision.rung)

    def _share_state(self, engine: LadderAdamW) -> None:
        """Move ``engine``'s state into this optimizer's ``state`` dict and make that its
        state dict: every engine touches only its own params' entries."""
        if engine.state is not self.state:
            self.state.update(engine.state)
            engine.state = self.state

    def _attach(self, engine: LadderAdamW) -> None:
        self._engine = engine
        self._share_state(engine)

    @staticmethod
    def _mark_groups(groups: list[dict[str, Any]], decision: Decision) -> None:
        reason = decision.reasons[-1] if decision.reasons else decision.origin
        for group in groups:
            group[RUNG_KEY] = decision.rung
            group[ORIGIN_KEY] = decision.origin
            group[REASON_KEY] = reason

    @property
    def engine(self) -> LadderAdamW:
        """The current rung's optimizer."""
        assert self._engine is not None
        return self._engine

    @property
    def pinned_engines(self) -> dict[Rung, LadderAdamW]:
        """Per pinned rung, the optimizer of the groups that pin it (a new dict)."""
        return dict(self._pinned)

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

        The group joins the current rung's engine, or, when it pins a rung
        (``param_group["rung"]``), that rung's pinned engine (built when it is the first
        group to pin that rung).

        Values the group leaves out are ``defaults``' (torch's semantics), including
        values set in ``opt.defaults`` by hand after construction.

        Raises:
            ValueError: naming the param or option, what was found and what is allowed;
                a pinned rung that is disabled or unavailable.
        """
        if self._engine is None:  # called by torch.optim.Optimizer.__init__ with the
            self.param_groups.append(param_group)  # engine's groups, which it checked
            return
        group = check_new_group(param_group)
        for key in _FILLED_KEYS:  # torch fills a new group's missing values from defaults
            value = self.defaults.get(key, _MISSING)
            built = self._built_defaults.get(key, _MISSING)
            if key not in group and value is not _MISSING and not _same_value(value, built):
                group[key] = value  # changed by hand since construction: the engines
                # would fill the construction's value
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
        with deferred_interrupts():  # Ctrl-C waits until the group is added everywhere
            if pin is None:
                check_params_for_rung(params, self.rung, self._engine)
                self._mark_groups([group], self._decision)
                self._engine.add_param_group(group)
                self.param_groups.append(self._engine.param_groups[-1])
            else:
                check_pins([*self.param_groups, group], self._decision)
                self.param_groups += self._add_pinned(pin, [(gi, group)])
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
        for engine in self._engines():
            engine.zero_grad(set_to_none=set_to_none)

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

    def _check_group_rungs(self) -> None:
        """Refuse a group whose ``"rung"`` entry was edited by hand: its state is on the
        rung of the engine holding it, and a step or a checkpoint under another name
        would contradict it (a checkpoint saying bf16 beside float32 moments).

        Raises:
            ValueError: naming the group, the value found and the rung its state is on.
        """
        groups = self.param_groups
        if not self._pin_rungs and all(g.get(RUNG_KEY) == self.rung for g in groups):
            return  # the common case
        for gi, group in enumerate(groups):
            rung = self._group_rung(group)
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

    def _check_params(self) -> None:
        """Construction's param checks again when the params changed since they last
        passed: a group's ``"params"`` list edited by hand (a param appended twice, or
        one of a dtype or layout the group's rung cannot take) or a param's ``.data``
        replaced (``module.to(dtype)``, ``module.to(memory_format=...)``, a resize) after
        its state was made. Once per step, in C: every param's identity, byte count and
        contiguity against the last ones checked (a new size, a dtype of another width,
        another memory format; what keeps all three keeps the state's fit: a param given
        other memory of the same size and layout is stepped there). When they changed,
        the engines' step memos are dropped too, so the next prepare checks every grad
        and lays out every moment again.

        Raises:
            ValueError: what construction would say of the params (a param listed twice,
                params sharing memory, a dtype the rung or its engine cannot take), or a
                grad or state tensor of another size than its param
                (:func:`~optladder.optimizers.fusedstep.refuse_resized`), with a note
                that the params changed; nothing is changed.
        """
        flat = list(chain.from_iterable(map(_PARAMS, self.param_groups)))
        sizes = list(map(_NBYTES, flat))
        layouts = self._layouts(flat)
        seen, seen_sizes, seen_layouts = self._checked_params
        if seen is not None and same_objects(flat, seen):
            if seen_sizes is None:  # as construction checked them
                self._checked_params = (flat, sizes, layouts)
                return
            if sizes == seen_sizes and layouts == seen_layouts:
                return
        names = self._group_names()
        place = {id(g): gi for gi, g in enumerate(self.param_groups)}
        try:
            decoupled = bool(self.defaults.get("decoupled_weight_decay", True))
            check_groups(self.param_groups, decoupled)
            refuse_meta_params(self.param_groups)
            for engine in self._engines():
                for group in engine.param_groups:
                    where = f"group {place[id(group)]}"
                    rung = self._group_rung(group)
                    check_params_for_rung(group["params"], rung, engine, where)
                grads = [list(map(grad_of, g["params"])) for g in engine.param_groups]
                refuse_resized(
                    engine,
                    grads,
                    names,
                    local=is_bnb_engine(engine),
                )
        except ValueError as exc:
            raise ValueError(
                f"{exc} (the params changed since the last step: a group's params list was "
                "edited, or a param's .data replaced, e.g. by module.to(dtype))"
            ) from None
        # what passed the step checks before may hold for these params no more (a
        # channels_last param's moments are laid out again, its grads checked again)
        self._memo = None
        self._checked_params = (flat, sizes, layouts)

    def _params_checked(self) -> None:
        """Record the params as construction checked them, so :meth:`_check_params` has
        nothing to do until they change. Their sizes and layouts are read at the first
        step (no state exists before it that a change could misfit), so construction
        reads each param no more than it did."""
        flat = list(chain.from_iterable(map(_PARAMS, self.param_groups)))
        self._checked_params = (flat, None, None)

    def _layouts(self, flat: list[torch.Tensor]) -> list[bool]:
        """Whether each param is contiguous, where a group is in the fp32 format (whose
        torch kernels pair a param's elements with its moments' by memory order; the
        other formats step any layout): empty otherwise."""
        if self.rung != "fp32" and "fp32" not in self._pinned:
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
        """Prepare every engine, agree with the other ranks, commit. Returns None when
        the step committed; otherwise, with nothing committed, ``(reason, rung,
        follow)``: escalate below ``rung`` (an out-of-memory error on some rank; ``rung``
        is the most escalated rank's), or, when ``follow``, move to ``rung`` itself
        (another rank moved there outside a step)."""
        engines = self._engines()
        names = self._group_names()
        self._number_params(engines)
        prepared: list[tuple[torch.optim.Optimizer, list[torch.Tensor]]] = []
        error: BaseException | None = None
        status = STEP_OK
        try:
            self._check_group_rungs()
            self._check_params()
            if self._memo is None:
                self._memo = StepMemo()
            for engine in engines:
                prepared.append((engine, prepare_step(engine, names, self._memo)))
        except BaseException as exc:
            for engine, created in prepared:  # the failing engine rolled itself back
                rollback_step(engine, created, self._memo)
            prepared = []
            error = exc
            status = STEP_OUT_OF_MEMORY if is_oom(exc) else STEP_FAILED
        mine = RUNGS.index(self.rung)
        try:
            # every rank takes part, also one whose prepare failed: none waits for it
            worst, furthest, nearest = agree_step(status, mine, self.device)
        except BaseException:  # a peer died or timed out: nothing of this step stays
            for engine, created in prepared:
                rollback_step(engine, created, self._memo)
            raise
        if worst == STEP_OK and furthest == nearest:
            self._commit(engines, unscale)
            self._warn_unfused()
            return None
        for engine, created in prepared:  # this rank prepared, another did not
            rollback_step(engine, created, self._memo)
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

    def _number_params(self, engines: list[torch.optim.Optimizer]) -> None:
        """Tell each engine that keeps ``param_starts`` (:class:`LadderAdamW`) where its
        groups' params stand over all groups, so that a param's stochastic rounding
        stream (keyed by its index over all groups, :mod:`optladder.optimizers.rounding`)
        is its own when pinned groups live in other engines (each engine had counted
        from 0, so a pinned group's first param shared the first decided param's
        stream). With one engine holding the groups in their order (no pin, or none
        added after construction) its own count is that index already."""
        groups = self.param_groups
        if len(engines) == 1 and same_objects(engines[0].param_groups, groups):
            if getattr(engines[0], "param_starts", None) is not None:
                engines[0].param_starts = None  # type: ignore[attr-defined]
            return
        key = (
            tuple(map(id, groups)),
            tuple(len(g["params"]) for g in groups),
            tuple(map(id, engines)),
        )
        if key == self._numbered:
            return
        first: dict[int, int] = {}
        start = 0
        for group in groups:
            first[id(group)] = start
            start += len(group["params"])
        for engine in engines:
            if hasattr(engine, "param_starts"):
                engine.param_starts = [first[id(g)] for g in engine.param_groups]
        self._numbered = key

    def _group_names(self) -> dict[int, str]:
        """``id(group) -> "group {place}"`` for messages, kept while the groups are."""
        key = tuple(map(id, self.param_groups))
        if self._names[0] != key:
            self._names = (key, {gid: f"group {gi}" for gi, gid in enumerate(key)})
        return self._names[1]

    def _commit(
        self,
        engines: list[torch.optim.Optimizer],
        unscale: tuple[list[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        """Run every engine's commit (they allocate nothing), with Ctrl-C held back until
        all are done, after dividing the grads of ``unscale`` (the distinct grads,
        :meth:`_grads_to_unscale`) by its ``grad_scale``, when given. Should one fail
        anyway, record which groups were written (``partial_step``) and raise
        :class:`PartialStepError` (a KeyboardInterrupt or other ``BaseException`` is
        re-raised as it is, after the record)."""
        self._commits += 1  # before the first write: Ladder must never rerun this step
        done: list[torch.optim.Optimizer] = []
        try:
            with deferred_interrupts():
                if unscale is not None:
                    unscale_grads_(*unscale)
                for engine in engines:
                    commit_step(engine, self._memo)
                    done.append(engine)
        except BaseException as exc:
            if len(done) == len(engines):  # Ctrl-C held back until the step was whole
                self._steps += 1
                self.partial_step = None
                raise
            failing = engines[len(done)]
            place = {id(g): gi for gi, g in enumerate(self.param_groups)}

            def places(es: list[torch.optim.Optimizer]) -> list[int]:
                return sorted(place[id(g)] for e in es for g in e.param_groups)

            stepped, partly = places(done), places([failing])
            rest = places(engines[len(done) + 1 :])
            error = PartialStepError(
                f"the optimizer step failed in its commit ({describe_error(exc)}) after it "
                f"had written params: param groups {stepped} were stepped, {partly} may be "
                f"partly stepped, {rest} were not. The step is not retried (that would step "
                "the written params twice); resume from a checkpoint to continue exactly.",
                stepped,
                partly,
                rest,
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
        rung: the decision's, a pinned rung's, and those of params an engine stepped
        eagerly."""
        reasons: list[tuple[Rung, str]] = []
        if not self._decision.fused:
            reasons.append((self.rung, self._decision.unfused_reason or ""))
        rungs: list[Rung] | None = None  # per param over all groups, its group's rung
        for rung, engine in [(self.rung, self.engine), *self._pinned.items()]:
            if engine is self.engine and rung != self.rung:
                continue  # a pin on the decision's engine: its reasons are listed once
            eager = getattr(engine, "eager_reasons", {})
            if eager and isinstance(engine, LadderAdamW):  # indices over all groups: each
                if rungs is None:  # reason under the rung of its param's group
                    groups = self.param_groups
                    rungs = [self._group_rung(g) for g in groups for _ in g["params"]]
                said = {(rungs[i] if i < len(rungs) else rung, r) for i, r in eager.items()}
                reasons += sorted(said)
                continue
            reasons += [(rung, reason) for reason in sorted(set(eager.values()))]
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
        Every rung is a state format of one engine: the state is converted in place
        and no engine is built. Groups that pin their rung stay where they are.

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
        the engine keeps it, and this optimizer's engine flags (``fused``, ``foreach``)
        are kept. Sharded 8-bit state saved per row (by :meth:`state_dict` under FSDP2)
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
        """Refused: the optimizer holds its engines and a build function, which a copy
        could not share. Save ``state_dict()`` and load it into a new optimizer.

        Raises:
            TypeError: always (``pickle``, ``copy.deepcopy``).
        """
        raise TypeError(
            f"an optladder {type(self).__name__} cannot be pickled or deep-copied; save "
            "opt.state_dict() and load it into a new one (load_state_dict)"
        )

    def __repr__(self) -> str:
        """torch's optimizer repr (every group's options but ``params``, keys sorted,
        ``rung`` among them) after a header with the rung, whether it is fused, and the
        engines."""
        fused = "fused" if self.decision.fused else "not fused"
        engine = type(self.engine).__name__
        pinned = "".join(
            f", pinned {rung}: {type(e).__name__} "
            f"({sum(self._pin_rungs.get(id(g)) == rung for g in e.param_groups)} groups)"
            for rung, e in self._pinned.items()
        )
        name = type(self).__name__
        groups = super().__repr__().removeprefix(f"{name} (")
        return f"{name} (rung={self.rung!r}, {fused}, engine={engine}{pinned}{groups}"


def _mark_pinned(groups: list[dict[str, Any]], rung: Rung) -> None:
    """Record in each group that it pins ``rung`` (the form :func:`group_pin` reads)."""
    for group in groups:
        group[RUNG_KEY] = rung
        group[ORIGIN_KEY] = GROUP_PIN_ORIGIN
        group[REASON_KEY] = _PIN_REASON
