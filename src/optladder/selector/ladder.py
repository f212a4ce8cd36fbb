"""Guarding a whole train step: rerun it one rung down when forward or backward runs out
of memory.

An OOM inside the optimizer step is handled by :class:`LadderOptimizer` itself (the step
is retried, grads kept). An OOM in forward or backward escapes the train step: the
:class:`Ladder` then zeroes the grads, restores torch's RNG state (so dropout draws
repeat), resets a ``torch.amp.GradScaler``'s record of the optimizer, empties the
allocator's cache, escalates the optimizer one rung (its state shrinks, leaving room for
activations) and reruns the step. The rules:

- A train step is rerun only if no optimizer step was committed in it
  (``LadderOptimizer.committed_steps`` is compared before and after), nor any other
  optimizer's (a GAN's discriminator, a second optimizer over other params: torch's global
  step post-hook sees each one's ``step()`` during the call). An OOM after a commit (an
  EMA update, a metric, the generator's backward) is not rerun: the optimizer escalates
  for the next step, the committed updates stand once, and :meth:`Ladder.run` returns
  None.
- It escalates only where that can help: when torch's message says how much the failed
  allocation asked for, and moving the optimizer as far down as it may go would free
  less, it raises :class:`OptimizerOutOfMemoryError` naming both and leaves the rung.
- Grads accumulated before the call are not zeroed silently: when the previous call
  asked for no optimizer step (none committed, none skipped by a ``GradScaler`` for an
  inf/NaN grad: ``LadderOptimizer.step_requests``) and left grads, none was committed
  since, and this call added into those grads (no ``opt.zero_grad()`` in it, and they
  are not all zeros: a ``model.zero_grad(set_to_none=False)`` leaves nothing to lose),
  the OOM is re-raised as :class:`OptimizerOutOfMemoryError` saying so, and nothing
  moves. Guard the whole accumulation window instead. (A call whose step the scaler skipped is a
  whole train step: its grads are spent, and a rerun of the next call loses nothing.)

Under ``torch.distributed`` the rank that ran out of memory moves down alone; the next
optimizer step's all-reduce tells the other ranks, which follow it before any rank
commits (see :meth:`LadderOptimizer.step`), so every rank steps on one rung. That holds
where the rerun train step meets the other ranks' collectives in order (DDP: the
rerun's backward joins their gradient all-reduce). Where an OOM leaves the other ranks
waiting in a collective the failed rank never reaches (FSDP's all-gathers in the
forward), the recovery is the rung stored in the checkpoint plus an elastic restart
(``torchrun``): the resumed optimizer moves to the rung the checkpoint had escalated to.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from optladder.compilation import run_eagerly
from optladder.oom import describe_error, is_oom, requested_bytes
from optladder.policies.decision import Decision, escalation_target
from optladder.rungs import Rung
from optladder.selector.checks import check_max_retries
from optladder.selector.optimizer import (
    LadderOptimizer,
    OptimizerOutOfMemoryError,
    PartialStepError,
)
from optladder.units import format_bytes

logger = logging.getLogger("optladder")

P = ParamSpec("P")
T = TypeVar("T")


def _holds_values(p: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` (a grad seen at a call's start) is still ``p``'s grad and holds a
    nonzero value."""
    return grad is not None and grad is p.grad and bool(grad.any())


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _cheapest_reachable(decision: Decision) -> tuple[Rung, int]:
    """The rung escalation may reach from ``decision.rung`` with the smallest state, and
    the state bytes moving there frees (0 when none is smaller)."""
    best: Rung = decision.rung
    rung: Rung = decision.rung
    while True:
        target, _ = escalation_target(decision.model_copy(update={"rung": rung}))
        if target is None:
            return best, decision.state_bytes[decision.rung] - decision.state_bytes[best]
        rung = target
        if decision.state_bytes[rung] < decision.state_bytes[best]:
            best = rung


