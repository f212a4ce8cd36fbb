"""Agreement across ranks under ``torch.distributed``: every cross-rank collective the
optimizer runs lives here.

At construction every rank must reach the same decision (:func:`min_over_ranks` of the
free memory, :func:`largest_over_ranks` of each rung's state bytes, then rank 0's decision
on every rank: :func:`same_on_all_ranks`); in a step every rank must agree, before any
rank commits, whether any rank's prepare ran out of memory or failed and which rungs the
ranks are on (:func:`agree_step`, one small all-reduce); after an escalation, whether
every rank's move succeeded (:func:`agree_any`).
On a single process (no initialized process group) each returns its input and
communicates nothing.

The collectives run on ``device`` under NCCL and on the CPU under other backends (gloo).
"""

from __future__ import annotations

from typing import Any

import torch

from optladder.policies import Decision, Footprint
from optladder.rungs import RUNGS

__all__ = [
    "STEP_FAILED",
    "STEP_OK",
    "STEP_OUT_OF_MEMORY",
    "agree_any",
    "agree_step",
    "largest_over_ranks",
    "min_over_ranks",
    "same_on_all_ranks",
]


def _distributed() -> Any:
    """``torch.distributed`` when a process group is initialized, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _reduced(
    dist: Any, values: list[int], op: Any, dtype: torch.dtype, device: str | torch.device
) -> list[int]:
    """``values`` reduced elementwise over the ranks with ``op`` (``dist.ReduceOp``), in
    one all-reduce on ``device`` under NCCL and on the CPU under other backends (gloo)."""
    on = device if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=dtype, device=on)
    dist.all_reduce(t, op=op)
    return [int(v) for v in t.tolist()]


def agree_any(flag: bool, device: str) -> bool:
    """True on every rank if ``flag`` is True on any rank (an all-reduce with MAX of one
    int32 on ``device``, or on the CPU under a backend other than NCCL)."""
    dist = _distributed()
    if dist is None:
        return flag
    return bool(_reduced(dist, [int(flag)], dist.ReduceOp.MAX, torch.int32, device)[0])


STEP_OK = 0
"""A rank's prepare succeeded (:func:`agree_step`)."""
STEP_OUT_OF_MEMORY = 1
"""A rank's prepare ran out of memory: every rank escalates and retries."""
STEP_FAILED = 2
"""A rank's prepare raised something else: every rank raises, nothing committed."""


def agree_step(status: int, rung_index: int, device: str) -> tuple[int, int, int]:
    """The worst prepare outcome over the ranks (:data:`STEP_OK`,
    :data:`STEP_OUT_OF_MEMORY` or :data:`STEP_FAILED`, in that order), and the largest
    and the smallest rung index (place in :data:`optladder.rungs.RUNGS`) over the ranks:
    one all-reduce with MAX of three int32 on ``device`` (on the CPU under a backend
    other than NCCL). Ranks on different rungs (one moved down alone:
    :class:`optladder.Ladder` after an out-of-memory error in its forward or backward,
    which the others did not see) are told so on every rank, so that the ranks behind
    follow before any commits; a rank whose prepare failed is known to every rank, so
    none waits for it in the next step's all-reduce.

    Returns:
        ``(status, furthest, nearest)``: ``(status, rung_index, rung_index)`` on a single
        process.
    """
    dist = _distributed()
    if dist is None:
        return status, rung_index, rung_index
    values = [status, rung_index, -rung_index]
    worst, furthest, minus_nearest = _reduced(dist, values, dist.ReduceOp.MAX, torch.int32, device)
    return worst, furthest, -minus_nearest


def min_over_ranks(free: int, source: str, device: torch.device) -> tuple[int, str]:
    """The least free memory over all ranks, in bytes, and its source in words (every
    rank must fit the same rung)."""
    dist = _distributed()
    if dist is None or dist.get_world_size() == 1:
        return free, source
    least = _reduced(dist, [free], dist.ReduceOp.MIN, torch.int64, device)[0]
    return least, f"{source}; minimum over {dist.get_world_size()} ranks"


def largest_over_ranks(footprint: Footprint, device: torch.device) -> Footprint:
    """``footprint`` with each rung's state bytes replaced by the maximum over all ranks.

    Sharded (DTensor) params can leave ranks with shards of different sizes; the rung
    must fit the rank that needs the most. Replicated params need the same everywhere.
    """
    dist = _distributed()
    if dist is None or dist.get_world_size() == 1:
        return footprint
    each = [footprint.state_bytes[r] for r in RUNGS]
    largest = dict(zip(RUNGS, _reduced(dist, each, dist.ReduceOp.MAX, torch.int64, device)))
    return footprint.model_copy(update={"state_bytes": largest})


def same_on_all_ranks(decision: Decision) -> Decision:
    """Rank 0's decision, on every rank (broadcast as its JSON)."""
    dist = _distributed()
    if dist is None or dist.get_world_size() == 1:
        return decision
    box: list[Any] = [decision.model_dump_json()]
    dist.broadcast_object_list(box, src=0)
    return Decision.model_validate_json(box[0])
