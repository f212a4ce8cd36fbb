"""The OOM ladder: recognizing OOM, migration, two-phase steps, the train-step guard."""

from __future__ import annotations

import copy
import inspect
import io
import math
import warnings
import weakref

import pytest
import torch

from memtools import FailNthAllocation, LiveBytes
from optladder import (
    DCPLoadPlanner,
    Escalation,
    Ladder,
    OptimizerOutOfMemoryError,
    choose_optimizer,
    is_oom,
    measure_footprint,
)
from optladder.policies.footprint import rung_state_bytes
from snapshots import assert_failed_steps_change_nothing, assert_same, snapshot

RUNGS = ("fp32", "bf16", "8bit")


# ---------------------------------------------------------------------------- is_oom
@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (MemoryError(), True),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate "
                "memory: you tried to allocate 4611686018427387904 bytes."
            ),
            True,
        ),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"), False),
        (ValueError("out of memory"), False),  # only RuntimeError messages are read
        (RuntimeError("tensor 'out of memory' is a weird name"), False),
        (KeyError("exp_avg"), False),
    ],
)
def test_is_oom(exc: BaseException, expected: bool) -> None:
    assert is_oom(exc) is expected


def test_is_oom_on_a_real_cpu_allocation_failure() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom(info.value)


# ---------------------------------------------------------------------------- helpers
SIZES = (20_000, 300, 5_000)


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _opt(params, rung: str | None = "fp32", **kwargs):  # type: ignore[no-untyped-def]
    groups = [
        {"params": params[:1], "lr": torch.tensor(3e-3)},  # a tensor lr survives migration
        {"params": params[1:], "lr": 1e-3, "weight_decay": 0.0},
    ]
    kwargs.setdefault("free_memory", "1GiB")
    return choose_optimizer(groups, rung=rung, **kwargs)


def _moments_fp32(opt, p) -> tuple[torch.Tensor, torch.Tensor, int]:  # type: ignore[no-untyped-def]
    st = opt.state[p]
    if "exp_avg" in st:
        return st["exp_avg"].float(), st["exp_avg_sq"].float(), int(st["step"].item())
    if st["state1"].dtype == torch.float32:
        return st["state1"], st["state2"], st["step"]
    import bitsandbytes.functional as F

    m, v = (
        F.dequantize_blockwise(
            st[f"state{i}"], absmax=st[f"absmax{i}"], code=st[f"qmap{i}"], blocksize=256
        )
        for i in (1, 2)
    )
    return m, v, st["step"]


def _half_gap(signed: bool) -> float:
    """Half the widest gap between neighbouring codes of bitsandbytes' dynamic code book
    (``create_dynamic_map``): the largest error of quantizing a value, relative to its
    block's absmax, under round-to-nearest code selection."""
    import bitsandbytes.functional as F

    code = F.create_dynamic_map(signed=signed).sort().values
    return (code[1:] - code[:-1]).max().item() / 2


