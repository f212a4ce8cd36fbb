"""Host cost of optladder for many small tensors: construction and one step, against
torch's fused AdamW on the same params in the same process.

Two transformer-like shapes (issue 9): 2,000 tensors of 4,096 elements and 20,000
tensors of 256 elements, float32 params and grads on the CPU, in one param group; and
many groups (``2000x4096/1000``: the same 2,000 tensors in 1,000 groups of 2, as
layer-wise learning rates make them: group ``g`` has ``lr = 1e-3 * 0.99**g`` and weight
decay 0.01 or 0, alternately). For each rung (``rung=`` forces it past the memory gate)
and for ``torch.optim.AdamW(fused=True)``:

- construction: seconds to build the optimizer (optladder's includes its one probe of
  the device's fused kernel and the decision; torch's has none);
- probe: seconds of that probe alone (``probe_capabilities``, timed where construction
  calls it, so its cold first step on freshly made params counts as the probe's), and
  construction without it (construction minus probe);
- step: seconds of one ``step()`` once the state exists (warm-up steps first), on the
  grads the warm-up steps had (kept: ``zero_grad(set_to_none=False)``, or accumulation);
- fresh: seconds a ``step()`` on new grads takes in the steady state of a training loop,
  the mean over ``--fresh-steps`` consecutive timed steps: every grad is replaced by a
  new tensor of the same values before each of ``--warmup`` untimed steps and before
  each timed one, as ``zero_grad()`` (set to None) and a backward make them at every
  step (what a step checks and writes again for new grads counts). Several steps, so
  that Python's garbage collections are counted at the rate a step's allocations cause
  them (one full collection of a process holding ~300,000 objects takes ~0.2 s: timed
  alone, a step that happens to trigger one reads several times slower, one that does
  not reads faster than it is).

Each rep builds and steps every implementation once, in an order rotated by one each
rep so that no implementation always runs first or last; reported are the median and
the min-max over reps, and the ratio of medians ``torch / optladder`` (above 1 is
faster than torch, below 1 slower; for construction, ``x`` is with the probe and ``x-p``
without it), then per implementation the ratio within each rep (torch's time over its,
both from the same rep) as ``median [min-max]`` over reps. Run with 1 and 2 threads
(``--threads 1,2``).

Usage::

    python bench/overhead.py                       # both shapes, 1 and 2 threads, 5 reps
    python bench/overhead.py --reps 9 --shapes 2000x4096 --threads 2
    python bench/overhead.py --threads 1 --clock cpu   # on a shared machine
    python bench/overhead.py --shapes 2000x4096/1000   # 1,000 param groups

``--clock cpu`` times with ``time.process_time`` (this process's CPU seconds) instead of
the wall clock: on a machine other jobs share, it leaves out the time this process waited
for a core. Use it with one thread (with more, it adds the threads' CPU seconds).

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import optladder
from optladder.selector import choose

Build = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def implementations(rungs: list[str]) -> dict[str, Build]:
    """Name -> a function that builds the optimizer over a list of params."""
    impls: dict[str, Build] = {
        "torch-fused-fp32": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    }
    for rung in rungs:
        impls[f"optladder-{rung}"] = lambda ps, r=rung: optladder.choose_optimizer(  # type: ignore[misc]
            ps, lr=1e-3, rung=r, free_memory="1TiB", environ={}
        )
    return impls


def make_params(count: int, numel: int) -> list[torch.nn.Parameter]:
    """``count`` float32 params of ``numel`` elements each, with float32 grads (seeded)."""
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(numel, generator=gen))
        p.grad = torch.randn(numel, generator=gen) * 1e-3
        params.append(p)
    return params


def make_groups(params: list[torch.nn.Parameter], groups: int) -> Any:
    """``params`` as they are (one group), or split into ``groups`` param groups of equal
    size with layer-wise options: group ``g`` has ``lr = 1e-3 * 0.99**g`` and weight decay
    0.01 (odd ``g``) or 0 (even ``g``: biases and norms)."""
    if groups == 1:
        return params
    size = len(params) // groups
    return [
        {
            "params": params[g * size : (g + 1) * size],
            "lr": 1e-3 * 0.99**g,
            "weight_decay": 0.01 if g % 2 else 0.0,
        }
        for g in range(groups)
    ]


def one_rep(
    impls: dict[str, Build],
    order: list[str],
    count: int,
    numel: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
    groups: int = 1,
    fresh_steps: int = 1,
) -> dict[str, tuple[float, float, float, float]]:
    """Build and step each implementation in ``order``: name -> (build s, probe s, step s,
    fresh-grads step s, the mean over ``fresh_steps`` steps, the grads made before each
    counted: as ``fresh_grads`` costs the same for every implementation, the ratios
    barely move); the probe is timed inside each build, where ``choose_optimizer`` calls
    it (0 for torch's); ``clock`` reads seconds."""
    out: dict[str, tuple[float, float, float, float]] = {}
    probe = choose.probe_capabilities
    probe_seconds = [0.0]

    def timed_probe(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return probe(*args, **kwargs)
        finally:
            probe_seconds[0] += clock() - t0

    for name in order:
        params = make_params(count, numel)
        gc.collect()
        probe_seconds[0] = 0.0
        choose.probe_capabilities = timed_probe
        try:
            t0 = clock()
            opt = impls[name](make_groups(params, groups))
            t_build = clock() - t0
        finally:
            choose.probe_capabilities = probe
        t_probe = probe_seconds[0]
        for _ in range(warmup):
            opt.step()
        t0 = clock()
        opt.step()
        t_step = clock() - t0
        for _ in range(warmup):  # a training loop's steps: new grads at every step
            fresh_grads(params)
            opt.step()
        t0 = clock()
        for _ in range(fresh_steps):
            fresh_grads(params)
            opt.step()
        t_fresh = (clock() - t0) / fresh_steps
        out[name] = (t_build, t_probe, t_step, t_fresh)
        del opt, params
    return out


def fresh_grads(params: list[torch.nn.Parameter]) -> None:
    """Give every param a new grad tensor of the same values, as ``zero_grad()`` (set to
    None) and a backward do at every step of a training loop."""
    for p in params:
        p.grad = p.grad.clone()  # type: ignore[union-attr]


def _ratios(base: list[float], mine: list[float]) -> str:
    """Each rep's ``base / mine`` (torch's seconds over the implementation's, measured in
    the same rep): ``median [min-max]``."""
    ratios = [b / m for b, m in zip(base, mine) if m > 0]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def spread(xs: list[float]) -> str:
    """``median [min-max]`` in milliseconds."""
    return f"{statistics.median(xs) * 1e3:9.2f} [{min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}]"


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print one table per (threads, shape)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--shapes",
        default="2000x4096,20000x256,2000x4096/1000",
        help="COUNTxNUMEL[/GROUPS],...",
    )
    ap.add_argument("--threads", default="1,2", help="torch thread counts to run")
    ap.add_argument("--rungs", default="fp32,bf16,8bit", help="optladder rungs to run")
    ap.add_argument("--reps", type=int, default=5, help="reps (>= 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed one")
    ap.add_argument(
        "--fresh-steps", type=int, default=10, help="timed steps on new grads (mean; >= 1)"
    )
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="wall clock or process CPU time"
    )
    args = ap.parse_args(argv)
    if args.reps < 3:
        ap.error(f"--reps must be >= 3, got {args.reps}")
    if args.fresh_steps < 1:
        ap.error(f"--fresh-steps must be >= 1, got {args.fresh_steps}")
    if args.warmup < 1:
        ap.error(f"--warmup must be >= 1 (the state must exist), got {args.warmup}")
    shapes = []
    for s in args.shapes.split(","):
        sizes, _, n_groups = s.lower().partition("/")
        try:
            count, numel = (int(x) for x in sizes.split("x"))
            groups = int(n_groups or 1)
        except ValueError:
            ap.error(f"--shapes: {s!r} is not COUNTxNUMEL[/GROUPS] like 2000x4096/1000")
        if groups < 1 or count % groups:
            ap.error(f"--shapes: {s!r}: GROUPS must divide COUNT")
        shapes.append((count, numel, groups))
    rungs = [r for r in args.rungs.split(",") if r]
    unknown = sorted(set(rungs) - set(optladder.RUNGS))
    if unknown:
        ap.error(f"--rungs: unknown {unknown}; choose from {list(optladder.RUNGS)}")
    impls = implementations(rungs)
    # The 8bit rung warns once per build that it is not fused on the CPU: said once here.
    warnings.filterwarnings("ignore", category=optladder.OptladderWarning)
    logging.getLogger("optladder").setLevel(logging.ERROR)
    names = list(impls)
    print(
        f"torch={torch.__version__} reps={args.reps} clock={args.clock} "
        "(median [min-max] ms; ratio torch/impl)"
    )
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for count, numel, groups in shapes:
            builds: dict[str, list[float]] = {n: [] for n in names}
            probes: dict[str, list[float]] = {n: [] for n in names}
            steps: dict[str, list[float]] = {n: [] for n in names}
            fresh: dict[str, list[float]] = {n: [] for n in names}
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            one_rep(impls, names, min(count, 64), numel, 1)  # untimed: imports, kernel loads
            for rep in range(args.reps):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name, (b, p, s, f) in one_rep(
                    impls, order, count, numel, args.warmup, clock, groups, args.fresh_steps
                ).items():
                    builds[name].append(b)
                    probes[name].append(p)
                    steps[name].append(s)
                    fresh[name].append(f)
            base_b = statistics.median(builds["torch-fused-fp32"])
            base_s = statistics.median(steps["torch-fused-fp32"])
            base_f = statistics.median(fresh["torch-fused-fp32"])
            in_groups = f" in {groups:,} groups" if groups > 1 else ""
            ratio_lines: list[str] = []
            no_probe = {n: [b - p for b, p in zip(builds[n], probes[n])] for n in names}
            print(f"\nthreads={threads}  {count:,} x {numel:,} float32{in_groups}")
            print(
                f"{'impl':<20}{'build ms':>28}{'x':>7}{'probe ms':>10}{'x-p':>7}"
                f"{'step ms':>28}{'x':>7}{'fresh grads ms':>28}{'x':>7}"
            )
            for name in names:
                paired = [
                    (
                        f"{name} per-rep torch/impl:",
                        f"build-p {_ratios(builds['torch-fused-fp32'], no_probe[name])}",
                        f"step {_ratios(steps['torch-fused-fp32'], steps[name])}",
                        f"fresh {_ratios(fresh['torch-fused-fp32'], fresh[name])}",
                    )
                ]
                rb = base_b / statistics.median(builds[name])
                without = [b - p for b, p in zip(builds[name], probes[name])]
                rbp = base_b / statistics.median(without)
                rs = base_s / statistics.median(steps[name])
                rf = base_f / statistics.median(fresh[name])
                line = f"{name:<20}{spread(builds[name]):>28}{rb:7.2f}"
                line += f"{statistics.median(probes[name]) * 1e3:10.2f}{rbp:7.2f}"
                line += f"{spread(steps[name]):>28}{rs:7.2f}"
                print(line + f"{spread(fresh[name]):>28}{rf:7.2f}")
                ratio_lines += [" ".join(row) for row in paired]
            for row in ratio_lines:
                print(row)


if __name__ == "__main__":
    main()
