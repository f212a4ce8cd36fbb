"""optladder.AdamW as a torch.optim class: torch's arguments and order, named params,
torch's flags, fixed defaults, repr, and step hooks once per step on every rung."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import optladder
from optladder import AdamW, LadderOptimizer, choose_optimizer

FREE = "1GiB"  # the policy picks fp32 for these small models


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("optladder").setLevel(logging.ERROR)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 80), torch.nn.LayerNorm(80))


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def test_adamw_is_the_class_choose_optimizer_returns() -> None:
    opt = choose_optimizer(_model(), free_memory=FREE)
    assert type(opt) is AdamW and optladder.AdamW is AdamW
    assert isinstance(opt, LadderOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert opt.rung == "fp32" and opt.decision.rung == "fp32"


def test_positional_arguments_in_torchs_order() -> None:
    model = _model()
    opt = AdamW(model.parameters(), 3e-3, (0.8, 0.95), 1e-6, 0.2, free_memory=FREE)
    ref = torch.optim.AdamW(model.parameters(), 3e-3, (0.8, 0.95), 1e-6, 0.2)
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert opt.param_groups[0][key] == ref.param_groups[0][key] == opt.defaults[key]
    assert choose_optimizer(_model(), 1e-4, free_memory=FREE).param_groups[0]["lr"] == 1e-4


def test_named_parameters_step_and_save_as_torch_does() -> None:
    """``named_parameters()`` and named groups: the names land in ``param_names`` as in
    torch 2.13's AdamW, and the steps are torch's fused AdamW's, bit for bit."""
    model, ref_model = _model(), _model()
    opt = AdamW(model.named_parameters(), 1e-2, free_memory=FREE)
    ref = torch.optim.AdamW(ref_model.named_parameters(), 1e-2, fused=True)
    for seed in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            _backward(m, seed)
            o.step()
    names = [n for n, _ in model.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    assert opt.state_dict()["param_groups"][0]["param_names"] == names
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)

    named_groups = [
        {"params": list(model[0].named_parameters()), "weight_decay": 0.0},
        {"params": list(model[1].named_parameters())},
    ]
    grouped = AdamW(named_groups, free_memory=FREE)
    assert [g["param_names"] for g in grouped.param_groups] == [
        ["weight", "bias"],
        ["weight", "bias"],
    ]
    mixed = [("w", model[0].weight), model[0].bias]
    with pytest.raises(ValueError, match="name all of them or none"):
        AdamW(mixed, free_memory=FREE)
    with pytest.raises(ValueError, match="named params in every group or in none"):
        grouped.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    extra = torch.nn.Parameter(torch.zeros(3))
    grouped.add_param_group({"params": [("extra", extra)]})
    assert grouped.param_groups[-1]["param_names"] == ["extra"]
    assert grouped.param_groups[-1]["params"][0] is extra


@pytest.mark.parametrize(
    ("flag", "value", "instead"),
    [
        ("amsgrad", True, "torch.optim.AdamW(amsgrad=True)"),
        ("maximize", True, "loss = -objective"),
        ("capturable", True, "CUDA graph"),
        ("differentiable", True, "without autograd"),
        ("foreach", True, "picks each rung's kernel itself"),
        ("foreach", False, "picks each rung's kernel itself"),
        ("fused", False, "fused=True to require the fused path"),
    ],
)
def test_torch_flags_get_a_message_naming_them(flag: str, value: bool, instead: str) -> None:
    with pytest.raises(ValueError, match=rf"^{flag}={value} is not supported") as info:
        AdamW(_model().parameters(), free_memory=FREE, **{flag: value})
    assert instead in str(info.value)


def test_torch_flags_at_their_torch_defaults_are_accepted() -> None:
    torch_defaults = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    flags = {k: torch_defaults[k] for k in ("amsgrad", "maximize", "foreach", "capturable")}
    flags |= {k: torch_defaults[k] for k in ("differentiable", "fused")}
    opt = AdamW(_model().parameters(), free_memory=FREE, **flags)
    assert {k: opt.defaults[k] for k in flags} == flags


def test_fused_true_requires_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    opt = AdamW(_model().parameters(), free_memory=FREE, fused=True)
    assert opt.decision.fused and opt.defaults["fused"] is True
    # without a C compiler the 8bit rung on the CPU runs bitsandbytes' unfused fallback:
    # torch raises for an unfused device, and so does this
    monkeypatch.setenv("CC", "no-such-compiler-for-optladder")
    with pytest.raises(ValueError, match="fused=True, but the 8bit rung is not fused here: "):
        AdamW(_model().parameters(), free_memory=FREE, rung="8bit", fused=True)
    with pytest.raises(TypeError, match="fused must be True, False or None, got 'yes'"):
        AdamW(_model().parameters(), free_memory=FREE, fused="yes")  # type: ignore[arg-type]


