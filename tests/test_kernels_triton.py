"""The Triton kernel of the bf16 rung against a float64 reference and the oracle's bits.

Without a GPU the kernel runs on CPU tensors in Triton's interpreter (``TRITON_INTERPRET``
is set for this module before the kernel module is first imported): that checks the
logic, not the GPU build; ``bench/gpu_check.sh`` runs this same file compiled on CUDA.

Expected moments are computed independently: the update in float64, rounded once to
float32, then rounded to bf16 with :func:`~optladder.optimizers.rounding.random_bits` of
:func:`~optladder.optimizers.rounding.element_key` (the oracle's definition). The kernel
computes in float32, so its pre-rounding value can differ from the float64 one by a few
float32 ulps; when a rounding threshold falls in between (probability ~ulps/65536 per
element) the bf16 result is the neighbour. We allow a handful of such one-ulp
differences and nothing else; wrong bits would differ in about half the elements.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.rounding import element_key, random_bits, stochastic_round_bf16
from triton_interp import exact_fma_interpreter

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SIZES = (1, 1000, 2 * 4096 + 5, 33 * 17)
"""Param sizes: one element, a partial chunk, whole chunks plus a tail, a 2-d param."""
STEPS = (0, 4, 19, 0)
"""Each param's step count before the tested step (torch keeps one per param)."""
SEED = 0xDEADBEEF12345678


@pytest.fixture(scope="module", autouse=True)
def _interpreter() -> Iterator[None]:
    """Run Triton's interpreter on CPU tensors (with a once-rounded fma, see
    ``triton_interp``) when there is no GPU."""
    if ON_GPU:
        yield
        return
    with exact_fma_interpreter():
        from optladder.optimizers.kernels import ops, triton_adamw

        if (
            not hasattr(triton_adamw._adamw_bf16_kernel, "run")
            or type(triton_adamw._adamw_bf16_kernel).__name__ != "InterpretedFunction"
        ):
            pytest.skip("the Triton kernel was imported compiled before this module ran")
        assert ops.adamw_bf16_ is not None
        yield


def _inputs(grad_dtype: torch.dtype, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("p", "g", "m", "v", "s")}
    for n, step in zip(SIZES, STEPS, strict=True):
        # small params, so that the update's precision shows above the param's ulp
        out["p"].append(torch.randn(n, generator=gen) * 1e-3)
        scale = 10.0 ** torch.randint(-3, 2, (n,), generator=gen)
        out["g"].append((torch.randn(n, generator=gen) * scale).to(grad_dtype))
        out["m"].append((torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16))
        out["v"].append((torch.rand(n, generator=gen) * 0.01).to(torch.bfloat16))
        out["s"].append(torch.tensor(float(step), dtype=torch.float64))
    out["p"][3] = out["p"][3].reshape(33, 17)
    for k in ("g", "m", "v"):
        out[k][3] = out[k][3].reshape(33, 17)
    return {k: [t.to(DEVICE) for t in v] for k, v in out.items()}


