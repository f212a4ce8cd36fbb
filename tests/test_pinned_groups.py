"""Param groups that pin their own rung (``{"params": ..., "rung": "fp32"}``): footprint,
decision, stepping, escalation, checkpoints, growth and errors."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch

from memtools import FailNthAllocation
from optladder import OptimizerOutOfMemoryError, choose_optimizer, measure_footprint
from optladder.optimizers import LadderAdamW
from optladder.optimizers.state import measure_state_bytes
from optladder.rungs import group_pin
from snapshots import assert_failed_steps_change_nothing, assert_same, snapshot

# emb: 100 x 64 = 6,400 elements; proj: 64 x 64 weight (4,096) + 64 bias.
EMB, W, B = 6_400, 4_096, 64
QMAP = 2 * 256 * 4  # bitsandbytes' two float32 code books, per engine and device
# Hand-computed state bytes (moments only): fp32 8 B/elem, bf16 4 B/elem, 8bit 2 B/elem
# plus two float32 absmax per 256-element block, float32 moments under 4,096 elements.
FOLLOW = {"fp32": (W + B) * 8, "bf16": (W + B) * 4, "8bit": 2 * W + 2 * 4 * 16 + B * 8 + QMAP}
PINNED = {"fp32": EMB * 8, "bf16": EMB * 4, "8bit": 2 * EMB + 2 * 4 * 25 + QMAP}


def _both(rung: str, pin: str) -> int:
    """State bytes with the following groups on ``rung`` beside the group pinning
    ``pin``: one engine holds both, so 8bit beside an 8bit pin has one pair of code
    books."""
    return FOLLOW[rung] + PINNED[pin] - (QMAP if rung == pin == "8bit" else 0)


def _model(seed: int = 0) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    return torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(100, 64), "proj": torch.nn.Linear(64, 64)}
    )


def _groups(model: torch.nn.ModuleDict, pin: str = "fp32") -> list[dict]:
    return [
        {"params": [model.emb.weight], "rung": pin, "lr": 2e-3},
        {"params": list(model.proj.parameters())},
    ]


def _set_grads(params: list[torch.Tensor], seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale


def _params(model: torch.nn.ModuleDict) -> list[torch.Tensor]:
    return [model.emb.weight, *model.proj.parameters()]


def _torch_adamw_emb(steps: int, lr: float = 2e-3) -> torch.Tensor:
    """The embedding after ``steps`` steps of torch's fused AdamW on the same grads."""
    model = _model()
    ref = torch.optim.AdamW([model.emb.weight], lr=lr, weight_decay=1e-2, fused=True)
    for s in range(steps):
        _set_grads(_params(model), s)
        ref.step()
    return model.emb.weight.detach()


def test_group_pin_reads_user_pins_and_ignores_the_ladders_marks() -> None:
    assert group_pin({"params": [], "rung": " BF16 "}, "g") == "bf16"
    assert group_pin({"params": [], "rung": "8bit", "rung_origin": "group"}, "g") == "8bit"
    # a group that follows the decision records its rung; that pins nothing
    assert group_pin({"params": [], "rung": "bf16", "rung_origin": "escalated"}, "g") is None
    assert group_pin({"params": []}, "g") is None
    with pytest.raises(ValueError, match=r"g\['rung'\]='fp16' is not a rung; accepted"):
        group_pin({"params": [], "rung": "fp16"}, "g")


@pytest.mark.parametrize("pin", ["fp32", "bf16", "8bit"])
def test_footprint_counts_a_pinned_group_on_its_rung(pin: str) -> None:
    fp = measure_footprint(_groups(_model(), pin))
    assert fp.state_bytes == {r: _both(r, pin) for r in FOLLOW}
    assert fp.pinned_params == EMB and fp.pinned_state_bytes == PINNED[pin]
    assert fp.trainable_params == EMB + W + B
    # without the pin the embedding moves with the rest
    plain = measure_footprint([{"params": [_model().emb.weight]}, _groups(_model())[1]])
    assert plain.pinned_params == 0
    assert plain.state_bytes["bf16"] == (EMB + W + B) * 4


@pytest.mark.parametrize("pin", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_measured_state_equals_the_estimate(pin: str, rung: str) -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, pin), rung=rung, free_memory="1GiB")
    assert opt.decision.state_bytes[rung] == _both(rung, pin)
    _set_grads(_params(model), 0)
    opt.step()
    assert measure_state_bytes(opt) == opt.decision.state_bytes[rung]
    assert opt.state[model.emb.weight] is opt.pinned_engines[pin].state[model.emb.weight]


