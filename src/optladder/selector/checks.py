"""Checks of param groups shared by ``choose_optimizer`` and ``add_param_group``."""

from __future__ import annotations

from typing import Any

import torch

from optladder.optimizers.adamw import validate_hyperparams
from optladder.rungs import Rung
from optladder.sharding import is_dtensor

_BNB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_groups(groups: list[dict[str, Any]], decoupled_weight_decay: bool) -> None:
    """Refuse what the rungs would silently get wrong: per-group options no rung keeps,
    out-of-range per-group hyperparameters, a param listed twice or two params over the
    same memory (each would be stepped twice), and expanded views (stride 0).

    Args:
        groups: all param groups (for ``add_param_group``: the live ones plus the new).
        decoupled_weight_decay: the optimizer's mode; a group may not ask for the other.

    Raises:
        ValueError: naming the group or param, what was found and what is allowed.
    """
    seen: dict[int, str] = {}
    storage: dict[tuple[Any, ...], str] = {}
    for gi, group in enumerate(groups):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(
                    f"param group {gi} sets {flag}=True, which optladder's rungs do not support"
                )
        if group.get("decoupled_weight_decay", decoupled_weight_decay) != decoupled_weight_decay:
            raise ValueError(
                f"param group {gi} sets decoupled_weight_decay={group['decoupled_weight_decay']!r}"
                f"; pass decoupled_weight_decay={group['decoupled_weight_decay']!r} to "
                "choose_optimizer instead (one mode per optimizer)"
            )
        try:
            validate_hyperparams(
                group.get("lr", 0.0),
                group.get("betas", (0.0, 0.0)),
                group.get("eps", 0.0),
                group.get("weight_decay", 0.0),
            )
        except ValueError as exc:
            raise ValueError(f"param group {gi}: {exc}") from None
        for pi, p in enumerate(group["params"]):
            where = f"param {pi} of group {gi}"
            if id(p) in seen:
                raise ValueError(f"{where} is the same tensor as {seen[id(p)]}; list it once")
            seen[id(p)] = where
            if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
                raise ValueError(
                    f"{where} is an expanded view (a stride of 0): its elements share memory. "
                    "Optimize a real tensor (.contiguous())"
                )
            if p.device.type != "meta" and not is_dtensor(p) and p.numel() > 0:
                key = (str(p.device), p.data_ptr(), tuple(p.shape), p.stride(), p.dtype)
                if key in storage:
                    raise ValueError(
                        f"{where} views the same memory as {storage[key]}; each would be "
                        "stepped; optimize one of them"
                    )
                storage[key] = where


def check_params_for_rung(
    params: list[torch.Tensor], rung: Rung, engine: torch.optim.Optimizer
) -> None:
    """Refuse params the current rung's engine cannot step correctly.

    Complex params run on the fp32 rung only; the 8-bit rung takes float32, bfloat16 and
    float16; torch's AdamW (the fp32 rung of float32 params) would keep bfloat16/float16
    params' moments in their own dtype and has no fused kernel for complex params.

    Raises:
        ValueError: naming the param, its dtype and what is allowed.
    """
    from optladder.optimizers.adamw import LadderAdamW

    for pi, p in enumerate(params):
        where = f"param {pi} of the new group ({p.dtype})"
        if p.is_complex() and rung != "fp32":
            raise ValueError(f"{where}: the {rung} rung takes real params only")
        if rung == "8bit" and p.dtype not in _BNB_DTYPES:
            raise ValueError(f"{where}: the 8bit rung takes float32, bfloat16 or float16 params")
        torch_engine = rung == "fp32" and not isinstance(engine, LadderAdamW)
        if torch_engine and p.dtype in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"{where}: this optimizer's fp32 rung runs torch's AdamW, which would keep its "
                "moments in that dtype; add float32 params, or create the optimizer with "
                "these params so that the fp32 rung keeps float32 moments for them"
            )
        if torch_engine and p.is_complex() and engine.defaults.get("fused"):
            raise ValueError(f"{where}: torch's fused AdamW has no kernel for complex params")
