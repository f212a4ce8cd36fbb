"""Steps in two phases: *prepare* allocates everything, *commit* writes.

An out-of-memory error in :func:`prepare_step` is rolled back (the state it created is
dropped), so params, moments and step counts stay exactly as they were. The commit of
each engine allocates nothing that the dispatcher sees:

- :class:`LadderAdamW` (the fp32 and bf16 rungs, two state formats of one engine):
  state and its scratch buffers are allocated in prepare
  (:meth:`LadderAdamW.prepare_step`), and so are the lists of torch's fused kernel calls
  for the fp32 format's float32/float64 params (:mod:`optladder.optimizers.fusedstep`);
  its kernels and its eager loop write in place. torch's foreach AdamW (complex params)
  allocates as it steps, so it steps copies first, before anything is written.
- bitsandbytes ``AdamW8bit``: state is created in prepare with bitsandbytes' own
  ``init_state``; its CUDA kernel updates in place, and so does optladder's 8-bit CPU
  kernel, whose tables are written in prepare (``prepare_kernel_step``). bitsandbytes'
  CPU fallback (no C compiler) allocates inside the update op, so there a real OOM can
  still leave one param half-written.
- ``torch.optim.AdamW(fused=True)`` passed in as an engine (no rung builds one since the
  fp32 format): state is created in prepare as torch creates it, and the commit is
  torch's kernel calls alone; with ``foreach=True`` the foreach ops allocate between
  in-place writes (no two-phase guarantee).

The checks of a step run once per change, not once per step: with a
:class:`~optladder.optimizers.stepmemo.StepMemo`, group options with the same values and
grads that are the same tensors are not checked again, and state creation (and, for
torch's fused AdamW, the lookup of each param's state) is skipped when every param with
a grad already has its state.
"""

from __future__ import annotations

import contextlib
import operator
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate, chain, compress, repeat
from typing import Any, NamedTuple, cast

import torch

from optladder.columns import PLAIN_TYPES
from optladder.optimizers.adamw import LadderAdamW, validate_group_hyperparams
from optladder.optimizers.build import KERNEL_KEYS
from optladder.optimizers.fusedstep import (
    FusedCall,
    StepCounts,
    fused_plan,
    laid_out_copy,
    laid_out_like,
    nondense_places,
    params_fit,
    plan_steps,
    refuse_nondense,
    refuse_resized,
    release_grads,
    run_fused_plan,
    steps_through_copy,
)
from optladder.optimizers.migrate import check_step_range, is_bnb_engine, read_step
from optladder.optimizers.stepmemo import StepMemo, grad_of
from optladder.optimizers.steps import STEP_DTYPE, refuse_shared_steps


