"""Does the bf16 rung train as well as fp32 AdamW? Do bf16 params? Small tasks, same seeds.

Tasks (``--tasks``, comma-separated; each runs alone):
    digits: an MLP on scikit-learn's 8x8 digits (1,797 images, 10 classes).
    stdlib-lm: a small causal transformer language model over bytes, trained from
        scratch on the source of Python's own standard library (the ``.py`` files next
        to ``os.py``), evaluated on a held-out tail of that text.
    lm-bf16-params: the same language model with its params in bfloat16
        (``model.to(torch.bfloat16)``, grads in bfloat16, loss in float32). Forward and
        backward run in ``--bf16-compute``: bfloat16 (as on a GPU), or float32 (default:
        each bfloat16 param is cast to float32 where it is used and its grad rounded back
        to bfloat16, so only the params' storage and the optimizer's writes differ from the
        float32 run; CPUs without native bfloat16 matmul take hours for the bfloat16 form).

Optimizers of digits and stdlib-lm, same seed (same init, same batches): torch's AdamW
with float32 moments, optladder's AdamW with bf16 moments and stochastic rounding, and
with round-to-nearest. Optimizers of lm-bf16-params: optladder's AdamW with float32
moments (the fp32 rung) on float32 params, and on bfloat16 params whose writes are
stochastically rounded (``param_rounding="stochastic"``) or rounded to nearest
(``param_rounding="nearest"``): only the params' dtype and their rounding differ.
The table gives the final losses and each one's gap to the task's fp32 run; a PNG shows
the curves.

    python bench/convergence.py                      # ~15-25 minutes on 2 CPU cores
    python bench/convergence.py --lm-steps 200 --digits-epochs 10   # a quick look
    python bench/convergence.py --tasks lm-bf16-params --lm-steps 300  # bf16 params only

Not a test; the issue's bar: bf16 stochastic within 1% of fp32's final loss.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from optladder.optimizers.adamw import LadderAdamW

TASKS = ("digits", "stdlib-lm", "lm-bf16-params")

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def optimizers(lr: float, weight_decay: float) -> dict[str, OptFactory]:
    """The three contenders, with the same hyperparameters."""
    return {
        "fp32 AdamW (torch)": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay),
        "bf16 stochastic": lambda ps: LadderAdamW(
            ps, lr=lr, weight_decay=weight_decay, rounding="stochastic", seed=0
        ),
        "bf16 nearest": lambda ps: LadderAdamW(
            ps, lr=lr, weight_decay=weight_decay, rounding="nearest", seed=0
        ),
    }


def bf16_param_optimizers(lr: float, weight_decay: float) -> dict[str, OptFactory]:
    """lm-bf16-params' contenders: float32 moments (the fp32 rung) on every one; the first
    steps float32 params, the others bfloat16 params with each ``param_rounding``."""

    def make(param_rounding: str) -> OptFactory:
        return lambda ps: LadderAdamW(
            ps,
            lr=lr,
            weight_decay=weight_decay,
            moment_dtype=torch.float32,
            param_rounding=param_rounding,  # type: ignore[arg-type]
            seed=0,
        )

    return {
        "fp32 params": make("stochastic"),  # float32 params: nothing to round
        "bf16 params, SR": make("stochastic"),
        "bf16 params, nearest": make("nearest"),
    }


@dataclass
class Run:
    """One training run: the loss curve and the final numbers."""

    task: str
    optimizer: str
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    final_train: float = math.nan
    final_eval: float = math.nan
    seconds: float = 0.0


# ---------------------------------------------------------------- digits MLP


def run_digits(name: str, make: OptFactory, epochs: int, seed: int) -> Run:
    """MLP 64-256-256-10 on digits, batch 32; eval loss on a fixed 25% split."""
    from sklearn.datasets import load_digits

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np, dtype=torch.int64)
    split = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    n_eval = len(x) // 4
    xe, ye, xt, yt = x[split[:n_eval]], y[split[:n_eval]], x[split[n_eval:]], y[split[n_eval:]]
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )
    opt = make(list(model.parameters()))
    gen = torch.Generator().manual_seed(seed)
    run = Run("digits", name)
    step, t0, last_epoch = 0, time.perf_counter(), []
    for epoch in range(epochs):
        order = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), 32):
            idx = order[i : i + 32]
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            run.steps.append(step)
            run.train_loss.append(loss.item())
            if epoch == epochs - 1:
                last_epoch.append(loss.item())
    with torch.no_grad():
        run.final_eval = F.cross_entropy(model(xe), ye).item()
        run.final_train = F.cross_entropy(model(xt), yt).item()
    run.seconds = time.perf_counter() - t0
    return run


# ---------------------------------------------------------------- stdlib byte LM


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's ``.py`` sources, sorted by path, concatenated."""
    os_file = __import__("os").__file__
    if os_file is None:  # a frozen standard library: no sources next to os
        raise RuntimeError("os.__file__ is None: no standard library sources to read")
    root = Path(os_file).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    """Byte-level causal LM: embeddings, ``layers`` blocks, tied output head."""

    def __init__(self, d: int = 128, layers: int = 4, heads: int = 4, context: int = 128):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.ln(self.blocks(x)) @ self.tok.weight.T


