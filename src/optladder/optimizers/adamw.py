"""optladder's own AdamW: moments stored in bfloat16 (the bf16 rung) or float32.

The eager implementation here is the reference ("oracle") for the bf16 rung: it defines
the update and the exact random bits of the stochastic rounding that every faster backend
must reproduce. It also serves the fp32 rung for bf16/fp16 params, where torch's own
AdamW would keep the moments in the param dtype.

Update rule: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019),
written as torch's ``_single_tensor_adam`` writes it (``lerp`` for the first moment,
``addcmul`` for the second, bias corrections folded into step size and denominator), with
all math in float32 whatever the storage dtypes.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Mapping
from itertools import chain, compress, repeat
from typing import Any, Literal, cast

import torch
from torch.optim.optimizer import ParamsT

from optladder.columns import PLAIN_TYPES
from optladder.compilation import run_eagerly
from optladder.dtype_names import dtype_name
from optladder.optimizers import dispatch, torchroute
from optladder.optimizers.eager import step_scalars
from optladder.optimizers.rounding import (
    Rounding,
    check_param_rounding,
    check_rounding,
    check_seed,
    element_key,
    round_moments,
    round_param,
    step_key,
)
from optladder.optimizers.stepmemo import (
    KeptGrads,
    StepMemo,
    grad_kinds,
    grad_of,
    same_grads,
    same_objects,
)
from optladder.optimizers.steps import (
    BF16_MAX_STEP,
    STEP_DTYPE,
    refuse_shared_steps,
)
from optladder.rungs import FLOAT32_MATH_DTYPES, LADDER_DTYPES, RUNG_KEY

_MOMENT_DTYPES = (torch.bfloat16, torch.float32)


def group_moment_dtype(group: Mapping[str, Any], default: torch.dtype) -> torch.dtype:
    """The moments' dtype of a param group's state format: its ``"rung"`` key
    (:data:`optladder.rungs.RUNG_KEY`) ``"fp32"`` -> ``torch.float32``, ``"bf16"`` ->
    ``torch.bfloat16``; ``default`` (the engine's ``moment_dtype``) for a group without
    the key or with another rung (whose state another engine keeps)."""
    rung = group.get(RUNG_KEY)
    if rung == "fp32":
        return torch.float32
    if rung == "bf16":
        return torch.bfloat16
    return default


Backend = Literal["auto", "eager", "cpu", "triton"]
"""Which code steps the bf16 rung: ``"auto"`` picks the fused kernel of each param's device
(the C kernel on CPU, Triton on CUDA) and steps the rest eagerly, recording why;
``"eager"`` always runs the reference loop; ``"cpu"`` and ``"triton"`` insist on that
kernel and raise for a param it cannot step."""
_BACKENDS = ("auto", "eager", "cpu", "triton")


def _real(value: object) -> float | None:
    """``value`` as a finite float if it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def validate_hyperparams(
    lr: float | torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """Check AdamW hyperparameters the way ``torch.optim.AdamW`` does.

    Real numbers of any type are accepted (Python, NumPy); bools, NaN and infinities are
    not.

    Args:
        lr: learning rate, ``>= 0`` (a number or a one-element tensor).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: term added to the denominator, ``>= 0``.
        weight_decay: decay coefficient, ``>= 0``.

    Raises:
        ValueError: naming the argument, its value and the allowed range.
    """
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.is_complex():
            raise ValueError(
                f"lr as a tensor must have one real element, got shape {tuple(lr.shape)}"
            )
        if lr.device.type == "meta":
            raise ValueError(
                "lr is a tensor on the meta device, which holds no value; pass a number or "
                "a one-element tensor on the CPU or the params' device"
            )
        lr_value = _real(float(lr.item()))
    else:
        lr_value = _real(lr)
    if lr_value is None or lr_value < 0.0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        value = _real(b)
        if value is None or not 0.0 <= value < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}{_tensor_hint(b)}")
    eps_value = _real(eps)
    if eps_value is None or eps_value < 0.0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}{_tensor_hint(eps)}")
    wd_value = _real(weight_decay)
    if wd_value is None or wd_value < 0.0:
        raise ValueError(
            f"weight_decay must be a finite number >= 0, got {weight_decay!r}"
            f"{_tensor_hint(weight_decay)}"
        )


def _tensor_hint(value: object) -> str:
    """What to pass instead of a tensor where only ``lr`` may be one (torch's AdamW takes
    tensor betas too; optladder's kernels take them as numbers)."""
    if isinstance(value, torch.Tensor):
        return " (a tensor: only lr may be one; pass a Python number, e.g. float(value))"
    return ""


UNSUPPORTED_GROUP_FLAGS = ("amsgrad", "maximize", "differentiable")
"""torch AdamW options no rung keeps: a group may hold them only as False."""

FOREIGN_GROUP_KEYS: dict[str, str] = {
    "momentum_decay": "torch.optim.NAdam",
    "lr_decay": "torch.optim.Adagrad",
    "initial_accumulator_value": "torch.optim.Adagrad",
    "rho": "torch.optim.Adadelta",
    "etas": "torch.optim.Rprop",
    "step_sizes": "torch.optim.Rprop",
    "lambd": "torch.optim.ASGD",
    "t0": "torch.optim.ASGD",
    "nesterov": "torch.optim.SGD",
    "dampening": "torch.optim.SGD",
    "centered": "torch.optim.RMSprop",
    "beta2_decay": "torch.optim.Adafactor",
}
"""Param-group keys that only other optimizers write (torch 2.13's group defaults), and
which optimizer: a checkpoint with them holds another update rule, and a group given
with one would have it ignored (refused where a group comes in)."""


