"""The optladder optimizer: one object per run that delegates to the current rung."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from optladder.policies.decision import Decision
from optladder.rungs import Rung

RUNG_KEY = "rung"
"""Param-group key recording the rung (param groups survive torch's loader and
distributed checkpointing, a top-level key would not)."""


class LadderOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that runs the chosen rung's engine.

    ``param_groups``, ``state`` and ``defaults`` are the engine's own objects, so an LR
    scheduler or a trainer that edits ``opt.param_groups[i]["lr"]`` edits the engine's
    groups. The object stays the same when the rung changes, so references held by
    schedulers and trainers stay valid.

    Each param group carries ``"rung"``, saved in ``state_dict()``.

    Args:
        engine: the rung's optimizer (built by :func:`optladder.optimizers.build_engine`).
        decision: the :class:`optladder.Decision` that chose it.

    Attributes:
        decision: the decision.
        rung: the current rung.
        engine: the current rung's optimizer.
    """

    def __init__(self, engine: torch.optim.Optimizer, decision: Decision) -> None:
        self._engine: torch.optim.Optimizer | None = None
        self._decision = decision
        for group in engine.param_groups:
            group[RUNG_KEY] = decision.rung
        super().__init__(engine.param_groups, engine.defaults)
        self._attach(engine)

    def _attach(self, engine: torch.optim.Optimizer) -> None:
        self._engine = engine
        self.param_groups = engine.param_groups
        self.state = engine.state
        self.defaults = engine.defaults

    @property
    def engine(self) -> torch.optim.Optimizer:
        """The current rung's optimizer."""
        assert self._engine is not None
        return self._engine

    @property
    def decision(self) -> Decision:
        """The :class:`optladder.Decision` behind the current rung."""
        return self._decision

    @property
    def rung(self) -> Rung:
        """The current rung: ``"fp32"``, ``"bf16"`` or ``"8bit"``."""
        return self._decision.rung

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the current rung's engine (torch's semantics)."""
        if self._engine is None:  # called by torch.optim.Optimizer.__init__
            super().add_param_group(param_group)
            return
        param_group = {**param_group, RUNG_KEY: self.rung}
        self._engine.add_param_group(param_group)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimizer step on the current rung.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        return self.engine.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of all params (to None by default, as torch does)."""
        self.engine.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The engine's ``state_dict``; each param group records its ``"rung"``."""
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict`` saved from an optimizer on the same rung.

        Raises:
            ValueError: if the checkpoint's groups record another rung, or do not match
                the params (torch's checks); the optimizer is left unchanged.
        """
        saved = {g.get(RUNG_KEY, self.rung) for g in state_dict.get("param_groups", [])}
        if saved - {self.rung}:
            raise ValueError(
                f"the state_dict holds {', '.join(sorted(saved))} state but this optimizer "
                f"runs the {self.rung} rung; loading across rungs is not supported yet: "
                f"choose_optimizer(..., rung={sorted(saved)[0]!r}) to load it"
            )
        self.engine.load_state_dict(state_dict)
        self._attach(self.engine)

    def __repr__(self) -> str:
        fused = "fused" if self.decision.fused else "not fused"
        engine = type(self.engine).__name__
        return f"{type(self).__name__}(rung={self.rung!r}, {fused}, engine={engine})"
