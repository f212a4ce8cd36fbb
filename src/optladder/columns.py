"""Attributes of many params read in bulk, each once, for the checks of construction.

Construction asks several things of every param: the duplicates and overlap check, the
footprint, each rung's dtype rules, the device whose memory gates the choice. Over tens
of thousands of small tensors a pass per check and per attribute costs several times
torch's whole optimizer construction. A :class:`ParamColumns` reads each attribute it
needs of every param once, in one pass over the params (all of a param's attributes
back to back, while its metadata is in the CPU's caches), and the checks read the
columns.

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
from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate, chain, islice, repeat
from typing import Any, Generic, TypeVar, cast, overload

import torch

from optladder.dtype_names import dtype_name

_T = TypeVar("_T")


class _cached(Generic[_T]):
    """``functools.cached_property`` without its lock (as Python 3.12 has it): computed
    on first access, then an entry of the instance's ``__dict__`` (a non-data
    descriptor, so the entry wins and may be set). Python 3.11's acquires an ``RLock``
    on every first access: measured ~20 us more each, after a garbage collection, than
    this one, and construction reads three or four of them."""

    def __init__(self, func: Callable[[Any], _T]) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> _cached[_T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...

    def __get__(self, instance: object, owner: type | None = None) -> _T | _cached[_T]:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.func(instance)
        return value


PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
"""The types whose attributes describe the tensor's own memory (no subclass, no DTensor)."""

_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_ITEMSIZE = operator.attrgetter("itemsize")
_CPU = torch.device("cpu")

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
        a data pointer (then the columns are not used).

        One pass over the params, every attribute of a param read back to back (while
        its ``TensorImpl``, storage and autograd metadata are in the caches: over 2,000
        params of 4,096 elements, one pass measured 1.15-1.3x faster than one C-level
        ``map`` per attribute over chunks of 512 params, whose later passes find those
        objects evicted by the 16 KiB of data between them). Booleans are kept as flags
        and dtypes and devices as sets, with no list per param.
        """
        params = self.params
        ptrs: list[int] = []
        nbytes: list[int] = []
        grads: list[bool] = []
        ptr_of, nbytes_of, grad_of = ptrs.append, nbytes.append, grads.append
        first = params[0].dtype if params else None
        others: set[torch.dtype] = set()
        on_cpu = contiguous = leaves = True
        try:  # sparse and mkldnn tensors have no data pointer
            for p in params:
                ptr_of(p.data_ptr())
                nbytes_of(p.nbytes)
                grad_of(p.requires_grad)
                if p.dtype is not first:
                    others.add(p.dtype)
                if not p.is_cpu:
                    on_cpu = False
                if not p.is_contiguous():
                    contiguous = False
                if not p.is_leaf:
                    leaves = False
        except RuntimeError:
            return False
        dtypes = others
        if params:
            dtypes.add(cast(torch.dtype, first))
        if not params:
            devices: set[torch.device] = set()
        else:  # params all on the CPU: no device object made per param
            devices = {_CPU} if on_cpu else set(map(_DEVICE, params))
        self.data_ptrs, self.nbytes, self.requires_grad = ptrs, nbytes, grads
        self.dtype_set, self.devices, self.contiguous = dtypes, devices, contiguous
        self.dense = contiguous or all(
            p.is_contiguous() or dense(p) for p in params
        )  # a transposed or channels_last param keeps the bulk checks
        self.leaves = leaves or all(p.is_leaf or p.retains_grad for p in params)
        return not any(d.type == "meta" for d in devices)

    @_cached
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

    @_cached
    def dtype_names(self) -> set[str]:
        """The distinct dtypes' names, e.g. ``{"float32", "bfloat16"}``."""
        return set(map(dtype_name, self.dtype_set))

    @_cached
    def numels(self) -> list[int]:
        """Each param's element count (its bytes over its dtype's itemsize)."""
        if len(self.dtype_set) == 1:
            sizes: Iterable[int] = repeat(next(iter(self.dtype_set)).itemsize)
        else:
            sizes = map(_ITEMSIZE, self.dtypes)
        return list(map(operator.floordiv, self.nbytes, sizes))

    @_cached
    def size_counts(self) -> dict[int, int]:
        """How many params have each byte size (:attr:`nbytes`)."""
        nbytes = self.nbytes
        if nbytes and nbytes.count(nbytes[0]) == len(nbytes):  # one size (a C-level scan)
            return {nbytes[0]: len(nbytes)}
        return Counter(nbytes)

    @_cached
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
