"""decide(): the decision table over (params, free memory, capabilities, overrides, policy),
and probe_capabilities(), which feeds it.

State bytes of one float32 tensor of n elements, by hand (DESIGN.md):
fp32 8n; bf16 4n; 8bit 2n + 8*ceil(n/256) + 2048 of code books (n >= 4096).
For n = 1,000,000: fp32 8,000,000; bf16 4,000,000; 8bit 2,000,000 + 8*3907 + 2048 = 2,033,304.
The default gate is int(0.25 * free): fp32 fits from free = 32,000,000, bf16 from 16,000,000,
8bit from 4 * 2,033,304 = 8,133,216.
"""

from __future__ import annotations

import math
import pickle
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from optladder.optimizers import probe_capabilities, spec
from optladder.policies import (
    Decision,
    Footprint,
    Overrides,
    Policy,
    decide,
    measure_footprint,
    read_overrides,
)
from optladder.policies.decision import escalation_target
from optladder.rungs import Capabilities

MILLION = 1_000_000
FP32_1M, BF16_1M, EIGHT_1M = 8_000_000, 4_000_000, 2_033_304


def synthetic(n: int, *, itemsize: int = 4, is_complex: bool = False) -> Footprint:
    """A footprint of one tensor of n >= 4096 elements, state bytes by the hand rules."""
    fp32 = 2 * n * max(itemsize, 4)
    eight = 2 * n + 8 * math.ceil(n / 256) + 2048
    return Footprint(
        trainable_params=n,
        param_tensors=1,
        frozen_params=0,
        largest_param=n,
        devices=("cpu",),
        dtypes=("complex64",) if is_complex else ("float32",),
        has_complex=is_complex,
        state_bytes={"fp32": fp32, "bf16": 4 * n, "8bit": eight},
    )


def caps(
    *,
    bf16_fused: bool = False,
    bnb: bool = True,
    device: str = "cpu",
    slow: dict[str, str] | None = None,
) -> Capabilities:
    """Capabilities by hand: fp32 fused; bf16 fused or not; 8bit fused on CUDA only."""
    fused = {"fp32": True, "bf16": bf16_fused, "8bit": device.startswith("cuda")}
    return Capabilities(
        device=device,
        fused=fused,
        unfused_reasons={
            r: f"{r} has no fused kernel on {device} (test)" for r, f in fused.items() if not f
        },
        available={"fp32": True, "bf16": True, "8bit": bnb},
        unavailable_reasons={} if bnb else {"8bit": "bitsandbytes is not installed (test)"},
        slow=slow or {},
    )


CPU = caps()
ONE_M = synthetic(MILLION)


def test_synthetic_footprint_matches_measure_footprint_of_a_meta_model() -> None:
    with torch.device("meta"):
        model = nn.Linear(1000, 1000, bias=False)  # 1,000,000 elements
    assert measure_footprint(model).state_bytes == ONE_M.state_bytes
    assert ONE_M.state_bytes == {"fp32": FP32_1M, "bf16": BF16_1M, "8bit": EIGHT_1M}


# --------------------------------------------------------------------- the memory gate


@pytest.mark.parametrize(
    ("free", "rung", "fits"),
    [
        (10**12, "fp32", True),
        (32_000_000, "fp32", True),  # gate 8,000,000 == fp32 state: fits
        (31_999_999, "bf16", True),  # gate 7,999,999
        (16_000_000, "bf16", True),  # gate 4,000,000 == bf16 state
        (15_999_999, "8bit", True),  # gate 3,999,999
        (8_133_216, "8bit", True),  # gate 2,033,304 == 8bit state
        (8_133_215, "8bit", False),  # gate 2,033,303: nothing fits, the cheapest
        (0, "8bit", False),
    ],
)
def test_gate_walks_down_the_ladder(free: int, rung: str, fits: bool) -> None:
    d = decide(ONE_M, free, CPU)
    assert (d.rung, d.fits, d.origin) == (rung, fits, "policy")
    assert d.budget_bytes == free // 4
    assert d.state_bytes == ONE_M.state_bytes
    assert d.free_memory == free
    if not fits:
        assert any("no allowed rung passes the gate; the cheapest is 8bit" in r for r in d.reasons)
    # One gate verdict per rung tried, in order, ending at the chosen one.
    tried = [r.split()[0] for r in d.reasons if "the gate" in r and " state " in r]
    assert tried == ["fp32", "bf16", "8bit"][: ["fp32", "bf16", "8bit"].index(rung) + 1]


