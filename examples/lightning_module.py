"""A PyTorch Lightning module whose ``configure_optimizers`` returns an optladder
optimizer and a per-step LR scheduler.

Trains a 64-256-256-10 MLP on the UCI handwritten digits (scikit-learn's ``load_digits``)
with Lightning's automatic optimization and a ``OneCycleLR`` schedule stepped every batch.

How the ladder's retry fits Lightning's loop:

- Lightning wraps the optimizer in a ``LightningOptimizer`` and calls
  ``optimizer.step(closure=...)``, where the closure runs ``training_step``, ``zero_grad``
  and ``backward``. The optladder optimizer runs the closure once, then steps; an OOM in
  the step is rolled back, the state moves one rung down (fp32 -> bf16 -> 8bit) and the
  step is retried with the closure's grads (the closure is not run again). Nothing in the
  module is needed for that.
- An OOM in forward or backward escapes the closure, and so ``optimizer.step``. The
  module overrides the ``optimizer_step`` hook to call ``optimizer.step(closure=...)``
  through ``optladder.integrations.lightning.ladder_optimizer_step`` (or mix in its
  ``LadderStep``), which uses :class:`optladder.Ladder`: on such an OOM the grads are
  zeroed, the RNG state
  restored, the optimizer moved one rung down and the step rerun, closure included, on
  the same batch. This covers one batch, so keep ``accumulate_grad_batches=1`` (with
  accumulation, Lightning runs the window's earlier closures outside ``optimizer_step``).
- The scheduler holds the optladder object, which stays the same across a move, so the
  schedule goes on; Lightning steps it after each optimizer step (``"interval": "step"``).
- Lightning moves the module to its device before ``configure_optimizers``, so the rung
  is gated on that device's free memory. A checkpoint (``trainer.save_checkpoint``)
  records the rung; ``fit(..., ckpt_path=...)`` moves a policy-chosen optimizer to the
  rung the checkpoint had escalated to.

Needs ``lightning`` (the ``integrations`` extra: ``pip install -c torch-pin.txt -e
".[integrations]"`` in the clone, ``torch-pin.txt`` as README's "Install into your own
environment" makes it; ``make test``'s venv has it). Run it::

    python examples/lightning_module.py --epochs 3
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

from optladder import LadderOptimizer, choose_optimizer
from optladder.demo import load_digits_split
from optladder.integrations.lightning import ladder_optimizer_step


class DigitsModule(L.LightningModule):
    """A 64-256-256-10 MLP classifying the digits, optimized by an optladder AdamW.

    Args:
        lr: OneCycleLR's peak learning rate.
        total_steps: the schedule's length in optimizer steps.
        rung: fix the rung (``"fp32"``, ``"bf16"``, ``"8bit"``); None lets the policy choose.
        free_memory: bytes the run may use (e.g. ``"2MiB"``); None probes the device.
        seed: seeds the weights.

    Attributes:
        opt: the optladder optimizer (set by ``configure_optimizers``).
        losses: the training loss of every step.
        rungs: the rung after every step.
        lrs: the learning rate every step ran with.
    """

    def __init__(
        self,
        lr: float = 1e-2,
        total_steps: int = 69,
        rung: str | None = None,
        free_memory: int | str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        self.lr = lr
        self.total_steps = total_steps
        self.rung = rung
        self.free_memory = free_memory
        self.opt: LadderOptimizer | None = None
        self.losses: list[float] = []
        self.rungs: list[str] = []
        self.lrs: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, 10)`` of images ``(batch, 64)``."""
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        """Cross-entropy of one batch."""
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        """The optladder optimizer and a OneCycleLR stepped every batch."""
        self.opt = choose_optimizer(
            self, lr=self.lr, weight_decay=0.01, rung=self.rung, free_memory=self.free_memory
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.opt, max_lr=self.lr, total_steps=self.total_steps
        )
        return {
            "optimizer": self.opt,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """Lightning's optimizer step (closure: forward, ``zero_grad``, backward), rerun
        one rung down when the closure runs out of memory."""
        assert self.opt is not None
        self.lrs.append(self.opt.param_groups[0]["lr"])
        ladder_optimizer_step(self, optimizer, optimizer_closure)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Record the step's loss and the rung it ended on."""
        assert self.opt is not None
        self.losses.append(float(outputs["loss"]))
        self.rungs.append(self.opt.rung)


def digits_loader(batch_size: int = 64, seed: int = 0) -> torch.utils.data.DataLoader[Any]:
    """The 1,437 training digits, shuffled with ``seed``."""
    x_train, y_train, _, _ = load_digits_split(seed)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train, y_train),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


def evaluate_accuracy(module: DigitsModule, seed: int = 0) -> float:
    """Fraction of the 360 test digits the module classifies right."""
    _, _, x_test, y_test = load_digits_split(seed)
    module.eval()
    with torch.no_grad():
        return (module(x_test).argmax(1) == y_test).float().mean().item()


def fit(
    module: DigitsModule,
    *,
    epochs: int = 3,
    batch_size: int = 64,
    limit_train_batches: int | float | None = None,
    seed: int = 0,
    quiet: bool = True,
    ckpt_path: str | Path | None = None,
) -> L.Trainer:
    """Fit ``module`` on the digits on the CPU, without automatic checkpoints or loggers
    (``trainer.save_checkpoint(path)`` still saves one; ``ckpt_path`` resumes from one).

    Returns:
        The ``lightning.Trainer`` that ran.
    """
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        limit_train_batches=limit_train_batches,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=not quiet,
        enable_model_summary=not quiet,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, digits_loader(batch_size, seed), ckpt_path=ckpt_path)
    return trainer


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: fit and print the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rung", choices=("fp32", "bf16", "8bit"), default=None)
    parser.add_argument("--free-memory", default=None, help='e.g. "2MiB"; default: probed')
    args = parser.parse_args(argv)
    steps = args.epochs * len(digits_loader())
    module = DigitsModule(total_steps=steps, rung=args.rung, free_memory=args.free_memory)
    fit(module, epochs=args.epochs, quiet=False)
    assert module.opt is not None
    print(module.opt.decision.summary())
    print(
        f"{len(module.losses)} steps; loss {module.losses[0]:.4f} -> {module.losses[-1]:.4f}; "
        f"test accuracy {evaluate_accuracy(module):.2%}; rung {module.opt.rung}"
    )


if __name__ == "__main__":
    main()
