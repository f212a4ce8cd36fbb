"""The 8bit state format of :class:`LadderAdamW`: a group whose ``"rung"`` is ``"8bit"``
keeps bitsandbytes' ``AdamW8bit`` state (uint8 codes with one float32 absmax per
256-element block, float32 moments for params under ``min_8bit_size``) and steps it
(the 8-bit CPU kernel here, bitsandbytes' ops elsewhere) as an optimizer holding only
8bit groups does.

The expected values are those of separate engines over copies of the same groups: a
:class:`LadderAdamW` per fp32/bf16 group set (each param at its index over all groups,
``param_starts``) and one holding only the 8bit groups (its grads unscaled as
:func:`~optladder.optimizers.adamw.unscale_grads_` does, its step skipped on a nonzero
``found_inf``), over 4 steps: params and every state tensor bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from engines import build_engine, eightbit
from optladder.optimizers.adamw import LadderAdamW, unscale_grads_
from optladder.optimizers.migrate import BNB_WRAPPED_KEY
from snapshots import same_bits

pytest.importorskip("bitsandbytes")

# (rung, param (shape, dtype) list, group options)
GROUPS: list[tuple[str, list[tuple[tuple[int, ...], torch.dtype]], dict[str, Any]]] = [
    ("fp32", [((33, 17), torch.bfloat16), ((300,), torch.float32)], {"lr": 3e-2}),
    (
        "8bit",
        [((64, 80), torch.float32), ((100,), torch.float32), ((4099,), torch.bfloat16)],
        {"lr": 1e-2, "weight_decay": 0.1},
    ),
    ("bf16", [((4099,), torch.float32), ((7,), torch.bfloat16)], {"betas": (0.8, 0.99)}),
    ("8bit", [((5000,), torch.float16), ((3, 5), torch.float32)], {"lr": 2e-2, "eps": 1e-6}),
]
NO_GRAD_AT = {(1, 1), (2, 0)}  # (step, flat param index): no grad at that step


def _groups() -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for rung, shapes, options in GROUPS:
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            for shape, dtype in shapes
        ]
        out.append({"params": params, "rung": rung, **options})
    return out


def _copy(group: dict[str, Any]) -> dict[str, Any]:
    params = [torch.nn.Parameter(p.detach().clone()) for p in group["params"]]
    return {**group, "params": params}


def _engines(
    groups: list[dict[str, Any]], decoupled: bool
) -> tuple[LadderAdamW, list[torch.optim.Optimizer], list[torch.nn.Parameter]]:
    """The mixed engine and the separate ones (over copies), and the copies' params in
    the mixed engine's order."""
    mixed = LadderAdamW(groups, decoupled_weight_decay=decoupled)
    starts, start = [], 0
    for group in groups:
        starts.append(start)
        start += len(group["params"])
    copies = [_copy(g) for g in groups]
    ladder = [k for k, g in enumerate(groups) if g["rung"] != "8bit"]
    eight = [k for k, g in enumerate(groups) if g["rung"] == "8bit"]
    single = LadderAdamW([copies[k] for k in ladder], decoupled_weight_decay=decoupled)
    single.param_starts = [starts[k] for k in ladder]
    bnb_groups = [{k: v for k, v in copies[k].items() if k != "rung"} for k in eight]
    reference = eightbit(bnb_groups, decoupled_weight_decay=decoupled)
    params = [p for g in copies for p in g["params"]]
    return mixed, [single, reference], params


def _grads(step: int, params: list[torch.Tensor], scale: float) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + step)
    out: list[torch.Tensor | None] = []
    for k, p in enumerate(params):
        g = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
        out.append(None if (step, k) in NO_GRAD_AT else g)
    return out


def _assert_same_state(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert sorted(a) == sorted(b), where
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].device == b[key].device, (where, key)
            assert same_bits(a[key], b[key]), (where, key)
        else:
            assert a[key] == b[key] and type(a[key]) is type(b[key]), (where, key)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("amp", [False, True])