def _tolerance(rung: str, x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per-element bound on the error of storing ``x`` (float32) on ``rung``."""
    if rung == "8bit" and x.numel() >= 4096:
        pad = (-x.numel()) % 256
        blocks = torch.nn.functional.pad(x.abs().flatten(), (0, pad)).view(-1, 256)
        absmax = blocks.amax(dim=1, keepdim=True).expand(-1, 256).flatten()[: x.numel()]
        # 1% slack: the quantizer compares float32-scaled values with the codes
        return (_half_gap(signed) * absmax * 1.01).view(x.shape)
    if rung == "bf16":
        return 2**-8 * x.abs()  # round-to-nearest: half an ulp, 8 significant bits
    return torch.zeros_like(x)


def _assert_converted(src: str, dst: str, before: tuple, after: tuple) -> None:
    """Moments converted from ``src`` to ``dst`` are within ``dst``'s storage error."""
    (m0, v0, _), (m1, v1, _) = before, after
    # moving down rounds into the target format; moving up is exact, except that
    # bitsandbytes' dequantized values are rounded to bf16 when the target is bf16
    if RUNGS.index(dst) > RUNGS.index(src) or dst == "bf16":
        tol_m, tol_v = _tolerance(dst, m0, signed=True), _tolerance(dst, v0, signed=False)
    else:
        tol_m = tol_v = torch.zeros_like(m0)
    assert bool(((m1 - m0).abs() <= tol_m).all())
    assert bool(((v1 - v0).abs() <= tol_v).all())


# ---------------------------------------------------------------------------- migration
@pytest.mark.parametrize("src", RUNGS)
@pytest.mark.parametrize("dst", RUNGS)
def test_migration_keeps_state_groups_and_identity(src: str, dst: str) -> None:
    params = _params()
    opt = _opt(params, rung=None, environ={"OPTLADDER_RUNG": src})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for s in range(3):
        _set_grads(params, s)
        opt.step()
        sched.step()
    before = {id(p): _moments_fp32(opt, p) for p in params}
    groups_before = [
        {k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay", "initial_lr")}
        for g in opt.param_groups
    ]
    group_ids = [id(g) for g in opt.param_groups]
    opt_id = id(opt)

    opt.migrate_to(dst, "test", force=True)

    assert id(opt) == opt_id and opt.rung == dst
    assert [id(g) for g in opt.param_groups] == group_ids
    assert [p for g in opt.param_groups for p in g["params"]] == params
    for g, expected in zip(opt.param_groups, groups_before):
        for k, v in expected.items():
            assert torch.equal(torch.as_tensor(g[k]), torch.as_tensor(v)), k
        assert g["rung"] == dst
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    for p in params:
        m0, v0, step0 = before[id(p)]
        m1, v1, step1 = _moments_fp32(opt, p)
        assert step1 == step0 == 3
        _assert_converted(src, dst, (m0, v0, step0), (m1, v1, step1))
    _set_grads(params, 9)
    opt.step()  # the new engine steps on the migrated state
    assert _moments_fp32(opt, params[0])[2] == 4


@pytest.mark.parametrize(("src", "dst"), [("fp32", "bf16"), ("bf16", "8bit"), ("fp32", "8bit")])
def test_migration_peak_memory_is_one_params_new_state(src: str, dst: str) -> None:
    sizes = (1_000_000, 400_000, 300_000, 9_000, 100)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    opt = choose_optimizer(params, free_memory="1GiB", rung=None, environ={"OPTLADDER_RUNG": src})
    _set_grads(params, 0)
    opt.step()
    old_tensors = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    with LiveBytes() as live:
        live.watch(old_tensors)
        del old_tensors
        opt.migrate_to(dst, "test", force=True)
    # bound: the largest param's new state (+ 4 bytes for its step tensor on torch rungs)
    bound = rung_state_bytes(dst, sizes[0], torch.float32) + 4
    if dst == "8bit":
        bound += 0  # code books already exist in the bitsandbytes engine's qmap cache
    assert 0 < live.peak <= bound + 2 * 256 * 4, (live.peak, bound)
    # the state shrank overall
    assert live.balance < 0


@pytest.mark.parametrize(("src", "dst"), [("8bit", "fp32"), ("8bit", "bf16"), ("bf16", "fp32")])
def test_a_move_up_that_fails_anywhere_restores_the_state_exactly(src: str, dst: str) -> None:
    """Fail the k-th allocation of migrate_to for every k of a move to a wider format: the
    old state is kept until the move is done, so the optimizer is exactly as before."""

    def trained():  # type: ignore[no-untyped-def]
        params = _params()
        opt = _opt(params, rung=src)
        for s in range(2):
            _set_grads(params, s)
            opt.step()
        return opt

    opt = trained()
    with FailNthAllocation() as counter:
        opt.migrate_to(dst, "test", force=True)
    assert counter.count >= 6  # at least the moments of the three params
    for k in range(1, counter.count + 1):
        opt = trained()
        before = snapshot(opt)
        with pytest.raises(torch.OutOfMemoryError), FailNthAllocation(k):
            opt.migrate_to(dst, "test", force=True)
        assert opt.rung == src
        assert_same(snapshot(opt), before)


# ---------------------------------------------------------------------------- two-phase
def _count_allocations(rung: str, steps_before: int, dtype: torch.dtype) -> int:
    params = _params(dtype=dtype)
    opt = _opt(params, rung=rung)
    for s in range(steps_before):
        _set_grads(params, s)
        opt.step()
    _set_grads(params, steps_before)
    with FailNthAllocation() as counter:
        opt.step()
    return counter.count


@pytest.mark.parametrize(
    ("rung", "dtype"),
    [
        ("fp32", torch.float32),  # torch's fused AdamW
        ("bf16", torch.float32),  # the C kernel
        ("8bit", torch.float32),  # bitsandbytes
        ("fp32", torch.bfloat16),  # optladder's eager AdamW, float32 moments
        ("bf16", torch.bfloat16),  # optladder's eager AdamW, bfloat16 moments
    ],
)
@pytest.mark.parametrize("steps_before", [0, 2])
def test_an_oom_at_any_allocation_changes_nothing(
    rung: str, dtype: torch.dtype, steps_before: int
) -> None:
    """Fail the k-th allocation inside step() for every k; then one clean step must equal
    the step of an optimizer that never failed, bit for bit."""
    n = _count_allocations(rung, steps_before, dtype)
    if steps_before == 0:
        # the first step creates two moments for each of the 3 params (and more: step
        # tensors on the fused fp32 rung, absmax on the 8-bit rung)
        assert n >= 6
    else:
        # once state (and the eager path's scratch) exists, every rung's commit runs in
        # kernels that allocate nothing the dispatcher sees, or on the cached scratch:
        # there is nothing left to fail
        assert n == 0
    clean_params = _params(dtype=dtype)
    clean = _opt(clean_params, rung=rung)
    for s in range(steps_before + 1):
        _set_grads(clean_params, s)
        clean.step()
    expected = snapshot(clean)

    def prepared():  # type: ignore[no-untyped-def]
        params = _params(dtype=dtype)
        opt = _opt(params, rung=rung)  # fixed: the OOM is re-raised, not escalated
        for s in range(steps_before):
            _set_grads(params, s)
            opt.step()
        _set_grads(params, steps_before)
        return opt

    assert_failed_steps_change_nothing(prepared, n, expected)


@pytest.mark.parametrize(("rung", "next_rung"), [("fp32", "bf16"), ("bf16", "8bit")])
def test_step_oom_escalates_and_retries_exactly_one_step(rung: str, next_rung: str) -> None:
    env = {"OPTLADDER_BF16_ADAM": "1"} if rung == "bf16" else {}
    params = _params()
    events: list[Escalation] = []
    made: list[weakref.ref[torch.Tensor]] = []

    def on_escalate(event: Escalation) -> None:
        events.append(event)
        # tensors made by the failed attempt are gone before the retry starts
        assert all(ref() is None for ref in made)

    opt = _opt(params, rung=None, environ=env, on_escalate=on_escalate)
    assert opt.rung == rung
    _set_grads(params, 0)
    grads = [p.grad for p in params]
    with FailNthAllocation(3) as fault:  # the third state tensor of the first step
        made = fault.made
        opt.step()
    assert [(e.from_rung, e.to_rung, e.step) for e in events] == [(rung, next_rung, 0)]
    assert opt.rung == next_rung and opt.decision.origin == "escalated"
    assert all(p.grad is g for p, g in zip(params, grads))  # grads kept
    ref_params = _params()
    ref = _opt(ref_params, rung=next_rung)
    _set_grads(ref_params, 0)
    ref.step()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)  # exactly one step, on the next rung
    assert _moments_fp32(opt, params[0])[2] == 1


# ---------------------------------------------------------------------------- Ladder.run
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(64, 128)
        self.drop = torch.nn.Dropout(0.5)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _guarded_setup(oom_calls: int, **kwargs):  # type: ignore[no-untyped-def]
    model = _Net()
    events: list[Escalation] = []
    opt = choose_optimizer(model, free_memory="1GiB", on_escalate=events.append, **kwargs)
    ladder = Ladder(opt)
    calls = {"n": 0}
    masks: list[torch.Tensor] = []
    made: list[weakref.ref[torch.Tensor]] = []

    @ladder.guard
    def train_step(x: torch.Tensor, scale: float = 1.0) -> float:
        """One step."""
        calls["n"] += 1
        opt.zero_grad()
        big = torch.ones(1000)  # stands for the activations of the failed attempt
        made.append(weakref.ref(big))
        loss = model(x).square().mean() * scale
        masks.append(torch.rand(8))  # an RNG draw, as dropout makes
        loss.backward()
        if calls["n"] <= oom_calls:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated in backward)")
        opt.step()
        return loss.item()

    return model, opt, train_step, calls, masks, made, events