def test_repr_shows_every_groups_hyperparameters_like_torch() -> None:
    """Every ``key: value`` line of torch's repr for the same groups is in ours, plus the
    rung; the header names the rung."""
    model = _model()
    groups = [
        {"params": [model[0].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0, "lr": 5e-4},
    ]
    opt = AdamW(groups, 1e-3, free_memory=FREE)
    ref = torch.optim.AdamW(groups, 1e-3, fused=True)
    ours = repr(opt).splitlines()
    assert ours[0] == "AdamW (rung='fp32', fused"
    for line in repr(ref).splitlines()[1:]:
        assert line in ours, line
    assert ours.count("    rung: fp32") == 2
    assert "    lr: 0.0005" in ours and "    weight_decay: 0.1" in ours


def test_defaults_fixed_across_escalations() -> None:
    opt = AdamW(_model().parameters(), 2e-3, free_memory=FREE, decoupled_weight_decay=False, seed=7)
    expected = {
        "lr": 2e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": False,
        "seed": 7,
        "rounding": "stochastic",
        "param_rounding": "stochastic",
    }
    assert opt.defaults == expected
    for rung in ("bf16", "8bit"):
        opt.escalate("test")
        assert opt.rung == rung
        assert opt.defaults == expected


@pytest.mark.parametrize("pin", [None, "fp32", "8bit"])
@pytest.mark.parametrize("escalated", [False, True])
def test_add_param_group_fills_defaults_edited_by_hand_as_torch_does(
    pin: str | None, escalated: bool
) -> None:
    """torch's ``add_param_group`` fills a group's missing values from ``opt.defaults``
    as they are now: ``opt.defaults["weight_decay"] = 0.5`` gave groups added later 0.5
    in torch, and the construction's 0.01 here (the engines filled their own)."""
    model = _model()
    opt = AdamW(model.parameters(), 2e-3, free_memory=FREE)
    ref = torch.optim.AdamW(_model().parameters(), 2e-3)
    for o in (opt, ref):
        o.defaults["weight_decay"] = 0.5
        o.defaults["betas"] = (0.8, 0.9)
    if escalated:
        opt.escalate("test")
    extra = {"params": [torch.nn.Parameter(torch.ones(3))], "lr": 1e-3}
    if pin is not None:
        extra["rung"] = pin
    opt.add_param_group(dict(extra))
    ref.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "lr": 1e-3})
    ours, theirs = opt.param_groups[-1], ref.param_groups[-1]
    assert (ours["weight_decay"], ours["betas"], ours["lr"]) == (0.5, (0.8, 0.9), 1e-3)
    assert (theirs["weight_decay"], theirs["betas"], theirs["lr"]) == (0.5, (0.8, 0.9), 1e-3)
    assert opt.param_groups[0]["weight_decay"] == 0.01  # groups already there keep theirs
    opt.defaults["amsgrad"] = True  # refused by the group checks, as if passed
    with pytest.raises(ValueError, match=r"amsgrad=True is not supported"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})


def test_adam_mode_add_param_group_after_escalation_steps_like_torch_adam() -> None:
    """Adam mode (coupled decay) on the 8bit rung: a group added with
    ``decoupled_weight_decay=False`` is accepted and steps as ``torch.optim.Adam`` does
    (bitsandbytes keeps 32-bit state under 4,096 elements, so the moments are exact)."""
    model = _model()
    adam = AdamW(
        model.parameters(), 1e-2, weight_decay=0.1, free_memory=FREE, decoupled_weight_decay=False
    )
    adam.escalate("test")
    adam.escalate("test")
    assert adam.rung == "8bit"
    torch.manual_seed(1)
    extra = torch.nn.Parameter(torch.randn(300))
    ref_param = torch.nn.Parameter(extra.detach().clone())
    ref_param0 = extra.detach().clone()
    adam.add_param_group({"params": [extra], "decoupled_weight_decay": False})
    with pytest.raises(ValueError, match="decoupled_weight_decay=True"):
        adam.add_param_group(
            {"params": [torch.nn.Parameter(torch.ones(2))], "decoupled_weight_decay": True}
        )
    ref = torch.optim.Adam([ref_param], 1e-2, weight_decay=0.1)
    for seed in range(3):
        grad = torch.randn(300, generator=torch.Generator().manual_seed(seed))
        adam.zero_grad()
        extra.grad = grad.clone()
        ref_param.grad = grad.clone()
        adam.step()
        ref.step()
    torch.testing.assert_close(extra, ref_param, rtol=1e-6, atol=1e-7)
    assert not torch.equal(extra.detach(), ref_param0)  # it did move


