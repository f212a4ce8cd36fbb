"""measure_footprint: trainable params and their optimizer-state bytes on every rung.

Hand rules used below (DESIGN.md, "The rungs"), for a param of n elements:

- fp32 rung: two moments of max(float32, param dtype): 8n bytes for float32/bf16/fp16
  params, 16n for float64 and complex64 params (complex64 is 8 bytes per element).
- bf16 rung: two bfloat16 moments: 4n bytes.
- 8bit rung (bitsandbytes): n < 4096 keeps two float32 moments, 8n bytes; n >= 4096 keeps
  two uint8 codes per element plus one float32 absmax per 256-element block and moment,
  2n + 2*4*ceil(n/256) bytes; plus 2 * 256 * 4 = 2048 bytes of code books per device that
  holds at least one 8-bit tensor.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from optladder.policies.footprint import Footprint, measure_footprint, rung_state_bytes

QMAPS = 2 * 256 * 4  # two 256-entry float32 code books


@pytest.mark.parametrize(
    ("rung", "numel", "dtype", "expected"),
    [
        ("fp32", 100, torch.float32, 800),  # 2 * 100 * 4
        ("fp32", 1000, torch.bfloat16, 8000),  # float32 moments for bf16 params
        ("fp32", 1000, torch.float16, 8000),
        ("fp32", 1000, torch.float64, 16000),  # 2 * 1000 * 8
        ("fp32", 1000, torch.complex64, 16000),  # 2 * 1000 * 8
        ("bf16", 100, torch.float32, 400),  # 2 * 100 * 2
        ("bf16", 1000, torch.bfloat16, 4000),
        ("8bit", 100, torch.float32, 800),  # under 4096: 2 * 100 * 4
        ("8bit", 4095, torch.float32, 32760),  # 2 * 4095 * 4
        ("8bit", 4095, torch.bfloat16, 32760),  # still float32 state for bf16 params
        ("8bit", 4096, torch.float32, 8320),  # 8192 + 8 * 16 blocks
        ("8bit", 5000, torch.float32, 10160),  # 10000 + 8 * ceil(19.53) = 8 * 20
        ("8bit", 70000, torch.float32, 142192),  # 140000 + 8 * ceil(273.4) = 8 * 274
        ("8bit", 70000, torch.bfloat16, 142192),
    ],
)
def test_rung_state_bytes(rung: str, numel: int, dtype: torch.dtype, expected: int) -> None:
    assert rung_state_bytes(rung, numel, dtype) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rung", "numel", "local", "expected"),
    [
        ("fp32", 6000, 3000, 24000),  # 2 * 3000 * 4: this rank's shard only
        ("bf16", 6000, 3000, 12000),  # 2 * 3000 * 2
        # the global 6000 >= 4096 quantizes the 3000-element shard, in its own blocks:
        # 2 * 3000 + 2 * 4 * ceil(3000 / 256) = 6000 + 8 * 12
        ("8bit", 6000, 3000, 6096),
        ("8bit", 3000, 1500, 12000),  # global 3000 < 4096: float32, 2 * 1500 * 4
        ("8bit", 8192, 8192, 16640),  # unsharded: as without local_numel
        ("8bit", 8192, 0, 0),  # an empty shard holds nothing
    ],
)
def test_rung_state_bytes_of_a_shard(rung: str, numel: int, local: int, expected: int) -> None:
    assert rung_state_bytes(rung, numel, torch.float32, local) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("numel", "local"), [(10, 11), (10, -1), (-1, None)])
def test_rung_state_bytes_refuses_impossible_counts(numel: int, local: int | None) -> None:
    with pytest.raises(ValueError, match="local_numel"):
        rung_state_bytes("fp32", numel, torch.float32, local)


@pytest.mark.parametrize(
    ("dtype", "fp32_per_param"),
    [
        (torch.float32, 8),
        (torch.bfloat16, 8),  # float32 moments, not torch's bf16 ones
        (torch.float16, 8),
        (torch.float64, 16),
        (torch.complex64, 16),
    ],
)
def test_bytes_per_param_by_dtype(dtype: torch.dtype, fp32_per_param: int) -> None:
    p = nn.Parameter(torch.zeros(10, 10, dtype=dtype))  # 100 elements: under 4096
    fp = measure_footprint([p])
    assert fp.trainable_params == 100
    assert fp.bytes_per_param("fp32") == fp32_per_param
    assert fp.bytes_per_param("bf16") == 4
    assert fp.bytes_per_param("8bit") == 8  # float32 state under bitsandbytes' minimum
    assert fp.dtypes == (str(dtype).removeprefix("torch."),)
    assert fp.has_complex is dtype.is_complex


def test_tied_embedding_is_counted_once() -> None:
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            self.norm = nn.LayerNorm(64)
            self.head = nn.Linear(64, 1000, bias=False)
            self.head.weight = self.embed.weight  # one Parameter, used twice

    model = TiedLM()
    fp = measure_footprint(model)
    # embed/head weight 64,000 once + LayerNorm weight 64 + bias 64
    assert fp.trainable_params == 64_000 + 128
    assert fp.param_tensors == 3
    assert fp.largest_param == 64_000
    assert fp.state_bytes["fp32"] == 8 * 64_128
    # A plain list that repeats the tied Parameter (embed.weight and head.weight).
    listed = [model.embed.weight, model.head.weight, model.norm.weight, model.norm.bias]
    assert measure_footprint(listed) == fp
    # The same Parameter in two param groups is counted once too.
    groups = [{"params": [model.embed.weight]}, {"params": [model.head.weight]}]
    assert measure_footprint(groups).trainable_params == 64_000


def test_frozen_layers_are_skipped_and_counted_apart() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    model[0].requires_grad_(False)
    fp = measure_footprint(model)
    assert fp.trainable_params == 20 * 5 + 5  # 105
    assert fp.frozen_params == 10 * 20 + 20  # 220
    assert fp.param_tensors == 2
    assert fp.state_bytes == {"fp32": 8 * 105, "bf16": 4 * 105, "8bit": 8 * 105}
    # A frozen tensor in a plain list is counted once as frozen, however often it appears.
    frozen = torch.zeros(7)
    fp = measure_footprint([frozen, nn.Parameter(torch.zeros(3)), frozen])
    assert (fp.trainable_params, fp.frozen_params) == (3, 7)


def test_meta_model_is_measured_without_allocating() -> None:
    # 10**12 + 10**6 float32 elements: 4 TB of params, 8 TB of fp32 moments. Allocating
    # any of it would fail, so a pass shows that only shapes and dtypes were read.
    with torch.device("meta"):
        model = nn.Linear(1_000_000, 1_000_000)
    assert model.weight.is_meta
    fp = measure_footprint(model)
    n_w, n_b = 10**12, 10**6
    assert fp.trainable_params == n_w + n_b
    assert fp.devices == ("meta",)
    assert fp.dtypes == ("float32",)
    assert fp.state_bytes["fp32"] == 8 * (n_w + n_b)
    assert fp.state_bytes["bf16"] == 4 * (n_w + n_b)
    # weight: 2e12 + 8 * (1e12 / 256 = 3,906,250,000 blocks); bias: 2e6 + 8 * ceil(3906.25)
    assert fp.state_bytes["8bit"] == (2 * n_w + 8 * 3_906_250_000) + (2 * n_b + 8 * 3907) + QMAPS


def test_meta_model_built_with_device_argument() -> None:
    model = nn.Embedding(50_000, 1024, device="meta")
    fp = measure_footprint(model)
    assert fp.trainable_params == 51_200_000
    assert fp.devices == ("meta",)
    # 51,200,000 / 256 = 200,000 blocks exactly
    assert fp.state_bytes["8bit"] == 2 * 51_200_000 + 8 * 200_000 + QMAPS


def test_meta_params_are_not_merged_by_storage() -> None:
    # Meta tensors have no storage to compare: two distinct Parameters are two params.
    a = nn.Parameter(torch.empty(100, device="meta"))
    b = nn.Parameter(torch.empty(100, device="meta"))
    assert measure_footprint([a, b]).trainable_params == 200
    assert measure_footprint([a, a]).trainable_params == 100  # the same object, once


def test_parameters_viewing_the_same_storage_are_merged_on_cpu() -> None:
    t = torch.zeros(100)
    a, b = nn.Parameter(t), nn.Parameter(t)
    assert a is not b and a.data_ptr() == b.data_ptr()
    fp = measure_footprint([a, b])
    assert (fp.trainable_params, fp.param_tensors) == (100, 1)
    # Distinct views of one storage are distinct params: 50 + 50 elements.
    halves = [nn.Parameter(t[:50]), nn.Parameter(t[50:])]
    fp = measure_footprint(halves)
    assert (fp.trainable_params, fp.param_tensors) == (100, 2)


def test_inputs_module_iterables_groups_and_a_tensor_agree() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))  # 36 + 10 = 46 elements
    fp = measure_footprint(model)
    assert fp.trainable_params == 46
    assert measure_footprint(model.parameters()) == fp  # a generator
    assert measure_footprint(list(model.parameters())) == fp
    assert measure_footprint(tuple(model.parameters())) == fp
    groups = [
        {"params": model[0].parameters(), "lr": 0.1},
        {"params": model[1].weight, "weight_decay": 0.0},  # a lone tensor in a group
        {"params": [model[1].bias]},
    ]
    assert measure_footprint(groups) == fp
    w = nn.Parameter(torch.zeros(3, 3))
    assert measure_footprint(w).trainable_params == 9


def test_dtypes_and_devices_are_recorded() -> None:
    params = [
        nn.Parameter(torch.zeros(10)),
        nn.Parameter(torch.zeros(10, dtype=torch.bfloat16)),
        nn.Parameter(torch.zeros(10, dtype=torch.bfloat16)),
        nn.Parameter(torch.empty(10, dtype=torch.float16, device="meta")),
    ]
    fp = measure_footprint(params)
    assert fp.dtypes == ("bfloat16", "float16", "float32")  # sorted, once each
    assert fp.devices == ("cpu", "meta")
    assert fp.has_complex is False


@pytest.mark.parametrize(
    ("cpu_numel", "meta_numel", "books"),
    [
        (5000, 5000, 2),  # an 8-bit tensor on each device: code books on each
        (100, 5000, 1),  # the CPU tensor keeps 32-bit state: no CPU code books
        (100, 4095, 0),  # no 8-bit tensor at all
    ],
)
def test_8bit_code_books_per_device(cpu_numel: int, meta_numel: int, books: int) -> None:
    params = [
        nn.Parameter(torch.zeros(cpu_numel)),
        nn.Parameter(torch.empty(meta_numel, device="meta")),
    ]
    fp = measure_footprint(params)

    def moments(n: int) -> int:
        return 8 * n if n < 4096 else 2 * n + 8 * -(-n // 256)

    assert fp.state_bytes["8bit"] == moments(cpu_numel) + moments(meta_numel) + books * QMAPS


def _mixed_model() -> nn.Module:
    model = nn.ModuleDict(
        {
            "a": nn.Linear(70, 90),  # weight 6300 (>= 4096, 6300/256 = 24.6), bias 90
            "b": nn.Linear(90, 45),  # weight 4050 (< 4096), bias 45
            "e": nn.Embedding(300, 17),  # 5100 (>= 4096, 5100/256 = 19.9)
        }
    )
    model.register_parameter("edge", nn.Parameter(torch.randn(64, 64)))  # 4096 exactly
    model.register_parameter("under", nn.Parameter(torch.randn(4095)))  # one under
    return model


# Hand computation of the mixed model's 8-bit state:
#   weight 6300: 2*6300 + 8*ceil(6300/256 = 24.6) = 12600 + 8*25 = 12800
#   bias     90: 8*90                                               =   720
#   weight 4050: 8*4050                                             = 32400
#   bias     45: 8*45                                               =   360
#   embed  5100: 2*5100 + 8*ceil(5100/256 = 19.9) = 10200 + 8*20 = 10360
#   edge   4096: 2*4096 + 8*16                    =  8192 + 128   =  8320
#   under  4095: 8*4095                                             = 32760
#   code books (one device)                                         =  2048
#   total                                                           = 99768
MIXED_NUMEL = 6300 + 90 + 4050 + 45 + 5100 + 4096 + 4095  # 23,776
MIXED_8BIT_BYTES = 99_768


def _state_storage_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the unique storages of the optimizer's state tensors (shared code books
    counted once), without the 0-d step counters."""
    storages: dict[int, int] = {}
    for state in opt.state.values():
        for key, value in state.items():
            if key == "step" or not torch.is_tensor(value):
                continue
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _one_step(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


def test_8bit_estimate_equals_what_bitsandbytes_allocates() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = _mixed_model()
    fp = measure_footprint(model)
    assert fp.trainable_params == MIXED_NUMEL
    assert fp.state_bytes["8bit"] == MIXED_8BIT_BYTES
    params = list(model.parameters())
    opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    _one_step(opt, params)
    assert _state_storage_bytes(opt) == MIXED_8BIT_BYTES


def test_fp32_estimate_equals_what_torch_adamw_allocates() -> None:
    torch.manual_seed(0)
    model = _mixed_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    _one_step(opt, params)
    assert _state_storage_bytes(opt) == 8 * MIXED_NUMEL  # float32 exp_avg + exp_avg_sq
    assert measure_footprint(model).state_bytes["fp32"] == 8 * MIXED_NUMEL


def test_footprint_is_frozen() -> None:
    fp = measure_footprint([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValidationError):
        fp.trainable_params = 5  # type: ignore[misc]
    assert isinstance(fp, Footprint)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(3, 3)).requires_grad_(False),  # all frozen
        lambda: [torch.zeros(3)],  # a plain tensor without requires_grad
        lambda: nn.ReLU(),  # a module without params
        lambda: [],
        lambda: [{"params": []}],
    ],
)
def test_no_trainable_params_raises(make) -> None:
    with pytest.raises(ValueError, match="trainable"):
        measure_footprint(make())


@pytest.mark.parametrize(
    "bad",
    [
        42,
        "weights",
        None,
        [1, 2],
        [nn.Parameter(torch.zeros(2)), "x"],
        [{"params": [nn.Parameter(torch.zeros(2))]}, nn.Parameter(torch.zeros(2))],
        [{"params": [3.0]}],
    ],
)
def test_wrong_type_raises_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        measure_footprint(bad)


def test_param_group_without_params_key() -> None:
    with pytest.raises(ValueError, match="'params'"):
        measure_footprint([{"lr": 0.1}])