@pytest.mark.parametrize("other", ["torch SGD", "optladder"])
def test_an_oom_after_another_optimizers_step_is_not_rerun(other: str) -> None:
    """A GAN's train step: the discriminator's optimizer steps, then the generator's
    backward runs out of memory. The Ladder over the generator's optimizer reran the
    whole step, so the discriminator stepped twice (SGD moved its weight by 2 lr x grad).
    Now it stands once: not rerun, the generator's optimizer moves down for the next
    step, its params untouched, and ``run`` returns None."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    opt_g = choose_optimizer(gen, free_memory="1GiB")
    if other == "torch SGD":
        opt_d: torch.optim.Optimizer = torch.optim.SGD(disc.parameters(), 0.1)
    else:
        opt_d = choose_optimizer(disc, 0.1, weight_decay=0.0, free_memory="1GiB")
    ladder = Ladder(opt_g)
    calls = {"n": 0}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def train_step() -> None:
        calls["n"] += 1
        opt_d.zero_grad()
        disc(x).mean().backward()  # d/dW of mean(x @ W.T + b): x's mean over the batch
        opt_d.step()
        opt_g.zero_grad()
        loss = disc(gen(x)).mean()
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (in the generator's backward)")
        loss.backward()
        opt_g.step()

    w0, b0, g0 = (
        disc.weight.detach().clone(),
        disc.bias.detach().clone(),
        gen.weight.detach().clone(),
    )
    assert ladder.run(train_step) is None
    assert calls["n"] == 1 and opt_g.rung == "bf16" and opt_g.committed_steps == 0
    assert torch.equal(gen.weight.detach(), g0)
    if other == "torch SGD":  # one SGD step: w0 - 0.1 * mean(x), b0 - 0.1 * 1
        torch.testing.assert_close(disc.weight.detach(), w0 - 0.1 * x.mean(0, keepdim=True))
        torch.testing.assert_close(disc.bias.detach(), b0 - 0.1)
    else:  # one AdamW step moves each element by lr (|m_hat / sqrt(v_hat)| = 1)
        torch.testing.assert_close(disc.bias.detach(), b0 - 0.1)
        assert {int(float(st["step"])) for st in opt_d.state.values()} == {1}
    ladder.run(train_step)  # the next call steps both, once each
    assert calls["n"] == 2 and opt_g.committed_steps == 1


def test_a_ladder_removes_its_step_hook_with_itself() -> None:
    """The Ladder watches other optimizers' steps through one global step post-hook,
    registered when it is made and removed when it is collected."""
    import gc

    from torch.optim.optimizer import _global_optimizer_post_hooks

    gc.collect()  # Ladders earlier tests left in reference cycles go now, not below
    before = len(_global_optimizer_post_hooks)
    ladder = Ladder(choose_optimizer(torch.nn.Linear(4, 4), free_memory="1GiB"))
    assert len(_global_optimizer_post_hooks) == before + 1
    del ladder
    gc.collect()
    assert len(_global_optimizer_post_hooks) == before


def test_forward_oom_reruns_one_rung_down_with_rng_restored() -> None:
    model, opt, train_step, calls, masks, made, events = _guarded_setup(oom_calls=1)
    assert opt.rung == "fp32"
    x = torch.randn(4, 64)
    loss = train_step(x, scale=2.0)
    assert calls["n"] == 2 and opt.rung == "bf16"
    assert [(e.from_rung, e.to_rung) for e in events] == [("fp32", "bf16")]
    assert "forward/backward" in events[0].reason
    assert torch.equal(masks[0], masks[1])  # the rerun drew the same random numbers
    assert made[0]() is None  # the failed attempt's tensors were freed
    assert math.isfinite(loss)
    # exactly one step was taken: the same as a clean bf16 run from the same start
    ref_model = _Net()
    ref_opt = choose_optimizer(ref_model, free_memory="1GiB", rung="bf16")
    torch.manual_seed(0)
    ref_opt.zero_grad()
    (ref_model(x).square().mean() * 2.0).backward()
    ref_opt.step()
    assert opt.state[model.fc1.weight]["step"].item() == 1.0


def test_grads_are_zeroed_before_the_rerun() -> None:
    model, opt, train_step, *_ = _guarded_setup(oom_calls=1)
    seen: list[bool] = []
    opt.on_escalate = lambda e: seen.append(all(p.grad is None for p in model.parameters()))
    train_step(torch.randn(4, 64))
    assert seen == [True]


def test_guard_keeps_the_signature() -> None:
    _, _, train_step, *_ = _guarded_setup(oom_calls=0)
    assert train_step.__name__ == "train_step"
    assert train_step.__doc__ == "One step."
    assert list(inspect.signature(train_step).parameters) == ["x", "scale"]


@pytest.mark.parametrize("wrong", [5, None, "train_step"])
def test_guard_refuses_what_is_not_callable_naming_its_type(wrong: object) -> None:
    """``ladder.guard(5)`` returned a function that failed only when first called."""
    _, opt, *_ = _guarded_setup(oom_calls=0)
    with pytest.raises(
        TypeError, match=rf"Ladder.guard takes the train step function, got {type(wrong).__name__}"
    ):
        Ladder(opt).guard(wrong)  # type: ignore[arg-type]


def test_retries_are_bounded_and_the_last_rung_reraises_with_bytes() -> None:
    model, opt, train_step, calls, *_ = _guarded_setup(oom_calls=99)
    with pytest.raises(OptimizerOutOfMemoryError) as info:
        train_step(torch.randn(4, 64))
    assert calls["n"] == 3  # fp32, then bf16, then 8bit
    assert opt.rung == "8bit"
    err = info.value
    assert isinstance(err.__cause__, torch.OutOfMemoryError)
    assert err.needed_bytes == measure_footprint(model).state_bytes["8bit"]
    assert f"{err.needed_bytes:,} bytes" in str(err) and f"{2**30:,} bytes" in str(err)


def test_a_fixed_rung_never_moves() -> None:
    _, opt, train_step, calls, *_ = _guarded_setup(oom_calls=1, rung="fp32")
    with pytest.raises(OptimizerOutOfMemoryError, match="fixed by rung='fp32'"):
        train_step(torch.randn(4, 64))
    assert opt.rung == "fp32" and calls["n"] == 1


def test_a_disabled_rung_is_skipped() -> None:
    _, opt, train_step, *_ = _guarded_setup(oom_calls=1, environ={"OPTLADDER_BF16_ADAM": "0"})
    train_step(torch.randn(4, 64))
    assert opt.rung == "8bit"


def test_other_errors_pass_through_untouched() -> None:
    model = _Net()
    opt = choose_optimizer(model, free_memory="1GiB")
    ladder = Ladder(opt)
    with pytest.raises(ZeroDivisionError):
        ladder.run(lambda: 1 / 0)
    assert opt.rung == "fp32" and not opt.escalations


def test_ladder_rejects_a_plain_optimizer() -> None:
    with pytest.raises(TypeError, match="optladder optimizer"):
        Ladder(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- checkpoints
def _trained(rung: str, escalated: bool = False):  # type: ignore[no-untyped-def]
    params = _params()
    if escalated:  # reach the rung the way a run does: by running out of memory
        opt = _opt(params, rung=None)
        while opt.rung != rung:
            opt.escalate("test")
    else:
        opt = _opt(params, rung=rung)
    for s in range(2):
        _set_grads(params, s)
        opt.step()
    return params, opt


@pytest.mark.parametrize("src", RUNGS)
@pytest.mark.parametrize("dst", RUNGS)
def test_any_rung_loads_into_any_fixed_rung(src: str, dst: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    params, opt = _trained(src)
    path = tmp_path / "ckpt.pt"
    torch.save(opt.state_dict(), path)
    loaded = torch.load(path, map_location="cpu", weights_only=False)
    live_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    live = _opt(live_params, rung=dst)
    fused_before = [g.get("fused") for g in live.param_groups]
    live.load_state_dict(loaded)
    assert live.rung == dst  # fixed: the checkpoint's state is converted into it
    assert [g.get("fused") for g in live.param_groups] == fused_before
    for p, q in zip(params, live_params):
        m0, v0, step0 = _moments_fp32(opt, p)
        m1, v1, step1 = _moments_fp32(live, q)
        assert step0 == step1 == 2
        _assert_converted(src, dst, (m0, v0, step0), (m1, v1, step1))
    st = live.state[live_params[0]]
    if dst == "bf16":
        assert st["exp_avg"].dtype == torch.bfloat16
    elif dst == "8bit":
        assert st["state1"].dtype == torch.uint8 and st["absmax1"].dtype == torch.float32
        assert isinstance(st["step"], int)
    else:
        assert st["exp_avg"].dtype == torch.float32
        assert st["step"].dtype == torch.float64 and st["step"].dim() == 0
    assert live.param_groups[0]["lr"] == pytest.approx(3e-3)
    _set_grads(live_params, 5)
    live.step()


def test_a_policy_optimizer_moves_to_the_rung_a_checkpoint_escalated_to() -> None:
    params, opt = _trained("bf16", escalated=True)
    assert opt.param_groups[0]["rung_origin"] == "escalated"
    live_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    live = _opt(live_params, rung=None)
    assert live.rung == "fp32"
    live.load_state_dict(opt.state_dict())
    assert live.rung == "bf16" and live.decision.origin == "checkpoint"
    _set_grads(params, 7)
    _set_grads(live_params, 7)
    opt.step()
    live.step()
    for p, q in zip(params, live_params):
        assert torch.equal(p, q)  # the resumed run continues exactly


def test_a_policy_checkpoint_does_not_move_a_policy_optimizer() -> None:
    params, opt = _trained("bf16")  # fixed bf16, not escalated
    live = _opt([torch.nn.Parameter(p.detach().clone()) for p in params], rung=None)
    live.load_state_dict(opt.state_dict())
    assert live.rung == "fp32"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_distributed_checkpoint_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed.checkpoint as dcp

    params, opt = _trained("bf16")
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    live_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    live = _opt(live_params, rung="bf16")
    _set_grads(live_params, 0)
    live.step()  # allocate state of the right shapes for DCP to load into
    target = {"optim": live.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    live.load_state_dict(target["optim"])
    assert_same(([], copy.deepcopy(live.state_dict())), ([], copy.deepcopy(opt.state_dict())))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("pin", [None, "fp32"])
@pytest.mark.parametrize("escalations", [1, 2])
def test_an_escalated_distributed_checkpoint_resumes_on_its_rung(
    tmp_path, pin: str | None, escalations: int
) -> None:  # type: ignore[no-untyped-def]
    """The README's recipe: a restarted job (on fp32, the policy's choice) loads model and
    optimizer with torch's DCP helpers and optladder's planner, with no preparatory call,
    and ends on the checkpoint's rung."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def setup():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 8))
        first = {"params": list(model[0].parameters())} | ({"rung": pin} if pin else {})
        groups = [first, {"params": list(model[1].parameters())}]
        return model, choose_optimizer(groups, free_memory="1GiB")

    def train(model, opt, step: int) -> None:  # type: ignore[no-untyped-def]
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    model, opt = setup()
    for _ in range(escalations):
        opt.escalate("test")
    train(model, opt, 0)
    path = str(tmp_path / "dcp")
    dcp.save(
        {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=path,
    )

    live_model, live = setup()
    assert live.rung == "fp32"
    state = {"model": live_model.state_dict(), "optim": get_optimizer_state_dict(live_model, live)}
    dcp.load(state, checkpoint_id=path, planner=DCPLoadPlanner())
    live_model.load_state_dict(state["model"])
    set_optimizer_state_dict(live_model, live, state["optim"])
    assert live.rung == opt.rung and live.decision.origin == "checkpoint"
    assert [g["rung"] for g in live.param_groups] == [g["rung"] for g in opt.param_groups]
    loaded, saved = copy.deepcopy(live.state_dict()), copy.deepcopy(opt.state_dict())
    # How the rung was reached differs, and a direct fp32 -> 8bit move never had the
    # bf16 rung's seed/rounding keys; every other key and all the state are equal.
    for a, b in zip(loaded["param_groups"], saved["param_groups"]):
        for g, other in ((a, b), (b, a)):
            for key in [*g]:
                if key in ("rung_origin", "rung_reason") or key not in other:
                    del g[key]
    assert_same(([], loaded), ([], saved))
    for step in (1, 2):
        train(model, opt, step)
        train(live_model, live, step)
    for p, q in zip(model.parameters(), live_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.filterwarnings("ignore:optladder. follow_checkpoint is deprecated:FutureWarning")
def test_follow_checkpoint_moves_only_where_load_state_dict_would() -> None:
    """Deprecated (DCPLoadPlanner needs no preparatory call), kept working for old code."""
    opt = _opt(_params(), rung=None)  # a policy choice: fp32
    live = _opt(_params(), rung=None)
    assert live.follow_checkpoint(opt.state_dict()["param_groups"]) is None  # not escalated
    opt.escalate("test")
    assert live.follow_checkpoint(opt.state_dict()["param_groups"]) == "bf16"
    assert live.rung == "bf16" and live.decision.origin == "checkpoint"
    fixed = _opt(_params(), rung="fp32")  # the user's word beats the checkpoint's
    with pytest.warns(FutureWarning, match="DCPLoadPlanner"):
        assert fixed.follow_checkpoint(opt.state_dict()["param_groups"]) is None
    with pytest.raises(ValueError, match="param_groups must be a list of dicts"):
        live.follow_checkpoint("bf16")  # type: ignore[arg-type]
    fresh = _opt(_params(), rung=None)
    with pytest.raises(ValueError, match="the checkpoint has 3 param groups; this optimizer has 2"):
        fresh.follow_checkpoint([*opt.state_dict()["param_groups"], {}])
    assert fresh.rung == "fp32"


def test_dcp_of_a_raw_8bit_state_dict_is_refused_with_the_fix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed.checkpoint as dcp

    _, opt = _trained("8bit")
    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
        target = {"optim": opt.state_dict()}
        dcp.load(target, checkpoint_id=path)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"save get_optimizer_state_dict\(model, opt\)"):
        opt.load_state_dict(target["optim"])  # bitsandbytes' int steps landed under "0", "1"
    assert_same(snapshot(opt), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_8bit_checkpoint_continues_in_plain_bitsandbytes(dtype: torch.dtype) -> None:
    """Moving off optladder: its 8bit checkpoint loads into bitsandbytes' own AdamW8bit,
    which then continues as optladder's 8bit rung does: exactly where bitsandbytes' own
    update runs; on the CPU optladder's kernel encodes small moments by the nearest code
    where bitsandbytes' CPU quantizer searches approximately, so there the runs agree
    within a few lr (3 Adam steps move a param by at most 3 * lr * 3.17; see
    tests/test_kernels_8bit_cpu.py for the kernel's own checks)."""
    import bitsandbytes as bnb

    params = _params(dtype=dtype)
    opt = _opt(params, rung="8bit")
    for s in range(3):
        _set_grads(params, s)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = bnb.optim.AdamW8bit([{"params": plain_params[:1]}, {"params": plain_params[1:]}])
    plain.load_state_dict(torch.load(buf, weights_only=True))
    for s in range(3, 6):
        _set_grads(params, s)
        _set_grads(plain_params, s)
        opt.step()
        plain.step()
    exact = any(p.device.type != "cpu" for p in params)
    for p, q in zip(params, plain_params):
        if exact:
            assert torch.equal(p, q)
        else:  # lr of group 0 is 3e-3
            assert (p.float() - q.float()).abs().max() <= 2 * 3 * 3e-3 * 3.17
        assert plain.state[q]["step"] == 6


# ---------------------------------------------------------------------------- real OOM
def test_a_real_cpu_oom_under_rlimit_as_escalates_and_finishes() -> None:
    from optladder.oom_demo import run_oom_demo

    lines: list[str] = []
    assert run_oom_demo(steps=3, log=lines.append) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "rung fp32 (policy)" in text  # chosen while memory was plentiful
    assert "can't allocate memory" in text  # the CPU allocator's own error
    assert "finished 3 steps" in text and "on bf16" in text
    assert "escalations: fp32 -> bf16" in text


def test_a_real_oom_with_a_pinned_8bit_group_escalates_the_decided_groups_exactly() -> None:
    """A real CPU OOM (RLIMIT_AS, in a child: tests/rlimit_child.py) in the third step's
    backward, with an embedding group pinned to 8bit beside decided fp32 groups: the
    Ladder moves only the decided groups to bf16 and reruns the step; after five steps
    params and the whole state equal, bit for bit, a run with no cap that moved at the
    same point, and every param stepped exactly five times."""
    import json
    import os
    import subprocess
    import sys

    child = os.path.join(os.path.dirname(__file__), "rlimit_child.py")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # big frees go back to the OS
    for name in ("OPTLADDER_RUNG", "OPTLADDER_BF16_ADAM", "OPTLADDER_8BIT_ADAM"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, child], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["seen"] == []  # the Ladder recovered every step
    assert [e[:3] for e in out["escalations"]] == [["fp32", "bf16", 2]]
    reason = out["escalations"][0][3]
    assert "forward/backward" in reason and "can't allocate memory" in reason  # a real OOM
    assert out["rung"] == "bf16" and out["pinned_rung"] == "8bit"
    assert {"state1", "state2", "absmax1", "absmax2"} <= set(out["pinned_keys"])  # 8-bit codes
    assert out["committed_steps"] == 5 and out["steps"] == [5]  # none lost, none doubled
    assert out["params_equal"] and out["groups_equal"] and out["state_equal"]


def test_migrate_to_honours_fixed_and_disabled_rungs() -> None:
    fixed = _opt(_params(), rung="fp32")
    with pytest.raises(ValueError, match=r"fixed by rung='fp32' \(pass force=True"):
        fixed.migrate_to("8bit", "test")
    assert fixed.rung == "fp32"
    no_bf16 = _opt(_params(), rung=None, environ={"OPTLADDER_BF16_ADAM": "0"})
    with pytest.raises(ValueError, match="disabled by OPTLADDER_BF16_ADAM=0"):
        no_bf16.migrate_to("bf16", "test")
    with pytest.raises(ValueError, match="origin must be"):
        no_bf16.migrate_to("8bit", "test", origin="bogus")
    # a checkpoint that escalated to a disabled rung is converted, not followed
    _, escalated = _trained("bf16", escalated=True)
    no_bf16.load_state_dict(escalated.state_dict())
    assert no_bf16.rung == "fp32"


def test_migrate_to_reads_a_rung_as_choose_optimizer_does() -> None:
    """rung= takes "BF16" (any case, spaces stripped); migrate_to had refused it."""
    opt = _opt(_params(), rung=None)
    opt.migrate_to(" BF16", "test")
    assert opt.rung == "bf16" and [g["rung"] for g in opt.param_groups] == ["bf16", "bf16"]
    with pytest.raises(ValueError, match=r"rung='int4' is not a rung; accepted values: fp32"):
        opt.migrate_to("int4", "test")
    assert opt.rung == "bf16"


@pytest.mark.parametrize("margin_mib", [0, 4, 8])
def test_a_real_oom_at_a_transposed_params_step_is_rolled_back_not_partial(
    margin_mib: int,
) -> None:
    """A transposed float32 param on the fp32 rung, a step under a real address-space
    cap (RLIMIT_AS, in a child: tests/rlimit_commit_child.py) with less room than the
    param's 16,000,000 bytes. torch's CPU fused AdamW copies a param that is not
    contiguous inside its kernel, so the cap was met in the commit: PartialStepError,
    the step neither retried nor taken whole. The kernel gets contiguous views of the
    param, its grad and moments in memory order (nothing to copy), so the step either
    runs (on some rung) or raises before anything is written, with the param and its
    state bit for bit as before."""
    import json
    import os
    import subprocess
    import sys

    child = os.path.join(os.path.dirname(__file__), "rlimit_commit_child.py")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # big frees go back to the OS
    for name in ("OPTLADDER_RUNG", "OPTLADDER_BF16_ADAM", "OPTLADDER_8BIT_ADAM"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, child, str(margin_mib)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["error"] is not None:
        assert out["error"][0] != "PartialStepError", out
        assert "memory" in out["error"][1] and out["unchanged"], out
