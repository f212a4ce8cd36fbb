"""``adopt``: put an optimizer the user built under the ladder."""

from __future__ import annotations

from typing import Any

import torch

from optladder.optimizers.build import ENGINE_KEYS
from optladder.optimizers.spec import to_fused_config
from optladder.selector.adamw import choose_optimizer
from optladder.selector.optimizer import LadderOptimizer


def adopt(optimizer: torch.optim.Optimizer, **kwargs: Any) -> LadderOptimizer:
    """An optladder optimizer over ``optimizer``'s params, hyperparameters and state.

    The optimizer must map to a fused Adam or AdamW configuration
    (:func:`optladder.optimizers.spec.to_fused_config`); Adam keeps its coupled weight
    decay on every rung. The rung is chosen as :func:`optladder.choose_optimizer` chooses
    it (``kwargs`` are its keyword arguments: ``free_memory``, ``rung``, ``policy``, ...),
    and the existing state (moments and step counts) is converted into it. Per-group
    hyperparameters (and a scheduler's ``initial_lr``) are kept. Use the returned object
    from then on: an LR scheduler made for the old optimizer keeps editing the old one.

    Args:
        optimizer: ``torch.optim.Adam``, ``torch.optim.AdamW`` or optladder's
            ``LadderAdamW`` (an optladder optimizer is returned unchanged).
        **kwargs: keyword arguments of :func:`optladder.choose_optimizer`, except the
            hyperparameters, which come from ``optimizer``.

    Returns:
        The :class:`LadderOptimizer`.

    Raises:
        ValueError: if the optimizer does not map (the reason is in the message: amsgrad,
            maximize, differentiable, sparse or complex params, 8-bit state, another
            class such as SGD), or ``kwargs`` name a hyperparameter.
    """
    if isinstance(optimizer, LadderOptimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (Adam, AdamW or LadderAdamW), got "
            f"{type(optimizer).__name__}"
        )
    taken = {"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"} & kwargs.keys()
    if taken:
        raise ValueError(
            f"adopt() takes the hyperparameters from the optimizer; do not pass {sorted(taken)}"
        )
    config, why = to_fused_config(optimizer)
    if config is None:
        raise ValueError(f"cannot adopt this optimizer: {why}")
    groups = [
        {k: v for k, v in g.items() if k not in ENGINE_KEYS and k != "params"}
        | {"params": list(g["params"])}
        for g in optimizer.param_groups
    ]
    adopted = choose_optimizer(
        groups,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        decoupled_weight_decay=config.kind == "adamw",
        **kwargs,
    )
    if any(optimizer.state.values()):
        adopted.load_state_dict(optimizer.state_dict())
    return adopted
