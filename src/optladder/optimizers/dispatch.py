"""The dispatch table of :class:`~optladder.optimizers.adamw.LadderAdamW`: which kernel
steps which bucket of params, and why a bucket is not on a fused kernel.

A bucket is keyed by ``(rung, device type, param dtype, grad dtype)``
(:data:`Key`); its state format's rung is the group's ``"rung"`` (``"fp32"``: float32
moments, ``"bf16"``: bfloat16 moments, ``"8bit"``: bitsandbytes' ``AdamW8bit`` state).
:meth:`DispatchTable.lookup` gives the key's :class:`Choice`, the name of an
:class:`Entry` of :data:`ENTRIES` and, for an entry that is not fused, the reason
(which the engine reports in ``eager_reasons``); a key the engine does not take gives
no entry and the reason it is refused. The rules, in order:

- a param dtype the rung does not take (:data:`optladder.rungs.RUNG_ACCEPTS`, the
  rungs' one table): refused.
- ``"8bit"``: the ``"8bit"`` entry, the 8bit groups' step
  (:class:`~optladder.optimizers.eightbit.EightBitGroups`: optladder's 8-bit C kernel on
  the CPU, bitsandbytes' block-wise 8-bit update elsewhere).
- ``"fp32"`` with ``backend="auto"``, float32/float64/complex params (whose moments
  torch's AdamW keeps in their own dtype, :mod:`~optladder.optimizers.torchroute`):
  grads of the param's dtype only; torch's fused AdamW kernel (``"torch_fused"``) where
  the device has one and the param is real, else torch's foreach AdamW
  (``"torch_foreach"``, :func:`~optladder.optimizers.spec.fp32_fused_miss` says why).
- ``"fp32"`` (bfloat16/float16 params, every param with another backend) and
  ``"bf16"``: optladder's kernels: ``backend="eager"``: the eager loop; CUDA (or
  ``backend="triton"``): the Triton kernel (``"triton"``, the CUDA implementation of
  ``torch.ops.optladder.adamw_bf16_``); the CPU: the C kernel (``"cpu"``, the op's CPU
  implementation, called through one table kept for all groups); other devices, or
  where the kernel cannot run (no compiler, no Triton, a dtype it does not read), the
  eager loop (``"eager"``) with the reason, or with ``backend="cpu"``/``"triton"`` a
  ``ValueError``.

The lookup reads the environment (compiler, Triton, torch's fused devices) and is
memoized per key; :meth:`DispatchTable.route` adds what depends on the tensors (the
C kernel steps a non-contiguous param through contiguous copies, ``"staged"``; grads of
another shape or device go eagerly or are refused). Both run when a group's plan is
made (prepare, when something changed), never per param per step.

Every entry has one signature: ``run(payload, grad_scale, found_inf)``, its payload made
by the engine's prepare (:meth:`~optladder.optimizers.adamw.LadderAdamW.prepare_step`:
tables, lists and scratch, :class:`FusedCalls`, :class:`CpuCall`, ...), so the commit is
one call per prepared entry and allocates nothing (torch's foreach AdamW, which
allocates as it steps, steps copies in its ``stage``, before anything is written). An
entry whose kernel takes ``grad_scale``/``found_inf`` on the device (``amp="kernel"``:
torch's fused kernel, Triton) gets them; for the others (``amp="host"``) the commit
reads ``found_inf`` once on the host (skipping them all, :attr:`Entry.skip`) and divides
their grads by the scale once per distinct memory (:attr:`Entry.grads`), then runs them
with None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast

import torch

from optladder.columns import PLAIN_TYPES
from optladder.dtype_names import dtype_name
from optladder.rungs import (
    FLOAT32_MATH_DTYPES,
    LADDER_DTYPES,
    RUNG_ACCEPTS,
    Rung,
    param_refusal,
)


def kernel_dtype_miss(dtypes: Iterable[str]) -> str | None:
    """Why optladder's kernels (C, Triton) step none of the params of ``dtypes`` (dtype
    names) that are not :data:`~optladder.rungs.FLOAT32_MATH_DTYPES`, or None."""
    other = sorted(set(dtypes) - set(FLOAT32_MATH_DTYPES))
    if not other:
        return None
    return (
        f"optladder's kernels step {', '.join(FLOAT32_MATH_DTYPES)} params; "
        f"{', '.join(other)} params run the eager path"
    )


def no_kernel_reason(device_type: str) -> str:
    """Why optladder's AdamW runs eagerly on a device type with neither of its kernels."""
    return f"no fused kernel of optladder's AdamW for {device_type}"