@pytest.mark.parametrize(
    ("fraction", "free", "budget", "rung"),
    [
        (0.25, 10**9, 250_000_000, "fp32"),
        (0.1, 10**9, 100_000_000, "fp32"),
        (0.3, 10**9, 300_000_000, "fp32"),  # 0.3 * 1e9 is 300000000.00000006 in floats
        (0.5, 16_000_000, 8_000_000, "fp32"),  # fp32 fits at half, not at a quarter
        (0.25, 16_000_000, 4_000_000, "bf16"),
        (1.0, 8_000_000, 8_000_000, "fp32"),
        (1.0, 7_999_999, 7_999_999, "bf16"),
        (0.25, 31_999_999, 7_999_999, "bf16"),  # int(7,999,999.75)
        (0.1, 7, 0, "8bit"),
    ],
)
def test_memory_fraction_sets_the_gate_exactly(
    fraction: float, free: int, budget: int, rung: str
) -> None:
    d = decide(ONE_M, free, CPU, policy=Policy(memory_fraction=fraction))
    assert d.budget_bytes == budget
    assert d.rung == rung
    assert d.policy.memory_fraction == fraction


@pytest.mark.parametrize("free", [-1, -(10**9), True, 1.5, "1GiB", None])
def test_decide_rejects_bad_free_memory(free: object) -> None:
    with pytest.raises(ValueError, match="free_memory"):
        decide(ONE_M, free, CPU)  # type: ignore[arg-type]


# ------------------------------------------------------------------ proactive bf16

FIFTY_M = 50_000_000
HUGE = 10**15  # everything fits


@pytest.mark.parametrize(
    ("n", "bf16_fused", "policy", "rung", "says"),
    [
        (FIFTY_M, True, Policy(), "bf16", "start at bf16 (fused on this device)"),
        (FIFTY_M + 1, True, Policy(), "bf16", "start at bf16"),
        (FIFTY_M - 1, True, Policy(), "fp32", None),
        (FIFTY_M, False, Policy(), "fp32", "proactive bf16 not engaged"),
        (FIFTY_M, True, Policy(proactive_bf16=False), "fp32", None),
        (10_000, True, Policy(proactive_bf16_min_params=10_000), "bf16", "start at bf16"),
        (10_000, False, Policy(proactive_bf16_min_params=10_000), "fp32", "not engaged"),
    ],
)
def test_proactive_bf16(n: int, bf16_fused: bool, policy: Policy, rung: str, says: str) -> None:
    capabilities = caps(bf16_fused=bf16_fused)
    d = decide(synthetic(n), HUGE, capabilities, policy=policy)
    assert (d.rung, d.fits, d.origin) == (rung, True, "policy")
    mentions = [r for r in d.reasons if "proactive" in r or "start at bf16" in r]
    if says is None:
        assert mentions == []
    else:
        assert any(says in r for r in mentions)
    if says and "not engaged" in says:
        # the reason says why: bf16 is not fused on the device
        assert any("bf16 has no fused kernel on cpu (test)" in r for r in mentions)


@pytest.mark.parametrize(
    ("bias", "rung"),
    [(True, "bf16"), (False, "fp32")],  # 9,999 * 5,000 + 5,000 = 50,000,000 exactly
)
def test_proactive_bf16_counts_a_meta_model(bias: bool, rung: str) -> None:
    with torch.device("meta"):
        model = nn.Linear(9_999, 5_000, bias=bias)
    fp = measure_footprint(model)
    assert fp.trainable_params == 49_995_000 + (5_000 if bias else 0)
    assert decide(fp, HUGE, caps(bf16_fused=True)).rung == rung


def test_proactive_bf16_still_obeys_the_gate() -> None:
    fp = synthetic(FIFTY_M)  # bf16 200,000,000; 8bit 100,000,000 + 8*195,313 + 2048
    assert fp.state_bytes["8bit"] == 101_564_552
    d = decide(fp, 4 * 200_000_000 - 1, caps(bf16_fused=True))
    assert (d.rung, d.fits) == ("8bit", True)


