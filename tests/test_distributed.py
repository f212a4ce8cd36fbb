"""Across ranks: one decision, one rung and one step count on every rank (issue 4, item 7).

Two gloo processes on the CPU (this file run as a script, one process per rank) meet
through a ``FileStore`` in a temporary directory; gloo's own connections stay on the
loopback interface. Every collective has a 60 s timeout, so a rank left waiting fails
instead of hanging. The two processes are started once for the module (importing torch,
its compiler stack and bitsandbytes takes most of the time) and run every case in
order; each rank records each case's outcome in a JSON file, and each test checks its
case on both ranks. A case that fails on a rank ends that rank (the other then fails in
its next collective), and the later cases are reported as not run.

The cases:

- ``decision``: ranks given different free memory reach the same decision, made from the
  smallest (rank 1's, which forces bf16 where rank 0's alone would keep fp32).
- ``construction_collectives``: construction (``choose_optimizer``, ``optladder.AdamW``,
  a fixed rung) makes one collective call (an ``all_gather_object``), counted by
  patching ``torch.distributed``'s functions, and still decides from the least free
  memory, the largest state bytes and rank 0's footprint (replicas of different sizes).
- ``oom_step``: an OOM injected into rank 1's first optimizer step (the allocation of the
  moments) makes both ranks roll back, escalate fp32 -> bf16 and retry; neither commits
  the failed step, and after more DDP-style steps (grads averaged by hand) the params,
  rungs and step counts are identical on both ranks.
- ``fixed``: the same OOM on a rung fixed by ``rung=`` raises ``OptimizerOutOfMemoryError`` on both
  ranks (no hang), with nothing committed; both ranks then step on together.
- ``follow``: rank 1 alone moves fp32 -> bf16 outside a step (as ``Ladder`` does after an
  OOM in its forward, which rank 0 did not have); at the next step rank 0 follows it
  before anything commits, so both ranks step on bf16 from the same state, and their
  params, states and step counts stay identical.
- ``ddp_ladder``: real DDP with ``Ladder``: rank 1's forward runs out of memory in its
  second train step (rank 0's does not); rank 1 moves to bf16 and reruns the train step,
  whose backward meets rank 0's gradient all-reduce; rank 0 follows it to bf16 before the
  step commits, so both ranks end on bf16 with identical params, equal to an unbroken
  single-process run of the same averaged grads that moves to bf16 at the same step,
  bit for bit.
- ``failed_move``: both ranks agree on an OOM in the step, and rank 1's move down fails:
  both ranks raise ``OptimizerOutOfMemoryError`` (rank 0's names the other rank) instead
  of rank 0 stepping on alone and waiting in the next step's all-reduce.
- ``failed_prepare``: rank 1's prepare raises something other than an OOM: rank 1 raises
  it, rank 0 raises a ``RuntimeError`` naming the other rank (it used to wait in the
  all-reduce until the timeout), nothing is committed anywhere, and the next step runs
  on both ranks together.
- ``fsdp``: FSDP2 (``fully_shard``) DTensor params. The footprint counts elements
  globally and state bytes per rank, and merges only true aliases; the 8bit rung steps
  each rank's local shard, quantizing the 6,144-element weight (3,072 per rank, under
  bitsandbytes' 4,096-element minimum) and never the 3,200-element one; an OOM on rank 1
  escalates both ranks fp32 -> 8bit (the bf16 rung does not take DTensors, and says so);
  the sharded run matches an unsharded one bit for bit, through a migration back to
  fp32; a state_dict round trip, a step on FSDP's own grads, and a ``Partial`` grad
  (reduced in the update) work too.
- ``dcp_same_world``: the README's DCP recipe under FSDP2 on 2 ranks, on the fp32 and
  8bit rungs, after an escalation (an OOM on rank 1 while the state exists) and with a
  pinned group, with a head that never stepped before the save: the loaded state equals
  the saved one bit for bit (8-bit codes and block scales included), the head has no
  state, and 3 more steps equal the uninterrupted run's.
- ``dcp_full_state_dict``: ``full_state_dict=True`` on the 8bit rung holds whole codes
  and every element's block scale (checked against each rank's live state); broadcast
  back from rank 0 it resumes bit for bit; in one unsharded optimizer, the params whose
  blocks are unchanged resume bit for bit and the others stay within the 8-bit rounding.
- ``dcp_reshard``: 2 ranks -> 1 and 1 -> 2 (1-rank meshes over 1-rank process groups):
  fp32 exact; 8bit exact where the blocks are unchanged, else within the rounding.
- ``dcp_unsharded_to_fsdp2``: a checkpoint of an 8bit run without FSDP (block scales
  over the whole param) loads under FSDP2 on the 8bit rung (exact where the blocks are
  unchanged, else within the rounding) and the fp32 rung (the values it held), and
  resumes as the unsharded run does.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engines import build_engine
from memtools import FailNthAllocation
from optladder import (
    Ladder,
    LadderOptimizer,
    OptimizerOutOfMemoryError,
    choose_optimizer,
    decide,
    measure_footprint,
    measure_state_bytes,
)
from optladder.optimizers.migrate import read_step
from optladder.optimizers.transaction import prepare_step
from optladder.sharding import is_dtensor, local_tensor

WORLD = 2
COLLECTIVE_TIMEOUT_S = 60
PROCESS_TIMEOUT_S = 150  # a hard stop for both processes, all cases together

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)


# ---------------------------------------------------------------------------- launcher
def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """Run every case on ``WORLD`` ranks; per rank, ``case -> "ok" or the failure``."""
    tmp = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTLADDER_")}
    env["OMP_NUM_THREADS"] = "1"
    lo = _loopback_interface()
    if lo is not None:
        env["GLOO_SOCKET_IFNAME"] = lo
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(tmp / "store"), str(tmp)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=PROCESS_TIMEOUT_S)
            logs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        logs = [f"(killed after {PROCESS_TIMEOUT_S} s)"] * WORLD
    outcomes = []
    for rank, log in enumerate(logs):
        path = tmp / f"rank{rank}.json"
        recorded = json.loads(path.read_text()) if path.exists() else {}
        missing = f"not run (rank {rank} exited {procs[rank].returncode}):\n{log[-4000:]}"
        outcomes.append({case: recorded.get(case, missing) for case in CASES})
    return outcomes


def _check(outcomes: list[dict[str, str]], case: str) -> None:
    failures = [f"rank {r}: {o[case]}" for r, o in enumerate(outcomes) if o[case] != "ok"]
    if failures:
        pytest.fail(f"case {case!r} failed\n" + "\n".join(failures), pytrace=False)


def test_ranks_reach_the_same_decision_from_the_least_free_memory(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "decision")


def test_construction_agrees_across_ranks_in_one_collective(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "construction_collectives")


def test_oom_in_one_ranks_step_escalates_every_rank_without_committing(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "oom_step")


def test_oom_on_a_fixed_rung_raises_on_every_rank(outcomes: list[dict[str, str]]) -> None:
    _check(outcomes, "fixed")


def test_oom_in_one_ranks_pinned_group_escalates_the_others_on_every_rank(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "pinned_group")


def test_a_rank_that_moved_down_alone_is_followed_before_the_next_commit(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "follow")


def test_ddp_ladder_after_a_forward_oom_on_one_rank_keeps_ranks_on_one_rung(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "ddp_ladder")


def test_a_move_that_fails_on_one_rank_raises_on_every_rank(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "failed_move")


def test_a_prepare_that_fails_on_one_rank_raises_on_every_rank(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "failed_prepare")


def test_fsdp2_footprint_and_8bit_rung_on_local_shards(outcomes: list[dict[str, str]]) -> None:
    _check(outcomes, "fsdp")


def test_fsdp2_dcp_round_trip_is_exact_on_every_rung_escalated_pinned_and_never_stepped(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "dcp_same_world")


def test_fsdp2_full_state_dict_holds_whole_8bit_state_and_resumes(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "dcp_full_state_dict")


def test_fsdp2_dcp_reshards_2_to_1_and_1_to_2_within_the_8bit_rounding(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "dcp_reshard")


def test_fsdp2_dcp_loads_a_checkpoint_of_an_unsharded_8bit_run(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "dcp_unsharded_to_fsdp2")


# ---------------------------------------------------------------------------- helpers
def _all_equal(t: torch.Tensor) -> bool:
    """Whether ``t`` is bitwise the same on every rank."""
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t)
    return all(torch.equal(parts[0], x) for x in parts[1:])


def _all_same(obj: Any) -> bool:
    """Whether the picklable ``obj`` is equal on every rank."""
    parts: list[Any] = [None] * WORLD
    dist.all_gather_object(parts, obj)
    return all(x == parts[0] for x in parts[1:])


def _averaged_grads(params: list[nn.Parameter], step: int, rank: int) -> list[torch.Tensor]:
    """Each rank's own grads, averaged over ranks as DDP does (identical on every rank)."""
    grads = []
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
        g = torch.randn(p.shape, generator=gen)
        dist.all_reduce(g)
        grads.append(g / WORLD)
    return grads


