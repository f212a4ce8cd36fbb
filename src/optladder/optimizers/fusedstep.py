"""torch's fused AdamW kernel called directly, on lists made in the prepare phase: the
commit of the fp32 format's float32/float64 params in
:class:`~optladder.optimizers.adamw.LadderAdamW` (:mod:`~optladder.optimizers.torchroute`).

torch's ``AdamW.step`` walks every param each step (``_init_group``: the grad, the state
dict by a tensor-keyed lookup, four lists) and then sorts the lists by device and dtype
(``_group_tensors_by_device_and_dtype``): on many small tensors that costs more than
the kernel. The prepare phase has already read every grad and made every state, so it
makes the lists torch would build, one call per group and (device, dtype)
(:func:`group_call`), and :func:`run_fused_plan` makes the calls as torch's
``_fused_adam`` does (``step += 1``, then ``torch._fused_adamw_``, or
``torch._fused_adam_`` for Adam; the step counts of every group bumped in one pass,
:class:`StepCounts`), so the result is bit for bit ``torch.optim.AdamW(fused=True)``'s.
A step with ``grad_scale``/``found_inf`` or a hyperparameter that is not a Python number
(:func:`numbers_only`) goes through torch's functional fused AdamW on the same lists.

A param that is not dense (a column slice of a buffer: its elements leave gaps in its
storage, :func:`optladder.columns.dense`) is stepped through a contiguous copy made in
prepare and written back after the kernel: torch's fused kernels step a param's memory as
``numel`` consecutive elements from its first, so on the param itself they would update
the wrong elements and write over the elements of the buffer between its rows (torch
2.13's own ``AdamW(fused=True)`` does).

It also holds the checks the optladder optimizer runs when params change
(:func:`refuse_resized`) and the moments' layout rule (:func:`laid_out_like`).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, compress, repeat
from typing import Any, cast

import torch

from optladder.columns import PLAIN_TYPES, dense, plain_types
from optladder.optimizers.adamw import LadderAdamW, is_8bit_group
from optladder.optimizers.stepmemo import same_objects
from optladder.optimizers.steps import refuse_shared_steps
from optladder.optimizers.torchroute import state_moment_dtype
from optladder.sharding import local_numel

_EXP_AVG = operator.itemgetter("exp_avg")
_EXP_AVG_SQ = operator.itemgetter("exp_avg_sq")
_STEP = operator.itemgetter("step")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_DATA_PTR = torch.Tensor.data_ptr

Copies = tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]
"""``(fills, write-backs)`` of the params stepped through contiguous buffers: ``(buffer,
source)`` pairs copied before the kernel (the param, and its grad when that is not
contiguous), ``(param, buffer)`` pairs copied back after it."""

FusedCall = tuple[Any, tuple[list[torch.Tensor], ...], dict[str, Any], Copies]
"""``(kernel, tensor lists, keyword options, copies)`` of one ``torch._fused_adam(w)_``
call; see :data:`Copies`."""


def steps_through_copy(p: torch.Tensor) -> bool:
    """Whether the direct kernel call steps ``p`` through a contiguous copy: a plain
    tensor (not a DTensor or other subclass, whose strides may describe a global
    tensor) with elements that is not dense (:func:`optladder.columns.dense`)."""
    return type(p) in PLAIN_TYPES and p.numel() > 0 and not dense(p)


def nondense_places(params: Sequence[torch.Tensor]) -> list[int]:
    """The places in ``params`` of the params that :func:`steps_through_copy` (contiguity
    is read in C, the few non-contiguous params are looked at one by one)."""
    return [
        i
        for i in compress(
            range(len(params)), map(operator.not_, map(torch.Tensor.is_contiguous, params))
        )
        if steps_through_copy(params[i])
    ]


_NUMEL = torch.Tensor.numel
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_STATE_KEYS = (*_MOMENT_KEYS, "state1", "state2")
"""The per-param state tensors of a param's shape: the Adam layout's moments, and
bitsandbytes' 8-bit codes (or float32 moments below its size rule)."""