def _build(rung: str) -> tuple[torch.nn.Module, AdamW]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 4))
    if rung == "pinned":
        groups = [
            {"params": list(model[0].parameters())},
            {"params": list(model[1].parameters()), "rung": "8bit"},
        ]
        return model, AdamW(groups, free_memory=FREE)
    return model, AdamW(model.parameters(), rung=rung, free_memory=FREE)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit", "pinned", "escalated"])
def test_step_hooks_run_once_per_step_in_torchs_order(rung: str) -> None:
    """Global and per-optimizer step hooks: pre (global, then own), step, post (own,
    then global), each once per ``step()`` and with this optimizer, on every rung, with a
    pinned group, and across an escalation inside ``step()``."""
    model, opt = _build("fp32" if rung == "escalated" else rung)
    if rung == "escalated":
        opt = AdamW(model.parameters(), free_memory=FREE)
    events: list[tuple[str, object]] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: events.append(("global pre", o))),
        register_optimizer_step_post_hook(lambda o, a, k: events.append(("global post", o))),
        opt.register_step_pre_hook(lambda o, a, k: events.append(("pre", o))),
        opt.register_step_post_hook(lambda o, a, k: events.append(("post", o))),
    ]
    try:
        for seed in range(3):
            opt.zero_grad()
            model(
                torch.randn(2, 64, generator=torch.Generator().manual_seed(seed))
            ).sum().backward()
            if rung == "escalated" and seed == 1:
                opt.escalate("test")  # moves the engine; hooks stay the optimizer's
            opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert [name for name, _ in events] == ["global pre", "pre", "post", "global post"] * 3
    assert all(o is opt for _, o in events)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit", "pinned", "escalated"])
def test_construction_runs_no_global_step_hook(rung: str) -> None:
    """Building the optimizer (its capability probe runs a fused AdamW step of its own,
    once more for a pinned group's engine) fires no global step hook: a hook that counts
    optimizer steps (a profiler, a step logger) sees the run's steps only, one pair per
    ``step()``."""
    events: list[tuple[str, object]] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: events.append(("global pre", o))),
        register_optimizer_step_post_hook(lambda o, a, k: events.append(("global post", o))),
    ]
    try:
        model, opt = _build("fp32" if rung == "escalated" else rung)
        if rung == "escalated":
            opt = AdamW(model.parameters(), free_memory=FREE)
            opt.escalate("test")
        optladder.optimizers.probe_capabilities("cpu")
        assert events == []
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert events == [("global pre", opt), ("global post", opt)]


def test_signature_matches_torch_adamw_for_frameworks_that_build_by_name() -> None:
    """Hydra (``_target_: optladder.AdamW`` with ``params=`` as a keyword), LightningCLI and
    HF's ``optimizer_cls_and_kwargs`` build the class by name with torch's argument names:
    the positional ones, their order and defaults are torch.optim.AdamW's, and every
    torch keyword is accepted."""
    import inspect
    import pydoc

    ours = inspect.signature(AdamW).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    for name, param in theirs.items():
        assert name in ours, name
        if name != "params":
            assert ours[name].default == param.default, name
    cls = pydoc.locate("optladder.AdamW")
    assert cls is AdamW
    model = _model()
    opt = cls(params=model.parameters(), lr=2e-3, weight_decay=0.0, free_memory=FREE)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]) == (2e-3, 0.0)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_construction_checks_the_hyperparameters_once(
    rung: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Construction's fixed cost (issue 9, "Host cost"): ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are checked once, where ``AdamW`` names its arguments, not again
    when the optimizer sets itself up over the groups (each group's own values are
    checked per group, as before); a bad value is still refused, naming it."""
    from optladder.optimizers import adamw as adamw_module
    from optladder.selector import choose as choose_module

    calls: list[object] = []
    real = adamw_module.validate_hyperparams

    def counted(*args: object) -> None:
        calls.append(args)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(adamw_module, "validate_hyperparams", counted)
    monkeypatch.setattr(choose_module, "validate_hyperparams", counted)
    AdamW(_model().parameters(), 2e-3, free_memory=FREE, rung=rung)
    assert calls.count((2e-3, (0.9, 0.999), 1e-8, 1e-2)) == 1  # (the group's check aside)
    with pytest.raises(ValueError, match="lr"):
        AdamW(_model().parameters(), -1.0, free_memory=FREE, rung=rung)
