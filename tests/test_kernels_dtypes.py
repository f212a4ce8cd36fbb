"""Every (rung, param dtype, grad dtype, device) the kernels serve, against a float64
reference and against the eager oracle's bits; stochastic rounding of param writes.

Rungs: ``fp32`` (float32 moments on optladder's kernel, where torch's fused AdamW would
keep bf16/fp16 moments) and ``bf16`` (bfloat16 moments). Devices: the C kernel, and the
Triton kernel in Triton's interpreter (with a once-rounded fma, see ``triton_interp``;
small params there: the interpreter is slow), or compiled on CUDA where a GPU is present
(``bench/gpu_check.sh``), against the eager bits computed on the CPU.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.kernels import cpu
from triton_interp import exact_fma_interpreter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16}
PRECISION = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}
"""Significand bits (with the implicit one) of each format."""
HYPER: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}

needs_gcc = pytest.mark.skipif(
    cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)


TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the compiled Triton kernel needs CUDA (gpu_check.sh)"
)
WRITE_BACKENDS = [
    pytest.param("cpu", marks=needs_gcc),
    "eager",
    pytest.param("triton", marks=needs_cuda),
]
"""Backends of the param-write tests; Triton's only where compiled (20,000-element params
are too slow for its interpreter)."""


@pytest.fixture(scope="module")
def triton_interpreter() -> Iterator[None]:
    pytest.importorskip("triton", reason="triton is not installed")
    if TRITON_DEVICE.type == "cuda":  # the compiled kernel
        yield
        return
    with exact_fma_interpreter():
        from optladder.optimizers.kernels import triton_adamw

        if type(triton_adamw._adamw_bf16_kernel).__name__ != "InterpretedFunction":
            pytest.skip("the Triton kernel was imported compiled before this module ran")
        yield


def _inputs(
    sizes: tuple[int, ...], param_dtype: torch.dtype, grad_dtype: torch.dtype, seed: int
) -> list[dict[str, torch.Tensor]]:
    """Params, grads over six decades, moments and per-param step counts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(sizes):
        scale = 10.0 ** torch.randint(-4, 2, (n,), generator=gen)
        out.append(
            {
                "p": torch.randn(n, generator=gen).to(param_dtype),
                "g": (torch.randn(n, generator=gen) * scale).to(grad_dtype),
                "m": torch.randn(n, generator=gen) * 0.1,
                "v": torch.rand(n, generator=gen) * 0.01,
                "step": torch.tensor(float(4 * k)),
            }
        )
    return out


def _one_step(
    backend: str, rung: str, inputs: list[dict[str, torch.Tensor]], **options: Any
) -> tuple[list[torch.nn.Parameter], LadderAdamW]:
    moment_dtype = MOMENTS[rung]
    device = TRITON_DEVICE if backend == "triton" else torch.device("cpu")
    params = [torch.nn.Parameter(x["p"].clone().to(device)) for x in inputs]
    opt = LadderAdamW(
        params, backend=backend, moment_dtype=moment_dtype, seed=5, **{**HYPER, **options}
    )  # type: ignore[arg-type]
    for p, x in zip(params, inputs, strict=True):
        opt.state[p] = {
            "step": x["step"].clone(),
            "exp_avg": x["m"].to(device, moment_dtype, copy=True),
            "exp_avg_sq": x["v"].to(device, moment_dtype, copy=True),
        }
        p.grad_dtype = None  # a grad dtype other than the param's
        p.grad = x["g"].clone().to(device)
    opt.step()
    assert backend == "eager" or opt.eager_reasons == {}, opt.eager_reasons
    return params, opt


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)