def foreign_group_key(group: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first key of ``group`` in :data:`FOREIGN_GROUP_KEYS` and the optimizer that
    writes it, or None."""
    for key, owner in FOREIGN_GROUP_KEYS.items():
        if key in group:
            return key, owner
    return None


_GROUP_FLAG_INSTEAD = {
    "amsgrad": "no rung keeps max_exp_avg_sq; use torch.optim.AdamW(amsgrad=True) for it",
    "maximize": "negate the objective instead: loss = -objective gives the same update",
    "differentiable": "optladder's kernels step params in place without autograd",
}


def validate_group_hyperparams(group: Mapping[str, Any]) -> None:
    """:func:`validate_hyperparams` on the values a param group sets, and its options:
    ``seed``, ``rounding`` and ``param_rounding`` (exactly ``"stochastic"`` or
    ``"nearest"``) where set, :data:`UNSUPPORTED_GROUP_FLAGS` only False, and no key of
    :data:`FOREIGN_GROUP_KEYS` (another optimizer's option). A key the group leaves out
    takes the optimizer's default, which is checked where it is given.

    Called wherever a group's values can come in: construction, ``add_param_group``,
    checkpoint loads, and before every step (a group dict edited by hand).

    Raises:
        ValueError: naming the hyperparameter or option, its value and what is allowed.
    """
    validate_hyperparams(
        group.get("lr", 0.0),
        group.get("betas", (0.0, 0.0)),
        group.get("eps", 0.0),
        group.get("weight_decay", 0.0),
    )
    if (foreign := foreign_group_key(group)) is not None:
        key, owner = foreign
        raise ValueError(
            f"{key}={group[key]!r} is an option of {owner}, which AdamW has not: it would "
            "be ignored, and this optimizer's checkpoints refused as another "
            "optimizer's; remove it from the group"
        )
    for flag in UNSUPPORTED_GROUP_FLAGS:
        if group.get(flag):
            raise ValueError(
                f"{flag}={group[flag]!r} is not supported by optladder's rungs: set {flag}="
                f"False or leave it out ({_GROUP_FLAG_INSTEAD[flag]})"
            )
    if "seed" in group:
        check_seed(group["seed"])
    if "rounding" in group:
        check_rounding(group["rounding"])
    if "param_rounding" in group:
        check_param_rounding(group["param_rounding"])


def unscale_grads_(grads: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """Divide ``grads`` by ``torch.amp.GradScaler``'s scale, in place (allocates nothing).

    Each tensor of ``grads`` is divided once, so ``grads`` must not share memory: pass
    :func:`distinct_grads` of the params' grads when they may."""
    if grads:
        torch._foreach_mul_(grads, 1.0 / float(grad_scale.item()))


_ID = id
_GET_DEVICE = torch.Tensor.get_device
_NUMEL = torch.Tensor.numel
_PTR = operator.itemgetter(1)
_END = operator.itemgetter(2)
_MATERIALIZE_LIMIT = 2**22
"""Elements up to which two grads of unlike layouts are compared address by address."""


def _byte_span(g: torch.Tensor) -> int:
    """Bytes from ``g``'s first element to past its last (strides are not negative)."""
    last = sum((n - 1) * s for n, s in zip(g.shape, g.stride()))
    return (last + 1) * g.element_size()


def _canonical(g: torch.Tensor) -> tuple[list[int], list[int]]:
    """``g``'s element set as ``(sizes, strides)``, strides descending: dims of one
    element or stride 0 left out (they add no element), dims that continue each other
    merged (``g`` and ``g.view(...)``, ``g.t()`` give the same)."""
    dims = sorted(((s, n) for n, s in zip(g.shape, g.stride()) if n > 1 and s > 0), reverse=True)
    sizes: list[int] = []
    strides: list[int] = []
    for s, n in dims:
        if strides and strides[-1] == n * s:
            sizes[-1] *= n
            strides[-1] = s
        else:
            sizes.append(n)
            strides.append(s)
    return sizes, strides


def _offsets_meet(
    d: int, sizes_a: list[int], sizes_b: list[int], strides: list[int]
) -> bool | None:
    """Whether ``d == sum(c_k * strides[k])`` for some ``-sizes_b[k] < c_k < sizes_a[k]``:
    whether two views of one layout, the second ``d`` elements past the first, share an
    element. None when too many cases to try (a layout whose dims interleave)."""
    budget = [10_000]

    def meet(d: int, k: int) -> bool | None:
        budget[0] -= 1
        if budget[0] < 0:
            return None
        if k == len(strides):
            return d == 0
        rest_hi = sum((n - 1) * s for n, s in zip(sizes_a[k + 1 :], strides[k + 1 :]))
        rest_lo = -sum((n - 1) * s for n, s in zip(sizes_b[k + 1 :], strides[k + 1 :]))
        s = strides[k]
        lo = max(-sizes_b[k] + 1, -((rest_hi - d) // s))  # c * s >= d - rest_hi
        hi = min(sizes_a[k] - 1, (d - rest_lo) // s)  # c * s <= d - rest_lo
        unknown = False
        for c in range(lo, hi + 1):
            found = meet(d - c * s, k + 1)
            if found:
                return True
            unknown = unknown or found is None
        return None if unknown else False

    return meet(d, 0)


def _addresses(g: torch.Tensor) -> torch.Tensor:
    """The byte address of every element of ``g`` (int64, flat)."""
    index = torch.zeros((), dtype=torch.int64)
    for n, s in zip(g.shape, g.stride()):
        index = index.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    return g.data_ptr() + index.flatten() * g.element_size()


def _relation(a: torch.Tensor, b: torch.Tensor) -> str:
    """How the elements of grads ``a`` and ``b`` (whose byte ranges meet) relate:
    ``"same"``, ``"disjoint"`` or ``"partial"`` (some shared, or cannot tell)."""
    if a.dtype != b.dtype:
        return "partial"
    d, rem = divmod(b.data_ptr() - a.data_ptr(), a.element_size())
    if rem:
        return "partial"
    (sizes_a, strides_a), (sizes_b, strides_b) = _canonical(a), _canonical(b)
    if strides_a == strides_b and len(sizes_a) == len(sizes_b):
        meet = _offsets_meet(d, sizes_a, sizes_b, strides_a)
        if meet is False:
            return "disjoint"
        if meet and d == 0 and sizes_a == sizes_b:
            return "same"
        if meet is not None:
            return "partial"
    if max(a.numel(), b.numel()) > _MATERIALIZE_LIMIT:
        return "partial"
    x, y = _addresses(a).unique(), _addresses(b).unique()
    shared = int(torch.isin(y, x).sum())
    if shared == 0:
        return "disjoint"
    return "same" if shared == x.numel() == y.numel() else "partial"


def distinct_grads(
    grads: list[torch.Tensor], name: Callable[[int], str] | None = None
) -> list[torch.Tensor]:
    """The tensors to unscale so that each element of the grads' memory is divided by
    the scale exactly once, when params share a grad tensor (``p1.grad = p2.grad = g``,
    set by hand) or grads are views of one storage (a flat grad buffer).

    One tensor per distinct memory: the same tensor object, or views of the very same
    elements (``g`` and ``g.view(...)``), count once; views of disjoint elements of one
    buffer (slices, column slices) are each kept. What torch does differs:
    ``torch.amp.GradScaler.unscale_`` and torch's fused AdamW with ``grad_scale``
    divide a shared grad once per param that holds it (the fused kernel writes the
    unscaled grad back, so the next param reads it divided again); each param here
    steps with ``grad / scale``, as ``torch.optim.AdamW`` on grads unscaled beforehand,
    and the grad holds ``grad / scale`` after the step, as torch's fused kernel leaves
    an unshared grad.

    The common case (no two grads' byte ranges meet) is found with one sort of the
    grads' addresses. Grads whose ranges meet are compared by layout; two of unlike
    layouts (not one the other's view or offset copy) by their element addresses,
    allocated here (so call this before anything is written), up to 2**22 elements
    each (``_MATERIALIZE_LIMIT``).

    Args:
        grads: the grads of the params that have one, in order.
        name: ``i -> "param ... of group ..."`` for ``grads[i]``, for the error.

    Returns:
        The grads to divide, in order of first appearance (empty grads left out).

    Raises:
        ValueError: if two grads share some elements but not all (or the same bytes
            as other dtypes, or layouts too large to compare): no set of tensors
            divides each element once; the message names both and says what to do.
    """
    unique = list({_ID(g): g for g in grads}.values())
    if not all(map(_NUMEL, unique)):
        unique = [g for g in unique if g.numel()]
    if not unique:
        return unique
    ptrs = list(map(_DATA_PTR, unique))
    devices = list(map(_GET_DEVICE, unique))
    if all(map(torch.Tensor.is_contiguous, unique)):
        sizes = map(operator.mul, map(_NUMEL, unique), map(torch.Tensor.element_size, unique))
        ends = list(map(operator.add, ptrs, sizes))
    else:
        ends = [p + _byte_span(g) for p, g in zip(ptrs, unique)]
    spans = sorted(zip(devices, ptrs, ends))  # the common case, in C: no ranges meet
    if all(map(operator.le, map(_END, spans), map(_PTR, spans[1:]))):
        return unique  # (a device's first range after another's last: swept below)
    order = sorted(range(len(unique)), key=lambda i: (devices[i], ptrs[i]))
    clusters: list[list[int]] = []
    reach, device = 0, None
    for i in order:
        if clusters and devices[i] == device and ptrs[i] < reach:
            clusters[-1].append(i)
            reach = max(reach, ends[i])
        else:
            clusters.append([i])
            reach, device = ends[i], devices[i]
    if len(clusters) == len(unique):
        return unique  # no two byte ranges meet: the common case
    drop: set[int] = set()
    where = name or (lambda i: f"grad {i}")
    first = {_ID(g): i for i, g in reversed(list(enumerate(grads)))}
    for cluster in clusters:
        cluster.sort()  # in order of first appearance: the first of equal views is kept
        for k, i in enumerate(cluster):
            for j in cluster[k + 1 :]:
                if i in drop or j in drop:
                    continue
                relation = _relation(unique[i], unique[j])
                if relation == "same":
                    drop.add(j)  # the same elements: divided once, through grad i
                elif relation == "partial":
                    gi, gj = first[_ID(unique[i])], first[_ID(unique[j])]
                    raise ValueError(
                        f"the grads of {where(gi)} and {where(gj)} share some of their "
                        "memory but not all (or cannot be told apart), so no unscaling "
                        "divides each element by grad_scale once; give each param a grad "
                        "of its own (or views of disjoint parts of one buffer), or unscale "
                        "the grads yourself and leave grad_scale unset"
                    )
    return [g for i, g in enumerate(unique) if i not in drop]


_STATE_TENSORS = operator.itemgetter("exp_avg", "exp_avg_sq", "step")
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")


class _GroupPlan:
    """How one param group of a :class:`LadderAdamW` steps, kept between steps while
    what it was made from stays the same (see :meth:`check`).

    Attributes:
        group: the group dict.
        params: its params then (identity).
        start: the index of its first param over all groups.
        routes: entry of the dispatch table (:mod:`~optladder.optimizers.dispatch`) ->
            ``(param, index)`` of the params it steps (``"cpu"``: rows of the C kernel's
            table; ``"staged"``: the C kernel on contiguous copies of a param and its
            grad that are not contiguous; ``"eager"``; ``"triton"``;
            ``"torch_fused"``/``"torch_foreach"``: torch's kernels, for the fp32 format's
            float32, float64 and complex params, :mod:`~optladder.optimizers.torchroute`).
        reasons: index -> why that param is not on a fused kernel (the table's).
        states: the state dicts of the C kernel's params, in table order.
        table: the C kernel's table these params are rows of (one table for all groups,
            :meth:`LadderAdamW.prepare_step`), or None before it is made.
        first: the table row of its first C kernel param.
        table_group: its group number in that table (whose options step its rows).
        moment_dtype: its state format's moment dtype then (:func:`group_moment_dtype`).
        torch_buckets: the ``"torch_fused"`` params by (device, dtype), one kernel call
            each; ``torch_calls``: those calls for this step (:meth:`make_torch_calls`).
    """

    def __init__(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        start: int,
        routes: dict[str, list[tuple[torch.Tensor, int]]],
        reasons: dict[int, str],
        states: list[dict[str, Any]],
        carried: dict[int, tuple[Any, ...]] | None = None,
        moment_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.group = group
        self.moment_dtype = moment_dtype
        self.params = list(params)
        self.start = start
        self.routes = routes
        self.reasons = reasons
        self.states = states
        self.table: Any = None
        self.first = 0
        self.table_group = 0
        self._kinds = grad_kinds(grads)
        self._positions = [i - start for _, i in routes["cpu"]]
        # what a step may change without a new plan: which of the C kernel's params have
        # a grad (a row without one is skipped), not the kinds of those that have one
        carried = carried or {}
        self._row_kinds = [
            carried[k] if k in carried else _kind(cast(torch.Tensor, grads[k]))
            for k in self._positions
        ]
        self._others = [
            i - start for name in ("eager", "staged", "triton") for _, i in routes[name]
        ]
        # torch's kernels' params: like the C kernel's rows, one without a grad at a
        # step is left out of that step's calls (the plan is kept)
        self._torch_positions = [
            i - start for name in ("torch_fused", "torch_foreach") for _, i in routes[name]
        ]
        self._torch_kinds = [
            None if grads[k] is None else _kind(cast(torch.Tensor, grads[k]))
            for k in self._torch_positions
        ]
        buckets: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, int]]] = {}
        for p, i in routes["torch_fused"]:
            buckets.setdefault((p.device, p.dtype), []).append((p, i))
        self.torch_buckets = list(buckets.values())
        self.torch_calls: list[Any] = []  # this step's calls
        # the group's options the calls were made with, and whether they are numbers
        # (the direct kernel call takes them; :meth:`reuse_torch_calls`)
        self.torch_options: tuple[Any, ...] = ()
        self.torch_numbers = False
        self._torch_cache: list[Any] | None = None  # per bucket: items, params, states
        self._picks: list[bool] = []  # which torch fused params have a grad this step
        self._bucket_calls: list[Any] = [None] * len(self.torch_buckets)  # their containers
        self._planned = set(self._positions).union(self._others, self._torch_positions)
        self._torch_items = routes["torch_fused"] + routes["torch_foreach"]
        self.torch_params = [p for p, _ in self._torch_items]
        # the torch routes' grads, their addresses (None: not read) and state tensors at
        # the last step (:meth:`ready_torch`)
        self._torch_grads = KeptGrads()  # weak references, with their addresses
        self._torch_state: list[Any] = []
        self._other_kinds = [
            None if grads[k] is None else _kind(cast(torch.Tensor, grads[k])) for k in self._others
        ]
        self.cpu_params = [p for p, _ in routes["cpu"]]
        # the grads whose pointers the table holds (it compares their addresses itself);
        # without C kernel rows, the grads the kinds were last checked for (at their
        # addresses: a grad given other memory is checked again)
        self._grads = KeptGrads(addresses=not routes["cpu"])
        self._grad_ptrs: list[int] = []
        # whether some params step off the C kernel's table (their step tensors are read
        # afresh at every step, so checked at every step)
        self.untracked_steps = bool(routes["eager"] or routes["staged"] or routes["triton"])
        # whether every param it steps is on torch's kernels (:class:`_SteadyPlans`)
        self.torch_only = not (self.untracked_steps or routes["cpu"])
        # this step's staged params: (param, index, one-row table, param and grad copies)
        self.staged: list[tuple[torch.Tensor, int, Any, torch.Tensor, torch.Tensor]] = []

    def grads_written(self, grads: list[torch.Tensor | None]) -> tuple[bool, list[int] | None]:
        """Whether the table already points at these grads (same tensors, same memory),
        and, when they are the same tensors, their pointers (else None)."""
        if not self._grads.same(grads):
            return False, None
        present = list(map(grads.__getitem__, self._positions))
        return (ptrs := _ptrs(present)) == self._grad_ptrs, ptrs

    def check(
        self, group: dict[str, Any], start: int, grads: list[torch.Tensor | None]
    ) -> tuple[bool, list[int] | None] | None:
        """Whether this plan still routes and points right: the same group dict, params
        and first index; grads of the same kinds (:func:`~.stepmemo.grad_kinds`, read
        only for grads that are not the ones the table holds). The caller checks the
        rest, for all groups at once: the state dicts are the same objects, and the C
        kernel's params and their state the same tensors in the same memory
        (:meth:`LadderAdamW._table_points_right`).

        Returns:
            None when the plan must be made again, else :meth:`grads_written` of
            ``grads`` (for :meth:`write_grads`).
        """
        if group is not self.group or start != self.start:
            return None
        if group_moment_dtype(group, self.moment_dtype) is not self.moment_dtype:
            return None  # its state format changed (its "rung" key flipped)
        if not same_objects(group["params"], self.params):
            return None
        written = self.grads_written(grads)
        if not written[0] and grad_kinds(grads) != self._kinds and not self._fits(grads):
            return None
        return written

    def plans_alike(
        self, group: dict[str, Any], params: list[torch.Tensor], moment_dtype: torch.dtype
    ) -> bool:
        """Whether a new plan of ``group`` over ``params`` in ``moment_dtype`` is of this
        plan's group dict, params (the same objects) and state format, so the rows and
        torch routes of this plan may be kept in it."""
        return (
            group is self.group
            and same_objects(params, self.params)
            and moment_dtype is self.moment_dtype
        )

    def rows_to_keep(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        state: Mapping[torch.Tensor, Any],
        moment_dtype: torch.dtype,
    ) -> dict[int, tuple[Any, ...]]:
        """The C kernel rows of this plan that a new plan of ``group`` keeps when their
        param has no grad: place in the group -> the kind of its grad then; only for the
        same group dict and params, CPU params the kernel steps (contiguous, a kernel
        dtype) whose state holds moments it can point at."""
        from optladder.optimizers.kernels import cpu

        if not self.plans_alike(group, params, moment_dtype):
            return {}
        kept = {}
        for k, kind in zip(self._positions, self._row_kinds):
            p = params[k]
            st = state.get(p)
            if not st or "step" not in st or cpu.param_unsupported_reason(p, p) is not None:
                continue
            if _kernel_moments(st, p, moment_dtype):
                kept[k] = kind
        return kept

    def torch_to_keep(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        state: Mapping[torch.Tensor, Any],
        moment_dtype: torch.dtype,
    ) -> dict[int, str]:
        """The params of torch's kernels in this plan that a new plan of ``group`` keeps
        when they have no grad: place in the group -> route; only for the same group
        dict, params and format, params that have their state."""
        if not self.plans_alike(group, params, moment_dtype):
            return {}
        kept = {}
        for name in ("torch_fused", "torch_foreach"):
            for p, i in self.routes[name]:
                if state.get(p):
                    kept[i - self.start] = name
        return kept

    def _fits(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether ``grads`` differ from the plan's only in C kernel params that have no
        grad now (their rows are skipped, :meth:`~.kernels.cpu.KernelTable.set_grads`):
        every param of the other routes has its grad, and every grad is a planned
        param's, of the kind it had (a step where some experts or heads got no grad,
        which made the whole table again); the other routes' grads of the kinds they
        had."""
        if any(grads[k] is None for k in self._others):
            return False
        if [_kind(cast(torch.Tensor, grads[k])) for k in self._others] != self._other_kinds:
            return False  # another route's grad of another kind: its checks run again
        present = [k for k, g in enumerate(grads) if g is not None]
        if not self._planned.issuperset(present):
            return False
        return all(
            grads[k] is None or _kind(cast(torch.Tensor, grads[k])) == kind
            for k, kind in chain(
                zip(self._positions, self._row_kinds),
                zip(self._torch_positions, self._torch_kinds),
            )
        )

    def write_grads(
        self, grads: list[torch.Tensor | None], written: tuple[bool, list[int] | None]
    ) -> None:
        """Point the C kernel's table at ``grads`` unless it already does (``written``:
        :meth:`grads_written` of ``grads``; the grads at the kernel's params' places
        must not be None: the grads' kinds are this plan's)."""
        if written[0]:
            return
        if self.table is None:
            if not self._positions:  # the kinds hold while these grads are kept
                self._grads.record(grads)
            return
        present = list(map(grads.__getitem__, self._positions))  # None: a skipped row
        ptrs = written[1] if written[1] is not None else _ptrs(present)
        self.table.set_grads(present, ptrs, self.first)
        self._grads.record(grads)
        self._grad_ptrs[:] = ptrs  # in place: a new list a step would outlive the step

    def ready_torch(self, state: Mapping[torch.Tensor, Any]) -> None:
        """Check the torch routes' state and grads where a kept plan would not see a
        change: make a param's state ready (:func:`~.torchroute.ready_state`, which
        refuses moments of another format) when a state tensor was replaced, and check a
        grad (:func:`~.dispatch.check_torch_grad`) that is the same tensor as at the last step
        but was given other memory (``grad.data = ...``; a new grad tensor is checked
        by :meth:`check`'s kinds). torch's kernels bump the step counts before they read
        the rest, so what they would refuse is refused here, before anything is written.

        Raises:
            ValueError: from those checks, before anything is written.
        """
        items = self._torch_items
        if not items:
            return
        sts = list(map(state.__getitem__, self.torch_params))
        grads = list(map(_GRAD, self.torch_params))
        kept = self._torch_grads
        # the same grad tensors over other memory (new ones: check()'s kinds)
        moved = not kept.same(grads) and same_grads(kept.refs, grads)
        tensors = [*map(_GET_AVG, sts), *map(_GET_AVG_SQ, sts), *map(_GET_STEP, sts)]
        replaced = not same_objects(tensors, self._torch_state)
        if moved or replaced:
            fused = len(self.routes["torch_fused"])
            for k, ((p, i), st, grad) in enumerate(zip(items, sts, grads)):
                if moved and grad is not None:
                    dispatch.check_torch_grad(p, grad, i)
                if replaced and st:  # a param that never had a grad has no state yet
                    torchroute.ready_state(p, st, k < fused, f"param {i}")
            tensors = [*map(_GET_AVG, sts), *map(_GET_AVG_SQ, sts), *map(_GET_STEP, sts)]
        kept.record(grads)
        self._torch_state[:] = tensors  # in place: a new list a step would outlive it

    def make_torch_calls(self, state: Mapping[torch.Tensor, Any]) -> None:
        """Make this step's torch fused kernel calls (:func:`~.fusedstep.group_call`, one
        per bucket, in the last step's containers), reading each param's grad and state
        tensors now, and allocating the contiguous copies of params that are not dense.

        Each bucket's params, state dicts (the same objects while the plan holds: a new
        state dict makes the plan again) and params that are not contiguous are read once
        per plan; at every step, the grads, and the strides of those params' grads (the
        rest's layouts are in the grads' kinds the plan was checked against).
        :meth:`torch_steps` then gives every step tensor and which have a grad.

        Raises:
            ValueError: a grad laid out unlike its param (:func:`~.dispatch.check_torch_grad`).
            Whatever allocating the copies raised (an OOM); nothing is written.
        """
        from optladder.optimizers.fusedstep import group_call, nondense_places, numbers_only

        if self._torch_cache is None:
            self._torch_cache = [
                (
                    [p for p, _ in bucket],
                    [state[p] for p, _ in bucket],
                    [(p, i) for p, i in bucket if not p.is_contiguous()],
                    nondense_places([p for p, _ in bucket]),
                )
                for bucket in self.torch_buckets
            ]
        calls = []
        kept = self._bucket_calls
        picks: list[bool] = []
        for k, (params, states, strided, nondense) in enumerate(self._torch_cache):
            grads = list(map(grad_of, params))
            absent = list(map(operator.is_, grads, repeat(None)))
            picks += map(operator.not_, absent)
            for p, i in strided:
                if p.grad is not None and p.grad.stride() != p.stride():
                    dispatch.check_torch_grad(p, p.grad, i)
            if any(absent):  # left out of this step
                params = list(compress(params, map(operator.not_, absent)))
                states = list(compress(states, map(operator.not_, absent)))
                grads = [g for g in grads if g is not None]
                if not params:
                    continue
                nondense = nondense_places(params)
            present = cast(list[torch.Tensor], grads)
            params = list(params)  # group_call puts the copies' buffers in this list
            kept[k] = group_call(self.group, params, present, states, nondense, kept[k])
            calls.append(kept[k])
        self.torch_calls[:] = calls  # in place: new lists a step per group would outlive
        self._picks[:] = picks  # the step's young collections (see fusedstep.group_call)
        self.torch_options = self._read_torch_options()
        self.torch_numbers = numbers_only(self.group)

    def _read_torch_options(self) -> tuple[Any, ...]:
        """The group's values that :func:`~.fusedstep.group_call` reads into a call:
        ``lr``, ``beta1``, ``beta2``, ``weight_decay``, ``eps``, ``maximize``,
        ``decoupled_weight_decay`` (the objects themselves, compared by identity)."""
        group = self.group
        beta1, beta2 = group["betas"]
        return (
            group["lr"],
            beta1,
            beta2,
            group["weight_decay"],
            group["eps"],
            group["maximize"],
            group["decoupled_weight_decay"],
        )

    def reuse_torch_calls(self) -> bool:
        """Put this step's grads into the calls :meth:`make_torch_calls` made at an
        earlier step, when they still hold: the group's options are the objects the
        calls were made with (an ``lr`` set anew, as a scheduler sets it, is written into
        the calls). The caller has checked the rest (:class:`_TorchRoutes`): the plan
        is :meth:`reusable_torch` (no param through a copy, every one had a grad), every
        param has a grad now, of the kind the plan was made for, and the params' state
        tensors are the same objects.

        Returns:
            False when the calls must be made again (:meth:`make_torch_calls`); nothing
            is changed then but grads already put in (the calls are remade).
        """
        from optladder.optimizers.fusedstep import numbers_only

        cache = self._torch_cache
        if cache is None or not self.torch_calls or len(self.torch_calls) != len(cache):
            return False
        now = self._read_torch_options()
        seen = self.torch_options
        if not all(map(operator.is_, now, seen)):
            if not all(map(operator.is_, now[1:], seen[1:])):
                return False  # betas, weight decay, eps or a flag: made again
            lr = now[0]
            for call in self.torch_calls:
                call[2]["lr"] = lr
            self.torch_options = now
            self.torch_numbers = numbers_only(self.group)
        for call, (params, _, _, _) in zip(self.torch_calls, cache):
            call[1][1][:] = map(grad_of, params)  # the grads' list, filled in place
        return True

    def reusable_torch(self) -> bool:
        """Whether :meth:`reuse_torch_calls` may reuse this step's calls at the next: every
        torch fused param had a grad at this step and none steps through a copy."""
        if not self.torch_buckets:
            return True
        cache = self._torch_cache
        return (
            cache is not None
            and all(self._picks)
            and len(self.torch_calls) == len(cache)
            and not any(strided or nondense for _, _, strided, nondense in cache)
        )

    def torch_steps(self) -> tuple[list[Any], list[bool]]:
        """``(step of every torch fused param, whether it has a grad now)``, in the order
        of :meth:`make_torch_calls`' calls (:meth:`~.fusedstep.StepCounts.prepare`'s
        ``within``), after :meth:`make_torch_calls`."""
        assert self._torch_cache is not None
        every = [st["step"] for _, states, _, _ in self._torch_cache for st in states]
        return every, self._picks

    def place(self, table: Any, first: int, table_group: int) -> None:
        """Make this plan's C kernel params rows ``first, ...`` of ``table`` (a new table:
        its grads are written at the next :meth:`write_grads`)."""
        self.table, self.first, self.table_group = table, first, table_group
        self._grads, self._grad_ptrs = KeptGrads(addresses=False), []


class _TorchRoutes:
    """The torch routes of every plan of one step, flat, kept between steps so that a
    step whose plans are the same objects (:meth:`_GroupPlan.check` passed for each)
    checks what :meth:`_GroupPlan.ready_torch` checks for all groups at once, in C, and
    reuses each plan's calls (:meth:`_GroupPlan.reuse_torch_calls`) instead of making
    them again: over many groups (layer-wise learning rates) the per-group work cost
    more than torch's own ``step``.

    What it compares at every step: the plans (identity), the torch routes' grads (none
    None; the same tensors over other memory are checked again by the plans), and every
    state tensor of those params (identity: a state tensor put in by hand or by a load
    is made ready again by the plans). Any change: the plans' own checks run, and this
    is made again after them.

    Attributes:
        plans: the plans it was made for, in order.
        with_calls: those with torch fused calls.
        params: every torch route param of them (fused and foreach), in order.
        states: their state dicts.
        tensors: their ``exp_avg``, ``exp_avg_sq`` and ``step`` then.
        grads: their grads then (:class:`~.stepmemo.KeptGrads`).
        steps: the step tensors of the fused calls, in the calls' order.
    """

    def __init__(self, plans: list[_GroupPlan], state: Mapping[torch.Tensor, Any]) -> None:
        self.plans = list(plans)
        self.with_calls = [plan for plan in plans if plan.torch_calls]
        self.params = [p for plan in plans for p in plan.torch_params]
        self.states = list(map(state.__getitem__, self.params))
        self.tensors = _state_tensors(self.states)
        self.grads = KeptGrads()
        self.grads.record(list(map(_GRAD, self.params)))
        self.steps = [step for plan in self.with_calls for step in plan.torch_steps()[0]]
        self.picks = [True] * len(self.steps)

    @staticmethod
    def fits(plans: list[_GroupPlan]) -> bool:
        """Whether the plans' torch routes can be kept so: every torch fused param had
        a grad at this step and none steps through a copy."""
        return all(plan.reusable_torch() for plan in plans)

    def reuse(self, plans: list[_GroupPlan]) -> bool:
        """Check this step's torch routes against what they were, and put this step's
        grads into every plan's calls; False (check and make them per plan) when the
        plans, a state tensor or a grad's presence changed, a grad that is the same
        tensor moved, or a plan's calls must be made again."""
        if not same_objects(plans, self.plans):
            return False
        grads = list(map(_GRAD, self.params))
        if any(map(operator.is_, grads, repeat(None))):
            return False
        if not same_objects(_state_tensors(self.states), self.tensors):
            return False
        kept = self.grads
        if not kept.same(grads) and same_grads(kept.refs, grads):
            return False  # the same grads over other memory: checked again per plan
        if not all(plan.reuse_torch_calls() for plan in self.with_calls):
            return False
        kept.record(grads)
        return True


