"""The fp32 and bf16 rungs are two state formats of one engine (issue 9's first slice):
one :class:`LadderAdamW` holds the groups of both, a group pinning one while the others
follow the other is a group of that engine, and a move fp32 -> bf16 converts the state
of the groups that follow the decision in place, building nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from optladder import choose_optimizer
from optladder.optimizers.adamw import LadderAdamW


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 80), nn.Linear(80, 8))
    model[2].to(torch.bfloat16)  # a bfloat16 layer beside float32 ones
    return model


def _groups(model: nn.Module, pin: str | None) -> list[dict[str, Any]]:
    first: dict[str, Any] = {"params": list(model[0].parameters())}
    if pin is not None:
        first["rung"] = pin
    return [first, {"params": [*model[1].parameters(), *model[2].parameters()]}]


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


CASES = [("fp32", None), ("bf16", None), ("fp32", "bf16"), ("bf16", "fp32")]


@pytest.mark.parametrize(("rung", "pin"), CASES, ids=["fp32", "bf16", "fp32+bf16", "bf16+fp32"])
def test_global_step_hooks_run_once_per_step(rung: str, pin: str | None) -> None:
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model = _model()
    opt = choose_optimizer(_groups(model, pin), rung=rung, free_memory="1GiB")
    calls: list[tuple[str, Any]] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", o))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", o))),
    ]
    try:
        for s in range(3):
            _grads(model, s)
            opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [("pre", opt), ("post", opt)] * 3


@pytest.mark.parametrize(("rung", "pin"), [*CASES, ("8bit", None), ("fp32", "8bit")])
def test_the_optimizer_is_one_torch_optimizer_initialised_once(
    rung: str, pin: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``optladder.AdamW`` is one ``torch.optim.Optimizer``: torch's ``__init__`` runs
    once per optimizer built (not once for a facade and once for an engine), and the
    object owns its groups, defaults and state (``engine`` is the optimizer itself)."""
    calls: list[object] = []
    init = torch.optim.Optimizer.__init__

    def counted(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", counted)
    model = _model8() if "8bit" in (rung, pin) else _model()
    opt = choose_optimizer(_groups(model, pin), rung=rung, free_memory="1GiB")
    assert calls == [opt]
    assert opt.engine is opt and isinstance(opt, LadderAdamW)
    assert all(p is opt for p in opt.pinned_engines.values())
    _grads(model, 0)
    opt.step()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert calls == [opt]  # nothing built by a step or a new group either
    assert len(opt.state) == len(list(model.parameters()))


@pytest.mark.parametrize(("rung", "pin"), CASES, ids=["fp32", "bf16", "fp32+bf16", "bf16+fp32"])
def test_the_fp32_and_bf16_groups_share_one_engine(rung: str, pin: str | None) -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, pin), rung=rung, free_memory="1GiB")
    assert isinstance(opt, LadderAdamW) and opt.engine is opt  # no engine of its own
    if pin is not None:
        assert opt.pinned_engines[pin] is opt  # nor one per pinned rung
    _grads(model, 0)
    opt.step()
    moments = {"fp32": torch.float32, "bf16": torch.bfloat16}
    want = [moments[pin or rung], moments[rung]]
    for group, dtype in zip(opt.param_groups, want, strict=True):
        for p in group["params"]:
            assert opt.state[p]["exp_avg"].dtype == dtype


@pytest.mark.parametrize("pin", [None, "fp32"], ids=["no-pin", "fp32-pin"])
def test_defaults_do_not_change_across_a_move_from_fp32_to_bf16(pin: str | None) -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, pin), rung=None, free_memory="1GiB", environ={})
    assert opt.rung == "fp32"
    before = copy.deepcopy(opt.defaults)
    _grads(model, 0)
    opt.step()
    opt.escalate("test")
    assert opt.rung == "bf16"
    assert opt.defaults == before


