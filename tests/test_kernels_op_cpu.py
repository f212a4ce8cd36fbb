"""``torch.ops.optladder.adamw_bf16_`` on CPU tensors: the C kernel registered as the op's
CPU implementation, checked bit for bit against the eager oracle (``LadderAdamW`` with
``backend="eager"``, the readable reference of :mod:`optladder.optimizers.eager`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.kernels import cpu, ops

pytestmark = pytest.mark.skipif(
    cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)

SEED = 0xC0FFEE_12345678
SHAPES = [(1,), (33, 17), (4099,), (70_001,)]
"""Odd sizes: the vector loops' tails and the thread split."""
PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
"""Mixed param dtypes in one call (the C kernel's rows each carry their dtype)."""


def _inputs(
    moment_dtype: torch.dtype, grad_dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Params, grads (six decades) and state with moments and per-param step counts."""
    gen = torch.Generator().manual_seed(3)
    params, grads, states = [], [], []
    for k, (shape, dtype) in enumerate(zip(SHAPES, PARAM_DTYPES, strict=True)):
        params.append(torch.randn(shape, generator=gen).to(dtype))
        scale = 10.0 ** torch.randint(-4, 2, shape, generator=gen)
        grads.append((torch.randn(shape, generator=gen) * scale).to(grad_dtype))
        states.append(
            {
                "step": torch.tensor(float(5 * k), dtype=torch.float64),
                "exp_avg": (torch.randn(shape, generator=gen) * 0.1).to(moment_dtype),
                "exp_avg_sq": (torch.rand(shape, generator=gen) * 0.01).to(moment_dtype),
            }
        )
    return params, grads, states


def _clone(xs: list[Any]) -> list[Any]:
    if isinstance(xs[0], dict):
        return [{k: v.clone() for k, v in x.items()} for x in xs]
    return [x.clone() for x in xs]


def _oracle(
    moment_dtype: torch.dtype, grad_dtype: torch.dtype, cfg: dict[str, Any]
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """One step of LadderAdamW's eager path (the oracle) from the same inputs."""
    params, grads, states = _inputs(moment_dtype, grad_dtype)
    ps = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(ps, grads, strict=True):
        p.grad_dtype = None  # a grad dtype other than the param's
        p.grad = g
    opt = LadderAdamW(
        ps,
        lr=cfg["lr"],
        betas=(cfg["beta1"], cfg["beta2"]),
        eps=cfg["eps"],
        weight_decay=cfg["weight_decay"],
        decoupled_weight_decay=cfg["decoupled"],
        maximize=cfg["maximize"],
        moment_dtype=moment_dtype,
        seed=SEED,
        rounding="stochastic" if cfg["stochastic"] else "nearest",
        param_rounding="stochastic" if cfg["param_stochastic"] else "nearest",
        backend="eager",
    )
    for p, st in zip(ps, states, strict=True):
        opt.state[p] = st
    opt.step()
    return [p.detach() for p in ps], [opt.state[p] for p in ps], [p.grad for p in ps]


def _op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    cfg: dict[str, Any],
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    indices: list[int] | None = None,
) -> None:
    lr = cfg["lr"]
    torch.ops.optladder.adamw_bf16_(
        params,
        grads,
        [st["exp_avg"] for st in states],
        [st["exp_avg_sq"] for st in states],
        [st["step"] for st in states],
        list(range(len(params))) if indices is None else indices,
        float(lr),
        lr if isinstance(lr, torch.Tensor) else None,
        cfg["beta1"],
        cfg["beta2"],
        cfg["eps"],
        cfg["weight_decay"],
        cfg["decoupled"],
        cfg["maximize"],
        cfg["stochastic"],
        cfg["param_stochastic"],
        ops.seed_prefix(SEED),
        grad_scale,
        found_inf,
    )


BASE: dict[str, Any] = {
    "lr": 1e-2,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "decoupled": True,
    "maximize": False,
    "stochastic": True,
    "param_stochastic": True,
}
CONFIGS: list[dict[str, Any]] = [
    {},
    {"decoupled": False, "weight_decay": 0.1},
    {"maximize": True, "weight_decay": 0.0},
    {"stochastic": False, "param_stochastic": False},
    {"lr": torch.tensor(2e-3)},
    {"beta1": 0.3, "beta2": 0.95, "eps": 1e-6},
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda c: ",".join(c) or "base")
def test_op_on_cpu_gives_the_oracle_bits(
    overrides: dict[str, Any], grad_dtype: torch.dtype, moment_dtype: torch.dtype
) -> None:
    cfg = {**BASE, **overrides}
    want_p, want_states, _ = _oracle(moment_dtype, grad_dtype, cfg)
    params, grads, states = _inputs(moment_dtype, grad_dtype)
    _op(params, grads, states, cfg)
    for k in range(len(params)):
        assert torch.equal(_bits(params[k]), _bits(want_p[k])), k
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(states[k][name]), _bits(want_states[k][name])), (k, name)
        assert states[k]["step"].item() == want_states[k]["step"].item() == 5 * k + 1


