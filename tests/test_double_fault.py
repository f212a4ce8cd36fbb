"""A move down that runs out of memory and whose way back runs out of memory too.

``tests/test_exactly_once.py`` and ``tests/test_every_op.py`` fail one allocation of a
move; then the way back (converting the moved params back) has all the memory it needs.
Memory that another process takes during the move stays taken: here every allocation
from the ``k``-th on fails (:class:`FailFromNth`). The way back may then fail too; every
param must still hold its state exactly as before, or be named by the error (rounded
back, or its state lost), and the error must not call the state exact when it is not.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtools import FailNthAllocation, _fresh_results
from optladder import OptimizerOutOfMemoryError, choose_optimizer
from optladder.optimizers import migrate
from runs import trained
from snapshots import flat_state


class FailFromNth(FailNthAllocation):
    """Raise ``torch.OutOfMemoryError`` instead of every allocating op from the ``n``-th
    on (1-based): memory taken away for good."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _fresh_results(func):
            self.count += 1
            if self.n is not None and self.count >= self.n:
                raise torch.OutOfMemoryError(f"injected: allocation {self.count} ({func})")
        return func(*args, **(kwargs or {}))


def _trained(env: dict[str, str]) -> tuple[list[torch.nn.Parameter], Any]:
    return trained((6000, 5000), env, steps=2)


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat_state(state).items()
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, va in a.items():
        vb = b[k]
        if isinstance(va, torch.Tensor):
            if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype):
                return False
            if not torch.equal(va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8)):
                return False
        elif va != vb:
            return False
    return True


def _named(message: str, what: str) -> set[int]:
    """The param indices the error names after ``what`` (``"params [0, 2] <what>"``)."""
    import re

    found = re.search(r"params \[([0-9, ]+)\][^\[]*?" + what, message)
    return {int(i) for i in found.group(1).split(",")} if found else set()


@pytest.mark.parametrize(("env", "rung"), [({}, "fp32"), ({"OPTLADDER_BF16_ADAM": "1"}, "bf16")])
def test_a_move_whose_way_back_runs_out_of_memory_loses_nothing_unnamed(
    env: dict[str, str], rung: str
) -> None:
    """fp32 -> bf16 (exact split) and bf16 -> 8bit (rounded back), every allocation from
    the k-th on failing, for every k of the move: the rung stays; each param's state is
    exactly as before (bits and dtypes) unless the error names it as rounded back or
    lost; a lost param holds no state (it is not left in the other rung's format); and
    the error says "exactly as before" only when that is so."""
    _, opt = _trained(env)
    with FailNthAllocation() as counter:
        opt.escalate("count")
    named = False
    for k in range(1, counter.count + 2):  # the first move in a process makes code books
        ps, opt = _trained(env)
        before = [_copy(opt.state[p]) for p in ps]
        try:
            with FailFromNth(k):
                opt.escalate("injected")
        except OptimizerOutOfMemoryError as exc:
            message = str(exc)
        else:
            assert opt.rung != rung
            break
        assert opt.rung == rung, k
        rounded, lost = _named(message, "were converted back"), _named(message, "lost")
        named = named or bool(rounded | lost)
        changed = {i for i, p in enumerate(ps) if not _same(_copy(opt.state.get(p, {})), before[i])}
        assert changed <= rounded | lost, (k, changed, message)
        for i in lost:
            assert not opt.state.get(ps[i]), (k, i)
        if "exactly as before" in message:
            assert not changed, (k, message)
    assert named  # some fault came after a param had moved: the way back ran


class InterruptAtNth(FailNthAllocation):
    """Raise ``KeyboardInterrupt`` (Ctrl-C arriving there) at the ``n``-th allocating op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _fresh_results(func):
            self.count += 1
            if self.count == self.n:
                raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def test_ctrl_c_during_a_move_to_8bit_stays_a_keyboard_interrupt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C at any allocation of bf16 -> 8bit (whose way back rounds the params moved
    so far) is raised as KeyboardInterrupt, not reported as running out of memory (it
    was raised as ``MigrationRoundedError``, and ``escalate`` said the move "ran out of
    memory too"); the rung stays, every param keeps a state, and the params rounded on
    the way back are named in a warning."""
    caplog.set_level(logging.WARNING, logger="optladder")  # other test files quiet it
    ps, opt = _trained({"OPTLADDER_BF16_ADAM": "1"})
    with FailNthAllocation() as counter:
        opt.escalate("count")
    named = False
    for k in range(1, counter.count + 2):
        ps, opt = _trained({"OPTLADDER_BF16_ADAM": "1"})
        try:
            with InterruptAtNth(k):
                opt.escalate("injected")
        except KeyboardInterrupt:
            pass
        else:
            assert opt.rung == "8bit"
            break
        assert opt.rung == "bf16", k
        assert all(opt.state.get(p) for p in ps), k
        named = named or "keep the narrower format's rounding" in caplog.text
    assert named  # some Ctrl-C came after a param had moved


