"""How the rungs keep ``step`` (the number of steps a param took), and its range.

- Adam layout (``torch.optim.AdamW``, :class:`~optladder.optimizers.adamw.LadderAdamW`):
  a 0-d :data:`STEP_DTYPE` tensor. float64 counts exactly to 2**53; float32, torch's
  default, stops at 2**24 = 16,777,216, where ``step + 1`` rounds back to ``step``.
  torch's fused AdamW takes float32 or float64 steps (``torch._fused_adamw_``: "step
  tensors that can be CPU and float32/64"); its other paths read ``step.item()``.
- bitsandbytes layout: a Python int.
"""

from __future__ import annotations

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
