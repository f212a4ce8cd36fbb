"""The 8-bit rung: bitsandbytes' ``AdamW8bit`` (block-wise quantized moments).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022). bitsandbytes
is imported only when this rung is built.

The rung is a state format of :class:`~optladder.optimizers.adamw.LadderAdamW`: its groups
(:class:`EightBitGroups`) keep bitsandbytes' own state, so their checkpoints continue in
``AdamW8bit``. It steps every CPU param it can with one call of
optladder's 8-bit CPU kernel (:mod:`optladder.optimizers.kernels.cpu8bit`: same state
format, no float32 copies), CUDA params with bitsandbytes' kernel, and the rest (no C
compiler, ``max_unorm``, a non-contiguous param) with bitsandbytes' per-tensor update,
recording why in ``eager_reasons``. It decides
which params keep float32 moments by one rule shared with migrations and the footprint
(:func:`optladder.bnb_overrides.quantized_8bit`: bitsandbytes' size rule and its
per-param overrides, ``StableEmbedding`` and ``override_config(p, "optim_bits", 32)``);
it runs bitsandbytes' update on each rank's local shard for sharded params (DTensor,
e.g. FSDP2's ``fully_shard``), while the size rule follows the param's global element
count, the same on every rank; and in Adam mode it adds ``weight_decay * param`` to the
grad and runs bitsandbytes with weight decay 0, because bitsandbytes applies weight
decay the AdamW (decoupled) way.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import itertools
import logging
import operator
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any, NamedTuple, cast

import torch

from optladder.bnb_overrides import no_overrides, quantized_8bit
from optladder.columns import ParamColumns
from optladder.dtype_names import dtype_name
from optladder.oom import is_oom
from optladder.optimizers.adamw import BNB_GROUP_KEYS
from optladder.optimizers.migrate import check_step_range
from optladder.optimizers.stepmemo import grad_of, kind_columns, same_objects
from optladder.optimizers.steps import MAX_STEP
from optladder.rungs import BNB_MIN_8BIT_SIZE, RUNG_KEY, param_refusal
from optladder.sharding import is_dtensor, local_tensor

_NOISY_LOGGER = "bitsandbytes.backends.cpu.ops"


def import_bitsandbytes() -> ModuleType:
    """Import bitsandbytes, hushing its CPU backend's warning about an optional 4-bit
    GEMM kernel from a hub (irrelevant to optimizers, and unreachable offline).

    Raises:
        ImportError: if bitsandbytes is missing or its native library fails to load.
        Out-of-memory errors (:func:`optladder.oom.is_oom`) raised while importing, as
            they are: they say nothing about whether bitsandbytes is installed.
    """
    noisy = logging.getLogger(_NOISY_LOGGER)
    previous = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError:
        raise
    except Exception as exc:  # a broken native library raises other errors
        if is_oom(exc):
            raise
        raise ImportError(f"bitsandbytes failed to import: {type(exc).__name__}: {exc}") from exc
    finally:
        noisy.setLevel(previous)


@functools.cache
def _code_book_values() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The values of bitsandbytes' signed and unsigned dynamic code books
    (``create_dynamic_map``, as its ``Optimizer8bit.fill_qmap`` makes them: 256 float32
    values each, held exactly as Python floats), computed once."""
    functional = importlib.import_module("bitsandbytes.functional")
    return (
        tuple(functional.create_dynamic_map(signed=True).tolist()),
        tuple(functional.create_dynamic_map(signed=False).tolist()),
    )


@functools.cache
def _bnb_optimizer() -> ModuleType:
    """bitsandbytes' ``optim.optimizer`` module (``Optimizer8bit``, ``Optimizer2State``)."""
    import_bitsandbytes()
    return importlib.import_module("bitsandbytes.optim.optimizer")


@functools.cache
def _sync_gpu() -> Any:
    """bitsandbytes' ``utils.sync_gpu``."""
    import_bitsandbytes()
    return importlib.import_module("bitsandbytes.utils").sync_gpu


