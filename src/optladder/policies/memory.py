"""Free memory: what this run may still use on the target device, in bytes.

Probes, in order of preference:

- CUDA: NVML (nvidia-ml-py) for the device's free bytes, mapping the torch device index
  to the NVML handle under ``CUDA_VISIBLE_DEVICES`` (UUIDs, or indices in PCI bus order),
  so no CUDA context is created; else ``torch.cuda.mem_get_info``. Memory that torch's
  caching allocator holds reserved but unallocated is free to this run and is added.
- CPU: the host's available memory (psutil), bounded by the cgroup memory limit (v2
  ``memory.max`` or v1 ``memory.limit_in_bytes``) and by ``RLIMIT_AS`` when the process
  runs under them.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from pydantic import BaseModel, ConfigDict


class MemoryProbe(BaseModel):
    """The result of probing a device's free memory.

    Attributes:
        device: the probed device, e.g. ``"cuda:0"``.
        free_bytes: bytes this run may still use there.
        source: how it was measured, in words.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    free_bytes: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_free_bytes(
    root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")
) -> int | None:
    """Bytes left under this process's cgroup memory limit, or None without a limit.

    Args:
        root: the cgroup file system mount.
        proc: the file naming this process's cgroups.

    Returns:
        ``limit - usage`` in bytes (``>= 0``), or None if no limit applies.
    """
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        lines = []
    candidates: list[tuple[Path, str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2
            candidates.append((root / rel, "memory.max", "memory.current"))
            candidates.append((root, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):  # cgroup v1
            candidates.append(
                (root / "memory" / rel, "memory.limit_in_bytes", "memory.usage_in_bytes")
            )
            candidates.append((root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for directory, limit_name, usage_name in candidates:
        limit = _read_int(directory / limit_name)  # "max" (v2, no limit) reads as None
        usage = _read_int(directory / usage_name)
        if limit is None or usage is None or limit >= 2**60:  # v1 spells "none" 2**63-4096
            continue
        return max(limit - usage, 0)
    return None


def host_free_bytes() -> tuple[int, str]:
    """Bytes the host lets this process still allocate, and how that was found."""
    free = int(psutil.virtual_memory().available)
    source = "host available memory (psutil)"
    cgroup = cgroup_free_bytes()
    if cgroup is not None and cgroup < free:
        free, source = cgroup, "cgroup memory limit minus usage"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        left = max(soft - psutil.Process().memory_info().vms, 0)
        if left < free:
            free, source = left, "RLIMIT_AS minus the process's virtual size"
    return free, source


def nvml_handle_for(index: int, pynvml: Any, environ: dict[str, str] | None = None) -> Any:
    """The NVML handle of torch's CUDA device ``index`` under ``CUDA_VISIBLE_DEVICES``.

    Entries of ``CUDA_VISIBLE_DEVICES`` may be UUIDs (``GPU-...``, ``MIG-...``, matched by
    prefix as CUDA does) or integers. Integers are NVML (PCI bus order) indices when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or when all visible devices are the same model
    (CUDA's default "fastest first" order then falls back to PCI bus order too).

    Args:
        index: torch's device index (``torch.device("cuda:1").index`` is 1).
        pynvml: the initialized ``pynvml`` module.
        environ: the environment; None reads ``os.environ``.

    Returns:
        An NVML device handle.

    Raises:
        LookupError: if the mapping cannot be made without CUDA (the caller then falls
            back to ``torch.cuda.mem_get_info``).
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    count = pynvml.nvmlDeviceGetCount()
    by_index = visible is None  # integers name devices in CUDA's order, not NVML's
    if visible is None:
        physical: list[int] = list(range(count))
    else:
        physical = []
        for entry in (e.strip() for e in visible.split(",")):
            if not entry:
                break
            if entry.lstrip("-").isdigit():
                if int(entry) < 0 or int(entry) >= count:
                    break  # CUDA stops at the first invalid entry
                physical.append(int(entry))
                by_index = True
            else:
                matches = []
                for i in range(count):
                    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                    if uuid.startswith(entry):
                        matches.append(i)
                if len(matches) != 1:
                    raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is not one GPU UUID")
                physical.append(matches[0])
    if index >= len(physical):
        raise LookupError(f"cuda:{index} is not visible (CUDA_VISIBLE_DEVICES={visible!r})")
    if env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and by_index:
        names = {
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)
        }
        if len(names) > 1:
            raise LookupError("mixed GPU models without CUDA_DEVICE_ORDER=PCI_BUS_ID")
    return pynvml.nvmlDeviceGetHandleByIndex(physical[index])


def _nvml_free(index: int) -> int:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        handle = nvml_handle_for(index, pynvml)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    finally:
        pynvml.nvmlShutdown()


def cuda_free_bytes(index: int, nvml: Callable[[int], int] = _nvml_free) -> tuple[int, str]:
    """Free bytes on CUDA device ``index`` and how they were found.

    Adds the bytes torch's caching allocator holds reserved but unallocated (only when
    CUDA is already initialized in this process, so the probe creates no context).

    Args:
        index: torch's CUDA device index.
        nvml: the NVML probe (replaceable for tests).
    """
    cached = 0
    if torch.cuda.is_initialized():
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    try:
        free, source = nvml(index), "NVML free memory"
    except Exception as exc:  # NVML missing, no driver, or no safe mapping
        free_info, _ = torch.cuda.mem_get_info(index)
        free, source = int(free_info), f"torch.cuda.mem_get_info (NVML: {exc})"
    if cached:
        source += " + torch cache reserved but unallocated"
    return free + cached, source


def probe_free_memory(device: torch.device | str) -> MemoryProbe:
    """Probe the memory this run may still use on ``device``.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (a torch device).

    Returns:
        The :class:`MemoryProbe`.

    Raises:
        ValueError: for something that is not a device, a device type with no probe, or a
            CUDA device this process cannot see (pass ``free_memory`` instead).
    """
    if not isinstance(device, torch.device | str):
        raise ValueError(f"device={device!r} is not a torch device (e.g. 'cpu', 'cuda:0')")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc})") from None
    if dev.type == "cpu":
        free, source = host_free_bytes()
        return MemoryProbe(device="cpu", free_bytes=free, source=source)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(
                f"cannot probe free memory on {str(dev)!r}: this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA "
                "devices; pass free_memory (bytes or a string such as '80GiB') to plan for it"
            )
        free, source = cuda_free_bytes(index)
        return MemoryProbe(device=f"cuda:{index}", free_bytes=free, source=source)
    raise ValueError(
        f"cannot probe free memory on device {str(dev)!r}; pass free_memory "
        "(bytes or a string such as '24GiB')"
    )