def _set_grads(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _steps(opt: torch.optim.Optimizer) -> list[int]:
    return [read_step(opt.state[p]) for g in opt.param_groups for p in g["params"]]


def _params(sizes: tuple[int, ...]) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)  # the same init on every rank
    return [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _oom_on(rank: int, target: int) -> contextlib.AbstractContextManager[Any]:
    """On rank ``target``, fail the first allocation (the first moment of the first
    param: the optimizer's state is allocated in the first step)."""
    return FailNthAllocation(1) if rank == target else contextlib.nullcontext()


# ---------------------------------------------------------------------------- cases
def _case_decision(rank: int) -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
    fp = measure_footprint(model)
    # Rank 1's gate (25% of free memory) lies halfway between the bf16 and fp32 state:
    # bf16 passes, fp32 does not. Rank 0 has plenty.
    small = 2 * (fp.state_bytes["bf16"] + fp.state_bytes["fp32"])
    free = 2**30 if rank == 0 else small
    opt = choose_optimizer(model, free_memory=free)
    d = opt.decision
    assert d.rung == "bf16" and d.origin == "policy" and d.fits, d.summary()
    assert d.free_memory == small
    assert d.free_memory_source.endswith(f"minimum over {WORLD} ranks")
    assert opt.rung == "bf16" and opt.engine is opt  # one optimizer, no engine of its own
    assert _all_same(d.model_dump_json())
    # Rank 0's own free memory alone would have kept fp32: the minimum decided.
    alone = decide(fp, free, d.capabilities, d.policy, d.overrides)
    assert alone.rung == ("fp32" if rank == 0 else "bf16")


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)
"""torch.distributed's communicating functions, as code calls them (``dist.<name>``)."""


