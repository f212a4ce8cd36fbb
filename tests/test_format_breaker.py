"""Attempts to break :class:`LadderAdamW`'s per-group state formats (``"rung"``: ``"fp32"``
/ ``"bf16"``) and the fp32 format's params on torch's kernels, on engines made by hand
with groups of both formats.

The references are torch's own optimizers (``torch.optim.AdamW``/``Adam`` with
``fused=True`` for real params, ``foreach=True`` for complex ones), the eager oracle
``LadderAdamW._step_param``, and, for a step that raises, the engine as it was before
it (a deep copy of its params and ``state_dict()``): a refused or failed step changes
nothing, step counts included.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memtools import FailNthAllocation
from optladder.optimizers.adamw import LadderAdamW
from snapshots import same_bits

Snap = tuple[list[torch.Tensor], dict[Any, Any]]


def _param(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dtype.is_complex:
        t = torch.complex(t, torch.randn(shape, generator=gen, dtype=torch.float64))
    return torch.nn.Parameter(t.to(dtype))


def _channels_last(seed: int) -> torch.nn.Parameter:
    t = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(seed))
    return torch.nn.Parameter(t.contiguous(memory_format=torch.channels_last))


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if p.is_complex():
            g = torch.complex(g, torch.randn(p.shape, generator=gen, dtype=torch.float64))
        out.append(torch.empty_like(p).copy_(g.to(p.dtype)))  # laid out like the param
    return out


def _set_grads(*lists: list[torch.Tensor], step: int) -> None:
    """The same grads (of step ``step``) for each list of params, each its own copy."""
    grads = _grads(lists[0], step)
    for params in lists:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()


def _assert_like_torch(
    opt: LadderAdamW, ref: torch.optim.Optimizer, got: list[Any], want: list[Any]
) -> None:
    for a, b in zip(got, want, strict=True):
        assert same_bits(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert same_bits(opt.state[a][name], ref.state[b][name]), name
        assert float(opt.state[a]["step"]) == float(ref.state[b]["step"])


def _snap(opt: LadderAdamW, params: list[torch.Tensor]) -> Snap:
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def _assert_unchanged(before: Snap, opt: LadderAdamW, params: list[torch.Tensor]) -> None:
    after = _snap(opt, params)
    for a, b in zip(before[0], after[0], strict=True):
        assert same_bits(a, b)
    assert before[1]["state"].keys() == after[1]["state"].keys()
    for k, st in before[1]["state"].items():
        assert st.keys() == after[1]["state"][k].keys()
        for name, value in st.items():
            assert same_bits(value, after[1]["state"][k][name]), (k, name)


def _mixed(seed: int) -> tuple[LadderAdamW, list[torch.nn.Parameter]]:
    """An engine of three groups: fp32 (float32, float64, complex64, channels_last, a
    column slice: torch's fused and foreach kernels), bf16, and fp32 again (a float16
    param on optladder's kernels beside a float32 one); the engine's default bf16."""
    fp32 = [
        _param(seed, 6, 4),
        _param(seed + 1, 5, dtype=torch.float64),
        _param(seed + 2, 3, dtype=torch.complex64),
        _channels_last(seed + 3),
        torch.nn.Parameter(_param(seed + 4, 6, 10).detach()[:, ::2]),
    ]
    bf16 = [_param(seed + 5, 7, dtype=torch.bfloat16), _param(seed + 6, 4)]
    more = [_param(seed + 7, 9), _param(seed + 8, 3, dtype=torch.float16)]
    opt = LadderAdamW(
        [
            {"params": fp32, "rung": "fp32", "weight_decay": 0.1},
            {"params": bf16, "rung": "bf16"},
            {"params": more, "rung": "fp32", "lr": 3e-3},
        ],
        lr=1e-2,
        seed=3,
    )
    return opt, fp32 + bf16 + more


# --- faults found (each test failed before its fix) ---------------------------------


def test_amsgrad_is_refused_not_ignored() -> None:
    """A group with ``amsgrad=True`` (torch's key) was stepped without
    ``max_exp_avg_sq``: neither torch's AdamW(amsgrad=True) nor a refusal. Refused now,
    naming the key, nothing changed."""
    p = _param(0, 5)
    opt = LadderAdamW([{"params": [p], "rung": "fp32", "amsgrad": True}], lr=1e-2)
    p.grad = _grads([p], 0)[0]
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"param group 0: amsgrad=True is not supported"):
        opt.step()
    assert same_bits(p, before) and len(opt.state) == 0
    opt.param_groups[0]["amsgrad"] = False  # then it steps as torch's AdamW
    q = torch.nn.Parameter(before.clone())
    ref = torch.optim.AdamW([q], lr=1e-2, fused=True)
    q.grad = p.grad.clone()
    opt.step()
    ref.step()
    _assert_like_torch(opt, ref, [p], [q])


def test_a_torch_adamw_checkpoint_loads_into_the_fp32_format_and_continues_bit_for_bit() -> None:
    """torch's AdamW saves no ``rung``, ``seed`` nor ``rounding``: its checkpoint dropped
    the live group's ``"rung": "fp32"`` (the group fell to the engine's bf16 default)
    and the next step raised KeyError 'rounding'. Keys a checkpoint lacks keep the live
    group's values now."""
    want = [_param(1, 6, 4), _param(2, 5, dtype=torch.float64), _channels_last(3)]
    got = [torch.nn.Parameter(p.detach().clone()) for p in want]
    ref = torch.optim.AdamW(want, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(2):
        _set_grads(want, step=step)
        ref.step()
    with torch.no_grad():
        for a, b in zip(got, want, strict=True):
            a.copy_(b)
    opt = LadderAdamW([{"params": got, "rung": "fp32", "weight_decay": 0.1}], lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["rung"] == "fp32"
    for step in range(2, 4):
        _set_grads(got, want, step=step)
        opt.step()
        ref.step()
    assert opt.eager_reasons == {}
    _assert_like_torch(opt, ref, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=["fused", "foreach"])
def test_moments_of_another_format_put_back_by_hand_are_refused_and_nothing_changes(
    dtype: torch.dtype,
) -> None:
    """The fp32 format's float32 (complex) param whose moments were replaced by bfloat16
    ones (complex64 ones) after a step: the kept plan handed them to torch's kernel,
    which raised after it had bumped the step count (a step lost). Refused now before
    anything is written, naming the param."""
    p = _param(4, 8, dtype=dtype)
    opt = LadderAdamW([{"params": [p], "rung": "fp32"}], lr=1e-2)
    p.grad = _grads([p], 0)[0]
    opt.step()
    st = opt.state[p]
    other = torch.bfloat16 if dtype == torch.float32 else torch.complex128
    for name in ("exp_avg", "exp_avg_sq"):
        st[name] = st[name].to(other)
    p.grad = _grads([p], 1)[0]
    before = _snap(opt, [p])
    with pytest.raises(ValueError, match=r"param 0 holds exp_avg"):
        opt.step()
    _assert_unchanged(before, opt, [p])
    assert float(st["step"]) == 1.0


@pytest.mark.parametrize("same_grad", [True, False], ids=["same-grad", "new-grad"])
@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_grad_whose_data_changed_is_refused_and_nothing_changes(
    change: str, same_grad: bool
) -> None:
    """A grad of a kept plan's torch route given other data (``grad.data = ...``) of
    another dtype (or shape), the grad of the last step or a new one: the kept plan
    stepped the other groups and then torch's kernel raised (or, of another shape, read
    the wrong elements without a word). Refused now before anything is written."""
    opt, params = _mixed(10)
    _set_grads(params, step=0)
    opt.step()
    if not same_grad:
        _set_grads(params, step=1)
    grad = params[-2].grad
    assert grad is not None
    if change == "dtype":
        grad.data = torch.randn(9, dtype=torch.float64)
    else:
        grad.data = torch.randn(10)
    before = _snap(opt, params)
    with pytest.raises(ValueError, match=r"param 7 has a torch\.float\d+ grad of shape"):
        opt.step()
    _assert_unchanged(before, opt, params)


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "grad_scale"])
def test_an_oom_at_any_allocation_of_a_mixed_step_changes_nothing(amp: bool) -> None:
    """An OOM at each allocation of a step (the first, which makes the state, and a
    later one), one per run: nothing changed. torch's foreach AdamW (the complex
    param's) allocates as it steps: it ran after the fused kernel and the C kernel had
    written, so an OOM there left half a step. After the faults, two clean steps equal
    torch's AdamW (fused for the real params, foreach for the complex one)."""
    for which in (0, 1):
        n = 1
        while True:
            opt, params = _mixed(20)
            for step in range(which):
                _set_grads(params, step=step)
                opt.step()
            _set_grads(params, step=which)
            if amp:
                opt.grad_scale = torch.tensor(2.0)  # type: ignore[attr-defined]
                opt.found_inf = torch.tensor(0.0)  # type: ignore[attr-defined]
            before = _snap(opt, params)
            fault = FailNthAllocation(n)
            try:
                with fault:
                    opt.step()
            except torch.OutOfMemoryError:
                _assert_unchanged(before, opt, params)
                n += 1
                continue
            break
        assert n > 2  # some allocation was failed

    opt, params = _mixed(20)
    _set_grads(params, step=0)
    with pytest.raises(torch.OutOfMemoryError), FailNthAllocation(n - 1):
        opt.step()
    fused = [params[k] for k in (0, 1, 3, 4)]
    complex_ = [params[2]]
    want_fused = [torch.nn.Parameter(p.detach().clone().contiguous()) for p in fused]
    want_complex = [torch.nn.Parameter(p.detach().clone()) for p in complex_]
    ref_fused = torch.optim.AdamW(want_fused, lr=1e-2, weight_decay=0.1, fused=True)
    ref_complex = torch.optim.AdamW(want_complex, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(2):
        _set_grads(params, step=step)
        for p, q in zip(fused + complex_, want_fused + want_complex, strict=True):
            q.grad = p.grad.clone().contiguous()  # type: ignore[union-attr]
        opt.step()
        ref_fused.step()
        ref_complex.step()
    _assert_like_torch(opt, ref_fused, fused, want_fused)
    _assert_like_torch(opt, ref_complex, complex_, want_complex)


def test_a_flip_to_bf16_of_a_channels_last_param_steps_as_the_oracle() -> None:
    """The fp32 format keeps a channels_last param's moments laid out like it (torch's
    layout); flipped to bf16 (moments converted with ``.to``, as the formats' tests do),
    the step raised in the commit (the eager path views moments flat). The moments are
    made contiguous when planned now, and the step is the eager oracle's."""
    p = _channels_last(30)
    opt = LadderAdamW([{"params": [p], "rung": "fp32"}], lr=1e-2, seed=5)
    for step in range(2):
        p.grad = _grads([p], step)[0]
        opt.step()
    opt.param_groups[0]["rung"] = "bf16"
    st = opt.state[p]
    for name in ("exp_avg", "exp_avg_sq"):
        st[name] = st[name].to(torch.bfloat16)
    q = torch.nn.Parameter(p.detach().clone())
    oracle = LadderAdamW([{"params": [q], "rung": "bf16"}], lr=1e-2, seed=5)
    oracle.state[q] = {k: v.clone().contiguous() for k, v in st.items()}
    for step in range(2, 4):
        p.grad = _grads([p], step)[0]
        q.grad = p.grad.clone()
        opt.step()
        with torch.no_grad():
            oracle._step_param(q, oracle.param_groups[0], 0)
    assert same_bits(p, q)
    for name in ("exp_avg", "exp_avg_sq"):
        assert same_bits(st[name], oracle.state[q][name].contiguous())
    assert float(st["step"]) == float(oracle.state[q]["step"]) == 4.0


# --- what held (passed before the fixes too) ----------------------------------------


def test_steps_without_some_grads_changed_lrs_and_a_tensor_lr_step_as_torch_fused() -> None:
    got = [_param(40, 5), _param(41, 7), _param(42, 3, dtype=torch.float64), _param(43, 0)]
    want = [torch.nn.Parameter(p.detach().clone()) for p in got]
    opt = LadderAdamW([{"params": got, "rung": "fp32", "weight_decay": 0.1}], lr=1e-2)
    ref = torch.optim.AdamW(want, lr=1e-2, weight_decay=0.1, fused=True)
    lrs: list[Any] = [1e-2, torch.tensor(3e-3), 5e-2, torch.tensor(1e-3), 2e-2]
    for step in range(5):
        _set_grads(got, want, step=step)
        for k in {1: [1], 2: [0], 3: [1, 2]}.get(step, []):
            got[k].grad = want[k].grad = None
        opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = lrs[step]
        opt.step()
        ref.step()
    _assert_like_torch(opt, ref, got, want)


def test_a_flip_fp32_bf16_fp32_then_steps_as_torch_fused_from_the_converted_state() -> None:
    p = _param(50, 6, 4)
    other = _param(51, 3)
    opt = LadderAdamW([{"params": [p], "rung": "fp32"}, {"params": [other], "rung": "bf16"}])
    for step, rung in enumerate(["fp32", "fp32", "bf16", "fp32"]):
        if opt.param_groups[0]["rung"] != rung:
            opt.param_groups[0]["rung"] = rung
            dtype = torch.float32 if rung == "fp32" else torch.bfloat16
            for name in ("exp_avg", "exp_avg_sq"):
                opt.state[p][name] = opt.state[p][name].to(dtype)
        p.grad, other.grad = _grads([p, other], step)
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.AdamW([q], fused=True)
    ref.state[q] = {k: v.clone().to(torch.float32) for k, v in opt.state[p].items()}
    for step in range(4, 6):
        p.grad = _grads([p], step)[0]
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    _assert_like_torch(opt, ref, [p], [q])
    assert float(opt.state[p]["step"]) == 6.0


def test_a_fp32_format_state_dict_loads_into_torch_adamw_and_continues_bit_for_bit() -> None:
    got = [_param(60, 6, 4), _param(61, 5, dtype=torch.float64), _channels_last(62)]
    opt = LadderAdamW([{"params": got, "rung": "fp32", "weight_decay": 0.1}], lr=1e-2)
    for step in range(2):
        _set_grads(got, step=step)
        opt.step()
    want = [torch.nn.Parameter(p.detach().clone()) for p in got]
    ref = torch.optim.AdamW(want, lr=1e-2, weight_decay=0.1, fused=True)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref.param_groups[0]["fused"] = True  # torch's load takes the saved group's (none)
    for step in range(2, 4):
        _set_grads(got, want, step=step)
        opt.step()
        ref.step()
    _assert_like_torch(opt, ref, got, want)


def test_a_mixed_engine_round_trips_its_state_dict() -> None:
    """A mixed engine's state_dict loaded into a fresh one: both continue alike, and the
    fp32 group's params continue as torch's fused AdamW from the same state."""
    opt, params = _mixed(70)
    for step in range(2):
        _set_grads(params, step=step)
        opt.step()
    twin, twin_params = _mixed(70)
    with torch.no_grad():
        for a, b in zip(params, twin_params, strict=True):
            b.copy_(a)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    fused = [params[k] for k in (0, 1, 3)]
    want = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    ref = torch.optim.AdamW(want, lr=1e-2, weight_decay=0.1, fused=True)
    for p, q in zip(fused, want, strict=True):
        ref.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
    for step in range(2, 4):
        _set_grads(params, twin_params, step=step)
        for p, q in zip(fused, want, strict=True):
            q.grad = p.grad.clone()  # type: ignore[union-attr]
        opt.step()
        twin.step()
        ref.step()
    _assert_like_torch(opt, ref, fused, want)
    for a, b in zip(params, twin_params, strict=True):
        assert same_bits(a, b)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(opt.state[a][name], twin.state[b][name])


def test_hooks_run_once_per_step_of_a_mixed_engine() -> None:
    opt, params = _mixed(80)
    events: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: events.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: events.append("global post")),
        opt.register_step_pre_hook(lambda o, a, k: events.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: events.append("post")),
        opt.register_state_dict_pre_hook(lambda o: events.append("save pre")),
        opt.register_state_dict_post_hook(lambda o, sd: events.append("save post")),
        opt.register_load_state_dict_pre_hook(lambda o, sd: events.append("load pre")),
        opt.register_load_state_dict_post_hook(lambda o: events.append("load post")),
    ]
    try:
        for step in range(2):
            _set_grads(params, step=step)
            opt.step()
        opt.load_state_dict(opt.state_dict())
    finally:
        for h in handles:
            h.remove()
    step_events = ["global pre", "pre", "post", "global post"]
    assert events == [*step_events, *step_events, "save pre", "save post", "load pre", "load post"]


