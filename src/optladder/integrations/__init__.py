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

from optladder.selector.optimizer import LadderOptimizer

__all__ = ["unwrap_optimizer"]


def unwrap_optimizer(optimizer: object) -> LadderOptimizer:
    """The optladder optimizer inside a framework's wrappers.

    Follows ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``) to the innermost optladder optimizer: a
    ``LightningOptimizer`` is an instance of its optimizer's class holding a copy of its
    attributes, which must not be moved down the ladder in the real one's place.

    Args:
        optimizer: an optladder optimizer, or a wrapper around one.

    Raises:
        TypeError: if there is no optladder optimizer inside, naming what was found.
    """
    seen, found = optimizer, None
    for _ in range(8):  # wrappers nest a few levels at most
        if isinstance(seen, LadderOptimizer):
            found = seen  # a wrapper may subclass it (LightningOptimizer does): go deeper
        inner = getattr(seen, "optimizer", None)
        if inner is None or inner is seen:
            break
        seen = inner
    if found is not None:
        return found
    raise TypeError(
        "expected an optladder optimizer (optladder.AdamW or choose_optimizer's), or a "
        f"wrapper around one; got "
        f"{type(optimizer).__name__} holding {type(seen).__name__}"
    )