@pytest.mark.parametrize("pin", [None, "fp32"], ids=["no-pin", "fp32-pin"])
def test_escalating_fp32_to_bf16_converts_in_place_as_a_fresh_bf16_load(pin: str | None) -> None:
    """The move builds no engine (the same object before and after) and gives, bit for
    bit, the state (and the next steps) of a fresh bf16 optimizer that loads the fp32
    checkpoint; a pinned fp32 group's state is untouched."""
    model, fresh_model = _model(), _model()
    opt = choose_optimizer(_groups(model, pin), rung=None, free_memory="1GiB", environ={})
    for s in range(3):
        _grads(model, s)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    pinned_before = {
        id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model[0].parameters()
    }
    engine = opt.engine
    opt.escalate("test")
    assert opt.engine is engine and opt.rung == "bf16"
    assert [g["rung"] for g in opt.param_groups] == [pin or "bf16", "bf16"]
    fresh = choose_optimizer(_groups(fresh_model, pin), rung="bf16", free_memory="1GiB")
    with torch.no_grad():
        for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True):
            a.copy_(b)
    fresh.load_state_dict(saved)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        sa, sb = opt.state[a], fresh.state[b]
        for name in ("exp_avg", "exp_avg_sq"):
            assert sa[name].dtype == sb[name].dtype
            assert torch.equal(_bits(sa[name]), _bits(sb[name])), name
        assert float(sa["step"]) == float(sb["step"]) == 3
    if pin is not None:  # the pinned group stays on fp32, its state as it was
        for p in model[0].parameters():
            for k, v in pinned_before[id(p)].items():
                assert torch.equal(opt.state[p][k], v)
    for s in range(3, 5):
        _grads(model, s)
        _grads(fresh_model, s)
        opt.step()
        fresh.step()
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(opt.state[a][name]), _bits(fresh.state[b][name]))


def test_one_checkpoint_layout_with_and_without_a_pin() -> None:
    """A pinned fp32 group saves as the same group following an fp32 decision does:
    the same state keys, dtypes and values, and the same group keys but those that say
    how the rung was reached."""
    runs = []
    for pin in (None, "fp32"):
        model = _model()
        opt = choose_optimizer(_groups(model, pin), rung="fp32", free_memory="1GiB")
        for s in range(2):
            _grads(model, s)
            opt.step()
        runs.append(opt.state_dict())
    plain, pinned = runs
    assert plain["state"].keys() == pinned["state"].keys()
    for k, st in plain["state"].items():
        assert st.keys() == pinned["state"][k].keys()
        for name, value in st.items():
            other = pinned["state"][k][name]
            assert value.dtype == other.dtype and torch.equal(value, other), (k, name)
    for a, b in zip(plain["param_groups"], pinned["param_groups"], strict=True):
        ignore = {"rung_origin", "rung_reason"}
        assert {k: v for k, v in a.items() if k not in ignore} == {
            k: v for k, v in b.items() if k not in ignore
        }