def test_a_pinned_group_runs_its_rung_and_the_rest_runs_the_decision() -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, "fp32"), rung="bf16", free_memory="1GiB")
    ref_model = _model()
    # the decided params at the same places over all groups (their rounding streams are
    # keyed by them), behind the embedding, which has no grad there and steps nothing
    ref = choose_optimizer(
        [{"params": [ref_model.emb.weight]}, {"params": list(ref_model.proj.parameters())}],
        rung="bf16",
        free_memory="1GiB",
    )
    for s in range(3):
        _set_grads(_params(model), s)
        _set_grads(_params(ref_model), s)
        ref_model.emb.weight.grad = None
        opt.step()
        ref.step()
    # the pinned embedding followed torch's fused AdamW (fp32 moments) bit for bit
    assert torch.equal(model.emb.weight, _torch_adamw_emb(3))
    assert opt.state[model.emb.weight]["exp_avg"].dtype == torch.float32
    # the rest ran the bf16 rung exactly as an optimizer stepping those params alone, on
    # the same engine: the fp32 and bf16 rungs are two state formats of one LadderAdamW
    assert isinstance(opt.engine, LadderAdamW) and opt.pinned_engines["fp32"] is opt.engine
    for p, r in zip(model.proj.parameters(), ref_model.proj.parameters()):
        assert torch.equal(p, r)
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert [g["rung"] for g in opt.param_groups] == ["fp32", "bf16"]
    assert [g["rung_origin"] for g in opt.param_groups] == ["group", "fixed"]
    assert opt.param_groups[0]["lr"] == 2e-3
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    scheduler.step()  # reaches the pinned engine's group: the dicts are shared
    pinned, decided = opt.param_groups
    assert any(g is pinned for g in opt.engine.param_groups)  # the engine's own dicts
    assert pinned["lr"] == 1e-3
    assert decided["lr"] == 5e-4
    assert "pinned fp32: 1 group\n" in repr(opt)
    assert "in groups that pin their rung" in opt.decision.summary()


def test_an_oom_escalates_only_the_groups_that_follow_the_decision() -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, "fp32"), free_memory="1GiB")
    assert opt.rung == "fp32" and opt.decision.origin == "policy"
    _set_grads(_params(model), 0)
    with FailNthAllocation(1):  # the first state tensor of the step
        opt.step()
    assert [(e.from_rung, e.to_rung) for e in opt.escalations] == [("fp32", "bf16")]
    assert torch.equal(model.emb.weight, _torch_adamw_emb(1))  # one step, fp32 moments
    assert opt.state[model.emb.weight]["exp_avg"].dtype == torch.float32
    assert opt.state[model.proj.weight]["exp_avg"].dtype == torch.bfloat16
    assert [(g["rung"], g["rung_origin"]) for g in opt.param_groups] == [
        ("fp32", "group"),
        ("bf16", "escalated"),
    ]
    opt.escalate("test")
    assert opt.rung == "8bit" and "state1" in opt.state[model.proj.weight]
    assert opt.state[model.emb.weight]["exp_avg"].dtype == torch.float32
    for s in (1, 2):
        _set_grads(_params(model), s)
        opt.step()
    assert torch.equal(model.emb.weight, _torch_adamw_emb(3))
    with pytest.raises(OptimizerOutOfMemoryError, match="8bit is the last rung"):
        opt.escalate("again")  # the pinned fp32 group is not a rung to move to


def _pinned_and_fixed(model: torch.nn.ModuleDict):  # type: ignore[no-untyped-def]
    # the rest fixed by rung=, so an OOM is re-raised instead of escalated
    return choose_optimizer(_groups(model, "8bit"), rung="bf16", free_memory="1GiB")


@pytest.mark.parametrize("steps_before", [0, 1])
def test_an_oom_at_any_allocation_of_any_engine_changes_nothing(steps_before: int) -> None:
    """Fail the k-th allocation of a step over two engines (bf16 first, then the pinned
    8bit one) for every k; a clean step afterwards equals an unfailed run bit for bit."""
    clean_model = _model()
    clean = _pinned_and_fixed(clean_model)
    for s in range(steps_before):
        _set_grads(_params(clean_model), s)
        clean.step()
    _set_grads(_params(clean_model), steps_before)
    with FailNthAllocation() as counter:
        clean.step()
    expected = snapshot(clean)
    if steps_before:
        assert counter.count == 0  # nothing left to allocate once state exists
        return
    assert counter.count >= 6  # moments of 3 params in 2 engines, absmax, step tensors

    def prepared():  # type: ignore[no-untyped-def]
        model = _model()
        opt = _pinned_and_fixed(model)
        _set_grads(_params(model), 0)
        return opt

    assert_failed_steps_change_nothing(prepared, counter.count, expected)


def test_checkpoint_keeps_pins_and_moves_the_rest_to_the_escalated_rung() -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, "fp32"), free_memory="1GiB")
    opt.escalate("test")
    for s in range(2):
        _set_grads(_params(model), s)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert [g["params"] for g in saved["param_groups"]] == [[0], [1, 2]]  # the user's order
    assert [(g["rung"], g["rung_origin"]) for g in saved["param_groups"]] == [
        ("fp32", "group"),
        ("bf16", "escalated"),
    ]
    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = choose_optimizer(_groups(resumed_model, "fp32"), free_memory="1GiB")
    assert resumed.rung == "fp32"
    resumed.load_state_dict(saved)
    assert resumed.rung == "bf16" and resumed.decision.origin == "checkpoint"
    assert resumed.pinned_engines.keys() == {"fp32"}
    resumed_params, resumed_sd = snapshot(resumed)
    for g in resumed_sd["param_groups"][1:]:  # how the rung was reached differs, only
        g.update(rung_origin="escalated", rung_reason="test: moved to bf16")
    assert_same((resumed_params, resumed_sd), snapshot(opt))
    for s in (2, 3):
        _set_grads(_params(model), s)
        _set_grads(_params(resumed_model), s)
        opt.step()
        resumed.step()
    for p, q in zip(_params(model), _params(resumed_model)):
        assert torch.equal(p, q)


