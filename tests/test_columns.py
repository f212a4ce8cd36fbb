"""ParamColumns: each param read once; the columns and the memory check they feed."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch

from optladder.columns import ParamColumns, dense


def _params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]


def test_columns_hold_each_params_attributes_in_order() -> None:
    a, b = _params((3, 4), (5,))
    c = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16), requires_grad=False)
    cols = ParamColumns([{"params": [a, b]}, {"params": [c]}])
    assert cols.plain
    assert cols.params == [a, b, c]
    assert cols.starts == [0, 2, 3]
    assert cols.numels == [12, 5, 7]
    assert cols.nbytes == [48, 20, 14]  # 4-byte float32, 2-byte bfloat16
    assert cols.size_counts == {48: 1, 20: 1, 14: 1}
    assert ParamColumns.of(_params((2, 3), (6,), (3,))).size_counts == {24: 2, 12: 1}
    assert cols.dtypes == [torch.float32, torch.float32, torch.bfloat16]
    assert cols.requires_grad == [True, True, False]
    assert cols.data_ptrs == [a.data_ptr(), b.data_ptr(), c.data_ptr()]
    assert cols.devices == {torch.device("cpu")}
    assert cols.dtype_names == {"float32", "bfloat16"}
    assert cols.leaves and cols.contiguous
    second = cols.group(1)
    assert second.params == [c]
    assert second.numels == [7]
    assert second.dtype_names == {"bfloat16"}
    assert cols.group(0).requires_grad == [True, True]


@pytest.mark.parametrize("first", [torch.float32, torch.bfloat16])
def test_columns_of_many_params_match_each_params_own_attributes(first: torch.dtype) -> None:
    """Over a thousand params of mixed sizes, dtypes (the first param's own or another)
    and ``requires_grad``: the columns are each param's own attributes, read one by one
    here."""
    count = 1031
    params = [torch.nn.Parameter(torch.zeros(1 + i % 5)) for i in range(count)]
    params[0] = torch.nn.Parameter(torch.zeros(3, dtype=first))
    params[3].requires_grad_(False)
    params[517] = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    cols = ParamColumns.of(params)
    assert cols.plain and cols.leaves and cols.contiguous and cols.dense
    assert cols.data_ptrs == [p.data_ptr() for p in params]
    assert cols.nbytes == [p.numel() * p.element_size() for p in params]
    assert cols.numels == [p.numel() for p in params]
    assert cols.requires_grad == [p.requires_grad for p in params]
    assert cols.dtypes == [p.dtype for p in params]
    assert cols.dtype_set == {p.dtype for p in params}
    assert cols.devices == {torch.device("cpu")}
    w = torch.nn.Parameter(torch.zeros(3))
    late = [*params[:-1], w * 2]  # a non-leaf, last
    assert not ParamColumns.of(late).leaves
    transposed = [*params[:-1], torch.zeros(3, 2).t()]  # dense, not contiguous, last
    cols = ParamColumns.of(transposed)
    assert not cols.contiguous and cols.dense
    assert ParamColumns.of([]).dtype_set == set() and ParamColumns.of([]).devices == set()


def test_disjoint_params_and_disjoint_views_of_one_buffer() -> None:
    assert ParamColumns.of(_params((4,), (8, 2), (1,))).disjoint
    buf = torch.zeros(10)
    halves = [buf[:5], buf[5:]]  # share a storage, not an element
    assert ParamColumns.of(halves).disjoint


def _ranges_disjoint(ranges: list[tuple[int, int]]) -> bool:
    """Reference: every pair of byte ranges ``[start, end)`` compared, O(n**2)."""
    return all(
        b_end <= a_start or a_end <= b_start
        for (a_start, a_end), (b_start, b_end) in itertools.combinations(ranges, 2)
    )


@pytest.mark.parametrize("seed", range(40))
def test_disjoint_agrees_with_comparing_every_pair_in_any_order(seed: int) -> None:
    """Slices of one buffer, shuffled: some sets overlap, some only touch, some have
    gaps, half of them all of one size; the two-sort rule must give the pairwise
    answer."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.zeros(64)
    count = int(torch.randint(2, 9, (), generator=gen))
    starts = torch.randint(0, 56, (count,), generator=gen).tolist()
    sizes = torch.randint(1, 9, (count,), generator=gen).tolist()
    if seed % 2:
        sizes = [sizes[0]] * count
    views = [buf[s : s + n] for s, n in zip(starts, sizes)]
    ranges = [(4 * s, 4 * (s + v.numel())) for s, v in zip(starts, views)]
    assert ParamColumns.of(views).disjoint == _ranges_disjoint(ranges)


def test_disjoint_slices_out_of_address_order() -> None:
    buf = torch.zeros(30)
    assert ParamColumns.of([buf[20:30], buf[0:10], buf[10:20]]).disjoint
    assert not ParamColumns.of([buf[20:30], buf[0:10], buf[9:20]]).disjoint  # 9 twice


def _fills_its_span(t: torch.Tensor) -> bool:
    """Reference for :func:`dense`: the storage offsets of all elements, enumerated one
    by one from the strides, are ``numel`` consecutive offsets, each once."""
    offsets = sorted(
        t.storage_offset() + sum(i * st for i, st in zip(index, t.stride()))
        for index in itertools.product(*map(range, t.shape))
    )
    return bool(offsets) and offsets == list(range(offsets[0], offsets[0] + t.numel()))


def _strided_cases() -> list[torch.Tensor]:
    base = torch.zeros(2, 3, 4, 5)
    return [
        base,
        base.permute(0, 2, 3, 1),
        base.to(memory_format=torch.channels_last),
        base.transpose(1, 3),
        base[:, 1:],
        base[..., ::2],
        base[:, :, :1],
        torch.zeros(3, 1).expand(3, 4),
        torch.zeros(12).as_strided((3, 4), (1, 3)),  # transposed, by hand
        torch.zeros(12).as_strided((3, 4), (1, 1)),  # overlaps itself
        torch.zeros(12).as_strided((3, 1, 4), (4, 7, 1)),  # odd stride on a size-1 dim
        torch.zeros(12).as_strided((2, 2), (2, 2)),  # one stride, two dims
        torch.zeros(0, 3),
        torch.zeros(()),
    ]


@pytest.mark.parametrize("index", range(len(_strided_cases())))
def test_dense_is_true_exactly_when_the_elements_fill_their_span(index: int) -> None:
    t = _strided_cases()[index]
    assert dense(t) == _fills_its_span(t)


def test_a_transposed_or_channels_last_param_keeps_the_bulk_memory_check() -> None:
    """Dense params that are not contiguous (a transposed weight, a channels_last conv
    weight) are still checked in bulk: the memory check sees their byte ranges."""
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    lin = torch.nn.Linear(4, 6)
    params = [conv.weight, torch.nn.Parameter(lin.weight.detach().t()), *_params((5,), (2, 2))]
    cols = ParamColumns.of(params)
    assert not cols.contiguous and cols.dense and cols.disjoint
    buf = torch.zeros(4, 6)
    assert not ParamColumns.of([buf.t(), buf[1]]).disjoint  # row 1 lies inside buf.t()


@pytest.mark.parametrize(
    "case",
    [
        "overlapping slices",
        "listed twice",
        "empty",
        "every other column",
        "expanded",
        "reversed order overlap",
        "a param and its transpose",
    ],
)
def test_memory_that_may_be_shared_is_left_to_the_pairwise_check(case: str) -> None:
    buf = torch.zeros(10)
    (p,) = _params((6,))
    params = {
        "overlapping slices": [buf[:6], buf[4:]],  # elements 4 and 5 in both
        "listed twice": [p, p],
        "empty": [torch.zeros(0), p],
        "every other column": [torch.zeros(3, 4)[:, ::2]],  # holes: its span is not its size
        "expanded": [torch.zeros(3, 1).expand(3, 4)],  # stride 0: elements shared
        "reversed order overlap": [buf[4:], buf[:6]],
        "a param and its transpose": [p.view(2, 3), p.view(2, 3).t()],
    }[case]
    assert not ParamColumns.of(params).disjoint


def test_meta_and_sparse_params_are_not_read_in_bulk() -> None:
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    assert not ParamColumns.of([*_params((2,)), meta]).plain
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on sparse invariant checks
        sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,))
        csr = torch.zeros(2, 2).to_sparse_csr()  # and that CSR is in beta
    assert not ParamColumns.of([sparse]).plain
    assert not ParamColumns.of([csr]).plain


