"""ParamColumns: each param read once; the columns and the memory check they feed."""

from __future__ import annotations

import warnings

import pytest
import torch

from optladder.columns import ParamColumns


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


def test_disjoint_params_and_disjoint_views_of_one_buffer() -> None:
    assert ParamColumns.of(_params((4,), (8, 2), (1,))).disjoint
    buf = torch.zeros(10)
    halves = [buf[:5], buf[5:]]  # share a storage, not an element
    assert ParamColumns.of(halves).disjoint


@pytest.mark.parametrize(
    "case",
    ["overlapping slices", "listed twice", "empty", "transposed view", "reversed order overlap"],
)
def test_memory_that_may_be_shared_is_left_to_the_pairwise_check(case: str) -> None:
    buf = torch.zeros(10)
    (p,) = _params((6,))
    params = {
        "overlapping slices": [buf[:6], buf[4:]],  # elements 4 and 5 in both
        "listed twice": [p, p],
        "empty": [torch.zeros(0), p],
        "transposed view": [torch.zeros(3, 4).t()],  # not contiguous: strides to check
        "reversed order overlap": [buf[4:], buf[:6]],
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
