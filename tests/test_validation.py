"""Bad input is refused before anything changes, with an error naming what was wrong;
what is accepted is carried exactly (issue 14's cases rel-05, rel-14, rel-16, rel-18,
rel-21, and the kinds without a script: overlapping params, coupled-decay checkpoints,
checkpoints that cannot be carried exactly).

Right values come from outside the code under test: torch's own optimizers, plain
bitsandbytes ``AdamW8bit`` on a contiguous copy, hand computations (``0.001 * 0.999**50``)
and brute-force element sets.
"""

from __future__ import annotations

import copy
import logging
import random
import re
import warnings

import numpy as np
import pytest
import torch

from memtools import FailNthAllocation
from optladder import choose_optimizer, decide, measure_footprint
from optladder.optimizers import probe_capabilities
from optladder.optimizers.migrate import read_step, unwrap_bnb_state
from optladder.policies import Overrides
from optladder.policies.decision import allowed_rungs
from optladder.rungs import PARAM_DTYPES, RUNGS, param_refusal
from snapshots import (
    assert_failed_steps_change_nothing,
    assert_load_refused,
    assert_same,
    snapshot,
)

logging.getLogger("optladder").setLevel(logging.ERROR)
GiB = "1GiB"


def _grads(params: list[torch.Tensor], seed: int) -> None:
    """Seeded grads laid out like their params, as autograd makes them."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        values = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
        p.grad = torch.empty_like(p).copy_(values)


# ---------------------------------------------------------------- the rung table


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int32, torch.bool])
def test_dtypes_no_rung_steps_are_refused_at_build(dtype: torch.dtype) -> None:
    """rel-05: float8 params used to pass construction and crash in torch's fused kernel
    at the first step, leaving state behind."""
    p = torch.zeros(64, 64).to(dtype)
    said = (
        f"param 0 of group 0 has dtype {dtype}; the rungs step float32, float64, bfloat16, "
        "float16, complex64, complex128 params (float64 on fp32 and bf16 only, complex64 on "
        "fp32 only, complex128 on fp32 only)"
    )
    with pytest.raises(ValueError, match=re.escape(said)):
        choose_optimizer([p], lr=1e-3, free_memory=GiB)
    opt = choose_optimizer([torch.nn.Parameter(torch.zeros(4))], free_memory=GiB)
    with pytest.raises(ValueError, match=rf"param 0 of group 1 has dtype {dtype}"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1 and len(opt.engine.param_groups) == 1


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dtype", [*PARAM_DTYPES, "float8_e4m3fn", "int64"])
def test_the_table_decides_construction_and_the_policy(rung: str, dtype: str) -> None:
    """One table: a rung the table refuses for a dtype is neither picked by decide()
    nor built when asked for; one it accepts is both."""
    torch_dtype = getattr(torch, dtype)
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch_dtype), requires_grad=dtype != "int64")
    accepted = dtype in PARAM_DTYPES and param_refusal(rung, dtype) is None  # type: ignore[arg-type]
    try:
        choose_optimizer([p], rung=rung, free_memory=GiB)
        built = True
    except ValueError as exc:
        built = False
        assert "param 0 of group 0" in str(exc)
    assert built == accepted
    if dtype in PARAM_DTYPES:
        footprint = measure_footprint([p])
        caps = probe_capabilities("cpu", footprint.dtypes, footprint.has_complex)
        allowed, why = allowed_rungs(footprint, caps, Overrides())
        assert allowed[rung] == accepted, why.get(rung)


def test_float64_params_are_never_rounded_to_float32() -> None:
    """rel-18: under memory pressure the policy picks bf16 for float64 params (8bit
    refuses them); the bf16 rung used to write its float32 math back into them, moving
    them by 1e-12 with lr=0 and a zero grad. Now the float32 update is added in float64."""
    p = torch.nn.Parameter(torch.full((1000,), 1.0 + 1e-12, dtype=torch.float64))
    before = p.detach().clone()
    # fp32 state 16,000 bytes against a gate of 8,000; bf16 state 8,000 passes
    opt = choose_optimizer([p], lr=0.0, weight_decay=0.1, free_memory=32_000)
    assert opt.rung == "bf16"
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), before)  # lr=0: bit for bit, decay included

    # lr > 0: the step is torch's float64 AdamW within float32 math of the update only;
    # the param keeps its float64 low bits (1e-12 is far below float32's 6e-8 ulp at 1).
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.Parameter(1.0 + 1e-12 + torch.rand(4096, generator=gen, dtype=torch.float64))
    ref = torch.nn.Parameter(q.detach().clone())
    opt = choose_optimizer([q], rung="bf16", lr=1e-3, weight_decay=0.1, free_memory=GiB)
    torch_adamw = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1)
    g = torch.randn(4096, generator=gen, dtype=torch.float64)
    q.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    torch_adamw.step()
    # step 1: the update is lr * g / (|g| + eps) ~ 1e-3; float32 math of it errs by at
    # most a few float32 ulps of 1e-3 (~1e-10), far below float32 rounding of the param.
    assert (q.detach() - ref.detach()).abs().max().item() < 1e-9
    assert not torch.equal(q.detach(), q.detach().float().double())  # not float32 values
    with pytest.raises(ValueError, match=r"param 0 of group 0 has dtype torch.float64; the 8bit"):
        choose_optimizer([p], rung="8bit", free_memory=GiB)
    with pytest.raises(ValueError, match=r"param 0 of group 0 has dtype torch.float64; the 8bit"):
        choose_optimizer([p], free_memory=GiB, environ={"OPTLADDER_8BIT_ADAM": "1"})


def test_float64_beside_bf16_params_on_one_fp32_engine() -> None:
    """The fp32 rung steps float64 params beside bfloat16 ones in one engine (the fp32
    format: float64 moments on torch's kernels for the one, float32 moments on optladder's
    kernels for the other). It was refused ("put the float64 params in a param group of
    their own"), and the policy passed over fp32 for such a model; now each param steps
    as it would alone: float64 bit for bit as torch's AdamW, bfloat16 as the fp32 rung
    over bfloat16 params alone."""
    wide = torch.nn.Parameter(torch.full((64,), 1.0 + 1e-12, dtype=torch.float64))
    low = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    assert choose_optimizer([wide, low], free_memory=GiB).rung == "fp32"  # no refusal
    # nearest param writes: stochastic ones draw bits keyed by the param's place
    # (lr 1e-2: a step past half a bfloat16 ulp of 1.0, so the nearest writes move)
    kw = {"rung": "fp32", "free_memory": GiB, "param_rounding": "nearest", "lr": 1e-2}
    opt = choose_optimizer([wide, low], **kw)
    ref = torch.nn.Parameter(wide.detach().clone())
    torch_adamw = torch.optim.AdamW([ref], lr=1e-2, weight_decay=1e-2)
    alone = torch.nn.Parameter(low.detach().clone())
    low_opt = choose_optimizer([alone], **kw)
    # float64 params added beside them are taken too, with float64 moments
    added = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt.add_param_group({"params": [added]})
    for s in range(3):
        _grads([wide, low], s)
        ref.grad, alone.grad = wide.grad.clone(), low.grad.clone()
        opt.step()
        torch_adamw.step()
        low_opt.step()
    assert torch.equal(wide.detach(), ref.detach())  # torch's float64 AdamW, bit for bit
    assert torch.equal(opt.state[wide]["exp_avg_sq"], torch_adamw.state[ref]["exp_avg_sq"])
    assert torch.equal(low.detach(), alone.detach())
    assert not torch.equal(low.detach(), torch.ones(64, dtype=torch.bfloat16))  # it moved
    assert opt.state[low]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt.state[low]["exp_avg"], low_opt.state[alone]["exp_avg"])
    added.grad = torch.ones(3, dtype=torch.float64)
    opt.step()
    assert opt.state[added]["exp_avg"].dtype == torch.float64


def test_the_bf16_rung_takes_float64_params_added_or_converted_mid_run() -> None:
    """The bf16 rung takes float64 params (README's table; construction accepts them):
    so does ``add_param_group``, and so does its next step after ``model.double()``.
    They were refused as though the engine were the fp32 rung's ("this fp32 rung runs
    optladder's AdamW"). With ``lr=0`` a float64 param stays bit for bit (no float32
    rounding), and an added one steps as in an optimizer built with it."""
    gen = torch.Generator().manual_seed(0)
    body = torch.nn.Parameter(torch.randn(64, generator=gen))
    wide = torch.nn.Parameter(torch.full((64,), 1.0 + 1e-12, dtype=torch.float64))
    twin = torch.nn.Parameter(wide.detach().clone())
    opt = choose_optimizer([body], rung="bf16", free_memory=GiB)
    opt.add_param_group({"params": [wide], "lr": 0.0})
    ref = choose_optimizer(
        [{"params": [body.detach().clone().requires_grad_()]}, {"params": [twin], "lr": 0.0}],
        rung="bf16",
        free_memory=GiB,
    )
    for _ in range(2):
        g = torch.randn(64, generator=gen, dtype=torch.float64)
        wide.grad, twin.grad = g.clone(), g.clone()
        body.grad = torch.randn(64, generator=gen)
        ref.param_groups[0]["params"][0].grad = body.grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(wide.detach(), torch.full((64,), 1.0 + 1e-12, dtype=torch.float64))
    opt.param_groups[1]["lr"] = ref.param_groups[1]["lr"] = 1e-3
    opt.step()
    ref.step()
    assert torch.equal(wide.detach(), twin.detach())
    assert not torch.equal(wide.detach(), wide.detach().float().double())  # float64 values

    model = torch.nn.Linear(8, 4)
    opt = choose_optimizer(model, rung="bf16", free_memory=GiB)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    model.double()
    opt.zero_grad()
    model(torch.ones(2, 8, dtype=torch.float64)).sum().backward()
    opt.step()
    assert all(
        p.dtype == torch.float64 and float(opt.state[p]["step"]) == 2 for p in model.parameters()
    )


# ---------------------------------------------------------------- group options


BAD_ROUNDING = ["Stochastic", "NEAREST", " stochastic", "", None, 1]


@pytest.mark.parametrize("bad", BAD_ROUNDING)
def test_rounding_is_validated_wherever_it_can_be_set(bad: object) -> None:
    """rel-16: any spelling other than "stochastic" used to mean round-to-nearest."""
    match = "rounding must be 'stochastic' or 'nearest'"
    p = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match=match):
        choose_optimizer([p], rung="bf16", rounding=bad, free_memory=GiB)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        choose_optimizer([{"params": [p], "rounding": bad}], rung="bf16", free_memory=GiB)
    opt = choose_optimizer([p], rung="bf16", free_memory=GiB)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "rounding": bad})
    _grads([p], 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["rounding"] = bad
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert_same(snapshot(opt), before)
    opt.param_groups[0]["rounding"] = bad  # edited by hand after construction
    with pytest.raises(ValueError, match=rf"param group 0: {match}"):
        opt.step()
    opt.param_groups[0]["rounding"] = "stochastic"
    assert_same(snapshot(opt), before)


def test_stochastic_rounding_keeps_decaying_after_a_refused_typo() -> None:
    """The right value of rel-16: v = 0.001 decays by 0.999 per zero-grad step, 50 steps
    give 0.001 * 0.999**50 = 9.512e-4 (round-to-nearest would stall at 0.001)."""
    p = torch.nn.Parameter(torch.zeros(10_000))
    opt = choose_optimizer([p], rung="bf16", lr=1e-3, free_memory=GiB)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["rounding"] = "Stochastic"
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError):
        opt.step()
    opt.param_groups[0]["rounding"] = "stochastic"
    for _ in range(50):
        opt.step()
    mean = opt.state[p]["exp_avg_sq"].double().mean().item()
    first = float(torch.tensor(0.001).bfloat16())  # v after the first step, in bfloat16
    assert abs(mean - first * 0.999**50) < 1e-6


@pytest.mark.parametrize(("key", "value"), [("amsgrad", True), ("maximize", True), ("seed", -1)])
def test_other_group_options_edited_by_hand_are_refused_before_the_step(
    key: str, value: object
) -> None:
    p = torch.nn.Parameter(torch.randn(64))
    opt = choose_optimizer([p], rung="bf16", free_memory=GiB)
    _grads([p], 0)
    opt.step()
    opt.param_groups[0].setdefault(key, False)
    before = snapshot(opt)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=key):
        opt.step()
    opt.param_groups[0][key] = before[1]["param_groups"][0][key]
    assert_same(snapshot(opt), before)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"betas": (torch.tensor(0.9), 0.999)}, "betas[0]"),
        ({"betas": (0.9, torch.tensor(0.999))}, "betas[1]"),
        ({"eps": torch.tensor(1e-8)}, "eps"),
        ({"weight_decay": torch.tensor(0.01)}, "weight_decay"),
    ],
)
def test_a_tensor_hyperparameter_is_refused_saying_it_is_the_tensor(
    kwargs: dict[str, object], named: str
) -> None:
    """torch's AdamW takes tensor betas; optladder only a tensor lr. tensor(0.9) was
    refused with 'betas[0] must be in [0, 1)', which it is: the message must say what is
    wrong (a tensor) and what to pass."""
    value = next(iter(kwargs.values()))
    shown = repr(value[0] if named == "betas[0]" else value[1] if named == "betas[1]" else value)
    for rung in RUNGS:
        p = torch.nn.Parameter(torch.randn(8))
        with pytest.raises(ValueError) as info:
            choose_optimizer([p], rung=rung, free_memory=GiB, **kwargs)  # type: ignore[arg-type]
        message = str(info.value)
        assert message.startswith(named) and shown in message, message
        assert "a tensor" in message and "Python number" in message, message


@pytest.mark.parametrize(
    ("flag", "instead"), [("maximize", "negate the objective"), ("amsgrad", "amsgrad=True")]
)
@pytest.mark.parametrize("where", ["construction", "add_param_group"])
def test_a_group_option_no_rung_keeps_says_what_is_allowed(
    flag: str, instead: str, where: str
) -> None:
    """A group's maximize=True/amsgrad=True was refused as 'not supported by optladder's
    rungs' alone: the message must say what to set instead (False, or no key)."""
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError) as info:
        if where == "construction":
            choose_optimizer([{"params": [a]}, {"params": [b], flag: True}], free_memory=GiB)
        else:
            opt = choose_optimizer([a], free_memory=GiB)
            opt.add_param_group({"params": [b], flag: True})
    message = str(info.value)
    assert f"{flag}=True" in message, message
    assert f"{flag}=False or leave it out" in message and instead in message, message


