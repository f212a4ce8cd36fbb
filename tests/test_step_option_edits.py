"""Group options are checked before every step when they changed (README: "a group dict
edited by hand"); the step memo compares them with a snapshot. An option that changes
in place (a betas list) must not compare equal to its own snapshot: the out-of-range
value is refused before any write."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optladder import choose_optimizer


def _opt(rung: str, **kwargs: Any) -> tuple[Any, list[Any]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(2)]
    opt = choose_optimizer(params, lr=1e-2, rung=rung, free_memory="1GiB", environ={}, **kwargs)
    return opt, params


def _grads(params: list[Any], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


class _ConfigList(list):  # type: ignore[type-arg]
    """A list subclass, as YAML config loaders make (ruamel's ``CommentedSeq``)."""


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("kind", [list, _ConfigList], ids=["list", "list-subclass"])
def test_betas_changed_in_place_are_checked_again(rung: str, kind: type) -> None:
    opt, params = _opt(rung)
    opt.param_groups[0]["betas"] = kind([0.9, 0.999])  # by hand: checked at the next step
    _grads(params, 0)
    opt.step()
    opt.param_groups[0]["betas"][0] = 1.5  # in place: the list checked at the last step
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match="beta"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_a_group_switched_to_the_other_weight_decay_mode_is_refused(
    rung: str, decoupled: bool
) -> None:
    """One mode per optimizer (README): construction, ``add_param_group`` and loads refuse
    a group of the other mode, and the step checks every group's
    ``decoupled_weight_decay`` before writing. A group switched by hand would otherwise
    decay the other way on fp32/bf16 (8bit keeps its engine's mode) and save a
    checkpoint this optimizer refuses to load."""
    opt, params = _opt(rung, weight_decay=0.1, decoupled_weight_decay=decoupled)
    _grads(params, 0)
    opt.step()
    opt.param_groups[0]["decoupled_weight_decay"] = not decoupled
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    opt.param_groups[0]["decoupled_weight_decay"] = decoupled  # put back: steps again
    opt.step()
    assert not torch.equal(params[0], before[0])


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("key", ["lr", "betas", "eps", "weight_decay"])
def test_a_hyperparameter_deleted_from_a_group_is_refused_before_any_write(
    rung: str, key: str
) -> None:
    """``del group[key]`` after construction: torch's own fp32 step wrote the first
    group's params, then failed on the second (a PartialStepError); the step is refused
    before any write, naming the group and the key, and runs once the key is back."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(2)]
    opt = choose_optimizer(
        [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.5}],
        lr=1e-2,
        rung=rung,
        free_memory="1GiB",
        environ={},
    )
    _grads(params, 0)
    opt.step()
    value = opt.param_groups[1].pop(key)
    before = [p.detach().clone() for p in params]
    steps = [float(opt.state[p]["step"]) for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match=rf"param group 1: the key '{key}' is missing"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == steps == [1.0, 1.0]
    opt.param_groups[1][key] = value
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [2.0, 2.0]