def test_a_param_converted_to_bfloat16_after_its_fp32_state_steps_on_with_float32_moments() -> None:
    """``module.to(torch.bfloat16)`` after the fp32 rung made float32 state: the fp32
    format keeps float32 moments for bfloat16 params, so the state fits and the next
    step is the oracle's (torch's AdamW, the engine before, kept moments in the param's
    dtype and refused it)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16)
    opt = choose_optimizer(model, lr=1e-2, rung="fp32", free_memory="64GiB", environ={})
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    model.to(torch.bfloat16)
    oracle = LadderAdamW(
        [{"params": [nn.Parameter(p.detach().clone()) for p in model.parameters()]}],
        lr=1e-2,
        moment_dtype=torch.float32,
    )
    for p, q in zip(model.parameters(), oracle.param_groups[0]["params"], strict=True):
        oracle.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
    _grads(model, 7)
    opt.step()
    with torch.no_grad():
        for i, (p, q) in enumerate(
            zip(model.parameters(), oracle.param_groups[0]["params"], strict=True)
        ):
            q.grad = p.grad.clone()
            oracle._step_param(q, oracle.param_groups[0], i)
    for p, q in zip(model.parameters(), oracle.param_groups[0]["params"], strict=True):
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(_bits(p), _bits(q))
        assert torch.equal(opt.state[p]["exp_avg"], oracle.state[q]["exp_avg"])


def test_the_fused_config_follows_the_groups_format_across_a_move() -> None:
    from optladder.optimizers.spec import to_fused_config

    model = _model()
    opt = choose_optimizer(_groups(model, None), free_memory="1GiB", environ={})
    assert opt.rung == "fp32"
    config, _ = to_fused_config(opt)
    assert config is not None and not config.use_bf16_moments
    opt.escalate("test")  # the same engine, its groups now in the bf16 format
    config, _ = to_fused_config(opt)
    assert config is not None and config.use_bf16_moments


# The 8bit rung is the third state format of the same engine (issue 9's next slice).


def _model8() -> nn.Module:
    """A model with a param of 5,120 elements (8-bit codes on the 8bit rung) beside
    small ones (float32 state there) and a bfloat16 layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 320), nn.Linear(320, 8))
    model[2].to(torch.bfloat16)
    return model


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
            )
        )
    return bool(a == b) and type(a) is type(b)


CASES_8BIT = [
    ("8bit", None),
    ("fp32", "8bit"),
    ("8bit", "fp32"),
    ("bf16", "8bit"),
    ("8bit", "bf16"),
]
IDS_8BIT = ["8bit", "fp32+8bit", "8bit+fp32", "bf16+8bit", "8bit+bf16"]


@pytest.mark.parametrize(("rung", "pin"), CASES_8BIT, ids=IDS_8BIT)
def test_global_step_hooks_run_once_per_step_on_8bit(rung: str, pin: str | None) -> None:
    test_global_step_hooks_run_once_per_step(rung, pin)


@pytest.mark.parametrize(("rung", "pin"), CASES_8BIT, ids=IDS_8BIT)
def test_an_8bit_group_is_a_group_of_the_one_engine(rung: str, pin: str | None) -> None:
    model = _model8()
    opt = choose_optimizer(_groups(model, pin), rung=rung, free_memory="1GiB")
    assert isinstance(opt, LadderAdamW) and opt.engine is opt  # no engine of its own
    if pin is not None:
        assert opt.pinned_engines[pin] is opt  # nor one per pinned rung
    _grads(model, 0)
    opt.step()
    for group, on in zip(opt.param_groups, [pin or rung, rung], strict=True):
        assert group["rung"] == on
        for p in group["params"]:
            st = opt.state[p]
            if on != "8bit":
                assert "exp_avg" in st and "state1" not in st
                continue
            assert isinstance(st["step"], int) and st["step"] == 1
            want = torch.uint8 if p.numel() >= 4096 else torch.float32
            assert st["state1"].dtype == st["state2"].dtype == want


@pytest.mark.parametrize("pin", [None, "fp32"], ids=["no-pin", "fp32-pin"])
def test_defaults_do_not_change_across_fp32_bf16_and_8bit(pin: str | None) -> None:
    model = _model8()
    opt = choose_optimizer(_groups(model, pin), rung=None, free_memory="1GiB", environ={})
    assert opt.rung == "fp32"
    before = copy.deepcopy(opt.defaults)
    engine_defaults = copy.deepcopy(opt.engine.defaults)
    engine = opt.engine
    for s, rung in enumerate(("bf16", "8bit")):
        _grads(model, s)
        opt.step()
        opt.escalate("test")
        assert opt.rung == rung and opt.engine is engine
        assert opt.defaults == before
        assert opt.engine.defaults == engine_defaults


