"""Test tools that watch allocations through torch's dispatcher.

Only allocations the dispatcher sees count: an op whose result is a fresh tensor (its
schema's return has no alias annotation). A kernel that allocates internally (a fused
op, a custom op, a ctypes call) is one opaque op here.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _fresh_results(func: Any) -> bool:
    return any(r.alias_info is None and "Tensor" in str(r.type) for r in func._schema.returns)


class FailNthAllocation(TorchDispatchMode):
    """Raise ``torch.OutOfMemoryError`` instead of the ``n``-th allocating op (1-based);
    with ``n=None`` only count them."""

    def __init__(self, n: int | None = None) -> None:
        super().__init__()
        self.n = n
        self.count = 0
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _fresh_results(func):
            self.count += 1
            if self.n is not None and self.count == self.n:
                raise torch.OutOfMemoryError(f"injected: allocation {self.n} ({func})")
        out = func(*args, **(kwargs or {}))
        if _fresh_results(func):
            self.made += [
                weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
            ]
        return out


class FailNthOp(TorchDispatchMode):
    """Raise ``torch.OutOfMemoryError`` instead of running the ``n``-th dispatched op
    (1-based), whatever the op (allocating or in place, a factory, a fused kernel, a
    custom op); with ``n=None`` only count them. ``ops`` lists every op seen, by name.

    Ops the dispatcher never sees (a ctypes kernel call) cannot be failed here.
    """

    def __init__(self, n: int | None = None) -> None:
        super().__init__()
        self.n = n
        self.count = 0
        self.ops: list[str] = []

    @property
    def reached(self) -> bool:
        """Whether the ``n``-th op was dispatched (and failed)."""
        return self.n is not None and self.count >= self.n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        self.ops.append(str(func))
        if self.count == self.n:
            raise torch.OutOfMemoryError(f"injected: op {self.n} ({func})")
        return func(*args, **(kwargs or {}))


class LiveBytes(TorchDispatchMode):
    """Track the bytes of tensors created while active, minus the bytes freed (of those and
    of tensors passed to :meth:`watch`), and the peak of that balance.

    A storage is counted once (by data pointer); it is freed when the tensor that made it
    dies, which holds for the state tensors a migration creates and drops.
    """

    def __init__(self) -> None:
        super().__init__()
        self.balance = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _add(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._seen or ptr == 0:
            return
        self._seen.add(ptr)
        nbytes = t.untyped_storage().nbytes()
        self.balance += nbytes
        self.peak = max(self.peak, self.balance)
        weakref.finalize(t, self._free, ptr, nbytes)

    def _free(self, ptr: int, nbytes: int) -> None:
        self._seen.discard(ptr)
        self.balance -= nbytes

    def watch(self, tensors: list[torch.Tensor]) -> None:
        """Count these existing tensors' frees (their allocation happened before)."""
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in self._seen:
                continue
            self._seen.add(ptr)
            weakref.finalize(t, self._free, ptr, t.untyped_storage().nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if _fresh_results(func):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._add(t)
        return out
