"""torch.amp.GradScaler with every rung: overflow steps change nothing, others unscale."""

from __future__ import annotations

import copy

import pytest
import torch

from optladder import choose_optimizer

RUNGS = ("fp32", "bf16", "8bit")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))


def _backward(model: torch.nn.Module, scaler: torch.amp.GradScaler, poison: bool = False) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    if poison:
        loss = loss * float("inf")
    scaler.scale(loss).backward()


def _flat_state(opt) -> dict:  # type: ignore[no-untyped-def]
    out = {}
    for k, st in copy.deepcopy(opt.state_dict())["state"].items():
        for name, value in st.items():
            if isinstance(value, dict):
                for n2, v2 in value.items():
                    out[(k, n2)] = v2
            else:
                out[(k, name)] = value
    return out


@pytest.mark.parametrize("rung", RUNGS)
def test_overflow_step_changes_nothing(rung: str) -> None:
    model = _model()
    opt = choose_optimizer(model, free_memory="1GiB", rung=rung)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    assert opt.last_step_skipped is False
    params = [p.detach().clone() for p in model.parameters()]
    state = _flat_state(opt)
    opt.zero_grad()
    _backward(model, scaler, poison=True)
    scaler.step(opt)
    scaler.update()
    assert opt.last_step_skipped is True
    assert scaler.get_scale() == 2.0**9  # the scaler backed off: it saw the overflow
    for before, p in zip(params, model.parameters()):
        assert torch.equal(before, p)
    after = _flat_state(opt)
    assert after.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key  # bitsandbytes keeps step as an int


@pytest.mark.parametrize("rung", RUNGS)
def test_scaled_step_equals_a_plain_step(rung: str) -> None:
    """Scales are powers of two, so unscaling is exact: the same bits as no scaler."""
    model_a, model_b = _model(), _model()
    opt_a = choose_optimizer(model_a, free_memory="1GiB", rung=rung)
    opt_b = choose_optimizer(model_b, free_memory="1GiB", rung=rung)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for _ in range(3):
        opt_a.zero_grad()
        opt_b.zero_grad()
        _backward(model_a, scaler)
        _backward(model_b, torch.amp.GradScaler("cpu", enabled=False))
        scaler.step(opt_a)
        scaler.update()
        opt_b.step()
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)


def test_scheduler_recipe_skips_with_the_optimizer() -> None:
    model = _model()
    opt = choose_optimizer(model, lr=1.0, free_memory="1GiB")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    for poison in (False, True, False):
        opt.zero_grad()
        _backward(model, scaler, poison=poison)
        scaler.step(opt)
        scaler.update()
        if not opt.last_step_skipped:
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.25  # two real steps: 1.0 * 0.5 * 0.5
