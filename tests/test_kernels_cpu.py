"""The C kernel against the eager path (the per-param oracle, ``_step_param``: test_oracle.py).

Params, moments and step counts must match bit for bit: the kernel repeats torch's
float32 operations in torch's order, with the same fused multiply-adds, the IEEE square
root (the eager path takes it in float64, see :mod:`optladder.optimizers.eager`), and the
oracle's random bits for the moments and for low-precision param writes. The dtype matrix
against a float64 reference is in ``test_kernels_dtypes.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.kernels import cpu

pytestmark = pytest.mark.skipif(
    cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)

SHAPES = [(1,), (17,), (33, 17), (4099,), (70_001,), (0,)]
"""Odd sizes so that the vector loops' tails and the thread split are exercised."""


SPLIT_SHAPES = [(33,), (200_001,), (70_001,)]
"""270,035 elements: enough for three threads (``cpu.run_table`` gives each at least
65,536), split inside params at offsets that are no multiple of any vector width
(OpenMP's 131,072-element work items, the pthread build's thirds rounded to 64)."""


def _params(
    seed: int = 0, shapes: list[tuple[int, ...]] = SHAPES, dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params: list[torch.nn.Parameter], step: int, dtype: torch.dtype) -> None:
    """Grads spanning six decades, in ``dtype`` (a None grad for param 1 on odd steps)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        scale = 10.0 ** torch.randint(-4, 2, p.shape, generator=gen)
        g = torch.randn(p.shape, generator=gen) * scale
        p.grad_dtype = None  # allow a grad dtype other than the param's
        p.grad = None if (i == 1 and step % 2 == 1) else g.to(dtype)


def _seed_state(opt: LadderAdamW, params: list[torch.nn.Parameter]) -> None:
    """Non-trivial moments and per-param step counts, identical for every optimizer."""
    gen = torch.Generator().manual_seed(7)
    for k, p in enumerate(params):
        opt.state[p] = {
            "step": torch.tensor(float(3 * k), dtype=torch.float64),
            "exp_avg": (torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16),
            "exp_avg_sq": (torch.rand(p.shape, generator=gen) * 0.01).to(torch.bfloat16),
        }


def _run(
    backend: str, steps: int, grad_dtype: torch.dtype, **kwargs: Any
) -> tuple[list[torch.nn.Parameter], LadderAdamW]:
    """Steps from the seeded state; returns params and optimizer."""
    params = _params()
    opt = LadderAdamW(params, seed=1234, backend=backend, **kwargs)  # type: ignore[arg-type]
    _seed_state(opt, params)
    for step in range(steps):
        _grads(params, step, grad_dtype)
        opt.step()
    return params, opt


CONFIGS: list[dict[str, Any]] = [
    {"lr": 1e-2},
    {"lr": 3e-3, "weight_decay": 0.1, "decoupled_weight_decay": False},
    {"lr": 1e-2, "maximize": True},
    {"lr": 1e-2, "rounding": "nearest"},
    {"lr": 1e-2, "weight_decay": 0.0},
    {"lr": torch.tensor(2e-3)},
    {"lr": 1e-2, "betas": (0.3, 0.95), "eps": 1e-6},  # lerp weight >= 0.5: the other branch
]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}" for k in c) or "-")
def test_one_step_matches_oracle(
    config: dict[str, Any], grad_dtype: torch.dtype, kernel_simd: int
) -> None:
    ref, ref_opt = _run("eager", 2, grad_dtype, **config)
    got, got_opt = _run("cpu", 2, grad_dtype, **config)
    assert got_opt.eager_reasons == {}
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        sa, sb = ref_opt.state[a], got_opt.state[b]
        assert torch.equal(sa["exp_avg"].view(torch.int16), sb["exp_avg"].view(torch.int16)), k
        assert torch.equal(
            sa["exp_avg_sq"].view(torch.int16), sb["exp_avg_sq"].view(torch.int16)
        ), k
        assert sa["step"].item() == sb["step"].item() == 3 * k + (1 if k == 1 else 2)
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32)), k


def test_many_steps_stay_bitwise() -> None:
    steps = 12
    ref, ref_opt = _run("eager", steps, torch.float32, lr=1e-2, weight_decay=0.05)
    got, got_opt = _run("cpu", steps, torch.float32, lr=1e-2, weight_decay=0.05)
    for a, b in zip(ref, got, strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_opt.state[a][name], got_opt.state[b][name])
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))
    # and the run really moved: the update is not a no-op
    assert not torch.equal(ref[4].detach(), _params()[4].detach())


def _direct_step(
    threads: int,
    library: Any = None,
    shapes: list[tuple[int, ...]] = SHAPES,
    dtype: torch.dtype = torch.float32,
    **run: Any,
) -> torch.Tensor:
    """One kernel call (``cpu.run_table(..., **run)``) on fresh params of ``shapes`` and
    ``dtype``; returns params and moments, concatenated."""
    params = [p for p in _params(shapes=shapes, dtype=dtype) if p.numel() > 0]
    _grads(params, 0, torch.float32)
    params = [p for p in params if p.grad is not None]
    moments = [torch.zeros_like(p, dtype=torch.bfloat16) for p in params for _ in range(2)]
    steps = [torch.tensor(float(k), dtype=torch.float64) for k in range(len(params))]
    table = cpu.KernelTable(
        [p.detach() for p in params], moments[0::2], moments[1::2], steps, list(range(len(params)))
    )
    assert table.read_steps(library) == [float(k) for k in range(len(params))]
    table.set_grads([p.grad for p in params])
    table.set_scalars([1.0] * len(params), {1.0: (99, -1e-2, 0.03)})
    table.set_options(
        0, beta1=0.9, beta2=0.999, eps=1e-8, lr=1e-2, weight_decay=0.01,
        decoupled_weight_decay=True, maximize=False, stochastic=True, param_stochastic=True,
    )  # fmt: skip
    cpu.run_table(table, num_threads=threads, library=library, **run)
    table.bump_steps(library)
    assert [s.item() for s in steps] == [k + 1.0 for k in range(len(params))]
    parts = [t.detach().reshape(-1).float() for t in [*params, *moments[0::2]]]
    return torch.cat(parts)


def test_thread_count_does_not_change_the_result() -> None:
    one = _direct_step(1)
    assert torch.equal(one, _direct_step(2)) and torch.equal(one, _direct_step(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_threads_split_inside_params_on_every_simd_path(
    dtype: torch.dtype, kernel_simd: int
) -> None:
    """Params split between threads at offsets off every vector width write the bits of
    one thread on the C loop (the random bits are keyed by each element's index)."""
    want = _direct_step(1, shapes=SPLIT_SHAPES, dtype=dtype, simd=cpu.SIMD_C_LOOP)
    for threads in (1, 2, 3):
        got = _direct_step(threads, shapes=SPLIT_SHAPES, dtype=dtype)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), threads


