"""torch.amp.GradScaler with every rung: overflow steps change nothing, others unscale."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from optladder import choose_optimizer
from optladder.optimizers.adamw import LadderAdamW, distinct_grads

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


class _LoggingScaler(torch.amp.GradScaler):
    """A GradScaler subclass whose own ``step`` wraps torch's (as trainers' scalers do)."""

    def step(self, optimizer, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        return super().step(optimizer, *args, **kwargs)


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, _LoggingScaler])
@pytest.mark.parametrize("rung", RUNGS)
def test_reading_the_amp_attribute_elsewhere_neither_skips_nor_requests_a_step(
    rung: str, scaler_class: type[torch.amp.GradScaler]
) -> None:
    """Only GradScaler.step's read of ``_step_supports_amp_scaling`` marks a scaler step:
    a stepped optimizer read by ``inspect.getmembers`` (or Lightning's clipping check)
    said ``last_step_skipped`` True and counted one more step request."""
    model = _model()
    opt = choose_optimizer(model, free_memory="1GiB", rung=rung)
    scaler = scaler_class("cpu", init_scale=2.0**10)
    _backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    assert opt.last_step_skipped is False and opt.step_requests == 2  # the scaler's, step()'s
    inspect.getmembers(opt)
    assert getattr(opt, "_step_supports_amp_scaling", True) is False  # as Lightning reads it
    assert opt.last_step_skipped is False and opt.step_requests == 2
    opt.zero_grad()
    _backward(model, scaler, poison=True)
    scaler.step(opt)  # skipped: step() is not called
    scaler.update()
    assert opt.last_step_skipped is True and opt.step_requests == 3
    assert scaler.get_scale() == 2.0**9


# --- grads that params share, with grad_scale set on the optimizer --------------------
# (p1.grad = p2.grad = g by hand, or views of one buffer). Each param must step with
# grad / scale, as torch.optim.AdamW on grads unscaled beforehand: each distinct grad
# memory divided once. torch's own fused AdamW with grad_scale divides a shared grad once
# per param that holds it, so the reference below gives each param its own copy.

N = 8192  # >= 4096 elements: the 8bit rung keeps 8-bit state (bitsandbytes' rule)
SCALE = 4.0  # a power of two: unscaling is exact, so the bits must match


def _shared_grads(kind: str) -> tuple[list[torch.nn.Parameter], torch.Tensor, torch.Tensor]:
    """Two params and one grad memory they both hold (``kind``), the scaled grad's
    values, and the buffer itself."""
    gen = torch.Generator().manual_seed(3)
    a = torch.nn.Parameter(torch.randn(64, N // 64, generator=gen))
    b = torch.nn.Parameter(
        torch.randn(N if kind == "reshaped view" else (64, N // 64), generator=gen)
    )
    g = torch.randn(64, N // 64, generator=gen) * SCALE
    buffer = g.clone()
    a.grad = buffer
    b.grad = {
        "same tensor": buffer,
        "view": buffer.view(64, N // 64),
        "reshaped view": buffer.view(-1),
    }[kind]
    return [a, b], g, buffer


def _reference(params: list[torch.nn.Parameter], g: torch.Tensor, rung: str) -> list[torch.Tensor]:
    """The params after one step of ``rung`` from grads unscaled by hand, each param
    holding its own copy."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = choose_optimizer(copies, free_memory="1GiB", rung=rung)
    for c in copies:
        c.grad = (g / SCALE).reshape(c.shape).clone()
    ref.step()
    return [c.detach() for c in copies]


@pytest.mark.parametrize("kind", ["same tensor", "view", "reshaped view"])
@pytest.mark.parametrize("rung", RUNGS)
def test_a_shared_grad_is_unscaled_once(rung: str, kind: str) -> None:
    params, g, buffer = _shared_grads(kind)
    want = _reference(params, g, rung)
    opt = choose_optimizer(params, free_memory="1GiB", rung=rung)
    opt.grad_scale = torch.tensor(SCALE)  # as torch.amp.GradScaler sets it on fused optimizers
    opt.step()
    for p, w in zip(params, want, strict=True):
        assert torch.equal(p.detach(), w)
    # the grad holds grad / scale after the step, as torch's fused AdamW leaves a grad
    assert torch.equal(buffer, g / SCALE)


def test_shared_grad_matches_torch_fused_adamw_on_own_grads() -> None:
    """The fp32 rung against torch's fused AdamW given the same grad_scale, each param
    with a grad of its own (what torch computes when nothing is shared): same params,
    same grads left behind."""
    params, g, buffer = _shared_grads("same tensor")
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c in copies:
        c.grad = g.clone()
    torch_opt = torch.optim.AdamW(copies, lr=1e-3, fused=True)
    torch_opt.grad_scale = torch.tensor(SCALE)  # type: ignore[attr-defined]
    torch_opt.found_inf = torch.tensor(0.0)  # type: ignore[attr-defined]
    torch_opt.step()
    opt = choose_optimizer(params, free_memory="1GiB", rung="fp32", lr=1e-3)
    opt.grad_scale = torch.tensor(SCALE)
    opt.step()
    for p, c in zip(params, copies, strict=True):
        assert torch.equal(p.detach(), c.detach())
        assert torch.equal(p.grad, c.grad)  # type: ignore[arg-type]
    assert torch.equal(buffer, g / SCALE)


@pytest.mark.parametrize("rung", RUNGS)
def test_disjoint_views_of_one_grad_buffer_are_each_unscaled(rung: str) -> None:
    """Column slices of one grad buffer (byte ranges meet, elements do not), for params
    that are column slices of one buffer, are divided once per element."""
    gen = torch.Generator().manual_seed(4)
    weights = torch.randn(128, 128, generator=gen)
    g = torch.randn(128, 128, generator=gen) * SCALE
    buffer = g.clone()
    blocks = [(slice(0, 64), slice(0, 64)), (slice(0, 64), slice(64, 128))]
    blocks += [(slice(64, 128), slice(0, 64)), (slice(64, 128), slice(64, 128))]
    params = [torch.nn.Parameter(weights[rows, cols]) for rows, cols in blocks]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, c, (rows, cols) in zip(params, copies, blocks, strict=True):
        p.grad = buffer[rows, cols]
        c.grad = (g[rows, cols] / SCALE).contiguous()
    ref = choose_optimizer(copies, free_memory="1GiB", rung=rung)
    ref.step()
    opt = choose_optimizer(params, free_memory="1GiB", rung=rung)
    opt.grad_scale = torch.tensor(SCALE)
    opt.step()
    for p, c in zip(params, copies, strict=True):
        assert torch.equal(p.detach(), c.detach())
    assert torch.equal(buffer, g / SCALE)


@pytest.mark.parametrize("rung", RUNGS)
def test_grads_sharing_part_of_their_memory_are_refused_before_the_step(rung: str) -> None:
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(100, generator=gen)) for _ in range(2)]
    buffer = torch.randn(150, generator=gen)
    params[0].grad, params[1].grad = buffer[:100], buffer[50:]
    opt = choose_optimizer(params, free_memory="1GiB", rung=rung)
    opt.grad_scale = torch.tensor(SCALE)
    before = [p.detach().clone() for p in params]
    grads = buffer.clone()
    with pytest.raises(ValueError, match="param 0 of group 0 and param 1 of group 0"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    assert torch.equal(buffer, grads)
    assert len(opt.state) == 0 and opt.committed_steps == 0


@pytest.mark.parametrize("backend", ["cpu", "eager"])
def test_ladder_adamw_unscales_a_grad_shared_across_groups_once(backend: str) -> None:
    """The bf16 engine on its own (torch.amp.GradScaler hands it grad_scale)."""
    params, g, buffer = _shared_grads("same tensor")
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c in copies:
        c.grad = g / SCALE
    ref = LadderAdamW([{"params": [c]} for c in copies], backend=backend)
    ref.step()
    opt = LadderAdamW([{"params": [p]} for p in params], backend=backend)
    opt.grad_scale = torch.tensor(SCALE)  # type: ignore[attr-defined]
    opt.step()
    for p, c in zip(params, copies, strict=True):
        assert torch.equal(p.detach(), c.detach())
    assert torch.equal(buffer, g / SCALE)


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda b: (b, b.view(-1)), "same"),
        (lambda b: (b, b.t()), "same"),
        (lambda b: (b[:, :5], b[:, 5:]), "disjoint"),
        (lambda b: (b[:, ::2], b[:, 1::2]), "disjoint"),
        (lambda b: (b[:4], b[4:]), "disjoint"),
        (lambda b: (b[:, :6], b[:, 5:]), "partial"),
        (lambda b: (b[:5], b[4:]), "partial"),
        (lambda b: (b, b[2:4]), "partial"),
        (lambda b: (b.view(-1)[:40], b[:, :5]), "partial"),
        (lambda b: (b.view(-1)[:10], b[:, :5]), "partial"),
    ],
)
def test_grad_relations_match_their_element_addresses(make, want) -> None:  # type: ignore[no-untyped-def]
    """distinct_grads' layout reasoning, against the sets of element addresses."""
    a, b = make(torch.zeros(8, 10))
    shared = set(_addresses(a).tolist()) & set(_addresses(b).tolist())
    assert want == (
        "disjoint" if not shared else "same" if len(shared) == a.numel() == b.numel() else "partial"
    )
    if want == "partial":
        with pytest.raises(ValueError, match="grad 0 and grad 1"):
            distinct_grads([a, b])
    else:
        got = distinct_grads([a, b])
        assert [x is a for x in got] == ([True] if want == "same" else [True, False])


def _addresses(t: torch.Tensor) -> torch.Tensor:
    """Element addresses by hand: every index, through the strides."""
    idx = torch.cartesian_prod(*[torch.arange(n) for n in t.shape]).reshape(-1, t.dim())
    return t.data_ptr() + (idx * torch.tensor(t.stride())).sum(-1) * t.element_size()
