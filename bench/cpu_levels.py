"""Time of the bf16/fp32 rungs' C kernel (``cpu.run_table``) on each of its SIMD paths,
in one process: gcc's vectorized C loop, the AVX2 intrinsics and the AVX-512 intrinsics,
as far as the CPU has them (the ``simd`` level caps the path, so an AVX-512 CPU also runs
its AVX2 path).

Every level steps the same params: one tensor of N elements, or bench/step_time.py's
transformer-like list (``--layouts list``), of ``--param-dtype`` with grads of
``--grad-dtype``, moments of ``--moments`` (bfloat16: the bf16 rung; float32: the fp32
rung of bfloat16 params), stochastic rounding on (``--rounding nearest`` for the other
mode), AdamW with weight decay, from zero moments at step 1 (each call repeats that step:
the time of a step does not depend on its count). Each rep times every level once, in
an order rotated by one each rep; a level's time in a rep is the best of ``--inner``
calls. Reported per (layout, threads, level): nanoseconds per element, median over reps
with the min-max, and the ratio of medians to the first level listed (above 1 is
faster). All levels write the eager oracle's bits (tests/test_kernels_cpu.py,
tests/test_kernels_dtypes.py); this only times them.

Usage::

    python bench/cpu_levels.py                                 # 16M float32, 1 thread
    python bench/cpu_levels.py --layouts one,list --threads 1,2 --reps 7
    python bench/cpu_levels.py --size 1M --inner 20            # in L3: compute alone
    python bench/cpu_levels.py --param-dtype bfloat16 --grad-dtype bfloat16

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import functools

import torch

from cpu8bit_levels import add_timing_args, chosen_levels, report, time_levels, torch_step
from optladder.optimizers.kernels import cpu
from step_time import layout_numels

LEVEL_NAMES = {cpu.SIMD_C_LOOP: "c-loop", cpu.SIMD_AVX2: "avx2", cpu.SIMD_AVX512: "avx512"}


def make_table(
    numels: list[int],
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    moment_dtype: torch.dtype,
    stochastic: bool,
) -> tuple[cpu.KernelTable, list[torch.Tensor]]:
    """A kernel table over random params and grads (scale 1e-2) with zero moments, set
    for step 1 of AdamW (lr 1e-3, weight decay 0.01); returns it and the grads, which
    the table does not hold."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(param_dtype) for n in numels]
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(grad_dtype) for n in numels]
    moments = [torch.zeros(n, dtype=moment_dtype) for n in numels for _ in range(2)]
    steps = [torch.tensor(0.0, dtype=torch.float64) for _ in numels]
    table = cpu.KernelTable(params, moments[0::2], moments[1::2], steps, range(len(numels)))
    table.set_grads(grads)
    step_size, bc2_sqrt = -1e-3 / (1 - 0.9), (1 - 0.999) ** 0.5
    table.set_scalars([1.0] * len(numels), {1.0: (12345, step_size, bc2_sqrt)})
    table.set_options(
        0, beta1=0.9, beta2=0.999, eps=1e-8, lr=1e-3, weight_decay=0.01,
        decoupled_weight_decay=True, maximize=False, stochastic=stochastic,
        param_stochastic=stochastic,
    )  # fmt: skip
    return table, grads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(ap)
    dtypes = ["float32", "bfloat16", "float16"]
    ap.add_argument("--param-dtype", default="float32", choices=dtypes)
    ap.add_argument("--grad-dtype", default="float32", choices=dtypes)
    ap.add_argument("--moments", default="bfloat16", choices=dtypes[:2])
    ap.add_argument("--rounding", default="stochastic", choices=["stochastic", "nearest"])
    args = ap.parse_args(argv)
    lib = cpu.load_library()
    levels = chosen_levels(args.levels, cpu.simd_level(lib), LEVEL_NAMES)
    label = f"{args.param_dtype} params, {args.grad_dtype} grads, {args.moments} moments"
    for layout in args.layouts.split(","):
        numels = layout_numels(args.size, layout)
        table, _grads = make_table(
            numels,
            getattr(torch, args.param_dtype),
            getattr(torch, args.grad_dtype),
            getattr(torch, args.moments),
            args.rounding == "stochastic",
        )
        for threads in (int(x) for x in args.threads.split(",")):
            run = functools.partial(cpu.run_table, table, num_threads=threads, library=lib)
            between = torch_step(sum(numels)) if args.after_torch else None
            times = time_levels(run, levels, args.reps, args.inner, args.clock, between)
            report(f"{label} {layout:4s} threads={threads}", sum(numels), times, LEVEL_NAMES)


if __name__ == "__main__":
    main()
