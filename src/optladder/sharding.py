"""Sharded params (FSDP2 / DTensor): the global tensor and this rank's shard.

A ``torch.distributed.tensor.DTensor`` param reports its *global* shape and element
count (``p.numel()``), while this rank stores and updates only its local shard
(``p.to_local()``). optladder counts elements globally where a rule is about the whole
tensor (bitsandbytes' ``min_8bit_size``, the policy's size thresholds) and bytes locally
where memory is spent (each rank holds the optimizer state of its own shard).

This module sits below ``policies`` and ``optimizers``, like :mod:`optladder.rungs`.
``torch.distributed.tensor`` is imported only when a tensor might be a DTensor.
"""

from __future__ import annotations

import operator

import torch

from optladder.columns import PLAIN_TYPES, plain_types


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 param is one)."""
    if type(t) in PLAIN_TYPES or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` if it is a DTensor (a view sharing its memory, no
    autograd history), else ``t`` itself."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined]


def all_plain(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is a plain ``torch.Tensor`` or ``nn.Parameter`` (no DTensor
    or other subclass) off the meta device: then per-tensor rules can be read in bulk."""
    return plain_types(tensors) and not any(map(operator.attrgetter("is_meta"), tensors))


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank stores of ``t``: the local shard's for a DTensor, else all."""
    return local_tensor(t).numel()


def shard_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as a tensor laid out like the param ``p``.

    For a DTensor ``p`` this wraps ``local`` in a DTensor with ``p``'s mesh, placements,
    global shape and stride, without communication (as torch's AdamW keeps the moments
    of a DTensor param); for a plain ``p`` it returns ``local``.

    Raises:
        ValueError: if ``local``'s shape is not the shape of ``p``'s local shard.
    """
    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    expected = tuple(local_tensor(p).shape)
    if tuple(local.shape) != expected:
        raise ValueError(
            f"a local shard of shape {tuple(local.shape)} cannot be laid out like this "
            f"param: its shard on this rank has shape {expected}"
        )
    assert isinstance(p, DTensor)
    return DTensor.from_local(
        local,
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )
