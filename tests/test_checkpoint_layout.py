"""One checkpoint layout with or without pins; torch.distributed.checkpoint across rungs
with DCPLoadPlanner and no preparatory call; checkpoints in the earlier layouts load."""

from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from optladder import DCPLoadPlanner, choose_optimizer
from optladder.optimizers.dcp import fit_optimizer_templates
from optladder.optimizers.migrate import BNB_WRAPPED_KEY, BNB_WRAPPED_KEYS, unwrap_bnb_state
from snapshots import assert_same, snapshot

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:.*loading moves the optimizer.*",
)

_OTHER = {"fp32": "8bit", "bf16": "fp32", "8bit": "fp32"}


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # both weights have 5,120 elements: 8-bit codes on 8bit
    return nn.Sequential(nn.Linear(64, 80), nn.Linear(80, 64))


def _build(model: nn.Sequential, rung: str | None, pin: str | None = None):  # type: ignore[no-untyped-def]
    first: dict[str, Any] = {"params": list(model[0].parameters())}
    if pin is not None:
        first["rung"] = pin
    groups = [first, {"params": list(model[1].parameters())}]
    return choose_optimizer(groups, lr=1e-2, rung=rung, free_memory="1GiB", environ={})


def _step(model: nn.Sequential, opt: torch.optim.Optimizer, s: int) -> None:
    """Grads set by hand: the same grads whatever the rungs, so states can be compared."""
    gen = torch.Generator().manual_seed(s)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.zero_grad()


def _states(params: list[torch.Tensor], *states: Any) -> tuple[list[torch.Tensor], dict]:
    """A :func:`snapshots.snapshot`-like pair holding only params and per-param states."""
    return params, {"state": dict(enumerate(states)), "param_groups": []}


def _layout(entry: dict[str, Any]) -> dict[tuple[str, ...], Any]:
    """One param's saved state as its nesting, keys, and each value's kind, dtype, shape."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in entry.items():
        if isinstance(value, dict):
            out.update({(key, *k): v for k, v in _layout(value).items()})
        elif isinstance(value, torch.Tensor):
            out[(key,)] = (value.dtype, tuple(value.shape))
        else:
            out[(key,)] = type(value).__name__
    return out


# ---------------------------------------------------------------- one layout
@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_state_dict_has_one_layout_with_and_without_a_pin(rung: str) -> None:
    """The same state saves the same way beside a pinned group as without one (8-bit
    state was flat beside a pin, wrapped without); a pinned group saves as the same
    state following the decision does; and each layout is its reference optimizer's."""
    import bitsandbytes as bnb

    other = _OTHER[rung]
    plain_model = _model()
    plain = _build(plain_model, rung)
    pinned_model = _model()
    pinned = _build(pinned_model, rung, pin=other)
    other_model = _model()
    on_other = _build(other_model, other)
    for s in range(2):
        for m, o in ((plain_model, plain), (pinned_model, pinned), (other_model, on_other)):
            _step(m, o, s)
    a, b, c = (
        plain.state_dict()["state"],
        pinned.state_dict()["state"],
        on_other.state_dict()["state"],
    )
    assert [g["rung"] for g in pinned.param_groups] == [other, rung]
    for i in (2, 3):  # the group following the decision: the same layout
        assert _layout(b[i]) == _layout(a[i])
        if rung == "bf16":  # the rounding's random bits depend on the param's place
            continue
        assert_same(_states([], b[i]), _states([], a[i]))
    for i in (0, 1):  # the pinned group: as the same state on an unpinned optimizer
        assert _layout(b[i]) == _layout(c[i])
        assert_same(_states([], b[i]), _states([], c[i]))
    # the reference optimizers' own state_dict() layouts, one param stepped once
    p = nn.Parameter(torch.randn(64, 80))
    p.grad = torch.randn(64, 80)
    reference = bnb.optim.AdamW8bit([p]) if rung == "8bit" else torch.optim.AdamW([p])
    reference.step()
    want = _layout(reference.state_dict()["state"][0])
    got = _layout(a[2])
    if rung == "8bit":
        assert got == want  # bitsandbytes' wrapped layout, its int step included
    else:  # torch's keys; bf16 keeps bfloat16 moments, step a float64 count
        assert {k for k in got} == {k for k in want} == {("step",), ("exp_avg",), ("exp_avg_sq",)}
        moments = torch.float32 if rung == "fp32" else torch.bfloat16
        assert got[("exp_avg",)] == got[("exp_avg_sq",)] == (moments, (64, 80))


