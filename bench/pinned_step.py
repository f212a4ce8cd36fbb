"""Step time of an optimizer whose embedding group pins the fp32 rung while the rest
runs a cheaper rung, against the same params on one rung and against two hand-made
optimizers.

Two float32 params: an "embedding" of ``--emb`` elements and a "body" of ``--body``
elements, float32 grads, state allocated by warm-up steps. Reported per implementation:
the median of ``--reps`` timed steps (timed in turns, as in ``step_time.py``), the ratio
to torch's fused fp32 AdamW over both params (``t_fused / t_impl``: above 1 is faster)
and the state bytes per param.

The question: does a pinned group cost more than the engines it runs? The pinned
optimizer steps two engines (torch's fused AdamW for the embedding, the bf16 kernel for
the body) after one check of every grad; "two optimizers" steps the same two engines by
hand with no checks, so the gap between them is optladder's overhead.

Usage::

    python bench/pinned_step.py                      # 8M + 24M params on CPU (or CUDA)
    python bench/pinned_step.py --emb 64M --body 192M --device cuda --reps 20

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from optladder import choose_optimizer
from optladder.optimizers.adamw import LadderAdamW
from step_time import (
    Stepper,
    median_step_seconds,
    parse_size,
    state_bytes,
    warm_process,
    warmed_up,
)

Params = tuple[torch.nn.Parameter, torch.nn.Parameter]


class _Both:
    """Two optimizers stepped one after the other, as a user would do by hand."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts

    @property
    def state(self) -> dict[torch.Tensor, dict[str, object]]:
        return {k: v for o in self.opts for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.opts:
            o.step()


def _ladder(emb_rung: str | None, body_rung: str) -> Callable[[Params], Stepper]:
    def make(ps: Params) -> Stepper:
        emb = {"params": [ps[0]]} | ({"rung": emb_rung} if emb_rung else {})
        return choose_optimizer([emb, {"params": [ps[1]]}], rung=body_rung, free_memory="1TiB")

    return make


IMPLS: dict[str, Callable[[Params], Stepper]] = {
    "torch-fused-fp32 (both)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "optladder fp32 (both)": _ladder(None, "fp32"),
    "optladder bf16 (both)": _ladder(None, "bf16"),
    "optladder emb pinned fp32 + bf16": _ladder("fp32", "bf16"),
    "two optimizers: fused fp32 + bf16": lambda ps: _Both(
        torch.optim.AdamW([ps[0]], lr=1e-3, fused=True), LadderAdamW([ps[1]], lr=1e-3)
    ),
    "optladder emb pinned fp32 + 8bit": _ladder("fp32", "8bit"),
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print the table; return ``impl -> median seconds``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emb", type=parse_size, default=8 * 2**20, help="embedding elements")
    ap.add_argument("--body", type=parse_size, default=24 * 2**20, help="body elements")
    ap.add_argument("--reps", type=int, default=9, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        ap.error(f"--reps and --warmup must be >= 1, got {args.reps} and {args.warmup}")
    device = torch.device(args.device)
    warm_process(device)
    live: dict[str, Stepper] = {}
    for name, make in IMPLS.items():
        gen = torch.Generator(device=device).manual_seed(0)
        ps: Params = (
            torch.nn.Parameter(torch.randn(args.emb, device=device, generator=gen)),
            torch.nn.Parameter(torch.randn(args.body, device=device, generator=gen)),
        )
        for p in ps:
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
        opt = warmed_up(lambda: make(ps), device, args.warmup, f"{name:<36}")  # noqa: B023
        if opt is not None:
            live[name] = opt
    medians = median_step_seconds(live, device, args.reps)
    base = medians.get("torch-fused-fp32 (both)")
    n = args.emb + args.body
    print(f"{args.emb:,} + {args.body:,} params on {device}, median of {args.reps} steps")
    print(f"{'implementation':<36}{'ms':>9}{'vs fused':>10}{'B/param':>9}")
    for name, t in medians.items():
        ratio = f"{base / t:.2f}" if base else "-"
        per = state_bytes(live[name]) / n
        print(f"{name:<36}{t * 1e3:>9.2f}{ratio:>10}{per:>9.3f}")
    return medians


if __name__ == "__main__":
    main()