def test_a_plain_torch_checkpoint_loads_into_pinned_groups() -> None:
    ref_model = _model()
    ref_groups = [{k: v for k, v in g.items() if k != "rung"} for g in _groups(ref_model)]
    ref = torch.optim.AdamW(ref_groups, weight_decay=1e-2, fused=True)
    for s in range(2):
        _set_grads(_params(ref_model), s)
        ref.step()
    model = _model()
    model.load_state_dict(ref_model.state_dict())
    opt = choose_optimizer(_groups(model, "8bit"), rung="fp32", free_memory="1GiB")
    opt.load_state_dict(ref.state_dict())
    # the follow-the-decision group on fp32 takes the moments as they were
    for p, r in zip(model.proj.parameters(), ref_model.proj.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[r]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[r]["exp_avg_sq"])
    # the pinned embedding keeps its 8bit rung: its moments are quantized into it
    st = opt.state[model.emb.weight]
    assert st["state1"].dtype == torch.uint8 and st["absmax1"].numel() == 25
    assert opt.param_groups[0]["rung"] == "8bit" and opt.param_groups[0]["lr"] == 2e-3


def test_add_param_group_with_a_pin_builds_or_joins_that_rungs_engine() -> None:
    model = _model()
    extra = torch.nn.Parameter(torch.randn(64, 80))  # 5,120 elements: quantized on 8bit
    opt = choose_optimizer(list(model.proj.parameters()), free_memory="1GiB")
    assert opt.rung == "fp32" and not opt.pinned_engines
    before = dict(opt.decision.state_bytes)
    opt.add_param_group({"params": [model.emb.weight], "rung": "8bit", "lr": 5e-4})
    shared = {r: QMAP if r == "8bit" else 0 for r in before}  # one engine: one pair of books
    assert opt.decision.state_bytes == {r: before[r] + PINNED["8bit"] - shared[r] for r in before}
    assert opt.decision.footprint.pinned_params == EMB
    opt.add_param_group({"params": [extra], "rung": "8bit"})
    grown = 2 * 5_120 + 2 * 4 * 20  # the same engine: no second pair of code books
    assert opt.decision.state_bytes["fp32"] == before["fp32"] + PINNED["8bit"] + grown
    # one engine holds every group (the 8bit pins are groups of the fp32 rung's engine)
    assert opt.pinned_engines["8bit"] is opt.engine
    assert sum(g["rung"] == "8bit" for g in opt.engine.param_groups) == 2
    assert [g["rung_origin"] for g in opt.param_groups] == ["policy", "group", "group"]
    params = [*model.proj.parameters(), model.emb.weight, extra]
    _set_grads(params, 0)
    opt.step()
    assert measure_state_bytes(opt) == opt.decision.state_bytes["fp32"]
    opt.escalate("test")
    assert opt.rung == "bf16" and "state1" in opt.state[extra]
    _set_grads(params, 1)
    opt.step()
    assert measure_state_bytes(opt) == opt.decision.state_bytes["bf16"]


def test_grad_scaler_unscales_the_pinned_groups_too() -> None:
    model, ref_model = _model(), _model()
    opt = choose_optimizer(_groups(model, "fp32"), rung="bf16", free_memory="1GiB")
    ref = choose_optimizer(_groups(ref_model, "fp32"), rung="bf16", free_memory="1GiB")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert scaler.scale(torch.ones(())).item() == 2.0**10
    _set_grads(_params(model), 0, scale=2.0**10)  # as scaler.scale(loss).backward() would
    _set_grads(_params(ref_model), 0)
    scaler.step(opt)
    scaler.update()
    ref.step()
    assert not opt.last_step_skipped
    for p, q in zip(_params(model), _params(ref_model)):
        assert torch.equal(p, q)  # unscaling by a power of two is exact
    before = snapshot(opt)
    _set_grads(_params(model), 1)
    model.emb.weight.grad[0, 0] = float("inf")  # an overflow in the pinned group
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    assert opt.last_step_skipped
    assert_same(snapshot(opt), before)


