"""Build the engine of one rung over param groups."""

from __future__ import annotations

from typing import Any

import torch

from optladder.optimizers import spec
from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.eightbit import build_8bit
from optladder.optimizers.fp32 import build_fp32
from optladder.optimizers.rounding import Rounding
from optladder.rungs import Rung


ENGINE_KEYS = (
    # torch.optim.AdamW
    "fused",
    "foreach",
    "capturable",
    "differentiable",
    "amsgrad",
    "maximize",
    "decoupled_weight_decay",
    # bitsandbytes Optimizer2State
    "alpha",
    "t_alpha",
    "t_beta3",
)
"""Param-group keys that belong to one engine's implementation, not to the user's
hyperparameters. They are cleared before another engine takes the groups: torch's
``add_param_group`` keeps existing keys, so a stale ``fused=True`` would otherwise reach
an engine that must not use it."""


def clear_engine_keys(param_groups: list[dict[str, Any]]) -> None:
    """Remove :data:`ENGINE_KEYS` from each group, in place."""
    for group in param_groups:
        for key in ENGINE_KEYS:
            group.pop(key, None)


def _dtype_names(param_groups: list[dict[str, Any]]) -> set[str]:
    return {str(p.dtype).removeprefix("torch.") for g in param_groups for p in g["params"]}


def build_engine(
    rung: Rung,
    param_groups: list[dict[str, Any]],
    *,
    fused: bool,
    lr: float | torch.Tensor = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    seed: int = 0,
    rounding: Rounding = "stochastic",
) -> torch.optim.Optimizer:
    """Build the optimizer that runs ``rung`` over ``param_groups``.

    Args:
        rung: ``"fp32"``, ``"bf16"`` or ``"8bit"``.
        param_groups: param groups; the dicts are used as given (their hyperparameters
            override the defaults per group) after :data:`ENGINE_KEYS` are cleared.
        fused: whether the rung runs fused here (``Decision.fused``); for the fp32 rung it
            selects torch's fused AdamW over foreach (or optladder's eager AdamW for
            bf16/fp16 params, see :func:`optladder.optimizers.spec.fp32_engine`).
        lr, betas, eps, weight_decay: AdamW hyperparameters (torch's meaning).
        seed: the bf16 rung's stochastic-rounding seed, ``0 <= seed < 2**64``.
        rounding: the bf16 rung's rounding, ``"stochastic"`` or ``"nearest"``.

    Returns:
        A ``torch.optim.Optimizer``: ``torch.optim.AdamW`` or :class:`LadderAdamW` (fp32),
        :class:`LadderAdamW` with bfloat16 moments (bf16), ``bitsandbytes.optim.AdamW8bit``
        (8bit).

    Raises:
        ValueError: for an unknown rung, bad hyperparameters, or params the rung refuses
            (complex params on bf16 and 8bit).
        ImportError: for the 8bit rung without bitsandbytes.
    """
    hyper: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    clear_engine_keys(param_groups)
    if rung == "fp32":
        engine = spec.fp32_engine(fused, _dtype_names(param_groups))
        return build_fp32(param_groups, engine=engine, **hyper)
    if rung == "bf16":
        return LadderAdamW(
            param_groups, moment_dtype=torch.bfloat16, seed=seed, rounding=rounding, **hyper
        )
    if rung == "8bit":
        return build_8bit(param_groups, **hyper)
    raise ValueError(f"rung={rung!r} is not a rung; accepted values: fp32, bf16, 8bit")
