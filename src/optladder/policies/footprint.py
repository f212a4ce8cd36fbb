"""Footprint: what a model's trainable params need in optimizer state on every rung."""

from __future__ import annotations

import itertools
import math
import operator
from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import repeat
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from optladder.bnb_overrides import no_overrides, quantized_8bit
from optladder.columns import ParamColumns, plain_types
from optladder.dtype_names import dtype_name
from optladder.rungs import (
    BNB_BLOCKSIZE,
    BNB_QMAP_BYTES,
    RUNGS,
    Rung,
    group_pin,
    quantizes,
)
from optladder.sharding import all_plain, is_dtensor, local_numel, local_tensor

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Footprint(BaseModel):
    """The trainable params of a model and their optimizer-state bytes on every rung.

    Element counts are global: a sharded (DTensor, e.g. FSDP2) param counts all its
    elements on every rank. State bytes are per rank: what this rank allocates for its
    own shards (for unsharded params, the whole state).

    Attributes:
        trainable_params: elements of the distinct params with ``requires_grad=True``
            (a complex element counts once).
        param_tensors: number of distinct trainable param tensors.
        frozen_params: elements of params skipped for ``requires_grad=False``.
        largest_param: elements of the largest trainable param.
        devices: sorted device strings of the trainable params, e.g. ``("cuda:0",)``.
        dtypes: sorted dtype names of the trainable params that follow the decision (in
            groups that do not pin their rung), e.g. ``("bfloat16", "float32")``; they
            decide which rungs are fused for them.
        has_complex: whether any trainable param that follows the decision (in a group
            that does not pin its rung) is complex (only the fp32 rung takes complex
            params).
        state_bytes: per rung, the bytes of state tensors the engines allocate for these
            params on this rank when the groups that follow the decision are on that
            rung (moments; for ``8bit`` also absmax and the shared code books), the
            ``pinned_state_bytes`` included. The 0-d ``step`` counters are not counted.
        sharded: whether any trainable param is a DTensor; its ``state_bytes`` then
            count this rank's shards.
        pinned_params: elements of the trainable params in groups that pin their rung
            (:func:`optladder.rungs.group_pin`).
        pinned_state_bytes: the state bytes of those params on their pinned rungs (part
            of every rung's ``state_bytes``: they do not move).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    trainable_params: int
    param_tensors: int
    frozen_params: int
    largest_param: int
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    has_complex: bool
    state_bytes: dict[Rung, int]
    sharded: bool = False
    pinned_params: int = 0
    pinned_state_bytes: int = 0

    def bytes_per_param(self, rung: Rung) -> float:
        """State bytes per trainable param element on ``rung``."""
        return self.state_bytes[rung] / max(self.trainable_params, 1)


def fp32_moment_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the fp32 rung's moments for a param of ``param_dtype``.

    torch's AdamW keeps moments in the param dtype; the fp32 rung keeps at least float32
    (bf16/fp16 params get float32 moments, float64 and complex params keep their own).
    """
    return torch.float32 if param_dtype in _LOW_PRECISION else param_dtype