def test_mixed_formats_step_as_the_separate_engines(decoupled: bool, amp: bool) -> None:
    groups = _groups()
    mixed, (single, reference), ref_params = _engines(groups, decoupled)
    params = [p for g in groups for p in g["params"]]
    eight_ids = {id(p) for g in reference.param_groups for p in g["params"]}
    scale = 512.0 if amp else 1.0
    for step in range(4):
        found = amp and step == 2  # an overflow step: nothing changes
        for p, q, g in zip(params, ref_params, _grads(step, params, scale)):
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        if amp:
            for opt in (mixed, single):
                opt.grad_scale = torch.tensor(scale)  # type: ignore[attr-defined]
                opt.found_inf = torch.tensor(1.0 if found else 0.0)  # type: ignore[attr-defined]
        mixed.step()
        single.step()
        if not found:
            if amp:
                grads = [q.grad for q in ref_params if id(q) in eight_ids and q.grad is not None]
                unscale_grads_(grads, torch.tensor(scale))
            reference.step()
    for k, (p, q) in enumerate(zip(params, ref_params)):
        assert same_bits(p, q), f"param {k}"
        engine = reference if id(q) in eight_ids else single
        _assert_same_state(mixed.state[p], engine.state[q], f"param {k}")
    # the 8bit groups' state as the 8bit engine keeps it: codes for large params, float32
    # moments for small ones
    for group in groups:
        if group["rung"] != "8bit":
            continue
        for p in group["params"]:
            st = mixed.state[p]
            want = torch.uint8 if p.numel() >= 4096 else torch.float32
            assert st["state1"].dtype == want and st["state2"].dtype == want
            assert isinstance(st["step"], int)


def test_state_dict_holds_the_8bit_engine_layout() -> None:
    groups = _groups()
    mixed, (single, reference), ref_params = _engines(groups, True)
    params = [p for g in groups for p in g["params"]]
    for step in range(2):
        for p, q, g in zip(params, ref_params, _grads(step, params, 1.0)):
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        mixed.step()
        single.step()
        reference.step()
    saved = mixed.state_dict()
    # the layout bitsandbytes' own AdamW8bit saves: its groups as it builds them, its
    # state_dict of the reference's state (loaded into it)
    bnb = pytest.importorskip("bitsandbytes")
    plain = bnb.optim.AdamW8bit(
        [
            {
                "params": [torch.nn.Parameter(p.detach().clone()) for p in g["params"]],
                **{k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay")},
            }
            for g in groups
            if g["rung"] == "8bit"
        ],
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
    )
    plain_groups = plain.state_dict()["param_groups"]
    plain.load_state_dict(copy.deepcopy(reference.state_dict()))
    want = {**plain.state_dict(), "param_groups": plain_groups}
    index, ref_index = 0, 0
    for group, saved_group in zip(groups, saved["param_groups"]):
        n = len(group["params"])
        if group["rung"] == "8bit":
            ref_group = want["param_groups"][ref_index]
            for key in ("lr", "betas", "eps", "weight_decay", "alpha", "t_alpha", "t_beta3"):
                assert saved_group[key] == ref_group[key], key
            for k in range(n):
                a, b = saved["state"][index + k], want["state"][ref_group["params"][k]]
                assert BNB_WRAPPED_KEY in a
                assert sorted(a) == sorted(b)
                _assert_same_state(a[BNB_WRAPPED_KEY], b[BNB_WRAPPED_KEY], f"param {k}")
                assert a["step"] == b["step"]
            ref_index += 1
        else:
            for k in range(n):
                assert BNB_WRAPPED_KEY not in saved["state"].get(index + k, {})
        index += n


def test_a_loaded_checkpoint_steps_on_alike() -> None:
    groups = _groups()
    mixed = LadderAdamW(groups)
    params = [p for g in groups for p in g["params"]]
    for step in range(2):
        for p, g in zip(params, _grads(step, params, 1.0)):
            p.grad = g
        mixed.step()
    saved = copy.deepcopy(mixed.state_dict())
    twins = [_copy(g) for g in groups]
    loaded = LadderAdamW(twins)
    loaded.load_state_dict(saved)
    twin_params = [p for g in twins for p in g["params"]]
    for k, (p, q) in enumerate(zip(params, twin_params)):
        _assert_same_state(mixed.state[p], loaded.state[q], f"param {k}")
    for step in range(2, 4):
        for p, q, g in zip(params, twin_params, _grads(step, params, 1.0)):
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        mixed.step()
        loaded.step()
    for k, (p, q) in enumerate(zip(params, twin_params)):
        assert same_bits(p, q), f"param {k}"
        _assert_same_state(mixed.state[p], loaded.state[q], f"param {k}")


def test_8bit_groups_refuse_what_the_rung_cannot_take() -> None:
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="param 0 of the new group"):
        LadderAdamW([{"params": [p], "rung": "8bit"}])
    q = torch.nn.Parameter(torch.zeros(8))
    opt = LadderAdamW([{"params": [q], "rung": "8bit", "maximize": True}])
    q.grad = torch.ones(8)
    with pytest.raises(ValueError, match="maximize"):
        opt.step()
    assert len(opt.state) == 0


