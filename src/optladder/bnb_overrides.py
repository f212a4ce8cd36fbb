"""bitsandbytes' per-param overrides of the 8-bit state format, read without importing it.

bitsandbytes lets a user keep some params' optimizer state in 32 bits on an 8-bit
optimizer: ``GlobalOptimManager.get_instance().override_config(p, "optim_bits", 32)``
(or ``"min_8bit_size"``), and ``bnb.nn.StableEmbedding`` / ``bnb.nn.Embedding``, which
register ``{"optim_bits": 32}`` for their weight with ``register_module_override``.
Plain ``bitsandbytes.optim.AdamW8bit`` honours both (``Optimizer8bit.check_overrides``
and ``get_config`` in ``bitsandbytes/optim/optimizer.py``). optladder's 8bit rung, its
migrations and the footprint's 8bit estimate all ask :func:`quantized_8bit` here, so they
agree with each other and with plain bitsandbytes.

Overrides live in bitsandbytes' process-wide manager; if bitsandbytes was never imported
there can be none, so nothing here imports it (reading ``sys.modules`` only).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from optladder.rungs import BNB_MIN_8BIT_SIZE

OPTIM_BITS = (8, 32)
"""``optim_bits`` values bitsandbytes' 2-state optimizers accept (``init_state``)."""


def param_override(p: torch.Tensor) -> Mapping[str, Any]:
    """bitsandbytes' config override for ``p``, as its optimizers would apply it.

    A module override (``register_module_override``, e.g. ``StableEmbedding``'s weight)
    replaces an ``override_config`` entry for the same param, as bitsandbytes'
    ``check_overrides`` does at an optimizer's first step; the last module override
    registered for the param wins. Entries keyed by index (``register_parameters``) name
    positions in some optimizer's groups, not params, and are not read here.

    Args:
        p: a param (identity matters, not value).

    Returns:
        The override (empty when there is none, or bitsandbytes was never imported).
    """
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    manager = getattr(getattr(module, "GlobalOptimManager", None), "_instance", None)
    if manager is None:
        return {}
    found: Mapping[str, Any] | None = None
    for owner, attr, config in getattr(manager, "module_weight_config_triple", ()):
        if getattr(owner, attr, None) is p:
            found = config
    if found is None:
        found = getattr(manager, "pid2config", {}).get(id(p))
    return dict(found or {})


def no_overrides() -> bool:
    """Whether bitsandbytes holds no per-param override at all (never imported, or its
    manager has none): then :func:`quantized_8bit` is the size rule alone for every
    param."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    manager = getattr(getattr(module, "GlobalOptimManager", None), "_instance", None)
    if manager is None:
        return True
    return not getattr(manager, "module_weight_config_triple", ()) and not getattr(
        manager, "pid2config", {}
    )


def quantized_8bit(
    p: torch.Tensor,
    where: str,
    *,
    optim_bits: int = 8,
    min_8bit_size: int = BNB_MIN_8BIT_SIZE,
) -> bool:
    """Whether the 8bit rung keeps ``p``'s moments as 8-bit codes (else float32).

    bitsandbytes' rule (``Optimizer2State.init_state``): 8-bit codes when the param's
    ``optim_bits`` is 8 and it has at least ``min_8bit_size`` elements; both can be
    overridden per param (:func:`param_override`).

    Args:
        p: the param.
        where: names it in messages, e.g. ``"param 2 of group 0"``.
        optim_bits: the optimizer's default (``AdamW8bit``: 8).
        min_8bit_size: the optimizer's default, in elements (4,096).

    Returns:
        True for uint8 codes with float32 absmax, False for two float32 moments.

    Raises:
        ValueError: if an override sets ``optim_bits`` to anything but 8 or 32, or
            ``min_8bit_size`` to anything but an int >= 0 (bitsandbytes would fail at
            the first step), naming the param and the value.
    """
    config = param_override(p)
    bits = config.get("optim_bits", optim_bits)
    size = config.get("min_8bit_size", min_8bit_size)
    if isinstance(bits, bool) or bits not in OPTIM_BITS:
        raise ValueError(
            f"{where}: bitsandbytes' override optim_bits={bits!r}; allowed: 8 or 32 "
            "(GlobalOptimManager.override_config)"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(
            f"{where}: bitsandbytes' override min_8bit_size={size!r}; allowed: an int >= 0 "
            "(elements)"
        )
    return bits == 8 and p.numel() >= size  # a DTensor's numel() is its global count
