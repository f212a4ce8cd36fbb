"""Probe once, decide, and ready the groups for the chosen rung: what
:class:`optladder.AdamW` runs at construction, before it builds itself over them."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import torch

from optladder.columns import ParamColumns, plain_types
from optladder.errors import (  # OptladderWarning re-exported: defined below policies
    OptladderWarning,
    user_stacklevel,
)
from optladder.optimizers import probe_capabilities, validate_hyperparams
from optladder.optimizers.build import rung_options, without_dtensor_unsupported
from optladder.optimizers.rounding import (
    Rounding,
    check_param_rounding,
    check_rounding,
    check_seed,
)
from optladder.policies import (
    Decision,
    Policy,
    decide,
    normalize_param_groups,
    probe_free_memory,
    read_overrides,
)
from optladder.policies.decision import allowed_rungs
from optladder.policies.footprint import groups_footprint
from optladder.policies.overrides import ENV_8BIT, ENV_BF16, Overrides
from optladder.rungs import Rung, group_pin
from optladder.selector.agreement import DecisionInputs, agree_inputs
from optladder.selector.checks import (
    check_groups,
    check_max_retries,
    check_param_collections,
    check_params_for_rung,
    check_pins,
    refuse_meta_params,
)
from optladder.selector.escalation import Escalation
from optladder.units import format_bytes, parse_bytes

logger = logging.getLogger("optladder")


class InsufficientMemoryError(RuntimeError):
    """Not even the cheapest allowed rung's state passes the memory gate.

    Attributes:
        decision: the decision, with ``fits=False``.
        needed_bytes: state bytes of the cheapest allowed rung.
        free_bytes: free memory seen, in bytes.
        budget_bytes: the gate, in bytes.
    """

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self.needed_bytes = decision.state_bytes[decision.rung]
        self.free_bytes = decision.free_memory
        self.budget_bytes = decision.budget_bytes
        _, excluded = allowed_rungs(decision.footprint, decision.capabilities, decision.overrides)
        skipped = "".join(f" Not allowed: {why}." for why in excluded.values())
        super().__init__(
            f"optimizer state does not fit: the cheapest allowed rung ({decision.rung}) needs "
            f"{self.needed_bytes:,} bytes ({format_bytes(self.needed_bytes)}), but only "
            f"{self.budget_bytes:,} bytes may be used "
            f"({decision.policy.memory_fraction:.0%} of {self.free_bytes:,} bytes free).{skipped} "
            "Pass strict=False to build it anyway, raise Policy(memory_fraction=...), or "
            "free memory."
        )


def _params_of(group: dict[str, object]) -> list[torch.Tensor]:
    return cast(list[torch.Tensor], group["params"])


def _target_device(
    groups: list[dict[str, object]], device: torch.device | str | None, columns: ParamColumns
) -> torch.device:
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device={device!r} is not a torch device ({exc})") from None
    if columns.plain and len(columns.devices) == 1 and any(columns.requires_grad):
        return next(iter(columns.devices))  # every param there, trainable ones among them
    devices = sorted(
        {str(d) for d in {p.device for g in groups for p in _params_of(g) if p.requires_grad}}
    )
    if len(devices) > 1:
        raise ValueError(
            f"the trainable params span devices {devices}; pass device= to name the one whose "
            "free memory gates the choice"
        )
    return torch.device(devices[0])


class Built(NamedTuple):
    """What :func:`decide_and_build` returns.

    Attributes:
        decision: the :class:`optladder.Decision`.
        groups: every param group, in the user's order (plain dicts); those that follow
            the decision checked for its rung and in its state format
            (:func:`optladder.optimizers.build.rung_options`), those that pin a rung
            as given.
        pins: per group, the rung it pins, or None when it follows the decision.
        options: the ``LadderAdamW`` keyword arguments beyond the hyperparameters that
            the optimizer over ``groups`` takes (``moment_dtype``, ``torch_fused``).
    """

    decision: Decision
    groups: list[dict[str, Any]]
    pins: list[Rung | None]
    options: dict[str, Any]


def decide_and_build(
    model_or_params: object,
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    rung: str | None,
    free_memory: int | float | str | None,
    device: torch.device | str | None,
    policy: Policy | None,
    seed: int,
    rounding: Rounding,
    param_rounding: Rounding,
    strict: bool,
    environ: Mapping[str, str] | None,
    max_retries: int,
    on_escalate: Callable[[Escalation], None] | None,
    decoupled_weight_decay: bool,
) -> Built:
    """Choose a rung for the model's optimizer state and ready the groups for it (the
    work of :class:`optladder.AdamW`'s constructor before it builds itself over them; see
    there for the user's view, param groups that pin their rung and ranks under
    ``torch.distributed`` included).

    Reads the trainable params' footprint and the device's free memory (probed once
    unless given), reads the overrides (``rung=`` beats ``OPTLADDER_RUNG``,
    ``OPTLADDER_BF16_ADAM``, ``OPTLADDER_8BIT_ADAM``, read now), decides with
    :func:`optladder.decide`, and checks the groups that follow the decision for its
    rung (:func:`optladder.optimizers.build.rung_options`).

    Args:
        model_or_params, lr, betas, eps, weight_decay, rung, free_memory, device, policy,
            seed, rounding, param_rounding, strict, environ, max_retries, on_escalate,
            decoupled_weight_decay: as documented on :class:`optladder.AdamW`, which
            passes them here unchanged.

    Returns:
        The :class:`Built` decision, param groups, their pins and LadderAdamW options.

    Raises:
        ValueError: bad hyperparameters (per group too), ``free_memory``, ``rung``,
            ``seed``, ``rounding`` or ``max_retries``; per-group amsgrad/maximize; a param
            listed twice, two params over the same memory, an expanded view; no
            trainable params; a rung that cannot take the params; a group pinning a
            disabled or unavailable rung, or pins that leave no trainable param to follow
            the decision.
        TypeError: ``policy``, ``environ``, ``on_escalate``, ``strict`` or
            ``decoupled_weight_decay`` of the wrong type (``strict`` and
            ``decoupled_weight_decay`` take a bool only); params given in a set.
        optladder.OverrideError: an unknown or contradictory override variable.
        InsufficientMemoryError: ``strict=True`` and no allowed rung passes the gate.
        ImportError: the 8bit rung without bitsandbytes.
    """
    validate_hyperparams(lr, betas, eps, weight_decay)
    check_seed(seed)
    check_rounding(rounding)
    check_param_rounding(param_rounding)
    _check_options(policy, environ, max_retries, on_escalate, decoupled_weight_decay, strict)
    typed = (  # the common call, a list of plain tensors: their types read once, here
        isinstance(model_or_params, list | tuple)
        and len(model_or_params) > 0
        and plain_types(model_or_params)
    )
    groups: list[dict[str, Any]]
    if typed:  # no set to refuse, nothing to name: what normalize_param_groups makes of it
        groups = [{"params": list(cast(list[torch.Tensor], model_or_params))}]
    else:
        model_or_params = check_param_collections(model_or_params)  # a generator: listed
        groups = normalize_param_groups(model_or_params)
    columns = ParamColumns(groups, typed=typed)  # each attribute read once, for every check
    check_groups(groups, decoupled_weight_decay, columns)
    refuse_meta_params(groups, columns=columns)
    footprint = groups_footprint(groups, columns)
    overrides = read_overrides(rung, environ)
    pins = [group_pin(g, f"param group {gi}") for gi, g in enumerate(groups)]  # checked above
    asked = overrides.fixed or overrides.forced
    if asked is not None:  # name the first param the asked rung cannot take, and who asked
        for gi, g in enumerate(groups):
            if pins[gi] is None:
                try:
                    check_params_for_rung(g["params"], asked, f"group {gi}", columns.group(gi))
                except ValueError as exc:
                    raise ValueError(
                        f"{_asked_by(overrides)} asks for the {asked} rung, which cannot "
                        f"take the params: {exc}"
                    ) from None
    target = _target_device(groups, device, columns)
    if free_memory is None:
        probe = probe_free_memory(target)
        free, source = probe.free_bytes, probe.source
    else:
        free, source = parse_bytes(free_memory, "free_memory"), "given as free_memory"
    # Of the params that follow the decision (a pinned group steps on its format's kernels
    # for its params here: the step logs why, where it leaves the fused path).
    capabilities = probe_capabilities(target, footprint.dtypes, footprint.has_complex)
    if footprint.sharded:
        capabilities = without_dtensor_unsupported(capabilities)
    # every rank decides from the same inputs (one collective under torch.distributed)
    agreed = agree_inputs(
        DecisionInputs(footprint, free, source, capabilities, policy or Policy(), overrides)
    )
    decision = decide(
        agreed.footprint,
        agreed.free,
        agreed.capabilities,
        agreed.policy,
        agreed.overrides,
        free_memory_source=agreed.source,
    )
    check_pins(groups, decision)
    if not decision.fits:
        if decision.origin == "policy" and strict:
            raise InsufficientMemoryError(decision)
        needed = format_bytes(decision.state_bytes[decision.rung])
        warnings.warn(
            f"optladder: {decision.rung} state ({needed}) exceeds the memory gate "
            f"({format_bytes(decision.budget_bytes)}); building it anyway",
            OptladderWarning,
            stacklevel=user_stacklevel(),
        )
    following = []  # the groups that follow the decision (the pinned: LadderOptimizer's)
    for gi, g in enumerate(groups):
        if pins[gi] is None:
            if decision.rung != asked:  # (the asked rung's checks ran above)
                check_params_for_rung(g["params"], decision.rung, f"group {gi}", columns.group(gi))
            following.append(g)
    options = rung_options(  # the columns when they are those of the following groups
        decision.rung,
        following,
        fused=capabilities.fused[decision.rung],
        columns=columns if len(following) == len(groups) else None,
        checked=True,
    )
    if logger.isEnabledFor(logging.INFO):  # the summary formats every rung's bytes
        logger.info("optladder decision: %s", decision.summary())
    return Built(decision, groups, pins, options)


def _asked_by(overrides: Overrides) -> str:
    """The setting behind the fixed or forced rung of ``overrides``, as its sources
    quote it: ``"rung='8bit'"``, ``"OPTLADDER_RUNG=8bit"`` or
    ``"OPTLADDER_8BIT_ADAM=1"``."""
    if overrides.fixed is not None:
        return overrides.sources[0]
    variable = ENV_BF16 if overrides.forced == "bf16" else ENV_8BIT
    return next(s for s in overrides.sources if s.startswith(f"{variable}="))


def _check_options(
    policy: object,
    environ: object,
    max_retries: object,
    on_escalate: object,
    decoupled_weight_decay: object,
    strict: object,
) -> None:
    """Type checks of choose_optimizer's options, each naming the argument."""
    if not isinstance(strict, bool):
        raise TypeError(
            f"strict must be True (raise when nothing fits) or False (build the cheapest "
            f"allowed rung and warn), got {strict!r}"
        )
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be an optladder.Policy, got {type(policy).__name__}")
    if environ is not None and not isinstance(environ, Mapping):
        raise TypeError(f"environ must be a mapping of str to str, got {type(environ).__name__}")
    check_max_retries(max_retries)
    if on_escalate is not None and not callable(on_escalate):
        raise TypeError(f"on_escalate must be callable, got {type(on_escalate).__name__}")
    if not isinstance(decoupled_weight_decay, bool):
        raise TypeError(
            f"decoupled_weight_decay must be True (AdamW) or False (Adam), got "
            f"{decoupled_weight_decay!r}"
        )