def _reference(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW in float64 (step is the new, 1-based step). Returns param, m, v."""
    p64, g64 = p.double().cpu(), g.double().cpu() / scale
    m64, v64 = m.double().cpu(), v.double().cpu()
    if maximize:
        g64 = -g64
    if weight_decay:
        if decoupled:
            p64 = p64 * (1 - lr * weight_decay)
        else:
            g64 = g64 + weight_decay * p64
    m64 = m64 + (1 - beta1) * (g64 - m64)
    v64 = beta2 * v64 + (1 - beta2) * g64 * g64
    denom = v64.sqrt() / math.sqrt(1 - beta2**step) + eps
    return p64 - lr / (1 - beta1**step) * m64 / denom, m64, v64


def _assert_bf16_close(
    got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, cancel: torch.Tensor
) -> None:
    """Equal bit patterns, but for a few elements (see the module docstring).

    An element may differ by one bf16 ulp, or, where the moment's update cancelled
    (``m + w (g - m)`` with ``g ~ m``), lie within float32 rounding of the inputs
    (``cancel``, float64 magnitudes) of the exact value ``exact``.
    """
    a = got.cpu().reshape(-1).view(torch.int16).to(torch.int32)
    b = want.reshape(-1).view(torch.int16).to(torch.int32)
    bad = a != b
    near = (a - b).abs() <= 1
    err = (got.cpu().reshape(-1).double() - exact.reshape(-1)).abs()
    cancelled = err <= 2.0**-21 * cancel.reshape(-1)
    assert bool((near | cancelled)[bad].all()), f"moments differ by {int((a - b).abs().max())}"
    assert int(bad.sum()) <= max(2, a.numel() // 500), int(bad.sum())


def _launch(t: dict[str, list[torch.Tensor]], cfg: dict[str, Any]) -> None:
    from optladder.optimizers.kernels import ops

    lr = cfg["lr"]
    torch.ops.optladder.adamw_bf16_(
        t["p"], t["g"], t["m"], t["v"], t["s"], [0, 2, 3, 5],
        0.0 if isinstance(lr, torch.Tensor) else lr,
        lr.to(DEVICE) if isinstance(lr, torch.Tensor) else None,
        cfg["beta1"], cfg["beta2"], cfg["eps"], cfg["weight_decay"], cfg["decoupled"],
        cfg["maximize"], cfg["stochastic"], True, ops.seed_prefix(SEED),
        cfg.get("grad_scale"), cfg.get("found_inf"),
    )  # fmt: skip


BASE: dict[str, Any] = {
    "lr": 0.05,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "decoupled": True,
    "maximize": False,
    "stochastic": True,
}
CONFIGS: list[dict[str, Any]] = [
    {},
    {"decoupled": False, "weight_decay": 0.1},
    {"maximize": True, "weight_decay": 0.0},
    {"stochastic": False},
    {"lr": torch.tensor(0.02)},
    {"beta1": 0.3, "beta2": 0.95, "eps": 1e-6},
    {"grad_scale": torch.tensor(4.0)},
]


# Every config with float32 grads, and the grad dtypes on two configs: each combination is
# a separate Triton compilation on a GPU (a few seconds each).
CASES = [(c, torch.float32) for c in CONFIGS] + [
    (c, dt) for c in (CONFIGS[0], CONFIGS[-1]) for dt in (torch.bfloat16, torch.float16)
]


@pytest.mark.parametrize(
    ("overrides", "grad_dtype"),
    CASES,
    ids=[f"{','.join(c) or 'base'}-{str(dt)[6:]}" for c, dt in CASES],
)
def test_kernel_matches_float64_and_oracle_bits(
    overrides: dict[str, Any], grad_dtype: torch.dtype
) -> None:
    cfg = {**BASE, **overrides}
    if "grad_scale" in cfg:
        cfg["grad_scale"] = cfg["grad_scale"].to(DEVICE)
    t = _inputs(grad_dtype)
    before = {k: [x.clone() for x in v] for k, v in t.items()}
    _launch(t, cfg)
    lr = float(cfg["lr"])
    scale = float(cfg["grad_scale"]) if "grad_scale" in cfg else 1.0
    for k, idx in enumerate([0, 2, 3, 5]):
        step = STEPS[k] + 1
        assert t["s"][k].item() == step
        p64, m64, v64 = _reference(
            before["p"][k], before["g"][k], before["m"][k], before["v"][k], step,
            lr=lr, beta1=cfg["beta1"], beta2=cfg["beta2"], eps=cfg["eps"],
            weight_decay=cfg["weight_decay"], decoupled=cfg["decoupled"],
            maximize=cfg["maximize"], scale=scale,
        )  # fmt: skip
        if cfg["stochastic"]:
            bits = random_bits(m64.numel(), element_key(SEED, step, idx)).reshape(m64.shape)
            want_m = stochastic_round_bf16(m64.float(), bits & 0xFFFF)
            want_v = stochastic_round_bf16(v64.float(), bits >> 16)
        else:
            want_m, want_v = m64.float().to(torch.bfloat16), v64.float().to(torch.bfloat16)
        g_abs = before["g"][k].double().cpu().abs() / scale
        m_in = before["m"][k].double().cpu().abs() + g_abs
        v_in = before["v"][k].double().cpu() + g_abs * g_abs
        _assert_bf16_close(t["m"][k], want_m, m64, m_in)
        _assert_bf16_close(t["v"][k], want_v, v64, v_in)
        # The param: float32 math costs a few ulps of the param, of the update, and of
        # the first moment's inputs (m = m + w (g - m) cancels when g ~ m).
        p = t["p"][k].double().cpu()
        moved = (p64 - before["p"][k].double().cpu()).abs()
        denom = v64.sqrt() / math.sqrt(1 - cfg["beta2"] ** step) + cfg["eps"]
        step_size = lr / (1 - cfg["beta1"] ** step)
        tol = 4 * 2.0**-24 * p64.abs() + 1e-5 * moved + step_size * 2.0**-22 * m_in / denom
        assert bool(((p - p64).abs() <= tol).all()), float(((p - p64).abs() / tol).max())
        if "grad_scale" in cfg:  # torch's fused Adam leaves unscaled grads behind
            unscaled = (before["g"][k].double() / scale).to(grad_dtype)
            assert torch.equal(t["g"][k].cpu(), unscaled.cpu())


def test_found_inf_changes_nothing() -> None:
    t = _inputs(torch.float32)
    before = {k: [x.clone() for x in v] for k, v in t.items()}
    _launch(t, {**BASE, "found_inf": torch.tensor(1.0, device=DEVICE)})
    for k, tensors in t.items():
        for a, b in zip(tensors, before[k], strict=True):
            assert torch.equal(a, b), k
    _launch(t, {**BASE, "found_inf": torch.tensor(0.0, device=DEVICE)})
    assert [s.item() for s in t["s"]] == [s + 1 for s in STEPS]
    assert not torch.equal(t["p"][1], before["p"][1])


def test_optimizer_backend_triton_matches_eager_oracle() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(3000,), (7, 5), (1,), (0,)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    got = [torch.nn.Parameter(p.detach().clone().to(DEVICE)) for p in ref]
    ref_opt = LadderAdamW(ref, lr=1e-2, seed=SEED, backend="eager")
    got_opt = LadderAdamW(got, lr=1e-2, seed=SEED, backend="triton")
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for k, (a, b) in enumerate(zip(ref, got, strict=True)):
            grad = torch.randn(a.shape, generator=g)
            a.grad = None if (k == 1 and step == 1) else grad
            b.grad = None if a.grad is None else grad.to(DEVICE)
        ref_opt.step()
        got_opt.step()
    assert got_opt.eager_reasons == {}
    for a, b in zip(ref, got, strict=True):
        sa, sb = ref_opt.state[a], got_opt.state[b]
        assert sa["step"].item() == sb["step"].item()
        assert sb["step"].device == b.device  # kept on the param's device, like fused Adam
        for name in ("exp_avg", "exp_avg_sq"):  # the eager bits, exactly
            assert torch.equal(sb[name].cpu().view(torch.int16), sa[name].view(torch.int16))
        assert torch.equal(b.detach().cpu().view(torch.int32), a.detach().view(torch.int32))


def test_second_moment_decays_in_the_kernel() -> None:
    seeds = range(20) if ON_GPU else range(2)  # the interpreter is slow: 2 seeds here
    n = 10_000
    for seed in seeds:
        p = torch.nn.Parameter(torch.zeros(n, device=DEVICE))
        p.grad = torch.zeros(n, device=DEVICE)
        opt = LadderAdamW([p], seed=seed, backend="triton")
        opt.state[p] = {
            "step": torch.tensor(0.0, dtype=torch.float64, device=DEVICE),
            "exp_avg": torch.zeros(n, dtype=torch.bfloat16, device=DEVICE),
            "exp_avg_sq": torch.ones(n, dtype=torch.bfloat16, device=DEVICE),
        }
        for _ in range(100):
            opt.step()
        v = opt.state[p]["exp_avg_sq"].double().cpu()
        se = v.std().item() / math.sqrt(n)
        assert se > 0 and abs(v.mean().item() - 0.999**100) <= 4 * se, (seed, v.mean(), se)


def test_op_traces_under_torch_compile() -> None:
    """The custom op's schema and fake kernel let torch.compile trace it whole."""
    t = _inputs(torch.float32)
    ref = {k: [x.clone() for x in v] for k, v in t.items()}
    _launch(ref, BASE)
    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(lambda: _launch(t, BASE), backend=backend, fullgraph=True)
    compiled()
    for k in ("p", "m", "v", "s"):
        for a, b in zip(t[k], ref[k], strict=True):
            assert torch.equal(a, b), k


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager_launches() -> None:
    t = _inputs(torch.float32)
    ref = {k: [x.clone() for x in v] for k, v in t.items()}
    _launch(t, BASE)  # warm-up: compiles the kernel and caches the pointer tables
    _launch(ref, BASE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(t, BASE)
    for _ in range(3):
        graph.replay()
        _launch(ref, BASE)
    torch.cuda.synchronize()
    for k in ("p", "m", "v", "s"):
        for a, b in zip(t[k], ref[k], strict=True):
            assert torch.equal(a, b), k


def test_the_optimizer_commit_allocates_nothing_with_a_tensor_lr() -> None:
    """Tables and a tensor lr's device copy are made in prepare_step: commit_step
    allocates nothing the dispatcher sees, and the lr it uses is the group's current one."""
    from memtools import FailNthAllocation

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3000, device=DEVICE))
    twin = torch.nn.Parameter(p.detach().clone())
    lr = torch.tensor(1e-2, dtype=torch.float64)
    opt = LadderAdamW([p], lr=lr, seed=SEED, backend="triton")
    ref = LadderAdamW([twin], lr=torch.tensor(1e-2), seed=SEED, backend="triton")
    for _ in range(2):
        p.grad = torch.randn_like(p)
        twin.grad = p.grad.clone()
        opt.prepare_step()
        with FailNthAllocation() as counter:
            opt.commit_step()
        assert counter.count == 0
        ref.step()
    assert opt.state[p]["step"].item() == 2.0 and opt.state[p]["step"].dtype == torch.float64
    assert torch.equal(p, twin)


