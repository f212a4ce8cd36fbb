"""Checkpoint forms of optimizer state (one process; the sharded runs are in
test_distributed.py): the row form of 8-bit block scales against a hand computation,
never-stepped params in state_dict() and DCP, and optimizers over meta params."""

from __future__ import annotations

import copy
import itertools
import tempfile

import pytest
import torch
from torch import nn

from optladder import DCPLoadPlanner, choose_optimizer
from optladder.optimizers.checkpoint import (
    PHASE_KEY,
    ROW_ABSMAX_KEYS,
    _rows_from_blocks,
    from_checkpoint_form,
    row_slots,
)
from optladder.optimizers.migrate import read_step, unwrap_bnb_state
from snapshots import assert_load_refused, assert_same, snapshot

RUNGS = ("fp32", "bf16", "8bit")


def _reference_table(absmax: list[float], rows: int, per_row: int) -> torch.Tensor:
    """Row ``r``, slot ``k``: the absmax of the ``k``-th block row ``r``'s elements fall
    in (blocks of 256 consecutive elements of the flattened shard), else 0."""
    table = torch.zeros(rows, row_slots(per_row))
    for r in range(rows):
        blocks: list[int] = []
        for c in range(per_row):
            b = (r * per_row + c) // 256
            if b not in blocks:
                blocks.append(b)
        for k, b in enumerate(blocks):
            table[r, k] = absmax[b]
    return table


