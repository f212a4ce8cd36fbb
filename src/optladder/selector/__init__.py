"""Wires policies and optimizers together: ``choose_optimizer`` and the optladder optimizer."""

from optladder.selector.choose import InsufficientMemoryError, OptladderWarning, choose_optimizer
from optladder.selector.optimizer import RUNG_KEY, LadderOptimizer

__all__ = [
    "RUNG_KEY",
    "InsufficientMemoryError",
    "LadderOptimizer",
    "OptladderWarning",
    "choose_optimizer",
]