def rung_state_bytes(
    rung: Rung,
    numel: int,
    dtype: torch.dtype,
    local_numel: int | None = None,
    *,
    quantize: bool | None = None,
) -> int:
    """State bytes one param of ``numel`` elements and ``dtype`` needs on ``rung``.

    Args:
        rung: the rung.
        numel: elements of the param, counted globally (a sharded param's full size:
            bitsandbytes' size rule applies to it).
        dtype: the param's dtype.
        local_numel: elements of this rank's shard, whose state this rank allocates;
            default ``numel`` (an unsharded param). On the ``8bit`` rung each rank
            quantizes its own shard: one float32 absmax per started 256-element block
            of the shard.
        quantize: ``8bit`` only: whether the param gets 8-bit codes; default
            bitsandbytes' size rule (``numel >= 4096``). False for a param that a
            bitsandbytes override keeps in 32 bits
            (:func:`optladder.bnb_overrides.quantized_8bit`).

    Returns:
        Bytes of ``exp_avg`` plus ``exp_avg_sq`` held by this rank (``8bit``: codes plus
        absmax, or two float32 moments when the *global* ``numel`` is under
        bitsandbytes' minimum size of 4,096 elements). Code books are not included.

    Raises:
        ValueError: if ``numel`` or ``local_numel`` is negative, or ``local_numel``
            exceeds ``numel``.
    """
    local = numel if local_numel is None else local_numel
    if numel < 0 or not 0 <= local <= numel:
        raise ValueError(
            f"need 0 <= local_numel <= numel, got numel={numel}, local_numel={local_numel}"
        )
    if rung == "fp32":
        return 2 * local * fp32_moment_dtype(dtype).itemsize
    if rung == "bf16":
        return 2 * local * 2
    if not (quantizes(numel) if quantize is None else quantize):
        return 2 * local * 4
    return 2 * local + 2 * 4 * math.ceil(local / BNB_BLOCKSIZE)


