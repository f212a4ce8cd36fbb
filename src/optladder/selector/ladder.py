"""Guarding a whole train step: rerun it one rung down when forward or backward runs out
of memory.

An OOM inside the optimizer step is handled by :class:`LadderOptimizer` itself (the step
is retried, grads kept). An OOM in forward or backward escapes the train step: the
:class:`Ladder` then zeroes the grads, restores torch's RNG state (so dropout draws
repeat), empties the allocator's cache, escalates the optimizer one rung (its state
shrinks, leaving room for activations) and reruns the step.

The wrapped function must cover the whole gradient-accumulation window (every forward
and backward that adds into the grads, then ``optimizer.step()``): a rerun starts from
zeroed grads.

Under DDP or FSDP an OOM in forward or backward on one rank cannot be recovered in the
process: the other ranks wait in a collective that never completes. There the recovery
is the rung stored in the checkpoint plus an elastic restart (``torchrun``): the resumed
optimizer moves to the rung the checkpoint had escalated to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from optladder.policies.decision import escalation_target
from optladder.selector.checks import check_max_retries
from optladder.selector.oom import describe_error, is_oom
from optladder.selector.optimizer import LadderOptimizer, OptimizerOutOfMemoryError

P = ParamSpec("P")
T = TypeVar("T")


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class Ladder:
    """Runs train steps so that an out-of-memory error moves the optimizer one rung
    down and reruns the step, instead of ending the run.

    Args:
        optimizer: the optladder optimizer from :func:`optladder.choose_optimizer`.
        max_retries: reruns allowed per call, ``>= 0`` (each moves one rung).

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

    def __init__(self, optimizer: LadderOptimizer, *, max_retries: int = 2) -> None:
        if not isinstance(optimizer, LadderOptimizer):
            raise TypeError(
                f"optimizer must be an optladder optimizer (from choose_optimizer), got "
                f"{type(optimizer).__name__}"
            )
        check_max_retries(max_retries)
        self.optimizer = optimizer
        self.max_retries = max_retries

    def run(self, train_step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Call ``train_step(*args, **kwargs)``; on an OOM in it, escalate and rerun.

        Returns:
            What ``train_step`` returned.

        Raises:
            OptimizerOutOfMemoryError: out of memory with no rung left (the original
                error chained), or ``max_retries`` reruns used up.
            Anything else ``train_step`` raises, unchanged.
        """
        retries = 0
        while True:
            rng = _rng_state()
            message = None
            try:
                return train_step(*args, **kwargs)
            except OptimizerOutOfMemoryError:
                raise  # the optimizer already climbed as far as it could
            except BaseException as exc:
                if not is_oom(exc):
                    raise
                target, why = escalation_target(self.optimizer.decision)
                if retries >= self.max_retries or target is None:
                    if target is not None:
                        why = f"{retries} reruns already (max_retries={self.max_retries})"
                    raise self.optimizer.out_of_memory_error(
                        f"out of memory in the train step ({describe_error(exc)}); {why}"
                    ) from exc
                message = describe_error(exc)
                exc.__traceback__ = None
            # Outside the except block: the failed attempt's frames and tensors are gone.
            retries += 1
            self.optimizer.zero_grad(set_to_none=True)
            _set_rng_state(rng)
            self.optimizer.escalate(f"out of memory in forward/backward ({message})")

    def guard(self, train_step: Callable[P, T]) -> Callable[P, T]:
        """Decorator form of :meth:`run`; keeps the function's name, docstring and
        signature (``functools.wraps``)."""

        @functools.wraps(train_step)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
            return self.run(train_step, *args, **kwargs)

        return guarded

    def __repr__(self) -> str:
        return f"Ladder(rung={self.optimizer.rung!r}, max_retries={self.max_retries})"