@contextlib.contextmanager
def _counted_collectives() -> Any:
    """Count the calls of :data:`_COLLECTIVES` through ``torch.distributed`` in the block
    (each still runs): yields the list of names called, in order. A function's own inner
    collectives (``all_gather_object`` runs two ``all_gather``) go through
    ``distributed_c10d``'s names and are not counted: the calls counted are those the
    caller's code makes."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return run(*args, **kwargs)

        return counted

    for name, run in originals.items():
        setattr(dist, name, counting(name, run))
    try:
        yield calls
    finally:
        for name, run in originals.items():
            setattr(dist, name, run)


def _case_construction_collectives(rank: int) -> None:
    """Construction agrees across ranks in one collective (it made three: an all-reduce
    of the free memory, one of the state bytes, a broadcast of rank 0's decision), and
    the decision is still the one rank 0 makes from the least free memory and the largest
    state bytes over the ranks: here rank 1's model is larger (its state bytes decide)
    and its free memory smaller, and rank 0's footprint is the one recorded."""
    import optladder

    torch.manual_seed(0)
    width = 256 if rank == 0 else 320  # replicas that differ, so the maxima show
    model = nn.Sequential(nn.Linear(width, 256), nn.Linear(256, 64))
    fp = measure_footprint(model)
    mine = (fp.state_bytes, fp.trainable_params, 2**30 if rank == 0 else 2**29)
    each: list[Any] = [None] * WORLD
    dist.all_gather_object(each, mine)
    largest = {r: max(e[0][r] for e in each) for r in fp.state_bytes}
    for build in (
        lambda: choose_optimizer(model, free_memory=mine[2]),
        lambda: optladder.AdamW(model.parameters(), free_memory=mine[2]),
        lambda: choose_optimizer(model, free_memory=mine[2], rung="bf16"),
    ):
        with _counted_collectives() as calls:
            opt = build()
        assert calls == ["all_gather_object"], calls
        d = opt.decision
        assert d.free_memory == 2**29 and d.state_bytes == largest
        assert d.footprint.trainable_params == each[0][1]  # rank 0's footprint
        assert _all_same(d.model_dump_json())
        want = decide(
            d.footprint,
            2**29,
            d.capabilities,
            d.policy,
            d.overrides,
            free_memory_source=d.free_memory_source,
        )
        assert want == d


def _case_oom_step(rank: int) -> None:
    sizes = (5_000, 300)
    params = _params(sizes)
    opt = choose_optimizer(params, free_memory="1GiB")
    assert opt.rung == "fp32" and opt.decision.origin == "policy"
    # The reference: bf16 from the start, one clean step per step.
    ref_params = _params(sizes)
    ref = choose_optimizer(ref_params, rung="bf16", free_memory="1GiB")
    before = [p.detach().clone() for p in params]

    grads = _averaged_grads(params, 0, rank)
    _set_grads(params, grads)
    _set_grads(ref_params, grads)
    with _oom_on(rank, 1):
        opt.step()
    ref.step()

    assert opt.rung == "bf16" and opt.decision.origin == "escalated"
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 0)]
    cause = "injected" if rank == 1 else "another rank ran out of memory"
    assert cause in opt.escalations[0].reason
    assert _steps(opt) == [1, 1]
    # No rank committed the fp32 step: one bf16 step from the initial params, exactly.
    for p, r, p0 in zip(params, ref_params, before):
        assert not torch.equal(p, p0)
        assert torch.equal(p, r)

    for step in range(1, 4):
        grads = _averaged_grads(params, step, rank)
        _set_grads(params, grads)
        _set_grads(ref_params, grads)
        opt.step()
        ref.step()
    assert _steps(opt) == [4, 4]
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
        assert _all_equal(p)
    for g in opt.param_groups:
        assert g["rung"] == "bf16"
    assert _all_same(
        (opt.rung, _steps(opt), [(e.from_rung, e.to_rung, e.step) for e in opt.escalations])
    )


def _case_fixed(rank: int) -> None:
    params = _params((5_000, 300))
    opt = choose_optimizer(params, rung="fp32", free_memory="1GiB")
    _set_grads(params, _averaged_grads(params, 0, rank))
    before = [p.detach().clone() for p in params]
    with pytest.raises(OptimizerOutOfMemoryError) as info, _oom_on(rank, 1):
        opt.step()
    message = str(info.value)
    assert "fixed by rung=" in message, message
    assert ("injected" if rank == 1 else "another rank ran out of memory") in message
    assert (info.value.__cause__ is not None) is (rank == 1)
    assert info.value.rung == "fp32" and opt.rung == "fp32" and not opt.escalations
    # Nothing committed: no state, params as they were.
    assert all(len(opt.state[p]) == 0 for p in params)
    for p, p0 in zip(params, before):
        assert torch.equal(p, p0)
    # The ranks are still in step: the next step runs on both.
    opt.step()
    assert _steps(opt) == [1, 1]
    for p in params:
        assert _all_equal(p)


def _case_pinned_group(rank: int) -> None:
    sizes = (5_000, 300, 6_000)

    def make(rung: str | None) -> tuple[list[nn.Parameter], LadderOptimizer]:
        params = _params(sizes)
        groups = [{"params": params[:2]}, {"params": params[2:], "rung": "8bit"}]
        return params, choose_optimizer(groups, rung=rung, free_memory="1GiB")

    params, opt = make(None)
    assert opt.rung == "fp32" and opt.pinned_engines.keys() == {"8bit"}
    ref_params, ref = make("bf16")  # the decided groups on bf16 from the start
    _, counter_opt = make(None)
    with FailNthAllocation() as counter:  # allocations of the decided groups' prepare
        prepare_step(counter_opt.engine)
    grads = _averaged_grads(params, 0, rank)
    _set_grads(params, grads)
    _set_grads(ref_params, grads)
    # rank 1 runs out of memory in the pinned 8bit engine's prepare, after the fp32 one's
    fail = FailNthAllocation(counter.count + 1) if rank == 1 else contextlib.nullcontext()
    with fail:
        opt.step()
    ref.step()
    assert [(e.from_rung, e.to_rung) for e in opt.escalations] == [("fp32", "bf16")]
    assert [g["rung"] for g in opt.param_groups] == ["bf16", "8bit"]
    assert _steps(opt) == [1, 1, 1]
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)  # one step, nothing of the failed attempt committed
        assert _all_equal(p)


def _case_follow(rank: int) -> None:
    sizes = (5_000, 300)
    params = _params(sizes)
    opt = choose_optimizer(params, free_memory="1GiB")
    for step in range(2):
        _set_grads(params, _averaged_grads(params, step, rank))
        opt.step()
    if rank == 1:  # what Ladder does after an OOM in rank 1's forward
        opt.escalate("injected: out of memory in the forward")
    assert opt.rung == ("bf16" if rank == 1 else "fp32")
    for step in range(2, 5):
        _set_grads(params, _averaged_grads(params, step, rank))
        opt.step()
    assert opt.rung == "bf16" and [g["rung"] for g in opt.param_groups] == ["bf16"]
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 2)]
    if rank == 0:
        assert "another rank moved to the bf16 rung" in opt.escalations[0].reason
    assert _steps(opt) == [5, 5]
    for p in params:
        assert _all_equal(p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].dtype == torch.bfloat16
            assert _all_equal(opt.state[p][key])


def _ddp_net() -> nn.Sequential:
    gen = torch.Generator().manual_seed(0)  # the same init on every rank
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return net


def _ddp_batch(i: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * i + rank))


