"""The rung a new optimizer's groups start on: their checks and state format
(:func:`rung_options`)."""

from __future__ import annotations

import operator
from itertools import chain
from typing import Any

import torch

from optladder.columns import ParamColumns, plain_types
from optladder.dtype_names import dtype_name
from optladder.optimizers import spec
from optladder.optimizers.adamw import refuse_ladder_dtypes
from optladder.optimizers.eightbit import prepare_8bit_format
from optladder.optimizers.fp32 import fp32_options
from optladder.rungs import LADDER_DTYPES, RUNG_ACCEPTS, RUNG_KEY, Capabilities, Rung
from optladder.sharding import is_dtensor

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

KERNEL_KEYS = ("fused", "foreach", "capturable")
"""The :data:`ENGINE_KEYS` that choose torch's kernel. optladder chooses it (construction
refuses ``foreach``, ``fused=False`` and ``capturable=True``): a group's own values are
cleared when it joins (construction, ``add_param_group``), and a torch engine's groups
must keep the engine's (:func:`optladder.optimizers.transaction.check_step_inputs`)."""


DTENSOR_UNSUPPORTED: dict[Rung, str] = {
    rung: accepts.sharded_reason for rung, accepts in RUNG_ACCEPTS.items() if not accepts.sharded
}
"""Rungs whose engine cannot step DTensor params, and why (from
:data:`optladder.rungs.RUNG_ACCEPTS`). torch's AdamW (the fp32 rung
of float32 params) steps DTensors; the 8bit rung steps their local shards
(:class:`optladder.optimizers.eightbit.EightBitGroups`). The fp32 rung of
bfloat16/float16 params runs LadderAdamW too and refuses DTensors at build time."""


def _refuse_dtensors(
    rung: Rung, param_groups: list[dict[str, Any]], fp32_engine: spec.Fp32Engine | None
) -> None:
    """Raise if ``rung``'s engine would be LadderAdamW and a param is a DTensor.

    LadderAdamW keeps plain moments of the global shape and mixes them with DTensor
    params ("got mixed torch.Tensor and DTensor"); its C kernel reads raw pointers.
    ``fp32_engine``: the fp32 rung's engine (None on the other rungs).
    """
    ladder_fp32 = fp32_engine == "ladder"
    if rung not in DTENSOR_UNSUPPORTED and not ladder_fp32:
        return
    if all(plain_types(group["params"]) for group in param_groups):
        return
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if not is_dtensor(p):
                continue
            if ladder_fp32:
                raise ValueError(
                    f"rung='fp32' cannot take param {pi} of group {gi}, a {p.dtype} DTensor: "
                    "the fp32 rung keeps float32 moments for bfloat16/float16 params with "
                    "optladder's AdamW, which steps plain tensors only. Keep the sharded "
                    "params in float32 (FSDP2's MixedPrecisionPolicy(param_dtype="
                    "torch.bfloat16) still computes in bfloat16) or use rung='8bit'"
                )
            raise ValueError(
                f"rung={rung!r} cannot take param {pi} of group {gi}, a DTensor: "
                f"{DTENSOR_UNSUPPORTED[rung]}; use rung='fp32' or rung='8bit'"
            )


def without_dtensor_unsupported(capabilities: Capabilities) -> Capabilities:
    """``capabilities`` with the rungs of :data:`DTENSOR_UNSUPPORTED` marked unavailable
    (for a model with DTensor params), so the policy and the ladder skip them."""
    available = dict(capabilities.available)
    reasons = dict(capabilities.unavailable_reasons)
    for rung, reason in DTENSOR_UNSUPPORTED.items():
        if available.get(rung, True):
            available[rung] = False
            reasons[rung] = reason
    return capabilities.model_copy(update={"available": available, "unavailable_reasons": reasons})


def clear_engine_keys(param_groups: list[dict[str, Any]]) -> None:
    """Remove :data:`ENGINE_KEYS` from each group, in place."""
    for group in param_groups:
        for key in ENGINE_KEYS:
            group.pop(key, None)


def dtype_names(param_groups: list[dict[str, Any]]) -> set[str]:
    """Names of the groups' param dtypes, e.g. ``{"float32", "bfloat16"}`` (the form
    :func:`optladder.optimizers.probe_capabilities` and :mod:`.spec` take)."""
    dtypes = set(map(_DTYPE, chain.from_iterable(g["params"] for g in param_groups)))
    return set(map(dtype_name, dtypes))