def _check_float64(
    params: list[torch.nn.Parameter],
    opt: LadderAdamW,
    inputs: list[dict[str, torch.Tensor]],
    moment_dtype: torch.dtype,
) -> None:
    """One step against AdamW in float64 from the same (stored) inputs.

    Bounds, per element: the moment, rounded once to its format (stochastic or nearest:
    at most one ulp, ``2**(1 - precision)`` relative), plus float32 arithmetic: ``m``'s
    lerp rounds twice on magnitudes up to ``|m_in| + |g|`` (it cancels when g ~ m), ``v``
    is a sum of positive terms (4 roundings: relative 4 * 2**-24). The param: its own
    format's ulp, float32 roundings of the decay product and the sum (2**-24 of
    ``|p_in| + |u|`` each), and the update ``u = step_size * m / denom``'s error: ``m``'s
    absolute error over ``denom`` plus ~8 float32 roundings of ``u`` (step size, sqrt, two
    divisions, eps, hyperparameters rounded to float32); float16's subnormal quantum
    2**-24 absolute. Float32 terms carry a factor 2 of slack.
    """
    lr, (beta1, beta2), eps, wd = (HYPER[k] for k in ("lr", "betas", "eps", "weight_decay"))
    ulp_m = 2.0 ** (1 - PRECISION[moment_dtype])
    for p, x in zip(params, inputs, strict=True):
        step = int(x["step"]) + 1
        p_in, g = x["p"].double(), x["g"].double()
        m_in = x["m"].to(moment_dtype).double()
        v_in = x["v"].to(moment_dtype).double()
        m64 = m_in + (1 - beta1) * (g - m_in)
        v64 = beta2 * v_in + (1 - beta2) * g * g
        denom = v64.sqrt() / math.sqrt(1 - beta2**step) + eps
        step_size = lr / (1 - beta1**step)
        u64 = step_size * m64 / denom
        p64 = p_in * (1 - lr * wd) - u64
        st = opt.state[p]
        m_err = 2 * 2.0**-23 * (m_in.abs() + g.abs())
        tol_m = ulp_m * m64.abs() + m_err
        tol_v = ulp_m * v64 + 2 * 4 * 2.0**-24 * v64
        assert ((st["exp_avg"].cpu().double() - m64).abs() <= tol_m).all()
        assert ((st["exp_avg_sq"].cpu().double() - v64).abs() <= tol_v).all()
        tol_p = (
            2.0 ** (1 - PRECISION[p.dtype]) * p64.abs()
            + 2 * 2.0**-24 * 2 * (p_in.abs() + u64.abs())
            + 2 * (step_size * m_err / denom + 8 * 2.0**-24 * u64.abs())
            + (2.0**-24 if p.dtype == torch.float16 else 0.0)
        )
        err = (p.detach().cpu().double() - p64).abs()
        assert (err <= tol_p).all(), float((err / tol_p).max())
        assert st["step"].item() == step


CPU_CASES = list(itertools.product(MOMENTS, DTYPES, DTYPES))


@needs_gcc
@pytest.mark.parametrize(("rung", "param_dtype", "grad_dtype"), CPU_CASES)
def test_c_kernel_matches_float64_and_eager_bits(
    rung: str, param_dtype: torch.dtype, grad_dtype: torch.dtype, kernel_simd: int
) -> None:
    """Each SIMD path (``kernel_simd``); sizes that leave tails of every vector width."""
    inputs = _inputs(
        (1, 17, 4099, 70_001),
        param_dtype,
        grad_dtype,
        seed=CPU_CASES.index((rung, param_dtype, grad_dtype)),  # the same in every process
    )
    got, got_opt = _one_step("cpu", rung, inputs)
    ref, ref_opt = _one_step("eager", rung, inputs)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(ref_opt.state[a][name]), _bits(got_opt.state[b][name]))
    _check_float64(got, got_opt, inputs, MOMENTS[rung])


# Every (rung, param dtype, grad dtype), as on the C kernel: each pair is its own launch
# configuration (the kernel specializes on both dtypes), ~0.2 s each in the interpreter;
# small params there, one of them past a chunk.
TRITON_CASES = CPU_CASES


@pytest.mark.parametrize(("rung", "param_dtype", "grad_dtype"), TRITON_CASES)
def test_triton_kernel_matches_float64_and_eager_bits(
    triton_interpreter: None, rung: str, param_dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    inputs = _inputs((3, 4096 + 7), param_dtype, grad_dtype, seed=11)
    got, got_opt = _one_step("triton", rung, inputs)
    ref, ref_opt = _one_step("eager", rung, inputs)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(ref_opt.state[a][name]), _bits(got_opt.state[b][name]))
    _check_float64(got, got_opt, inputs, MOMENTS[rung])


