"""The CPU kernel of the bf16 rung: a C loop compiled with the system gcc, loaded by ctypes.

Nothing happens at import. The first call of :func:`load_library` (the first fused CPU
step) compiles :data:`~optladder.optimizers.kernels._cpu_source.SOURCE` once, about 0.5
seconds with gcc 12, into a shared object cached under
``$XDG_CACHE_HOME/optladder/kernels`` (``~/.cache/optladder/kernels`` when unset or
relative), named by the hash of the source and the compiler command; later processes load
it in milliseconds. The cache is private and checked (:mod:`.cache`): a library is mapped
only if it is this user's and its bytes match the SHA-256 recorded when it was built, else
it is rebuilt; the verified bytes are loaded from an anonymous in-memory copy, so a file
changed on disk afterwards cannot reach the process.
``python -m optladder.optimizers.kernels.cpu`` builds it ahead of time.

One call updates every param of a group in one pass over memory: read the float32 param,
the grad (float32, bfloat16 or float16) and the two bfloat16 moments, write the param and
the moments (20 bytes per element with float32 grads, against 28 for float32 moments).
Work is split into 128Ki-element items handed out to ``torch.get_num_threads()`` threads
of torch's own OpenMP pool (the kernel links ``libgomp.so.1``, which resolves to the copy
torch loaded); where torch runs another OpenMP runtime the kernel starts pthreads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from optladder.optimizers.kernels import cache
from optladder.optimizers.kernels._cpu_source import SOURCE

GRAD_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
}
"""Grad dtypes the kernel reads, and their codes in the C struct."""

_CFLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fno-math-errno",  # lets sqrtf vectorize; the kernel never reads errno
    "-fno-trapping-math",
    "-ffp-contract=off",  # only the fmaf calls written in the source may fuse
    "-fno-strict-aliasing",
)

_MIN_ELEMENTS_PER_THREAD = 1 << 16
"""Below this many elements per thread, starting threads costs more than it saves."""


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be compiled or loaded; the message says why."""