Key = tuple[str, str, torch.dtype, torch.dtype]
"""``(rung, device type, param dtype, grad dtype)``: ``("bf16", "cuda", torch.bfloat16,
torch.float32)``."""

Amp = Literal["kernel", "host"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One kernel of the dispatch table.

    Attributes:
        name: the route name (the key of a group plan's routes).
        kernel: what it calls, in words.
        fused: whether it is a fused kernel (one launch updates many params).
        amp: ``"kernel"``: ``run`` takes ``grad_scale``/``found_inf`` to the device's
            kernel; ``"host"``: the commit unscales its grads and skips it on infs, and
            runs it with None for both.
        run: ``run(payload, grad_scale, found_inf)``: the step of its params, writing
            params, moments and step counts in place, allocating nothing.
        grads: ``grads(payload)``: the grads its run reads (``amp="host"``: the commit
            divides them by the scale).
        stage: ``stage(payload, grad_scale)`` or None: work before anything is written
            (may allocate; an error there leaves everything as it was).
        skip: ``skip(payload)`` or None: what to release when a step with infs skips it.
    """

    name: str
    kernel: str
    fused: bool
    amp: Amp
    run: Callable[[Any, torch.Tensor | None, torch.Tensor | None], None]
    grads: Callable[[Any], list[torch.Tensor]]
    stage: Callable[[Any, torch.Tensor | None], None] | None = None
    skip: Callable[[Any], None] | None = None


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :meth:`DispatchTable.lookup` says of a key.

    Attributes:
        entry: the entry's name, or None when the engine refuses the key.
        reason: why the entry is not a fused kernel, or why the key is refused; None for
            a fused entry.
        by_backend: refused because ``backend`` insists on a kernel that cannot step it.
    """

    entry: str | None
    reason: str | None = None
    by_backend: bool = False


# --- the payloads the engine's prepare makes, one per entry ---------------------------


@dataclasses.dataclass
class FusedCalls:
    """``"torch_fused"``: the calls of :func:`~.fusedstep.group_call` (one per group and
    (device, dtype)); the group plans that made them (each with its ``group`` and its
    ``torch_calls``, in the order of ``calls``); whether every group's options are
    numbers (the direct call takes them); the step counts to bump
    (:class:`~.fusedstep.StepCounts`, prepared)."""

    calls: list[Any]
    plans: list[Any]
    direct: bool
    counts: Any


@dataclasses.dataclass
class ForeachCalls:
    """``"torch_foreach"``: per group, its options and torch's functional AdamW's lists
    (params, grads, ``exp_avg``, ``exp_avg_sq``, (empty), ``step``) of its params with a
    grad; ``copies``: the stepped copies, from :func:`_stage_foreach` to the run."""

    parts: Sequence[tuple[Mapping[str, Any], tuple[list[Any], ...]]]
    copies: list[tuple[list[Any], ...]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CpuCall:
    """``"cpu"``: the C kernel's one table of every group's rows (its grads, scalars and
    options written in prepare), and the group plans of its rows (each with its
    ``cpu_params``: the grads to unscale)."""

    table: Any
    plans: list[Any]


@dataclasses.dataclass
class TritonLaunch:
    """One ``"triton"`` launch: its group, the op's tensor lists (params, grads,
    ``exp_avg``, ``exp_avg_sq``, ``step``, param indices; their device tables made in
    prepare), the device, and a tensor ``lr``'s float32 copy on it (or None)."""

    group: Mapping[str, Any]
    lists: tuple[list[Any], ...]
    device: torch.device
    lr_tensor: torch.Tensor | None


@dataclasses.dataclass
class EagerItem:
    """One ``"eager"`` param: its state, group, index over all groups, moment dtype and
    the prepared scratch of its device."""

    param: torch.Tensor
    state: dict[str, Any]
    group: dict[str, Any]
    index: int
    moment_dtype: torch.dtype
    scratch: Any


StagedItem = tuple[torch.Tensor, int, Any, torch.Tensor, torch.Tensor]
"""One ``"staged"`` param: ``(param, index, one-row C kernel table, param copy, grad
copy)``, the copies views of the device's stage buffer."""


# --- the entries' runs ---------------------------------------------------------------


def _run_torch_fused(
    payload: FusedCalls, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """torch's fused AdamW: the direct calls of :func:`~.fusedstep.run_fused_plan` (every
    group's step counts bumped at once), or, with ``grad_scale``/``found_inf`` or a
    hyperparameter that is not a Python number (a tensor ``lr``), torch's functional
    fused AdamW per call, which takes them; then the calls let go of the grads."""
    from optladder.optimizers.fusedstep import release_grads, run_fused_plan
    from optladder.optimizers.torchroute import step_functional

    calls = payload.calls
    if grad_scale is None and found_inf is None and payload.direct:
        run_fused_plan(calls, payload.counts)
    else:
        with torch.no_grad():  # the copies of params that are not dense
            for plan in payload.plans:
                for _, lists, _, (fills, writeback) in plan.torch_calls:
                    for buffer, source in fills:
                        buffer.copy_(source)
                    step_functional(
                        plan.group, lists, fused=True, grad_scale=grad_scale, found_inf=found_inf
                    )
                    for param, buffer in writeback:
                        param.copy_(buffer)
    release_grads(calls)


def _fused_grads(payload: FusedCalls) -> list[torch.Tensor]:
    return [g for call in payload.calls for g in call[1][1]]


def _stage_foreach(payload: ForeachCalls, grad_scale: torch.Tensor | None) -> None:
    """Step copies of the params, grads (unscaled as the commit unscales the live ones)
    and state with torch's functional foreach AdamW, leaving the live tensors as they
    are: torch's foreach AdamW allocates as it steps, so an OOM here loses nothing."""
    from optladder.optimizers.torchroute import step_functional

    payload.copies.clear()
    for group, lists in payload.parts:
        copies = tuple([t.detach().clone() for t in ts] for ts in lists)
        if grad_scale is not None and copies[1]:
            torch._foreach_mul_(copies[1], 1.0 / float(grad_scale.item()))
        step_functional(group, copies, fused=False)
        payload.copies.append(copies)


def _run_foreach(
    payload: ForeachCalls, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """Copy the stepped copies of :func:`_stage_foreach` back into the live params,
    moments and step counts (not the grads)."""
    with torch.no_grad():  # as torch's step: the update is not recorded
        for (_, live), stepped in zip(payload.parts, payload.copies):
            for k in (0, 2, 3, 5):  # params, exp_avg, exp_avg_sq, step
                for dst, src in zip(live[k], stepped[k]):
                    dst.copy_(src)
    payload.copies.clear()


def _foreach_grads(payload: ForeachCalls) -> list[torch.Tensor]:
    return [g for _, lists in payload.parts for g in lists[1]]


def _run_cpu(
    payload: CpuCall, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """Every group's C kernel rows in one call of the kept table, then every step count
    bumped in one call."""
    from optladder.optimizers.kernels import cpu

    cpu.run_table(payload.table)
    payload.table.bump_steps()


def _params_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _run_staged(
    payload: list[StagedItem], grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """The staged params one after another: copy the param and its grad into the copies,
    run the kernel, copy the param back in place (so tensors that view it stay tied) and
    count the step."""
    from optladder.optimizers.kernels import cpu

    for p, _, table, work, work_grad in payload:
        work.copy_(p.detach())  # the same dtype: the bits as they are
        work_grad.copy_(cast(torch.Tensor, p.grad).detach())
        cpu.run_table(table)
        table.bump_steps()
        p.detach().copy_(work)


def _staged_grads(payload: list[StagedItem]) -> list[torch.Tensor]:
    return _params_grads([item[0] for item in payload])


def _run_triton(
    payload: list[TritonLaunch], grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """``torch.ops.optladder.adamw_bf16_``, one launch per (group, device, param dtype,
    grad dtype); the kernel divides the grads by ``grad_scale`` and skips on
    ``found_inf`` on the device, as torch's fused kernel."""
    from optladder.optimizers.kernels import ops

    for launch in payload:
        group = launch.group
        beta1, beta2 = group["betas"]
        device = launch.device
        torch.ops.optladder.adamw_bf16_(
            *launch.lists,
            0.0 if launch.lr_tensor is not None else float(group["lr"]),
            launch.lr_tensor,
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group["decoupled_weight_decay"]),
            bool(group["maximize"]),
            group["rounding"] == "stochastic",
            group.get("param_rounding", "stochastic") == "stochastic",
            ops.seed_prefix(group["seed"]),
            None if grad_scale is None else grad_scale.to(device),
            None if found_inf is None else found_inf.to(device),
        )


def _triton_grads(payload: list[TritonLaunch]) -> list[torch.Tensor]:
    return [g for launch in payload for g in launch.lists[1]]


def _run_eager(
    payload: list[EagerItem], grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """The eager loop (:func:`~optladder.optimizers.eager.eager_step`), param by param, on
    the prepared scratch."""
    from optladder.optimizers import eager

    for item in payload:
        eager.eager_step(
            item.param, item.state, item.group, item.index, item.moment_dtype, item.scratch
        )


def _eager_grads(payload: list[EagerItem]) -> list[torch.Tensor]:
    return _params_grads([item.param for item in payload])


def _run_8bit(
    payload: Any, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """The 8bit groups' prepared step (:meth:`~.eightbit.EightBitGroups.commit_step`:
    optladder's 8-bit C kernel over one table on the CPU, bitsandbytes' block-wise
    8-bit update for the rest)."""
    payload.commit_step()


def _eightbit_grads(payload: Any) -> list[torch.Tensor]:
    return [p.grad for g in payload.param_groups for p in g["params"] if p.grad is not None]


def _skip_8bit(payload: Any) -> None:
    payload.drop_kernel_step()
    payload.release_scratch()


ENTRIES: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry(
            "triton",
            "torch.ops.optladder.adamw_bf16_ (the Triton kernel), one launch per group, "
            "device, param dtype and grad dtype",
            True,
            "kernel",
            _run_triton,
            _triton_grads,
        ),
        Entry(
            "torch_fused",
            "torch._fused_adamw_ / torch._fused_adam_ (torch's fused AdamW), one call per "
            "group, device and dtype",
            True,
            "kernel",
            _run_torch_fused,
            _fused_grads,
        ),
        Entry(
            "cpu",
            "optladder's C kernel (the CPU implementation of torch.ops.optladder."
            "adamw_bf16_), one call over a table of every group's params",
            True,
            "host",
            _run_cpu,
            lambda payload: _params_grads([p for plan in payload.plans for p in plan.cpu_params]),
        ),
        Entry(
            "8bit",
            "the 8bit groups' step: optladder's 8-bit C kernel on the CPU, bitsandbytes' "
            "block-wise 8-bit update elsewhere",
            True,
            "host",
            _run_8bit,
            _eightbit_grads,
            skip=_skip_8bit,
        ),
        Entry(
            "staged",
            "optladder's C kernel on contiguous copies, one param at a time",
            False,
            "host",
            _run_staged,
            _staged_grads,
        ),
        Entry(
            "torch_foreach",
            "torch.optim.adam.adam(foreach=True) (torch's foreach AdamW) on copies",
            False,
            "host",
            _run_foreach,
            _foreach_grads,
            stage=_stage_foreach,
        ),
        Entry(
            "eager",
            "optladder.optimizers.eager.eager_step (the eager loop), one param at a time",
            False,
            "host",
            _run_eager,
            _eager_grads,
        ),
    )
}
"""Every entry, in the order a commit runs them (those taking ``grad_scale`` on the
device first, then the grads of the rest are unscaled)."""

ROUTES = tuple(ENTRIES)
"""The entries' names, in commit order."""

TORCH_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)
"""Param dtypes the fp32 format steps on torch's kernels (``backend="auto"``)."""


def check_torch_grad(p: torch.Tensor, grad: torch.Tensor, index: int) -> None:
    """Refuse a grad torch's AdamW kernels cannot take for ``p`` (the fp32 format's
    float32/float64/complex params, :mod:`~optladder.optimizers.torchroute`): another
    dtype, shape or device, or (for a dense param) laid out unlike it, which torch's
    fused kernel pairs by memory order. Before anything is written.

    Raises:
        ValueError: naming the param (its index over all groups) and what to do.
    """
    from optladder.optimizers.fusedstep import steps_through_copy

    if grad.dtype != p.dtype or grad.shape != p.shape or grad.device != p.device:
        raise ValueError(
            f"param {index} has a {grad.dtype} grad of shape {tuple(grad.shape)} on "
            f"{grad.device}; the param is {p.dtype} of shape {tuple(p.shape)} on {p.device} "
            "(torch's AdamW, which steps it on the fp32 rung, takes grads of its dtype)"
        )
    if (
        type(p) in PLAIN_TYPES
        and grad.stride() != p.stride()
        and p.numel() > 1
        and not steps_through_copy(p)
    ):
        raise ValueError(
            f"param {index} has a grad with strides {grad.stride()} but the param has "
            f"{p.stride()}; torch's fused AdamW needs them laid out alike (autograd's grads "
            "are; set hand-made grads with torch.empty_like(param))"
        )


class DispatchTable:
    """One :class:`~optladder.optimizers.adamw.LadderAdamW`'s table: :meth:`lookup` of a
    key, :meth:`route` of a param (see the module's docstring for the rules).

    Args:
        backend: the engine's ``backend`` (:data:`~.adamw.Backend`).
        torch_fused: the fp32 format's float32/float64 params take torch's fused kernel
            where the device has one (False: its foreach path everywhere).
        build_kernels: False to take the C kernel as running where a C compiler is found,
            without building it (what a plan says of a device,
            :func:`~optladder.optimizers.spec.kernel_routes`); True (the engine's table):
            the lookup builds it, and a failed build sends its keys to the eager loop.

    Attributes:
        entries: name -> :class:`Entry`, a copy of :data:`ENTRIES` (per engine: a test may
            put a counting entry in one engine's table).
    """

    def __init__(self, backend: str, torch_fused: bool, *, build_kernels: bool = True) -> None:
        self.backend = backend
        self.build_kernels = build_kernels
        self.entries: dict[str, Entry] = dict(ENTRIES)
        self._fused_devices: tuple[str, ...] | None = None if torch_fused else ()
        self._cpu_error: str | None = None  # the C kernel failed to build: why
        self._memo: dict[Key, Choice] = {}

    def fused_devices(self) -> tuple[str, ...]:
        """Device types of torch's fused AdamW kernel (read once per table; none with
        ``torch_fused=False``)."""
        if self._fused_devices is None:
            from optladder.optimizers.torchroute import fused_devices

            self._fused_devices = fused_devices()
        return self._fused_devices

    def forget(self) -> None:
        """Forget the looked-up keys, so the next lookups read the environment again
        (the engine calls it before it makes plans: a compiler installed or removed
        since is seen, as when each step looked)."""
        self._memo.clear()

    def lookup(
        self, rung: str, device_type: str, param_dtype: torch.dtype, grad_dtype: torch.dtype
    ) -> Choice:
        """The :class:`Choice` of key ``(rung, device_type, param_dtype, grad_dtype)``.

        Args:
            rung: the group's state format: ``"fp32"``, ``"bf16"`` or ``"8bit"``.
            device_type: the param's device type (``"cpu"``, ``"cuda"``, ...).
            param_dtype: the param's dtype.
            grad_dtype: its grad's dtype.

        Raises:
            optladder.optimizers.kernels.cpu.KernelBuildError: with ``backend="cpu"``,
                when the C kernel cannot be built (it is built here, at the first key
                that takes it).
        """
        key = (rung, device_type, param_dtype, grad_dtype)
        choice = self._memo.get(key)
        if choice is None:
            choice = self._memo[key] = self._choose(*key)
        return choice

    def _choose(
        self, rung: str, device_type: str, param_dtype: torch.dtype, grad_dtype: torch.dtype
    ) -> Choice:
        from optladder.optimizers import kernels
        from optladder.optimizers.kernels import cpu

        name = dtype_name(param_dtype)
        if rung not in RUNG_ACCEPTS:
            return Choice(
                None, f"no state format {rung!r}: the rungs are {', '.join(RUNG_ACCEPTS)}"
            )
        refusal = param_refusal(cast(Rung, rung), name)  # the rungs' one table
        if refusal is not None:
            return Choice(None, refusal)
        if rung == "8bit":
            return Choice("8bit")
        moment_dtype = torch.float32 if rung == "fp32" else torch.bfloat16
        if rung == "fp32" and self.backend == "auto" and param_dtype in TORCH_DTYPES:
            if grad_dtype != param_dtype:
                return Choice(
                    None,
                    f"a {name} param takes {name} grads on the fp32 rung (torch's AdamW, "
                    f"which steps it, takes grads of its dtype), not {grad_dtype}",
                )
            complex_param = param_dtype.is_complex
            on_device = device_type in self.fused_devices()
            if complex_param or not on_device:
                from optladder.optimizers.spec import fp32_fused_miss

                return Choice(
                    "torch_foreach", fp32_fused_miss(on_device, device_type, (name,), complex_param)
                )
            return Choice("torch_fused")
        accepted = LADDER_DTYPES if rung == "bf16" else FLOAT32_MATH_DTYPES
        if name not in accepted:  # the fp32 rung's float64 and complex params, off torch's
            return Choice(
                None,
                f"optladder's AdamW with {dtype_name(moment_dtype)} moments takes "
                f"{', '.join(accepted)} params, not {name} (backend={self.backend!r}; "
                "backend='auto' steps it on torch's AdamW)",
            )
        if self.backend == "eager":
            return Choice("eager", "backend='eager' was asked for")
        if name not in FLOAT32_MATH_DTYPES:  # the bf16 format's float64 params
            return self._kernel_or_eager("eager", kernel_dtype_miss((name,)))
        if self.backend == "triton" or (self.backend == "auto" and device_type == "cuda"):
            why = kernels.triton_unavailable_reason() or kernels.triton_dtype_unsupported_reason(
                param_dtype, grad_dtype, moment_dtype
            )
            return self._kernel_or_eager("triton", why)
        if device_type == "cpu":
            why = (
                self._cpu_error
                or kernels.cpu_unavailable_reason()
                or cpu.dtype_unsupported_reason(param_dtype, grad_dtype)
            )
            if why is None and self.build_kernels:
                try:
                    cpu.load_library()
                except cpu.KernelBuildError as exc:
                    if self.backend == "cpu":
                        raise
                    why = self._cpu_error = f"the CPU kernel could not be built: {exc}"
            return self._kernel_or_eager("cpu", why)
        return self._kernel_or_eager("eager", no_kernel_reason(device_type))

    def _kernel_or_eager(self, name: str, why: str | None) -> Choice:
        """``name`` when nothing stops it (``why`` None), else the eager loop with
        ``why``, or a refusal when ``backend`` insists on a kernel."""
        if why is None:
            return Choice(name)
        if self.backend != "auto":
            return Choice(None, why, by_backend=True)
        return Choice("eager", why)

    def route(
        self, rung: str, p: torch.Tensor, grad: torch.Tensor, index: int, moment_dtype: torch.dtype
    ) -> tuple[str, str | None]:
        """The entry that steps ``p`` (a param of a group in format ``rung``, ``"fp32"``
        or ``"bf16"``, with the dense ``grad``) and why it is not fused (None when it is):
        :meth:`lookup` of its key, then what depends on the tensors: torch's kernels
        take grads laid out like the param (:func:`check_torch_grad`), the C kernel a
        contiguous param and grad (else its copies, ``"staged"``) of one shape, the
        Triton kernel contiguous ones on its device.

        Args:
            rung: the group's format.
            p: the param.
            grad: its grad.
            index: its index over all groups, for messages.
            moment_dtype: its group's moment dtype.

        Raises:
            ValueError: a key the engine refuses, a grad torch's kernels cannot take, or
                a param the kernel ``backend`` insists on cannot step, naming the param.
        """
        if rung == "fp32" and self.backend == "auto" and p.dtype in TORCH_DTYPES:
            check_torch_grad(p, grad, index)
        choice = self.lookup(rung, p.device.type, p.dtype, grad.dtype)
        name = choice.entry
        if name is None:
            self._refuse(index, choice.reason, choice.by_backend)
        if name == "cpu":
            from optladder.optimizers.kernels import cpu

            why = cpu.param_unsupported_reason(p, grad)
            if why is None:
                return "cpu", None
            if cpu.param_unsupported_reason(p, grad, contiguous=False) is None:
                return "staged", None  # not contiguous: the kernel steps copies
            return self._eager_or_refuse(index, why)
        if name == "triton":
            from optladder.optimizers import kernels

            why = kernels.triton_param_unsupported_reason(p, grad, moment_dtype)
            if why is not None:
                return self._eager_or_refuse(index, why)
        return cast(str, name), choice.reason

    def _eager_or_refuse(self, index: int, why: str) -> tuple[str, str]:
        if self.backend != "auto":
            self._refuse(index, why, True)
        return "eager", why

    def _refuse(self, index: int, why: str | None, by_backend: bool) -> None:
        if by_backend:
            raise ValueError(
                f"backend={self.backend!r} cannot step param {index}: {why}; "
                "use backend='auto' to step such params eagerly"
            )
        raise ValueError(f"param {index}: {why}")