def test_proactive_bf16_skips_a_disabled_bf16() -> None:
    overrides = read_overrides(environ={"OPTLADDER_BF16_ADAM": "0"})
    d = decide(synthetic(FIFTY_M), HUGE, caps(bf16_fused=True), overrides=overrides)
    assert d.rung == "fp32"
    assert not any("start at bf16" in r for r in d.reasons)


# ---------------------------------------------------------------- excluded rungs


@pytest.mark.parametrize("spelling", ["0", "off", "False"])
def test_disabled_bf16_is_skipped(spelling: str) -> None:
    overrides = read_overrides(environ={"OPTLADDER_BF16_ADAM": spelling})
    d = decide(ONE_M, 31_999_999, CPU, overrides=overrides)  # fp32 over, bf16 would fit
    assert (d.rung, d.fits, d.origin) == ("8bit", True, "policy")
    assert f"bf16 is disabled by OPTLADDER_BF16_ADAM={spelling}" in d.reasons


def test_disabled_8bit_leaves_bf16_as_the_cheapest() -> None:
    overrides = read_overrides(environ={"OPTLADDER_8BIT_ADAM": "0"})
    d = decide(ONE_M, 15_999_999, CPU, overrides=overrides)  # bf16 over the gate
    assert (d.rung, d.fits) == ("bf16", False)
    assert "8bit is disabled by OPTLADDER_8BIT_ADAM=0" in d.reasons


def test_both_disabled_leaves_fp32() -> None:
    env = {"OPTLADDER_BF16_ADAM": "0", "OPTLADDER_8BIT_ADAM": "0"}
    d = decide(ONE_M, 31_999_999, CPU, overrides=read_overrides(environ=env))
    assert (d.rung, d.fits) == ("fp32", False)


def test_unavailable_8bit_is_skipped() -> None:
    d = decide(ONE_M, 15_999_999, caps(bnb=False))  # bf16 over; 8bit would fit
    assert (d.rung, d.fits) == ("bf16", False)
    assert "bitsandbytes is not installed (test)" in d.reasons


@pytest.mark.parametrize(
    ("overrides", "asker"),
    [
        (read_overrides(environ={"OPTLADDER_8BIT_ADAM": "1"}), "OPTLADDER_8BIT_ADAM=1"),
        (read_overrides(environ={"OPTLADDER_RUNG": "8bit"}), "OPTLADDER_RUNG=8bit"),
        (read_overrides(rung="8bit", environ={}), "rung='8bit'"),
    ],
)
def test_asking_for_an_unavailable_8bit_raises(overrides: Overrides, asker: str) -> None:
    with pytest.raises(ValueError, match="bitsandbytes is not installed") as info:
        decide(ONE_M, HUGE, caps(bnb=False), overrides=overrides)
    assert asker in str(info.value)


COMPLEX_1M = synthetic(MILLION, itemsize=8, is_complex=True)  # fp32 rung: 16 bytes/param


@pytest.mark.parametrize(
    ("free", "fits"),
    [(64_000_000, True), (63_999_999, False), (0, False)],  # fp32 state 16,000,000
)
def test_complex_params_get_fp32_only(free: int, fits: bool) -> None:
    assert COMPLEX_1M.state_bytes["fp32"] == 16 * MILLION
    d = decide(COMPLEX_1M, free, caps(bf16_fused=True))
    assert (d.rung, d.fits) == ("fp32", fits)
    if not fits:
        assert sum("complex" in r for r in d.reasons) == 2  # bf16 and 8bit excluded


def test_complex_params_measured_get_fp32() -> None:
    p = nn.Parameter(torch.zeros(1000, dtype=torch.complex64))
    fp = measure_footprint([p])
    assert fp.has_complex
    assert decide(fp, 1000, CPU).rung == "fp32"  # over the gate: still fp32


@pytest.mark.parametrize(
    "overrides",
    [
        read_overrides(environ={"OPTLADDER_BF16_ADAM": "1"}),
        read_overrides(environ={"OPTLADDER_RUNG": "bf16"}),
        read_overrides(environ={"OPTLADDER_8BIT_ADAM": "1"}),
        read_overrides(rung="bf16", environ={}),
        Overrides(forced="bf16"),  # built by hand, without sources
    ],
)
def test_asking_for_bf16_or_8bit_with_complex_params_raises(overrides: Overrides) -> None:
    with pytest.raises(ValueError, match="complex"):
        decide(COMPLEX_1M, HUGE, CPU, overrides=overrides)


