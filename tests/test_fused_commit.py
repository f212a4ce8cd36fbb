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


def _count_init_group(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of ``engine._init_group`` (what torch's ``step`` runs per group)."""
    calls = [0]
    original = engine._init_group  # bound; importing bitsandbytes wraps AdamW's own

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "_init_group", counted)
    return calls


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_the_direct_kernel_call_equals_torchs_fused_step(
    decoupled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, ref, opt, reference = _pair(decoupled)
    calls = _count_init_group(opt.engine, monkeypatch)
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
    calls = _count_init_group(opt.engine, monkeypatch)
    for s in range(3):
        _grads(ours, ref, s)
        before = calls[0]
        opt.step()
        assert calls[0] > before  # torch's step ran (it moves a tensor lr per device)
        reference.step()
        _assert_equal(opt, ours, reference, ref)


def _shape(p: Any) -> None:
    p.grad.data = torch.randn(p.numel() + 1)  # torch refuses this shape at ``p.grad =``


def _dtype(p: Any) -> None:
    p.grad_dtype = None  # torch >= 2.9 refuses another dtype otherwise
    p.grad = p.grad.double()


def _layout(p: Any) -> None:
    p.grad = p.grad.to_sparse()


def _strides(p: Any) -> None:
    p.grad = torch.randn(tuple(reversed(p.shape))).t()  # same shape, transposed layout


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_shape, "grad of shape"),
        (_dtype, "float64 grad"),
        (_layout, "sparse grad"),
        (_strides, "laid out alike"),
    ],
    ids=["shape", "dtype", "layout", "strides"],
)
def test_a_grad_that_changes_after_the_lists_exist_is_refused_before_any_write(
    change: Any, match: str
) -> None:
    ours, ref, opt, reference = _pair(True)
    for s in range(2):
        _grads(ours, ref, s)
        opt.step()
        reference.step()
    _grads(ours, ref, 2)
    ours[0].grad = ours[0].grad.clone()  # a new grad tensor, then changed
    change(ours[0])
    with pytest.raises(ValueError, match=match):
        opt.step()
    _assert_equal(opt, ours, reference, ref)  # nothing written, step counts included