class _SteadyPlans:
    """Every group's plan at the last step, kept while the step's inputs stay as they
    were, when every plan steps on torch's kernels alone (the fp32 format's float32,
    float64 and complex params): a step then checks the groups, their params and their
    grads' kinds for all groups at once, in C, instead of :meth:`_GroupPlan.check` per
    group (a few microseconds a group: over 1,000 groups, more than torch's ``step``).

    What :meth:`reuse` compares: the group dicts and their ``"rung"`` keys (the state
    format), every group's params (identity) and their count per group, the params'
    first indices (``param_starts``), and the grads: the same tensors at the same
    addresses, or new ones of the same kinds (:func:`~.stepmemo.grad_kinds`: which are
    None, dtypes, contiguity, element counts, devices, all dense). Those are what
    :meth:`_GroupPlan.check` reads; the torch routes' state and grads are then checked
    by :class:`_TorchRoutes`.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        starts: list[int] | None,
        plans: list[_GroupPlan],
        grads: list[torch.Tensor | None],
        reasons: dict[int, str],
    ) -> None:
        self.groups = list(groups)
        self.starts = None if starts is None else list(starts)
        self.rungs = list(map(_GET_RUNG, groups))
        self.params = list(chain.from_iterable(map(_PARAMS, groups)))
        self.sizes = list(map(len, map(_PARAMS, groups)))
        self.plans = plans
        self.kinds = grad_kinds(grads)
        self.grads = KeptGrads()
        self.grads.record(grads)
        self.reasons = reasons

    @staticmethod
    def fits(plans: list[_GroupPlan]) -> bool:
        """Whether every plan steps its params on torch's kernels alone."""
        return all(plan.torch_only for plan in plans)

    def reuse(
        self,
        groups: list[dict[str, Any]],
        starts: list[int] | None,
        checked: list[list[torch.Tensor | None]] | None,
    ) -> bool:
        """Whether the kept plans hold for this step (see the class docstring); the
        grads are ``checked``'s (per group) or read here."""
        if not same_objects(groups, self.groups) or starts != self.starts:
            return False
        if list(map(_GET_RUNG, groups)) != self.rungs:
            return False
        params = list(chain.from_iterable(map(_PARAMS, groups)))
        if not same_objects(params, self.params):
            return False
        if list(map(len, map(_PARAMS, groups))) != self.sizes:
            return False
        if checked is None:
            grads = list(map(grad_of, params))
        else:
            grads = list(chain.from_iterable(checked))
        if not self.grads.same(grads) and grad_kinds(grads) != self.kinds:
            return False
        self.grads.record(grads)
        return True