def test_unfused_pinned_rung_warns_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without a C compiler the 8bit rung on the CPU is unfused (bitsandbytes' fallback)
    monkeypatch.setenv("CC", "no-such-compiler-for-optladder")
    model = _model()
    with caplog.at_level(logging.WARNING, logger="optladder"):
        opt = choose_optimizer(_groups(model, "8bit"), rung="fp32", free_memory="1GiB")
        for s in range(3):
            _set_grads(_params(model), s)
            opt.step()
    lines = [
        r.getMessage() for r in caplog.records if "8bit rung not on the fused" in r.getMessage()
    ]
    assert len(lines) == 1, lines


@pytest.mark.parametrize(
    ("groups", "kwargs", "match"),
    [
        (
            lambda m: [{"params": [m.emb.weight], "rung": "fp16"}, {"params": [m.proj.weight]}],
            {},
            r"param group 0\['rung'\]='fp16' is not a rung; accepted values: fp32, bf16, 8bit",
        ),
        (
            lambda m: [{"params": [m.emb.weight], "rung": "fp32"}],
            {},
            "every trainable param is in a param group that pins its rung",
        ),
        (  # the unpinned group holds no trainable param: nothing follows the decision
            lambda m: [
                {"params": [m.emb.weight], "rung": "fp32"},
                {"params": [torch.nn.Parameter(torch.ones(3), requires_grad=False)]},
            ],
            {},
            "every trainable param is in a param group that pins its rung",
        ),
        (
            lambda m: [
                {"params": [m.proj.weight]},
                {"params": [m.emb.weight], "rung": "8bit", "rung_origin": "user"},
            ],
            {},
            r"param group 1\['rung_origin'\]='user' is not an origin; accepted values: policy, "
            "forced, fixed, escalated, checkpoint, group",
        ),
        (  # named by the group's place in the user's list, not in its engine
            lambda m: [
                {"params": [m.proj.weight]},
                {"params": [m.emb.weight], "rung": "8bit"},
                {
                    "params": [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))],
                    "rung": "8bit",
                },
            ],
            {},
            r"param group 2 pins 8bit: param 0 of group 2 has dtype torch.float64; the 8bit rung "
            "takes float32, bfloat16 or float16",
        ),
        (
            lambda m: _groups(m, "8bit"),
            {"environ": {"OPTLADDER_8BIT_ADAM": "0"}},
            "param group 0 pins the 8bit rung, which cannot be used: 8bit is disabled by "
            "OPTLADDER_8BIT_ADAM=0",
        ),
        (
            lambda m: [
                {
                    "params": [torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))],
                    "rung": "bf16",
                },
                {"params": [m.proj.weight]},
            ],
            {},
            "complex",
        ),
    ],
)
def test_bad_pins_are_refused(groups, kwargs, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        choose_optimizer(groups(_model()), free_memory="1GiB", **kwargs)


def test_add_param_group_refuses_a_disabled_pin_and_changes_nothing() -> None:
    model = _model()
    env = {"OPTLADDER_8BIT_ADAM": "0"}
    opt = choose_optimizer(list(model.proj.parameters()), free_memory="1GiB", environ=env)
    decision = opt.decision
    with pytest.raises(ValueError, match="param group 1 pins the 8bit rung"):
        opt.add_param_group({"params": [model.emb.weight], "rung": "8bit"})
    with pytest.raises(ValueError, match=r"param group 1\['rung'\]=3 is not a rung"):
        opt.add_param_group({"params": [model.emb.weight], "rung": 3})
    assert len(opt.param_groups) == 1 and not opt.pinned_engines
    assert opt.decision is decision


def test_complex_params_in_a_pinned_fp32_group_leave_the_rest_free_to_move() -> None:
    model = _model()
    z = torch.nn.Parameter(torch.randn(16, dtype=torch.complex64))
    groups = [{"params": [z], "rung": "fp32"}, {"params": list(model.proj.parameters())}]
    opt = choose_optimizer(groups, rung="8bit", free_memory="1GiB")
    assert not opt.decision.footprint.has_complex  # the params that follow are real
    pinned = opt.pinned_engines["fp32"]
    ref_z = torch.nn.Parameter(z.detach().clone())
    ref = torch.optim.AdamW([ref_z], weight_decay=1e-2, foreach=True)
    for s in range(2):
        _set_grads(list(model.proj.parameters()), s)
        z.grad = torch.full_like(z, 0.5 - 1j * s)
        ref_z.grad = z.grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(z, ref_z)
    assert "real params only" in pinned.eager_reasons[0]  # torch's fused has no complex kernel
    assert "state1" in opt.state[model.proj.weight]


def test_resuming_moves_to_the_escalated_rung_whatever_the_groups_pin() -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, "fp32"), free_memory="1GiB")
    opt.escalate("test")
    opt.escalate("test")
    saved = opt.state_dict()
    # the same params, no pin: the checkpoint's decided groups had reached 8bit
    plain = choose_optimizer(
        [{"params": _groups(_model())[0]["params"]}, _groups(_model())[1]],
        free_memory="1GiB",
    )
    plain.load_state_dict(saved)
    assert plain.rung == "8bit" and plain.decision.origin == "checkpoint"
    # pins swapped: the checkpoint's group 1 is pinned, its group 0 had reached bf16
    other = _model()
    swapped = choose_optimizer(
        [{"params": [other.emb.weight]}, {"params": list(other.proj.parameters()), "rung": "fp32"}],
        free_memory="1GiB",
    )
    swapped.escalate("test")
    live = choose_optimizer(_groups(_model(), "fp32"), free_memory="1GiB")
    live.load_state_dict(swapped.state_dict())
    assert live.rung == "bf16"