# ---------------------------------------------------------------- fixed and forced


@pytest.mark.parametrize(
    ("overrides", "free", "rung", "fits", "origin", "first"),
    [
        (
            read_overrides(rung="fp32", environ={}),
            0,
            "fp32",
            False,
            "fixed",
            "rung='fp32' fixes the fp32 rung past the memory gate",
        ),
        (
            read_overrides(environ={"OPTLADDER_RUNG": "bf16"}),
            0,
            "bf16",
            False,
            "fixed",
            "OPTLADDER_RUNG=bf16 fixes the bf16 rung past the memory gate",
        ),
        (
            read_overrides(environ={"OPTLADDER_BF16_ADAM": "1"}),
            HUGE,  # fp32 would fit: forced bf16 all the same
            "bf16",
            True,
            "forced",
            "OPTLADDER_BF16_ADAM=1 forces the bf16 rung past the memory gate",
        ),
        (
            read_overrides(environ={"OPTLADDER_8BIT_ADAM": "on"}),
            8_133_215,  # one byte short of the 8bit gate
            "8bit",
            False,
            "forced",
            "OPTLADDER_8BIT_ADAM=on forces the 8bit rung past the memory gate",
        ),
        (
            Overrides(fixed="bf16"),  # built by hand, without sources
            HUGE,
            "bf16",
            True,
            "fixed",
            "the fixed override fixes the bf16 rung past the memory gate",
        ),
    ],
)
def test_fixed_and_forced_bypass_the_gate(
    overrides: Overrides, free: int, rung: str, fits: bool, origin: str, first: str
) -> None:
    d = decide(ONE_M, free, CPU, overrides=overrides)
    assert (d.rung, d.fits, d.origin) == (rung, fits, origin)
    assert d.reasons[0] == first
    verdict = "within" if fits else "over"
    assert any(r.startswith(f"{rung} state") and f"is {verdict} the gate" in r for r in d.reasons)


def test_a_decision_serialized_with_the_old_name_pinned_loads_as_fixed() -> None:
    """Before it was called "fixed", a rung fixed by rung= had the origin "pinned" and sat
    in ``Overrides.pinned``: a decision serialized then loads as today's."""
    d = decide(ONE_M, HUGE, CPU, overrides=read_overrides(rung="bf16", environ={}))
    assert (d.origin, d.overrides.fixed, d.overrides.origin) == ("fixed", "bf16", "fixed")
    old = d.model_dump(mode="json")
    old["origin"] = "pinned"
    old["overrides"]["pinned"] = old["overrides"].pop("fixed")
    assert Decision.model_validate(old) == d
    assert Overrides(pinned="bf16") == Overrides(fixed="bf16")  # type: ignore[call-arg]
    assert Overrides(pinned="bf16", fixed="bf16") == Overrides(fixed="bf16")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="'pinned' is the old name of 'fixed'"):
        Overrides(pinned="bf16", fixed="8bit")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="origin"):
        Decision.model_validate({**old, "origin": "pined"})
    with pytest.warns(FutureWarning, match=r"Overrides\.pinned is now Overrides\.fixed"):
        assert d.overrides.pinned == "bf16"


class _AsPickledBefore:
    """Pickles as ``model`` with the fields ``fields`` (a model of an earlier version,
    whose field names differ): pickle restores a model from its fields by name."""

    def __init__(self, model: object, fields: dict[str, object]) -> None:
        self.model, self.fields = model, fields

    def __reduce__(self) -> tuple[object, ...]:
        state = self.model.__getstate__()  # type: ignore[attr-defined]
        fields = {**state, "__dict__": self.fields, "__pydantic_fields_set__": set()}
        return object.__new__, (type(self.model),), fields