def test_groups_of_both_formats_launch_as_two_single_format_engines() -> None:
    """One engine over groups of the fp32 format (``"rung": "fp32"``, float32 moments) and
    the bf16 format (bfloat16 moments): the Triton launches (one per group, the moments'
    dtype read from the tensors) write the bits of two single-format engines over the
    same groups, each param at the same index over all groups (``param_starts``)."""
    gen = torch.Generator().manual_seed(5)
    specs = [
        ("fp32", torch.bfloat16, (300,)),
        ("bf16", torch.float32, (7, 5)),
        ("fp32", torch.float32, (33,)),
    ]
    base = [torch.randn(shape, generator=gen).to(dt) for _, dt, shape in specs]
    mixed = [torch.nn.Parameter(t.clone().to(DEVICE)) for t in base]
    ref = [torch.nn.Parameter(t.clone().to(DEVICE)) for t in base]
    mixed_opt = LadderAdamW(
        [{"params": [p], "rung": rung} for p, (rung, _, _) in zip(mixed, specs)],
        lr=1e-2,
        seed=SEED,
        backend="triton",
    )
    refs = []
    for rung, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        picked = [k for k, (r, _, _) in enumerate(specs) if r == rung]
        engine = LadderAdamW(
            [{"params": [ref[k]]} for k in picked],
            lr=1e-2,
            seed=SEED,
            backend="triton",
            moment_dtype=dtype,
        )
        engine.param_starts = picked
        refs.append(engine)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(mixed, ref, strict=True):
            grad = torch.randn(a.shape, generator=g).to(device=DEVICE, dtype=a.dtype)
            a.grad, b.grad = grad.clone(), grad.clone()
        mixed_opt.step()
        for engine in refs:
            engine.step()
    assert mixed_opt.eager_reasons == {}
    ref_state = {p: st for engine in refs for p, st in engine.state.items()}
    for (rung, _, _), a, b in zip(specs, mixed, ref, strict=True):
        sa, sb = mixed_opt.state[a], ref_state[b]
        assert sa["step"].item() == sb["step"].item() == 3
        for name in ("exp_avg", "exp_avg_sq"):
            assert sa[name].dtype == (torch.float32 if rung == "fp32" else torch.bfloat16)
            assert torch.equal(sa[name], sb[name])
        assert torch.equal(a.detach(), b.detach())
