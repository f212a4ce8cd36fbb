"""Framework integrations, each imported only when asked for (``import optladder`` imports
none of them, nor their frameworks):

- :mod:`optladder.integrations.hf`: Hugging Face ``transformers.Trainer`` (needs
  ``transformers`` and ``accelerate``).
- :mod:`optladder.integrations.lightning`: PyTorch Lightning (needs ``lightning``).

Both guard a whole train step with :class:`optladder.Ladder`, so that an out-of-memory
error in forward or backward reruns the step one rung down; an OOM in the optimizer step
is retried by the optimizer itself, in any trainer.
"""

from __future__ import annotations

from optladder.selector.ladder import unwrap_optimizer

__all__ = ["unwrap_optimizer"]
