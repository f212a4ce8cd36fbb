"""Each rung against torch.optim.AdamW(foreach=False) after several steps.

Setup shared by every case: K = 5 steps, lr = 1e-2, betas = (0.9, 0.999), eps = 1e-8,
weight_decay = 0.01, params and grads drawn from N(0, 1) with a fixed seed, the same grads
fed to the rung and to the reference.

Adam's per-step update is bounded: |lr * m_hat / (sqrt(v_hat) + eps)| <= lr * U with
U = (1 - beta1) / sqrt(1 - beta2) = 3.16 when 1 - beta1 > sqrt(1 - beta2) (Kingma & Ba,
"Adam", ICLR 2015, section 2.1). The tolerances below are built from U, K and the
storage precision of each rung's moments, and the same check is shown to reject an AdamW
without bias correction (whose update is 3.2x to 5.8x larger over these steps).
"""

from __future__ import annotations

import math

import pytest
import torch

from engines import build_engine
from optladder.optimizers.adamw import LadderAdamW

K, LR, BETAS, EPS, WD = 5, 1e-2, (0.9, 0.999), 1e-8, 0.01
U = (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])
SIZES = (8192, 300, 5000)  # two above bitsandbytes' 4096-element minimum, one below

# fp32 rung: torch's fused kernel vs the single-tensor path differ by float32 rounding in
# each of ~10 ops a step: <= 10 ulp of |p| <= 5 per step, so K * 10 * 2**-23 * 5 on params;
# moments likewise relative to their size (|m| <= max|g| ~ 5, v <= 25).
FP32_PARAM_ATOL = K * 10 * 2**-23 * 5
FP32_MOMENT_ATOL = (K * 10 * 2**-23 * 5, K * 10 * 2**-23 * 25)

# bf16 rung: each stored moment is rounded once a step with relative error <= 2**-7 (one
# bf16 ulp: 8 significant bits). Errors carried in the stored moments add up, so at step k
# the update m/sqrt(v) is off by <= k * (2**-7 + 2**-7 / 2) relatively; summing lr * U
# times that over k = 1..K gives the param bound. Moment bound: K * 2**-7 * max|moment|.
BF16_PARAM_ATOL = LR * U * 1.5 * 2**-7 * K * (K + 1) / 2

# 8bit rung: bitsandbytes' dynamic code books round a moment to the nearest of 256 codes
# scaled by its block's absmax; the widest gap is 0.0141 (signed map, exp_avg) and 0.0070
# (unsigned map, exp_avg_sq), so each step adds <= half a gap times the absmax, K times.
# For params, moments far below their block's absmax have coarser relative precision, so
# elementwise bounds are loose; the bulk of elements (within two decades of the absmax)
# keep >= 4 fraction bits: relative error <= 2**-5 for m and v, so <= 1.5 * 2**-5 on the
# update per step, carried as for bf16: mean |dp| <= K * 1.5 * 2**-5 of the mean movement
# (23%); a wrong bias correction moves params several times further and fails it.
EIGHTBIT_CODE_HALF_GAP = (0.0141 / 2, 0.0070 / 2)
EIGHTBIT_MEAN_FRACTION = K * 1.5 * 2**-5