@pytest.mark.parametrize(
    ("key", "value", "owner"),
    [("nesterov", True, "SGD"), ("momentum_decay", 4e-3, "NAdam"), ("lr_decay", 0.0, "Adagrad")],
)
@pytest.mark.parametrize("where", ["construction", "add_param_group", "edited before a step"])
def test_another_optimizers_group_key_is_refused_where_the_group_comes_in(
    key: str, value: object, owner: str, where: str
) -> None:
    """A group holding another optimizer's key (SGD's nesterov, NAdam's momentum_decay)
    was taken and ignored, and the optimizer's own state_dict then failed to load ('it
    has the key ..., which torch.optim.SGD writes'): the run could not resume. It is
    refused where it comes in, naming the group, the key, its value and its owner, and
    nothing changes."""
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    if where == "construction":
        with pytest.raises(ValueError) as info:
            choose_optimizer([{"params": [a]}, {"params": [b], key: value}], free_memory=GiB)
        group = 1
    else:
        opt = choose_optimizer([a], free_memory=GiB)
        _grads([a], 0)
        opt.step()
        before = snapshot(opt)
        with pytest.raises(ValueError) as info:
            if where == "add_param_group":
                opt.add_param_group({"params": [b], key: value})
            else:
                opt.param_groups[0][key] = value
                opt.step()
        if where != "add_param_group":
            del opt.param_groups[0][key]
        assert_same(snapshot(opt), before)
        group = 1 if where == "add_param_group" else 0
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own checkpoint loads
    message = str(info.value)
    assert f"group {group}" in message and f"{key}={value!r}" in message, message
    assert f"torch.optim.{owner}" in message and "remove it" in message, message


# ---------------------------------------------------------------- 8bit and non-contiguous


def _bnb_reference(base: torch.Tensor, steps: int, wd: float, coupled: bool) -> torch.Tensor:
    """The same updates by the 8bit rung (LadderAdamW's 8bit state format: on the CPU
    optladder's 8-bit kernel, see tests/test_kernels_8bit_cpu.py for it against plain
    bitsandbytes) on a contiguous copy of the param."""
    from engines import eightbit

    q = torch.nn.Parameter(base.t().contiguous().clone())
    ref = eightbit([q], lr=0.01, weight_decay=wd, decoupled_weight_decay=not coupled)
    for s in range(steps):
        _grads([q], s)
        ref.step()
    return q.detach()


@pytest.mark.parametrize("shape", [(80, 64), (16, 8)])  # quantized (5,120 >= 4,096) and 32-bit
@pytest.mark.parametrize("coupled", [False, True])
def test_8bit_steps_a_noncontiguous_param_in_place(shape: tuple[int, int], coupled: bool) -> None:
    """rel-14: bitsandbytes' update ran ``p.data = p.data.contiguous()``: the param got
    new storage and the buffer it viewed stopped seeing updates."""
    base = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    start = base.clone()
    p = torch.nn.Parameter(base.t())
    tied = base.t()  # another view of the same memory, as a tied weight would be
    opt = choose_optimizer(
        [p],
        rung="8bit",
        lr=0.01,
        weight_decay=0.1,
        decoupled_weight_decay=not coupled,
        free_memory=GiB,
    )
    for s in range(3):
        _grads([p], s)
        opt.step()
    assert p.data_ptr() == base.data_ptr() and torch.equal(tied, p.detach())
    assert torch.equal(p.detach(), _bnb_reference(start, 3, 0.1, coupled))
    st = opt.state[p]
    assert st["state1"].is_contiguous()  # state kept in the param's logical order


