"""Agreement across ranks under ``torch.distributed``: every cross-rank collective the
optimizer runs lives here.

At construction every rank must reach the same decision: :func:`agree_inputs` gives
every rank the same inputs for it in one ``all_gather_object`` (the least free memory,
the largest state bytes of each rung, rank 0's footprint, capabilities, policy and
overrides), and ``decide`` is a pure function of them; in a step every rank must agree, before any
rank commits, whether any rank's prepare ran out of memory or failed and which rungs the
ranks are on (:func:`agree_step`, one small all-reduce); after an escalation, whether
every rank's move succeeded (:func:`agree_any`).
On a single process (no initialized process group) each returns its input and
communicates nothing.

The collectives run on ``device`` under NCCL and on the CPU under other backends (gloo).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from optladder.policies import Footprint, Overrides, Policy
from optladder.rungs import RUNGS, Capabilities

__all__ = [
    "STEP_FAILED",
    "STEP_OK",
    "STEP_OUT_OF_MEMORY",
    "DecisionInputs",
    "agree_any",
    "agree_inputs",
    "agree_step",
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


class DecisionInputs(NamedTuple):
    """What :func:`optladder.policies.decide` reads at construction, besides nothing.

    Attributes:
        footprint: the trainable params' footprint.
        free: free memory on the target device, in bytes.
        source: where ``free`` came from, in words.
        capabilities: the target device's kernels.
        policy: the policy's thresholds.
        overrides: the user's word on the rung.
    """

    footprint: Footprint
    free: int
    source: str
    capabilities: Capabilities
    policy: Policy
    overrides: Overrides


def agree_inputs(mine: DecisionInputs) -> DecisionInputs:
    """The decision's inputs every rank decides from, in one ``all_gather_object``: rank
    0's footprint with each rung's state bytes the largest over the ranks (sharded
    (DTensor) params can leave ranks with shards of different sizes, and the rung must fit
    the rank that needs the most), the least free memory over the ranks (every rank must
    fit the same rung; its source says so), and rank 0's capabilities, policy and
    overrides. ``decide`` being pure, every rank then reaches rank 0's decision over these.

    Each rank sends its free bytes and state bytes; rank 0 sends its inputs too (a few
    kilobytes, pickled; the others send None for them). Collectives on the CPU under
    gloo; under NCCL on the current CUDA device, as ``all_gather_object`` runs them.

    Returns:
        ``mine`` on a single process (no initialized process group, or one rank).
    """
    dist = _distributed()
    if dist is None or dist.get_world_size() == 1:
        return mine
    each = tuple(mine.footprint.state_bytes[r] for r in RUNGS)
    sent = (mine.free, each, mine if dist.get_rank() == 0 else None)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sent)
    first: DecisionInputs = parts[0][2]
    largest = {r: max(part[1][k] for part in parts) for k, r in enumerate(RUNGS)}
    return first._replace(
        footprint=first.footprint.model_copy(update={"state_bytes": largest}),
        free=min(part[0] for part in parts),
        source=f"{first.source}; minimum over {dist.get_world_size()} ranks",
    )