def test_a_decision_pickled_with_the_old_name_pinned_unpickles_as_fixed() -> None:
    """A decision pickled before the rename (``Overrides.pinned``, origin "pinned")
    unpickles as today's: ``overrides.fixed`` set, origin "fixed", never escalated."""
    d = decide(ONE_M, HUGE, CPU, overrides=read_overrides(rung="bf16", environ={}))
    old_overrides = {("pinned" if k == "fixed" else k): v for k, v in vars(d.overrides).items()}
    old = {**vars(d), "origin": "pinned"}
    old["overrides"] = _AsPickledBefore(d.overrides, old_overrides)
    loaded = pickle.loads(pickle.dumps(_AsPickledBefore(d, old)))
    assert type(loaded) is Decision
    assert (loaded.origin, loaded.overrides.fixed, loaded.overrides.origin) == (
        "fixed",
        "bf16",
        "fixed",
    )
    assert loaded == d
    assert escalation_target(loaded) == (None, "the bf16 rung is fixed by rung='bf16'")


def test_fixed_fp32_beats_proactive_bf16() -> None:
    d = decide(synthetic(FIFTY_M), HUGE, caps(bf16_fused=True), overrides=read_overrides("fp32"))
    assert d.rung == "fp32"


def test_reasons_name_the_overrides_that_acted() -> None:
    beaten = read_overrides(rung="fp32", environ={"OPTLADDER_BF16_ADAM": "1"})
    d = decide(ONE_M, HUGE, CPU, overrides=beaten)
    assert "note: rung='fp32' overrides OPTLADDER_BF16_ADAM=1" in d.reasons
    fixed = read_overrides(environ={"OPTLADDER_RUNG": "bf16", "OPTLADDER_8BIT_ADAM": "0"})
    d = decide(ONE_M, HUGE, CPU, overrides=fixed)
    assert "note: OPTLADDER_8BIT_ADAM=0" in d.reasons
    disabled = read_overrides(environ={"OPTLADDER_8BIT_ADAM": "0"})
    d = decide(ONE_M, HUGE, CPU, overrides=disabled)  # fp32 fits; the override still shows
    assert d.rung == "fp32"
    assert "OPTLADDER_8BIT_ADAM=0 acts" in d.reasons


# ------------------------------------------------------------- the Decision record


def test_fused_and_slow_come_from_the_capabilities() -> None:
    slow = {"8bit": "bitsandbytes on the CPU is slow (test)"}
    d = decide(ONE_M, HUGE, caps(slow=slow))
    assert (d.rung, d.fused, d.unfused_reason) == ("fp32", True, None)
    d = decide(ONE_M, 15_999_999, caps(slow=slow))
    assert (d.rung, d.fused) == ("8bit", False)
    assert d.unfused_reason == "8bit has no fused kernel on cpu (test)"
    assert (
        d.reasons[-1] == "8bit is known to be slow on cpu: bitsandbytes on the CPU is slow (test)"
    )
    d = decide(ONE_M, 15_999_999, caps(device="cuda:0"))
    assert (d.rung, d.fused, d.unfused_reason) == ("8bit", True, None)


def test_decision_records_its_inputs() -> None:
    policy = Policy(memory_fraction=0.5)
    overrides = read_overrides(environ={"OPTLADDER_BF16_ADAM": "0"})
    d = decide(ONE_M, 10**9, CPU, policy, overrides, free_memory_source="NVML free memory")
    assert d.footprint == ONE_M
    assert d.capabilities == CPU
    assert d.policy == policy
    assert d.overrides == overrides
    assert d.free_memory_source == "NVML free memory"
    assert decide(ONE_M, 10**9, CPU).free_memory_source == "given"
    assert decide(ONE_M, 10**9, CPU).policy == Policy()


def test_decision_is_frozen_and_round_trips_through_json() -> None:
    overrides = read_overrides(environ={"OPTLADDER_BF16_ADAM": "off"})
    d = decide(ONE_M, 15_999_999, caps(bnb=True, slow={"8bit": "slow"}), overrides=overrides)
    with pytest.raises(ValidationError):
        d.rung = "fp32"  # type: ignore[misc]
    again = Decision.model_validate_json(d.model_dump_json())
    assert again == d
    assert again.overrides.disabled == frozenset({"bf16"})


@pytest.mark.parametrize(("free", "verdict"), [(HUGE, "fits"), (0, "does NOT fit")])
def test_summary(free: int, verdict: str) -> None:
    text = decide(ONE_M, free, CPU).summary()
    assert verdict in text
    assert text.splitlines()[0].startswith(f"rung {'fp32' if free else '8bit'} (policy)")


