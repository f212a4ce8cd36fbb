"""The fp32 rung: :class:`LadderAdamW` in the fp32 state format (float32 moments, or
the param's own dtype on torch's kernels for float32, float64 and complex params)."""

from __future__ import annotations

from typing import Any

import torch

from optladder.optimizers.adamw import refuse_ladder_dtypes
from optladder.optimizers.spec import Fp32Engine


def fp32_options(
    param_groups: list[dict[str, Any]], *, engine: Fp32Engine, checked: bool = False
) -> dict[str, Any]:
    """The :class:`LadderAdamW` options of the fp32 rung over ``param_groups`` (float32
    moments, the fp32 state format), whose float32, float64 and complex params step on
    torch's kernels (bit for bit ``torch.optim.AdamW``) and whose bfloat16/float16 params
    keep float32 moments on optladder's kernels (:mod:`optladder.optimizers.torchroute`).

    Args:
        param_groups: the param groups.
        engine: ``"fused"``: torch's fused kernel where the device has it; ``"foreach"``:
            torch's foreach path for the float32/float64 params (the decision found the
            fused kernel not running here); ``"ladder"``: as ``"fused"`` (bf16/fp16
            params among them). See :mod:`optladder.optimizers.spec`.
        checked: the params passed construction's checks, so the optimizer is built with
            torch's per-param checks over each group's first param only
            (:mod:`optladder.optimizers.checked`): LadderAdamW's own dtype check runs
            here, over every param.

    Returns:
        ``moment_dtype`` and ``torch_fused``, LadderAdamW's keyword arguments.

    Raises:
        ValueError: a param dtype the fp32 format cannot step (naming it).
    """
    if checked:  # its own check of the dtypes, over every param
        for group in param_groups:
            refuse_ladder_dtypes(group["params"], torch.float32, torch_kernels=True)
    return {"moment_dtype": torch.float32, "torch_fused": engine != "foreach"}
