"""The checkpoint form of one param's state: what ``state_dict()`` saves and loads.

Plain params keep their engine's layout (see :mod:`optladder.optimizers.migrate`).
Sharded params (FSDP2 DTensors, sharded on dim 0) need a form that
``torch.distributed.checkpoint`` (DCP) and ``get_optimizer_state_dict(...,
full_state_dict=True)`` can shard, gather and reshard: every tensor a DTensor whose
global shape does not depend on the world size. A plain tensor of a rank's shard is
taken for a replicated value (DCP saves one rank's copy; a full state dict keeps rank
0's), which loses the other ranks' state.

- Adam layout (fp32 rung): ``exp_avg``/``exp_avg_sq`` are already DTensors laid out
  like the param; kept as they are.
- bitsandbytes layout, float32 moments (params under ``min_8bit_size``): ``state1``/
  ``state2`` become DTensors laid out like the param.
- bitsandbytes layout, 8-bit moments: the uint8 codes ``state1``/``state2`` become
  DTensors laid out like the param. The float32 block scales (one absmax per
  256-element block of each rank's *local* shard, so blocks straddle no shard boundary
  but depend on where the boundaries are) are saved per *row* of the param (dim 0):
  ``block_absmax1``/``block_absmax2`` of shape ``(rows, K)`` hold the absmax of each
  block that row's elements fall in (``K = (row_numel + 254) // 256 + 1`` slots, zero
  padded), and ``block_phase`` (int32, ``(rows,)``) the position of each row's first
  element in its block. Both are DTensors sharded like the param's rows, so DCP
  reshards them like the codes. Memory: ``4 * K / row_numel`` bytes per element more
  than the live state (0.08 for rows of 96 elements; 4 for a 1-D param).

Loading the row form (:func:`from_checkpoint_form`) rebuilds the live layout:

- exactly (codes and absmax bit for bit) when every row's saved phase equals its phase
  in this rank's shard: the 256-element blocks are then the same blocks. That holds at
  the world size of the save, and at any other whose shard boundaries fall on multiples
  of 256 elements of the flattened param (a full state dict loaded unsharded included);
- otherwise by dequantizing each element with its own saved block's absmax (exactly the
  value the optimizer held) and returning float32 moments, which the target engine
  quantizes into its own blocks: each element then moves by at most half the widest
  gap of the code book (``qmap``) times its new block's absmax, the 8-bit format's own
  rounding (Dettmers et al., 2022), once per reshard.

A param that has never stepped has no state. ``state_dict()`` saves a zero state with
``step`` 0 for it (:func:`zero_state`), so that every trainable param has the same keys
in every checkpoint (DCP refuses a checkpoint that lacks a key the live optimizer has,
as torch's ``_init_optim_state`` gives every trainable param state before a load); a
saved state with ``step`` 0 loads as no state, so the param's first step is a first step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from optladder.optimizers.migrate import (
    StateTarget,
    convert_param_state,
    unwrap_bnb_state,
)
from optladder.rungs import BNB_BLOCKSIZE
from optladder.sharding import is_dtensor, local_tensor, shard_like

PHASE_KEY = "block_phase"
"""Row form: int32 ``(rows,)``, the position of each row's first element in its block."""
ROW_ABSMAX_KEYS = ("block_absmax1", "block_absmax2")
"""Row form: float32 ``(rows, K)``, the absmax of each block a row's elements fall in."""


def row_numel(shape: torch.Size | tuple[int, ...]) -> int:
    """Elements per row (dim 0) of a param of ``shape``: 1 for a 1-D param."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def row_slots(numel_per_row: int) -> int:
    """``K``: the most 256-element blocks one row of ``numel_per_row`` elements touches."""
    return (numel_per_row + BNB_BLOCKSIZE - 2) // BNB_BLOCKSIZE + 1


def _row_starts(rows: int, per_row: int, device: torch.device, first_row: int = 0) -> torch.Tensor:
    """Each row's first element (int64, ``(rows,)``), counting from row ``first_row``."""
    return torch.arange(first_row, first_row + rows, dtype=torch.int64, device=device) * per_row


def _rows_from_blocks(
    absmax: torch.Tensor, rows: int, per_row: int, first_row: int = 0
) -> torch.Tensor:
    """The ``(rows, K)`` table of a contiguous shard's per-block ``absmax``: its rows
    ``first_row`` to ``first_row + rows - 1`` (the blocks counted from row 0)."""
    k = row_slots(per_row)
    start = _row_starts(rows, per_row, absmax.device, first_row)
    first = start // BNB_BLOCKSIZE
    last = (start + per_row - 1) // BNB_BLOCKSIZE
    idx = first[:, None] + torch.arange(k, device=absmax.device)[None, :]
    table = torch.zeros(rows, k, dtype=torch.float32, device=absmax.device)
    if absmax.numel():
        values = absmax.float()[idx.clamp(max=absmax.numel() - 1)]
        table = torch.where(idx <= last[:, None], values, table)
    return table


