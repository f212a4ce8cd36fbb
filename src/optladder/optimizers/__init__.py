"""The three rungs' state formats, the fused-spec mapping, and the capability probe.

Nothing here probes memory or reads the ``OPTLADDER_*`` overrides (the kernels read
only ``CC``, ``XDG_CACHE_HOME``/``HOME`` and ``TRITON_INTERPRET``).
"""

from optladder.optimizers.adamw import LadderAdamW, validate_hyperparams
from optladder.optimizers.capabilities import probe_capabilities
from optladder.optimizers.state import measure_state_bytes

__all__ = [
    "LadderAdamW",
    "measure_state_bytes",
    "probe_capabilities",
    "validate_hyperparams",
]
