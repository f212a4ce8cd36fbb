"""Build an engine over param groups whose params construction has checked already.

``torch.optim.Optimizer.add_param_group`` checks every param it is given (a tensor, a
leaf, listed once over all groups). optladder's construction has checked all of that
before it builds an engine (:func:`optladder.selector.checks.check_groups`, whose messages
name the param and say what to do), and over tens of thousands of small tensors torch's
second pass costs as much as torch's whole optimizer construction. While an engine is
built inside :func:`first_params_only`, each group holds its first param only, so
torch's checks read one param per group; the engine keeps the group dicts themselves
(torch appends the dicts it is given), and each gets its full list back on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def first_params_only(param_groups: list[dict[str, Any]], checked: bool = True) -> Iterator[None]:
    """Within the block each group's ``"params"`` is a list of its first param (empty
    for an empty group); on exit, normal or not, each group dict holds its full list
    again (the same list object it held before).

    Only for groups whose params passed construction's checks; a builder runs its own
    per-param checks (dtypes, bitsandbytes' overrides) over the full lists before.

    Args:
        param_groups: the groups, each with a ``"params"`` list of tensors.
        checked: False does nothing (the groups are built as given, torch checking every
            param).
    """
    if not checked:
        yield
        return
    full = [group["params"] for group in param_groups]
    for group, params in zip(param_groups, full):
        group["params"] = params[:1]
    try:
        yield
    finally:
        for group, params in zip(param_groups, full):
            group["params"] = params