def test_nan_grads_with_found_inf_change_nothing_and_without_it_step_as_torch() -> None:
    """A NaN in grads of every param of a mixed engine: with ``found_inf`` set (as
    ``torch.amp.GradScaler`` sets it) nothing changes, step counts included; without it,
    the NaN propagates as in torch's AdamW (fused for real params, foreach for complex),
    bit for bit, NaNs included."""
    opt, params = _mixed(90)
    _set_grads(params, step=0)
    opt.step()
    grads = _grads(params, 1)
    for p, g in zip(params, grads, strict=True):
        g[(0,) * g.dim()] = float("nan")
        p.grad = g.clone()
    opt.grad_scale = torch.tensor(1.0)  # type: ignore[attr-defined]
    opt.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
    before = _snap(opt, params)
    opt.step()
    _assert_unchanged(before, opt, params)

    del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]
    fused = [params[k] for k in (0, 1, 3)]
    want = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    want_c = [torch.nn.Parameter(params[2].detach().clone())]
    ref = torch.optim.AdamW(want, lr=1e-2, weight_decay=0.1, fused=True)
    ref_c = torch.optim.AdamW(want_c, lr=1e-2, weight_decay=0.1, foreach=True)
    pairs = [(a, b, ref) for a, b in zip(fused, want)] + [(params[2], want_c[0], ref_c)]
    for p, q, r in pairs:
        r.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
        q.grad = p.grad.clone()  # type: ignore[union-attr]
    opt.step()
    ref.step()
    ref_c.step()

    def bits(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return (torch.view_as_real(t) if t.is_complex() else t).reshape(-1).view(torch.int8)

    for p, q, r in pairs:
        assert bool(p.detach().isnan().any())
        assert torch.equal(bits(p), bits(q))
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(bits(opt.state[p][name]), bits(r.state[q][name]))
        assert float(opt.state[p]["step"]) == float(r.state[q]["step"]) == 2.0


def test_a_compiled_step_of_a_mixed_engine_steps_as_torch_fused_once_per_step() -> None:
    got = [_param(95, 6, 4), _param(96, 5, dtype=torch.float64)]
    want = [torch.nn.Parameter(p.detach().clone()) for p in got]
    other = [_param(97, 7, dtype=torch.bfloat16)]
    opt = LadderAdamW([{"params": got, "rung": "fp32"}, {"params": other, "rung": "bf16"}])
    ref = torch.optim.AdamW(want, fused=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda: opt.step(), backend="aot_eager")
    for step in range(3):
        _set_grads(got, want, step=step)
        other[0].grad = _grads(other, step)[0]
        compiled()
        ref.step()
    _assert_like_torch(opt, ref, got, want)
    assert float(opt.state[other[0]]["step"]) == 3.0


def test_a_new_grad_of_another_dtype_after_a_step_is_refused_and_nothing_changes() -> None:
    """``param.grad_dtype = None`` lets a param take a grad of another dtype: after a
    step, a kept plan let torch's fused kernel raise on it once it had bumped the step
    count (a step lost). Refused now, naming the param, nothing changed."""
    p, q = _param(12, 8), _param(13, 8, dtype=torch.bfloat16)
    opt = LadderAdamW([{"params": [p], "rung": "fp32"}, {"params": [q], "rung": "bf16"}])
    p.grad, q.grad = _grads([p, q], 0)
    opt.step()
    p.grad_dtype = None
    p.grad = _grads([p], 1)[0].to(torch.bfloat16)
    q.grad = _grads([q], 1)[0]
    before = _snap(opt, [p, q])
    with pytest.raises(ValueError, match=r"param 0 has a torch\.bfloat16 grad"):
        opt.step()
    _assert_unchanged(before, opt, [p, q])


@pytest.mark.parametrize(
    "options",
    [
        {"maximize": True, "weight_decay": 0.1, "decoupled_weight_decay": False},
        {"weight_decay": 0.0},
    ],
    ids=["adam-maximize", "no-decay"],
)
def test_complex_params_step_on_copies_as_torch_foreach(options: dict[str, Any]) -> None:
    """The foreach route steps copies and copies them back: bit for bit torch's
    ``Adam``/``AdamW(foreach=True)``, with ``maximize`` and L2 weight decay too."""
    got = [_param(100, 4, 3, dtype=torch.complex64), _param(101, 3, dtype=torch.complex128)]
    want = [torch.nn.Parameter(p.detach().clone()) for p in got]
    decoupled = options.get("decoupled_weight_decay", True)
    torch_options = {k: v for k, v in options.items() if k != "decoupled_weight_decay"}
    opt = LadderAdamW(
        [{"params": got, "rung": "fp32", **torch_options}],
        lr=1e-2,
        decoupled_weight_decay=decoupled,
    )
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = cls(want, lr=1e-2, foreach=True, **torch_options)
    for step in range(3):
        _set_grads(got, want, step=step)
        opt.step()
        ref.step()
    _assert_like_torch(opt, ref, got, want)
