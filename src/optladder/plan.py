"""``optladder plan``: which rung a model's optimizer state would get on a target device.

Nothing is trained and nothing is allocated: the model is a parameter count, a Hugging
Face ``config.json`` built on the meta device, or a factory called on the meta device.
:func:`make_plan` returns the numbers (one :class:`PlanRow` per rung) and the
:class:`optladder.Decision`; :func:`print_plan` prints them with rich.

Sharding (``world_size > 1``): the optimizer state is split across the ranks (ZeRO-1/2,
FSDP), so each rank holds ``ceil(moment bytes / world_size)`` bytes of moments (the
8-bit rung's absmax included) plus, on the 8-bit rung, its own copy of bitsandbytes'
2,048 bytes of code books. The memory gate compares these per-rank bytes with the free
memory of one device. The decision's footprint carries the per-rank ``state_bytes``
while ``trainable_params`` stays the global count (the proactive-bf16 threshold and
bitsandbytes' 4,096-element rule both apply to global sizes).

Errors are :class:`PlanError` (a ``ValueError``) whose messages name the command-line
option (a keyword argument of :func:`make_plan` with dashes: ``model_config`` is
``--model-config``), its value, and what is allowed.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from optladder import units
from optladder.dtype_names import canonical_dtype, dtype_name
from optladder.optimizers import probe_capabilities
from optladder.policies import (
    Decision,
    Footprint,
    Policy,
    decide,
    measure_footprint,
    normalize_param_groups,
    probe_free_memory,
    read_overrides,
    rung_state_bytes,
    trainable_params,
)
from optladder.rungs import BNB_MIN_8BIT_SIZE, BNB_QMAP_BYTES, RUNGS, Rung, quantizes
from optladder.units import format_bytes, parse_bytes

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Param dtypes ``--dtype`` accepts (other spellings: :mod:`optladder.dtype_names`)."""

CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")
"""The keys of a Hugging Face config.json that name its params' dtype: ``dtype`` (what
transformers >= 4.56 writes) and ``torch_dtype`` (what earlier versions wrote, still read);
``dtype`` wins when both are present, as in ``PretrainedConfig``."""


class PlanError(ValueError):
    """Bad input to :func:`make_plan`; the message names the option, its value, and
    what is allowed."""


class FreeMemoryUnknownError(PlanError):
    """The target device is not on this machine and no ``free_memory`` was given, so
    there is nothing to decide against (the state bytes can still be estimated: pass
    ``free_memory=0`` and read each row's ``min_free_memory``)."""