def _write_many(backend: str, param_dtype: torch.dtype, seed: int, **options: Any) -> torch.Tensor:
    """One step of N equal params whose update is a fraction of their ulp: returns the
    written params (on the CPU)."""
    n = 20_000
    device = TRITON_DEVICE if backend == "triton" else torch.device("cpu")
    p = torch.nn.Parameter(torch.full((n,), 1.0 + 2.0**-6).to(device, param_dtype))
    opt = LadderAdamW([p], lr=3e-4, weight_decay=0.0, backend=backend, seed=seed, **options)  # type: ignore[arg-type]
    p.grad = torch.full((n,), 0.5, dtype=param_dtype, device=device)
    opt.step()
    return p.detach().cpu()


def _float32_result() -> float:
    """The same step on a float32 param: the float32 value every write rounds."""
    return float(_write_many("eager", torch.float32, seed=0)[0])


@pytest.mark.parametrize("backend", WRITE_BACKENDS)
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_stochastic_param_writes_are_unbiased_and_reproducible(
    backend: str, param_dtype: torch.dtype
) -> None:
    """Every write is one of the two neighbours of the float32 value, and their mean is
    within 4 standard errors of it: a write rounds up with probability ``f``, the
    float32 value's fraction of the way from its lower neighbour to its upper one, so
    the mean of ``n`` writes has standard error ``ulp * sqrt(f * (1 - f) / n)``."""
    exact = _float32_result()
    lo = float(torch.tensor(exact).to(param_dtype))  # nearest; the neighbour is 1 ulp off
    written = _write_many(backend, param_dtype, seed=1)
    values = written.double()
    down = torch.tensor(exact).to(param_dtype)
    if float(down) > exact:
        down = torch.nextafter(down, torch.tensor(-math.inf, dtype=param_dtype))
    up = torch.nextafter(down, torch.tensor(math.inf, dtype=param_dtype))
    ulp = float(up) - float(down)
    f = (exact - float(down)) / ulp
    assert 0.0 < f < 1.0  # the float32 value lies strictly between the two
    assert set(values.unique().tolist()) == {float(down), float(up)}
    assert set(values.unique().tolist()) <= {
        lo,
        float(
            torch.nextafter(
                torch.tensor(lo, dtype=param_dtype), torch.tensor(-1.0, dtype=param_dtype)
            )
        ),
        float(
            torch.nextafter(
                torch.tensor(lo, dtype=param_dtype), torch.tensor(2.0, dtype=param_dtype)
            )
        ),
    }
    assert values.unique().numel() == 2  # both neighbours occur
    sigma = ulp * math.sqrt(f * (1.0 - f) / values.numel())
    assert abs(values.mean().item() - exact) <= 4 * sigma, (values.mean().item(), exact, sigma)
    assert torch.equal(_bits(written), _bits(_write_many(backend, param_dtype, seed=1)))
    assert not torch.equal(_bits(written), _bits(_write_many(backend, param_dtype, seed=2)))