def _case_ddp_ladder(rank: int) -> None:
    net = _ddp_net()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = choose_optimizer(ddp, lr=1e-2, free_memory="1GiB")
    ladder = Ladder(opt)
    failed = []

    def train_step(i: int) -> None:
        opt.zero_grad()
        out = ddp(_ddp_batch(i, rank))
        if rank == 1 and i == 1 and not failed:
            failed.append(i)
            raise torch.OutOfMemoryError("injected: out of memory in rank 1's forward")
        out.square().mean().backward()
        opt.step()

    for i in range(4):
        ladder.run(train_step, i)
    assert opt.rung == "bf16" and [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [
        ("fp32", "bf16", 1)
    ]
    assert _steps(opt) == [4] * 4
    # The reference, in one process: the same averaged grads, fp32 for one step, then
    # moved to bf16 (the state migrated, as both ranks' was) for the other three.
    ref_net = _ddp_net()
    ref = choose_optimizer(ref_net, lr=1e-2, free_memory="1GiB")
    for i in range(4):
        if i == 1:
            ref.migrate_to("bf16", "the reference")
        ref.zero_grad()
        for r in range(WORLD):  # DDP averages the ranks' grads: the mean of the losses
            (ref_net(_ddp_batch(i, r)).square().mean() / WORLD).backward()
        ref.step()
    for p, q in zip(net.parameters(), ref_net.parameters()):
        assert _all_equal(p)
        # bit for bit: DDP's (g0 + g1) / 2 and the reference's g0 / 2 + g1 / 2 are the
        # same floats (halving is exact, and a sum of two terms does not depend on order)
        assert torch.equal(p, q)


def _case_failed_move(rank: int) -> None:
    params = _params((5_000, 300))
    opt = choose_optimizer(params, free_memory="1GiB")
    _set_grads(params, _averaged_grads(params, 0, rank))
    before = [p.detach().clone() for p in params]
    if rank == 1:

        def failing_move(*args: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("injected: out of memory converting the state")

        opt.migrate_to = failing_move  # type: ignore[method-assign]
    with pytest.raises(OptimizerOutOfMemoryError) as info, _oom_on(rank, 1):
        opt.step()
    if rank == 0:
        assert "another rank could not move down the ladder" in str(info.value)
        assert opt.rung == "bf16"
    else:
        assert "escalating fp32 -> bf16 ran out of memory too" in str(info.value)
        assert opt.rung == "fp32"
    assert all(len(opt.state[p]) == 0 for p in params)  # the failed step committed nothing
    for p, p0 in zip(params, before):
        assert torch.equal(p, p0)


def _case_failed_prepare(rank: int) -> None:
    params = _params((5_000, 300))
    opt = choose_optimizer(params, free_memory="1GiB")
    _set_grads(params, _averaged_grads(params, 0, rank))
    before = [p.detach().clone() for p in params]
    if rank == 1:

        def failing_check(*_: object) -> None:  # as _check_params(pins)
            raise ValueError("injected: a check that fails on rank 1 only")

        opt._check_params = failing_check  # type: ignore[method-assign]
    expected = (RuntimeError, "another rank's optimizer step failed")
    if rank == 1:
        expected = (ValueError, "injected: a check that fails on rank 1 only")
    with pytest.raises(expected[0], match=expected[1]):
        opt.step()
    assert all(len(opt.state[p]) == 0 for p in params)
    for p, p0 in zip(params, before):
        assert torch.equal(p, p0)
    if rank == 1:
        del opt._check_params
    opt.step()
    assert _steps(opt) == [1, 1]
    for p in params:
        assert _all_equal(p)


def _case_fsdp(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    # Weights of 6,144 elements (3,072 per rank: quantized, by the global count) and
    # 3,200 (1,600 per rank: never quantized). 3,072 is 12 whole 256-element blocks, so
    # the sharded 8-bit state matches the unsharded reference's bit for bit.
    model = nn.Sequential(nn.Linear(96, 64, bias=False), nn.Linear(64, 50, bias=False))
    ref_model = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    ref_params = list(ref_model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    local = [p.to_local().numel() for p in params]
    assert local == [3_072, 1_600]

    # Footprint: elements globally, state bytes for this rank's shards.
    fp = measure_footprint(model)
    assert fp.sharded and fp.trainable_params == 6_144 + 3_200 and fp.largest_param == 6_144
    assert fp.param_tensors == 2
    eight_bit = (2 * 3_072 + 2 * 4 * 12) + 2 * 4 * 1_600 + 2 * 256 * 4
    assert fp.state_bytes == {"fp32": 8 * 4_672, "bf16": 4 * 4_672, "8bit": eight_bit}
    # Storage dedup on DTensors: the same param twice, or a second DTensor over the same
    # shard with the same layout, counts once; a distinct param of the same shape does not.
    first = params[0]
    alias = nn.Parameter(
        DTensor.from_local(
            first.to_local(), mesh, first.placements, shape=first.shape, stride=first.stride()
        )
    )
    assert measure_footprint([first, first, alias]).param_tensors == 1
    twin = nn.Parameter(
        DTensor.from_local(
            torch.zeros(32, 96), mesh, first.placements, shape=first.shape, stride=first.stride()
        )
    )
    assert measure_footprint([first, twin]).param_tensors == 2

    opt = choose_optimizer(model, free_memory="1GiB")
    assert opt.rung == "fp32"
    assert not opt.decision.capabilities.available["bf16"]
    assert "DTensor" in opt.decision.capabilities.unavailable_reasons["bf16"]
    ref = choose_optimizer(ref_model, rung="8bit", free_memory="1GiB")
    with pytest.raises(ValueError, match="DTensor"):
        choose_optimizer(model, rung="bf16", free_memory="1GiB")
    with pytest.raises(ValueError, match="DTensor"):
        build_engine("bf16", [{"params": params}], fused=False)
    # The fp32 rung of bf16 params runs optladder's AdamW too: refused, with the way out.
    bf16_param = nn.Parameter(
        DTensor.from_local(
            torch.zeros(32, 96, dtype=torch.bfloat16),
            mesh,
            first.placements,
            shape=first.shape,
            stride=first.stride(),
        )
    )
    with pytest.raises(ValueError, match="MixedPrecisionPolicy"):
        build_engine("fp32", [{"params": [bf16_param]}], fused=True)

    def grads_for(step: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(500 + step)  # the same on every rank
        return [torch.randn(p.shape, generator=gen) for p in ref_params]

    def step_both(step: int, on_rank_1: Callable[[], Any] = contextlib.nullcontext) -> None:
        for p, r, g in zip(params, ref_params, grads_for(step)):
            shard = g.chunk(WORLD, dim=0)[rank].contiguous()
            p.grad = DTensor.from_local(shard, mesh, p.placements, shape=p.shape, stride=p.stride())
            r.grad = g.clone()
        with on_rank_1() if rank == 1 else contextlib.nullcontext():
            opt.step()
        ref.step()

    def assert_matches_reference() -> None:
        for p, r in zip(params, ref_params):
            assert torch.equal(p.full_tensor(), r.detach())

    # The first step allocates the moments; rank 1 runs out of memory doing so.
    step_both(0, lambda: FailNthAllocation(1))
    assert opt.rung == "8bit", "bf16 takes no DTensor params: straight to 8bit"
    assert [(e.from_rung, e.to_rung) for e in opt.escalations] == [("fp32", "8bit")]
    # The 8-bit rung on local shards, its size rule on the global count.
    big, small = (opt.state[p] for p in params)
    assert big["state1"].dtype == torch.uint8 and big["state1"].shape == (32, 96)
    assert big["absmax1"].numel() == 12 and big["absmax2"].numel() == 12
    assert small["state1"].dtype == torch.float32 and small["state1"].shape == (25, 64)
    assert measure_state_bytes(opt) == opt.decision.state_bytes["8bit"] == eight_bit
    for s in (1, 2):
        step_both(s)
    assert _steps(opt) == [3, 3]
    assert_matches_reference()

    # Migration up keeps DTensor moments laid out like the params, on this rank's shard.
    opt.migrate_to("fp32", "test", force=True)
    ref.migrate_to("fp32", "test", force=True)
    exp_avg = opt.state[params[0]]["exp_avg"]
    assert isinstance(exp_avg, DTensor) and exp_avg.to_local().shape == (32, 96)
    assert measure_state_bytes(opt) == opt.decision.state_bytes["fp32"] == 8 * 4_672
    step_both(3)
    assert_matches_reference()
    assert _steps(opt) == [4, 4]

    # A state_dict round trip into a fresh optimizer fixed on 8bit, then one step with
    # FSDP's own forward/backward (grads reduce-scattered by FSDP).
    fixed = choose_optimizer(model, rung="8bit", free_memory="1GiB")
    fixed.load_state_dict(opt.state_dict())
    assert fixed.state[params[0]]["state1"].shape == (32, 96)
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(rank))
    fixed.zero_grad()
    model(x).square().mean().backward()
    fixed.step()
    assert _steps(fixed) == [5, 5]
    assert all(torch.isfinite(p.to_local()).all() for p in params)
    assert _all_same((fixed.rung, _steps(fixed), measure_state_bytes(fixed)))

    # A grad laid out unlike its param (Partial: summed over ranks, not yet reduced) is
    # reduced to the param's shards in the update: the same step as the reduced grad.
    layout = {"shape": first.shape, "stride": first.stride()}
    g = grads_for(9)[0]
    a, b = (
        nn.Parameter(DTensor.from_local(first.to_local().clone(), mesh, first.placements, **layout))
        for _ in range(2)
    )
    shard = g.chunk(WORLD, dim=0)[rank].contiguous()
    a.grad = DTensor.from_local(shard, mesh, first.placements, **layout)
    b.grad = DTensor.from_local(g / WORLD, mesh, [Partial()], **layout)
    for param in (a, b):
        build_engine("8bit", [{"params": [param]}], fused=False).step()
    assert torch.equal(a.to_local(), b.to_local())


# ---------------------------------------------------------------------------- DCP cases
# Weights of the checkpoint cases, by name: (global shape, first step with a grad).
# "a": 6,144 elements, 3,072 per rank (whole 256-element blocks: its 8-bit blocks are the
# same on 1 and 2 ranks); "c": 7,000, rows of 1,000 split 4 + 3, so rank 1's shard
# starts mid-block (its blocks differ between 1 and 2 ranks); "b": 512 (float32 state on
# the 8bit rung; no grad at step 0, so an OOM at step 1 migrates the others' state);
# "h": 5,120, a head frozen until step 4 (never stepped when the checkpoint is taken).
_DCP_PARAMS = {"a": ((64, 96), 0), "c": ((7, 1000), 0), "b": ((8, 64), 1), "h": ((5, 1024), 4)}
_SAVE_AT, _STEPS = 3, 6
_CONFIGS = ("fp32", "8bit", "escalated", "pinned")
_ckpt_dir: list[Path] = []  # set by _worker: a directory both ranks share


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)  # the same init on every rank
        for name, (shape, _) in _DCP_PARAMS.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen) / 10))