@pytest.mark.parametrize("layout", ["transposed", "expanded", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_steps_a_grad_laid_out_unlike_its_param_on_the_kernel(
    layout: str, dtype: torch.dtype
) -> None:
    """A contiguous param with a hand-set grad that is not contiguous (a transposed,
    expanded or strided view) went to bitsandbytes' per-tensor CPU path: 8-9x slower at 1M
    elements on 1 thread, and other bits than the same grad values laid out contiguously
    (268 of 6,144 elements differed after two steps, by up to 0.0027). Now the kernel steps a
    contiguous copy of the grad: the same bits as the contiguous grads."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(64, 96, generator=gen).to(dtype)
    p = torch.nn.Parameter(start.clone())
    q = torch.nn.Parameter(start.clone())
    opt = choose_optimizer([p], rung="8bit", lr=0.01, free_memory=GiB)
    ref = choose_optimizer([q], rung="8bit", lr=0.01, free_memory=GiB)
    for s in range(3):
        g = torch.Generator().manual_seed(10 + s)
        if layout == "transposed":
            grad = torch.randn(96, 64, generator=g).to(dtype).t()
        elif layout == "expanded":
            grad = torch.randn(1, 96, generator=g).to(dtype).expand(64, 96)
        else:
            grad = torch.randn(64, 192, generator=g).to(dtype)[:, ::2]
        assert not grad.is_contiguous()
        p.grad = grad
        q.grad = grad.contiguous()
        opt.step()
        ref.step()
        assert opt.engine.eager_reasons == {}  # on the kernel, not bitsandbytes' path
    assert torch.equal(p.detach(), q.detach())
    for key in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(opt.state[p][key], ref.state[q][key]), key
    assert opt.state[p]["step"] == ref.state[q]["step"] == 3


def test_8bit_failed_steps_with_a_grad_laid_out_unlike_its_param_change_nothing() -> None:
    """Every allocation of such a step (the grad's contiguous copy included), failed one
    at a time: nothing changes, and the next step is the one that never failed."""

    def prepared() -> torch.optim.Optimizer:
        p = torch.nn.Parameter(torch.randn(80, 64, generator=torch.Generator().manual_seed(1)))
        opt = choose_optimizer([p], rung="8bit", lr=0.01, free_memory=GiB)
        for s in range(2):
            p.grad = torch.randn(64, 80, generator=torch.Generator().manual_seed(s)).t()
            if s == 0:
                opt.step()
        return opt

    reference = prepared()
    with FailNthAllocation() as counter:
        reference.step()
    assert counter.count >= 1  # at least the grad's contiguous copy
    assert_failed_steps_change_nothing(prepared, counter.count, snapshot(reference))


def test_an_escalation_to_8bit_keeps_views_tied() -> None:
    base = torch.randn(80, 64, generator=torch.Generator().manual_seed(1))
    start = base.clone()
    p = torch.nn.Parameter(base.t())
    opt = choose_optimizer([p], lr=0.01, weight_decay=0.1, free_memory=GiB)
    opt.escalate("test")
    opt.escalate("test")
    assert opt.rung == "8bit"
    for s in range(3):
        _grads([p], s)
        opt.step()
    assert p.data_ptr() == base.data_ptr()
    assert torch.equal(p.detach(), _bnb_reference(start, 3, 0.1, coupled=False))


def test_8bit_noncontiguous_failed_steps_and_moves_change_nothing() -> None:
    """Every allocation of a step (the contiguous copies included) and of a move to 8bit,
    failed one at a time: nothing changes and no prepared copy is left behind."""

    def prepared() -> torch.optim.Optimizer:
        p = torch.nn.Parameter(torch.randn(80, 64, generator=torch.Generator().manual_seed(1)).t())
        opt = choose_optimizer([p], rung="8bit", lr=0.01, free_memory=GiB)
        _grads([p], 0)
        opt.step()
        _grads([p], 1)
        return opt

    reference = prepared()
    with FailNthAllocation() as counter:
        reference.step()
    assert counter.count >= 1  # at least the param's contiguous copy
    assert_failed_steps_change_nothing(prepared, counter.count, snapshot(reference))
    assert not reference.engine.eightbit_groups()._contiguous

    for k in range(1, 12):
        p = torch.nn.Parameter(torch.randn(80, 64, generator=torch.Generator().manual_seed(1)).t())
        opt = choose_optimizer([p], rung=None, lr=0.01, free_memory=GiB)
        _grads([p], 0)
        opt.step()
        before = snapshot(opt)
        try:
            with FailNthAllocation(k):
                opt.migrate_to("8bit", "test", force=True)
        except torch.OutOfMemoryError:
            assert opt.rung == "fp32" and set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
            assert_same(snapshot(opt), before)
        else:
            assert opt.rung == "8bit"
            break


def test_a_noncontiguous_param_added_later_is_stepped_in_place() -> None:
    """The 8bit engine is always optladder's subclass, so add_param_group takes a
    non-contiguous param too: it is stepped in its own memory, like a contiguous copy."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(80, 64, generator=gen)
    grad = torch.randn(64, 80, generator=gen)
    results = []
    for view in (True, False):
        first = torch.nn.Parameter(torch.zeros(8))
        opt = choose_optimizer([first], rung="8bit", free_memory=GiB, lr=0.01)
        p = torch.nn.Parameter(base.clone().t() if view else base.t().contiguous())
        ptr = p.data_ptr()
        opt.add_param_group({"params": [p]})
        for _ in range(3):
            p.grad = grad.clone()
            first.grad = torch.zeros(8)
            opt.step()
        assert p.data_ptr() == ptr and p.is_contiguous() == (not view)
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


# ---------------------------------------------------------------- params sharing memory


def _elements(t: torch.Tensor) -> set[int]:
    """Brute force: the storage offsets (in elements) of every element of ``t``."""
    return {
        t.storage_offset() + sum(i * s for i, s in zip(idx, t.stride()))
        for idx in np.ndindex(*t.shape)
    }


def _views() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    buf = torch.zeros(100)
    mat = torch.zeros(8, 6)
    return {
        "overlapping slices": (buf[0:60], buf[50:100]),
        "disjoint slices": (buf[0:50], buf[50:100]),
        "tensor and a reshaped view": (mat, mat.view(48)),
        "tensor and its transpose": (mat, mat.t()),
        "column split": (mat[:, :3], mat[:, 3:]),
        "interleaved columns": (mat[:, ::2], mat[:, 1::2]),
        "overlapping columns": (mat[:, :4], mat[:, 3:]),
        "a row inside a block": (mat[2], mat[1:4, 2:5]),
        "a row beside a block": (mat[0], mat[1:4, 2:5]),
    }


@pytest.mark.parametrize("name", list(_views()))
def test_params_sharing_elements_are_refused_whatever_the_shapes(name: str) -> None:
    a, b = _views()[name]
    shared = bool(_elements(a) & _elements(b))
    params = [torch.nn.Parameter(a), torch.nn.Parameter(b)]
    if shared:
        with pytest.raises(ValueError, match=r"param 1 of group 0 .*(overlaps|same memory)"):
            choose_optimizer(params, free_memory=GiB)
        opt = choose_optimizer([params[0]], free_memory=GiB)
        with pytest.raises(ValueError, match="param 0 of group 1"):
            opt.add_param_group({"params": [params[1]]})
        assert len(opt.param_groups) == 1
    else:
        choose_optimizer(params, free_memory=GiB)


def test_random_views_of_one_buffer_are_refused_exactly_when_they_share_elements() -> None:
    """Property: random strided views (non-self-overlapping) of one 240-element buffer;
    refused iff the brute-force element sets intersect."""
    rng = random.Random(7)
    buf = torch.zeros(240)
    for _ in range(300):
        views = []
        for _ in range(2):
            rows, cols = rng.randint(1, 6), rng.randint(1, 6)
            col_stride = rng.randint(1, 3)
            row_stride = rng.choice([cols * col_stride, cols * col_stride + rng.randint(1, 5)])
            if rng.random() < 0.3:
                row_stride, col_stride = col_stride, row_stride * rows  # column-major
            extent = (rows - 1) * row_stride + (cols - 1) * col_stride + 1
            offset = rng.randint(0, 240 - extent) if extent <= 240 else None
            if offset is None:
                break
            views.append(buf.as_strided((rows, cols), (row_stride, col_stride), offset))
        if len(views) < 2 or any(len(_elements(v)) != v.numel() for v in views):
            continue
        shared = bool(_elements(views[0]) & _elements(views[1]))
        try:
            choose_optimizer([torch.nn.Parameter(v) for v in views], free_memory=GiB, rung="fp32")
            refused = False
        except ValueError:
            refused = True
        assert refused == shared, [(v.shape, v.stride(), v.storage_offset()) for v in views]


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_params_over_shared_memory_in_two_storages_are_refused(layout: str) -> None:
    """Two tensors can view the same memory through storages of their own (NumPy slices
    of one array under torch.from_numpy): the check compares the memory, not the
    storage objects. Views next to each other are accepted."""
    array = np.zeros((12, 8), dtype=np.float32)
    a, b = torch.from_numpy(array[0:6]), torch.from_numpy(array[4:12])  # rows 4, 5 shared
    c = torch.from_numpy(array[6:12])  # right after a: nothing shared
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    if layout == "transposed":
        a, b, c = a.t(), b.t(), c.t()
    with pytest.raises(ValueError, match=r"param 1 of group 0 .*overlaps param 0 of group 0"):
        choose_optimizer([torch.nn.Parameter(a), torch.nn.Parameter(b)], free_memory=GiB)
    with pytest.raises(ValueError, match=r"param 0 of group 1 .*overlaps param 0 of group 0"):
        groups = [{"params": [torch.nn.Parameter(b)]}, {"params": [torch.nn.Parameter(a)]}]
        choose_optimizer(groups, free_memory=GiB)
    opt = choose_optimizer([torch.nn.Parameter(a), torch.nn.Parameter(c)], free_memory=GiB)
    assert len(opt.param_groups[0]["params"]) == 2


def test_a_view_overlapping_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="elements overlap in memory"):
        choose_optimizer([torch.nn.Parameter(torch.zeros(10).as_strided((4, 4), (1, 1)))])


@pytest.mark.parametrize("kind", ["generator", "iterator", "dict values", "map"])
def test_param_groups_from_a_one_pass_iterable_holding_a_set_are_refused(kind: str) -> None:
    """A set of params in a group is refused however the groups come (torch refuses it
    too: its order changes between runs, and with it the checkpoints' param order),
    and the groups are read once."""
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    groups = [{"params": [p]}, {"params": {q}, "lr": 0.5}]
    given = {
        "generator": lambda: (g for g in groups),
        "iterator": lambda: iter(groups),
        "dict values": lambda: dict(enumerate(groups)).values(),
        "map": lambda: map(dict, groups),
    }[kind]
    with pytest.raises(TypeError, match="ordered collections"):
        torch.optim.AdamW(given())
    with pytest.raises(TypeError, match=r"param group 1\['params'\] is a set; .*pass a list"):
        choose_optimizer(given(), free_memory=GiB)
    ok = [{"params": [p]}, {"params": [q], "lr": 0.5}]
    opt = choose_optimizer((g for g in ok), free_memory=GiB)  # a generator is read once
    assert [g["params"] for g in opt.param_groups] == [[p], [q]]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.5]


@pytest.mark.parametrize(
    ("params", "found"),
    [
        ([], "got an empty list"),
        ({"w": torch.zeros(2)}, "param 0 is a str"),  # a dict lists its keys, as in torch
        ([torch.nn.Parameter(torch.zeros(2)), 3.0], "param 1 is a float"),
        (None, "got an empty list"),
    ],
)
def test_add_param_group_names_what_it_found_in_params(params: object, found: str) -> None:
    opt = choose_optimizer([torch.nn.Parameter(torch.zeros(4))], free_memory=GiB)
    with pytest.raises(ValueError, match=rf"must be a non-empty list of tensors; {found}"):
        opt.add_param_group({"params": params})
    assert len(opt.param_groups) == 1 and len(opt.engine.param_groups) == 1


def test_add_param_group_without_params_says_the_key_is_missing() -> None:
    opt = choose_optimizer([torch.nn.Parameter(torch.zeros(4))], free_memory=GiB)
    with pytest.raises(ValueError, match=r"missing its 'params' key \(it holds 'lr'\)"):
        opt.add_param_group({"lr": 1e-3})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("pin", [None, "fp32"])
def test_a_complex_param_added_beside_fused_float32_ones_steps_as_torch(pin: str | None) -> None:
    """A complex param added beside fused float32 ones (in a group of its own pinning
    fp32, or following the fp32 decision: one engine, the fp32 format, steps it on
    torch's foreach AdamW; it was refused when torch's fused AdamW was the engine)
    steps as torch's AdamW."""
    opt = choose_optimizer(
        [torch.nn.Parameter(torch.zeros(4))], rung="fp32", free_memory=GiB, environ={}
    )
    z = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))
    start = z.detach().clone()
    opt.add_param_group({"params": [z]} if pin is None else {"params": [z], "rung": pin})
    z.grad = torch.full((8,), 1 + 1j, dtype=torch.complex64)
    opt.step()
    ref = torch.nn.Parameter(start)
    ref.grad = torch.full((8,), 1 + 1j, dtype=torch.complex64)
    torch.optim.AdamW([ref], lr=1e-3, foreach=True).step()
    assert torch.equal(z.detach(), ref.detach())