def refuse_resized(
    engine: LadderAdamW,
    grads: Sequence[Sequence[torch.Tensor | None]],
    group_names: Mapping[int, str] | None = None,
) -> None:
    """Raise before anything is allocated or written when a param with a grad no longer
    has its grad's or its state tensors' element count: its ``.data`` was replaced by a
    tensor of another size after its state was made or its grad computed (model surgery,
    pruning or growing code).

    The kernels step ``param.numel()`` elements of every tensor of the param: torch's
    fused CPU kernel would read and write past the smaller ones (heap corruption, then an
    abort), optladder's C kernels would step part of the param, and the eager paths fail
    on the size mismatch part-way through a commit. It reads each param's, grad's and
    state tensor's element count, in C; the optladder optimizer runs it when its per-step
    check finds the params changed (their byte counts or layouts), a two-phase step
    without a memo at every step.

    Args:
        engine: an optimizer whose state prepare has made (the Adam layout's moments, or
            bitsandbytes' ``state1``/``state2`` in its 8bit groups, which hold the local
            shard of a DTensor param: the param's local element count is compared with
            them).
        grads: per group, every param's grad (None where it has none), in order.
        group_names: ``id(group) -> name`` for the message (default ``"group {i}"``).

    It also refuses a param (with a grad or not) whose state is in another layout than
    the engine keeps (:func:`_refuse_foreign_layouts`).

    Raises:
        ValueError: naming the param, its element count (or dtype) and the tensor that
            differs; or the layout its state has and the engine's.
    """
    _refuse_foreign_layouts(engine, group_names)
    state = engine.state
    for gi, (group, gs) in enumerate(zip(engine.param_groups, grads)):
        present = list(map(operator.is_not, gs, repeat(None)))
        params, live = group["params"], cast(list[torch.Tensor], gs)
        if not all(present):
            params = list(compress(params, present))
            live = list(compress(cast(list[torch.Tensor], gs), present))
        if not params:
            continue
        states = [state.get(p) for p in params]
        numels = list(map(_NUMEL, params))
        shards = is_8bit_group(group)
        mine = numels if not shards or plain_types(params) else list(map(local_numel, params))
        keys = [k for k in _STATE_KEYS if any(st and k in st for st in states)]
        tensors: list[tuple[str, list[Any], list[int]]] = [("grad", live, numels)]
        tensors += [(k, [st.get(k) if st else None for st in states], mine) for k in keys]
        for name, column, want in tensors:
            if not any(map(operator.is_, column, repeat(None))):  # not `in`: Tensor ==
                if want == list(map(_NUMEL, column)):
                    continue
            elif all(t is None or t.numel() == n for t, n in zip(column, want)):
                continue
            for p, n, t in zip(params, want, column, strict=True):
                if t is not None and t.numel() != n:
                    raise ValueError(
                        f"{_param_name(group, gi, p, group_names)} has {n:,} elements but "
                        f"its {name} has {t.numel():,}: the param was resized (its .data "
                        "replaced) after its state was made or its grad computed, and "
                        "stepping it would write past the smaller tensor. Build a new "
                        "optimizer for the resized model, or drop the param's state (del "
                        "opt.state[param]) to start it afresh"
                    )


def _layout_name(state: Mapping[str, Any]) -> str:
    """One param's state layout in words, for messages."""
    if "state1" in state:
        return "bitsandbytes' 8-bit state (state1, state2)"
    m = state.get("exp_avg")
    if isinstance(m, torch.Tensor):
        return f"exp_avg {m.dtype}"
    return f"the keys {sorted(map(str, state))}"


