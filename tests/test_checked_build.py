"""Engines built over checked groups (torch's per-param checks over first params only)
hold every param, the same group keys, and step the same as engines torch checked."""

from __future__ import annotations

import pytest
import torch

from engines import build_engine
from optladder.optimizers.checked import first_params_only
from optladder.rungs import RUNGS


def _groups(seed: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (3, 5000, 7, 300)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}, {"params": []}]


@pytest.mark.parametrize("rung", RUNGS)
def test_checked_build_holds_every_param_and_steps_as_the_torch_checked_one(rung: str) -> None:
    if rung == "8bit":
        pytest.importorskip("bitsandbytes")
    checked, plain = _groups(0), _groups(0)
    lists = [g["params"] for g in checked]
    a = build_engine(rung, checked, fused=rung != "8bit", checked=True)  # type: ignore[arg-type]
    b = build_engine(rung, plain, fused=rung != "8bit")  # type: ignore[arg-type]
    assert [g["params"] for g in a.param_groups] == lists
    assert all(g["params"] is full for g, full in zip(a.param_groups, lists))
    for ga, gb in zip(a.param_groups, b.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == {
            k: v for k, v in gb.items() if k != "params"
        }
    a.step()
    b.step()
    for ga, gb in zip(a.param_groups, b.param_groups):
        for pa, pb in zip(ga["params"], gb["params"]):
            assert torch.equal(pa, pb)


def test_first_params_only_gives_the_lists_back_after_an_error() -> None:
    groups = _groups(1)
    lists = [g["params"] for g in groups]
    with pytest.raises(RuntimeError, match="boom"), first_params_only(groups):  # type: ignore[arg-type]
        assert [len(g["params"]) for g in groups] == [1, 1, 0]
        raise RuntimeError("boom")
    assert all(g["params"] is full for g, full in zip(groups, lists))


def test_a_checked_bf16_build_still_refuses_a_dtype_past_the_first_param() -> None:
    params = [
        torch.nn.Parameter(torch.zeros(2)),
        torch.nn.Parameter(torch.zeros(2, dtype=torch.cfloat)),
    ]
    with pytest.raises(ValueError, match=r"param 1 of the new group is complex"):
        build_engine("bf16", [{"params": params}], fused=True, checked=True)
