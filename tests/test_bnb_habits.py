"""bitsandbytes habits on the 8bit rung: per-param 32-bit overrides and foreign code books.

Expected values come from plain ``bitsandbytes.optim.AdamW8bit`` (the control) and from
hand counts of bitsandbytes' layout: float32 moments are 8 bytes per element; 8-bit
moments are 2 bytes per element plus 2 x 4 bytes per started 256-element block; the two
shared code books are 2 x 256 x 4 = 2,048 bytes per device.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from optladder import choose_optimizer, measure_footprint, measure_state_bytes
from optladder.bnb_overrides import param_override, quantized_8bit

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

EMB = (100, 48)  # 4,800 elements: over bitsandbytes' 4,096, so 8-bit unless overridden
LIN = (48, 96)  # weight 96 x 48 = 4,608 elements, bias 96


def _f32(n: int) -> int:
    return 2 * 4 * n


def _u8(n: int) -> int:
    return 2 * n + 2 * 4 * -(-n // 256)


QMAPS = 2 * 256 * 4


@pytest.fixture
def manager() -> Iterator[Any]:
    """bitsandbytes' process-wide override manager, emptied before and after."""
    mng = bnb.optim.GlobalOptimManager.get_instance()
    mng.initialize()
    yield mng
    mng.initialize()


class Net(torch.nn.Module):
    def __init__(self, stable: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        emb = bnb.nn.StableEmbedding(*EMB) if stable else torch.nn.Embedding(*EMB)
        self.emb = emb
        self.head = torch.nn.Linear(*LIN)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).pow(2).mean()


IDX = torch.randint(0, EMB[0], (40,), generator=torch.Generator().manual_seed(1))


