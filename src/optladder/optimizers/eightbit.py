"""The 8-bit rung: bitsandbytes' ``AdamW8bit`` (block-wise quantized moments).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022). bitsandbytes
is imported only when this rung is built.

The rung runs a subclass of ``AdamW8bit`` (:func:`ladder_adamw8bit_class`). It decides
which params keep float32 moments by one rule shared with migrations and the footprint
(:func:`optladder.bnb_overrides.quantized_8bit`: bitsandbytes' size rule and its
per-param overrides, ``StableEmbedding`` and ``override_config(p, "optim_bits", 32)``);
it runs bitsandbytes' update on each rank's local shard for sharded params (DTensor,
e.g. FSDP2's ``fully_shard``), while the size rule follows the param's global element
count, the same on every rank; and in Adam mode it adds ``weight_decay * param`` to the
grad and runs bitsandbytes with weight decay 0, because bitsandbytes applies weight
decay the AdamW (decoupled) way.
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

from optladder.bnb_overrides import quantized_8bit
from optladder.rungs import BNB_MIN_8BIT_SIZE, param_refusal
from optladder.sharding import is_dtensor, local_tensor

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
    """bitsandbytes' ``AdamW8bit``, taught to keep the state format of
    :func:`optladder.bnb_overrides.quantized_8bit`, to step DTensor params on their
    local shards and, with ``coupled_weight_decay=True``, to decay the Adam way.

    State format: for each param, ``get_config`` (bitsandbytes' per-param configuration
    hook, read by ``init_state``) reports ``optim_bits`` 8 with ``min_8bit_size`` 0 when
    the shared rule quantizes the param, else ``optim_bits`` 32. The rule reads
    bitsandbytes' own overrides by param identity, module overrides included, so a
    ``StableEmbedding`` keeps float32 moments from the first state allocated (plain
    bitsandbytes reads module overrides in ``step``, which optladder's prepare phase
    comes before), and a migration or checkpoint load creates the same format.

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
    everywhere. Plain params take bitsandbytes' update unchanged.

    A non-contiguous plain param is stepped through a contiguous copy (allocated by
    :meth:`prepare_contiguous` in the prepare phase of a two-phase step, dropped after
    the step), and the result is copied back into the param's own memory; its state is
    kept contiguous, in the param's logical order. bitsandbytes alone would run
    ``p.data = p.data.contiguous()`` and move the param to new storage.

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
            # non-contiguous param -> (contiguous copy, contiguous grad or None), made in
            # prepare_contiguous and dropped after the step or by release_scratch
            self._contiguous: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]] = {}
            super().__init__(*args, **kwargs)

        def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> Any:
            # bitsandbytes' zeros_like keeps a non-contiguous param's strides, while its
            # kernels index state by memory order: keep the state in the param's logical
            # (row-major) order, as the contiguous copy is stepped.
            if not p.is_contiguous() and not self.is_paged:
                return torch.zeros(p.shape, dtype=dtype, device=p.device)
            return super().get_state_buffer(p, dtype=dtype)

        def prepare_contiguous(self) -> None:
            """Allocate a contiguous copy of every non-contiguous plain param that has a
            grad (and of its grad when that is not contiguous), for the next step; the
            commit then allocates nothing for them. On failure (an OOM) nothing is kept.
            """
            try:
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None or is_dtensor(p) or p in self._contiguous:
                            continue
                        if p.is_contiguous():
                            continue
                        work = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                        grad = None
                        if not p.grad.is_contiguous():
                            grad = torch.empty(p.shape, dtype=p.grad.dtype, device=p.device)
                        self._contiguous[p] = (work, grad)
            except BaseException:
                self.release_scratch()
                raise

        def release_scratch(self) -> None:
            """Drop the contiguous copies :meth:`prepare_contiguous` made."""
            self._contiguous.clear()

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            try:
                return super().step(closure)
            finally:
                self.release_scratch()

        def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
            config: dict[str, Any] = super().get_config(gindex, pindex, group)
            if self.coupled_weight_decay:
                config["weight_decay"] = 0.0  # folded into the grad in update_step
            p = self.param_groups[gindex]["params"][pindex]
            # bitsandbytes compares the tensor it is handed (for a DTensor, the local
            # shard) with min_8bit_size: state the shared rule's answer outright.
            quantize = quantized_8bit(
                p,
                f"param {pindex} of group {gindex}",
                optim_bits=self.args.optim_bits,
                min_8bit_size=self.args.min_8bit_size,
            )
            config["optim_bits"] = 8 if quantize else 32
            config["min_8bit_size"] = 0
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
            if not is_dtensor(p) and not p.is_contiguous():
                self._update_noncontiguous(group, p, gindex, pindex, wd)
                return
            if not is_dtensor(p):
                if wd:
                    cast(torch.Tensor, p.grad).add_(p, alpha=wd)
                super().update_step(group, p, gindex, pindex)
                return
            with self._on_shard(p, with_grad=True) as shard:
                if wd:
                    cast(torch.Tensor, shard.grad).add_(shard, alpha=wd)
                super().update_step(group, shard, gindex, pindex)

        def _update_noncontiguous(
            self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int, wd: float
        ) -> None:
            """Step a non-contiguous param through a contiguous copy, written back in
            place: bitsandbytes would otherwise run ``p.data = p.data.contiguous()`` and
            move the param to new storage, untying every tensor that views it."""
            grad = cast(torch.Tensor, p.grad)
            prepared = self._contiguous.pop(p) if p in self._contiguous else None
            work, work_grad = prepared or (  # stepped without prepare_contiguous: made here
                torch.empty(p.shape, dtype=p.dtype, device=p.device),
                None
                if grad.is_contiguous()
                else torch.empty_like(grad, memory_format=torch.contiguous_format),
            )
            work.copy_(p)
            if work_grad is not None:
                work_grad.copy_(grad)
            else:
                work_grad = grad
            if wd:
                work_grad.add_(work, alpha=wd)
            work.grad = work_grad
            self.state[work] = self.state[p]
            try:
                super().update_step(group, work, gindex, pindex)
            finally:
                del self.state[work]
                work.grad = None
            p.copy_(work)

    return LadderAdamW8bit