# ---------------------------------------------------------------- checkpoints


def _trained(cls: type, seed: int = 0, **kwargs: object) -> tuple[torch.nn.Linear, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = cls(model.parameters(), **kwargs)
    for s in range(2):
        _grads(list(model.parameters()), s)
        opt.step()
    return model, copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (torch.optim.NAdam, {}, "momentum_decay"),
        (torch.optim.RAdam, {}, "RAdam"),
        (torch.optim.Adamax, {}, "capturable"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "nesterov"),
        (torch.optim.RMSprop, {}, "centered"),
        (torch.optim.Adagrad, {}, "lr_decay"),
    ],
)
@pytest.mark.parametrize("rung", RUNGS)
def test_other_optimizers_checkpoints_are_refused(
    cls: type, kwargs: dict, match: str, rung: str
) -> None:
    model, saved = _trained(cls, **kwargs)
    opt = choose_optimizer(model, rung=rung, free_memory=GiB)
    _grads(list(model.parameters()), 5)
    opt.step()
    assert_load_refused(opt, saved, match)


def test_nadam_state_keys_are_refused_by_name() -> None:
    model, saved = _trained(torch.optim.NAdam)
    for group in saved["param_groups"]:
        group.pop("momentum_decay")
        group["amsgrad"] = False  # disguised as an Adam group: the state still says NAdam
    opt = choose_optimizer(model, free_memory=GiB)
    with pytest.raises(ValueError, match="param 0: the state holds 'mu_product'"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("rung", RUNGS)
def test_coupled_and_decoupled_decay_checkpoints_do_not_mix(rung: str) -> None:
    model, adam = _trained(torch.optim.Adam, weight_decay=0.1)
    _, adamw = _trained(torch.optim.AdamW, weight_decay=0.1)
    opt = choose_optimizer(model, rung=rung, free_memory=GiB)
    with pytest.raises(
        ValueError, match=r"decays the Adam way .* this optimizer decays the AdamW way"
    ):
        opt.load_state_dict(adam)
    coupled = choose_optimizer(model, rung=rung, decoupled_weight_decay=False, free_memory=GiB)
    with pytest.raises(
        ValueError, match=r"decays the AdamW way .* this optimizer decays the Adam way"
    ):
        coupled.load_state_dict(adamw)
    _, no_decay = _trained(torch.optim.Adam)  # weight_decay=0: the same update either way
    opt.load_state_dict(no_decay)


def test_an_adam_checkpoint_continues_exactly_in_adam_mode() -> None:
    model, saved = _trained(torch.optim.Adam, weight_decay=0.1)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.Adam(ref_model.parameters(), weight_decay=0.1)
    ref.load_state_dict(copy.deepcopy(saved))
    opt = choose_optimizer(model, rung="fp32", decoupled_weight_decay=False, free_memory=GiB)
    opt.load_state_dict(saved)
    for s in range(2, 4):
        _grads(list(model.parameters()), s)
        _grads(list(ref_model.parameters()), s)
        opt.step()
        ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def _optladder_checkpoint(rung: str) -> tuple[torch.nn.Linear, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(80, 64)  # a 5,120-element weight: quantized on 8bit
    opt = choose_optimizer(model, rung=rung, free_memory=GiB)
    for s in range(2):
        _grads(list(model.parameters()), s)
        opt.step()
    return model, copy.deepcopy(opt.state_dict())


def _flat_state(saved: dict, key: int) -> dict:
    """The param's state, bitsandbytes' wrapped tensors moved to the top level (a layout
    the loader takes too)."""
    saved["state"][key] = unwrap_bnb_state(saved["state"][key])
    return saved["state"][key]


MUTATIONS = {
    # name: (edit of a checkpoint, the rungs it applies to (state layout), refused?)
    "NaN moment": (lambda sd, st: st[_values(st, 1)].view(-1).__setitem__(0, float("nan")), True),
    "inf moment": (lambda sd, st: st[_values(st, 2)].view(-1).__setitem__(0, float("inf")), True),
    "negative exp_avg_sq": (lambda sd, st: _neg(st), True),
    "step 2.5": (lambda sd, st: st.__setitem__("step", 2.5), True),
    "step -1": (lambda sd, st: st.__setitem__("step", -1), True),
    "step True": (lambda sd, st: st.__setitem__("step", True), True),
    "mu_product": (lambda sd, st: st.__setitem__("mu_product", torch.tensor(1.0)), True),
    "max_exp_avg_sq": (lambda sd, st: st.__setitem__("max_exp_avg_sq", torch.zeros(1)), True),
    "sparse moment": (lambda sd, st: st.__setitem__(_m1(st), _sparse(st[_m1(st)])), True),
    "int moment": (lambda sd, st: st.__setitem__(_m1(st), st[_m1(st)].to(torch.int16)), True),
    "moment of another size": (lambda sd, st: st.__setitem__(_m1(st), st[_m1(st)][:3]), True),
    "rounding typo": (
        lambda sd, st: sd["param_groups"][0].__setitem__("rounding", "Nearest"),
        True,
    ),
    "rung int4": (lambda sd, st: sd["param_groups"][0].__setitem__("rung", "int4"), True),
    "NAdam group key": (
        lambda sd, st: sd["param_groups"][0].__setitem__("momentum_decay", 4e-3),
        True,
    ),
    "coupled decay": (
        lambda sd, st: sd["param_groups"][0].__setitem__("decoupled_weight_decay", False),
        True,
    ),
    "lr NaN": (lambda sd, st: sd["param_groups"][0].__setitem__("lr", float("nan")), True),
    "amsgrad": (lambda sd, st: sd["param_groups"][0].__setitem__("amsgrad", True), True),
    # carried exactly: the same values in another form
    "step as an int": (
        lambda sd, st: st.__setitem__("step", int(torch.as_tensor(st["step"]).item())),
        False,
    ),
    "step as a float64 tensor": (
        lambda sd, st: st.__setitem__(
            "step", torch.tensor(float(torch.as_tensor(st["step"]).item()), dtype=torch.float64)
        ),
        False,
    ),
    "initial_lr key": (
        lambda sd, st: sd["param_groups"][0].__setitem__("initial_lr", sd["param_groups"][0]["lr"]),
        False,
    ),
    "rung_reason edited": (
        lambda sd, st: sd["param_groups"][0].__setitem__("rung_reason", "x"),
        False,
    ),
}


def _m1(st: dict) -> str:
    return "state1" if "state1" in st else "exp_avg"


def _m2(st: dict) -> str:
    return "state2" if "state2" in st else "exp_avg_sq"


def _values(st: dict, i: int) -> str:
    """The float tensor that holds moment ``i``'s values: 8-bit codes' block scales."""
    quantized = st.get(f"state{i}") is not None and st[f"state{i}"].dtype == torch.uint8
    return f"absmax{i}" if quantized else (_m1(st) if i == 1 else _m2(st))


def _neg(st: dict) -> None:
    st[_values(st, 2)].view(-1)[0] = -1.0


def _sparse(t: torch.Tensor) -> torch.Tensor:
    return t.float().to_sparse()


def test_malformed_checkpoints_property() -> None:
    """Property test (seeded): a checkpoint of a random rung, edited by 1-2 random
    mutations, loaded into an optimizer of a random rung: refused with optimizer and
    params bit-identical, or accepted and then stepping exactly like the same optimizer
    loaded from the clean checkpoint. Every mutation that cannot be carried exactly is
    refused."""
    rng = random.Random(14)
    names = list(MUTATIONS)
    sources = {rung: _optladder_checkpoint(rung) for rung in RUNGS}
    for trial in range(40):
        src = rng.choice(RUNGS)
        dst = rng.choice(RUNGS)
        # at most one edit that must be refused, after at most one that carries exactly
        chosen = [
            rng.choice([n for n in names if MUTATIONS[n][1] == refuse])
            for refuse in rng.choice([(True,), (False,), (False, True)])
        ]
        model0, clean = sources[src]
        saved = copy.deepcopy(clean)
        key = rng.choice(list(saved["state"]))
        for name in chosen:
            MUTATIONS[name][0](saved, _flat_state(saved, key))
        must_refuse = any(MUTATIONS[name][1] for name in chosen)

        def fresh(
            model0: torch.nn.Linear = model0, dst: str = dst
        ) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
            model = copy.deepcopy(model0)
            opt = choose_optimizer(model, rung=dst, free_memory=GiB)
            _grads(list(model.parameters()), 9)
            opt.step()
            return model, opt

        model, opt = fresh()
        before = snapshot(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                opt.load_state_dict(saved)
                refused = None
            except ValueError as exc:
                refused = exc
        context = f"trial {trial}: {src} -> {dst}, {chosen}, state key {key}"
        if refused is not None:
            assert must_refuse, f"{context}: refused ({refused})"
            assert_same(snapshot(opt), before)
            continue
        assert not must_refuse, f"{context}: accepted"
        ref_model, ref = fresh()
        ref.load_state_dict(copy.deepcopy(clean))
        for s in range(2):
            _grads(list(model.parameters()), 20 + s)
            _grads(list(ref_model.parameters()), 20 + s)
            opt.step()
            ref.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), context


# ---------------------------------------------------------------- arguments (rel-21)


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


@pytest.mark.filterwarnings("ignore:optladder. follow_checkpoint is deprecated:FutureWarning")
def test_unclear_errors_now_name_the_argument() -> None:
    """rel-21: each bad input gets a ValueError/TypeError naming it."""
    m = _model()
    opt = choose_optimizer(m, lr=1e-3, free_memory=GiB)
    _grads(list(m.parameters()), 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].to_sparse()
    fp = measure_footprint(m)
    cases = [
        (
            lambda: choose_optimizer([torch.nn.Parameter(torch.randn(4, 4).to_sparse())]),
            ValueError,
            "is a sparse tensor",
        ),
        (
            lambda: choose_optimizer(m, lr=torch.tensor(1e-3, device="meta")),
            ValueError,
            "lr is a tensor on the meta device",
        ),
        (
            lambda: opt.add_param_group([torch.nn.Parameter(torch.randn(3))]),
            TypeError,
            "param_group must be a dict",
        ),
        (
            lambda: opt.add_param_group({"params": {torch.nn.Parameter(torch.randn(3))}}),
            TypeError,
            r"param_group\['params'\] is a set",
        ),
        (
            lambda: choose_optimizer({torch.nn.Parameter(torch.randn(3))}),
            TypeError,
            "model_or_params is a set",
        ),
        (
            lambda: choose_optimizer([{"params": {torch.nn.Parameter(torch.randn(3))}}]),
            TypeError,
            r"param group 0\['params'\] is a set",
        ),
        (lambda: opt.load_state_dict(sd), ValueError, "param 0: exp_avg is a sparse tensor"),
        (
            lambda: decide(fp, 10**9, probe_capabilities("cpu"), {"memory_fraction": 0.5}),
            TypeError,
            "policy must be an optladder Policy",
        ),  # type: ignore[arg-type]
        (lambda: decide({}, 10**9, probe_capabilities("cpu")), TypeError, "footprint must be"),  # type: ignore[arg-type]
        (lambda: choose_optimizer(m, free_memory=0, strict="no"), TypeError, "strict must be True"),  # type: ignore[arg-type]
        (lambda: choose_optimizer(m, free_memory=0, strict=1), TypeError, "strict must be True"),  # type: ignore[arg-type]
        (
            lambda: opt.follow_checkpoint([{"rung": "int4", "rung_origin": "escalated"}]),
            ValueError,
            r"\['rung'\]='int4' is not a rung",
        ),
        (
            lambda: opt.follow_checkpoint([{"rung": "8bit", "rung_origin": "nowhere"}]),
            ValueError,
            "is not an origin",
        ),
    ]
    before = snapshot(opt)
    for call, kind, match in cases:
        with pytest.raises(kind, match=match):
            call()
    assert_same(snapshot(opt), before)
    assert len(opt.param_groups) == 1


def test_numpy_numbers_are_taken_like_python_ones() -> None:
    m = _model()
    a = choose_optimizer(m, free_memory=np.int64(2**33), lr=np.float32(0.5))
    b = choose_optimizer(m, free_memory=2**33, lr=0.5)
    assert a.decision.free_memory == b.decision.free_memory == 2**33
    fp = measure_footprint(m)
    caps = probe_capabilities("cpu")
    assert decide(fp, np.int64(10**9), caps).rung == decide(fp, 10**9, caps).rung  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="free_memory"):
        choose_optimizer(m, free_memory=np.int64(-1))


BAD_ARGUMENTS = {
    "lr": [-1.0, float("nan"), "1e-3", True, torch.tensor([1.0, 2.0])],
    "betas": [(0.9,), (1.0, 0.999), (0.9, -0.1), "ab"],
    "eps": [-1e-8, float("inf")],
    "weight_decay": [-0.1, None],
    "free_memory": [-1, "24 bananas", float("nan"), np.int64(-5)],
    "rung": ["int4", 8, ""],
    "seed": [-1, 2**64, 1.5],
    "rounding": ["Stochastic", None],
    "strict": ["no", 0, None],
    "max_retries": [-1, 1.5, True],
    "decoupled_weight_decay": [None, 1, "yes"],
}
GOOD_ARGUMENTS = {
    "lr": [(np.float64(0.01), 0.01), (torch.tensor(0.01), 0.01)],
    "free_memory": [(np.int64(2**30), 2**30), (np.float64(2**30), 2**30), ("1GiB", 2**30)],
    "weight_decay": [(np.float32(0.25), 0.25)],
}


def test_random_arguments_property() -> None:
    """Property test (seeded): choose_optimizer with one random argument from a pool of
    bad values is refused with a ValueError/TypeError naming it and the params
    unchanged; a good value in another type (NumPy, a tensor, a string) steps exactly
    like its plain-Python equal."""
    rng = random.Random(21)
    for _ in range(40):
        m = _model()
        start = [p.detach().clone() for p in m.parameters()]
        if rng.random() < 0.7:
            name = rng.choice(list(BAD_ARGUMENTS))
            value = rng.choice(BAD_ARGUMENTS[name])
            kwargs = {"free_memory": GiB, name: value}
            with pytest.raises((ValueError, TypeError)) as info:
                choose_optimizer(m, **kwargs)
            text = str(info.value)
            assert name.split("_")[0] in text or name in text, (name, value, text)
            assert all(torch.equal(a, b) for a, b in zip(start, m.parameters()))
            continue
        name = rng.choice(list(GOOD_ARGUMENTS))
        value, plain = rng.choice(GOOD_ARGUMENTS[name])
        ref_model = copy.deepcopy(m)
        opt = choose_optimizer(m, **{"free_memory": GiB, name: value})
        ref = choose_optimizer(ref_model, **{"free_memory": GiB, name: plain})
        for s in range(2):
            _grads(list(m.parameters()), s)
            _grads(list(ref_model.parameters()), s)
            opt.step()
            ref.step()
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_model.parameters()))


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("grads", ["fresh", "kept"])
@pytest.mark.parametrize("resize", ["new memory", "same address", "smaller"])
def test_a_param_resized_under_the_optimizer_is_refused_on_every_rung(
    rung: str, grads: str, resize: str
) -> None:
    """``param.data = other`` of another element count after the state was made (model
    surgery): the next step is refused before anything is written, naming the param and
    the tensor whose size differs; torch's fused CPU kernel would write past the old
    moments (heap corruption), the C kernels would step part of the param. With the
    param's state dropped, the optimizer goes on from a fresh state, as torch's AdamW
    does for a new param (the fp32 rung's step equals torch's)."""
    if rung == "8bit":
        pytest.importorskip("bitsandbytes")
    buf = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    keep = torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(1)))
    q = torch.nn.Parameter(buf[:5_000])
    opt = choose_optimizer([keep, q], lr=1e-3, rung=rung, free_memory="64GiB", environ={})
    keep.grad, q.grad = torch.ones(300), torch.ones(5_000)
    opt.step()
    before = [keep.detach().clone(), q.detach().clone()]
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[q].items()}
    n = {"new memory": 8_000, "same address": 8_000, "smaller": 3_000}[resize]
    q.data = torch.randn(n) if resize == "new memory" else buf[:n]
    resized = q.detach().clone()
    if grads == "fresh":  # new grad tensors: every grad is checked again
        q.grad, keep.grad = torch.ones(n), torch.full((300,), 2.0)
    tensor = "grad" if grads == "kept" else ("state1" if rung == "8bit" else "exp_avg")
    match = rf"param 1 of group 0 has {n:,} elements but its {tensor} has "
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(keep.detach(), before[0]) and torch.equal(q.detach(), resized)
    for key, value in opt.state[q].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state[key]), key
    del opt.state[q]
    q.grad = torch.ones(n)
    opt.step()
    assert int(opt.state[q]["step"]) == 1 and int(opt.state[keep]["step"]) == 2
    if rung == "fp32":
        ref_param = torch.nn.Parameter(resized.clone())
        ref_param.grad = torch.ones(n)
        torch.optim.AdamW([ref_param], lr=1e-3, fused=True).step()
        assert torch.equal(q.detach(), ref_param.detach())