@pytest.mark.parametrize("simd", [-1, 3, True, 2.0, "2"])
def test_run_table_refuses_a_simd_level_it_does_not_have(simd: Any) -> None:
    table = cpu.KernelTable([], [], [], [], [])
    with pytest.raises(ValueError, match=rf"simd={simd!r} is not a SIMD level; accepted: 0"):
        cpu.run_table(table, simd=simd)


def test_pthread_build_matches_openmp_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback build (no OpenMP: torch on another OpenMP runtime) gives equal bits."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_uses_gnu_openmp", lambda: False)
    lib = cpu.load(cpu.build())
    assert torch.equal(_direct_step(1), _direct_step(2, library=lib))
    one = _direct_step(1, shapes=SPLIT_SHAPES)
    assert torch.equal(one, _direct_step(3, library=lib, shapes=SPLIT_SHAPES))


def test_amp_found_inf_changes_nothing_and_grad_scale_unscales() -> None:
    params = _params()
    opt = LadderAdamW(params, lr=1e-2, backend="cpu")
    _seed_state(opt, params)
    _grads(params, 0, torch.float32)
    before = [p.detach().clone() for p in params]
    state_before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    opt.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
    opt.grad_scale = torch.tensor(8.0)  # type: ignore[attr-defined]
    opt.step()
    for p, b, sb in zip(params, before, state_before, strict=True):
        assert torch.equal(p.detach(), b)
        assert all(torch.equal(opt.state[p][k], v) for k, v in sb.items())

    # grad_scale: the same step as with grads divided by the scale (a power of two: exact)
    ref = _params()
    ref_opt = LadderAdamW(ref, lr=1e-2, backend="cpu")
    _seed_state(ref_opt, ref)
    _grads(ref, 0, torch.float32)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(8.0)
    opt.found_inf = torch.tensor(0.0)  # type: ignore[attr-defined]
    opt.step()
    ref_opt.step()
    for a, b in zip(ref, params, strict=True):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(ref_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)  # grads are left unscaled, as torch's fused


def test_unsupported_params_fall_back_with_a_reason_or_raise() -> None:
    p16 = torch.nn.Parameter(torch.randn(10).to(torch.bfloat16))
    p64 = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    for p in (p16, p64):
        p.grad = torch.randn(p.shape).to(p.dtype)
    opt = LadderAdamW([p16, p64], backend="auto")
    opt.step()
    assert set(opt.eager_reasons) == {1}  # bfloat16 is fused; float64 is not
    assert "float64" in opt.eager_reasons[1]
    with pytest.raises(ValueError, match=r"backend='cpu' cannot step param 1: .*float64"):
        LadderAdamW([p16, p64], backend="cpu").step()
    with pytest.raises(ValueError, match="backend must be one of"):
        LadderAdamW([p16], backend="fast")  # type: ignore[arg-type]


