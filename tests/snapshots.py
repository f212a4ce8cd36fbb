"""Test tools that snapshot an optimizer and compare snapshots bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch


def snapshot(opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Copies of the optimizer's params (in group order) and of its ``state_dict()``."""
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return params, copy.deepcopy(opt.state_dict())


def assert_same(
    a: tuple[list[torch.Tensor], dict[str, Any]], b: tuple[list[torch.Tensor], dict[str, Any]]
) -> None:
    """Assert two :func:`snapshot` results equal: params bitwise, param groups equal,
    every state value equal (tensors bitwise and of the same dtype; bitsandbytes' wrapped
    per-param state compared entry by entry)."""
    params_a, sd_a = a
    params_b, sd_b = b
    for x, y in zip(params_a, params_b, strict=True):
        assert torch.equal(x, y)
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k in sd_a["state"]:
        flat_a = flat_state(sd_a["state"][k])
        flat_b = flat_state(sd_b["state"][k])
        assert flat_a.keys() == flat_b.keys()
        for name in flat_a:
            va, vb = flat_a[name], flat_b[name]
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and torch.equal(va, vb), name
            else:
                assert va == vb, name


def assert_load_refused(opt: torch.optim.Optimizer, state_dict: dict[str, Any], match: str) -> None:
    """Assert ``opt.load_state_dict(state_dict)`` raises a ``ValueError`` matching
    ``match`` (a regex) and leaves ``opt`` and its params exactly as before (bitwise,
    :func:`assert_same` of :func:`snapshot` before and after)."""
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state_dict)
    assert_same(snapshot(opt), before)


def flat_state(state: dict[str, Any]) -> dict[str, Any]:
    """One param's state with nested dicts (bitsandbytes' wrapped state) merged in."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(v)
        else:
            out[k] = v
    return out


def assert_failed_steps_change_nothing(
    prepared: Callable[[], torch.optim.Optimizer],
    allocations: int,
    expected: tuple[list[torch.Tensor], dict[str, Any]],
) -> None:
    """For every ``k`` in ``1..allocations``: an optimizer from ``prepared()`` (grads set,
    one step to go, its rung fixed so an OOM is re-raised) whose step fails at the
    ``k``-th allocation raises ``OptimizerOutOfMemoryError`` and changes nothing, and its
    next step gives ``expected`` (a :func:`snapshot` of an optimizer that never failed)."""
    from memtools import FailNthAllocation
    from optladder import OptimizerOutOfMemoryError

    for k in range(1, allocations + 1):
        opt = prepared()
        before = snapshot(opt)
        with pytest.raises(OptimizerOutOfMemoryError, match="fixed"), FailNthAllocation(k):
            opt.step()
        assert_same(snapshot(opt), before)
        opt.step()
        assert_same(snapshot(opt), expected)


def assert_steps_as_torch(
    opt: torch.optim.Optimizer,
    ours: list[torch.Tensor],
    reference: torch.optim.Optimizer,
    ref: list[torch.Tensor],
) -> None:
    """Assert that ``opt``'s params ``ours`` and their state equal, bit for bit, those of
    a torch AdamW ``reference`` over its params ``ref`` (the same params, stepped side by
    side): the same state keys (none for a param neither has stepped), every tensor
    equal, ``step`` by value (optladder's is float64), naming the first param that
    differs."""
    for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(p, q), f"param {i}"
        a, b = opt.state.get(p, {}), reference.state.get(q, {})
        assert a.keys() == b.keys(), f"param {i}"
        for key in a:
            if key == "step":
                assert float(a[key]) == float(b[key]), f"param {i}"
            else:
                assert torch.equal(a[key], b[key]), f"param {i} {key}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits: dtype, shape and values (complex
    tensors compared as their real views, so a NaN part compares by torch.equal's rule)."""
    a, b = a.detach(), b.detach()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