def _blocks_from_rows(table: torch.Tensor, rows: int, per_row: int) -> torch.Tensor:
    """The per-block absmax of a contiguous shard from its ``(rows, K)`` table."""
    blocks = -(-rows * per_row // BNB_BLOCKSIZE)
    first_elem = torch.arange(blocks, dtype=torch.int64, device=table.device) * BNB_BLOCKSIZE
    row = first_elem // per_row
    slot = first_elem // BNB_BLOCKSIZE - (row * per_row) // BNB_BLOCKSIZE
    return table[row, slot].contiguous()


def _check_row_sharding(p: torch.Tensor, where: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(p.placements)  # type: ignore[attr-defined]
    if p.dim() == 0 or not all(
        isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in placements
    ):
        raise ValueError(
            f"{where}: the 8bit rung saves the state of DTensor params sharded on dim 0 "
            f"(FSDP2's default); this param has shape {tuple(p.shape)} and placements "
            f"{placements}"
        )


def rows_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (``(local rows, ...)``) as a DTensor sharded like ``p``'s rows."""
    from torch.distributed.tensor import DTensor

    shape = (p.shape[0], *local.shape[1:])
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        local.contiguous(),
        p.device_mesh,  # type: ignore[attr-defined]
        p.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def to_checkpoint_form(state: Mapping[str, Any], p: torch.Tensor, where: str) -> dict[str, Any]:
    """One param's live state as ``state_dict()`` saves it (a new dict; see the module).

    Args:
        state: the param's live state, in its engine's layout.
        p: the param.
        where: names the param in messages, e.g. ``"param 3"``.

    Returns:
        ``state`` itself (as a new dict) for a plain param or the Adam layout; for a
        DTensor param in the bitsandbytes layout, its moments as DTensors and, for
        8-bit moments, the row form of the block scales (codes shared with the live
        state, as torch's ``state_dict`` shares its tensors; tables newly made).

    Raises:
        ValueError: for 8-bit state of a DTensor param not sharded on dim 0.
    """
    flat = unwrap_bnb_state(state)
    if not is_dtensor(p) or "state1" not in flat:
        return dict(state)
    shard = local_tensor(p)
    out: dict[str, Any] = {"step": flat["step"]}
    rows, per_row = shard.shape[0] if shard.dim() else 1, row_numel(p.shape)
    quantized = False
    for i in (1, 2):
        m = local_tensor(flat[f"state{i}"]).reshape(shard.shape)
        out[f"state{i}"] = shard_like(m, p)
        if m.dtype == torch.uint8:
            quantized = True
            _check_row_sharding(p, where)
            table = _rows_from_blocks(flat[f"absmax{i}"], rows, per_row)
            out[ROW_ABSMAX_KEYS[i - 1]] = rows_like(table, p)
            out[f"qmap{i}"] = flat[f"qmap{i}"].clone()
    if quantized:
        start = _row_starts(rows, per_row, shard.device)
        out[PHASE_KEY] = rows_like((start % BNB_BLOCKSIZE).to(torch.int32), p)
    return out


def is_row_form(state: Mapping[str, Any]) -> bool:
    """Whether a saved state is in the row form of sharded 8-bit state."""
    return PHASE_KEY in state


def _first_row(p: torch.Tensor) -> int:
    """The global index of the first row (dim 0) of ``p``'s shard on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        p.shape,
        p.device_mesh,  # type: ignore[attr-defined]
        p.placements,  # type: ignore[attr-defined]
    )
    return int(offset[0]) if offset else 0


def _row_form_of_whole(
    flat: Mapping[str, Any], p: torch.Tensor, where: str
) -> dict[str, Any] | None:
    """The row form of this rank's rows of a DTensor param's 8-bit state saved in
    bitsandbytes' layout over the *whole* param, or None when ``flat`` is not that.

    A run without FSDP saves its 8-bit state as bitsandbytes does: codes laid out like
    the param, which ``torch.distributed.checkpoint`` loads as this rank's rows (a
    DTensor laid out like the param, as :class:`~optladder.DCPLoadPlanner` makes the
    template) and a full state dict holds whole (this rank's rows are taken), and one
    absmax per 256-element block of the *whole* param, counted from its first element,
    which DCP loads whole. Those scales were refused as the wrong
    number of values for this rank's shard, so such a checkpoint did not load under
    FSDP2 on any rung. As rows, they load as the row form does: exactly where the
    shard starts on a multiple of 256 elements, requantized elsewhere.

    Args:
        flat: one param's saved state, bitsandbytes' wrapping undone.
        p: the live param.
        where: names the param in messages, e.g. ``"param 3"``.

    Raises:
        ValueError: for a param not sharded on dim 0.
    """
    if not is_dtensor(p) or not all(f"state{i}" in flat for i in (1, 2)):
        return None
    n = p.numel()
    shard = local_tensor(p)
    if shard.numel() == n:  # this rank holds the whole param: the layout is the live one
        return None
    for i in (1, 2):
        codes, absmax = flat[f"state{i}"], flat.get(f"absmax{i}")
        if not (
            isinstance(codes, torch.Tensor)
            and codes.dtype == torch.uint8
            and isinstance(absmax, torch.Tensor)
            and not is_dtensor(absmax)
            and absmax.dim() == 1
            and absmax.numel() == -(-n // BNB_BLOCKSIZE)
            and tuple(codes.shape) == tuple(p.shape)
            and (not is_dtensor(codes) or tuple(local_tensor(codes).shape) == tuple(shard.shape))
        ):
            return None
    _check_row_sharding(p, where)
    first = _first_row(p)
    rows, per_row = shard.shape[0], row_numel(p.shape)
    out: dict[str, Any] = {
        "step": flat.get("step"),
        PHASE_KEY: (_row_starts(rows, per_row, shard.device, first) % BNB_BLOCKSIZE).to(
            torch.int32
        ),
    }
    for i in (1, 2):
        codes = flat[f"state{i}"]
        # DCP loads this rank's rows (a DTensor laid out like the param); a full state
        # dict holds the whole codes: this rank's rows of them
        out[f"state{i}"] = local_tensor(codes) if is_dtensor(codes) else codes[first : first + rows]
        out[ROW_ABSMAX_KEYS[i - 1]] = _rows_from_blocks(flat[f"absmax{i}"], rows, per_row, first)
        out[f"qmap{i}"] = flat.get(f"qmap{i}")
    return out


def _rows_of_full(flat: Mapping[str, Any], p: torch.Tensor) -> dict[str, Any] | None:
    """This rank's rows of a DTensor param's float moments saved whole (plain tensors
    of the param's global shape: Adam's ``exp_avg``/``exp_avg_sq``, bitsandbytes'
    float32 ``state1``/``state2``), as a full state dict of a run without FSDP holds
    them; None when ``flat`` holds none, or ``p`` is not sharded by rows alone."""
    from torch.distributed.tensor import Replicate, Shard

    if not is_dtensor(p) or p.dim() == 0:
        return None
    shard = local_tensor(p)
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    if shard.numel() == p.numel() or not all(
        isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in placements
    ):
        return None
    names = [
        k
        for k in ("exp_avg", "exp_avg_sq", "state1", "state2")
        if isinstance(flat.get(k), torch.Tensor)
        and not is_dtensor(flat[k])
        and flat[k].is_floating_point()
        and tuple(flat[k].shape) == tuple(p.shape)
    ]
    if not names:
        return None
    first, rows = _first_row(p), shard.shape[0]
    return {k: (v[first : first + rows] if k in names else v) for k, v in flat.items()}


def from_checkpoint_form(state: Mapping[str, Any], p: torch.Tensor, where: str) -> dict[str, Any]:
    """A saved state of ``p`` in a layout :func:`convert_param_state` reads.

    The row form becomes the bitsandbytes layout of this rank's shard (exact) when the
    saved blocks are this shard's blocks, else the Adam layout with float32 moments
    dequantized element by element from their saved blocks (see the module). So does
    8-bit state of a DTensor param saved in bitsandbytes' layout over the whole param
    (by a run without FSDP; :func:`_row_form_of_whole`); float moments of a DTensor
    param saved whole become this rank's rows (:func:`_rows_of_full`). Any other form
    is returned as it is (a new dict). Nothing is written to ``state``.

    Args:
        state: one param's saved state (DTensor values are read on this rank's shard;
            plain values are taken whole, as a full state dict holds them).
        p: the live param.
        where: names the param in messages, e.g. ``"param 3"``.

    Raises:
        ValueError: naming the key, when the row form is incomplete, its shapes
            do not fit the param's shard on this rank, its codes are not uint8, or its
            ``block_phase`` is not integer offsets in ``[0, 255]``.
    """
    flat = unwrap_bnb_state(state)
    whole = _row_form_of_whole(flat, p, where)
    if whole is not None:
        state = whole
    elif not is_row_form(state):
        sliced = _rows_of_full(flat, p)
        return sliced if sliced is not None else dict(state)
    shard = local_tensor(p)
    rows = shard.shape[0] if shard.dim() else 1
    per_row = row_numel(p.shape)
    k = row_slots(per_row)
    values: dict[str, torch.Tensor] = {}
    for name in (PHASE_KEY, "state1", "state2", *ROW_ABSMAX_KEYS, "qmap1", "qmap2"):
        t = state.get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: the row form of 8-bit state needs a tensor {name!r}")
        values[name] = local_tensor(t)
    expected = {
        PHASE_KEY: (rows,),
        "state1": tuple(shard.shape),
        "state2": tuple(shard.shape),
        ROW_ABSMAX_KEYS[0]: (rows, k),
        ROW_ABSMAX_KEYS[1]: (rows, k),
        "qmap1": (256,),
        "qmap2": (256,),
    }
    for name, shape in expected.items():
        if tuple(values[name].shape) != shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(values[name].shape)}; this rank's shard "
                f"of the param (shape {tuple(shard.shape)}) needs {shape}"
            )
    phase = values[PHASE_KEY]
    if phase.is_floating_point() or phase.is_complex() or phase.dtype == torch.bool:
        raise ValueError(
            f"{where}: {PHASE_KEY} has dtype {phase.dtype}; allowed: an integer dtype (each "
            f"row's offset in its {BNB_BLOCKSIZE}-element block)"
        )
    phase = phase.to(torch.int64)
    if rows and (int(phase.min()) < 0 or int(phase.max()) >= BNB_BLOCKSIZE):
        raise ValueError(
            f"{where}: {PHASE_KEY} holds values in [{int(phase.min())}, {int(phase.max())}]; "
            f"allowed: each row's offset in its {BNB_BLOCKSIZE}-element block, in "
            f"[0, {BNB_BLOCKSIZE - 1}]"
        )
    for name in ("state1", "state2"):
        if values[name].dtype != torch.uint8:
            raise ValueError(
                f"{where}: {name} has dtype {values[name].dtype}; allowed: torch.uint8 (the "
                "row form holds 8-bit codes)"
            )
    live = _row_starts(rows, per_row, phase.device) % BNB_BLOCKSIZE
    step = state.get("step")
    if torch.equal(phase, live):  # the same blocks: exact
        out: dict[str, Any] = {"step": step}
        for i in (1, 2):
            out[f"state{i}"] = values[f"state{i}"]
            out[f"absmax{i}"] = _blocks_from_rows(values[ROW_ABSMAX_KEYS[i - 1]], rows, per_row)
            out[f"qmap{i}"] = values[f"qmap{i}"]
        return out
    slot = (phase[:, None] + torch.arange(per_row, device=phase.device)[None, :]) // BNB_BLOCKSIZE
    moments = []
    for i in (1, 2):
        codes = values[f"state{i}"].reshape(rows, per_row).to(torch.int64)
        scale = values[ROW_ABSMAX_KEYS[i - 1]].float().gather(1, slot)
        moments.append((values[f"qmap{i}"].float()[codes] * scale).reshape(shard.shape))
    return {
        "step": step,  # as saved: a float32 tensor would round counts past 2**24
        "exp_avg": moments[0],
        "exp_avg_sq": moments[1],
    }


def zero_state(target: StateTarget, p: torch.Tensor) -> dict[str, Any]:
    """The state of a param that never stepped, in ``target``'s layout: ``step`` 0 and
    zero moments (8-bit: zero codes with zero absmax, as bitsandbytes' ``init_state``
    makes them), on this rank's shard of ``p``. Allocates the param's state size."""
    shard = local_tensor(p)
    if target.layout == "adam":
        zeros = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
        base = {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros}
        return convert_param_state(base, p, target, copy=True)
    out: dict[str, Any] = {"step": 0}
    blocks = -(-shard.numel() // BNB_BLOCKSIZE)
    for i in (1, 2):
        dtype = torch.uint8 if target.quantize else torch.float32
        out[f"state{i}"] = torch.zeros(shard.shape, dtype=dtype, device=shard.device)
        if target.quantize:
            assert target.qmaps is not None
            out[f"absmax{i}"] = torch.zeros(blocks, dtype=torch.float32, device=shard.device)
            out[f"qmap{i}"] = target.qmaps[i - 1]
    return out
