"""Group options are checked before every step when they changed (README: "a group dict
edited by hand"); the step memo compares them with a snapshot. An option that changes
in place (a betas list) must not compare equal to its own snapshot: the out-of-range
value is refused before any write."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optladder import choose_optimizer


def _opt(rung: str, **kwargs: Any) -> tuple[Any, list[Any]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(2)]
    opt = choose_optimizer(params, lr=1e-2, rung=rung, free_memory="1GiB", environ={}, **kwargs)
    return opt, params


def _grads(params: list[Any], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


class _ConfigList(list):  # type: ignore[type-arg]
    """A list subclass, as YAML config loaders make (ruamel's ``CommentedSeq``)."""


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("kind", [list, _ConfigList], ids=["list", "list-subclass"])
def test_betas_changed_in_place_are_checked_again(rung: str, kind: type) -> None:
    opt, params = _opt(rung)
    opt.param_groups[0]["betas"] = kind([0.9, 0.999])  # by hand: checked at the next step
    _grads(params, 0)
    opt.step()
    opt.param_groups[0]["betas"][0] = 1.5  # in place: the list checked at the last step
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match="beta"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_a_group_switched_to_the_other_weight_decay_mode_is_refused(
    rung: str, decoupled: bool
) -> None:
    """One mode per optimizer (README): construction, ``add_param_group`` and loads refuse
    a group of the other mode, and the step checks every group's
    ``decoupled_weight_decay`` before writing. A group switched by hand would otherwise
    decay the other way on fp32/bf16 (8bit keeps its engine's mode) and save a
    checkpoint this optimizer refuses to load."""
    opt, params = _opt(rung, weight_decay=0.1, decoupled_weight_decay=decoupled)
    _grads(params, 0)
    opt.step()
    opt.param_groups[0]["decoupled_weight_decay"] = not decoupled
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    opt.param_groups[0]["decoupled_weight_decay"] = decoupled  # put back: steps again
    opt.step()
    assert not torch.equal(params[0], before[0])


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("key", ["lr", "betas", "eps", "weight_decay"])
def test_a_hyperparameter_deleted_from_a_group_is_refused_before_any_write(
    rung: str, key: str
) -> None:
    """``del group[key]`` after construction: torch's own fp32 step wrote the first
    group's params, then failed on the second (a PartialStepError); the step is refused
    before any write, naming the group and the key, and runs once the key is back."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(2)]
    opt = choose_optimizer(
        [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.5}],
        lr=1e-2,
        rung=rung,
        free_memory="1GiB",
        environ={},
    )
    _grads(params, 0)
    opt.step()
    value = opt.param_groups[1].pop(key)
    before = [p.detach().clone() for p in params]
    steps = [float(opt.state[p]["step"]) for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match=rf"param group 1: the key '{key}' is missing"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == steps == [1.0, 1.0]
    opt.param_groups[1][key] = value
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [2.0, 2.0]


# --- tensors in options: a tensor can change in place, so it is checked at every step.
# optladder takes lr as a one-element tensor (torch does) but not betas as tensors
# (construction refuses them: betas[i] must be a real number in [0, 1)).


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize(
    "betas",
    [
        (torch.tensor(0.9), torch.tensor(0.999)),  # equal to the floats checked before
        (0.9, torch.tensor(0.999)),
        [torch.tensor(0.9), 0.999],
        (torch.tensor([0.9, 0.9]), 0.999),  # would make ``==`` raise, not refuse
    ],
    ids=["tensors", "one-tensor", "list", "two-element"],
)
def test_betas_swapped_for_tensors_are_refused_as_at_construction(rung: str, betas: Any) -> None:
    """A tensor ``== 0.9`` is a true tensor: the betas tuple of tensors compared equal to
    the floats checked before, so it was never checked and reached the kernel."""
    with pytest.raises(ValueError, match=r"betas\[0\] must be in \[0, 1\)"):
        _opt(rung, betas=(torch.tensor(0.9), torch.tensor(0.999)))  # construction refuses
    opt, params = _opt(rung)
    _grads(params, 0)
    opt.step()
    opt.param_groups[0]["betas"] = betas
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match=r"param group 0: betas\[\d\] must be in \[0, 1\)"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    opt.param_groups[0]["betas"] = (0.9, 0.999)  # floats again: steps
    opt.step()


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
def test_a_tensor_lr_set_out_of_range_in_place_is_refused(rung: str, bad: float) -> None:
    lr = torch.tensor(1e-2)
    opt, params = _opt(rung)
    opt.param_groups[0]["lr"] = lr
    _grads(params, 0)
    opt.step()
    lr.fill_(bad)  # in place, as a scheduler writes a tensor lr
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match="param group 0: lr must be a finite number >= 0"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_a_tensor_lr_changed_in_place_takes_effect(rung: str) -> None:
    """The same steps as an optimizer given the new lr as a float (fp32: as torch's
    fused AdamW given it)."""
    opt, params = _opt(rung, weight_decay=0.1)
    ref, ref_params = _opt(rung, weight_decay=0.1)
    lr = torch.tensor(1e-2)
    opt.param_groups[0]["lr"] = lr
    for step, value in enumerate((1e-2, 0.25, 0.0)):
        lr.fill_(value)
        ref.param_groups[0]["lr"] = float(lr)  # the float32 value the tensor holds
        _grads(params, step)
        _grads(ref_params, step)
        opt.step()
        ref.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), (step, value)
    if rung == "fp32":  # and torch's own AdamW, from the state optladder holds
        torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        torch_opt = torch.optim.AdamW(torch_params, lr=lr, weight_decay=0.1, fused=True)
        torch_opt.load_state_dict(
            {
                "state": {
                    i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)
                },
                "param_groups": [dict(torch_opt.param_groups[0], params=[0, 1])],
            }
        )
        torch_opt.param_groups[0]["lr"] = lr  # the load put a copy there
        lr.fill_(0.5)
        _grads(params, 9)
        _grads(torch_params, 9)
        opt.step()
        torch_opt.step()
        for p, q in zip(params, torch_params):
            assert torch.equal(p, q)


def test_options_snapshot_never_takes_tensors_as_unchanged() -> None:
    """The step memo's comparison itself, by hand: a snapshot with a tensor anywhere in
    its options is none (checked at every step); betas of equal value whose items are
    tensors differ from float betas; the same tuple, and equal floats, do not."""
    from optladder.optimizers.stepmemo import options_snapshot, same_options

    betas = (0.9, 0.999)
    group: dict[str, Any] = {"params": [torch.zeros(2)], "lr": 1e-3, "betas": betas}
    snap = options_snapshot(group)
    assert snap is not None and same_options(group, snap)
    group["lr"] = float("0.001")  # another float object of the same value
    assert same_options(group, snap)
    group["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
    assert bool(group["betas"] == betas)  # what the comparison saw
    assert not same_options(group, snap)
    group["betas"] = (0.9, torch.tensor(0.999))
    assert not same_options(group, snap)
    group["betas"] = tuple(betas)
    assert same_options(group, snap)
    for options in ({"lr": torch.tensor(1e-3)}, {"betas": (torch.tensor(0.9), 0.999)}):
        assert options_snapshot({"params": [], **options}) is None


def test_a_snapshot_made_from_the_last_one_compares_as_a_full_one() -> None:
    """A scheduler's new lr reuses the group's last snapshot (same keys, types and betas
    tuple): it equals the group as it is then, not as it was, and every other change
    (another value, another type, a betas tuple holding a tensor, a list, a new key) is
    still seen, exactly as by a snapshot made from scratch."""
    from optladder.optimizers.stepmemo import options_snapshot, same_options

    group: dict[str, Any] = {"params": [torch.zeros(2)], "lr": 1e-3, "betas": (0.9, 0.999)}
    snap = options_snapshot(group)
    for lr in (5e-4, 2.5e-4):
        group["lr"] = lr
        assert snap is not None and not same_options(group, snap)
        snap = options_snapshot(group, snap)
        full = options_snapshot(group)
        assert snap is not None and full is not None
        assert snap.values[1:] == full.values[1:] and snap.fixed and same_options(group, snap)
    edits: list[dict[str, Any]] = [
        {"lr": 1e-4},
        {"lr": 1},  # an int: another type
        {"betas": (0.9, torch.tensor(0.999))},
        {"betas": [0.9, 0.999]},
        {"betas": (0.5, 0.999)},
        {"eps": 1e-8},
    ]
    for edit in edits:
        edited = {**group, **edit}
        assert not same_options(edited, snap), edit
        again = options_snapshot(edited, snap)
        if any(isinstance(x, torch.Tensor) for x in edited["betas"]):
            assert again is None
            continue
        assert again is not None and same_options(edited, again), edit
        assert not same_options(group, again), edit


# --- torch's kernel flags: optladder picks each rung's kernel (README: foreach,
# fused=False and capturable=True raise at construction); a group holding other values
# reached torch's own step, which failed in the commit (a PartialStepError, params
# possibly written) for a tensor lr with foreach=True, or capturable=True on the CPU.

KERNEL_FLAGS = [("foreach", True), ("capturable", True), ("fused", False)]


@pytest.mark.parametrize(("key", "value"), KERNEL_FLAGS)
@pytest.mark.parametrize("lr", ["float", "tensor"])
def test_a_kernel_flag_edited_by_hand_is_refused_before_any_write(
    key: str, value: object, lr: str
) -> None:
    """fp32 rung (torch's fused AdamW): a group whose ``foreach``, ``capturable`` or
    ``fused`` was set by hand is refused before the step writes anything, naming the
    group, the key, its value and the engine's; put back, the step runs and moves the
    params as ``torch.optim.AdamW(fused=True)`` moves its own copies."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(2)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    rate = torch.tensor(1e-2) if lr == "tensor" else 1e-2
    opt = choose_optimizer(params, lr=rate, rung="fp32", free_memory="1GiB", environ={})
    ref = torch.optim.AdamW(copies, lr=torch.tensor(1e-2) if lr == "tensor" else 1e-2, fused=True)
    _grads(params, 0)
    _grads(copies, 0)
    opt.step()
    ref.step()
    engine_value = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    _grads(copies, 1)
    with pytest.raises(
        ValueError, match=rf"param group 0: {key}={value!r}, .*{key}={engine_value!r}"
    ):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == [1.0, 1.0]
    opt.param_groups[0][key] = engine_value
    opt.step()
    ref.step()
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("key", "value"), KERNEL_FLAGS)
@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_add_param_group_leaves_the_kernel_flags_to_the_engine(
    rung: str, key: str, value: object
) -> None:
    """A group added with torch's kernel flags (a copy of another optimizer's group) gets
    the engine's, as groups given at construction do; with a tensor lr its params then
    step as ``torch.optim.AdamW(fused=True)`` steps them (fp32 rung)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(2)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = choose_optimizer(
        params[:1], lr=torch.tensor(1e-2), rung=rung, free_memory="1GiB", environ={}
    )
    opt.add_param_group({"params": params[1:], key: value, "lr": torch.tensor(1e-2)})
    assert opt.param_groups[1].get(key) == opt.param_groups[0].get(key)
    ref = torch.optim.AdamW(copies, lr=torch.tensor(1e-2), fused=True)
    for s in range(2):
        _grads(params, s)
        _grads(copies, s)
        opt.step()
        ref.step()
    assert [float(opt.state[p]["step"]) for p in params] == [2.0, 2.0]
    if rung == "fp32":
        for p, q in zip(params, copies, strict=True):
            assert torch.equal(p, q)
