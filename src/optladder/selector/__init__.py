"""Wires policies and optimizers together: ``choose_optimizer``, the optladder optimizer,
and the OOM ladder."""

from optladder.oom import describe_error, is_oom
from optladder.selector.adamw import AdamW, choose_optimizer
from optladder.selector.adopt import adopt
from optladder.selector.choose import InsufficientMemoryError, OptladderWarning
from optladder.selector.escalation import Escalation
from optladder.selector.ladder import Ladder
from optladder.selector.optimizer import (
    ORIGIN_KEY,
    REASON_KEY,
    RUNG_KEY,
    LadderOptimizer,
    OptimizerOutOfMemoryError,
    PartialStepError,
)

__all__ = [
    "ORIGIN_KEY",
    "REASON_KEY",
    "RUNG_KEY",
    "AdamW",
    "Escalation",
    "InsufficientMemoryError",
    "Ladder",
    "LadderOptimizer",
    "OptimizerOutOfMemoryError",
    "OptladderWarning",
    "PartialStepError",
    "adopt",
    "choose_optimizer",
    "describe_error",
    "is_oom",
]
