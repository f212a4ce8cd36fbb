"""``torch.compile`` around the optimizer: its methods run eagerly inside compiled code
(a graph break, as torch's optimizers mark theirs), so a compiled step is the eager step.

Traced, the step failed on every rung (the fp32 rung's fused call in AOT autograd's
functionalization, the bf16 and 8bit rungs in TorchDynamo). The tests compile with
``backend="aot_eager"``: TorchDynamo and AOT autograd as ``inductor`` runs them, without
its C++ code generation (seconds per test instead of a minute).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import optladder
from optladder.compilation import run_eagerly


def _rungs() -> list[str]:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return ["fp32", "bf16"]
    return ["fp32", "bf16", "8bit"]


def _pair(rung: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, Any, Any]:
    """Two identical small models and an optladder optimizer on ``rung`` for each."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    twin = copy.deepcopy(model)

    def make(m: torch.nn.Module) -> Any:
        return optladder.AdamW(m.parameters(), lr=1e-2, rung=rung, free_memory="1TiB", environ={})

    return model, twin, make(model), make(twin)


def _backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad()
    model(x).square().mean().backward()


def _step_count(opt: Any, p: torch.Tensor) -> int:
    return int(opt.state[p]["step"])


@pytest.mark.parametrize("rung", _rungs())
def test_a_compiled_step_is_the_eager_step(rung: str) -> None:
    """Three steps through a compiled function equal three eager steps of a twin
    optimizer bit for bit (the twin is the reference: the same kernels, run eagerly),
    and each step counts once."""
    model, twin, opt, ref = _pair(rung)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    _assert_compiled_steps_equal_eager(model, twin, opt, ref, x, steps=3)
    assert opt.rung == rung


def _assert_compiled_steps_equal_eager(
    model: torch.nn.Module, twin: torch.nn.Module, opt: Any, ref: Any, x: torch.Tensor, steps: int
) -> None:
    """``steps`` steps of ``opt`` through a compiled function and of its twin ``ref``
    eagerly, on the same grads: the params equal bit for bit, each step counted once."""
    torch._dynamo.reset()
    compiled_step = torch.compile(lambda: opt.step(), backend="aot_eager")
    for _ in range(steps):
        _backward(model, x)
        _backward(twin, x)
        compiled_step()
        ref.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
        assert _step_count(opt, p) == steps


@pytest.mark.parametrize("rung", _rungs())
def test_hooks_run_once_per_compiled_step(rung: str) -> None:
    """Global and per-optimizer step hooks run once per step inside compiled code, as
    in eager code."""
    model, _, opt, _ = _pair(rung)
    events: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: events.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: events.append("global post")),
        opt.register_step_pre_hook(lambda o, a, k: events.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: events.append("post")),
    ]
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager")
    def compiled_step() -> None:
        opt.step()

    try:
        x = torch.randn(4, 64)
        for _ in range(2):
            _backward(model, x)
            compiled_step()
    finally:
        for handle in handles:
            handle.remove()
    assert events == ["global pre", "pre", "post", "global post"] * 2


def test_a_compiled_train_step_matches_eager() -> None:
    """Forward, backward, step and ``zero_grad`` in one compiled function: the params
    follow the eager loop's (compiled forward and backward may round differently, so
    within float32 tolerance), every step counts once, and the grads end as None."""
    model, twin, opt, ref = _pair("bf16")
    torch._dynamo.reset()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))

    def train_step(m: torch.nn.Module, o: Any) -> torch.Tensor:
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    compiled: Callable[[torch.nn.Module, Any], torch.Tensor] = torch.compile(
        train_step, backend="aot_eager"
    )
    for _ in range(3):
        compiled(model, opt)
        train_step(twin, ref)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert _step_count(opt, p) == 3
        assert p.grad is None
    assert opt.zero_grad_calls == 3


def test_an_out_of_memory_step_escalates_inside_compiled_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An out-of-memory error in a compiled step's prepare is caught by the optimizer,
    which moves to the next rung and retries, as in eager code: the params equal a twin
    that met the same error eagerly, and the step counts once."""
    model, twin, _, _ = _pair("fp32")
    opt = optladder.AdamW(model.parameters(), lr=1e-2, free_memory="1TiB", environ={})
    ref = optladder.AdamW(twin.parameters(), lr=1e-2, free_memory="1TiB", environ={})
    assert opt.rung == ref.rung == "fp32"
    real = torch.zeros_like
    failures = {"left": 0}

    def zeros_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        if failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros_like", zeros_like)
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager")
    def compiled_step() -> None:
        opt.step()

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    for o, m, step in ((opt, model, compiled_step), (ref, twin, ref.step)):
        _backward(m, x)
        failures["left"] = 1
        step()
        assert o.rung == "bf16" and len(o.escalations) == 1
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
        assert _step_count(opt, p) == 1


def test_run_eagerly_keeps_the_function_and_its_result() -> None:
    """The wrapper returns what the function returns, keeps its name and docstring, and
    inside compiled code runs it as Python (a list append, which a traced graph could not
    hold as a side effect per call)."""
    calls: list[int] = []

    @run_eagerly
    def record(n: int) -> int:
        """Doc."""
        calls.append(n)
        return n + 1

    assert record.__name__ == "record" and record.__doc__ == "Doc."
    assert record(1) == 2
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager")
    def f(t: torch.Tensor) -> torch.Tensor:
        record(len(calls))
        return t * 2

    for _ in range(3):
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [1, 1, 2, 3]


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32])
def test_ladder_adamw_alone_steps_eagerly_inside_compiled_code(moment_dtype: torch.dtype) -> None:
    """``LadderAdamW`` on its own (what ``adopt`` takes) steps inside compiled code as
    eagerly, bit for bit (a traced step failed in TorchDynamo)."""
    from optladder.optimizers.adamw import LadderAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    twin = copy.deepcopy(model)
    opt = LadderAdamW(model.parameters(), lr=1e-2, moment_dtype=moment_dtype)
    ref = LadderAdamW(twin.parameters(), lr=1e-2, moment_dtype=moment_dtype)
    _assert_compiled_steps_equal_eager(model, twin, opt, ref, torch.randn(4, 32), steps=2)


def test_run_eagerly_without_torchdynamo_calls_the_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where ``torch._dynamo`` cannot be imported nothing is compiled: the wrapper calls
    the function itself."""
    import sys

    monkeypatch.setitem(sys.modules, "torch._dynamo", None)  # import raises ImportError

    @run_eagerly
    def double(n: int) -> int:
        return 2 * n

    assert double(21) == 42
