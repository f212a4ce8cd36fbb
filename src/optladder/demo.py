"""The main job: train an MLP on the UCI handwritten digits through ``choose_optimizer``.

The digits (1,797 8x8 images, shipped with scikit-learn as ``load_digits``) are split
80/20 with a fixed seed. The MLP's first two weights (64x256 and 256x256 elements) are
above bitsandbytes' 4,096-element minimum, so the 8bit rung truly quantizes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from optladder.optimizers.state import measure_state_bytes
from optladder.policies.footprint import measure_footprint
from optladder.rungs import RUNGS, Rung
from optladder.selector.adamw import choose_optimizer
from optladder.units import format_bytes


@dataclass(frozen=True)
class DemoResult:
    """What one demo run reached.

    Attributes:
        rung: the rung the optimizer ran.
        test_accuracy: fraction of test images classified right after the last epoch.
        final_loss: mean training cross-entropy of the last epoch (nats).
        state_bytes: optimizer-state bytes measured from the state tensors.
        seconds: wall-clock training time.
    """

    rung: Rung
    test_accuracy: float
    final_loss: float
    state_bytes: int
    seconds: float


def load_digits_split(
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits as float32 tensors scaled to [0, 1]: ``(x_train, y_train, x_test, y_test)``.

    Shapes: ``x_*`` is ``(n, 64)`` float32, ``y_*`` is ``(n,)`` int64; n is 1,437 / 360.

    Raises:
        ImportError: without scikit-learn (the message says how to install it).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the demo needs scikit-learn: pip install 'scikit-learn>=1.3' (what optladder's "
            "demo extra installs)"
        ) from exc
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model(seed: int = 0) -> nn.Module:
    """The demo MLP: 64 -> 256 -> 256 -> 10 with ReLU (85,002 params)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def train_digits(
    *,
    rung: str | None = None,
    free_memory: int | str | None = None,
    epochs: int = 12,
    seed: int = 0,
    autocast: bool = False,
    log: Callable[[str], None] = print,
) -> DemoResult:
    """Train the demo MLP through ``choose_optimizer`` (lr 2e-3, weight decay 0.01, 32
    examples a step) and report what it reached.

    Args:
        rung: fix the rung, or None to let the policy choose.
        free_memory: bytes (or ``"2MiB"``) the optimizer may assume free; None probes.
        epochs: passes over the training set, ``>= 1``.
        seed: seeds the split, the init, the batch order and the bf16 rounding.
        autocast: run forward and loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``
            (params, grads and the optimizer stay as the rung keeps them).
        log: where the progress lines go.

    Returns:
        The :class:`DemoResult`.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    x_train, y_train, x_test, y_test = load_digits_split(seed)
    model = make_model(seed)
    opt = choose_optimizer(
        model, 2e-3, weight_decay=0.01, rung=rung, free_memory=free_memory, seed=seed, strict=False
    )
    log(opt.decision.summary() + ("\n(forward under bf16 autocast)" if autocast else ""))
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    accuracy, epoch_loss = 0.0, float("nan")
    for epoch in range(1, epochs + 1):
        model.train()
        total, batches = 0.0, 0
        for idx in torch.randperm(len(y_train), generator=gen).split(32):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(model(x_train[idx]).float(), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            batches += 1
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        epoch_loss = total / batches
        log(f"  epoch {epoch:2d}  loss {epoch_loss:.4f}  test accuracy {accuracy:.2%}")
    seconds = time.perf_counter() - start
    state_bytes = measure_state_bytes(opt)
    log(
        f"  {opt.rung}: measured optimizer state {state_bytes:,} bytes "
        f"({format_bytes(state_bytes)}; estimated {opt.decision.state_bytes[opt.rung]:,}); "
        f"{seconds:.1f} s"
    )
    return DemoResult(opt.rung, accuracy, epoch_loss, state_bytes, seconds)


def ladder_budgets(seed: int = 0) -> dict[Rung, int]:
    """Free-memory values under which the default policy picks each rung for the demo MLP.

    With the gate at 25% of free memory, a rung passes when ``4 * state <= free``; each
    budget sits midway between this rung's need and the next dearer one's.
    """
    state = measure_footprint(make_model(seed)).state_bytes
    return {
        "fp32": 8 * state["fp32"],
        "bf16": 2 * (state["fp32"] + state["bf16"]),
        "8bit": 2 * (state["bf16"] + state["8bit"]),
    }


def run_demo(
    rung: str | None = None,
    free_memory: int | str | None = None,
    epochs: int = 12,
    seed: int = 0,
) -> list[DemoResult]:
    """Run the demo: one run as asked, or, given neither ``rung`` nor ``free_memory``, one
    run per rung: first with the probed free memory (fp32), then with free-memory values
    that make the policy choose bf16 and 8bit."""
    if rung is not None or free_memory is not None:
        return [train_digits(rung=rung, free_memory=free_memory, epochs=epochs, seed=seed)]
    print("== free memory probed on this machine: the policy should choose fp32 ==")
    results = [train_digits(epochs=epochs, seed=seed)]
    for r, budget in list(ladder_budgets(seed).items())[1:]:
        print(f"\n== free_memory={format_bytes(budget)}: the policy should choose {r} ==")
        results.append(train_digits(free_memory=budget, epochs=epochs, seed=seed))
    print("\n== bf16 rung, forward under bf16 autocast ==")
    results.append(train_digits(rung="bf16", epochs=epochs, seed=seed, autocast=True))
    print("\n(the last row: forward under bf16 autocast)")
    print("rung   test accuracy   final loss   state bytes   bytes/param   seconds")
    n = sum(p.numel() for p in make_model(seed).parameters())
    for res in results:
        print(
            f"{res.rung:5}  {res.test_accuracy:13.2%}   {res.final_loss:10.4f}   "
            f"{res.state_bytes:11,}   {res.state_bytes / n:11.2f}   {res.seconds:7.1f}"
        )
    assert [res.rung for res in results[:3]] == list(RUNGS), "the ladder budgets missed a rung"
    return results