class Ladder:
    """Runs train steps so that an out-of-memory error moves the optimizer one rung
    down and reruns the step, instead of ending the run (the rules are in this module's
    docstring and in README's "The OOM ladder").

    Args:
        optimizer: the optladder optimizer from :func:`optladder.choose_optimizer`, or a
            framework's wrapper around it (accelerate's ``AcceleratedOptimizer``,
            Lightning's ``self.optimizers()``): the Ladder works on the optimizer inside
            (:func:`unwrap_optimizer`; ``.optimizer`` is that one).
        max_retries: reruns allowed per call, ``>= 0`` (each moves one rung).
        scaler: the ``torch.amp.GradScaler`` the train step uses, if any: its record of
            this optimizer (``unscale_`` already called) is reset before a rerun, so the
            rerun's ``scaler.unscale_(opt)`` works.

    Raises:
        TypeError: ``optimizer`` is no optladder optimizer nor holds one (naming what it
            holds); ``scaler`` is not a GradScaler.

    Example::

        ladder = Ladder(opt)

        @ladder.guard
        def train_step(batch):
            opt.zero_grad()
            loss = model(batch).mean()
            loss.backward()
            opt.step()
            return loss.item()

        for batch in loader:
            train_step(batch)        # or: ladder.run(train_step_fn, batch)
    """

    def __init__(
        self,
        optimizer: object,
        *,
        max_retries: int = 2,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        try:  # Lightning's wrapper is an instance of the class, holding a copy of it
            optimizer = unwrap_optimizer(optimizer)
        except TypeError as exc:
            raise TypeError(f"optimizer: {exc}") from None
        check_max_retries(max_retries)
        if scaler is not None and not hasattr(scaler, "_per_optimizer_states"):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.optimizer = optimizer
        self.max_retries = max_retries
        self.scaler = scaler
        # committed_steps when the last call returned having committed no step (its grads
        # may be a micro-batch's, to be added to); None after a call that committed one
        self._accumulating_at: int | None = None
        # other optimizers' steps during a call (None between calls), seen by a global
        # step post-hook registered once (per call, it made torch.compile recompile
        # compiled train steps holding a torch optimizer's step) and removed with self
        self._others: list[str] | None = None
        watch = register_optimizer_step_post_hook(_other_steps(weakref.ref(self)))
        weakref.finalize(self, watch.remove)

    def run(self, train_step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """Call ``train_step(*args, **kwargs)``; on an OOM in it, escalate and rerun.

        Returns:
            What ``train_step`` returned; None when it ran out of memory after its
            optimizer step committed (the step is not rerun; the optimizer escalated
            for the next one).

        Raises:
            OptimizerOutOfMemoryError: out of memory with no rung left (the original
                error chained), ``max_retries`` reruns used up, an escalation that cannot
                free what the failed allocation asked for, or grads accumulated before
                the call that a rerun would lose.
            PartialStepError: the optimizer's commit failed part-way (never rerun).
            Anything else ``train_step`` raises, unchanged.
        """
        opt = self.optimizer
        retries = 0
        while True:
            rng = _rng_state()
            committed, zeroed = opt.committed_steps, opt.zero_grad_calls
            requested = opt.step_requests
            entry = [
                (p, weakref.ref(p.grad))
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
            message = None
            others: list[str] = []  # other optimizers' steps taken in this call
            self._others = others
            try:
                result = train_step(*args, **kwargs)
                # a call that asked for no step (none committed, none skipped by a
                # GradScaler) may be a micro-batch: the next call may add into its grads
                self._accumulating_at = committed if opt.step_requests == requested else None
                return result
            except (OptimizerOutOfMemoryError, PartialStepError):
                raise  # the optimizer already climbed as far as it could / no rerun
            except BaseException as exc:
                if not is_oom(exc):
                    raise
                message = describe_error(exc)
                if opt.committed_steps != committed or others:
                    # a rerun would step them twice (a GAN's discriminator, a second
                    # optimizer's params): the updates stand once, as after a commit
                    self._accumulating_at = None
                    note = None
                    if opt.committed_steps == committed:
                        note = (
                            f"after {len(others)} step(s) of another optimizer "
                            f"({', '.join(sorted(set(others)))}) in this train step (they "
                            "stand once; the train step is not rerun, so this optimizer "
                            "takes no step for it)"
                        )
                    self._escalate_after_commit(exc, message, note)
                    return None
                if opt.zero_grad_calls == zeroed and self._accumulating_at == committed:
                    # grads this call found and still holds, with values (grads zeroed in
                    # place, by model.zero_grad(set_to_none=False), lose nothing)
                    kept = sum(_holds_values(p, ref()) for p, ref in entry)
                    if kept:
                        raise opt.out_of_memory_error(
                            f"out of memory in the train step ({message}); {kept} params "
                            "had grads from before this call that it added into (gradient "
                            "accumulation), so a rerun would lose them or count this "
                            "micro-batch twice: nothing was rerun and the rung stays. Guard "
                            "the whole accumulation window (zero_grad, every micro-batch's "
                            "forward and backward, opt.step) in one call"
                        ) from exc
                self._check_can_help(exc, message, retries)
                exc.__traceback__ = None
            finally:
                self._others = None
            # Outside the except block: the failed attempt's frames and tensors are gone.
            del entry
            retries += 1
            opt.zero_grad(set_to_none=True)
            self._reset_scaler()
            _set_rng_state(rng)
            opt.escalate(f"out of memory in forward/backward ({message})")

    def _check_can_help(self, exc: BaseException, message: str, retries: int) -> None:
        """Raise unless escalating one rung and rerunning may get past ``exc``."""
        opt = self.optimizer
        target, why = escalation_target(opt.decision)
        if retries >= self.max_retries or target is None:
            if target is not None:
                why = f"{retries} reruns already (max_retries={self.max_retries})"
            raise opt.out_of_memory_error(
                f"out of memory in the train step ({message}); {why}"
            ) from exc
        asked = requested_bytes(exc)
        cheapest, freed = _cheapest_reachable(opt.decision)
        if asked is not None and asked > freed:
            state = opt.decision.state_bytes[opt.rung]
            raise opt.out_of_memory_error(
                f"out of memory in the train step ({message}): the failed allocation asked "
                f"for {asked:,} bytes ({format_bytes(asked)}), but moving the optimizer "
                f"from {opt.rung} down to {cheapest} would free only {freed:,} bytes "
                f"({format_bytes(freed)}) of its {state:,}-byte ({format_bytes(state)}) "
                "state, so the rung stays. Make room elsewhere: a smaller batch, activation "
                "checkpointing, shorter sequences, or autocast"
            ) from exc

    def _escalate_after_commit(
        self, exc: BaseException, message: str, note: str | None = None
    ) -> None:
        """An OOM after the train step's optimizer step committed, or another optimizer's
        step (``note`` says so): no rerun (it would step twice); escalate for the next
        step where that can help, else raise."""
        opt = self.optimizer
        if note is None:
            note = "after the optimizer step committed (the step stands once and is not rerun)"
        try:
            self._check_can_help(exc, f"{message}, {note}", 0)
        except OptimizerOutOfMemoryError as err:
            raise err from exc
        exc.__traceback__ = None
        self._reset_scaler()
        event = opt.escalate(f"out of memory {note} ({message})")
        logger.warning(
            "optladder: the train step ran out of memory %s; not rerun; %s -> %s for the "
            "next step; Ladder.run returns None",
            note,
            event.from_rung,
            event.to_rung,
        )

    def _reset_scaler(self) -> None:
        """Forget the GradScaler's per-step record of this optimizer (``unscale_`` done,
        inf checks), as its ``update()`` does, so the rerun can unscale again."""
        if self.scaler is not None:
            self.scaler._per_optimizer_states.pop(id(self.optimizer), None)

    def guard(self, train_step: Callable[P, T]) -> Callable[P, T | None]:
        """Decorator form of :meth:`run`; keeps the function's name, docstring and
        signature (``functools.wraps``).

        Raises:
            TypeError: ``train_step`` is not callable (refused here, not at the first
                call of what it returns).
        """
        if not callable(train_step):
            raise TypeError(
                f"Ladder.guard takes the train step function, got {type(train_step).__name__}"
                " (use @ladder.guard over a def, or ladder.guard(train_step))"
            )

        @functools.wraps(train_step)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> T | None:
            return self.run(train_step, *args, **kwargs)

        return guarded

    def __repr__(self) -> str:
        return f"Ladder(rung={self.optimizer.rung!r}, max_retries={self.max_retries})"


def _other_steps(
    ladder: weakref.ref[Ladder],
) -> Callable[[torch.optim.Optimizer, tuple[object, ...], dict[str, object]], None]:
    """A global optimizer step post-hook (torch calls it after every optimizer's
    successful ``step()``) that, while ``ladder`` runs a train step, appends to its
    ``_others`` the class name of each optimizer that stepped other than its optimizer."""

    @run_eagerly  # in a compiled train step, torch's optimizers call it from traced code
    def hook(
        optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        owner = ladder()
        if owner is None or owner._others is None:
            return
        opt = owner.optimizer
        if optimizer is opt:
            return
        owner._others.append(type(optimizer).__name__)

    return hook


def unwrap_optimizer(optimizer: object) -> LadderOptimizer:
    """The optladder optimizer inside a framework's wrappers.

    Follows ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``) to the innermost optladder optimizer: a
    ``LightningOptimizer`` is an instance of a subclass of its optimizer's class that
    reads the optimizer's attributes; attributes written on it would stay on it.

    :class:`Ladder` takes what it is given through this; the integrations too
    (:func:`optladder.integrations.unwrap_optimizer` is this function).

    Args:
        optimizer: an optladder optimizer, or a wrapper around one.

    Raises:
        TypeError: if there is no optladder optimizer inside, naming what was found.
    """
    seen, found = optimizer, None
    for _ in range(8):  # wrappers nest a few levels at most
        if isinstance(seen, LadderOptimizer):
            found = seen  # a wrapper may subclass it (LightningOptimizer does): go deeper
        inner = getattr(seen, "optimizer", None)
        if inner is None or inner is seen:
            break
        seen = inner
    if found is not None:
        return found
    raise TypeError(
        "expected an optladder optimizer (optladder.AdamW or choose_optimizer's), or a "
        f"wrapper around one; got "
        f"{type(optimizer).__name__} holding {type(seen).__name__}"
    )