def test_missing_compiler_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "optladder-no-such-compiler")
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    opt = LadderAdamW([p], backend="auto")
    opt.step()
    assert "no C compiler" in opt.eager_reasons[0]
    assert opt.state[p]["step"].item() == 1.0
    with pytest.raises(ValueError, match="no C compiler"):
        LadderAdamW([p], backend="cpu").step()


def test_build_caches_under_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cpu.build()
    assert path.parent == tmp_path / "optladder" / "kernels" and path.suffix == ".so"
    mtime = os.stat(path).st_mtime_ns
    assert cpu.build() == path and os.stat(path).st_mtime_ns == mtime  # no rebuild


def test_nan_moments_stay_nan() -> None:
    p = torch.nn.Parameter(torch.zeros(64))
    p.grad = torch.full((64,), float("nan"))
    opt = LadderAdamW([p], backend="cpu")
    opt.step()
    bits: Callable[[str], torch.Tensor] = lambda n: opt.state[p][n].view(torch.int16)  # noqa: E731
    assert torch.isnan(opt.state[p]["exp_avg"].float()).all()
    # the oracle's quiet NaN: high half of the float32 pattern with bit 22 set
    assert ((bits("exp_avg_sq").to(torch.int32) & 0x7FC0) == 0x7FC0).all()


