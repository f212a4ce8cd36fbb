"""Migration: convert optimizer state between rungs, one parameter at a time.

Two state layouts exist:

- the *Adam layout* of ``torch.optim.AdamW`` and :class:`LadderAdamW`: ``step`` (0-d
  float64 tensor, see :mod:`optladder.optimizers.steps`), ``exp_avg`` and ``exp_avg_sq``
  (the param's shape, float32 on the fp32 rung, bfloat16 on the bf16 rung);
- the *bitsandbytes layout* of ``AdamW8bit``: ``step`` (int), ``state1``/``state2``
  (uint8 codes of the param's shape, or float32 moments below ``min_8bit_size``),
  ``absmax1``/``absmax2`` (one float32 per 256-element block) and ``qmap1``/``qmap2``
  (the optimizer's shared code books).

Each conversion goes straight from the source tensors to the target dtype (bitsandbytes
quantizes from and dequantizes to bfloat16 or float32 directly), so converting one param
allocates only that param's new state. Narrowing a moment (fp32 -> bf16) rounds to
nearest, ties away from zero, in a move and in a load alike (:func:`_split_moment`: a
move must be undoable, and round-to-nearest-even would need a 17th bit for that), so a
run that escalated and one resumed on bf16 from its checkpoint hold the same moments: a
one-time rounding of a value, where the bf16 rung's stochastic rounding is for the
repeated ``v = beta2 * v`` updates.

A DTensor param (FSDP2) is converted on this rank's local shard: torch's AdamW keeps
DTensor moments laid out like the param, bitsandbytes' layout keeps plain tensors of the
shard (:class:`optladder.optimizers.eightbit.EightBitGroups`); whether the shard
is quantized follows the param's global element count. No conversion communicates.
"""

from __future__ import annotations

import logging
import math
import numbers
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from optladder.bnb_overrides import quantized_8bit
from optladder.optimizers.adamw import LadderAdamW, foreign_group_key, is_8bit_group
from optladder.optimizers.codebooks import check_8bit_codes, check_values
from optladder.optimizers.steps import BF16_MAX_STEP, BNB_CUDA_MAX_STEP, MAX_STEP, STEP_DTYPE
from optladder.optimizers.torchroute import state_moment_dtype, torch_steps
from optladder.rungs import BNB_BLOCKSIZE
from optladder.sharding import is_dtensor, local_numel, local_tensor, shard_like

BNB_WRAPPED_KEY = "__bnb_optimizer_quant_state__"
"""bitsandbytes' ``state_dict`` moves its quantization tensors under this key (to hide
them from FSDP's gathering); :func:`unwrap_bnb_state` puts them back."""


BNB_WRAPPED_KEYS = frozenset(
    {
        "qmap1",
        "qmap2",
        "max1",
        "max2",
        "new_max1",
        "new_max2",
        "state1",
        "state2",
        "gnorm_vec",
        "absmax1",
        "absmax2",
        "unorm_vec",
    }
)
"""The keys bitsandbytes' ``state_dict`` moves under :data:`BNB_WRAPPED_KEY` (its
``Optimizer8bit.non_castable_tensor_keys``: tensors that ``load_state_dict`` must not
cast to the param's dtype)."""


def wrap_bnb_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """One param's state as bitsandbytes' ``state_dict`` lays it out (a new dict): the
    keys of :data:`BNB_WRAPPED_KEYS` moved into a dict under :data:`BNB_WRAPPED_KEY`,
    ``step`` left at the top. State without such keys (the Adam layout) and state already
    wrapped are returned as they are (a new dict)."""
    flat = unwrap_bnb_state(state)
    inner = {k: flat.pop(k) for k in [k for k in flat if k in BNB_WRAPPED_KEYS]}
    if inner:
        flat[BNB_WRAPPED_KEY] = inner
    return flat


def unwrap_bnb_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """One param's state with bitsandbytes' wrapped tensors back at the top level."""
    if BNB_WRAPPED_KEY not in state:
        return dict(state)
    flat = {k: v for k, v in state.items() if k != BNB_WRAPPED_KEY}
    flat.update(state[BNB_WRAPPED_KEY])
    return flat


@dataclass(frozen=True)
class StateTarget:
    """How one param's state must look for one engine.

    Attributes:
        layout: ``"adam"`` or ``"bnb"``.
        moment_dtype: dtype of ``exp_avg``/``exp_avg_sq`` (Adam layout).
        qmaps: bitsandbytes layout: the engine's ``(dynamic, udynamic)`` code books on
            the param's device.
        quantize: bitsandbytes layout: whether this param gets 8-bit codes (its global
            element count is at least ``min_8bit_size`` and no bitsandbytes override
            keeps it in 32 bits: :func:`optladder.bnb_overrides.quantized_8bit`).
    """

    layout: str
    moment_dtype: torch.dtype = torch.float32
    qmaps: tuple[torch.Tensor, torch.Tensor] | None = None
    quantize: bool = False


