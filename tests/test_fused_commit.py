"""The fp32 rung's commit calls torch's fused kernel on lists made in the prepare phase
(:mod:`optladder.optimizers.fusedstep`), not ``torch.optim.AdamW.step``: its params and
state must equal, bit for bit, those of ``torch.optim.AdamW(fused=True)`` (the reference
here) stepped on the same grads, through new grads, grads written in place, a param
without a grad, an lr set between steps and a group added later; options the direct call
does not take (a tensor lr) go through torch's ``step``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optladder import choose_optimizer

SIZES = ((64, 3), (17,), (5, 5), (300,))


def _pair(decoupled: bool, lr: Any = 1e-2) -> tuple[list[Any], list[Any], Any, Any]:
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SIZES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(ps: list[Any]) -> list[dict[str, Any]]:
        return [{"params": ps[:2]}, {"params": ps[2:3], "lr": 3e-3, "weight_decay": 0.3}]

    opt = choose_optimizer(
        groups(ours),
        lr=lr,
        weight_decay=0.1,
        rung="fp32",
        free_memory="1GiB",
        environ={},
        decoupled_weight_decay=decoupled,
    )
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch_lr = lr.clone() if isinstance(lr, torch.Tensor) else lr
    reference = cls(groups(ref), lr=torch_lr, weight_decay=0.1, fused=True)
    return ours, ref, opt, reference


def _grads(ours: list[Any], ref: list[Any], seed: int, skip: int | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i, (p, q) in enumerate(zip(ours, ref)):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = (None, None) if i == skip else (g, g.clone())


def _assert_equal(opt: Any, ours: list[Any], reference: Any, ref: list[Any]) -> None:
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert torch.equal(p, q), f"param {i}"
        a, b = opt.state.get(p, {}), reference.state.get(q, {})
        assert a.keys() == b.keys(), f"param {i}"
        if a:
            assert torch.equal(a["exp_avg"], b["exp_avg"]), f"param {i}"
            assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]), f"param {i}"
            assert float(a["step"]) == float(b["step"]), f"param {i}"


def _count_init_group(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of torch's ``Adam._init_group`` (what torch's ``step`` runs per group)."""
    calls = [0]
    original = torch.optim.Adam._init_group

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "_init_group", counted)
    return calls


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_the_direct_kernel_call_equals_torchs_fused_step(
    decoupled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, ref, opt, reference = _pair(decoupled)
    calls = _count_init_group(monkeypatch)
    for s in range(7):
        if s == 2:  # grads written in place: the same tensors
            for p, q in zip(ours, ref):
                p.grad.mul_(-0.5)
                q.grad.mul_(-0.5)
        else:
            _grads(ours, ref, s, skip=1 if s in (3, 4) else None)
        if s == 4:  # an lr set between steps, as a scheduler does
            for group in (*opt.param_groups, *reference.param_groups):
                group["lr"] *= 0.5
        if s == 5:  # a group added after the lists exist
            opt.add_param_group({"params": ours[3:], "lr": 2e-3})
            reference.add_param_group({"params": ref[3:], "lr": 2e-3})
            _grads(ours, ref, 50 + s)
        before = calls[0]
        opt.step()
        assert calls[0] == before, "optladder's step ran torch's step"
        reference.step()
        _assert_equal(opt, ours, reference, ref)
    assert float(opt.state[ours[1]]["step"]) == 5  # no grad at steps 3 and 4


def test_a_tensor_lr_steps_through_torchs_step(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, ref, opt, reference = _pair(True, lr=torch.tensor(1e-2))
    calls = _count_init_group(monkeypatch)
    for s in range(3):
        _grads(ours, ref, s)
        before = calls[0]
        opt.step()
        assert calls[0] > before  # torch's step ran (it moves a tensor lr per device)
        reference.step()
        _assert_equal(opt, ours, reference, ref)
