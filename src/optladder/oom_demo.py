"""A real out-of-memory error on the CPU, and the ladder recovering from it.

A child process trains a wide MLP (about 34 million params) on the UCI digits. The
optimizer is chosen while memory is plentiful, so the policy picks fp32. After one
warm-up forward/backward, the child caps its own address space (``RLIMIT_AS``) so that
the fp32 rung's state (8 bytes a param) cannot be allocated while the bf16 rung's (4 bytes
a param) can. The first optimizer step runs out of memory for real (the CPU allocator's
"can't allocate memory"), the ladder moves to bf16, and training finishes.

Run it with ``optladder demo --oom``. The limit only ever applies to the child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

HIDDEN = 4096
"""Width of the MLP's three hidden layers: 64*4096 + 2*4096**2 + 4096*10 weights."""


def wide_mlp() -> nn.Module:
    """64 -> HIDDEN -> HIDDEN -> HIDDEN -> 10 with ReLU (33,845,258 params), initialized
    from seed 0."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )


def _vms() -> int:
    import psutil

    return int(psutil.Process().memory_info().vms)


def child(steps: int) -> int:
    """The child's job: train under an address-space cap that only bf16 state fits in.

    Returns:
        0 when training finished after exactly one escalation fp32 -> bf16.
    """
    import resource

    from optladder.demo import load_digits_split
    from optladder.optimizers.adamw import LadderAdamW
    from optladder.policies.footprint import measure_footprint
    from optladder.selector.adamw import choose_optimizer
    from optladder.selector.ladder import Ladder

    x_train, y_train, x_test, y_test = load_digits_split(0)
    model = wide_mlp()
    footprint = measure_footprint(model)
    opt = choose_optimizer(model, lr=1e-4, weight_decay=0.01)
    print(f"child: {footprint.trainable_params:,} params; decision before the cap:")
    print(opt.decision.summary())
    ladder = Ladder(opt)
    loss_fn = nn.CrossEntropyLoss()

    def train_step(idx: torch.Tensor) -> float:
        opt.zero_grad()
        loss = loss_fn(model(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        return float(loss.item())

    # Warm up: one forward/backward (grads allocated), and the bf16 kernel loaded, so
    # that what remains to allocate is the optimizer state.
    loss_fn(model(x_train[:64]), y_train[:64]).backward()
    tiny = nn.Parameter(torch.zeros(8))
    tiny.grad = torch.zeros(8)
    LadderAdamW([tiny]).step()
    fp32, bf16 = footprint.state_bytes["fp32"], footprint.state_bytes["bf16"]
    headroom = (fp32 + bf16) // 2
    limit = _vms() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(
        f"child: RLIMIT_AS set to {limit:,} bytes: {headroom:,} bytes of headroom, under the "
        f"fp32 state ({fp32:,} bytes), over the bf16 state ({bf16:,} bytes)"
    )
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        idx = torch.randint(len(y_train), (64,), generator=gen)
        loss = ladder.run(train_step, idx)
        print(f"child: step {step:3d}  rung {opt.rung}  loss {loss:.4f}")
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(
        f"child: finished {steps} steps in {time.perf_counter() - start:.1f} s on {opt.rung}; "
        f"test accuracy {accuracy:.2%}; escalations: "
        + "; ".join(f"{e.from_rung} -> {e.to_rung} ({e.reason})" for e in opt.escalations)
    )
    return 0 if [(e.from_rung, e.to_rung) for e in opt.escalations] == [("fp32", "bf16")] else 1


def run_oom_demo(steps: int = 20, log: Callable[[str], None] = print) -> int:
    """Run :func:`child` in a fresh process and relay its output.

    Returns:
        The child's exit status (0: it escalated once and finished).
    """
    code = f"import sys; from optladder.oom_demo import child; sys.exit(child(steps={int(steps)}))"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("OPTLADDER_RUNG", "OPTLADDER_BF16_ADAM", "OPTLADDER_8BIT_ADAM"):
        env.pop(name, None)  # the demo shows the policy's choice and the ladder
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the escalation's log line in its place
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        log(line)
    return proc.returncode
