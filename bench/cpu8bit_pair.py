"""Two builds of the 8-bit CPU kernel side by side: the same bits, and which is faster.

Each source is a git revision (``main``, ``HEAD~1``: its ``_cpu8bit_source.py``) or the
path of a ``_cpu8bit_source.py``; each is built into the kernel cache under a stem of its
own and loaded into this one process. First every build steps the same edge cases twice
(zero, tiny, huge, NaN/Inf and heavy-tailed grads, absmax of 0, Inf and NaN, sizes not
a multiple of 256, float32 state, bfloat16/float16 params and grads, Adam's coupled
decay, 300 small tensors) on each SIMD level and 1 and 2 threads, and every written
tensor (params, codes, absmax, float32 state) is compared bit for bit with the first
build's. Then each build steps ``--size`` params (``bench/cpu8bit_levels.py``'s jobs)
in turns, the order rotated each rep, and the report gives ns per element (median
[min-max]) and the paired ratio to the first build (its median [min-max] over reps).
``--after-torch`` steps torch's fused AdamW over as many params before each timed call,
as ``bench/step_time.py``'s other implementations do.

Usage::

    python bench/cpu8bit_pair.py main src/optladder/optimizers/kernels/_cpu8bit_source.py
    python bench/cpu8bit_pair.py main HEAD --size 64M --layouts one,list --after-torch

Not a test: the times depend on the machine; the bit comparison exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from cpu8bit_levels import make_jobs, torch_step
from optladder.optimizers.kernels import cpu, cpu8bit
from step_time import layout_numels, parse_size

SOURCE_PATH = "src/optladder/optimizers/kernels/_cpu8bit_source.py"


def read_source(spec: str) -> str:
    """The C source of ``spec``: a file's ``SOURCE``, else that of git revision ``spec``."""
    path = Path(spec)
    if not path.is_file():
        text = subprocess.run(
            ["git", "show", f"{spec}:{SOURCE_PATH}"], capture_output=True, text=True, check=True
        ).stdout
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "source.py"
            path.write_text(text)
            return str(runpy.run_path(str(path))["SOURCE"])
    return str(runpy.run_path(str(path))["SOURCE"])


def load(spec: str) -> ctypes.CDLL:
    """Build (once, cached) and load the kernel of ``spec`` with its step's C signature."""
    source = read_source(spec)
    stem = "adamw8bit_pair_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    lib = cpu.load_source(stem, source)
    lib.ol_adamw8bit_step.argtypes = (
        ctypes.POINTER(cpu8bit._Param),
        ctypes.POINTER(cpu8bit._Item),
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
    )
    lib.ol_adamw8bit_step.restype = ctypes.c_int
    return lib


def _copy(jobs: list[cpu8bit.Job]) -> list[cpu8bit.Job]:
    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    return [
        dataclasses.replace(
            j,
            param=j.param.clone(),
            state1=j.state1.clone(),
            state2=j.state2.clone(),
            absmax1=c(j.absmax1),
            absmax2=c(j.absmax2),
        )
        for j in jobs
    ]


