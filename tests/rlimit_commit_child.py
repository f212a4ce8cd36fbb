"""Child process of ``test_ladder.py::test_a_real_oom_at_a_transposed_params_step_...``.

One transposed float32 param (2,000 x 2,000, 16,000,000 bytes) on the fp32 rung takes a
step; then the process caps its own address space (``RLIMIT_AS``) ``argv[1]`` MiB above
what it uses and takes a second step. Prints one JSON line: the error the capped step
raised (its type and first line; none if it stepped), and whether the param and its
state are as before the step (bit for bit).
"""

from __future__ import annotations

import json
import resource
import sys

import torch

N = 2_000


def main() -> None:
    from optladder import choose_optimizer

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N, N).t())
    opt = choose_optimizer([p], lr=1e-2, free_memory="64GiB")
    for seed in range(2):
        grad = torch.randn(N, N, generator=torch.Generator().manual_seed(seed))
        p.grad = torch.empty_like(p).copy_(grad)  # laid out like the param, as autograd's
        if seed == 0:
            opt.step()
    before = [p.detach().clone(), *(opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq"))]
    step_before = float(opt.state[p]["step"])
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + int(sys.argv[1]) * 2**20, hard))
    error = None
    try:
        opt.step()
    except Exception as exc:  # reported: the test judges it
        error = [type(exc).__name__, str(exc).splitlines()[0][:300]]
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    state = opt.state.get(p, {})
    now = [p.detach(), state.get("exp_avg"), state.get("exp_avg_sq")]
    unchanged = (
        all(
            isinstance(b, torch.Tensor) and b.dtype == a.dtype and torch.equal(a, b)
            for a, b in zip(before, now)
        )
        and float(state.get("step", -1)) == step_before
    )
    print(json.dumps({"error": error, "unchanged": unchanged, "rung": opt.rung}))


if __name__ == "__main__":
    main()
