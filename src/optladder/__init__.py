"""optladder: choose how much memory an AdamW optimizer's state may take.

Typical use::

    from optladder import choose_optimizer
    opt = choose_optimizer(model, lr=3e-4, weight_decay=0.01)
    print(opt.decision.summary())

The names below are imported on first use (PEP 562 ``__getattr__``), so ``import
optladder`` and ``optladder --help`` do not import torch; ``from optladder import X``
works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optladder.errors import OptladderWarning
    from optladder.optimizers import measure_state_bytes
    from optladder.optimizers.dcp import DCPLoadPlanner
    from optladder.policies import (
        Decision,
        Footprint,
        OverrideError,
        Overrides,
        Policy,
        decide,
        measure_footprint,
        probe_free_memory,
        read_overrides,
    )
    from optladder.rungs import RUNGS, Capabilities, Rung
    from optladder.selector import (
        AdamW,
        Escalation,
        InsufficientMemoryError,
        Ladder,
        LadderOptimizer,
        OptimizerOutOfMemoryError,
        PartialStepError,
        adopt,
        choose_optimizer,
        is_oom,
    )
    from optladder.units import parse_bytes

__version__ = "0.1.0"
"""The package's version; pyproject.toml reads it from here (one place)."""

_WHERE = {
    "AdamW": "optladder.selector",
    "RUNGS": "optladder.rungs",
    "Capabilities": "optladder.rungs",
    "Rung": "optladder.rungs",
    "OptladderWarning": "optladder.errors",
    "DCPLoadPlanner": "optladder.optimizers.dcp",
    "measure_state_bytes": "optladder.optimizers",
    "Decision": "optladder.policies",
    "Footprint": "optladder.policies",
    "OverrideError": "optladder.policies",
    "Overrides": "optladder.policies",
    "Policy": "optladder.policies",
    "decide": "optladder.policies",
    "measure_footprint": "optladder.policies",
    "probe_free_memory": "optladder.policies",
    "read_overrides": "optladder.policies",
    "Escalation": "optladder.selector",
    "InsufficientMemoryError": "optladder.selector",
    "Ladder": "optladder.selector",
    "LadderOptimizer": "optladder.selector",
    "OptimizerOutOfMemoryError": "optladder.selector",
    "PartialStepError": "optladder.selector",
    "adopt": "optladder.selector",
    "choose_optimizer": "optladder.selector",
    "is_oom": "optladder.selector",
    "parse_bytes": "optladder.units",
}

__all__ = [
    "RUNGS",
    "AdamW",
    "Capabilities",
    "DCPLoadPlanner",
    "Decision",
    "Escalation",
    "Footprint",
    "InsufficientMemoryError",
    "Ladder",
    "LadderOptimizer",
    "OptimizerOutOfMemoryError",
    "OptladderWarning",
    "OverrideError",
    "Overrides",
    "PartialStepError",
    "Policy",
    "Rung",
    "adopt",
    "choose_optimizer",
    "decide",
    "is_oom",
    "measure_footprint",
    "measure_state_bytes",
    "parse_bytes",
    "probe_free_memory",
    "read_overrides",
]  # the keys of _WHERE (a test keeps them equal)


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and cache the name here."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'optladder' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
