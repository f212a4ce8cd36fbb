"""The CPU kernel of optladder's AdamW: a C loop compiled with the system gcc, loaded by ctypes.

Nothing happens at import. The first call of :func:`load_library` (the first fused CPU
step) compiles :data:`~optladder.optimizers.kernels._cpu_source.SOURCE` once, about 6
seconds with gcc 12 (one loop per dtype and rounding combination), into a shared object
cached under ``$XDG_CACHE_HOME/optladder/kernels`` (``~/.cache/optladder/kernels`` when
unset or relative), named by the hash of the source and the compiler command; later
processes load it in milliseconds. The cache is private and checked (:mod:`.cache`): a
library is mapped only if it is this user's and its bytes match the SHA-256 recorded when
it was built, else it is rebuilt; the verified bytes are loaded from an anonymous
in-memory copy, so a file changed on disk afterwards cannot reach the process.
``python -m optladder.optimizers.kernels`` builds it (and the 8-bit kernel's) ahead of time.

One call updates every param of a group in one pass over memory: read the param and the
grad (float32, bfloat16 or float16) and the two moments (bfloat16 on the bf16 rung,
float32 on the fp32 rung for low-precision params), write the param and the moments (20
bytes per element for float32 params and grads with bfloat16 moments, against 28 for
float32 moments).
Work is split into 128Ki-element items handed out to ``torch.get_num_threads()`` threads
of torch's own OpenMP pool (the kernel links ``libgomp.so.1``, which resolves to the copy
torch loaded); where torch runs another OpenMP runtime the kernel starts pthreads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path
from typing import Any, cast

import torch

from optladder.optimizers.kernels import cache
from optladder.optimizers.kernels._cpu_source import SOURCE as _BF16_SOURCE

SOURCE = _BF16_SOURCE
"""The C source of the bf16 rung's kernel library (also the fp32 rung's, for bfloat16 and
float16 params). The 8bit rung's kernel (:mod:`.cpu8bit`) is a library of its own, built
through the same cache (:func:`load_source`) only when an 8-bit CPU step first needs it:
it takes several times longer to compile."""

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
}
"""Param and grad dtypes the kernel reads, and their codes in the C struct."""

MOMENT_DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}
"""Moment dtypes the kernel keeps (the fp32 and bf16 rungs), and their codes."""

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

SIMD_C_LOOP = 0
"""``simd`` level of :func:`run_table`: the C loop alone (``target_clones`` compiles it for
x86-64-v4, x86-64-v3 and baseline x86-64, and gcc vectorizes each clone)."""
SIMD_AVX2 = 1
"""``simd`` level: the AVX2/FMA/F16C intrinsics path (8 lanes)."""
SIMD_AVX512 = 2
"""``simd`` level: the AVX-512 (F, BW, DQ, VL) intrinsics path (16 lanes). Every level
writes the C loop's bits (the oracle's); the intrinsics paths step every param dtype,
the C loop's float16 params one element at a time (~4-7 ns per element against 0.5-0.9)."""
_SIMD_LEVELS = (SIMD_C_LOOP, SIMD_AVX2, SIMD_AVX512)

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
        ("step", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
        ("param_index", ctypes.c_int64),
        ("grad_dtype", ctypes.c_int32),
        ("param_dtype", ctypes.c_int32),
        ("step_key", ctypes.c_uint32),
        ("step_size", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("hyper_index", ctypes.c_int32),
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
        ("maximize", ctypes.c_int32),
        ("moment_dtype", ctypes.c_int32),
        ("stochastic", ctypes.c_int32),
        ("param_stochastic", ctypes.c_int32),
        ("pad", ctypes.c_int32),
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
            "(apt-get install gcc) or set CC to build the CPU kernels"
        )
    return None


def cache_dir() -> Path:
    """Where built kernels are cached: ``<cache root>/optladder/kernels``.

    The root is ``$XDG_CACHE_HOME`` when it is an absolute path, else ``~/.cache``
    (:func:`.cache.cache_root`). Nothing is created here.
    """
    return cache.cache_root() / "optladder" / "kernels"


def _library_path(cc: str, source: str = SOURCE, stem: str = "adamw_bf16") -> Path:
    """Where the library built from ``source`` by ``cc`` lives in the cache (default: the
    bf16 kernel's; scripts that plant or truncate a cached build read it this way)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    digest = hashlib.sha256()
    for part in (source, " ".join(_CFLAGS), cc, version.stdout, str(_uses_gnu_openmp())):
        digest.update(part.encode())
    return cache_dir() / f"{stem}_{digest.hexdigest()[:16]}.so"


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


_BF16_NAME = "the bf16 CPU kernel"


def _build(
    force: bool, source: str = SOURCE, stem: str = "adamw_bf16", name: str = _BF16_NAME
) -> tuple[Path, bytes]:
    """:func:`build` of ``source`` (cached as ``<stem>_<hash>.so``; errors call it
    ``name``), also returning the verified bytes of the library (read once)."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelBuildError(reason)
    cc = compiler()
    assert cc is not None
    path = _library_path(cc, source, stem)
    try:
        cache.ensure_private_dir(path.parent, cache.cache_root())
    except cache.CacheError as exc:
        raise KernelBuildError(f"{name}'s cache is not used: {exc}") from exc
    if not force:
        try:
            return path, cache.read_trusted(path)
        except cache.UntrustedFileError:
            pass  # missing, or not a build of ours: build it
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
            src = Path(tmp) / f"{stem}.c"
            fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(source)
            out = Path(tmp) / path.name
            proc = _compile(cc, src, out, openmp=_uses_gnu_openmp())
            if proc.returncode != 0:
                proc = _compile(cc, src, out, openmp=False)
            if proc.returncode != 0:
                raise KernelBuildError(
                    f"building {name} with {cc} failed (exit {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}"
                )
            data = cache.install(out, path)
    except OSError as exc:
        raise KernelBuildError(
            f"{name} could not be written to its cache {path.parent} ({exc}); set "
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


def build_source(stem: str, source: str, name: str) -> Path:
    """:func:`build` for another C library of this package's kernels (arguments as
    :func:`load_source`): compile it into the private cache unless a verified build is
    there, and return its path.

    Raises:
        KernelBuildError: if the library cannot be built or its cache used.
    """
    return _build(False, source, stem, name)[0]


def load_source(stem: str, source: str, name: str | None = None) -> ctypes.CDLL:
    """Build (first use only) and load another C library of this package's kernels, with
    the same compiler, flags, private cache and checks as the bf16 kernel's (:func:`build`).
    Its C signatures are the caller's to declare. Not cached here: callers keep the result.

    Args:
        stem: the cached file's name before the source's hash, e.g. ``"adamw8bit"``.
        source: the C source.
        name: what errors call the library; default ``the CPU kernel library '<stem>'``.

    Raises:
        KernelBuildError: if the library cannot be built or loaded.
    """
    name = name or f"the CPU kernel library {stem!r}"
    path, data = _build(False, source, stem, name)
    return _load_bytes(data, path, name)


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
        raise KernelBuildError(f"the CPU kernel is not loaded: {exc}") from exc
    return _declare(_load_bytes(data, path), path)


def _declare(lib: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    """Check the ABI version of a loaded kernel and declare its C signature."""
    if lib.ol_abi_version() != _ABI_VERSION:
        raise KernelBuildError(f"{path} has ABI {lib.ol_abi_version()}, expected {_ABI_VERSION}")
    _declare_signature(lib)
    return lib


_ABI_VERSION = 6
"""``ol_abi_version()`` of the source: the layout of ``ol_param_t``/``ol_hyper_t``."""


def _declare_signature(lib: ctypes.CDLL) -> None:
    """Declare the C signature of ``ol_adamw_step`` on a loaded kernel."""
    lib.ol_adamw_step.argtypes = (
        ctypes.POINTER(_Param),
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(_Hyper),
        ctypes.c_int32,
        ctypes.c_int32,
    )
    lib.ol_adamw_step.restype = ctypes.c_int
    lib.ol_simd_level.argtypes = ()
    lib.ol_simd_level.restype = ctypes.c_int
    lib.ol_read_steps.argtypes = (
        ctypes.POINTER(_Param),
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_double),
    )
    lib.ol_read_steps.restype = None
    lib.ol_bump_steps.argtypes = (ctypes.POINTER(_Param), ctypes.c_int64)
    lib.ol_bump_steps.restype = None


def _load_bytes(data: bytes, path: Path, name: str = _BF16_NAME) -> ctypes.CDLL:
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
            return lib
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading {name} {path} failed: {exc}") from exc


def dtype_unsupported_reason(param_dtype: torch.dtype, grad_dtype: torch.dtype) -> str | None:
    """Why the CPU kernel cannot step a param of ``param_dtype`` with a grad of
    ``grad_dtype`` (it steps and reads :data:`DTYPE_CODES`' dtypes), or None if it can."""
    if param_dtype not in DTYPE_CODES:
        return f"param dtype {param_dtype}: the CPU kernel steps float32, bfloat16, float16 params"
    if grad_dtype not in DTYPE_CODES:
        return f"grad dtype {grad_dtype}: the CPU kernel reads float32, bfloat16, float16"
    return None


def param_unsupported_reason(
    p: torch.Tensor, grad: torch.Tensor, *, contiguous: bool = True
) -> str | None:
    """Why the CPU kernel cannot step this param, or None if it can.

    Args:
        p: the param (needs float32, bfloat16 or float16, CPU, contiguous).
        grad: its grad (needs float32, bfloat16 or float16, CPU, contiguous, dense, same
            shape).
        contiguous: whether ``p`` and ``grad`` must be contiguous (False: the caller steps
            contiguous copies of them, as :class:`LadderAdamW` stages a transposed or
            ``channels_last`` param).
    """
    if p.device.type != "cpu":
        return f"param is on {p.device}, the CPU kernel needs CPU tensors"
    why = dtype_unsupported_reason(p.dtype, grad.dtype)
    if why is not None:
        return why
    if grad.is_sparse or grad.device != p.device or grad.shape != p.shape:
        return "grad is sparse, on another device or of another shape"
    if contiguous and not (p.is_contiguous() and grad.is_contiguous()):
        return "param or grad is not contiguous"
    return None


_DTYPE_OF = operator.attrgetter("dtype")


_ROW_WRITES = 4
"""Up to this many rows, :meth:`KernelTable.set_grads` and :meth:`~KernelTable.set_scalars`
write each row's fields (a few hundred nanoseconds a row) rather than each column (a few
microseconds a column)."""


class KernelTable:
    """The kernel's param table for a fixed list of params, built once and reused.

    Holds one C row per param (pointers, element count, dtypes, index, group) and the
    prefix sums of the element counts, so a step allocates nothing: :meth:`set_grads`,
    :meth:`set_scalars` and :meth:`set_options` rewrite only what changes between steps
    (grad pointers and dtypes, the per-step scalars, a group's options; each a
    vectorized write of a run of rows, or row by row for a few), :meth:`read_steps` /
    :meth:`bump_steps` read and bump every step count in one call, and :func:`run_table`
    steps every row, of every group, in one call. It holds the params, moments and step
    tensors it points into (``tensors``), so their memory outlives it.

    Args:
        params: float32/bfloat16/float16 CPU tensors, contiguous (see
            :func:`param_unsupported_reason`).
        exp_avgs, exp_avg_sqs: their moments, contiguous, the params' shapes, in their
            group's moment dtype (``moment_dtypes``).
        steps: their step counts, 0-d float64 CPU tensors (exact to 2**53).
        param_indices: each param's index over all param groups (for the random bits).
        groups: each param's group number in the table, ``0 <= g < n_groups``, whose
            options (:meth:`set_options`) step it; default all 0 (one group).
        moment_dtypes: each group's moment dtype (float32 or bfloat16; the kernel reads
            it per group, ``ol_hyper_t.moment_dtype``), one per group number; default
            ``exp_avgs[0]``'s dtype for every group.

    Raises:
        ValueError: naming the row and tensor that is not as described, or a group number
            out of range.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        param_indices: Sequence[int],
        groups: Sequence[int] | None = None,
        moment_dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        n = len(params)
        if groups is None:
            groups = [0] * n
        if len(groups) != n or any(g < 0 for g in groups):
            raise ValueError(f"groups must hold {n} group numbers >= 0, got {list(groups)!r}")
        self.n_groups = max(groups, default=0) + 1
        if moment_dtypes is None:
            moment_dtypes = [exp_avgs[0].dtype if n else torch.bfloat16] * self.n_groups
        moment_dtypes = list(moment_dtypes)
        if len(moment_dtypes) != self.n_groups:
            raise ValueError(
                f"moment_dtypes must hold one dtype per group ({self.n_groups}), got "
                f"{len(moment_dtypes)}"
            )
        for g, dtype in enumerate(moment_dtypes):
            if dtype not in MOMENT_DTYPE_CODES:
                raise ValueError(
                    f"moment_dtypes[{g}] is {dtype}; the kernel keeps float32 or bfloat16 moments"
                )
        self.moment_dtypes = moment_dtypes
        self.rows = (_Param * max(n, 1))()
        self.offsets = (ctypes.c_int64 * (n + 1))()
        self.step_values = (ctypes.c_double * max(n, 1))()
        self.hypers = (_Hyper * self.n_groups)()
        self._options: list[tuple[Any, ...] | None] = [None] * self.n_groups
        total = 0
        for k, (p, m, v, s, i, g) in enumerate(
            zip(params, exp_avgs, exp_avg_sqs, steps, param_indices, groups, strict=True)
        ):
            if s.dtype != torch.float64 or s.device.type != "cpu" or s.numel() != 1:
                raise ValueError(
                    f"steps[{k}] must be a one-element float64 CPU tensor, got {s.dtype} "
                    f"{tuple(s.shape)} on {s.device}"
                )
            if p.dtype not in DTYPE_CODES or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(
                    f"params[{k}] must be a contiguous float32/bfloat16/float16 CPU tensor, "
                    f"got {p.dtype} on {p.device}"
                )
            moment_dtype = moment_dtypes[g]
            for name, t in (("exp_avgs", m), ("exp_avg_sqs", v)):
                if t.dtype != moment_dtype or not t.is_contiguous() or t.shape != p.shape:
                    raise ValueError(
                        f"{name}[{k}] must be a contiguous {moment_dtype} tensor of shape "
                        f"{tuple(p.shape)}, got {t.dtype} {tuple(t.shape)}"
                    )
            row = self.rows[k]
            row.param = p.data_ptr()
            row.exp_avg = m.data_ptr()
            row.exp_avg_sq = v.data_ptr()
            row.step = s.data_ptr()
            row.numel = p.numel()
            row.param_index = i
            row.param_dtype = DTYPE_CODES[p.dtype]
            row.hyper_index = g
            total += p.numel()
            self.offsets[k + 1] = total
        self.n_params = n
        self.total = total
        self._columns: dict[str, torch.Tensor] = {}
        self._grad_dtypes: list[torch.dtype | None] = [None] * n  # as last written
        self._numels = [p.numel() for p in params]
        self._skipped: set[int] = set()  # rows without a grad at the last set_grads
        self.tensors = (list(params), list(exp_avgs), list(exp_avg_sqs), list(steps))

    def read_steps(self, library: ctypes.CDLL | None = None) -> list[float]:
        """Every param's step count (before this step), in one C call."""
        lib = load_library() if library is None else library
        lib.ol_read_steps(self.rows, self.n_params, self.step_values)
        return self.step_values[: self.n_params]

    def bump_steps(self, library: ctypes.CDLL | None = None) -> None:
        """Add one to every param's step count, in one C call."""
        lib = load_library() if library is None else library
        lib.ol_bump_steps(self.rows, self.n_params)

    def _column(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Field ``name`` of every row, as a strided ``dtype`` view of the rows' memory
        (for writing one field of a run of rows in one torch call)."""
        if name not in self._columns:
            offset = getattr(_Param, name).offset
            width = ctypes.sizeof(_Param) // dtype.itemsize
            rows = torch.frombuffer(self.rows, dtype=torch.uint8)[
                : self.n_params * width * dtype.itemsize
            ]
            self._columns[name] = rows.view(dtype).view(self.n_params, width)[
                :, offset // dtype.itemsize
            ]
        return self._columns[name]

    def set_grads(
        self,
        grads: Sequence[torch.Tensor | None],
        ptrs: Sequence[int] | None = None,
        first: int = 0,
    ) -> None:
        """Point rows ``first, first + 1, ...`` at their params' grads (one vectorized
        write of the pointers, or row by row for up to :data:`_ROW_WRITES` rows).

        A row whose grad is None is skipped by the next steps (its element count set to
        0 and its grad pointer to NULL: the kernel steps none of its elements and
        :meth:`bump_steps` does not count it) until it is given a grad again. A
        zero-size grad (address 0) is pointed at address 1 (never read), so that its
        row is counted.

        Args:
            grads: each param's grad or None, in row order (float32/bfloat16/float16,
                contiguous, its param's shape and device: :func:`param_unsupported_reason`).
            ptrs: their ``data_ptr()``s (0 for None), when the caller has them.
            first: the first row written.
        """
        n = len(grads)
        if not n:
            return
        end = first + n
        absent = list(map(operator.is_, grads, repeat(None)))
        skipped = {first + k for k, a in enumerate(absent) if a} if any(absent) else set()
        given: list[torch.Tensor]
        if skipped:  # the param stands in for a missing grad: its dtype has a code
            params = self.tensors[0]
            given = [params[first + k] if g is None else g for k, g in enumerate(grads)]
            if ptrs is None:
                ptrs = [0 if a else g.data_ptr() for g, a in zip(given, absent)]
            else:
                ptrs = [0 if a else ptr for ptr, a in zip(ptrs, absent)]
        else:
            given = cast(list[torch.Tensor], list(grads))
            if ptrs is None:
                ptrs = list(map(torch.Tensor.data_ptr, given))
        grads = given
        dtypes = list(map(_DTYPE_OF, grads))
        before = {r for r in self._skipped if first <= r < end} if self._skipped else set()
        if skipped or before:
            for r in before - skipped:
                self.rows[r].numel = self._numels[r]
            for r in skipped - before:
                self.rows[r].numel = 0
            self._skipped = (self._skipped - before) | skipped
        if n <= _ROW_WRITES:
            for k, ptr, dtype in zip(range(first, end), ptrs, dtypes):
                row = self.rows[k]
                row.grad = 0 if k in skipped else (ptr or 1)
                row.grad_dtype = DTYPE_CODES[dtype]
            self._grad_dtypes[first:end] = dtypes
            return
        column = torch.tensor(ptrs, dtype=torch.int64).clamp_(min=1)
        if skipped:
            column[[r - first for r in skipped]] = 0
        self._column("grad", torch.int64)[first:end].copy_(column)
        if dtypes != self._grad_dtypes[first:end]:
            codes = [DTYPE_CODES[d] for d in dtypes]
            column = self._column("grad_dtype", torch.int32)[first:end]
            column.copy_(torch.tensor(codes, dtype=torch.int32))
            self._grad_dtypes[first:end] = dtypes

    def set_scalars(
        self,
        steps: Sequence[float],
        scalars: dict[float, tuple[int, float, float]],
        first: int = 0,
    ) -> None:
        """Write this step's per-param scalars into rows ``first, first + 1, ...``: one
        write of each column when every param takes the same step (the common case) and
        there are more than :data:`_ROW_WRITES` rows, else row by row.

        Args:
            steps: each param's new (1-based) step count, in row order.
            scalars: for each distinct step, ``(step_key, step_size, bc2_sqrt)``:
                :func:`~optladder.optimizers.rounding.step_key`, ``-lr /
                bias_correction1`` and ``sqrt(bias_correction2)``.
            first: the first row written.
        """
        n = len(steps)
        if not n:
            return
        end = first + n
        if len(scalars) == 1 and n > _ROW_WRITES:
            key, step_size, bc2_sqrt = next(iter(scalars.values()))
            # the uint32 key as the int32 of the same bits
            signed = key - (1 << 32) if key >= 1 << 31 else key
            self._column("step_key", torch.int32)[first:end].fill_(signed)
            self._column("step_size", torch.float32)[first:end].fill_(step_size)
            self._column("bc2_sqrt", torch.float32)[first:end].fill_(bc2_sqrt)
            return
        rows = self.rows
        for k, step in zip(range(first, end), steps):
            row = rows[k]
            row.step_key, row.step_size, row.bc2_sqrt = scalars[step]

    def set_options(
        self,
        group: int,
        *,
        beta1: float,
        beta2: float,
        eps: float,
        lr: float,
        weight_decay: float,
        decoupled_weight_decay: bool,
        maximize: bool,
        stochastic: bool,
        param_stochastic: bool,
    ) -> None:
        """Set the options group ``group``'s rows are stepped with (written only when
        they differ, in value or type, from the last ones set).

        Args:
            group: the group number (``0 <= group < n_groups``).
            beta1: first-moment decay, in ``[0, 1)``.
            beta2: second-moment decay, in ``[0, 1)``.
            eps: denominator term.
            lr: learning rate (for the decoupled decay factor; the step size is a
                per-row scalar, :meth:`set_scalars`).
            weight_decay: decay coefficient; 0 disables it.
            decoupled_weight_decay: AdamW (True) or Adam's L2 term (False).
            maximize: ascend.
            stochastic: stochastic rounding of bfloat16 moments (else round to nearest
                even).
            param_stochastic: stochastic rounding of bfloat16/float16 param writes (else
                round to nearest even).

        Raises:
            IndexError: for a group number outside ``[0, n_groups)``.
        """
        if not 0 <= group < self.n_groups:
            raise IndexError(f"group {group} is not in [0, {self.n_groups})")
        key = (
            beta1,
            beta2,
            eps,
            lr,
            weight_decay,
            decoupled_weight_decay,
            maximize,
            stochastic,
            param_stochastic,
            # the types too: a numpy float32 equal to a float (0.5) makes other fields
            # below (``lr * weight_decay`` in float32 arithmetic)
            *map(type, (beta1, beta2, eps, lr, weight_decay)),
        )
        if self._options[group] == key:
            return
        has_wd = weight_decay != 0
        hyper = self.hypers[group]
        hyper.lerp_weight = 1.0 - beta1
        hyper.beta2 = beta2
        hyper.one_minus_beta2 = 1.0 - beta2
        hyper.eps = eps
        hyper.decay = (1.0 - lr * weight_decay) if has_wd and decoupled_weight_decay else 1.0
        hyper.weight_decay = weight_decay if has_wd and not decoupled_weight_decay else 0.0
        hyper.coupled = int(has_wd and not decoupled_weight_decay)
        hyper.maximize = int(maximize)
        hyper.moment_dtype = MOMENT_DTYPE_CODES[self.moment_dtypes[group]]
        hyper.stochastic = int(stochastic)
        hyper.param_stochastic = int(param_stochastic)
        self._options[group] = key


def simd_level(library: ctypes.CDLL | None = None) -> int:
    """The highest ``simd`` level this CPU runs: :data:`SIMD_AVX512`, :data:`SIMD_AVX2` or
    :data:`SIMD_C_LOOP`.

    Raises:
        KernelBuildError: if the kernel cannot be built or loaded.
    """
    lib = load_library() if library is None else library
    return int(lib.ol_simd_level())


def run_table(
    table: KernelTable,
    *,
    num_threads: int | None = None,
    library: ctypes.CDLL | None = None,
    simd: int = SIMD_AVX512,
) -> None:
    """Update the params and moments of every row of ``table`` in place, each row with
    its group's options, in one call (on up to ``num_threads`` threads, default
    ``torch.get_num_threads()``, fewer for small tables), exactly as the eager oracle
    does. Allocates nothing: :meth:`KernelTable.set_grads`,
    :meth:`~KernelTable.set_scalars` and :meth:`~KernelTable.set_options` must have run
    for this step.

    ``simd`` caps the hand-written path taken (:data:`SIMD_C_LOOP`, :data:`SIMD_AVX2`,
    :data:`SIMD_AVX512`; the CPU's own features cap it too, :func:`simd_level`): every
    path writes the same bits, so lower levels are for tests and benchmarks.

    Raises:
        ValueError: ``simd`` not one of the three levels.
        KernelBuildError: if the kernel cannot be built or loaded.
    """
    if type(simd) is not int or simd not in _SIMD_LEVELS:
        raise ValueError(
            f"simd={simd!r} is not a SIMD level; accepted: {SIMD_C_LOOP} (SIMD_C_LOOP), "
            f"{SIMD_AVX2} (SIMD_AVX2), {SIMD_AVX512} (SIMD_AVX512)"
        )
    if table.n_params == 0:
        return
    threads = torch.get_num_threads() if num_threads is None else num_threads
    threads = max(1, min(threads, table.total // _MIN_ELEMENTS_PER_THREAD))
    lib = load_library() if library is None else library
    lib.ol_adamw_step(table.rows, table.n_params, table.offsets, table.hypers, threads, simd)
