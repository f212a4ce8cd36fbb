"""choose_optimizer and the optladder optimizer object."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from optladder import (
    InsufficientMemoryError,
    LadderOptimizer,
    OptimizerOutOfMemoryError,
    OptladderWarning,
    OverrideError,
    choose_optimizer,
    measure_footprint,
)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 64, generator=gen)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_is_a_torch_optimizer_with_decision() -> None:
    opt = choose_optimizer(_mlp(), lr=3e-4, weight_decay=0.01, free_memory="1GiB")
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(opt, LadderOptimizer)
    assert opt.rung == opt.decision.rung == "fp32"
    assert opt.decision.free_memory == 2**30
    assert opt.decision.budget_bytes == 2**30 // 4
    assert len(opt.param_groups) == len(opt.engine.param_groups) == 1
    assert opt.param_groups[0] is opt.engine.param_groups[0]  # the same dict
    assert opt.state is opt.engine.state
    assert opt.param_groups[0]["lr"] == 3e-4


@pytest.mark.parametrize(
    ("free_memory", "rung"),
    [
        # the MLP has 64*128 + 128 + 128*10 + 10 = 9,610 params: fp32 state 76,880 bytes,
        # bf16 38,440; 8bit: the 8,192-element weight quantizes (2*8192 + 2*4*32 = 16,640
        # bytes), the rest (1,418 elements) keeps float32 (11,344 bytes), + 2,048 code books
        # = 30,032 bytes. The gate is a quarter of free memory.
        (4 * 76_880, "fp32"),
        (4 * 76_880 - 1, "bf16"),
        (4 * 38_440 - 1, "8bit"),
    ],
)
def test_memory_gate_picks_each_rung(free_memory: int, rung: str) -> None:
    model = _mlp()
    assert measure_footprint(model).state_bytes == {"fp32": 76_880, "bf16": 38_440, "8bit": 30_032}
    opt = choose_optimizer(model, free_memory=free_memory)
    assert opt.rung == rung
    assert opt.decision.fits


def test_strict_raises_with_bytes_needed_and_free() -> None:
    with pytest.raises(InsufficientMemoryError) as info:
        choose_optimizer(_mlp(), free_memory=4 * 30_032 - 1)
    assert info.value.needed_bytes == 30_032
    assert info.value.free_bytes == 4 * 30_032 - 1
    assert "30,032 bytes" in str(info.value) and "120,127 bytes free" in str(info.value)


def test_not_strict_builds_cheapest_and_warns() -> None:
    with pytest.warns(OptladderWarning, match="exceeds the memory gate"):
        opt = choose_optimizer(_mlp(), free_memory=1000, strict=False)
    assert opt.rung == "8bit" and not opt.decision.fits


def test_env_overrides_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTLADDER_BF16_ADAM", "ON")
    opt = choose_optimizer(_mlp(), free_memory="1GiB")
    assert opt.rung == "bf16" and opt.decision.origin == "forced"
    assert any("OPTLADDER_BF16_ADAM=ON" in r for r in opt.decision.reasons)
    monkeypatch.setenv("OPTLADDER_BF16_ADAM", "0")
    monkeypatch.setenv("OPTLADDER_RUNG", "8bit")
    assert choose_optimizer(_mlp(), free_memory="1GiB").rung == "8bit"
    # the argument beats every variable
    assert choose_optimizer(_mlp(), free_memory="1GiB", rung="fp32").rung == "fp32"


def test_unknown_env_value_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTLADDER_8BIT_ADAM", "maybe")
    with pytest.raises(
        OverrideError, match=r"OPTLADDER_8BIT_ADAM='maybe'.*1, 0, true, false, on, off"
    ):
        choose_optimizer(_mlp(), free_memory="1GiB")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr must be"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] must be in \[0, 1\)"),
        ({"eps": -1e-8}, "eps must be"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"free_memory": -5}, "free_memory=-5"),
        ({"free_memory": "lots"}, "free_memory='lots'"),
        ({"rung": "4bit"}, "rung='4bit' is not a rung; accepted values: fp32, bf16, 8bit"),
        ({"seed": -1}, "seed must be"),
        ({"rounding": "up"}, "rounding must be"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_optimizer(_mlp(), **{"free_memory": "1GiB", **kwargs})


def test_no_trainable_params() -> None:
    model = _mlp()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        choose_optimizer(model, free_memory="1GiB")


def test_complex_params_get_fp32_and_refuse_bf16() -> None:
    p = torch.nn.Parameter(torch.randn(10_000, dtype=torch.complex64))
    # fp32 (160,000 bytes) is over the gate, but bf16 and 8bit cannot take complex params
    with pytest.warns(OptladderWarning, match="exceeds the memory gate"):
        opt = choose_optimizer([p], free_memory=100_000, strict=False)
    assert opt.rung == "fp32"
    assert any("complex" in r for r in opt.decision.reasons)
    with pytest.raises(ValueError, match="complex"):
        choose_optimizer([p], free_memory="1GiB", rung="bf16")


def test_param_groups_keep_their_hyperparameters() -> None:
    model = _mlp()
    groups = [
        {"params": model[0].parameters(), "lr": 1e-4},
        {"params": model[2].parameters(), "weight_decay": 0.0},
    ]
    opt = choose_optimizer(groups, lr=1e-3, free_memory="1GiB", rung="bf16")
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 1e-3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(g["rung"] == "bf16" for g in opt.param_groups)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_lr_scheduler_drives_the_engine(rung: str) -> None:
    model = _mlp()
    opt = choose_optimizer(model, lr=1e-3, free_memory="1GiB", rung=rung)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train_step(model, opt, 0)
    sched.step()
    assert opt.engine.param_groups[0]["lr"] == pytest.approx(5e-4)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_state_dict_round_trip_resumes_identically(rung: str) -> None:
    """Save after 2 steps, load into a fresh optimizer, take 2 more: bitwise the same."""
    model_a = _mlp()
    opt_a = choose_optimizer(model_a, free_memory="1GiB", rung=rung, seed=7)
    for s in range(2):
        _train_step(model_a, opt_a, s)
    buffer = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, buffer)
    for s in range(2, 4):
        _train_step(model_a, opt_a, s)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model_b = _mlp(seed=1)
    model_b.load_state_dict(saved["model"])
    opt_b = choose_optimizer(model_b, free_memory="1GiB", rung=rung, seed=0)
    opt_b.load_state_dict(saved["opt"])
    if rung == "bf16":
        assert opt_b.param_groups[0]["seed"] == 7  # the seed travels in the state_dict
        st = opt_b.state[model_b[0].weight]
        assert st["exp_avg"].dtype == torch.bfloat16
    for s in range(2, 4):
        _train_step(model_b, opt_b, s)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


def test_load_state_dict_refuses_mismatched_params_and_changes_nothing() -> None:
    src_model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 9)
    )
    src = choose_optimizer(src_model, free_memory="1GiB", rung="bf16")
    gen = torch.Generator().manual_seed(0)
    src_model(torch.randn(4, 64, generator=gen)).sum().backward()
    src.step()
    model = _mlp()
    dst = choose_optimizer(model, free_memory="1GiB", rung="fp32")
    _train_step(model, dst, 1)
    before = copy.deepcopy(dst.state_dict())
    with pytest.raises(ValueError, match=r"param 2: .* 1152 elements .* 1280"):
        dst.load_state_dict(src.state_dict())
    after = dst.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, st in before["state"].items():
        for name, value in st.items():
            assert torch.equal(after["state"][k][name], value)


def test_add_param_group_reaches_the_engine() -> None:
    model = _mlp()
    opt = choose_optimizer(model[0].parameters(), free_memory="1GiB", rung="bf16")
    opt.add_param_group({"params": model[2].parameters(), "lr": 5e-4})
    assert len(opt.engine.param_groups) == 2
    assert opt.param_groups[1]["rung"] == "bf16"
    _train_step(model, opt, 0)
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("param", "match"),
    [
        (torch.randn(4, requires_grad=True) * 2, "param 0 of group 0 is not a leaf tensor"),
        (torch.zeros(4, dtype=torch.int64), "param 0 of group 0 has dtype torch.int64; the rungs"),
    ],
)
def test_params_no_optimizer_can_step_are_refused(param: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_optimizer([param], free_memory="1GiB")


@pytest.mark.parametrize(
    ("kwargs", "environ", "asked"),
    [
        ({"rung": "8bit"}, {}, "rung='8bit'"),
        ({}, {"OPTLADDER_RUNG": "8bit"}, "OPTLADDER_RUNG=8bit"),
        ({}, {"OPTLADDER_8BIT_ADAM": "1"}, "OPTLADDER_8BIT_ADAM=1"),
        ({}, {"OPTLADDER_BF16_ADAM": "0", "OPTLADDER_8BIT_ADAM": "on"}, "OPTLADDER_8BIT_ADAM=on"),
    ],
)
def test_a_rung_asked_for_that_cannot_take_the_params_names_who_asked(
    kwargs: dict[str, str], environ: dict[str, str], asked: str
) -> None:
    """float64 params on the 8bit rung: the error names the setting that asked for it
    (an ``OPTLADDER_*`` variable set in a job's environment is not in the code that
    fails), the param, its dtype and what the rung takes."""
    params = [torch.nn.Parameter(torch.randn(8, dtype=torch.float64))]
    with pytest.raises(ValueError) as info:
        choose_optimizer(params, free_memory="1GiB", environ=environ, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{asked} asks for the 8bit rung, which cannot take the params")
    assert "param 0 of group 0 has dtype torch.float64" in message
    assert "the 8bit rung takes float32, bfloat16 or float16 params" in message


def test_float64_params_skip_the_8bit_rung() -> None:
    """fp32 (torch's AdamW, float64 math) and bf16 (float32 update added in float64)
    step float64 params without rounding them; 8bit (bitsandbytes, float32 params' math
    written back) would round them, so the policy never picks it (rel-18)."""
    params = [torch.nn.Parameter(torch.randn(64, 80, dtype=torch.float64))]
    # fp32: 2 moments * 5,120 * 8 = 81,920 bytes; bf16: 2 * 5,120 * 2 = 20,480 bytes;
    # the gate is 25% of 100 KiB = 25,600 bytes: bf16 passes
    opt = choose_optimizer(params, free_memory="100KiB")
    assert opt.rung == "bf16" and opt.decision.fits
    assert opt.decision.state_bytes["fp32"] == 2 * 64 * 80 * 8
    assert opt.decision.state_bytes["bf16"] == 2 * 64 * 80 * 2
    assert any(
        "8bit takes float32, bfloat16, float16 params and the model has float64" in r
        for r in opt.decision.reasons
    )
    with pytest.raises(OptimizerOutOfMemoryError, match="bf16 is the last usable rung"):
        opt.escalate("test")
