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
    """Count calls of torch's functional AdamW from the fp32 format's engine (what it
    runs instead of the direct kernel call: torch's own step over the lists)."""
    from optladder.optimizers import torchroute

    calls = [0]
    original = torchroute.step_functional

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(torchroute, "step_functional", counted)
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


# which params have a grad at each step (param 4 first at step 2; param 2 is a column
# slice of a buffer, stepped through a contiguous copy, after params that lack a grad at
# some steps); step 5 has none
_HAVING = [
    {0, 1, 2, 3},
    {1, 2},
    {0, 2, 3, 4},
    {3},
    {0, 1, 2, 3, 4},
    set(),
    {2, 4},
    {0, 1, 3},
]


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "grad_scale"])
def test_steps_that_change_which_params_have_a_grad_keep_what_prepare_made(
    amp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Params that have a grad at some steps only (experts, a task's head): every step
    equals torch's fused AdamW bit for bit (params, moments, step counts: each param's
    count is the number of steps at which it had a grad), through the direct kernel call,
    and once every param has its state, such a step neither reads the state again (the
    memo's record is kept: it was made again at every such step, with every param's state
    looked up, its moments' layout read and its step count's memory cell made again, about
    0.5-0.55x torch's step over 20,000 x 256 params with 1% missing a grad) nor makes the
    step counts' cells again. With ``grad_scale`` the grads are 64 times larger and divided
    back before the commit (powers of two: exact)."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(12, 9, generator=gen)
    shapes = [(64, 3), (17,), None, (300,), (5, 5)]
    ours: list[Any] = [
        buf[:, 2:6].requires_grad_()
        if s is None
        else torch.nn.Parameter(torch.randn(s, generator=gen))
        for s in shapes
    ]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(ps: list[Any]) -> list[dict[str, Any]]:
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.3}]

    opt = choose_optimizer(
        groups(ours), lr=1e-2, weight_decay=0.1, rung="fp32", free_memory="1GiB", environ={}
    )
    reference = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1, fused=True)
    calls = _count_init_group(opt.engine, monkeypatch)
    kept = []
    for s, having in enumerate(_HAVING):
        gen = torch.Generator().manual_seed(100 + s)
        for i, (p, q) in enumerate(zip(ours, ref)):
            g = torch.randn(p.shape, generator=gen)
            q.grad = g.clone() if i in having else None
            p.grad = g * 64 if amp and i in having else g if i in having else None
        if amp:
            opt.grad_scale = torch.tensor(64.0)
        opt.step()
        reference.step()
        _assert_equal(opt, ours, reference, ref)
        engine = opt.engine
        kept.append((dict(engine._group_plans), engine._torch_counts._steps))
    assert calls[0] == 0  # every step took the direct kernel call
    counts = [sum(i in having for having in _HAVING) for i in range(len(ours))]
    assert [float(opt.state[p]["step"]) for p in ours] == counts
    # from step 2 (param 4's first grad) on, all have state: nothing made again (the
    # groups' plans, the step counts' cells; step 5, where no param has a grad, prepares
    # nothing)
    assert all(k[0] == kept[2][0] and k[1] is kept[2][1] for k in kept[2:] if k is not kept[5])


def test_the_commit_lists_are_filled_again_and_hold_no_grad_between_steps() -> None:
    """The fused commit's lists are made once and filled again at every step (made anew
    for each of 1,000 groups, they outlived the step's young-generation collections and
    set off a full garbage collection every ~10 steps), and hold no grad between steps:
    ``zero_grad()`` frees the grads (a kept grad would double the grads' memory), also
    the contiguous copy of a param that is not dense. Every step equals torch's fused
    AdamW bit for bit."""
    import gc
    import weakref

    ours, ref, opt, reference = _pair(decoupled=True)
    buf = torch.randn(12, 9)
    cols = buf[:, 2:6].requires_grad_()  # not dense: stepped through a copy
    twin = torch.nn.Parameter(cols.detach().clone())
    opt.add_param_group({"params": [cols], "lr": 5e-3})
    reference.add_param_group({"params": [twin], "lr": 5e-3})
    ours, ref = [*ours, cols], [*ref, twin]
    containers = []
    for s in range(4):
        _grads(ours, ref, s, skip=1 if s == 2 else None)
        opt.step()
        reference.step()
        _assert_equal(opt, ours, reference, ref)
        kept = [c for plan in opt.engine._group_plans.values() for c in plan.torch_calls]
        assert all(not lists[1] and not fills and not back for _, lists, _, (fills, back) in kept)
        containers.append([id(x) for _, lists, options, _ in kept for x in (*lists, options)])
        stepped = [p for group in opt.param_groups for p in group["params"]]
        grads = [weakref.ref(p.grad) for p in stepped if p.grad is not None]
        opt.zero_grad()
        reference.zero_grad()
        gc.collect()
        assert all(g() is None for g in grads), s
    assert all(c == containers[0] for c in containers[1:])