@pytest.mark.parametrize(("rows", "per_row"), [(7, 1000), (64, 96), (3, 256), (300, 1), (0, 50)])
def test_row_table_holds_each_rows_block_scales(rows: int, per_row: int) -> None:
    blocks = -(-rows * per_row // 256)
    absmax = torch.arange(1, blocks + 1, dtype=torch.float32) / 7
    table = _rows_from_blocks(absmax, rows, per_row)
    assert torch.equal(table, _reference_table(absmax.tolist(), rows, per_row))


def _row_form(codes: torch.Tensor, absmaxes: list[torch.Tensor], row_starts: list[int]) -> dict:
    """The row form of a param whose flattened rows were quantized in shards starting
    at ``row_starts`` (each shard's blocks restart at its first row)."""
    rows, per_row = codes.shape
    bounds = [*row_starts, rows]
    tables, phases = [[], []], []
    for s, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        phases += [((r - lo) * per_row) % 256 for r in range(lo, hi)]
        for i in (0, 1):
            tables[i].append(_reference_table(absmaxes[i][s].tolist(), hi - lo, per_row))
    code = torch.linspace(-1, 1, 256)
    return {
        "step": 5,
        "state1": codes,
        "state2": codes.flip(0),
        ROW_ABSMAX_KEYS[0]: torch.cat(tables[0]),
        ROW_ABSMAX_KEYS[1]: torch.cat(tables[1]),
        PHASE_KEY: torch.tensor(phases, dtype=torch.int32),
        "qmap1": code,
        "qmap2": code.abs(),
    }


def _shard_scales(rows: int, per_row: int, starts: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    bounds = [*starts, rows]
    return [
        torch.rand(-(-(hi - lo) * per_row // 256), generator=gen) + 0.1
        for lo, hi in itertools.pairwise(bounds)
    ]


def test_row_form_of_the_same_blocks_loads_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (64, 96), dtype=torch.uint8, generator=gen)
    # two shards of 32 rows (3,072 elements, 12 whole blocks): the unsharded blocks
    starts = [0, 32]
    scales = [_shard_scales(64, 96, starts, 1), _shard_scales(64, 96, starts, 2)]
    form = _row_form(codes, scales, starts)
    out = from_checkpoint_form(form, torch.zeros(64, 96), "param 0")
    assert out["step"] == 5
    assert torch.equal(out["state1"], codes) and torch.equal(out["state2"], codes.flip(0))
    assert torch.equal(out["absmax1"], torch.cat(scales[0]))
    assert torch.equal(out["absmax2"], torch.cat(scales[1]))


def test_row_form_of_other_blocks_dequantizes_each_element_with_its_saved_block() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (7, 1000), dtype=torch.uint8, generator=gen)
    starts = [0, 4]  # rank 1's shard starts at element 4,000: mid-block unsharded
    scales = [_shard_scales(7, 1000, starts, 1), _shard_scales(7, 1000, starts, 2)]
    form = _row_form(codes, scales, starts)
    out = from_checkpoint_form(form, torch.zeros(7, 1000), "param 0")
    assert set(out) == {"step", "exp_avg", "exp_avg_sq"} and float(out["step"]) == 5
    for i, (name, m) in enumerate((("exp_avg", codes), ("exp_avg_sq", codes.flip(0)))):
        qmap, codes_list = form[f"qmap{i + 1}"].tolist(), m.tolist()
        want = [[0.0] * 1000 for _ in range(7)]
        for r in range(7):
            shard = 0 if r < 4 else 1
            scale = scales[i][shard].tolist()
            for c in range(1000):
                block = ((r - starts[shard]) * 1000 + c) // 256
                want[r][c] = qmap[codes_list[r][c]] * scale[block]
        # float32 product, as the reference computes it in float64 from float32 factors
        assert torch.allclose(out[name], torch.tensor(want), rtol=2**-23, atol=0)


@pytest.mark.parametrize("rung", RUNGS)
def test_row_form_of_other_blocks_keeps_a_step_past_float32s_whole_numbers(rung: str) -> None:
    """A requantized row form keeps its step exactly: 2**24 + 1 is no float32 (it was
    read back as 2**24)."""
    codes = torch.randint(0, 256, (7, 1000), dtype=torch.uint8, generator=torch.Generator())
    starts = [0, 4]  # other blocks: the requantizing branch
    scales = [_shard_scales(7, 1000, starts, 1), _shard_scales(7, 1000, starts, 2)]
    form = {**_row_form(codes, scales, starts), "step": 2**24 + 1}
    out = from_checkpoint_form(form, torch.zeros(7, 1000), "param 0")
    assert read_step(out) == 16_777_217
    p = nn.Parameter(torch.zeros(7, 1000))
    opt = choose_optimizer([p], rung=rung, free_memory="1GiB", environ={})
    saved = {"state": {0: form}, "param_groups": copy.deepcopy(opt.state_dict()["param_groups"])}
    opt.load_state_dict(saved)
    assert read_step(unwrap_bnb_state(opt.state[p])) == 16_777_217


def test_row_form_with_missing_or_misshapen_tensors_is_refused() -> None:
    codes = torch.zeros(64, 96, dtype=torch.uint8)
    scales = [_shard_scales(64, 96, [0], 1), _shard_scales(64, 96, [0], 2)]
    form = _row_form(codes, scales, [0])
    with pytest.raises(ValueError, match=r"param 3: the row form .* 'block_absmax2'"):
        from_checkpoint_form(
            {k: v for k, v in form.items() if k != "block_absmax2"}, torch.zeros(64, 96), "param 3"
        )
    with pytest.raises(ValueError, match=r"param 3: block_phase has shape \(63,\)"):
        from_checkpoint_form(
            {**form, PHASE_KEY: form[PHASE_KEY][1:]}, torch.zeros(64, 96), "param 3"
        )


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        # an offset past the block: each row was read with the next row's scales
        (
            PHASE_KEY,
            torch.full((64,), 300, dtype=torch.int32),
            r"block_phase holds values in \[300, 300\]; allowed: .*\[0, 255\]",
        ),
        # a negative offset: an IndexError from the gather
        (
            PHASE_KEY,
            torch.full((64,), -5, dtype=torch.int32),
            r"block_phase holds values in \[-5, -5\]",
        ),
        # offsets are whole numbers: 0.5 was truncated to 0
        (
            PHASE_KEY,
            torch.full((64,), 0.5),
            r"block_phase has dtype torch.float32; allowed: an integer",
        ),
        # float codes were read as moments of bitsandbytes' 32-bit layout
        ("state1", torch.zeros(64, 96), r"state1 has dtype torch.float32; allowed: torch.uint8"),
    ],
)
def test_row_form_with_offsets_out_of_a_block_or_codes_not_uint8_is_refused(
    key: str, value: torch.Tensor, match: str
) -> None:
    codes = torch.zeros(64, 96, dtype=torch.uint8)
    form = {**_row_form(codes, [_shard_scales(64, 96, [0], 1), _shard_scales(64, 96, [0], 2)], [0])}
    form[key] = value
    with pytest.raises(ValueError, match="param 3: " + match):
        from_checkpoint_form(form, torch.zeros(64, 96), "param 3")
    p = nn.Parameter(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)))
    opt = choose_optimizer([p], rung="8bit", free_memory="1GiB", environ={})
    p.grad = torch.ones(64, 96)
    opt.step()
    before = snapshot(opt)
    saved = {"state": {0: form}, "param_groups": copy.deepcopy(opt.state_dict()["param_groups"])}
    with pytest.raises(ValueError, match="param 0: " + match):
        opt.load_state_dict(saved)
    assert_same(snapshot(opt), before)