def _torch_adam_init(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """State exactly as ``torch.optim.Adam(W)._init_group`` creates it (``amsgrad``'s
    ``max_exp_avg_sq`` never: :func:`check_step_inputs` refuses ``amsgrad=True``)."""
    # float64 (not torch's float32) so the count stays exact past 2**24; see steps.py
    if group["capturable"] or group["fused"]:
        step = torch.zeros((), dtype=STEP_DTYPE, device=p.device)
    else:
        step = torch.tensor(0.0, dtype=STEP_DTYPE, device="cpu")
    return {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def check_step_inputs(
    engine: torch.optim.Optimizer,
    group_names: Mapping[int, str] | None = None,
    memo: StepMemo | None = None,
) -> list[list[torch.Tensor | None]]:
    """Refuse, before anything is allocated or written, what would fail half-way:
    out-of-range group hyperparameters (and :class:`LadderAdamW`'s own group options,
    :meth:`LadderAdamW.check_group_options`), a group switched to the other weight decay mode
    (``decoupled_weight_decay``), sparse grads, grads of another shape, dtype or
    device, bitsandbytes step counts its kernel cannot take (see
    :func:`optladder.optimizers.migrate.step_limit`; :class:`LadderAdamW` checks its own,
    torch's float64 steps cannot leave their range by stepping from a checkpoint that
    loaded), and (for torch's fused AdamW) grads laid out unlike their dense param, which
    its CPU kernel silently mis-updates (a param that is not dense is stepped through
    contiguous copies of it and its grad, see :mod:`~.fusedstep`).

    Args:
        engine: the rung's optimizer.
        group_names: ``id(group) -> name`` for messages, e.g. ``"group 3"`` (the group's
            place among all of an optladder optimizer's groups); default ``"group {i}"``
            with ``i`` its place in ``engine.param_groups``.
        memo: what passed these checks before (:class:`~.stepmemo.StepMemo`, updated
            here): a group whose options have the same values is not checked again, nor
            grads that are the same tensors. None: check everything.

    Returns:
        Per group, every param's grad (None where it has none), as read for the checks.

    Raises:
        ValueError: naming the group or param, what was found and what is allowed.
    """
    bnb = is_bnb_engine(engine)
    ladder = isinstance(engine, LadderAdamW)
    fused = not ladder and not bnb
    names = group_names or {}
    groups = engine.param_groups
    if memo is not None:
        memo.trim(len(groups))
    all_grads: list[list[torch.Tensor | None]] = []
    # the groups whose grads are checked, by place (ints: no tuple per group, which over
    # many groups would outlive the step's young collections, see fusedstep.fused_plan)
    changed: list[int] = []
    with_strides: list[bool] = []
    options_same = memo is not None and memo.all_options_unchanged(groups)
    every = None if memo is None or bnb else memo.all_grads  # bitsandbytes: per group
    for gi, group in enumerate(groups):
        if not options_same and (memo is None or not memo.options_unchanged(gi, group)):
            try:
                missing = [key for key in _HYPERPARAMS if key not in group]
                if missing:  # deleted by hand: torch's step would fail half-way
                    raise ValueError(
                        f"the key {', '.join(map(repr, missing))} is missing (every group "
                        "of a built optimizer holds it); set it on the group again"
                    )
                validate_group_hyperparams(group)
                _check_decay_mode(engine, group)
                if fused:
                    _check_kernel_flags(engine, group)
                if ladder:
                    LadderAdamW.check_group_options(group)
                    cast(LadderAdamW, engine).check_kernel_flags(group)
            except ValueError as exc:
                raise ValueError(f"param {names.get(id(group), f'group {gi}')}: {exc}") from None
            if memo is not None:
                memo.record_options(gi, group)
        params = group["params"]
        grads = list(map(grad_of, params))
        all_grads.append(grads)
        strides = fused and bool(group.get("fused"))
        with_strides.append(strides)
        if every is None and (
            memo is None or not memo.grads_unchanged(gi, group, params, grads, strides)
        ):
            changed.append(gi)
    if memo is not None and not options_same:
        memo.record_all_options(groups)
    if every is not None:  # every group's grads at once: all checked when any changed
        flat_params = list(chain.from_iterable(map(_PARAMS, groups)))
        flat_grads = list(chain.from_iterable(all_grads))
        if not every.same(groups, flat_params, flat_grads, with_strides):
            changed = list(range(len(groups)))
    for strides in (False, True):  # the groups' grads checked together, in C
        checks = [gi for gi in changed if with_strides[gi] is strides]
        flat = list(chain.from_iterable(groups[gi]["params"] for gi in checks))
        flat_grads = list(chain.from_iterable(all_grads[gi] for gi in checks))
        if _grads_match(flat, flat_grads, strides):
            continue
        for gi in checks:
            params = groups[gi]["params"]
            if not _grads_match(params, all_grads[gi], strides):  # raises, naming it:
                _check_grads(params, names.get(id(groups[gi]), f"group {gi}"), strides)
    if every is not None:
        if changed:
            every.record(groups, flat_params, flat_grads, with_strides)
        return all_grads
    for gi in changed:
        group, strides = groups[gi], with_strides[gi]
        params = group["params"]
        if bnb:
            _check_bnb_steps(engine, params, names.get(id(group), f"group {gi}"))
        if memo is not None:
            memo.record_grads(gi, group, params, all_grads[gi], strides)
    return all_grads


def _check_decay_mode(engine: torch.optim.Optimizer, group: Mapping[str, Any]) -> None:
    """Refuse a group whose ``decoupled_weight_decay`` (set by hand after construction)
    is not the engine's mode: one mode per optimizer, as construction,
    ``add_param_group`` and loads require (the 8bit engine keeps its mode as
    ``coupled_weight_decay`` and would ignore the group's; the others would decay that
    group the other way, and the checkpoint would not load back)."""
    if hasattr(engine, "coupled_weight_decay"):
        mode = not engine.coupled_weight_decay
    else:
        mode = bool(engine.defaults.get("decoupled_weight_decay", True))
    if group.get("decoupled_weight_decay", mode) != mode:
        raise ValueError(
            f"decoupled_weight_decay={group['decoupled_weight_decay']!r}, but this optimizer "
            f"decays the {'AdamW' if mode else 'Adam'} way (decoupled_weight_decay={mode!r}); "
            "one mode per optimizer: create it with the other mode instead"
        )


def _check_kernel_flags(engine: torch.optim.Optimizer, group: Mapping[str, Any]) -> None:
    """Refuse a group of torch's AdamW whose kernel flags (:data:`~.build.KERNEL_KEYS`,
    set by hand after construction) are not the engine's: optladder chooses the kernel,
    and torch's own step, which runs such a group, failed in the commit (a tensor lr
    with ``foreach=True``, ``capturable=True`` on the CPU) after writing params."""
    for key in KERNEL_KEYS:
        want = engine.defaults.get(key)
        if group.get(key, want) != want:
            flags = ", ".join(f"{k}={engine.defaults.get(k)!r}" for k in KERNEL_KEYS)
            raise ValueError(
                f"{key}={group[key]!r}, but optladder chooses each rung's kernel (this "
                f"group's engine runs {flags}); set {key}={want!r} back, or leave "
                "the kernel flags out of the group"
            )


_HYPERPARAMS = ("lr", "betas", "eps", "weight_decay")
_LAYOUT = operator.attrgetter("layout")
_IS_CPU = operator.attrgetter("is_cpu")
_PARAMS = operator.itemgetter("params")
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")


def _grads_match(
    params: list[torch.Tensor], grads: list[torch.Tensor | None], strides: bool
) -> bool:
    """Whether every grad is dense and has its param's shape, device and dtype (and
    strides, with ``strides``): the checks of :func:`_check_grads` as loops in C, for
    the common case where all pass. Shapes and strides are compared pair by pair, not
    as lists: a list of 20,000 ``torch.Size`` tuples would set off the garbage
    collector's full passes, which cost more than the checks."""
    present = cast(list[torch.Tensor], grads)  # unless some are None:
    if any(map(operator.is_, grads, repeat(None))):
        present = [g for g in grads if g is not None]
        params = [p for p, g in zip(params, grads) if g is not None]
    return (
        all(map(operator.is_, map(_LAYOUT, present), repeat(torch.strided)))
        and list(map(_DTYPE, present)) == list(map(_DTYPE, params))
        and list(map(_DEVICE, present)) == list(map(_DEVICE, params))
        and all(map(torch.Tensor.is_same_size, present, params))
        and (
            not strides
            or all(
                map(
                    operator.eq, map(torch.Tensor.stride, present), map(torch.Tensor.stride, params)
                )
            )
        )
    )


def _check_bnb_steps(engine: torch.optim.Optimizer, params: list[torch.Tensor], name: str) -> None:
    """Refuse a bitsandbytes step count (a Python int) its CUDA kernel cannot step from
    (:func:`~optladder.optimizers.migrate.step_limit`; on the CPU the limit is float64's
    integer range, which stepping cannot pass and loads check)."""
    if all(map(_IS_CPU, params)):  # the common case, in C
        return
    for pi, p in enumerate(params):
        if p.grad is None or p.is_cpu:
            continue
        st = engine.state.get(p)
        if st and "step" in st:
            check_step_range(read_step(st), engine, p, f"param {pi} of {name}")


def _check_grads(params: list[torch.Tensor], name: str, strides: bool) -> None:
    """The grad checks of :func:`check_step_inputs` for one group, param by param."""
    for pi, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        where = f"param {pi} of {name}"
        if g.is_sparse:
            raise ValueError(f"{where} has a sparse grad; optladder's rungs need dense grads")
        if g.shape != p.shape or g.device != p.device or g.dtype != p.dtype:
            raise ValueError(
                f"{where} has a {g.dtype} grad of shape {tuple(g.shape)} on {g.device}; "
                f"the param is {p.dtype} of shape {tuple(p.shape)} on {p.device}"
            )
        if strides and g.stride() != p.stride() and not steps_through_copy(p):
            raise ValueError(
                f"{where} has a grad with strides {g.stride()} but the param has "
                f"{p.stride()}; torch's fused AdamW needs them laid out alike (autograd's "
                "grads are; set hand-made grads with torch.empty_like(param))"
            )


def prepare_step(
    engine: torch.optim.Optimizer,
    group_names: Mapping[int, str] | None = None,
    memo: StepMemo | None = None,
) -> list[torch.Tensor]:
    """Allocate the state the engine's next step needs, before anything is written.

    Args:
        engine: the rung's optimizer.
        group_names: names of its groups in messages (see :func:`check_step_inputs`).
        memo: what passed the checks before (see :func:`check_step_inputs`).

    Returns:
        The params whose state this call created (for :func:`rollback_step`).

    Raises:
        ValueError: from :func:`check_step_inputs`, before anything changes.
        Whatever the allocation raised (an OOM); the state created so far is dropped
        first, so the engine is as it was.
    """
    grads = check_step_inputs(engine, group_names, memo)
    if memo is None:  # with a memo, the optimizer checks this when params change
        refuse_resized(engine, grads, group_names, local=is_bnb_engine(engine))
    created: list[torch.Tensor] = []
    if memo is not None:
        memo.plan = None
    try:
        if isinstance(engine, LadderAdamW):
            # rolls back its own state on failure; its options and grads were checked above
            return engine.prepare_step(checked=grads)
        if is_bnb_engine(engine) or isinstance(engine, torch.optim.Adam | torch.optim.AdamW):
            bnb = is_bnb_engine(engine)
            state = engine.state
            params = list(chain.from_iterable(map(_PARAMS, engine.param_groups)))
            missing = list(map(operator.is_, chain.from_iterable(grads), repeat(None)))
            sizes = list(map(len, grads))
            ready = memo is not None and memo.states_exist(state, params, missing, sizes)
            if not ready:
                for gi, group in enumerate(engine.param_groups):
                    for pi, p in enumerate(group["params"]):
                        if p.grad is None or (p in state and len(state[p]) != 0):
                            continue
                        created.append(p)
                        if bnb:
                            engine.init_state(group, p, gi, pi)  # type: ignore[attr-defined]
                        else:
                            state[p].update(_torch_adam_init(group, p))
            if not ready and not bnb:
                _lay_out_moments(engine)
            if bnb and hasattr(engine, "prepare_contiguous"):
                engine.prepare_contiguous()  # copies of non-contiguous params, see eightbit
            prepare_kernel = getattr(engine, "prepare_kernel_step", None)
            if prepare_kernel is not None:
                prepare_kernel()  # the 8-bit CPU kernel's tables
            if memo is not None and not ready:
                extra = None if bnb else _fused_states(engine)
                memo.record_states(state, params, sizes, extra)
            if memo is not None and memo.states_extra is not None:
                kept, memo.kept_plan = memo.kept_plan, None  # its containers, filled again
                memo.plan = _plan(engine, grads, memo.states_extra, kept)
            if not bnb and memo is not None and memo.plan is not None:
                if memo.step_counts is None:
                    memo.step_counts = StepCounts()
                names = param_names(engine.param_groups, grads, group_names)
                memo.step_counts.prepare(  # on change: shared?
                    plan_steps(memo.plan), names, _every_step(memo.states_extra, missing)
                )
            elif not bnb:  # torch's step, which costs far more than reading every step
                refuse_nondense(engine, grads, group_names)  # torch's step: past them
                refuse_shared_steps(
                    _steps_of(engine, grads), param_names(engine.param_groups, grads, group_names)
                )
    except BaseException:
        rollback_step(engine, created, memo)
        raise
    return created


_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_STRIDE = torch.Tensor.stride
_STEP = operator.itemgetter("step")


def _lay_out_moments(engine: torch.optim.Optimizer) -> None:
    """Give each moment of a fused group's param that is laid out unlike the param (see
    :func:`~.fusedstep.laid_out_like`) a copy laid out like it, in its state dict (the values stay
    the same). torch's fused kernel pairs elements by memory order; torch creates
    moments laid out like the param, but a checkpoint load or a move between rungs makes
    them contiguous, which would pair a ``channels_last`` or transposed param's elements
    with other elements' moments. Once per change of the state, before anything is
    written, for every param with state (also those without a grad this step: a later
    step that gives one a grad finds it laid out); plain tensors only (a DTensor's
    strides describe the global tensor)."""
    state = engine.state
    for group in engine.param_groups:
        if not group.get("fused"):
            continue
        params = [p for p in group["params"] if p in state]
        for key in _MOMENTS:
            pairs = [(p, state[p][key]) for p in params if key in state[p]]
            if all(
                map(
                    operator.eq,
                    map(_STRIDE, (m for _, m in pairs)),
                    map(_STRIDE, (p for p, _ in pairs)),
                )
            ):
                continue  # laid out like their params: the common case, read in C
            for p, m in pairs:
                plain = type(p) in PLAIN_TYPES and type(m) in PLAIN_TYPES
                if not plain or m.shape != p.shape or laid_out_like(m, p):
                    continue
                state[p][key] = laid_out_copy(m, p)


class FusedStates(NamedTuple):
    """What the fused commit reads of the state, once per change of it
    (:func:`_fused_states`; kept in the memo while every param with a grad had its
    state then, :meth:`~.stepmemo.StepMemo.states_exist`).

    Attributes:
        states: per group, every param's state dict (None for a param without state).
        nondense: per group, the places of the params that are not dense
            (:func:`~.fusedstep.nondense_places`).
        having: every param with state (flat, in order): whether it has one.
        with_state: the state dicts of those params, in order.
    """

    states: list[list[dict[str, Any] | None]]
    nondense: list[list[int]]
    having: list[bool]
    with_state: list[dict[str, Any]]


def _fused_states(engine: torch.optim.Optimizer) -> FusedStates | None:
    """:class:`FusedStates` of a torch Adam engine whose every group can take the direct
    fused call (:func:`~.fusedstep.params_fit`), else None. One lookup per param, once
    per change of the state (not of which params have a grad: a step that changes that
    picks among these)."""
    if not isinstance(engine, torch.optim.Adam):
        return None
    state = engine.state
    out, nondense = [], []
    for group in engine.param_groups:
        if not group.get("fused") or not group["params"] or not params_fit(group["params"]):
            return None
        out.append([state.get(p) or None for p in group["params"]])
        nondense.append(nondense_places(group["params"]))
    flat = list(chain.from_iterable(out))
    having = list(map(operator.is_not, flat, repeat(None)))
    with_state = cast(list[dict[str, Any]], list(compress(flat, having)))
    return FusedStates(out, nondense, having, with_state)


def _plan(
    engine: torch.optim.Optimizer,
    grads: list[list[torch.Tensor | None]],
    fused: FusedStates,
    kept: list[FusedCall] | None = None,
) -> list[FusedCall] | None:
    """The commit's kernel calls (:func:`~.fusedstep.fused_plan`, in ``kept``'s
    containers where it can) on the state dicts of the params with a grad (every one has
    its state: see :class:`FusedStates`), or None for torch's ``step`` (an option
    changed so that a group no longer fits, a state dict lost a tensor)."""
    states: list[list[dict[str, Any]]] = []
    nondense: list[list[int]] = []
    for sts, nd, gs in zip(fused.states, fused.nondense, grads, strict=True):
        present = list(map(operator.is_not, gs, repeat(None)))
        if all(present):
            states.append(cast(list[dict[str, Any]], sts))
            nondense.append(nd)
            continue
        states.append(cast(list[dict[str, Any]], list(compress(sts, present))))
        ranks = list(accumulate(present, initial=0))  # place among those with a grad
        nondense.append([ranks[i] for i in nd if present[i]])
    try:
        return fused_plan(engine, grads, states, nondense, kept)
    except KeyError:
        return None


def _every_step(
    fused: FusedStates, missing: list[bool]
) -> tuple[list[torch.Tensor], list[bool]] | None:
    """``(step of every param with state, whether it has a grad)`` for
    :meth:`~.fusedstep.StepCounts.prepare` (``missing``: per param, whether its grad is
    None), or None when a state dict has no ``step``."""
    try:
        every = list(map(_STEP, fused.with_state))
    except KeyError:
        return None
    present = map(operator.not_, compress(missing, fused.having))
    return every, list(present)


def _steps_of(engine: torch.optim.Optimizer, grads: list[list[torch.Tensor | None]]) -> list[Any]:
    """The ``step`` of every param with a grad and a step count, in order."""
    state = engine.state
    return [
        state[p]["step"]
        for group, gs in zip(engine.param_groups, grads)
        for p, g in zip(group["params"], gs)
        if g is not None and "step" in state.get(p, ())
    ]


def param_names(
    groups: list[dict[str, Any]],
    grads: list[list[torch.Tensor | None]],
    group_names: Mapping[int, str] | None,
) -> Callable[[int], str]:
    """``i -> "param {pi} of {group}"`` for the ``i``-th param with a grad over
    ``groups`` (``grads``: per group, every param's grad or None; the order of
    :func:`_steps_of` and of the fused plan's step tensors), found when called (for
    messages: the common case never names a param).

    Args:
        groups: param groups, in order.
        grads: per group, every param's grad (None where it has none).
        group_names: ``id(group) -> name`` (default ``"group {place in groups}"``).
    """
    names = group_names or {}

    def name(i: int) -> str:
        k = 0
        for gi, (group, gs) in enumerate(zip(groups, grads)):
            for pi, g in enumerate(gs):
                if g is not None:
                    if k == i:
                        return f"param {pi} of {names.get(id(group), f'group {gi}')}"
                    k += 1
        return f"param {i}"

    return name


def rollback_step(
    engine: torch.optim.Optimizer, created: list[torch.Tensor], memo: StepMemo | None = None
) -> None:
    """Drop the state :func:`prepare_step` created and any scratch it holds (and the
    commit's lists it left in ``memo``)."""
    if memo is not None:
        memo.plan = None
    for p in created:
        engine.state.pop(p, None)
    if hasattr(engine, "release_scratch"):  # LadderAdamW, the 8bit engine's copies
        engine.release_scratch()
    drop_kernel = getattr(engine, "drop_kernel_step", None)
    if drop_kernel is not None:
        drop_kernel()


def commit_step(engine: torch.optim.Optimizer, memo: StepMemo | None = None) -> None:
    """Run the engine's step on the state :func:`prepare_step` allocated: for torch's
    fused AdamW, the kernel calls on the lists prepare left in ``memo`` when it left
    them (:mod:`optladder.optimizers.fusedstep`), torch's ``step`` otherwise.

    The engine's ``step`` runs without the wrapper ``torch.optim.Optimizer`` puts around
    every optimizer class's ``step`` (which runs the global step hooks of
    ``torch.optim.optimizer.register_optimizer_step_pre_hook``/``_post_hook``): the
    optladder optimizer's own ``step`` already ran them, and they must run once per step.
    """
    plan = None
    if memo is not None:
        plan, memo.plan = memo.plan, None  # one commit per prepare
    if memo is not None and plan is not None:
        run_fused_plan(plan, memo.step_counts)  # prepared with the plan
        memo.kept_plan = release_grads(plan)  # its containers, for the next prepare
    elif isinstance(engine, LadderAdamW) or hasattr(engine, "commit_step"):
        engine.commit_step()  # LadderAdamW, optladder's bitsandbytes engine
    else:
        step: Any = type(engine).step
        if getattr(step, "hooked", False):  # torch's profile_hook_step: unwrap it once
            step = step.__wrapped__
        step(engine)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) until the block is done, then raise KeyboardInterrupt.

    A commit interrupted half-way would leave some params stepped and others not. This
    applies in the main thread while Python's default SIGINT handler is installed; a
    handler of the user's own is left alone (it runs as usual).
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
