"""PyTorch Lightning with an optladder optimizer.

``configure_optimizers`` returns ``optladder.AdamW(self.parameters(), ...)`` (or
LightningCLI builds it from ``--optimizer optladder.AdamW``). Lightning calls
``optimizer.step(closure=...)``, where the closure runs ``training_step``, ``zero_grad``
and ``backward``: the optimizer runs the closure once, and an OOM in the step is rolled
back, the state moved one rung down and the step retried with the closure's grads.

An OOM in forward or backward escapes the closure. :class:`LadderStep` (a mixin) or
:func:`ladder_optimizer_step` (for your own ``optimizer_step``) run the step through
:class:`optladder.Ladder`: the grads are zeroed, the RNG state restored, the optimizer
moved one rung down and the step rerun, closure included, on the same batch. That covers
one batch, so ``accumulate_grad_batches`` must be 1.

A checkpoint (``trainer.save_checkpoint``) records the rung; ``fit(..., ckpt_path=...)``
moves a policy-chosen optimizer to the rung the checkpoint had escalated to.

Importing this module imports ``lightning``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L

from optladder.integrations import unwrap_optimizer
from optladder.selector.ladder import Ladder

__all__ = ["LadderStep", "ladder_optimizer_step"]


def ladder_optimizer_step(
    module: L.LightningModule, optimizer: Any, optimizer_closure: Callable[[], Any] | None
) -> Any:
    """Lightning's optimizer step (``optimizer.step(closure=optimizer_closure)``), rerun
    one rung down when the closure (forward, ``zero_grad``, backward) runs out of memory.

    Call it from a ``LightningModule.optimizer_step`` override.

    Args:
        module: the LightningModule (keeps the :class:`optladder.Ladder`).
        optimizer: what Lightning passes (a ``LightningOptimizer`` around optladder's).
        optimizer_closure: what Lightning passes.

    Returns:
        What ``optimizer.step`` returned.

    Raises:
        TypeError: if the optimizer is not optladder's.
        ValueError: if the trainer accumulates grads over more than one batch.
    """
    trainer = module._trainer  # None outside a fit: then there is nothing to accumulate
    accumulation = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulation > 1:
        raise ValueError(
            "a rerun starts from zeroed grads and covers one batch, so it would drop the "
            f"accumulation window's earlier batches; got accumulate_grad_batches="
            f"{accumulation}. Use 1, or a plain optimizer_step (OOMs in the optimizer step "
            "are still handled)"
        )
    inner = unwrap_optimizer(optimizer)
    ladder = module.__dict__.get("_optladder_ladder")
    if ladder is None or ladder.optimizer is not inner:
        ladder = Ladder(inner)
        module.__dict__["_optladder_ladder"] = ladder
    return ladder.run(optimizer.step, closure=optimizer_closure)


class LadderStep:
    """Mixin for a ``LightningModule`` (``class Net(LadderStep, L.LightningModule)``):
    its ``optimizer_step`` is :func:`ladder_optimizer_step`."""

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """Lightning's hook: the step, rerun one rung down on a forward/backward OOM."""
        if not isinstance(self, L.LightningModule):
            raise TypeError(
                f"LadderStep is a mixin for a LightningModule; {type(self).__name__} is not one"
            )
        ladder_optimizer_step(self, optimizer, optimizer_closure)
