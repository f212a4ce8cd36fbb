"""What a step keeps between steps (checked inputs, the kernels' param tables) is made
again when what it was made from changes: each change below is made to an optimizer that
has stepped (so its tables exist), and its next step must equal, bit for bit, the step of
a fresh optimizer that loads the same state_dict (which has nothing kept)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from optladder import choose_optimizer
from optladder.optimizers import LadderAdamW

# 8,192 and 5,000 elements: quantized on the 8-bit rung; 300 and 17: float32 state there
SIZES = (8192, 300, 5000, 17)
RUNGS = ("fp32", "bf16", "8bit")


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2


def _build(params: list[torch.nn.Parameter], rung: str, groups: int = 2) -> Any:
    split = [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}][:groups]
    if groups == 1:
        split = [{"params": params}]
    return choose_optimizer(split, lr=1e-2, weight_decay=0.1, rung=rung, free_memory="64GiB")


def _assert_same(a: Any, pa: list[torch.Tensor], b: Any, pb: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"param {i} differs"
        sa, sb = a.state.get(x, {}), b.state.get(y, {})
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            other = sb[key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"param {i} state {key} differs"
            else:
                assert value == other, f"param {i} state {key} differs"


def _new_grads(opt: Any, params: list[torch.nn.Parameter]) -> None:
    _grads(params, 99)  # new grad tensors, new values


def _grads_in_place(opt: Any, params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad.mul_(-3.0)  # same tensors, new values


def _lr(opt: Any, params: list[torch.nn.Parameter]) -> None:
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    opt.step()  # the scheduler's order check wants a step before its first step()
    scheduler.step()  # sets each group's lr, as every torch scheduler does


def _weight_decay(opt: Any, params: list[torch.nn.Parameter]) -> None:
    opt.param_groups[1]["weight_decay"] = 0.5


def _betas(opt: Any, params: list[torch.nn.Parameter]) -> None:
    opt.param_groups[0]["betas"] = (0.5, 0.9)


def _eps(opt: Any, params: list[torch.nn.Parameter]) -> None:
    opt.param_groups[0]["eps"] = 1e-3


def _fewer_grads(opt: Any, params: list[torch.nn.Parameter]) -> None:
    params[2].grad = None  # another set of params steps


def _load(opt: Any, params: list[torch.nn.Parameter]) -> None:
    other = _params(seed=5)
    twin = _build(other, opt.rung)
    for s in range(3):
        _grads(other, 40 + s)
        twin.step()
    opt.load_state_dict(copy.deepcopy(twin.state_dict()))  # new state tensors


CHANGES: dict[str, Callable[[Any, list[torch.nn.Parameter]], None]] = {
    "new grad tensors": _new_grads,
    "grads written in place": _grads_in_place,
    "lr set by a scheduler": _lr,
    "weight_decay": _weight_decay,
    "betas": _betas,
    "eps": _eps,
    "a param without grad": _fewer_grads,
    "load_state_dict": _load,
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("rung", RUNGS)
def test_a_change_between_steps_reaches_the_next_step(rung: str, change: str) -> None:
    params = _params()
    opt = _build(params, rung)
    for s in range(2):  # the kept tables exist after these
        _grads(params, s)
        opt.step()
    CHANGES[change](opt, params)
    # a fresh optimizer at the same point: same params, state, options and grads
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, fresh_params):
        q.grad = None if p.grad is None else p.grad.clone()
    fresh = _build(fresh_params, rung)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for group, fresh_group in zip(opt.param_groups, fresh.param_groups):
        assert group["lr"] == fresh_group["lr"] and group["betas"] == fresh_group["betas"]
    _assert_same(opt, params, fresh, fresh_params)
    opt.step()
    fresh.step()
    _assert_same(opt, params, fresh, fresh_params)
    if change != "a param without grad":  # and a second step on the same inputs
        opt.step()
        fresh.step()
        _assert_same(opt, params, fresh, fresh_params)


@pytest.mark.parametrize("rung", RUNGS)
def test_add_param_group_between_steps(rung: str) -> None:
    """A group added after the tables exist is stepped; the others as before."""
    params = _params()
    opt = _build(params[:2], rung, groups=1)
    for s in range(2):
        _grads(params, s)
        opt.step()
    opt.add_param_group({"params": params[2:], "lr": 5e-3})
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, fresh_params):
        q.grad = p.grad.clone()
    fresh = _build(fresh_params[:2], rung, groups=1)
    fresh.add_param_group({"params": fresh_params[2:], "lr": 5e-3})
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(2):
        opt.step()
        fresh.step()
    _assert_same(opt, params, fresh, fresh_params)
    assert all(int(opt.state[p]["step"]) == 2 for p in params[2:])


def test_an_escalation_between_steps_reaches_the_next_step() -> None:
    """bf16 -> 8bit after the bf16 tables exist: the 8bit step equals a fresh 8bit
    optimizer's from the same state."""
    params = _params()
    opt = _build(params, "bf16")
    for s in range(2):
        _grads(params, s)
        opt.step()
    opt.migrate_to("8bit", "test", force=True)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, fresh_params):
        q.grad = p.grad.clone()
    fresh = _build(fresh_params, "8bit")
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.step()
    fresh.step()
    _assert_same(opt, params, fresh, fresh_params)