def test_each_engine_is_fused_for_its_own_params() -> None:
    model = _model()
    low = torch.nn.Parameter(torch.randn(5_000).to(torch.bfloat16))
    # a bfloat16 param pinned to 8bit leaves the float32 params on torch's fused AdamW
    opt = choose_optimizer(
        [{"params": [low], "rung": "8bit"}, {"params": list(model.proj.parameters())}],
        rung="fp32",
        free_memory="1GiB",
    )
    assert opt.decision.fused and isinstance(opt.engine, LadderAdamW)
    assert opt.decision.footprint.dtypes == ("float32",)
    # bfloat16 params that follow the decision leave a pinned float32 group fused
    mixed = choose_optimizer(
        [{"params": [model.emb.weight], "rung": "fp32"}, {"params": [low]}],
        rung="fp32",
        free_memory="1GiB",
    )
    # bf16 params: optladder's AdamW with fp32 moments, on its C kernel where gcc is found
    from optladder.optimizers.kernels import cpu_unavailable_reason

    assert mixed.decision.fused is (cpu_unavailable_reason() is None)
    assert mixed.pinned_engines["fp32"] is mixed.engine  # one engine for both groups
    for s in range(3):
        _set_grads([model.emb.weight], s)
        low.grad = torch.ones_like(low)
        mixed.step()
    assert mixed.engine.eager_reasons == {}  # the float32 param on torch's fused kernel
    assert torch.equal(model.emb.weight, _torch_adamw_emb(3, lr=1e-3))


def test_add_param_group_takes_what_choose_optimizer_takes() -> None:
    model = _model()
    z = torch.nn.Parameter(torch.randn(16, dtype=torch.complex64))
    opt = choose_optimizer(list(model.proj.parameters()), free_memory="1GiB")
    opt.add_param_group({"params": [z], "rung": "fp32"})  # foreach for it, not fused
    assert opt.pinned_engines["fp32"] is opt.engine  # the fp32 format of the same engine
    z.grad = torch.ones_like(z)
    _set_grads(list(model.proj.parameters()), 0)
    opt.step()
    assert opt.state[z]["exp_avg"].dtype == torch.complex64
    assert "real params only" in opt.engine.eager_reasons[2]


def test_step_errors_name_the_users_group_and_change_nothing() -> None:
    model = _model()
    opt = choose_optimizer(_groups(model, "8bit"), rung="bf16", free_memory="1GiB")
    _set_grads(_params(model), 0)
    opt.step()
    before = snapshot(opt)
    _set_grads(_params(model), 1)
    model.emb.weight.grad = model.emb.weight.grad.to_sparse()
    with pytest.raises(ValueError, match="param 0 of group 0 has a sparse grad"):
        opt.step()
    _set_grads(_params(model), 1)
    model.proj.bias.grad_dtype = None  # torch >= 2.9 refuses such a grad otherwise
    model.proj.bias.grad = model.proj.bias.grad.double()
    with pytest.raises(ValueError, match=r"param 1 of group 1 has a torch.float64 grad"):
        opt.step()
    assert_same(snapshot(opt), before)


@pytest.mark.parametrize(("gi", "edit"), [(1, "bf16"), (0, "8bit"), (1, None)])
def test_a_group_rung_edited_by_hand_is_refused_and_changes_nothing(
    gi: int, edit: str | None
) -> None:
    """A group's ``"rung"`` set by hand (a following group's or a pinned one's, or
    deleted) would make steps and checkpoints name a rung its state is not on: step()
    and state_dict() refuse it, naming the group, and nothing changes; put back, the
    optimizer goes on."""
    model = _model()
    opt = choose_optimizer(_groups(model, "fp32"), rung="fp32", free_memory="1GiB")
    _set_grads(_params(model), 0)
    opt.step()
    before = snapshot(opt)
    old = opt.param_groups[gi]["rung"]
    if edit is None:
        del opt.param_groups[gi]["rung"]
    else:
        opt.param_groups[gi]["rung"] = edit
    _set_grads(_params(model), 1)
    match = rf"param group {gi} has rung={edit!r}, but its state is on the fp32 rung"
    with pytest.raises(ValueError, match=match):
        opt.step()
    with pytest.raises(ValueError, match=match):
        opt.state_dict()
    opt.param_groups[gi]["rung"] = old
    assert_same(snapshot(opt), before)
    opt.step()
    assert int(opt.state[model.emb.weight]["step"]) == 2
    assert torch.equal(model.emb.weight.detach(), _torch_adamw_emb(2))


