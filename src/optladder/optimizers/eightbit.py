"""The 8-bit rung: bitsandbytes' ``AdamW8bit`` (block-wise quantized moments).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022). bitsandbytes
is imported only when this rung is built.

Sharded params (DTensor, e.g. FSDP2's ``fully_shard``) and Adam's coupled weight decay
get a subclass of ``AdamW8bit`` (:func:`ladder_adamw8bit_class`): it runs bitsandbytes'
update on each rank's local shard, while the size rule (``min_8bit_size``) follows the
param's global element count, the same on every rank; and in Adam mode it adds
``weight_decay * param`` to the grad and runs bitsandbytes with weight decay 0, because
bitsandbytes applies weight decay the AdamW (decoupled) way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any, cast

import torch

from optladder.rungs import BNB_DTYPES, BNB_MIN_8BIT_SIZE
from optladder.sharding import is_dtensor, local_tensor

_BNB_DTYPES = tuple(getattr(torch, name) for name in BNB_DTYPES)
_NOISY_LOGGER = "bitsandbytes.backends.cpu.ops"


def import_bitsandbytes() -> ModuleType:
    """Import bitsandbytes, hushing its CPU backend's warning about an optional 4-bit
    GEMM kernel from a hub (irrelevant to optimizers, and unreachable offline).

    Raises:
        ImportError: if bitsandbytes is missing or its native library fails to load.
    """
    noisy = logging.getLogger(_NOISY_LOGGER)
    previous = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError:
        raise
    except Exception as exc:  # a broken native library raises other errors
        raise ImportError(f"bitsandbytes failed to import: {type(exc).__name__}: {exc}") from exc
    finally:
        noisy.setLevel(previous)


@functools.cache
def ladder_adamw8bit_class() -> type[torch.optim.Optimizer]:
    """bitsandbytes' ``AdamW8bit``, taught to step DTensor params on their local shards
    and, with ``coupled_weight_decay=True``, to decay the Adam way.

    Adam mode: bitsandbytes decays decoupled (``param *= 1 - lr * wd``, its CPU fallback
    and CUDA kernel alike), so the decay is folded into the grad instead
    (``grad += wd * param``, in place, before the update: the grad then holds the
    decayed grad, as ``torch.optim.Adam`` computes it) and bitsandbytes runs with
    weight decay 0.

    bitsandbytes' kernels take plain tensors (a DTensor reaching them raises "got mixed
    torch.Tensor and DTensor"). For each DTensor param this class hands bitsandbytes'
    own ``init_state`` and ``update_step`` the rank's local shard (``p.to_local()``, a
    view of the DTensor's memory, so the update lands in the param) and its grad's
    local shard. The state is keyed by the DTensor param, as torch's optimizers key it,
    and holds plain tensors of the shard: uint8 codes of the shard's shape and one
    float32 absmax per started 256-element block of the shard (blocks never straddle a
    shard boundary, so they depend on where the boundaries are; ``state_dict()`` saves
    them per row of the param, see :mod:`optladder.optimizers.checkpoint`).

    The size rule follows the *global* element count (``p.numel()`` of the DTensor,
    equal on every rank): a param of at least ``min_8bit_size`` elements is quantized on
    every rank even where its shard is smaller, and a smaller one keeps float32 moments
    everywhere. It is set per param through ``get_config``, bitsandbytes' per-param
    configuration hook (the one ``GlobalOptimManager.override_config`` feeds), on this
    optimizer rather than in bitsandbytes' process-wide manager. Plain params take
    bitsandbytes' path unchanged.

    Created on first use, so bitsandbytes is imported only when the 8-bit rung is built.

    Raises:
        ImportError: if bitsandbytes does not import.
    """
    bnb = import_bitsandbytes()

    class LadderAdamW8bit(bnb.optim.AdamW8bit):  # type: ignore[name-defined]
        """``AdamW8bit`` stepping DTensor params on their local shards, and decaying
        the Adam way when ``coupled_weight_decay``; see
        :func:`optladder.optimizers.eightbit.ladder_adamw8bit_class`."""

        def __init__(self, *args: Any, coupled_weight_decay: bool = False, **kwargs: Any) -> None:
            self.coupled_weight_decay = coupled_weight_decay
            super().__init__(*args, **kwargs)

        def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
            config: dict[str, Any] = super().get_config(gindex, pindex, group)
            if self.coupled_weight_decay:
                config["weight_decay"] = 0.0  # folded into the grad in update_step
            p = self.param_groups[gindex]["params"][pindex]
            if is_dtensor(p):
                # bitsandbytes compares the tensor it is handed (the local shard) with
                # min_8bit_size: translate the global rule into a per-shard threshold.
                quantize = p.numel() >= config["min_8bit_size"]
                config["min_8bit_size"] = 0 if quantize else local_tensor(p).numel() + 1
            return config

        @contextlib.contextmanager
        def _on_shard(self, p: torch.Tensor, with_grad: bool) -> Iterator[torch.Tensor]:
            """Lend bitsandbytes the local shard of ``p``, sharing ``p``'s state dict
            for the duration; ``with_grad``: with the grad's local shard as ``.grad``.

            A grad laid out unlike its param (e.g. ``Partial``, not yet reduced) is
            redistributed to the param's placements first: a collective, so it is done
            only in the update, which every rank runs after agreeing to commit, never in
            ``init_state`` (the prepare phase, where a rank may stop early on OOM).
            """
            shard = local_tensor(p)
            if not shard.is_contiguous():
                raise ValueError(
                    "the 8bit rung steps a DTensor param on its local shard, which must be "
                    f"contiguous; this rank's shard has shape {tuple(shard.shape)} and "
                    f"stride {shard.stride()}"
                )
            grad = p.grad if with_grad else None
            if grad is not None and is_dtensor(grad):
                placements = tuple(p.placements)  # type: ignore[attr-defined]
                if tuple(grad.placements) != placements:  # type: ignore[attr-defined]
                    grad = grad.redistribute(p.device_mesh, placements)  # type: ignore[attr-defined]
                grad = local_tensor(grad)
            shard.grad = grad
            self.state[shard] = self.state[p]
            try:
                yield shard
            finally:
                del self.state[shard]
                shard.grad = None

        @torch.no_grad()
        def init_state(
            self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int
        ) -> None:
            if not is_dtensor(p):
                super().init_state(group, p, gindex, pindex)
                return
            with self._on_shard(p, with_grad=False) as shard:
                super().init_state(group, shard, gindex, pindex)

        @torch.no_grad()
        def update_step(
            self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int
        ) -> None:
            wd = group["weight_decay"] if self.coupled_weight_decay else 0.0
            if not is_dtensor(p):
                if wd:
                    cast(torch.Tensor, p.grad).add_(p, alpha=wd)
                super().update_step(group, p, gindex, pindex)
                return
            with self._on_shard(p, with_grad=True) as shard:
                if wd:
                    cast(torch.Tensor, shard.grad).add_(shard, alpha=wd)
                super().update_step(group, shard, gindex, pindex)

    return LadderAdamW8bit


def check_8bit_param(p: torch.Tensor, where: str) -> None:
    """Raise unless the 8-bit rung can take ``p``: real float32, bfloat16 or float16.

    Args:
        p: the param.
        where: names it in the message, e.g. ``"param 2 of group 0"``.

    Raises:
        ValueError: naming the param, its dtype and what is allowed.
    """
    if p.is_complex():
        raise ValueError(
            f"{where} is complex ({p.dtype}); the 8bit rung takes real params only: use rung='fp32'"
        )
    if p.dtype not in _BNB_DTYPES:
        raise ValueError(
            f"{where} has dtype {p.dtype}; the 8bit rung takes float32, bfloat16 or float16 params"
        )


def build_8bit(
    param_groups: list[dict[str, Any]],
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
) -> torch.optim.Optimizer:
    """Build ``bitsandbytes.optim.AdamW8bit`` over ``param_groups``.

    Tensors under bitsandbytes' ``min_8bit_size`` (4096 elements) keep float32 moments;
    larger ones keep uint8 codes with one float32 absmax per 256-element block. When any
    param is a DTensor (FSDP2), the optimizer is :func:`ladder_adamw8bit_class`: each
    rank steps its local shard, and the 4,096-element rule follows the global count.
    ``decoupled_weight_decay=False`` (Adam) uses it too, to decay the Adam way.

    Raises:
        ImportError: if bitsandbytes does not import (install ``optladder[8bit]``).
        ValueError: for complex params or dtypes bitsandbytes does not take.
    """
    sharded = False
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            sharded = sharded or is_dtensor(p)
            check_8bit_param(p, f"param {pi} of group {gi}")
    try:
        bnb = import_bitsandbytes()
    except ImportError as exc:
        raise ImportError(
            f"the 8bit rung needs bitsandbytes, which does not import ({exc}); "
            "pip install 'optladder[8bit]'"
        ) from exc
    kwargs: dict[str, Any] = {}
    engine: Any = bnb.optim.AdamW8bit
    if sharded or not decoupled_weight_decay:
        engine = ladder_adamw8bit_class()
        kwargs["coupled_weight_decay"] = not decoupled_weight_decay
    return engine(
        param_groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        min_8bit_size=BNB_MIN_8BIT_SIZE,
        **kwargs,
    )