def test_the_wrapped_keys_are_bitsandbytes_own() -> None:
    import bitsandbytes as bnb

    engine = bnb.optim.AdamW8bit([nn.Parameter(torch.zeros(4))])
    assert engine.non_castable_tensor_keys == BNB_WRAPPED_KEYS
    assert engine._FSDP_WRAPPED_QUANT_STATE_KEY == BNB_WRAPPED_KEY


# ---------------------------------------------------------------- earlier layouts
def _flat_layout_of_before(opt: Any) -> dict[str, Any]:
    """What an optimizer with a pinned group wrote in state_dict() before the layout was
    one (its code, literally): torch's layout over every group, every param's state flat."""
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    return copy.deepcopy(
        {
            "state": {index[id(p)]: unwrap_bnb_state(st) for p, st in opt.state.items()},
            "param_groups": [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [index[id(p)] for p in g["params"]],
                }
                for g in opt.param_groups
            ],
        }
    )


def _by_name(sd: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``sd`` keyed by param names, as ``get_optimizer_state_dict`` keys it."""
    names = [name for name, _ in model.named_parameters()]
    return {
        "state": {names[i]: st for i, st in sd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]
        ],
    }


@pytest.mark.parametrize("dst", ["fp32", "8bit"])
def test_a_checkpoint_in_the_earlier_flat_layout_still_loads(dst: str) -> None:
    """An 8-bit group beside a pin was saved flat: that checkpoint loads as the wrapped
    one does, through load_state_dict and through DCP (whose template is now wrapped)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = _model()
    opt = _build(model, "8bit", pin="fp32")
    for s in range(2):
        _step(model, opt, s)
    old = _flat_layout_of_before(opt)
    assert "state1" in old["state"][2] and BNB_WRAPPED_KEY not in old["state"][2]

    ref_model = _model()
    ref = _build(ref_model, dst, pin="fp32")
    ref.load_state_dict(opt.state_dict())
    via_old = _build(_model(), dst, pin="fp32")
    via_old.load_state_dict(old)
    assert_same(snapshot(via_old), snapshot(ref))

    with tempfile.TemporaryDirectory() as path:
        dcp.save({"optim": _by_name(old, model)}, checkpoint_id=path)
        live_model = _model()
        live = _build(live_model, dst, pin="fp32")
        state = {"optim": get_optimizer_state_dict(live_model, live)}
        dcp.load(state, checkpoint_id=path, planner=DCPLoadPlanner())
        set_optimizer_state_dict(live_model, live, state["optim"])
    assert_same(snapshot(live), snapshot(ref))


@pytest.mark.parametrize("dst", [None, "bf16", "8bit"])
def test_a_checkpoint_with_the_old_origin_pinned_still_loads(dst: str | None) -> None:
    """Before it was called "fixed", the groups of an optimizer whose rung was fixed by
    rung= recorded the origin "pinned": such a checkpoint loads as today's does (a
    policy-chosen optimizer does not move for it: that rung was fixed, not escalated),
    and its pinned group ("group") stays pinned."""
    model = _model()
    opt = _build(model, "bf16", pin="fp32")
    for s in range(2):
        _step(model, opt, s)
    new = opt.state_dict()
    assert [g["rung_origin"] for g in new["param_groups"]] == ["group", "fixed"]
    old = copy.deepcopy(new)
    old["param_groups"][1]["rung_origin"] = "pinned"

    ref = _build(_model(), dst, pin="fp32")
    ref.load_state_dict(new)
    via_old = _build(_model(), dst, pin="fp32")
    via_old.load_state_dict(old)
    assert_same(snapshot(via_old), snapshot(ref))
    assert via_old.rung == (dst or "fp32")  # 1GiB free: the policy keeps fp32
    assert [g["rung_origin"] for g in via_old.param_groups] == [
        "group",
        "fixed" if dst else "policy",
    ]
    assert [g["rung"] for g in via_old.param_groups] == ["fp32", dst or "fp32"]
    misspelt = copy.deepcopy(old)  # the origin is checked: "pinned" is accepted, not skipped
    misspelt["param_groups"][1]["rung_origin"] = "pined"
    with pytest.raises(ValueError, match=r"\['rung_origin'\]='pined' is not an origin"):
        _build(_model(), dst, pin="fp32").load_state_dict(misspelt)


# ---------------------------------------------------------------- DCP across rungs
def _dcp_save(model: nn.Module, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(
        {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=path,
    )


def _dcp_load(model: nn.Module, opt: Any, path: str) -> None:
    """The README's recipe."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, planner=DCPLoadPlanner())
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


@pytest.mark.parametrize("pin", [None, "fp32"])
@pytest.mark.parametrize(
    ("src", "dst"),
    [("fp32", "8bit"), ("8bit", "fp32"), ("bf16", "8bit"), ("8bit", "8bit"), ("bf16", "bf16")],
)
def test_dcp_loads_a_checkpoint_of_any_rung_into_any_rung(
    src: str, dst: str, pin: str | None
) -> None:
    """No preparatory call: on the same rung the run continues bit for bit as the
    uninterrupted one; on another, the loaded state is the state migrated there, and the
    run continues exactly as from the migrated optimizer."""
    model = _model()
    opt = _build(model, src, pin=pin)
    for s in range(2):
        _step(model, opt, s)
    with tempfile.TemporaryDirectory() as path:
        _dcp_save(model, opt, path)
        live_model = _model()
        live = _build(live_model, dst, pin=pin)
        _dcp_load(live_model, live, path)
    assert [g["rung"] for g in live.param_groups] == [pin or dst, dst]
    if src != dst:
        opt.migrate_to(dst, "the reference: the same state migrated", force=True)
    (params, saved), (live_params, loaded) = snapshot(opt), snapshot(live)
    assert_same(
        _states(live_params, *loaded["state"].values()), _states(params, *saved["state"].values())
    )
    if dst == "8bit":
        assert live.state[live_model[1].weight]["state1"].dtype == torch.uint8
    for s in range(2, 4):
        _step(model, opt, s)
        _step(live_model, live, s)
    for p, q in zip(model.parameters(), live_model.parameters()):
        assert torch.equal(p, q)


def test_plain_dcp_load_across_rungs_is_refused_by_dcp_and_changes_nothing() -> None:
    """Why the planner: DCP loads into the live optimizer's state_dict(), whose keys are
    the rung's (an fp32 template has no 8-bit codes to fill)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model()
    opt = _build(model, "8bit")
    _step(model, opt, 0)
    live_model = _model()
    live = _build(live_model, "fp32")
    _step(live_model, live, 0)
    before = snapshot(live)
    with tempfile.TemporaryDirectory() as path:
        _dcp_save(model, opt, path)
        state = {"optim": get_optimizer_state_dict(live_model, live)}
        from torch.distributed.checkpoint.api import CheckpointException

        with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict"):
            dcp.load(state, checkpoint_id=path)
    assert_same(snapshot(live), before)


def test_the_planner_replaces_only_what_does_not_fit() -> None:
    """Same rung: new tensors by default (the live state is not written before the load
    is accepted); with ``in_place=True`` DCP loads into the live optimizer's own tensors
    (no copy). Another rung: new tensors of the saved dtypes, the model and other
    optimizers left alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model()
    opt = _build(model, "fp32")
    _step(model, opt, 0)
    with tempfile.TemporaryDirectory() as path:
        other = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        other.step()
        _dcp_save(model, opt, path)
        metadata = dcp.FileSystemReader(path).read_metadata()

    def ids(template: dict[str, Any]) -> set[int]:
        return {id(t) for st in template["optim"]["state"].values() for t in st.values()}

    same = {"optim": get_optimizer_state_dict(model, opt)}
    tensors = ids(same)
    fit_optimizer_templates(same, metadata, in_place=True)
    assert ids(same) == tensors
    fit_optimizer_templates(same, metadata)
    assert not ids(same) & tensors
    st = same["optim"]["state"]["1.weight"]
    assert st["exp_avg"].shape == (64, 80) and st["exp_avg"].dtype == torch.float32

    live_model = _model()
    live = _build(live_model, "8bit")
    _step(live_model, live, 0)
    template = {
        "model": live_model.state_dict(),
        "optim": get_optimizer_state_dict(live_model, live),
        "other": other.state_dict(),
    }
    model_tensors = dict(template["model"])
    other_state = template["other"]["state"]
    fit_optimizer_templates(template, metadata)
    assert all(template["model"][k] is v for k, v in model_tensors.items())
    assert template["other"]["state"] is other_state
    st = template["optim"]["state"]["1.weight"]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == (64, 80)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("fault", ["nan moment", "misspelt rung"])
def test_a_refused_same_rung_dcp_load_leaves_the_live_optimizer_as_it_was(
    rung: str, fault: str
) -> None:
    """The README's recipe, a checkpoint of the live optimizer's own rung that
    ``load_state_dict`` refuses (a NaN in the first moment, or a group's rung misspelt):
    the live state, params and groups are bit for bit as before the load (DCP wrote into
    new tensors, not the live ones)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model()
    opt = _build(model, rung)
    for s in range(2):
        _step(model, opt, s)
    bad = copy.deepcopy(get_optimizer_state_dict(model, opt))
    if fault == "nan moment":
        entry = bad["state"]["1.weight"]
        entry = entry.get(BNB_WRAPPED_KEY, entry)
        key = "absmax1" if rung == "8bit" else "exp_avg"
        entry[key] = entry[key].clone()
        entry[key].view(-1)[0] = float("nan")
    else:
        bad["param_groups"][0]["rung"] = "fp16"
    live_model = _model()
    live = _build(live_model, rung)
    for s in range(3):
        _step(live_model, live, s)
    before = snapshot(live)
    with tempfile.TemporaryDirectory() as path:
        import torch.distributed.checkpoint as dcp

        # the live model's own params: the recipe's model load changes nothing here
        dcp.save({"model": live_model.state_dict(), "optim": bad}, checkpoint_id=path)
        with pytest.raises(ValueError, match=r"NaN|'fp16' is not a rung"):
            _dcp_load(live_model, live, path)
    assert_same(snapshot(live), before)


def test_follow_checkpoint_still_runs_and_warns() -> None:
    model = _model()
    opt = _build(model, None)
    opt.escalate("test")
    live = _build(_model(), None)
    with pytest.warns(FutureWarning, match="DCPLoadPlanner"):
        assert live.follow_checkpoint(opt.state_dict()["param_groups"]) == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        live.load_state_dict(opt.state_dict())  # the new recipe warns about nothing


def test_dcp_loads_optimizers_kept_in_a_list_across_rungs() -> None:
    """Trainers keep several optimizers in a list ({"optims": [a, b]}); DCP names a list
    item by its index. The planner looked for optimizers in dicts only, so DCP refused
    the checkpoint of another rung ("expected BytesStorageMetadata")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def build(model: nn.Sequential, rungs: tuple[str, str]) -> list[Any]:
        return [
            choose_optimizer(
                list(model[i].parameters()), lr=1e-2, rung=r, free_memory="1GiB", environ={}
            )
            for i, r in enumerate(rungs)
        ]

    def step(model: nn.Sequential, opts: list[Any], s: int) -> None:
        gen = torch.Generator().manual_seed(s)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        for o in opts:
            o.step()

    model = _model()
    opts = build(model, ("8bit", "fp32"))
    for s in range(2):
        step(model, opts, s)
    live_model = _model()
    live = build(live_model, ("fp32", "bf16"))
    with tempfile.TemporaryDirectory() as path:
        dcp.save({"optims": [get_optimizer_state_dict(model, o) for o in opts]}, checkpoint_id=path)
        state = {"optims": [get_optimizer_state_dict(live_model, o) for o in live]}
        dcp.load(state, checkpoint_id=path, planner=DCPLoadPlanner())
    for o, sd in zip(live, state["optims"]):
        set_optimizer_state_dict(live_model, o, sd)
    for o, rung in zip(opts, ("fp32", "bf16")):  # the reference: the same state migrated
        o.migrate_to(rung, "the reference", force=True)
    for o, ref in zip(live, opts):
        assert [g["rung"] for g in o.param_groups] == [g["rung"] for g in ref.param_groups]
        saved, loaded = snapshot(ref)[1], snapshot(o)[1]
        assert_same(_states([], *loaded["state"].values()), _states([], *saved["state"].values()))


# ---------------------------------------------------------------- AdEMAMix group keys
_ADEMAMIX_KEYS = ("alpha", "t_alpha", "t_beta3")


def _get_config_045(monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes 0.45's ``Optimizer8bit.get_config`` (which pyproject allows): the
    AdEMAMix keys read with ``group.get(key)``, no default (0.46 added 0.0/0/0)."""
    from bitsandbytes.optim.optimizer import Optimizer8bit

    current = Optimizer8bit.get_config

    def get_config(self: Any, gindex: int, pindex: int, group: dict[str, Any]) -> Any:
        config = current(self, gindex, pindex, group)
        for key in _ADEMAMIX_KEYS:
            config[key] = group.get(key)
        return config

    monkeypatch.setattr(Optimizer8bit, "get_config", get_config)


@pytest.mark.parametrize("compiler", [True, False], ids=["c-kernel", "no-compiler"])
def test_8bit_groups_hold_no_ademamix_keys_but_their_checkpoint_does(
    monkeypatch: pytest.MonkeyPatch, compiler: bool
) -> None:
    """The live param groups hold none of bitsandbytes' AdEMAMix keys (``alpha``,
    ``t_alpha``, ``t_beta3``; they are no option of optladder's): built on 8bit,
    escalated to 8bit, after loading a plain ``AdamW8bit`` checkpoint (which has them).
    ``state_dict()`` writes them into the 8bit groups, as ``AdamW8bit``'s own
    ``state_dict()`` (the reference) has them: under bitsandbytes 0.45's ``get_config``
    the checkpoint steps on in plain ``AdamW8bit`` (a group without them: its update
    refuses ``alpha=None``), as it steps under the installed bitsandbytes, bit for bit;
    and optladder's own 8bit steps run under it too, also where no C compiler is found
    and bitsandbytes' own update steps the 8bit groups (its config is given Adam's
    values)."""
    import bitsandbytes as bnb

    if not compiler:  # no C kernel: bitsandbytes' CPU update steps the 8bit groups
        monkeypatch.setenv("CC", "optladder-no-such-compiler")
    _get_config_045(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (5000, 300)]
    built = choose_optimizer([{"params": params[:1]}, {"params": params[1:]}], rung="8bit")
    moved = choose_optimizer([nn.Parameter(p.detach().clone()) for p in params], free_memory="1GiB")
    opts = (built, moved)
    for k in range(2):
        for opt in opts:
            for g in opt.param_groups:
                for p in g["params"]:
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
            opt.step()
        if k == 0:
            moved.escalate("test")
            moved.escalate("test")
    assert moved.rung == built.rung == "8bit"
    plain_params = [nn.Parameter(p.detach().clone()) for p in params]
    plain = bnb.optim.AdamW8bit([{"params": plain_params[:1]}, {"params": plain_params[1:]}])
    for p in plain_params:
        p.grad = torch.ones_like(p)
    plain.step()
    reference = plain.state_dict()
    loaded = choose_optimizer([{"params": params[:1]}, {"params": params[1:]}], rung="8bit")
    loaded.load_state_dict(copy.deepcopy(reference))
    for opt in (*opts, loaded):
        for group in opt.param_groups:
            assert not set(_ADEMAMIX_KEYS) & group.keys(), sorted(group)
    saved = built.state_dict()
    for group, want in zip(saved["param_groups"], reference["param_groups"]):
        assert {k: group[k] for k in _ADEMAMIX_KEYS} == {k: want[k] for k in _ADEMAMIX_KEYS}
    # the export: bitsandbytes 0.45 steps on from the checkpoint, as the installed one
    ends = []
    for patched in (True, False):
        if not patched:
            monkeypatch.undo()
        twins = [nn.Parameter(p.detach().clone()) for p in params]
        export = bnb.optim.AdamW8bit([{"params": twins[:1]}, {"params": twins[1:]}])
        export.load_state_dict(copy.deepcopy(saved))
        for p in twins:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(5))
        export.step()
        ends.append(twins)
    for a, b in zip(*ends):
        assert torch.equal(a, b)
