"""Checks of param groups shared by ``choose_optimizer``, ``add_param_group`` and
``load_state_dict``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from optladder.optimizers.adamw import LadderAdamW, validate_group_hyperparams
from optladder.optimizers.eightbit import check_8bit_param
from optladder.optimizers.rounding import check_param_rounding, check_rounding, check_seed
from optladder.policies.decision import Decision, allowed_rungs
from optladder.policies.footprint import storage_key
from optladder.rungs import Rung, group_pin


def check_group_options(group: Mapping[str, Any]) -> None:
    """Refuse per-group options that no rung keeps (instead of silently dropping them),
    and an out-of-range bf16 seed, rounding or param_rounding mode.

    Raises:
        ValueError: naming the option, its value and what is allowed.
    """
    for flag in ("amsgrad", "maximize", "differentiable"):
        if group.get(flag):
            raise ValueError(f"{flag}=True is not supported by optladder's rungs")
    check_seed(group.get("seed", 0))
    check_rounding(group.get("rounding", "stochastic"))
    check_param_rounding(group.get("param_rounding", "stochastic"))


def check_max_retries(max_retries: object) -> None:
    """Raise unless ``max_retries`` is an integer ``>= 0`` (a bool is not a count).

    Raises:
        ValueError: naming ``max_retries``, its value and what is allowed.
    """
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")


def check_groups(groups: list[dict[str, Any]], decoupled_weight_decay: bool) -> None:
    """Refuse what the rungs would silently get wrong: per-group options no rung keeps,
    out-of-range per-group hyperparameters, a pinned ``"rung"`` that is not a rung, a
    param listed twice or two params over the same memory (each would be stepped twice),
    expanded views (stride 0), non-leaf tensors and params that are not floating point
    or complex.

    Args:
        groups: all param groups (for ``add_param_group``: the live ones plus the new).
        decoupled_weight_decay: the optimizer's mode; a group may not ask for the other.

    Raises:
        ValueError: naming the group or param, what was found and what is allowed.
    """
    seen: dict[int, str] = {}
    storage: dict[tuple[Any, ...], str] = {}
    for gi, group in enumerate(groups):
        if group.get("decoupled_weight_decay", decoupled_weight_decay) != decoupled_weight_decay:
            raise ValueError(
                f"param group {gi} sets decoupled_weight_decay={group['decoupled_weight_decay']!r}"
                f"; pass decoupled_weight_decay={group['decoupled_weight_decay']!r} to "
                "choose_optimizer instead (one mode per optimizer)"
            )
        group_pin(group, f"param group {gi}")
        try:
            check_group_options(group)
            validate_group_hyperparams(group)
        except ValueError as exc:
            raise ValueError(f"param group {gi}: {exc}") from None
        for pi, p in enumerate(group["params"]):
            where = f"param {pi} of group {gi}"
            if id(p) in seen:
                raise ValueError(f"{where} is the same tensor as {seen[id(p)]}; list it once")
            seen[id(p)] = where
            if not (p.is_leaf or p.retains_grad):  # torch.optim's own rule
                raise ValueError(
                    f"{where} is not a leaf tensor (it is computed from others); optimize leaf "
                    "params such as nn.Parameter"
                )
            if not (p.is_floating_point() or p.is_complex()):
                raise ValueError(
                    f"{where} has dtype {p.dtype}; the rungs step floating-point params "
                    "(complex ones on fp32)"
                )
            if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
                raise ValueError(
                    f"{where} is an expanded view (a stride of 0): its elements share memory. "
                    "Optimize a real tensor (.contiguous())"
                )
            key = storage_key(p) if p.numel() > 0 else None  # empty tensors share no memory
            if key is not None:
                if key in storage:
                    raise ValueError(
                        f"{where} views the same memory as {storage[key]}; each would be "
                        "stepped; optimize one of them"
                    )
                storage[key] = where


def check_pins(groups: list[dict[str, Any]], decision: Decision) -> None:
    """Refuse group pins the run cannot honour: a pinned rung the user disabled (``=0``)
    or the device cannot run, and pins that leave no trainable param to follow the
    decision (pin the whole optimizer with ``rung=`` instead).

    Args:
        groups: all param groups.
        decision: the decision for the groups that follow it.

    Raises:
        ValueError: naming the group, its rung and why it cannot be used.
    """
    # A pinned group's own params are checked against its rung where its engine is built.
    real = decision.footprint.model_copy(update={"has_complex": False, "dtypes": ()})
    allowed, excluded = allowed_rungs(real, decision.capabilities, decision.overrides)
    pins = [group_pin(group, f"param group {gi}") for gi, group in enumerate(groups)]
    for gi, pin in enumerate(pins):
        if pin is not None and not allowed[pin]:
            raise ValueError(
                f"param group {gi} pins the {pin} rung, which cannot be used: {excluded[pin]}"
            )
    following = (p for g, pin in zip(groups, pins) if pin is None for p in g["params"])
    if not any(p.requires_grad for p in following):
        raise ValueError(
            "every trainable param is in a param group that pins its rung "
            "(param_group['rung']), so none follows the decision; leave at least one group "
            "of trainable params unpinned, or pin the whole optimizer with rung= / "
            "OPTLADDER_RUNG"
        )


def check_params_for_rung(
    params: list[torch.Tensor],
    rung: Rung,
    engine: torch.optim.Optimizer | None,
    group: str = "the new group",
) -> None:
    """Refuse params ``rung``'s engine cannot step correctly.

    Complex params run on the fp32 rung only; the 8-bit rung takes float32, bfloat16 and
    float16; torch's AdamW (the fp32 rung of float32 params) would keep bfloat16/float16
    params' moments in their own dtype and has no fused kernel for complex params, and
    optladder's AdamW (the fp32 rung of bfloat16/float16 params) takes real params only.

    Args:
        params: the params of one group.
        rung: the rung they would join.
        engine: the engine they would join, or None for one to be built for them (the
            rules that depend on the engine are skipped).
        group: names the group in messages, e.g. ``"group 2"``.

    Raises:
        ValueError: naming the param, its dtype and what is allowed.
    """
    for pi, p in enumerate(params):
        where = f"param {pi} of {group} ({p.dtype})"
        if rung == "8bit":
            check_8bit_param(p, f"param {pi} of {group}")
        if p.is_complex() and rung != "fp32":
            raise ValueError(f"{where}: the {rung} rung takes real params only")
        if engine is None:
            continue
        if p.is_complex() and isinstance(engine, LadderAdamW):
            raise ValueError(
                f"{where}: this fp32 rung runs optladder's AdamW (float32 moments for "
                "bfloat16/float16 params), which takes real params only; create the optimizer "
                "with the complex params among its params instead"
            )
        torch_engine = rung == "fp32" and not isinstance(engine, LadderAdamW)
        if torch_engine and p.dtype in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"{where}: this optimizer's fp32 rung runs torch's AdamW, which would keep its "
                "moments in that dtype; add float32 params, or create the optimizer with "
                "these params so that the fp32 rung keeps float32 moments for them"
            )
        if torch_engine and p.is_complex() and engine.defaults.get("fused"):
            raise ValueError(f"{where}: torch's fused AdamW has no kernel for complex params")