def _refuse_foreign_layouts(engine: LadderAdamW, group_names: Mapping[int, str] | None) -> None:
    """Raise when a param of ``engine``'s groups holds state in another layout than the
    engine keeps: bitsandbytes' ``state1``/``state2`` on the 8bit rung, Adam moments of
    :class:`~optladder.optimizers.adamw.LadderAdamW`'s ``moment_dtype`` (bf16 rung, and
    fp32 rung of bfloat16/float16 params). A move to another rung converts the state of the
    groups' params only: a param taken out of its group by hand keeps its state as it
    was (torch keeps it too), and appended back after the move it was refused by a
    kernel's table (bf16) or failed the commit half-way (8bit)."""
    state = engine.state
    for gi, group in enumerate(engine.param_groups):
        bnb = is_8bit_group(group)  # its 8bit format
        moment_dtype = engine.group_moment_dtype(group)
        if bnb:
            want = "bitsandbytes' 8-bit state (state1, state2)"
        else:
            want = f"{str(moment_dtype).removeprefix('torch.')} exp_avg and exp_avg_sq"
        for p in group["params"]:
            st = state.get(p)
            if not st:
                continue
            m = st.get("exp_avg")
            if bnb:
                fits = "state1" in st
            else:  # the fp32 format's torch params: their dtype
                want_dtype = state_moment_dtype(p, moment_dtype)
                fits = isinstance(m, torch.Tensor) and m.dtype == want_dtype
            if fits:
                continue
            changed = (  # the fp32 format's moments, of the param's dtype before
                not bnb
                and isinstance(m, torch.Tensor)
                and torch.bfloat16 not in (m.dtype, want_dtype)
                and "state1" not in st
            )
            if changed:
                raise ValueError(  # Adam moments of another dtype: the param's changed
                    f"{_param_name(group, gi, p, group_names)} is {p.dtype} but its "
                    f"exp_avg is {m.dtype}, and its group's format keeps {want_dtype} "
                    "moments for it: the param's dtype changed after its state was made "
                    "(module.to(dtype)). Build the optimizer after converting the model "
                    "(and load a checkpoint into it), or drop the param's state (del "
                    "opt.state[param]) to start it afresh"
                )
            raise ValueError(
                f"{_param_name(group, gi, p, group_names)} holds state in another layout "
                f"({_layout_name(st)}) than its group's engine keeps ({want}): it was out of "
                "its group's params when the optimizer moved to another rung (a move "
                "converts the groups' params only) and was put back by hand. Drop its state "
                "(del opt.state[param]) to start it afresh; to freeze a param for a while, "
                "leave it in its group with requires_grad_(False) (no grad: not stepped, "
                "and moves convert its state)"
            )


def _param_name(
    group: dict[str, Any], gi: int, p: torch.Tensor, group_names: Mapping[int, str] | None
) -> str:
    """``"param {place in its group} of {group's name}"`` for messages (the group named
    by ``group_names``, default ``"group {gi}"``)."""
    pi = next(i for i, q in enumerate(group["params"]) if q is p)
    where = group_names.get(id(group)) if group_names else None
    return f"param {pi} of {where or f'group {gi}'}"


def memory_order(p: torch.Tensor) -> list[int]:
    """The dims of dense ``p`` from the largest stride to the smallest (size-1 dims where
    they are): ``p.permute(memory_order(p))`` is a contiguous view of the same memory."""
    strides = p.stride()
    return sorted(range(p.dim()), key=lambda d: (-strides[d], d))


def strided_in_place(params: Sequence[torch.Tensor]) -> list[int]:
    """The places in ``params`` of CPU params that are dense but not contiguous (a
    transposed or ``channels_last`` weight, stepped in place, not through a copy).
    torch's CPU fused kernel copies such a tensor to contiguous memory inside its call,
    in the commit, where an out-of-memory error can no longer be rolled back;
    :func:`group_call` hands it contiguous views of the param, its grad and its moments
    (all laid out alike, :func:`laid_out_like`) in their memory order instead, which
    pair the same elements at the same places in memory and allocate nothing."""
    return [
        i
        for i, p in enumerate(params)
        if p.device.type == "cpu"
        and type(p) in PLAIN_TYPES
        and not p.is_contiguous()
        and not steps_through_copy(p)
        and p.numel() > 0
    ]


def numbers_only(group: Mapping[str, Any]) -> bool:
    """Whether ``group``'s hyperparameters (``lr``, ``betas``, ``weight_decay``, ``eps``)
    are Python numbers or numpy float64 scalars, as the direct kernel call takes them."""
    options = (group["lr"], *group["betas"], group["weight_decay"], group["eps"])
    return all(isinstance(v, float) or type(v) is int for v in options)  # numpy's float64 too


