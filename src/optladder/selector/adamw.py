"""``optladder.AdamW``: the optimizer class, and ``choose_optimizer``, its convenience entry.

``AdamW(params, lr, ...)`` takes torch's arguments in torch's order, so it works wherever
a framework wants an optimizer *class* and calls it with the params: Hugging Face
``Trainer(optimizer_cls_and_kwargs=(optladder.AdamW, {...}))`` (which then applies its own
no-decay grouping), a Hydra ``_target_: optladder.AdamW``, LightningCLI's
``--optimizer optladder.AdamW``. It probes, decides and builds at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from optladder.optimizers.rounding import Rounding
from optladder.policies import Policy
from optladder.selector.choose import decide_and_build
from optladder.selector.escalation import Escalation
from optladder.selector.optimizer import LadderOptimizer

__all__ = ["AdamW", "choose_optimizer"]

_UNSUPPORTED_FLAGS: dict[str, str] = {
    "amsgrad": (
        "optladder's rungs keep exp_avg and exp_avg_sq only (no max_exp_avg_sq; "
        "bitsandbytes' 8-bit state has none either). Leave amsgrad=False, or use "
        "torch.optim.AdamW(amsgrad=True)"
    ),
    "maximize": (
        "optladder's kernels descend. Negate the objective instead (loss = -objective "
        "gives the same update), or use torch.optim.AdamW(maximize=True)"
    ),
    "capturable": (
        "an optladder step decides on the host (the out-of-memory retry, bitsandbytes' "
        "step counter), so it cannot be captured in a CUDA graph. Leave capturable=False, "
        "or use torch.optim.AdamW(capturable=True)"
    ),
    "differentiable": (
        "optladder's kernels update params and moments in place without autograd, so the "
        "step cannot be differentiated through. Leave differentiable=False, or use "
        "torch.optim.AdamW(differentiable=True)"
    ),
}
"""torch.optim.AdamW flags optladder refuses when True, and what to do instead."""

_KERNEL_CHOICE = (
    "optladder picks each rung's kernel itself: torch's fused AdamW for the fp32 rung where "
    "the device has it (foreach otherwise), its own fused kernels for bf16, for 8bit its "
    "8-bit C kernel on the CPU and bitsandbytes' kernel on CUDA; opt.decision.fused and "
    ".unfused_reason say which ran"
)


def _check_torch_flags(
    amsgrad: object,
    maximize: object,
    foreach: object,
    capturable: object,
    differentiable: object,
    fused: object,
) -> None:
    """Refuse the ``torch.optim.AdamW`` flags optladder cannot honour, each with what it
    does instead (instead of dropping them, or Python's bare "unexpected keyword").

    Raises:
        TypeError: a flag that is not a bool (``foreach``/``fused``: bool or None).
        ValueError: ``amsgrad``, ``maximize``, ``capturable`` or ``differentiable`` True;
            ``foreach`` not None; ``fused=False``.
    """
    flags = {
        "amsgrad": amsgrad,
        "maximize": maximize,
        "capturable": capturable,
        "differentiable": differentiable,
    }
    for name, value in {**flags, "foreach": foreach, "fused": fused}.items():
        optional = name in ("foreach", "fused")
        if not (isinstance(value, bool) or (optional and value is None)):
            allowed = "True, False or None" if optional else "True or False"
            raise TypeError(f"{name} must be {allowed}, got {value!r}")
    for name, value in flags.items():
        if value:
            raise ValueError(f"{name}=True is not supported: {_UNSUPPORTED_FLAGS[name]}")
    if foreach is not None:
        raise ValueError(f"foreach={foreach!r} is not supported: {_KERNEL_CHOICE}. Leave it None")
    if fused is False:
        raise ValueError(
            f"fused=False is not supported: {_KERNEL_CHOICE}. Leave fused=None, or pass "
            "fused=True to require the fused path"
        )


class AdamW(LadderOptimizer):
    """AdamW whose state takes the rung (fp32, bf16 or 8bit moments) the params and the
    device's free memory allow, and moves down a rung when a step runs out of memory.

    One ``torch.optim.Optimizer`` that takes ``torch.optim.AdamW``'s arguments in its
    order and owns its ``param_groups``, ``defaults`` and ``state``; each group's state
    is in the format of its rung (its ``"rung"`` key), and a move to another rung
    converts the state in place, so LR schedulers and trainers holding this object keep
    working. At construction it measures the trainable params' footprint, reads the
    device's free memory (probed once unless given) and the overrides (``rung=`` beats
    ``OPTLADDER_RUNG``, ``OPTLADDER_BF16_ADAM``, ``OPTLADDER_8BIT_ADAM``, read now),
    decides with :func:`optladder.decide` and puts the groups in the rung's format.
    ``defaults`` are fixed here (torch's keys plus ``seed``, ``rounding`` and
    ``param_rounding``) and stay the same whatever rung the state later moves to. The
    ladder itself (the two-phase step and its retry, the moves, checkpoints) is
    :class:`~optladder.selector.optimizer.LadderOptimizer`'s.

    A param group may pin its own rung with a ``"rung"`` entry (``{"params":
    model.embed.parameters(), "rung": "fp32"}``, as bitsandbytes users keep embeddings
    in 32-bit state): it runs on that rung whatever the decision, an out-of-memory step
    never moves it, and its state bytes count in every rung's estimate. The other
    groups follow the decision (``rung=`` and the variables apply to them).

    Under ``torch.distributed`` every rank reaches the same decision, in one collective
    (:func:`optladder.selector.agreement.agree_inputs`): free memory is the minimum over
    ranks, each rung's state bytes the maximum over ranks, and the rest of the inputs
    rank 0's. A DTensor (FSDP2) param counts its global elements (for the
    policy's thresholds and bitsandbytes' 4,096-element rule) and the state bytes of
    this rank's shard; rungs whose state format cannot step DTensors (bf16, see
    :data:`optladder.optimizers.build.DTENSOR_UNSUPPORTED`) are skipped for such models.

    Args:
        params: params, ``(name, param)`` pairs (``model.named_parameters()``), param
            groups (per-group hyperparameters and ``"rung"`` pins are kept), or a
            ``torch.nn.Module``.
        lr: learning rate, ``>= 0`` (a float or a one-element tensor).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to the denominator, ``>= 0``.
        weight_decay: decoupled (AdamW) decay, ``>= 0``.
        amsgrad: False only (see below).
        rung: fix the rung (``"fp32"``, ``"bf16"``, ``"8bit"``) of the groups that follow
            the decision, past the memory gate; the ladder never moves a fixed rung.
        free_memory: bytes this run may still use on the device (an int, or a string
            such as ``"24GiB"``); probed when None.
        device: the device whose memory gates the choice; default the params' device.
        policy: the thresholds; default :class:`optladder.Policy()`.
        seed: the bf16 rung's stochastic-rounding seed, ``0 <= seed < 2**64``; saved in
            ``state_dict``.
        rounding: the bf16 rung's rounding: ``"stochastic"`` (default) or ``"nearest"``.
        param_rounding: how optladder's AdamW (the bf16 rung, and the fp32 rung of
            bfloat16/float16 params) writes bfloat16/float16 params: ``"stochastic"``
            (default) or ``"nearest"``; a group key, saved in ``state_dict``.
        strict: when not even the cheapest allowed rung passes the gate, raise (True) or
            build it with a warning (False).
        environ: the environment to read the overrides from; None means ``os.environ``.
        max_retries: escalations allowed within one ``step()``, ``>= 0``.
        on_escalate: called with each :class:`Escalation` when the ladder moves down.
        decoupled_weight_decay: True (default) for AdamW; False for Adam's coupled decay
            (``grad += weight_decay * param``), kept on every rung.
        maximize, capturable, differentiable: False only; True raises, naming what to do
            instead (as does ``amsgrad=True``).
        foreach: None only: optladder picks each rung's kernel (``decision.fused`` says
            which); True or False raises, saying so.
        fused: None (default: fused where the device has the kernel) or True (raise
            unless the chosen rung runs fused, with the reason); False raises.

    Raises:
        ValueError: bad hyperparameters (per group too), ``free_memory``, ``rung``,
            ``seed``, ``rounding`` or ``max_retries``; the torch flags above; a param
            listed twice, two params over the same memory, an expanded view; some params
            named and others not; no trainable params; a rung that cannot take the
            params; a group pinning a disabled or unavailable rung, or pins that leave no
            trainable param to follow the decision.
        TypeError: ``policy``, ``environ``, ``on_escalate``, ``decoupled_weight_decay`` or
            a torch flag of the wrong type.
        optladder.OverrideError: an unknown or contradictory override variable.
        InsufficientMemoryError: ``strict=True`` and no allowed rung passes the gate.
        ImportError: the 8bit rung without bitsandbytes.

    Attributes:
        decision: the :class:`optladder.Decision` behind the current rung.
        rung: the current rung of the groups that follow the decision.
    """

    def __init__(
        self,
        params: object,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        rung: str | None = None,
        free_memory: int | float | str | None = None,
        device: torch.device | str | None = None,
        policy: Policy | None = None,
        seed: int = 0,
        rounding: Rounding = "stochastic",
        param_rounding: Rounding = "stochastic",
        strict: bool = True,
        environ: Mapping[str, str] | None = None,
        max_retries: int = 2,
        on_escalate: Callable[[Escalation], None] | None = None,
        decoupled_weight_decay: bool = True,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        _check_torch_flags(amsgrad, maximize, foreach, capturable, differentiable, fused)
        built = decide_and_build(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            rung=rung,
            free_memory=free_memory,
            device=device,
            policy=policy,
            seed=seed,
            rounding=rounding,
            param_rounding=param_rounding,
            strict=strict,
            environ=environ,
            max_retries=max_retries,
            on_escalate=on_escalate,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        if fused and not built.decision.fused:
            raise ValueError(
                f"fused=True, but the {built.decision.rung} rung is not fused here: "
                f"{built.decision.unfused_reason}. Leave fused=None to run it anyway"
            )
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
            "seed": seed,
            "rounding": rounding,
            "param_rounding": param_rounding,
        }
        hyperparams: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
            "seed": seed,
            "rounding": rounding,
            "param_rounding": param_rounding,
        }
        super().__init__(
            built.groups,
            built.decision,
            pins=built.pins,
            hyperparams=hyperparams,
            options=built.options,
            max_retries=max_retries,
            on_escalate=on_escalate,
            defaults=defaults,
        )


def choose_optimizer(
    model_or_params: object,
    lr: float | torch.Tensor = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    **options: Any,
) -> AdamW:
    """Choose a rung for the model's optimizer state and build an :class:`AdamW` on it.

    The same as ``AdamW(model_or_params, lr, betas, eps, weight_decay, amsgrad,
    **options)``: positional arguments in ``torch.optim.AdamW``'s order.

    Args:
        model_or_params: a ``torch.nn.Module``, params, ``(name, param)`` pairs, or param
            groups.
        lr, betas, eps, weight_decay, amsgrad: as in :class:`AdamW`.
        **options: :class:`AdamW`'s keyword arguments (``rung``, ``free_memory``,
            ``device``, ``policy``, ``seed``, ``rounding``, ``param_rounding``, ``strict``,
            ``environ``, ``max_retries``, ``on_escalate``, ``decoupled_weight_decay`` and
            torch's flags).

    Returns:
        The :class:`AdamW`; ``.decision`` holds the :class:`optladder.Decision`.

    Raises:
        As :class:`AdamW`.
    """
    return AdamW(model_or_params, lr, betas, eps, weight_decay, amsgrad, **options)