def _build(config: str, mesh: Any) -> tuple[_Net, LadderOptimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _Net()
    if mesh is not None:
        fully_shard(model, mesh=mesh)
    kw: dict[str, Any] = {"lr": 1e-2, "free_memory": "1GiB", "environ": {}}
    if config == "pinned":
        groups = [
            {"params": [model.a, model.c, model.h]},
            {"params": [model.b], "rung": "fp32"},
        ]
        return model, choose_optimizer(groups, rung="8bit", **kw)
    rung = None if config == "escalated" else config
    return model, choose_optimizer(model, rung=rung, **kw)


def _set_dcp_grads(model: _Net, step: int) -> None:
    """The same full grads on every world size; each rank takes its rows (FSDP2's
    ``torch.chunk`` split of dim 0)."""
    for i, (name, (shape, first)) in enumerate(_DCP_PARAMS.items()):
        p = getattr(model, name)
        if step < first:
            p.grad = None
            continue
        g = torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i))
        p.grad = _shard_of(g, p) if is_dtensor(p) else g


def _run(model: _Net, opt: LadderOptimizer, steps: range, oom_at: int | None = None) -> None:
    rank = dist.get_rank()
    for s in steps:
        _set_dcp_grads(model, s)
        fail = s == oom_at and rank == 1
        with FailNthAllocation(1) if fail else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()


