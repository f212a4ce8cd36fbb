"""The 8bit rung's CPU kernel (optimizers/kernels/cpu8bit.py) against bitsandbytes.

References, computed independently of the kernel:
- bitsandbytes' own CPU update (``_optimizer_update_8bit_blockwise_cpu`` and
  ``_optimizer_update_32bit_cpu`` in ``bitsandbytes/backends/cpu/ops.py``), with its
  quantizer routed to bitsandbytes' torch backend (``quantize_blockwise`` registered for
  CompositeExplicitAutograd: nearest code by ``torch.bucketize`` on the midpoints), the
  encoding rule the kernel follows;
- plain ``bitsandbytes.optim.AdamW8bit`` (native CPU quantizer) and ``torch.optim.AdamW``
  (float32 moments) for the error budget and checkpoint interchange.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engines import eightbit
from memtools import FailNthAllocation
from optladder.optimizers import kernels, transaction

pytestmark = pytest.mark.skipif(
    kernels.cpu_unavailable_reason() is not None, reason="no C compiler for the CPU kernel"
)
bnb = pytest.importorskip("bitsandbytes")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 20,000 elements: 78 full blocks and a partial one; 5,000: a partial block too;
# 1,000: under min_8bit_size (4,096), float32 state.
SIZES = (20_000, 5_000, 1_000)


def _engine(params: Any, *, coupled_weight_decay: bool = False, **kwargs: Any) -> Any:
    """The 8bit rung over ``params`` (LadderAdamW's 8bit state format; min_8bit_size
    4,096), in Adam mode with ``coupled_weight_decay``."""
    return eightbit(params, decoupled_weight_decay=not coupled_weight_decay, **kwargs)


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]


def _grads(params: list[torch.nn.Parameter], seed: int) -> Iterator[torch.Tensor]:
    """Heavy-tailed grads (many tiny values, the hard case for a code book), with zeros."""
    gen = torch.Generator().manual_seed(100 + seed)
    for p in params:
        g = torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen) ** 3
        g[::7] = 0.0
        yield g.to(p.dtype)


@pytest.fixture
def torch_quantizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route bitsandbytes' CPU update's re-quantization to its torch backend."""
    import bitsandbytes.backends.cpu.ops as cpu_ops

    def quantize(
        a: torch.Tensor, code: torch.Tensor, absmax_out: torch.Tensor, out: torch.Tensor, bs: int
    ) -> None:
        codes, absmax = _reference_encode(a, code)
        out.copy_(codes)
        absmax_out.copy_(absmax)

    monkeypatch.setattr(cpu_ops, "_quant_blockwise_fp32_direct", quantize)


