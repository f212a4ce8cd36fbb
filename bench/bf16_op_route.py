"""The bf16 rung's CPU step two ways, against torch's fused AdamW on the same params:
through the kept C-kernel table (what ``optladder.AdamW`` runs) and through the custom
op ``torch.ops.optladder.adamw_bf16_`` (its CPU implementation, which reads every tensor
of its lists in Python at each call).

The question: what would routing the CPU step through torch's dispatcher cost? Each
layout is ``N x SIZE`` float32 params with float32 grads; each implementation has its own
copy. Timed in one process, the order rotated each rep; printed per layout: the median
[min-max] of each, and the ratio of medians ``t_torch / t_impl`` (above 1 is faster).

Usage::

    python bench/bf16_op_route.py                    # 20000x256 and 2000x4096, 1 thread
    python bench/bf16_op_route.py --layouts 2000x4096 --threads 2 --reps 11

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import optladder
from optladder.optimizers.kernels import ops  # noqa: F401 - registers the op


def _params(count: int, size: int) -> list[torch.Tensor]:
    params = [torch.randn(size, requires_grad=True) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(size)
    return params


def _via_op(count: int, size: int) -> Callable[[], None]:
    """One bf16-rung step of ``count`` float32 params of ``size`` elements through the op
    (bfloat16 moments, stochastic rounding, lr 1e-3, weight decay 0.01)."""
    params = _params(count, size)
    data = [p.detach() for p in params]
    grads = [p.grad for p in params if p.grad is not None]
    exp_avgs = [torch.zeros(size, dtype=torch.bfloat16) for _ in params]
    exp_avg_sqs = [torch.zeros(size, dtype=torch.bfloat16) for _ in params]
    steps = [torch.zeros((), dtype=torch.float64) for _ in params]
    indices = list(range(count))

    def step() -> None:
        torch.ops.optladder.adamw_bf16_(
            data, grads, exp_avgs, exp_avg_sqs, steps, indices, 1e-3, None,
            0.9, 0.999, 1e-8, 0.01, True, False, True, True, 0, None, None,
        )  # fmt: skip

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="20000x256,2000x4096", help="NxSIZE,...")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for layout in args.layouts.split(","):
        count, size = (int(x) for x in layout.split("x"))
        steps: dict[str, Callable[[], object]] = {
            "torch fused": torch.optim.AdamW(_params(count, size), lr=1e-3, fused=True).step,
            "optladder bf16": optladder.AdamW(_params(count, size), lr=1e-3, rung="bf16").step,
            "bf16 via the op": _via_op(count, size),
        }
        for step in steps.values():  # state and kernel tables built, caches warm
            step()
            step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for _ in range(args.reps):
            order = order[1:] + order[:1]
            for name in order:
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["torch fused"])
        print(f"{count} x {size}, {args.threads} thread(s), {args.reps} reps:")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"  {name:16s} {med * 1e3:8.1f} ms [{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}]"
                f"  torch/impl {base / med:.2f}"
            )


if __name__ == "__main__":
    main()