def steps_noncontiguous(engine: torch.optim.Optimizer) -> bool:
    """Whether ``engine`` (an 8bit engine) steps non-contiguous params in place, through
    a contiguous copy (:func:`ladder_adamw8bit_class`); bitsandbytes' plain
    ``AdamW8bit`` would move them to new storage."""
    return hasattr(engine, "prepare_contiguous")


def check_8bit_param(p: torch.Tensor, where: str) -> None:
    """Raise unless the 8-bit rung can take ``p`` (:data:`optladder.rungs.RUNG_ACCEPTS`:
    real float32, bfloat16 or float16).

    Args:
        p: the param.
        where: names it in the message, e.g. ``"param 2 of group 0"``.

    Raises:
        ValueError: naming the param, its dtype and what is allowed.
    """
    refusal = param_refusal("8bit", str(p.dtype).removeprefix("torch."), sharded=is_dtensor(p))
    if refusal is not None:
        kind = f"is complex ({p.dtype})" if p.is_complex() else f"has dtype {p.dtype}"
        raise ValueError(f"{where} {kind}; {refusal}")


def build_8bit(
    param_groups: list[dict[str, Any]],
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
) -> torch.optim.Optimizer:
    """Build :func:`ladder_adamw8bit_class` (bitsandbytes' ``AdamW8bit``) over
    ``param_groups``.

    Tensors under bitsandbytes' ``min_8bit_size`` (4096 elements, the global count for
    a DTensor) keep float32 moments, as do params bitsandbytes' overrides keep in 32 bits
    (``StableEmbedding``, ``override_config(p, "optim_bits", 32)``); the others keep
    uint8 codes with one float32 absmax per 256-element block. DTensor params (FSDP2)
    are stepped on each rank's local shard. ``decoupled_weight_decay=False`` (Adam)
    decays the Adam way. A non-contiguous param (a transposed view, a column slice) is
    stepped through a contiguous copy written back in place: bitsandbytes' own
    ``update_step`` runs ``p.data = p.data.contiguous()``, which gives the param new
    storage and unties every tensor that views it.

    Raises:
        ImportError: if bitsandbytes does not import (the message says how to install it).
        ValueError: for complex params, dtypes bitsandbytes does not take, or a
            bitsandbytes override it would fail on (``optim_bits`` not 8 or 32).
    """
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            check_8bit_param(p, f"param {pi} of group {gi}")
            quantized_8bit(p, f"param {pi} of group {gi}")
    try:
        engine: Any = ladder_adamw8bit_class()
    except ImportError as exc:
        raise ImportError(
            f"the 8bit rung needs bitsandbytes, which does not import ({exc}); "
            "install it with pip install 'bitsandbytes>=0.45' (what optladder's 8bit extra "
            "installs)"
        ) from exc
    return engine(
        param_groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        min_8bit_size=BNB_MIN_8BIT_SIZE,
        coupled_weight_decay=not decoupled_weight_decay,
    )
