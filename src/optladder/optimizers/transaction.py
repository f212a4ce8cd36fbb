"""Steps in two phases: *prepare* allocates everything, *commit* writes.

An out-of-memory error in :func:`prepare_step` is rolled back (the state it created is
dropped), so params, moments and step counts stay exactly as they were. The commit of
:class:`LadderAdamW` (every rung a state format of it) allocates nothing that the
dispatcher sees:

- the fp32 and bf16 formats: state and its scratch buffers are allocated in prepare
  (:meth:`LadderAdamW.prepare_step`), and so are the lists of torch's fused kernel calls
  for the fp32 format's float32/float64 params (:mod:`optladder.optimizers.fusedstep`);
  its kernels and its eager loop write in place. torch's foreach AdamW (complex params)
  allocates as it steps, so it steps copies first, before anything is written.
- the 8bit format (:class:`~optladder.optimizers.eightbit.EightBitGroups`): state is
  created in prepare with bitsandbytes' own ``init_state``; its CUDA kernel updates in
  place, and so does optladder's 8-bit CPU kernel, whose tables are written in prepare
  (``prepare_kernel_step``). bitsandbytes' CPU fallback (no C compiler) allocates inside
  the update op, so there a real OOM can still leave one param half-written.

The checks of a step run once per change, not once per step: with a
:class:`~optladder.optimizers.stepmemo.StepMemo`, group options with the same values and
grads that are the same tensors are not checked again.
"""

from __future__ import annotations

import contextlib
import operator
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from itertools import chain, repeat
from typing import Any, cast

import torch

from optladder.optimizers.adamw import LadderAdamW, is_8bit_group, validate_group_hyperparams
from optladder.optimizers.fusedstep import refuse_resized
from optladder.optimizers.migrate import check_step_range, read_step
from optladder.optimizers.stepmemo import StepMemo, grad_of


def _refuse_other_engines(engine: torch.optim.Optimizer) -> None:
    """Raise for an optimizer this module does not step in two phases.

    Raises:
        TypeError: naming its class and the one it takes.
    """
    if not isinstance(engine, LadderAdamW):
        raise TypeError(
            "a two-phase step takes optladder's LadderAdamW (every rung a state format of "
            f"it), got {type(engine).__name__}"
        )


def check_step_inputs(
    engine: torch.optim.Optimizer,
    group_names: Mapping[int, str] | None = None,
    memo: StepMemo | None = None,
) -> list[list[torch.Tensor | None]]:
    """Refuse, before anything is allocated or written, what would fail half-way:
    out-of-range group hyperparameters (and :class:`LadderAdamW`'s own group options,
    :meth:`LadderAdamW.check_group_options`), a group switched to the other weight decay mode
    (``decoupled_weight_decay``), sparse grads, grads of another shape, dtype or
    device, and 8bit groups' step counts bitsandbytes' kernel cannot take (see
    :func:`optladder.optimizers.migrate.step_limit`; :class:`LadderAdamW` checks its other
    formats' own, and torch's float64 steps cannot leave their range by stepping from a
    checkpoint that loaded).

    Args:
        engine: the :class:`LadderAdamW`.
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
        TypeError: another engine (:func:`_refuse_other_engines`).
    """
    _refuse_other_engines(engine)
    ladder = cast(LadderAdamW, engine)
    names = group_names or {}
    groups = engine.param_groups
    if memo is not None:
        memo.trim(len(groups))
    all_grads: list[list[torch.Tensor | None]] = []
    # the groups whose grads are checked, by place (ints: no tuple per group, which over
    # many groups would outlive the step's young collections, see fusedstep.group_call)
    changed: list[int] = []
    options_same = memo is not None and memo.all_options_unchanged(groups)
    every = None if memo is None else memo.all_grads
    for gi, group in enumerate(groups):
        if not options_same and (memo is None or not memo.options_unchanged(gi, group)):
            try:
                missing = [key for key in _HYPERPARAMS if key not in group]
                if missing:  # deleted by hand: the step would fail half-way
                    raise ValueError(
                        f"the key {', '.join(map(repr, missing))} is missing (every group "
                        "of a built optimizer holds it); set it on the group again"
                    )
                validate_group_hyperparams(group)
                _check_decay_mode(ladder, group)
                LadderAdamW.check_group_options(group)
                ladder.check_kernel_flags(group)
                ladder.check_8bit_options(group)
            except ValueError as exc:
                raise ValueError(f"param {names.get(id(group), f'group {gi}')}: {exc}") from None
            if memo is not None:
                memo.record_options(gi, group)
        params = group["params"]
        grads = list(map(grad_of, params))
        all_grads.append(grads)
        if every is None and (
            memo is None or not memo.grads_unchanged(gi, group, params, grads, None)
        ):
            changed.append(gi)
    if memo is not None and not options_same:
        memo.record_all_options(groups)
    if every is not None:  # every group's grads at once: all checked when any changed
        flat_params = list(chain.from_iterable(map(_PARAMS, groups)))
        flat_grads = list(chain.from_iterable(all_grads))
        if not every.same(groups, flat_params, flat_grads):
            changed = list(range(len(groups)))
    # the groups' grads checked together, in C
    to_check = list(chain.from_iterable(groups[gi]["params"] for gi in changed))
    their_grads = list(chain.from_iterable(all_grads[gi] for gi in changed))
    if not _grads_match(to_check, their_grads):
        for gi in changed:
            params = groups[gi]["params"]
            if not _grads_match(params, all_grads[gi]):  # raises, naming it:
                _check_grads(params, names.get(id(groups[gi]), f"group {gi}"))
    if every is not None:
        if changed:
            every.record(groups, flat_params, flat_grads)
        return all_grads
    for gi in changed:
        group = groups[gi]
        params = group["params"]
        if is_8bit_group(group):  # bitsandbytes' CUDA kernel's range
            _check_bnb_steps(engine, group, names.get(id(group), f"group {gi}"))
        if memo is not None:
            memo.record_grads(gi, group, params, all_grads[gi], None)
    return all_grads