def test_the_optimizer_refuses_to_be_copied() -> None:
    opt = choose_optimizer(_groups(_model()), free_memory="1GiB")
    with pytest.raises(TypeError, match=r"cannot be pickled or deep-copied; save opt.state_dict"):
        copy.deepcopy(opt)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda sd: sd["state"][1].update(step=float("inf")), r"param 1: 'step' must be a finite"),
        (lambda sd: sd["state"][1].update(step=torch.tensor(float("nan"))), "param 1: 'step'"),
        (
            lambda sd: sd["state"][1].update(exp_avg=torch.zeros(64, 64, device="meta")),
            "param 1: exp_avg is on the meta device",
        ),
        (
            lambda sd: sd.update(state={str(k): v for k, v in sd["state"].items()}),
            r"entries for no param of its param groups: \[\"'0'\", \"'1'\", \"'2'\"\]",
        ),
        (
            lambda sd: sd["param_groups"][0].update(rung="zzz"),
            r"param group 0 of the state_dict: its\['rung'\]='zzz' is not a rung",
        ),
    ],
)
def test_malformed_checkpoints_are_refused_and_change_nothing(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    opt = choose_optimizer(_groups(model, "8bit"), rung="bf16", free_memory="1GiB")
    _set_grads(_params(model), 0)
    opt.step()
    before = snapshot(opt)
    saved = copy.deepcopy(opt.state_dict())
    edit(saved)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert_same(snapshot(opt), before)


def test_groups_pinning_one_rung_share_one_engine_built_for_all_their_params() -> None:
    model = _model()
    low = torch.nn.Parameter(torch.randn(300).to(torch.bfloat16))
    groups = [
        {"params": [model.emb.weight], "rung": "fp32"},  # float32 first...
        {"params": [low], "rung": "fp32"},  # ...then bfloat16: fp32 moments for both
        {"params": list(model.proj.parameters())},
    ]
    opt = choose_optimizer(groups, rung="bf16", free_memory="1GiB")
    engine = opt.pinned_engines["fp32"]
    assert isinstance(engine, LadderAdamW) and engine is opt.engine  # one engine for all
    # the groups in the user's order, each in its rung's format
    assert [opt._group_rung(g) for g in engine.param_groups] == ["fp32", "fp32", "bf16"]
    _set_grads(_params(model), 0)
    low.grad = torch.ones_like(low)
    opt.step()
    assert opt.state[low]["exp_avg"].dtype == torch.float32
    assert opt.state[model.emb.weight]["exp_avg"].dtype == torch.float32


def test_a_forced_move_names_the_users_group() -> None:
    model = _model()
    wide = torch.nn.Parameter(torch.randn(64, 80, dtype=torch.float64))
    opt = choose_optimizer([*_groups(model, "fp32")[:1], {"params": [wide]}], free_memory="1GiB")
    with pytest.raises(ValueError, match=r"param 0 of group 1 has dtype torch.float64; the 8bit"):
        opt.migrate_to("8bit", "test", force=True)
    assert opt.rung == "fp32"


@pytest.mark.parametrize("pin", [None, "fp32"])
def test_state_dict_hooks_run_as_torch_runs_them(pin: str | None) -> None:
    model = _model()
    groups = _groups(model, "fp32") if pin else [{"params": _params(model)}]
    opt = choose_optimizer(groups, free_memory="1GiB")
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: {k: v for k, v in sd.items() if k != "extra"}
    )
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    _set_grads(_params(model), 0)
    opt.step()
    saved = opt.state_dict()
    assert saved["extra"] == 1 and calls == ["save pre"]
    opt.load_state_dict(saved)  # the pre-hook drops "extra"
    assert calls == ["save pre", "load post"]


@pytest.mark.parametrize(("rung", "pin"), [("bf16", "bf16"), ("fp32", "bf16"), ("bf16", "fp32")])
def test_a_pinned_groups_params_keep_their_own_rounding_streams(rung: str, pin: str) -> None:
    """Stochastic rounding is keyed by (seed, step, the param's index over all groups),
    whichever engine steps the param. Four equal bfloat16 params with equal grads in
    four groups, the second and fourth pinned: each ends bit-identical to a run of its
    own rung in which it has the same index (behind params without grads, which step
    nothing), so no two share a stream (each engine had counted its params from 0, so
    the pinned group's first param shared the first decided param's stream)."""
    base = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grad = torch.randn(4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def stepped(groups: list[dict], params: list[torch.Tensor], fixed: str) -> None:  # type: ignore[type-arg]
        opt = choose_optimizer(groups, lr=1e-3, rung=fixed, free_memory="8GiB", environ={})
        for _ in range(3):
            for p in params:
                p.grad = grad.clone()
            opt.step()

    ps = [torch.nn.Parameter(base.clone()) for _ in range(4)]
    groups: list[dict] = [{"params": [p]} for p in ps]  # type: ignore[type-arg]
    groups[1]["rung"] = groups[3]["rung"] = pin
    stepped(groups, ps, rung)
    for i, p in enumerate(ps):
        alone = torch.nn.Parameter(base.clone())
        ahead = [{"params": [torch.nn.Parameter(base.clone())]} for _ in range(i)]
        stepped([*ahead, {"params": [alone]}], [alone], pin if i % 2 else rung)
        assert torch.equal(p, alone), i
    assert not torch.equal(ps[0], ps[1])


def _seeded_grads(params: list[torch.nn.Parameter], k: int) -> None:
    """Grads of step ``k``: normal draws from a generator seeded ``10 + k``."""
    gen = torch.Generator().manual_seed(10 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_a_pin_survives_group_dicts_replaced_by_hand() -> None:
    """``opt.param_groups[:] = [dict(g) for g in opt.param_groups]`` (torch accepts it):
    a group that pins fp32 keeps its rung and its state when the rest escalates, as the
    same optimizer whose dicts were not replaced (the pins were keyed by the group
    dicts' identity: the pinned group moved to bf16 with the rest)."""
    import optladder

    def build() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300, 40, 500)]
        opt = optladder.AdamW(
            [{"params": params[:2], "rung": "fp32"}, {"params": params[2:]}],
            1e-2,
            free_memory="64GiB",
        )
        return params, opt

    params, opt = build()
    ref_params, ref = build()
    for k in range(3):
        _seeded_grads(params, k)
        _seeded_grads(ref_params, k)
        if k == 1:
            opt.param_groups[:] = [dict(g) for g in opt.param_groups]
            opt.escalate("test")
            ref.escalate("test")
        opt.step()
        ref.step()
    assert [g["rung"] for g in opt.param_groups] == ["fp32", "bf16"]
    a, b = snapshot(opt), snapshot(ref)
    for sd in (a[1], b[1]):
        for g in sd["param_groups"]:
            g.pop("rung_reason", None)
    assert_same(a, b)