_GET_RUNG = operator.methodcaller("get", RUNG_KEY)
_PARAMS = operator.itemgetter("params")


def _state_tensors(states: list[Any]) -> list[Any]:
    """Every state dict's ``exp_avg``, then ``exp_avg_sq``, then ``step`` (None where
    missing), in C."""
    return [*map(_GET_AVG, states), *map(_GET_AVG_SQ, states), *map(_GET_STEP, states)]


def _kind(g: torch.Tensor) -> tuple[Any, ...]:
    """What routing reads of one grad (as :func:`~.stepmemo.grad_kinds` of a group)."""
    return (g.dtype, g.is_contiguous(), g.numel(), g.get_device(), g.layout)


_GRAD = operator.attrgetter("grad")
_GET_AVG = operator.methodcaller("get", "exp_avg")
_GET_AVG_SQ = operator.methodcaller("get", "exp_avg_sq")
_GET_STEP = operator.methodcaller("get", "step")


def _ptrs(grads: list[torch.Tensor | None]) -> list[int]:
    """The grads' addresses, 0 for None."""
    if any(map(operator.is_, grads, repeat(None))):
        return [0 if g is None else g.data_ptr() for g in grads]
    return list(map(_DATA_PTR, cast(list[torch.Tensor], grads)))


def _kernel_moments(st: Mapping[str, Any], p: torch.Tensor, moment_dtype: torch.dtype) -> bool:
    """Whether ``st`` holds moments the C kernel can point at for ``p``: ``exp_avg`` and
    ``exp_avg_sq`` tensors of ``moment_dtype``, contiguous, of ``p``'s shape."""
    return all(
        isinstance(m, torch.Tensor)
        and m.dtype == moment_dtype
        and m.is_contiguous()
        and m.shape == p.shape
        for m in (st.get("exp_avg"), st.get("exp_avg_sq"))
    )


def _stage_offset(p: torch.Tensor) -> int:
    """Where a staged param's grad copy starts in the stage buffer: after the param's
    copy, rounded up to 64 bytes."""
    return (p.numel() * p.element_size() + 63) // 64 * 64


def refuse_ladder_dtypes(
    params: list[torch.Tensor], moment_dtype: torch.dtype, torch_kernels: bool = False
) -> None:
    """Refuse params :class:`LadderAdamW` with ``moment_dtype`` moments cannot step without
    rounding them (what its ``add_param_group`` checks of each group's params).

    Args:
        params: one group's params.
        moment_dtype: ``torch.bfloat16`` (takes :data:`optladder.rungs.LADDER_DTYPES`) or
            ``torch.float32`` (takes :data:`optladder.rungs.FLOAT32_MATH_DTYPES`; with
            ``torch_kernels`` also float64 and complex params, which torch's kernels step
            with moments in their own dtype, :mod:`~optladder.optimizers.torchroute`).
        torch_kernels: the engine steps the fp32 format's float32, float64 and complex
            params on torch's kernels (``backend="auto"``).

    Raises:
        ValueError: naming the param (its place in the group), its dtype and what is
            allowed; complex params first.
    """
    dtypes: tuple[str, ...] = (
        LADDER_DTYPES if moment_dtype == torch.bfloat16 else FLOAT32_MATH_DTYPES
    )
    if torch_kernels and moment_dtype == torch.float32:
        dtypes = (*dtypes, "float64", "complex64", "complex128")
    names = set(map(dtype_name, set(map(_DTYPE, params))))
    for i, p in enumerate(params if not names <= set(dtypes) else ()):
        if p.is_complex() and dtype_name(p.dtype) not in dtypes:
            raise ValueError(
                f"param {i} of the new group is complex ({p.dtype}); the bf16 rung and "
                "optladder's AdamW take real params only: use the fp32 rung "
                "(rung='fp32') for complex params"
            )
        if dtype_name(p.dtype) not in dtypes:
            raise ValueError(
                f"param {i} of the new group has dtype {p.dtype}; optladder's AdamW with "
                f"{dtype_name(moment_dtype)} moments takes "
                f"{', '.join(dtypes)} params (float64 params keep float64 moments on the "
                "fp32 rung's torch AdamW)"
            )


def is_8bit_group(group: Mapping[str, Any]) -> bool:
    """Whether ``group``'s state format is the 8bit rung's (its ``"rung"`` key)."""
    return group.get(RUNG_KEY) == "8bit"


BNB_GROUP_KEYS: dict[str, Any] = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}
"""The group keys bitsandbytes' ``AdamW8bit`` gives its groups beyond Adam's (its
AdEMAMix options, at the values that make it Adam). The live groups do not hold them
(they are no option of optladder's); an 8bit-format group's saved form does
(:func:`saved_group_keys`), so its checkpoint is the one ``AdamW8bit`` saves, and steps
on in it: ``AdamW8bit.load_state_dict`` replaces its groups with the saved ones, and
bitsandbytes 0.45 reads ``group.get("alpha")`` with no default (its update then refuses
None); 0.46 added defaults."""


