"""The three rungs' engines, the fused-spec mapping, and the capability probe.

Nothing here probes memory or reads the environment.
"""

from optladder.optimizers.adamw import LadderAdamW, validate_hyperparams
from optladder.optimizers.build import build_engine
from optladder.optimizers.capabilities import fused_adamw_runs, probe_capabilities
from optladder.optimizers.rounding import Rounding
from optladder.optimizers.state import measure_state_bytes

__all__ = [
    "LadderAdamW",
    "Rounding",
    "build_engine",
    "fused_adamw_runs",
    "measure_state_bytes",
    "probe_capabilities",
    "validate_hyperparams",
]