@pytest.mark.parametrize(
    ("rung", "dtype", "match"),
    [
        ("fp32", torch.float64, r"is torch.float64 but its exp_avg is torch.float32"),
        ("8bit", torch.float64, r"float64"),
    ],
)
def test_params_converted_by_module_to_after_their_state_are_refused(
    rung: str, dtype: torch.dtype, match: str
) -> None:
    """``module.to(dtype)`` keeps the Parameter objects and swaps their data: a dtype the
    rung's engine cannot step from the state it has (torch's AdamW keeps moments in the
    param's dtype; 8bit would round float64 params through float32) is refused before
    anything changes, step counts and ``committed_steps`` included (it failed in the
    commit, or stepped float64 params in float32)."""
    if rung == "8bit":
        pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    opt = choose_optimizer(model, lr=1e-2, rung=rung, free_memory="64GiB", environ={})
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    model.to(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    steps = [opt.state[p]["step"] for p in model.parameters()]
    steps = [int(s) for s in steps]
    with pytest.raises(ValueError, match=match) as info:
        opt.step()
    assert "the params changed since the last step" in str(info.value)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == steps == [1, 1]
    assert opt.committed_steps == 1


@pytest.mark.parametrize("where", ["same group", "another group", "a pinned group"])
def test_a_param_appended_twice_by_hand_is_refused_and_a_new_one_is_stepped(where: str) -> None:
    """Progressive unfreezing by ``opt.param_groups[i]["params"].append(p)``: a param the
    optimizer already holds is refused before the step (it was stepped twice, or broke
    the commit across engines), naming both places; a new param appended so is stepped
    from a fresh state, as torch's AdamW does (its values equal torch's)."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(64)) for _ in range(3))
    second = {"params": [b]} if where != "a pinned group" else {"params": [b], "rung": "bf16"}
    opt = choose_optimizer(
        [{"params": [a]}, second], lr=1e-2, rung="fp32", free_memory="64GiB", environ={}
    )
    for p in (a, b):
        p.grad = torch.ones(64)
    opt.step()
    target = opt.param_groups[0 if where == "same group" else 1]["params"]
    target.append(a)
    before = [p.detach().clone() for p in (a, b)]
    with pytest.raises(ValueError, match=r"is the same tensor as param 0 of group 0; list it"):
        opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
    assert int(opt.state[a]["step"]) == int(opt.state[b]["step"]) == 1
    target.pop()
    start = c.detach().clone()
    opt.param_groups[0]["params"].append(c)
    c.grad = torch.ones(64)
    opt.step()
    assert int(opt.state[a]["step"]) == 2 and int(opt.state[c]["step"]) == 1
    ref = torch.nn.Parameter(start)
    ref.grad = torch.ones(64)
    torch.optim.AdamW([ref], lr=1e-2, fused=True).step()
    assert torch.equal(c.detach(), ref.detach())


@pytest.mark.parametrize("moved_to", ["bf16", "8bit"])
def test_a_param_back_in_its_group_after_a_move_is_refused_before_any_write(
    moved_to: str,
) -> None:
    """A param taken out of its group by hand keeps its state in ``opt.state`` (torch
    keeps it too); a move to another rung converts the groups' params only, so back in
    its group (appended by hand) its state is in the old rung's layout. The next step is
    refused before any write, naming the param and both layouts (on 8bit the commit
    failed half-way, a PartialStepError; on bf16 the kernel's table refused
    ``exp_avgs[2]``); without its grad too. With its state dropped, as the message says,
    it steps from a fresh state."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(64, 80)) for _ in range(3))
    opt = choose_optimizer([a, b, c], lr=1e-2, free_memory="64GiB", environ={})
    for p in (a, b, c):
        p.grad = torch.ones(64, 80)
    opt.step()
    removed = opt.param_groups[0]["params"].pop()
    opt.migrate_to(moved_to, "test")
    opt.param_groups[0]["params"].append(removed)
    for grad in (None, torch.ones(64, 80)):
        removed.grad = grad
        before = [p.detach().clone() for p in (a, b, c)]
        with pytest.raises(ValueError) as info:
            opt.step()
        message = str(info.value)
        assert "param 2 of group 0" in message and "del opt.state[param]" in message
        assert "exp_avg torch.float32" in message
        want = "bfloat16 exp_avg" if moved_to == "bf16" else "bitsandbytes' 8-bit state"
        assert want in message
        assert all(torch.equal(p.detach(), x) for p, x in zip((a, b, c), before))
        assert [int(opt.state[p]["step"]) for p in (a, b, c)] == [1, 1, 1]
    del opt.state[removed]
    opt.step()
    assert [int(opt.state[p]["step"]) for p in (a, b, c)] == [2, 2, 1]


@pytest.mark.parametrize("rung", RUNGS)
def test_channels_last_mid_run_keeps_each_element_with_its_moments(rung: str) -> None:
    """``model.to(memory_format=torch.channels_last)`` between steps gives the conv
    weights new memory in another order (same Parameter objects): the moments made in
    the old order are laid out again before the next step, so each element keeps its
    own (torch's fused kernel pairs them by memory order: it stepped every weight with
    another element's moments). The weights equal a run without the switch."""
    if rung == "8bit":
        pytest.importorskip("bitsandbytes")

    def run(switch: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Conv2d(16, 32, 3)
        opt = choose_optimizer(model, lr=1e-2, rung=rung, free_memory="64GiB", environ={})
        x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1))
        for step in range(3):
            if switch and step == 1:
                model.to(memory_format=torch.channels_last)
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return model.weight.detach().contiguous()

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("change", ["layout", "size"])
def test_a_kept_grad_given_other_memory_is_checked_again(rung: str, change: str) -> None:
    """The step checks grads again only when they change; a kept grad object whose
    ``.data`` was replaced (by a hook, bucketing code) is a change: a grad of another
    size is refused before anything is written on every rung (the fp32 rung read past
    it), one of another layout where the rung needs its param's (the fp32 rung stepped
    elements with other elements' grads) and otherwise stepped as the same rung steps the
    same values laid out like the param."""
    if rung == "8bit":
        pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(80, 80))
    opt = choose_optimizer([w], lr=1e-2, rung=rung, free_memory="64GiB", environ={})
    g = torch.randn(80, 80, generator=torch.Generator().manual_seed(1))
    w.grad = g.clone()
    opt.step()
    before = w.detach().clone()
    saved = copy.deepcopy(opt.state_dict())
    if change == "size":
        w.grad.data = torch.ones(100)
        with pytest.raises(ValueError, match=r"param 0 of group 0 has a torch.float32 grad of"):
            opt.step()
        assert torch.equal(w.detach(), before) and int(opt.state[w]["step"]) == 1
        return
    w.grad.data = g.t().contiguous().t()  # the same values, column-major
    if rung == "fp32":
        with pytest.raises(ValueError, match=r"grad with strides \(1, 80\) but the param"):
            opt.step()
        assert torch.equal(w.detach(), before)
        return
    opt.step()
    twin_w = torch.nn.Parameter(before.clone())  # the same rung, the grad row-major
    twin = choose_optimizer([twin_w], lr=1e-2, rung=rung, free_memory="64GiB", environ={})
    twin.load_state_dict(copy.deepcopy(saved))
    twin_w.grad = g.clone()
    twin.step()
    if rung == "bf16":  # the eager path and the kernel write the same bits
        assert torch.equal(w.detach(), twin_w.detach())
        return
    # 8bit: a grad that is not contiguous goes through bitsandbytes' CPU update, whose
    # float32 update differs from the kernel's in the rounding of its last operations:
    # a few float32 ulps of the largest magnitude involved (old param, new one, 4 * lr),
    # as tests/test_kernels_8bit_cpu.py derives for one step from the same state
    scale = before.abs() + twin_w.detach().abs() + 4 * 1e-2
    ulp = torch.exp2(torch.floor(torch.log2(scale))) * torch.finfo(torch.float32).eps
    assert bool(((w.detach() - twin_w.detach()).abs() <= 4 * ulp).all())