def saved_group_keys(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (a group as ``state_dict()`` writes it) with :data:`BNB_GROUP_KEYS`
    where it is in the 8bit format (those it lacks); returned, changed in place."""
    if saved.get(RUNG_KEY) == "8bit":
        for key, value in BNB_GROUP_KEYS.items():
            saved.setdefault(key, value)
    return saved


def refuse_8bit_params(params: list[torch.Tensor]) -> None:
    """Refuse params the 8bit format cannot take (:data:`optladder.rungs.RUNG_ACCEPTS`:
    real float32, bfloat16 or float16) or whose bitsandbytes override it would fail on
    (:func:`optladder.bnb_overrides.quantized_8bit`).

    Raises:
        ValueError: naming the param (its place in the new group), its dtype and what is
            allowed.
    """
    from optladder.bnb_overrides import quantized_8bit
    from optladder.optimizers.eightbit import check_8bit_param

    for i, p in enumerate(params):
        check_8bit_param(p, f"param {i} of the new group")
        quantized_8bit(p, f"param {i} of the new group")


def _wrap_8bit_hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """:meth:`LadderAdamW._wrap_8bit_state` as a state-dict post hook."""
    cast(LadderAdamW, opt)._wrap_8bit_state(state_dict)


def _saved_8bit_ids(
    saved_groups: list[dict[str, Any]], live_groups: list[dict[str, Any]]
) -> frozenset[Any]:
    """The checkpoint's param ids of the groups that are 8bit once loaded: the saved
    group's ``"rung"``, else the live group's (a checkpoint of bitsandbytes'
    ``AdamW8bit`` or torch's AdamW saves none)."""
    ids: set[Any] = set()
    for saved, live in zip(saved_groups, live_groups):
        if saved.get(RUNG_KEY, live.get(RUNG_KEY)) == "8bit":
            ids.update(saved["params"])
    return frozenset(ids)


def _refuse_codes_without_books(
    saved_state: Mapping[Any, Any],
    saved_groups: list[dict[str, Any]],
    eight_ids: frozenset[Any],
) -> None:
    """Refuse, before anything loads, an 8bit param's saved uint8 codes (``state1``,
    ``state2``) without what decodes them (:func:`~.codebooks.check_8bit_codes`: float32
    block scales ``absmax1``/``absmax2`` and a 256-entry code book ``qmap1``/``qmap2``, as
    bitsandbytes' ``AdamW8bit`` keeps them; its step reads them, and without them the step
    raised KeyError). The number of scales is checked where the state is stepped or
    converted (a sharded param's scales are its shard's).

    Raises:
        ValueError: naming the param (its place over every group), the key, what was
            found and what is allowed.
    """
    from optladder.optimizers.codebooks import check_8bit_codes
    from optladder.optimizers.migrate import unwrap_bnb_state

    saved_ids = [i for g in saved_groups for i in g["params"]]
    for index, saved_id in enumerate(saved_ids):
        if saved_id not in eight_ids or saved_id not in saved_state:
            continue
        state = unwrap_bnb_state(saved_state[saved_id])
        for name in ("state1", "state2"):
            codes = state.get(name)
            if isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8:
                check_8bit_codes(state, name, f"param {index}")


def _loaded_8bit_state(
    saved: Mapping[str, Any], p: torch.Tensor, copies: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """One 8bit param's loaded state, as bitsandbytes' ``Optimizer8bit.load_state_dict``
    makes it: unwrapped (:func:`~.migrate.unwrap_bnb_state`), a copy of every tensor
    (one per checkpoint tensor, so the code books the checkpoint shares stay shared),
    its quantization tensors on the param's device, other floating tensors but uint8
    ones cast to the param's dtype."""
    from optladder.optimizers.migrate import BNB_WRAPPED_KEYS, unwrap_bnb_state

    out: dict[str, Any] = {}
    for key, value in unwrap_bnb_state(saved).items():
        if isinstance(value, torch.Tensor):
            copy = copies.get(id(value))
            if copy is None:
                copy = value.detach().clone()
                copies[id(value)] = copy
            value = copy
            if key in BNB_WRAPPED_KEYS:
                value = value.to(p.device)
            elif p.is_floating_point() and value.dtype != torch.uint8:
                value = value.to(p.dtype)
        out[key] = value
    return out


def _global_indices(eight: Any, starts: list[int]) -> dict[int, str]:
    """``eight.eager_reasons`` (param index over the 8bit groups) by param index over
    every group (``starts``: each 8bit group's first param's index over every group)."""
    out: dict[int, str] = {}
    index = 0
    for start, group in zip(starts, eight.param_groups):
        for pi in range(len(group["params"])):
            if index in eight.eager_reasons:
                out[start + pi] = eight.eager_reasons[index]
            index += 1
    return out


class LadderAdamW(torch.optim.Optimizer):
    """AdamW whose moments ``exp_avg`` and ``exp_avg_sq`` are stored in ``moment_dtype``.

    Params stay in their own dtype (any real floating dtype) and are updated in place;
    the arithmetic runs in float32. With ``moment_dtype=torch.bfloat16`` the state is
    4 bytes per param element instead of 8; the moments are written back with stochastic
    rounding by default, because round-to-nearest turns ``v = 0.999 * v`` back into ``v``
    and the second moment stops decaying. The random bits are documented in
    :mod:`optladder.optimizers.rounding`.

    Each param group's state format is its own: a group's ``"rung"`` key
    (:data:`optladder.rungs.RUNG_KEY`) ``"fp32"`` keeps float32 moments, ``"bf16"``
    bfloat16 moments; a group without the key keeps ``moment_dtype`` moments
    (:meth:`group_moment_dtype`); a group whose key is ``"8bit"`` keeps bitsandbytes'
    ``AdamW8bit`` state (:class:`~optladder.optimizers.eightbit.EightBitGroups`). Which
    kernel steps which param is the engine's dispatch table (:attr:`dispatch`,
    :mod:`~optladder.optimizers.dispatch`), looked up when a group's plan is made; a
    step is :meth:`prepare_step` (state, scratch, kernel tables and calls) then
    :meth:`commit_step` (one call per entry of the table that has params this step).

    State per param (as torch names it): ``step`` (0-d float64 tensor on the CPU, the
    number of steps this param took; stepped from counts up to
    :data:`~optladder.optimizers.steps.BF16_MAX_STEP` with either moment dtype, since the
    random bits' key and the bias corrections take 32-bit steps), ``exp_avg`` and
    ``exp_avg_sq`` (``moment_dtype``, the param's shape, contiguous). A param whose grad
    is None is not stepped.

    Args:
        params: params or param groups, as for any ``torch.optim.Optimizer``.
        lr: learning rate (float or 0-d tensor), ``>= 0``. Default 1e-3.
        betas: ``(beta1, beta2)`` in ``[0, 1)``. Default (0.9, 0.999).
        eps: denominator term, ``>= 0``. Default 1e-8.
        weight_decay: ``>= 0``. Default 1e-2 (torch's AdamW default).
        decoupled_weight_decay: True for AdamW (``p *= 1 - lr * wd``), False for Adam
            (``grad += wd * p``).
        maximize: ascend instead of descend.
        moment_dtype: ``torch.bfloat16`` or ``torch.float32``: the moments of groups
            without a ``"rung"`` key.
        rounding: ``"stochastic"`` or ``"nearest"``; used only for bfloat16 moments.
        param_rounding: how bfloat16/float16 params are written: ``"stochastic"``
            (default; its own stream of the same hash, see
            :mod:`optladder.optimizers.rounding`) or ``"nearest"`` (round-to-nearest-even,
            as ``Tensor.copy_``). A group key like ``rounding``, so in ``state_dict``.
        seed: ``0 <= seed < 2**64``; with the step, param index and element index it
            fixes every random bit. Stored in each param group, so in ``state_dict``.
        backend: see :data:`Backend`. All backends write the same bits: the kernels
            match the eager loop bit for bit (params, moments and step counts).
            After each step, ``eager_reasons`` maps the index of every param that
            stepped eagerly to the reason.
        torch_fused: with ``backend="auto"``, the fp32 format's float32, float64 and
            complex params step on torch's kernels (:mod:`~optladder.optimizers.torchroute`):
            its fused kernel where the device has one (True), or its foreach path
            everywhere (False: a device whose fused kernel did not run).
        checked: True when the caller has checked ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``rounding``, ``param_rounding`` and ``seed`` already
            (:class:`optladder.AdamW`'s construction checks them once, naming its own
            arguments); they are not checked again here.

    AMP: like torch's fused AdamW, this optimizer takes ``grad_scale`` and ``found_inf``
    from ``torch.amp.GradScaler`` (``_step_supports_amp_scaling``): grads are unscaled in
    place, and a step with infs changes nothing, step counts included. On CUDA steps
    stay on the device (the Triton path keeps ``step`` there, like torch's fused Adam).

    Raises:
        ValueError: for a bad hyperparameter, a complex or non-floating param, or a
            sparse grad at ``step``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        maximize: bool = False,
        moment_dtype: torch.dtype = torch.bfloat16,
        rounding: Rounding = "stochastic",
        param_rounding: Rounding = "stochastic",
        seed: int = 0,
        backend: Backend = "auto",
        torch_fused: bool = True,
        checked: bool = False,
    ) -> None:
        if not checked:
            validate_hyperparams(lr, betas, eps, weight_decay)
            check_rounding(rounding)
            check_param_rounding(param_rounding)
            check_seed(seed)
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if moment_dtype not in _MOMENT_DTYPES:
            raise ValueError(
                f"moment_dtype must be torch.bfloat16 or torch.float32, got {moment_dtype}"
            )
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
            "maximize": maximize,
            "rounding": rounding,
            "param_rounding": param_rounding,
            "seed": seed,
        }
        self.moment_dtype = moment_dtype
        self.backend: Backend = backend
        self.torch_fused = torch_fused
        self.eager_reasons: dict[int, str] = {}
        # which kernel steps which (rung, device, param dtype, grad dtype), and why not
        # fused (:mod:`~optladder.optimizers.dispatch`)
        self.dispatch = dispatch.DispatchTable(backend, torch_fused)
        # the prepared step: (entry, payload) per entry with params, in commit order,
        # and the group plans it was made from
        self._buckets: list[tuple[dispatch.Entry, Any]] | None = None
        self._bucket_plans: list[_GroupPlan] = []
        # after a commit_step that raised: the places in param_groups of the groups it
        # had stepped, those it may have partly stepped and those it had not touched
        self.commit_outcome: tuple[list[int], list[int], list[int]] | None = None
        self._created: list[torch.Tensor] = []  # the state the last prepare created
        self._scratch: dict[torch.device, Any] = {}
        self._stage: dict[torch.device, torch.Tensor] = {}  # staged params' copies (bytes)
        self._cpu_table: Any = None  # cpu.KernelTable of every group's C kernel params
        self._table_plans: list[_GroupPlan] = []  # the plans it was made for, in order
        self._table_held: list[torch.Tensor] = []  # the tensors it points into
        self._table_ptrs: list[int] = []  # and their addresses then
        self._group_plans: dict[int, _GroupPlan] = {}  # group position -> its plan
        self._options_memo = StepMemo()  # group options that passed their checks
        self._state_seen: list[Any] = []  # self.state's values after the last prepare
        self._state_lens: list[int] = []  # and their lengths then (a dict emptied by hand)
        self._untracked_steps = False  # a plan has params off the C kernel (see prepare)
        self._torch_counts: Any = None  # fusedstep.StepCounts of the torch fused calls
        self._torch_routes: _TorchRoutes | None = None  # the plans' torch routes, flat
        self._steady: _SteadyPlans | None = None  # every plan, when all are torch's
        # each group's first param's index over the groups of a larger optimizer this
        # one steps a part of (its rounding streams' param index, and the index messages
        # name), set by its caller; None (optladder.AdamW, which holds every group):
        # counted over this optimizer's own groups
        self.param_starts: list[int] | None = None
        self._eightbit: Any = None  # eightbit.EightBitGroups, made with the first 8bit group
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(_wrap_8bit_hook, prepend=True)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True: ``torch.amp.GradScaler`` hands the scale and the inf flag to
        :meth:`step` (``grad_scale``, ``found_inf``), as to torch's fused AdamW."""
        return True

    @run_eagerly
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, refusing params this optimizer cannot step.

        Raises:
            ValueError: if a param's dtype is not one this optimizer steps without
                rounding the param (:data:`optladder.rungs.LADDER_DTYPES` with bfloat16
                moments; with float32 moments, the fp32 rung of bfloat16/float16 params,
                not float64, which keeps float64 moments on torch's AdamW; complex and
                non-float dtypes are refused),
                or the group's ``rounding``, ``param_rounding`` or ``seed`` is not allowed.
        """
        check_rounding(param_group.get("rounding", "stochastic"))
        check_param_rounding(param_group.get("param_rounding", "stochastic"))
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if param_group.get(RUNG_KEY) == "8bit":
            refuse_8bit_params(params)
        else:
            refuse_ladder_dtypes(
                params, self.group_moment_dtype(param_group), torch_kernels=self.backend == "auto"
            )
        param_group["params"] = params
        self.format_keys(param_group)
        super().add_param_group(param_group)
        # torch fills the keys the group lacks from defaults: of torch's AdamW flags (an
        # optimizer whose defaults hold them, optladder.AdamW), only the format's stay
        self.format_keys(param_group)
        if hasattr(self, "_group_plans"):  # not while torch's __init__ adds the first groups
            self._group_plans.clear()
            self._torch_routes = None
            self._steady = None

    @run_eagerly
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state, keeping the moments in ``moment_dtype`` without a lossy cast.

        torch's loader casts floating state to the param dtype, which would round
        float32 moments of a bfloat16 param to bfloat16. The moments are therefore set
        aside, the rest is loaded by torch (which validates the groups first and changes
        nothing when they do not match), and the moments are put back in
        ``moment_dtype`` on the param's device. ``step`` becomes a 0-d float64 CPU tensor.

        Raises:
            ValueError: from torch's loader (groups that do not match); an 8bit param's
                uint8 codes without their ``absmax``/``qmap`` (naming the param and
                key), refused before anything loads; an OOM while
                copying the state. Either way the optimizer is as it was: its ``state``
                and ``param_groups`` are the objects they were, unchanged.
        """
        moment_keys = ("exp_avg", "exp_avg_sq")
        saved_state = state_dict["state"]
        eight_ids = _saved_8bit_ids(state_dict["param_groups"], self.param_groups)
        _refuse_codes_without_books(saved_state, state_dict["param_groups"], eight_ids)
        stripped = {
            **state_dict,
            "state": {
                k: {n: v for n, v in s.items() if n not in moment_keys}
                for k, s in saved_state.items()
                if k not in eight_ids
            },
        }
        live_groups = [dict(g) for g in self.param_groups]
        # torch's loader puts new state dicts and group dicts in place of these (its
        # last act); the rest below only fills those, so these are the way back
        old_state, old_groups = self.state, self.param_groups
        super().load_state_dict(stripped)
        self._group_plans.clear()
        if self._eightbit is not None:
            self._eightbit.release_tables()
        self._torch_routes = None
        self._steady = None
        try:
            self._finish_load(state_dict, saved_state, eight_ids, live_groups)
        except BaseException:  # an OOM copying the moments: the optimizer as it was
            self.state, self.param_groups = old_state, old_groups
            raise

    def _finish_load(
        self,
        state_dict: dict[str, Any],
        saved_state: dict[Any, Any],
        eight_ids: frozenset[Any],
        live_groups: list[dict[str, Any]],
    ) -> None:
        """The part of :meth:`load_state_dict` after torch's loader: the live groups'
        keys the checkpoint lacks, the moments in ``moment_dtype``, the 8bit groups'
        state as bitsandbytes loads it, ``step`` as a float64 CPU tensor of its own."""
        moment_keys = ("exp_avg", "exp_avg_sq")
        for group, before in zip(self.param_groups, live_groups):  # keys the checkpoint
            for key, value in before.items():  # lacks (torch's AdamW saves no "rung",
                group.setdefault(key, value)  # "seed", "rounding"): the live group's
        for group in self.param_groups:  # checkpoints from before param_rounding existed
            group.setdefault("param_rounding", self.defaults.get("param_rounding", "stochastic"))
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        live = [(p, g) for g in self.param_groups for p in g["params"]]
        copies: dict[int, torch.Tensor] = {}  # a tensor the checkpoint shares, copied once
        for saved_id, (p, group) in zip(saved_ids, live):
            if saved_id not in saved_state:
                continue
            if saved_id in eight_ids:
                self.state[p] = _loaded_8bit_state(saved_state[saved_id], p, copies)
                continue
            st = self.state[p]
            moment_dtype = torchroute.state_moment_dtype(p, self.group_moment_dtype(group))
            for name in moment_keys:
                if name in saved_state[saved_id]:
                    value = saved_state[saved_id][name]
                    st[name] = value.to(device=p.device, dtype=moment_dtype).contiguous()
            if isinstance(st.get("step"), torch.Tensor):  # its own: not the checkpoint's,
                st["step"] = st["step"].detach().to("cpu", STEP_DTYPE, copy=True)  # nor shared

    def _wrap_8bit_state(self, state_dict: dict[str, Any]) -> None:
        """State-dict post hook: the 8bit groups' state and groups as bitsandbytes'
        ``AdamW8bit`` saves them (its ``state_dict`` moves the quantization tensors under
        ``"__bnb_optimizer_quant_state__"``, :func:`~.migrate.wrap_bnb_state`; its groups
        hold :data:`BNB_GROUP_KEYS`)."""
        from optladder.optimizers.migrate import wrap_bnb_state

        for saved_group in state_dict["param_groups"]:
            saved_group_keys(saved_group)
        index = 0
        saved = state_dict["state"]
        for group in self.param_groups:
            n = len(group["params"])
            if group.get(RUNG_KEY) == "8bit":
                for k in range(index, index + n):
                    if k in saved:
                        saved[k] = wrap_bnb_state(saved[k])
            index += n

    def format_keys(self, group: dict[str, Any]) -> None:
        """Give ``group`` the keys of its state format: an fp32-format group stepped on
        torch's kernels (``backend="auto"``) holds torch's AdamW group keys
        (:func:`~.torchroute.torch_group_keys`, those it lacks), a bf16-format group and
        an 8bit-format group none of them. No group holds bitsandbytes' AdEMAMix keys
        (:data:`BNB_GROUP_KEYS`: removed, as groups of earlier versions had them on the
        8bit rung); an 8bit group's checkpoint does (:func:`saved_group_keys`)."""
        for key in BNB_GROUP_KEYS:
            group.pop(key, None)
        if group.get(RUNG_KEY) == "8bit":
            for key in torchroute.TORCH_GROUP_KEYS:
                group.pop(key, None)
            return
        if self.backend == "auto" and self.group_moment_dtype(group) == torch.float32:
            for key, value in torchroute.torch_group_keys(self.torch_fused).items():
                group.setdefault(key, value)
        else:
            for key in torchroute.TORCH_GROUP_KEYS:
                group.pop(key, None)

    def set_format(self, group: dict[str, Any], rung: str) -> None:
        """Put ``group`` in the state format of ``rung`` (``"fp32"``, ``"bf16"`` or
        ``"8bit"``): its ``"rung"`` key and :meth:`format_keys`. Its state is converted by
        the caller."""
        group[RUNG_KEY] = rung
        self.format_keys(group)
        self.release_tables()

    def check_kernel_flags(self, group: Mapping[str, Any]) -> None:
        """Refuse an fp32-format group whose torch kernel flags (``fused``, ``foreach``,
        ``capturable``; set by hand after construction) are not the engine's:
        optladder chooses the kernel.

        Raises:
            ValueError: naming the key, its value and the engine's.
        """
        if self.backend != "auto" or self.group_moment_dtype(group) != torch.float32:
            return
        want = torchroute.torch_group_keys(self.torch_fused)
        for key in ("fused", "foreach", "capturable"):
            if group.get(key, want[key]) != want[key]:
                flags = ", ".join(f"{k}={want[k]!r}" for k in ("fused", "foreach", "capturable"))
                raise ValueError(
                    f"{key}={group[key]!r}, but optladder chooses each rung's kernel (this "
                    f"group's engine runs {flags}); set {key}={want[key]!r} back, or leave "
                    "the kernel flags out of the group"
                )

    def group_moment_dtype(self, group: Mapping[str, Any]) -> torch.dtype:
        """The moments' dtype of ``group``'s state format: its ``"rung"`` key's
        (``"fp32"``: float32, ``"bf16"``: bfloat16), else this engine's ``moment_dtype``
        (:func:`group_moment_dtype`)."""
        return group_moment_dtype(group, self.moment_dtype)

    def _init_state(self, p: torch.Tensor, moment_dtype: torch.dtype) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=STEP_DTYPE)
            state["exp_avg"] = torch.zeros(p.shape, dtype=moment_dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=moment_dtype, device=p.device)
        return cast(dict[str, Any], state)

    @run_eagerly
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimizer step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: if a grad is sparse; with ``grad_scale`` set, grads that share
                some of their memory but not all (:func:`distinct_grads`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:  # refuse grads that partly share memory, before writing
            grads = [p.grad for g in self.param_groups for p in g["params"]]
            distinct_grads([g for g in grads if g is not None])
        self.prepare_step()
        self.commit_step(grad_scale, getattr(self, "found_inf", None))
        return loss

    def prepare_step(
        self, *, checked: list[list[torch.Tensor | None]] | None = None
    ) -> list[torch.Tensor]:
        """Phase one of a step: check the grads, route each param to a backend, and
        allocate everything the step will need (state of params stepping for the first
        time, ``step`` tensors on the Triton device, the eager path's scratch), and write
        the C kernel's tables for this step.

        Each group's routing and kernel table are kept between steps
        (:class:`_GroupPlan`) and made again only when something they depend on
        changed: the group dict, its params (by identity and memory), the kinds of its
        grads (which are None, their dtypes, devices, element counts, contiguity), its
        params' state (the state dicts and the tensors in them), or a param's index.
        New grad tensors of the same kinds only get their pointers written.

        Args:
            checked: per group, every param's grad (None where it has none) as the
                caller read it for this step, having checked every group's options
                with :meth:`check_group_options` (the two-phase step of
                :mod:`optladder.optimizers.transaction` does): the options are not
                checked again here, nor the grads read again. None: read and check
                here.

        Returns:
            The params whose state this call created.

        Raises:
            ValueError: if a grad is sparse, a group option is not allowed, or a step
                count is out of this rung's range. An OOM while allocating: the state
                created so far is dropped first, so the optimizer is as it was.
        """
        from optladder.optimizers import eager

        plans: list[_GroupPlan] = []
        eight_starts: list[int] = []  # each 8bit group's first param's index
        writes: list[tuple[list[torch.Tensor | None], tuple[bool, list[int] | None]]] = []
        created: list[torch.Tensor] = []
        replanned = False  # whether a plan or the C kernel's table was made again
        state_dicts = list(self.state.values())
        # the same state dicts, none emptied by hand since (torch's AdamW starts a param
        # whose state is empty afresh: its plan must create the state again)
        state_same = same_objects(state_dicts, self._state_seen) and (
            list(map(len, state_dicts)) == self._state_lens
        )
        if state_same and not self._table_points_right():
            self._group_plans.clear()  # made again below, with a new table
            self._torch_routes = None
            self._steady = None
            self._cpu_table, self._table_plans = None, []
            self._table_held, self._table_ptrs = [], []
        starts = self.param_starts
        if starts is not None and len(starts) != len(self.param_groups):
            starts = None  # set for other groups: count over this engine's own
        groups = self.param_groups
        if checked is None:
            self._check_options(groups)
        self._buckets = None
        self._bucket_plans = []
        steady, self._steady = self._steady, None
        if steady is not None and state_same and steady.reuse(groups, starts, checked):
            try:  # every plan holds and steps on torch's kernels alone: checked flat
                self._prepare_torch(steady.plans)
            except BaseException:
                self._drop_created(created)
                raise
            self._steady = steady  # the state dicts are those _see_state recorded: no
            # state was created (a change replans, next step)
            self._buckets = self._torch_buckets(steady.plans)
            self._bucket_plans = steady.plans
            self._created = created
            self.eager_reasons = dict(steady.reasons)
            return created
        self.dispatch.forget()  # plans made below look the environment up again
        try:
            start = 0
            for gi, group in enumerate(groups):
                if starts is not None:
                    start = starts[gi]
                params = group["params"]
                if group.get(RUNG_KEY) == "8bit":  # stepped by self._eightbit, below
                    self._group_plans.pop(gi, None)
                    eight_starts.append(start)
                    start += len(params)
                    continue
                grads = list(map(grad_of, params)) if checked is None else checked[gi]
                plan = self._group_plans.get(gi)
                written = None
                if plan is not None and state_same:
                    written = plan.check(group, start, grads)
                if plan is None or written is None:
                    plan = self._plan_group(group, params, grads, start, created, plan)
                    self._group_plans[gi] = plan
                    written = (False, None)
                    replanned = True
                plans.append(plan)
                writes.append((grads, written))
                start += len(params)
            for gi in [gi for gi in self._group_plans if gi >= len(self.param_groups)]:
                del self._group_plans[gi]
            if self._place_cpu_params(plans):  # a new table: every grad pointer written
                writes = [(grads, (False, written[1])) for grads, written in writes]
                replanned = True
            if replanned or self._untracked_steps:
                # the C kernel's step tensors are the table's (a new one is made when
                # they change); the other routes' are read afresh at every step
                self._untracked_steps = any(p.untracked_steps for p in plans)
                self._refuse_shared_steps(plans)
            for plan, (grads, written) in zip(plans, writes):
                plan.write_grads(grads, written)
            launches = self._prepare_triton(plans)
            self._write_cpu_steps()
            self._check_steps(plans)
            self._prepare_staged(plans)
            self._prepare_torch(plans)
            need: dict[torch.device, int] = {}
            for plan in plans:
                for p, _ in plan.routes["eager"]:
                    need[p.device] = max(need.get(p.device, 0), eager.scratch_length(p))
            for device, length in need.items():
                have = self._scratch.get(device)
                if have is None or have.length < length:
                    self._scratch.pop(device, None)
                    self._scratch[device] = eager.EagerScratch.allocate(length, device)
            eight = None
            if eight_starts:  # the 8bit groups: their state, copies and kernel tables
                eight = self.eightbit_groups()
                created += eight.prepare()
            buckets = self._make_buckets(plans, launches, eight)
        except BaseException:
            self._drop_created(created)
            raise
        self._see_state()
        self._buckets = buckets
        self._bucket_plans = plans
        self._created = created
        self.eager_reasons = {i: r for plan in plans for i, r in plan.reasons.items()}
        if eight is not None and eight.eager_reasons:
            self.eager_reasons.update(_global_indices(eight, eight_starts))
        if not eight_starts and _SteadyPlans.fits(plans):  # no 8bit group
            grads = (
                list(map(grad_of, chain.from_iterable(map(_PARAMS, groups))))
                if checked is None
                else list(chain.from_iterable(checked))
            )
            self._steady = _SteadyPlans(groups, starts, plans, grads, self.eager_reasons)
        return created

    def _see_state(self) -> None:
        """Record ``state``'s dicts and their lengths after a prepare (what the next
        prepare compares to keep its plans)."""
        self._state_seen = list(self.state.values())
        self._state_lens = list(map(len, self._state_seen))

    def eightbit_groups(self) -> Any:
        """The :class:`~optladder.optimizers.eightbit.EightBitGroups` of this optimizer's
        8bit groups (made when first needed: bitsandbytes is imported then)."""
        if self._eightbit is None:
            from optladder.optimizers.eightbit import EightBitGroups

            self._eightbit = EightBitGroups(self)
        return self._eightbit

    def check_8bit_options(self, group: Mapping[str, Any]) -> None:
        """Refuse an 8bit-format group's options bitsandbytes' update does not take:
        ``maximize``, and a ``decoupled_weight_decay`` other than the optimizer's (the
        8bit groups decay one way, the ``defaults``').

        Raises:
            ValueError: naming the option, its value and what is allowed.
        """
        if group.get(RUNG_KEY) != "8bit":
            return
        if group.get("maximize", False):
            raise ValueError(
                "maximize=True is not supported on the 8bit rung (bitsandbytes' update "
                "descends): set maximize=False, or give the group rung='fp32'"
            )
        want = bool(self.defaults.get("decoupled_weight_decay", True))
        if bool(group.get("decoupled_weight_decay", want)) != want:
            raise ValueError(
                f"decoupled_weight_decay={group['decoupled_weight_decay']!r} on an 8bit "
                f"group, but the optimizer's is {want!r}: its 8bit groups decay one way"
            )

    def _check_options(self, groups: list[dict[str, Any]]) -> None:
        """Check every group's options (:meth:`check_group_options`,
        :meth:`check_kernel_flags`, :meth:`check_8bit_options`) that changed since they
        last passed (the options memo: all groups at once, else group by group).

        Raises:
            ValueError: naming the group, the option, its value and what is allowed.
        """
        memo = self._options_memo
        if memo.all_options_unchanged(groups):
            return
        memo.trim(len(groups))
        for gi, group in enumerate(groups):
            if not memo.options_unchanged(gi, group):
                try:
                    self.check_group_options(group)
                    self.check_kernel_flags(group)
                    self.check_8bit_options(group)
                except ValueError as exc:
                    raise ValueError(f"param group {gi}: {exc}") from None
                memo.record_options(gi, group)
        memo.record_all_options(groups)

    def _drop_created(self, created: list[torch.Tensor]) -> None:
        """Drop the state a step's prepare created (nothing was written to it) and the
        plans, which may point at it."""
        for p in created:
            self.state.pop(p, None)
        if self._eightbit is not None:
            self._eightbit.drop_kernel_step()
            self._eightbit.release_scratch()
            self._eightbit.release_tables()
        self._buckets = None
        self._bucket_plans = []
        self._group_plans.clear()
        self._torch_routes = None
        self._steady = None
        self._cpu_table, self._table_plans = None, []
        self._table_held, self._table_ptrs = [], []

    def _prepare_torch(self, plans: list[_GroupPlan]) -> None:
        """Make this step's torch fused kernel calls of every plan and make ready the
        count of their step tensors (:class:`~.fusedstep.StepCounts`, which refuses step
        tensors that params share when they change)."""
        from optladder.optimizers.fusedstep import StepCounts, plan_steps

        routes = self._torch_routes
        if routes is not None and routes.reuse(plans):  # nothing changed: checked flat
            if routes.steps:
                self._torch_counts.prepare(routes.steps, within=(routes.steps, routes.picks))
            return
        self._torch_routes = None
        self._steady = None
        calls: list[Any] = []
        every: list[torch.Tensor] = []
        picks: list[bool] = []
        for plan in plans:
            plan.ready_torch(self.state)
            if plan.torch_buckets:
                plan.make_torch_calls(self.state)
                calls += plan.torch_calls
                steps, having = plan.torch_steps()
                every += steps
                picks += having
        if calls:
            if self._torch_counts is None:
                self._torch_counts = StepCounts()
            # the cells of every such param's step kept: a step that changes which have
            # a grad picks among them (experts, a task's head)
            self._torch_counts.prepare(plan_steps(calls), within=(every, picks))
        if any(plan.torch_params for plan in plans) and _TorchRoutes.fits(plans):
            self._torch_routes = _TorchRoutes(plans, self.state)

    def _refuse_shared_steps(self, plans: list[_GroupPlan]) -> None:
        """Refuse step tensors that two stepped params share (see
        :func:`~optladder.optimizers.steps.refuse_shared_steps`): the C kernel would
        step both from the count it read and add two, the eager loop would step the
        second from the first's new count, so the bits would depend on the route.

        Raises:
            ValueError: naming both params (their indices over all groups).
        """
        items = [item for plan in plans for route in plan.routes.values() for item in route]
        state = self.state
        refuse_shared_steps([state[p]["step"] for p, _ in items], lambda k: f"param {items[k][1]}")

    @staticmethod
    def check_group_options(group: Mapping[str, Any]) -> None:
        """Refuse a group's ``rounding``, ``param_rounding``, ``seed`` and flags set to
        what this optimizer does not take (keys may be set on a group after
        construction).

        Raises:
            ValueError: naming the option, its value and what is allowed.
        """
        check_rounding(group["rounding"])
        check_param_rounding(group.get("param_rounding", "stochastic"))
        check_seed(group["seed"])
        for flag in ("decoupled_weight_decay", "maximize"):
            if not isinstance(group.get(flag, False), bool):
                raise ValueError(f"{flag} must be True or False, got {group[flag]!r}")
        if group.get("amsgrad"):  # torch's key: no route keeps max_exp_avg_sq
            raise ValueError(
                f"amsgrad={group['amsgrad']!r} is not supported by optladder's AdamW: set "
                f"amsgrad=False or leave it out ({_GROUP_FLAG_INSTEAD['amsgrad']})"
            )

    def _plan_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        start: int,
        created: list[torch.Tensor],
        previous: _GroupPlan | None = None,
    ) -> _GroupPlan:
        """Route each param of a group with a grad to an entry of the dispatch table
        (:meth:`~.dispatch.DispatchTable.route`), create the state of those stepping for
        the first time (appended to ``created``): a new :class:`_GroupPlan`.

        Raises:
            ValueError: if a grad is sparse, a grad torch's kernels cannot take, or
                ``backend`` names a kernel that cannot step a param.
            optladder.optimizers.kernels.cpu.KernelBuildError: with ``backend="cpu"``,
                when the C kernel cannot be built.
        """
        routes: dict[str, list[tuple[torch.Tensor, int]]] = {
            "eager": [],
            "cpu": [],
            "staged": [],
            "triton": [],
            "torch_fused": [],
            "torch_foreach": [],
        }
        reasons: dict[int, str] = {}
        # rows of the group's last plan whose param has no grad now stay rows, skipped
        # (a param with a grad at some steps only: an expert, a task's head): a plan
        # then covers every param that had a grad, and steps that change which have
        # one keep it (:meth:`_GroupPlan.check`)
        moment_dtype = self.group_moment_dtype(group)
        rung = "fp32" if moment_dtype == torch.float32 else "bf16"
        route = self.dispatch.route
        kept = {}
        torch_kept: dict[int, str] = {}  # torch's kernels' params kept without a grad
        if previous is not None:
            kept = previous.rows_to_keep(group, params, self.state, moment_dtype)
            torch_kept = previous.torch_to_keep(group, params, self.state, moment_dtype)
        carried: dict[int, tuple[Any, ...]] = {}
        for k, (p, grad) in enumerate(zip(params, grads)):
            if grad is None:
                kind = kept.get(k)
                if kind is not None:
                    routes["cpu"].append((p, start + k))
                    carried[k] = kind
                elif k in torch_kept:
                    routes[torch_kept[k]].append((p, start + k))
                continue
            if grad.is_sparse:
                raise ValueError(
                    f"param {start + k} has a sparse grad; optladder's AdamW needs dense grads"
                )
            name, reason = route(rung, p, grad, start + k, moment_dtype)
            routes[name].append((p, start + k))
            if reason is not None:
                reasons[start + k] = reason
        for name in ("torch_fused", "torch_foreach"):
            for p, i in routes[name]:
                st = self.state[p]
                if len(st) == 0:
                    created.append(p)
                    st.update(torchroute.init_state(p, name == "torch_fused"))
                else:
                    torchroute.ready_state(p, st, name == "torch_fused", f"param {i}")
        for name, items in routes.items():
            if name.startswith("torch_"):
                continue
            for p, _ in items:
                if len(self.state[p]) == 0:
                    created.append(p)
                    self._init_state(p, moment_dtype)
                    continue
                st = self.state[p]
                if st["step"].dtype != STEP_DTYPE:  # state set by hand
                    st["step"] = st["step"].to(STEP_DTYPE)
                for key in ("exp_avg", "exp_avg_sq"):  # torch's layout (the fp32 format's,
                    m = st.get(key)  # flipped): contiguous copies, as a load makes them
                    if type(m) in PLAIN_TYPES and m.shape == p.shape and not m.is_contiguous():
                        st[key] = m.contiguous()
        for p, _ in routes["triton"]:
            st = self.state[p]
            if st["step"].device != p.device:
                st["step"] = st["step"].to(p.device)
        if routes["staged"]:
            staged = []
            for p, i in routes["staged"]:  # moments the kernel can point at, else eager
                if _kernel_moments(self.state[p], p, moment_dtype):
                    staged.append((p, i))
                else:
                    routes["eager"].append((p, i))
                    reasons[i] = "its moments are not contiguous tensors of its shape"
            routes["staged"] = staged
        states = [self.state[p] for p, _ in routes["cpu"]]
        return _GroupPlan(
            group, params, grads, start, routes, reasons, states, carried, moment_dtype
        )

    def _place_cpu_params(self, plans: list[_GroupPlan]) -> bool:
        """Make the C kernel's one table of every group's C kernel params (rows in group
        order, each group's rows stepped with its options) unless the plans are those it
        was made for; returns whether it was made.

        Raises:
            ValueError: from :class:`~.kernels.cpu.KernelTable` (a tensor it cannot
                point at).
        """
        with_rows = [plan for plan in plans if plan.routes["cpu"]]
        if same_objects(with_rows, self._table_plans) and (
            self._cpu_table is not None or not with_rows
        ):
            return False
        from optladder.optimizers.kernels import cpu

        self._cpu_table, self._table_plans = None, []
        self._table_held, self._table_ptrs = [], []
        if not with_rows:
            return True
        items = [(plan, g, p, i) for g, plan in enumerate(with_rows) for p, i in plan.routes["cpu"]]
        states = [st for plan in with_rows for st in plan.states]
        table = cpu.KernelTable(
            [p for _, _, p, _ in items],
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [st["step"] for st in states],
            [i for _, _, _, i in items],
            [g for _, g, _, _ in items],
            [plan.moment_dtype for plan in with_rows],
        )
        first = 0
        for g, plan in enumerate(with_rows):
            plan.place(table, first, g)
            first += len(plan.routes["cpu"])
        self._cpu_table, self._table_plans = table, with_rows
        self._table_held = self._table_tensors(with_rows)
        self._table_ptrs = list(map(_DATA_PTR, self._table_held))
        return True

    @staticmethod
    def _table_tensors(plans: list[_GroupPlan]) -> list[torch.Tensor]:
        """What the C kernel's table points into, as the plans' state dicts hold it now:
        every row's param, then every row's ``exp_avg``, ``exp_avg_sq`` and ``step``.

        Raises:
            KeyError: a state dict lost one of them.
        """
        states = chain.from_iterable(plan.states for plan in plans)
        return list(
            chain(
                chain.from_iterable(plan.cpu_params for plan in plans),
                chain.from_iterable(map(_STATE_TENSORS, states)),
            )
        )

    def _table_points_right(self) -> bool:
        """Whether the C kernel's table still points at its params and their state: the
        same tensors (a load or a hand edit can put new ones in the same state dicts) in
        the same memory (``st["exp_avg"].data = ...`` keeps the tensor: the table would
        step the memory it held, freed unless something else holds it). One pass over
        every row, for all groups; True without a table."""
        if self._cpu_table is None:
            return True
        try:
            held = self._table_tensors(self._table_plans)
        except KeyError:
            return False
        return same_objects(held, self._table_held) and (
            list(map(_DATA_PTR, held)) == self._table_ptrs
        )

    def release_scratch(self) -> None:
        """Drop the prepared step, the eager path's scratch buffers and the kernel tables."""
        self._buckets = None
        self._bucket_plans = []
        self._scratch.clear()
        self._stage.clear()
        self._cpu_table, self._table_plans = None, []
        self._table_held, self._table_ptrs = [], []
        self._group_plans.clear()
        self._torch_routes = None
        self._steady = None
        if self._eightbit is not None:
            self._eightbit.drop_kernel_step()
            self._eightbit.release_scratch()
            self._eightbit.release_tables()

    def release_tables(self) -> None:
        """Drop the kept plans and kernel tables (they hold the state's tensors): before
        the state moves to another format or is replaced; the next step makes them
        again."""
        self._group_plans.clear()
        self._torch_routes = None
        self._steady = None
        self._cpu_table, self._table_plans = None, []
        self._table_held, self._table_ptrs = [], []
        self._state_seen, self._state_lens = [], []
        if self._eightbit is not None:
            self._eightbit.release_tables()

    def _write_cpu_steps(self) -> None:
        """Read the step counts of every C kernel param (one call), refuse those out of
        range (see :meth:`_check_steps`), and write this step's scalars and each
        group's options into the table: the bias corrections and the random bits' key
        prefix, computed once per distinct (step count, betas) and (seed, step count)."""
        table = self._cpu_table
        if table is None:
            return
        limit = BF16_MAX_STEP  # both moment dtypes: the random bits' key and power()
        steps = table.read_steps()
        if steps and not (min(steps) >= 0 and max(steps) <= limit):
            rows = [i for plan in self._table_plans for _, i in plan.routes["cpu"]]
            for i, step in zip(rows, steps):
                if not 0 <= step <= limit:
                    raise ValueError(
                        f"param {i} has step {step:.0f}; this rung steps from counts in "
                        f"[0, {limit:,}]"
                    )
        together = steps.count(steps[0]) == len(steps)  # every param at one count
        keys: dict[tuple[int, int], int] = {}  # shared by groups of one seed and step
        # by value and type: a numpy float32 beta equal to a float one (0.75) gives other
        # bias corrections (numpy float32 arithmetic, as the eager path computes them)
        corrections: dict[tuple[float, float, int, type, type], tuple[float, float]] = {}
        for plan in self._table_plans:
            n_rows = len(plan.routes["cpu"])
            if together:
                new_steps = [steps[0] + 1.0] * n_rows
            else:
                new_steps = [s + 1.0 for s in steps[plan.first : plan.first + n_rows]]
            self._write_group_scalars(
                table, plan.group, new_steps, plan.first, plan.table_group, keys, corrections
            )

    @staticmethod
    def _write_group_scalars(
        table: Any,
        group: dict[str, Any],
        new_steps: list[float],
        first: int,
        table_group: int,
        keys: dict[tuple[int, int], int],
        corrections: dict[tuple[float, float, int, type, type], tuple[float, float]],
    ) -> None:
        """Write the scalars of rows ``first, ...`` of ``table`` (one param group's, at
        the new step counts ``new_steps``) and the group's options (its group number
        ``table_group`` in the table); ``keys`` and ``corrections`` memoize the random
        bits' keys and the bias corrections across calls of one step."""
        from optladder.optimizers import eager

        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        seed = group["seed"]
        scalars = {}
        for s in set(new_steps):
            n = int(s)
            key = keys.get((seed, n))
            if key is None:
                key = keys[seed, n] = step_key(seed, n)
            ckey = (beta1, beta2, n, type(beta1), type(beta2))
            found = corrections.get(ckey)
            if found is None:
                found = corrections[ckey] = eager.bias_corrections(beta1, beta2, n)
            scalars[s] = (key, -lr / found[0], found[1])  # as eager.step_scalars
        table.set_scalars(new_steps, scalars, first)
        table.set_options(
            table_group,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            lr=lr,
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            maximize=group["maximize"],
            stochastic=group["rounding"] == "stochastic",
            param_stochastic=group.get("param_rounding", "stochastic") == "stochastic",
        )

    def _prepare_staged(self, plans: list[_GroupPlan]) -> None:
        """Ready the staged params' step (the C kernel on contiguous copies of a param
        and its grad that are not contiguous: transposed, ``channels_last``, a slice):
        one buffer per device for the largest param's and grad's copies (the params
        step one after another through it; the eager path would take 82 bytes an
        element of scratch for them), and per param a one-row kernel table pointing at
        the copies and at its moments and step count, with this step's scalars. The
        kernel indexes the random bits by the copies' (row-major) element order, as the
        eager path does for such a param, so the bits are the eager path's."""
        from optladder.optimizers.kernels import cpu

        need: dict[torch.device, int] = {}
        for plan in plans:
            plan.staged.clear()  # in place: a new list a step per group outlives the step
            for p, _ in plan.routes["staged"]:
                grad = cast(torch.Tensor, p.grad)
                size = _stage_offset(p) + grad.numel() * grad.element_size()
                need[p.device] = max(need.get(p.device, 0), size)
        for device, size in need.items():
            have = self._stage.get(device)
            if have is None or have.numel() < size:
                self._stage.pop(device, None)
                self._stage[device] = torch.empty(size, dtype=torch.uint8, device=device)
        keys: dict[tuple[int, int], int] = {}
        corrections: dict[tuple[float, float, int, type, type], tuple[float, float]] = {}
        for plan in plans:
            for p, i in plan.routes["staged"]:
                grad = cast(torch.Tensor, p.grad)
                buffer = self._stage[p.device]
                offset = _stage_offset(p)
                work = buffer[: p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                work_grad = (
                    buffer[offset : offset + grad.numel() * grad.element_size()]
                    .view(grad.dtype)
                    .view(p.shape)
                )
                st = self.state[p]
                table = cpu.KernelTable(
                    [work],
                    [st["exp_avg"]],
                    [st["exp_avg_sq"]],
                    [st["step"]],
                    [i],
                    moment_dtypes=[plan.moment_dtype],
                )
                table.set_grads([work_grad])
                (step,) = table.read_steps()
                self._write_group_scalars(table, plan.group, [step + 1.0], 0, 0, keys, corrections)
                plan.staged.append((p, i, table, work, work_grad))

    def _check_steps(self, plans: list[_GroupPlan]) -> None:
        """Refuse a step count this rung cannot step from, before anything is written
        (the eager path's; the C kernel's are checked where they are read,
        :meth:`_write_cpu_steps`; the Triton path keeps ``step`` on the device, where
        reading it would synchronize; a checkpoint's steps are checked at load).

        Raises:
            ValueError: naming the param, its step and the limit
                (:data:`optladder.optimizers.steps.BF16_MAX_STEP` with either moment
                dtype: the random bits' key and the bias corrections' powering
                (:func:`~optladder.optimizers.eager.power`) take 32-bit steps).
        """
        limit = BF16_MAX_STEP  # both moment dtypes: the random bits' key and power()
        for plan in plans:
            for p, i in chain(plan.routes["eager"], plan.routes["staged"]):
                step = float(self.state[p]["step"].item())
                if not 0 <= step <= limit:
                    raise ValueError(
                        f"param {i} has step {step:.0f}; this rung steps from counts in "
                        f"[0, {limit:,}]"
                    )

    def _make_buckets(
        self, plans: list[_GroupPlan], launches: list[dispatch.TritonLaunch], eight: Any
    ) -> list[tuple[dispatch.Entry, Any]]:
        """The prepared step: per entry of the dispatch table that steps some param this
        step, the entry and its payload (:mod:`~optladder.optimizers.dispatch`), in the
        commit's order. Everything was allocated before: the Triton ``launches``
        (:meth:`_prepare_triton`), torch's fused calls (:meth:`_prepare_torch`), the C
        kernel's table, the staged copies, the eager scratch, the 8bit groups' step
        (``eight``, prepared, or None)."""
        entries = self.dispatch.entries
        payloads: dict[str, Any] = {}
        if launches:
            payloads["triton"] = launches
        for entry, payload in self._torch_buckets(plans):
            payloads[entry.name] = payload
        if self._cpu_table is not None:
            payloads["cpu"] = dispatch.CpuCall(self._cpu_table, self._table_plans)
        if eight is not None:
            payloads["8bit"] = eight
        staged = [item for plan in plans for item in plan.staged]
        if staged:
            payloads["staged"] = staged
        state, scratch = self.state, self._scratch
        eager = [
            dispatch.EagerItem(p, state[p], plan.group, i, plan.moment_dtype, scratch[p.device])
            for plan in plans
            for p, i in plan.routes["eager"]
        ]
        if eager:
            payloads["eager"] = eager
        return [(entries[name], payloads[name]) for name in dispatch.ROUTES if name in payloads]

    def _torch_buckets(self, plans: list[_GroupPlan]) -> list[tuple[dispatch.Entry, Any]]:
        """The prepared step's torch entries: the plans' fused calls (made by
        :meth:`_prepare_torch`) and their foreach params' lists."""
        entries = self.dispatch.entries
        buckets: list[tuple[dispatch.Entry, Any]] = []
        with_calls = [plan for plan in plans if plan.torch_calls]
        if with_calls:
            calls = [c for plan in with_calls for c in plan.torch_calls]
            direct = all(plan.torch_numbers for plan in with_calls)  # read in prepare
            fused = dispatch.FusedCalls(calls, with_calls, direct, self._torch_counts)
            buckets.append((entries["torch_fused"], fused))
        parts = [
            (plan.group, self._torch_lists(plan.routes["torch_foreach"]))
            for plan in plans
            if plan.routes["torch_foreach"]
        ]
        if parts:
            buckets.append((entries["torch_foreach"], dispatch.ForeachCalls(parts)))
        return buckets

    def commit_step(
        self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
    ) -> None:
        """Phase two of a step: one call per prepared entry of the dispatch table
        (:mod:`~optladder.optimizers.dispatch`), writing params, moments and step counts,
        allocating nothing (the kernels update in place; the eager path uses the prepared
        scratch; torch's foreach AdamW, which allocates, steps copies before anything is
        written, copied back after).

        Args:
            grad_scale: ``torch.amp.GradScaler``'s scale, when the grads are still scaled:
                the entries whose kernel takes it (Triton, torch's fused kernel) divide
                their grads themselves, as torch's fused kernel does (a grad two of their
                params share is divided for each); the grads of the others are divided
                in place here, each distinct memory once (:func:`distinct_grads`:
                :meth:`step` refuses grads that partly share memory before anything is
                written).
            found_inf: its inf/NaN flag; when set, nothing changes, step counts included
                (read on the host once when an entry steps on the host).

        Should a run raise anyway (it should not: nothing in it allocates), the error is
        re-raised after :attr:`commit_outcome` records which groups the entries that had
        run stepped, which the failing entry's may have partly stepped, and which the
        entries after it did not touch (:meth:`_commit_outcome`).

        Raises:
            RuntimeError: if :meth:`prepare_step` did not run first.
            Whatever torch's foreach AdamW raised on the copies (an OOM): nothing was
                written, the state the prepare created is dropped.
        """
        buckets = self._buckets
        if buckets is None:
            raise RuntimeError("commit_step() needs prepare_step() first")
        self._buckets = None
        # the plans, for a failure's outcome only: not kept past the commit (they hold the
        # state, which a move frees param by param)
        plans, self._bucket_plans = self._bucket_plans, []
        self.commit_outcome = None
        created, self._created = self._created, []
        host = [bucket for bucket in buckets if bucket[0].amp == "host"]
        if host and found_inf is not None and bool(found_inf.item() != 0):  # host: a sync
            for entry, payload in host:
                if entry.skip is not None:
                    entry.skip(payload)
            host = []
        unscale: list[torch.Tensor] = []
        if grad_scale is not None and host:  # each grad once, also one held twice
            unscale = distinct_grads([g for entry, payload in host for g in entry.grads(payload)])
        try:
            for entry, payload in host:
                if entry.stage is not None:
                    entry.stage(payload, grad_scale)
        except BaseException:  # nothing written yet: as before the prepare
            self.commit_outcome = ([], [], list(range(len(self.param_groups))))
            self._drop_created(created)
            raise
        ran: list[str] = []  # the entries whose run finished
        running = None  # and the one running
        try:
            for entry, payload in buckets:
                if entry.amp == "kernel":
                    running = entry.name
                    entry.run(payload, grad_scale, found_inf)
                    ran.append(running)
            running = None
            if grad_scale is not None:
                unscale_grads_(unscale, grad_scale)
            for entry, payload in host:
                running = entry.name
                entry.run(payload, None, None)
                ran.append(running)
        except BaseException:
            self.commit_outcome = self._commit_outcome(plans, ran, running)
            raise

    def _commit_outcome(
        self, plans: list[_GroupPlan], ran: list[str], running: str | None
    ) -> tuple[list[int], list[int], list[int]]:
        """Which groups a commit that failed had written, by their places in
        ``param_groups``: ``(stepped, partly, not_stepped)``, from the step's group
        ``plans``. A group is stepped when
        every entry that steps one of its params (one with a grad: a plan's route of
        that entry's name, or the ``"8bit"`` entry for an 8bit group) had finished
        (``ran``); partly stepped when the failing entry (``running``) steps one of them,
        or some of its entries had finished and others had not run; not stepped when
        none of its entries had started (a group without grads among them). An entry's
        run is one call (the C kernel's over every group's rows, torch's fused calls of
        every group), so each of the failing entry's groups may be partly stepped."""
        entries: dict[int, set[str]] = {}  # id(group) -> the entries stepping its params
        for plan in plans:
            for name, items in plan.routes.items():
                if any(p.grad is not None for p, _ in items):
                    entries.setdefault(id(plan.group), set()).add(name)
        for group in self.param_groups:
            if group.get(RUNG_KEY) == "8bit" and any(p.grad is not None for p in group["params"]):
                entries.setdefault(id(group), set()).add("8bit")
        done = set(ran)
        started = done | ({running} if running is not None else set())
        stepped: list[int] = []
        partly: list[int] = []
        not_stepped: list[int] = []
        for gi, group in enumerate(self.param_groups):
            names = entries.get(id(group), set())
            if names and names <= done:
                stepped.append(gi)
            elif names & started:
                partly.append(gi)
            else:
                not_stepped.append(gi)
        return stepped, partly, not_stepped

    def _torch_lists(self, items: list[tuple[torch.Tensor, int]]) -> tuple[list[Any], ...]:
        """Torch's functional AdamW's lists for ``items``: params, grads, ``exp_avg``,
        ``exp_avg_sq``, ``max_exp_avg_sq`` (empty), ``step``."""
        items = [item for item in items if item[0].grad is not None]
        states = [self.state[p] for p, _ in items]
        return (
            [p for p, _ in items],
            [cast(torch.Tensor, p.grad) for p, _ in items],
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [],
            [st["step"] for st in states],
        )

    @staticmethod
    def _triton_batches(
        items: list[tuple[torch.Tensor, int]],
    ) -> dict[tuple[torch.device, torch.dtype, torch.dtype], list[tuple[torch.Tensor, int]]]:
        """The params of one Triton launch each: per (device, param dtype, grad dtype)."""
        batches: dict[
            tuple[torch.device, torch.dtype, torch.dtype], list[tuple[torch.Tensor, int]]
        ] = {}
        for p, i in items:
            grad = p.grad
            assert grad is not None
            batches.setdefault((p.device, p.dtype, grad.dtype), []).append((p, i))
        return batches

    def _launch_lists(self, batch: list[tuple[torch.Tensor, int]]) -> tuple[list[Any], ...]:
        """The Triton launch's per-param lists for ``batch``: params, grads, ``exp_avg``,
        ``exp_avg_sq``, ``step`` tensors and param indices."""
        states = [self.state[p] for p, _ in batch]
        return (
            [p.detach() for p, _ in batch],
            [cast(torch.Tensor, p.grad).detach() for p, _ in batch],
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [st["step"] for st in states],
            [i for _, i in batch],
        )

    def _prepare_triton(self, plans: list[_GroupPlan]) -> list[dispatch.TritonLaunch]:
        """The Triton launches of this step, one per group and (device, param dtype, grad
        dtype): their lists, device tables and a tensor lr's float32 copy on the device,
        so that the commit's launches allocate nothing."""
        launches: list[dispatch.TritonLaunch] = []
        for plan in plans:
            items = plan.routes["triton"]
            if not items:
                continue
            from optladder.optimizers.kernels import triton_adamw

            lr = plan.group["lr"]
            for (device, _, _), batch in self._triton_batches(items).items():
                lists = self._launch_lists(batch)
                triton_adamw.prepare_tables(*lists)
                lr_tensor = None
                if isinstance(lr, torch.Tensor):
                    lr_tensor = lr.detach().to(device=device, dtype=torch.float32).reshape(())
                launches.append(dispatch.TritonLaunch(plan.group, lists, device, lr_tensor))
        return launches

    def _step_param(self, p: torch.Tensor, group: dict[str, Any], param_index: int) -> None:
        """The readable oracle of one param's step (prepare every new value, then
        commit), in plain torch ops: the bits the kernels and the eager path write.

        The math is float32 (the moments widened, the IEEE float32 square root), the
        moments are written in the group's format (bfloat16: :func:`round_moments`) and
        the param in its dtype (:func:`round_param`), but a float64 param, which gets the
        float32 update added in float64, decoupled decay applied in float64 (as
        :func:`~optladder.optimizers.eager.eager_step`): it is never rounded to float32.

        Args:
            p: the param (float32, bfloat16, float16, float64) with a dense grad.
            group: its param group.
            param_index: its index over all groups (the random bits' counter).
        """
        moment_dtype = self.group_moment_dtype(group)
        state = self._init_state(p, moment_dtype)
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        step = int(state["step"].item()) + 1

        # Prepare every new value first, then commit: an error before the commit
        # leaves the param, the moments and the step count as they were.
        grad = cast(torch.Tensor, p.grad).detach().to(torch.float32, copy=True)
        if group["maximize"]:
            grad.neg_()
        param = p.detach().to(torch.float32, copy=True)
        # a float64 param: the float32 update is added to it in float64, decoupled decay
        # applied in float64 too, so it is never rounded to float32 (lr=0 keeps its bits)
        wide = p.detach().to(torch.float64, copy=True) if p.dtype == torch.float64 else None
        if wd != 0:
            if not group["decoupled_weight_decay"]:
                grad.add_(param, alpha=wd)
            elif wide is not None:
                wide.mul_(1.0 - lr * wd)
            else:
                param.mul_(1.0 - lr * wd)
        if wide is not None:
            param.zero_()  # below, param is the float32 update
        exp_avg = state["exp_avg"].to(torch.float32, copy=True)
        exp_avg_sq = state["exp_avg_sq"].to(torch.float32, copy=True)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        step_size, bias_correction2_sqrt = step_scalars(lr, beta1, beta2, step)
        root = exp_avg_sq.double().sqrt().float()  # the IEEE float32 root (see eager.py)
        denom = (root / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=step_size)
        key = element_key(group["seed"], step, param_index)
        if moment_dtype == torch.bfloat16:
            new_avg, new_avg_sq = round_moments(exp_avg, exp_avg_sq, key, group["rounding"])
        else:
            new_avg, new_avg_sq = exp_avg, exp_avg_sq
        if wide is not None:
            new_param = wide.add_(param)  # the float32 update, added in float64
        else:
            new_param = round_param(param, p.dtype, key, group.get("param_rounding", "stochastic"))

        p.copy_(new_param)
        state["exp_avg"].copy_(new_avg)
        state["exp_avg_sq"].copy_(new_avg_sq)
        state["step"].fill_(float(step))
