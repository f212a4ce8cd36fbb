"""The C kernel's cache: private to the user, and it maps only what this user built.

Each test uses its own cache folder (``XDG_CACHE_HOME`` in ``tmp_path``) and clears the
process's loaded kernel before and after, so tests neither share nor fight over a cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.kernels import cache, cpu

pytestmark = pytest.mark.skipif(
    cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="os.chown to another uid needs root")
NOBODY = 65534

EVIL_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w"); if (f) { fputs("ran", f); fclose(f); }
}
int ol_abi_version(void) { return 6; }  /* cpu._ABI_VERSION: would pass the ABI check */
int ol_adamw_step(void *a, long n, void *o, void *h, int t, int s) { return 0; }
int ol_simd_level(void) { return 0; }
void ol_read_steps(void *a, long n, void *out) {}
void ol_bump_steps(void *a, long n) {}
"""


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, empty cache root for this test; the process's loaded kernel is forgotten."""
    root = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    cpu.load_library.cache_clear()
    yield root
    cpu.load_library.cache_clear()


@pytest.fixture(scope="module")
def built_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding one clean build, made once for this module."""
    root = tmp_path_factory.mktemp("template") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        cpu.build()
    return root


@pytest.fixture
def warm_cache(private_cache: Path, built_template: Path) -> Path:
    """:func:`private_cache` holding a copy of the clean build (no compile per test)."""
    shutil.copytree(built_template, private_cache)
    return private_cache


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    """A library whose constructor writes a marker file: (its bytes, the marker's path)."""
    tmp = tmp_path_factory.mktemp("planted")
    marker = tmp / "planted-code-ran"
    src = tmp / "planted.c"
    src.write_text(EVIL_SOURCE % marker)
    out = tmp / "planted.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return out.read_bytes(), marker


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _overwrite(path: Path, data: bytes, mode: int = 0o500) -> None:
    path.chmod(0o600)
    path.write_bytes(data)
    path.chmod(mode)


def _step_params(backend: str) -> torch.Tensor:
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(70_000))
    p.grad = torch.randn(70_000)
    opt = LadderAdamW([p], lr=1e-2, weight_decay=0.1, backend=backend)  # type: ignore[arg-type]
    opt.step()
    return p.detach().clone()