class NoBiasCorrectionAdamW(torch.optim.Optimizer):
    """A deliberately wrong AdamW: no bias correction. The checks must reject it."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            st = self.state[p]
            if not st:
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            p.mul_(1 - LR * WD)
            st["exp_avg"].lerp_(p.grad, 1 - BETAS[0])
            st["exp_avg_sq"].mul_(BETAS[1]).addcmul_(p.grad, p.grad, value=1 - BETAS[1])
            p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(EPS), value=-LR)


def _run(make_opt, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(K)]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    opt = make_opt(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return init, params, opt


def _reference() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.optim.Optimizer]:
    return _run(
        lambda ps: torch.optim.AdamW(
            ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False
        )
    )  # type: ignore[return-value]


def _build(rung: str, fused: bool = True):
    return lambda ps: build_engine(
        rung, [{"params": ps}], fused=fused, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
    )


def check_params(rung: str, init, params, ref_params) -> None:
    """Raise AssertionError if ``params`` are not within ``rung``'s tolerance of the reference."""
    for x0, p, r in zip(init, params, ref_params):
        err = (p.detach() - r.detach()).abs()
        if rung == "fp32":
            assert err.max().item() <= FP32_PARAM_ATOL, err.max().item()
        elif rung == "bf16":
            assert err.max().item() <= BF16_PARAM_ATOL, err.max().item()
        else:
            movement = (r.detach() - x0).abs().mean().item()
            assert err.mean().item() <= EIGHTBIT_MEAN_FRACTION * movement, (err.mean(), movement)
            assert err.max().item() <= 2 * LR * U * K  # no step can exceed 2 * lr * U


