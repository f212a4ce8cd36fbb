"""Probe what a device's optimizer kernels can do, per rung, as plain data."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable

import torch

from optladder.oom import is_oom
from optladder.optimizers import spec
from optladder.rungs import Capabilities, Rung

_PROBE_ATTEMPTS = 2


def fused_adamw_runs(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch.optim.AdamW(fused=True)`` steps on ``device``, and how that is known.

    On a device present in this process, one step on a one-element param is run (the
    probe, not an assumption) by torch's fused AdamW kernel (``torch._fused_adamw_``, what
    ``AdamW(fused=True)`` and the functional ``adamw(..., fused=True)`` call, after the
    step count's increment) on a device type in torch's list of fused device types,
    without an optimizer's ``step()``, so torch's global step hooks
    (``register_optimizer_step_pre_hook``) never see the probe. Its param, grad, moments
    and step count are the five elements of one tensor of ones (one allocation and one
    view op: after a garbage collection each torch call costs tens of microseconds,
    and the functional's Python path several of them; measured 0.28 ms for the probe
    through the functional with five tensors, of a ~1.5 ms construction). An
    out-of-memory error says nothing about the kernel: the probe is tried again, and a
    second one is raised.
    For a device that is not present (planning for a GPU on a CPU machine) torch's list
    of fused device types answers.

    Raises:
        torch.OutOfMemoryError: (or the allocator's error) when the probe ran out of
            memory twice.
    """
    present = device.type == "cpu" or (
        device.type == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() > 0
    )
    if not present:
        listed = device.type in spec.torch_fused_device_types()
        return listed, "torch's list of fused device types (device not present)"
    kernels = spec.torch_fused_device_types()
    if device.type not in kernels:  # AdamW(fused=True) refuses the device at its first step
        return False, f"torch's fused AdamW runs on {', '.join(kernels)}, not {device.type}"
    for attempt in range(_PROBE_ATTEMPTS):
        try:
            p, g, m, v, step = torch.ones(5, device=device).unbind()  # step 1: counted
            torch._fused_adamw_(
                [p],
                [g],
                [m],
                [v],
                [],
                [step],
                amsgrad=False,
                beta1=0.9,
                beta2=0.999,
                lr=1e-3,
                weight_decay=1e-2,
                eps=1e-8,
                maximize=False,
            )
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            if not is_oom(exc):
                return False, f"a fused AdamW step failed: {exc}"
            if attempt + 1 == _PROBE_ATTEMPTS:  # out of memory says nothing of the kernel
                raise
            del exc
            continue
        return True, "a fused AdamW step ran"
    raise AssertionError("unreachable")


def bitsandbytes_installed() -> tuple[bool, str]:
    """Whether bitsandbytes is installed, without importing it, and why not.

    Already imported counts as installed; otherwise :func:`importlib.util.find_spec`
    looks the package up on ``sys.path``. A package that is installed but whose native
    library fails to load passes here and fails with an ``ImportError`` (naming
    bitsandbytes' error) when the 8-bit rung is built.
    """
    if sys.modules.get("bitsandbytes") is not None:
        return True, "bitsandbytes is imported"
    try:
        found = importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError) as exc:  # a broken parent package or __spec__
        return False, f"bitsandbytes cannot be found ({type(exc).__name__}: {exc})"
    if not found:
        return False, "bitsandbytes is not installed (pip install 'bitsandbytes>=0.45')"
    return True, "bitsandbytes is installed (imported when the 8bit rung is built)"


def probe_capabilities(
    device: torch.device | str, dtypes: Iterable[str] = ("float32",), has_complex: bool = False
) -> Capabilities:
    """Probe which rungs can be built on ``device`` and which are fused.

    Args:
        device: the target device.
        dtypes: names of the trainable params' dtypes (``Footprint.dtypes``).
        has_complex: whether any trainable param is complex.

    Returns:
        :class:`optladder.rungs.Capabilities` for ``device``.
    """
    dev = torch.device(device)
    dtypes = tuple(dtypes)
    fused: dict[Rung, bool] = {}
    reasons: dict[Rung, str] = {}
    device_fused, _ = fused_adamw_runs(dev)
    misses: dict[Rung, str | None] = {
        "fp32": spec.fp32_fused_miss(device_fused, str(dev), dtypes, has_complex),
        "bf16": spec.bf16_fused_miss(dev.type, dtypes),
        "8bit": spec.eightbit_fused_miss(dev.type),
    }
    for rung, miss in misses.items():
        fused[rung] = miss is None
        if miss is not None:
            reasons[rung] = miss
    bnb_ok, bnb_why = bitsandbytes_installed()  # no import: most runs never build 8bit
    available: dict[Rung, bool] = {"fp32": True, "bf16": True, "8bit": bnb_ok}
    unavailable = {} if bnb_ok else {"8bit": f"the 8bit rung is unavailable: {bnb_why}"}
    slow: dict[Rung, str] = {}
    if dev.type == "cpu" and not fused["8bit"]:
        slow["8bit"] = (
            "bitsandbytes' CPU optimizer path is tens of times slower than torch's fused "
            "fp32 AdamW (measured: 30x at 16M params on a 2-core CPU, 227 ms against 7.6 ms "
            "a step)"
        )
    if not fused["bf16"]:
        slow["bf16"] = reasons["bf16"]
    return Capabilities(
        kernels=spec.kernel_routes(dev.type, device_fused, dtypes, has_complex),
        device=str(dev),
        fused=fused,
        unfused_reasons=reasons,
        available=available,
        unavailable_reasons=unavailable,
        slow=slow,
    )