def test_an_8bit_checkpoint_entry_without_its_quant_state_is_refused_saying_so() -> None:
    """bitsandbytes' layout keeps the codes under ``__bnb_optimizer_quant_state__``; an
    entry that lost it holds a step alone: the refusal names both layouts' moments and
    the missing key (it named 'exp_avg' alone), and nothing changes."""
    pytest.importorskip("bitsandbytes")
    model = torch.nn.Linear(64, 4096)
    opt = choose_optimizer(model, rung="8bit", free_memory="1TiB", environ={})
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    before = snapshot(opt)
    sd = opt.state_dict()
    del sd["state"][0]["__bnb_optimizer_quant_state__"]
    with pytest.raises(
        ValueError, match=r"param 0: the state holds a 'step' but no moments: .*'state1'.*lacks"
    ):
        opt.load_state_dict(sd)
    assert_same(snapshot(opt), before)


def _stepped(rung: str) -> tuple[torch.optim.Optimizer, dict]:
    """An optimizer on ``rung`` over an 8,192-element weight (8-bit codes on 8bit) and a
    bias, stepped twice, and a deep copy of its state dict."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128)
    opt = choose_optimizer(model, rung=rung, free_memory=GiB, environ={})
    for s in range(2):
        _grads(list(model.parameters()), s)
        opt.step()
    return opt, copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("rung", RUNGS)
def test_a_step_past_floats_range_is_refused_naming_the_rungs_step_range(rung: str) -> None:
    """10**400 is a whole number no float holds: it was an OverflowError from the check;
    now the range check names it and the rung's range, and nothing changes."""
    opt, saved = _stepped(rung)
    before = snapshot(opt)
    entry = saved["state"][0]
    entry["step"] = 10**400  # a Python int, as bitsandbytes keeps its step
    with pytest.raises(
        ValueError,
        match=r"param 0 of the state_dict has step 10{400}; this rung takes step counts in \[0, ",
    ):
        opt.load_state_dict(saved)
    assert_same(snapshot(opt), before)