def _step(net: Net, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    net(IDX).backward()
    opt.step()


def _dtypes(opt: torch.optim.Optimizer, net: Net) -> list[torch.dtype]:
    return [opt.state[p]["state1"].dtype for p in net.parameters()]


def _choose(net: torch.nn.Module, rung: str | None = "8bit") -> Any:
    return choose_optimizer(net, lr=1e-3, rung=rung, free_memory="64GiB", environ={})


def test_stable_embedding_keeps_float32_state_as_plain_adamw8bit(manager: Any) -> None:
    net = Net(stable=True)  # each StableEmbedding registers its own module override
    ctl_net = Net(stable=True)
    ctl = bnb.optim.AdamW8bit(ctl_net.parameters(), lr=1e-3)
    _step(ctl_net, ctl)
    opt = _choose(net)
    _step(net, opt)
    # emb.weight, emb.norm.weight, emb.norm.bias (StableEmbedding's LayerNorm), head
    f32, u8 = torch.float32, torch.uint8
    assert _dtypes(ctl, ctl_net) == [f32, f32, f32, u8, f32]
    assert _dtypes(opt, net) == _dtypes(ctl, ctl_net)
    expected = (
        _f32(EMB[0] * EMB[1]) + 2 * _f32(EMB[1]) + _u8(LIN[0] * LIN[1]) + _f32(LIN[1]) + QMAPS
    )
    assert expected == 51_344
    assert measure_state_bytes(ctl) == expected
    assert measure_state_bytes(opt) == expected
    assert measure_footprint(net).state_bytes["8bit"] == expected
    # the same update as bitsandbytes' own optimizer (same state format; on the CPU
    # optladder's 8-bit kernel takes IEEE sqrt where bitsandbytes' torch ops take torch's
    # vectorized sqrt, within 0.5001 ulp (SLEEF's u05): the denominator can differ by an
    # ulp, so a param by a few float32 ulps of its value or of the update (~lr)
    for p, q in zip(net.parameters(), ctl_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=4 * 2**-23, atol=4 * 2**-23 * 1e-3)


@pytest.mark.parametrize("path", ["8bit", "escalated"])
def test_override_config_optim_bits_32_directly_and_after_escalation(
    manager: Any, path: str
) -> None:
    net = Net(stable=False)
    manager.register_parameters(net.parameters())
    manager.override_config(net.emb.weight, "optim_bits", 32)
    if path == "8bit":
        opt = _choose(net)
        _step(net, opt)
    else:
        opt = _choose(net, rung=None)  # plenty of memory: the decision is fp32
        assert opt.rung == "fp32"
        _step(net, opt)
        exp_avg = opt.state[net.emb.weight]["exp_avg"].clone()
        exp_avg_sq = opt.state[net.emb.weight]["exp_avg_sq"].clone()
        opt.migrate_to("8bit", "test: escalate straight to 8bit")
        assert opt.rung == "8bit"
        # float32 moments carried exactly: no quantization for the overridden param
        assert torch.equal(opt.state[net.emb.weight]["state1"], exp_avg)
        assert torch.equal(opt.state[net.emb.weight]["state2"], exp_avg_sq)
        _step(net, opt)
    assert _dtypes(opt, net) == [torch.float32, torch.uint8, torch.float32]
    expected = _f32(EMB[0] * EMB[1]) + _u8(LIN[0] * LIN[1]) + _f32(LIN[1]) + QMAPS
    assert measure_state_bytes(opt) == measure_footprint(net).state_bytes["8bit"] == expected


def test_min_8bit_size_override_both_ways(manager: Any) -> None:
    net = Net(stable=False)
    manager.override_config(net.head.weight, "min_8bit_size", 10**6)  # kept in float32
    manager.override_config(net.head.bias, "min_8bit_size", 0)  # 96 elements quantized
    opt = _choose(net)
    _step(net, opt)
    assert _dtypes(opt, net) == [torch.uint8, torch.float32, torch.uint8]
    assert opt.state[net.head.bias]["absmax1"].numel() == 1
    expected = _u8(EMB[0] * EMB[1]) + _f32(LIN[0] * LIN[1]) + _u8(LIN[1]) + QMAPS
    assert measure_state_bytes(opt) == measure_footprint(net).state_bytes["8bit"] == expected
    # plain bitsandbytes makes the same choice
    ctl_net = Net(stable=False)
    manager.override_config(ctl_net.head.weight, "min_8bit_size", 10**6)
    manager.override_config(ctl_net.head.bias, "min_8bit_size", 0)
    ctl = bnb.optim.AdamW8bit(ctl_net.parameters(), lr=1e-3)
    _step(ctl_net, ctl)
    assert _dtypes(ctl, ctl_net) == _dtypes(opt, net)


def test_unsupported_optim_bits_override_is_refused_before_anything_is_built(
    manager: Any,
) -> None:
    net = Net(stable=False)
    manager.override_config(net.emb.weight, "optim_bits", 16)
    with pytest.raises(ValueError, match=r"optim_bits=16; allowed: 8 or 32"):
        _choose(net)
    with pytest.raises(ValueError, match=r"trainable param 0: .*optim_bits=16"):
        measure_footprint(net)
    assert all(p.grad is None for p in net.parameters())


def test_overrides_are_read_without_importing_bitsandbytes(
    manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = torch.nn.Parameter(torch.zeros(5000))
    manager.override_config(p, "optim_bits", 32)
    assert param_override(p) == {"optim_bits": 32}
    assert not quantized_8bit(p, "p")
    monkeypatch.delitem(sys.modules, "bitsandbytes.optim.optimizer")
    assert param_override(p) == {}  # never imported: no override can exist
    assert quantized_8bit(p, "p")


# --- checkpoints whose code books are not bitsandbytes' default ones ---------------


def _linear_checkpoint(
    model: torch.nn.Linear, signed: torch.Tensor, unsigned: torch.Tensor
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """An AdamW8bit-layout state_dict (step 3) quantized with the given code books,
    and the first and second moments its codes stand for under those books."""
    g = torch.Generator().manual_seed(11)
    w = model.weight
    m = 0.01 * torch.randn(w.shape, generator=g)
    v = (0.002 * torch.randn(w.shape, generator=g)) ** 2
    c1, a1 = torch.ops.bitsandbytes.quantize_blockwise(m.reshape(-1), signed, 256)
    c2, a2 = torch.ops.bitsandbytes.quantize_blockwise(v.reshape(-1), unsigned, 256)

    def decode(codes: torch.Tensor, absmax: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
        # by hand: value = book[code] * absmax of its 256-element block
        scale = absmax.repeat_interleave(256)[: codes.numel()]
        return (book[codes.long()] * scale).reshape(w.shape)

    state = {
        0: {
            "step": 3,
            "state1": c1.reshape(w.shape),
            "state2": c2.reshape(w.shape),
            "absmax1": a1,
            "absmax2": a2,
            "qmap1": signed,
            "qmap2": unsigned,
        },
        1: {"step": 3, "state1": torch.zeros(LIN[1]), "state2": torch.zeros(LIN[1])},
    }
    groups = [
        {
            "lr": 1e-3,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.01,
            "params": [0, 1],
            "rung": "8bit",
            "rung_origin": "fixed",
            "rung_reason": "test",
        }
    ]
    ckpt = {"state": state, "param_groups": groups}
    return ckpt, decode(c1, a1, signed), decode(c2, a2, unsigned)


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(*LIN)


LINEAR_SIGNED = torch.linspace(-1.0, 1.0, 256)
LINEAR_UNSIGNED = torch.linspace(0.0, 1.0, 256)


def test_foreign_code_books_are_decoded_exactly_on_fp32() -> None:
    model = _model()
    opt = _choose(model, rung="fp32")
    ckpt, m, v = _linear_checkpoint(model, LINEAR_SIGNED, LINEAR_UNSIGNED)
    opt.load_state_dict(ckpt)
    assert torch.equal(opt.state[model.weight]["exp_avg"], m)
    assert torch.equal(opt.state[model.weight]["exp_avg_sq"], v)


def test_foreign_code_books_are_decoded_then_requantized_on_8bit() -> None:
    model = _model()
    opt = _choose(model)
    ckpt, m, v = _linear_checkpoint(model, LINEAR_SIGNED, LINEAR_UNSIGNED)
    opt.load_state_dict(ckpt)
    st = opt.state[model.weight]
    dynamic = F.create_dynamic_map(signed=True)
    udynamic = F.create_dynamic_map(signed=False)
    assert torch.equal(st["qmap1"], dynamic) and torch.equal(st["qmap2"], udynamic)

    def read(i: int, book: torch.Tensor) -> torch.Tensor:
        scale = st[f"absmax{i}"].repeat_interleave(256)
        return (book[st[f"state{i}"].reshape(-1).long()] * scale).reshape(m.shape)

    # one re-quantization with bitsandbytes' dynamic map: within 2% of each block's max
    for i, book, want in ((1, dynamic, m), (2, udynamic, v)):
        block_max = want.reshape(-1, 256).abs().amax(1).repeat_interleave(256).reshape(m.shape)
        err = (read(i, book) - want).abs() / block_max
        assert err.max().item() < 0.02, (i, err.max().item())
    # what keeping the codes under the engine's book gave before: off by far more
    saved = ckpt["state"][0]
    kept = dynamic[saved["state1"].reshape(-1).long()] * saved["absmax1"].repeat_interleave(256)
    assert (kept.reshape(m.shape) - m).abs().max().item() / m.abs().max().item() > 0.2


def test_each_engine_owns_bitsandbytes_code_books() -> None:
    """The 8bit engine's code books are bitsandbytes' own (``create_dynamic_map``, what
    plain ``AdamW8bit`` holds), and two engines do not share the tensors. They are made
    when the first state is (as bitsandbytes' ``init_state`` makes them when missing),
    not in construction, which allocates no tensor."""
    ctl = bnb.optim.AdamW8bit(_model().parameters(), lr=1e-3)
    models = [_model(), _model()]
    opts = [_choose(m) for m in models]
    first, second = (opt.engine.eightbit_groups() for opt in opts)  # the 8bit groups
    assert "dynamic" not in first.name2qmap and "udynamic" not in first.name2qmap
    for model, opt in zip(models, opts):
        model(torch.randn(4, LIN[0])).sum().backward()
        opt.step()
    for i, (name, signed) in enumerate((("dynamic", True), ("udynamic", False)), start=1):
        want = F.create_dynamic_map(signed=signed)
        assert torch.equal(ctl.name2qmap[name], want)
        assert torch.equal(first.name2qmap[name], want)
        held = first.state[models[0].weight][f"qmap{i}"]
        assert held is first.name2qmap[name]
        assert first.name2qmap[name].data_ptr() != second.name2qmap[name].data_ptr()


def test_default_code_books_keep_the_codes_bit_for_bit() -> None:
    model = _model()
    opt = _choose(model)
    dynamic = F.create_dynamic_map(signed=True)
    udynamic = F.create_dynamic_map(signed=False)
    ckpt, _, _ = _linear_checkpoint(model, dynamic, udynamic)
    opt.load_state_dict(ckpt)
    st = opt.state[model.weight]
    saved = ckpt["state"][0]
    for key in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(st[key], saved[key]), key


@pytest.mark.parametrize(
    ("qmap", "match"),
    [
        (torch.full((256,), float("nan")), "qmap1 .* holds non-finite values"),
        (torch.linspace(-1.0, 1.0, 255), "qmap1, a code book of 256 floating values; got a "),
        (torch.arange(256, dtype=torch.int32), "got a torch.int32 tensor of 256 elements"),
    ],
)
def test_undecodable_code_books_are_refused_and_nothing_changes(
    qmap: torch.Tensor, match: str
) -> None:
    model = _model()
    opt = _choose(model)
    g = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    before = {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in opt.state.items()
    }
    params_before = [p.detach().clone() for p in model.parameters()]
    ckpt, _, _ = _linear_checkpoint(model, LINEAR_SIGNED, LINEAR_UNSIGNED)
    ckpt["state"][0]["qmap1"] = qmap
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(ckpt)
    for p, b in zip(model.parameters(), params_before, strict=True):
        assert torch.equal(p, b)
    for p, s in opt.state.items():
        for k, v in s.items():
            w = before[id(p)][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
