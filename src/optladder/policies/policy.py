"""The policy: the numbers that turn a footprint and free memory into a rung."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Policy(BaseModel):
    """Thresholds of the decision rules; frozen and validated.

    Attributes:
        proactive_bf16_min_params: trainable param elements (counted over the whole
            model, across ranks) from which the bf16 rung is chosen even when fp32 state
            would fit. Default 50,000,000, the threshold of the seed design's
            ``AIDOTNET_BF16_ADAM`` heuristic, where a large model's fp32 moments start
            to cost more than its activations save. Engaged only where the bf16 rung
            has a fused kernel on the target device: a memory saving that leaves the
            fast path made every large model there ~1.5x slower per step.
        memory_fraction: the memory gate. A rung passes when its state bytes are at most
            this fraction of the free memory (the rest is left for params, grads,
            activations and the allocator's slack). Default 0.25; must lie in (0, 1].
        proactive_bf16: set False to choose bf16 only when the memory gate demands it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    proactive_bf16_min_params: int = Field(default=50_000_000, ge=0)
    memory_fraction: float = Field(default=0.25, gt=0.0, le=1.0)
    proactive_bf16: bool = True