def test_a_torch_adamw_state_in_an_8bit_group_is_refused_before_anything_changes() -> None:
    """torch's AdamW state loaded into a LadderAdamW's 8bit group (its checkpoint saves
    no ``"rung"``, so the live group's 8bit format takes it as is): the step refuses it,
    naming the param, and changes nothing (bitsandbytes' ``update_step`` counted the
    step of the param, then raised KeyError 'state1'); once that state is dropped the
    group steps as the 8bit engine does from a fresh state."""
    from snapshots import assert_same, snapshot

    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(5000, generator=gen), torch.randn(30, generator=gen)]
    ref_params = [torch.nn.Parameter(t.clone()) for t in start]
    torch_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    for p in ref_params:
        p.grad = torch.randn(p.shape, generator=gen)
    torch_opt.step()
    params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = LadderAdamW([{"params": params, "rung": "8bit", "lr": 1e-2}])
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    twins = [torch.nn.Parameter(t.clone()) for t in start]
    reference = eightbit([{"params": twins, "lr": 1e-2}])
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for p, q, g in zip(params, twins, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"param 0 of param group 0 \(8bit\) holds state"):
        opt.step()
    assert_same(snapshot(opt), before)
    for p in params:
        del opt.state[p]
    opt.step()
    reference.step()
    for k, (p, q) in enumerate(zip(params, twins, strict=True)):
        assert same_bits(p, q), k
        _assert_same_state(opt.state[p], reference.state[q], f"param {k}")


def test_a_load_failing_at_any_allocation_changes_nothing() -> None:
    """``LadderAdamW.load_state_dict`` over fp32, 8bit and bf16 groups, with an OOM at
    the k-th allocation for every k: the load raises it and the optimizer is as it was
    (torch's loader had put its new state in place, then the moments' copies and the
    8bit state's failed over it: state and groups half loaded); a load after it, and
    the steps after that, are those of an optimizer that loaded the checkpoint
    once."""
    from memtools import FailNthAllocation
    from snapshots import assert_same, snapshot

    def stepped(seed: int) -> tuple[LadderAdamW, list[torch.Tensor]]:
        groups = _groups()
        opt = LadderAdamW(groups)
        params = [p for g in groups for p in g["params"]]
        for step in range(2):
            for p, g in zip(params, _grads(seed + step, params, 1.0), strict=True):
                p.grad = g
            opt.step()
        return opt, params

    saved = copy.deepcopy(stepped(10)[0].state_dict())
    once, once_params = stepped(0)
    checkpoint = copy.deepcopy(saved)
    with FailNthAllocation() as counter:
        once.load_state_dict(checkpoint)
    assert counter.count >= 6  # moments of the fp32/bf16 params, the 8bit state's copies
    for k in range(1, counter.count + 1):
        opt, params = stepped(0)
        checkpoint = copy.deepcopy(saved)
        before = snapshot(opt)
        with pytest.raises(torch.OutOfMemoryError), FailNthAllocation(k):
            opt.load_state_dict(checkpoint)
        assert_same(snapshot(opt), before)
        if k in (1, counter.count):  # once loaded, it steps as the one that loaded once
            opt.load_state_dict(checkpoint)
            for step in range(4, 6):
                for p, q, g in zip(params, once_params, _grads(step, params, 1.0), strict=True):
                    p.grad = None if g is None else g.clone()
                    q.grad = None if g is None else g.clone()
                opt.step()
                once.step()
            assert_same(snapshot(opt), snapshot(once))
            once, once_params = stepped(0)
            once.load_state_dict(copy.deepcopy(saved))


@pytest.mark.parametrize("build", ["prepare_8bit_format", "build_engine"])
def test_without_bitsandbytes_the_8bit_rung_says_how_to_install_it(
    build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from optladder.optimizers import eightbit as eightbit_module

    def missing() -> None:
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setattr(eightbit_module, "import_bitsandbytes", missing)
    p = torch.nn.Parameter(torch.zeros(8))
    groups = [{"params": [p]}]
    with pytest.raises(ImportError) as info:
        if build == "prepare_8bit_format":
            eightbit_module.prepare_8bit_format(groups)
        else:
            build_engine("8bit", groups, fused=False, lr=1e-3, weight_decay=0.0)
    message = str(info.value)
    assert "No module named 'bitsandbytes'" in message
    assert "pip install 'bitsandbytes>=0.45'" in message
    assert "rung" not in groups[0]  # nothing marked before the import failed


def _stepped_8bit(
    seed: int,
) -> tuple[torch.Generator, list[torch.Tensor], list[torch.nn.Parameter], LadderAdamW]:
    """A LadderAdamW over one 8bit group (a param of 5,000 elements: 8-bit codes, one of
    30: float32 state) after one step: the generator, the params' start values, the
    params and the optimizer."""
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(5000, generator=gen), torch.randn(30, generator=gen)]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    saver = LadderAdamW([{"params": params, "rung": "8bit", "lr": 1e-2}])
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    saver.step()
    return gen, start, params, saver


