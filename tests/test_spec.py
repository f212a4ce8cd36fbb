"""The fused-spec mapping, adopt(), drift, and one warning per reason."""

from __future__ import annotations

import logging

import pytest
import torch

from optladder import adopt, choose_optimizer
from optladder.optimizers import kernels
from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.spec import FusedOptimizerConfig, to_fused_config


def _p(n: int = 8, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(n, dtype=dtype))]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: torch.optim.AdamW(_p(), lr=2e-3, weight_decay=0.1), ("adamw", False)),
        (lambda: torch.optim.Adam(_p(), lr=2e-3, weight_decay=0.1), ("adam", False)),
        (lambda: torch.optim.Adam(_p(), decoupled_weight_decay=True), ("adamw", False)),
        (lambda: LadderAdamW(_p()), ("adamw", True)),
        (lambda: LadderAdamW(_p(), moment_dtype=torch.float32), ("adamw", False)),
        (lambda: LadderAdamW(_p(), decoupled_weight_decay=False), ("adam", True)),
        (lambda: choose_optimizer(_p(), rung="bf16", free_memory="1GiB"), ("adamw", True)),
    ],
)
def test_maps(make, expected) -> None:  # type: ignore[no-untyped-def]
    config, why = to_fused_config(make())
    assert why is None and isinstance(config, FusedOptimizerConfig)
    assert (config.kind, config.use_bf16_moments) == expected


def test_maps_hyperparameters() -> None:
    config, _ = to_fused_config(torch.optim.Adam(_p(), lr=2e-3, betas=(0.8, 0.99), eps=1e-6))
    assert config is not None
    assert (config.lr, config.betas, config.eps, config.weight_decay) == (
        2e-3,
        (0.8, 0.99),
        1e-6,
        0.0,
    )


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: torch.optim.Adam(_p(), amsgrad=True), "amsgrad=True"),
        (lambda: torch.optim.AdamW(_p(), maximize=True), "maximize=True"),
        (lambda: torch.optim.Adam(_p(), differentiable=True), "differentiable=True"),
        (lambda: torch.optim.AdamW(_p(dtype=torch.complex64)), "is complex"),
        (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9), "SGD is not Adam or AdamW"),
        (lambda: torch.optim.RMSprop(_p()), "RMSprop is not Adam or AdamW"),
        (
            lambda: choose_optimizer(_p(5000), rung="8bit", free_memory="1GiB"),
            "8-bit block-quantized state",
        ),
    ],
)
def test_misses_say_why(make, reason: str) -> None:  # type: ignore[no-untyped-def]
    config, why = to_fused_config(make())
    assert config is None and why is not None and reason in why


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("AdamW8bit", "8-bit block-quantized state"),
        ("PagedAdamW8bit", "8-bit block-quantized state"),
        ("AdamW32bit", "32-bit state in bitsandbytes' layout"),
        ("PagedAdamW32bit", "32-bit state in bitsandbytes' layout"),
    ],
)
def test_a_bitsandbytes_miss_names_the_state_it_keeps(name: str, kept: str) -> None:
    """The reason states the optimizer's own bit width (its ``args.optim_bits``): a 32-bit
    bitsandbytes optimizer is never said to keep 8-bit state."""
    bnb = pytest.importorskip("bitsandbytes")
    opt = getattr(bnb.optim, name)(_p(5000))
    assert opt.args.optim_bits == int(kept.split("-")[0])
    config, why = to_fused_config(opt)
    assert config is None and why is not None
    assert why.startswith(f"{name} keeps {kept}"), why
    other = "32-bit" if kept.startswith("8") else "8-bit"
    assert other not in why


def test_sparse_grad_is_a_miss() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    config, why = to_fused_config(torch.optim.Adam(emb.parameters()))
    assert config is None and "sparse" in (why or "")


# ------------------------------------------------------------------------------ adopt
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 4))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_adopt_keeps_adam_state_and_coupled_decay() -> None:
    """Adopt a torch Adam (coupled decay) mid-run: the next steps match torch Adam."""
    model, ref_model = _model(), _model()
    user = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.5)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=0.5, foreach=False)
    for s in range(2):
        _step(model, user, s)
        _step(ref_model, ref, s)
    opt = adopt(user, free_memory="1GiB")
    assert opt.rung == "fp32" and not opt.engine.defaults["decoupled_weight_decay"]
    assert opt.state[model[0].weight]["step"].item() == 2.0
    for s in range(2, 4):
        _step(model, opt, s)
        _step(ref_model, ref, s)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        # fused vs single-tensor Adam: float32 rounding of ~10 ops a step, 4 steps
        torch.testing.assert_close(a, b, rtol=0, atol=4 * 10 * 2**-23 * 2)


