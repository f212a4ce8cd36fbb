"""Attributes of many params read in bulk, each once, for the checks of construction.

Construction asks several things of every param: the duplicates and overlap check, the
footprint, each rung's dtype rules, the device whose memory gates the choice. Over tens
of thousands of small tensors a pass per check and per attribute costs several times
torch's whole optimizer construction. A :class:`ParamColumns` reads each attribute it
needs of every param once, one C-level ``map`` per attribute over a chunk of params at
a time (:data:`_CHUNK`: no bytecode per param, and each chunk's tensors stay in cache
from one attribute to the next), and the checks read the columns.

Only plain params are read this way (:attr:`ParamColumns.plain`: ``torch.Tensor`` and
``nn.Parameter`` objects off the meta device). DTensors and other subclasses, whose
attributes may describe a global tensor rather than this rank's memory, are checked
param by param by each check, which also names what it refuses.

This module sits below ``policies``, ``optimizers`` and ``selector``, like
:mod:`optladder.sharding`.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import cached_property
from itertools import accumulate, chain, islice, repeat
from typing import Any

import torch

from optladder.dtype_names import dtype_name

PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
"""The types whose attributes describe the tensor's own memory (no subclass, no DTensor)."""

_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NBYTES = operator.attrgetter("nbytes")
_IS_LEAF = operator.attrgetter("is_leaf")
_ITEMSIZE = operator.attrgetter("itemsize")
_IS_CPU = operator.attrgetter("is_cpu")
_CPU = torch.device("cpu")
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous

_CHUNK = 512
"""Params read at a time, each attribute by one C-level ``map``: their memory stays in
the CPU's caches from one attribute to the next (a ``map`` per attribute over 20,000
params measured 1.8x slower than over chunks; one Python loop reading all attributes
of each param, 1.15x slower over 2,000 params)."""

_SLICED = ("dtypes", "requires_grad", "nbytes", "data_ptrs")
"""Per-param columns a group's :class:`ParamColumns` takes from its whole's, sliced."""


def dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill ``tensor.numel()`` consecutive elements of its
    storage from its first one, each once, in some order of its dims: contiguous, or a
    permutation of contiguous (a transposed param, a ``channels_last`` conv weight).

    The rule torch calls non-overlapping and dense: taken by increasing stride, the dims
    of size above 1 have strides 1, then the product of the sizes before (so no stride is
    0 over more than one element and no two elements share memory). An empty tensor is
    not dense here (it covers no memory).
    """
    if tensor.is_contiguous():
        return tensor.numel() > 0
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=operator.itemgetter(1)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return tensor.numel() > 0


def plain_types(tensors: Iterable[object]) -> bool:
    """Whether every object is exactly a ``torch.Tensor`` or an ``nn.Parameter`` (one pass
    over the types, in C): the fast test before reading attributes in bulk."""
    return set(map(type, tensors)) <= PLAIN_TYPES


class ParamColumns:
    """The params of param groups, flat in group order, and what the checks of
    construction read of them, each attribute read once.

    The params are read when their types are plain; the columns are meaningful only
    when :attr:`plain`, and a caller checks param by param otherwise.

    Args:
        groups: param groups whose ``"params"`` are lists of tensors (already
            normalized, e.g. by :func:`optladder.policies.normalize_param_groups`).
        typed: the caller has found every param to be a plain ``torch.Tensor`` or
            ``nn.Parameter`` (:func:`plain_types`), so their types are not read again.

    Attributes:
        params: every group's params, flat, in group order (a param listed twice appears
            twice).
        starts: where each group's params begin in :attr:`params`, plus the end.
        plain: whether every param is a plain ``torch.Tensor`` or ``nn.Parameter``, off
            the meta device, with a data pointer (sparse and mkldnn tensors have none);
            an empty list is plain.
        dtype_set: the distinct dtypes.
        dtypes: each param's dtype (a property: read again only when they differ).
        requires_grad: each param's ``requires_grad``.
        nbytes: each param's bytes (``numel() * itemsize``).
        numels: each param's element count (a property, from :attr:`nbytes`).
        data_ptrs: each param's first element's address.
        devices: the distinct devices (params all on the CPU are seen as such with one
            pass of ``is_cpu``, no device object made per param).
        leaves: whether every param is a leaf or retains its grad (torch.optim's rule).
        contiguous: whether every param is contiguous.
        dense: whether every param is :func:`dense` (contiguous, or a permutation of
            contiguous), so that it covers exactly its element count's bytes from its
            first element's address. (A group's columns, :meth:`group`, keep these three
            flags of all groups: a False there may come from another group's params.)
    """

    def __init__(self, groups: Iterable[Mapping[str, Any]], *, typed: bool = False) -> None:
        lists = [g["params"] for g in groups]
        self.params: list[torch.Tensor] = list(chain.from_iterable(lists))
        self.starts: list[int] = [0, *accumulate(map(len, lists))]
        self.dtype_set: set[torch.dtype] = set()
        self.requires_grad: list[bool] = []
        self.nbytes: list[int] = []
        self.data_ptrs: list[int] = []
        self.devices: set[torch.device] = set()
        self.leaves = True
        self.contiguous = True
        self.dense = True
        self.plain = (typed or plain_types(self.params)) and self._read()

    def _read(self) -> bool:
        """Read the columns of plain-typed params; False for a param on meta or without
        a data pointer (then the columns are not used)."""
        params = self.params
        ptrs: list[int] = []
        nbytes: list[int] = []
        grads: list[bool] = []
        dtypes: set[torch.dtype] = set()
        devices: set[torch.device] = set()
        contiguous = leaves = True
        try:  # sparse and mkldnn tensors have no data pointer
            for start in range(0, len(params), _CHUNK):
                part = params[start : start + _CHUNK]
                ptrs += map(_DATA_PTR, part)
                nbytes += map(_NBYTES, part)
                dtypes.update(map(_DTYPE, part))
                grads += map(_REQUIRES_GRAD, part)
                if all(map(_IS_CPU, part)):  # no device object made per param
                    devices.add(_CPU)
                else:
                    devices.update(map(_DEVICE, part))
                contiguous = contiguous and all(map(_IS_CONTIGUOUS, part))
                leaves = leaves and all(map(_IS_LEAF, part))
        except RuntimeError:
            return False
        self.data_ptrs, self.nbytes, self.requires_grad = ptrs, nbytes, grads
        self.dtype_set, self.devices, self.contiguous = dtypes, devices, contiguous
        self.dense = contiguous or all(
            p.is_contiguous() or dense(p) for p in params
        )  # a transposed or channels_last param keeps the bulk checks
        self.leaves = leaves or all(p.is_leaf or p.retains_grad for p in params)
        return not any(d.type == "meta" for d in devices)

    @cached_property
    def dtypes(self) -> list[torch.dtype]:
        """Each param's dtype (read again only when they differ)."""
        if not self.dtype_set:  # no params, or not read
            return []
        if len(self.dtype_set) == 1:
            return [next(iter(self.dtype_set))] * len(self.params)
        return list(map(_DTYPE, self.params))

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> ParamColumns:
        """The columns of one list of params (one group)."""
        return cls([{"params": params}])

    def group(self, gi: int) -> ParamColumns:
        """The columns of group ``gi`` alone (its slice of the columns, not read again)."""
        start, stop = self.starts[gi], self.starts[gi + 1]
        if start == 0 and stop == len(self.params):
            return self
        if not self.plain:
            return ParamColumns.of(self.params[start:stop])
        sub = ParamColumns.of([])
        sub.params = self.params[start:stop]
        sub.starts = [0, stop - start]
        for name in _SLICED:
            setattr(sub, name, getattr(self, name)[start:stop])
        sub.dtype_set = set(sub.dtypes)
        one = len(self.devices) == 1 and stop > start
        sub.devices = set(self.devices) if one else set(map(_DEVICE, sub.params))
        sub.leaves, sub.contiguous, sub.dense = self.leaves, self.contiguous, self.dense
        return sub

    @cached_property
    def dtype_names(self) -> set[str]:
        """The distinct dtypes' names, e.g. ``{"float32", "bfloat16"}``."""
        return set(map(dtype_name, self.dtype_set))

    @cached_property
    def numels(self) -> list[int]:
        """Each param's element count (its bytes over its dtype's itemsize)."""
        if len(self.dtype_set) == 1:
            sizes: Iterable[int] = repeat(next(iter(self.dtype_set)).itemsize)
        else:
            sizes = map(_ITEMSIZE, self.dtypes)
        return list(map(operator.floordiv, self.nbytes, sizes))

    @cached_property
    def size_counts(self) -> Counter[int]:
        """How many params have each byte size (:attr:`nbytes`)."""
        nbytes = self.nbytes
        if nbytes and nbytes.count(nbytes[0]) == len(nbytes):  # one size (a C-level scan)
            return Counter({nbytes[0]: len(nbytes)})
        return Counter(nbytes)

    @cached_property
    def disjoint(self) -> bool:
        """Whether the params are :func:`dense`, non-empty, on one device, and cover
        disjoint byte ranges (so no param is listed twice and no two share an element),
        found in O(n log n). False means "compare pairs", not that two overlap. Plain
        params only.

        Non-empty ranges ``[start, end)`` are pairwise disjoint exactly when, with the
        starts and the ends each sorted on their own, the ``i``-th end is at most the
        ``i+1``-th start for every ``i``. If so, for a byte ``x`` at or above ``k``
        starts, the first ``k - 1`` ends are at most the ``k``-th start, so at or below
        ``x``; a range that ends at or below ``x`` starts below it, so of the ``k`` ranges
        that start at or below ``x`` at least ``k - 1`` end at or below it, and at most
        one holds ``x``. Conversely, disjoint ranges sorted by start are sorted by end too, each
        ending at or before the next one starts. So two sorts of plain integers (nearly
        in order already when params were allocated one after another), not a sort of
        positions by a key.
        """
        if not (self.plain and self.dense and len(self.devices) <= 1):
            return False
        nbytes = self.nbytes
        if not all(nbytes):
            return False
        n = len(self.params)
        if n < 2:
            return True
        starts = self.data_ptrs
        ends = map(operator.add, islice(starts, n - 1), nbytes)
        if all(map(operator.le, ends, islice(starts, 1, None))):
            return True  # in increasing order already
        first = sorted(starts)
        if len(self.size_counts) == 1:  # one size: the sorted ends are the sorted starts + it
            end: Iterable[int] = map(operator.add, first, repeat(nbytes[0]))
        else:
            end = sorted(map(operator.add, starts, nbytes))
        return all(map(operator.le, islice(end, n - 1), islice(first, 1, None)))
