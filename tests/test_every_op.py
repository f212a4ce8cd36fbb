"""Fault injection at every dispatched op (issue 11's "Must show").

``FailNthOp(k)`` raises ``torch.OutOfMemoryError`` instead of the ``k``-th op torch's
dispatcher sees (allocating or in place, factories, the fused kernel, bitsandbytes'
custom ops), for every ``k`` from 1 until the phase finishes without reaching ``k``, one
fault per run. After the fault the run takes two more clean steps and is compared, bit
for bit (params and the whole ``state_dict``), with a run that never failed and that
moved rungs at the same step counts (the moves the failing run recorded) and skipped the
step that raised, if one did. Every param's ``step`` must equal the steps committed:
none lost, none doubled.

A fault in a commit (in torch's fused AdamW: the ``step`` increment, then the kernel;
optladder's C kernels dispatch nothing) is reported as :class:`PartialStepError`, never
retried: the groups it calls stepped equal the reference's after the step, those it calls
not stepped are as before, and no param steps twice.

The model is tiny (an 8,192-element embedding, quantized on the 8-bit rung, and a
512-element linear weight, kept in 32-bit state there), so a phase dispatches at most a
few hundred ops.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

from memtools import FailNthOp
from optladder import Ladder, OptimizerOutOfMemoryError, choose_optimizer
from optladder.selector.optimizer import PartialStepError
from snapshots import assert_same, flat_state, snapshot

Snap = tuple[list[torch.Tensor], dict[str, Any]]

COMBOS = [
    ("fp32", None),
    ("fp32", "8bit"),
    ("bf16", None),
    ("bf16", "fp32"),
    ("8bit", None),
    ("8bit", "bf16"),
]
"""(decided rung, rung the embedding's group pins or None): every rung decided and every
rung pinned beside another. A plain step runs on all of them."""

GUARDED_COMBOS = [("fp32", None), ("fp32", "8bit"), ("bf16", "fp32"), ("8bit", "bf16")]
"""A representative set for the guarded train step (it repeats the step's prepare and
commit, plus forward and backward): every rung decided, every rung pinned, and a
decided rung with no pin."""


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(128, 64)
        self.body = torch.nn.Linear(64, 8, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.body(self.emb(idx)).square().mean()


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, 128, (4,), generator=torch.Generator().manual_seed(100 + i))


def _build(rung: str, pin: str | None):  # type: ignore[no-untyped-def]
    net = _Tiny()
    emb: dict[str, Any] = {"params": [net.emb.weight]}
    if pin is not None:
        emb["rung"] = pin
    opt = choose_optimizer(
        [emb, {"params": [net.body.weight], "lr": 5e-3}],
        lr=1e-2,
        free_memory="64GiB",
        environ={"OPTLADDER_RUNG": rung},
    )
    # OPTLADDER_RUNG fixes the rung; let the optimizer escalate like a policy's one
    opt._decision = opt.decision.model_copy(
        update={"overrides": opt.decision.overrides.model_copy(update={"fixed": None})}
    )
    return net, opt


def _step(net: _Tiny, opt: Any, i: int) -> None:
    opt.zero_grad()
    net(_batch(i)).backward()
    opt.step()


def _guarded_step(net: _Tiny, opt: Any) -> None:
    """Train step 1 under a fresh ``Ladder`` (made inside the faulted call)."""
    Ladder(opt).run(_step, net, opt, 1)


def _plain(snap: Snap) -> Snap:
    """A snapshot without the groups' ``rung_reason`` (its words quote the fault) and
    ``rung_origin`` (a move there and back is recorded as an escalation)."""
    for group in snap[1]["param_groups"]:
        group.pop("rung_reason", None)
        group.pop("rung_origin", None)
    return snap


@functools.cache
def _reference(
    rung: str, pin: str | None, moves: tuple[int, ...], skip: int | None, there_and_back=False
) -> tuple[Snap, ...]:
    """Snapshots after steps 0..3 of a run that never failed: ``moves[i]`` escalations
    before step ``i``, step ``skip`` not taken; with ``there_and_back``, before step 1 a
    move down and back up (the state a failed move to 8bit leaves: converted there and
    back)."""
    net, opt = _build(rung, pin)
    snaps = []
    for i in range(4):
        for _ in range(moves[i]):
            opt.escalate("as the failing run did")
        if i == 1 and there_and_back:
            was = opt.rung
            opt.escalate("there")
            opt.migrate_to(was, "and back", force=True)
        if i != skip:
            _step(net, opt, i)
        snaps.append(_plain(snapshot(opt)))
    return tuple(snaps)  # type: ignore[return-value]


def _moves(opt: Any, before: int = 0) -> tuple[int, ...]:
    """Escalations per step count 0..3 (an escalation's ``step``: steps committed before)."""
    counts = [0, 0, 0, 0]
    for e in opt.escalations[before:]:
        counts[e.step] += 1
    return tuple(counts)


def _steps(opt: Any) -> set[int]:
    return {int(float(st["step"])) for st in opt.state.values()}


def _group_params(snap: Snap, opt: Any, groups: list[int]) -> list[int]:
    """Indices (over all params, in group order) of the params of ``groups``."""
    out, index = [], 0
    for gi, g in enumerate(opt.param_groups):
        for _ in g["params"]:
            if gi in groups:
                out.append(index)
            index += 1
    return out


def _faulted(
    k: int, call: Any, caught: tuple[type[BaseException], ...]
) -> tuple[FailNthOp, BaseException | None]:
    """Run ``call()`` with its ``k``-th dispatched op failing: the fault (``reached``:
    whether the call got that far) and what it raised of ``caught`` (None if nothing)."""
    with FailNthOp(k) as fault:
        try:
            call()
        except caught as exc:
            return fault, exc
    return fault, None


def _state(snap: Snap, i: int) -> dict[str, Any]:
    """Param ``i``'s state; a zero state with ``step`` 0 (saved for a param that has
    not stepped) as no state."""
    st = flat_state(snap[1]["state"].get(i, {}))
    return {} if st and float(st["step"]) == 0 else st


def _same_params(a: Snap, b: Snap, indices: list[int]) -> None:
    for i in indices:
        assert torch.equal(a[0][i], b[0][i]), i
        sa, sb = _state(a, i), _state(b, i)
        assert sa.keys() == sb.keys(), i
        for name, va in sa.items():
            vb = sb[name]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, (i, name)


def _check_partial(
    exc: PartialStepError, opt: Any, before: Snap, after: Snap, commits: int = 2
) -> None:
    """A commit that failed part-way: the groups it calls stepped are exactly the
    reference's after the step, those it calls not stepped are as before; nothing was
    retried or moved; no param of the failing engine's groups stepped more than once."""
    assert "not retried" in str(exc) and opt.partial_step is exc
    assert opt.committed_steps == commits  # counted once, never rerun
    now = snapshot(opt)
    _same_params(now, after, _group_params(now, opt, exc.stepped))
    _same_params(now, before, _group_params(now, opt, exc.not_stepped))
    stepped_before = {int(float(_state(before, i).get("step", 0))) for i in range(len(now[0]))}
    for i in _group_params(now, opt, exc.partly):
        assert int(float(now[1]["state"][i]["step"])) - max(stepped_before) in (0, 1), i
        assert torch.equal(now[0][i], before[0][i]) or torch.equal(now[0][i], after[0][i]), i


def _finish(
    net: _Tiny, opt: Any, rung: str, pin: str | None, *, at: int = 1, skipped: bool
) -> None:
    """Two more clean steps after the faulted step ``at``, then the comparison with the
    reference."""
    for i in (at + 1, at + 2):
        _step(net, opt, i)
    ref = _reference(rung, pin, _moves(opt), at if skipped else None)
    assert_same(_plain(snapshot(opt)), ref[at + 2])
    assert _steps(opt) == {at + 2 if skipped else at + 3}


def _check_outcomes(seen: set[str], rung: str, pin: str | None) -> None:
    """The faults met every outcome the combination allows: a move and rerun (below
    8bit), a step that raised and was skipped (8bit: nowhere to move), a commit that
    failed part-way (torch's fused kernel steps fp32 groups, and dispatches)."""
    assert ("moved" if rung != "8bit" else "skipped") in seen, seen
    if "fp32" in (rung, pin):
        assert "partial" in seen, seen


# ------------------------------------------------------------------ a step, no Ladder
@pytest.mark.parametrize("at", [0, 1])
@pytest.mark.parametrize(("rung", "pin"), COMBOS)
def test_a_fault_at_any_op_of_a_step_neither_loses_nor_doubles_it(
    rung: str, pin: str | None, at: int
) -> None:
    """``opt.step()`` alone: every op of prepare (the first step's allocates the state),
    commit, and the move and retry after a fault in prepare; on every rung, with and
    without a pinned group. ``at``: the step faulted (0: the first)."""
    k, seen = 0, set()
    while True:
        k += 1
        net, opt = _build(rung, pin)
        for i in range(at):
            _step(net, opt, i)
        opt.zero_grad()
        net(_batch(at)).backward()
        before = snapshot(opt)
        fault, raised = _faulted(k, opt.step, (torch.OutOfMemoryError, PartialStepError))
        if not fault.reached:
            assert raised is None
            break
        if isinstance(raised, PartialStepError):
            after = _reference(rung, pin, _moves(opt), None)[at]
            before_ref = _reference(rung, pin, _moves(opt), at)[at]
            _check_partial(raised, opt, before_ref, after, commits=at + 1)
            seen.add("partial")
            continue
        skipped = opt.committed_steps == at
        seen.add("moved" if opt.escalations else "skipped" if skipped else "stepped")
        if skipped and not opt.escalations:  # nowhere to move, or before the step began
            assert_same(snapshot(opt), before)
        _finish(net, opt, rung, pin, at=at, skipped=skipped)
    if at == 0:  # the later step's prepare allocates nothing a fault could hit
        _check_outcomes(seen, rung, pin)
    assert k > 2


# ------------------------------------------------------------------ a train step under Ladder
@pytest.mark.parametrize(("rung", "pin"), GUARDED_COMBOS)
def test_a_fault_at_any_op_of_a_guarded_train_step_neither_loses_nor_doubles_it(
    rung: str, pin: str | None
) -> None:
    """``Ladder.run`` of a train step: every op of forward, backward, prepare and commit
    (and of the rerun after a move)."""
    k, seen = 0, set()
    while True:
        k += 1
        net, opt = _build(rung, pin)
        _step(net, opt, 0)
        before = snapshot(opt)
        fault, raised = _faulted(
            k,
            functools.partial(_guarded_step, net, opt),
            (torch.OutOfMemoryError, PartialStepError),
        )
        if not fault.reached:
            assert raised is None
            break
        if isinstance(raised, PartialStepError):
            after = _reference(rung, pin, _moves(opt), None)[1]
            _check_partial(raised, opt, _reference(rung, pin, _moves(opt), 1)[1], after)
            seen.add("partial")
            continue
        skipped = opt.committed_steps == 1
        seen.add("moved" if opt.escalations else "skipped" if skipped else "stepped")
        if skipped and not opt.escalations:  # a failed move (exact) or nowhere to move
            assert_same(snapshot(opt), before)
        _finish(net, opt, rung, pin, skipped=skipped)
    _check_outcomes(seen, rung, pin)
    assert k > 20


# ------------------------------------------------------------------ a move down, a load
def _failed_move_left(exc: BaseException) -> bool:
    """Whether a failed move converted params there and back (named in the error)."""
    return "converted back with" in str(exc)


def _failing(move: Any, fault: FailNthOp) -> Any:
    """``move`` run under ``fault``."""

    def failing_move(*args: Any, **kwargs: Any) -> None:
        with fault:
            move(*args, **kwargs)

    return failing_move


def _oom_once_after_backward(net: _Tiny, opt: Any) -> Any:
    """A train step that runs out of memory after its first backward (no size given)."""
    calls = []

    def train_step(i: int) -> None:
        opt.zero_grad()
        net(_batch(i)).backward()
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (no size given)")
        opt.step()

    return train_step


@pytest.mark.parametrize(
    ("rung", "pin", "guarded"),
    [("fp32", "8bit", True), ("bf16", None, False)],
)
def test_a_fault_at_any_op_of_a_move_down_changes_nothing_or_says_what(
    rung: str, pin: str | None, guarded: bool
) -> None:
    """Every op of the migration fp32 -> bf16 (exact: nothing changes) and bf16 -> 8bit
    (params converted before the fault are converted back with the 8-bit rounding, and
    the error names them), under Ladder (a train step that runs out of memory after its
    backward, before its optimizer step) and without (``opt.escalate``), beside a pinned
    group and without. Faults are injected only inside the move. Two representative
    cases (each move once, one with Ladder and a pin, one without either; the move
    without a fault is exercised on every rung by the tests above, and
    tests/test_exactly_once.py fails every allocation of an unpinned fp32 -> bf16
    move)."""
    k = 0
    while True:
        k += 1
        net, opt = _build(rung, pin)
        _step(net, opt, 0)
        before = snapshot(opt)
        fault = FailNthOp(k)
        opt.migrate_to = _failing(opt.migrate_to, fault)
        train_step = _oom_once_after_backward(net, opt)
        try:
            if guarded:
                Ladder(opt).run(train_step, 1)
            else:
                opt.escalate("injected")
            raised: BaseException | None = None
        except OptimizerOutOfMemoryError as exc:
            raised = exc
        del opt.migrate_to
        if not fault.reached:
            assert raised is None and opt.escalations
            break
        assert raised is not None and f"escalating {rung} -> " in str(raised)
        assert opt.rung == rung and not opt.escalations and opt.committed_steps == 1
        if _failed_move_left(raised):
            assert rung == "bf16" and "[0" in str(raised)  # the embedding: quantized
        else:
            assert "exactly as before" in str(raised)
            assert_same(snapshot(opt), before)
        for i in (2, 3) if guarded else (1, 2):
            _step(net, opt, i)
        skip = 1 if guarded else None
        ref = _reference(rung, pin, (0, 0, 0, 0), skip, _failed_move_left(raised))
        assert_same(_plain(snapshot(opt)), ref[3 if guarded else 2])
        assert _steps(opt) == {3}
    assert k > 20


@pytest.mark.parametrize(("src", "dst", "pin"), [("fp32", "8bit", None), ("8bit", "bf16", "fp32")])
def test_a_fault_at_any_op_of_a_load_changes_nothing(src: str, dst: str, pin: str | None) -> None:
    """Every op of ``load_state_dict`` of a checkpoint from another rung (two
    representative cases: 8bit state from fp32 moments and bf16 from 8-bit codes, with
    a pinned group and without; tests/test_exactly_once.py fails sampled allocations of
    the other pairs): the load raises, the
    optimizer is as before, and its next two steps equal those of a run that never
    loaded. The load that no longer reaches the fault, then two steps, equal a load
    without any fault."""
    net, source = _build(src, pin)
    for i in range(2):
        _step(net, source, i)
    saved = copy.deepcopy(source.state_dict())
    k = 0
    while True:
        k += 1
        net, opt = _build(dst, pin)
        _step(net, opt, 0)
        before = snapshot(opt)
        sd = copy.deepcopy(saved)
        fault, raised = _faulted(
            k, functools.partial(opt.load_state_dict, sd), (torch.OutOfMemoryError,)
        )
        if not fault.reached:
            assert raised is None
            break
        assert raised is not None and opt.rung == dst
        assert_same(snapshot(opt), before)
        for i in (1, 2):
            _step(net, opt, i)
        assert_same(_plain(snapshot(opt)), _reference(dst, pin, (0, 0, 0, 0), None)[2])
    assert k > 20
    for i in (1, 2):  # the load that did not fail, then two steps
        _step(net, opt, i)
    clean_net, clean = _build(dst, pin)
    _step(clean_net, clean, 0)
    clean.load_state_dict(copy.deepcopy(saved))
    for i in (1, 2):
        _step(clean_net, clean, i)
    assert_same(snapshot(opt), snapshot(clean))
