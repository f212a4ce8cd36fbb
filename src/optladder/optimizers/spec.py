"""The fused-spec mapping: the one place that says which configuration runs on a fused
kernel, which falls back to an eager or foreach path, and why.

Each ``*_fused_miss`` function returns None when the configuration is fused, or the
reason in a sentence when it is not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from optladder.optimizers.adamw import LadderAdamW, is_8bit_group
from optladder.optimizers.dispatch import (
    Choice,
    DispatchTable,
    kernel_dtype_miss,
    no_kernel_reason,
)
from optladder.rungs import LOW_PRECISION_DTYPES, RUNGS, KernelRoute, Rung, param_refusal

Fp32Engine = Literal["fused", "foreach", "ladder"]
"""How the fp32 rung runs: torch's fused AdamW, torch's foreach AdamW, or optladder's
AdamW with float32 moments (for bf16/fp16 params; its fused kernels where they run)."""


def torch_fused_device_types() -> tuple[str, ...]:
    """Device types for which the installed torch has fused Adam/AdamW kernels."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older or trimmed torch
        return ("cuda",)


def fp32_fused_miss(
    device_fused: bool,
    device: str,
    dtypes: Iterable[str],
    has_complex: bool,
) -> str | None:
    """Why the fp32 rung is not on torch's fused AdamW, or None when it is.

    Args:
        device_fused: whether a fused AdamW step ran (or is listed) for the device.
        device: the device, for the message.
        dtypes: names of the trainable params' dtypes, e.g. ``("float32",)``.
        has_complex: whether any trainable param is complex.
    """
    low = sorted(set(dtypes) & set(LOW_PRECISION_DTYPES))
    if low and not has_complex:
        # torch's fused AdamW would keep their moments in bf16/fp16: optladder's AdamW
        # keeps float32 moments on its own kernels (see fp32_engine); float32/float64
        # params stay on torch's kernels, so only these dtypes are the kernels' to step
        why = _kernel_miss(torch.device(device).type, low)
        if why is None:
            return None
        return (
            f"torch's fused AdamW keeps moments in the param dtype ({', '.join(low)}); the fp32 "
            f"rung keeps float32 moments for them on optladder's AdamW, which runs eagerly "
            f"here: {why}"
        )
    if not device_fused:
        return f"torch {torch.__version__} has no fused AdamW kernel on {device}; foreach path"
    if has_complex:
        return "torch's fused AdamW takes real params only; complex params use the foreach path"
    return None


def fp32_engine(fused: bool, dtypes: Iterable[str]) -> Fp32Engine:
    """Which engine the fp32 rung builds.

    Args:
        fused: whether the decision found the fp32 rung fused (see
            :func:`fp32_fused_miss`).
        dtypes: names of the trainable params' dtypes.
    """
    if set(dtypes) & set(LOW_PRECISION_DTYPES):
        return "ladder"  # torch would keep their moments in bf16/fp16
    return "fused" if fused else "foreach"


def _kernel_miss(device_type: str, dtypes: Iterable[str]) -> str | None:
    """Why optladder's kernels cannot step params of ``dtypes`` on ``device_type``, or None."""
    from optladder.optimizers import kernels

    why = kernel_dtype_miss(dtypes)
    if why is not None:
        return why
    if device_type == "cpu":
        return kernels.cpu_unavailable_reason()
    if device_type == "cuda":
        return kernels.triton_unavailable_reason()
    return no_kernel_reason(device_type)


def bf16_fused_miss(device_type: str, dtypes: Iterable[str] = ("float32",)) -> str | None:
    """Why the bf16 rung is not on a fused kernel on ``device_type``, or None.

    The fused kernels (:mod:`optladder.optimizers.kernels`: C on the CPU, Triton on CUDA)
    step float32, bfloat16 and float16 params; other params, and devices without a
    kernel, run the eager path (:mod:`optladder.optimizers.eager`), bit-identical but
    several times slower.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        dtypes: names of the trainable params' dtypes.
    """
    why = _kernel_miss(device_type, dtypes)
    return None if why is None else f"{why}; the bf16 rung runs the eager path"


def eightbit_fused_miss(device_type: str) -> str | None:
    """Why the 8-bit rung is not on a fused kernel on ``device_type``, or None.

    On CUDA bitsandbytes runs its block-wise 8-bit kernel; on the CPU optladder's C kernel
    (:mod:`optladder.optimizers.kernels.cpu8bit`, bitsandbytes' state format) steps all
    params in one call where a C compiler is found, else bitsandbytes' per-tensor CPU
    fallback runs, tens of times slower than torch's fused fp32 AdamW.
    """
    from optladder.optimizers import kernels
    from optladder.optimizers.kernels import cpu8bit

    if device_type == "cuda":
        return None
    if device_type == "cpu":
        why = kernels.cpu_unavailable_reason()
        return None if why is None else cpu8bit.fallback_reason(why)
    return f"bitsandbytes has no fused 8-bit optimizer kernel on {device_type}"