def test_adopt_into_a_cheaper_rung_converts_the_state() -> None:
    model = _model()
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, user, 0)
    opt = adopt(user, free_memory="1GiB", rung="bf16")
    st = opt.state[model[0].weight]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["step"].item() == 1.0
    torch.testing.assert_close(
        st["exp_avg"].float(), user.state[model[0].weight]["exp_avg"], rtol=2**-8, atol=0
    )


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "SGD is not Adam or AdamW"),
        (lambda m: torch.optim.Adam(m.parameters(), amsgrad=True), "amsgrad=True"),
        (lambda m: torch.optim.RMSprop(m.parameters()), "RMSprop is not Adam"),
    ],
)
def test_adopt_refuses_with_the_reason(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        adopt(make(_model()), free_memory="1GiB")


def test_adopt_refuses_hyperparameters_in_kwargs() -> None:
    with pytest.raises(ValueError, match=r"do not pass \['lr'\]"):
        adopt(torch.optim.AdamW(_model().parameters()), lr=1.0)


# ------------------------------------------------------------------------------ drift
def test_toggling_the_bf16_rung_mid_run_rebuilds_and_keeps_stepping() -> None:
    """fp32 -> bf16 -> fp32 on the same params: each step runs the engine of the rung
    it is on (bf16 state while on bf16), and the result tracks plain AdamW closely."""
    model, ref_model = _model(), _model()
    opt = choose_optimizer(model, lr=1e-2, free_memory="1GiB")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    rungs = ["fp32", "fp32", "bf16", "bf16", "fp32", "fp32"]
    for s, rung in enumerate(rungs):
        opt.migrate_to(rung, "toggled by the test")  # type: ignore[arg-type]
        _step(model, opt, s)
        _step(ref_model, ref, s)
        dtype = opt.state[model[0].weight]["exp_avg"].dtype
        assert dtype == (torch.bfloat16 if rung == "bf16" else torch.float32)
    assert opt.state[model[0].weight]["step"].item() == len(rungs)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        # two steps stored in bf16 moments: bounded as in test_rungs (lr * U * 1.5 * 2**-7 * 3)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * 3.17 * 1.5 * 2**-7 * 3)


def test_changing_betas_mid_run_takes_effect_on_the_fused_kernel() -> None:
    """A hyperparameter change reaches the next step (nothing stale is cached)."""
    params = [torch.nn.Parameter(torch.randn(1000))]
    opt = choose_optimizer(params, rung="bf16", free_memory="1GiB")
    ref = LadderAdamW([torch.nn.Parameter(params[0].detach().clone())], backend="eager")
    for s, betas in enumerate([(0.9, 0.999), (0.5, 0.9)]):
        for group in (opt.param_groups[0], ref.param_groups[0]):
            group["betas"] = betas
        g = torch.randn(1000, generator=torch.Generator().manual_seed(s))
        params[0].grad = g.clone()
        ref.param_groups[0]["params"][0].grad = g.clone()
        opt.step()
        ref.step()
    st, rst = opt.state[params[0]], ref.state[ref.param_groups[0]["params"][0]]
    assert torch.equal(st["exp_avg"], rst["exp_avg"])  # the kernel's moments are the oracle's
    assert torch.equal(st["exp_avg_sq"], rst["exp_avg_sq"])


# --------------------------------------------------------------------------- warnings
def test_one_warning_per_distinct_reason(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "optladder-no-such-compiler")  # no C kernel: the eager path
    params = [torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16)) for _ in range(3)]
    caplog.set_level(logging.WARNING, logger="optladder")
    opt = choose_optimizer(params, rung="bf16", free_memory="1GiB")
    for s in range(4):
        for p in params:
            p.grad = torch.randn(64, generator=torch.Generator().manual_seed(s)).bfloat16()
        opt.step()
    lines = [r.getMessage() for r in caplog.records if "not on the fused path" in r.getMessage()]
    # 3 params x 4 steps, two distinct reasons (the decision's, and the CPU kernel's per
    # param), each logged once
    assert len(lines) == len(set(lines)) == 2, lines
    assert "no C compiler" in lines[0] and "the bf16 rung runs the eager path" in lines[0]
    assert "no C compiler" in lines[1] and "bf16 rung runs" not in lines[1]