_DTYPE = operator.attrgetter("dtype")


def rung_options(
    rung: Rung,
    param_groups: list[dict[str, Any]],
    *,
    fused: bool,
    columns: ParamColumns | None = None,
    checked: bool = False,
) -> dict[str, Any]:
    """Check ``param_groups`` for ``rung`` and put them in its state format (their
    ``"rung"`` key; :data:`ENGINE_KEYS` cleared); returns the :class:`LadderAdamW`
    keyword arguments beyond the hyperparameters that an optimizer over them on ``rung``
    takes (``moment_dtype``, ``torch_fused``).

    The groups are not built over: :class:`optladder.AdamW` runs its own
    ``LadderAdamW.__init__`` with these options.

    Args:
        rung: ``"fp32"``, ``"bf16"`` or ``"8bit"``.
        param_groups: the param groups, changed in place.
        fused: whether the rung runs fused here (``Decision.fused``); for the fp32 rung it
            selects torch's fused AdamW over foreach (or optladder's AdamW with float32
            moments for bf16/fp16 params, see :func:`optladder.optimizers.spec.fp32_engine`).
        columns: the :class:`optladder.columns.ParamColumns` of ``param_groups`` when
            construction has read them already (their dtypes are not read again).
        checked: True when the params passed construction's checks
            (:func:`optladder.selector.checks.check_groups`) and the optimizer built over
            the groups runs torch's per-param checks over each group's first param only
            (:mod:`optladder.optimizers.checked`): the rung's dtype checks then run here,
            over every param (in bulk from ``columns`` where they can).

    Returns:
        ``{"moment_dtype": torch.bfloat16}`` (bf16), the fp32 format's options
        (:func:`optladder.optimizers.fp32.fp32_options`), or ``{}`` (8bit: bitsandbytes'
        ``AdamW8bit`` state).

    Raises:
        ValueError: for an unknown rung, or params the rung refuses (complex params on
            bf16 and 8bit; DTensor params on bf16, and on fp32 when they are
            bfloat16/float16, see :data:`DTENSOR_UNSUPPORTED`); the groups are unchanged
            for an unknown rung.
        ImportError: for the 8bit rung without bitsandbytes.
    """
    if rung not in ("fp32", "bf16", "8bit"):
        raise ValueError(f"rung={rung!r} is not a rung; accepted values: fp32, bf16, 8bit")
    if columns is not None and not columns.plain:
        columns = None
    if rung == "fp32":
        names = dtype_names(param_groups) if columns is None else columns.dtype_names
        fp32_engine: spec.Fp32Engine | None = spec.fp32_engine(fused, names)
    else:
        fp32_engine = None
    if columns is None:  # plain columns: no DTensor among the params
        _refuse_dtensors(rung, param_groups, fp32_engine)
    clear_engine_keys(param_groups)
    if rung in ("fp32", "bf16"):
        for group in param_groups:  # their state format in LadderAdamW (a group moving
            group[RUNG_KEY] = rung  # here from 8bit still says "8bit")
    if fp32_engine == "foreach" and any(
        p.is_complex() for group in param_groups for p in group["params"]
    ):  # complex params take torch's foreach path anyway: the real ones stay fused
        fp32_engine = "fused"
    if fp32_engine is not None:
        # its dtype check over every param, unless the columns construction read show
        # every dtype is one the fp32 format steps (then it would find nothing)
        bulk = columns is not None and columns.dtype_names <= set(RUNG_ACCEPTS["fp32"].dtypes)
        return fp32_options(param_groups, engine=fp32_engine, checked=checked and not bulk)
    if rung == "bf16":
        # LadderAdamW's own check of the dtypes, over every param: from the columns when
        # construction read them (every group's dtypes allowed), else group by group
        # (which names the first param refused)
        bulk = columns is not None and columns.dtype_names <= set(LADDER_DTYPES)
        if checked and not bulk:
            for group in param_groups:
                refuse_ladder_dtypes(group["params"], torch.bfloat16)
        return {"moment_dtype": torch.bfloat16}
    prepare_8bit_format(param_groups, columns)
    return {}
