"""How the rungs keep ``step`` (the number of steps a param took), and its range.

- Adam layout (``torch.optim.AdamW``, :class:`~optladder.optimizers.adamw.LadderAdamW`):
  a 0-d :data:`STEP_DTYPE` tensor. float64 counts exactly to 2**53; float32, torch's
  default, stops at 2**24 = 16,777,216, where ``step + 1`` rounds back to ``step``.
  torch's fused AdamW takes float32 or float64 steps (``torch._fused_adamw_``: "step
  tensors that can be CPU and float32/64"); its other paths read ``step.item()``.
- bitsandbytes layout: a Python int.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

STEP_DTYPE = torch.float64
"""dtype of the Adam layout's ``step`` tensors."""

MAX_STEP = 2**53 - 1
"""The largest step count kept exactly (float64's integer range)."""

BF16_MAX_STEP = 2**32 - 2
"""The largest step count the bf16 rung steps from: its random bits key
(:func:`optladder.optimizers.rounding.element_key`) takes steps below 2**32."""

BNB_CUDA_MAX_STEP = 2**31 - 2
"""The largest step count bitsandbytes' CUDA 8-bit update steps from: it passes the step
to its kernel as a C ``int32`` (``ct.c_int32(step)`` in ``bitsandbytes/backends/cuda``)."""


def refuse_shared_steps(
    steps: Sequence[torch.Tensor], name: Callable[[int], str] | None = None
) -> None:
    """Refuse step count tensors that two params share (the same tensor, or tensors on
    one memory: ``state[p2]["step"] = state[p1]["step"]`` by hand, or a hand-built
    state), before anything is written.

    Each param counts its own steps, once per step. A shared tensor cannot: torch's
    AdamW adds one for each param that holds it (two a step), and every kernel would
    read it at another point of its bumps (torch's single-tensor loop steps the first
    param with ``step + 1`` and the second with ``step + 2``, its foreach and fused
    loops both with ``step + 2``), so the bits would depend on the code path.
    optladder's own loads give each param a step tensor of its own.

    Args:
        steps: the step tensors of the params a step will step, in order.
        name: ``i -> "param ..."`` naming the param of ``steps[i]``, for the error.

    Raises:
        ValueError: naming the two params and how to give each its own count.
    """
    try:
        keys: list[object] = list(map(torch.Tensor.data_ptr, steps))
    except RuntimeError:  # a tensor without storage (a wrapper subclass): by identity
        keys = list(map(id, steps))
    if len(set(keys)) == len(keys):
        return  # the common case, in C
    devices = list(map(torch.Tensor.get_device, steps))
    seen: dict[tuple[int, object], int] = {}
    for i, key in enumerate(zip(devices, keys)):
        j = seen.setdefault(key, i)
        if j != i:
            where = name or (lambda k: f"param {k}")
            raise ValueError(
                f"{where(j)} and {where(i)} share one step count tensor; each param counts "
                "its own steps (torch's AdamW would add one for each of them at every "
                "step): give each its own, e.g. state[p]['step'] = state[p]['step'].clone()"
            )
