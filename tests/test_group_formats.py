"""Per-group state formats of one :class:`LadderAdamW`: a group's ``"rung"`` key
(``"fp32"``: float32 moments, ``"bf16"``: bfloat16 moments; without the key the engine's
``moment_dtype``) sets its moments' dtype, and one step steps groups of both formats.

The expected values are those of two separate single-format engines (one with float32
moments, one with bfloat16 moments) over the same groups, each param at the same index
over all groups (``param_starts``: the random bits' counter), stepped over several steps:
params, moments and step counts bit for bit, on the C kernel at each SIMD level and on
the eager path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.kernels import cpu

BACKENDS = ["eager"] + ([] if cpu.unavailable_reason() else ["cpu"])

# (rung key or None, param dtypes, group options)
GROUPS: list[tuple[str | None, tuple[torch.dtype, ...], dict[str, Any]]] = [
    ("fp32", (torch.bfloat16, torch.float16), {"lr": 3e-2, "weight_decay": 0.1}),
    ("bf16", (torch.float32, torch.bfloat16), {"lr": 1e-2, "betas": (0.8, 0.99)}),
    (None, (torch.float16,), {"lr": 2e-2, "rounding": "nearest"}),
    ("fp32", (torch.float32, torch.bfloat16), {"lr": 5e-3, "weight_decay": 0.0}),
]
SHAPES = [(33, 17), (4099,), (5,)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.int64)


def _groups(seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for k, (rung, dtypes, options) in enumerate(GROUPS):
        params = [
            torch.nn.Parameter(torch.randn(SHAPES[(k + i) % len(SHAPES)], generator=gen).to(dt))
            for i, dt in enumerate(dtypes)
        ]
        group: dict[str, Any] = {"params": params, **options}
        if rung is not None:
            group["rung"] = rung
        groups.append(group)
    return groups


def _formats(default: torch.dtype) -> list[torch.dtype]:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return [dtypes[rung] if rung else default for rung, _, _ in GROUPS]


def _run(
    engines: list[LadderAdamW], params: list[torch.nn.Parameter], steps: int, amp: bool
) -> None:
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        scale = 256.0 if amp else 1.0
        for k, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen) * scale
            # a param without a grad at one step: skipped, its step count not counted
            p.grad = None if (step == 1 and k == 2) else g.to(p.dtype)
        for engine in engines:
            if amp:
                engine.grad_scale = torch.tensor(scale)  # type: ignore[attr-defined]
            engine.step()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("default", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("amp", [False, True], ids=["plain", "grad_scale"])
def test_groups_of_both_formats_step_as_two_single_format_engines(
    backend: str, default: torch.dtype, amp: bool, kernel_simd: int
) -> None:
    mixed_groups, ref_groups = _groups(0), _groups(0)
    formats = _formats(default)
    options = {"seed": 7, "backend": backend}
    mixed = LadderAdamW(mixed_groups, moment_dtype=default, **options)  # type: ignore[arg-type]
    starts, start = [], 0
    for group in ref_groups:
        starts.append(start)
        start += len(group["params"])
    refs = []
    for dtype in (torch.float32, torch.bfloat16):
        picked = [k for k, f in enumerate(formats) if f == dtype]
        engine = LadderAdamW(
            [ref_groups[k] for k in picked],
            moment_dtype=dtype,
            **options,  # type: ignore[arg-type]
        )
        engine.param_starts = [starts[k] for k in picked]
        refs.append(engine)
    mixed_params = [p for g in mixed_groups for p in g["params"]]
    ref_params = [p for g in ref_groups for p in g["params"]]
    _run([mixed], mixed_params, 4, amp)
    _run(refs, ref_params, 4, amp)
    if backend == "cpu":
        assert mixed.eager_reasons == {}
        assert mixed._cpu_table is not None
        assert mixed._cpu_table.moment_dtypes == formats  # one table, both formats
    ref_state = {p: st for engine in refs for p, st in engine.state.items()}
    for gi, group in enumerate(mixed_groups):
        for a, b in zip(group["params"], ref_groups[gi]["params"], strict=True):
            assert torch.equal(_bits(a), _bits(b))
            sa, sb = mixed.state[a], ref_state[b]
            for name in ("exp_avg", "exp_avg_sq"):
                assert sa[name].dtype == sb[name].dtype == formats[gi]
                assert torch.equal(_bits(sa[name]), _bits(sb[name])), name
            assert float(sa["step"]) == float(sb["step"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_whose_format_flips_is_planned_again(backend: str) -> None:
    """A group whose ``"rung"`` flips from fp32 to bf16 (its moments converted by the
    caller, as a move between rungs does) steps in its new format from the next step:
    as an engine of bfloat16 moments loading the converted state would."""
    groups, ref_groups = _groups(1), _groups(1)
    opt = LadderAdamW(groups, moment_dtype=torch.float32, seed=3, backend=backend)  # type: ignore[arg-type]
    params = [p for g in groups for p in g["params"]]
    _run([opt], params, 2, amp=False)
    saved = copy.deepcopy(opt.state_dict())  # not the live tensors
    for k in (0, 3):  # the fp32 groups: converted to bf16 in place
        groups[k]["rung"] = "bf16"
        for p in groups[k]["params"]:
            st = opt.state[p]
            for name in ("exp_avg", "exp_avg_sq"):
                st[name] = st[name].to(torch.bfloat16)
    for g in saved["param_groups"]:
        g["rung"] = "bf16" if g.get("rung") == "fp32" else g.get("rung")
        if g["rung"] is None:
            del g["rung"]
    ref = LadderAdamW(ref_groups, moment_dtype=torch.float32, seed=3, backend=backend)  # type: ignore[arg-type]
    ref.load_state_dict(saved)  # casts each group's moments to its format
    ref_params = [p for g in ref_groups for p in g["params"]]
    with torch.no_grad():
        for a, b in zip(params, ref_params, strict=True):
            b.copy_(a)
    _run([opt], params, 2, amp=False)
    _run([ref], ref_params, 2, amp=False)
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for name in ("exp_avg", "exp_avg_sq"):
            assert opt.state[a][name].dtype == torch.bfloat16 or a in groups[2]["params"]
            assert torch.equal(_bits(opt.state[a][name]), _bits(ref.state[b][name]))
