"""Optimizer step time and state bytes per param: optladder's rungs (the 8bit rung's CPU
kernel is ``optladder-8bit-cpu``: bitsandbytes' state format) against baselines.

Every implementation steps the same params (one float32 tensor of N elements, or a
transformer-like list of tensors adding up to about N elements: ``--layouts``) with
grads of the params' dtype (float32, or bfloat16 / float16 with ``--param-dtype``;
stochastic rounding on for optladder), its state allocated by warm-up steps before
timing. With bfloat16 or float16 params the baseline is torch's fused AdamW on the same
params (it keeps its moments in their dtype), and optladder's fp32 rung (float32 moments
on its own kernel) is measured beside the bf16 rung. All implementations live in one
process and are timed in turns, the order rotated by one every rep, so that drifts of
the machine hit all alike.
Reported per (threads, layout, size, implementation): the median of ``--reps`` timed
steps with the min-max over reps, the state bytes per param summed over the real state
tensors, the speed ratio to torch's fused AdamW (``t_fused / t_impl`` of the
medians: above 1 is faster) and, given ``--peak-gbps``, the memory bandwidth reached
against the peak. ``--threads 1,2`` repeats everything at each torch thread count.

Usage::

    python bench/step_time.py                       # 1M, 16M, 64M params on CPU (or CUDA)
    python bench/step_time.py --sizes 16M,64M --threads 1,2 --layouts one,list --reps 9
    python bench/step_time.py --device cuda --peak-gbps 4800   # H200 HBM3e
    python bench/step_time.py --param-dtype bfloat16 --sizes 16M,64M
    python bench/step_time.py --param-dtype float16 --sizes 16M --threads 1,2

Not a test: numbers depend on the machine. The README carries the CPU table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from optladder.optimizers.adamw import Backend, LadderAdamW
from optladder.optimizers.kernels import cpu_unavailable_reason as cpu_kernel_unavailable_reason


class Stepper(Protocol):
    """What the timing functions use of an optimizer: ``step()`` and ``state`` (a torch
    optimizer, or two stepped one after the other as in ``pinned_step.py``)."""

    @property
    def state(self) -> Mapping[Any, Any]: ...

    def step(self) -> Any: ...


Factory = Callable[[list[torch.nn.Parameter]], Stepper]

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def moment_bytes(impl: str, param_dtype: torch.dtype) -> int:
    """Bytes of one moment element of ``impl`` (torch keeps the param's dtype)."""
    if impl.startswith("torch-"):
        return param_dtype.itemsize
    if "8bit" in impl:
        return 1
    return 4 if impl.startswith("optladder-fp32") else 2


def traffic_bytes_per_param(impl: str, param_dtype: torch.dtype) -> int:
    """Least bytes a step must move per param (one pass), for the bandwidth column:
    param read and write, grad read (the param's dtype), two moments read and written
    (float32 params: 28 for torch fused, 20 for the bf16 rung, 14 for 8-bit codes plus
    their absmax; bfloat16 params: 14 for torch fused and the bf16 rung, 22 for the fp32
    rung)."""
    return 3 * param_dtype.itemsize + 4 * moment_bytes(impl, param_dtype)


@dataclass
class Result:
    """One measured (implementation, size, layout, threads); times in seconds."""

    impl: str
    params: int
    median_s: float
    state_bytes_per_param: float
    min_s: float = math.nan
    max_s: float = math.nan
    layout: str = "one"
    threads: int | None = None


def layout_numels(n: int, layout: str) -> list[int]:
    """Element counts of the tensors stepped for about ``n`` params.

    ``"one"``: one tensor of ``n``. ``"list"``: a transformer-like list: blocks of
    width ``d`` (1024 from 16M params, else 256) with a fused QKV ``3d x d``, an output
    ``d x d``, an MLP ``4d x d`` and ``d x 4d``, their biases and two LayerNorms
    (weight and bias) -- ``12 d^2 + 13 d`` elements a block -- and the rest of ``n`` as
    one embedding tensor.

    Raises:
        ValueError: ``layout`` is neither ``"one"`` nor ``"list"``.
    """
    if layout == "one":
        return [n]
    if layout != "list":
        raise ValueError(f"layout {layout!r} is not one of 'one', 'list'")
    d = 1024 if n >= 16 * 2**20 else 256
    block = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    blocks = max(1, n // sum(block) - 1)
    numels = block * blocks
    rest = n - sum(numels)
    return ([rest] if rest > 0 else []) + numels


def parse_size(text: str) -> int:
    """``"16M"`` -> 16 * 2**20, ``"512K"`` -> 512 * 2**10, ``"1000"`` -> 1000.

    Raises:
        argparse.ArgumentTypeError: naming the value and the accepted forms.
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper()
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is not a count like 1000, 512K, 16M or 1G"
        ) from None


def implementations(
    device: torch.device, param_dtype: torch.dtype = torch.float32
) -> dict[str, Factory | str]:
    """Name -> optimizer factory, or the reason it cannot run here. The first name is
    the baseline: torch's fused AdamW (moments in the param dtype, hence its suffix)."""
    tag = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[param_dtype]
    impls: dict[str, Factory | str] = {
        f"torch-fused-{tag}": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        f"torch-foreach-{tag}": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    }
    fused_backend: Backend = "triton" if device.type == "cuda" else "cpu"
    if param_dtype != torch.float32:  # the fp32 rung of low-precision params: our kernel
        impls[f"optladder-fp32-{fused_backend}"] = lambda ps: LadderAdamW(
            ps, lr=1e-3, backend=fused_backend, moment_dtype=torch.float32
        )
    else:  # the fp32 rung of float32 params: torch's fused kernel inside LadderAdamW
        impls["optladder-fp32-torch"] = lambda ps: LadderAdamW(
            ps, lr=1e-3, moment_dtype=torch.float32
        )
    impls[f"optladder-bf16-{fused_backend}"] = lambda ps: LadderAdamW(
        ps, lr=1e-3, backend=fused_backend
    )
    impls["optladder-bf16-eager"] = lambda ps: LadderAdamW(ps, lr=1e-3, backend="eager")
    try:
        import bitsandbytes as bnb

        impls["bnb-adamw8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    except ImportError as exc:
        impls["bnb-adamw8bit"] = f"bitsandbytes not importable: {exc}"
    if device.type == "cpu":  # the 8bit rung (LadderAdamW's 8bit format): bitsandbytes' state
        if isinstance(impls["bnb-adamw8bit"], str):
            impls["optladder-8bit-cpu"] = impls["bnb-adamw8bit"]
        elif (why := cpu_kernel_unavailable_reason()) is not None:
            impls["optladder-8bit-cpu"] = why
        else:
            impls["optladder-8bit-cpu"] = lambda ps: LadderAdamW(
                [{"params": list(ps), "rung": "8bit"}], lr=1e-3, weight_decay=0.01
            )
    try:
        from torchao.optim import AdamW8bit as AoAdamW8bit

        impls["torchao-adamw8bit"] = lambda ps: AoAdamW8bit(ps, lr=1e-3)
    except ImportError as exc:
        impls["torchao-adamw8bit"] = f"torchao not importable: {exc}"
    return impls


def state_bytes(opt: Stepper) -> int:
    """Bytes of every tensor in the optimizer's state (moments, codes, scales, steps)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                # torchao keeps tensor subclasses: count their inner tensors
                inner = getattr(v, "__tensor_flatten__", None)
                if inner is not None and type(v) is not torch.Tensor:
                    names, _ = inner()
                    total += sum(getattr(v, n).nbytes for n in names)
                else:
                    total += v.nbytes
    return total


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) to finish the queued work; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_process(device: torch.device, seconds: float = 1.0) -> None:
    """Step a small fused AdamW for a while: a fresh process runs its first steps slowly
    (thread pools, page faults, clocks), which would bias whichever impl comes first."""
    p = torch.nn.Parameter(torch.randn(1 << 20, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], fused=True)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        opt.step()
        sync(device)


def warmed_up(
    make: Callable[[], Stepper], device: torch.device, warmup: int, label: str
) -> Stepper | None:
    """The optimizer ``make()`` builds, after ``warmup`` untimed steps (its state then
    exists); None, with ``label`` and the error printed, if building or stepping fails
    (a baseline that cannot run here is reported, not fatal)."""
    try:
        opt = make()
        for _ in range(warmup):
            opt.step()
        sync(device)
    except Exception as exc:
        print(f"{label}  failed: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    return opt


def step_seconds(
    optimizers: Mapping[str, Stepper], device: torch.device, reps: int
) -> dict[str, list[float]]:
    """Seconds of each of ``reps`` ``step()`` calls of every optimizer, timed in turns
    (rep 1 of each, then rep 2 of each, ...), the order rotated by one every rep so that
    no optimizer always runs right after the same other one, first or last."""
    names = list(optimizers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        k = rep % max(1, len(names))
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            optimizers[name].step()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def median_step_seconds(
    optimizers: Mapping[str, Stepper], device: torch.device, reps: int
) -> dict[str, float]:
    """Median seconds of one ``step()`` of each optimizer over ``reps`` steps
    (:func:`step_seconds`)."""
    return {n: statistics.median(t) for n, t in step_seconds(optimizers, device, reps).items()}


def measure_size(
    impls: dict[str, Factory],
    n: int,
    device: torch.device,
    reps: int,
    warmup: int,
    layout: str = "one",
    param_dtype: torch.dtype = torch.float32,
) -> list[Result]:
    """Step times of every implementation on params of ``param_dtype`` (grads likewise)
    of about ``n`` elements in the given layout (:func:`layout_numels`,
    :func:`step_seconds`): median and min-max. One that fails is reported and left out.
    """
    numels = layout_numels(n, layout)
    n = sum(numels)
    live: dict[str, Stepper] = {}
    for name, factory in impls.items():
        gen = torch.Generator(device=device).manual_seed(0)
        ps = []
        for k in numels:
            p = torch.nn.Parameter(torch.randn(k, device=device, generator=gen).to(param_dtype))
            p.grad = (torch.randn(k, device=device, generator=gen) * 1e-3).to(param_dtype)
            ps.append(p)
        opt = warmed_up(lambda: factory(ps), device, warmup, f"{name:<24}{n:>10}")  # noqa: B023
        if opt is not None:
            live[name] = opt
    times = step_seconds(live, device, reps)
    threads = torch.get_num_threads() if device.type == "cpu" else None
    results = [
        Result(
            name,
            n,
            statistics.median(times[name]),
            state_bytes(opt) / n,
            min(times[name]),
            max(times[name]),
            layout,
            threads,
        )
        for name, opt in live.items()
    ]
    live.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def plot(
    results: list[Result], path: Path, baseline: str, param_dtype: torch.dtype = torch.float32
) -> None:
    """Bar charts of each implementation's speed against ``baseline`` (an implementation's
    name, torch's fused AdamW in :func:`main`), one panel per (threads, layout).

    A bar is the ratio of medians ``t_baseline / t_impl`` (above 1 is faster); its
    whiskers are the baseline's median over the implementation's max and min step time
    (the implementation's own spread); the panel title gives the baseline's spread.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.threads, r.layout) for r in results))
    names = [n for n in dict.fromkeys(r.impl for r in results) if n != baseline]
    cols = len({layout for _, layout in panels})
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, (threads, layout) in zip(axes.flat, panels):
        here = [r for r in results if (r.threads, r.layout) == (threads, layout)]
        base = {r.params: r for r in here if r.impl == baseline}
        sizes = sorted(base)
        for k, name in enumerate(names):
            xs: list[float] = []
            ys: list[float] = []
            lo: list[float] = []
            hi: list[float] = []
            for i, n in enumerate(sizes):
                hit = [r for r in here if r.impl == name and r.params == n]
                if hit:
                    b, r = base[n].median_s, hit[0]
                    xs.append(i + k * width)
                    ys.append(b / r.median_s)
                    lo.append(b / r.median_s - b / r.max_s)
                    hi.append(b / r.min_s - b / r.median_s)
            bars = ax.bar(xs, ys, width, label=name, yerr=[lo, hi], capsize=2)
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))])
        ax.set_xticklabels([f"{n / 2**20:.3g}M params" for n in sizes])
        spread = ", ".join(
            f"{b.min_s / b.median_s:.2f}-{b.max_s / b.median_s:.2f}"
            for b in (base[n] for n in sizes)
        )
        who = "one tensor" if layout == "one" else "transformer-like list"
        ax.set_title(
            f"{threads or '-'} thread(s), {who}\n{baseline} min-max / median: {spread}",
            fontsize=8,
        )
        ax.set_ylabel(f"{baseline} time / time")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    dtype_name = str(param_dtype).removeprefix("torch.")
    fig.suptitle(
        f"AdamW step, {dtype_name} params: ratio of medians (whiskers: each one's min-max)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Result]:
    """Run the benchmark; print the table; write JSON and PNG if asked."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M", help="comma-separated param counts")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per measurement (>= 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--impls", default="", help="comma-separated subset of implementations")
    ap.add_argument("--json", type=Path, default=None, help="write the records here")
    ap.add_argument(
        "--png",
        type=lambda s: Path(s) if s else None,
        default=Path("bench/out/step_time.png"),
        help="write the plot here ('' for none)",
    )
    ap.add_argument("--peak-gbps", type=float, default=None, help="memory bandwidth peak")
    ap.add_argument("--threads", default="", help="CPU thread counts, e.g. 1,2 (default: torch's)")
    ap.add_argument("--layouts", default="one", help="one (one tensor), list (transformer-like)")
    ap.add_argument(
        "--param-dtype",
        choices=sorted(PARAM_DTYPES),
        default="float32",
        help="dtype of the params and grads (baseline: torch's fused AdamW on them)",
    )
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error(f"--reps must be >= 5, got {args.reps}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    layouts = [x for x in args.layouts.split(",") if x]
    bad = sorted(set(layouts) - {"one", "list"})
    if bad:
        ap.error(f"--layouts: unknown {bad}; choose from ['list', 'one']")
    try:
        thread_counts = [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]
    except ValueError:
        ap.error(f"--threads must be comma-separated integers >= 1, got {args.threads!r}")
    if min(thread_counts) < 1:
        ap.error(f"--threads must be >= 1, got {args.threads!r}")
    device = torch.device(args.device)
    param_dtype = PARAM_DTYPES[args.param_dtype]
    impls = implementations(device, param_dtype)
    baseline = next(iter(impls))
    if args.impls:
        wanted = args.impls.split(",")
        unknown = sorted(set(wanted) - set(impls))
        if unknown:
            ap.error(f"--impls: unknown {unknown}; choose from {sorted(impls)}")
        impls = {k: v for k, v in impls.items() if k in wanted}
    print(
        f"device={device} torch={torch.__version__} reps={args.reps} (order rotated each rep) "
        f"params={args.param_dtype}"
    )
    if param_dtype == torch.float32:
        print("torch's own bf16-moment fused AdamW: none in this torch (fused keeps param dtype)")
    for name, f in impls.items():
        if isinstance(f, str):
            print(f"skip {name}: {f}")
    results: list[Result] = []
    header = f"{'impl':<24}{'params':>10}{'median ms':>12}{'min-max ms':>18}{'state B/param':>15}"
    header += f"{'vs fused':>10}{'GB/s':>9}" + (f"{'% peak':>8}" if args.peak_gbps else "")
    runnable = {k: v for k, v in impls.items() if not isinstance(v, str)}
    for threads in thread_counts:
        if device.type == "cpu":
            torch.set_num_threads(threads)
        warm_process(device)
        for layout in layouts:
            print(f"\nthreads={threads if device.type == 'cpu' else '-'} layout={layout}")
            print(header)
            for n in sizes:
                base: float | None = None
                measured = measure_size(
                    runnable, n, device, args.reps, args.warmup, layout, param_dtype
                )
                for r in measured:
                    results.append(r)
                    if r.impl == baseline:
                        base = r.median_s
                    ratio = f"{base / r.median_s:10.2f}" if base else f"{'-':>10}"
                    gbps = traffic_bytes_per_param(r.impl, param_dtype) * r.params / r.median_s
                    gbps /= 1e9
                    spread = f"{r.min_s * 1e3:.3f}-{r.max_s * 1e3:.3f}"
                    line = f"{r.impl:<24}{r.params:>10}{r.median_s * 1e3:12.3f}{spread:>18}"
                    line += f"{r.state_bytes_per_param:15.3f}{ratio}{gbps:9.1f}"
                    if args.peak_gbps:
                        line += f"{100 * gbps / args.peak_gbps:7.1f}%"
                    print(line, flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    if any(r.impl == baseline for r in results) and args.png:
        try:
            plot(results, args.png, baseline, param_dtype)
            print(f"plot: {args.png}")
        except ImportError as exc:
            print(f"no plot: matplotlib is not importable ({exc}); pip install 'matplotlib>=3.7'")
    return results


if __name__ == "__main__":
    main()
