"""The fp32 format keeps its torch kernel calls between steps (``_TorchRoutes``,
``_SteadyPlans`` in :mod:`optladder.optimizers.adamw`): a step reuses the calls and
checks made at the last one while nothing changed. These tests change one thing at a
time between steps (an option, a grad, the groups, the state) and check that params and
state stay bit for bit those of ``torch.optim.AdamW(fused=True)`` stepping the same
sequence (a stale reuse would step with the old value), with grads kept between steps
(``zero_grad(set_to_none=False)``) and new at every step (``set_to_none=True``), on
:class:`LadderAdamW` itself and on the fp32 rung of ``optladder.choose_optimizer``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import optladder
from optladder.optimizers.adamw import LadderAdamW
from snapshots import same_bits

SHAPES = [(5, 7), (13,), (3, 4, 2), (6, 6)]


def _params(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]


def _ladder(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return LadderAdamW(groups, lr=1e-2, moment_dtype=torch.float32)


def _rung(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return optladder.choose_optimizer(groups, lr=1e-2, rung="fp32", free_memory="1TiB", environ={})


class _Pair:
    """Ours and torch's fused AdamW over copies of the same params, stepped alike."""

    def __init__(self, build: Callable[[list[dict[str, Any]]], Any], fresh: bool) -> None:
        self.fresh = fresh
        self.mine = _params(0, SHAPES)
        self.ref = [torch.nn.Parameter(p.detach().clone()) for p in self.mine]
        self.opt = build([{"params": self.mine[:2]}, {"params": self.mine[2:], "lr": 3e-3}])
        self.torch = torch.optim.AdamW(
            [{"params": self.ref[:2]}, {"params": self.ref[2:], "lr": 3e-3}], lr=1e-2, fused=True
        )
        self.skip: set[int] = set()  # params without a grad at the next step

    def both(self, change: Callable[[torch.optim.Optimizer], None]) -> None:
        change(self.opt)
        change(self.torch)

    def grads(self, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 + step)
        for k, (p, q) in enumerate(zip(self.mine, self.ref, strict=True)):
            g = torch.randn(p.shape, generator=gen)
            if k in self.skip:
                p.grad = q.grad = None
            elif self.fresh or p.grad is None:
                p.grad, q.grad = g.clone(), g.clone()
            else:  # the same grad tensors, written in place
                p.grad.copy_(g)
                assert q.grad is not None
                q.grad.copy_(g)

    def step(self, step: int) -> None:
        self.grads(step)
        self.opt.step()
        self.torch.step()
        self.check()

    def check(self) -> None:
        for p, q in zip(self.mine, self.ref, strict=True):
            assert same_bits(p.detach(), q.detach())
            mine, ref = self.opt.state.get(p), self.torch.state.get(q)
            assert bool(mine) == bool(ref)
            if not ref:
                continue
            for name in ("exp_avg", "exp_avg_sq"):
                assert same_bits(mine[name], ref[name]), name
            assert float(mine["step"]) == float(ref["step"])


def _set(key: str, value: Any, group: int = 0) -> Callable[[torch.optim.Optimizer], None]:
    def change(opt: torch.optim.Optimizer) -> None:
        opt.param_groups[group][key] = copy.deepcopy(value)

    return change


CHANGES: dict[str, Callable[[_Pair], None]] = {
    "lr": lambda pair: pair.both(_set("lr", 2e-2)),
    "lr each group": lambda pair: pair.both(_set("lr", 5e-3, 1)),
    "betas": lambda pair: pair.both(_set("betas", (0.8, 0.99))),
    "betas list, changed in place": lambda pair: (
        pair.both(_set("betas", [0.85, 0.995], 1)),
        pair.step(50),
        pair.both(lambda opt: opt.param_groups[1]["betas"].__setitem__(0, 0.7)),
    ),
    "weight_decay": lambda pair: pair.both(_set("weight_decay", 0.1, 1)),
    "eps": lambda pair: pair.both(_set("eps", 1e-3)),
    "a grad None": lambda pair: pair.skip.add(1),
    "a grad None, then back": lambda pair: (pair.skip.add(2), pair.step(50), pair.skip.clear()),
    "add a group": lambda pair: _add_group(pair),
    "load a state dict": lambda pair: _reload(pair),
    "a state tensor replaced by hand": lambda pair: _replace_state(pair),
    "a state dict emptied by hand": lambda pair: _empty_state(pair),
}