def test_bf16_and_f16_params_are_fused_on_both_rungs() -> None:
    """bfloat16/float16 params: the fp32 rung keeps float32 moments on optladder's
    kernel (torch's fused AdamW would keep them in bf16), the bf16 rung bf16 moments;
    every param is stepped by the C kernel, none eagerly."""
    if kernels.cpu_unavailable_reason() is not None:
        pytest.skip(str(kernels.cpu_unavailable_reason()))
    for rung, moment_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        params = [
            torch.nn.Parameter(torch.randn(64, dtype=d)) for d in (torch.bfloat16, torch.float16)
        ]
        opt = choose_optimizer(params, rung=rung, free_memory="1GiB")
        assert opt.decision.fused and opt.decision.unfused_reason is None
        for p in params:
            p.grad = torch.randn(64).to(p.dtype)
        opt.step()
        assert opt.engine.eager_reasons == {}  # type: ignore[attr-defined]
        assert all(opt.state[p]["exp_avg"].dtype == moment_dtype for p in params)
    # the kernels step float32, bfloat16 and float16; other dtypes are named
    from optladder.optimizers.spec import bf16_fused_miss, fp32_fused_miss

    assert "float64 params run the eager path" in str(bf16_fused_miss("cpu", ("float64",)))
    # on the fp32 rung float64 params are torch's fused AdamW's, not optladder's kernels'
    assert fp32_fused_miss(True, "cpu", ("bfloat16", "float64"), False) is None


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_float64_beside_low_precision_params_is_fused_on_the_fp32_rung(low: torch.dtype) -> None:
    """float64 params beside float16/bfloat16 ones on the fp32 rung: the float64 ones on
    torch's fused AdamW, the others on the C kernel, none eagerly (the step's own
    routes), so the decision says fused and no warning says otherwise (it said 'fp32 no
    (... runs eagerly here: ... float64 params run the eager path)', read from the C
    kernel's dtypes, which do not step the float64 params on this rung)."""
    if kernels.cpu_unavailable_reason() is not None:
        pytest.skip(str(kernels.cpu_unavailable_reason()))
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(64, generator=gen).to(d)) for d in (torch.float64, low)
    ]
    opt = choose_optimizer(params, free_memory="1GiB")
    assert opt.rung == "fp32"
    for p in params:
        p.grad = torch.randn(64, generator=gen).to(p.dtype)
    opt.step()
    assert opt.engine.eager_reasons == {}  # type: ignore[attr-defined]
    assert opt.decision.fused and opt.decision.unfused_reason is None
    assert "fp32 yes" in opt.decision.summary()


# ----------------------------------------------------------------------- growth
@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_add_param_group_mid_run_on_every_rung(rung: str) -> None:
    model = _model()
    opt = choose_optimizer(model[0].parameters(), free_memory="1GiB", rung=rung)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _step(model, opt, 0)
    sched.step()
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 1e-3})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["rung"] == rung
    before = model[2].weight.detach().clone()
    _step(model, opt, 1)
    assert not torch.equal(before, model[2].weight)  # the new group is stepped
    st = opt.state[model[2].weight]
    key = "exp_avg" if rung != "8bit" else "state1"
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.float32}[rung]
    assert st[key].dtype == expected  # 96*4 = 384 elements: bitsandbytes keeps float32
    # the new group escalates with the rest
    if rung != "8bit":
        opt.migrate_to("8bit", "test", force=True)
        _step(model, opt, 2)
        assert opt.state[model[2].weight]["state1"].dtype == torch.float32
        assert opt.state[model[0].weight]["state1"].dtype == torch.uint8  # 64*96 >= 4096


@pytest.mark.parametrize(
    ("rung", "param", "match"),
    [
        ("8bit", torch.randn(4, dtype=torch.complex64), "takes real params only"),
        ("bf16", torch.randn(4, dtype=torch.complex64), "takes real params only"),
        ("8bit", torch.randn(4, dtype=torch.float64), "float32, bfloat16 or float16"),
    ],
)
def test_add_param_group_refuses_what_the_rung_cannot_take(rung: str, param, match: str) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    opt = choose_optimizer(model, free_memory="1GiB", rung=rung)
    before = len(opt.param_groups)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(param)]})
    assert len(opt.param_groups) == before


