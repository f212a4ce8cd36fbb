"""The fp32 rung: float32 (or wider) moments on torch's fused AdamW where it can."""

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
) -> torch.optim.Optimizer:
    """Build the fp32 rung's optimizer.

    Args:
        param_groups: the param groups (each dict's other keys override the defaults).
        engine: ``"fused"`` -> ``torch.optim.AdamW(fused=True)``; ``"foreach"`` ->
            ``torch.optim.AdamW(foreach=True)``; ``"ladder"`` -> :class:`LadderAdamW` with
            float32 moments (for bf16/fp16 params, whose moments torch keeps in their
            own dtype; its fused kernels where they run). See :mod:`optladder.optimizers.spec`.
        lr, betas, eps, weight_decay: AdamW hyperparameters.
        decoupled_weight_decay: True for AdamW, False for Adam (``grad += wd * param``):
            ``torch.optim.Adam`` then, with the same fused/foreach choice.
        seed: the ``"ladder"`` engine's stochastic-rounding seed, ``0 <= seed < 2**64``
            (its param writes' random bits; kept in each group, so a move to the bf16
            rung keeps it).
        rounding: the bf16 rung's moment rounding, kept in each group of the
            ``"ladder"`` engine for a move to the bf16 rung (float32 moments are not
            rounded).
        param_rounding: how the ``"ladder"`` engine writes bfloat16/float16 params.
        checked: the params passed construction's checks: torch's per-param checks run
            over each group's first param only (:mod:`optladder.optimizers.checked`).

    Returns:
        The optimizer over ``param_groups``.
    """
    if engine == "ladder":
        if checked:  # its own check of the dtypes, over every param
            for group in param_groups:
                refuse_ladder_dtypes(group["params"], torch.float32)
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
            )
    flags = {"fused": True} if engine == "fused" else {"foreach": True}
    cls = torch.optim.AdamW if decoupled_weight_decay else torch.optim.Adam
    with first_params_only(param_groups, checked):
        return cls(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags)
