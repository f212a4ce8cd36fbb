"""Step count tensors that two params share (``state[p2]["step"] is state[p1]["step"]``,
set by hand or in a hand-built state): each param counts its own steps, so a step refuses
them before anything is written, on every path (torch's fused commit, torch's own
``step``, the bf16 C kernel and the eager loop), and loads give each param its own.

torch's AdamW adds one per param that holds a shared tensor (two a step), so there is no
torch value to match for the shared case: references are torch's AdamW and optladder's
own steps from the same state with a step tensor per param."""

from __future__ import annotations

import copy

import pytest
import torch

from optladder import choose_optimizer
from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.fusedstep import StepCounts

SHARED = "share one step count tensor"


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(40, generator=gen)) for _ in range(3)]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _snapshot(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _ladder(params: list[torch.nn.Parameter], path: str) -> torch.optim.Optimizer:
    if path in ("cpu", "eager"):
        return LadderAdamW(params, backend=path)
    if path == "fp32 tensor lr":  # torch's own step (a tensor lr leaves the direct call)
        return choose_optimizer(params, free_memory="1GiB", rung="fp32", lr=torch.tensor(1e-3))
    return choose_optimizer(params, free_memory="1GiB", rung=path)


PATHS = ["fp32", "fp32 tensor lr", "bf16", "cpu", "eager"]


@pytest.mark.parametrize("path", PATHS)
def test_a_shared_step_tensor_is_refused_before_anything_is_written(path: str) -> None:
    params = _params()
    opt = _ladder(params, path)
    _grads(params, 0)
    opt.step()
    opt.state[params[2]]["step"] = opt.state[params[0]]["step"]  # by hand
    _grads(params, 1)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=f"param 0.* and param 2.*{SHARED}"):
        opt.step()
    _assert_same(_snapshot(params, opt), before)
    assert opt.state[params[0]]["step"].item() == 1.0  # not bumped
    # given back its own tensor, the param steps from its own count, as torch's AdamW
    opt.state[params[2]]["step"] = opt.state[params[0]]["step"].clone()
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("path", PATHS)
def test_a_hand_built_state_with_one_step_tensor_is_refused(path: str) -> None:
    params = _params()
    opt = _ladder(params, path)
    opt.step()  # no grads: no state yet
    step = torch.tensor(3.0, dtype=torch.float64)
    moments = torch.bfloat16 if path in ("bf16", "cpu", "eager") else torch.float32
    for p in params:
        opt.state[p] = {
            "step": step,  # one tensor for all: a hand-built state
            "exp_avg": torch.zeros(p.shape, dtype=moments),
            "exp_avg_sq": torch.zeros(p.shape, dtype=moments),
        }
    _grads(params, 0)
    with pytest.raises(ValueError, match=SHARED):
        opt.step()
    assert step.item() == 3.0 and all(torch.equal(p, q) for p, q in zip(params, _params()))


def test_the_fp32_rung_steps_as_torch_adamw_once_unshared() -> None:
    """After the refusal and the fix, the fused commit matches torch's fused AdamW from
    the same state (each param its own step): the same bits, counts 1 then 2."""
    params, ref_params = _params(), _params()
    opt = choose_optimizer(params, free_memory="1GiB", rung="fp32")
    ref = torch.optim.AdamW(ref_params, fused=True)
    for ps in (params, ref_params):
        _grads(ps, 0)
    opt.step()
    ref.step()
    opt.state[params[1]]["step"] = opt.state[params[0]]["step"]
    for ps in (params, ref_params):
        _grads(ps, 1)
    with pytest.raises(ValueError, match=SHARED):
        opt.step()
    opt.state[params[1]]["step"] = torch.tensor(1.0, dtype=torch.float64)
    opt.step()
    ref.step()
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)
        assert opt.state[p]["step"].item() == ref.state[q]["step"].item() == 2.0


def _shared_checkpoint(opt: torch.optim.Optimizer) -> dict:  # type: ignore[type-arg]
    """``opt``'s state_dict with one step tensor for every param (a hand-built file)."""
    sd = copy.deepcopy(opt.state_dict())
    step = sd["state"][0]["step"]
    for st in sd["state"].values():
        st["step"] = step
    return sd


def test_ladder_adamw_load_gives_each_param_its_own_step() -> None:
    """The C kernel and the eager loop, loaded from one checkpoint whose params share a
    step tensor, step alike (the same bits) and each param counts once; the
    checkpoint's tensor is left alone."""
    src = _params()
    opt = LadderAdamW(src)
    _grads(src, 0)
    opt.step()
    sd = _shared_checkpoint(opt)
    results = []
    for backend in ("cpu", "eager"):
        params = _params(seed=1)
        loaded = LadderAdamW(params, backend=backend)
        # a copy for each load (it keeps the sharing): the moments load as the
        # checkpoint's own tensors when their dtype fits, as torch loads them
        loaded.load_state_dict(copy.deepcopy(sd))
        steps = [loaded.state[p]["step"] for p in params]
        assert len({s.data_ptr() for s in steps}) == 3
        _grads(params, 1)
        loaded.step()
        assert [s.item() for s in steps] == [2.0, 2.0, 2.0]
        results.append(_snapshot(params, loaded))
    _assert_same(results[0], results[1])
    params = _params(seed=1)
    loaded = LadderAdamW(params)
    loaded.load_state_dict(sd)
    _grads(params, 1)
    loaded.step()
    assert sd["state"][0]["step"].item() == 1.0  # the checkpoint's count is its own


@pytest.mark.parametrize("rung", ["fp32", "bf16"])
def test_optladder_load_gives_each_param_its_own_step(rung: str) -> None:
    """Through optladder's load, a checkpoint with one step tensor steps like the same
    checkpoint with a tensor per param (the reference: torch's fused AdamW on fp32)."""
    src = _params()
    opt = choose_optimizer(src, free_memory="1GiB", rung=rung)
    _grads(src, 0)
    opt.step()
    sd = _shared_checkpoint(opt)
    own = copy.deepcopy(sd)
    for st in own["state"].values():
        st["step"] = st["step"].clone()
    params, ref_params = _params(seed=1), _params(seed=1)
    loaded = choose_optimizer(params, free_memory="1GiB", rung=rung)
    loaded.load_state_dict(sd)
    if rung == "fp32":
        ref: torch.optim.Optimizer = torch.optim.AdamW(ref_params, fused=True)
        ref.load_state_dict({**own, "param_groups": [dict(own["param_groups"][0], fused=True)]})
    else:
        ref = choose_optimizer(ref_params, free_memory="1GiB", rung=rung)
        ref.load_state_dict(own)
    for ps in (params, ref_params):
        _grads(ps, 1)
    loaded.step()
    ref.step()
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)
        assert loaded.state[p]["step"].item() == 2.0


def test_step_counts_refuse_a_tensor_listed_twice() -> None:
    step = torch.tensor(5.0, dtype=torch.float64)
    other = torch.tensor(1.0, dtype=torch.float64)
    counts = StepCounts()
    with pytest.raises(ValueError, match=f"param 0 and param 2 {SHARED}"):
        counts.bump([step, other, step])
    view = step.view(1)  # another tensor on the same memory
    with pytest.raises(ValueError, match=SHARED):
        counts.prepare([step, other, view], lambda i: f"row {i}")
    assert step.item() == 5.0 and other.item() == 1.0
    counts.bump([step, other])
    assert step.item() == 6.0 and other.item() == 2.0