@pytest.mark.parametrize("backend", WRITE_BACKENDS)
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_nearest_param_writes_are_round_to_nearest_even(
    backend: str, param_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(4)
    device = TRITON_DEVICE if backend == "triton" else torch.device("cpu")
    p32 = torch.nn.Parameter(torch.randn(5000, generator=gen).to(param_dtype).float())
    low = torch.nn.Parameter(p32.detach().to(device, param_dtype))
    grad = torch.randn(5000, generator=gen)
    ref = LadderAdamW([p32], lr=1e-2, backend="eager")
    opt = LadderAdamW([low], lr=1e-2, backend=backend, param_rounding="nearest")  # type: ignore[arg-type]
    p32.grad, low.grad = grad, grad.to(device, param_dtype)
    p32.grad = low.grad.float().cpu()  # the same grad values
    ref.step()
    opt.step()
    assert torch.equal(_bits(low.cpu()), _bits(p32.detach().to(param_dtype)))  # torch's RNE


def test_param_rounding_is_validated_exactly_and_saved() -> None:
    p = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    for bad in ("Stochastic", "nearest ", None, True):
        with pytest.raises(
            ValueError, match=r"param_rounding must be 'stochastic' or 'nearest', got"
        ):
            LadderAdamW([p], param_rounding=bad)  # type: ignore[arg-type]
    opt = LadderAdamW([p], backend="eager", param_rounding="nearest")
    with pytest.raises(ValueError, match="param_rounding"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.randn(2))], "param_rounding": "sr"}
        )
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_rounding"] == "nearest"
    # set on a group after construction: refused at the step, nothing changes
    p.grad = torch.randn(8).to(torch.bfloat16)
    opt.param_groups[0]["param_rounding"] = "NEAREST"
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"param group 0: param_rounding must be"):
        opt.step()
    assert torch.equal(before, p.detach()) and len(opt.state) == 0
    # a checkpoint from before the key existed loads with the optimizer's default
    fresh = LadderAdamW([p], backend="eager", param_rounding="nearest")
    old = fresh.state_dict()
    del old["param_groups"][0]["param_rounding"]
    loader = LadderAdamW([p], backend="eager")
    loader.load_state_dict(old)
    assert loader.param_groups[0]["param_rounding"] == "stochastic"
    loader.load_state_dict(saved)
    assert loader.param_groups[0]["param_rounding"] == "nearest"


@needs_gcc
def test_kernel_table_is_built_once_and_rebuilt_when_the_params_change() -> None:
    params = [torch.nn.Parameter(torch.randn(n)) for n in (10, 20)]
    opt = LadderAdamW(params, backend="cpu")
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    table = opt._cpu_table
    for p in params:
        p.grad = torch.randn(p.shape)  # new grad storage: only the grad pointers change
    opt.step()
    assert opt._cpu_table is table
    assert [opt.state[p]["step"].item() for p in params] == [2.0, 2.0]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new moment tensors
    opt.step()
    assert opt._cpu_table is not table
    table = opt._cpu_table
    params[1].grad = None  # a param without a grad: its row is skipped, the table kept
    opt.step()
    assert opt._cpu_table is table and table.n_params == 2
    assert [opt.state[p]["step"].item() for p in params] == [4.0, 3.0]


def test_choose_optimizer_takes_param_rounding_on_both_rungs() -> None:
    from optladder import choose_optimizer

    with pytest.raises(ValueError, match=r"param_rounding must be .* got 'round'"):
        choose_optimizer([torch.nn.Parameter(torch.randn(4))], param_rounding="round")
    gen = torch.Generator().manual_seed(9)
    start = torch.randn(300, generator=gen).to(torch.bfloat16)
    grad = torch.randn(300, generator=gen).to(torch.bfloat16)
    for rung in ("fp32", "bf16"):
        p = torch.nn.Parameter(start.clone())
        opt = choose_optimizer([p], rung=rung, free_memory="1GiB", param_rounding="nearest")
        assert opt.param_groups[0]["param_rounding"] == "nearest"
        p.grad = grad.clone()
        opt.step()
        ref = torch.nn.Parameter(start.float())
        ref_opt = LadderAdamW([ref], backend="eager", moment_dtype=MOMENTS[rung])
        ref.grad = grad.float()
        ref_opt.step()
        assert torch.equal(_bits(p), _bits(ref.detach().to(torch.bfloat16)))


