"""The decision: a pure function from plain data to a rung, with its reasons."""

from __future__ import annotations

import numbers
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from optladder.policies.footprint import Footprint
from optladder.policies.overrides import Overrides
from optladder.policies.policy import Policy
from optladder.rungs import RUNGS, Capabilities, Origin, Rung, current_origin, rung_refusal
from optladder.units import format_bytes


class Decision(BaseModel):
    """Which rung to use, why, and everything the choice was made from.

    Attributes:
        rung: the chosen rung.
        origin: ``"policy"`` (chosen by the rules), ``"forced"`` (a ``=1`` variable),
            ``"fixed"`` (``rung=`` or ``OPTLADDER_RUNG``), ``"escalated"`` (moved down
            after an out-of-memory error) or ``"checkpoint"`` (moved to the rung a loaded
            checkpoint had escalated to). ``"pinned"``, the name of ``"fixed"`` in
            earlier versions, is read as ``"fixed"``.
        fits: whether the rung's state passes the memory gate.
        reasons: the steps of the choice, in sentences.
        state_bytes: per rung, estimated optimizer-state bytes (from the footprint).
        budget_bytes: the gate, ``memory_fraction * free_memory``, in bytes.
        free_memory: bytes this run may still use on the device (given or probed).
        free_memory_source: where ``free_memory`` came from.
        fused: whether the chosen rung's engine runs on a fused kernel.
        unfused_reason: why not, when ``fused`` is False.
        footprint, capabilities, policy, overrides: the inputs, as seen.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rung: Rung
    origin: Origin
    fits: bool
    reasons: tuple[str, ...]
    state_bytes: dict[Rung, int]
    budget_bytes: int
    free_memory: int
    free_memory_source: str
    fused: bool
    unfused_reason: str | None
    footprint: Footprint
    capabilities: Capabilities
    policy: Policy
    overrides: Overrides

    @field_validator("origin", mode="before")
    @classmethod
    def _old_origin(cls, origin: object) -> object:
        """An origin written by an earlier version in today's spelling
        (:data:`optladder.rungs.OLD_ORIGINS`)."""
        return current_origin(origin)

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """Unpickle, reading an origin pickled by an earlier version in today's spelling
        (:data:`optladder.rungs.OLD_ORIGINS`)."""
        fields = state.get("__dict__", {})
        if "origin" in fields:
            state = {**state, "__dict__": {**fields, "origin": current_origin(fields["origin"])}}
        super().__setstate__(state)

    def summary(self) -> str:
        """The decision in a few lines for a log or a terminal.

        Lines: the rung, who chose it (``origin``) and whether it passes the memory gate;
        the trainable params (count, tensors, dtypes; those in groups that pin their
        rung); every rung's state bytes; which rungs are fused on the device and why the
        others are not (and which are unavailable); which kernel steps each param dtype
        on each available rung (``bf16 rung: bfloat16 params on the C kernel (fused)``,
        or the reason it is not fused); then the reasons, one per line.
        """
        fp = self.footprint
        verdict = "fits" if self.fits else "does NOT fit"
        lines = [
            f"rung {self.rung} ({self.origin}): {verdict}: state "
            f"{format_bytes(self.state_bytes[self.rung])} against a gate of "
            f"{format_bytes(self.budget_bytes)} ({self.policy.memory_fraction:.0%} of "
            f"{format_bytes(self.free_memory)} free; {self.free_memory_source})",
        ]
        tensors = "1 tensor" if fp.param_tensors == 1 else f"{fp.param_tensors:,} tensors"
        params = (
            f"params: {fp.trainable_params:,} trainable in {tensors} "
            f"({', '.join(fp.dtypes) or 'no dtype'})"
        )
        if fp.pinned_params:
            params += (
                f"; {fp.pinned_params:,} of them in groups that pin their rung "
                f"({format_bytes(fp.pinned_state_bytes)} of state in every rung's bytes)"
            )
        lines.append(params)
        lines.append(
            "state bytes: "
            + "; ".join(
                f"{r} {self.state_bytes[r]:,} ({format_bytes(self.state_bytes[r])})"
                + (" (chosen)" if r == self.rung else "")
                for r in RUNGS
            )
        )
        caps = self.capabilities
        fused = []
        for r in RUNGS:
            if not caps.available.get(r, True):
                fused.append(f"{r} unavailable ({caps.unavailable_reasons.get(r, 'no reason')})")
            elif r == self.rung:
                fused.append(f"{r} yes" if self.fused else f"{r} no ({self.unfused_reason})")
            elif caps.fused.get(r, False):
                fused.append(f"{r} yes")
            else:
                fused.append(f"{r} no ({caps.unfused_reasons.get(r, 'no fused kernel')})")
        lines.append(f"fused on {caps.device}: " + "; ".join(fused))
        routes = [
            route.describe(r, dtype)
            for r in RUNGS
            if caps.available.get(r, True)
            for dtype, route in caps.kernels.get(r, {}).items()
        ]
        if routes:
            lines.append("kernels:")
            lines += [f"- {line}" for line in routes]
        lines.append("why:")
        lines += [f"- {r}" for r in self.reasons]
        return "\n".join(lines)


PROACTIVE_BF16_WHY = (
    "bf16 moments with stochastic rounding tracked fp32 AdamW within 0.05% of its final "
    "train loss (0.14% of its eval loss) on optladder's causal-LM convergence benchmark, "
    "and take half the memory (4 bytes a param instead of 8)"
)
"""Why the policy starts large models at bf16, in the words of its reasons. The figures
are bench/convergence.py's causal LM over the standard library's source (README,
"Convergence"): final train / eval loss 2.3168 / 2.5720 with fp32 AdamW, +0.05% / +0.14%
with bf16 moments and stochastic rounding, same seed and batches."""


def allowed_rungs(
    footprint: Footprint, capabilities: Capabilities, overrides: Overrides
) -> tuple[dict[Rung, bool], dict[Rung, str]]:
    """Which rungs the policy may pick, and why each excluded one is excluded.

    A rung is excluded when the user disabled it (``=0``), the device cannot run it, or
    it cannot step the params that follow the decision (their dtypes, complex or
    sharded), by the table :data:`optladder.rungs.RUNG_ACCEPTS`: float64 params only on
    fp32, complex params only on fp32, DTensor params not on bf16.
    """
    why: dict[Rung, str] = {}
    for rung in RUNGS:
        if rung in overrides.disabled:
            # e.g. "OPTLADDER_BF16_ADAM=off": match the variable, whatever false spelling
            source = next((s for s in overrides.sources if f"{rung.upper()}_ADAM=" in s), "")
            why[rung] = f"{rung} is disabled by {source or 'an override'}"
        elif not capabilities.available.get(rung, True):
            why[rung] = capabilities.unavailable_reasons.get(rung, f"{rung} is unavailable")
        else:
            dtypes = (*footprint.dtypes, *(("complex64",) if footprint.has_complex else ()))
            refusal = rung_refusal(rung, dtypes, sharded=footprint.sharded)
            if refusal is not None:
                why[rung] = refusal
    return {r: r not in why for r in RUNGS}, why


def decide(
    footprint: Footprint,
    free_memory: int,
    capabilities: Capabilities,
    policy: Policy | None = None,
    overrides: Overrides | None = None,
    *,
    free_memory_source: str = "given",
) -> Decision:
    """Choose a rung from plain data. Pure: it probes nothing and reads no environment.

    Rules, in order:

    1. A fixed rung (``rung=`` / ``OPTLADDER_RUNG``) or a forced one (``=1``) is used as
       asked, past the memory gate; ``fits`` still reports the gate.
    2. Otherwise the policy starts at ``fp32``, or at ``bf16`` when the model has at
       least ``policy.proactive_bf16_min_params`` trainable elements *and* the bf16 rung
       is fused on the device (a memory saving that leaves the fast path is a trap).
    3. From there it walks to cheaper allowed rungs until one's state is at most
       ``policy.memory_fraction * free_memory`` bytes. Disabled (``=0``), unavailable
       (bitsandbytes missing) and rungs that cannot take the params (non-fp32 for complex
       params, 8bit for float64) are skipped.
    4. When none passes, the cheapest allowed rung is returned with ``fits=False``.

    Args:
        footprint: from :func:`optladder.measure_footprint`.
        free_memory: bytes this run may still use on the target device, ``>= 0``.
        capabilities: from :func:`optladder.optimizers.probe_capabilities`.
        policy: thresholds; default :class:`Policy()`.
        overrides: the user's word; default none.
        free_memory_source: where ``free_memory`` came from, recorded in the decision.

    Returns:
        The :class:`Decision`.

    Raises:
        ValueError: if ``free_memory`` is not an integer ``>= 0`` (NumPy integers are
            accepted), or a fixed/forced rung cannot be built (disabled is impossible
            here; unavailable, or params it cannot take).
        TypeError: if ``footprint``, ``capabilities``, ``policy`` or ``overrides`` is not
            of its optladder type (a plain dict is not a :class:`Policy`).
    """
    for name, value, kind in (
        ("footprint", footprint, Footprint),
        ("capabilities", capabilities, Capabilities),
        ("policy", policy, Policy),
        ("overrides", overrides, Overrides),
    ):
        if not isinstance(value, kind) and not (value is None and name in ("policy", "overrides")):
            raise TypeError(
                f"{name} must be an optladder {kind.__name__}, got {type(value).__name__}"
                + (f" (build it with {kind.__name__}(**...))" if isinstance(value, dict) else "")
            )
    policy = policy or Policy()
    overrides = overrides or Overrides()
    if (
        isinstance(free_memory, bool)
        or not isinstance(free_memory, numbers.Integral)
        or free_memory < 0
    ):
        raise ValueError(
            f"free_memory must be an integer number of bytes >= 0, got {free_memory!r}"
        )
    free_memory = int(free_memory)
    budget = int(policy.memory_fraction * free_memory)
    state = footprint.state_bytes
    allowed, excluded = allowed_rungs(footprint, capabilities, overrides)
    reasons: list[str] = []

    def gate(rung: Rung) -> str:
        verdict = "within" if state[rung] <= budget else "over"
        return (
            f"{rung} state {format_bytes(state[rung])} is {verdict} the gate "
            f"{format_bytes(budget)} ({policy.memory_fraction:.0%} of "
            f"{format_bytes(free_memory)} free)"
        )

    asked = overrides.fixed or overrides.forced
    if asked is not None:
        # Overrides built by hand may carry no sources.
        asker = overrides.sources[0] if overrides.sources else f"the {overrides.origin} override"
        if asked in excluded and asked not in overrides.disabled:
            raise ValueError(
                f"{asker} asks for the {asked} rung, which cannot be used: {excluded[asked]}"
            )
        rung: Rung = asked
        verb = "fixes" if overrides.fixed else "forces"
        reasons.append(f"{asker} {verb} the {rung} rung past the memory gate")
        reasons += [f"note: {s}" for s in overrides.sources[1:]]
        reasons.append(gate(rung))
        fits = state[rung] <= budget
    else:
        reasons += [f"{s} acts" for s in overrides.sources]
        start: Rung = "fp32"
        n = footprint.trainable_params
        if policy.proactive_bf16 and n >= policy.proactive_bf16_min_params and allowed["bf16"]:
            if capabilities.fused.get("bf16", False):
                start = "bf16"
                reasons.append(
                    f"{n:,} trainable params >= {policy.proactive_bf16_min_params:,}: "
                    f"start at bf16 (fused on this device): {PROACTIVE_BF16_WHY}"
                )
            else:
                reasons.append(
                    f"{n:,} trainable params >= {policy.proactive_bf16_min_params:,}, but "
                    f"bf16 is not fused on {capabilities.device} "
                    f"({capabilities.unfused_reasons.get('bf16', 'no fused kernel')}): "
                    "proactive bf16 not engaged"
                )
        candidates = [r for r in RUNGS[RUNGS.index(start) :] if allowed[r]]
        reasons += [excluded[r] for r in RUNGS[RUNGS.index(start) :] if r in excluded]
        chosen: Rung | None = None
        for r in candidates:
            reasons.append(gate(r))
            if state[r] <= budget:
                chosen = r
                break
        if not candidates:
            raise ValueError(
                "no rung can be used: " + "; ".join(excluded[r] for r in RUNGS if r in excluded)
            )
        if chosen is None:
            rung = candidates[-1]
            reasons.append(f"no allowed rung passes the gate; the cheapest is {rung}")
            fits = False
        else:
            rung, fits = chosen, True
    if rung in capabilities.slow:
        reasons.append(
            f"{rung} is known to be slow on {capabilities.device}: {capabilities.slow[rung]}"
        )
    fused = capabilities.fused.get(rung, False)
    return Decision(
        rung=rung,
        origin=overrides.origin,
        fits=fits,
        reasons=tuple(reasons),
        state_bytes=dict(state),
        budget_bytes=budget,
        free_memory=free_memory,
        free_memory_source=free_memory_source,
        fused=fused,
        unfused_reason=None
        if fused
        else capabilities.unfused_reasons.get(rung, f"{rung} has no fused kernel here"),
        footprint=footprint,
        capabilities=capabilities,
        policy=policy,
        overrides=overrides,
    )


def fixed_reason(decision: Decision) -> str | None:
    """Why ``decision``'s rung may not move at all (``"the bf16 rung is fixed by
    rung='bf16'"``: ``rung=`` or ``OPTLADDER_RUNG`` fixed it), or None."""
    if decision.overrides.fixed is None:
        return None
    source = decision.overrides.sources[0] if decision.overrides.sources else "the user"
    return f"the {decision.rung} rung is fixed by {source}"


def escalation_target(decision: Decision) -> tuple[Rung | None, str]:
    """The next cheaper rung the ladder may move to from ``decision.rung``, and why.

    Pure, like :func:`decide`: a fixed rung (``rung=``) never moves; rungs disabled by the user,
    unavailable on the device, or unable to take the params (complex, float64) are skipped.

    Returns:
        ``(rung, "")``, or ``(None, reason)`` when there is nowhere to go.
    """
    fixed = fixed_reason(decision)
    if fixed is not None:
        return None, fixed
    allowed, excluded = allowed_rungs(decision.footprint, decision.capabilities, decision.overrides)
    skipped = []
    for rung in RUNGS[RUNGS.index(decision.rung) + 1 :]:
        if allowed[rung]:
            return rung, ""
        skipped.append(excluded[rung])
    if not skipped:
        return None, f"{decision.rung} is the last rung"
    return None, f"{decision.rung} is the last usable rung (" + "; ".join(skipped) + ")"