def _empty_state(pair: _Pair) -> None:
    """Empty param 1's and param 3's state dicts (the same dict objects): torch's AdamW
    starts a param whose state is empty afresh."""
    for opt, params in ((pair.opt, pair.mine), (pair.torch, pair.ref)):
        opt.state[params[1]].clear()
        opt.state[params[3]].clear()


def _replace_state(pair: _Pair) -> None:
    """Put copies of param 1's moments and param 2's step in their state dicts."""
    for opt, params in ((pair.opt, pair.mine), (pair.torch, pair.ref)):
        st1, st2 = opt.state[params[1]], opt.state[params[2]]
        st1["exp_avg"], st1["exp_avg_sq"] = st1["exp_avg"].clone(), st1["exp_avg_sq"].clone()
        st2["step"] = st2["step"].clone()


def _add_group(pair: _Pair) -> None:
    new = _params(7, [(4, 3), (9,)])
    pair.mine += new
    pair.ref += [torch.nn.Parameter(p.detach().clone()) for p in new]
    pair.opt.add_param_group({"params": new, "lr": 4e-3, "weight_decay": 0.0})
    pair.torch.add_param_group({"params": pair.ref[-2:], "lr": 4e-3, "weight_decay": 0.0})


def _reload(pair: _Pair) -> None:
    """Step twice more, then load the state both had before (new tensors in the state)."""
    mine, ref = copy.deepcopy(pair.opt.state_dict()), copy.deepcopy(pair.torch.state_dict())
    pair.step(51)
    pair.step(52)
    pair.opt.load_state_dict(mine)
    pair.torch.load_state_dict(ref)


BUILDS = {"LadderAdamW": _ladder, "choose_optimizer": _rung}


@pytest.mark.parametrize("fresh", [False, True], ids=["kept grads", "new grads"])
@pytest.mark.parametrize("build", list(BUILDS), ids=list(BUILDS))
@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_change_between_steps_is_stepped_as_torch_fused_adamw(
    change: str, build: str, fresh: bool
) -> None:
    pair = _Pair(BUILDS[build], fresh)
    for step in range(3):  # the calls are kept from the second step on
        pair.step(step)
    CHANGES[change](pair)
    for step in range(3, 6):
        pair.step(step)


@pytest.mark.parametrize("fresh", [False, True], ids=["kept grads", "new grads"])
def test_a_tensor_lr_set_and_changed_in_place_between_steps(fresh: bool) -> None:
    pair = _Pair(_ladder, fresh)
    for step in range(3):
        pair.step(step)
    lrs = [torch.tensor(2e-2), torch.tensor(2e-2)]
    pair.opt.param_groups[0]["lr"], pair.torch.param_groups[0]["lr"] = lrs
    pair.step(3)
    pair.step(4)
    for lr in lrs:
        lr.fill_(7e-3)  # the same tensor, another value
    pair.step(5)
    pair.opt.param_groups[0]["lr"] = pair.torch.param_groups[0]["lr"] = 1e-2  # a float again
    pair.step(6)
    pair.step(7)


@pytest.mark.parametrize("fresh", [False, True], ids=["kept grads", "new grads"])
def test_maximize_set_and_unset_between_steps(fresh: bool) -> None:
    pair = _Pair(_ladder, fresh)  # the optladder rungs refuse maximize; LadderAdamW takes it
    for step in range(3):
        pair.step(step)
    pair.both(_set("maximize", True))
    pair.step(3)
    pair.step(4)
    pair.both(_set("maximize", False))
    pair.step(5)


def _new_layout(g: torch.Tensor) -> torch.Tensor:
    """``g``'s values, transposed in memory (the same shape, other strides)."""
    return torch.empty(g.shape[::-1], dtype=g.dtype).t().copy_(g)


