"""Every step exactly once: all-or-nothing steps under any failure, and a ladder that
never reruns a committed step (issue 11; the cases rel-01..22 and bug-10 as tests)."""

from __future__ import annotations

import copy
import math
import signal
import warnings

import pytest
import torch

from memtools import FailNthAllocation, _fresh_results
from optladder import Ladder, OptimizerOutOfMemoryError, choose_optimizer
from optladder.oom import requested_bytes
from optladder.optimizers.capabilities import fused_adamw_runs
from optladder.optimizers.kernels import cpu
from optladder.optimizers.migrate import _join_moment, _narrowed, _split_moment
from optladder.selector.optimizer import PartialStepError
from runs import trained
from snapshots import assert_same, snapshot

RUNGS = ("fp32", "bf16", "8bit")


class _Net(torch.nn.Module):
    """An embedding (8,192 elements: quantized on the 8-bit rung) and a small body."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(128, 64)
        self.body = torch.nn.Linear(64, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.body(self.emb(idx)).square().mean()


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(100 + i))


def _groups(net: _Net, pin: str | None) -> list[dict]:  # type: ignore[type-arg]
    emb: dict = {"params": [net.emb.weight]}  # type: ignore[type-arg]
    if pin is not None:
        emb["rung"] = pin
    return [emb, {"params": list(net.body.parameters()), "lr": 5e-3}]


def _build(rung: str, pin: str | None):  # type: ignore[no-untyped-def]
    net = _Net()
    opt = choose_optimizer(
        _groups(net, pin), lr=1e-2, free_memory="64GiB", environ={"OPTLADDER_RUNG": rung}
    )
    # OPTLADDER_RUNG fixes the rung; let the test's optimizer escalate like a policy one
    opt._decision = opt.decision.model_copy(
        update={"overrides": opt.decision.overrides.model_copy(update={"fixed": None})}
    )
    return net, opt


def _step_fn(net: _Net, opt):  # type: ignore[no-untyped-def]
    def train_step(idx: torch.Tensor) -> float:
        opt.zero_grad()
        loss = net(idx)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return train_step


def _no_reasons(snap):  # type: ignore[no-untyped-def]
    """A snapshot without the groups' ``rung_reason`` (its words quote the OOM)."""
    for group in snap[1]["param_groups"]:
        group.pop("rung_reason", None)
    return snap