def _grouped_run(backend: str, edit: Callable[[LadderAdamW, int], None]) -> list[torch.Tensor]:
    """Six steps of two groups (one table for both on the C kernel), ``edit`` applied to
    the groups before each; the params' bits and moments after."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300, 5000, 64)]
    opt = LadderAdamW(
        [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}],
        lr=0.7640108443576374,
        weight_decay=0.5,
        seed=5,
        backend=backend,  # type: ignore[arg-type]
    )
    for step in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        edit(opt, step)
        opt.step()
    moments = [opt.state[p][name] for p in params for name in ("exp_avg", "exp_avg_sq")]
    return [p.detach().view(torch.int32) for p in params] + [m.view(torch.int16) for m in moments]


def _numpy_weight_decay_from_step_3(opt: LadderAdamW, step: int) -> None:
    np = pytest.importorskip("numpy")
    # equal to 0.5, but lr * weight_decay is then numpy float32 arithmetic: at this lr,
    # 1 - lr * weight_decay rounds to another float (0.61799455 rather than 0.6179946)
    opt.param_groups[0]["weight_decay"] = np.float32(0.5) if step >= 3 else 0.5


def _equal_betas_of_two_types(opt: LadderAdamW, step: int) -> None:
    np = pytest.importorskip("numpy")
    # equal betas, but numpy float32 powers give other bias corrections than float ones
    opt.param_groups[0]["betas"] = (0.75, 0.5)
    opt.param_groups[1]["betas"] = (np.float32(0.75), np.float32(0.5))


@pytest.mark.parametrize("edit", [_numpy_weight_decay_from_step_3, _equal_betas_of_two_types])
def test_options_equal_in_value_but_not_type_step_as_the_oracle(
    edit: Callable[[LadderAdamW, int], None],
) -> None:
    """The table keeps each group's options and a step's bias corrections while they are
    equal: a numpy float32 option equal to the float one before it (or to another
    group's) computes other fields, so it must not be taken as the same."""
    ref = _grouped_run("eager", edit)
    got = _grouped_run("cpu", edit)
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq", "step"])
def test_state_given_other_memory_between_steps_is_stepped_there(name: str) -> None:
    """``state[name].data = ...`` keeps the tensor but moves its memory: the kept table
    must point at the new memory (it stepped the old one, left alive here so the wrong
    result shows without writing freed memory) and give the eager oracle's bits."""
    results = []
    for backend in ("eager", "cpu"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300, 5000)]
        opt = LadderAdamW(params, lr=1e-2, backend=backend)  # type: ignore[arg-type]
        old = []
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if step == 2:
                for p in params:
                    old.append(opt.state[p][name].data)
                    opt.state[p][name].data = opt.state[p][name].data.clone()
            opt.step()
        if backend == "cpu":
            assert opt.eager_reasons == {}  # every param on the C kernel's table
        results.append(
            [p.detach().view(torch.int32) for p in params]
            + [opt.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_sq")]
            + [opt.state[p]["step"].clone() for p in params]
        )
    for k, (a, b) in enumerate(zip(*results, strict=True)):
        assert torch.equal(a, b), k
    assert [s.item() for s in results[1][-2:]] == [4.0, 4.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t``'s elements, in row-major order."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().reshape(-1).view(ints[t.element_size()])


def _strided(kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A param that is not contiguous: a transposed weight, a channels_last conv weight,
    or a column slice of a wider buffer (not dense)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "transposed":
        return torch.randn(37, 70, generator=gen).to(dtype).t()
    if kind == "channels_last":
        x = torch.randn(9, 7, 3, 5, generator=gen).to(dtype)
        return x.contiguous(memory_format=torch.channels_last)
    return torch.randn(41, 50, generator=gen).to(dtype)[:, 3:36]


@pytest.mark.parametrize("kind", ["transposed", "channels_last", "slice"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_params_that_are_not_contiguous_step_on_the_kernel_with_the_eager_bits(
    kind: str, param_dtype: torch.dtype, moment_dtype: torch.dtype, kernel_simd: int
) -> None:
    """A transposed, channels_last or sliced param (and its grad, of another dtype) is
    stepped by the C kernel on contiguous copies, written back in place (a view of the
    same memory stays tied), with the eager path's bits, params, moments and step counts,
    over steps of different grads; nothing steps eagerly (they all went through the
    eager loop: 8-46x slower per step over channels_last conv weights)."""
    grad_dtypes = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float16}
    grad_dtype = grad_dtypes.get(param_dtype, torch.float32)
    runs = []
    for backend in ("cpu", "eager"):
        base = _strided(kind, param_dtype, seed=3)
        other = torch.randn(33, generator=torch.Generator().manual_seed(4)).to(param_dtype)
        params = [torch.nn.Parameter(base), torch.nn.Parameter(other)]
        opt = LadderAdamW(
            params, lr=1e-2, weight_decay=0.1, seed=9, moment_dtype=moment_dtype, backend=backend
        )  # type: ignore[arg-type]
        for step in range(3):
            gen = torch.Generator().manual_seed(50 + step)
            for k, p in enumerate(params):
                p.grad_dtype = None
                g = torch.randn(p.shape, generator=gen) * 10.0 ** (-step)
                p.grad = g.to(grad_dtype if k == 0 else param_dtype)
            opt.step()
            if backend == "cpu":
                assert opt.eager_reasons == {}
        # stepped in place: the tensor it was made from still views it
        assert not params[0].is_contiguous() and base.data_ptr() == params[0].data_ptr()
        assert torch.equal(_bits(base), _bits(params[0]))
        runs.append((params, opt))
    (got, got_opt), (ref, ref_opt) = runs
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_bits(ref_opt.state[a][name]), _bits(got_opt.state[b][name]))


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "grad_scale"])
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_params_without_a_grad_at_some_steps_keep_the_table_and_the_eager_bits(
    moment_dtype: torch.dtype, amp: bool, kernel_simd: int
) -> None:
    """Params that have a grad at some steps only (experts, a task's head): the kernel's
    table is kept and their rows skipped (a step where the set of params with a grad
    changed made the whole table again: ~3x the step's host time over 20,000 params with
    1% of them missing a grad), with the eager path's bits, and each param's step count
    is the number of steps at which it had a grad (a zero-size param's too)."""
    sizes = (1, 17, 300, 70_001, 0, 5, 4099, 33)
    schedule = [  # which params have a grad at each step (param 4 is zero-size)
        set(range(8)),
        {0, 2, 4, 5, 7},
        {1, 2, 3, 6},
        set(range(8)),
        {0, 3, 4},
        {1, 5, 6, 7},
    ]
    runs = []
    for backend in ("cpu", "eager"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        opt = LadderAdamW(params, lr=1e-2, seed=3, moment_dtype=moment_dtype, backend=backend)  # type: ignore[arg-type]
        tables = []
        for having in schedule:
            scale = 64.0 if amp else 1.0
            for k, p in enumerate(params):
                g = torch.randn(p.shape, generator=gen) * scale
                p.grad = g if k in having else None
            if amp:
                opt.grad_scale = torch.tensor(scale)  # type: ignore[attr-defined]
            opt.step()
            tables.append(opt._cpu_table)
        if backend == "cpu":
            assert opt.eager_reasons == {}
            assert all(t is tables[0] for t in tables)  # made once, at the first step
        counts = [sum(k in having for having in schedule) for k in range(len(sizes))]
        assert [float(opt.state[p]["step"]) for p in params] == counts
        runs.append((params, opt))
    (got, got_opt), (ref, ref_opt) = runs
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        assert a.grad is None or torch.equal(a.grad, b.grad)  # unscaled alike
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_bits(ref_opt.state[a][name]), _bits(got_opt.state[b][name]))
