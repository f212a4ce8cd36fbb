"""The readable per-param oracle ``LadderAdamW._step_param`` (one param, prepare then
commit, in plain torch ops) against the optimizer's real step on the eager path and the
C kernel: the same bits for params, moments and step counts."""

from __future__ import annotations

import pytest
import torch

from optladder.optimizers import LadderAdamW
from optladder.optimizers.kernels import cpu

BACKENDS = ["eager"] + ([] if cpu.unavailable_reason() else ["cpu"])
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(7)
    shapes = [(33, 17), (5,), (260,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, object]]:
    # two groups with different options: the oracle reads each group's own
    return [
        {"params": params[:2], "lr": 3e-2, "weight_decay": 0.1},
        {"params": params[2:], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("moment_dtype", "param_dtype"),
    # float32 params with float32 moments are the fp32 rung: torch's AdamW, not this class
    [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        # the bf16 rung's float64 params: the float32 update added in float64
        (torch.bfloat16, torch.float64),
    ],
    ids=[
        "bf16-moments",
        "bf16-moments-bf16-params",
        "fp32-moments-bf16-params",
        "bf16-moments-float64-params",
    ],
)
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_the_per_param_oracle_writes_the_steps_bits(
    backend: str,
    moment_dtype: torch.dtype,
    param_dtype: torch.dtype,
    rounding: str,
    decoupled: bool,
) -> None:
    if backend == "cpu" and param_dtype == torch.float64:
        pytest.skip("the C kernel steps no float64 param (backend='auto' steps it eagerly)")
    live, ref = _params(param_dtype), _params(param_dtype)
    kwargs = {
        "moment_dtype": moment_dtype,
        "rounding": rounding,
        "param_rounding": rounding,
        "seed": 11,
        "decoupled_weight_decay": decoupled,
    }
    opt = LadderAdamW(_groups(live), backend=backend, **kwargs)  # type: ignore[arg-type]
    oracle = LadderAdamW(_groups(ref), backend="eager", **kwargs)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for a, b in zip(live, ref, strict=True):
            grad = torch.randn(a.shape, generator=g).to(param_dtype)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        index = 0
        with torch.no_grad():
            for group in oracle.param_groups:
                for p in group["params"]:
                    oracle._step_param(p, group, index)
                    index += 1
        for a, b in zip(live, ref, strict=True):
            assert torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))
            sa, sb = opt.state[a], oracle.state[b]
            assert float(sa["step"]) == float(sb["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                assert sa[name].dtype == sb[name].dtype == moment_dtype
                assert torch.equal(sa[name], sb[name]), name


def test_the_oracle_never_rounds_a_float64_param_to_float32() -> None:
    """With ``lr=0`` (decoupled decay 0.1: the factor 1 - lr * wd is 1) a float64 param
    keeps its bits, in the oracle as in the step (README: float64 params on the bf16 rung
    get the float32 update added in float64); the oracle had rounded it to float32."""
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(300, generator=gen, dtype=torch.float64))
    start = p.detach().clone()
    assert not torch.equal(start.float().double(), start)  # bits float32 cannot hold
    oracle = LadderAdamW([p], lr=0.0, weight_decay=0.1, backend="eager")
    for _ in range(2):
        p.grad = torch.randn(300, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            oracle._step_param(p, oracle.param_groups[0], 0)
    assert torch.equal(p.detach().view(torch.int64), start.view(torch.int64))
    assert float(oracle.state[p]["step"]) == 2.0