def test_a_non_leaf_is_seen_and_retains_grad_makes_it_one() -> None:
    (w,) = _params((3,))
    y = w * 2
    assert not ParamColumns.of([w, y]).leaves
    y.retain_grad()
    assert ParamColumns.of([w, y]).leaves


def test_subclasses_other_than_parameter_are_not_plain() -> None:
    class Tagged(torch.Tensor):
        pass

    t = torch.zeros(3).as_subclass(Tagged)
    assert not ParamColumns.of([t]).plain
    assert not ParamColumns.of([t]).disjoint


def _per_param_message(groups: list[dict[str, Any]]) -> str | None:
    """What the per-param checks of ``check_groups`` say of ``groups``, reached without
    the columns (their ``plain`` cleared, as for DTensors): None when they pass."""
    from optladder.selector.checks import check_groups

    unread = ParamColumns(groups)
    unread.plain = False
    try:
        check_groups(groups, True, unread)
    except ValueError as exc:
        return str(exc)
    return None


def _bulk_message(groups: list[dict[str, Any]]) -> tuple[bool, str | None]:
    """Whether the bulk pass over the columns takes ``groups``, and what ``check_groups``
    says of them with the columns read (the bulk pass first)."""
    from optladder.selector.checks import _params_pass, check_groups

    cols = ParamColumns(groups)
    taken = _params_pass(cols)
    try:
        check_groups(groups, True, cols)
    except ValueError as exc:
        return taken, str(exc)
    return taken, None


