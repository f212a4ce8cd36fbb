"""Measure the optimizer state an optimizer really holds."""

from __future__ import annotations

import torch

from optladder.sharding import local_tensor


def measure_state_bytes(optimizer: torch.optim.Optimizer, include_step: bool = False) -> int:
    """Bytes of the tensors in ``optimizer.state``, each storage counted once.

    Counting storages (not tensors) counts a tensor shared by many params once, as
    bitsandbytes shares its code books. This is the quantity the footprint estimates.
    DTensor state (torch's AdamW over FSDP2 params) counts this rank's shards.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (optladder's delegates to its engine's
            state).
        include_step: also count ``step`` tensors (0-d, 4 bytes each in torch).

    Returns:
        Bytes, ``>= 0``.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for state in optimizer.state.values():
        for name, value in state.items():
            if not isinstance(value, torch.Tensor) or (name == "step" and not include_step):
                continue
            value = local_tensor(value)  # a DTensor moment: this rank's shard
            storage = value.untyped_storage()
            key = (str(value.device), storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
