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
- ``oom_step``: an OOM injected into rank 1's first optimizer step (the allocation of the
  moments) makes both ranks roll back, escalate fp32 -> bf16 and retry; neither commits
  the failed step, and after more DDP-style steps (grads averaged by hand) the params,
  rungs and step counts are identical on both ranks.
- ``pinned``: the same OOM on a pinned rung raises ``OptimizerOutOfMemoryError`` on both
  ranks (no hang), with nothing committed; both ranks then step on together.
- ``fsdp``: FSDP2 (``fully_shard``) DTensor params. The footprint counts elements
  globally and state bytes per rank, and merges only true aliases; the 8bit rung steps
  each rank's local shard, quantizing the 6,144-element weight (3,072 per rank, under
  bitsandbytes' 4,096-element minimum) and never the 3,200-element one; an OOM on rank 1
  escalates both ranks fp32 -> 8bit (the bf16 rung does not take DTensors, and says so);
  the sharded run matches an unsharded one bit for bit, through a migration back to
  fp32; a state_dict round trip, a step on FSDP's own grads, and a ``Partial`` grad
  (reduced in the update) work too.
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

from memtools import FailNthAllocation
from optladder import (
    LadderOptimizer,
    OptimizerOutOfMemoryError,
    choose_optimizer,
    decide,
    measure_footprint,
    measure_state_bytes,
)
from optladder.optimizers import build_engine
from optladder.optimizers.migrate import read_step
from optladder.optimizers.transaction import prepare_step

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


def test_oom_in_one_ranks_step_escalates_every_rank_without_committing(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "oom_step")


def test_oom_on_a_pinned_rung_raises_on_every_rank(outcomes: list[dict[str, str]]) -> None:
    _check(outcomes, "pinned")


def test_oom_in_one_ranks_pinned_group_escalates_the_others_on_every_rank(
    outcomes: list[dict[str, str]],
) -> None:
    _check(outcomes, "pinned_group")


def test_fsdp2_footprint_and_8bit_rung_on_local_shards(outcomes: list[dict[str, str]]) -> None:
    _check(outcomes, "fsdp")


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
    assert opt.rung == "bf16" and type(opt.engine).__name__ == "LadderAdamW"
    assert _all_same(d.model_dump_json())
    # Rank 0's own free memory alone would have kept fp32: the minimum decided.
    alone = decide(fp, free, d.capabilities, d.policy, d.overrides)
    assert alone.rung == ("fp32" if rank == 0 else "bf16")


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


def _case_pinned(rank: int) -> None:
    params = _params((5_000, 300))
    opt = choose_optimizer(params, rung="fp32", free_memory="1GiB")
    _set_grads(params, _averaged_grads(params, 0, rank))
    before = [p.detach().clone() for p in params]
    with pytest.raises(OptimizerOutOfMemoryError) as info, _oom_on(rank, 1):
        opt.step()
    message = str(info.value)
    assert "pinned" in message, message
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

    # A state_dict round trip into a fresh optimizer pinned on 8bit, then one step with
    # FSDP's own forward/backward (grads reduce-scattered by FSDP).
    pinned = choose_optimizer(model, rung="8bit", free_memory="1GiB")
    pinned.load_state_dict(opt.state_dict())
    assert pinned.state[params[0]]["state1"].shape == (32, 96)
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(rank))
    pinned.zero_grad()
    model(x).square().mean().backward()
    pinned.step()
    assert _steps(pinned) == [5, 5]
    assert all(torch.isfinite(p.to_local()).all() for p in params)
    assert _all_same((pinned.rung, _steps(pinned), measure_state_bytes(pinned)))

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


CASES: dict[str, Callable[[int], None]] = {
    "decision": _case_decision,
    "oom_step": _case_oom_step,
    "pinned": _case_pinned,
    "pinned_group": _case_pinned_group,
    "fsdp": _case_fsdp,
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