def test_summary_lines_show_params_every_rungs_bytes_and_fused() -> None:
    # 15,999,999 free: the gate 3,999,999 passes only 8bit (2,033,304 bytes)
    d = decide(ONE_M, 15_999_999, caps(bf16_fused=False), free_memory_source="probed (test)")
    lines = d.summary().splitlines()
    assert lines[0] == (
        "rung 8bit (policy): fits: state 1.94 MiB against a gate of 3.81 MiB "
        "(25% of 15.26 MiB free; probed (test))"
    )  # 2,033,304 / 2**20 = 1.939; 3,999,999 / 2**20 = 3.815; 15,999,999 / 2**20 = 15.259
    assert lines[1] == "params: 1,000,000 trainable in 1 tensor (float32)"
    assert lines[2] == (
        "state bytes: fp32 8,000,000 (7.63 MiB); bf16 4,000,000 (3.81 MiB); "
        "8bit 2,033,304 (1.94 MiB) (chosen)"
    )
    assert lines[3] == (
        "fused on cpu: fp32 yes; bf16 no (bf16 has no fused kernel on cpu (test)); "
        "8bit no (8bit has no fused kernel on cpu (test))"
    )
    assert lines[4] == "why:"
    assert lines[5:] == [f"- {r}" for r in d.reasons]
    assert len(lines) == 5 + len(d.reasons)


def test_summary_names_an_unavailable_rung() -> None:
    d = decide(ONE_M, 10**12, caps(bnb=False))
    assert "8bit unavailable (bitsandbytes is not installed (test))" in d.summary()


def test_proactive_bf16_reason_says_why_in_plain_words() -> None:
    d = decide(synthetic(FIFTY_M), 10**12, caps(bf16_fused=True))
    assert d.rung == "bf16"
    (reason,) = [r for r in d.reasons if "start at bf16" in r]
    # README's convergence table: the causal LM, bf16 stochastic +0.05% train / +0.14% eval
    assert "tracked fp32 AdamW within 0.05% of its final train loss" in reason
    assert "0.14% of its eval loss" in reason
    assert "half the memory (4 bytes a param instead of 8)" in reason
    assert "bench/" not in reason  # an installed package ships no bench/
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (lm_row,) = [line for line in readme.splitlines() if line.startswith("| causal LM")]
    assert "| +0.05% / +0.14% |" in lm_row  # the measured figure the reason cites


# ------------------------------------------------------------------------- Policy


def test_policy_defaults() -> None:
    policy = Policy()
    assert policy.proactive_bf16_min_params == 50_000_000
    assert policy.memory_fraction == 0.25
    assert policy.proactive_bf16 is True
    assert Policy(memory_fraction=1.0).memory_fraction == 1.0  # the closed end of (0, 1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"memory_fraction": 0}, "memory_fraction"),
        ({"memory_fraction": 0.0}, "memory_fraction"),
        ({"memory_fraction": 1.5}, "memory_fraction"),
        ({"memory_fraction": -0.25}, "memory_fraction"),
        ({"memory_fraction": "lots"}, "memory_fraction"),
        ({"proactive_bf16_min_params": -1}, "proactive_bf16_min_params"),
        ({"proactive_bf16_min_params": 1.5}, "proactive_bf16_min_params"),
        ({"gate": 0.5}, "gate"),  # unknown fields are refused
    ],
)
def test_policy_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        Policy(**kwargs)  # type: ignore[arg-type]
    assert [e["loc"] for e in info.value.errors()] == [(field,)]
    assert field in str(info.value)


def test_policy_is_frozen() -> None:
    with pytest.raises(ValidationError):
        Policy().memory_fraction = 0.5  # type: ignore[misc]


# ------------------------------------------------------------ probe_capabilities


def _bitsandbytes_imports() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def test_probe_cpu() -> None:
    c = probe_capabilities("cpu")
    assert c.device == "cpu"
    # torch >= 2.4 ships a fused AdamW kernel for the CPU.
    assert torch.torch_version.TorchVersion(torch.__version__) >= (2, 4)
    assert c.fused["fp32"] is True
    assert "fp32" not in c.unfused_reasons
    # optladder's 8-bit CPU kernel where a C compiler is found, else bitsandbytes' fallback
    from optladder.optimizers.kernels import cpu_unavailable_reason

    assert c.fused["8bit"] is (cpu_unavailable_reason() is None)
    assert ("8bit" in c.slow) is (cpu_unavailable_reason() is not None)
    assert c.available["fp32"] and c.available["bf16"]
    assert c.available["8bit"] is _bitsandbytes_imports()