_ROUTE_KERNELS = {
    "torch_fused": "torch's fused AdamW",
    "torch_foreach": "torch's foreach AdamW",
    "cpu": "the C kernel",
    "triton": "the Triton kernel",
    "eager": "the eager path",
}
"""The dispatch table's entries (:data:`optladder.optimizers.dispatch.ENTRIES`) in the
words of a plan."""


def _eightbit_route(device_type: str) -> KernelRoute:
    """The 8bit entry's kernel on ``device_type``: bitsandbytes' kernel on CUDA,
    optladder's 8-bit C kernel on the CPU (see :func:`eightbit_fused_miss`)."""
    miss = eightbit_fused_miss(device_type)
    if device_type == "cuda":
        return KernelRoute(kernel="bitsandbytes' 8-bit kernel", fused=True)
    if device_type == "cpu":
        if miss is None:
            return KernelRoute(kernel="the 8-bit C kernel", fused=True)
        return KernelRoute(kernel="bitsandbytes' CPU path", fused=False, reason=miss)
    return KernelRoute(kernel="bitsandbytes", fused=False, reason=miss)


def _route(choice: Choice, device_type: str) -> KernelRoute:
    """A :class:`~optladder.rungs.KernelRoute` of one lookup of the dispatch table."""
    if choice.entry is None:
        return KernelRoute(kernel="no engine", fused=False, reason=choice.reason)
    if choice.entry == "8bit":
        return _eightbit_route(device_type)
    kernel = _ROUTE_KERNELS[choice.entry]
    return KernelRoute(kernel=kernel, fused=choice.reason is None, reason=choice.reason)


def kernel_routes(
    device_type: str, device_fused: bool, dtypes: Iterable[str], has_complex: bool
) -> dict[Rung, dict[str, KernelRoute]]:
    """What steps the params of each dtype on each rung of ``device_type``: the lookup
    of each (rung, device type, dtype, grad of the same dtype) in the engine's dispatch
    table (:class:`~optladder.optimizers.dispatch.DispatchTable`, ``backend="auto"``,
    the C kernel taken as running where a compiler is found, not built here), each
    param routed by its own dtype:

    - fp32: float32, float64 and complex params on torch's fused AdamW kernel where it
      runs (its foreach path else, and for complex params); bfloat16 and float16 params
      with float32 moments on optladder's kernels.
    - bf16: optladder's kernel (C on the CPU, Triton on CUDA) for float32, bfloat16 and
      float16 params, the eager path for float64 ones.
    - 8bit: bitsandbytes' kernel on CUDA; optladder's 8-bit C kernel on the CPU where it
      builds, else bitsandbytes' per-tensor CPU path.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        device_fused: whether torch's fused AdamW runs there (:func:`fused_adamw_runs`).
        dtypes: names of the trainable params' dtypes (complex ones included or not).
        has_complex: whether any trainable param is complex (``complex64`` is added to
            ``dtypes`` when no complex name is among them).

    Returns:
        ``{rung: {dtype: KernelRoute}}`` for every rung and every distinct dtype,
        including dtypes a rung refuses (their route says why: the rungs' table,
        :data:`optladder.rungs.RUNG_ACCEPTS`).
    """
    names = tuple(dict.fromkeys(dtypes))
    if has_complex and not any(d.startswith("complex") for d in names):
        names = (*names, "complex64")
    table = DispatchTable("auto", torch_fused=device_fused, build_kernels=False)
    routes: dict[Rung, dict[str, KernelRoute]] = {rung: {} for rung in RUNGS}
    for dtype in names:
        param_dtype = getattr(torch, dtype, None)
        for rung in RUNGS:
            if not isinstance(param_dtype, torch.dtype):  # no torch dtype: no rung's
                refusal = param_refusal(rung, dtype)
                routes[rung][dtype] = KernelRoute(kernel="no engine", fused=False, reason=refusal)
                continue
            choice = table.lookup(rung, device_type, param_dtype, param_dtype)
            routes[rung][dtype] = _route(choice, device_type)
    return routes