@pytest.mark.parametrize(
    ("rung", "dtype", "value", "kept_as"),
    [
        ("fp32", torch.float64, 1e300, "torch.float32"),
        ("bf16", torch.float64, 1e300, "torch.bfloat16"),
        ("8bit", torch.float64, 1e300, "torch.float32"),
        # finite in float32, past bfloat16's largest finite (3.3895e38): rounds to inf
        ("bf16", torch.float32, 3.4e38, "torch.bfloat16"),
    ],
)
def test_moments_past_the_range_of_the_rungs_format_are_refused(
    rung: str, dtype: torch.dtype, value: float, kept_as: str
) -> None:
    """Finite saved moments that the rung's format cannot hold became infinite moments
    (the 8-bit rung: infinite block scales); refused naming the key, the largest
    magnitude and the format, nothing changed."""
    opt, _ = _stepped(rung)
    _, saved = _stepped("fp32")
    entry = saved["state"][0]
    entry["exp_avg_sq"] = torch.full_like(entry["exp_avg_sq"], value, dtype=dtype)
    assert_load_refused(
        opt,
        saved,
        r"param 0 of the state_dict: exp_avg_sq holds values up to "
        + re.escape(f"{value:.4g} in magnitude; this param's rung keeps them as {kept_as}"),
    )
    # the largest value the format holds loads
    entry["exp_avg_sq"].fill_(torch.finfo(getattr(torch, kept_as[6:])).max)
    opt.load_state_dict(saved)


def test_a_param_listed_twice_in_the_saved_groups_is_refused_naming_it() -> None:
    """Saved groups listing one place twice ([0, 0]) gave both live params the state
    of place 0, so the second param was stepped from the first one's moments; refused
    naming the place and both groups, nothing changed."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(64, generator=gen)) for _ in range(2))
    opt = choose_optimizer([{"params": [a]}, {"params": [b]}], rung="fp32", free_memory=GiB)
    _grads([a, b], 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][1]["params"] = [0]  # place 1's state is there still
    del saved["state"][1]
    _grads([a, b], 1)
    opt.step()
    assert_load_refused(
        opt, saved, r"param group 1 of the state_dict lists param 0, which param group 0"
    )


@pytest.mark.parametrize("missing", ["state1", "state2"])
def test_an_8bit_entry_missing_its_codes_is_refused_naming_them(missing: str) -> None:
    """An entry holding bitsandbytes' keys but not ``state1`` was judged an Adam entry
    and refused for holding 'absmax1', ... (the missing key unnamed)."""
    pytest.importorskip("bitsandbytes")
    opt, saved = _stepped("8bit")
    del saved["state"][0]["__bnb_optimizer_quant_state__"][missing]
    assert_load_refused(opt, saved, rf"param 0: the state has no tensor '{missing}'")


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize(
    ("entry", "found"),
    [(None, "NoneType"), ([], "list"), (torch.zeros(128), "Tensor"), ((), "tuple")],
)
def test_a_param_state_that_is_not_a_dict_is_refused_naming_the_param(
    rung: str, entry: object, found: str
) -> None:
    """A param's saved state of None or [] loaded as no state (the bias's moments
    and step count silently lost: it restarted from zero moments); a tensor failed on
    its truth value (RuntimeError). Refused naming the param and the type, nothing
    changed."""
    opt, _ = _stepped(rung)
    _, saved = _stepped("fp32")
    saved["state"][1] = entry
    assert_load_refused(
        opt, saved, rf"param 1: its state must be a dict \(an empty one for no state\), got {found}"
    )


@pytest.mark.parametrize("rung", RUNGS)
def test_bitsandbytes_wrapped_state_that_is_not_a_dict_is_refused_naming_the_param(
    rung: str,
) -> None:
    """bitsandbytes' state_dict() puts a param's 8-bit tensors in a dict under
    '__bnb_optimizer_quant_state__'; a tensor there failed with a TypeError from
    dict.update. Refused naming the param and the type, nothing changed."""
    opt, _ = _stepped(rung)
    _, saved = _stepped("8bit")
    saved["state"][0]["__bnb_optimizer_quant_state__"] = torch.zeros(3)
    assert_load_refused(
        opt,
        saved,
        r"param 0: its state's '__bnb_optimizer_quant_state__' must be a dict of tensors, "
        r"as bitsandbytes' state_dict\(\) wraps them, got Tensor",
    )


def _mixed(kind: str) -> dict:
    """One param's saved state holding two forms, as torch's full-state-dict loading
    leaves it when the checkpoint's form is not the live optimizer's: the keys the
    checkpoint lacks keep the template's values."""
    _, adam = _stepped("fp32")
    _, bnb = _stepped("8bit")
    wrapped = bnb["state"][0]["__bnb_optimizer_quant_state__"]
    if kind == "flat+wrapped":  # an old flat 8-bit checkpoint into a wrapped template
        return {**wrapped, "step": 2, "__bnb_optimizer_quant_state__": wrapped}
    rows = 128  # the row form of the 128 x 64 weight: each row's block and scale
    phase = (torch.arange(rows) * 64 % 256).to(torch.int32)
    slot = torch.arange(rows) * 64 // 256
    row_form = {
        "block_phase": phase,
        "block_absmax1": torch.stack([wrapped["absmax1"][slot], torch.zeros(rows)], 1),
        "block_absmax2": torch.stack([wrapped["absmax2"][slot], torch.zeros(rows)], 1),
    }
    mixed = {
        **row_form,
        **{k: wrapped[k] for k in ("state1", "state2", "qmap1", "qmap2")},
        "step": 2,
        "__bnb_optimizer_quant_state__": wrapped,
    }
    if kind == "adam+rows+wrapped":
        mixed.update({k: adam["state"][0][k] for k in ("exp_avg", "exp_avg_sq")})
    return mixed


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("source", RUNGS)
def test_a_checkpoint_merged_into_a_template_of_another_form_loads_the_checkpoint(
    rung: str, source: str
) -> None:
    """torch's set_optimizer_state_dict(full_state_dict=True) loads a checkpoint into the
    live optimizer's own state dict and keeps the keys the checkpoint lacks, so a
    checkpoint of another form arrives beside the live form's values (it was refused for
    holding the other layout's keys). The live form's keys are the template's: the load
    equals loading the checkpoint alone, bit for bit."""
    pytest.importorskip("bitsandbytes")
    opt, template = _stepped(rung)
    _, saved = _stepped(source)
    for key in saved["state"]:  # saved after 2 steps on another rung: other values
        saved["state"][key]["step"] = 5
    merged = copy.deepcopy(template)
    for key, st in saved["state"].items():
        merged["state"][key] = {**merged["state"][key], **copy.deepcopy(st)}
    opt.load_state_dict(merged)
    alone, _ = _stepped(rung)
    alone.load_state_dict(saved)
    assert_same(snapshot(opt), snapshot(alone))
    assert read_step(opt.state[next(iter(opt.state))]) == 5