@pytest.mark.parametrize(
    ("source", "pin"),
    [("fp32", None), ("bf16", None), ("fp32", "fp32"), ("bf16", "bf16")],
    ids=["fp32", "bf16", "fp32-pin", "bf16-pin"],
)
def test_a_move_to_8bit_converts_in_place_as_a_fresh_8bit_load(
    source: str, pin: str | None
) -> None:
    """fp32 -> 8bit and bf16 -> 8bit keep the engine object and give, bit for bit, the
    state (and the next two steps) of a fresh 8bit optimizer that loads the source
    checkpoint; a pinned group's state is untouched."""
    model, fresh_model = _model8(), _model8()
    opt = choose_optimizer(_groups(model, pin), rung=source, free_memory="1GiB")
    for s in range(3):
        _grads(model, s)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    pinned_before = copy.deepcopy({id(p): dict(opt.state[p]) for p in model[0].parameters()})
    engine = opt.engine
    opt.migrate_to("8bit", "test", force=True)
    assert opt.engine is engine and opt.rung == "8bit"
    assert [g["rung"] for g in opt.param_groups] == [pin or "8bit", "8bit"]
    fresh = choose_optimizer(_groups(fresh_model, pin), rung="8bit", free_memory="1GiB")
    with torch.no_grad():
        for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True):
            a.copy_(b)
    fresh.load_state_dict(saved)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        sa, sb = opt.state[a], fresh.state[b]
        assert sa.keys() == sb.keys()
        for name in sa:
            assert _bitwise_equal(sa[name], sb[name]), name
    if pin is not None:  # the pinned group stays on its rung, its state as it was
        for p in model[0].parameters():
            for k, v in pinned_before[id(p)].items():
                assert _bitwise_equal(opt.state[p][k], v), k
    for s in range(3, 5):
        _grads(model, s)
        _grads(fresh_model, s)
        opt.step()
        fresh.step()
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert _bitwise_equal(a, b)
        for name in opt.state[a]:
            assert _bitwise_equal(opt.state[a][name], fresh.state[b][name]), name
    assert opt.state_dict()["state"].keys() == fresh.state_dict()["state"].keys()


@pytest.mark.parametrize(
    ("rung", "pin"),
    [*CASES, *CASES_8BIT],
    ids=["fp32", "bf16", "fp32+bf16", "bf16+fp32", *IDS_8BIT],
)
def test_checkpoint_hooks_run_once_per_call_and_see_the_one_layout(
    rung: str, pin: str | None
) -> None:
    """``state_dict``/``load_state_dict`` pre and post hooks run once per call, in
    torch's order, on every rung with and without a pin; a state-dict post hook sees the
    checkpoint layout (8bit state wrapped as bitsandbytes' ``state_dict`` wraps it, as
    before: the wrapping is the optimizer's own, not a hook of its), and what a
    load pre hook returns is what loads."""
    model = _model8()
    opt = choose_optimizer(_groups(model, pin), rung=rung, free_memory="1GiB")
    _grads(model, 0)
    opt.step()
    calls: list[str] = []
    seen: list[dict[str, Any]] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: (calls.append("save post"), seen.append(sd))[0])
    opt.register_load_state_dict_pre_hook(lambda o, sd: (calls.append("load pre"), sd)[1])
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    saved = opt.state_dict()
    assert calls == ["save pre", "save post"] and seen == [saved]
    on = [pin or rung, rung]
    for gi, group in enumerate(saved["param_groups"]):
        assert group["rung"] == on[gi]
        for key in group["params"]:
            st = saved["state"][key]
            if on[gi] == "8bit":
                assert set(st) == {"step", "__bnb_optimizer_quant_state__"}
            else:
                assert {"step", "exp_avg", "exp_avg_sq"} == set(st)
    calls.clear()
    opt.load_state_dict(copy.deepcopy(saved))
    assert calls == ["load pre", "load post"]
    assert _nested_equal(opt.state_dict()["state"], saved["state"])


def _nested_equal(a: Any, b: Any) -> bool:
    """:func:`_bitwise_equal` through dicts (a saved state: param -> key -> tensor)."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_nested_equal(a[k], b[k]) for k in a)
        )
    return _bitwise_equal(a, b)
