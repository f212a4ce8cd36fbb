"""What a step's inputs were when they were last checked, so a step can skip checking
them again.

A step checks its inputs (group options, grads) before anything is written. Most steps
see the same groups and options as the one before, and often the same grad tensors, so
each check is done once per change instead of once per step: the param-group option
values are compared with a snapshot (one tuple per group), and params and grads by
identity, element by element in C (``map(operator.is_, ...)``), which costs a few
nanoseconds a param against the microseconds of checking one.

What counts as a change (and so is checked again): another group list or group dict, a
group option of another value (an lr set by a scheduler, betas, weight decay, ...; a
tensor-valued option is checked at every step, since it can change in place), another
params list, and another grad tensor (``zero_grad()`` with ``set_to_none=True`` makes
new ones at every backward, so those are checked at every step, as torch checks them).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, NamedTuple, cast

import torch

grad_of = operator.attrgetter("grad")
_VALUES = dict.values
"""``p -> p.grad``, for ``list(map(grad_of, params))`` (a loop in C)."""

_NO_GRAD = type(None)  # called, returns None: the "reference" of a missing grad
_call: Callable[[Callable[[], Any]], Any] = getattr(operator, "call", lambda f: f())

GradRefs = list[Callable[[], "torch.Tensor | None"]]
"""Weak references to grads (None where a param has none): a memo must not keep a grad
alive after ``zero_grad(set_to_none=True)`` (that would double the grads' memory)."""


def grad_refs(grads: Sequence[torch.Tensor | None]) -> GradRefs:
    """Weak references to ``grads`` (see :data:`GradRefs`)."""
    return [_NO_GRAD if g is None else weakref.ref(g) for g in grads]


def same_grads(refs: GradRefs, grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether ``refs`` (from :func:`grad_refs`) still point at exactly ``grads`` (a
    reference to a grad that died reads as None: the missing grads must be the same)."""
    return (
        len(refs) == len(grads)
        and all(map(operator.is_, map(_call, refs), grads))
        and list(map(operator.is_, grads, repeat(None)))
        == list(map(operator.is_, refs, repeat(_NO_GRAD)))
    )


def _grad_ptrs(grads: Sequence[torch.Tensor | None]) -> list[int]:
    """The grads' ``data_ptr()``s, None left out (in C)."""
    present: Sequence[torch.Tensor | None] = grads
    if any(map(operator.is_, grads, repeat(None))):
        present = [g for g in grads if g is not None]
    return list(map(_DATA_PTR, cast(Sequence[torch.Tensor], present)))


_DATA_PTR = torch.Tensor.data_ptr


def same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects in the same order (identity, not
    ``==``: tensors compare elementwise)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class _AnyValue:
    """Equal to anything: stands for ``params``/``param_names`` in an options snapshot
    (params are compared by identity elsewhere; comparing tensors with ``==`` would
    compare their elements)."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return True


class _ListValue:
    """A list option (``betas`` set as ``[0.9, 0.999]``, or a list subclass) as it was:
    equal to a list of equal items. The list itself can change in place, so the snapshot
    holds a copy."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, items: list[Any]) -> None:
        self.items = tuple(items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list) and tuple(other) == self.items


_ANY = _AnyValue()
_NOT_OPTIONS = frozenset(("params", "param_names"))
_IMMUTABLE = (float, int, str, bytes, complex, type(None), torch.dtype, torch.device)
"""Types whose values cannot change in place (``bool`` and numpy's float64 are
subclasses): an option holding the same such object holds the same value."""


class OptionsSnapshot(NamedTuple):
    """A group's options as they were (:func:`options_snapshot`).

    Attributes:
        keys: the group's keys, in order.
        objects: its values themselves, for the identity check of :func:`same_options`.
        fixed: whether every option value is immutable, so that the same objects are
            the same values.
        types: its values' types.
        values: its values as compared with ``==`` (``params``/``param_names`` equal to
            anything, a list as a copy of its items).
        nested: picks the tuple and list options (betas) out of the list of values
            (``operator.itemgetter`` of their places), or None when there are none.
        several: whether there are several (``nested`` returns a tuple of them).
        nested_then: what ``nested`` picked from ``objects`` when all are tuples (the
            same tuple objects hold the same items), else None.
        item_types: the types of their items, in order: another tuple of equal items is
            the same value only with items of the same types (``torch.tensor(0.9) ==
            0.9`` is a true tensor).
    """

    keys: list[str]
    objects: list[Any]
    fixed: bool
    types: list[type]
    values: list[Any]
    nested: Callable[[list[Any]], Any] | None
    several: bool
    nested_then: Any
    item_types: list[type]


def _holds_tensor(value: object) -> bool:
    """Whether ``value`` is a tensor or a tuple/list holding one (at any depth)."""
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, tuple | list) and any(map(_holds_tensor, value))


def _immutable(value: object) -> bool:
    """Whether ``value`` cannot change in place: an :data:`_IMMUTABLE` scalar, or a
    tuple of such values (at any depth)."""
    if isinstance(value, tuple):
        return all(map(_immutable, value))
    return isinstance(value, _IMMUTABLE)


def options_snapshot(
    group: Mapping[str, Any], previous: OptionsSnapshot | None = None
) -> OptionsSnapshot | None:
    """The group's options (every key but ``params`` and ``param_names``) as they are
    now, for :func:`same_options`, or None when one is a tensor or a tuple or list
    holding one (a tensor lr, betas as tensors): a tensor can change in place, so such
    options are never taken as unchanged: they are checked at every step.

    ``previous``: the group's last snapshot, if any. When the group has its keys, every
    value is of the type it had, all were immutable and the tuple options (betas) are
    the tuples it saw (an LR scheduler setting ``lr`` at every step), the snapshot is
    ``previous`` with the new values (~1 us where the full one takes ~14 us a group).
    """
    keys = list(group)
    objects = list(group.values())
    types = list(map(type, objects))
    if (
        previous is not None
        and previous.fixed
        and types == previous.types
        and keys == previous.keys
        and (
            previous.nested is None
            or (
                previous.nested_then is not None
                and (
                    all(map(operator.is_, previous.nested(objects), previous.nested_then))
                    if previous.several
                    else previous.nested(objects) is previous.nested_then
                )
            )
        )
    ):
        # the same immutable types, the same tuples: no tensor and no list among them
        fast = list(objects)
        for i, value in enumerate(previous.values):
            if value is _ANY:
                fast[i] = _ANY
        return previous._replace(objects=objects, values=fast)
    values = list(objects)
    places: list[int] = []
    fixed = True
    for i, (key, t) in enumerate(zip(keys, types)):
        if key in _NOT_OPTIONS:
            values[i] = _ANY
            continue
        value = objects[i]
        if _holds_tensor(value):
            return None
        if issubclass(t, tuple | list):
            places.append(i)
        if issubclass(t, list):  # a subclass too (a config loader's list)
            values[i] = _ListValue(value)
        fixed = fixed and _immutable(value)
    nested = operator.itemgetter(*places) if places else None
    item_types = [type(x) for i in places for x in objects[i]]
    tuples = all(issubclass(types[i], tuple) for i in places)
    then = nested(objects) if nested is not None and tuples else None
    several = len(places) > 1
    return OptionsSnapshot(keys, objects, fixed, types, values, nested, several, then, item_types)


def _item_types(picked: Any, several: bool) -> list[type]:
    """The types of the items of what :attr:`OptionsSnapshot.nested` picked."""
    return list(map(type, chain.from_iterable(picked) if several else picked))


def same_options(group: Mapping[str, Any], snapshot: OptionsSnapshot) -> bool:
    """Whether ``group`` has the keys, value types and option values of ``snapshot``.

    When every value is the object the snapshot saw and all options are immutable (the
    common case: nothing was assigned since), two list comparisons in C; otherwise the
    types, those of the items of tuple and list options unless they are the tuples the
    snapshot saw (a tuple holding a tensor where a float was is another value, though
    the two compare equal), then the values."""
    keys, objects, fixed, types, values, nested, several, then, item_types = snapshot
    now = list(group.values())
    if list(group) != keys:
        return False
    if fixed and all(map(operator.is_, now, objects)):
        return True
    if list(map(type, now)) != types:
        return False
    if nested is not None:
        picked = nested(now)
        same = then is not None and (
            all(map(operator.is_, picked, then)) if several else picked is then
        )
        if not same and _item_types(picked, several) != item_types:
            return False
    return bool(now == values)


REFS_EVERY = 16
"""While grads are new tensors at every step, one step in this many records them (to
notice when they start being reused); see :class:`KeptGrads`."""


@dataclass
class KeptGrads:
    """The grads a check (or a kernel table) last took, as weak references, to tell at
    the next step whether they are the same tensors.

    While each step brings new grad tensors (``zero_grad()`` sets them to None, the
    backward makes new ones), the grads are recorded at one step in :data:`REFS_EVERY`
    only: references that are never found again cost a weak reference per param per
    step, and their churn sets off the garbage collector (~3 us a grad over 20,000
    grads, more than the step's kernel).

    Attributes:
        refs: weak references to the grads last recorded (see :data:`GradRefs`); empty
            when not recorded (matches no grads).
        reused: whether a step found the recorded grads again (they are reused: kept
            between steps, ``zero_grad(set_to_none=False)``).
        fresh: steps in a row whose grads were new tensors while ``reused`` is False.
        ptrs: the kept grads' addresses (None present) when recorded while kept.
        addresses: whether :meth:`same` compares addresses too (False for a caller that
            reads them itself, as the C kernel's table does).
    """

    refs: GradRefs = field(default_factory=list)
    reused: bool = True
    fresh: int = 0
    ptrs: list[int] | None = None
    addresses: bool = True

    def same(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``grads`` are the grads last recorded (identity), at the same
        addresses (a grad whose ``.data`` was replaced, with another size or layout, is
        the same object over other memory: checked again). The addresses are recorded
        while grads are kept; the first time recorded grads are found again (after a
        run of new ones), they are checked again and recorded with their addresses."""
        if not same_grads(self.refs, grads):
            return False
        self.reused = True
        if not self.addresses:
            return True
        return self.ptrs is not None and _grad_ptrs(grads) == self.ptrs

    def record(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Record ``grads`` (at one step in :data:`REFS_EVERY` while they are new at
        every step; their addresses only while they are kept)."""
        if self.reused or self.fresh % REFS_EVERY == 0:
            self.refs = grad_refs(grads)
            self.ptrs = _grad_ptrs(grads) if self.reused and self.addresses else None
        elif self.refs:
            # matches no grads: checked again at the next step (emptied in place: a new
            # list a step per group would outlive the step, see fusedstep.group_call)
            self.refs.clear()
        self.fresh = 0 if self.reused else self.fresh + 1
        self.reused = False


@dataclass
class AllGrads:
    """Every group's params and grads as they were when their checks last passed, flat:
    one comparison for all groups (:meth:`same`), where :meth:`StepMemo.grads_unchanged`
    costs a few microseconds a group (over 1,000 groups, more than torch's step).

    Attributes:
        groups: the group dicts (identity).
        params: every group's params, in order (identity).
        grads: their grads (:class:`KeptGrads`).
    """

    groups: list[Any] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    grads: KeptGrads = field(default_factory=KeptGrads)

    def same(
        self,
        groups: Sequence[Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
    ) -> bool:
        """Whether ``groups`` hold ``params`` (all groups', flat) with the same grad
        tensors at the same addresses as last recorded."""
        return (
            same_objects(groups, self.groups)
            and same_objects(params, self.params)
            and len(params) == len(grads)
            and self.grads.same(grads)
        )

    def record(
        self,
        groups: Sequence[Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
    ) -> None:
        """Remember them (their checks passed; the grads as :meth:`KeptGrads.record`
        keeps them)."""
        if not same_objects(groups, self.groups):
            self.groups = list(groups)
        if not same_objects(params, self.params):
            self.params = list(params)
        self.grads.record(grads)


@dataclass
class GroupMemo:
    """One param group as it was when its checks last passed.

    Attributes:
        group: the group dict (identity).
        options: :func:`options_snapshot` of the group when its options were checked,
            or None (check again).
        params: its params when its grads were checked, in order (identity).
        grads: their grads then (:class:`KeptGrads`).
        context: whatever else the grad checks read.
    """

    group: dict[str, Any]
    options: OptionsSnapshot | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    grads: KeptGrads = field(default_factory=KeptGrads)
    context: object = None


@dataclass
class StepMemo:
    """The groups of one optimizer as they were when their checks last passed, by place
    in ``param_groups``. Owned by whoever runs the checks (the optladder optimizer keeps
    one per engine); dropping it only makes the next step check everything.

    It holds the params and the state dicts (not the grads): drop it before the state
    moves to another format, so the old state can be freed as it goes.

    Attributes:
        groups: place in ``param_groups`` -> :class:`GroupMemo`.
        all_options: every group's dict, keys and values when all passed their checks
            (:meth:`record_all_options`), or None.
        all_grads: every group's params and grads when their checks last passed, for
            callers that check all groups' grads at once (:class:`AllGrads`).
    """

    groups: dict[int, GroupMemo] = field(default_factory=dict)
    all_options: tuple[list[Any], list[Any], list[Any]] | None = None
    all_grads: AllGrads = field(default_factory=AllGrads)

    def all_options_unchanged(self, groups: list[dict[str, Any]]) -> bool:
        """Whether ``groups`` are the group dicts of :meth:`record_all_options`, in order,
        each with the same keys holding the same objects, all immutable (then every
        group's options are as they were checked: one pass in C for all groups, where
        :meth:`options_unchanged` costs a few microseconds a group)."""
        seen = self.all_options
        if seen is None:
            return False
        seen_groups, keys, values = seen
        return (
            same_objects(groups, seen_groups)
            and same_objects(list(chain.from_iterable(groups)), keys)
            and same_objects(list(chain.from_iterable(map(_VALUES, groups))), values)
        )

    def record_all_options(self, groups: list[dict[str, Any]]) -> None:
        """Remember every group's keys and values for :meth:`all_options_unchanged`, when
        each group's options passed their checks as they are now (:meth:`record_options`
        or :meth:`options_unchanged`) and all are immutable (no list, no tensor: what
        changes in place is compared by value, group by group)."""
        self.all_options = None
        for gi, group in enumerate(groups):
            memo = self.groups.get(gi)
            if memo is None or memo.group is not group or memo.options is None:
                return
            if not memo.options.fixed:
                return
        self.all_options = (
            list(groups),
            list(chain.from_iterable(groups)),
            list(chain.from_iterable(map(_VALUES, groups))),
        )

    def _memo(self, gi: int, group: dict[str, Any]) -> GroupMemo:
        memo = self.groups.get(gi)
        if memo is None or memo.group is not group:
            memo = self.groups[gi] = GroupMemo(group)
        return memo

    def options_unchanged(self, gi: int, group: dict[str, Any]) -> bool:
        """Whether group ``gi`` is the same dict with the same option values as when its
        options were last checked (:meth:`record_options`)."""
        memo = self.groups.get(gi)
        if memo is None or memo.group is not group or memo.options is None:
            return False
        return same_options(group, memo.options)

    def record_options(self, gi: int, group: dict[str, Any]) -> None:
        """Remember group ``gi``'s options as they are now (their checks passed)."""
        memo = self._memo(gi, group)
        memo.options = options_snapshot(group, memo.options)

    def grads_unchanged(
        self,
        gi: int,
        group: dict[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        context: object,
    ) -> bool:
        """Whether group ``gi`` is the same dict holding the same params with the same
        grad tensors, and ``context`` is equal, as when its grads were last checked
        (:meth:`record_grads`)."""
        memo = self.groups.get(gi)
        return (
            memo is not None
            and memo.group is group
            and memo.context == context
            and same_objects(params, memo.params)
            and memo.grads.same(grads)
        )

    def record_grads(
        self,
        gi: int,
        group: dict[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        context: object,
    ) -> None:
        """Remember group ``gi``'s params and grads as they are now (their checks
        passed; the grads as :meth:`KeptGrads.record` keeps them)."""
        memo = self._memo(gi, group)
        if not same_objects(params, memo.params):  # kept when the same: see KeptGrads.record
            memo.params = list(params)
        memo.context = context
        memo.grads.record(grads)

    def trim(self, n_groups: int) -> None:
        """Forget groups at places ``>= n_groups`` (the optimizer has fewer groups)."""
        for gi in [gi for gi in self.groups if gi >= n_groups]:
            del self.groups[gi]


_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")


def kind_columns(grads: Sequence[Any]) -> list[list[Any]]:
    """What a kernel's routing reads of each grad (no None among them), as columns to
    compare with ``==``: dtypes, contiguity, element counts, devices, layouts (loops in
    C)."""
    return [
        list(map(_DTYPE, grads)),
        list(map(torch.Tensor.is_contiguous, grads)),
        list(map(torch.Tensor.numel, grads)),
        list(map(torch.Tensor.get_device, grads)),
        list(map(_LAYOUT, grads)),
    ]


def grad_kinds(grads: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
    """What a kernel's routing reads of a group's grads, to compare with ``==``: which
    are None, and the others' :func:`kind_columns` but their layouts, and whether all
    are dense."""
    present = [g for g in grads if g is not None]
    *columns, layouts = kind_columns(present)
    return (
        list(map(operator.is_, grads, repeat(None))),
        *columns,
        all(map(operator.is_, layouts, repeat(torch.strided))),
    )