def edge_cases(seed: int = 1) -> list[tuple[str, list[cpu8bit.Job]]]:
    """Named lists of jobs that reach every branch of the kernel (see the module doc)."""
    from bitsandbytes import functional as F

    gen = torch.Generator().manual_seed(seed)
    q1 = F.create_dynamic_map(signed=True).float()
    q2 = F.create_dynamic_map(signed=False).float()
    b1, b2 = cpu8bit.code_bounds(q1), cpu8bit.code_bounds(q2)
    t1, t2 = cpu8bit.code_table(b1), cpu8bit.code_table(b2)

    def job(
        n: int,
        kind: str,
        dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
        wd: float = 0.01,
        coupled: bool = False,
        quantized: bool = True,
    ) -> cpu8bit.Job:
        g = torch.randn(n, generator=gen) * 1e-2
        if kind == "zeros":
            g.zero_()
        elif kind == "tiny":
            g *= 1e-38
        elif kind == "huge":
            g *= 1e36
        elif kind == "naninf":
            idx = torch.randint(0, n, (max(1, n // 97),), generator=gen)
            special = torch.tensor([float("nan"), float("inf"), -float("inf")])
            g[idx] = special.repeat(len(idx))[: len(idx)]
        elif kind == "heavy":
            g *= torch.exp(torch.randn(n, generator=gen) * 20).clamp(max=1e30)
        m = torch.randn(n, generator=gen) * 1e-3
        if kind == "zeros":
            m[: n // 2] = 0
        v = m * m + 1e-8
        a1 = a2 = None
        s1, s2 = m, v
        if quantized:
            s1, a1 = cpu8bit.quantize_blockwise(m, q1)
            s2, a2 = cpu8bit.quantize_blockwise(v, q2)
            if kind == "absmax":
                a1[::3] = 0.0
                a2[1::3] = float("inf")
                a1[2::5] = float("nan")
        return cpu8bit.Job(
            param=torch.randn(n, generator=gen).to(dtypes[0]),
            grad=g.to(dtypes[1]),
            state1=s1,
            state2=s2,
            absmax1=a1,
            absmax2=a2,
            bounds1=b1 if quantized else None,
            bounds2=b2 if quantized else None,
            table1=t1 if quantized else None,
            table2=t2 if quantized else None,
            qmap1=q1 if quantized else None,
            qmap2=q2 if quantized else None,
            step=7,
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=wd,
            coupled_weight_decay=coupled,
        )

    cases = []
    for kind in ("normal", "zeros", "tiny", "huge", "naninf", "heavy", "absmax"):
        for n in (4096, 4097, 65536 + 17, 300_003):
            cases.append((f"{kind} n={n}", [job(n, kind)]))
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    for dts in ((bf16, bf16), (f16, f16), (f32, bf16), (bf16, f32)):
        cases.append((f"{dts[0]} params, {dts[1]} grads", [job(200_005, "heavy", dts)]))
    cases.append(("Adam (coupled decay)", [job(100_000, "normal", wd=0.1, coupled=True)]))
    cases.append(("no decay", [job(100_000, "normal", wd=0.0)]))
    sizes = torch.randint(4096, 9000, (300,), generator=gen).tolist()
    kinds = ("normal", "heavy", "zeros") * 100
    cases.append(("300 small tensors", [job(n, k) for n, k in zip(sizes, kinds, strict=True)]))
    cases.append(("float32 state", [job(1000, "normal", quantized=False), job(50_000, "naninf")]))
    return cases


def compare_bits(libs: list[ctypes.CDLL], names: list[str]) -> int:
    """Step every edge case twice with each build, on every SIMD level and 1 and 2
    threads; print and return the number of written tensors that differ from the first
    build's."""
    bad = 0
    cases = edge_cases()
    for name, jobs in cases:
        for simd in (cpu8bit.SIMD_AVX512, cpu8bit.SIMD_AVX2, cpu8bit.SIMD_SCALAR):
            for threads in (1, 2):
                outs = []
                for lib in libs:
                    js = _copy(jobs)
                    for _ in range(2):  # the second step decodes the first one's codes
                        table = cpu8bit.prepare_table(js, num_threads=threads)
                        cpu8bit.run_table(table, lib, simd=simd)
                    outs.append(js)
                for k in range(1, len(libs)):
                    for a, b in zip(outs[0], outs[k], strict=True):
                        for f in ("param", "state1", "state2", "absmax1", "absmax2"):
                            x, y = getattr(a, f), getattr(b, f)
                            if x is not None and not torch.equal(
                                x.view(torch.uint8), y.view(torch.uint8)
                            ):
                                bad += 1
                                print(f"DIFFER {names[k]}: {name}, simd {simd}, {threads}t, {f}")
    print(f"bits: {len(cases)} cases x 3 SIMD levels x 1, 2 threads: {bad} tensors differ")
    return bad


def time_pair(
    runs: Sequence[Callable[[], object]],
    reps: int,
    between: Callable[[], object] | None,
) -> list[list[float]]:
    """CPU seconds of each run per rep, the order rotated each rep; ``between`` (untimed)
    before each timed call."""
    for run in runs:
        run()
    out: list[list[float]] = [[] for _ in runs]
    for rep in range(reps):
        order = list(range(len(runs)))
        k = rep % len(runs)
        for i in order[k:] + order[:k]:
            if between is not None:
                between()
            t0 = time.process_time()
            runs[i]()
            out[i].append(time.process_time() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="git revisions or _cpu8bit_source.py paths")
    ap.add_argument("--size", type=parse_size, default=16 * 2**20, help="params, e.g. 16M")
    ap.add_argument("--layouts", default="one", help="one, list (bench/step_time.py's)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--after-torch", action="store_true", help="see the module doc")
    ap.add_argument("--no-bits", action="store_true", help="skip the bit comparison")
    args = ap.parse_args(argv)
    libs = [load(s) for s in args.sources]
    if not args.no_bits and compare_bits(libs, args.sources):
        sys.exit(1)
    for layout in args.layouts.split(","):
        numels = layout_numels(args.size, layout)
        n = sum(numels)
        table = cpu8bit.prepare_table(make_jobs(numels, torch.float32), num_threads=1)
        runs = [functools.partial(cpu8bit.run_table, table, lib) for lib in libs]
        times = time_pair(runs, args.reps, torch_step(n) if args.after_torch else None)
        for name, ts in zip(args.sources, times, strict=True):
            ns = [t / n * 1e9 for t in ts]
            ratio = [a / b for a, b in zip(times[0], ts, strict=True)]
            print(
                f"{layout:4s} 1 thread {name}: ns/element {statistics.median(ns):.3f} "
                f"[{min(ns):.3f}-{max(ns):.3f}], paired x{statistics.median(ratio):.3f} "
                f"[{min(ratio):.3f}-{max(ratio):.3f}]"
            )


if __name__ == "__main__":
    main()