def test_state_replaced_by_hand_is_not_stepped_through_the_old_table() -> None:
    """bf16 kernel table kept, then a param's moments replaced by new tensors: the step
    writes the new tensors, as the eager oracle does (round to nearest: no keys)."""
    params = _params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = LadderAdamW(params, rounding="nearest", backend="cpu")
    ref = LadderAdamW(twin, rounding="nearest", backend="eager")
    for s in range(2):
        _grads(params, s)
        _grads(twin, s)
        opt.step()
        ref.step()
    old = opt.state[params[0]]["exp_avg_sq"]
    old_values = old.clone()
    for o, p in ((opt, params[0]), (ref, twin[0])):
        o.state[p]["exp_avg"] = torch.full_like(o.state[p]["exp_avg"], 0.125)
        o.state[p]["exp_avg_sq"] = o.state[p]["exp_avg_sq"].clone()
    opt.step()
    ref.step()
    assert torch.equal(old, old_values)  # the replaced tensor was not written
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_steps_on_fresh_grads_leave_no_new_containers_behind(rung: str) -> None:
    """Over many param groups, a step on new grad tensors (as ``zero_grad()`` and a
    backward make them) fills the containers the last step made instead of making new
    ones: the objects made by two such steps that are still alive after them (besides
    the grads themselves) are fewer than one per group. A step that left a few per
    group behind (the fp32 rung's kernel lists, the memo's params lists, the bf16 rung's
    staged lists) had them outlive its young-generation collections, and with ~300,000
    objects in the process a full collection (~0.2 s) came every ~10 steps (1,000 groups:
    0.64-0.73x torch's fused step, 1.08 after)."""
    import gc

    if rung == "8bit":
        pytest.importorskip("bitsandbytes")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, generator=gen)) for _ in range(600)]
    groups = [
        {"params": params[2 * g : 2 * g + 2], "lr": 1e-3 * 0.99**g, "weight_decay": 0.01 * (g % 2)}
        for g in range(300)
    ]
    opt = choose_optimizer(groups, lr=1e-3, rung=rung, free_memory="1GiB", environ={})

    def step() -> None:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()

    for _ in range(3):  # past the first steps (state, tables, the memo's first records)
        step()
    gc.collect()
    gc.freeze()  # what exists now is left out of gc.get_objects()
    try:
        step()
        step()
        made = [o for o in gc.get_objects() if not isinstance(o, torch.Tensor)]
    finally:
        gc.unfreeze()
    assert len(made) < len(groups), sorted({type(o).__name__ for o in made})
