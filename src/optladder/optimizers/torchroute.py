"""The fp32 format's params that torch's own AdamW kernels step, inside
:class:`~optladder.optimizers.adamw.LadderAdamW`.

On the fp32 format (float32 moments) a param whose moments torch's AdamW keeps in the
param's own dtype without loss (float32, float64, complex) is stepped by torch's
kernels, so the rung's bits are ``torch.optim.AdamW``'s:

- plain real params on a device where torch has a fused AdamW kernel: torch's fused
  kernel, through the direct call of :mod:`optladder.optimizers.fusedstep`
  (:func:`~.fusedstep.group_call`, :func:`~.fusedstep.run_fused_plan`: bit for bit
  ``torch.optim.AdamW(fused=True)``), or torch's functional ``adam(fused=True)`` when the
  step carries ``grad_scale``/``found_inf`` or a tensor ``lr``;
- complex params, and params on a device without a fused kernel: torch's functional
  ``adam(foreach=True)`` (it views complex params as real), as
  ``torch.optim.AdamW(foreach=True)`` steps them.

DTensor params (FSDP2) take the same kernels (torch's fused and foreach ops take
DTensors, their moments DTensors laid out like them), as ``torch.optim.AdamW(fused=True)``
steps them.

bfloat16/float16 params on the fp32 format keep float32 moments on optladder's kernels.

State per param is torch's layout: ``exp_avg`` and ``exp_avg_sq`` in the param's dtype,
laid out like the param (:func:`~.fusedstep.laid_out_like`), ``step`` a 0-d float64
tensor (on the param's device for the fused kernel, on the CPU for the foreach path;
float64 keeps the count exact past 2**24, :mod:`optladder.optimizers.steps`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from optladder.columns import PLAIN_TYPES
from optladder.optimizers.steps import STEP_DTYPE

TORCH_GROUP_KEYS = ("amsgrad", "foreach", "capturable", "differentiable", "fused")
"""The group keys ``torch.optim.AdamW`` writes that :class:`LadderAdamW` has no option
for; the fp32 format's groups hold them as torch's AdamW on the same kernel holds them
(:func:`torch_group_keys`), so its ``state_dict()`` continues in ``torch.optim.AdamW``
on that kernel and its ``repr`` reads as torch's."""


def torch_group_keys(fused: bool) -> dict[str, Any]:
    """:data:`TORCH_GROUP_KEYS` as ``torch.optim.AdamW(fused=True)`` (``fused``) or
    ``(foreach=True)`` writes them in each group."""
    return {
        "amsgrad": False,
        "foreach": None if fused else True,
        "capturable": False,
        "differentiable": False,
        "fused": True if fused else None,
    }


TORCH_REAL_DTYPES = (torch.float32, torch.float64)
"""Real param dtypes the fp32 format steps on torch's kernels (moments in their dtype)."""


def torch_steps(p: torch.Tensor) -> bool:
    """Whether the fp32 format steps ``p`` on torch's kernels: a float32, float64 or
    complex param."""
    return p.dtype in TORCH_REAL_DTYPES or p.is_complex()


def state_moment_dtype(p: torch.Tensor, format_dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``p``'s moments in a group of moment dtype ``format_dtype``: the
    param's own for a param torch's kernels step on the fp32 format (:func:`torch_steps`),
    else ``format_dtype``."""
    if format_dtype == torch.float32 and torch_steps(p):
        return p.dtype
    return format_dtype


def fused_devices() -> tuple[str, ...]:
    """Device types where the installed torch has a fused Adam/AdamW kernel."""
    from optladder.optimizers.spec import torch_fused_device_types

    return torch_fused_device_types()


def init_state(p: torch.Tensor, fused: bool) -> dict[str, Any]:
    """State as ``torch.optim.AdamW._init_group`` creates it, with a float64 ``step``
    (see the module's docstring): on ``p``'s device for the fused kernel, on the CPU for
    the foreach path; moments zeros like ``p`` (its dtype and layout)."""
    if fused:
        step = torch.zeros((), dtype=STEP_DTYPE, device=p.device)
    else:
        step = torch.tensor(0.0, dtype=STEP_DTYPE)
    return {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def ready_state(p: torch.Tensor, st: dict[str, Any], fused: bool, where: str) -> None:
    """Make an existing state dict ready for torch's kernel (before anything is written):
    ``step`` a float64 tensor where the kernel reads it, moments laid out like ``p``
    (copies where they are not: a load or a move makes them contiguous).

    Raises:
        ValueError: naming the param (``where``) when its moments are not tensors of its
            shape in its dtype (state of another format put back by hand).
    """
    from optladder.optimizers.fusedstep import laid_out_copy, laid_out_like

    for name in ("exp_avg", "exp_avg_sq"):
        m = st.get(name)
        if not isinstance(m, torch.Tensor) or m.dtype != p.dtype or m.shape != p.shape:
            found = f"{m.dtype} {tuple(m.shape)}" if isinstance(m, torch.Tensor) else repr(m)
            raise ValueError(
                f"{where} holds {name} {found}; its group's fp32 format keeps {p.dtype} moments "
                f"of shape {tuple(p.shape)} for it (torch's AdamW layout). Drop its state (del "
                "opt.state[param]) to start it afresh"
            )
        if type(p) in PLAIN_TYPES and type(m) in PLAIN_TYPES and not laid_out_like(m, p):
            st[name] = laid_out_copy(m, p)
    step = st["step"]
    device = p.device if fused else torch.device("cpu")
    if step.dtype != STEP_DTYPE or step.device != device:
        st["step"] = step.detach().to(device=device, dtype=STEP_DTYPE)


def step_functional(
    group: Mapping[str, Any],
    lists: tuple[list[torch.Tensor], ...],
    *,
    fused: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One step of torch's functional Adam over ``lists`` (params, grads, ``exp_avg``,
    ``exp_avg_sq``, ``max_exp_avg_sq`` (empty), ``step``), with ``group``'s options, as
    ``torch.optim.AdamW(fused=True)`` or ``(foreach=True)`` steps them
    (``torch.optim.adam.adam``; ``decoupled_weight_decay`` from the group).

    Args:
        group: the param group.
        lists: the tensor lists.
        fused: torch's fused kernel (takes ``grad_scale``/``found_inf``); else foreach
            (the grads already unscaled, the step skipped by the caller on infs; a tensor
            ``lr`` is read as a number there, as foreach takes none on the host).
    """
    from torch.optim.adam import adam

    params, grads, exp_avgs, exp_avg_sqs, _, steps = lists
    if not params:
        return
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    if not fused and isinstance(lr, torch.Tensor):
        lr = float(lr.item())
    with torch.no_grad():  # as torch's step: the update is not recorded
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=not fused,
            fused=fused,
            grad_scale=grad_scale if fused else None,
            found_inf=found_inf if fused else None,
            has_complex=any(p.is_complex() for p in params),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=bool(group["maximize"]),
        )