# ------------------------------------------------------------ fault injection, whole steps
@pytest.mark.parametrize("pin", [None, "fp32", "8bit"])
@pytest.mark.parametrize("rung", RUNGS)
def test_a_failed_allocation_anywhere_in_a_guarded_step_neither_loses_nor_doubles_it(
    rung: str, pin: str | None
) -> None:
    """Fail the k-th allocation of a Ladder-guarded train step (forward, backward,
    prepare, escalation; the commit has none) for sampled k, then run one more step. Each
    run equals, bit for bit, a run that never failed and moved rungs at the same points
    (the escalations the failing run recorded), and takes exactly one step per batch."""
    if pin == rung:
        pytest.skip("a pin equal to the decided rung is the unpinned case")
    net, opt = _build(rung, pin)
    _step_fn(net, opt)(_batch(0))
    batch, step = _batch(1), _step_fn(net, opt)
    with FailNthAllocation() as counter:
        Ladder(opt).run(step, batch)
    total = counter.count
    assert total >= 10
    for k in sorted({1, total // 2, total}):
        net, opt = _build(rung, pin)
        _step_fn(net, opt)(_batch(0))
        before = snapshot(opt)
        raised = None
        ladder, step = Ladder(opt), _step_fn(net, opt)
        try:
            with FailNthAllocation(k):
                ladder.run(step, batch)
        except OptimizerOutOfMemoryError as exc:  # the move itself failed: nothing changed
            raised = exc
            assert_same(snapshot(opt), before)
        _step_fn(net, opt)(_batch(2))
        # the reference: no fault, the same moves at the same step counts
        ref_net, ref = _build(rung, pin)
        moves = {e.step for e in opt.escalations}
        for i in range(3):
            if raised is not None and i == 1:
                continue  # the failed call committed nothing
            if i in moves:
                ref.escalate("as the failing run did")
            _step_fn(ref_net, ref)(_batch(i))
        assert opt.rung == ref.rung, k
        assert_same(_no_reasons(snapshot(opt)), _no_reasons(snapshot(ref)))
        steps = 2 if raised is not None else 3
        for p in net.parameters():
            assert int(float(opt.state[p]["step"])) == steps, k


@pytest.mark.parametrize(("src", "dst"), [("fp32", "bf16"), ("bf16", "8bit"), ("8bit", "fp32")])
def test_a_load_that_fails_at_any_allocation_changes_nothing(src: str, dst: str) -> None:
    """Fail the k-th allocation of load_state_dict (sampled k; a pinned group beside): the
    optimizer is as before, and loading again then stepping equals a clean load."""

    def trained_on(rung: str):  # type: ignore[no-untyped-def]
        net, opt = _build(rung, "fp32")
        for i in range(2):
            _step_fn(net, opt)(_batch(i))
        return net, opt

    _, source = trained_on(src)
    saved = copy.deepcopy(source.state_dict())
    net, opt = trained_on(dst)
    sd = copy.deepcopy(saved)
    with FailNthAllocation() as counter:
        opt.load_state_dict(sd)
    _step_fn(net, opt)(_batch(5))
    expected = _no_reasons(snapshot(opt))
    for k in sorted({1, counter.count // 2, counter.count}):
        net, opt = trained_on(dst)
        before = snapshot(opt)
        sd = copy.deepcopy(saved)
        with pytest.raises(torch.OutOfMemoryError), FailNthAllocation(k):
            opt.load_state_dict(sd)
        assert opt.rung == dst
        assert_same(snapshot(opt), before)
        opt.load_state_dict(copy.deepcopy(saved))
        _step_fn(net, opt)(_batch(5))
        assert_same(_no_reasons(snapshot(opt)), expected)


# ------------------------------------------------------------ a committed step is never rerun
def test_an_oom_after_the_optimizer_step_is_not_rerun() -> None:
    """rel-01: an OOM after opt.step() (an EMA update, a metric): no rerun; the optimizer
    escalates for the next step and the committed step stands once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    ref_model = copy.deepcopy(model)
    opt = choose_optimizer(model, lr=1e-2, free_memory="8GiB")
    x = torch.randn(16, 32)
    calls = []

    @Ladder(opt).guard
    def train_step() -> float:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (after opt.step)")
        return 1.0

    assert train_step() is None
    assert len(calls) == 1 and opt.committed_steps == 1
    assert opt.rung == "bf16" and "after the optimizer step committed" in opt.escalations[0].reason
    # the one step equals torch's AdamW (independent reference), moments moved to bf16 after
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ref_model(x).pow(2).mean().backward()
    ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
        assert int(opt.state[p]["step"]) == 1


def _fused_fails_on_second_call(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch._fused_adamw_
    calls = {"n": 0}

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (in the fused kernel)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", failing)


def test_a_commit_that_fails_part_way_is_reported_and_never_rerun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bug-10: torch's fused kernel fails on the second group after the first was written:
    PartialStepError names the groups, Ladder does not rerun, step counts are not doubled."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    opt = choose_optimizer(
        [{"params": a.parameters()}, {"params": b.parameters(), "lr": 5e-3}],
        lr=1e-2,
        free_memory="64GiB",
    )
    _fused_fails_on_second_call(monkeypatch)
    x = torch.randn(4, 8)

    def train_step() -> None:
        opt.zero_grad()
        b(a(x)).sum().backward()
        opt.step()

    with pytest.raises(PartialStepError) as info:
        Ladder(opt).run(train_step)
    assert info.value.partly == [0, 1] and info.value.stepped == [] == info.value.not_stepped
    assert "not retried" in str(info.value) and opt.partial_step is info.value
    assert opt.committed_steps == 1 and opt.rung == "fp32" and not opt.escalations
    assert int(opt.state[a.weight]["step"]) == 1  # written once, not twice


def test_the_bf16_cpu_kernel_commit_allocates_nothing_for_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rel-02: the C kernel's table (rows, the groups' options and the offsets prefix
    sums) is built in prepare and kept, so the commit's kernel call (one for all groups)
    allocates no tensor and cannot fail on input prepare accepted. The result equals one
    optimizer per group (round to nearest: no param-index keys)."""
    from optladder.optimizers import LadderAdamW

    torch.manual_seed(0)
    nets = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)]
    twin = copy.deepcopy(nets)
    real = cpu.run_table
    calls = []

    def counting(table, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(table.n_params)
        with FailNthAllocation() as counter:  # counts torch allocations
            out = real(table, **kwargs)
        assert counter.count == 0
        return out

    monkeypatch.setattr(cpu, "run_table", counting)
    hyper = {"lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.1}
    opt = LadderAdamW(
        [{"params": nets[0].parameters()}, {"params": nets[1].parameters(), **hyper}],
        lr=1e-2,
        rounding="nearest",
    )
    refs = [
        LadderAdamW(twin[0].parameters(), lr=1e-2, rounding="nearest"),
        LadderAdamW(twin[1].parameters(), rounding="nearest", **hyper),  # type: ignore[arg-type]
    ]
    x = torch.randn(16, 64)
    for _ in range(3):
        opt.zero_grad()
        nets[1](nets[0](x)).pow(2).mean().backward()
        opt.step()
    assert calls == [4] * 3  # one call per step: both groups, 2 params each
    for _ in range(3):
        for r in refs:
            r.zero_grad()
        twin[1](twin[0](x)).pow(2).mean().backward()
        for r in refs:
            r.step()
    assert calls == [4] * 3 + [2, 2] * 3  # the reference optimizers: one group each
    pairs = zip(
        [*nets[0].parameters(), *nets[1].parameters()],
        [*twin[0].parameters(), *twin[1].parameters()],
    )
    for i, (p, q) in enumerate(pairs):
        ref = refs[i // 2]
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        assert opt.state[p]["step"].dtype == torch.float64


# ------------------------------------------------------------ checks before the first write
@pytest.mark.parametrize(
    ("rung", "key", "value", "match"),
    [
        ("bf16", "seed", -1, "seed"),
        ("bf16", "decoupled_weight_decay", None, "decoupled_weight_decay"),
        ("bf16", "rounding", "nearst", "rounding"),
        ("fp32", "amsgrad", True, "amsgrad"),
        ("8bit", "maximize", True, "maximize"),
    ],
)
def test_a_bad_option_in_a_later_group_is_refused_before_any_write(
    rung: str, key: str, value: object, match: str
) -> None:
    """rel-15: options are checked for every group before anything is written."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
    opt = choose_optimizer(
        [{"params": a.parameters()}, {"params": b.parameters()}], rung=rung, lr=1e-2
    )
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[1][key] = value
    before = snapshot(opt)
    with pytest.raises(ValueError, match=f"param group 1.*{match}"):
        opt.step()
    assert_same(snapshot(opt), before)
    assert opt.committed_steps == 1


# ------------------------------------------------------------ exact counters
@pytest.mark.parametrize("rung", RUNGS)
def test_step_counts_stay_exact_past_2_24(rung: str) -> None:
    """rel-19: float32 stops counting at 2**24; every rung counts on."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = choose_optimizer([p], rung=rung, lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[p]
    if rung == "8bit":
        st["step"] = 2**24 - 2
    else:
        st["step"].fill_(2**24 - 2)
    counts = []
    for _ in range(4):
        p.grad = torch.randn_like(p)
        opt.step()
        counts.append(int(float(st["step"])))
    assert counts == [2**24 - 1, 2**24, 2**24 + 1, 2**24 + 2]


def test_bf16_steps_past_2_24_use_new_random_bits() -> None:
    """The C kernel and the eager oracle agree at step 2**24 + 1 and 2**24 + 2, and the two
    steps round with different bits (the key moves with the step)."""
    from optladder.optimizers import LadderAdamW

    torch.manual_seed(0)
    base = torch.randn(4096)
    out = {}
    for backend in ("auto", "eager"):
        p = torch.nn.Parameter(base.clone())
        opt = LadderAdamW([p], lr=1e-3, backend=backend)  # type: ignore[arg-type]
        p.grad = torch.ones_like(p)
        opt.step()
        opt.state[p]["step"].fill_(2**24)
        p.grad = torch.full_like(p, 0.5)
        opt.step()
        out[backend] = (p.detach().clone(), opt.state[p]["exp_avg"].clone())
        assert opt.state[p]["step"].item() == 2**24 + 1
    assert torch.equal(out["auto"][0], out["eager"][0])
    assert torch.equal(out["auto"][1], out["eager"][1])


@pytest.mark.parametrize(
    ("rung", "step", "ok"),
    [
        ("bf16", 5e9, False),
        ("bf16", 2**32 - 2, True),
        ("fp32", 5e9, True),
        ("fp32", 2.0**53, False),
        ("8bit", 5e9, True),  # bitsandbytes' int step, on the CPU kernel exact to 2**53 - 1
        ("8bit", 2.0**53, False),
    ],
)
def test_checkpoint_steps_outside_a_rungs_range_are_refused_at_load(
    rung: str, step: float, ok: bool
) -> None:
    """rel-06: the bf16 rung's random bits take steps below 2**32, float64 (and the 8bit
    rung's CPU path) counts to 2**53 - 1; a checkpoint outside is refused at load and
    nothing changes, one inside continues."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    opt = choose_optimizer([{"params": a.parameters()}, {"params": b.parameters()}], rung=rung)
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for i in (2, 3):
        sd["state"][i]["step"] = torch.tensor(step, dtype=torch.float64)
    before = snapshot(opt)
    if not ok:
        with pytest.raises(ValueError, match="param 2 of the state_dict has step"):
            opt.load_state_dict(sd)
        assert_same(snapshot(opt), before)
        return
    opt.load_state_dict(sd)
    opt.step()
    assert float(opt.state[b.weight]["step"]) == step + 1
    assert float(opt.state[a.weight]["step"]) == 2


@pytest.mark.parametrize(("step", "ok"), [(2**32 - 2, True), (2**32 - 1, False), (5e9, False)])
def test_low_precision_params_on_the_fp32_rung_take_the_bf16_rungs_step_range(
    step: float, ok: bool
) -> None:
    """bfloat16 params on the fp32 rung are stepped by optladder's kernel, whose random
    bits and bias corrections take 32-bit steps: a checkpoint past 2**32 - 2 is refused
    at load with nothing changed (it loaded, then every step failed with 'step must be
    in [0, 2**32)'); one at the limit continues."""
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = choose_optimizer(a.parameters(), rung="fp32")
    for p in a.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for i in (0, 1):
        sd["state"][i]["step"] = torch.tensor(step, dtype=torch.float64)
    if not ok:
        before = snapshot(opt)
        with pytest.raises(ValueError, match=r"param 0 of the state_dict has step .*below 2\*\*32"):
            opt.load_state_dict(sd)
        assert_same(snapshot(opt), before)
        return
    opt.load_state_dict(sd)
    opt.step()
    assert float(opt.state[a.weight]["step"]) == step + 1


@pytest.mark.parametrize("backend", ["cpu", "eager"])
def test_optladder_adamw_with_float32_moments_refuses_a_count_past_its_range_before_writing(
    backend: str,
) -> None:
    """LadderAdamW with float32 moments (the fp32 rung's engine of bfloat16/float16 params)
    steps from counts up to 2**32 - 2, as with bfloat16 moments; past it the step is
    refused before anything is written (the C route raised the key's bare range error,
    the eager one divided by zero in its commit: 1 - beta1**(2**32) came out 0 with the
    32-bit powering). At the limit the bias corrections are 1 (beta**(2**32 - 1)
    underflows): p = 1 - lr * m / (sqrt(v) + eps), m = 0.1, v = 0.001."""
    if backend == "cpu" and cpu.unavailable_reason() is not None:
        pytest.skip(str(cpu.unavailable_reason()))
    from optladder.optimizers.adamw import LadderAdamW

    def build(step: float) -> tuple[torch.nn.Parameter, LadderAdamW]:
        p = torch.nn.Parameter(torch.ones(40))
        opt = LadderAdamW(
            [p], lr=0.1, weight_decay=0.0, moment_dtype=torch.float32, backend=backend
        )
        opt.state[p] = {
            "step": torch.tensor(step, dtype=torch.float64),
            "exp_avg": torch.zeros(40),
            "exp_avg_sq": torch.zeros(40),
        }
        p.grad = torch.ones(40)
        return p, opt

    p, opt = build(2.0**32 - 1)
    with pytest.raises(ValueError, match=r"param 0 has step 4294967295; .*4,294,967,294\]"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(40)) and float(opt.state[p]["step"]) == 2**32 - 1
    assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
    p, opt = build(2.0**32 - 2)
    opt.step()
    expected = 1.0 - 0.1 * 0.1 / (math.sqrt(0.001) + 1e-8)
    torch.testing.assert_close(p.detach(), torch.full((40,), expected), rtol=4e-7, atol=0)
    assert float(opt.state[p]["step"]) == 2**32 - 1


# ------------------------------------------------------------ probe, migration, load
def test_a_probe_that_runs_out_of_memory_is_retried_then_raises() -> None:
    """rel-12: an OOM says nothing about the kernel: retried once, never read as 'no
    fused kernel'; two in a row are raised."""
    with FailNthAllocation(1):
        assert fused_adamw_runs(torch.device("cpu")) == (True, "a fused AdamW step ran")

    class AlwaysFail(FailNthAllocation):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            raise torch.OutOfMemoryError("CUDA out of memory (probe)")

    with pytest.raises(torch.OutOfMemoryError), AlwaysFail():
        fused_adamw_runs(torch.device("cpu"))
    model = torch.nn.Linear(16, 16)
    with FailNthAllocation(1):  # the probe's first allocation
        opt = choose_optimizer(model, free_memory="8GiB")
    assert opt.decision.fused and opt.engine.param_groups[0]["fused"]


def test_an_escalation_that_runs_out_of_memory_says_so() -> None:
    """rel-13: a move that fails inside Ladder surfaces as OptimizerOutOfMemoryError naming
    the move, the rung stays and the state is exactly as before."""
    model = torch.nn.Linear(64, 64)
    opt = choose_optimizer(model, lr=1e-3, free_memory="8GiB")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    before = snapshot(opt)

    class FailAll(FailNthAllocation):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if _fresh_results(func):
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 64)

    def train_step() -> None:
        opt.zero_grad()
        model(x).sum().backward()

    # memory is exhausted: forward fails, and so does the move
    with (
        pytest.raises(OptimizerOutOfMemoryError, match="escalating fp32 -> bf16 ran out"),
        FailAll(),
    ):
        Ladder(opt).run(train_step)
    assert opt.rung == "fp32"
    assert_same(snapshot(opt), before)


def test_a_failed_fp32_to_bf16_escalation_changes_nothing_at_any_allocation() -> None:
    """rel-07: fp32 -> bf16 keeps each moment's dropped 16 bits until the move is done, so
    a failure at any allocation gives every param its float32 moments back bit for bit."""
    sizes = (3000, 2000, 1000)
    _, opt = trained(sizes, {}, steps=3)
    with FailNthAllocation() as counter:
        opt.escalate("count")
    for k in range(1, counter.count + 1):
        _, opt = trained(sizes, {}, steps=3)
        before = snapshot(opt)
        with (
            pytest.raises(OptimizerOutOfMemoryError, match="exactly as before"),
            FailNthAllocation(k),
        ):
            opt.escalate("injected")
        assert opt.rung == "fp32"
        assert_same(snapshot(opt), before)


def test_a_failed_move_to_8bit_names_the_rounded_params() -> None:
    """8-bit codes cannot hold bf16 moments exactly within the one-param bound: the error
    names the params converted back with that rounding."""
    for _ in range(2):  # the first move in a process also makes the code books: not counted
        _, opt = trained((300_000, 200_000, 100_000), {"OPTLADDER_BF16_ADAM": "1"}, steps=3)
        with FailNthAllocation() as counter:
            opt.escalate("count")
    _, opt = trained((300_000, 200_000, 100_000), {"OPTLADDER_BF16_ADAM": "1"}, steps=3)
    with (
        pytest.raises(OptimizerOutOfMemoryError, match=r"params \[0, 1\]"),
        FailNthAllocation(counter.count),
    ):
        opt.escalate("injected")
    assert opt.rung == "bf16"


@pytest.mark.parametrize("n", [1, 1000, 65536, 1_000_003])
def test_splitting_a_float32_moment_is_exact_and_rounds_to_nearest(n: int) -> None:
    """The bfloat16 half is float32's value rounded to nearest (ties away from zero), a
    NaN a NaN and an infinity the same infinity, as ``.to(torch.bfloat16)`` keeps them
    (the carry had made NaNs whose low half is 0x8000 or more -0 or +0, and 0x7F80xxxx
    an infinity); joined with the low half it is the float32 value, every bit (NaN and
    inf too), but for signalling NaNs whose payload is in the low half only, which come
    back quiet (bit 22 set: 32 bits cannot keep them and a NaN half). One in 32,768 random
    patterns is such a NaN; NaNs of every kind and the infinities are added by hand."""
    gen = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    nans = [0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFBF8000, 0x7F800001, 0xFF80FFFF]
    special = torch.tensor([*nans, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7FC08000])
    k = min(n, len(special))
    bits[:k] = special[:k]
    bits = bits.to(torch.int32)
    m = bits.view(torch.float32)
    original = m.clone()
    value, low = _split_moment(m, torch.Size([n]))
    assert torch.equal(m.view(torch.int32), original.view(torch.int32))  # source untouched
    magnitude = bits & 0x7FFFFFFF
    low_only = (magnitude > 0x7F800000) & (magnitude < 0x7F810000)  # 0x7F80xxxx, xxxx > 0
    want = torch.where(low_only, bits | 0x00400000, bits)
    assert torch.equal(_join_moment(value, low).view(torch.int32), want)
    torch_value = original.to(torch.bfloat16)  # torch's round to nearest
    assert torch.equal(value.isnan(), original.isnan())
    assert torch.equal(value.isnan(), torch_value.isnan())
    assert torch.equal(value.isinf(), torch_value.isinf())  # 0x7F7FFFFF rounds up to inf
    nan = original.isnan()
    assert torch.equal(value[nan].view(torch.int16) < 0, bits[nan] < 0)  # each NaN's sign
    infinite = original.isinf()
    assert torch.equal(value[infinite].float(), original[infinite])
    finite = torch.isfinite(original) & torch.isfinite(value.float())
    ties = (original.view(torch.int32) & 0xFFFF) == 0x8000
    keep = finite & ~ties
    assert torch.equal(value[keep], original[keep].to(torch.bfloat16))
    if n >= len(special):  # a load's narrowing gives the move's bits, NaNs included
        got = _narrowed(m, torch.Size([n]), torch.device("cpu"), torch.bfloat16)
        assert torch.equal(got.view(torch.int16), value.view(torch.int16))


_NON_FINITE = [0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFC12345, 0x7F800000, 0xFF800000]
"""float32 moments, as bits: quiet NaNs of both signs (three whose low half is 0x8000 or
more: the carry had made them -0, +0, -0), the infinities."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _nan_moments(n: int = 600) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """An optimizer on the fp32 rung after one step, whose param's moments hold
    :data:`_NON_FINITE` (exp_avg) and a NaN and inf (exp_avg_sq) at the front."""
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = choose_optimizer([p], lr=1e-2, free_memory="8GiB", environ={})
    p.grad = torch.randn(n, generator=gen)
    opt.step()
    assert opt.rung == "fp32"
    special = torch.tensor(_NON_FINITE, dtype=torch.int64).to(torch.int32).view(torch.float32)
    opt.state[p]["exp_avg"][: len(special)] = special
    opt.state[p]["exp_avg_sq"][:2] = torch.tensor([float("nan"), float("inf")])
    return p, opt


def test_a_move_to_bf16_keeps_nan_and_inf_moments() -> None:
    """An escalation fp32 -> bf16 narrows a NaN moment to a NaN and an infinite one to
    the same infinity, as ``.to(torch.bfloat16)`` does (0x7FFFFFFF became -0 and
    0xFFFFFFFF +0); every other moment is torch's round to nearest (no halfway values
    here, where the move rounds away from zero)."""
    p, opt = _nan_moments()
    before = {name: opt.state[p][name].clone() for name in ("exp_avg", "exp_avg_sq")}
    opt.escalate("test")
    assert opt.rung == "bf16"
    for name, m in before.items():
        numbers = ~m.isnan()
        assert not bool(((m.view(torch.int32) & 0xFFFF) == 0x8000)[numbers].any())  # no ties
        moved, want = opt.state[p][name], m.to(torch.bfloat16)
        assert moved.dtype == torch.bfloat16
        assert torch.equal(moved.isnan(), m.isnan()), name
        assert torch.equal(moved.isnan(), want.isnan()), name
        assert torch.equal(_bits(moved[numbers]), _bits(want[numbers])), name


def test_a_failed_move_gives_nan_moments_back_bit_for_bit_at_any_allocation() -> None:
    """A move fp32 -> bf16 that fails at any allocation joins each moment back from its
    halves: NaN moments too (a NaN's bfloat16 half carries nothing, its low half is
    joined without the borrow), bit for bit."""
    p, opt = _nan_moments()
    with FailNthAllocation() as counter:
        opt.escalate("count")
    assert counter.count > 2
    for k in range(1, counter.count + 1):
        p, opt = _nan_moments()
        before = {name: opt.state[p][name].clone() for name in ("exp_avg", "exp_avg_sq")}
        with pytest.raises(OptimizerOutOfMemoryError), FailNthAllocation(k):
            opt.escalate("injected")
        assert opt.rung == "fp32"
        for name, m in before.items():
            got = opt.state[p][name]
            assert got.dtype == torch.float32, (k, name)
            assert torch.equal(_bits(got), _bits(m)), (k, name)


HALFWAY = [1 + 2**-8, -(1 + 2**-8), 1 + 3 * 2**-8, 1 + 2**-8 - 2**-20, 3.0, 2 + 2**-7]
"""float32 moments, four of them exactly halfway between two bfloat16 values."""
AWAY = [1.0078125, -1.0078125, 1.015625, 1.0, 3.0, 2.015625]
"""By hand: the nearest bfloat16, ties away from zero (1.0, 1.0078125, 1.015625 and
2.0, 2.015625 are neighbours; 1 + 2**-8 - 2**-20 is below the halfway point)."""


def test_a_move_to_bf16_and_a_load_into_bf16_round_halfway_moments_alike() -> None:
    """fp32 -> bf16 narrows each moment to nearest, ties away from zero (the move must be
    undoable: :func:`_split_moment`); a load of the same state into the bf16 rung rounded
    ties to even (``.to(torch.bfloat16)``): 1 + 2**-8 became 1.0078125 in a move and 1.0
    in a load, so a run resumed from its checkpoint drifted from the one that moved."""
    p = torch.nn.Parameter(torch.zeros(len(HALFWAY)))
    opt = choose_optimizer([p], lr=1e-2, free_memory="8GiB", environ={})
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.rung == "fp32"
    opt.state[p]["exp_avg"].copy_(torch.tensor(HALFWAY))
    opt.state[p]["exp_avg_sq"].copy_(torch.tensor(HALFWAY).abs())
    saved = copy.deepcopy(opt.state_dict())
    q = torch.nn.Parameter(torch.zeros(len(HALFWAY)))
    loaded = choose_optimizer([q], lr=1e-2, free_memory="8GiB", environ={}, rung="bf16")
    loaded.load_state_dict(saved)
    opt.escalate("test")
    assert opt.rung == "bf16"
    for name, want in (("exp_avg", AWAY), ("exp_avg_sq", [abs(v) for v in AWAY])):
        moved, got = opt.state[p][name], loaded.state[q][name]
        assert moved.dtype == got.dtype == torch.bfloat16
        assert moved.float().tolist() == want, name
        assert torch.equal(moved.view(torch.int16), got.view(torch.int16)), name


def test_an_escalated_run_continues_as_one_resumed_on_bf16_from_its_checkpoint() -> None:
    """The user's flow: three steps on fp32 with bfloat16 params, then one run escalates to
    bf16 and a twin is saved and loaded into an optimizer fixed on bf16; both continue bit
    for bit. bfloat16 grads (8 significant bits) make halfway float32 moments common."""
    dtype = torch.bfloat16

    def steps(opt: object, ps: list[torch.nn.Parameter], seeds: range) -> None:
        for s in seeds:
            gen = torch.Generator().manual_seed(s)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            opt.step()  # type: ignore[attr-defined]

    def params() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (5000, 77)]

    moved_ps, saved_ps = params(), params()
    moved = choose_optimizer(moved_ps, lr=1e-2, free_memory="8GiB", environ={})
    saved = choose_optimizer(saved_ps, lr=1e-2, free_memory="8GiB", environ={})
    steps(moved, moved_ps, range(3))
    steps(saved, saved_ps, range(3))
    halfway = sum(
        int(((moved.state[p][name].view(torch.int32) & 0xFFFF) == 0x8000).sum())
        for p in moved_ps
        for name in ("exp_avg", "exp_avg_sq")
    )
    assert halfway > 0  # the case under test is there
    moved.escalate("test")
    resumed_ps = [torch.nn.Parameter(p.detach().clone()) for p in saved_ps]
    resumed = choose_optimizer(resumed_ps, lr=1.0, free_memory="8GiB", environ={}, rung="bf16")
    resumed.load_state_dict(copy.deepcopy(saved.state_dict()))
    for a, b in zip(moved_ps, resumed_ps):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                moved.state[a][name].view(torch.int16), resumed.state[b][name].view(torch.int16)
            ), name
    steps(moved, moved_ps, range(3, 6))
    steps(resumed, resumed_ps, range(3, 6))
    for a, b in zip(moved_ps, resumed_ps):
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))


@pytest.mark.parametrize(
    "layout", ["contiguous", "transposed", "channels_last", "0-dim", "chunked rows"]
)
def test_a_loads_narrowing_rounds_ties_away_from_zero_in_any_layout(layout: str) -> None:
    """What a load makes of float32 moments (:func:`_narrowed`, any layout: moments laid
    out like a transposed or channels_last param) is the nearest bfloat16, ties away from
    zero, as a move's split: checked against integer arithmetic on the bits, every finite
    value and every halfway one."""
    shape = {
        "contiguous": (1000,),
        "transposed": (70, 90),
        "channels_last": (3, 5, 7, 11),
        "0-dim": (),
        "chunked rows": (3000, 70),  # several chunks of rows, the last one short
    }[layout]
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    bits[::3] = (bits[::3] & ~0xFFFF) | 0x8000  # a third exactly halfway
    m = bits.to(torch.int32).view(torch.float32).reshape(shape)
    finite = torch.isfinite(m)
    m = torch.where(finite, m, torch.ones_like(m))
    bits = m.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = ((bits + 0x8000) >> 16) & 0xFFFF  # ties away from zero, in sign-magnitude bits
    want = torch.where(want >= 0x8000, want - 0x10000, want).to(torch.int16).reshape(shape)
    if layout == "transposed":
        m = m.t().contiguous().t()
    elif layout == "channels_last":
        m = m.contiguous(memory_format=torch.channels_last)
    got = _narrowed(m, torch.Size(shape), torch.device("cpu"), torch.bfloat16)
    assert got.is_contiguous() and got.shape == torch.Size(shape)
    assert torch.equal(got.view(torch.int16), want)
    assert torch.equal(
        got.view(torch.int16), _split_moment(m, torch.Size(shape))[0].view(torch.int16)
    )


def test_a_load_that_moves_past_the_local_policy_warns_and_says_why() -> None:
    """rel-22: a checkpoint that escalated to bf16, loaded where the policy chose 8bit."""
    m = torch.nn.Linear(256, 256)
    src = choose_optimizer(m, lr=1e-3, free_memory="8GiB")
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    src.step()
    src.escalate("OOM")
    src.step()
    dst = choose_optimizer(copy.deepcopy(m), lr=1e-3, free_memory=560_000)
    assert dst.rung == "8bit"
    with pytest.warns(UserWarning, match="loading moves the optimizer to bf16"):
        dst.load_state_dict(copy.deepcopy(src.state_dict()))
    assert dst.rung == "bf16" and not dst.decision.fits
    assert "the local policy chose 8bit" in dst.decision.reasons[-1]
    # a checkpoint that moves down (within the gate) does not warn
    quiet = choose_optimizer(copy.deepcopy(m), lr=1e-3, free_memory="8GiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.load_state_dict(copy.deepcopy(src.state_dict()))
    assert quiet.rung == "bf16"


def test_ctrl_c_during_the_commit_waits_until_the_step_is_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rel-20: SIGINT in the commit is held until every group is written, then raised:
    params, moments and step counts all show the step."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    opts = [
        choose_optimizer([{"params": x.parameters()}, {"params": y.parameters()}], rung="bf16")
        for x, y in ((a, b), (ref_a, ref_b))
    ]
    for ps in ([*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()]):
        for i, p in enumerate(ps):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
    opts[1].step()
    real = cpu.run_table

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        signal.raise_signal(signal.SIGINT)  # lands mid-commit, before the kernel's call
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "run_table", interrupted)
    # Python's own SIGINT handler, also when the tests run in a background job (which
    # starts with SIGINT ignored, and then the held signal is rightly dropped)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            opts[0].step()
    finally:
        signal.signal(signal.SIGINT, previous)
    for p, q in zip([*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()]):
        assert torch.equal(p, q)
        assert opts[0].state[p]["step"].item() == 1.0


# ------------------------------------------------------------ escalation only where it helps
@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity", 20 * 2**20),
        ("CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 79.1 GiB total)", 3 * 2**29),
        (
            "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 20971520 bytes. Error code 12 (Cannot allocate memory)",
            20971520,
        ),
        ("CUDA out of memory (simulated)", None),
    ],
)
def test_requested_bytes_reads_torchs_messages(message: str, expected: int | None) -> None:
    assert requested_bytes(torch.OutOfMemoryError(message)) == expected


def _small_run(message: str):  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(32, 32)  # 1,056 params: 8,448 bytes of fp32 state
    opt = choose_optimizer(model, lr=1e-3, free_memory="8GiB")
    calls = []

    def train_step() -> None:
        opt.zero_grad()
        model(torch.randn(2, 32)).sum().backward()
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(message)
        opt.step()

    return opt, train_step, calls


def test_an_escalation_that_cannot_free_enough_raises_and_keeps_the_rung() -> None:
    opt, train_step, calls = _small_run("CUDA out of memory. Tried to allocate 20.00 MiB.")
    with pytest.raises(OptimizerOutOfMemoryError) as info:
        Ladder(opt).run(train_step)
    text = str(info.value)
    assert "20,971,520 bytes" in text and "8,448-byte" in text  # the ask and the state
    assert "smaller batch" in text and "activation checkpointing" in text
    assert opt.rung == "fp32" and not opt.escalations and calls == [1]


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 4.00 KiB.",
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes.",
    ],
)
def test_an_escalation_that_can_free_enough_moves_and_reruns(message: str) -> None:
    """fp32 -> bf16 frees 4 bytes a param: 4,224 bytes here, enough for 4,096."""
    opt, train_step, calls = _small_run(message)
    Ladder(opt).run(train_step)
    assert opt.rung == "bf16" and calls == [1, 1] and opt.committed_steps == 1


# ------------------------------------------------------------ accumulated grads, GradScaler
def test_an_oom_in_a_micro_batch_does_not_drop_accumulated_grads() -> None:
    """The guard wraps one micro-batch of an accumulation window: the OOM is re-raised
    with the reason, grads are kept and nothing moves."""
    model = torch.nn.Linear(16, 4)
    opt = choose_optimizer(model, lr=1e-3, free_memory="8GiB")
    x = torch.randn(8, 16)
    ladder = Ladder(opt)
    fail = {"now": False}

    def micro_batch() -> None:
        model(x).sum().backward()
        if fail["now"]:
            raise torch.OutOfMemoryError("CUDA out of memory (micro-batch)")

    opt.zero_grad()
    ladder.run(micro_batch)
    first = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    fail["now"] = True
    with pytest.raises(OptimizerOutOfMemoryError, match="gradient accumulation"):
        ladder.run(micro_batch)
    assert opt.rung == "fp32"
    for p, g in zip(model.parameters(), first):
        assert torch.equal(p.grad, 2 * g)  # type: ignore[arg-type]  # kept, not zeroed


@pytest.mark.parametrize("previous", ["skipped by the scaler", "committed"])
def test_a_forward_oom_after_a_whole_train_step_is_rerun(previous: str) -> None:
    """A train step that asked for an optimizer step (committed, or skipped by the
    GradScaler for an inf grad) spent its grads, even when it leaves them as zeros
    (``zero_grad(set_to_none=False)`` at its end): a forward OOM in the next call is
    rerun one rung down, once, not refused as gradient accumulation. The rerun step
    equals a reference optimizer's one step on the same grads (bf16 rung, eager oracle
    bits), and the step counts are 1 (the skipped step counted none)."""
    from optladder.optimizers.adamw import LadderAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    ref_model = copy.deepcopy(model)
    opt = choose_optimizer(model, lr=1e-3, free_memory="8GiB", environ={})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ladder = Ladder(opt, scaler=scaler)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    flags = {"overflow": previous == "skipped by the scaler", "fail": False}

    def train_step() -> None:
        if flags["fail"]:  # out of memory in forward, before any backward of this call
            flags["fail"] = False
            raise torch.OutOfMemoryError("CUDA out of memory (forward)")
        loss = model(x).square().mean() * (float("inf") if flags["overflow"] else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)

    ladder.run(train_step)
    assert opt.last_step_skipped == flags["overflow"]
    stepped = 0 if flags["overflow"] else 1
    assert opt.committed_steps == stepped
    flags["overflow"], flags["fail"] = False, True
    ladder.run(train_step)
    assert opt.rung == "bf16" and opt.committed_steps == stepped + 1
    assert int(opt.state[model.weight]["step"]) == stepped + 1
    if previous == "skipped by the scaler":  # one real step, taken on bf16
        ref = LadderAdamW(ref_model.parameters(), lr=1e-3, backend="eager")
        ref_model(x).square().mean().backward()
        ref.step()
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p, q)


def test_grads_zeroed_in_place_before_a_forward_oom_are_not_accumulation() -> None:
    """A loop that skips ``opt.step()`` on a non-finite loss (no step asked for) and
    zeroes grads at its top with ``model.zero_grad(set_to_none=False)`` (not through the
    optimizer): at the next call's forward OOM the kept grads are all zeros, so a rerun
    loses nothing: it is rerun one rung down and steps once. Grads that still hold a
    micro-batch's values are refused, as before."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = choose_optimizer(model, lr=1e-3, free_memory="8GiB", environ={})
    ladder = Ladder(opt)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    flags = {"nan": True, "fail": False}

    def train_step() -> None:
        model.zero_grad(set_to_none=False)
        if flags["fail"]:
            flags["fail"] = False
            raise torch.OutOfMemoryError("CUDA out of memory (forward)")
        loss = model(x).square().mean() * (float("nan") if flags["nan"] else 1.0)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()

    model(x).sum().backward()  # grads exist before the loop (kept tensors)
    ladder.run(train_step)  # a NaN loss: no step asked for, grads left NaN
    assert opt.committed_steps == 0
    flags["nan"], flags["fail"] = False, True
    ladder.run(train_step)
    assert opt.rung == "bf16" and opt.committed_steps == 1
    assert int(opt.state[model.weight]["step"]) == 1


def test_a_grad_scaler_is_reset_for_the_rerun() -> None:
    model = torch.nn.Linear(16, 4)
    opt = choose_optimizer(model, lr=1e-3, free_memory="8GiB")
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    calls = []

    def train_step() -> None:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).sum()).backward()
        scaler.unscale_(opt)  # e.g. before clipping
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (after unscale_)")
        scaler.step(opt)
        scaler.update()

    Ladder(opt, scaler=scaler).run(train_step)
    assert calls == [1, 1] and opt.rung == "bf16"
    assert int(opt.state[model.weight]["step"]) == 1
    assert torch.equal(model.bias.grad, torch.full((4,), 2.0))  # unscaled once: 8 * 2 / 8


@pytest.mark.parametrize("rung", RUNGS)
def test_a_failed_agreement_across_ranks_leaves_no_state_of_the_step(
    rung: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's all-reduce fails (a peer died, a timeout, Ctrl-C while waiting): the
    state the prepare made for never-stepped params is dropped with the rest, so the
    optimizer and params are as before the step; the next step equals a clean one."""
    from optladder.selector import optimizer as optimizer_module

    net, opt = _build(rung, "fp32" if rung != "fp32" else "8bit")
    ref_net, ref = _build(rung, "fp32" if rung != "fp32" else "8bit")
    for model in (net, ref_net):
        model(_batch(0)).backward()
    before = snapshot(opt)

    def dead_peer(*args: object) -> None:
        raise RuntimeError("injected: connection closed by peer")

    with monkeypatch.context() as patch:
        patch.setattr(optimizer_module, "agree_step", dead_peer)
        with pytest.raises(RuntimeError, match="connection closed by peer"):
            opt.step()
    assert_same(snapshot(opt), before)
    assert all(not opt.state.get(p) for g in opt.param_groups for p in g["params"])
    opt.step()
    ref.step()
    for p, q in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("failing", "stepped", "partly", "not_stepped"),
    [
        ("torch_fused", [], [0], [1, 2, 3, 4]),  # the first entry
        ("staged", [0, 1], [2], [3, 4]),  # a later one
        ("eager", [0, 1, 2], [3], [4]),  # the last
    ],
)
def test_a_commit_that_fails_part_way_names_exactly_the_groups_it_wrote(
    failing: str, stepped: list[int], partly: list[int], not_stepped: list[int]
) -> None:
    """A commit whose entry ``failing`` raises (a fault injected into the optimizer's
    own dispatch table) after the entries before it ran: PartialStepError says the
    groups of the entries that ran were stepped, the failing entry's may be partly
    stepped, and those of the entries after it (and a group without grads) were not
    (every group was listed as partly stepped). The groups it calls stepped are the
    same optimizer's after a clean step, bit for bit; those it calls not stepped are as
    before the step. The groups, one per entry in the commit's order: an fp32-pinned
    float32 param (torch's fused kernel), a contiguous float32 param (the C kernel), a
    transposed one (the C kernel on copies, "staged"), a float64 param (the eager path
    on the bf16 rung), a param without a grad."""
    import dataclasses

    def build() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(64, generator=gen)),
            torch.nn.Parameter(torch.randn(32, 8, generator=gen)),
            torch.nn.Parameter(torch.randn(16, 8, generator=gen).t()),
            torch.nn.Parameter(torch.randn(40, generator=gen, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(16, generator=gen)),
        ]
        groups = [{"params": [p]} for p in params]
        groups[0]["rung"] = "fp32"
        opt = choose_optimizer(groups, lr=1e-2, rung="bf16", free_memory="64GiB")
        return params, opt

    def grads(params: list[torch.nn.Parameter], k: int) -> None:
        gen = torch.Generator().manual_seed(10 + k)
        for p in params[:4]:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)

    params, opt = build()
    ref_params, ref = build()
    for k in range(2):
        grads(params, k)
        grads(ref_params, k)
        if k == 1:
            before = snapshot(opt)
            entry = opt.dispatch.entries[failing]

            def fail(*args: object) -> None:
                raise RuntimeError("injected")

            opt.dispatch.entries[failing] = dataclasses.replace(entry, run=fail)
            with pytest.raises(PartialStepError) as info:
                opt.step()
        else:
            opt.step()
        ref.step()
    assert (info.value.stepped, info.value.partly, info.value.not_stepped) == (
        stepped,
        partly,
        not_stepped,
    )
    assert f"{stepped} were stepped, {partly} may be partly stepped" in str(info.value)
    now, after = snapshot(opt), snapshot(ref)
    for i in range(5):  # one param per group: the state_dict's keys are the groups'
        expected = after if i in stepped else before if i in not_stepped else None
        if expected is None:
            continue
        assert torch.equal(now[0][i], expected[0][i]), i
        st, want = now[1]["state"].get(i, {}), expected[1]["state"].get(i, {})
        assert st.keys() == want.keys(), i
        for name in st:
            assert torch.equal(st[name], want[name]), (i, name)


def test_a_commit_that_fails_before_writing_names_no_group_written() -> None:
    """The commit's stage (torch's foreach AdamW steps copies of a complex param before
    anything is written) fails: PartialStepError says no group was stepped or partly
    stepped, and params and state are as before the step."""
    import dataclasses

    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, generator=gen))
    z = torch.nn.Parameter(torch.randn(8, generator=gen, dtype=torch.complex64))
    opt = choose_optimizer([{"params": [a]}, {"params": [z]}], lr=1e-2, free_memory="64GiB")
    assert opt.rung == "fp32"
    for k in range(2):
        a.grad = torch.randn(64, generator=gen)
        z.grad = torch.randn(8, generator=gen, dtype=torch.complex64)
        if k == 0:
            opt.step()
    before = snapshot(opt)
    entry = opt.dispatch.entries["torch_foreach"]

    def fail(*args: object) -> None:
        raise RuntimeError("injected")

    opt.dispatch.entries["torch_foreach"] = dataclasses.replace(entry, stage=fail)
    with pytest.raises(PartialStepError, match="before it wrote any param") as info:
        opt.step()
    assert (info.value.stepped, info.value.partly, info.value.not_stepped) == ([], [], [0, 1])
    assert_same(snapshot(opt), before)