@pytest.mark.parametrize("dtypes", [("bfloat16",), ("float16", "float32")])
def test_probe_cpu_low_precision_params_fused_on_optladders_kernel(
    dtypes: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's fused AdamW would keep bf16/fp16 moments: the fp32 rung keeps float32
    moments on optladder's C kernel (fused), or eagerly with the reason without gcc."""
    from optladder.optimizers.kernels import cpu_unavailable_reason

    c = probe_capabilities("cpu", dtypes=dtypes)
    assert c.fused["fp32"] is (cpu_unavailable_reason() is None)
    assert c.fused["bf16"] is (cpu_unavailable_reason() is None)
    monkeypatch.setenv("CC", "optladder-no-such-compiler")
    c = probe_capabilities("cpu", dtypes=dtypes)
    assert c.fused["fp32"] is False and c.fused["bf16"] is False
    assert "float32 moments" in c.unfused_reasons["fp32"]
    assert "no C compiler" in c.unfused_reasons["fp32"]


def test_probe_cpu_complex_params_miss_the_fused_fp32() -> None:
    c = probe_capabilities("cpu", dtypes=("complex64",), has_complex=True)
    assert c.fused["fp32"] is False
    assert "real params only" in c.unfused_reasons["fp32"]


def test_probe_runs_a_step_rather_than_assuming(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fused_adamw(*args: object, **kwargs: object) -> None:
        raise RuntimeError("fused=True is not supported here (test)")

    monkeypatch.setattr(torch, "_fused_adamw_", no_fused_adamw)  # the kernel the probe runs
    c = probe_capabilities("cpu")
    assert c.fused["fp32"] is False
    assert "no fused AdamW kernel on cpu" in c.unfused_reasons["fp32"]


def test_probe_without_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules is how Python blocks an import: find_spec answers None, as for
    # a package that is not installed
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    c = probe_capabilities("cpu")
    assert c.available["8bit"] is False
    assert c.unavailable_reasons["8bit"] == (
        "the 8bit rung is unavailable: bitsandbytes is not installed "
        "(pip install 'bitsandbytes>=0.45')"
    )
    d = decide(ONE_M, 15_999_999, c)  # 8bit would be the rung: skipped
    assert (d.rung, d.fits) == ("bf16", False)
    with pytest.raises(ValueError, match="bitsandbytes"):
        decide(ONE_M, HUGE, c, overrides=read_overrides("8bit"))


needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="plans for an absent CUDA device"
)


@needs_no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_probe_cuda_without_cuda_uses_torchs_fused_list(device: str) -> None:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    c = probe_capabilities(device)
    assert c.device == device
    assert c.fused["fp32"] is ("cuda" in _get_fused_kernels_supported_devices())
    assert c.fused["8bit"] is True  # bitsandbytes' block-wise kernel on CUDA
    assert "8bit" not in c.slow


@needs_no_cuda
def test_probe_cuda_follows_the_fused_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec, "torch_fused_device_types", lambda: ("cpu",))
    c = probe_capabilities("cuda")
    assert c.fused["fp32"] is False
    assert "no fused AdamW kernel on cuda" in c.unfused_reasons["fp32"]


def test_decide_refuses_when_no_rung_can_be_used() -> None:
    from optladder import Capabilities, Overrides, decide, measure_footprint

    footprint = measure_footprint([torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))])
    caps = Capabilities(
        device="cpu",
        fused={"fp32": True, "bf16": True, "8bit": False},
        available={"fp32": False, "bf16": True, "8bit": True},
        unavailable_reasons={"fp32": "fp32 is unavailable (test)"},
    )
    with pytest.raises(ValueError, match="no rung can be used: fp32 is unavailable"):
        decide(footprint, 2**30, caps, overrides=Overrides())


def test_policy_is_strict_about_types() -> None:
    from pydantic import ValidationError

    from optladder import Policy

    with pytest.raises(ValidationError, match="memory_fraction"):
        Policy(memory_fraction=True)
    with pytest.raises(ValidationError, match="proactive_bf16"):
        Policy(proactive_bf16="yes")