# ---------------------------------------------------------------- never-stepped params
class _AB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(80, 64, generator=gen))  # 8-bit codes on 8bit
        self.b = nn.Parameter(torch.randn(80, 64, generator=gen))  # no grad before step 2
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)


def _build(model: _AB, rung: str):  # type: ignore[no-untyped-def]
    return choose_optimizer(model, lr=1e-2, rung=rung, free_memory="1GiB", environ={})


def _step(model: _AB, opt: torch.optim.Optimizer, s: int) -> None:
    gen = torch.Generator().manual_seed(s)
    model.a.grad = torch.randn(80, 64, generator=gen)
    model.b.grad = torch.randn(80, 64, generator=gen) if s >= 2 else None
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("rung", RUNGS)
def test_state_dict_saves_a_zero_state_for_a_param_that_never_stepped(rung: str) -> None:
    model = _AB()
    opt = _build(model, rung)
    assert opt.state_dict()["state"] == {}  # nothing stepped yet: nothing allocated
    _step(model, opt, 0)
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1]  # the frozen param (index 2) gets none
    b = unwrap_bnb_state(state[1])
    a = unwrap_bnb_state(state[0])
    assert read_step(b) == 0 and read_step(a) == 1
    assert sorted(b) == sorted(a)  # the keys of a param that stepped
    for k, v in b.items():
        if isinstance(v, torch.Tensor) and not k.startswith("qmap") and k != "step":
            assert v.dtype == a[k].dtype and v.shape == a[k].shape and not v.any(), k
    assert not opt.state.get(model.b)  # saving allocated nothing in the optimizer