_MANY = 600  # the odd param sits among many plain ones, late in the list


def _case(name: str, at: int) -> list[dict[str, Any]]:
    params: list[torch.Tensor] = [torch.nn.Parameter(torch.randn(4)) for _ in range(_MANY)]
    buf = torch.zeros(10)
    w = torch.nn.Parameter(torch.zeros(3))
    odd: dict[str, list[torch.Tensor]] = {
        "fine": [],
        "listed twice": [params[7]],
        "overlapping slices": [buf[:6], buf[4:]],
        "a view of another param": [params[11].view(2, 2)],
        "expanded": [torch.zeros(3, 1).expand(3, 4)],
        "every other column": [torch.zeros(3, 4)[:, ::2]],
        "transposed": [torch.zeros(3, 4).t()],
        "non-leaf": [w * 2],
        "float8": [torch.zeros(4, dtype=torch.float8_e4m3fn)],
        "int": [torch.zeros(4, dtype=torch.int32)],
        "bfloat16": [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))],
        "frozen": [torch.nn.Parameter(torch.zeros(4), requires_grad=False)],
        "empty": [torch.zeros(0)],
    }[name]
    return [{"params": params[:at] + odd + params[at:]}]


@pytest.mark.parametrize(
    "name",
    [
        "fine",
        "listed twice",
        "overlapping slices",
        "a view of another param",
        "expanded",
        "every other column",
        "transposed",
        "non-leaf",
        "float8",
        "int",
        "bfloat16",
        "frozen",
        "empty",
    ],
)
@pytest.mark.parametrize("at", [0, _MANY - 5])
def test_the_bulk_pass_refuses_exactly_what_the_per_param_checks_refuse(name: str, at: int) -> None:
    """The columns' one pass (dtypes kept as the first param's and the others, flags
    for leaves, contiguity and devices) with the memory check over them: construction's
    checks refuse exactly the params the per-param checks refuse, with their message
    (the bulk pass never refuses: it passes what it can prove fine, and leaves the rest
    to the per-param checks, which name the param). The odd param comes first (its
    dtype is the one the pass compares the others with) or late."""
    groups = _case(name, at)
    want = _per_param_message(groups)
    taken, got = _bulk_message(groups)
    assert got == want
    if want is not None:
        assert not taken  # nothing refused is passed in bulk
        assert "of group 0" in want
    expected_refused = {
        "listed twice",
        "overlapping slices",
        "a view of another param",
        "expanded",
        "non-leaf",
        "float8",
        "int",
    }
    assert (want is not None) == (name in expected_refused)
    # what the bulk pass takes, as proven by hand: plain dense non-empty leaves of
    # allowed dtypes whose byte ranges are pairwise disjoint
    assert taken == (name in ("fine", "transposed", "bfloat16", "frozen"))