def test_ctrl_c_at_the_handover_of_a_move_waits_until_the_move_is_whole() -> None:
    """A real Ctrl-C (SIGINT) arriving after the state was converted, while the new engine
    is handed over (between the decision's update and the engine's attach), used to drop
    every param's state (it was only on the new engine) and leave the decision on bf16
    beside the fp32 engine. Now it is held back until the move is done and recorded: the
    optimizer is on bf16 with every state, and its next step equals, bit for bit, that of
    a run that escalated without the interrupt."""
    import signal

    from snapshots import assert_same, snapshot

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a handler of its own here")
    ps, opt = _trained({})
    ref_ps, ref = _trained({})
    mark = opt._mark_groups

    def interrupted_mark(groups: list[dict[str, Any]], decision: Any) -> None:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, delivered at the next bytecode
        mark(groups, decision)

    opt._mark_groups = interrupted_mark  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        opt.escalate("injected")
    del opt._mark_groups
    ref.escalate("injected")
    assert opt.rung == "bf16" and len(opt.escalations) == 1
    assert all(opt.state.get(p) for p in ps)
    for params, o in ((ps, opt), (ref_ps, ref)):
        torch.manual_seed(5)
        for p in params:
            p.grad = torch.randn_like(p)
        o.step()
    assert_same(snapshot(opt), snapshot(ref))


def test_ctrl_c_during_a_loads_commit_waits_until_the_load_is_whole() -> None:
    """A real Ctrl-C arriving in ``load_state_dict``'s commit (after the groups took the
    checkpoint's options, before the state was replaced) used to leave the checkpoint's
    lr beside the old state. Now it is held back until the load is done: the optimizer
    equals, bit for bit, one that loaded the same checkpoint without the interrupt."""
    import copy
    import signal

    from snapshots import assert_same, snapshot

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a handler of its own here")
    _, source = _trained({})
    saved = source.state_dict()
    for group in saved["param_groups"]:
        group["lr"] = 3e-3
    ps, opt = _trained({"OPTLADDER_RUNG": "bf16"})
    _, clean = _trained({"OPTLADDER_RUNG": "bf16"})
    release = opt.engine.release_tables

    def interrupted_release() -> None:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, delivered at the next bytecode
        release()

    opt.engine.release_tables = interrupted_release  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(copy.deepcopy(saved))
    del opt.engine.release_tables
    clean.load_state_dict(copy.deepcopy(saved))
    assert_same(snapshot(opt), snapshot(clean))
    assert all(float(opt.state[p]["step"]) == 2 for p in ps)


@pytest.mark.parametrize("pin", [None, "8bit"])
def test_ctrl_c_during_add_param_group_adds_the_group_whole(pin: str | None) -> None:
    """A real Ctrl-C arriving in ``add_param_group`` right after an engine took the group
    used to leave it stepped by the engine but missing from ``param_groups`` (so from
    ``state_dict()``; adding it again was refused as a duplicate). Now it is held back
    until the group is added everywhere: ``param_groups`` lists it, and a step then a
    checkpoint equal, bit for bit, those of an optimizer that added it without the
    interrupt."""
    import signal

    from snapshots import assert_same, snapshot

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a handler of its own here")
    runs = []
    for interrupted in (True, False):
        ps, opt = _trained({})
        extra = [torch.nn.Parameter(torch.full((5000,), 0.5))]
        group: dict[str, Any] = {"params": extra, "lr": 1e-3}
        if pin is not None:
            group["rung"] = pin
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "rung": pin})
        engine = opt.pinned_engines[pin] if pin is not None else opt.engine
        if interrupted:
            take = engine.add_param_group

            def interrupted_take(g: dict[str, Any], take: Any = take) -> None:
                take(g)
                signal.raise_signal(signal.SIGINT)  # Ctrl-C, delivered at the next bytecode

            engine.add_param_group = interrupted_take  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                opt.add_param_group(group)
            del engine.add_param_group
        else:
            opt.add_param_group(group)
        assert any(g["params"][0] is extra[0] for g in opt.param_groups)
        torch.manual_seed(5)
        for p in [*ps, *extra]:
            p.grad = torch.randn_like(p)
        opt.step()
        runs.append(snapshot(opt))
    assert_same(runs[0], runs[1])


class _FailNthClone(TorchDispatchMode):
    """Raise ``torch.OutOfMemoryError`` instead of the ``n``-th ``aten.clone``; keep a
    weak reference to every clone made before it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.clone.default:
            if len(self.made) + 1 == self.n:
                raise torch.OutOfMemoryError("injected: the second moment's low half")
            out = func(*args, **(kwargs or {}))
            self.made.append(weakref.ref(out))
            return out
        return func(*args, **(kwargs or {}))


def test_a_failed_split_frees_its_half_before_the_first_moment_is_joined_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32 -> bf16 splits each float32 moment into two new halves (exp_avg's, then
    exp_avg_sq's). When exp_avg_sq's second half could not be allocated, its first half
    (2 bytes an element) stayed alive in the failed frame, held by the exception being
    handled, while exp_avg was joined back (4 bytes an element): the way back needed more
    memory than the move had taken, and under a real cap (RLIMIT_AS) it ran out too and
    the param lost its state. The half is gone before the join, and the state is back
    bit for bit."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5000))
    opt = choose_optimizer([p], lr=1e-2, free_memory="64GiB")
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    assert opt.rung == "fp32"
    before = _copy(opt.state[p])
    alive_at_join: list[bool] = []
    join = migrate._join_moment
    fault = _FailNthClone(4)  # the clones: exp_avg's high and low, exp_avg_sq's high, low

    def watched_join(value: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        gc.collect()
        alive_at_join.append(fault.made[2]() is not None)  # exp_avg_sq's high half
        return join(value, low)

    monkeypatch.setattr(migrate, "_join_moment", watched_join)
    with pytest.raises(OptimizerOutOfMemoryError, match="exactly as before"), fault:
        opt.escalate("injected")
    assert len(fault.made) == 3 and alive_at_join == [False]
    assert opt.rung == "fp32" and _same(_copy(opt.state[p]), before)