@pytest.mark.parametrize(
    ("rung", "kind", "forms"),
    [
        ("fp32", "flat+wrapped", "bitsandbytes' layout .*; bitsandbytes' layout under"),
        ("bf16", "rows+wrapped", "the row form .*; bitsandbytes' layout under"),
        ("8bit", "adam+rows+wrapped", "3 forms: the Adam layout"),
    ],
)
def test_a_state_holding_two_forms_but_not_the_live_one_is_refused(
    rung: str, kind: str, forms: str
) -> None:
    """Forms of which none is the live optimizer's cannot be told apart (which values
    are the checkpoint's?): refused naming them, nothing changed. The row form beside
    bitsandbytes' wrapped state was read alone; a flat 8-bit state beside wrapped values
    took the wrapped ones."""
    pytest.importorskip("bitsandbytes")
    opt, _ = _stepped(rung)
    _, saved = _stepped("fp32")
    saved["state"][0] = _mixed(kind)
    assert_load_refused(opt, saved, rf"param 0: its state holds the keys of .*{forms}")


@pytest.mark.parametrize("rung", RUNGS)
def test_loaded_group_options_are_the_optimizers_own_not_the_checkpoints(rung: str) -> None:
    """Loading copies the saved groups' values, as torch's load_state_dict deep-copies
    them: a tensor lr was the checkpoint's object, so an LR scheduler on one optimizer
    set the lr of every optimizer loaded from the same state dict, and of the one that
    saved it."""
    gen = torch.Generator().manual_seed(0)
    src_p = torch.nn.Parameter(torch.randn(64, generator=gen))
    src = choose_optimizer([src_p], lr=torch.tensor(0.5), rung="fp32", free_memory=GiB)
    _grads([src_p], 0)
    src.step()
    saved = src.state_dict()
    saved["param_groups"][0]["betas"] = [0.9, 0.99]  # a list, as JSON or YAML give it
    opts = []
    for _ in range(2):
        p = torch.nn.Parameter(torch.randn(64, generator=gen))
        opt = choose_optimizer([p], lr=torch.tensor(0.1), rung=rung, free_memory=GiB)
        opt.load_state_dict(saved)
        opts.append(opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda epoch: 0.25)
    saved["param_groups"][0]["betas"][1] = 0.5
    assert float(opts[0].param_groups[0]["lr"]) == 0.125  # 0.5 * 0.25
    assert float(opts[1].param_groups[0]["lr"]) == 0.5
    assert float(src.param_groups[0]["lr"]) == 0.5
    assert [list(o.param_groups[0]["betas"]) for o in opts] == [[0.9, 0.99], [0.9, 0.99]]
    del scheduler


@pytest.mark.parametrize("rung", RUNGS)
def test_an_8bit_second_moment_code_book_with_negative_values_is_refused(rung: str) -> None:
    """``state2`` (exp_avg_sq, a running average of squared grads) indexes an unsigned
    book; codes decoded with a book holding negative values gave negative exp_avg_sq,
    whose square root made the next fp32 or bf16 step NaN."""
    pytest.importorskip("bitsandbytes")
    opt, _ = _stepped(rung)
    _, saved = _stepped("8bit")
    inner = saved["state"][0]["__bnb_optimizer_quant_state__"]
    assert inner["state2"].dtype == torch.uint8
    inner["qmap2"] = -inner["qmap2"]  # bitsandbytes' unsigned map: one 0, 255 positive
    assert_load_refused(
        opt, saved, r"param 0: qmap2 \(the code book state2's codes index\) holds 255 "
    )


@pytest.mark.parametrize("rung", ["fp32", "8bit"])
@pytest.mark.parametrize(
    ("other", "message"),
    [
        ("Lion8bit", r"only 'state1': one moment, as bitsandbytes' 1-state optimizers"),
        ("Lion", r"only 'state1': one moment, as bitsandbytes' 1-state optimizers"),
        ("Adafactor", r"'beta2_decay', which torch.optim.Adafactor writes"),
    ],
)
def test_another_optimizers_checkpoint_is_refused_naming_that_optimizer(
    rung: str, other: str, message: str
) -> None:
    """bitsandbytes' Lion (1 state) and torch's Adafactor: refused naming what wrote them
    (the messages had named a missing 'state2' and Adafactor's eps tuple), nothing
    changed."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    src = torch.nn.Linear(64, 128)  # the params of _stepped's optimizer
    makers = {
        "Lion8bit": lambda ps: bnb.optim.Lion8bit(ps, min_8bit_size=16),
        "Lion": lambda ps: bnb.optim.Lion(ps),
        "Adafactor": lambda ps: torch.optim.Adafactor(ps),
    }
    foreign = makers[other](src.parameters())
    src(torch.randn(4, 64)).sum().backward()
    foreign.step()
    opt, _ = _stepped(rung)
    before = snapshot(opt)
    saved = foreign.state_dict()
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert_same(snapshot(opt), before)


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_codes_cast_to_a_float_are_refused_not_read_as_moments(
    rung: str, dtype: torch.dtype
) -> None:
    """An 8-bit entry whose ``state1``/``state2`` codes were cast to a float (its absmax
    and qmap kept) was read as float moments: code 62 loaded as ``exp_avg == 62.0``
    (bitsandbytes keeps float moments only without block scales)."""
    pytest.importorskip("bitsandbytes")
    opt, _ = _stepped(rung)
    _, saved = _stepped("8bit")
    inner = saved["state"][0]["__bnb_optimizer_quant_state__"]
    assert inner["state1"].dtype == torch.uint8 and "absmax1" in inner
    for name in ("state1", "state2"):
        cast = copy.deepcopy(saved)
        codes = cast["state"][0]["__bnb_optimizer_quant_state__"]
        codes[name] = codes[name].to(dtype)
        assert_load_refused(
            opt, cast, rf"param 0: {name} has dtype {dtype} beside absmax{name[-1]}, the block"
        )


@pytest.mark.parametrize("loader", RUNGS)
@pytest.mark.parametrize("saver", RUNGS)
def test_a_saved_state_of_step_0_with_moments_is_refused_not_dropped(
    saver: str, loader: str
) -> None:
    """A saved state with step 0 loads as no state (state_dict() saves step 0 and zero
    moments for a param that never stepped). With non-zero moments (here: the weight's
    after two steps, its step set to 0 by hand) they were dropped silently; torch's
    AdamW would keep them. Refused naming the param, step 0 and the key; nothing
    changed. The same state with its moments zeroed still loads as no state."""
    opt, _ = _stepped(loader)
    _, saved = _stepped(saver)
    saved["state"][0]["step"] = 0
    key = "exp_avg" if saver != "8bit" else "absmax1"
    assert_load_refused(opt, saved, rf"param 0 of the state_dict has step 0 but a non-zero {key}")
    for entry in (saved["state"][0], saved["state"][0].get("__bnb_optimizer_quant_state__", {})):
        for name, value in entry.items():
            if name in ("exp_avg", "exp_avg_sq", "absmax1", "absmax2") or (
                name.startswith("state") and value.dtype != torch.uint8
            ):
                value.zero_()
    opt.load_state_dict(saved)
    weight = opt.param_groups[0]["params"][0]
    assert not opt.state.get(weight)  # no state: its next step is its first
    assert read_step(unwrap_bnb_state(opt.state[opt.param_groups[0]["params"][1]])) == 2
