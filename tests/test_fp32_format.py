"""The fp32 format of :class:`LadderAdamW` on torch's kernels: a group of the fp32 format
(``"rung": "fp32"``, or ``moment_dtype=torch.float32``) steps its float32 and float64
params (DTensors too) with torch's fused AdamW kernel and its complex params with
torch's foreach AdamW, so params, ``exp_avg``, ``exp_avg_sq``, ``step`` and
``state_dict()`` are bit for bit those of ``torch.optim.AdamW(fused=True)`` /
``(foreach=True)`` (the reference here), with ``grad_scale``/``found_inf`` too; its
bfloat16/float16 params keep float32 moments on optladder's kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from optladder.optimizers import torchroute
from optladder.optimizers.adamw import LadderAdamW
from snapshots import same_bits


def _params(seed: int, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in specs:
        real = dtype.to_real() if dtype.is_complex else dtype
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(real)
        if dtype.is_complex:
            t = torch.complex(t, torch.randn(shape, generator=gen, dtype=torch.float64).to(real))
        out.append(torch.nn.Parameter(t))
    return out


def _strided(seed: int, reference: bool = False) -> list[torch.nn.Parameter]:
    """A transposed param, a channels_last one, and a column slice (not dense: stepped
    through a contiguous copy; torch's fused kernel would step the wrong elements of it,
    so the reference steps it contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(17, 33, generator=gen).t()
    c = torch.randn(4, 6, 3, 5, generator=gen).contiguous(memory_format=torch.channels_last)
    s = torch.randn(41, 50, generator=gen)[:, 3:36]
    if reference:
        s = s.contiguous()
    return [torch.nn.Parameter(x) for x in (t, c, s)]


def _grads(params: list[torch.Tensor], step: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
        if p.is_complex():
            g = torch.complex(g, torch.randn(p.shape, generator=gen, dtype=torch.float64))
        g = torch.empty_like(p).copy_(g.to(p.dtype))  # laid out like the param
        out.append(g)
    return out


def _assert_like_torch(
    opt: LadderAdamW, ref: torch.optim.Optimizer, got: list[Any], want: list[Any]
) -> None:
    for a, b in zip(got, want, strict=True):
        assert same_bits(a, b)
        sa, sb = opt.state[a], ref.state[b]
        for name in ("exp_avg", "exp_avg_sq"):
            assert same_bits(sa[name], sb[name]), name
        assert float(sa["step"]) == float(sb["step"])
    saved, ref_saved = opt.state_dict(), ref.state_dict()
    assert saved["state"].keys() == ref_saved["state"].keys()
    for k, st in saved["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert same_bits(st[name], ref_saved["state"][k][name])
        assert float(st["step"]) == float(ref_saved["state"][k]["step"])
    for g, rg in zip(saved["param_groups"], ref_saved["param_groups"], strict=True):
        for key in ("lr", "betas", "eps", "weight_decay", "maximize", "params"):
            assert g[key] == rg[key], key


SPECS = [
    ((33, 17), torch.float32),
    ((5,), torch.float64),
    ((4099,), torch.float32),
    ((0,), torch.float32),
]
OPTIONS: list[dict[str, Any]] = [
    {"weight_decay": 0.1},
    {"weight_decay": 0.0, "maximize": True, "betas": (0.8, 0.99)},
    {"decoupled_weight_decay": False, "weight_decay": 0.05},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["adamw", "maximize", "adam"])
@pytest.mark.parametrize("marked", [True, False], ids=["rung-key", "moment_dtype"])
def test_float32_and_float64_params_step_as_torch_fused_adamw(
    options: dict[str, Any], marked: bool
) -> None:
    got = _params(0, SPECS) + _strided(1)
    want = _params(0, SPECS) + _strided(1, reference=True)
    decoupled = options.get("decoupled_weight_decay", True)
    torch_options = {k: v for k, v in options.items() if k != "decoupled_weight_decay"}
    group: dict[str, Any] = {"params": got, **torch_options}
    if marked:
        group["rung"] = "fp32"
    opt = LadderAdamW(
        [group],
        lr=1e-2,
        decoupled_weight_decay=decoupled,
        moment_dtype=torch.bfloat16 if marked else torch.float32,
    )
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = cls([{"params": want, **torch_options}], lr=1e-2, fused=True)
    for step in range(4):
        for a, b, g in zip(got, want, _grads(got, step), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert opt.eager_reasons == {}
    _assert_like_torch(opt, ref, got, want)


def test_grad_scale_and_found_inf_as_torch_fused_adamw() -> None:
    """AMP: ``grad_scale`` and ``found_inf`` reach torch's fused kernel, as on
    ``torch.optim.AdamW(fused=True)``: grads unscaled by the kernel, a step with infs
    changes nothing (step counts included)."""
    got = _params(2, SPECS) + _strided(3)
    want = _params(2, SPECS) + _strided(3, reference=True)
    opt = LadderAdamW([{"params": got, "rung": "fp32"}], lr=1e-2)
    ref = torch.optim.AdamW(want, lr=1e-2, fused=True)
    for step, inf in enumerate([0.0, 1.0, 0.0, 0.0]):
        for a, b, g in zip(got, want, _grads(got, step, scale=1024.0), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        for o in (opt, ref):
            o.grad_scale = torch.tensor(1024.0)  # type: ignore[attr-defined]
            o.found_inf = torch.tensor(inf)  # type: ignore[attr-defined]
        opt.step()
        ref.step()
        for a, b in zip(got, want, strict=True):
            assert same_bits(a.grad, b.grad)  # unscaled alike
    _assert_like_torch(opt, ref, got, want)
    assert float(opt.state[got[0]]["step"]) == 3.0


def test_a_tensor_lr_as_torch_fused_adamw() -> None:
    got, want = _params(4, SPECS), _params(4, SPECS)
    opt = LadderAdamW([{"params": got, "rung": "fp32"}], lr=torch.tensor(1e-2))
    ref = torch.optim.AdamW(want, lr=torch.tensor(1e-2), fused=True)
    for step in range(3):
        for a, b, g in zip(got, want, _grads(got, step), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    _assert_like_torch(opt, ref, got, want)


COMPLEX = [((6, 5), torch.complex64), ((7,), torch.complex128)]


def _foreach_run(
    got: list[torch.Tensor], want: list[torch.Tensor], opt: LadderAdamW, scale: float
) -> torch.optim.Optimizer:
    """Steps ``opt`` with ``grad_scale`` (and one step of infs) and the foreach
    reference with the grads unscaled as ``torch.amp.GradScaler.unscale_`` does (times
    the float32 reciprocal of the scale) and that step skipped."""
    ref = torch.optim.AdamW(want, lr=1e-2, foreach=True, weight_decay=0.1)
    for step, inf in enumerate([0.0, 1.0, 0.0]):
        for a, b, g in zip(got, want, _grads(got, step, scale=scale), strict=True):
            a.grad = g.clone()
            b.grad = g.clone() * torch.tensor(scale).reciprocal().float()
        opt.grad_scale = torch.tensor(scale)  # type: ignore[attr-defined]
        opt.found_inf = torch.tensor(inf)  # type: ignore[attr-defined]
        opt.step()
        if not inf:
            ref.step()
    return ref


def test_complex_params_step_as_torch_foreach_adamw() -> None:
    got, want = _params(5, COMPLEX), _params(5, COMPLEX)
    opt = LadderAdamW([{"params": got, "rung": "fp32"}], lr=1e-2, weight_decay=0.1)
    ref = _foreach_run(got, want, opt, 512.0)
    assert set(opt.eager_reasons) == {0, 1}
    assert "real params only" in opt.eager_reasons[0]
    _assert_like_torch(opt, ref, got, want)


def test_a_device_without_a_fused_kernel_steps_as_torch_foreach_adamw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch has no fused AdamW kernel (none listed for the CPU here), the fp32
    format's params take torch's foreach AdamW, and the reason says so."""
    monkeypatch.setattr(torchroute, "fused_devices", lambda: ("cuda",))
    got, want = _params(6, SPECS), _params(6, SPECS)
    opt = LadderAdamW([{"params": got, "rung": "fp32"}], lr=1e-2, weight_decay=0.1)
    ref = _foreach_run(got, want, opt, 1.0)
    assert "no fused AdamW kernel on cpu; foreach path" in opt.eager_reasons[0]
    _assert_like_torch(opt, ref, got, want)


def test_low_precision_params_of_the_fp32_format_keep_float32_moments_on_the_kernels() -> None:
    """bfloat16/float16 params of an fp32 group: float32 moments on optladder's kernels
    (the oracle's bits), beside float32 params on torch's fused kernel."""
    specs = [((33, 17), torch.bfloat16), ((5,), torch.float16), ((40,), torch.float32)]
    got, oracle_params = _params(7, specs), _params(7, specs)
    opt = LadderAdamW([{"params": got, "rung": "fp32"}], lr=1e-2, seed=4)
    oracle = LadderAdamW([{"params": oracle_params, "rung": "fp32"}], lr=1e-2, seed=4)
    for step in range(3):
        for a, b, g in zip(got, oracle_params, _grads(got, step), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        with torch.no_grad():
            for i, b in enumerate(oracle_params[:2]):
                oracle._step_param(b, oracle.param_groups[0], i)
    for a, b in zip(got[:2], oracle_params[:2], strict=True):
        assert same_bits(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert opt.state[a][name].dtype == torch.float32
            assert same_bits(opt.state[a][name], oracle.state[b][name])
    assert opt.state[got[2]]["exp_avg"].dtype == torch.float32
    assert len(opt._group_plans[0].routes["torch_fused"]) == 1


def test_the_fp32_format_takes_float64_and_complex_params_but_the_bf16_format_does_not() -> None:
    p64 = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    pc = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    LadderAdamW([{"params": [p64, pc], "rung": "fp32"}])
    with pytest.raises(ValueError, match="complex"):
        LadderAdamW([{"params": [pc], "rung": "bf16"}])
    with pytest.raises(ValueError, match="complex"):  # the eager oracle keeps its dtypes
        LadderAdamW([{"params": [pc], "rung": "fp32"}], backend="eager")


def test_a_grad_of_another_dtype_is_refused_before_anything_is_written() -> None:
    p = torch.nn.Parameter(torch.randn(8))
    opt = LadderAdamW([{"params": [p], "rung": "fp32"}])
    before = p.detach().clone()
    p.grad_dtype = None
    p.grad = torch.randn(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"param 0 has a torch\.bfloat16 grad"):
        opt.step()
    assert torch.equal(p.detach(), before) and len(opt.state) == 0


def _dtensor_params(make: Callable[[torch.Tensor], Any]) -> list[Any]:
    gen = torch.Generator().manual_seed(8)
    return [torch.nn.Parameter(make(torch.randn(s, generator=gen))) for s in ((12, 4), (9,))]


def test_float32_dtensor_params_step_as_torch_fused_adamw() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not initialized by another test")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def make(t: torch.Tensor) -> Any:
            return DTensor.from_local(t, mesh, [Replicate()])

        got, want = _dtensor_params(make), _dtensor_params(make)
        opt = LadderAdamW([{"params": got, "rung": "fp32"}], lr=1e-2, weight_decay=0.1)
        ref = torch.optim.AdamW(want, lr=1e-2, fused=True, weight_decay=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for a, b in zip(got, want, strict=True):
                g = torch.randn(a.shape, generator=gen)
                a.grad, b.grad = make(g.clone()), make(g.clone())
            opt.step()
            ref.step()
        assert opt.eager_reasons == {}
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.to_local(), b.to_local())
            for name in ("exp_avg", "exp_avg_sq"):
                m = opt.state[a][name]
                assert isinstance(m, DTensor)
                assert torch.equal(m.to_local(), ref.state[b][name].to_local())
            assert float(opt.state[a]["step"]) == float(ref.state[b]["step"]) == 3
    finally:
        dist.destroy_process_group()
