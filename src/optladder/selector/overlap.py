"""Which params share memory: byte ranges by address, then element-exact checks.

An optimizer steps each param it holds, so two params over shared elements (the same
view twice, overlapping slices of one buffer, a tensor beside a reshaped view of it)
give those elements more than one update per step. Params that share a storage without
sharing elements (the rows, or the columns, of one buffer) are fine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from optladder.sharding import local_tensor

_CHUNK = 1 << 20
"""Elements enumerated at a time by the exact check (8 bytes each), to bound its memory."""


def _span(t: torch.Tensor) -> tuple[tuple[str, int], int, int] | None:
    """``((device, storage pointer), first byte, end byte)`` that ``t``'s elements lie in,
    or None for tensors that hold no memory (meta, empty, storage-less subclasses)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        base = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    size = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    start = int(t.storage_offset()) * size
    return (str(t.device), base), start, start + (int(last) + 1) * size


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its byte span exactly (no gaps, no overlap)."""
    span = _span(t)
    return span is not None and span[2] - span[1] == t.numel() * t.element_size()


def _nested(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """``t``'s (stride, size) pairs of size > 1, largest stride first, when each stride
    exceeds the furthest offset the smaller ones reach (then every element has its own
    offset, found greedily); None otherwise."""
    dims = sorted(((st, n) for st, n in zip(t.stride(), t.shape) if n > 1), reverse=True)
    reach = 0
    for st, n in reversed(dims):
        if st <= reach:
            return None
        reach += (n - 1) * st
    return dims


def _offsets(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The element offsets of ``t`` in its storage (int64, in elements), in chunks."""
    shape, stride = list(t.shape), list(t.stride())
    for first in range(0, t.numel(), _CHUNK):
        flat = torch.arange(first, min(first + _CHUNK, t.numel()), dtype=torch.int64)
        offset = torch.full_like(flat, int(t.storage_offset()))
        for n, st in zip(reversed(shape), reversed(stride)):
            offset += (flat % n) * st
            flat = flat // n
        yield offset


def self_overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a view made with ``as_strided``; an
    expanded view is one too).

    Args:
        t: a strided tensor (for a DTensor, pass its local shard).
    """
    if _span(t) is None or _dense(t) or _nested(t) is not None:
        return False
    offsets = torch.cat(list(_offsets(t)))
    return bool(torch.unique(offsets).numel() != offsets.numel())


def _share_elements(a: torch.Tensor, b: torch.Tensor, shift: int = 0) -> bool:
    """Whether views ``a`` and ``b``, whose byte spans intersect, share an element.
    ``shift``: the first byte of ``a``'s storage minus that of ``b``'s (0 for views of
    one storage; storages of their own may hold the same memory, as NumPy slices of one
    array under ``torch.from_numpy`` do). Exact for views of one itemsize, their storages
    a whole number of elements apart, where ``b``'s strides are nested (every real tensor
    and view of one); True (shared) when that cannot be decided exactly."""
    size = a.element_size()
    if size != b.element_size() or shift % size or (_dense(a) and _dense(b)):
        return True
    if _nested(b) is None:
        a, b, shift = b, a, -shift
    dims = _nested(b)
    if dims is None:
        return True
    for offsets in _offsets(a):
        rel = offsets + shift // size - int(b.storage_offset())
        inside = rel >= 0
        for st, n in dims:
            index = torch.div(rel, st, rounding_mode="floor")
            inside &= (index >= 0) & (index < n)
            rel = rel - index * st
        if bool((inside & (rel == 0)).any()):
            return True
    return False


def first_shared_memory(named: list[tuple[torch.Tensor, str]]) -> str | None:
    """The first pair of params that share memory, as a sentence; None when none do.

    Params are grouped by device, sorted by the address of their first byte (storages
    of their own may hold the same memory: NumPy slices of one array under
    ``torch.from_numpy``), and each is compared with the earlier ones whose byte span
    it starts inside (then element by element).

    Args:
        named: ``(param, name)`` pairs, e.g. ``(p, "param 0 of group 1")``; DTensor
            params are compared by their local shards.

    Returns:
        ``"{name} ... {other name} ..."`` naming both and the bytes of their storages
        they cover, or None.
    """
    by_device: dict[str, list[tuple[int, int, torch.Tensor, str, int, int]]] = {}
    for place, (p, name) in enumerate(named):
        local = local_tensor(p)
        span = _span(local)
        if span is not None:
            (device, base), start, end = span
            by_device.setdefault(device, []).append(
                (base + start, base + end, local, name, place, base)
            )
    for entries in by_device.values():
        if len(entries) < 2:
            continue
        entries.sort(key=lambda e: e[0])
        active: list[tuple[int, int, torch.Tensor, str, int, int]] = []
        for start, end, t, name, place, base in entries:
            active = [e for e in active if e[1] > start]
            for o_start, o_end, other, other_name, other_place, o_base in active:
                later, earlier = (name, other_name) if place > other_place else (other_name, name)
                same_view = (
                    o_start == start
                    and other.shape == t.shape
                    and other.stride() == t.stride()
                    and other.dtype == t.dtype
                )
                if same_view:
                    return (
                        f"{later} views the same memory as {earlier}; each would be "
                        "stepped; optimize one of them"
                    )
                if _share_elements(other, t, o_base - base):
                    spans = {
                        name: (start - base, end - base),
                        other_name: (o_start - o_base, o_end - o_base),
                    }
                    return (
                        f"{later} (bytes {spans[later][0]} to {spans[later][1]} of its "
                        f"storage) overlaps {earlier} (bytes {spans[earlier][0]} to "
                        f"{spans[earlier][1]}) in memory: shared "
                        "elements would be stepped more than once per step; optimize the "
                        "buffer once, or views that do not overlap"
                    )
            active.append((start, end, t, name, place, base))
    return None