def _dcp_save(model: nn.Module, opt: LadderOptimizer, path: Path, pg: Any = None) -> None:
    """The README's recipe: save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(path), process_group=pg)


def _dcp_load(model: nn.Module, opt: LadderOptimizer, path: Path, pg: Any = None) -> None:
    """The README's recipe: load (optladder's planner fits the optimizer's template to
    the checkpoint, whatever its rung; set_optimizer_state_dict then moves the rung)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from optladder import DCPLoadPlanner

    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path), planner=DCPLoadPlanner(), process_group=pg)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _gather_rows(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole tensor from each rank's rows of ``t`` (``t`` itself on a 1-rank mesh)."""
    if not is_dtensor(p) or p.device_mesh.size() == 1:  # type: ignore[attr-defined]
        return t.clone()
    parts: list[Any] = [None] * WORLD
    dist.all_gather_object(parts, t)
    return torch.cat(parts)


def _dequantized(opt: LadderOptimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Whole-param moments, as float32 values and (8-bit) codes and per-element block
    absmax, computed here from the live state of each rank's shard (an independent
    dequantization: ``qmap[code] * absmax[element // 256]`` over the local shard)."""
    from torch.distributed.tensor import DTensor

    st = opt.state[p]
    shard = local_tensor(p)
    out: dict[str, torch.Tensor] = {}
    for i, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
        if name in st:
            m = st[name]
            local = (m.to_local() if isinstance(m, DTensor) else m).float()
        else:
            inner = st.get("__bnb_optimizer_quant_state__", st)
            codes = inner[f"state{i}"] if f"state{i}" in inner else st[f"state{i}"]
            if codes.dtype == torch.uint8:
                block = torch.arange(codes.numel()) // 256
                scale = inner[f"absmax{i}"][block].reshape(shard.shape)
                local = inner[f"qmap{i}"][codes.long()] * scale
                out[f"codes{i}"] = _gather_rows(codes.reshape(shard.shape), p)
                out[f"scale{i}"] = _gather_rows(scale, p)
            else:
                local = codes.float()
        out[name] = _gather_rows(local.reshape(shard.shape), p)
    return out


def _local_states(opt: LadderOptimizer) -> list[dict[str, Any]]:
    """Each param's live state on this rank's shard, copied (bnb's wrapping undone)."""
    from torch.distributed.tensor import DTensor

    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            st = dict(opt.state.get(p, {}))
            st.update(st.pop("__bnb_optimizer_quant_state__", {}))
            out.append(
                {
                    k: (v.to_local() if isinstance(v, DTensor) else v).clone()
                    if isinstance(v, torch.Tensor)
                    else v
                    for k, v in st.items()
                }
            )
    return out


def _assert_same_states(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [sorted(s) for s in got] == [sorted(s) for s in want]
    for pi, (a, b) in enumerate(zip(got, want)):
        for k in a:
            x, y = a[k], b[k]
            if k == "step":
                assert float(x) == float(y), (pi, k, x, y)
            else:
                assert x.dtype == y.dtype and torch.equal(x, y), (pi, k)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if is_dtensor(p) else p.detach()).clone()  # type: ignore[attr-defined]
        for n, p in model.named_parameters()
    }


def _assert_within_8bit_rounding(
    opt: LadderOptimizer,
    model: nn.Module,
    before: dict[str, dict[str, torch.Tensor]],
    exact: tuple[str, ...],
) -> None:
    """The moments of ``model``'s params in ``opt`` against ``before`` (from
    :func:`_dequantized`): equal, codes included, for the params named in ``exact``;
    for the others, each element within half the widest gap of the code book times its
    block's absmax (bitsandbytes rounds to the nearest code; 1 % slack for float
    rounding), and not all equal (the blocks did change)."""
    for name, old in before.items():
        p = model.get_parameter(name)
        new = _dequantized(opt, p)
        if name in exact:
            assert sorted(new) == sorted(old), name
            for k in new:
                assert torch.equal(new[k], old[k]), (name, k)
            continue
        st = opt.state[p]
        inner = st.get("__bnb_optimizer_quant_state__", st)
        for i, m in ((1, "exp_avg"), (2, "exp_avg_sq")):
            gap = inner[f"qmap{i}"].sort().values.diff().max()
            bound = 0.505 * gap * new[f"scale{i}"]
            assert ((new[m] - old[m]).abs() <= bound).all(), (name, m)
            assert not torch.equal(new[m], old[m]), (name, m)


def _dcp_steps(opt: LadderOptimizer) -> list[int]:
    """Each param's step count; 0 for a param without state."""
    return [
        read_step(opt.state[p]) if opt.state.get(p) else 0
        for g in opt.param_groups
        for p in g["params"]
    ]


def _case_dcp_same_world(rank: int) -> None:
    """DCP save and load on 2 ranks, every configuration: the resumed run's state
    right after the load and its params over 3 more steps equal the uninterrupted
    run's bit for bit; the never-stepped head loads as no state."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    for config in _CONFIGS:
        path = _ckpt_dir[0] / f"w2_{config}"
        model, opt = _build(config, mesh)
        _run(model, opt, range(_SAVE_AT), oom_at=1 if config == "escalated" else None)
        if config == "escalated":
            assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [
                ("fp32", "8bit", 1)
            ]
            assert _all_same((opt.rung, _dcp_steps(opt)))
        assert not opt.state.get(model.h)
        saved = _local_states(opt)
        _dcp_save(model, opt, path)
        _run(model, opt, range(_SAVE_AT, _STEPS))
        want = _full_params(model)

        model2, opt2 = _build(config, mesh)
        _dcp_load(model2, opt2, path)
        assert opt2.rung == opt.rung and [g["rung"] for g in opt2.param_groups] == [
            g["rung"] for g in opt.param_groups
        ], config
        _assert_same_states(_local_states(opt2), saved)
        assert not opt2.state.get(model2.h)  # step 0 in the checkpoint: no state
        _run(model2, opt2, range(_SAVE_AT, _STEPS))
        got = _full_params(model2)
        for name in want:
            assert torch.equal(got[name], want[name]), (config, name)
        assert _dcp_steps(opt2) == _dcp_steps(opt)


def _case_dcp_full_state_dict(rank: int) -> None:
    """8bit rung: the full state dict holds every element of every moment (codes laid
    out like the whole param, block scales per row); broadcast back into 2 ranks it
    resumes bit for bit; loaded into one unsharded optimizer, the params whose blocks
    are the same unsharded resume bit for bit, and the moments of the others stay within
    the 8-bit format's rounding."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    model, opt = _build("8bit", mesh)
    _run(model, opt, range(_SAVE_AT))
    saved = _local_states(opt)
    names = [n for n, _ in model.named_parameters()]
    moments = {n: _dequantized(opt, p) for n, p in model.named_parameters() if opt.state.get(p)}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_optimizer_state_dict(model, opt, options=options)
    params_at_save = _full_params(model)
    _run(model, opt, range(_SAVE_AT, _STEPS))
    want = _full_params(model)
    if rank == 0:
        a = full["state"]["a"]
        assert a["state1"].shape == (64, 96) and a["state1"].dtype == torch.uint8
        assert torch.equal(a["state1"], moments["a"]["codes1"])
        assert torch.equal(a["state2"], moments["a"]["codes2"])
        c = full["state"]["c"]
        # each element's block scale, read back from the row table and phases
        slot = (c["block_phase"].long()[:, None] + torch.arange(1000)) // 256
        for i in (1, 2):
            scale = c[f"block_absmax{i}"].gather(1, slot)
            assert torch.equal(scale, moments["c"][f"scale{i}"])
            values = c[f"qmap{i}"][c[f"state{i}"].long()] * scale
            name = ("exp_avg", "exp_avg_sq")[i - 1]
            assert torch.equal(values, moments["c"][name])
        assert full["state"]["b"]["state1"].shape == (8, 64)
        assert full["state"]["h"]["step"] == 0  # never stepped: zero state, step 0

    # Broadcast from rank 0 into a fresh 2-rank optimizer: exact.
    model2, opt2 = _build("8bit", mesh)
    model2.load_state_dict(
        {n: _shard_of(params_at_save[n], p) for n, p in model2.named_parameters()}
    )
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model2, opt2, full if rank == 0 else {}, options=options)
    _assert_same_states(_local_states(opt2), saved)
    _run(model2, opt2, range(_SAVE_AT, _STEPS))
    got = _full_params(model2)
    for name in want:
        assert torch.equal(got[name], want[name]), name

    # Into one unsharded optimizer, keyed by index as opt.state_dict() keys it. Both
    # ranks do it, in step (choose_optimizer and step agree over the default group).
    shared = [full]
    dist.broadcast_object_list(shared, src=0)
    full = shared[0]
    plain = _Net()
    plain.load_state_dict(params_at_save)
    single = choose_optimizer(plain, lr=1e-2, rung="8bit", free_memory="1GiB", environ={})
    sd = {
        "state": {names.index(k): v for k, v in full["state"].items()},
        "param_groups": [
            {**g, "params": [names.index(k) for k in g["params"]]} for g in full["param_groups"]
        ],
    }
    single.load_state_dict(sd)
    _assert_within_8bit_rounding(single, plain, moments, exact=("a", "b"))
    _run(plain, single, range(_SAVE_AT, _STEPS))
    for name in ("a", "b"):
        assert torch.equal(plain.get_parameter(name).detach(), want[name]), name
    assert not torch.equal(plain.c.detach(), params_at_save["c"])


def _shard_of(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``full`` as a DTensor laid out like ``p`` (its rows on this rank)."""
    from torch.distributed.tensor import DTensor

    size, r = p.device_mesh.size(), p.device_mesh.get_local_rank()  # type: ignore[attr-defined]
    rows = -(-full.shape[0] // size)
    start = min(r * rows, full.shape[0])
    local = full[start : min(start + rows, full.shape[0])].contiguous()
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())  # type: ignore[attr-defined]


def _case_dcp_reshard(rank: int) -> None:
    """A DCP checkpoint of 2 ranks loads on 1, and one of 1 rank on 2, on the fp32 and
    8bit rungs (the bf16 rung takes no DTensors). fp32: exact. 8bit: exact for the params
    whose blocks are the same on both world sizes ("a"; "b" keeps float32 state), the
    params then resume bit for bit; "c"'s blocks differ, so its moments are requantized,
    within the format's rounding. Each rank runs its own 1-rank job (a 1-rank mesh and
    process group) in step with the other, as choose_optimizer and step agree over the
    default group."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh2 = init_device_mesh("cpu", (WORLD,))
    singles = [dist.new_group([r]) for r in range(WORLD)]
    mine = singles[rank]
    mesh1 = DeviceMesh.from_group(mine, "cpu")
    root = _ckpt_dir[0]
    for config in ("fp32", "8bit"):
        exact = ("a", "b", "c") if config == "fp32" else ("a", "b")
        # 2 -> 1
        model, opt = _build(config, mesh2)
        _run(model, opt, range(_SAVE_AT))
        moments = {n: _dequantized(opt, p) for n, p in model.named_parameters() if opt.state.get(p)}
        _dcp_save(model, opt, root / f"reshard_{config}_w2")
        _run(model, opt, range(_SAVE_AT, _STEPS))
        want = _full_params(model)
        model1, opt1 = _build(config, mesh1)
        _dcp_load(model1, opt1, root / f"reshard_{config}_w2", pg=mine)
        assert not opt1.state.get(model1.h)
        _assert_within_8bit_rounding(opt1, model1, moments, exact)
        _run(model1, opt1, range(_SAVE_AT, _STEPS))
        got = _full_params(model1)
        for name in exact:
            assert torch.equal(got[name], want[name]), (config, "2 -> 1", name)
        # 1 -> 2
        path = root / f"reshard_{config}_w1_rank{rank}"
        model1, opt1 = _build(config, mesh1)
        _run(model1, opt1, range(_SAVE_AT))
        moments = {
            n: _dequantized(opt1, p) for n, p in model1.named_parameters() if opt1.state.get(p)
        }
        _dcp_save(model1, opt1, path, pg=mine)
        _run(model1, opt1, range(_SAVE_AT, _STEPS))
        want = _full_params(model1)
        dist.barrier()
        model, opt = _build(config, mesh2)
        _dcp_load(model, opt, root / f"reshard_{config}_w1_rank0")
        assert not opt.state.get(model.h)
        _assert_within_8bit_rounding(opt, model, moments, exact)
        _run(model, opt, range(_SAVE_AT, _STEPS))
        got = _full_params(model)
        for name in exact:
            assert torch.equal(got[name], want[name]), (config, "1 -> 2", name)


# Weights of the unsharded -> FSDP2 case, by name: global shape. "a": 6,144 elements,
# each rank's 3,072 whole blocks (the same blocks unsharded); "c": 7 rows of 1,000, split
# 4 + 3 (rank 1 starts mid-block); "r": 24 rows of 250, 24 blocks (as many block scales
# as rows: DCP had split its scales like its rows), split 12 + 12 (rank 1 starts at
# element 3,000, mid-block); "b": 512 (float32 state on the 8bit rung).
_UNSHARDED_PARAMS = {"a": (64, 96), "c": (7, 1000), "r": (24, 250), "b": (8, 64)}


class _UnshardedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)  # the same init on every rank
        for name, shape in _UNSHARDED_PARAMS.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen) / 10))