def _strip_ladder_keys(sd: dict) -> dict:  # type: ignore[type-arg]
    """``sd`` as a checkpoint written before groups recorded their rung: its groups
    without ``rung``, ``rung_origin`` and ``rung_reason``."""
    sd = dict(sd)
    drop = ("rung", "rung_origin", "rung_reason")
    sd["param_groups"] = [{k: v for k, v in g.items() if k not in drop} for g in sd["param_groups"]]
    return sd


@pytest.mark.parametrize("edit", ["pop", "new list", "dict copies"])
@pytest.mark.parametrize("reload", [None, "round trip", "older checkpoint"])
def test_a_pin_survives_its_params_list_edited_and_a_reload(edit: str, reload: str | None) -> None:
    """A group that pins fp32 keeps its rung and its state when the rest escalates, after
    ``opt.param_groups[1]["params"].pop(0)``, or its params list replaced by a new one
    without that param, or the group dicts replaced by copies, each also followed by
    ``load_state_dict`` of the optimizer's own checkpoint or of one whose groups lack
    the rung keys (written before groups recorded them): every param still in the
    optimizer as in the same optimizer without the edit, bit for bit (the pin was keyed
    by the group's first param: after a pop the pinned group moved to bf16 with the
    rest). The pinned group is the last, so the edit leaves the following group's
    params at the same places (their rounding streams' index)."""
    import optladder

    def build() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (500, 70, 300, 40, 90)]
        opt = optladder.AdamW(
            [{"params": params[:2]}, {"params": params[2:], "rung": "fp32"}],
            1e-2,
            free_memory="64GiB",
        )
        return params, opt

    params, opt = build()
    ref_params, ref = build()
    assert opt.rung == "fp32"
    for k in range(3):
        _seeded_grads(params, k)
        _seeded_grads(ref_params, k)
        if k == 1:
            group = opt.param_groups[1]
            if edit == "pop":
                group["params"].pop(0)
            elif edit == "new list":
                group["params"] = group["params"][1:]
            else:
                opt.param_groups[:] = [dict(g) for g in opt.param_groups]
            if reload is not None:
                sd = opt.state_dict()
                opt.load_state_dict(_strip_ladder_keys(sd) if reload != "round trip" else sd)
            opt.escalate("test")
            ref.escalate("test")
        opt.step()
        ref.step()
    assert [g["rung"] for g in opt.param_groups] == ["bf16", "fp32"]
    kept = params if edit == "dict copies" else params[:2] + params[3:]
    ref_kept = ref_params if edit == "dict copies" else ref_params[:2] + ref_params[3:]
    assert [p for g in opt.param_groups for p in g["params"]] == kept
    for p, q in zip(kept, ref_kept, strict=True):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == ref.state[q].keys()
        for name, value in opt.state[p].items():
            assert value.dtype == ref.state[q][name].dtype, name
            assert torch.equal(value, ref.state[q][name]), name
    for p in kept[2:]:  # the pinned group's
        assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_a_pinned_group_whose_params_were_all_replaced_keeps_its_pin() -> None:
    """A pinned group given a new params list of new params (none recorded): its own
    mark (``"rung_origin": "group"``) keeps the pin, so the new param steps on fp32 after
    the rest escalates, as torch's fused AdamW steps it on the same grads."""
    import optladder

    gen = torch.Generator().manual_seed(4)
    a, b = (torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300, 200))
    opt = optladder.AdamW(
        [{"params": [a]}, {"params": [b], "rung": "fp32"}], 1e-2, free_memory="64GiB"
    )
    new = torch.nn.Parameter(torch.randn(50, generator=gen))
    ref_param = torch.nn.Parameter(new.detach().clone())
    ref = torch.optim.AdamW([ref_param], 1e-2, fused=True)
    opt.param_groups[1]["params"] = [new]
    opt.escalate("test")
    for _ in range(2):
        grad = torch.randn(50, generator=gen)
        a.grad = torch.randn(300, generator=gen)
        new.grad, ref_param.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    assert [g["rung"] for g in opt.param_groups] == ["bf16", "fp32"]
    assert torch.equal(new, ref_param)
    for name in ("exp_avg", "exp_avg_sq"):
        assert opt.state[new][name].dtype == torch.float32
        assert torch.equal(opt.state[new][name], ref.state[ref_param][name])