def test_add_param_group_on_the_fp32_rung_keeps_float32_moments_for_bfloat16_params() -> None:
    """The fp32 rung is a state format of optladder's AdamW: a bfloat16 param added to an
    optimizer of float32 params keeps float32 moments (torch's AdamW, the fp32 rung's
    engine before, would have kept them in bfloat16 and refused the group)."""
    model = _model()
    opt = choose_optimizer(model, free_memory="1GiB", rung="fp32")
    low = torch.nn.Parameter(torch.randn(4).bfloat16())
    opt.add_param_group({"params": [low]})
    low.grad = torch.ones_like(low)
    opt.step()
    assert opt.state[low]["exp_avg"].dtype == torch.float32


def test_add_param_group_checks_and_updates_the_estimate() -> None:
    model = _model()
    opt = choose_optimizer(model[0].parameters(), free_memory="1GiB", rung="bf16")
    with pytest.raises(ValueError, match=r"param group 1: lr must be a finite number >= 0"):
        opt.add_param_group({"params": list(model[2].parameters()), "lr": -1.0})
    with pytest.raises(ValueError, match="same tensor as param 0 of group 0"):
        opt.add_param_group({"params": [model[0].weight]})
    opt.add_param_group({"params": list(model[2].parameters())})
    # bf16: 4 bytes per element of both layers, 64*96+96 + 96*4+4
    assert opt.decision.state_bytes["bf16"] == 4 * (64 * 96 + 96 + 96 * 4 + 4)


# ------------------------------------------------------------------ more bad input
@pytest.mark.parametrize("thing", [None, "adam", torch.nn.Linear(2, 2)])
def test_adopt_refuses_non_optimizers(thing: object) -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer"):
        adopt(thing)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_retries": -1}, ValueError, "max_retries must be an integer >= 0"),
        ({"max_retries": True}, ValueError, "max_retries must be an integer >= 0"),
        ({"policy": {"memory_fraction": 0.5}}, TypeError, "policy must be an optladder.Policy"),
        ({"environ": 1}, TypeError, "environ must be a mapping"),
        ({"on_escalate": 1}, TypeError, "on_escalate must be callable"),
        ({"decoupled_weight_decay": None}, TypeError, "decoupled_weight_decay must be"),
        ({"lr": True}, ValueError, "lr must be a finite number"),
        ({"weight_decay": float("inf")}, ValueError, "weight_decay must be a finite number"),
    ],
)
def test_choose_optimizer_option_types(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        choose_optimizer(_model(), free_memory="1GiB", **kwargs)


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"maximize": True}, "maximize=True"),
        ({"amsgrad": True}, "amsgrad=True"),
        ({"decoupled_weight_decay": False}, "pass decoupled_weight_decay=False"),
        ({"lr": -1.0}, "param group 0: lr must be"),
    ],
)
def test_per_group_options_are_refused_not_dropped(group: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_optimizer([{"params": _model().parameters(), **group}], free_memory="1GiB")


def test_a_param_listed_twice_or_aliased_or_expanded_is_refused() -> None:
    p = torch.nn.Parameter(torch.randn(5000))
    with pytest.raises(ValueError, match="same tensor as param 0 of group 0"):
        choose_optimizer([p, p], free_memory="1GiB")
    t = torch.randn(5000)
    with pytest.raises(ValueError, match="views the same memory"):
        choose_optimizer([torch.nn.Parameter(t), torch.nn.Parameter(t)], free_memory="1GiB")
    expanded = torch.nn.Parameter(torch.randn(1, 4).expand(5000, 4))
    with pytest.raises(ValueError, match="expanded view"):
        choose_optimizer([expanded], free_memory="1GiB")


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_a_sparse_grad_changes_nothing(rung: str) -> None:
    lin = torch.nn.Linear(8, 8)
    emb = torch.nn.Embedding(10, 8, sparse=True)
    opt = choose_optimizer([*lin.parameters(), *emb.parameters()], rung=rung, free_memory="1GiB")
    before = [p.detach().clone() for p in (*lin.parameters(), *emb.parameters())]
    (lin(torch.randn(2, 8)).sum() + emb(torch.tensor([1])).sum()).backward()
    with pytest.raises(ValueError, match="sparse grad"):
        opt.step()
    after = [p.detach() for p in (*lin.parameters(), *emb.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not any(opt.state.values())


def test_misplaced_grad_strides_are_refused_on_the_fused_rung() -> None:
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = choose_optimizer([p], rung="fp32", free_memory="1GiB")
    p.grad = torch.randn(4, 6).t()  # same shape, transposed layout
    with pytest.raises(ValueError, match="laid out alike"):
        opt.step()
    assert not any(opt.state.values())
