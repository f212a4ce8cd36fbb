"""Time of the 8-bit CPU kernel's commit phase (``cpu8bit.run_table``) on each of its
SIMD paths, in one process: the scalar loops, AVX2 and AVX-512, as far as the CPU has
them (the ``simd`` level caps the path, so an AVX-512 CPU also runs its AVX2 path).

Every level steps the same params: one float32 (or ``--dtype bfloat16``) tensor of N
elements, or bench/step_time.py's transformer-like list (``--layouts list``), with
bitsandbytes-format 8-bit state made by ``cpu8bit.quantize_blockwise`` from random
moments, AdamW with weight decay. Each rep times every level once, in an order rotated
by one each rep; a level's time in a rep is the best of ``--inner`` calls. Reported per
(dtype, layout, threads, level): nanoseconds per element, median over reps with the
min-max, and the ratio of medians to the first level listed (above 1 is faster).
All levels write the same bits (tests/test_kernels_8bit_cpu.py); this only times them.

Usage::

    python bench/cpu8bit_levels.py                          # 16M, one tensor, 1 thread
    python bench/cpu8bit_levels.py --layouts one,list --threads 1,2 --reps 7
    python bench/cpu8bit_levels.py --size 64K --inner 50    # in cache: compute alone
    python bench/cpu8bit_levels.py --levels 1,2 --clock cpu # on a shared machine
    python bench/cpu8bit_levels.py --size 64M --inner 1 --after-torch  # step_time's caches

``--after-torch`` steps torch's fused AdamW over as many float32 params before each timed
call (untimed), so that the kernel starts, as in ``bench/step_time.py`` and in training,
with the caches full of other data: stepped back to back, a 16M-64M step finds the
hardware prefetchers trained on its own streams and runs up to ~1.5x faster than there.

``--clock cpu`` times with ``time.process_time`` (this process's CPU seconds): on a
machine other jobs share it leaves out the time spent waiting for a core; use it with
one thread (with more it adds the threads' CPU seconds).

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from optladder.optimizers.kernels import cpu8bit
from step_time import layout_numels, parse_size

LEVEL_NAMES = {
    cpu8bit.SIMD_SCALAR: "scalar",
    cpu8bit.SIMD_AVX2: "avx2",
    cpu8bit.SIMD_AVX512: "avx512",
}


def make_jobs(numels: list[int], dtype: torch.dtype, seed: int = 0) -> list[cpu8bit.Job]:
    """8-bit AdamW jobs over params of these sizes: random params, grads (scale 1e-2)
    and moments (exp_avg ~ 1e-3, exp_avg_sq its square plus 1e-8), encoded with the
    kernel's own rule into bitsandbytes' dynamic maps."""
    from bitsandbytes import functional as F

    gen = torch.Generator().manual_seed(seed)
    q1 = F.create_dynamic_map(signed=True).float()
    q2 = F.create_dynamic_map(signed=False).float()
    b1, b2 = cpu8bit.code_bounds(q1), cpu8bit.code_bounds(q2)
    t1, t2 = cpu8bit.code_table(b1), cpu8bit.code_table(b2)
    jobs = []
    for n in numels:
        m = torch.randn(n, generator=gen) * 1e-3
        c1, a1 = cpu8bit.quantize_blockwise(m, q1)
        c2, a2 = cpu8bit.quantize_blockwise(m * m + 1e-8, q2)
        jobs.append(
            cpu8bit.Job(
                param=torch.randn(n, generator=gen).to(dtype),
                grad=(torch.randn(n, generator=gen) * 1e-2).to(dtype),
                state1=c1,
                state2=c2,
                absmax1=a1,
                absmax2=a2,
                bounds1=b1,
                bounds2=b2,
                table1=t1,
                table2=t2,
                qmap1=q1,
                qmap2=q2,
                step=10,
                lr=1e-3,
                betas=(0.9, 0.999),
                eps=1e-8,
                weight_decay=0.01,
            )
        )
    return jobs


def time_levels(
    run: Callable[..., object],
    levels: list[int],
    reps: int,
    inner: int,
    clock: str,
    between: Callable[[], object] | None = None,
) -> dict[int, list[float]]:
    """Seconds of one ``run(simd=level)`` per level and rep (the best of ``inner`` calls),
    the levels' order rotated by one each rep; ``between`` (untimed) runs before each
    timed call."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    for level in levels:  # warm: pages, caches, the library
        run(simd=level)
    out: dict[int, list[float]] = {level: [] for level in levels}
    for rep in range(reps):
        k = rep % len(levels)
        for level in levels[k:] + levels[:k]:
            best = float("inf")
            for _ in range(inner):
                if between is not None:
                    between()
                t0 = now()
                run(simd=level)
                best = min(best, now() - t0)
            out[level].append(best)
    return out


def report(label: str, n: int, times: dict[int, list[float]], names: dict[int, str]) -> None:
    """Print ns per element (median [min-max]) of each level over ``n`` elements and the
    ratio of medians to the first level."""
    levels = list(times)
    base = statistics.median(times[levels[0]])
    for level in levels:
        ns = [t / n * 1e9 for t in times[level]]
        print(
            f"{label} {names[level]:7s} ns/element {statistics.median(ns):6.3f}"
            f" [{min(ns):.3f}-{max(ns):.3f}]  x{base / statistics.median(times[level]):.2f}"
        )


def add_timing_args(ap: argparse.ArgumentParser) -> None:
    """The options both kernel-level benchmarks take: size, layouts, threads, levels, reps,
    inner calls and clock."""
    ap.add_argument("--size", type=parse_size, default=16 * 2**20, help="params, e.g. 16M")
    ap.add_argument("--layouts", default="one", help="one, list (bench/step_time.py's)")
    ap.add_argument("--threads", default="1", help="thread counts, e.g. 1,2")
    ap.add_argument("--levels", default="", help="e.g. 0,2 (default: every level here)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=3, help="calls per rep; the best counts")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    ap.add_argument(
        "--after-torch",
        action="store_true",
        help="before each timed call, step torch's fused AdamW over as many params",
    )


def torch_step(n: int) -> Callable[[], object]:
    """A step of torch's fused AdamW over one float32 tensor of ``n`` params (random grads):
    run before each timed call (``--after-torch``) it fills the caches with other data, as
    the other implementations' steps do in ``bench/step_time.py``."""
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()  # its state exists before timing
    return opt.step


def chosen_levels(spec: str, best: int, names: dict[int, str]) -> list[int]:
    """The levels of ``spec`` (e.g. ``"0,2"``; empty: every level) this CPU runs (up to
    ``best``), printed with their names."""
    levels = [int(x) for x in spec.split(",")] if spec else list(range(best + 1))
    levels = [level for level in levels if level <= best]
    print(f"best SIMD level here: {names[best]}; timing {[names[x] for x in levels]}")
    return levels


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(ap)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    levels = chosen_levels(args.levels, cpu8bit.simd_level(), LEVEL_NAMES)
    dtype = getattr(torch, args.dtype)
    for layout in args.layouts.split(","):
        numels = layout_numels(args.size, layout)
        jobs = make_jobs(numels, dtype)
        n = sum(numels)
        for threads in (int(x) for x in args.threads.split(",")):
            table = cpu8bit.prepare_table(jobs, num_threads=threads)
            run = functools.partial(cpu8bit.run_table, table, cpu8bit.load_library())
            between = torch_step(n) if args.after_torch else None
            times = time_levels(run, levels, args.reps, args.inner, args.clock, between)
            report(f"{args.dtype} {layout:4s} threads={table.threads}", n, times, LEVEL_NAMES)


if __name__ == "__main__":
    main()
