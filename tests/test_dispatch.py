"""The dispatch table of ``LadderAdamW`` (:mod:`optladder.optimizers.dispatch`): it covers
every (rung, device, param dtype, grad dtype) the engine takes, refuses what the engine
refuses, and the entry it names is the kernel the step runs (each entry's run counted),
with the bits of the references (torch's AdamW, the eager oracle ``_step_param``,
bitsandbytes' ``AdamW8bit``)."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
from typing import Any

import pytest
import torch

from optladder.optimizers import LadderAdamW, kernels
from optladder.optimizers.dispatch import ENTRIES, ROUTES, DispatchTable
from optladder.optimizers.kernels import cpu

needs_gcc = pytest.mark.skipif(
    cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)
needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed"
)

RUNGS = ("fp32", "bf16", "8bit")
DEVICES = ("cpu", "cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KEYS = list(itertools.product(RUNGS, DEVICES, DTYPES, DTYPES))


def _expected(rung: str, device: str, param: torch.dtype, grad: torch.dtype) -> str | None:
    """The entry each key must take, by the rules as README states them (None: refused):
    8bit takes float32/bfloat16/float16 params; the fp32 rung steps float32 and float64
    params on torch's fused AdamW (grads of their dtype only); the rest is optladder's
    kernel of the device (the C kernel, Triton) where it reads both dtypes, else the
    eager loop."""
    if rung == "8bit":
        return None if param == torch.float64 else "8bit"
    if rung == "fp32" and param in (torch.float32, torch.float64):
        return "torch_fused" if grad == param else None
    if torch.float64 in (param, grad):
        return "eager"
    if device == "cuda":
        return "eager" if kernels.triton_unavailable_reason() else "triton"
    return "cpu"


def _counting(opt: LadderAdamW) -> collections.Counter[str]:
    """Put a counting run in place of each entry's run in ``opt``'s table."""
    counts: collections.Counter[str] = collections.Counter()
    for name, entry in list(opt.dispatch.entries.items()):

        def run(
            payload: Any, grad_scale: Any, found_inf: Any, _run: Any = entry.run, _name: str = name
        ) -> None:
            counts[_name] += 1
            _run(payload, grad_scale, found_inf)

        opt.dispatch.entries[name] = dataclasses.replace(entry, run=run)
    return counts


def test_entries_share_one_signature_and_name_their_kernel() -> None:
    assert list(ROUTES) == list(ENTRIES)
    for name, entry in ENTRIES.items():
        assert entry.name == name and entry.kernel
        assert entry.amp in ("kernel", "host")
        # unfused entries are exactly those stepping one param at a time
        assert entry.fused is (name in ("triton", "torch_fused", "cpu", "8bit"))
    # the kernels that take grad_scale/found_inf on the device run before the host's
    amps = [ENTRIES[name].amp for name in ROUTES]
    assert amps == sorted(amps, key=lambda amp: amp != "kernel")


@needs_gcc
@pytest.mark.parametrize(("rung", "device", "param", "grad"), KEYS)
def test_the_table_covers_every_key(
    rung: str, device: str, param: torch.dtype, grad: torch.dtype
) -> None:
    """Every key of the engine has an entry (the one the rules give) or a refusal with
    its reason; an unfused entry says why."""
    choice = DispatchTable("auto", torch_fused=True).lookup(rung, device, param, grad)
    want = _expected(rung, device, param, grad)
    assert choice.entry == want, choice
    if want is None or not ENTRIES[want].fused:
        assert choice.reason, choice  # a refusal or an unfused entry says why
    else:
        assert choice.reason is None


@needs_gcc
@needs_bnb
@pytest.mark.parametrize(("rung", "param", "grad"), list(itertools.product(RUNGS, DTYPES, DTYPES)))
def test_the_entry_the_table_names_is_the_one_the_step_runs(
    rung: str, param: torch.dtype, grad: torch.dtype
) -> None:
    """On the CPU: the engine takes a key exactly when the table has an entry for it,
    and a step runs that entry once and no other."""
    want = _expected(rung, "cpu", param, grad)
    p = torch.nn.Parameter(torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(param))
    try:
        opt = LadderAdamW([{"params": [p], "rung": rung}], weight_decay=0.1)
    except ValueError as exc:
        assert want is None and "float64" in str(exc)  # the 8bit rung refuses it here
        return
    counts = _counting(opt)
    p.grad_dtype = None  # torch 2.13 refuses a grad of another dtype by default
    p.grad = torch.randn(4096, generator=torch.Generator().manual_seed(1)).to(grad)
    before = p.detach().clone()
    if want is None:
        with pytest.raises(ValueError, match="param 0 has a torch"):
            opt.step()
        assert not counts and torch.equal(p, before) and not opt.state[p]
        return
    opt.step()
    assert counts == {want: 1}
    assert not torch.equal(p, before)
    # the 8bit entry steps a float64 grad on bitsandbytes' per-tensor path, and says so
    unfused = want == "eager" or (want == "8bit" and grad == torch.float64)
    assert (0 in opt.eager_reasons) is unfused


_MIXED_GROUPS = (
    ("fp32", 2e-2, ("torch_fused", "cpu_fp32_format", "torch_foreach")),
    ("bf16", 1e-2, ("cpu", "eager", "staged")),
    ("8bit", 1e-2, ("8bit",)),
)
"""Three groups of the three rungs: (rung, lr, the params' names)."""


def _mixed_params() -> dict[str, torch.nn.Parameter]:
    """One param per entry that runs on the CPU (the name of its entry, or where that
    is another format's)."""
    g = torch.Generator().manual_seed(3)
    return {
        "torch_fused": torch.nn.Parameter(torch.randn(24, 16, generator=g)),
        "cpu_fp32_format": torch.nn.Parameter(torch.randn(300, generator=g).bfloat16()),
        "torch_foreach": torch.nn.Parameter(torch.randn(20, generator=g, dtype=torch.complex64)),
        "cpu": torch.nn.Parameter(torch.randn(500, generator=g)),
        "eager": torch.nn.Parameter(torch.randn(70, generator=g)),  # its grad: float64
        "staged": torch.nn.Parameter(torch.randn(16, 40, generator=g).t()),  # transposed
        "8bit": torch.nn.Parameter(torch.randn(64, 64, generator=g)),
    }


def _mixed_groups(params: dict[str, torch.nn.Parameter], n: int = 3) -> list[dict[str, Any]]:
    return [
        {"params": [params[k] for k in names], "rung": rung, "lr": lr}
        for rung, lr, names in _MIXED_GROUPS[:n]
    ]


def _grads(params: dict[str, torch.nn.Parameter], step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    grads = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()}
    grads["eager"] = grads["eager"].double()  # no kernel reads it: the eager loop
    return grads


def _set_grads(params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor]) -> None:
    params["eager"].grad_dtype = None  # torch 2.13 refuses a grad of another dtype by default
    for k, grad in grads.items():
        params[k].grad = grad.clone()