def test_grad_scale_unscales_the_grads_in_place() -> None:
    """With ``grad_scale`` (a power of two, as GradScaler's), the step is the step on the
    unscaled grads, and the grads are left unscaled (torch's fused Adam does the same)."""
    cfg = dict(BASE)
    want_p, want_states, want_grads = _oracle(torch.bfloat16, torch.float32, cfg)
    params, grads, states = _inputs(torch.bfloat16, torch.float32)
    grads = [g * 8 for g in grads]
    _op(params, grads, states, cfg, grad_scale=torch.tensor(8.0))
    for k in range(len(params)):
        assert torch.equal(_bits(params[k]), _bits(want_p[k])), k
        assert torch.equal(states[k]["exp_avg"], want_states[k]["exp_avg"]), k
        assert torch.equal(grads[k], want_grads[k]), k


def test_found_inf_changes_nothing_then_zero_steps() -> None:
    params, grads, states = _inputs(torch.bfloat16, torch.float32)
    before = (_clone(params), _clone(grads), _clone(states))
    _op(params, grads, states, BASE, grad_scale=torch.tensor(4.0), found_inf=torch.tensor(1.0))
    for got, want in zip((params, grads), before[:2], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for st, old in zip(states, before[2], strict=True):
        assert all(torch.equal(st[k], old[k]) for k in st)
    _op(params, grads, states, BASE, found_inf=torch.tensor(0.0))
    assert [st["step"].item() for st in states] == [5.0 * k + 1 for k in range(len(states))]
    assert not torch.equal(params[3], before[0][3])


def test_op_steps_inside_compiled_code() -> None:
    """The op is opaque to ``torch.compile``: called from compiled code on CPU tensors,
    it runs the C kernel and gives the same bits."""
    cfg = dict(BASE)
    want_p, want_states, _ = _oracle(torch.bfloat16, torch.float32, cfg)
    params, grads, states = _inputs(torch.bfloat16, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda: _op(params, grads, states, cfg), backend="aot_eager")
    compiled()
    for k in range(len(params)):
        assert torch.equal(_bits(params[k]), _bits(want_p[k])), k
        assert torch.equal(states[k]["exp_avg_sq"], want_states[k]["exp_avg_sq"]), k


def test_bad_inputs_are_refused_before_anything_changes() -> None:
    params, grads, states = _inputs(torch.bfloat16, torch.float32)
    before = _clone(params)
    with pytest.raises(ValueError, match=r"params\[1\]"):  # a grad of another shape
        _op(params, [grads[0], grads[1].flatten()[:5], *grads[2:]], states, BASE)
    with pytest.raises(ValueError, match="exp_avgs"):  # a moment of another dtype
        bad = _clone(states)
        bad[2]["exp_avg"] = bad[2]["exp_avg"].float()
        _op(params, grads, bad, BASE)
    with pytest.raises(ValueError, match=r"one entry per param; got lengths \[4, 4, 4, 4, 4, 3\]"):
        _op(params, grads, states, BASE, indices=[0, 1, 2])
    with pytest.raises(ValueError, match=r"2\*\*32"):  # a step the random bits cannot key
        bad = _clone(states)
        bad[0]["step"].fill_(2.0**32)
        _op(params, grads, bad, BASE)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    assert [st["step"].item() for st in states] == [5.0 * k for k in range(len(states))]


def test_the_triton_interpreter_still_takes_cpu_tensors_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``TRITON_INTERPRET=1`` the op's CPU implementation hands the call to the
    Triton kernel (how ``tests/test_kernels_triton.py`` tests it without a GPU)."""
    calls: list[int] = []
    monkeypatch.setattr(ops, "_adamw_bf16_triton", lambda *args: calls.append(len(args[0])))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    params, grads, states = _inputs(torch.bfloat16, torch.float32)
    before = _clone(params)
    _op(params, grads, states, BASE)
    assert calls == [len(params)]
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