class FusedOptimizerConfig(BaseModel):
    """An optimizer configuration that runs on a fused kernel, as plain data.

    Attributes:
        kind: ``"adam"`` (coupled weight decay: ``grad += wd * param``) or ``"adamw"``
            (decoupled: ``param *= 1 - lr * wd``).
        lr: the default learning rate (per-group values stay in the param groups).
        betas: ``(beta1, beta2)``.
        eps: the denominator term.
        weight_decay: the default decay coefficient.
        use_bf16_moments: the moments are stored in bfloat16 (optladder's bf16 rung: every
            group of the engine in the bf16 state format).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["adam", "adamw"]
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float = 0.0
    use_bf16_moments: bool = False


def _param_misses(optimizer: torch.optim.Optimizer) -> str | None:
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if p.is_complex():
                return (
                    f"param {pi} of group {gi} is complex ({p.dtype}): the bf16 and 8-bit rungs "
                    "take real params only"
                )
            if p.is_sparse or (p.grad is not None and p.grad.is_sparse):
                return f"param {pi} of group {gi} is sparse: the fused kernels take dense tensors"
    return None


def _flag_misses(optimizer: torch.optim.Optimizer, flags: dict[str, str]) -> str | None:
    for gi, group in enumerate(optimizer.param_groups):
        for flag, why in flags.items():
            if group.get(flag):
                return f"{flag}=True in param group {gi}: {why}"
    return None


_ADAM_FLAGS = {
    "amsgrad": "it keeps a third state tensor (max_exp_avg_sq) that no rung below fp32 stores",
    "maximize": "bitsandbytes' 8-bit rung only descends",
    "differentiable": "fused kernels do not record the update for autograd",
}


def _is_bitsandbytes(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of bitsandbytes' optimizers (a class of its own or a
    subclass), without importing bitsandbytes."""
    return any(c.__module__.startswith("bitsandbytes.") for c in type(optimizer).__mro__)


def to_fused_config(
    optimizer: torch.optim.Optimizer,
) -> tuple[FusedOptimizerConfig | None, str | None]:
    """Map an optimizer to the fused configuration it runs as, or say why it does not.

    Maps plain ``torch.optim.Adam`` and ``torch.optim.AdamW``, and
    optladder's :class:`~optladder.optimizers.adamw.LadderAdamW` (``use_bf16_moments``
    when its moments are bfloat16); an optladder optimizer maps as its current engine.
    Each unmappable case has its own reason: amsgrad, maximize, differentiable, sparse or
    complex params, bitsandbytes optimizers (8-bit block-quantized or 32-bit state in
    their own layout), any other optimizer class.

    Args:
        optimizer: any ``torch.optim.Optimizer``.

    Returns:
        ``(config, None)`` when it maps, ``(None, reason)`` when it does not.
    """
    inner = getattr(optimizer, "engine", None)  # an optladder optimizer's current engine
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    name = type(optimizer).__name__
    if isinstance(optimizer, LadderAdamW) and any(map(is_8bit_group, optimizer.param_groups)):
        return None, (
            f"{name} keeps 8-bit block-quantized state (its 8bit groups, bitsandbytes' "
            "format): bitsandbytes owns that format, which is not a fused AdamW "
            "configuration"
        )
    if _is_bitsandbytes(optimizer):
        bits = getattr(getattr(optimizer, "args", None), "optim_bits", None)
        kept = (
            "8-bit block-quantized state"
            if bits == 8
            else f"{bits}-bit state in bitsandbytes' layout (state1/state2)"
            if bits is not None
            else "state in bitsandbytes' layout (state1/state2)"
        )
        return None, (
            f"{name} keeps {kept}: bitsandbytes owns its kernels and its format, which is "
            "not a fused AdamW configuration"
        )
    d = optimizer.defaults
    if isinstance(optimizer, LadderAdamW | torch.optim.Adam | torch.optim.AdamW):
        miss = _flag_misses(optimizer, _ADAM_FLAGS) or _param_misses(optimizer)
        if miss is not None:
            return None, f"{name}: {miss}"
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
            d.get("decoupled_weight_decay", False)
        )
        bf16 = isinstance(optimizer, LadderAdamW) and all(  # every group's state format
            optimizer.group_moment_dtype(g) == torch.bfloat16 for g in optimizer.param_groups
        )
        return (
            FusedOptimizerConfig(
                kind="adamw" if decoupled else "adam",
                lr=float(d["lr"]),
                betas=(float(d["betas"][0]), float(d["betas"][1])),
                eps=float(d["eps"]),
                weight_decay=float(d["weight_decay"]),
                use_bf16_moments=bf16,
            ),
            None,
        )
    return None, (
        f"{name} is not Adam or AdamW: no fused mapping (optladder's rungs store Adam's two "
        "moments)"
    )