def _unsharded_run(model: nn.Module, opt: LadderOptimizer, steps: range) -> None:
    """Steps on the same full grads whatever the sharding (each rank takes its rows)."""
    for s in steps:
        for i, (name, shape) in enumerate(_UNSHARDED_PARAMS.items()):
            p = model.get_parameter(name)
            g = torch.randn(shape, generator=torch.Generator().manual_seed(100 * s + i))
            p.grad = _shard_of(g, p) if is_dtensor(p) else g
        opt.step()
        opt.zero_grad()


def _case_dcp_unsharded_to_fsdp2(rank: int) -> None:
    """A DCP checkpoint of an 8bit run without FSDP (bitsandbytes' layout: one block
    scale per 256 elements of the whole param) loads under FSDP2 on 2 ranks, and so
    does its full state dict through set_optimizer_state_dict. DCP's was refused on
    every rung ("absmax1 has 24 values; 3072 elements ... need 12": the scales were read
    against this rank's shard); the full state dict loaded the template's zero moments
    on 8bit and was refused on fp32. 8bit: codes and scales exact for
    the params whose shards start on a block boundary ("a"; "b" keeps float32 state),
    which then resume bit for bit; the others requantized within the format's
    rounding. fp32: every moment is the value the 8-bit state held (dequantized here
    independently), and the run resumes bit for bit as the unsharded run moved to
    fp32 at the save."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    singles = [dist.new_group([r]) for r in range(WORLD)]
    kw: dict[str, Any] = {"lr": 1e-2, "free_memory": "1GiB", "environ": {}}
    want: dict[str, dict[str, torch.Tensor]] = {}
    for rung in ("8bit", "fp32"):  # each rank runs the same unsharded job, in step
        plain = _UnshardedNet()
        opt = choose_optimizer(plain, rung="8bit", **kw)
        _unsharded_run(plain, opt, range(_SAVE_AT))
        if rung == "8bit":
            at_save = _full_params(plain)
            moments = {n: _dequantized(opt, p) for n, p in plain.named_parameters()}
            _dcp_save(plain, opt, _ckpt_dir[0] / f"unsharded_rank{rank}", pg=singles[rank])
            full = copy.deepcopy(
                get_optimizer_state_dict(plain, opt, options=StateDictOptions(full_state_dict=True))
            )
        else:  # the reference: the same run moved to fp32 at the save
            opt.migrate_to("fp32", "the reference", force=True)
        _unsharded_run(plain, opt, range(_SAVE_AT, _STEPS))
        want[rung] = _full_params(plain)
    dist.barrier()
    # The same state as DCP saved it, and as a full state dict on every rank, which
    # torch merges into the live state dict (row form on 8bit, Adam on fp32), keeping
    # the keys it lacks: each param's state then holds two forms, of which the live
    # one's keys are the template's. The row form, the template's, was read alone:
    # every moment loaded as the template's zeros, no error.
    cases = [
        ("dcp", "8bit", ("a", "b")),
        ("dcp", "fp32", tuple(_UNSHARDED_PARAMS)),
        # into another rung, torch's own merge fails (KeyError on the groups' keys)
        ("full state dict", "8bit", ("a", "b")),
    ]
    for how, rung, exact in cases:
        model = _UnshardedNet()
        fully_shard(model, mesh=mesh)
        sharded = choose_optimizer(model, rung=rung, **kw)
        if how == "dcp":
            _dcp_load(model, sharded, _ckpt_dir[0] / "unsharded_rank0")
        else:
            model.load_state_dict(
                {n: _shard_of(at_save[n], p) for n, p in model.named_parameters()}
            )
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(model, sharded, copy.deepcopy(full), options=options)
        if rung == "8bit":
            _assert_within_8bit_rounding(sharded, model, moments, exact)
        else:
            for name, old in moments.items():
                new = _dequantized(sharded, model.get_parameter(name))
                for m in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(new[m], old[m]), (how, name, m)
        _unsharded_run(model, sharded, range(_SAVE_AT, _STEPS))
        got = _full_params(model)
        for name in exact:
            assert torch.equal(got[name], want[rung][name]), (how, rung, name)


CASES: dict[str, Callable[[int], None]] = {
    "decision": _case_decision,
    "construction_collectives": _case_construction_collectives,
    "oom_step": _case_oom_step,
    "fixed": _case_fixed,
    "pinned_group": _case_pinned_group,
    "follow": _case_follow,
    "ddp_ladder": _case_ddp_ladder,
    "failed_move": _case_failed_move,
    "failed_prepare": _case_failed_prepare,
    "fsdp": _case_fsdp,
    "dcp_same_world": _case_dcp_same_world,
    "dcp_full_state_dict": _case_dcp_full_state_dict,
    "dcp_reshard": _case_dcp_reshard,
    "dcp_unsharded_to_fsdp2": _case_dcp_unsharded_to_fsdp2,
}


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    """Run every case in order on this rank, recording each outcome as it ends."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    recorded: dict[str, str] = {}
    path = Path(out_dir) / f"rank{rank}.json"
    _ckpt_dir.append(Path(out_dir))
    for case, run in CASES.items():
        try:
            run(rank)
            dist.barrier()  # the next case starts together
        except BaseException:
            recorded[case] = traceback.format_exc()
            for later in list(CASES)[list(CASES).index(case) + 1 :]:
                recorded[later] = f"not run: case {case!r} failed on rank {rank}"
            path.write_text(json.dumps(recorded))
            sys.stdout.flush()
            os._exit(1)  # the other rank fails in its next collective instead of waiting
        recorded[case] = "ok"
        path.write_text(json.dumps(recorded))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