@pytest.mark.parametrize("rung", RUNGS)
def test_dcp_resume_with_a_never_stepped_param_equals_the_uninterrupted_run(rung: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = _AB()
    opt = _build(model, rung)
    _step(model, opt, 0)
    _step(model, opt, 1)
    with tempfile.TemporaryDirectory() as path:
        dcp.save(
            {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=path,
        )
        saved = snapshot(opt)
        for s in range(2, 5):
            _step(model, opt, s)
        model2 = _AB()
        opt2 = _build(model2, rung)
        state = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(state, checkpoint_id=path, planner=DCPLoadPlanner())
        model2.load_state_dict(state["model"])
        set_optimizer_state_dict(model2, opt2, state["optim"])
    assert not opt2.state.get(model2.b)  # step 0 in the checkpoint: loads as no state
    assert_same(snapshot(opt2), saved)
    for s in range(2, 5):
        _step(model2, opt2, s)
    assert torch.equal(model2.a, model.a) and torch.equal(model2.b, model.b)
    assert read_step(opt2.state[model2.b]) == 3


# ---------------------------------------------------------------- meta params
@pytest.mark.parametrize("rung", RUNGS)
def test_an_optimizer_over_meta_params_is_refused(rung: str) -> None:
    """bug-14: model.to_empty() makes new Parameters, so an optimizer built over the meta
    ones would never move the model: refused at construction, naming the param."""
    with torch.device("meta"):
        model = nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"param 0 of group 0 .* meta device.*after materializing"):
        choose_optimizer(model, lr=1e-3, rung=rung, free_memory="1GiB", environ={})
    model.to_empty(device="cpu")
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    model(torch.ones(2, 64)).sum().backward()
    # built after materializing, it steps: AdamW's first step moves by lr * g / (|g| + eps)
    opt = choose_optimizer(model, lr=1e-3, rung=rung, free_memory="1GiB", environ={})
    opt.step()
    assert torch.allclose(model.bias, torch.full((64,), -1e-3 * 2 / (2 + 1e-8)), rtol=1e-2)


NUMPY_STEPS = ("int64", "int32", "uint32", "float32", "float64")


@pytest.mark.parametrize("rung", RUNGS)
def test_numpy_scalar_steps_load_in_the_engines_own_form(rung: str) -> None:
    """bug-23 (ray#61937): a checkpoint whose ``step`` came back from a numpy round trip
    holds numpy scalars (``np.int64`` is no Python int). Each loads like the Python
    number it stands for: the step lands in the rung's own form (a 0-d ``STEP_DTYPE``
    tensor, or an int on 8bit) and the next step is bit-identical to a resume from the
    untouched checkpoint. A numpy bool is not a count: refused, nothing changes."""
    np = pytest.importorskip("numpy")
    from optladder.optimizers.steps import STEP_DTYPE

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Linear(80, 64)  # 5,120 weight elements: quantized on the 8-bit rung
        return m, choose_optimizer(m, lr=1e-2, rung=rung, free_memory="64GiB", environ={})

    def grads(m: nn.Module, s: int) -> None:
        for i, p in enumerate(m.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i))

    m, opt = build()
    for s in range(3):
        grads(m, s)
        opt.step()
    ckpt, weights = opt.state_dict(), {k: v.clone() for k, v in m.state_dict().items()}
    ref_m, ref = build()
    ref_m.load_state_dict(weights)
    ref.load_state_dict(copy.deepcopy(ckpt))
    grads(ref_m, 3)
    ref.step()
    for name in NUMPY_STEPS:
        sd = copy.deepcopy(ckpt)
        for st in sd["state"].values():
            st["step"] = getattr(np, name)(3)
        m2, opt2 = build()
        m2.load_state_dict(weights)
        opt2.load_state_dict(sd)
        for p in m2.parameters():
            step = opt2.state[p]["step"]
            if rung == "8bit":
                assert type(step) is int and step == 3, (name, step)
            else:
                assert isinstance(step, torch.Tensor) and step.dtype == STEP_DTYPE, (name, step)
                assert step.dim() == 0 and step.item() == 3.0, (name, step)
        grads(m2, 3)
        opt2.step()
        for p, q in zip(m2.parameters(), ref_m.parameters(), strict=True):
            assert torch.equal(p, q), name
    sd = copy.deepcopy(ckpt)
    next(iter(sd["state"].values()))["step"] = np.bool_(True)
    assert_load_refused(opt, sd, "'step' must be a finite whole number >= 0")


TENSOR_STEPS = {
    "python int": int,
    "python float": float,
    "0-d float32 (torch's own)": lambda n: torch.tensor(float(n)),
    "shape (1,) (older capturable AdamW)": lambda n: torch.tensor([float(n)]),
    "0-d float64": lambda n: torch.tensor(float(n), dtype=torch.float64),
    "0-d int64": lambda n: torch.tensor(int(n)),
    "0-d bfloat16": lambda n: torch.tensor(float(n), dtype=torch.bfloat16),
    "0-d float16": lambda n: torch.tensor(float(n), dtype=torch.float16),
}