def test_the_fp32_rung_takes_the_seed_and_keeps_it_and_rounding_across_a_move() -> None:
    """bf16 params on the fp32 rung are written with the random bits of the given seed
    (the eager oracle with that seed gives the same bits; seed 0, the default, other
    bits), and the groups keep the seed and the moments' rounding, so a move to the bf16
    rung steps with them (the fp32 engine once dropped both: seed 0 and stochastic)."""
    from optladder import choose_optimizer

    def params() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16()) for n in (5000, 300)]

    def run(opt: Any, ps: list[torch.nn.Parameter]) -> None:
        for k in range(3):
            gen = torch.Generator().manual_seed(100 + k)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()

    live, ref, zero = params(), params(), params()
    opt = choose_optimizer(live, lr=1e-2, rung="fp32", free_memory="64GiB", environ={}, seed=5)
    run(opt, live)
    run(LadderAdamW(ref, lr=1e-2, backend="eager", moment_dtype=torch.float32, seed=5), ref)
    run(LadderAdamW(zero, lr=1e-2, backend="eager", moment_dtype=torch.float32, seed=0), zero)
    assert [g["seed"] for g in opt.param_groups] == [5]
    for a, b, c in zip(live, ref, zero, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        assert not torch.equal(_bits(a), _bits(c))  # the seed matters to these bits
    moved = choose_optimizer(
        params(), lr=1e-2, free_memory="64GiB", environ={}, seed=5, rounding="nearest"
    )
    assert moved.rung == "fp32"
    moved.migrate_to("bf16", "a test's move", force=True)
    assert moved.param_groups[0]["seed"] == 5
    assert moved.param_groups[0]["rounding"] == "nearest"


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_gcc), "triton"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("param_dtype", DTYPES)
def test_nan_and_inf_write_the_same_bits_in_kernel_and_eager(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    param_dtype: torch.dtype,
    rounding: str,
) -> None:
    """NaN and infinite grads, params and moments: stochastic writes keep NaN a NaN
    (quiet, its sign and high payload bits kept; float16: 0x7E00 with the sign), nearest
    bfloat16 writes make it 0x7FC0, and the kernel writes the eager bits, the NaN
    patterns included (the Triton kernel: compiled on CUDA, else in its interpreter; the
    C kernel: each SIMD path this CPU runs)."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    levels = range(cpu.simd_level() + 1) if backend == "cpu" else [None]
    for level in levels:
        if level is not None:
            monkeypatch.setattr(cpu, "run_table", functools.partial(_RUN_TABLE, simd=level))
        _check_nan_and_inf(backend, param_dtype, rounding)


_RUN_TABLE = cpu.run_table


def _check_nan_and_inf(backend: str, param_dtype: torch.dtype, rounding: str) -> None:
    inputs = _inputs((64,), param_dtype, torch.float32, seed=3)
    x = inputs[0]
    x["g"][:8] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, 3.0, -2.0]
    )
    x["p"][8:12] = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan")]).to(
        param_dtype
    )
    x["m"][12:14] = torch.tensor([float("nan"), float("inf")])
    x["v"][14:16] = torch.tensor([float("nan"), float("inf")])
    options = {"rounding": rounding, "param_rounding": rounding}
    for rung in MOMENTS:
        got, got_opt = _one_step(backend, rung, inputs, **options)
        ref, ref_opt = _one_step("eager", rung, inputs, **options)
        assert torch.equal(_bits(ref[0]), _bits(got[0]))
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = ref_opt.state[ref[0]][name], got_opt.state[got[0]][name]
            assert torch.equal(_bits(a), _bits(b)), name
            assert bool(torch.isnan(b[[0, 12 if name == "exp_avg" else 14]]).all())
        assert bool(torch.isnan(got[0].detach()[[0, 8, 11]]).all())


@needs_gcc
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("lr", [1e-9, 1e-6, 1e-2, 30.0])
def test_float16_params_in_every_range_write_the_eager_bits(
    rounding: str, lr: float, kernel_simd: int
) -> None:
    """float16 params whose new values fall below the smallest subnormal (2**-24: the
    stochastic write rounds up with probability |x| / 2**-24), among the subnormals (a
    quantum of 2**-24), among the normals, and past the largest finite value (65504: an
    infinity), written by each SIMD path with the eager oracle's bits; 1,000 elements (a
    tail after every vector width)."""
    gen = torch.Generator().manual_seed(11)
    n = 1000
    starts = torch.tensor([0.0, 2.0**-24, -(2.0**-20), 2.0**-14, 1.0, -3.0, 60000.0, -65504.0])
    p = starts[torch.randint(0, len(starts), (n,), generator=gen)]
    inputs = [
        {
            "p": p.to(torch.float16),
            "g": torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 2, (n,), generator=gen),
            "m": torch.randn(n, generator=gen) * 0.1,
            "v": torch.rand(n, generator=gen) * 0.01,
            "step": torch.tensor(3.0),
        }
    ]
    options = {"rounding": rounding, "param_rounding": rounding, "lr": lr}
    for rung in MOMENTS:
        got, got_opt = _one_step("cpu", rung, inputs, **options)
        ref, ref_opt = _one_step("eager", rung, inputs, **options)
        assert torch.equal(_bits(ref[0]), _bits(got[0])), rung
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = ref_opt.state[ref[0]][name], got_opt.state[got[0]][name]
            assert torch.equal(_bits(a), _bits(b)), name
    new = got[0].detach().float().abs()
    if lr == 1e-9:  # below and among the subnormals, some rounded up to 2**-24
        assert bool(((new > 0) & (new <= 2.0**-24)).any())
    if lr == 30.0:  # past 65504
        assert bool(torch.isinf(new).any())


@needs_gcc
def test_tables_released_between_prepare_and_commit_still_step() -> None:
    """release_tables() (before state moves) between a prepare and its commit: the commit
    steps with the table the prepared plans point into, as the eager oracle does."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (10, 20)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = LadderAdamW([{"params": params[:1]}, {"params": params[1:]}], backend="cpu")
    ref = LadderAdamW([{"params": twins[:1]}, {"params": twins[1:]}], backend="eager")
    for p, q in zip(params, twins):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
    opt.prepare_step()
    opt.release_tables()
    opt.commit_step()
    ref.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
        assert opt.state[p]["step"].item() == 1.0


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_gcc), "eager"])
@pytest.mark.parametrize("rung", MOMENTS)
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_param_writes_take_their_own_stream_of_the_moments_hash(
    backend: str, rung: str, param_dtype: torch.dtype
) -> None:
    """The written param is its float32 value rounded with the bits ``rounding.py``
    documents: ``hash32((i + param_key(key)) mod 2**32)``, ``key`` the moments' key of
    (seed, step, param index), computed here element by element with the scalar hash;
    bfloat16 adds their low 16 bits to the float32 pattern's low half and truncates
    (written out here), float16 takes all 32 (the oracle's ``stochastic_round_f16``).
    The moments' own stream (``key``) would give other bits. The float32 value is the
    same step on a float32 twin (exact upcasts of the same params and grads; the moments
    do not depend on the param), set to the written param before each step."""
    from optladder.optimizers.rounding import (
        MASK32,
        element_key,
        hash32,
        param_key,
        stochastic_round_f16,
    )

    n, seed = 300, 7
    gen = torch.Generator().manual_seed(8)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(param_dtype)) for _ in "ab"]
    twins = [torch.nn.Parameter(p.detach().float()) for p in params]
    options: dict[str, Any] = {"moment_dtype": MOMENTS[rung], "seed": seed, **HYPER}
    opt = LadderAdamW(params, backend=backend, **options)  # type: ignore[arg-type]
    ref = LadderAdamW(twins, backend="eager", **options)

    def bits(key: int) -> torch.Tensor:
        return torch.tensor([hash32((i + key) & MASK32) for i in range(n)], dtype=torch.int64)

    def rounded(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if param_dtype == torch.float16:
            return stochastic_round_f16(x, r)
        u = x.view(torch.int32).to(torch.int64) & MASK32
        return (((u + (r & 0xFFFF)) >> 16) << 16).to(torch.int32).view(torch.float32).bfloat16()

    for step in (1, 2, 3):
        for p, t in zip(params, twins, strict=True):
            g = torch.randn(n, generator=gen).to(param_dtype)
            p.grad, t.grad = g, g.float()
            with torch.no_grad():
                t.copy_(p.float())
        opt.step()
        ref.step()
        assert backend == "eager" or opt.eager_reasons == {}
        for index, (p, t) in enumerate(zip(params, twins, strict=True)):
            x = t.detach()
            assert bool(x.isfinite().all())
            key = element_key(seed, step, index)
            want = rounded(x, bits(param_key(key)))
            assert torch.equal(_bits(p), _bits(want)), (step, index)
            assert not torch.equal(_bits(p), _bits(rounded(x, bits(key))))
            assert not torch.equal(_bits(p), _bits(x.to(param_dtype)))  # not nearest