@needs_gcc
@needs_bnb
def test_a_mixed_rung_step_runs_each_entry_once_with_the_references_bits() -> None:
    """Three groups of the three rungs, one param per entry: each step runs every entry
    once (Triton: none on the CPU), and every param gets its reference's values: torch's
    fused and foreach AdamW bit for bit, the eager oracle ``_step_param`` bit for bit
    (the C kernel, staged or not, and the eager loop match it), bitsandbytes'
    ``AdamW8bit`` within float32 rounding at the first step (another update code: see
    test_kernels_8bit_cpu.py's tolerances)."""
    import bitsandbytes as bnb

    params = _mixed_params()
    opt = LadderAdamW(_mixed_groups(params), weight_decay=0.1, seed=5)
    counts = _counting(opt)
    twins = {k: torch.nn.Parameter(p.detach().clone()) for k, p in params.items()}
    fused = torch.optim.AdamW([twins["torch_fused"]], lr=2e-2, weight_decay=0.1, fused=True)
    foreach = torch.optim.AdamW([twins["torch_foreach"]], lr=2e-2, weight_decay=0.1, foreach=True)
    eight = bnb.optim.AdamW8bit([twins["8bit"]], lr=1e-2, weight_decay=0.1)
    # the oracle: an engine over the same groups of copies, stepped param by param
    oracle = LadderAdamW(_mixed_groups(twins, 2), weight_decay=0.1, seed=5)  # never stepped
    ladder = ("cpu_fp32_format", "cpu", "eager", "staged")
    for step in range(2):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(twins, grads)
        opt.step()
        fused.step()
        foreach.step()
        eight.step()
        index = 0
        with torch.no_grad():
            for group in oracle.param_groups:
                for q in group["params"]:
                    if any(q is twins[k] for k in ladder):
                        oracle._step_param(q, group, index)
                    index += 1
        want = dict.fromkeys(("torch_fused", "cpu", "torch_foreach", "eager", "staged", "8bit"))
        assert counts == {name: step + 1 for name in want}
        assert set(opt.eager_reasons) == {2, 4}  # complex: torch's foreach; a float64 grad
        if step == 0:  # from zero state (later, a code one off near a midpoint compounds)
            torch.testing.assert_close(params["8bit"], twins["8bit"], rtol=1e-6, atol=1e-6)
    for k in ("torch_fused", "torch_foreach", *ladder):
        assert torch.equal(params[k], twins[k]), k
    for k in ladder:
        st, ref = opt.state[params[k]], oracle.state[twins[k]]
        assert torch.equal(st["exp_avg"], ref["exp_avg"]), k
        assert torch.equal(st["exp_avg_sq"], ref["exp_avg_sq"]), k
    assert opt.state[params["torch_fused"]]["step"].item() == 2.0
    assert opt.state[params["8bit"]]["step"] == 2