def test_relative_xdg_cache_home_is_ignored(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # XDG Base Directory spec: a relative path in XDG_CACHE_HOME is invalid and ignored
    env = {"XDG_CACHE_HOME": "relative/cache", "HOME": str(home)}
    assert cache.cache_root(env) == home / ".cache"
    assert cache.cache_root({"XDG_CACHE_HOME": "/abs/cache", "HOME": str(home)}) == Path(
        "/abs/cache"
    )
    assert cache.cache_root({"XDG_CACHE_HOME": "", "HOME": str(home)}) == home / ".cache"
    # a relative HOME is not used either: the passwd entry's home folder is
    import pwd

    passwd_home = pwd.getpwuid(os.geteuid()).pw_dir
    assert cache.cache_root({"HOME": "rel"}) == Path(passwd_home) / ".cache"


def test_relative_xdg_cache_home_builds_nothing_in_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built_template: Path
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_CACHE_HOME", "relcache")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shutil.copytree(built_template, tmp_path / "home" / ".cache")
    path = cpu.build()
    assert path.parent == tmp_path / "home" / ".cache" / "optladder" / "kernels"
    assert list(cwd.iterdir()) == []


def test_umask_000_gives_private_folders_and_files(private_cache: Path) -> None:
    old = os.umask(0)
    try:
        path = cpu.build()
    finally:
        os.umask(old)
    assert path.parent == private_cache / "optladder" / "kernels"
    for folder in (private_cache, private_cache / "optladder", path.parent):
        assert _mode(folder) == 0o700, folder
    assert _mode(path) == 0o500
    assert _mode(cache.record_path(path)) == 0o600
    # nothing else is left in the folder (no temporary build folder or record)
    assert sorted(p.name for p in path.parent.iterdir()) == [
        path.name,
        path.name + ".sha256",
    ]
    recorded = cache.record_path(path).read_text().strip()
    assert recorded == hashlib.sha256(path.read_bytes()).hexdigest()


def test_existing_folders_of_ours_are_narrowed_to_0700(warm_cache: Path) -> None:
    kernels = warm_cache / "optladder" / "kernels"
    for folder in (warm_cache / "optladder", kernels):
        folder.chmod(0o777)
    cpu.build()
    assert _mode(warm_cache / "optladder") == 0o700 and _mode(kernels) == 0o700


def test_library_with_other_content_is_not_loaded_and_is_rebuilt(
    warm_cache: Path, planted: tuple[bytes, Path]
) -> None:
    path = cpu.build()
    good = path.read_bytes()
    planted_bytes, marker = planted
    _overwrite(path, planted_bytes)  # ours, mode 0500: only the content differs from the record
    with pytest.raises(cpu.KernelBuildError, match=r"differs from the build recorded"):
        cpu.load(path)
    assert not marker.exists()
    assert cpu.build() == path and path.read_bytes() == good  # rebuilt: gcc is deterministic
    lib = cpu.load(path)
    assert lib.ol_abi_version() == cpu._ABI_VERSION and not marker.exists()


@as_root
def test_library_owned_by_another_user_is_not_loaded_and_is_replaced(
    warm_cache: Path, planted: tuple[bytes, Path]
) -> None:
    path = cpu.build()
    good = path.read_bytes()
    planted_bytes, marker = planted
    # the record even matches the planted bytes: ownership alone must refuse it
    _overwrite(path, planted_bytes)
    cache.record_path(path).write_text(hashlib.sha256(planted_bytes).hexdigest() + "\n")
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(cpu.KernelBuildError, match=f"owned by uid {NOBODY}"):
        cpu.load(path)
    assert cpu.build() == path
    assert os.stat(path).st_uid == os.geteuid() and path.read_bytes() == good
    p = torch.nn.Parameter(torch.ones(100_000))
    p.grad = torch.ones(100_000)
    opt = LadderAdamW([p], lr=0.1, weight_decay=0.0, backend="auto")
    opt.step()
    assert opt.eager_reasons == {} and not marker.exists()
    # Adam's first step moves each element by about lr (m / sqrt(v) = 1 up to bf16
    # rounding of the moments); the planted no-op kernel left it at 1.0
    assert (p.detach() - (1.0 - 0.1)).abs().max().item() < 1e-3


@as_root
def test_record_owned_by_another_user_is_not_trusted(warm_cache: Path) -> None:
    path = cpu.build()
    os.chown(cache.record_path(path), NOBODY, NOBODY)
    with pytest.raises(cpu.KernelBuildError, match=f"sha256 is owned by uid {NOBODY}"):
        cpu.load(path)


@as_root
def test_cache_folder_of_another_user_is_refused_and_the_step_falls_back(
    private_cache: Path,
) -> None:
    kernels = private_cache / "optladder" / "kernels"
    kernels.mkdir(parents=True)
    os.chown(kernels, NOBODY, NOBODY)
    with pytest.raises(cpu.KernelBuildError, match=f"owned by uid {NOBODY}, not by this user"):
        cpu.build()
    assert list(kernels.iterdir()) == []  # nothing written into another user's folder
    p = torch.nn.Parameter(torch.ones(10))
    p.grad = torch.ones(10)
    opt = LadderAdamW([p], lr=0.1, backend="auto")
    opt.step()
    assert f"owned by uid {NOBODY}" in opt.eager_reasons[0]
    assert opt.state[p]["step"].item() == 1.0
    q = torch.nn.Parameter(torch.ones(10))
    q.grad = torch.ones(10)
    LadderAdamW([q], lr=0.1, backend="eager").step()
    assert torch.equal(p.detach(), q.detach())  # the eager path ran


def test_loose_mode_symlink_and_fifo_are_not_trusted(warm_cache: Path) -> None:
    path = cpu.build()
    path.chmod(0o755)
    with pytest.raises(cache.UntrustedFileError, match="mode 0755"):
        cache.read_trusted(path)
    good = warm_cache / "good.so"
    path.chmod(0o500)
    os.replace(path, good)
    path.symlink_to(good)
    with pytest.raises(cache.UntrustedFileError, match="cannot be opened as a plain file"):
        cache.read_trusted(path)
    path.unlink()
    os.mkfifo(path, 0o600)
    with pytest.raises(cache.UntrustedFileError, match="not a regular file"):
        cache.read_trusted(path)  # returns at once: a FIFO is never read
    assert cpu.build() == path and path.read_bytes() == good.read_bytes()


def test_truncated_library_is_never_mapped_and_falls_back_with_a_reason(
    warm_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = cpu.build()
    _overwrite(path, path.read_bytes()[:20_000])
    with pytest.raises(cpu.KernelBuildError, match="20000 bytes"):
        cpu.load(path)
    monkeypatch.setenv("CC", "/bin/false")  # found, but every build fails
    p = torch.nn.Parameter(torch.ones(10))
    p.grad = torch.ones(10)
    opt = LadderAdamW([p], lr=0.1, backend="auto")
    opt.step()
    assert "building the bf16 CPU kernel with /bin/false failed" in opt.eager_reasons[0]
    assert opt.state[p]["step"].item() == 1.0


def test_truncated_library_is_rebuilt_by_the_next_process(warm_cache: Path, tmp_path: Path) -> None:
    path = cpu.build()
    good = path.read_bytes()
    _overwrite(path, good[:20_000])
    out = tmp_path / "param.pt"
    script = textwrap.dedent(
        f"""
        import torch
        from optladder.optimizers.adamw import LadderAdamW
        torch.manual_seed(3)
        p = torch.nn.Parameter(torch.randn(70_000))
        p.grad = torch.randn(70_000)
        opt = LadderAdamW([p], lr=1e-2, weight_decay=0.1, backend="auto")
        opt.step()
        torch.save((p.detach(), opt.eager_reasons), {str(out)!r})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=os.environ.copy(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr  # not killed by SIGBUS (returncode -7)
    param, reasons = torch.load(out)
    assert reasons == {}  # the next process rebuilt the kernel and stepped with it
    assert path.read_bytes() == good
    assert torch.equal(param, _step_params("cpu"))


def test_concurrent_builds_leave_one_verified_library(private_cache: Path) -> None:
    errors: list[BaseException] = []

    def build() -> None:
        try:
            cpu.build(force=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    path = cpu.build()
    assert cache.read_trusted(path) == path.read_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]


PROBE_SOURCE = "int ol_probe(void) { return 42; }\n"
"""A library of another stem, built by :func:`cpu.load_source` as the 8-bit kernel is
(same private cache and checks, compiled in a fraction of a second)."""


@pytest.mark.parametrize("attack", ["planted", "truncated", pytest.param("foreign", marks=as_root)])
def test_a_library_of_another_stem_is_checked_as_the_bf16_one(
    private_cache: Path, planted: tuple[bytes, Path], attack: str
) -> None:
    """:func:`cpu.load_source` (the 8-bit kernel's loader) maps a cached library only if
    it is this user's build: a planted one (own, mode 0500, other bytes), a truncated
    one, or one owned by another user (even with a matching record) is rebuilt, never
    mapped: the planted constructor does not run and the loaded library is the source's."""
    assert cpu.load_source("probe", PROBE_SOURCE).ol_probe() == 42
    cc = cpu.compiler()
    assert cc is not None
    path = cpu._library_path(cc, PROBE_SOURCE, "probe")
    good = path.read_bytes()
    planted_bytes, marker = planted
    if attack == "truncated":
        _overwrite(path, good[: len(good) // 2])
    else:
        _overwrite(path, planted_bytes)
    if attack == "foreign":
        cache.record_path(path).write_text(hashlib.sha256(planted_bytes).hexdigest() + "\n")
        os.chown(path, NOBODY, NOBODY)
    with pytest.raises(cache.UntrustedFileError):
        cache.read_trusted(path)
    assert cpu.load_source("probe", PROBE_SOURCE).ol_probe() == 42
    assert not marker.exists()
    assert path.read_bytes() == good and os.stat(path).st_uid == os.geteuid()


def test_a_failed_8bit_build_falls_back_to_bitsandbytes_naming_the_8bit_kernel(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that is found but fails (``CC=/bin/false``): the 8bit rung steps with
    bitsandbytes' own CPU update (bit for bit plain ``AdamW8bit``) and its reason names
    the 8-bit kernel's build, not the bf16 kernel's."""
    bnb = pytest.importorskip("bitsandbytes")
    from engines import eightbit
    from optladder.optimizers.kernels import cpu8bit

    monkeypatch.setenv("CC", "/bin/false")
    cpu8bit.load_library.cache_clear()
    try:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5000))
        q = torch.nn.Parameter(p.detach().clone())
        p.grad = torch.randn(5000)
        q.grad = p.grad.clone()
        opt = eightbit([p], lr=1e-3)
        opt.step()
        bnb.optim.AdamW8bit([q], lr=1e-3).step()
    finally:
        cpu8bit.load_library.cache_clear()
    reason = opt.eager_reasons[0]
    assert "building the 8-bit CPU kernel with /bin/false failed" in reason, reason
    assert "bf16" not in reason
    assert torch.equal(p.detach(), q.detach())
