"""A :class:`LadderAdamW` over param groups all in one rung's state format, built as
:class:`optladder.AdamW`'s construction builds its groups (:func:`rung_options`), without
the probe and the decision: what tests of one rung's state format step."""

from __future__ import annotations

from typing import Any

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.build import rung_options
from optladder.optimizers.checked import first_params_only
from optladder.rungs import Rung


def build_engine(
    rung: Rung,
    param_groups: list[dict[str, Any]],
    *,
    fused: bool,
    checked: bool = False,
    **hyperparams: Any,
) -> LadderAdamW:
    """``param_groups`` checked for ``rung`` and put in its state format, then a
    :class:`LadderAdamW` over them (``hyperparams``: its keyword arguments, e.g. ``lr``,
    ``decoupled_weight_decay``). ``fused``, ``checked``: as for :func:`rung_options`
    (``checked``: torch's per-param checks then read each group's first param only)."""
    options = rung_options(rung, param_groups, fused=fused, checked=checked)
    with first_params_only(param_groups, checked):
        return LadderAdamW(param_groups, **hyperparams, **options)


def eightbit(param_groups: Any, **hyperparams: Any) -> LadderAdamW:
    """The 8bit rung over ``param_groups`` (params or group dicts, as any optimizer takes
    them): a :class:`LadderAdamW` with every group in the 8bit state format
    (bitsandbytes' ``AdamW8bit`` state, stepped by optladder's 8-bit CPU kernel on the
    CPU)."""
    groups = list(param_groups)
    if not groups or not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return build_engine("8bit", groups, fused=False, **hyperparams)