def bnb_qmaps(engine: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's shared code books on ``device``, made as bitsandbytes makes them."""
    if "dynamic" not in engine.name2qmap:
        engine.fill_qmap()
    for name in ("dynamic", "udynamic"):
        if engine.name2qmap[name].device != device:
            engine.name2qmap[name] = engine.name2qmap[name].to(device)
    return engine.name2qmap["dynamic"], engine.name2qmap["udynamic"]


def state_target(
    engine: torch.optim.Optimizer,
    group: Mapping[str, Any],
    p: torch.Tensor,
) -> StateTarget:
    """The state layout ``engine`` keeps for param ``p`` of ``group``.

    Args:
        engine: the :class:`LadderAdamW` holding ``group`` (its state format).
        group: the param group holding ``p``.
        p: the param.

    Raises:
        TypeError: for an engine of another kind.
    """
    if isinstance(engine, LadderAdamW) and is_8bit_group(group):  # bitsandbytes' layout
        quantize = quantized_8bit(p, "a param of the 8bit rung")
        qmaps = bnb_qmaps(engine.eightbit_groups(), p.device)
        return StateTarget("bnb", qmaps=qmaps, quantize=quantize)
    if isinstance(engine, LadderAdamW):  # the group's state format (its "rung" key)
        format_dtype = engine.group_moment_dtype(group)
        return StateTarget("adam", moment_dtype=state_moment_dtype(p, format_dtype))
    raise TypeError(f"cannot convert state for a {type(engine).__name__} engine")


def read_step(state: Mapping[str, Any]) -> int:
    """The number of steps a param took, from either layout."""
    step = state["step"]
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def _dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    if codes.dtype != torch.uint8:  # bitsandbytes keeps small tensors in float32
        return codes.to(dtype)
    blocks = -(-codes.numel() // BNB_BLOCKSIZE)
    if absmax.numel() != blocks or code.numel() != 256:
        raise ValueError(
            f"8-bit state of {codes.numel()} elements needs {blocks} absmax values and a "
            f"256-entry code book; got {absmax.numel()} and {code.numel()}"
        )
    code = code.to(device=codes.device, dtype=torch.float32)
    out = torch.ops.bitsandbytes.dequantize_blockwise(
        codes, absmax.to(codes.device), code, BNB_BLOCKSIZE, dtype
    )
    return out.reshape(codes.shape)


def _quantize(values: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``values`` as bitsandbytes' block-wise 8-bit state: on the CPU with the 8-bit
    CPU kernel's rule (nearest code, so an exact 0 stays 0) where that kernel builds,
    elsewhere with bitsandbytes' ``quantize_blockwise``."""
    if values.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        values = values.float()
    if values.device.type == "cpu" and code.device.type == "cpu":
        from optladder.optimizers.kernels import cpu, cpu8bit

        if cpu8bit.unavailable_reason() is None:
            try:
                codes, absmax = cpu8bit.quantize_blockwise(values, code)
            except (cpu.KernelBuildError, ValueError):
                pass  # a kernel that cannot load, or an unsorted code book: bitsandbytes'
            else:
                return codes, absmax
    codes, absmax = torch.ops.bitsandbytes.quantize_blockwise(
        values.contiguous(), code, BNB_BLOCKSIZE
    )
    return codes.reshape(values.shape), absmax


def convert_param_state(
    state: Mapping[str, Any], p: torch.Tensor, target: StateTarget, *, copy: bool = False
) -> dict[str, Any]:
    """Convert one param's state, in either layout, to ``target``.

    The source is not modified. Tensors already in the target's dtype and on the param's
    device are reused (a migration drops the source right after) unless ``copy``.

    A DTensor ``p`` is converted on this rank's shard: DTensor source tensors are read
    through their local shards, and Adam-layout moments come back as DTensors laid out
    like ``p``.

    Args:
        state: the param's state (Adam or bitsandbytes layout), on any device (for
            instance loaded with ``map_location="cpu"``).
        p: the param (its device and shape).
        target: from :func:`state_target`.
        copy: never return a tensor that shares memory with ``state`` (loading).

    Returns:
        The new state dict for ``p``.

    Raises:
        ValueError: if the state's moments do not have the param's element count (for a
            DTensor param: its local shard's).
    """
    state = unwrap_bnb_state(state)
    if is_dtensor(p):
        local_state = {
            k: local_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }
        converted = convert_param_state(local_state, local_tensor(p), target, copy=copy)
        if target.layout == "adam":
            converted["exp_avg"] = shard_like(converted["exp_avg"], p)
            converted["exp_avg_sq"] = shard_like(converted["exp_avg_sq"], p)
        return converted
    step = read_step(state)
    src_bnb = "state1" in state
    if src_bnb:
        moments = (state["state1"], state["state2"])
    else:
        moments = (state["exp_avg"], state["exp_avg_sq"])
    for name, m in zip(("exp_avg", "exp_avg_sq"), moments):
        if m.numel() != p.numel():
            raise ValueError(
                f"state {name} has {m.numel()} elements but the param has {p.numel()}"
                f" (shape {tuple(p.shape)})"
            )
    device = p.device
    if target.layout == "adam":
        if src_bnb:
            out = [
                _dequantize(
                    state[f"state{i}"],
                    state.get(f"absmax{i}", torch.empty(0)),
                    state.get(f"qmap{i}", torch.empty(0)),
                    target.moment_dtype,
                )
                for i in (1, 2)
            ]
        else:
            out = list(moments)
        exp_avg, exp_avg_sq = (_narrowed(m, p.shape, device, target.moment_dtype) for m in out)
        if copy and exp_avg.untyped_storage().data_ptr() == moments[0].untyped_storage().data_ptr():
            exp_avg = exp_avg.clone()
        if (
            copy
            and exp_avg_sq.untyped_storage().data_ptr() == moments[1].untyped_storage().data_ptr()
        ):
            exp_avg_sq = exp_avg_sq.clone()
        return {
            "step": torch.tensor(float(step), dtype=STEP_DTYPE),  # on the CPU, as prepare makes it
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
    result = _bnb_state(state, moments, step, p, target)
    if copy:
        sources = {
            t.untyped_storage().data_ptr() for t in state.values() if isinstance(t, torch.Tensor)
        }
        for name, value in result.items():
            shared = name.startswith("qmap")  # the engine's own code books
            if (
                isinstance(value, torch.Tensor)
                and not shared
                and value.untyped_storage().data_ptr() in sources
            ):
                result[name] = value.clone()
    return result


_TIE_CHUNK = 1 << 14
"""Elements per chunk where :func:`_narrowed` looks for halfway values (bounds its
scratch: a narrowing allocates the bfloat16 result and at most ~300 KiB besides, for
rows of at most this many elements)."""


def _narrowed(
    m: torch.Tensor, shape: torch.Size, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """``m`` as a contiguous ``dtype`` tensor of ``shape`` on ``device``.

    float32 to bfloat16 rounds as a move does (:func:`_split_moment`: to nearest, ties
    away from zero), not as ``.to()`` alone (ties to even), so a load and a move give the
    same bits: ``.to()`` first, then, where the float32 value was exactly halfway (its low
    half 0x8000) and rounded to the even bfloat16 nearer zero, one place away from zero.
    A NaN becomes the move's NaN (:func:`_put_nan_highs`), whatever NaN ``.to()`` wrote (CUDA's
    0x7FFF, which the step away from zero would carry into -0); infinities stay.
    """
    if not (m.dtype == torch.float32 and dtype == torch.bfloat16):
        return m.to(device=device, dtype=dtype).reshape(shape).contiguous()
    value = torch.empty(shape, dtype=dtype, device=device)
    src = m.to(device=device).reshape(shape)
    value.copy_(src)  # one allocation, whatever src's layout
    if value.numel() == 0:
        return value
    if src.dim() == 0 or src.is_contiguous():  # chunks of elements, else of rows (views)
        src, value_rows = src.reshape(-1), value.reshape(-1)
    else:
        value_rows = value
    rows = max(1, _TIE_CHUNK // max(1, src[0].numel()))
    nans = _has_nan(src)
    for start in range(0, src.shape[0], rows):
        bits = src[start : start + rows].reshape(-1).view(torch.int32)  # a chunk's copy at most
        out = value_rows[start : start + rows].reshape(-1).view(torch.int16)
        halfway = bits.bitwise_and(0xFFFF).eq_(0x8000)
        # .to() kept the float32 value's own high half (even): ties away take the next
        kept = bits.bitwise_right_shift(16).eq_(out.to(torch.int32))
        out.add_(kept.logical_and_(halfway).to(torch.int16))
        if nans:
            _put_nan_highs(bits, out)
    return value


def _put_nan_highs(bits: torch.Tensor, out: torch.Tensor) -> None:
    """Where the int32 ``bits`` are a float32 NaN, write into the int16 ``out`` (the
    same element count) the bfloat16 it narrows to: its high half, a NaN with its sign,
    as ``.to()`` keeps it; where that half alone is an infinity (a payload in the low half
    only: 0x7F800001), with the quiet bit (0x0040) set. Other elements are left."""
    high = bits.bitwise_right_shift(16)
    quiet = high.bitwise_and(0x7F).eq(0).to(high.dtype).bitwise_left_shift_(6)
    nan = bits.bitwise_and(0x7FFFFFFF).gt(0x7F800000)
    out.copy_(torch.where(nan, high.bitwise_or_(quiet).to(torch.int16), out))


def _has_nan(t: torch.Tensor) -> bool:
    """Whether float tensor ``t`` holds a NaN, without a tensor of its size (``amax``
    propagates NaN; one host sync)."""
    return t.numel() > 0 and bool(t.amax().isnan())


def _bnb_state(
    state: Mapping[str, Any],
    moments: tuple[torch.Tensor, torch.Tensor],
    step: int,
    p: torch.Tensor,
    target: StateTarget,
) -> dict[str, Any]:
    device = p.device
    src_bnb = "state1" in state
    assert target.qmaps is not None
    qmap1, qmap2 = target.qmaps
    result: dict[str, Any] = {"step": step}
    for i, (m, qmap) in enumerate(zip(moments, (qmap1, qmap2)), start=1):
        codes_of_this_book = (
            src_bnb and m.dtype == torch.uint8 and same_code_book(state[f"qmap{i}"], qmap)
        )
        if codes_of_this_book and target.quantize:
            result[f"state{i}"] = m.to(device).reshape(p.shape)
            result[f"absmax{i}"] = state[f"absmax{i}"].to(device)
        elif src_bnb and m.dtype == torch.uint8 and target.quantize:
            # codes of another code book (another bitsandbytes, or hand-made): decode
            # them with their own book, then encode with the engine's (one rounding)
            values = _dequantize(m, state[f"absmax{i}"], state[f"qmap{i}"], torch.float32)
            codes, absmax = _quantize(values.to(device), qmap)
            result[f"state{i}"] = codes.reshape(p.shape)
            result[f"absmax{i}"] = absmax
        elif src_bnb and m.dtype == torch.uint8:
            result[f"state{i}"] = (
                _dequantize(m, state[f"absmax{i}"], state[f"qmap{i}"], torch.float32)
                .to(device)
                .reshape(p.shape)
            )
        elif target.quantize:
            codes, absmax = _quantize(m.to(device), qmap)
            result[f"state{i}"] = codes.reshape(p.shape)
            result[f"absmax{i}"] = absmax
        else:
            result[f"state{i}"] = m.to(device=device, dtype=torch.float32).reshape(p.shape)
        if target.quantize:
            result[f"qmap{i}"] = qmap
    return result


def step_limit(
    engine: torch.optim.Optimizer, p: torch.Tensor, group: Mapping[str, Any] | None = None
) -> tuple[int, str]:
    """The largest step count ``engine`` takes for ``p`` before its next step, and why.

    Args:
        engine: the engine that steps ``p``.
        p: the param.
        group: its param group (its state format, on :class:`LadderAdamW`; default the
            engine's ``moment_dtype``).

    Returns:
        ``(limit, reason)``: the limits of :mod:`optladder.optimizers.steps`.
    """
    if isinstance(engine, LadderAdamW) and group is not None and is_8bit_group(group):
        return rung_step_limit("8bit", p.device.type)
    if isinstance(engine, LadderAdamW):
        format_dtype = engine.moment_dtype if group is None else engine.group_moment_dtype(group)
        if format_dtype == torch.bfloat16:
            return rung_step_limit("bf16", p.device.type)
        if torch_steps(p) and engine.backend == "auto":  # on torch's kernels
            return rung_step_limit("fp32", p.device.type)
    if isinstance(engine, LadderAdamW):  # the fp32 rung's bfloat16/float16 params
        return BF16_MAX_STEP, (
            "optladder's AdamW, which steps bfloat16/float16 params on the fp32 rung, keys "
            "its random bits and bias corrections by a step below 2**32"
        )
    return rung_step_limit("fp32", p.device.type)


def rung_step_limit(rung: str, device_type: str) -> tuple[int, str]:
    """The largest step count ``rung`` takes for a param on ``device_type`` (``"cpu"``,
    ``"cuda"``) before its next step, and why (:mod:`optladder.optimizers.steps`): the
    bf16 rung's random bits are keyed by a step below 2**32, bitsandbytes' CUDA kernel
    takes an int32 step, and float64 counts are exact to 2**53 - 1 elsewhere."""
    if rung == "bf16":
        return BF16_MAX_STEP, "the bf16 rung keys its random bits by a step below 2**32"
    if rung == "8bit" and device_type == "cuda":
        return BNB_CUDA_MAX_STEP, "bitsandbytes' CUDA 8-bit kernel takes the step as an int32"
    return MAX_STEP, "step counts are exact up to 2**53 - 1"


def check_step_range(
    step: int,
    engine: torch.optim.Optimizer,
    p: torch.Tensor,
    where: str,
    group: Mapping[str, Any] | None = None,
) -> None:
    """Refuse a step count ``engine`` cannot take another step from.

    Args:
        step: the steps the param has taken.
        engine: the engine that would step it.
        p: the param.
        where: names the param in messages, e.g. ``"param 3"``.
        group: its param group (see :func:`step_limit`).

    Raises:
        ValueError: naming the param, its step, the limit and why.
    """
    limit, why = step_limit(engine, p, group)
    if not 0 <= step <= limit:
        raise ValueError(
            f"{where} has step {step}; this rung takes step counts in [0, {limit:,}] ({why})"
        )


def same_code_book(saved: torch.Tensor, engine_book: torch.Tensor) -> bool:
    """Whether a checkpoint's code book (``qmap1``/``qmap2``: 256 float32 values that
    uint8 codes index) is the engine's, value for value, so its codes can be kept."""
    return bool(
        saved.shape == engine_book.shape
        and torch.equal(saved.to(device=engine_book.device, dtype=torch.float32), engine_book)
    )


_MOMENTS = ("exp_avg", "exp_avg_sq")
_HALF = 0x8000  # half of bfloat16's last place, in float32 bits


def _splits_exactly(state: Mapping[str, Any], p: torch.Tensor, spec: StateTarget) -> bool:
    """Whether a move of this state narrows float32 moments to bfloat16 (Adam layout to
    Adam layout on a plain tensor), which :func:`_split_moment` does exactly."""
    if spec.layout != "adam" or spec.moment_dtype != torch.bfloat16 or is_dtensor(p):
        return False
    moments = [state.get(name) for name in _MOMENTS]
    return "state1" not in state and all(
        isinstance(m, torch.Tensor)
        and m.dtype == torch.float32
        and m.is_contiguous()
        and m.device == p.device
        and m.numel() == p.numel()
        for m in moments
    )


def _split_moment(m: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Split float32 ``m`` into its bfloat16 value and the 16 bits that value drops.

    With ``w = bits(m) + 0x8000`` (modulo 2**32), the bfloat16 value is ``w``'s high half
    (round to nearest, ties away from zero) and the low half is kept aside, so
    :func:`_join_moment` gives back ``m`` bit for bit. Both halves are computed in their
    own new tensors (``m``'s high half plus the carry out of its low half, and the low
    half with its top bit flipped); ``m`` is only read, so a failure at any point leaves
    it as it was. This allocates the two halves: ``m``'s bytes, the bfloat16 value being
    half of them (and, when ``m`` holds a NaN, chunks of at most ``_TIE_CHUNK`` elements).

    A NaN stays NaN and an infinity infinite, as ``m.to(torch.bfloat16)`` keeps them:
    a NaN's value is its high half, no carry (the carry had made 0x7FFFFFFF -0 and
    0xFFFFFFFF +0), with the quiet bit set where that half alone is an infinity
    (:func:`_put_nan_highs`). Joined, it is the float32 NaN bit for bit, but for a signalling
    NaN whose payload lies in the low half only (0x7F80xxxx, 0xFF80xxxx; no arithmetic
    makes one, x86 and CUDA quiet the NaNs they compute), which comes back with the quiet
    bit set: 32 bits cannot hold both halves of every NaN and keep the bfloat16 half a
    NaN.

    Returns:
        ``(value, low)``: a contiguous bfloat16 tensor of ``shape`` and a contiguous int16
        tensor of ``m``'s element count.
    """
    words = m.view(torch.int32).reshape(-1)
    halves = words.view(torch.int16)  # little-endian: (low, high)
    # clone, not contiguous(): a one-element slice is "contiguous" and would stay a view
    high = halves[1::2].clone(memory_format=torch.contiguous_format)
    low = halves[0::2].clone(memory_format=torch.contiguous_format)
    low.bitwise_right_shift_(15)  # -1 where the low half is >= 0x8000 (the carry), else 0
    high.sub_(low)  # + the carry, modulo 2**16 as the 32-bit addition
    low.copy_(halves[0::2]).bitwise_xor_(-_HALF)  # the low half of w: + 0x8000 modulo 2**16
    if _has_nan(m):  # the NaNs' high halves, quiet, without the carry
        for start in range(0, words.numel(), _TIE_CHUNK):
            _put_nan_highs(words[start : start + _TIE_CHUNK], high[start : start + _TIE_CHUNK])
    return high.view(torch.bfloat16).reshape(shape), low


def _join_moment(value: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 moment :func:`_split_moment` split into ``value`` and ``low``."""
    words = torch.empty(value.shape, dtype=torch.int32, device=value.device)
    halves = words.view(-1).view(torch.int16)
    halves[1::2].copy_(value.reshape(-1).view(torch.int16))
    halves[0::2].copy_(low)
    words.sub_(_HALF)
    if _has_nan(value):  # a NaN's value carried nothing: its low half without the borrow
        flat, high = words.view(-1), value.reshape(-1).view(torch.int16)
        for start in range(0, flat.numel(), _TIE_CHUNK):
            chunk, hi = flat[start : start + _TIE_CHUNK], high[start : start + _TIE_CHUNK]
            nan = hi.bitwise_and(0x7FFF).gt(0x7F80)
            whole = (
                hi.to(torch.int32)
                .bitwise_left_shift_(16)
                .bitwise_or_(
                    low[start : start + _TIE_CHUNK].bitwise_xor(-_HALF).to(torch.int32) & 0xFFFF
                )
            )
            chunk.copy_(torch.where(nan, whole, chunk))
    return words.view(torch.float32)


def _split_state(
    state: dict[str, Any], p: torch.Tensor, spec: StateTarget
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Move one param's float32 Adam state to bfloat16 moments exactly (see
    :func:`_split_moment`), freeing each float32 moment once its halves exist.

    Returns:
        The new state and, per moment, the dropped low bits (for :func:`_unsplit_state`).
    """
    new: dict[str, Any] = {"step": torch.tensor(float(read_step(state)), dtype=STEP_DTYPE)}
    lows: dict[str, torch.Tensor] = {}
    try:
        for name in _MOMENTS:
            new[name], lows[name] = _split_moment(state[name], p.shape)
            state[name] = new[name]  # the float32 moment is freed here
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # the failed split's halves go first
        try:
            _unsplit_state(state, lows)
        except BaseException:
            state.clear()  # the way back failed too: no state rather than half of each
            raise
        raise
    return new, lows


def _unsplit_state(state: dict[str, Any], lows: dict[str, torch.Tensor]) -> None:
    """Put the float32 moments :func:`_split_state` split back into ``state``."""
    for name, low in lows.items():
        state[name] = _join_moment(state[name], low)


def migrate_states(
    source: torch.optim.Optimizer,
    source_state: Any,
    target_state: Any,
    params: list[torch.Tensor],
    source_spec: Any,
    target_spec: Any,
    *,
    keep_source: bool = False,
    places: Mapping[int, int] | None = None,
) -> None:
    """Move the state of ``params`` from ``source_state`` into ``target_state`` (two
    dicts keyed by param), one param at a time.

    Params are converted largest first, and each param's old state is dropped as soon as
    its new state exists, so when escalating (the target's state per param is at most half
    the source's) the extra memory peaks at the new state of the largest param: every
    later conversion fits in what the earlier ones freed. ``source_state`` ends without
    the moved params' state.

    If a conversion fails (an OOM), the error is re-raised after ``source_state`` gets
    every param's state back:

    - with ``keep_source``, the old state itself (exact);
    - float32 moments narrowed to bfloat16 (fp32 -> bf16): exact too, within the bound
      above. The bfloat16 value plus the 16 bits it drops take the float32 moment's bytes
      (:func:`_split_moment`); the dropped bits are kept until the move is done.
    - otherwise (a move to the 8-bit rung, float64 moments narrowed to bfloat16, a
      DTensor or non-contiguous moment), the params converted so far are converted
      back, which rounds them to the target's format; the error raised is then
      :class:`MigrationRoundedError`, naming them.

    The way back starts with the param converted last (what its conversion freed pays for
    its way back), after the failed conversion's tensors are dropped. Should it run out
    of memory too (memory taken during the move stayed taken), the params it cannot
    convert back get no state rather than a state in the other format, and
    :class:`MigrationRoundedError` names them (``lost``).

    A move between the fp32 and bf16 formats of one :class:`LadderAdamW` converts its
    groups' state in place with it: ``target_state`` a new dict, merged into the
    engine's state after the move.

    Args:
        source: the engine that held the state (its kernel tables are released first).
        source_state: the state dict it is in.
        target_state: the dict the new states go to (another dict than ``source_state``).
        params: the params to move, in order over their groups (the indices messages
            name); those without state are skipped.
        source_spec: ``p -> StateTarget`` of the state now (for the way back).
        target_spec: ``p -> StateTarget`` of the new state.
        keep_source: keep each param's old state until every param is converted, so a
            failure restores it exactly; the extra memory then peaks at the old state
            plus the new. For moves to a wider format (the new state is the larger one,
            so the bound above does not hold anyway).
        places: ``id(p) -> p``'s index over all the source engine's groups, the index
            messages and :class:`MigrationRoundedError` name (needed where ``params`` are
            not all of them: groups that pin their rung stay); None: ``params``' order.

    Raises:
        MigrationRoundedError: a conversion failed and params were rounded on the way back,
            or lost their state there (the original error chained).
        KeyboardInterrupt: Ctrl-C during the move, after the way back (as it came, never
            reported as running out of memory; the rounded params are named in a warning
            on the ``optladder`` logger).
        Whatever a conversion raised, otherwise (the state exactly as before).
    """
    release = getattr(source, "release_tables", None)
    if release is not None:
        release()  # kernel tables hold the old state's tensors: let them go as they drop
    todo = [p for p in params if source_state.get(p)]
    todo.sort(key=local_numel, reverse=True)  # the bytes this rank converts
    done: list[torch.Tensor] = []
    kept: dict[torch.Tensor, Any] = {}
    lows: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    current: torch.Tensor | None = None
    try:
        for p in todo:
            current = p
            spec = target_spec(p)
            old = source_state[p]
            if not keep_source and _splits_exactly(old, p, spec):
                target_state[p], lows[p] = _split_state(old, p, spec)
            else:
                target_state[p] = convert_param_state(old, p, spec)
            old = source_state.pop(p)
            if keep_source:
                kept[p] = old
            del old
            done.append(p)
            current = None
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # the failed conversion's tensors go first
        rounded: list[int] = []
        lost: list[int] = []
        interrupt: BaseException | None = None
        order = places if places is not None else {id(q): i for i, q in enumerate(params)}
        if current is not None and not source_state.get(current):  # its way back failed
            source_state.pop(current, None)
            lost.append(order[id(current)])
        # the last converted first: the memory its conversion freed pays for its way back
        for p in reversed(done):
            try:
                if p in kept:
                    source_state[p] = kept.pop(p)
                elif p in lows:
                    state = dict(target_state[p])
                    _unsplit_state(state, lows[p])
                    source_state[p] = convert_param_state(state, p, source_spec(p))
                else:
                    source_state[p] = convert_param_state(target_state[p], p, source_spec(p))
                    rounded.append(order[id(p)])
            except BaseException as back:  # out of memory again: p's state is lost
                lost.append(order[id(p)])
                if not isinstance(back, Exception):
                    interrupt = back
            target_state.pop(p, None)
            lows.pop(p, None)
        said = ""
        if rounded or lost:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            said = f"the move ran out of memory or failed ({type(exc).__name__}: {first})"
            if rounded:
                said += (
                    f" after converting params {sorted(rounded)} (index over all groups); they "
                    "were converted back and keep the narrower format's rounding"
                )
            if lost:
                said += (
                    f"; params {sorted(lost)} lost their state (index over all groups): the "
                    "way back ran out of memory too, so they start again from zero moments "
                    "and step 0 at their next step"
                )
        if said and (interrupt is not None or not isinstance(exc, Exception)):
            logging.getLogger("optladder").warning("optladder: %s", said)  # Ctrl-C goes on
        if interrupt is not None:
            raise interrupt from exc
        if said and isinstance(exc, Exception):
            raise MigrationRoundedError(said, sorted(rounded), sorted(lost)) from exc
        raise


class MigrationRoundedError(torch.OutOfMemoryError):
    """A migration failed after converting some params to a narrower format that cannot
    hold their values exactly (the 8-bit rung); they were converted back with that
    rounding. Every param has its state on the source engine.

    Attributes:
        rounded: indices (over all the source engine's groups) of the rounded params.
        lost: indices of params whose way back ran out of memory too (memory taken
            during the move stayed taken): they have no state (it was dropped rather
            than left in the other format), so their next step starts from zero moments.
    """

    def __init__(self, message: str, rounded: list[int], lost: list[int] | None = None) -> None:
        super().__init__(message)
        self.rounded = rounded
        self.lost = lost or []


ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})
"""Per-param state keys of the Adam layout (torch's Adam/AdamW, LadderAdamW)."""
BNB_STATE_KEYS = frozenset(
    {"step", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2", "unorm_vec"}
)
"""Per-param state keys of bitsandbytes' 2-state layout (``Optimizer2State.init_state``;
``unorm_vec`` only with ``max_unorm > 0``)."""


def foreign_group_reason(group: Mapping[str, Any]) -> str | None:
    """Why a checkpoint's param group was written by an optimizer whose update is not
    Adam/AdamW's, or None.

    Two signs: a key only another optimizer writes (:data:`FOREIGN_GROUP_KEYS`, e.g.
    NAdam's ``momentum_decay``), and torch's own group layout without ``amsgrad``: torch's
    Adam and AdamW always write ``amsgrad`` (and ``capturable``), while RAdam, NAdam and
    Adamax write ``capturable`` only. optladder's groups (LadderAdamW, bitsandbytes)
    write neither.
    """
    if (foreign := foreign_group_key(group)) is not None:
        key, owner = foreign
        return (
            f"it has the key {key!r}, which {owner} writes: its update is not AdamW's, "
            "so its state cannot be carried; optladder loads checkpoints of torch's "
            "Adam/AdamW, LadderAdamW and bitsandbytes' AdamW8bit"
        )
    if "capturable" in group and "amsgrad" not in group:
        return (
            "it has torch's 'capturable' key but no 'amsgrad', as torch.optim.RAdam, NAdam "
            "and Adamax write their groups (torch's Adam and AdamW always write 'amsgrad'): "
            "its update is not AdamW's, so its state cannot be carried"
        )
    return None


def _finite_number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.device.type == "meta":
            return None
        value = value.item()
    # numbers.Real takes numpy's integer and float scalars too (an np.int64 from a numpy
    # round trip is no int); bools (Python's and numpy's) are not counts
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def check_param_state(state: Mapping[str, Any], p: torch.Tensor, where: str) -> None:
    """Check one param's saved state before anything is converted or loaded: refuse what
    no rung can carry exactly.

    Accepts the Adam layout (``step``, ``exp_avg``, ``exp_avg_sq``: dense floating
    tensors of the param's element count; complex ones for a complex param, as torch's
    AdamW keeps them on the fp32 rung) and the bitsandbytes layout (``step``,
    ``state1``/``state2``: uint8 codes with float32 ``absmax1``/``absmax2`` of one value
    per started 256-element block and 256-entry ``qmap1``/``qmap2``, or float32
    moments). Checked against the param's local shard for a DTensor param. Refused:
    keys of other optimizers' state (NAdam's ``mu_product``, amsgrad's
    ``max_exp_avg_sq``, Adamax's ``exp_inf``, ...), a ``step`` that is not a whole number
    ``>= 0`` (``2.5`` would be truncated), sparse or meta tensors, NaN or infinite
    moments or block scales (the 8-bit format would turn them finite), and a negative
    ``exp_avg_sq`` (a sum of squares, which the 8-bit format's unsigned code book
    cannot hold), or a ``qmap2`` with negative values (its codes would decode to one).

    Args:
        state: the saved state of one param.
        p: the live param.
        where: names the param in messages, e.g. ``"param 3"``.

    Raises:
        ValueError: naming the param, the key, what was found and what is allowed.
    """
    state = unwrap_bnb_state(state)
    shard = local_tensor(p)
    n = shard.numel()
    if "max_exp_avg_sq" in state:
        raise ValueError(
            f"{where}: the state holds max_exp_avg_sq (amsgrad), which no optladder rung keeps"
        )
    bnb = any(k in state for k in BNB_STATE_KEYS - ADAM_STATE_KEYS)  # its codes may be missing
    known = BNB_STATE_KEYS if bnb else ADAM_STATE_KEYS
    other = sorted(str(k) for k in state if k not in known)
    if other:
        raise ValueError(
            f"{where}: the state holds {', '.join(map(repr, other))}, which the "
            f"{'bitsandbytes' if bnb else 'Adam'} layout has no place for (state of another "
            f"optimizer, e.g. NAdam's 'mu_product'); allowed keys: {', '.join(sorted(known))}"
        )
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"{where}: {name} is on the meta device, so it holds no values")
        if isinstance(t, torch.Tensor) and local_tensor(t).layout != torch.strided:
            raise ValueError(
                f"{where}: {name} is a sparse tensor (layout {local_tensor(t).layout}); "
                "allowed: dense (torch.strided) tensors"
            )
    step = state.get("step")
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        whole = int(step) >= 0  # exact at any size: the range check names one past floats
    else:
        value = _finite_number(step)
        whole = value is not None and value >= 0 and value.is_integer()
    if not whole:
        raise ValueError(
            f"{where}: 'step' must be a finite whole number >= 0 (an int or a one-element "
            "tensor), "
            f"got {step!r}"
        )
    names = ("state1", "state2") if bnb else ("exp_avg", "exp_avg_sq")
    if not bnb and set(state) <= {"step"}:  # a step alone: neither layout's moments
        raise ValueError(
            f"{where}: the state holds a 'step' but no moments: the Adam layout needs "
            "'exp_avg' and 'exp_avg_sq', bitsandbytes' needs 'state1' and 'state2' (in an "
            f"8-bit checkpoint, under {BNB_WRAPPED_KEY!r}, which this entry lacks)"
        )
    if bnb and isinstance(state.get("state1"), torch.Tensor) and "state2" not in state:
        raise ValueError(
            f"{where}: the state has no tensor 'state2', only 'state1': one moment, as "
            "bitsandbytes' 1-state optimizers (Lion, Lion8bit, Momentum, RMSprop, SGD with "
            "momentum) save it, where AdamW keeps two; such an update is not AdamW's, so "
            "its state cannot be carried; optladder loads checkpoints of torch's "
            "Adam/AdamW, LadderAdamW and bitsandbytes' AdamW8bit"
        )
    for name in names:
        t = state.get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: the state has no tensor {name!r} (got {type(t).__name__})")
        t = local_tensor(t)
        if t.numel() != n:
            raise ValueError(
                f"{where}: {name} has {t.numel()} elements (shape {tuple(t.shape)}) but the "
                f"param has {n} (shape {tuple(shard.shape)})"
            )
        if t.dim() > 1 and t.shape != shard.shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(t.shape)} but the param has {tuple(shard.shape)}"
            )
        if t.dtype == torch.uint8 and bnb:
            check_8bit_codes(state, name, where, numel=n)
        elif t.is_complex() and shard.is_complex() and not bnb:
            # torch's AdamW keeps a complex param's moments complex (real and imaginary
            # parts as two reals)
            nonnegative = name == "exp_avg_sq"
            check_values(torch.view_as_real(t), name, where, nonnegative=nonnegative)
        elif not t.is_floating_point():
            allowed = "uint8 codes or float32" if bnb else "a floating dtype"
            raise ValueError(f"{where}: {name} has dtype {t.dtype}; allowed: {allowed}")
        elif bnb and f"absmax{name[-1]}" in state:
            # bitsandbytes keeps float moments without block scales (under min_8bit_size,
            # optim_bits=32); codes cast to a float (a checkpoint's tensors converted by
            # hand) were read as moments: exp_avg 62.0 for code 62
            raise ValueError(
                f"{where}: {name} has dtype {t.dtype} beside absmax{name[-1]}, the block "
                f"scales of 8-bit codes; allowed: uint8 codes with absmax{name[-1]} and "
                f"qmap{name[-1]}, or float moments without them (the codes were cast to a "
                "float: cast them back with .to(torch.uint8))"
            )
        else:
            check_values(t, name, where, nonnegative=name in ("exp_avg_sq", "state2"))
