"""``fusedstep.StepCounts``: the fused commit adds one to every param's step count by
writing the float64 CPU tensors' memory, not by ``torch._foreach_add_``. Each case is
compared with torch's own ``_foreach_add_`` on copies of the same tensors, and no tensor
outside the list is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optladder.optimizers.fusedstep import StepCounts


def _steps(values: list[float], dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=dtype) for v in values]


def _expected(steps: list[torch.Tensor]) -> list[torch.Tensor]:
    copies = [s.clone() for s in steps]
    torch._foreach_add_(copies, 1)
    return copies


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


def test_adds_one_as_foreach_add_does_step_after_step() -> None:
    # 2**53 - 1 is float64's last whole number with a successor; 2.5 is not a count but
    # is added to exactly the same way
    steps = _steps([0.0, 7.0, 2.0**53 - 2, 2.5])
    counts = StepCounts()
    for _ in range(3):
        expected = _expected(steps)
        counts.bump(steps)
        _assert_equal(steps, expected)
    assert [s.item() for s in steps] == [3.0, 10.0, 2.0**53 + 1, 5.5]


def test_a_replaced_tensor_is_written_and_the_old_one_is_not() -> None:
    steps = _steps([1.0, 2.0, 3.0])
    counts = StepCounts()
    counts.bump(steps)
    old = steps[1]
    steps[1] = torch.tensor(40.0, dtype=torch.float64)  # a load puts new tensors there
    counts.bump(steps)
    assert [s.item() for s in steps] == [3.0, 41.0, 5.0]
    assert old.item() == 3.0  # bumped once, before it left the list


def test_a_tensor_given_other_memory_is_written_there() -> None:
    steps = _steps([1.0, 2.0])
    counts = StepCounts()
    counts.bump(steps)
    before = steps[0].data
    steps[0].data = torch.tensor(10.0, dtype=torch.float64)  # same tensor, new storage
    counts.bump(steps)
    assert [s.item() for s in steps] == [11.0, 4.0]
    assert before.item() == 2.0


def test_other_dtypes_and_mixed_lists_go_through_foreach_add() -> None:
    for steps in (
        _steps([1.0, 2.0], torch.float32),  # torch's own float32 steps
        [*_steps([5.0]), *_steps([6.0], torch.float32)],
        [torch.tensor(3.0, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)[:1]],
    ):
        expected = _expected(steps)
        StepCounts().bump(steps)
        _assert_equal(steps, expected)


def test_an_empty_list_is_a_no_op() -> None:
    StepCounts().bump([])


def test_a_step_in_which_no_param_has_a_grad_changes_nothing() -> None:
    from optladder import choose_optimizer

    p = torch.nn.Parameter(torch.ones(3))
    opt = choose_optimizer([p], rung="fp32", free_memory="1GiB")
    p.grad = torch.ones(3)
    opt.step()
    before = p.detach().clone()
    p.grad = None  # the fused commit has no call to make
    opt.step()
    assert opt.state[p]["step"].item() == 1.0 and torch.equal(p.detach(), before)


def test_a_tensor_given_a_narrower_dtype_at_the_same_address_is_not_written_as_float64() -> None:
    # the same tensor, the same address, now a float32 view of its own 8 bytes: a float64
    # cell kept from the last call would write both halves; torch adds 1.0 to the first
    step = torch.tensor(3.0, dtype=torch.float64)
    counts = StepCounts()
    counts.bump([step])
    halves = step.data.reshape(1).view(torch.float32)  # (2,) float32 over the same bytes
    halves.copy_(torch.tensor([5.0, 7.0]))
    address = step.data_ptr()
    step.data = halves[0]
    assert step.data_ptr() == address and step.dtype == torch.float32
    counts.bump([step])
    assert halves.tolist() == [6.0, 7.0]  # 5 + 1, and the other half untouched
    assert step.dtype == torch.float32 and step.item() == 6.0


def test_a_negative_view_is_refused_as_foreach_add_refuses_it() -> None:
    # a tensor with the negative bit reads as minus its memory: a float64 cell would add
    # one to the memory (the count it reads going from -3 to -4); torch's _foreach_add_
    # refuses such a tensor, and so does the bump, writing nothing
    base = torch.tensor(3.0, dtype=torch.float64)
    steps = [torch._neg_view(base)]
    assert steps[0].item() == -3.0
    with pytest.raises(RuntimeError, match="negation"):
        torch._foreach_add_(list(steps), 1)
    with pytest.raises(RuntimeError, match="negation"):
        StepCounts().bump(steps)
    assert base.item() == 3.0


def test_the_memory_of_kept_cells_is_held_when_a_tensor_moves_away() -> None:
    step = torch.tensor(3.0, dtype=torch.float64)
    counts = StepCounts()
    counts.bump([step])
    old = step.untyped_storage()
    address = old.data_ptr()
    step.data = torch.tensor(10.0, dtype=torch.float64)  # its old memory is free to reuse
    del old
    assert any(s.data_ptr() == address for s in counts._storages)  # not while a cell is kept
    counts.bump([step])
    assert step.item() == 11.0


def _at_step(step: int, **kwargs: Any) -> tuple[torch.nn.Parameter, Any]:
    """An fp32-rung optimizer (the policy's pick) whose param has taken ``step`` steps
    (through a checkpoint, as a long run resumes)."""
    from optladder import choose_optimizer

    a = torch.nn.Parameter(torch.randn(5000, generator=torch.Generator().manual_seed(0)))
    opt = choose_optimizer([a], lr=1e-3, free_memory="64GiB", **kwargs)
    a.grad = torch.ones_like(a)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(float(step), dtype=torch.float64)
    opt.load_state_dict(sd)
    return a, opt


def test_an_escalation_passes_a_rung_that_cannot_step_from_the_counts() -> None:
    """At step 2**32 the bf16 rung (random bits keyed by a 32-bit step) cannot take
    another step: the ladder moves on to 8bit (exact counts to 2**53 on the CPU), and
    the next step counts 2**32 + 1. A forced move to bf16 is refused, naming the param,
    its step and the range, and nothing changes."""
    pytest.importorskip("bitsandbytes")
    a, opt = _at_step(2**32, environ={})
    before = opt.state[a]["exp_avg"].clone()
    with pytest.raises(ValueError, match=rf"param 0 of group 0 has step {2**32}, past the bf16"):
        opt.migrate_to("bf16", "a test's move", force=True)
    assert opt.rung == "fp32" and torch.equal(opt.state[a]["exp_avg"], before)
    event = opt.escalate("out of memory (a test)")
    assert (event.from_rung, event.to_rung) == ("fp32", "8bit")
    a.grad = torch.ones_like(a)
    opt.step()
    assert opt.state[a]["step"] == 2**32 + 1


def test_with_no_rung_left_that_steps_from_the_counts_the_escalation_says_why() -> None:
    from optladder import OptimizerOutOfMemoryError

    _, opt = _at_step(2**32, environ={"OPTLADDER_8BIT_ADAM": "0"})
    with pytest.raises(OptimizerOutOfMemoryError, match=r"has step 4294967296, past the bf16"):
        opt.escalate("out of memory (a test)")
    assert opt.rung == "fp32"


def test_picks_among_kept_cells_bump_only_the_picked_tensors() -> None:
    """``prepare(steps, within=(every, picks))``: cells made once for every tensor; each
    step bumps the picked ones only (as ``_foreach_add_`` on them would), also when the
    picks change, and two unpicked tensors sharing memory make the cells for the picked
    ones alone (refused only when two picked ones share it)."""
    every = _steps([0.0, 10.0, 20.0, 30.0])
    counts = StepCounts()
    for picks in ([True, False, True, True], [False, True, False, True], [True] * 4):
        steps = [t for t, k in zip(every, picks) if k]
        expected = _expected(steps)
        before = [t.clone() for t in every]
        counts.prepare(steps, within=(every, picks))
        counts.bump()
        _assert_equal(steps, expected)
        _assert_equal(
            [t for t, k in zip(every, picks) if not k], [b for b, k in zip(before, picks) if not k]
        )
        kept = counts._steps  # the cells of every tensor, made at the first step
        assert len(kept) == len(every) and all(a is b for a, b in zip(kept, every))
    assert [t.item() for t in every] == [2.0, 12.0, 22.0, 33.0]
    shared = [*every, every[0].view(())]
    counts.prepare(every[1:3], within=(shared, [False, True, True, False, False]))
    counts.bump()
    assert [t.item() for t in every] == [2.0, 13.0, 23.0, 33.0]
    with pytest.raises(ValueError, match="share one step count"):
        counts.prepare([every[0], shared[4]], within=(shared, [True, False, False, False, True]))
    # steps that are not the picks: prepared as they are
    counts.prepare(every[:1], within=(every, [False, True, False, False]))
    counts.bump()
    assert [t.item() for t in every] == [3.0, 13.0, 23.0, 33.0]