def _check_decay_mode(engine: torch.optim.Optimizer, group: Mapping[str, Any]) -> None:
    """Refuse a group whose ``decoupled_weight_decay`` (set by hand after construction)
    is not the optimizer's mode: one mode per optimizer, as construction,
    ``add_param_group`` and loads require (the 8bit format keeps the optimizer's mode
    and would ignore the group's; the others would decay that group the other way, and
    the checkpoint would not load back)."""
    mode = bool(engine.defaults.get("decoupled_weight_decay", True))
    if group.get("decoupled_weight_decay", mode) != mode:
        raise ValueError(
            f"decoupled_weight_decay={group['decoupled_weight_decay']!r}, but this optimizer "
            f"decays the {'AdamW' if mode else 'Adam'} way (decoupled_weight_decay={mode!r}); "
            "one mode per optimizer: create it with the other mode instead"
        )


_HYPERPARAMS = ("lr", "betas", "eps", "weight_decay")
_LAYOUT = operator.attrgetter("layout")
_IS_CPU = operator.attrgetter("is_cpu")
_PARAMS = operator.itemgetter("params")
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")


def _grads_match(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> bool:
    """Whether every grad is dense and has its param's shape, device and dtype: the
    checks of :func:`_check_grads` as loops in C, for the common case where all pass.
    Shapes are compared pair by pair, not as lists: a list of 20,000 ``torch.Size``
    tuples would set off the garbage collector's full passes, which cost more than the
    checks."""
    present = cast(list[torch.Tensor], grads)  # unless some are None:
    if any(map(operator.is_, grads, repeat(None))):
        present = [g for g in grads if g is not None]
        params = [p for p, g in zip(params, grads) if g is not None]
    return (
        all(map(operator.is_, map(_LAYOUT, present), repeat(torch.strided)))
        and list(map(_DTYPE, present)) == list(map(_DTYPE, params))
        and list(map(_DEVICE, present)) == list(map(_DEVICE, params))
        and all(map(torch.Tensor.is_same_size, present, params))
    )


def _check_bnb_steps(engine: torch.optim.Optimizer, group: Mapping[str, Any], name: str) -> None:
    """Refuse a bitsandbytes step count (a Python int) its CUDA kernel cannot step from
    (:func:`~optladder.optimizers.migrate.step_limit`; on the CPU the limit is float64's
    integer range, which stepping cannot pass and loads check)."""
    params = group["params"]
    if all(map(_IS_CPU, params)):  # the common case, in C
        return
    for pi, p in enumerate(params):
        if p.grad is None or p.is_cpu:
            continue
        st = engine.state.get(p)
        if st and "step" in st:
            check_step_range(read_step(st), engine, p, f"param {pi} of {name}", group)


def _check_grads(params: list[torch.Tensor], name: str) -> None:
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


def prepare_step(
    engine: torch.optim.Optimizer,
    group_names: Mapping[int, str] | None = None,
    memo: StepMemo | None = None,
) -> list[torch.Tensor]:
    """Allocate the state the engine's next step needs, before anything is written.

    Args:
        engine: the :class:`LadderAdamW`.
        group_names: names of its groups in messages (see :func:`check_step_inputs`).
        memo: what passed the checks before (see :func:`check_step_inputs`).

    Returns:
        The params whose state this call created (for :func:`rollback_step`).

    Raises:
        ValueError: from :func:`check_step_inputs`, before anything changes.
        TypeError: another engine (:func:`_refuse_other_engines`).
        Whatever the allocation raised (an OOM); the state created so far is dropped
        first, so the engine is as it was.
    """
    grads = check_step_inputs(engine, group_names, memo)
    ladder = cast(LadderAdamW, engine)  # check_step_inputs refused any other
    if memo is None:  # with a memo, the optimizer checks this when params change
        refuse_resized(ladder, grads, group_names)
    try:  # rolls back its own state on failure; its options and grads were checked above
        return ladder.prepare_step(checked=grads)
    except BaseException:
        rollback_step(ladder, [], memo)
        raise


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
    """Drop the state :func:`prepare_step` created and any scratch it holds (the 8bit
    format's copies and kernel tables included). ``memo``: kept for the callers'
    signature; nothing in it refers to a step in progress."""
    for p in created:
        engine.state.pop(p, None)
    cast(LadderAdamW, engine).release_scratch()


def commit_step(engine: torch.optim.Optimizer, memo: StepMemo | None = None) -> None:
    """Run the optimizer's commit (:meth:`LadderAdamW.commit_step`) on the state
    :func:`prepare_step` allocated. ``memo``: as for :func:`rollback_step`.

    The commit runs no step hooks (those of
    ``torch.optim.optimizer.register_optimizer_step_pre_hook``/``_post_hook``): the
    optladder optimizer's own ``step`` already ran them, and they must run once per step.
    """
    cast(LadderAdamW, engine).commit_step()


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
