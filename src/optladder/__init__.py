"""optladder: choose how much memory an AdamW optimizer's state may take.

Typical use::

    from optladder import choose_optimizer
    opt = choose_optimizer(model, lr=3e-4, weight_decay=0.01)
    print(opt.decision.summary())
"""

from optladder.optimizers import measure_state_bytes
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
    Escalation,
    InsufficientMemoryError,
    Ladder,
    LadderOptimizer,
    OptimizerOutOfMemoryError,
    OptladderWarning,
    PartialStepError,
    adopt,
    choose_optimizer,
    is_oom,
)
from optladder.units import parse_bytes

__all__ = [
    "RUNGS",
    "Capabilities",
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
]
