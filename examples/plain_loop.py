"""A plain PyTorch training loop with an LR scheduler and the OOM ladder.

Trains a 64-256-256-10 MLP on the UCI handwritten digits (scikit-learn's ``load_digits``)
with an optimizer from :func:`optladder.choose_optimizer`, a warmup-then-cosine
``LambdaLR`` schedule, and a :class:`optladder.Ladder` guarding the train step.

How the ladder's retry fits this loop:

- An OOM inside ``opt.step()`` is handled by the optimizer itself: the step is rolled
  back, the state moves one rung down (fp32 -> bf16 -> 8bit) and the step is retried with
  the same grads. ``train_step`` never sees the error.
- An OOM in forward or backward escapes ``opt.step()``; the ``Ladder`` catches it, zeroes
  the grads, restores torch's RNG state, moves the optimizer one rung down and reruns the
  whole ``train_step`` on the same batch. So the guarded function must contain the whole
  gradient-accumulation window (here: one batch).
- ``scheduler.step()`` runs once per batch, outside the guard: a retried step is still
  one step of the schedule. The optimizer object never changes (only its state format does), so
  the scheduler keeps driving the learning rate across an escalation.

Run it::

    python examples/plain_loop.py --epochs 3
    python examples/plain_loop.py --rung bf16
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from optladder import Escalation, Ladder, LadderOptimizer, choose_optimizer
from optladder.demo import load_digits_split


def make_model(seed: int = 0) -> nn.Module:
    """The 64-256-256-10 MLP (85,002 params), initialized from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """The LR multiplier at scheduler step ``step``: linear warmup from
    ``1 / warmup_steps`` to 1 over ``warmup_steps`` steps, then a cosine decay to 0 at
    ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    """What :func:`train` ran and reached.

    Attributes:
        optimizer: the optladder optimizer (one object for the whole run).
        scheduler: the LR scheduler driving it.
        losses: the training loss of every step, in order.
        lrs: the learning rate each step ran with.
        rungs: the rung each step ended on.
        escalations: the moves down the ladder, in order.
        test_accuracy: fraction of test images classified right at the end.
    """

    optimizer: LadderOptimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    rungs: list[str] = field(default_factory=list)
    escalations: list[Escalation] = field(default_factory=list)
    test_accuracy: float = 0.0


def train(
    *,
    epochs: int = 3,
    batch_size: int = 64,
    lr: float = 1e-2,
    warmup_steps: int = 10,
    weight_decay: float = 1e-2,
    rung: str | None = None,
    free_memory: int | str | None = None,
    model: nn.Module | None = None,
    device: str = "cpu",
    seed: int = 0,
    verbose: bool = False,
) -> TrainResult:
    """Train the MLP on the digits; return the losses, the LR and rung of every step.

    Args:
        epochs: passes over the 1,437 training images.
        batch_size: images per step.
        lr: the peak learning rate (reached after ``warmup_steps``).
        warmup_steps: steps of linear warmup before the cosine decay.
        weight_decay: AdamW's decoupled weight decay.
        rung: fix the rung (``"fp32"``, ``"bf16"``, ``"8bit"``); None lets the policy choose.
        free_memory: bytes the run may use (e.g. ``"2MiB"``); None probes the device.
        model: the model to train (default :func:`make_model`); its forward gets a
            ``(batch, 64)`` float tensor and returns ``(batch, 10)`` logits.
        device: where to train (``"cpu"``, ``"cuda"``); its free memory gates the rung.
        seed: seeds the model (when built here), the data split and the shuffling.
        verbose: print the decision, each escalation and per-epoch results.
    """
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits_split(seed))
    model = (make_model(seed) if model is None else model).to(device)  # before choosing
    steps_per_epoch = math.ceil(len(y_train) / batch_size)
    total_steps = epochs * steps_per_epoch

    def report(event: Escalation) -> None:
        if verbose:
            print(f"escalated {event.from_rung} -> {event.to_rung} after {event.step} steps")

    opt = choose_optimizer(
        model,
        lr=lr,
        weight_decay=weight_decay,
        rung=rung,
        free_memory=free_memory,
        on_escalate=report,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: warmup_cosine(step, warmup_steps, total_steps)
    )
    ladder = Ladder(opt)
    result = TrainResult(optimizer=opt, scheduler=scheduler)
    if verbose:
        print(opt.decision.summary())

    @ladder.guard
    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # an OOM here is retried inside step(), one rung down
        return loss.item()

    gen = torch.Generator().manual_seed(seed)  # a CPU generator: the order is device-free
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(y_train), generator=gen).to(device)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            result.lrs.append(opt.param_groups[0]["lr"])
            result.losses.append(train_step(x_train[idx], y_train[idx]))
            result.rungs.append(opt.rung)
            scheduler.step()
        if verbose:
            epoch_losses = result.losses[-steps_per_epoch:]
            print(
                f"epoch {epoch + 1}: mean loss {sum(epoch_losses) / len(epoch_losses):.4f}, "
                f"lr {opt.param_groups[0]['lr']:.2e}, rung {opt.rung}"
            )
    model.eval()
    with torch.no_grad():
        result.test_accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    result.escalations = list(opt.escalations)
    return result


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: train and print the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rung", choices=("fp32", "bf16", "8bit"), default=None)
    parser.add_argument("--free-memory", default=None, help='e.g. "2MiB"; default: probed')
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    result = train(
        device=args.device,
        epochs=args.epochs,
        lr=args.lr,
        rung=args.rung,
        free_memory=args.free_memory,
        verbose=True,
    )
    print(
        f"{len(result.losses)} steps; loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; "
        f"test accuracy {result.test_accuracy:.2%}; rung {result.optimizer.rung}"
    )


if __name__ == "__main__":
    main()