def _as_data(make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.nn.Parameter], None]:
    """Give the param's grad (the same tensor) other memory: ``grad.data = ...``."""

    def change(p: torch.nn.Parameter) -> None:
        assert p.grad is not None
        p.grad.data = make(p.grad.detach())

    return change


def _new_grad(p: torch.nn.Parameter) -> None:
    assert p.grad is not None
    p.grad = _new_layout(p.grad.detach())


BAD_GRADS: dict[str, Callable[[torch.nn.Parameter], None]] = {
    "dtype": _as_data(lambda g: g.double()),
    "shape": _as_data(lambda g: g.reshape(g.shape[1], g.shape[0])),
    "layout": _as_data(_new_layout),
    "layout, a new grad": _new_grad,
}


# LadderAdamW itself compares a new grad's element count with its param's, not its
# shape (as torch's fused kernel); the optladder optimizer checks shapes, of grads that
# are new tensors or the same ones at other addresses (a view of another shape at the
# same address, grad.data = grad.data.view(...), is not checked again)
BAD_CASES = [
    (bad, build, fresh)
    for bad in BAD_GRADS
    for build in BUILDS
    for fresh in (False, True)
    if bad != "shape" or (build, fresh) == ("choose_optimizer", True)
]


@pytest.mark.parametrize(
    ("bad", "build", "fresh"),
    BAD_CASES,
    ids=[f"{a}-{b}-{'new grads' if c else 'kept grads'}" for a, b, c in BAD_CASES],
)
def test_a_grad_changed_between_steps_is_refused_then_steps_on(
    bad: str, build: str, fresh: bool
) -> None:
    pair = _Pair(BUILDS[build], fresh)
    for step in range(3):
        pair.step(step)
    pair.grads(3)
    good = pair.mine[0].grad
    assert good is not None
    values = good.detach().clone()
    before = [p.detach().clone() for p in pair.mine]
    state = copy.deepcopy([pair.opt.state[p] for p in pair.mine])
    BAD_GRADS[bad](pair.mine[0])
    with pytest.raises(ValueError, match="param 0"):
        pair.opt.step()
    assert all(same_bits(p.detach(), b) for p, b in zip(pair.mine, before, strict=True))
    for p, st in zip(pair.mine, state, strict=True):
        for name, value in st.items():
            assert same_bits(pair.opt.state[p][name], value), name
    pair.mine[0].grad = None
    pair.mine[0].grad = values
    pair.opt.step()
    pair.torch.step()
    pair.check()
    pair.step(4)


@pytest.mark.parametrize("backend", ["auto", "eager"])
@pytest.mark.parametrize("rung", ["fp32", "bf16"])
def test_a_state_dict_emptied_by_hand_starts_afresh(rung: str, backend: str) -> None:
    """A param whose state dict is emptied in place (``opt.state[p].clear()``) starts
    afresh at the next step, as torch's AdamW does (its ``len(state) == 0`` test) and as
    a param whose state entry was deleted does: the kept plans must not step it over
    the state that is gone (they raised KeyError)."""

    def run(drop: Callable[[dict[Any, Any], torch.Tensor], None]) -> list[torch.Tensor]:
        ps = _params(0, [(5, 7), (13,), (300,), (6, 6)])
        opt = LadderAdamW(
            [{"params": ps[:2], "rung": rung}, {"params": ps[2:], "rung": rung}],
            lr=1e-2,
            backend=backend,  # type: ignore[arg-type]
        )
        for step in range(5):
            gen = torch.Generator().manual_seed(2000 + step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            if step == 2:
                drop(opt.state, ps[1])
                drop(opt.state, ps[3])
        out = [p.detach().clone() for p in ps]
        for p in ps:
            out += [opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"]]
        return out

    emptied = run(lambda state, p: state[p].clear())
    deleted = run(lambda state, p: state.__delitem__(p))
    for k, (a, b) in enumerate(zip(emptied, deleted, strict=True)):
        assert same_bits(a, b), k
    assert float(emptied[4 + 3 * 1 + 2]) == 2.0  # param 1 restarted after step 3: 2 steps