def laid_out_like(m: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether moment ``m`` is laid out as torch's fused kernel needs for param ``p``: the
    same strides over the dims of more than one element when ``p`` is dense (so element
    ``k`` in memory is the same element of both), contiguous when it is not (such a param
    is stepped through a contiguous copy, see the module's docstring)."""
    if not dense(p):
        return m.is_contiguous()
    return all(a == b for a, b, n in zip(m.stride(), p.stride(), p.shape) if n > 1)


def laid_out_copy(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A copy of moment ``m`` (of ``p``'s shape) laid out as :func:`laid_out_like` asks:
    like ``p`` when ``p`` is dense, contiguous when it is not (the values are ``m``'s)."""
    if dense(p):
        like = torch.empty_like(p, dtype=m.dtype, memory_format=torch.preserve_format)
    else:
        like = torch.empty(p.shape, dtype=m.dtype, device=m.device)
    return like.copy_(m)


def group_call(
    group: Mapping[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: Sequence[Mapping[str, Any]],
    nondense: Sequence[int],
    previous: FusedCall | None = None,
) -> FusedCall:
    """One ``torch._fused_adam(w)_`` call: one group's params with a grad (one device,
    one real dtype), stepped with the group's options.

    Args:
        group: the group's options (``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``maximize``, ``decoupled_weight_decay``: Python numbers and bools).
        params: its params with a grad (this list is changed: see ``nondense``).
        grads: their grads, in order (changed too).
        states: their state dicts (``exp_avg``, ``exp_avg_sq``, ``step``).
        nondense: places in ``params`` of params that are not dense: each (and its grad,
            when that is not contiguous) is replaced by a contiguous buffer allocated here,
            filled before the kernel and written back after it (:func:`run_fused_plan`).
        previous: an earlier call (emptied by :func:`release_grads`) whose lists,
            options dict and tuples are filled again in place when it has the same
            kernel and options' keys: over many groups a call is ~11 objects a group,
            and made anew at every step they outlived each step's young-generation
            collections and set off a full garbage collection every ~10 steps (~0.2 s
            over 1,000 groups in a process of ~300,000 objects).

    Returns:
        The call, ``(kernel, tensor lists, options, copies)``.

    Raises:
        Whatever allocating the copies raised (an OOM); nothing is written here.
    """
    fills: list[tuple[torch.Tensor, torch.Tensor]] = []
    writeback: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in nondense:  # contiguous buffers, filled in the commit (after any unscaling)
        p, g = params[i], grads[i]
        params[i] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        fills.append((params[i], p))
        writeback.append((p, params[i]))
        if not g.is_contiguous():
            grads[i] = torch.empty(g.shape, dtype=g.dtype, device=g.device)
            fills.append((grads[i], g))
    exp_avgs = list(map(_EXP_AVG, states))
    exp_avg_sqs = list(map(_EXP_AVG_SQ, states))
    for i in strided_in_place(params):  # contiguous views in memory order (see below)
        order = memory_order(params[i])
        for tensors in (params, grads, exp_avgs, exp_avg_sqs):
            tensors[i] = tensors[i].permute(order)
    lists: tuple[list[torch.Tensor], ...] = (
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],  # max_exp_avg_sq: no rung keeps it (amsgrad is refused)
        list(map(_STEP, states)),
    )
    beta1, beta2 = group["betas"]
    options = {
        "amsgrad": False,
        "lr": group["lr"],
        "beta1": beta1,
        "beta2": beta2,
        "weight_decay": group["weight_decay"],
        "eps": group["eps"],
        "maximize": bool(group["maximize"]),
        "grad_scale": None,
        "found_inf": None,
    }
    kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    if previous is None or previous[0] is not kernel or previous[2].keys() != options.keys():
        return (kernel, lists, options, (fills, writeback))
    for kept, new in zip(previous[1], lists, strict=True):  # its containers, filled again
        kept[:] = new
    previous[2].update(options)
    previous[3][0][:] = fills
    previous[3][1][:] = writeback
    return previous


def release_grads(calls: list[FusedCall]) -> list[FusedCall]:
    """Empty the grad lists and copies of :func:`group_call`'s calls in place (after the
    commit: kept calls must not keep the grads alive after ``zero_grad()``, nor the
    copies' buffers); returns ``calls``, for :func:`group_call`'s ``previous``."""
    for _, lists, _, (fills, writeback) in calls:
        lists[1].clear()
        fills.clear()
        writeback.clear()
    return calls


class StepCounts:
    """Adds one to many step counts, each a one-element float64 CPU tensor (torch's
    state layout, in float64 here: :mod:`optladder.optimizers.steps`), by writing their
    memory: ``torch._foreach_add_`` takes ~2 microseconds a tensor on the CPU (the step
    counts of 20,000 params cost about as much as their kernel), a write ~0.1.

    The addresses and dtypes are read at every step (:meth:`prepare`, in the step's
    prepare phase) and the memory cells made again when a tensor, an address or a dtype
    changed, after refusing step tensors that params share (each param counts its own
    steps: :func:`~optladder.optimizers.steps.refuse_shared_steps`). A tensor can be
    given other memory at the same address (``t.data = t.data.view(...)``, or a new
    allocation where its old memory was; a float64 cell written there would write past
    a smaller element). The
    cells' storages are held while they are kept, so the memory they point at is not
    freed and given to another tensor (short of resizing that storage in place). Step
    counts of another kind (another dtype or device, as a capturable or CUDA optimizer
    keeps them, a negative view, a tensor subclass) go through ``torch._foreach_add_``.
    Either way the sum is float64's ``step + 1``, exactly torch's.
    """

    def __init__(self) -> None:
        self._steps: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._dtypes: list[torch.dtype] = []
        self._storages: list[torch.UntypedStorage] = []
        self._cells: list[ctypes.c_double] | None = None
        self._pending: list[torch.Tensor] | None = None  # what prepare() made ready
        self._pending_cells: list[ctypes.c_double] | None = None  # their cells

    def _keep(
        self,
        steps: list[torch.Tensor],
        ptrs: list[int],
        dtypes: list[torch.dtype],
        cells: list[ctypes.c_double] | None,
    ) -> None:
        """Keep these tensors' cells (None: they take ``torch._foreach_add_``), holding
        their storages while the cells point into them."""
        storages = [] if cells is None else [t.untyped_storage() for t in steps]
        self._steps, self._ptrs, self._dtypes = list(steps), ptrs, dtypes
        self._storages, self._cells = storages, cells

    def _kept(self, steps: list[torch.Tensor], ptrs: list[int]) -> bool:
        """Whether the kept cells are ``steps``' (at addresses ``ptrs``), dtypes included."""
        return (
            ptrs == self._ptrs
            and list(map(_DTYPE, steps)) == self._dtypes
            and same_objects(steps, self._steps)
        )

    def _make(
        self, steps: list[torch.Tensor], ptrs: list[int], name: Callable[[int], str] | None
    ) -> None:
        """Refuse step tensors that params share, then make and keep ``steps``' cells.

        Raises:
            ValueError: from :func:`~optladder.optimizers.steps.refuse_shared_steps`;
                nothing is kept then.
        """
        self._keep([], [], [], None)
        refuse_shared_steps(steps, name)
        cells = None
        if all(map(_is_cpu_double_cell, steps)):
            cells = [ctypes.c_double.from_address(ptr) for ptr in ptrs]
        self._keep(steps, ptrs, list(map(_DTYPE, steps)), cells)

    def prepare(
        self,
        steps: list[torch.Tensor],
        name: Callable[[int], str] | None = None,
        within: tuple[list[torch.Tensor], list[bool]] | None = None,
    ) -> None:
        """Make ready to bump ``steps`` (in the step's prepare phase): read their
        addresses and dtypes, and when a tensor, an address or a dtype changed, refuse
        step tensors that params share (:func:`~optladder.optimizers.steps.refuse_shared_steps`,
        naming them with ``name``) and make the cells again. The next :meth:`bump`
        without ``steps`` bumps this list, reading nothing.

        ``within``: ``(every step tensor, picks)`` with ``steps`` the picked ones
        (``itertools.compress``; checked by identity), e.g. the step counts of every
        param with state and which of those have a grad this step: the cells are made
        and kept for every tensor, so a step that changes which params have a grad
        (experts, a task's head) picks among them instead of making them again (~1 us a
        tensor). When two of every tensor share memory (but not two of ``steps``), the
        cells are made for ``steps`` alone.

        Raises:
            ValueError: two params share one step tensor; nothing is kept then.
        """
        self._pending, self._pending_cells = None, None
        if not steps:
            self._pending = steps
            return
        if within is not None and self._prepare_within(steps, *within):
            return
        try:
            ptrs = list(map(_DATA_PTR, steps))
        except RuntimeError:  # a tensor without storage (a wrapper subclass)
            self._keep([], [], [], None)
            refuse_shared_steps(steps, name)
            self._pending = steps
            return
        if not self._kept(steps, ptrs):
            self._make(steps, ptrs, name)
        self._pending, self._pending_cells = steps, self._cells

    def _prepare_within(
        self, steps: list[torch.Tensor], every: list[torch.Tensor], picks: list[bool]
    ) -> bool:
        """:meth:`prepare` with cells kept for ``every``; False when that does not apply
        (``steps`` are not the picks of ``every``, a tensor has no storage, or two of
        ``every`` share memory): then nothing is kept and the caller prepares ``steps``."""
        if not same_objects(steps, list(compress(every, picks))):
            return False
        try:
            ptrs = list(map(_DATA_PTR, every))
        except RuntimeError:
            return False
        if not self._kept(every, ptrs):
            try:
                self._make(every, ptrs, None)
            except ValueError:  # shared among every tensor: the plain path names them
                return False
        cells = self._cells
        if cells is not None and not all(picks):
            cells = list(compress(cells, picks))
        self._pending, self._pending_cells = steps, cells
        return True

    def bump(self, steps: list[torch.Tensor] | None = None) -> None:
        """Add one to every tensor of ``steps`` in place (allocating no tensor); None:
        the list :meth:`prepare` made ready (prepared here when it is another list).

        Raises:
            ValueError: from :meth:`prepare`, when it runs here.
            RuntimeError: ``steps`` None with no list prepared.
        """
        if steps is None:
            if self._pending is None:
                raise RuntimeError("StepCounts.bump() without steps needs prepare() first")
            steps = self._pending
        elif steps is not self._pending:
            self.prepare(steps)
        cells = self._pending_cells
        self._pending, self._pending_cells = None, None
        if not steps:
            return
        if cells is None:
            torch._foreach_add_(steps, 1)
            return
        for cell in cells:
            cell.value += 1.0


def _is_cpu_double_cell(t: torch.Tensor) -> bool:
    return (
        type(t) in PLAIN_TYPES
        and t.dtype == torch.float64
        and t.device.type == "cpu"
        and t.numel() == 1
        and not t.requires_grad
        and not t.is_neg()
    )


def plan_steps(calls: list[FusedCall]) -> list[torch.Tensor]:
    """The step tensors :func:`run_fused_plan` bumps, in order: every call's."""
    return list(chain.from_iterable(call[1][5] for call in calls))


def run_fused_plan(calls: list[FusedCall], counts: StepCounts) -> None:
    """Make the calls of :func:`group_call`: ``step += 1`` for every group's params (all
    groups at once, with ``counts``' writes: torch's ``_fused_adam`` makes one
    ``_foreach_add_`` per group, and groups share no param), then per group the kernel,
    as torch's ``_fused_adam`` does (no grad recorded), with the params that are not
    dense (and their grads) copied into their buffers before and back after (in place,
    allocating nothing). ``counts`` must have been prepared (:meth:`StepCounts.prepare`)
    with :func:`plan_steps` of these calls."""
    with torch.no_grad():
        counts.bump()
        for kernel, lists, options, (fills, writeback) in calls:
            for buffer, source in fills:
                buffer.copy_(source)
            kernel(*lists, **options)
            for param, buffer in writeback:
                param.copy_(buffer)