@pytest.mark.parametrize("source", ["fused", "foreach"])
@pytest.mark.parametrize("rung", RUNGS)
def test_a_torch_adamw_checkpoint_with_any_step_form_resumes_in_the_rungs_own_form(
    source: str, rung: str
) -> None:
    """bug-01 (pytorch#103256) and bug-23 (ray#61937): a checkpoint written by plain
    ``torch.optim.AdamW`` (fused or foreach), through ``torch.save``/``torch.load(
    map_location="cpu")``, whose ``step`` is then in any form a round trip makes (Python
    int/float, 0-d float32/float64/int64/bfloat16/float16, shape (1,)), loads into every
    rung with ``step`` in the rung's own form: a 0-d :data:`~.steps.STEP_DTYPE` tensor (on
    the param's device for the fused fp32 engine, else the CPU), an int on 8bit; the
    engine's own ``fused``/``foreach`` flags stay. The next 3 steps are bit-identical to
    a resume from torch's untouched checkpoint, and on fp32 from a torch fused source
    bit-identical to ``torch.optim.AdamW(fused=True)`` continuing itself; the count reads
    6. Steps 3..6 are exact in every form (bfloat16 holds integers to 256)."""
    import io

    from optladder.optimizers.steps import STEP_DTYPE

    def grads(m: nn.Module, s: int) -> None:
        for i, p in enumerate(m.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i))

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(80, 64)  # 5,120 weight elements: quantized on the 8-bit rung

    model = fresh()
    flags = {"fused": True} if source == "fused" else {"foreach": True}
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **flags)  # type: ignore[arg-type]
    for s in range(3):
        grads(model, s)
        torch_opt.step()
    buf = io.BytesIO()
    torch.save(torch_opt.state_dict(), buf)
    buf.seek(0)
    ckpt = torch.load(buf, map_location="cpu", weights_only=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    def resume(sd: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
        m = fresh()
        m.load_state_dict(weights)
        opt = choose_optimizer(m, lr=1e-2, rung=rung, free_memory="64GiB", environ={})
        opt.load_state_dict(sd)
        return m, opt

    def check_form(m: nn.Module, opt: torch.optim.Optimizer, name: str) -> None:
        fused = opt.engine.param_groups[0].get("fused")  # type: ignore[attr-defined]
        for p in m.parameters():
            step = opt.state[p]["step"]
            if rung == "8bit":
                assert type(step) is int, (name, step)
            else:
                device = p.device if fused else torch.device("cpu")
                assert isinstance(step, torch.Tensor) and step.dim() == 0, (name, step)
                assert (step.dtype, step.device) == (STEP_DTYPE, device), (name, step)

    ref_m, ref = resume(copy.deepcopy(ckpt))
    for s in range(3, 6):
        grads(ref_m, s)
        ref.step()
    if rung == "fp32" and source == "fused":
        for s in range(3, 6):
            grads(model, s)
            torch_opt.step()
        for p, q in zip(ref_m.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)  # torch's own continuation, bit for bit
    for name, form in TENSOR_STEPS.items():
        sd = copy.deepcopy(ckpt)
        for st in sd["state"].values():
            st["step"] = form(3)
        m, opt = resume(sd)
        engine_group = opt.engine.param_groups[0]
        if rung == "fp32":
            assert engine_group.get("fused") is True and not engine_group.get("foreach"), name
        else:
            assert not any(engine_group.get(k) for k in ("fused", "foreach", "capturable")), name
        check_form(m, opt, name)
        for s in range(3, 6):
            grads(m, s)
            opt.step()
        check_form(m, opt, name)
        for p, q in zip(m.parameters(), ref_m.parameters(), strict=True):
            assert float(opt.state[p]["step"]) == 6.0, name
            assert torch.equal(p, q), name


def _complex_run(steps: int) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(3)
    z = nn.Parameter(torch.randn(5, dtype=torch.complex64))
    a = nn.Parameter(torch.randn(6))
    opt = choose_optimizer([z, a], free_memory="1GiB", rung="fp32")
    for s in range(steps):
        for p in (z, a):
            p.grad = torch.full_like(p, 0.5 * (s + 1))
        opt.step()
    return [z, a], opt


def test_a_checkpoint_with_complex_params_loads_and_resumes_as_the_uninterrupted_run() -> None:
    """The fp32 rung takes complex params (torch's AdamW keeps their moments complex):
    its own state_dict loads back, and the resumed run equals the uninterrupted one
    and torch's AdamW bit for bit; a NaN in a complex moment is still refused."""
    params, opt = _complex_run(2)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.complex64
    resumed_params, resumed = _complex_run(0)
    with torch.no_grad():
        for r, p in zip(resumed_params, params):
            r.copy_(p)
    resumed.load_state_dict(copy.deepcopy(saved))
    torch.manual_seed(3)
    ref_params = [nn.Parameter(p.detach().clone()) for p in _complex_run(0)[0]]
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=1e-2)
    for s in range(2):
        for p in ref_params:
            p.grad = torch.full_like(p, 0.5 * (s + 1))
        ref.step()
    for group in (params, resumed_params, ref_params):
        for p in group:
            p.grad = torch.full_like(p, 0.25)
    opt.step()
    resumed.step()
    ref.step()
    for p, r, t in zip(params, resumed_params, ref_params):
        assert torch.equal(r, p)
        assert torch.equal(t, p)
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg"][1] = complex(float("nan"), 0.0)
    with pytest.raises(ValueError, match="param 0: exp_avg holds 1 NaN or infinite values"):
        resumed.load_state_dict(bad)


@pytest.mark.parametrize("rung", ["fp32", "8bit"])
def test_every_group_saves_its_rounding_options_on_every_rung(rung: str) -> None:
    """``seed``, ``rounding`` and ``param_rounding`` are group keys saved in
    ``state_dict()`` on every rung, also where the engine uses none of them (the fp32
    rung of float32 params runs torch's AdamW, the 8bit rung bitsandbytes'): a later
    move to the bf16 rung, here or after a resume, rounds with them. A group's own value
    wins; a group added later takes the optimizer's."""
    torch.manual_seed(0)
    model = nn.Linear(80, 64)
    opt = choose_optimizer(
        [{"params": [model.weight]}, {"params": [model.bias], "seed": 5, "rounding": "stochastic"}],
        rung=rung,
        seed=3,
        rounding="nearest",
        param_rounding="nearest",
        free_memory="64GiB",
    )
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))]})
    saved = opt.state_dict()["param_groups"]
    assert [(g["seed"], g["rounding"], g["param_rounding"]) for g in saved] == [
        (3, "nearest", "nearest"),
        (5, "stochastic", "nearest"),
        (3, "nearest", "nearest"),
    ]