@needs_gcc
def test_a_step_with_infs_runs_no_host_entry_and_changes_nothing() -> None:
    """found_inf set: the host entries are skipped (no run), the device entries get the
    flag (torch's fused kernel skips the update itself); nothing changes."""
    params = _mixed_params()
    del params["8bit"]
    opt = LadderAdamW(_mixed_groups(params, 2), weight_decay=0.1)
    counts = _counting(opt)
    _set_grads(params, _grads(params, 0))
    before = {k: p.detach().clone() for k, p in params.items()}
    opt.grad_scale = torch.tensor(1.0)  # type: ignore[attr-defined]
    opt.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
    opt.step()
    assert counts == {"torch_fused": 1}  # the only entry taking found_inf on the device
    for k, p in params.items():
        assert torch.equal(p, before[k]), k
    assert all(float(opt.state[p]["step"]) == 0.0 for p in params.values())


def test_a_backend_that_insists_refuses_what_its_kernel_cannot_step() -> None:
    table = DispatchTable("cpu", torch_fused=True)
    choice = table.lookup("bf16", "cuda", torch.float32, torch.float32)
    assert choice.entry is None and choice.by_backend
    assert choice.reason == "no fused kernel of optladder's AdamW for cuda"
    key = ("bf16", "cpu", torch.float32, torch.float32)
    eager = DispatchTable("eager", torch_fused=True).lookup(*key)
    assert eager.entry == "eager" and eager.reason == "backend='eager' was asked for"
    # without torch's fused kernel (a device whose fused step did not run): foreach, why
    foreach = DispatchTable("auto", torch_fused=False).lookup(
        "fp32", "cpu", torch.float32, torch.float32
    )
    assert foreach.entry == "torch_foreach"
    assert "no fused AdamW kernel on cpu" in str(foreach.reason)


@pytest.mark.parametrize(
    ("rung", "pin", "dtypes"),
    [
        ("bf16", None, (torch.float64,)),
        ("bf16", None, (torch.float64, torch.float32)),
        ("fp32", "bf16", (torch.float64, torch.float32)),  # float64 pins bf16; fp32 is fused
    ],
)
def test_float64_params_on_the_bf16_rung_log_one_line(
    caplog: pytest.LogCaptureFixture,
    rung: str,
    pin: str | None,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """float64 params on the bf16 rung run the eager path for one reason, logged once
    over construction and three steps (README: "one log line per reason"): it was logged
    twice, as the decision's (``float64 params run the eager path``) and as the C
    kernel's per param (``param dtype torch.float64: ...``). Beside a decision that is
    fused (fp32, the float64 params in a group that pins bf16) the param's own reason is
    that one line."""
    import logging

    from optladder import choose_optimizer

    caplog.set_level(logging.WARNING, logger="optladder")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, generator=gen, dtype=d)) for d in dtypes]
    group: dict[str, Any] = {"params": params[:1]}
    if pin is not None:
        group["rung"] = pin
    groups = [group, *({"params": [p]} for p in params[1:])]
    opt = choose_optimizer(groups, lr=1e-3, rung=rung, free_memory="1GiB")
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
    lines = [r.getMessage() for r in caplog.records if "not on the fused path" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "bf16 rung" in lines[0] and "float64" in lines[0]