def run_lm(
    name: str,
    make: OptFactory,
    steps: int,
    seed: int,
    data: torch.Tensor,
    *,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    task: str = "stdlib-lm",
) -> Run:
    """Train on the first 90% of the bytes, batch 32 x 128; eval on the last 10%.

    The model is built in float32 from ``seed`` and then cast to ``param_dtype`` (so every
    dtype starts from the same init, rounded to nearest once); the loss is taken in
    float32 from the logits. With ``compute_dtype`` (another dtype than ``param_dtype``)
    the forward runs on the params cast to it (``torch.func.functional_call``); the
    cast's backward rounds each grad back to ``param_dtype`` (round to nearest).
    """
    context, batch = 128, 32
    cut = int(len(data) * 0.9)
    train, held = data[:cut], data[cut:]
    torch.manual_seed(seed)
    model = ByteLM(context=context).to(param_dtype)
    opt = make(list(model.parameters()))

    def forward(xb: torch.Tensor) -> torch.Tensor:
        if compute_dtype is None or compute_dtype == param_dtype:
            return model(xb)
        cast = {n: p.to(compute_dtype) for n, p in model.named_parameters()}
        return torch.func.functional_call(model, cast, (xb,))

    gen = torch.Generator().manual_seed(seed)
    run = Run(task, name)
    t0 = time.perf_counter()
    tail: list[float] = []
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(train) - context - 1, (batch,), generator=gen)
        xb = torch.stack([train[s : s + context] for s in starts])
        yb = torch.stack([train[s + 1 : s + context + 1] for s in starts])
        loss = F.cross_entropy(forward(xb).float().reshape(-1, 256), yb.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.steps.append(step)
        run.train_loss.append(loss.item())
        if step > steps - max(1, steps // 10):
            tail.append(loss.item())
    run.final_train = sum(tail) / len(tail)  # mean over the last 10% of steps
    with torch.no_grad():
        starts = torch.arange(0, len(held) - context - 1, context)[:64]
        xb = torch.stack([held[s : s + context] for s in starts])
        yb = torch.stack([held[s + 1 : s + context + 1] for s in starts])
        logits = forward(xb).float().reshape(-1, 256)
        run.final_eval = F.cross_entropy(logits, yb.reshape(-1)).item()
    run.seconds = time.perf_counter() - t0
    return run


# ---------------------------------------------------------------- report


def report(runs: list[Run]) -> str:
    """The table: final losses and the relative gap of each to fp32 on the same task."""
    lines = [
        f"{'task':<15}{'optimizer':<21}{'train loss':>11}{'eval loss':>11}"
        f"{'train gap':>11}{'eval gap':>10}{'seconds':>9}"
    ]
    for r in runs:
        base = next(b for b in runs if b.task == r.task and b.optimizer.startswith("fp32"))
        gap_t = 100 * (r.final_train - base.final_train) / base.final_train
        gap_e = 100 * (r.final_eval - base.final_eval) / base.final_eval
        lines.append(
            f"{r.task:<15}{r.optimizer:<21}{r.final_train:11.4f}{r.final_eval:11.4f}"
            f"{gap_t:+10.2f}%{gap_e:+9.2f}%{r.seconds:9.1f}"
        )
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> None:
    """Loss curves (smoothed over 25 steps), one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r.task for r in runs))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in runs:
            if r.task != task:
                continue
            y = torch.tensor(r.train_loss)
            k = min(25, len(y))
            smooth = torch.nn.functional.avg_pool1d(y[None, None], k, 1).flatten()
            ax.plot(r.steps[k - 1 :], smooth.tolist(), label=r.optimizer, linewidth=1)
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (25-step mean)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Run]:
    """Train every (task, optimizer) pair; print the table; write the PNG."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--digits-epochs", type=int, default=20)
    ap.add_argument("--lm-steps", type=int, default=600)
    ap.add_argument("--lm-bytes", type=int, default=4_000_000, help="stdlib text to use")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--bf16-compute",
        choices=("float32", "bfloat16"),
        default="float32",
        help="lm-bf16-params: the dtype forward/backward run in (default float32)",
    )
    ap.add_argument(
        "--tasks",
        default=",".join(TASKS),
        help=f"comma-separated, from {', '.join(TASKS)} (default: all)",
    )
    ap.add_argument(
        "--png",
        type=lambda s: Path(s) if s else None,
        default=Path("bench/out/convergence.png"),
        help="write the loss curves here ('' for none)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    runs: list[Run] = []
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        ap.error(f"--tasks={args.tasks!r}: unknown {unknown}; expected some of {', '.join(TASKS)}")
    if "digits" in tasks:
        for name, make in optimizers(lr=1e-3, weight_decay=1e-2).items():
            runs.append(run_digits(name, make, args.digits_epochs, args.seed))
            print(f"digits    {name:<21} done in {runs[-1].seconds:.1f}s", flush=True)
    if "stdlib-lm" in tasks or "lm-bf16-params" in tasks:
        text = stdlib_text(args.lm_bytes)
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        print(f"stdlib-lm: {len(text):,} bytes of {sys.version.split()[0]} stdlib source")
    if "stdlib-lm" in tasks:
        for name, make in optimizers(lr=2e-3, weight_decay=1e-2).items():
            runs.append(run_lm(name, make, args.lm_steps, args.seed, data))
            print(f"stdlib-lm {name:<21} done in {runs[-1].seconds:.1f}s", flush=True)
    if "lm-bf16-params" in tasks:
        for name, make in bf16_param_optimizers(lr=2e-3, weight_decay=1e-2).items():
            dtype = torch.float32 if name.startswith("fp32") else torch.bfloat16
            runs.append(
                run_lm(
                    name,
                    make,
                    args.lm_steps,
                    args.seed,
                    data,
                    param_dtype=dtype,
                    compute_dtype=getattr(torch, args.bf16_compute),
                    task="lm-bf16-params",
                )
            )
            print(
                f"lm-bf16-params {name:<21} done in {runs[-1].seconds:.1f}s "
                f"(compute {args.bf16_compute})",
                flush=True,
            )
    print(report(runs))
    if args.png:
        try:
            plot(runs, args.png)
            print(f"plot: {args.png}")
        except ImportError as exc:  # the table above is the result; the plot is extra
            print(f"no plot: matplotlib is not importable ({exc}); pip install 'matplotlib>=3.7'")
    return runs


if __name__ == "__main__":
    main()