def _moments(rung: str, opt, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    st = opt.state[p]
    if rung != "8bit":
        return st["exp_avg"].float(), st["exp_avg_sq"].float()
    if st["state1"].dtype == torch.float32:
        return st["state1"], st["state2"]
    import bitsandbytes.functional as F

    return tuple(  # type: ignore[return-value]
        F.dequantize_blockwise(
            st[f"state{i}"], absmax=st[f"absmax{i}"], code=st[f"qmap{i}"], blocksize=256
        )
        for i in (1, 2)
    )


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_rung_matches_torch_adamw(rung: str) -> None:
    init, params, opt = _run(_build(rung))
    _, ref_params, ref_opt = _reference()
    check_params(rung, init, params, ref_params)
    for p, r in zip(params, ref_params):
        m, v = _moments(rung, opt, p)
        m_ref, v_ref = ref_opt.state[r]["exp_avg"], ref_opt.state[r]["exp_avg_sq"]
        if rung == "fp32":
            atol_m, atol_v = FP32_MOMENT_ATOL
        elif rung == "bf16":
            atol_m = K * 2**-7 * m_ref.abs().max().item()
            atol_v = K * 2**-7 * v_ref.abs().max().item()
        elif p.numel() < 4096:  # bitsandbytes keeps small tensors in float32
            atol_m, atol_v = FP32_MOMENT_ATOL
        else:
            atol_m = K * EIGHTBIT_CODE_HALF_GAP[0] * m_ref.abs().max().item()
            atol_v = K * EIGHTBIT_CODE_HALF_GAP[1] * v_ref.abs().max().item()
        assert (m - m_ref).abs().max().item() <= atol_m
        assert (v - v_ref).abs().max().item() <= atol_v
        assert int(ref_opt.state[r]["step"].item()) == K


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_wrong_update_fails_the_same_check(rung: str) -> None:
    init, wrong, _ = _run(NoBiasCorrectionAdamW)
    _, ref_params, _ = _reference()
    with pytest.raises(AssertionError):
        check_params(rung, init, wrong, ref_params)


def test_fp32_eager_for_bf16_params_keeps_float32_moments() -> None:
    p = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    opt = _build("fp32")([p])
    assert isinstance(opt, LadderAdamW)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16
    # one step from zero moments: m = (1 - beta1) g exactly in float32
    expected = (1 - BETAS[0]) * p.grad.float()
    torch.testing.assert_close(opt.state[p]["exp_avg"], expected, rtol=2**-23, atol=0)


@pytest.mark.parametrize(
    ("rung", "fused", "engine", "flag"),
    [
        ("fp32", True, "LadderAdamW", "fused"),  # its fp32 format: torch's kernels
        ("fp32", False, "LadderAdamW", "foreach"),
        ("bf16", False, "LadderAdamW", None),
        ("8bit", False, "LadderAdamW", None),  # its 8bit format: bitsandbytes' state
    ],
)
def test_build_engine_kinds(rung: str, fused: bool, engine: str, flag: str | None) -> None:
    opt = _build(rung, fused)([torch.nn.Parameter(torch.zeros(4))])
    assert type(opt).__name__ == engine
    if rung == "8bit":  # every group in the 8bit state format; AdamW8bit's group keys
        group = opt.param_groups[0]  # only in its checkpoint (test_checkpoint_layout.py)
        assert group["rung"] == "8bit" and "alpha" not in group and "fused" not in group
    if flag is not None:  # the kernel torch's AdamW would name in its groups
        assert opt.param_groups[0][flag] is True


@pytest.mark.parametrize(
    ("rung", "bytes_per_param", "dtypes"),
    [
        ("fp32", 8.0, {torch.float32}),
        ("bf16", 4.0, {torch.bfloat16}),
        # 8192 elements: 2 * 8192 + 2 * 4 * 32 blocks = 16,640 bytes, + 2,048 code books
        ("8bit", (2 * 8192 + 2 * 4 * 32 + 2048) / 8192, {torch.uint8, torch.float32}),
    ],
)
def test_state_dtypes_and_bytes(rung: str, bytes_per_param: float, dtypes: set) -> None:
    from optladder import measure_state_bytes

    p = torch.nn.Parameter(torch.randn(8192))
    opt = _build(rung)([p])
    p.grad = torch.randn_like(p)
    opt.step()
    assert measure_state_bytes(opt) / p.numel() == pytest.approx(bytes_per_param, abs=0)
    assert {
        v.dtype for k, v in opt.state[p].items() if torch.is_tensor(v) and k != "step"
    } == dtypes


@pytest.mark.parametrize("rung", ["bf16", "8bit"])
def test_complex_params_are_refused(rung: str) -> None:
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        _build(rung)([p])


def test_fp32_rung_takes_complex_params() -> None:
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = _build("fp32", fused=False)([p])
    ref_opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    g = torch.randn(8, dtype=torch.complex64)
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(p, ref, rtol=0, atol=FP32_PARAM_ATOL)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_adam_mode_matches_torch_adam_on_every_rung(rung: str) -> None:
    """Coupled weight decay (Adam) survives every rung, the 8-bit one included, where
    bitsandbytes only decays decoupled: checked against torch.optim.Adam with the same
    tolerances as AdamW, and against AdamW to show the check tells them apart."""
    wd = 0.5  # large, so coupled and decoupled decay differ by far more than the tolerance

    def build(ps):  # type: ignore[no-untyped-def]
        return build_engine(
            rung,
            [{"params": ps}],
            fused=True,
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=wd,
            decoupled_weight_decay=False,
        )

    init, params, _ = _run(build)
    _, ref, _ = _run(
        lambda ps: torch.optim.Adam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, foreach=False)
    )
    _, adamw, _ = _run(
        lambda ps: torch.optim.AdamW(
            ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, foreach=False
        )
    )
    check_params(rung, init, params, ref)
    if rung != "8bit":  # the 8-bit bound is looser than the Adam/AdamW gap at K=5 steps
        with pytest.raises(AssertionError):
            check_params(rung, init, adamw, ref)
    for p, r, a in zip(params, ref, adamw):
        # much closer to Adam than to AdamW: the rung did not quietly decay the AdamW way
        assert (p - r).abs().mean() < (p - a).abs().mean() / 10


def test_size_rule_is_bitsandbytes_min_8bit_size() -> None:
    """The 8bit rung's size rule (read from RUNG_ACCEPTS by the footprint and `plan`) is
    bitsandbytes' own default ``min_8bit_size``: a param of that many elements is
    quantized, one element fewer keeps float32 moments."""
    import inspect

    bnb = pytest.importorskip("bitsandbytes")
    from optladder.rungs import RUNG_ACCEPTS, quantizes

    limit = inspect.signature(bnb.optim.AdamW8bit).parameters["min_8bit_size"].default
    assert limit == 4096
    assert RUNG_ACCEPTS["8bit"].min_quantized_numel == limit
    assert quantizes(limit) and not quantizes(limit - 1)