@pytest.mark.parametrize(
    "dropped",
    [("qmap1",), ("qmap2",), ("qmap1", "qmap2"), ("absmax1",), ("absmax2",)],
)
def test_an_8bit_checkpoint_missing_its_code_books_is_refused_at_load(
    dropped: tuple[str, ...],
) -> None:
    """An 8bit checkpoint whose uint8 codes lost their code book (``qmap1``/``qmap2``) or
    block scales (``absmax1``/``absmax2``), loaded into :class:`LadderAdamW` directly, is
    refused by the load, naming the param and the key, and changes nothing (it loaded,
    then the step raised KeyError 'qmap1'); the intact checkpoint loads and steps as the
    optimizer that saved it."""
    from snapshots import assert_same, snapshot

    gen, _, params, saver = _stepped_8bit(7)
    saved = saver.state_dict()
    broken = copy.deepcopy(saved)
    for key in dropped:
        del broken["state"][0][BNB_WRAPPED_KEY][key]
    twins = [torch.nn.Parameter(t.clone()) for t in params]
    loaded = LadderAdamW([{"params": twins, "rung": "8bit", "lr": 1e-3}])
    before = snapshot(loaded)
    with pytest.raises(ValueError, match=rf"param 0: .*{dropped[0]}"):
        loaded.load_state_dict(broken)
    assert_same(snapshot(loaded), before)
    loaded.load_state_dict(copy.deepcopy(saved))
    for p, q in zip(params, twins):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    saver.step()
    loaded.step()
    assert_same(snapshot(loaded), snapshot(saver))


def _nan_book(st: dict[str, Any]) -> None:
    st["qmap1"] = torch.full((256,), float("nan"))


def _negative_unsigned_book(st: dict[str, Any]) -> None:
    st["qmap2"] = torch.linspace(-1.0, 1.0, 256)


def _half_scales(st: dict[str, Any]) -> None:
    st["absmax1"] = st["absmax1"].half()


def _short_book(st: dict[str, Any]) -> None:
    st["qmap2"] = st["qmap2"][:255]


def _infinite_scale(st: dict[str, Any]) -> None:
    st["absmax2"] = st["absmax2"].clone()
    st["absmax2"][3] = float("inf")


@pytest.mark.parametrize(
    ("breaking", "match"),
    [
        (_nan_book, r"param 0: qmap1 \(the code book state1's codes index\) holds non-finite"),
        (_negative_unsigned_book, r"param 0: qmap2 .* holds 128 negative values"),
        (_half_scales, r"param 0: 8-bit state1 needs a float32 absmax1 tensor .*got a torch"),
        (_short_book, r"param 0: 8-bit state2 needs qmap2, a code book of 256 floating values"),
        (_infinite_scale, r"param 0: absmax2 holds 1 NaN or infinite values"),
    ],
)
def test_both_loaders_refuse_undecodable_codes_with_one_message(breaking: Any, match: str) -> None:
    """8-bit codes whose code book or block scales cannot decode them: refused, naming
    the param and the key, by ``LadderAdamW.load_state_dict`` (before anything loads)
    and by :class:`optladder.AdamW`'s load (its checkpoint conversion) with the same
    message, and neither changes. (``LadderAdamW``'s own load took the NaN and the
    negative code book and the infinite scale before, and refused the other two in
    words of its own.)"""
    from optladder import AdamW
    from snapshots import assert_same, snapshot

    _, start, _, saver = _stepped_8bit(11)
    broken = copy.deepcopy(saver.state_dict())
    breaking(broken["state"][0][BNB_WRAPPED_KEY])
    messages = []
    for make in (
        lambda ps: LadderAdamW([{"params": ps, "rung": "8bit", "lr": 1e-2}]),
        lambda ps: AdamW(ps, lr=1e-2, rung="8bit", free_memory=2**30),
    ):
        opt = make([torch.nn.Parameter(t.clone()) for t in start])
        before = snapshot(opt)
        with pytest.raises(ValueError, match=match) as info:
            opt.load_state_dict(copy.deepcopy(broken))
        assert_same(snapshot(opt), before)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
