"""Wires policies and optimizers together: ``choose_optimizer``, the optladder optimizer,
and the OOM ladder."""

from optladder.oom import is_oom
from optladder.selector.adamw import AdamW, choose_optimizer
from optladder.selector.adopt import adopt
from optladder.selector.choose import InsufficientMemoryError
from optladder.selector.escalation import Escalation
from optladder.selector.ladder import Ladder
from optladder.selector.optimizer import (
    LadderOptimizer,
    OptimizerOutOfMemoryError,
    PartialStepError,
)

__all__ = [
    "AdamW",
    "Escalation",
    "InsufficientMemoryError",
    "Ladder",
    "LadderOptimizer",
    "OptimizerOutOfMemoryError",
    "PartialStepError",
    "adopt",
    "choose_optimizer",
    "is_oom",
]