def normalize_param_groups(model_or_params: object) -> list[dict[str, Any]]:
    """Turn a module, an iterable of params, or param groups into param groups.

    Args:
        model_or_params: a ``torch.nn.Module``, a tensor, an iterable of tensors or of
            ``(name, tensor)`` pairs (``model.named_parameters()``), or an iterable of
            dicts each with a ``"params"`` entry of either kind (other keys are kept).

    Returns:
        A new list of new dicts; each ``"params"`` is a list of the given tensors in
        order (a module's ``parameters()`` already lists a tied weight once). Named
        params give their group a ``"param_names"`` list, as ``torch.optim.Optimizer``
        (2.6 and later) keeps it.

    Raises:
        TypeError: if an element is neither a tensor, a ``(str, tensor)`` pair nor a
            param group dict.
        ValueError: if there are no params at all; if some params are named and others
            not (torch's rule: all or none, over all groups).
    """
    if isinstance(model_or_params, torch.nn.Module):
        items: list[Any] = list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor):
        items = [model_or_params]
    elif isinstance(model_or_params, Iterable) and not isinstance(model_or_params, (str, bytes)):
        items = list(model_or_params)
    else:
        raise TypeError(
            "model_or_params must be a torch.nn.Module, params, or param groups; "
            f"got {type(model_or_params).__name__}"
        )
    if not items:
        raise ValueError(
            "model_or_params holds no parameters, so no trainable parameters; pass a model "
            "with params, or the params to optimize"
        )
    unchecked = [0]  # groups whose params may hold something other than tensors
    if all(isinstance(x, Mapping) for x in items):
        groups, unchecked = [], []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"param group {i} has no 'params' key")
            params = g["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            if plain_types(params):  # tensors only: no names to split
                groups.append({**g, "params": params})
            else:
                groups.append(_split_names({**g, "params": params}, f"param group {i}"))
                unchecked.append(i)
    elif plain_types(items):  # tensors only (the common case): nothing to split or check
        return [{"params": items}]
    elif all(isinstance(x, torch.Tensor) or _is_named(x) for x in items):
        groups = [_split_names({"params": items}, "model_or_params")]
    else:
        bad = next((x for x in items if not isinstance(x, (torch.Tensor, Mapping))), None)
        found = "both" if bad is None else f"a {type(bad).__name__}"
        raise TypeError(
            f"model_or_params must hold only tensors or only param group dicts; found {found}"
        )
    for gi in unchecked:
        for pi, p in enumerate(groups[gi]["params"]):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param {pi} of group {gi} is a {type(p).__name__}, not a tensor")
    named = ["param_names" in g for g in groups]
    if any(named) and not all(named):
        raise ValueError(
            f"param groups {[i for i, n in enumerate(named) if n]} name their params and "
            f"groups {[i for i, n in enumerate(named) if not n]} do not; torch's optimizers "
            "take named params in every group or in none"
        )
    return groups


def _is_named(x: object) -> bool:
    """Whether ``x`` is a ``(name, tensor)`` pair, as ``named_parameters()`` yields."""
    return (
        isinstance(x, tuple)
        and len(x) == 2
        and isinstance(x[0], str)
        and isinstance(x[1], torch.Tensor)
    )


def _split_names(group: dict[str, Any], where: str) -> dict[str, Any]:
    """``group`` with ``(name, tensor)`` pairs in ``"params"`` split into tensors and a
    ``"param_names"`` list (torch's ``add_param_group`` does the same).

    Raises:
        ValueError: if only some of the params are named.
    """
    params = group["params"]
    named = [_is_named(p) for p in params]
    if not any(named):
        return group
    if not all(named):
        raise ValueError(
            f"{where}: params {[i for i, n in enumerate(named) if not n][:5]} have no name "
            "while others are (name, tensor) pairs; name all of them or none"
        )
    return {**group, "params": [p for _, p in params], "param_names": [n for n, _ in params]}


def storage_key(p: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of the memory a param occupies, or None where there is none (meta): two
    params with the same key are the same view of the same memory.

    A DTensor has no storage of its own (its ``data_ptr`` raises): it is identified by
    its local shard's memory plus its global shape, stride and placements.
    """
    if p.device.type == "meta":
        return None
    local = local_tensor(p)
    try:
        ptr = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    key: tuple[Any, ...] = (
        str(local.device),
        ptr,
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
    )
    if local is not p:
        key += (tuple(p.shape), p.stride(), tuple(getattr(p, "placements", ())))
    return (*key, p.dtype)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")


def trainable_params(groups: Iterable[Mapping[str, Any]]) -> list[torch.Tensor]:
    """The distinct trainable params of ``groups``, in order of first appearance.

    A param is counted once however often it appears (tied weights); on real devices two
    Parameter objects that are the same view of the same storage are merged too (for
    DTensors: the same view of the same local shard, with the same global layout).
    """
    groups = list(groups)
    flat = [p for g in groups for p in g["params"]]
    if all_plain(flat):  # in bulk: distinct element pointers mean distinct memory
        trainable = list(itertools.compress(flat, map(_REQUIRES_GRAD, flat)))
        distinct = list({id(p): p for p in trainable}.values())  # first places, in order
        ptrs = set(map(torch.Tensor.data_ptr, distinct))
        if len(ptrs) == len(distinct) and len({p.device for p in distinct}) <= 1:
            return distinct
    seen_ids: set[int] = set()
    seen_storage: set[tuple[Any, ...]] = set()
    out = []
    for g in groups:
        for p in g["params"]:
            if not p.requires_grad or id(p) in seen_ids:
                continue
            seen_ids.add(id(p))
            key = storage_key(p)
            if key is not None:
                if key in seen_storage:
                    continue
                seen_storage.add(key)
            out.append(p)
    return out


def _counted_state_bytes(
    counts: Mapping[tuple[int, torch.dtype], int], rung: Rung, quantized_devices: int
) -> int:
    """State bytes on ``rung`` of plain params counted by (elements, dtype), once per
    distinct pair; ``quantized_devices``: devices with a param of 8-bit codes (each has
    its code books; 8bit only, where no bitsandbytes override applies)."""
    total = sum(k * rung_state_bytes(rung, n, d) for (n, d), k in counts.items())
    return total + (BNB_QMAP_BYTES * quantized_devices if rung == "8bit" else 0)


def _state_bytes(params: list[torch.Tensor], rung: Rung) -> int:
    """State bytes ``params`` need on ``rung`` in one engine (its code books included)."""
    if rung != "8bit":
        if all_plain(params):  # once per distinct (elements, dtype)
            counts = Counter(zip(map(torch.Tensor.numel, params), map(_DTYPE, params)))
            return _counted_state_bytes(counts, rung, 0)
        return sum(rung_state_bytes(rung, p.numel(), p.dtype, local_numel(p)) for p in params)
    if all_plain(params) and no_overrides():  # the size rule alone, in bulk
        counts = Counter(zip(map(torch.Tensor.numel, params), map(_DTYPE, params)))
        quantized = {p.device for p in params if quantizes(p.numel())}
        return _counted_state_bytes(counts, rung, len(quantized))
    total = 0
    devices = set()
    for i, p in enumerate(params):
        quantize = quantized_8bit(p, f"trainable param {i}")
        total += rung_state_bytes(rung, p.numel(), p.dtype, local_numel(p), quantize=quantize)
        if quantize:
            devices.add(str(p.device))
    return total + BNB_QMAP_BYTES * len(devices)


def measure_footprint(model_or_params: object) -> Footprint:
    """Measure what a model's trainable params need in optimizer state on every rung.

    Works on meta-device models without allocating anything: only shapes and dtypes are
    read. The ``8bit`` estimate follows bitsandbytes' own rule (``min_8bit_size`` 4096:
    smaller tensors keep two float32 moments; larger ones keep uint8 codes plus one
    float32 absmax per 256-element block, per moment; plus 2,048 bytes of code books per
    device) and its per-param overrides (``bnb.nn.StableEmbedding``,
    ``GlobalOptimManager.override_config(p, "optim_bits", 32)``: two float32 moments),
    and equals what ``bitsandbytes.optim.AdamW8bit`` allocates.

    A param group that pins its rung (``{"params": ..., "rung": "fp32"}``, see
    :func:`optladder.rungs.group_pin`) is counted on that rung for every rung's
    ``state_bytes`` (its engine has code books of its own), and reported in
    ``pinned_params`` and ``pinned_state_bytes`` (the 8bit rung's code books are counted
    once per device: one engine holds every group).

    DTensor params (FSDP2, ``torch.distributed.tensor``): ``trainable_params``,
    ``largest_param`` and the 4,096-element rule use the global element count
    (``p.numel()``), the same on every rank; ``state_bytes`` count this rank's shard
    (``p.to_local().numel()``), as the ``8bit`` rung quantizes each rank's shard in its
    own blocks.

    Args:
        model_or_params: a ``torch.nn.Module``, an iterable of params, or param groups.

    Returns:
        The :class:`Footprint`.

    Raises:
        TypeError: if the input is not a module, params, or param groups.
        ValueError: if no param has ``requires_grad=True``, a group pins something
            that is not a rung, or a bitsandbytes override sets ``optim_bits`` to
            anything but 8 or 32.
    """
    groups = normalize_param_groups(model_or_params)
    return groups_footprint(groups, ParamColumns(groups))


def groups_footprint(groups: list[dict[str, Any]], columns: ParamColumns) -> Footprint:
    """:func:`measure_footprint` of param groups already normalized
    (:func:`normalize_param_groups`), reading plain params' attributes from ``columns``
    (their :class:`optladder.columns.ParamColumns`, shared with the other checks of
    construction).

    Raises:
        ValueError: as :func:`measure_footprint`.
    """
    pins = [group_pin(g, f"param group {gi}") for gi, g in enumerate(groups)]
    if columns.plain and not any(pins) and columns.disjoint:
        return _disjoint_footprint(columns)  # each param once, no shared memory: in bulk
    params = trainable_params(groups)
    pin_of: dict[int, Rung | None] = {}
    for g, pin in zip(reversed(groups), reversed(pins)):  # the first group listing a param wins
        pin_of.update(zip(map(id, g["params"]), repeat(pin)))
    frozen_ids: set[int] = set()
    frozen = 0
    for g in groups:
        for p in itertools.compress(
            g["params"], map(operator.not_, map(_REQUIRES_GRAD, g["params"]))
        ):
            if id(p) not in frozen_ids:
                frozen_ids.add(id(p))
                frozen += p.numel()
    if not params:
        raise ValueError(_NO_TRAINABLE)
    param_pins = [pin_of[i] for i in map(id, params)]
    following = [p for p, pin in zip(params, param_pins) if pin is None]
    pinned_on = {
        rung: [p for p, pin in zip(params, param_pins) if pin == rung]
        for rung in RUNGS
        if rung in param_pins
    }
    pinned_bytes = {rung: _state_bytes(ps, rung) for rung, ps in pinned_on.items()}
    pinned = sum(pinned_bytes.values())

    def on(rung: Rung) -> int:
        """State bytes with the following params on ``rung``: one engine holds every
        group, so 8bit pins share the code books of the following params on 8bit."""
        if rung == "8bit" and "8bit" in pinned_on:
            shared = _state_bytes(following + pinned_on["8bit"], "8bit")
            return shared + pinned - pinned_bytes["8bit"]
        return _state_bytes(following, rung) + pinned

    numels = list(map(torch.Tensor.numel, params))
    dtypes = set(map(_DTYPE, following))
    return Footprint(
        trainable_params=sum(numels),
        param_tensors=len(params),
        frozen_params=frozen,
        largest_param=max(numels),
        devices=tuple(sorted({str(d) for d in {p.device for p in params}})),
        dtypes=tuple(sorted(map(dtype_name, dtypes))),
        has_complex=any(d.is_complex for d in dtypes),
        state_bytes={rung: on(rung) for rung in RUNGS},
        sharded=not all_plain(params) and any(is_dtensor(p) for p in params),
        pinned_params=sum(n for n, pin in zip(numels, param_pins) if pin is not None),
        pinned_state_bytes=pinned,
    )


_NO_TRAINABLE = (
    "model_or_params has no trainable parameters (none with requires_grad=True); "
    "unfreeze some or pass the ones to optimize"
)


def _disjoint_footprint(columns: ParamColumns) -> Footprint:
    """The footprint of plain params over disjoint memory on one device
    (:attr:`ParamColumns.disjoint`) in groups that pin no rung, from columns: each param
    is distinct, so the trainable ones are those with ``requires_grad``, and every rung's
    state bytes are counted once per distinct (elements, dtype)."""
    trainable = columns.requires_grad
    every = all(trainable)  # then nothing to pick out (the common case)
    counts: dict[tuple[int, torch.dtype], int]
    if len(columns.dtype_set) == 1:  # one dtype: count the byte sizes alone
        dtype = next(iter(columns.dtype_set))
        size = dtype.itemsize
        nbytes = columns.nbytes if every else list(itertools.compress(columns.nbytes, trainable))
        if not nbytes:
            raise ValueError(_NO_TRAINABLE)
        per_size = columns.size_counts if every else Counter(nbytes)
        counts = {(b // size, dtype): k for b, k in per_size.items()}
        elements = sum(nbytes) // size  # each a whole number of elements
        frozen = 0 if every else sum(columns.nbytes) // size - elements
    else:
        numels = columns.numels if every else list(itertools.compress(columns.numels, trainable))
        if not numels:
            raise ValueError(_NO_TRAINABLE)
        picked = columns.dtypes if every else itertools.compress(columns.dtypes, trainable)
        counts = Counter(zip(numels, picked))
        elements = sum(numels)
        frozen = 0 if every else sum(columns.numels) - elements
    dtypes = {d for _, d in counts}
    quantized = int(any(quantizes(n) for n, _ in counts))  # one device
    state_bytes = {
        rung: _counted_state_bytes(counts, rung, quantized)
        if rung != "8bit" or no_overrides()
        else _state_bytes(list(itertools.compress(columns.params, trainable)), rung)
        for rung in RUNGS
    }
    return Footprint(
        trainable_params=elements,
        param_tensors=sum(counts.values()),
        frozen_params=frozen,
        largest_param=max(n for n, _ in counts),
        devices=tuple(sorted(map(str, columns.devices))),
        dtypes=tuple(sorted(map(dtype_name, dtypes))),
        has_complex=any(d.is_complex for d in dtypes),
        state_bytes=state_bytes,
    )
