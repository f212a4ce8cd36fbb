"""The fp32 rung: :class:`LadderAdamW` in the fp32 state format (float32 moments, or
the param's own dtype on torch's kernels for float32, float64 and complex params)."""

from __future__ import annotations

from typing import Any

import torch

from optladder.optimizers.adamw import LadderAdamW, refuse_ladder_dtypes
from optladder.optimizers.checked import first_params_only
from optladder.optimizers.rounding import Rounding
from optladder.optimizers.spec import Fp32Engine


def build_fp32(
    param_groups: list[dict[str, Any]],
    *,
    engine: Fp32Engine,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
    seed: int = 0,
    rounding: Rounding = "stochastic",
    param_rounding: Rounding = "stochastic",
    checked: bool = False,
) -> LadderAdamW:
    """Build the fp32 rung's optimizer: :class:`LadderAdamW` with float32 moments (the
    fp32 state format), whose float32, float64 and complex params step on torch's
    kernels (bit for bit ``torch.optim.AdamW``) and whose bfloat16/float16 params keep
    float32 moments on optladder's kernels (:mod:`optladder.optimizers.torchroute`).

    Args:
        param_groups: the param groups (each dict's other keys override the defaults).
        engine: ``"fused"``: torch's fused kernel where the device has it; ``"foreach"``:
            torch's foreach path for the float32/float64 params (the decision found the
            fused kernel not running here); ``"ladder"``: as ``"fused"`` (bf16/fp16
            params among them). See :mod:`optladder.optimizers.spec`.
        lr, betas, eps, weight_decay: AdamW hyperparameters.
        decoupled_weight_decay: True for AdamW, False for Adam (``grad += wd * param``).
        seed: the stochastic-rounding seed, ``0 <= seed < 2**64`` (its bfloat16/float16
            param writes' random bits; kept in each group, so a move to the bf16 rung
            keeps it).
        rounding: the bf16 rung's moment rounding, kept in each group for a move to the
            bf16 rung (float32 moments are not rounded).
        param_rounding: how bfloat16/float16 params are written.
        checked: the params passed construction's checks: torch's per-param checks run
            over each group's first param only (:mod:`optladder.optimizers.checked`).

    Returns:
        The optimizer over ``param_groups``.
    """
    if checked:  # its own check of the dtypes, over every param
        for group in param_groups:
            refuse_ladder_dtypes(group["params"], torch.float32, torch_kernels=True)
    with first_params_only(param_groups, checked):
        return LadderAdamW(
            param_groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            moment_dtype=torch.float32,
            seed=seed,
            rounding=rounding,
            param_rounding=param_rounding,
            torch_fused=engine != "foreach",
        )
