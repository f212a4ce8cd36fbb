"""Inputs and decision rules: footprint, free memory, overrides, policy, decision.

Nothing here builds an optimizer; what a device's kernels can do arrives as
:class:`optladder.rungs.Capabilities`.
"""

from optladder.policies.decision import Decision, decide
from optladder.policies.footprint import (
    Footprint,
    measure_footprint,
    normalize_param_groups,
    rung_state_bytes,
    trainable_params,
)
from optladder.policies.memory import probe_free_memory
from optladder.policies.overrides import OverrideError, Overrides, read_overrides
from optladder.policies.policy import Policy

__all__ = [
    "Decision",
    "Footprint",
    "OverrideError",
    "Overrides",
    "Policy",
    "decide",
    "measure_footprint",
    "normalize_param_groups",
    "probe_free_memory",
    "read_overrides",
    "rung_state_bytes",
    "trainable_params",
]