class PlanRow(BaseModel):
    """One rung of a plan.

    Attributes:
        rung: the rung.
        state_bytes: optimizer-state bytes of the whole model on one device (unsharded).
        per_rank_bytes: optimizer-state bytes each rank holds: ``ceil(moments /
            world_size)`` plus, on the 8-bit rung, one copy of the code books.
        share_of_free: ``per_rank_bytes / free_memory``; None when no memory is free.
        passes_gate: whether ``per_rank_bytes`` is at most the gate
            (``memory_fraction * free_memory`` bytes).
        min_free_memory: the least free bytes of one device under which
            ``per_rank_bytes`` passes the gate (:func:`min_free_memory`).
        fused: whether the rung's engine runs on a fused kernel on the target device.
        chosen: whether the decision picked this rung.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rung: Rung
    state_bytes: int
    per_rank_bytes: int
    share_of_free: float | None
    passes_gate: bool
    min_free_memory: int
    fused: bool
    chosen: bool


class Plan(BaseModel):
    """What :func:`make_plan` found: the model, the target, one row per rung, the decision.

    Attributes:
        source: the model, in words (``"--params 7e9"``, ``"config gpt2 (shipped: ...)"``).
        notes: assumptions the numbers rest on, in sentences.
        trainable_params: trainable param elements of the whole model.
        param_tensors: distinct trainable param tensors (1 for ``--params``).
        dtypes: the params' dtype names.
        param_bytes: bytes of the trainable params themselves (elements times each
            one's dtype size; not sharded), beside which the optimizer state lives.
        device: the target device, e.g. ``"cuda"``.
        device_present: whether that device exists on this machine (if not, its
            capabilities come from torch's kernel lists).
        world_size: ranks the state is sharded across, ``>= 1``.
        free_memory: free bytes of one device.
        free_memory_source: where ``free_memory`` came from.
        budget_bytes: the gate, ``memory_fraction * free_memory`` bytes per rank.
        rows: one :class:`PlanRow` per rung, from ``fp32`` to ``8bit``.
        decision: the :class:`optladder.Decision` (its footprint is per rank).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    notes: tuple[str, ...]
    trainable_params: int
    param_tensors: int
    dtypes: tuple[str, ...]
    param_bytes: int
    device: str
    device_present: bool
    world_size: int
    free_memory: int
    free_memory_source: str
    budget_bytes: int
    rows: tuple[PlanRow, ...]
    decision: Decision


def parse_count(value: object, name: str = "--params") -> int:
    """:func:`optladder.units.parse_count`, raising :class:`PlanError`.

    Args:
        value: an ``int`` or a string such as ``"7e9"``, ``"1.5B"``, ``"350M"``.
        name: the option it came from, for the error message.

    Returns:
        The count, an ``int`` from 1 to :data:`optladder.units.MAX_COUNT`.

    Raises:
        PlanError: if the value is not a whole number in that range.
    """
    try:
        return units.parse_count(value, name)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def min_free_memory(state_bytes: int, memory_fraction: float) -> int:
    """The least free memory (bytes) under which ``state_bytes`` passes the memory gate.

    The gate is ``int(memory_fraction * free_memory)`` bytes (:func:`optladder.decide`),
    so this is the smallest integer ``F`` with ``int(memory_fraction * F) >= state_bytes``.

    Args:
        state_bytes: optimizer-state bytes (per rank), ``>= 0``.
        memory_fraction: the policy's gate fraction, in ``(0, 1]``.
    """
    free = math.ceil(state_bytes / memory_fraction)
    while int(memory_fraction * free) < state_bytes:  # float rounding: at most a step or two
        free += 1
    while free > 0 and int(memory_fraction * (free - 1)) >= state_bytes:
        free -= 1
    return free


def shipped_configs() -> dict[str, Path]:
    """The architectures' config.json files shipped in ``optladder/configs``, by name."""
    folder = resources.files("optladder") / "configs"
    return {
        entry.name.removesuffix(".json"): Path(str(entry))
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".json")
    }


def resolve_config(spec: str | Path) -> tuple[Path, str]:
    """Find the config.json that ``--model-config`` names.

    Args:
        spec: a path to a config.json file, a folder holding one, or the bare name of a
            shipped config (``gpt2``, ``llama-2-7b``, ...; see :func:`shipped_configs`).

    Returns:
        The file's path and a description of it.

    Raises:
        PlanError: if no such file or shipped name exists.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path, str(path)
    if (path / "config.json").is_file():
        return path / "config.json", str(path / "config.json")
    shipped = shipped_configs()
    if str(spec) in shipped:
        return shipped[str(spec)], f"{spec} (shipped with optladder)"
    what = "a folder without a config.json" if path.is_dir() else "not a file"
    raise PlanError(
        f"--model-config={str(spec)!r} is {what}, nor a shipped config; expected a "
        f"config.json file, a folder holding one, or one of: {', '.join(shipped)}"
    )


def model_from_config(path: Path) -> tuple[torch.nn.Module, str]:
    """Build a Hugging Face transformers model from a config.json on the meta device.

    Uses ``AutoConfig`` and ``AutoModelForCausalLM.from_config`` (``AutoModel`` for
    architectures without a causal-LM head) under ``torch.device("meta")``: no weights
    are allocated and nothing is downloaded. A ``dtype``/``torch_dtype`` of ``"auto"``
    names no dtype (:func:`config_dtype`) and is left out of the config transformers
    reads, which would take it for a torch dtype.

    Args:
        path: the config.json file.

    Returns:
        The model (params on the meta device) and the name of its class.

    Raises:
        ImportError: if transformers is not installed.
        PlanError: if the file is not a JSON object with a ``model_type`` transformers
            knows, or transformers cannot read it or build a model from it (whatever it
            raises on the values: a width of 0, a count given as a string).
    """
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"--model-config={str(path)!r} is not a readable JSON file: {exc}") from exc
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise PlanError(
            f"--model-config={str(path)!r} has no 'model_type' key; expected a Hugging Face "
            "transformers config.json (e.g. 'model_type': 'llama')"
        )
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "--model-config needs transformers: pip install 'transformers>=4.40' (what "
            "optladder's plan extra installs) "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    auto = [key for key in CONFIG_DTYPE_KEYS if raw.get(key) == "auto"]
    try:
        if auto:  # "auto" names no dtype (config_dtype), but transformers takes it for one
            kept = {k: v for k, v in raw.items() if k not in auto}
            config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(kept)
        else:
            config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # the user's file: whatever transformers raises on it
        raise PlanError(
            f"--model-config={str(path)!r}: transformers {transformers.__version__} cannot read "
            f"it ({type(exc).__name__}: {exc})"
        ) from exc
    errors = []
    for auto_class in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            with torch.device("meta"):
                model = auto_class.from_config(config)
        except Exception as exc:  # the user's config: whatever building from it raises
            errors.append(f"{auto_class.__name__}: {type(exc).__name__}: {exc}")
            continue
        return model, type(model).__name__
    raise PlanError(
        f"--model-config={str(path)!r}: transformers {transformers.__version__} cannot build a "
        f"model of model_type {raw['model_type']!r} from it ({'; '.join(errors)})"
    )


def config_dtype(path: Path) -> tuple[str | None, str]:
    """The params' dtype a Hugging Face config.json names, if any.

    Reads ``dtype`` or else ``torch_dtype`` (:data:`CONFIG_DTYPE_KEYS`): the dtype of the
    checkpoint's weights, which ``from_pretrained(..., dtype="auto")`` loads and most
    fine-tuning then trains in. ``null``, a missing key and ``"auto"`` name none.

    Args:
        path: the config.json file.

    Returns:
        The canonical dtype name (``"bfloat16"``, ...) or None, and the key it came from
        (``""`` when none).

    Raises:
        PlanError: if the file is not a JSON object, or the key names a dtype other than
            float32, bfloat16 or float16 (any spelling of :mod:`optladder.dtype_names`);
            the message says that ``--dtype`` overrides it.
    """
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"--model-config={str(path)!r} is not a readable JSON file: {exc}") from exc
    if not isinstance(raw, dict):
        raise PlanError(f"--model-config={str(path)!r} holds no JSON object")
    for key in CONFIG_DTYPE_KEYS:
        value = raw.get(key)
        if value is None or value == "auto":
            continue
        try:
            return canonical_dtype(value, f"--model-config {str(path)!r}: {key}"), key
        except ValueError as exc:
            raise PlanError(f"{exc}; or give --dtype to override it") from None
    return None, ""


def model_from_factory(spec: str) -> torch.nn.Module:
    """Import ``package.module:callable`` and call it, without arguments, on the meta device.

    The current directory is searched first, as ``python -m`` would (only while
    importing). ``callable`` may be dotted (``module:Class.build``).

    Args:
        spec: ``"package.module:callable"``.

    Returns:
        The module it returns.

    Raises:
        PlanError: if the spec is malformed, the module does not import, the attribute is
            missing or not callable, the call fails, or it returns no ``torch.nn.Module``.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise PlanError(
            f"--model={spec!r} is not a factory spec; expected 'package.module:callable' "
            "(a callable taking no arguments that returns a torch.nn.Module), "
            "e.g. 'mypkg.models:build_model'"
        )
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name.strip())
    except Exception as exc:  # the user's module: any import-time error
        raise PlanError(
            f"--model={spec!r}: module {module_name!r} does not import ({type(exc).__name__}: "
            f"{exc}); check the name and that it is on PYTHONPATH or under the current folder"
        ) from exc
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    target: Any = module
    for part in attr.strip().split("."):
        if not hasattr(target, part):
            raise PlanError(f"--model={spec!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise PlanError(
            f"--model={spec!r}: {attr} is a {type(target).__name__}, not a callable; expected "
            "a callable taking no arguments that returns a torch.nn.Module"
        )
    try:
        inspect.signature(target).bind()
    except TypeError as exc:
        raise PlanError(
            f"--model={spec!r}: {attr} needs arguments ({exc}); expected a callable taking "
            "no arguments that returns a torch.nn.Module"
        ) from None
    except ValueError:  # no signature to read (some builtins): calling it will tell
        pass
    try:
        with torch.device("meta"):
            model = target()
    except Exception as exc:  # the user's code: report whatever it raised
        raise PlanError(
            f"--model={spec!r}: calling {attr}() on the meta device failed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise PlanError(
            f"--model={spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _device_present(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        index = device.index or 0
        return torch.cuda.is_available() and index < torch.cuda.device_count()
    return False


def _free_memory(
    device: torch.device, free_memory: int | str | None, present: bool
) -> tuple[int, str]:
    if free_memory is not None:
        return parse_bytes(free_memory, "--free-memory"), "given as --free-memory"
    if not present:
        raise FreeMemoryUnknownError(
            f"--device={str(device)!r} is not present on this machine, so its free memory "
            "cannot be probed; to plan for that device, pass --free-memory with its free "
            "bytes, e.g. --free-memory 80GiB (an 80 GB GPU) or --free-memory 141GB"
        )
    try:
        probe = probe_free_memory(device)
    except ValueError as exc:
        raise PlanError(f"{exc} (--free-memory, e.g. --free-memory 80GiB)") from exc
    return probe.free_bytes, f"probed on {probe.device}: {probe.source}"


def _shard(state: Mapping[Rung, int], codebook_bytes: int, world_size: int) -> dict[Rung, int]:
    """Per-rank state bytes: moments split across ranks, code books on every rank."""
    per_rank: dict[Rung, int] = {}
    for rung in RUNGS:
        books = codebook_bytes if rung == "8bit" else 0
        per_rank[rung] = -(-(state[rung] - books) // world_size) + books  # exact int ceil
    return per_rank


def make_plan(
    *,
    params: int | str | None = None,
    model_config: str | Path | None = None,
    model: str | None = None,
    device: str = "cuda",
    free_memory: int | str | None = None,
    world_size: int = 1,
    dtype: str | None = None,
    policy: Policy | None = None,
    rung: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    """Estimate every rung's optimizer state for a model on a target device, and decide.

    Give exactly one of ``params``, ``model_config`` and ``model``.

    Args:
        params: a trainable param count (elements), e.g. ``7_000_000_000`` or ``"7e9"``.
            The params are taken to be float32 (or ``dtype``) and every tensor at least
            bitsandbytes' 4,096-element minimum, so the 8-bit rung quantizes all of them.
        model_config: a Hugging Face transformers config.json (a file, a folder holding
            one, or a shipped name such as ``"gpt2"``), built on the meta device.
        model: ``"package.module:callable"``, called without arguments on the meta device.
        device: the target device; its kernels decide which rungs are fused. It need
            not be present here (a CPU-only machine can plan for ``"cuda"``).
        free_memory: free bytes of one target device (an int or ``"80GiB"``); probed
            when None, which needs the device to be present.
        world_size: ranks the optimizer state is sharded across, ``>= 1``.
        dtype: the params' dtype (``float32``, ``bfloat16``, ``float16``, or another
            spelling of :mod:`optladder.dtype_names`: ``bf16``, ``fp16``, ``half``...);
            default float32 for ``params``, the config's ``dtype`` or ``torch_dtype``
            (:func:`config_dtype`; float32 when it names none) for ``model_config``, the
            factory's own for ``model``.
        policy: the thresholds; default :class:`optladder.Policy()`.
        rung: fix the rung, as ``choose_optimizer(rung=...)`` does.
        environ: where to read ``OPTLADDER_*`` overrides; None means ``os.environ``.

    Returns:
        The :class:`Plan`.

    Raises:
        FreeMemoryUnknownError: ``free_memory`` is None and ``device`` is not present.
        PlanError: bad or missing input (the message names the option).
        ImportError: ``model_config`` without transformers installed.
        optladder.OverrideError: an unknown or contradictory ``OPTLADDER_*`` variable.
    """
    given = {
        name: value
        for name, value in (
            ("--params", params),
            ("--model-config", model_config),
            ("--model", model),
        )
        if value is not None
    }
    if len(given) != 1:
        found = "none" if not given else " and ".join(given)
        raise PlanError(
            "give exactly one of --params, --model-config, --model to describe the model; "
            f"got {found}"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"--world-size={world_size!r} is not allowed; expected an integer >= 1")
    if dtype is not None:
        try:
            dtype = canonical_dtype(dtype, "--dtype")
        except ValueError as exc:
            raise PlanError(str(exc)) from None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PlanError(
            f"--device={device!r} is not a torch device ({exc}); expected e.g. cuda, cuda:1, cpu"
        ) from None
    count = parse_count(params, "--params") if params is not None else 0
    overrides = read_overrides(rung, environ)
    present = _device_present(target)
    free, free_source = _free_memory(target, free_memory, present)
    param_dtype = DTYPES[dtype or "float32"]

    notes: list[str] = []
    if params is not None:
        param_bytes = count * param_dtype.itemsize
        state = {r: rung_state_bytes(r, count, param_dtype) for r in RUNGS}
        codebooks = BNB_QMAP_BYTES if quantizes(count) else 0
        state["8bit"] += codebooks
        footprint = Footprint(
            trainable_params=count,
            param_tensors=1,
            frozen_params=0,
            largest_param=count,
            devices=(str(target),),
            dtypes=(dtype_name(param_dtype),),
            has_complex=False,
            state_bytes=state,
        )
        source = f"--params {params} ({count:,} params)"
        notes.append(
            f"--params alone: params assumed {footprint.dtypes[0]}, and every tensor assumed "
            f">= {BNB_MIN_8BIT_SIZE:,} elements (8bit quantizes them all: 2 bytes/param plus "
            "a float32 absmax per 256 elements per moment, plus 2,048 bytes of code books)"
        )
    else:
        if model_config is not None:
            path, described = resolve_config(model_config)
            try:  # before transformers reads the value
                from_config, key = config_dtype(path)
            except PlanError:
                if dtype is None:
                    raise
                from_config, key = None, ""  # --dtype given: the config's is not needed
            module, class_name = model_from_config(path)
            source = f"--model-config {described}: {class_name}"
            if dtype is not None:
                said = f"; the config's {key} is {from_config}" if from_config else ""
                notes.append(f"params taken as {dtype} (--dtype{said})")
            elif from_config is not None:
                param_dtype = DTYPES[from_config]
                notes.append(
                    f"params taken as {from_config}, the config's {key} (--dtype to change)"
                )
            else:
                notes.append(
                    "params taken as float32: the config names no dtype (no dtype or "
                    "torch_dtype key, or 'auto'; --dtype to change)"
                )
            module = module.to(dtype=param_dtype)  # on the meta device: no memory
        else:
            assert model is not None
            module = model_from_factory(model)
            source = f"--model {model}: {type(module).__name__}"
            if dtype is not None:
                module = module.to(dtype=param_dtype)  # on the meta device: no memory
                notes.append(f"params taken as {dtype} (--dtype)")
        footprint = measure_footprint(module)
        tensors = trainable_params(normalize_param_groups(module))
        param_bytes = sum(p.numel() * p.element_size() for p in tensors)
        codebooks = BNB_QMAP_BYTES if quantizes(footprint.largest_param) else 0
        # One target device: the code books are counted once, wherever the params were built.
        state = {r: sum(rung_state_bytes(r, p.numel(), p.dtype) for p in tensors) for r in RUNGS}
        state["8bit"] += codebooks
        footprint = footprint.model_copy(update={"devices": (str(target),), "state_bytes": state})
        if footprint.frozen_params:
            notes.append(f"{footprint.frozen_params:,} frozen params (requires_grad=False) skipped")
    if world_size > 1:
        notes.append(
            f"state sharded across {world_size} ranks: each holds ceil(moments / {world_size})"
            f" bytes (8bit: plus its own {BNB_QMAP_BYTES:,} bytes of code books); the gate "
            "compares that with one device's free memory"
        )
        free_source += f"; one of {world_size} ranks, state bytes per rank"
    per_rank = _shard(footprint.state_bytes, codebooks, world_size)
    rank_footprint = footprint.model_copy(update={"state_bytes": per_rank})
    capabilities = probe_capabilities(target, footprint.dtypes, footprint.has_complex)
    if not present:
        notes.append(
            f"{target} is not present on this machine: its fused kernels are taken from "
            f"torch {torch.__version__}'s lists"
        )
    decision = decide(
        rank_footprint,
        free,
        capabilities,
        policy or Policy(),
        overrides,
        free_memory_source=free_source,
    )
    rows = tuple(
        PlanRow(
            rung=r,
            state_bytes=footprint.state_bytes[r],
            per_rank_bytes=per_rank[r],
            share_of_free=per_rank[r] / free if free else None,
            passes_gate=per_rank[r] <= decision.budget_bytes,
            min_free_memory=min_free_memory(per_rank[r], decision.policy.memory_fraction),
            fused=capabilities.fused[r],
            chosen=r == decision.rung,
        )
        for r in RUNGS
    )
    return Plan(
        source=source,
        notes=tuple(notes),
        trainable_params=footprint.trainable_params,
        param_tensors=footprint.param_tensors,
        dtypes=footprint.dtypes,
        param_bytes=param_bytes,
        device=str(target),
        device_present=present,
        world_size=world_size,
        free_memory=free,
        free_memory_source=free_source,
        budget_bytes=decision.budget_bytes,
        rows=rows,
        decision=decision,
    )


def _bytes_cell(n: int) -> str:
    return f"{n:,} ({format_bytes(n)})"


def print_plan(plan: Plan, *, decided: bool = True) -> None:
    """Print a plan: the model and target, a table with one row per rung, the decision.

    Args:
        plan: from :func:`make_plan`.
        decided: False when the free memory is unknown (the plan was made with
            ``free_memory=0`` only for its estimates): the free memory, the gate's
            verdicts and the decision are left out; each rung's state bytes and the free
            memory it needs are printed.
    """
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:  # a pipe or a file: no 80-column wrap of the numbers
        console = Console(file=sys.stdout, highlight=False, width=140)
    d = plan.decision
    tensors = "1 tensor" if plan.param_tensors == 1 else f"{plan.param_tensors:,} tensors"
    lines = [
        f"model: {plan.source}",
        f"       {plan.trainable_params:,} trainable params in {tensors} "
        f"({', '.join(plan.dtypes)}): {_bytes_cell(plan.param_bytes)} of params",
    ]
    if decided:
        lines += [
            f"target: {plan.device}, world size {plan.world_size}; free memory "
            f"{_bytes_cell(plan.free_memory)} per device ({plan.free_memory_source})",
            f"gate: {d.policy.memory_fraction:.0%} of free memory = "
            f"{_bytes_cell(plan.budget_bytes)} per rank",
        ]
    else:
        lines.append(
            f"target: {plan.device}, world size {plan.world_size}; free memory unknown "
            f"(gate: {d.policy.memory_fraction:.0%} of it)"
        )
    lines += [f"note: {note}" for note in plan.notes]
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)
    table = Table(title=None, show_lines=False)
    table.add_column("rung", no_wrap=True)
    table.add_column("state bytes", justify="right", no_wrap=True)
    table.add_column(f"per rank (/{plan.world_size})", justify="right", no_wrap=True)
    if decided:
        table.add_column("of free", justify="right", no_wrap=True)
        table.add_column("passes gate", no_wrap=True)
    table.add_column("needs free", justify="right", no_wrap=True)
    table.add_column("fused", no_wrap=True)
    for row in plan.rows:
        share = "-" if row.share_of_free is None else f"{row.share_of_free:.1%}"
        verdict = [share, "yes" if row.passes_gate else "no"] if decided else []
        chosen = decided and row.chosen
        table.add_row(
            f"{row.rung} <- chosen" if chosen else row.rung,
            _bytes_cell(row.state_bytes),
            _bytes_cell(row.per_rank_bytes),
            *verdict,
            format_bytes(row.min_free_memory),
            "yes" if row.fused else "no",
            style="bold" if chosen else None,
        )
    console.print(table)
    if not decided:
        return
    console.print("decision:", markup=False)
    console.print(d.summary(), markup=False, soft_wrap=True)
    if not d.fits and d.origin == "policy":
        console.print(
            "choose_optimizer would raise InsufficientMemoryError here; with strict=False it "
            f"builds {d.rung} anyway and warns",
            markup=False,
            soft_wrap=True,
        )
