"""Free-memory probes: host and cgroup on the CPU, NVML handle mapping and CUDA fallback."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from optladder.policies import memory
from optladder.policies.memory import (
    MemoryProbe,
    cgroup_free_bytes,
    cuda_free_bytes,
    host_free_bytes,
    nvml_handle_for,
    probe_free_memory,
)

# ---------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cpu_probe_is_positive_and_at_most_the_host_total(device: object) -> None:
    probe = probe_free_memory(device)  # type: ignore[arg-type]
    assert isinstance(probe, MemoryProbe)
    assert probe.device == "cpu"
    assert 0 < probe.free_bytes <= psutil.virtual_memory().total
    assert probe.source


def _no_rlimit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        memory.resource, "getrlimit", lambda _: (memory.resource.RLIM_INFINITY,) * 2
    )


def test_host_free_is_psutil_available_without_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_rlimit(monkeypatch)
    monkeypatch.setattr(memory, "cgroup_free_bytes", lambda: None)
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=5000))
    assert host_free_bytes() == (5000, "host available memory (psutil)")


@pytest.mark.parametrize(
    ("available", "cgroup", "expected"),
    [
        (5000, 1234, 1234),  # the cgroup limit is tighter
        (5000, 9999, 5000),  # the host is tighter
        (5000, None, 5000),  # no cgroup limit
    ],
)
def test_host_free_is_bounded_by_the_cgroup(
    monkeypatch: pytest.MonkeyPatch, available: int, cgroup: int | None, expected: int
) -> None:
    _no_rlimit(monkeypatch)
    monkeypatch.setattr(memory, "cgroup_free_bytes", lambda: cgroup)
    monkeypatch.setattr(
        memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=available)
    )
    free, source = host_free_bytes()
    assert free == expected
    assert ("cgroup" in source) == (expected != available)


def test_host_free_is_bounded_by_rlimit_as(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "cgroup_free_bytes", lambda: None)
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=5000))
    monkeypatch.setattr(memory.resource, "getrlimit", lambda _: (1500, 1500))
    fake_process = SimpleNamespace(memory_info=lambda: SimpleNamespace(vms=1000))
    monkeypatch.setattr(memory.psutil, "Process", lambda: fake_process)
    free, source = host_free_bytes()
    assert free == 500  # 1500 limit - 1000 already mapped
    assert "RLIMIT_AS" in source


# ------------------------------------------------------------------------- cgroups


def _cgroup_tree(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line)
    return root, proc


V1_NO_LIMIT = str(2**63 - 4096)  # 9223372036854771712: how cgroup v1 spells "no limit"


@pytest.mark.parametrize(
    ("proc_line", "files", "expected"),
    [
        pytest.param(
            "0::/job\n",
            {"job/memory.max": "1073741824\n", "job/memory.current": "73741824\n"},
            1_000_000_000,  # 2**30 - 73,741,824
            id="v2",
        ),
        pytest.param(
            "0::/job\n",
            {"job/memory.max": "max\n", "job/memory.current": "73741824\n"},
            None,
            id="v2-max-is-no-limit",
        ),
        pytest.param(
            "0::/\n",
            {"memory.max": "4096\n", "memory.current": "1000\n"},
            3096,
            id="v2-namespace-root",
        ),
        pytest.param(
            "0::/host/path/job\n",  # no cgroup namespace: the mount is the job's cgroup
            {"memory.max": "4096\n", "memory.current": "1000\n"},
            3096,
            id="v2-fallback-to-mount",
        ),
        pytest.param(
            "0::/job\n",
            {"job/memory.max": "1000\n", "job/memory.current": "1500\n"},
            0,  # over the limit (reclaimable cache): nothing left, never negative
            id="v2-usage-over-limit",
        ),
        pytest.param(
            "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n1:name=systemd:/docker/abc\n",
            {
                "memory/docker/abc/memory.limit_in_bytes": "2147483648\n",
                "memory/docker/abc/memory.usage_in_bytes": "147483648\n",
            },
            2_000_000_000,  # 2**31 - 147,483,648
            id="v1",
        ),
        pytest.param(
            "5:memory:/docker/abc\n",
            {
                "memory/memory.limit_in_bytes": "2147483648\n",
                "memory/memory.usage_in_bytes": "147483648\n",
            },
            2_000_000_000,
            id="v1-fallback-to-mount",
        ),
        pytest.param(
            "5:memory:/docker/abc\n",
            {
                "memory/docker/abc/memory.limit_in_bytes": V1_NO_LIMIT + "\n",
                "memory/docker/abc/memory.usage_in_bytes": "147483648\n",
            },
            None,
            id="v1-huge-is-no-limit",
        ),
        pytest.param("5:memory:/docker/abc\n", {}, None, id="no-files"),
        pytest.param("", {}, None, id="empty-proc"),
    ],
)
def test_cgroup_free_bytes(
    tmp_path: Path, proc_line: str, files: dict[str, str], expected: int | None
) -> None:
    root, proc = _cgroup_tree(tmp_path, proc_line, files)
    assert cgroup_free_bytes(root=root, proc=proc) == expected


def test_cgroup_free_bytes_without_proc_file(tmp_path: Path) -> None:
    assert cgroup_free_bytes(root=tmp_path, proc=tmp_path / "missing") is None


# ---------------------------------------------------------------------------- NVML

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
UUIDS = [
    "GPU-aaaa1111-0000-0000-0000-000000000000",
    "GPU-bbbb2222-0000-0000-0000-000000000000",
    "GPU-bbbb3333-0000-0000-0000-000000000000",
    "GPU-cccc4444-0000-0000-0000-000000000000",
]


class FakeNVML:
    """Four GPUs in NVML (PCI bus) order; handles are ``("handle", nvml_index)``."""

    def __init__(self, names: list[str], uuid_bytes: bool = False) -> None:
        self.names = names
        self.uuid_bytes = uuid_bytes

    def nvmlDeviceGetCount(self) -> int:
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[str, int]:
        assert 0 <= i < len(self.names)
        return ("handle", i)

    def nvmlDeviceGetUUID(self, handle: tuple[str, int]) -> str | bytes:
        uuid = UUIDS[handle[1]]
        return uuid.encode() if self.uuid_bytes else uuid

    def nvmlDeviceGetName(self, handle: tuple[str, int]) -> str:
        return self.names[handle[1]]


SAME = [H100] * 4
MIXED = [H100, A100, H100, A100]


@pytest.mark.parametrize(
    ("names", "env", "index", "nvml_index"),
    [
        (SAME, {}, 0, 0),
        (SAME, {}, 3, 3),
        (SAME, {"CUDA_VISIBLE_DEVICES": "2,0"}, 0, 2),
        (SAME, {"CUDA_VISIBLE_DEVICES": "2,0"}, 1, 0),
        (SAME, {"CUDA_VISIBLE_DEVICES": " 3 , 1 "}, 1, 1),
        (SAME, {"CUDA_VISIBLE_DEVICES": "1,7,0"}, 0, 1),  # 7 cuts the list after 1
        (SAME, {"CUDA_VISIBLE_DEVICES": UUIDS[3]}, 0, 3),
        (SAME, {"CUDA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[0]}"}, 1, 0),
        (SAME, {"CUDA_VISIBLE_DEVICES": "GPU-cccc"}, 0, 3),  # a unique UUID prefix
        (SAME, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb3"}, 0, 2),
        # UUIDs name devices exactly: mixed models need no CUDA_DEVICE_ORDER.
        (MIXED, {"CUDA_VISIBLE_DEVICES": f"{UUIDS[1]},{UUIDS[0]}"}, 0, 1),
        # Integers under mixed models are NVML indices only in PCI bus order.
        (MIXED, {"CUDA_VISIBLE_DEVICES": "3,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, 0, 3),
        (MIXED, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, 1, 1),
    ],
)
def test_nvml_handle_for(
    names: list[str], env: dict[str, str], index: int, nvml_index: int
) -> None:
    assert nvml_handle_for(index, FakeNVML(names), environ=env) == ("handle", nvml_index)


def test_nvml_handle_for_decodes_byte_uuids() -> None:
    fake = FakeNVML(SAME, uuid_bytes=True)
    assert nvml_handle_for(0, fake, environ={"CUDA_VISIBLE_DEVICES": "GPU-cccc"}) == ("handle", 3)


@pytest.mark.parametrize(
    ("names", "env", "index", "match"),
    [
        (SAME, {"CUDA_VISIBLE_DEVICES": "1,7,0"}, 1, "not visible"),  # cut after 1
        (SAME, {"CUDA_VISIBLE_DEVICES": "1,-1,0"}, 1, "not visible"),
        (SAME, {"CUDA_VISIBLE_DEVICES": "1,,0"}, 1, "not visible"),
        (SAME, {"CUDA_VISIBLE_DEVICES": ""}, 0, "not visible"),  # no GPU visible
        (SAME, {"CUDA_VISIBLE_DEVICES": "0,1"}, 2, "not visible"),
        (SAME, {}, 4, "not visible"),
        (SAME, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, 0, "not one GPU UUID"),  # ambiguous
        (SAME, {"CUDA_VISIBLE_DEVICES": "GPU-ffff"}, 0, "not one GPU UUID"),  # unknown
        (MIXED, {}, 0, "mixed GPU models"),  # CUDA's default order is fastest first
        (MIXED, {"CUDA_VISIBLE_DEVICES": "2,0"}, 0, "mixed GPU models"),
        (MIXED, {"CUDA_VISIBLE_DEVICES": "2", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, 0, "mixed"),
    ],
)
def test_nvml_handle_for_raises_lookup_error(
    names: list[str], env: dict[str, str], index: int, match: str
) -> None:
    with pytest.raises(LookupError, match=match):
        nvml_handle_for(index, FakeNVML(names), environ=env)


def test_nvml_handle_for_reads_os_environ_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert nvml_handle_for(1, FakeNVML(SAME)) == ("handle", 2)


def test_nvml_free_reads_the_mapped_device_and_shuts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    fake = FakeNVML(SAME)
    fake.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(free=1000 + h[1])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert memory._nvml_free(0) == 1002  # torch's cuda:0 is NVML device 2
    assert calls == ["init", "shutdown"]


# ---------------------------------------------------------------------------- CUDA


def _forbid_cuda_context(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_context(*_: object) -> None:
        raise AssertionError("the probe must not touch torch.cuda when NVML answers")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    monkeypatch.setattr(torch.cuda, "memory_reserved", no_context)
    monkeypatch.setattr(torch.cuda, "memory_allocated", no_context)


def test_cuda_free_bytes_from_nvml_creates_no_context(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_cuda_context(monkeypatch)
    assert cuda_free_bytes(3, nvml=lambda i: 5000 + i) == (5003, "NVML free memory")


def test_cuda_free_bytes_falls_back_to_mem_get_info(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_nvml(_: int) -> int:
        raise LookupError("mixed GPU models")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (700 + i, 10**9))
    free, source = cuda_free_bytes(1, nvml=broken_nvml)
    assert free == 701
    assert "mem_get_info" in source and "mixed GPU models" in source


def test_cuda_free_bytes_adds_the_allocator_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 3000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1000)
    free, source = cuda_free_bytes(0, nvml=lambda i: 5000)
    assert free == 5000 + (3000 - 1000)  # reserved but unallocated is free to this run
    assert source.startswith("NVML free memory") and "cache" in source


@pytest.mark.parametrize(("device", "probed"), [("cuda", "cuda:0"), ("cuda:2", "cuda:2")])
def test_probe_free_memory_cuda_index(
    monkeypatch: pytest.MonkeyPatch, device: str, probed: str
) -> None:
    monkeypatch.setattr(memory, "cuda_free_bytes", lambda i: (1000 * (i + 1), "fake"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    probe = probe_free_memory(device)
    expected_index = int(probed.split(":")[1])
    assert probe == MemoryProbe(
        device=probed, free_bytes=1000 * (expected_index + 1), source="fake"
    )


@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_probe_free_memory_refuses_unknown_devices(device: str) -> None:
    with pytest.raises(ValueError, match="free_memory") as info:
        probe_free_memory(device)
    assert repr(device) in str(info.value)


def test_probe_free_memory_refuses_an_invisible_cuda_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"cannot probe free memory on 'cuda:1'.*free_memory"):
        probe_free_memory("cuda:1")


@pytest.mark.parametrize("device", [None, 5, "gpu"])
def test_probe_free_memory_refuses_non_devices(device: object) -> None:
    with pytest.raises(ValueError, match="is not a torch device"):
        probe_free_memory(device)  # type: ignore[arg-type]