class EightBitGroups:
    """The 8bit groups of a :class:`~optladder.optimizers.adamw.LadderAdamW` (those whose
    ``"rung"`` is ``"8bit"``): their state is bitsandbytes' ``AdamW8bit`` state
    (``step`` a Python int, ``state1``/``state2`` uint8 codes of the param's shape with
    ``qmap1``/``qmap2`` the signed/unsigned dynamic code books and ``absmax1``/``absmax2``
    one float32 per started 256-element block; float32 ``state1``/``state2`` for params
    :func:`optladder.bnb_overrides.quantized_8bit` keeps in 32 bits), made by
    bitsandbytes' ``init_state`` and stepped by the 8-bit CPU kernel's table over these
    groups, bitsandbytes' ``update_step`` for the rest (CUDA params included).
    bitsandbytes' own methods (``Optimizer8bit.get_config``,
    ``Optimizer2State.init_state``/``update_step``, ...) are called with this object,
    which holds the attributes they read (``param_groups``, ``state``, ``args``,
    ``mng``, ``name2qmap``, ``is_paged``, ``optimizer_name``).

    State format: for each param, :meth:`get_config` (bitsandbytes' per-param
    configuration hook, read by ``init_state``) reports ``optim_bits`` 8 with
    ``min_8bit_size`` 0 when the shared rule quantizes the param, else ``optim_bits`` 32.
    The rule reads bitsandbytes' own overrides by param identity, module overrides
    included, so a ``StableEmbedding`` keeps float32 moments from the first state
    allocated (plain bitsandbytes reads module overrides in ``step``, which optladder's
    prepare phase comes before), and a migration or checkpoint load creates the same
    format.

    CPU kernel: every CPU param whose state is ``AdamW8bit``'s (8-bit codes, or float32
    under ``min_8bit_size``) steps in one call of :mod:`optladder.optimizers.kernels.cpu8bit`,
    which writes the same state format (nearest code, bitsandbytes' reference rule)
    without float32 copies of any tensor, then bumps their ``step``.
    :meth:`prepare_kernel_step` writes its tables ahead (the prepare phase); the commit
    allocates nothing, except for a DTensor param whose grad is laid out unlike it
    (``Partial``): that grad is redistributed (a collective, run only once every rank
    commits) and the param stepped with its own small table. A missing C compiler, a
    non-contiguous param or ``max_unorm``/``skip_zeros`` send a param to bitsandbytes'
    per-tensor update instead, with the reason in ``eager_reasons`` (param index over
    these groups). In Adam mode the kernel adds ``weight_decay * param`` to the grad in
    float32 without writing the grad tensor; bitsandbytes' update (which decays
    decoupled, ``param *= 1 - lr * wd``) gets the decay folded into the grad instead
    (``grad += wd * param``, in place, before the update: the grad then holds the decayed
    grad, as ``torch.optim.Adam`` computes it) and runs with weight decay 0.

    Sharded params: bitsandbytes' kernels take plain tensors (a DTensor reaching them
    raises "got mixed torch.Tensor and DTensor"). For each DTensor param, bitsandbytes'
    own ``init_state`` and ``update_step`` get the rank's local shard (``p.to_local()``,
    a view of the DTensor's memory, so the update lands in the param) and its grad's
    local shard. The state is keyed by the DTensor param, as torch's optimizers key it,
    and holds plain tensors of the shard: uint8 codes of the shard's shape and one
    float32 absmax per started 256-element block of the shard (blocks never straddle a
    shard boundary, so they depend on where the boundaries are; ``state_dict()`` saves
    them per row of the param, see :mod:`optladder.optimizers.checkpoint`). The size rule
    follows the *global* element count (``p.numel()`` of the DTensor, equal on every
    rank): a param of at least ``min_8bit_size`` elements is quantized on every rank
    even where its shard is smaller, and a smaller one keeps float32 moments everywhere.

    A non-contiguous plain param is stepped through a contiguous copy (allocated by
    :meth:`prepare_contiguous` in the prepare phase, dropped after the step), and the
    result is copied back into the param's own memory; its state is kept contiguous, in
    the param's logical order. bitsandbytes alone would run
    ``p.data = p.data.contiguous()`` and move the param to new storage.

    Not an optimizer: it reads the owner's groups and ``state`` when asked
    (:attr:`param_groups` lists the 8bit groups in their order among the owner's; the
    group and param indices of its tables, messages of its own and bitsandbytes'
    per-index overrides count over these groups, as an engine holding only them would).

    Args:
        owner: the optimizer whose 8bit groups these are; its ``defaults``'
            ``decoupled_weight_decay`` False decays the Adam way.

    Raises:
        ImportError: if bitsandbytes does not import.
    """

    name2qmap: dict[str, torch.Tensor]
    is_paged: bool
    args: Any
    mng: Any
    initialized: bool
    coupled_weight_decay: bool
    eager_reasons: dict[int, str]
    _kernel_error: str | None
    _prepared: _PreparedStep | None
    _kernel_plan: _KernelPlan | None
    _bounds: dict[int, tuple[torch.Tensor, int, Any]]
    _contiguous: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]

    optimizer_name = "adam"  # bitsandbytes' update op's name for Adam and AdamW

    def __init__(self, owner: torch.optim.Optimizer) -> None:
        optimizer = _bnb_optimizer()
        self.owner = owner
        self.args = optimizer.MockArgs(
            {
                "optim_bits": 8,
                "min_8bit_size": BNB_MIN_8BIT_SIZE,
                "max_unorm": 0.0,
                "skip_zeros": False,
            }
        )  # what AdamW8bit(min_8bit_size=BNB_MIN_8BIT_SIZE) holds
        self.mng = optimizer.GlobalOptimManager.get_instance()
        self.name2qmap = {}
        self.is_paged = False
        self.initialized = False
        self.coupled_weight_decay = not bool(owner.defaults.get("decoupled_weight_decay", True))
        self._init_kernel_state()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The owner's 8bit groups, in order (a new list)."""
        return [g for g in self.owner.param_groups if g.get(RUNG_KEY) == "8bit"]

    @property
    def state(self) -> Any:
        """The owner's ``state``."""
        return self.owner.state

    def prepare(self) -> list[torch.Tensor]:
        """The prepare phase of these groups' step: create the state of params with a
        grad and none (bitsandbytes' ``init_state``), allocate the contiguous copies and
        write the CPU kernel's tables (:meth:`prepare_kernel_step`).

        Returns:
            The params whose state this call created.

        Raises:
            ValueError: a stepping param whose state is not ``AdamW8bit``'s (it lacks
                ``step``, ``state1`` or ``state2``: torch's AdamW state loaded into the
                group, say), naming the param; from :meth:`prepare_kernel_step`; an OOM
                while allocating. The state created is dropped first, and the copies
                and tables.
        """
        created: list[torch.Tensor] = []
        state = self.owner.state
        try:
            kept = self._kept_step()
            if kept is not None:  # nothing to create, copy or refuse: see _kept_step
                self._prepared = kept
                return created
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    st = state.get(p)
                    if st:
                        if not _EIGHTBIT_KEYS.issubset(st):
                            raise ValueError(self._foreign_state(group, pi, st))
                        continue
                    created.append(p)
                    self.init_state(group, p, gi, pi)
            self.prepare_contiguous()
            self.prepare_kernel_step()
        except BaseException:
            for p in created:
                state.pop(p, None)
            self.release_scratch()
            self.drop_kernel_step()
            raise
        return created

    def _foreign_state(self, group: dict[str, Any], pi: int, st: Mapping[str, Any]) -> str:
        """The message refusing param ``pi`` of ``group`` whose state is not
        ``AdamW8bit``'s (a torch AdamW checkpoint loaded into the group, or state set by
        hand): bitsandbytes' ``update_step`` would count its step, then fail."""
        gi = next(k for k, g in enumerate(self.owner.param_groups) if g is group)
        return (
            f"param {pi} of param group {gi} (8bit) holds state {sorted(st)}; the 8bit "
            f"format keeps bitsandbytes' AdamW8bit state ({', '.join(sorted(_EIGHTBIT_KEYS))}"
            ", and qmap1/qmap2, absmax1/absmax2 for uint8 codes). Drop its state (del "
            "opt.state[param]) to start it afresh, or load the checkpoint through "
            "optladder's AdamW, which converts it to the group's rung"
        )

    def _init_kernel_state(self) -> None:
        """Set the attributes the methods below keep between calls, before any runs."""
        self.eager_reasons = {}
        self._kernel_error = None
        self._prepared = None
        self._kernel_plan = None  # the table kept between steps
        self._bounds = {}
        # non-contiguous param -> (contiguous copy, contiguous grad or None), made in
        # prepare_contiguous and dropped after the step or by release_scratch
        self._contiguous = {}

    def fill_qmap(self) -> None:
        # bitsandbytes' two code books, made from their values computed once per
        # process (its own fill_qmap computes them anew, ~0.3 ms a construction) the
        # way it makes them (torch.tensor of the values); each optimizer owns its pair.
        # Made when first needed, not in construction (Optimizer8bit.__init__ calls
        # this): every reader fills them when "dynamic" is missing (bitsandbytes'
        # init_state, migrate.bnb_qmaps), as a state is first made. Two tensor
        # factories cost ~0.1-0.25 ms of a construction after a garbage collection
        # (measured: torch's whole AdamW construction over 2,000 params is ~1.5 ms).
        # Both are made before either is kept: the first state may be made in a
        # step's prepare phase, where an allocation can fail (out of memory) between
        # the two, and readers take "dynamic" present to mean both are.
        signed, unsigned = _code_book_values()
        books = (
            torch.tensor(signed, dtype=torch.float32),
            torch.tensor(unsigned, dtype=torch.float32),
        )
        self.name2qmap["dynamic"], self.name2qmap["udynamic"] = books

    def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> Any:
        # bitsandbytes' zeros_like keeps a non-contiguous param's strides, while its
        # kernels index state by memory order: keep the state in the param's logical
        # (row-major) order, as the contiguous copy is stepped.
        if not p.is_contiguous() and not self.is_paged:
            return torch.zeros(p.shape, dtype=dtype, device=p.device)
        return _bnb_optimizer().Optimizer8bit.get_state_buffer(self, p, dtype=dtype)

    def prepare_contiguous(self) -> None:
        """Allocate a contiguous copy of every non-contiguous plain param that has a
        grad (and of its grad when that is not contiguous), for the next step; the
        commit then allocates nothing for them. On failure (an OOM) nothing is kept.
        """
        try:
            for group in self.param_groups:
                if all(map(torch.Tensor.is_contiguous, group["params"])):
                    continue  # the common case, checked in C
                for p in group["params"]:
                    if p.grad is None or is_dtensor(p) or p in self._contiguous:
                        continue
                    if p.is_contiguous():
                        continue
                    work = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                    grad = None
                    if not p.grad.is_contiguous():
                        grad = torch.empty(p.shape, dtype=p.grad.dtype, device=p.device)
                    self._contiguous[p] = (work, grad)
        except BaseException:
            self.release_scratch()
            raise

    def release_scratch(self) -> None:
        """Drop the contiguous copies :meth:`prepare_contiguous` made."""
        self._contiguous.clear()

    def prepare_kernel_step(self) -> None:
        """Prepare the CPU kernel's tables for the next :meth:`step` (the prepare
        phase of a two-phase step; the state of stepping params must exist, as
        bitsandbytes' ``init_state`` makes it). The next ``step`` uses them if the
        params' grads and state are still the same tensors, else prepares again.

        Raises:
            ValueError: from :func:`optladder.optimizers.kernels.cpu8bit.prepare_table`
                (state of the wrong layout); nothing changes.
        """
        self._prepared = None
        self._prepared = _prepare_step(self)

    def _kept_step(self) -> _PreparedStep | None:
        """The next step on the kept kernel table (:class:`_KernelPlan`), when it still
        fits and the step needs nothing else, so the per-param pass that creates state,
        refuses foreign state and makes contiguous copies can be skipped: the table's
        params are then every param with a grad (each with its state, in the same state
        dicts holding the same tensors), every param is contiguous and none is stepped
        by bitsandbytes (whose state the table does not check). None otherwise (the
        full prepare runs, keeping or remaking the table).

        Raises:
            ValueError: a step count out of the kernel's range (:meth:`_KernelPlan.refresh`).
        """
        plan = self._kernel_plan
        if plan is None or plan.prepared.others:
            return None
        groups = self.param_groups
        if not all(all(map(torch.Tensor.is_contiguous, g["params"])) for g in groups):
            return None
        return plan.refresh(self)

    def release_tables(self) -> None:
        """Drop the kept kernel table (it holds the state's tensors): before the
        state moves to another format or is replaced; the next step makes it again."""
        self._kernel_plan = None
        self._prepared = None

    def drop_kernel_step(self) -> None:
        """Forget the tables :meth:`prepare_kernel_step` made (a rolled-back step)."""
        self._prepared = None

    @torch.no_grad()
    def commit_step(self) -> None:
        """The commit of a two-phase step (:mod:`optladder.optimizers.transaction`):
        the step :meth:`prepare_kernel_step` prepared, run without checking again that
        its grads and state are the ones prepared (nothing ran in between but the
        grads' unscaling, in place). Runs no step hooks, as the optladder optimizer's
        own ``step`` ran them."""
        try:
            self._step(None, just_prepared=True)
        finally:
            self.release_scratch()

    def _step(self, closure: Any, just_prepared: bool = False) -> Any:
        """One step, as bitsandbytes' ``Optimizer8bit.step``, with every CPU param the
        8-bit CPU kernel can take stepped by one kernel call (see
        :class:`EightBitGroups`); the rest through bitsandbytes' ``update_step``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not getattr(self, "initialized", False):  # as bitsandbytes' step begins
            _bnb_optimizer().Optimizer8bit.check_overrides(self)
            _bnb_optimizer().Optimizer8bit.to_gpu(self)
            self.initialized = True
        prepared, self._prepared = self._prepared, None
        if prepared is None or not (just_prepared or prepared.still_valid(self)):
            prepared = self._kept_step()
        if prepared is None:
            self.prepare_contiguous()
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p.grad is not None and len(self.state[p]) == 0:
                        self.init_state(group, p, gindex, pindex)
            prepared = _prepare_step(self)
        for group, p, gindex, pindex in prepared.others:
            _bnb_optimizer().Optimizer8bit.prefetch_state(self, p)
            self.update_step(group, p, gindex, pindex)
            _sync_gpu()(p)
        from optladder.optimizers.kernels import cpu8bit

        for p, job, st in prepared.late:  # DTensor grads laid out unlike their param
            grad = cast(torch.Tensor, p.grad)
            grad = grad.redistribute(p.device_mesh, tuple(p.placements))  # type: ignore[attr-defined]
            local = local_tensor(grad).detach().contiguous()
            late = cpu8bit.prepare_table([dataclasses.replace(job, grad=local)])
            cpu8bit.run_table(late, prepared.library)
            st["step"] += 1
        if prepared.table is not None:
            for p, work, work_grad in prepared.staged:
                work.copy_(p)
                if work_grad is not None:
                    work_grad.copy_(cast(torch.Tensor, p.grad))
            cpu8bit.run_table(prepared.table, prepared.library)
            for p, work, _ in prepared.staged:
                p.copy_(work)
            for st in prepared.states:
                st["step"] += 1
        return loss

    def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
        config: dict[str, Any] = _bnb_optimizer().Optimizer8bit.get_config(
            self, gindex, pindex, group
        )
        for key, value in BNB_GROUP_KEYS.items():  # Adam's values: the groups hold none
            if key not in group:  # (bitsandbytes 0.45 reads None for them, its update
                config[key] = value  # refuses None)
        if self.coupled_weight_decay:
            config["weight_decay"] = 0.0  # folded into the grad in update_step
        p = self.param_groups[gindex]["params"][pindex]
        # bitsandbytes compares the tensor it is handed (for a DTensor, the local
        # shard) with min_8bit_size: state the shared rule's answer outright.
        quantize = quantized_8bit(
            p,
            f"param {pindex} of group {gindex}",
            optim_bits=self.args.optim_bits,
            min_8bit_size=self.args.min_8bit_size,
        )
        config["optim_bits"] = 8 if quantize else 32
        config["min_8bit_size"] = 0
        return config

    @contextlib.contextmanager
    def _on_shard(self, p: torch.Tensor, with_grad: bool) -> Iterator[torch.Tensor]:
        """Lend bitsandbytes the local shard of ``p``, sharing ``p``'s state dict
        for the duration; ``with_grad``: with the grad's local shard as ``.grad``.

        A grad laid out unlike its param (e.g. ``Partial``, not yet reduced) is
        redistributed to the param's placements first: a collective, so it is done
        only in the update, which every rank runs after agreeing to commit, never in
        ``init_state`` (the prepare phase, where a rank may stop early on OOM).
        """
        shard = local_tensor(p)
        if not shard.is_contiguous():
            raise ValueError(
                "the 8bit rung steps a DTensor param on its local shard, which must be "
                f"contiguous; this rank's shard has shape {tuple(shard.shape)} and "
                f"stride {shard.stride()}"
            )
        grad = p.grad if with_grad else None
        if grad is not None and is_dtensor(grad):
            placements = tuple(p.placements)  # type: ignore[attr-defined]
            if tuple(grad.placements) != placements:  # type: ignore[attr-defined]
                grad = grad.redistribute(p.device_mesh, placements)  # type: ignore[attr-defined]
            grad = local_tensor(grad)
        shard.grad = grad
        self.state[shard] = self.state[p]
        try:
            yield shard
        finally:
            del self.state[shard]
            shard.grad = None

    @torch.no_grad()
    def init_state(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        if not is_dtensor(p):
            _bnb_optimizer().Optimizer2State.init_state(self, group, p, gindex, pindex)
            return
        with self._on_shard(p, with_grad=False) as shard:
            _bnb_optimizer().Optimizer2State.init_state(self, group, shard, gindex, pindex)

    @torch.no_grad()
    def update_step(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        wd = group["weight_decay"] if self.coupled_weight_decay else 0.0
        if not is_dtensor(p) and not p.is_contiguous():
            self._update_noncontiguous(group, p, gindex, pindex, wd)
            return
        if not is_dtensor(p):
            if wd:
                cast(torch.Tensor, p.grad).add_(p, alpha=wd)
            _bnb_optimizer().Optimizer2State.update_step(self, group, p, gindex, pindex)
            return
        with self._on_shard(p, with_grad=True) as shard:
            if wd:
                cast(torch.Tensor, shard.grad).add_(shard, alpha=wd)
            _bnb_optimizer().Optimizer2State.update_step(self, group, shard, gindex, pindex)

    def _update_noncontiguous(
        self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int, wd: float
    ) -> None:
        """Step a non-contiguous param through a contiguous copy, written back in
        place: bitsandbytes would otherwise run ``p.data = p.data.contiguous()`` and
        move the param to new storage, untying every tensor that views it."""
        grad = cast(torch.Tensor, p.grad)
        prepared = self._contiguous.pop(p) if p in self._contiguous else None
        work, work_grad = prepared or (  # stepped without prepare_contiguous: made here
            torch.empty(p.shape, dtype=p.dtype, device=p.device),
            None
            if grad.is_contiguous()
            else torch.empty_like(grad, memory_format=torch.contiguous_format),
        )
        work.copy_(p)
        if work_grad is not None:
            work_grad.copy_(grad)
        else:
            work_grad = grad
        if wd:
            work_grad.add_(work, alpha=wd)
        work.grad = work_grad
        self.state[work] = self.state[p]
        try:
            _bnb_optimizer().Optimizer2State.update_step(self, group, work, gindex, pindex)
        finally:
            del self.state[work]
            work.grad = None
        p.copy_(work)


_EIGHTBIT_KEYS = frozenset({"step", "state1", "state2"})
"""The keys every param's ``AdamW8bit`` state holds (bitsandbytes' ``init_state``)."""


@dataclasses.dataclass
class _PreparedStep:
    """What :func:`_prepare_step` decided for one step of a :class:`EightBitGroups`.

    Attributes:
        table: the CPU kernel's tables, or None when no param takes the kernel.
        library: the loaded kernel library (None with ``table``).
        states: the state dicts of the kernel's params (their ``step`` is bumped after
            the kernel ran), in table order.
        others: ``(group, param, gindex, pindex)`` stepped by bitsandbytes.
        late: ``(param, job, state)`` of DTensor params whose grad is redistributed in
            the commit: each job's grad is a placeholder until then.
        staged: ``(param, copy, grad copy or None)`` of non-contiguous params, stepped
            in the contiguous copies ``prepare_contiguous`` made (copied in before the
            kernel runs, the param copied back after); and ``(param, param, grad copy)``
            of contiguous params whose grad is not (a hand-set transposed or expanded
            view), the grad copied in before the kernel runs.
        params: every param of every group when prepared, in order.
        grads: their grads then (None where a param had none).
        state_seen: the engine's state dicts then (``state.values()``, in order).
        check_states: the state dicts of every kernel param (``late`` ones included).
        check_steps: their ``step`` then.
        check_state1: their ``state1`` then.
        n_groups: the number of param groups when prepared.
    """

    table: Any
    library: Any
    states: list[dict[str, Any]]
    others: list[tuple[dict[str, Any], torch.Tensor, int, int]]
    late: list[tuple[torch.Tensor, Any, dict[str, Any]]]
    staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    state_seen: list[Any]
    check_states: list[dict[str, Any]]
    check_steps: list[int]
    check_state1: list[torch.Tensor]
    n_groups: int

    def still_valid(self, engine: Any) -> bool:
        """Whether the params, their grads and the state the tables point at are still
        the ones prepared (identity, compared in C), with the same step counts."""
        groups = engine.param_groups
        if len(groups) != self.n_groups:
            return False
        params = list(itertools.chain.from_iterable(g["params"] for g in groups))
        return (
            same_objects(params, self.params)
            and same_objects(list(map(grad_of, params)), self.grads)
            and same_objects(list(engine.state.values()), self.state_seen)
            and list(map(_STEP, self.check_states)) == self.check_steps
            and same_objects(list(map(_STATE1, self.check_states)), self.check_state1)
        )


_STEP = operator.itemgetter("step")
_STATE1 = operator.itemgetter("state1")
_STATE2 = operator.itemgetter("state2")
_ABSMAX = operator.itemgetter("absmax1", "absmax2")
_QMAPS = operator.itemgetter("qmap1", "qmap2")
_DATA_PTR = torch.Tensor.data_ptr


def _row_bytes(rows: ctypes.Array[Any]) -> torch.Tensor:
    """The kernel table's param rows as a ``(rows, row bytes)`` uint8 view of their
    memory."""
    size = ctypes.sizeof(rows._type_)
    return torch.frombuffer(rows, dtype=torch.uint8)[: len(rows) * size].view(len(rows), size)


class _KernelPlan:
    """The 8-bit CPU kernel's table of a :class:`EightBitGroups`, kept between steps while
    the groups, params (and their memory), grads' kinds, state (the same tensors, in
    the same memory) and bitsandbytes' per-param overrides stay the same; a step then
    writes only the grad pointers and, per (group, state format, step count), the
    scalars of its step count and the group's options (written into one row per such
    key by :func:`~.kernels.cpu8bit.write_step_scalars`, the function a full table's
    rows are written with, and copied to the rows in one call, so the scalars are
    exactly the ones a full table would hold).

    A step that changes which of the table's params have a grad (experts of a mixture,
    a task's head: a param gets a grad at some steps only) keeps the table: the work
    items of a row whose param has no grad are left out of that step's item list (its
    elements are not read or written), its ``step`` is not bumped, and each row's
    scalars follow its own step count. A param that had no grad when the table was made
    and gets one later makes the table again; rows of the last table whose param has
    no grad then are kept in the new one (:meth:`rows_to_keep`), so after a few steps
    the table covers every param that had a grad.

    Made only for plain CPU params without per-param overrides, DTensors or
    non-contiguous params; :meth:`make` returns None otherwise (every step then
    prepares a full table).
    """

    def __init__(
        self,
        engine: Any,
        prepared: _PreparedStep,
        full: Any,
        jobs: list[Any],
        places: list[tuple[int, int]],
        kernel_params: list[torch.Tensor],
        states: list[dict[str, Any]],
        skipped: list[bool],
    ) -> None:
        from optladder.optimizers.kernels import cpu8bit

        groups = engine.param_groups
        self.groups = list(groups)
        self.params = [list(g["params"]) for g in groups]
        self.places = places
        self.n_overrides = (len(engine.mng.pid2config), len(engine.mng.index2config))
        self.state_seen = prepared.state_seen
        held = [dataclasses.replace(job, grad=job.param) for job in jobs]  # no grads held
        keep = tuple(getattr(job, f.name) for job in held for f in dataclasses.fields(job))
        self.table = dataclasses.replace(  # the tensors it points into, but none of the grads
            full, tensors=tuple(t for t in keep if isinstance(t, torch.Tensor))
        )
        self.prepared = dataclasses.replace(prepared, table=self.table, params=[], grads=[])
        offsets = list(itertools.accumulate((len(p) for p in self.params), initial=0))
        self.flat_places = [offsets[gi] + pi for gi, pi in places]
        self.kernel_places = frozenset(self.flat_places)
        self.kernel_params = kernel_params
        self.param_ptrs = list(map(torch.Tensor.data_ptr, kernel_params))
        self.states = states  # every row's, skipped ones too
        self.quantized_states = [
            st for st, job in zip(self.states, jobs) if job.absmax1 is not None
        ]
        self.held, self.held_qmaps = self.table_state()
        self.held_ptrs = self.addresses(self.held, self.held_qmaps)
        # what each place's grad must be for the table to fit: the kinds the grads had
        # (None: had none), a skipped row's as its param's (grads of a kernel param have
        # its dtype, shape and device: checked before the step)
        grads = list(prepared.grads)
        for k, (place, p) in enumerate(zip(self.flat_places, kernel_params)):
            if skipped[k]:
                grads[place] = p
        self.missing = list(map(operator.is_, prepared.grads, itertools.repeat(None)))
        has = list(map(operator.is_not, grads, itertools.repeat(None)))
        columns = map(iter, kind_columns(list(itertools.compress(grads, has))))
        self.kinds = [[next(c) if h else None for h in has] for c in columns]
        self.runs: list[tuple[int, int, int]] = []  # (group, first row, end row)
        for k, (gi, _) in enumerate(places):
            quantized = jobs[k].state1.dtype
            if (
                self.runs
                and self.runs[-1][0] == gi
                and jobs[self.runs[-1][1]].state1.dtype == quantized
            ):
                self.runs[-1] = (gi, self.runs[-1][1], k + 1)
            else:
                self.runs.append((gi, k, k + 1))
        self.rows = _row_bytes(full.params)
        row_type = full.params._type_
        spans = sorted(
            (getattr(row_type, name).offset, getattr(row_type, name).size)
            for name in cpu8bit.STEP_SCALAR_FIELDS
        )
        lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
        if sum(size for _, size in spans) != hi - lo:  # the C struct keeps them together
            raise AssertionError(f"the step scalars of a row are not one span: {spans}")
        self.scalar_span = (lo, hi)
        grad_field = row_type.grad
        self.grad_column = self.rows.view(torch.int64)[:, grad_field.offset // 8]
        # each step's scalars: one row per (run, step count), copied to the rows in one
        # call; the rows of a run at one step count (the common case) share the run's
        self.step_rows = cpu8bit.step_rows(len(self.runs))
        self.step_bytes = _row_bytes(self.step_rows)
        self.run_of_row = torch.tensor(
            [r for r, (_, first, end) in enumerate(self.runs) for _ in range(first, end)],
            dtype=torch.int64,
        )
        self.scalars = torch.empty((len(self.run_of_row), hi - lo), dtype=torch.uint8)
        self.run_formats = [
            (jobs[first].state1.dtype == torch.uint8, jobs[first].coupled_weight_decay)
            for _, first, _ in self.runs
        ]
        # a step that skips rows runs the table's work items but theirs, written here
        self.step_items = (full.items._type_ * max(full.n_items, 1))()

    @classmethod
    def make(
        cls,
        engine: Any,
        prepared: _PreparedStep,
        full: Any,
        jobs: list[Any],
        places: list[tuple[int, int]],
        kernel_params: list[torch.Tensor],
        states: list[dict[str, Any]],
        skipped: list[bool],
    ) -> _KernelPlan | None:
        """A plan for the next steps, or None when this step's table cannot be kept
        (see the class docstring). ``full``: the step's table with every row's work
        items; ``states``: every row's state dict; ``skipped``: per row, whether its param
        has no grad this step."""
        if full is None or prepared.late or prepared.staged:
            return None
        if any(is_dtensor(p) for p in kernel_params):
            return None
        mng = engine.mng
        for (gi, pi), p in zip(places, kernel_params):
            if (gi, pi) in mng.index2config or id(p) in mng.pid2config:
                return None
        plan = cls(engine, prepared, full, jobs, places, kernel_params, states, skipped)
        # the scalars a later step writes must be the ones this table holds: check
        lo, hi = plan.scalar_span
        plan.write_scalars(engine.param_groups, list(map(_STEP, plan.states)))
        if not torch.equal(plan.rows[:, lo:hi], plan.scalars):
            return None
        return plan

    def table_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The state tensors the table points into, as the state dicts hold them now:
        every kernel param's ``state1`` and ``state2`` and the 8-bit ones' ``absmax1`` and
        ``absmax2`` (written by the kernel), then the 8-bit ones' ``qmap1`` and ``qmap2``
        (read: the engine's code books, the same two tensors for nearly every param).

        Raises:
            KeyError: a state dict has lost one of them.
        """
        written = list(
            itertools.chain(
                map(_STATE1, self.states),
                map(_STATE2, self.states),
                itertools.chain.from_iterable(map(_ABSMAX, self.quantized_states)),
            )
        )
        return written, list(itertools.chain.from_iterable(map(_QMAPS, self.quantized_states)))

    @staticmethod
    def addresses(written: list[torch.Tensor], qmaps: list[torch.Tensor]) -> list[int]:
        """The memory of :meth:`table_state`'s tensors: each written tensor's address,
        then each distinct code book's (reading the address touches the tensor's
        metadata, ~0.3 us a tensor once a step's kernel has moved it out of the cache)."""
        books = list({id(q): q for q in qmaps}.values())
        return list(map(_DATA_PTR, itertools.chain(written, books)))

    def rows_to_keep(self, engine: Any) -> dict[tuple[int, int], torch.Tensor]:
        """The rows of this table that a new table keeps when their param has no grad:
        ``(group index, place in the group) -> param`` of every kernel param still at
        its place in the same group dict (the new table checks the rest)."""
        groups = engine.param_groups
        kept = {}
        for (gi, pi), p in zip(self.places, self.kernel_params):
            if gi < len(groups) and groups[gi] is self.groups[gi]:
                params = groups[gi]["params"]
                if pi < len(params) and params[pi] is p:
                    kept[gi, pi] = p
        return kept

    def fits(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether ``grads`` (every param's, over all groups) are of the kinds the table
        takes: the params that had a grad when it was made have one of the same kind,
        except the table's own params, which may have none (their rows are skipped),
        and no other param has one unless it is a row of the table (a param its last
        table had, kept without a grad: :meth:`rows_to_keep`)."""
        missing = list(map(operator.is_, grads, itertools.repeat(None)))
        if missing != self.missing:
            changed = itertools.compress(
                range(len(missing)), map(operator.ne, missing, self.missing)
            )
            if not self.kernel_places.issuperset(changed):
                return False
        if not any(missing):
            return kind_columns(grads) == self.kinds
        present = list(map(operator.not_, missing))
        want = [list(itertools.compress(column, present)) for column in self.kinds]
        return kind_columns(list(itertools.compress(grads, present))) == want

    def write_scalars(self, groups: list[dict[str, Any]], steps: list[int]) -> None:
        """Write every row's step scalars for the step after ``steps`` (each row's step
        count, in row order) into :attr:`scalars` (the table's rows are not written)."""
        from optladder.optimizers.kernels import cpu8bit

        index, keys = self._scalar_keys(steps)
        if len(keys) > len(self.step_rows):
            self.step_rows = cpu8bit.step_rows(max(len(keys), 2 * len(self.step_rows)))
            self.step_bytes = _row_bytes(self.step_rows)
        corrections: dict[tuple[int, float, float], tuple[float, float]] = {}
        for k, (r, step) in enumerate(keys):
            quantized, coupled = self.run_formats[r]
            group = groups[self.runs[r][0]]
            cpu8bit.write_step_scalars(
                self.step_rows[k],
                step=step + 1,
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                quantized=quantized,
                coupled_weight_decay=coupled,
                corrections=corrections,
            )
        lo, hi = self.scalar_span
        torch.index_select(self.step_bytes[:, lo:hi], 0, index, out=self.scalars)

    def _scalar_keys(self, steps: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """``(row -> key index, keys)``: one key ``(run, step count)`` per run and step
        count among its rows, in order of first row (one per run when each run's rows
        are at one step count, the common case)."""
        firsts = [steps[first] for _, first, _ in self.runs]
        if all(
            steps[first:end].count(step) == end - first
            for (_, first, end), step in zip(self.runs, firsts)
        ):
            return self.run_of_row, list(enumerate(firsts))
        keys: list[tuple[int, int]] = []
        index: list[int] = []
        for r, ((_, first, end), step) in enumerate(zip(self.runs, firsts)):
            run = steps[first:end]
            if run.count(step) == end - first:
                index += itertools.repeat(len(keys), end - first)
                keys.append((r, step))
                continue
            at: dict[int, int] = {}
            for s in run:
                if s not in at:
                    at[s] = len(keys)
                    keys.append((r, s))
            index += map(at.__getitem__, run)
        return torch.tensor(index, dtype=torch.int64), keys

    def refresh(self, engine: Any) -> _PreparedStep | None:
        """The prepared step for the engine's current grads, step counts and options on
        this plan's table, or None when the plan no longer fits (prepare a full table).

        Raises:
            ValueError: a step count outside what the kernel steps from (see
                :func:`~optladder.optimizers.migrate.check_step_range`).
        """
        groups = engine.param_groups
        if not same_objects(groups, self.groups):
            return None
        params: list[torch.Tensor] = []
        for group, held in zip(groups, self.params):
            group_params = group["params"]
            if not same_objects(group_params, held):
                return None
            params += group_params
        grads: list[torch.Tensor | None] = list(map(grad_of, params))
        if not self.fits(grads):
            return None
        state_seen = list(engine.state.values())
        if (
            not same_objects(state_seen, self.state_seen)
            or (len(engine.mng.pid2config), len(engine.mng.index2config)) != self.n_overrides
            or list(map(torch.Tensor.data_ptr, self.kernel_params)) != self.param_ptrs
        ):
            return None
        try:
            held, qmaps = self.table_state()
        except KeyError:
            return None
        # the same tensors, in the same memory (``state["state1"].data = ...`` keeps the
        # tensor: the table would step the memory it held, freed unless held elsewhere)
        if (
            not same_objects(held, self.held)
            or not same_objects(qmaps, self.held_qmaps)
            or self.addresses(held, qmaps) != self.held_ptrs
        ):
            return None
        try:
            steps = list(map(_STEP, self.states))
        except KeyError:  # a hand edit: the full prepare refuses the state, naming the param
            return None
        if not all(isinstance(step, int) for step in (min(steps), max(steps))):
            return None
        if min(steps) < 0 or max(steps) > MAX_STEP:
            k = next(k for k, step in enumerate(steps) if not 0 <= step <= MAX_STEP)
            check_step_range(steps[k], engine, self.kernel_params[k], f"param {k}")
        kernel_grads = list(map(grads.__getitem__, self.flat_places))
        absent = list(map(operator.is_, kernel_grads, itertools.repeat(None)))
        table, states = self.table, self.states
        if any(absent):
            given = list(kernel_grads)  # a skipped row points at its param (read by no
            for k in itertools.compress(range(len(absent)), absent):  # item), as a full
                given[k] = self.kernel_params[k]  # table's does
            ptrs = list(map(_DATA_PTR, cast(list[torch.Tensor], given)))
            table = _skip_rows(self.table, absent, self.step_items)
            states = list(itertools.compress(states, map(operator.not_, absent)))
        else:
            ptrs = list(map(_DATA_PTR, cast(list[torch.Tensor], kernel_grads)))
        self.grad_column.copy_(torch.tensor(ptrs, dtype=torch.int64))
        self.write_scalars(groups, steps)
        lo, hi = self.scalar_span
        self.rows[:, lo:hi].copy_(self.scalars)  # nothing allocated: the step commits next
        self.state_seen = state_seen
        return dataclasses.replace(
            self.prepared,
            table=table,
            states=states,
            params=params,
            grads=grads,
            state_seen=state_seen,
            check_steps=steps,
        )


def _code_bounds(engine: Any, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~optladder.optimizers.kernels.cpu8bit.code_bounds` and ``code_table`` of
    ``qmap``: :func:`~optladder.optimizers.kernels.cpu8bit.book_tables` (shared by
    content: a loaded checkpoint gives each param its own copy of the same two books),
    looked up once per book tensor, cached on the engine by identity and version."""
    from optladder.optimizers.kernels import cpu8bit

    cache: dict[int, tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]]]
    cache = engine._bounds
    hit = cache.get(id(qmap))
    if hit is not None and hit[0] is qmap and hit[1] == qmap._version:
        return hit[2]
    bounds = cpu8bit.book_tables(qmap)
    cache[id(qmap)] = (qmap, qmap._version, bounds)
    return bounds


def _local_pair(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(param, grad)`` as the kernel steps them: a DTensor param's local shard and its
    grad's local shard, else the tensors themselves. The grad is None for a DTensor grad
    laid out unlike its param (e.g. ``Partial``): it is redistributed to the param's
    placements in the commit (a collective, which every rank runs after agreeing to
    commit, never in prepare, where a rank may stop early on OOM)."""
    grad = cast(torch.Tensor, p.grad)
    if not is_dtensor(p):
        return p.detach(), grad.detach()
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    if not is_dtensor(grad) or tuple(grad.placements) != placements:  # type: ignore[attr-defined]
        return local_tensor(p).detach(), None
    return local_tensor(p).detach(), local_tensor(grad).detach()


def _kernel_miss(
    engine: Any,
    pair: tuple[torch.Tensor, torch.Tensor | None],
    config: dict[str, Any],
    state: dict[str, Any],
) -> str | None:
    """Why the 8-bit CPU kernel does not step a CPU param (its local ``(param, grad)``
    from :func:`_local_pair`), or None if it does."""
    from optladder.optimizers.kernels import cpu8bit

    if engine._kernel_error is None:
        why = cpu8bit.unavailable_reason()
        if why is None:
            try:
                cpu8bit.load_library()
            except cpu8bit.cpu.KernelBuildError as exc:
                why = f"the 8-bit CPU kernel could not be built: {exc}"
        engine._kernel_error = why or ""
    if engine._kernel_error:
        return cpu8bit.fallback_reason(engine._kernel_error)
    param, grad = pair
    why = cpu8bit.param_unsupported_reason(param, param if grad is None else grad)
    if why is not None:
        return why
    if config.get("max_unorm", 0.0) > 0.0 or config.get("skip_zeros", False):
        return "max_unorm or skip_zeros is set: bitsandbytes' per-tensor CPU path steps it"
    s1 = state.get("state1")
    if s1 is None or s1.dtype not in (torch.uint8, torch.float32) or "state2" not in state:
        return "its state is not AdamW8bit's (state1/state2 of uint8 or float32)"
    return None


def _prepare_step(engine: Any) -> _PreparedStep:
    """The prepared step of a :class:`EightBitGroups`: on the engine's kept
    :class:`_KernelPlan` when it still fits, else from a full table
    (:func:`_build_step`, keeping the last table's rows whose param has no grad now),
    kept for the next steps when it can be."""
    plan = engine._kernel_plan
    carry: dict[tuple[int, int], torch.Tensor] = {}
    if plan is not None:
        prepared = plan.refresh(engine)
        if prepared is not None:
            return cast(_PreparedStep, prepared)
        carry = plan.rows_to_keep(engine)
        engine._kernel_plan = None
    built = _build_step(engine, carry)
    engine._kernel_plan = _KernelPlan.make(engine, *built)
    return built.prepared


class _Built(NamedTuple):
    """What :func:`_build_step` made: the prepared step, its table with every row's work
    items (the prepared one leaves out those of skipped rows), and per row in table
    order: its job, ``(gindex, pindex)``, param, state dict and whether it is skipped
    (its param has no grad this step)."""

    prepared: _PreparedStep
    full: Any
    jobs: list[Any]
    places: list[tuple[int, int]]
    kernel_params: list[torch.Tensor]
    states: list[dict[str, Any]]
    skipped: list[bool]


def _build_step(engine: Any, carry: dict[tuple[int, int], torch.Tensor] | None = None) -> _Built:
    """Route each param with a grad of a :class:`EightBitGroups` to the 8-bit CPU kernel or
    to bitsandbytes, and prepare the kernel's tables; record why each CPU param that
    is not on the kernel is not, in ``engine.eager_reasons`` (param index over all
    groups -> reason).

    Args:
        engine: the engine.
        carry: ``(gindex, pindex) -> param`` of params that get a row of the table
            without a grad (skipped this step: no work items, no step bump), when the
            kernel can step them (a plain contiguous CPU param with its state); the
            last table's rows (:meth:`_KernelPlan.rows_to_keep`).

    Returns:
        The prepared step and its rows, in table order (by group, then state format,
        then param order): :class:`_Built`.
    """
    from optladder.optimizers.kernels import cpu8bit

    carry = carry or {}
    entries: list[tuple[int, bool, int, Any, dict[str, Any], torch.Tensor, bool]] = []
    check_states: list[dict[str, Any]] = []
    others: list[tuple[dict[str, Any], torch.Tensor, int, int]] = []
    late: list[tuple[torch.Tensor, cpu8bit.Job, dict[str, Any]]] = []
    staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    reasons: dict[int, str] = {}
    jobs: list[cpu8bit.Job] = []
    index = -1
    for gindex, group in enumerate(engine.param_groups):
        for pindex, p in enumerate(group["params"]):
            index += 1
            grad = p.grad
            skip = grad is None
            # a param without a grad that was a row of the last table keeps its row,
            # skipped (see _KernelPlan), if it can
            if skip and not (_carried(engine, p) and carry.get((gindex, pindex)) is p):
                continue
            state = engine.state[p]
            if p.device.type != "cpu" or len(state) == 0:
                others.append((group, p, gindex, pindex))  # bitsandbytes' own kernel
                continue
            check_step_range(int(state["step"]), engine, p, f"param {pindex} of group {gindex}")
            config = engine.get_config(gindex, pindex, group)
            pair = (p.detach(), p.detach()) if skip else _local_pair(p)
            copies = engine._contiguous.get(p)
            if skip:
                pass  # contiguous: its param stands in for its grad (its row runs no items)
            elif copies is not None and not p.is_contiguous():  # stepped in its copy
                work, work_grad = copies
                pair = (work, work_grad if work_grad is not None else pair[1])
                staged.append((p, work, work_grad))
            elif (
                pair[1] is not None
                and not pair[1].is_contiguous()
                and pair[0].is_contiguous()
                and pair[1].layout == torch.strided
                and pair[1].shape == pair[0].shape
                and pair[1].device == pair[0].device
            ):  # a hand-set grad laid out unlike its param (a transposed or expanded view):
                # the kernel reads a contiguous copy, allocated here and filled in the
                # commit (bitsandbytes' per-tensor path stepped it: 8-9x slower at 1M
                # elements, and other bits)
                work_grad = torch.empty(pair[1].shape, dtype=pair[1].dtype, device=p.device)
                staged.append((p, p, work_grad))  # p.copy_(p) returns at once
                pair = (pair[0], work_grad)
            why = _kernel_miss(engine, pair, config, state)
            quantized = why is None and state["state1"].dtype == torch.uint8
            enc1: tuple[torch.Tensor | None, ...] = (None, None)
            enc2: tuple[torch.Tensor | None, ...] = (None, None)
            if quantized:
                try:
                    enc1 = _code_bounds(engine, state["qmap1"])
                    enc2 = _code_bounds(engine, state["qmap2"])
                except ValueError as exc:
                    why = f"its code books do not fit the kernel: {exc}"
            if why is not None:
                if skip:
                    continue
                reasons[index] = why
                others.append((group, p, gindex, pindex))
                continue
            coupled = bool(engine.coupled_weight_decay)
            wd = config["weight_decay"]
            jobs.append(
                cpu8bit.Job(
                    param=pair[0],
                    grad=pair[0] if pair[1] is None else pair[1],  # the former: redistributed
                    state1=state["state1"],
                    state2=state["state2"],
                    absmax1=state.get("absmax1") if quantized else None,
                    absmax2=state.get("absmax2") if quantized else None,
                    bounds1=enc1[0],
                    bounds2=enc2[0],
                    table1=enc1[1],
                    table2=enc2[1],
                    qmap1=state.get("qmap1") if quantized else None,
                    qmap2=state.get("qmap2") if quantized else None,
                    step=int(state["step"]) + 1,
                    lr=float(config["lr"]),
                    betas=(float(config["betas"][0]), float(config["betas"][1])),
                    eps=float(config["eps"]),
                    weight_decay=float(group["weight_decay"] if coupled else wd),
                    coupled_weight_decay=coupled,
                )
            )
            if pair[1] is None:
                late.append((p, jobs.pop(), state))
            else:
                entries.append((gindex, quantized, pindex, jobs.pop(), state, p, skip))
            check_states.append(state)
    entries.sort(key=lambda e: (e[0], e[1]))  # runs of one group and state format
    jobs = [e[3] for e in entries]
    states = [e[4] for e in entries]
    skipped = [e[6] for e in entries]
    full = table = cpu8bit.prepare_table(jobs) if jobs else None
    run_states = states
    if any(skipped):
        table = _skip_rows(full, skipped)
        run_states = list(itertools.compress(states, map(operator.not_, skipped)))
    for _, job, _ in late:
        cpu8bit.prepare_table([job])  # checks it now (its table is written in the commit)
    engine.eager_reasons = reasons
    params = [p for g in engine.param_groups for p in g["params"]]
    prepared = _PreparedStep(
        table=table,
        library=cpu8bit.load_library() if jobs or late else None,
        states=run_states,
        others=others,
        late=late,
        staged=staged,
        params=params,
        grads=list(map(grad_of, params)),
        state_seen=list(engine.state.values()),
        check_states=check_states,
        check_steps=list(map(_STEP, check_states)),
        check_state1=list(map(_STATE1, check_states)),
        n_groups=len(engine.param_groups),
    )
    places = [(e[0], e[2]) for e in entries]
    return _Built(prepared, full, jobs, places, [e[5] for e in entries], states, skipped)


def _carried(engine: Any, p: torch.Tensor) -> bool:
    """Whether a param without a grad can keep its row in the 8-bit CPU kernel's table:
    a plain contiguous CPU param with its state."""
    return (
        p.device.type == "cpu"
        and not is_dtensor(p)
        and p.is_contiguous()
        and bool(engine.state.get(p))
    )


def _skip_rows(table: Any, skipped: list[bool], out: Any = None) -> Any:
    """``table`` without the work items of the rows ``skipped`` marks (their params are
    not read or written; the param rows are ``table``'s own), written into ``out`` (an
    item array at least as long as ``table``'s) or a new item array."""
    items = table.items
    item_type = items._type_
    if ctypes.sizeof(item_type) % 8 or item_type.param.offset % 8:
        raise AssertionError("a work item of the 8-bit CPU kernel is not a row of int64s")
    every = _row_bytes(items)[: table.n_items]
    rows = every.view(torch.int64)[:, item_type.param.offset // 8]
    present = torch.tensor(skipped, dtype=torch.bool).logical_not_()
    keep = torch.nonzero(present[rows]).squeeze(1)
    if out is None:
        out = (item_type * max(table.n_items, 1))()
    n = keep.numel()
    torch.index_select(every, 0, keep, out=_row_bytes(out)[:n])
    return dataclasses.replace(table, items=out, n_items=n)


def check_8bit_param(p: torch.Tensor, where: str) -> None:
    """Raise unless the 8-bit rung can take ``p`` (:data:`optladder.rungs.RUNG_ACCEPTS`:
    real float32, bfloat16 or float16).

    Args:
        p: the param.
        where: names it in the message, e.g. ``"param 2 of group 0"``.

    Raises:
        ValueError: naming the param, its dtype and what is allowed.
    """
    refusal = param_refusal("8bit", dtype_name(p.dtype), sharded=is_dtensor(p))
    if refusal is not None:
        kind = f"is complex ({p.dtype})" if p.is_complex() else f"has dtype {p.dtype}"
        raise ValueError(f"{where} {kind}; {refusal}")


def check_8bit_groups(
    param_groups: list[dict[str, Any]], columns: ParamColumns | None = None
) -> None:
    """Refuse params the 8bit rung cannot take: complex params, dtypes bitsandbytes does
    not take, a bitsandbytes override it would fail on (``optim_bits`` not 8 or 32).
    ``columns``: the :class:`optladder.columns.ParamColumns` of ``param_groups`` when
    read already (then only dtypes are read again, when no override is set).

    Raises:
        ValueError: naming the param (``param {pi} of group {gi}``), its dtype and what
            is allowed.
    """
    if columns is None:
        columns = ParamColumns(param_groups)
    names = columns.dtype_names
    bulk = columns.plain and no_overrides()  # then only dtypes can be refused
    if not bulk or any(param_refusal("8bit", n, sharded=False) is not None for n in names):
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                check_8bit_param(p, f"param {pi} of group {gi}")
                quantized_8bit(p, f"param {pi} of group {gi}")


def _require_bitsandbytes() -> None:
    """Import bitsandbytes for the 8bit rung.

    Raises:
        ImportError: if it does not import, saying how to install it.
    """
    try:
        import_bitsandbytes()
    except ImportError as exc:
        raise ImportError(
            f"the 8bit rung needs bitsandbytes, which does not import ({exc}); "
            "install it with pip install 'bitsandbytes>=0.45' (what optladder's 8bit extra "
            "installs)"
        ) from exc


def prepare_8bit_format(
    param_groups: list[dict[str, Any]], columns: ParamColumns | None = None
) -> None:
    """Check ``param_groups`` for the 8bit state format (:func:`check_8bit_groups`),
    import bitsandbytes, and mark each group ``"rung": "8bit"`` (the groups are built
    over by :class:`optladder.AdamW`, a :class:`~optladder.optimizers.adamw.LadderAdamW`).

    Raises:
        ImportError: if bitsandbytes does not import (the message says how to install
            it); no group is marked then.
        ValueError: as :func:`check_8bit_groups`.
    """
    check_8bit_groups(param_groups, columns)
    _require_bitsandbytes()
    for group in param_groups:
        group[RUNG_KEY] = "8bit"