def _reference_encode(
    values: torch.Tensor, code: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' torch-backend ``quantize_blockwise`` (nearest code, ties to the lower),
    with the kernel's one documented exception: on a book whose first code is 0, a
    positive value below the first midpoint takes code 1, not 0."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    codes, absmax = op.redispatch(keys, values, code, 256)
    if code[0] == 0:
        codes[(codes == 0) & (values.reshape(codes.shape) > 0)] = 1
    return codes, absmax


def _reference_step(
    state: dict[str, Any], p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], coupled: bool
) -> None:
    """One step of bitsandbytes' CPU update on copies held in ``state``/``p``."""
    import bitsandbytes.backends.cpu.ops as cpu_ops

    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    if coupled:  # Adam: the kernel folds the decay into the grad in float32
        g = g.float().add_(p.float(), alpha=wd)
        wd = 0.0
    step = state["step"] + 1
    if state["state1"].dtype == torch.uint8:
        cpu_ops._optimizer_update_8bit_blockwise_cpu(
            "adam",
            g,
            p,
            state["state1"],
            state["state2"],
            beta1,
            beta2,
            0.0,
            0.0,
            group["eps"],
            step,
            lr,
            state["qmap1"],
            state["qmap2"],
            state["absmax1"],
            state["absmax2"],
            wd,
            1.0,
            False,
        )
    else:
        cpu_ops._optimizer_update_32bit_cpu(
            "adam",
            g,
            p,
            state["state1"],
            state["state2"],
            None,
            0.0,
            1.0,
            beta1,
            beta2,
            0.0,
            0.0,
            group["eps"],
            wd,
            step,
            lr,
            1.0,
            False,
        )
    state["step"] = step


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at each value's magnitude, in float32."""
    finfo = torch.finfo(x.dtype)
    mag = x.float().abs().clamp_min(finfo.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * finfo.eps


@pytest.mark.parametrize("coupled", [False, True], ids=["adamw", "adam"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_step_matches_bitsandbytes_cpu_update(
    dtype: torch.dtype, coupled: bool, torch_quantizer: None
) -> None:
    """Lockstep: from the same state, one kernel step and one step of bitsandbytes' CPU
    update (torch-backend quantizer) give the same codes and absmax, and params equal
    within a few float32 rounding steps.

    Tolerances: both compute the update with the same float32 operations (the kernel
    mirrors torch's fused multiply-adds), so the moments, their absmax and their codes
    come out equal; a code may still differ by one where a value lies within rounding of
    a midpoint (allowed: 1 element in 1,000, by one code). The param update differs at
    most in the rounding of its last operations, a few float32 ulps of the largest value
    involved (the old param, the new one, or the update, under ``4 * lr``): 4 ulps of
    that magnitude for float32 params; bfloat16/float16 params are rounded from float32
    to nearest, so those few float32 ulps can flip the rounding once: 1 ulp of the
    param's dtype at the old or new magnitude (at most 2 ulps of their sum).
    """
    params = _params(dtype)
    groups = [
        {"params": params[:1], "lr": 2e-3, "weight_decay": 0.1},
        {"params": params[1:], "lr": 1e-3, "weight_decay": 0.01, "betas": (0.8, 0.99)},
    ]
    opt = _engine(groups, coupled_weight_decay=coupled)
    for s in range(4):
        grads = list(_grads(params, s))
        refs: list[tuple[dict[str, Any], torch.Tensor]] = []
        olds = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g
            refs.append((copy.deepcopy(dict(opt.state[p])), p.detach().clone()))
        opt.step()
        assert opt.eager_reasons == {}
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                k = next(i for i, q in enumerate(params) if q is p)
                ref_state, ref_p = refs[k]
                if not ref_state:  # the first step: bitsandbytes' init_state
                    ref_state = {"step": 0}
                    for name in ("state1", "state2"):
                        ref_state[name] = torch.zeros_like(opt.state[p][name])
                    if opt.state[p]["state1"].dtype == torch.uint8:
                        for i in (1, 2):
                            ref_state[f"qmap{i}"] = opt.state[p][f"qmap{i}"]
                            ref_state[f"absmax{i}"] = torch.zeros_like(opt.state[p][f"absmax{i}"])
                _reference_step(ref_state, ref_p, grads[k], group, coupled)
                st = opt.state[p]
                assert st["step"] == ref_state["step"] == s + 1, gi
                if st["state1"].dtype == torch.uint8:
                    for i in (1, 2):
                        diff = (st[f"state{i}"].int() - ref_state[f"state{i}"].int()).abs()
                        assert diff.max() <= 1 and (diff != 0).sum() <= p.numel() // 1000
                        torch.testing.assert_close(
                            st[f"absmax{i}"], ref_state[f"absmax{i}"], rtol=2**-22, atol=0
                        )
                else:
                    for i in (1, 2):
                        torch.testing.assert_close(
                            st[f"state{i}"], ref_state[f"state{i}"], rtol=2**-21, atol=1e-30
                        )
                before = olds[k]
                scale = before.float().abs() + ref_p.float().abs() + 4 * group["lr"]
                bound = _ulp(scale.to(dtype)) * (4 if dtype == torch.float32 else 2)
                err = (p.detach().float() - ref_p.float()).abs()
                bad = (err > bound).nonzero().flatten()[:5]
                assert bad.numel() == 0, (
                    s,
                    p.numel(),
                    err[bad] / bound[bad],
                    ref_p[bad],
                    grads[k][bad],
                )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_several_steps_within_bitsandbytes_own_error(dtype: torch.dtype) -> None:
    """Free run of 12 steps: the kernel's distance to float32 AdamW is no larger than
    plain ``bitsandbytes.optim.AdamW8bit``'s (its own error budget on the CPU).

    Both keep the same format and update; they differ only in the encoding (nearest code
    vs bitsandbytes' approximate native search, which misplaces values under ~3e-5 of the
    block's absmax), so the kernel's mean error must not exceed bitsandbytes' by more than
    10% (the spread between seeds of such means, measured, is a few percent).
    """
    base = _params(dtype, seed=3)
    copies = [[torch.nn.Parameter(p.detach().float().clone()) for p in base]]
    copies += [[torch.nn.Parameter(p.detach().clone()) for p in base] for _ in range(2)]
    ref = torch.optim.AdamW(copies[0], lr=1e-3, weight_decay=0.01, foreach=False)
    ours = _engine(copies[1], lr=1e-3, weight_decay=0.01)
    plain = bnb.optim.AdamW8bit(copies[2], lr=1e-3, weight_decay=0.01)
    for s in range(12):
        for ps in copies:
            for p, g in zip(ps, _grads(base, s)):
                p.grad = g.to(p.dtype)
        for opt in (ref, ours, plain):
            opt.step()
    assert ours.eager_reasons == {}
    for p_ref, p_ours, p_plain in zip(*copies):
        err_ours = (p_ours.float() - p_ref).abs().mean().item()
        err_plain = (p_plain.float() - p_ref).abs().mean().item()
        assert err_ours <= 1.1 * err_plain + 1e-7, (p_ref.numel(), err_ours, err_plain)


def test_a_zero_grad_keeps_a_zero_moment_at_the_zero_code() -> None:
    """Coordinates whose grad is always exactly 0, in blocks with live ones: their codes
    are the code books' exact zeros (index 127 of the signed map, 0 of the unsigned one)
    after every step, and the params do not move (weight decay 0)."""
    p = torch.nn.Parameter(torch.randn(8192))
    opt = _engine([p], lr=1e-3, weight_decay=0.0)
    dead = torch.arange(8192) % 2 == 1
    p0 = p.detach().clone()
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        g = torch.randn(8192, generator=gen) * 10
        g[dead] = 0.0
        p.grad = g
        opt.step()
        st = opt.state[p]
        zero1 = int((st["qmap1"] == 0).nonzero().item())
        zero2 = int((st["qmap2"] == 0).nonzero().item())
        assert (zero1, zero2) == (127, 0)
        assert (st["state1"][dead] == zero1).all() and (st["state2"][dead] == zero2).all()
        assert torch.equal(p.detach()[dead], p0[dead])
    # plain bitsandbytes on the CPU does not keep them at zero (its native quantizer)
    q = torch.nn.Parameter(p0.clone())
    plain = bnb.optim.AdamW8bit([q], lr=1e-3, weight_decay=0.0)
    q.grad = g
    plain.step()
    assert (plain.state[q]["state1"][dead] != 127).any()


def test_encoding_is_bitsandbytes_reference_rule() -> None:
    """``cpu8bit.quantize_blockwise`` (the kernel's encoder) gives bit for bit the codes and
    absmax of bitsandbytes' torch backend, on both code books, with zeros, ties and an
    all-zero block; on the unsigned book, positive values under the first midpoint take
    code 1 (and there are such values here)."""
    from bitsandbytes import functional as F

    from optladder.optimizers.kernels import cpu8bit

    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256 * 40 + 77, generator=gen) * torch.rand(256 * 40 + 77, generator=gen) ** 6
    x[::5] = 0.0
    x[256:512] = 0.0  # an all-zero block
    for signed in (True, False):
        code = F.create_dynamic_map(signed=signed).float()
        values = x if signed else x.abs()
        values = values.clone()
        values[1024 + 3] = values[1024:1280].abs().max() * (code[200] + code[201]) / 2  # a tie
        codes, absmax = cpu8bit.quantize_blockwise(values, code)
        nearest, want_absmax = op.redispatch(keys, values, code, 256)
        want_codes, _ = _reference_encode(values, code)
        assert torch.equal(absmax, want_absmax)
        assert torch.equal(codes, want_codes)
        assert (codes[values == 0] == int((code == 0).nonzero().item())).all()
        if not signed:
            assert ((nearest == 0) & (values > 0)).sum() > 100  # the exception is exercised


@pytest.mark.parametrize("signed", [True, False])
def test_encoding_at_every_midpoint(signed: bool) -> None:
    """Values at each midpoint between adjacent codes and one float32 step either side
    (absmax 1, so they are encoded as they are): the midpoint itself takes the lower code,
    the next float up the upper one, as bitsandbytes' reference rule says."""
    from bitsandbytes import functional as F

    from optladder.optimizers.kernels import cpu8bit

    code = F.create_dynamic_map(signed=signed).float()
    mids = (code[:-1] + code[1:]) / 2
    below = torch.nextafter(mids, torch.tensor(-2.0))
    above = torch.nextafter(mids, torch.tensor(2.0))
    values = torch.stack([below, mids, above], dim=1).reshape(-1)
    values = values[values.abs() <= 1]
    blocks = values.split(255)
    values = torch.cat([torch.cat([b, torch.ones(1)]) for b in blocks])  # absmax 1
    codes, absmax = cpu8bit.quantize_blockwise(values, code)
    want, _ = _reference_encode(values, code)
    assert torch.equal(absmax, torch.ones_like(absmax))
    assert torch.equal(codes, want)


def test_checkpoints_interchange_with_plain_bitsandbytes_both_ways() -> None:
    """optladder's 8bit state is ``AdamW8bit``'s: same keys, dtypes and shapes; a
    checkpoint of either loads into the other and continues. The continuation matches
    the source optimizer's own within the format's encoding difference: 3 steps of Adam
    move a param by at most 3 * lr * (1 - beta1) / sqrt(1 - beta2) ~ 9.5 lr per element
    (the bound of an Adam update), so two runs differ by at most twice that; on average
    they differ by far less (mean below 2% of the mean movement)."""
    params = _params(torch.float32, seed=5)
    for direction in ("to_plain", "from_plain"):
        src = [torch.nn.Parameter(p.detach().clone()) for p in params]
        make_src = bnb.optim.AdamW8bit if direction == "from_plain" else _engine
        make_dst = _engine if direction == "from_plain" else bnb.optim.AdamW8bit
        opt_src = make_src(src, lr=1e-3)
        for s in range(3):
            for p, g in zip(src, _grads(src, s)):
                p.grad = g
            opt_src.step()
        buf = io.BytesIO()
        torch.save(opt_src.state_dict(), buf)
        buf.seek(0)
        dst = [torch.nn.Parameter(p.detach().clone()) for p in src]
        opt_dst = make_dst(dst, lr=1e-3)
        opt_dst.load_state_dict(torch.load(buf, weights_only=True))
        for p, q in zip(src, dst):
            a, b = opt_src.state[p], opt_dst.state[q]
            assert sorted(a) == sorted(b)
            for key in a:
                if isinstance(a[key], torch.Tensor):
                    assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape)
                    assert torch.equal(a[key], b[key]), key
                else:
                    assert a[key] == b[key] == 3
        at_save = [p.detach().clone() for p in src]
        for s in range(3, 6):
            for ps in (src, dst):
                for p, g in zip(ps, _grads(ps, s)):
                    p.grad = g
            opt_src.step()
            opt_dst.step()
        for p, q, p0 in zip(src, dst, at_save):
            assert opt_dst.state[q]["step"] == 6
            diff = (p.detach() - q.detach()).abs()
            assert diff.max() <= 2 * 3 * 1e-3 * 0.1 / (1 - 0.999) ** 0.5
            assert diff.mean() <= 0.02 * (p.detach() - p0).abs().mean()


def test_a_step_at_16m_elements_peaks_at_the_state_in_a_fresh_process() -> None:
    """The issue's measurement: bench/eightbit_memory.py run in its own process on one
    float32 param of 16M (2**24) elements. The state is counted by hand: two code
    tensors of one byte per element, two float32 absmax per 256-element block, two
    256-entry float32 code books. The first step's extra resident-set peak is at most
    that state plus 1% of it (it creates the state; no float32 copy of a moment, the
    grad or the param, which would be 4 bytes per element each), the second step's at
    most 1% of it (everything in place)."""
    n = 1 << 24
    bench = Path(__file__).resolve().parents[1] / "bench" / "eightbit_memory.py"
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here: {exc}")
    done = subprocess.run(
        [sys.executable, str(bench), "--elements", str(n), "--engines", "kernel", "--json"],
        capture_output=True,
        text=True,
        # glibc hands out every block of 64 KiB or more by mmap and unmaps it when freed,
        # so the resident set follows what is allocated (by default freed heap stays
        # resident and the threshold moves: the same run read 0.985-1.025x the state)
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "MALLOC_MMAP_THRESHOLD_": "65536",
        },
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    state = 2 * n + 2 * 4 * (n // 256) + 2 * 4 * 256
    assert (first["elements"], first["step"], second["step"]) == (n, 1, 2)
    assert first["state_bytes"] == second["state_bytes"] == state
    assert first["fallback"] == second["fallback"] == []
    assert first["extra_peak_bytes"] <= 1.01 * state, first
    assert second["extra_peak_bytes"] <= 0.01 * state, second


def test_the_prepared_commit_allocates_nothing() -> None:
    """Through the two-phase step, the commit (``engine.step``) uses the tables prepare
    wrote and allocates no tensor; a rolled-back prepare leaves no tables behind."""
    params = _params(torch.bfloat16)
    opt = _engine(params, lr=1e-3)
    for s in range(2):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        transaction.prepare_step(opt)
        assert opt.eightbit_groups()._prepared is not None
        with FailNthAllocation(None) as counter:
            transaction.commit_step(opt)
        assert counter.count == 0
        assert all(opt.state[p]["step"] == s + 1 for p in params)
    transaction.prepare_step(opt)
    transaction.rollback_step(opt, [])
    assert opt.eightbit_groups()._prepared is None


def test_stale_tables_are_not_used() -> None:
    """Tables prepared for other grads (replaced between prepare and step, or given to
    more params) are remade."""
    p = torch.nn.Parameter(torch.randn(10_000))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = _engine([p], lr=1e-3), _engine([q], lr=1e-3)
    p.grad = torch.randn(10_000)
    transaction.prepare_step(opt)
    p.grad = torch.randn(10_000, generator=torch.Generator().manual_seed(9))
    q.grad = p.grad.clone()
    opt.step()
    ref.step()
    assert torch.equal(p, q)
    # a param that gets a grad after prepare is stepped too
    p2, q2 = torch.nn.Parameter(torch.randn(5_000)), torch.nn.Parameter(torch.empty(5_000))
    q2.data.copy_(p2.detach())
    opt.add_param_group({"params": [p2], "rung": "8bit"})
    ref.add_param_group({"params": [q2], "rung": "8bit"})
    p.grad, q.grad = None, None
    transaction.prepare_step(opt)
    p.grad, p2.grad = torch.ones(10_000), torch.ones(5_000)
    q.grad, q2.grad = torch.ones(10_000), torch.ones(5_000)
    opt.step()
    ref.step()
    assert torch.equal(p, q) and torch.equal(p2, q2)
    assert opt.state[p]["step"] == 2 and opt.state[p2]["step"] == 1


def test_without_a_compiler_bitsandbytes_steps_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No C compiler: the engine runs bitsandbytes' own update (bit for bit plain
    ``AdamW8bit``) and records the reason per param."""
    monkeypatch.setenv("CC", "no-such-compiler-for-optladder")
    params = _params(torch.float32)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, plain = _engine(params, lr=1e-3), bnb.optim.AdamW8bit(plain_params, lr=1e-3)
    for s in range(2):
        for ps in (params, plain_params):
            for p, g in zip(ps, _grads(ps, s)):
                p.grad = g
        opt.step()
        plain.step()
    assert set(opt.eager_reasons) == {0, 1, 2}
    assert "no-such-compiler-for-optladder" in opt.eager_reasons[0]
    for p, q in zip(params, plain_params):
        assert torch.equal(p, q)


def _books() -> list[torch.Tensor]:
    from bitsandbytes import functional as F

    return [F.create_dynamic_map(signed=s).float() for s in (True, False)]


def _special_values(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed values with zeros of both signs, exact ties and NaN/Inf sprinkled."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 8
    x[::11] = 0.0
    x[5::13] = -0.0
    x[7::97] = float("nan")
    x[9::389] = float("inf")
    x[3::401] = -float("inf")
    return x


def _kernel_jobs(dtype: torch.dtype, grad_dtype: torch.dtype, seed: int, coupled: bool) -> Any:
    """One step's jobs over 8-bit params (3 whole blocks and a partial one, 20 whole
    blocks) with non-trivial codes and absmax, and a float32-state param."""
    from optladder.optimizers.kernels import cpu8bit

    gen = torch.Generator().manual_seed(seed)
    q1, q2 = _books()
    b1, b2 = cpu8bit.code_bounds(q1), cpu8bit.code_bounds(q2)
    t1, t2 = cpu8bit.code_table(b1), cpu8bit.code_table(b2)
    jobs = []
    for n, quantized in ((3 * 256 + 100, True), (20 * 256, True), (700, False)):
        p = torch.randn(n, generator=gen).to(dtype)
        g = _special_values(n, seed + n).to(grad_dtype) if n == 700 else None
        g = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype) if g is None else g
        g[::53] = float("nan") if seed % 2 else 0.0
        blocks = -(-n // 256)
        if quantized:
            s1 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
            s2 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
            a1, a2 = torch.rand(blocks, generator=gen), torch.rand(blocks, generator=gen)
            books = dict(bounds1=b1, bounds2=b2, table1=t1, table2=t2, qmap1=q1, qmap2=q2)
        else:
            s1, s2 = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
            a1 = a2 = None
            books = dict.fromkeys(("bounds1", "bounds2", "table1", "table2", "qmap1", "qmap2"))
        jobs.append(
            cpu8bit.Job(
                param=p,
                grad=g,
                state1=s1,
                state2=s2,
                absmax1=a1,
                absmax2=a2,
                step=3,
                lr=1e-2,
                betas=(0.9, 0.99),
                eps=1e-8,
                weight_decay=0.1,
                coupled_weight_decay=coupled,
                **books,
            )
        )
    return jobs


@pytest.mark.parametrize("coupled", [False, True], ids=["adamw", "adam"])
@pytest.mark.parametrize(
    ("dtype", "grad_dtype"),
    [(a, b) for a in DTYPES for b in DTYPES],
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_the_simd_path_writes_the_scalar_loops_bits(
    dtype: torch.dtype, grad_dtype: torch.dtype, coupled: bool
) -> None:
    """The SIMD path for whole blocks (AVX-512, or AVX2 with FMA and F16C, whichever the
    CPU has) writes bit for bit what the scalar loops write: params, codes, absmax and
    float32 state, for every param and grad dtype, with NaN grads, over two steps.
    Skipped on a CPU without AVX2, where both runs would take the scalar loops."""
    from optladder.optimizers.kernels import cpu8bit

    if not cpu8bit.simd_available():
        pytest.skip("no AVX-512 nor AVX2+FMA+F16C: the 8-bit kernel runs its scalar loops only")

    for seed in (0, 1):
        runs = []
        for simd in (False, True):
            jobs = _kernel_jobs(dtype, grad_dtype, seed, coupled)
            cpu8bit.run_table(cpu8bit.prepare_table(jobs), simd=simd)
            runs.append(jobs)
        for a, b in zip(*runs):
            for name in ("param", "state1", "state2", "absmax1", "absmax2"):
                x, y = getattr(a, name), getattr(b, name)
                if x is not None:
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_start_table_encodes_as_the_binary_search_and_the_reference(
    dtype: torch.dtype,
) -> None:
    """``quantize_blockwise`` with the step's start table (scalar and SIMD) gives the
    codes and absmax of the binary search, and both equal bitsandbytes' reference rule
    (``_reference_encode``) wherever the values are finite, on both books: midpoints and
    the floats either side of each, zeros of both signs, tiny values under the smallest
    midpoint, NaN (code 255, last, as ``torch.bucketize`` sorts it) and Inf."""
    from optladder.optimizers.kernels import cpu8bit

    for code in _books():
        bounds = cpu8bit.code_bounds(code)
        table = cpu8bit.code_table(bounds)
        mids = bounds[:255]
        edge = torch.cat(
            [
                mids,
                torch.nextafter(mids, torch.tensor(2.0)),
                torch.nextafter(mids, torch.tensor(-2.0)),
                torch.tensor([1e-30, -1e-30, 1e-45, -1e-45, 1.0, -1.0]),
            ]
        )
        edge = edge[edge.abs() <= 1]
        # blocks whose absmax is 1, so the edge values are encoded as they are
        pieces = [torch.cat([b, torch.ones(1)]) for b in edge.split(255)]
        values = torch.cat([*pieces, _special_values(256 * 30 + 17, 3)])
        if code[0] == 0:
            values = values.abs()
        values = values.to(dtype)
        search = cpu8bit.quantize_blockwise(values, code)
        for simd in (False, True) if cpu8bit.simd_available() else (False,):
            fast = cpu8bit.quantize_blockwise(values, code, start_table=table, simd=simd)
            assert torch.equal(fast[0], search[0])
            assert torch.equal(fast[1].view(torch.int32), search[1].view(torch.int32))
        assert (search[0][values.isnan()] == 255).all()  # NaN sorts last, as in bucketize
        blocks_ok = torch.stack(
            [torch.isfinite(b.float()).all() for b in values.split(256)]
        )  # a NaN or Inf makes its whole block's scale NaN: compare the other blocks
        want_codes, want_absmax = _reference_encode(values.float(), code)
        keep = blocks_ok.repeat_interleave(256)[: values.numel()]
        assert torch.equal(search[0][keep], want_codes[keep])
        assert torch.equal(search[1][blocks_ok], want_absmax[blocks_ok])


def _absmax_one_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, within [-1, 1]) as whole blocks of 255 values after a 1.0 (the last
    padded with zeros): every block's absmax is 1, so each value is encoded as it is
    (``x * (1 / 1)``)."""
    x = torch.cat([x, torch.zeros(-x.numel() % 255)])
    return torch.cat([torch.ones(x.numel() // 255, 1), x.view(-1, 255)], dim=1).flatten()


def _near_every_bound_and_a_stride(bounds: torch.Tensor) -> torch.Tensor:
    """Every float within 64 float32 steps of each midpoint, a stride through every float
    in [-1, 1] (both signs), ±0, ±1, the smallest normals and denormals."""
    mids = bounds[:255]
    bits = mids.view(torch.int32).to(torch.int64)
    steps = torch.arange(-64, 65, dtype=torch.int64)
    near = bits[:, None] + steps  # float32 steps away from the midpoint, on its sign's side
    near = near[(near >= -(1 << 31)) & (near < 1 << 31)].to(torch.int32).view(torch.float32)
    across = torch.cat([near, -near])  # the midpoints' mirror images too
    stride = torch.arange(0, 0x3F800001, 4099, dtype=torch.int64).to(torch.int32)
    stride = stride.view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-126, -(2.0**-126), 1e-45, -1e-45])
    x = torch.cat([across, stride, -stride, special])
    return x[x.abs() <= 1]


def test_the_vector_encode_counts_the_bounds_below_every_float() -> None:
    """The AVX-512 encode (``ol8v_quantize64``, by register permutes on the tables at the
    end of ``code_table``) against the rule, counted independently (``searchsorted`` on
    the midpoints, NaN last), and against the scalar loop with the start table: every
    float within 64 steps of every midpoint, a stride through all floats in [-1, 1], zeros
    and denormals, NaN of both signs, on both books (negative values on the unsigned book
    too), through ``quantize_blockwise`` at each SIMD level the CPU has."""
    from optladder.optimizers.kernels import cpu8bit

    for code in _books():
        bounds = cpu8bit.code_bounds(code)
        table = cpu8bit.code_table(bounds)
        assert int(table[4 + 2 * int(table[1])]) == 1  # the vector tables serve the book
        x = _near_every_bound_and_a_stride(bounds)
        values = _absmax_one_blocks(x)
        want = torch.searchsorted(bounds[:255], values, side="left").to(torch.uint8)
        nan = torch.tensor([float("nan"), 1.0, -float("nan"), -1.0, 0.5, -0.5, 0.0, -0.0])
        nan_block = nan.repeat(32)  # absmax NaN: the other values scale to ±1 or ±0
        values = torch.cat([values, nan_block])
        # NaN counts 255; with absmax NaN the scale is 1e38, so ±0.5 and ±1 clamp to ±1:
        # 255 or no bound; ±0 count the negative midpoints (none on the unsigned book)
        zero = int((bounds[:255] < 0).sum())
        nan_codes = torch.tensor([255, 255, 255, 0, 255, 0, zero, zero] * 32, dtype=torch.uint8)
        want = torch.cat([want, nan_codes])
        for simd in (False, cpu8bit.SIMD_AVX2, cpu8bit.SIMD_AVX512):
            codes, absmax = cpu8bit.quantize_blockwise(values, code, start_table=table, simd=simd)
            assert torch.equal(codes, want), simd
            assert bool((absmax[:-1] == 1).all()) and bool(absmax[-1].isnan())


def test_a_book_the_vector_tables_cannot_serve_takes_the_start_table() -> None:
    """A book with a midpoint under 2**-31 (the vector encode's exponent slots span 1.0
    down to 2**-31): ``code_table``'s vector tables are all 0, and every SIMD level still
    encodes by the rule (the start table's encode)."""
    from optladder.optimizers.kernels import cpu8bit

    code, _ = torch.cat([torch.linspace(-1, 1, 254), torch.tensor([1e-12, 3e-12])]).sort()
    bounds = cpu8bit.code_bounds(code)
    table = cpu8bit.code_table(bounds)
    assert not bool(table[4 + 2 * int(table[1]) :].any())
    values = _absmax_one_blocks(_near_every_bound_and_a_stride(bounds))
    want = torch.searchsorted(bounds[:255], values, side="left").to(torch.uint8)
    for simd in (False, cpu8bit.SIMD_AVX2, cpu8bit.SIMD_AVX512):
        codes, _ = cpu8bit.quantize_blockwise(values, code, start_table=table, simd=simd)
        assert torch.equal(codes, want), simd


def test_a_book_denser_than_the_start_table_takes_is_refused() -> None:
    """Two midpoints among floats sharing their top 16 bits: ``code_table`` raises
    (such a book is stepped by bitsandbytes' own path, see ``eightbit._kernel_miss``)."""
    from optladder.optimizers.kernels import cpu8bit

    code = torch.linspace(-1, 1, 256)
    code[100:103] = torch.tensor([0.5, 0.5 + 2**-20, 0.5 + 2**-19])  # 2 midpoints in 0.5's bucket
    code, _ = code.sort()
    with pytest.raises(ValueError, match="top 16 bits"):
        cpu8bit.code_table(cpu8bit.code_bounds(code))


def test_a_partial_block_is_scaled_as_bitsandbytes_scales_it() -> None:
    """bitsandbytes' torch backend scales a full block by ``x * (1 / absmax)`` but the
    partial last block by ``x / absmax`` (and returns that block's absmax clamped to
    1e-38). The two differ by one float32 step for some values; here, values whose two
    scalings fall on either side of a midpoint, in a partial block: the codes (every
    path) and absmax equal the torch backend's; an all-zero partial block's absmax too."""
    from optladder.optimizers.kernels import cpu8bit

    for code in _books():
        mids = (code[:-1] + code[1:]) / 2
        am = torch.tensor([0.7481])
        x = mids * am
        x = torch.cat([x, torch.nextafter(x, torch.tensor(2.0)), torch.nextafter(x, -x - 1)])
        x = x[x.abs() < am]
        straddle = torch.bucketize(x / am, mids) != torch.bucketize(x * (1.0 / am), mids)
        assert 20 <= int(straddle.sum()) < 255  # the case is exercised, in one block
        partial = torch.cat([x[straddle], am])
        table = cpu8bit.code_table(cpu8bit.code_bounds(code))
        for values in (
            torch.cat([torch.ones(256), torch.zeros(256), partial]),
            torch.cat([torch.ones(256), torch.zeros(7)]),  # an all-zero partial block
        ):
            want_codes, want_absmax = _reference_encode(values, code)
            for start_table in (None, table):
                for simd in (False, True):
                    codes, absmax = cpu8bit.quantize_blockwise(
                        values, code, start_table=start_table, simd=simd
                    )
                    assert torch.equal(codes, want_codes), (start_table is None, simd)
                    assert torch.equal(absmax.view(torch.int32), want_absmax.view(torch.int32))
        assert want_absmax[-1] == torch.tensor(1e-38)  # clamped, as the torch backend does


def test_a_book_with_several_zero_midpoints_is_refused() -> None:
    """bitsandbytes' dynamic map with fewer than 8 bits (``total_bits=7``) is padded with
    zeros: 128 midpoints equal 0, which the start table's one comparison cannot count (it
    gave tiny positive values the code after the first zero, not after the last).
    ``code_table`` raises (the engine then steps such a param with bitsandbytes' own path);
    the binary search still encodes such a book as the reference rule does."""
    from bitsandbytes import functional as F

    from optladder.optimizers.kernels import cpu8bit

    code = F.create_dynamic_map(signed=True, total_bits=7).float()
    bounds = cpu8bit.code_bounds(code)
    assert int((bounds == 0).sum()) > 1
    with pytest.raises(ValueError, match="midpoints equal to 0"):
        cpu8bit.code_table(bounds)
    values = torch.tensor([1e-30, -1e-30, 0.0, -0.0, 0.3, -0.3, 1.0])
    codes, _ = cpu8bit.quantize_blockwise(values, code)
    want, _ = _reference_encode(values, code)
    assert torch.equal(codes, want)


def _sized_jobs(sizes: tuple[int, ...], dtype: torch.dtype, seed: int, extreme: bool) -> Any:
    """8-bit jobs of the given sizes (AdamW, float32 grads with NaN/Inf/±0/denormals);
    ``extreme``: absmax near float32's largest (exp_avg) and smallest (exp_avg_sq)."""
    from optladder.optimizers.kernels import cpu8bit

    gen = torch.Generator().manual_seed(seed)
    q1, q2 = _books()
    b1, b2 = cpu8bit.code_bounds(q1), cpu8bit.code_bounds(q2)
    books = dict(bounds1=b1, bounds2=b2, qmap1=q1, qmap2=q2)
    books.update(table1=cpu8bit.code_table(b1), table2=cpu8bit.code_table(b2))
    jobs = []
    for n in sizes:
        g = _special_values(n, seed + n)
        g[1::17] = 1e-41
        blocks = -(-n // 256)
        if extreme:
            a1, a2 = torch.full((blocks,), 3e38), torch.full((blocks,), 1e-45)
        else:
            a1, a2 = torch.rand(blocks, generator=gen), torch.rand(blocks, generator=gen)
        jobs.append(
            cpu8bit.Job(
                param=torch.randn(n, generator=gen).to(dtype),
                grad=g,
                state1=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
                state2=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
                absmax1=a1,
                absmax2=a2,
                step=2,
                lr=1e-2,
                betas=(0.9, 0.99),
                eps=1e-8,
                weight_decay=0.1,
                **books,
            )
        )
    return jobs


def _state_bits(jobs: Any) -> list[torch.Tensor]:
    return [
        getattr(j, name).view(torch.uint8).clone()
        for j in jobs
        for name in ("param", "state1", "state2", "absmax1", "absmax2")
    ]


@pytest.mark.parametrize("extreme", [False, True], ids=["absmax", "extreme-absmax"])
def test_the_simd_path_writes_the_scalar_bits_at_lane_and_block_edges(extreme: bool) -> None:
    """Sizes on either side of the SIMD width (8 lanes on AVX2, 16 on AVX-512) and of the
    256-element block, so every tail length of the lane loops runs: the SIMD path writes
    the scalar loops' bits (params, codes, absmax), also with absmax near float32's
    largest and smallest values."""
    from optladder.optimizers.kernels import cpu8bit

    if not cpu8bit.simd_available():
        pytest.skip("no AVX-512 nor AVX2+FMA+F16C: the 8-bit kernel runs its scalar loops only")
    sizes = (1, 7, 8, 9, 15, 17, 255, 256, 257, 263, 4095, 4097)
    for dtype in (torch.float32, torch.bfloat16):
        runs = []
        for simd in (False, True):
            jobs = _sized_jobs(sizes, dtype, 4, extreme)
            for _ in range(2):
                cpu8bit.run_table(cpu8bit.prepare_table(jobs), simd=simd)
            runs.append(_state_bits(jobs))
        for k, (a, b) in enumerate(zip(*runs)):
            assert torch.equal(a, b), (dtype, sizes[k // 5], k % 5)


@pytest.mark.parametrize("coupled", [False, True], ids=["adamw", "adam"])
def test_every_simd_level_the_cpu_has_writes_the_scalar_loops_bits(coupled: bool) -> None:
    """Each SIMD path the CPU runs, not only its best (on an AVX-512 CPU the AVX2 path
    too, by the ``simd`` level): the scalar loops' bits for steps (params, codes,
    absmax, float32 state; several dtype pairs, NaN grads, sizes at lane and block
    edges) and for ``quantize_blockwise`` with the start table."""
    from optladder.optimizers.kernels import cpu8bit

    best = cpu8bit.simd_level()
    if best == cpu8bit.SIMD_SCALAR:
        pytest.skip("no AVX-512 nor AVX2+FMA+F16C: the 8-bit kernel runs its scalar loops only")
    pairs = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
    pairs += [(torch.float16, torch.float32)]
    values = _special_values(256 * 9 + 5, 8)
    q1, _ = _books()
    table = cpu8bit.code_table(cpu8bit.code_bounds(q1))
    want_codes = cpu8bit.quantize_blockwise(values, q1, start_table=table, simd=False)
    sizes = (1, 15, 17, 255, 256, 257, 4097)
    for level in range(cpu8bit.SIMD_AVX2, best + 1):
        for dtype, grad_dtype in pairs:
            runs = []
            for simd in (cpu8bit.SIMD_SCALAR, level):
                jobs = _kernel_jobs(dtype, grad_dtype, 1, coupled)
                cpu8bit.run_table(cpu8bit.prepare_table(jobs), simd=simd)
                runs.append(_state_bits(j for j in jobs if j.absmax1 is not None))
                last = jobs[-1]  # float32 state
                runs[-1] += [t.view(torch.uint8) for t in (last.param, last.state1, last.state2)]
            for a, b in zip(*runs):
                assert torch.equal(a, b), (level, dtype, grad_dtype)
        runs = []
        for simd in (cpu8bit.SIMD_SCALAR, level):
            jobs = _sized_jobs(sizes, torch.float32, 9, False)
            for _ in range(2):
                cpu8bit.run_table(cpu8bit.prepare_table(jobs), simd=simd)
            runs.append(_state_bits(jobs))
        for a, b in zip(*runs):
            assert torch.equal(a, b), level
        got = cpu8bit.quantize_blockwise(values, q1, start_table=table, simd=level)
        assert torch.equal(got[0], want_codes[0]), level
        assert torch.equal(got[1].view(torch.int32), want_codes[1].view(torch.int32)), level


@pytest.mark.parametrize(
    "case", ["negative-nan", "negative-absmax2", "beta2-minus-zero", "signed-book2"]
)
def test_the_simd_path_writes_the_scalar_bits_where_exp_avg_sq_has_a_sign(case: str) -> None:
    """The AVX-512 path encodes ``exp_avg_sq`` without its negative side's slots where
    every value is >= +0 or a NaN (beta2, 1 - beta2 and the book's codes with the sign
    bit clear, the block's absmax2 too): still the scalar loops' bits with grads whose
    NaNs carry the sign bit (the x86 default NaN, e.g. of inf - inf), with blocks whose
    absmax2 is negative (a state edited by hand), with beta2 = -0.0 and with a signed
    book for ``exp_avg_sq`` (the last three take the general encode)."""
    from optladder.optimizers.kernels import cpu8bit

    if not cpu8bit.simd_available():
        pytest.skip("no AVX-512 nor AVX2+FMA+F16C: the 8-bit kernel runs its scalar loops only")
    q1, q2 = _books()
    if case == "signed-book2":
        q2 = q1
    b1, b2 = cpu8bit.code_bounds(q1), cpu8bit.code_bounds(q2)
    books = dict(bounds1=b1, bounds2=b2, qmap1=q1, qmap2=q2)
    books.update(table1=cpu8bit.code_table(b1), table2=cpu8bit.code_table(b2))
    n, blocks = 256 * 12, 12
    runs = []
    for simd in (False, True):
        gen = torch.Generator().manual_seed(3)
        g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 8
        neg_nan = torch.tensor(-0x400000, dtype=torch.int32).view(torch.float32)  # 0xFFC00000
        g[256 + 2 : 512 : 37] = neg_nan  # in blocks 1 and 5 only: the others keep a finite
        g[5 * 256 + 7] = neg_nan  # absmax2, whose codes a NaN would wipe out
        g[3 * 256 : 4 * 256 : 11] = 0.0
        g[3 * 256 + 5 : 4 * 256 : 13] = -0.0
        g[7 * 256 + 9] = -float("inf")
        absmax2 = torch.rand(blocks, generator=gen)
        if case == "negative-absmax2":
            absmax2[::2] = -absmax2[::2]
        job = cpu8bit.Job(
            param=torch.randn(n, generator=gen),
            grad=g,
            state1=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
            state2=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
            absmax1=torch.rand(blocks, generator=gen),
            absmax2=absmax2,
            step=2,
            lr=1e-2,
            betas=(0.9, -0.0 if case == "beta2-minus-zero" else 0.99),
            eps=1e-8,
            weight_decay=0.1,
            **books,
        )
        bits = []
        for _ in range(2):
            cpu8bit.run_table(cpu8bit.prepare_table([job]), simd=simd)
            bits += _state_bits([job])
        runs.append(bits)
    assert not bool(runs[0][4].view(torch.float32).isnan().all())  # absmax2 after step 1
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b), case


def test_one_and_two_threads_write_the_same_bits() -> None:
    """A step split into several work items (a 300,000-element param: three items of up
    to 512 blocks) on one thread and on two, and ``quantize_blockwise`` under
    ``torch.set_num_threads(1)`` and ``(2)``: the same bits (each block is written by one
    thread, from its own inputs only)."""
    from optladder.optimizers.kernels import cpu8bit

    runs = []
    for threads in (1, 2):
        jobs = _sized_jobs((300_000, 4097, 1), torch.bfloat16, 5, False)
        table = cpu8bit.prepare_table(jobs, num_threads=threads)
        assert (table.threads, table.n_items) == (threads, 5)
        cpu8bit.run_table(table)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            values = torch.randn(300_000, generator=torch.Generator().manual_seed(6))
            codes = cpu8bit.quantize_blockwise(values, jobs[0].qmap1)
        finally:
            torch.set_num_threads(old)
        runs.append([*_state_bits(jobs), codes[0], codes[1].view(torch.uint8)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_the_prebuild_command_builds_both_cpu_kernels() -> None:
    """``python -m optladder.optimizers.kernels`` (README) builds or verifies the bf16 and
    the 8-bit kernels' libraries and prints their paths: the ones this process loads from
    the same cache, each a file of its own stem."""
    import subprocess
    import sys

    from optladder.optimizers.kernels import cpu, cpu8bit

    out = subprocess.run(
        [sys.executable, "-m", "optladder.optimizers.kernels"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "RuntimeWarning" not in out.stderr
    printed = out.stdout.split()
    assert printed == [str(cpu.build()), str(cpu8bit.build())]
    assert printed[0].split("/")[-1].startswith("adamw_bf16_")
    assert printed[1].split("/")[-1].startswith("adamw8bit_")


def test_a_numpy_eps_steps_float32_state_as_the_same_python_float() -> None:
    """A group's ``eps`` set as a numpy float32 (validation takes it) is the number it
    holds: the kept table's later steps write float32 state's ``eps * sqrt(1 -
    beta2**step)`` in float64 then round it once, as the first step's full table does
    (numpy's float32 product would round twice: other bits at steps 3, 4, 8, 9, 12).
    Params, grads and eps are tiny so the eps term sets the update's bits."""
    np = pytest.importorskip("numpy")
    eps = np.float32(1e-8)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) * 1e-9 for n in (100, 64)]  # float32 state
    grads = [[torch.randn(p.shape, generator=gen) * 1e-14 for p in start] for _ in range(12)]
    finals = []
    for value in (eps, float(eps)):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = _engine([{"params": params[:1]}, {"params": params[1:], "lr": 3e-3}], lr=1e-2)
        for group in opt.param_groups:
            group["eps"] = value
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        assert _eight(opt)._kernel_plan is not None  # the later steps took the kept table
        assert all(opt.state[p]["state1"].dtype == torch.float32 for p in params)
        finals.append([p.detach().clone() for p in params])
    for a, b in zip(*finals):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", ["state1", "state2", "absmax1", "absmax2", "qmap1"])
@pytest.mark.parametrize("how", ["data", "replace"])
def test_state_moved_to_other_memory_between_steps_is_stepped_there(name: str, how: str) -> None:
    """A state tensor given a copy of its memory (``.data = clone``, the same tensor) or
    replaced by a copy (a new tensor in the same state dict) holds the same values: the
    steps after must give the bits of a run where nothing moved, so the kept table must
    point at the new memory (it stepped the old one: kept alive here so the wrong result
    shows without writing freed memory)."""
    results = []
    for move in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (1_000, 5_000)]
        opt = _engine(params, lr=1e-2)
        old = []
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if move and step == 2:
                for p in params:
                    state = opt.state[p]
                    if name not in state:  # absmax and qmap: 8-bit state only
                        continue
                    old.append(state[name].data)
                    if how == "data":
                        state[name].data = state[name].data.clone()
                    else:
                        state[name] = state[name].clone()
            opt.step()
        assert _eight(opt)._kernel_plan is not None and opt.eager_reasons == {}
        results.append(
            [p.detach().clone() for p in params]
            + [opt.state[p][k].clone() for p in params for k in ("state1", "state2")]
            + [opt.state[params[1]][k].clone() for k in ("absmax1", "absmax2")]
        )
    for k, (a, b) in enumerate(zip(*results, strict=True)):
        assert torch.equal(a, b), k


# which params have a grad at each step: param 5 gets its first grad at step 1 (its state
# is made then: the table is made again, keeping the rows of params without a grad);
# step 5 has no grad at all; param 2 (300 elements) and 4 (70) keep float32 state
_SKIP_SIZES = (1_000, 5_000, 300, 20_000, 70, 4_097)
_SKIP_SCHEDULE = [
    {0, 1, 2, 3, 4},
    {0, 2, 3, 5},
    {1, 4},
    {0, 1, 2, 3, 4, 5},
    {3},
    set(),
    {0, 5},
    {1, 2, 3, 4},
    {0, 1, 2, 3, 4, 5},
]
_SKIP_GROUPS = (
    {"lr": 2e-3, "weight_decay": 0.1},
    {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.8, 0.99), "eps": 1e-6},
)


def _skip_grads(step: int) -> list[torch.Tensor]:
    """Step ``step``'s grads (every param's; those the schedule leaves out are unused),
    multiples of 2**-20 so that a grad scale of 64 divides them exactly."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [
        (torch.randn(n, generator=gen) * 2**10).round() * 2**-20 * (1 + k)
        for k, n in enumerate(_SKIP_SIZES)
    ]


def _skip_reference(coupled: bool) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Each param of the schedule stepped alone (its own engine, a one-row table made
    afresh whenever it steps) at the steps where it has a grad: its final value and
    state."""
    gen = torch.Generator().manual_seed(0)
    starts = [torch.randn(n, generator=gen) for n in _SKIP_SIZES]
    finals, states = [], []
    for k, start in enumerate(starts):
        q = torch.nn.Parameter(start.clone())
        opt = _engine(
            [{"params": [q], **_SKIP_GROUPS[k % 2]}], lr=1e-3, coupled_weight_decay=coupled
        )
        for s, having in enumerate(_SKIP_SCHEDULE):
            if k in having:
                q.grad = _skip_grads(s)[k]
                opt.step()
                _eight(opt)._kernel_plan = None  # a full table at every step
        finals.append(q.detach())
        states.append(opt.state[q])
    return finals, states


@pytest.mark.parametrize("coupled", [False, True], ids=["adamw", "adam"])
def test_params_without_a_grad_at_some_steps_keep_the_table_and_step_as_if_alone(
    coupled: bool,
) -> None:
    """Params that have a grad at some steps only (experts, a task's head; param 5 gets
    its first one at step 1): the engine keeps its kernel table (a step where the set of
    params with a grad changed made the whole table again: ~6x the step's host time
    over 20,000 params with 1% of them missing a grad), its rows without a grad are
    skipped, and every param ends bit for bit as when stepped alone at the steps where
    it had a grad (its own step count in its bias correction), with that step count.
    Two groups alternate (param k in group k % 2), so runs of one group hold 8-bit and
    float32 state and rows of several step counts."""
    ref, ref_states = _skip_reference(coupled)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in _SKIP_SIZES]
    groups = [
        {"params": [p for k, p in enumerate(params) if k % 2 == g], **_SKIP_GROUPS[g]}
        for g in (0, 1)
    ]
    opt = _engine(groups, lr=1e-3, coupled_weight_decay=coupled)
    plans = []
    for s, having in enumerate(_SKIP_SCHEDULE):
        grads = _skip_grads(s)
        for k, p in enumerate(params):
            p.grad = grads[k] if k in having else None
        opt.step()
        plans.append(_eight(opt)._kernel_plan)
    assert opt.eager_reasons == {}
    assert plans[1] is not None and all(plan is plans[1] for plan in plans[1:])
    counts = [sum(k in having for having in _SKIP_SCHEDULE) for k in range(len(_SKIP_SIZES))]
    assert [opt.state[p]["step"] for p in params] == counts
    assert {opt.state[p]["state1"].dtype for p in params} == {torch.uint8, torch.float32}
    for k, (p, q, want) in enumerate(zip(params, ref, ref_states, strict=True)):
        assert torch.equal(p.detach().view(torch.int32), q.view(torch.int32)), k
        st = opt.state[p]
        assert st["step"] == want["step"] == counts[k]
        for name in ("state1", "state2", "absmax1", "absmax2"):
            if name in want:
                a, b = st[name], want[name]
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (k, name)


def test_params_without_a_grad_through_grad_scale_and_found_inf() -> None:
    """The 8bit rung of the optladder optimizer, with grad_scale and found_inf set on it
    (as torch.amp.GradScaler sets them on fused optimizers) and params missing a grad at
    some steps: grads scaled by 64 and divided back before the commit, a step with an
    overflow (found_inf 1) changes nothing; every param ends as stepped alone on the
    unscaled grads at the steps where it had one."""
    import optladder

    ref, ref_states = _skip_reference(coupled=False)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in _SKIP_SIZES]
    groups = [
        {"params": [p for k, p in enumerate(params) if k % 2 == g], **_SKIP_GROUPS[g]}
        for g in (0, 1)
    ]
    opt = optladder.choose_optimizer(groups, lr=1e-3, rung="8bit", free_memory="1TiB", environ={})
    plans = []
    for s, having in enumerate(_SKIP_SCHEDULE):
        for overflow in (True, False) if s in (2, 6) else (False,):
            grads = _skip_grads(s)
            for k, p in enumerate(params):
                p.grad = grads[k] * 64 if k in having else None
            opt.grad_scale = torch.tensor(64.0)  # type: ignore[attr-defined]
            opt.found_inf = torch.tensor(1.0 if overflow else 0.0)  # type: ignore[attr-defined]
            opt.step()
            assert opt.last_step_skipped == overflow
        plans.append(opt.engine.eightbit_groups()._kernel_plan)  # type: ignore[attr-defined]
    assert plans[1] is not None and all(plan is plans[1] for plan in plans[1:])
    state = opt.engine.state  # type: ignore[attr-defined]
    for k, (p, q, want) in enumerate(zip(params, ref, ref_states, strict=True)):
        assert torch.equal(p.detach().view(torch.int32), q.view(torch.int32)), k
        assert state[p]["step"] == want["step"]
        for name in ("state1", "state2", "absmax1", "absmax2"):
            if name in want:
                assert torch.equal(state[p][name].view(torch.uint8), want[name].view(torch.uint8))


def _eight(opt: Any) -> Any:
    """What holds the kept kernel table: LadderAdamW's 8bit groups."""
    return opt.eightbit_groups()


def test_a_state_cleared_between_steps_on_the_kept_table_starts_afresh() -> None:
    """While nothing changes, a step on the kept kernel table skips the per-param pass
    (state creation, the refusal of foreign state). A param's state dict emptied in
    place between steps (the dicts stay the same objects) is still seen: the param
    starts afresh, as on a full table made at every step (the twin, whose per-param
    pass runs at every step), bit for bit, and the other params' steps go on."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(n, generator=gen) for n in SIZES]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    twins = [torch.nn.Parameter(t.clone()) for t in start]
    opt, full = (_engine([{"params": ps, "lr": 1e-2}]) for ps in (params, twins))
    for step in range(5):
        for p, q, g in zip(params, twins, _grads(params, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 3:
            opt.state[params[0]].clear()
            full.state[twins[0]].clear()
        _eight(full)._kernel_plan = None  # the twin makes a full table at every step
        opt.step()
        full.step()
        assert _eight(opt)._kernel_plan is not None
    assert [opt.state[p]["step"] for p in params] == [2, 5, 5]
    for k, (p, q) in enumerate(zip(params, twins, strict=True)):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32)), k
        for name, value in opt.state[p].items():
            want = full.state[q][name]
            assert (value == want) if name == "step" else torch.equal(value, want), (k, name)


def test_a_step_count_lost_between_steps_on_the_kept_table_is_refused() -> None:
    """A param's ``step`` deleted from its state between steps on the kept kernel table
    (the per-param pass, which refuses state that is not AdamW8bit's, is skipped while
    nothing changes): the step is refused naming the param, as on a full table, and
    changes no param and no other state."""
    from optladder.optimizers.adamw import LadderAdamW

    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    opt = LadderAdamW([{"params": params, "rung": "8bit", "lr": 1e-2}])
    for step in range(3):
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g
        opt.step()
    assert opt.eightbit_groups()._kernel_plan is not None
    del opt.state[params[1]]["step"]
    before = [p.detach().clone() for p in params]
    states = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params
    ]
    with pytest.raises(ValueError, match=r"param 1 of param group 0 \(8bit\) holds state"):
        opt.step()
    for k, p in enumerate(params):
        assert torch.equal(p.detach(), before[k]), k
        assert opt.state[p].keys() == states[k].keys(), k
        for name, value in opt.state[p].items():
            want = states[k][name]
            assert (value == want) if name == "step" else torch.equal(value, want), (k, name)


def test_book_tables_are_the_books_own_tables_shared_by_content() -> None:
    """cpu8bit.book_tables gives what code_bounds and code_table compute for that book,
    the same tensors for an equal book (another tensor), other tables for another book,
    and tells a book holding -0.0 from one holding +0.0 (equal as floats, not as bits)."""
    from bitsandbytes import functional as F

    from optladder.optimizers.kernels import cpu8bit

    signed = F.create_dynamic_map(signed=True)
    unsigned = F.create_dynamic_map(signed=False)
    for book in (signed, unsigned):
        edges, table = cpu8bit.book_tables(book)
        want = cpu8bit.code_bounds(book)
        assert torch.equal(edges.view(torch.int32), want.view(torch.int32))
        assert torch.equal(table, cpu8bit.code_table(want))
        again = cpu8bit.book_tables(book.clone())
        assert again[0] is edges and again[1] is table
    assert not torch.equal(cpu8bit.book_tables(signed)[1], cpu8bit.book_tables(unsigned)[1])
    plus = torch.linspace(-1, 1, 256)
    plus[128] = 0.0
    minus = plus.clone()
    minus[128] = -0.0
    assert cpu8bit.book_tables(plus)[0] is not cpu8bit.book_tables(minus)[0]
    with pytest.raises(ValueError, match=r"256 float32 values on the CPU, got torch\.float64"):
        cpu8bit.book_tables(signed.double())