def test_a_run_resumed_with_another_seed_escalates_as_the_uninterrupted_run() -> None:
    """A run on the fp32 rung (float32 params: torch's AdamW) saved after 2 steps and
    resumed in an optimizer built with the default seed, then escalated to bf16, ends bit
    for bit where the uninterrupted run (seed 3) ends: the checkpoint carries the seed of
    the bf16 rung's stochastic rounding. A run with seed 0 throughout ends elsewhere (the
    seed matters)."""

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(80, 64)

    def steps(m: nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
        for s in seeds:
            for i, p in enumerate(m.parameters()):
                g = torch.Generator().manual_seed(10 * s + i)
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    def uninterrupted(seed: int) -> nn.Module:
        m = fresh()
        opt = choose_optimizer(m, lr=1e-2, seed=seed, free_memory="64GiB")
        steps(m, opt, range(2))
        opt.escalate("test")
        steps(m, opt, range(2, 4))
        return m

    first = fresh()
    opt = choose_optimizer(first, lr=1e-2, seed=3, free_memory="64GiB")
    steps(first, opt, range(2))
    assert opt.rung == "fp32"
    ckpt = copy.deepcopy({"model": first.state_dict(), "optim": opt.state_dict()})
    resumed = fresh()
    resumed.load_state_dict(ckpt["model"])
    opt = choose_optimizer(resumed, lr=1e-2, free_memory="64GiB")  # seed 0
    opt.load_state_dict(ckpt["optim"])
    opt.escalate("test")
    assert opt.rung == "bf16"
    steps(resumed, opt, range(2, 4))
    for a, b in zip(resumed.parameters(), uninterrupted(3).parameters(), strict=True):
        assert torch.equal(a, b)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(resumed.parameters(), uninterrupted(0).parameters(), strict=True)
    )


@pytest.mark.parametrize("rung", RUNGS)
def test_a_checkpoint_whose_moments_require_grad_loads_as_plain_state(rung: str) -> None:
    """Moments saved with ``requires_grad=True`` (state made by hand, or by code that
    tracked it) were cloned with their autograd history: the state held tensors that
    are not graph leaves, so ``copy.deepcopy(opt.state_dict())`` raised ('Only Tensors
    created explicitly by the user ... support the deepcopy protocol'), where torch's
    AdamW takes the same checkpoint. They load as the same checkpoint without the flag."""
    torch.manual_seed(0)
    w = torch.randn(64, 80)
    p = nn.Parameter(w.clone())
    source = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    source.step()
    plain = copy.deepcopy(source.state_dict())
    tracked = copy.deepcopy(plain)
    for name in ("exp_avg", "exp_avg_sq"):
        tracked["state"][0][name].requires_grad_()
    loaded = []
    for saved in (plain, tracked):
        q = nn.Parameter(w.clone())
        opt = choose_optimizer([q], lr=1e-2, rung=rung, free_memory="1GiB")
        opt.load_state_dict(saved)
        loaded.append(snapshot(opt))  # deep-copies the state dict
        assert not any(
            t.requires_grad
            for t in unwrap_bnb_state(opt.state[q]).values()
            if isinstance(t, torch.Tensor)
        )
    assert_same(loaded[1], loaded[0])