class _Param(ctypes.Structure):
    _fields_ = (
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
        ("grad_dtype", ctypes.c_int64),
        ("key", ctypes.c_uint32),
        ("step_size", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("hyper", ctypes.c_int32),
    )


class _Hyper(ctypes.Structure):
    _fields_ = (
        ("lerp_weight", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("coupled", ctypes.c_int32),
        ("decoupled", ctypes.c_int32),
        ("maximize", ctypes.c_int32),
        ("stochastic", ctypes.c_int32),
    )


def compiler() -> str | None:
    """The C compiler the kernel is built with: ``$CC`` if set, else ``gcc``, if found."""
    return _which(os.environ.get("CC", "gcc"))


@functools.cache
def _which(name: str) -> str | None:
    return shutil.which(name)  # looked up once per name: this runs for every param step


def unavailable_reason() -> str | None:
    """Why the CPU kernel cannot run here, or None if it can (it may still need building).

    Cheap: it looks for the compiler and the platform, it compiles nothing.
    """
    if sys.platform != "linux":
        return f"the CPU kernel is built for Linux only, this is {sys.platform}"
    if os.uname().machine not in ("x86_64", "AMD64"):
        return f"the CPU kernel is built for x86-64 only, this is {os.uname().machine}"
    if compiler() is None:
        return (
            f"no C compiler: {os.environ.get('CC', 'gcc')!r} is not on PATH; install gcc "
            "(apt-get install gcc) or set CC to build the bf16 CPU kernel"
        )
    return None


def cache_dir() -> Path:
    """Where built kernels are cached: ``<cache root>/optladder/kernels``.

    The root is ``$XDG_CACHE_HOME`` when it is an absolute path, else ``~/.cache``
    (:func:`.cache.cache_root`). Nothing is created here.
    """
    return cache.cache_root() / "optladder" / "kernels"


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    digest = hashlib.sha256()
    for part in (SOURCE, " ".join(_CFLAGS), cc, version.stdout, str(_uses_gnu_openmp())):
        digest.update(part.encode())
    return cache_dir() / f"adamw_bf16_{digest.hexdigest()[:16]}.so"


def _compile(cc: str, src: Path, out: Path, openmp: bool) -> subprocess.CompletedProcess[str]:
    flags = [*_CFLAGS, "-fopenmp"] if openmp else list(_CFLAGS)
    return subprocess.run(
        [cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True, check=False
    )


def build(force: bool = False) -> Path:
    """Compile the kernel into the private cache unless a verified build is there.

    The kernel is built with ``-fopenmp`` so that it runs on the OpenMP runtime torch has
    loaded (``libgomp.so.1``, matched by soname); where that build fails it is built with
    plain pthreads. A cached file is reused only if :func:`.cache.read_trusted` accepts it
    (ours, mode 0500/0600, bytes equal to the recorded SHA-256); a truncated, swapped or
    planted file is replaced by a fresh build. The build is written in a private
    temporary folder of the cache and renamed into place (:func:`.cache.install`).

    Args:
        force: rebuild even if a verified build is cached.

    Returns:
        Path of the shared object.

    Raises:
        KernelBuildError: with the compiler's message when the build fails, or when the
            cache folder cannot be used safely (another user's, not a folder, unwritable).
    """
    return _build(force)[0]


def _build(force: bool) -> tuple[Path, bytes]:
    """:func:`build`, also returning the verified bytes of the library (read once)."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelBuildError(reason)
    cc = compiler()
    assert cc is not None
    path = _library_path(cc)
    try:
        cache.ensure_private_dir(path.parent, cache.cache_root())
    except cache.CacheError as exc:
        raise KernelBuildError(f"the bf16 CPU kernel's cache is not used: {exc}") from exc
    if not force:
        try:
            return path, cache.read_trusted(path)
        except cache.UntrustedFileError:
            pass  # missing, or not a build of ours: build it
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
            src = Path(tmp) / "adamw_bf16.c"
            fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(SOURCE)
            out = Path(tmp) / path.name
            proc = _compile(cc, src, out, openmp=_uses_gnu_openmp())
            if proc.returncode != 0:
                proc = _compile(cc, src, out, openmp=False)
            if proc.returncode != 0:
                raise KernelBuildError(
                    f"building the bf16 CPU kernel with {cc} failed (exit {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}"
                )
            data = cache.install(out, path)
    except OSError as exc:
        raise KernelBuildError(
            f"the bf16 CPU kernel could not be written to its cache {path.parent} ({exc}); set "
            "XDG_CACHE_HOME to a writable folder"
        ) from exc
    return path, data


def _uses_gnu_openmp() -> bool:
    """Whether GNU OpenMP (``libgomp``) is loaded here, as torch's CPU wheels load it.

    Then a ``-fopenmp`` kernel shares torch's thread pool; otherwise (Intel OpenMP, or
    none) it would bring a second runtime whose threads compete with torch's.
    """
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (first use only) and load the kernel; cached for the life of the process.

    The bytes loaded are those checked (or just built) by this call: a concurrent
    process replacing the cached file in between cannot make it load something else.

    Raises:
        KernelBuildError: if the kernel cannot be built or loaded.
    """
    path, data = _build(force=False)
    return _declare(_load_bytes(data, path), path)


def load(path: Path) -> ctypes.CDLL:
    """Load a built kernel, after checking it, and declare its C signature.

    The file is read once and checked by :func:`.cache.read_trusted`; those bytes are
    copied to an anonymous memory file (``memfd_create``) and loaded from there, so what
    was checked is what is mapped (a file truncated or replaced on disk later is never
    mapped). Where memory files cannot be mapped executable, the checked file is loaded
    from its (private) path.

    Args:
        path: a library from :func:`build`.

    Raises:
        KernelBuildError: if the file is not a verified build of this user (the reason is
            in the message), cannot be loaded, or has another ABI version.
    """
    try:
        data = cache.read_trusted(path)
    except cache.CacheError as exc:
        raise KernelBuildError(f"the bf16 CPU kernel is not loaded: {exc}") from exc
    return _declare(_load_bytes(data, path), path)


def _declare(lib: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    """Check the ABI version of a loaded kernel and declare its C signature."""
    if lib.ol_abi_version() != 2:
        raise KernelBuildError(f"{path} has ABI {lib.ol_abi_version()}, expected 2")
    lib.ol_adamw_bf16_step.argtypes = (
        ctypes.POINTER(_Param),
        ctypes.c_int64,
        ctypes.POINTER(_Hyper),
        ctypes.c_int32,
        ctypes.c_void_p,
    )
    lib.ol_adamw_bf16_step.restype = ctypes.c_int
    return lib


def _load_bytes(data: bytes, path: Path) -> ctypes.CDLL:
    """dlopen ``data`` (the checked bytes of ``path``) from a memory file."""
    try:
        fd = os.memfd_create(path.name, os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except OSError:
            os.close(fd)  # e.g. vm.memfd_noexec forbids mapping it executable
        else:
            # The fd stays open while the process lives: the dynamic loader knows the
            # library by this /proc path, which must not name another library later.
            lib._optladder_memfd = fd  # type: ignore[attr-defined]
            return lib
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading the bf16 CPU kernel {path} failed: {exc}") from exc


def param_unsupported_reason(p: torch.Tensor, grad: torch.Tensor) -> str | None:
    """Why the CPU kernel cannot step this param, or None if it can.

    Args:
        p: the param (needs float32, CPU, contiguous).
        grad: its grad (needs float32, bfloat16 or float16, CPU, contiguous, dense, same
            shape).
    """
    if p.device.type != "cpu":
        return f"param is on {p.device}, the CPU kernel needs CPU tensors"
    if p.dtype != torch.float32:
        return f"param dtype {p.dtype}: the CPU kernel steps float32 params only"
    if grad.dtype not in GRAD_DTYPE_CODES:
        return f"grad dtype {grad.dtype}: the CPU kernel reads float32, bfloat16, float16"
    if grad.is_sparse or grad.device != p.device or grad.shape != p.shape:
        return "grad is sparse, on another device or of another shape"
    if not (p.is_contiguous() and grad.is_contiguous()):
        return "param or grad is not contiguous"
    return None


@dataclass(frozen=True)
class ParamJob:
    """One param for :func:`adamw_bf16_step`, with its per-step scalars.

    Attributes:
        param: float32 CPU tensor, contiguous, updated in place.
        grad: float32/bfloat16/float16 tensor of the same shape, contiguous.
        exp_avg: bfloat16 tensor of the same shape, contiguous, updated in place.
        exp_avg_sq: bfloat16 tensor of the same shape, contiguous, updated in place.
        key: :func:`~optladder.optimizers.rounding.element_key` of this step.
        step_size: ``-lr / (1 - beta1**step)`` (float64; rounded to float32 in C).
        bias_correction2_sqrt: ``sqrt(1 - beta2**step)``.
        group: index of its group's :class:`GroupScalars` in ``adamw_bf16_step``'s
            ``groups`` (0 when one group is passed as keywords).
    """

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    key: int
    step_size: float
    bias_correction2_sqrt: float
    group: int = 0


@dataclass(frozen=True)
class GroupScalars:
    """The scalars one param group shares (see :func:`adamw_bf16_step`'s keywords)."""

    beta1: float
    beta2: float
    eps: float
    lr: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool
    stochastic: bool


def offsets_table(n_params: int) -> torch.Tensor:
    """The kernel's offsets table for ``n_params`` params (``n_params + 1`` int64), to
    allocate before the commit: the kernel fills it and allocates nothing itself."""
    return torch.empty(n_params + 1, dtype=torch.int64)


def _hyper(g: GroupScalars) -> _Hyper:
    has_wd = g.weight_decay != 0
    return _Hyper(
        lerp_weight=1.0 - g.beta1,
        beta2=g.beta2,
        one_minus_beta2=1.0 - g.beta2,
        eps=g.eps,
        decay=(1.0 - g.lr * g.weight_decay) if has_wd and g.decoupled_weight_decay else 1.0,
        weight_decay=g.weight_decay if has_wd and not g.decoupled_weight_decay else 0.0,
        coupled=int(has_wd and not g.decoupled_weight_decay),
        decoupled=int(has_wd and g.decoupled_weight_decay),
        maximize=int(g.maximize),
        stochastic=int(g.stochastic),
    )


def adamw_bf16_step(
    jobs: Sequence[ParamJob],
    *,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True,
    maximize: bool = False,
    stochastic: bool = True,
    groups: Sequence[GroupScalars] | None = None,
    offsets: torch.Tensor | None = None,
    num_threads: int | None = None,
    library: ctypes.CDLL | None = None,
) -> None:
    """Update params and bf16 moments in place, exactly as the eager oracle does, in one
    kernel call for params of any number of groups.

    Args:
        jobs: the params (see :class:`ParamJob`); checked beforehand with
            :func:`param_unsupported_reason`, the moments must be bfloat16 and contiguous.
        beta1: first-moment decay, in ``[0, 1)`` (one group passed as keywords).
        beta2: second-moment decay, in ``[0, 1)``.
        eps: denominator term.
        lr: learning rate (for the decoupled decay factor).
        weight_decay: decay coefficient; 0 disables it.
        decoupled_weight_decay: AdamW (True) or Adam's L2 term (False).
        maximize: ascend.
        stochastic: stochastic rounding of the moments (else round to nearest even).
        groups: the scalars of several groups, indexed by ``ParamJob.group``; replaces
            the keywords above.
        offsets: from :func:`offsets_table` for ``len(jobs)`` params, allocated in the
            prepare phase; default allocated here.
        num_threads: worker threads; default ``torch.get_num_threads()``.
        library: a kernel from :func:`load`; default :func:`load_library`.

    Raises:
        ValueError: if a moment is not a contiguous bfloat16 tensor of the param's shape,
            a job names a group not in ``groups``, or ``offsets`` is too short.
        KernelBuildError: if the kernel cannot be built or loaded.
        RuntimeError: if the kernel reports an error code (it has none but -1 today).
    """
    if not jobs:
        return
    if groups is None:
        groups = [
            GroupScalars(
                beta1, beta2, eps, lr, weight_decay, decoupled_weight_decay, maximize, stochastic
            )
        ]
    if offsets is None:
        offsets = offsets_table(len(jobs))
    if offsets.dtype != torch.int64 or not offsets.is_contiguous() or offsets.numel() <= len(jobs):
        raise ValueError(
            f"offsets must be a contiguous int64 tensor of at least {len(jobs) + 1} elements "
            f"(offsets_table), got {offsets.dtype} of {offsets.numel()}"
        )
    table = (_Param * len(jobs))()
    total = 0
    for k, job in enumerate(jobs):
        for name in ("exp_avg", "exp_avg_sq"):
            t = getattr(job, name)
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape != job.param.shape:
                raise ValueError(
                    f"jobs[{k}].{name} must be a contiguous bfloat16 tensor of shape "
                    f"{tuple(job.param.shape)}, got {t.dtype} {tuple(t.shape)}"
                )
        if not 0 <= job.group < len(groups):
            raise ValueError(f"jobs[{k}].group is {job.group}; {len(groups)} groups were given")
        row = table[k]
        row.param = job.param.data_ptr()
        row.grad = job.grad.data_ptr()
        row.exp_avg = job.exp_avg.data_ptr()
        row.exp_avg_sq = job.exp_avg_sq.data_ptr()
        row.numel = job.param.numel()
        row.grad_dtype = GRAD_DTYPE_CODES[job.grad.dtype]
        row.key = job.key
        row.step_size = job.step_size
        row.bc2_sqrt = job.bias_correction2_sqrt
        row.hyper = job.group
        total += row.numel
    hypers = (_Hyper * len(groups))(*(_hyper(g) for g in groups))
    threads = torch.get_num_threads() if num_threads is None else num_threads
    threads = max(1, min(threads, total // _MIN_ELEMENTS_PER_THREAD))
    lib = load_library() if library is None else library
    rc = lib.ol_adamw_bf16_step(table, len(jobs), hypers, threads, offsets.data_ptr())
    if rc not in (0, -1):
        raise RuntimeError(f"the bf16 CPU kernel returned error code {rc}")


if __name__ == "__main__":
    print(build())