@pytest.mark.parametrize("pin", [None, "8bit"])
def test_a_param_taken_out_of_a_pinned_group_and_added_again_takes_the_new_groups_rung(
    pin: str | None,
) -> None:
    """A param removed from a pinned fp32 group, its state deleted (``del opt.state[p]``
    restarts it), and added back with ``add_param_group`` in a group that follows the
    decision (here bf16, after an escalation) or pins 8bit: the new group is on that
    rung, not on the fp32 pin the param had (its old pin was still read: the step
    refused the group as 'rung edited by hand'). Its param's step equals a fresh
    optimizer's on that rung with the same hyperparameters, bit for bit, and so does its
    state (bf16 moments: within one bfloat16 step of the first step's (1 - beta) * g and
    (1 - beta2) * g**2, stochastically rounded with the param's own stream)."""
    model = _model()
    extra = torch.nn.Parameter(torch.randn(100, 64, generator=torch.Generator().manual_seed(7)))
    emb = model.emb.weight
    opt = choose_optimizer(
        [{"params": [emb, extra], "rung": "fp32"}, {"params": list(model.proj.parameters())}],
        lr=1e-3,
        free_memory="1GiB",
    )
    _set_grads([emb, extra, *model.proj.parameters()], 0)
    opt.step()
    opt.escalate("test")
    want = pin or "bf16"
    opt.param_groups[0]["params"].remove(emb)
    del opt.state[emb]
    twin = torch.nn.Parameter(emb.detach().clone())
    opt.add_param_group({"params": [emb]} if pin is None else {"params": [emb], "rung": pin})
    assert opt.param_groups[2]["rung"] == want
    assert [g["rung"] for g in opt.param_groups[:2]] == ["fp32", "bf16"]
    ref = choose_optimizer([twin], lr=1e-3, rung=want, free_memory="1GiB")
    _set_grads([emb, extra, *model.proj.parameters()], 1)
    twin.grad = emb.grad.clone()
    opt.step()
    ref.step()
    assert torch.equal(emb, twin)
    got = opt.state[emb]
    assert got.keys() == ref.state[twin].keys()
    for key, value in ref.state[twin].items():
        mine = torch.as_tensor(got[key])
        assert mine.dtype == torch.as_tensor(value).dtype, key
        if pin is None and key.startswith("exp_avg"):  # stochastically rounded from
            g = emb.grad.float()  # (1 - beta) * g or g**2: within one bfloat16 step of it
            exact = 0.1 * g if key == "exp_avg" else 0.001 * g * g
            assert ((mine.float() - exact).abs() <= exact.abs() * 2**-7).all(), key
        else:
            assert torch.equal(mine, torch.as_tensor(value)), key


def test_a_param_moved_by_hand_to_the_front_of_a_following_group_does_not_pin_it() -> None:
    """A param taken out of a pinned fp32 group (its state deleted) and put first in a
    group that follows the decision, between steps: that group still follows the
    decision (its pin was read from its first param's old record: the group stayed on
    fp32 through an escalation that reported fp32 -> bf16). After the escalation the
    pinned group's moments are float32 and the following group's bfloat16."""
    gen = torch.Generator().manual_seed(0)
    emb, extra, w = (torch.nn.Parameter(torch.randn(n, 64, generator=gen)) for n in (100, 100, 64))
    opt = choose_optimizer(
        [{"params": [emb, extra], "rung": "fp32"}, {"params": [w]}], lr=1e-3, free_memory="1GiB"
    )
    _set_grads([emb, extra, w], 0)
    opt.step()
    opt.param_groups[0]["params"].remove(emb)
    del opt.state[emb]
    opt.param_groups[1]["params"].insert(0, emb)
    _set_grads([emb, extra, w], 1)
    opt.step()
    opt.escalate("test")
    assert [g["rung"] for g in opt.param_groups] == ["fp32", "bf16"]
    _set_grads([emb, extra, w], 2)
    opt.step()
    dtypes = [opt.state[p]["exp_avg"].dtype for p in (extra, emb, w)]
    assert dtypes == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert [float(opt.state[p]["step"]) for p in (extra, emb, w)] == [3.0, 2.0, 3.0]


def test_a_failed_move_names_the_rounded_params_by_their_place_among_all_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A move fp32 -> bf16 that fails after converting a float64 param's moments (which
    bfloat16 cannot give back exactly) names that param by its index over all groups, as
    ``MigrationRoundedError.rounded`` says, beside a pinned group before it: param 3 (the
    pinned group's two params, then the following group's float32 one, then it). Both
    messages said 1 (its place among the moved params), one of them calling it an index
    over all groups, which is the pinned group's second param."""
    import optladder.optimizers.migrate as migrate

    gen = torch.Generator().manual_seed(0)
    pinned = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (64, 32)]
    small = torch.nn.Parameter(torch.randn(100, generator=gen))
    wide = torch.nn.Parameter(torch.randn(6000, generator=gen, dtype=torch.float64))
    opt = choose_optimizer(
        [{"params": pinned, "rung": "fp32"}, {"params": [small, wide]}], free_memory="1GiB"
    )
    for p in (*pinned, small, wide):
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    opt.step()
    flat = [p for g in opt.param_groups for p in g["params"]]
    want = next(i for i, p in enumerate(flat) if p is wide)  # 3, independently of the code
    assert want == 3

    def fail(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("injected")

    # the largest param (the float64 one) converts first; the float32 one splits next
    monkeypatch.setattr(migrate, "_split_state", fail)
    with pytest.raises(OptimizerOutOfMemoryError) as info:
        opt.escalate("test")
    cause = info.value.__cause__
    assert isinstance(cause, migrate.MigrationRoundedError)
    assert cause.rounded == [want]
    assert f"params [{want}] (index over all groups)" in str(cause)
    assert f"params [{want}] (index over all groups) were converted back" in str(info.value)
    assert [g["rung"] for g in opt.param_groups] == ["fp32", "fp32"]
