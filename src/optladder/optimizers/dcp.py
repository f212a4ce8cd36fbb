"""Loading optimizer state with ``torch.distributed.checkpoint`` (DCP) across rungs.

DCP loads *into* a template: the state dict passed to ``dcp.load`` (for an optimizer,
``get_optimizer_state_dict(model, opt)``, i.e. the live optimizer's ``state_dict()``).
It reads only the template's keys, refuses a key the checkpoint lacks, refuses a tensor
whose size differs, and copies each saved tensor into the template's tensor, casting to
the template's dtype. A rung's state has its own keys, sizes and dtypes (Adam moments,
bfloat16 moments, uint8 codes with block scales), so a template made on one rung cannot
hold a checkpoint saved on another: keys are missing, and no choice of rung-independent
keys helps, because float moments copied into a uint8 template are truncated
(``0.75 -> 0``) and uint8 codes need their block scales to mean anything.

:class:`DCPLoadPlanner` is DCP's ``DefaultLoadPlanner`` that, once the checkpoint's
metadata is read and before any tensor is, fits each optladder optimizer state dict in
the template to what the checkpoint holds: every param whose saved entries (keys, sizes,
dtypes) differ from the template's gets new tensors of the saved sizes and dtypes (laid
out like the param's rows for a DTensor param, as
:mod:`optladder.optimizers.checkpoint` saves them), params the checkpoint has no state
for are dropped, and the param groups take the saved keys. ``load_state_dict`` (through
``set_optimizer_state_dict``) then converts the checkpoint's state into each group's
rung, as it does for a ``torch.save`` checkpoint.

Where the template already fits (the same rung), its tensors are the live optimizer's
own (``get_optimizer_state_dict`` returns them), and DCP would write the checkpoint into
them before ``load_state_dict`` has checked it: a checkpoint it then refuses (a NaN
moment, a step that is no whole number, a rung misspelt) would have replaced the live
state already. So by default every optimizer entry gets new tensors, and the live state
changes only when ``load_state_dict`` accepts the whole checkpoint (optladder's promise:
a failed load leaves the optimizer as it was). ``in_place=True`` keeps fitting templates
as they are, so DCP loads into the live tensors as it does without this planner: no
extra memory on the same rung, but a refused checkpoint then leaves its values in the
live state. The new tensors are the checkpoint's state of this rank: the load needs
them as extra memory (one copy of the optimizer state on this rank) until
``load_state_dict`` has copied or converted them.

An optimizer state dict is recognized as a mapping with a ``"state"`` mapping and a
``"param_groups"`` list of dicts of which one carries optladder's ``"rung"`` key; the
rest of the template (the model, other optimizers) is loaded as DCP always does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import pairwise
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from optladder.optimizers.checkpoint import rows_like
from optladder.rungs import RUNG_KEY
from optladder.sharding import is_dtensor, local_tensor

__all__ = ["DCPLoadPlanner", "fit_optimizer_templates"]

Path = tuple[str | int, ...]

_REPLICATED = frozenset({"qmap1", "qmap2", "absmax1", "absmax2"})
"""Saved tensors of a DTensor param's state that are never sharded: the code books, and
bitsandbytes' block scales of an unsharded param's 8-bit state (one per 256-element
block of the whole param; a param with as many rows as blocks had them split like its
rows, and refused). Sharded state saves its scales per row (``block_absmax1/2``)."""
_PARAM_SHAPED = ("exp_avg", "state1")
"""Template tensors laid out like the param, whichever rung made the template."""


class DCPLoadPlanner(DefaultLoadPlanner):
    """``torch.distributed.checkpoint``'s default load planner, for state dicts that hold
    optladder optimizers: a checkpoint saved on any rung loads into an optimizer on any
    rung (see the module). Pass it to ``dcp.load``::

        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path, planner=DCPLoadPlanner())
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])

    Args:
        in_place: let DCP load a same-rung checkpoint into the live optimizer's tensors
            (no extra memory; a checkpoint that ``load_state_dict`` then refuses leaves
            its values in the live state). By default (False) every optimizer entry
            gets new tensors, one copy of this rank's optimizer state held until
            ``set_optimizer_state_dict`` has loaded them, and a refused checkpoint
            changes nothing.
        *args, **kwargs: ``DefaultLoadPlanner``'s (``allow_partial_load`` and the
            flattening flags); it needs ``flatten_state_dict=True`` (the default) to
            find the optimizer's entries, and loads as ``DefaultLoadPlanner`` without it
            or for a checkpoint saved without flattening (no ``planner_data`` in its
            metadata).
    """

    def __init__(self, *args: Any, in_place: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_place = in_place

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Fit the optimizer templates in ``state_dict`` to ``metadata`` (in place, see
        :func:`fit_optimizer_templates`), then set up as ``DefaultLoadPlanner`` does."""
        if metadata is not None and self.flatten_state_dict:
            fit_optimizer_templates(state_dict, metadata, in_place=self.in_place)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def fit_optimizer_templates(
    state_dict: dict[str, Any], metadata: Metadata, *, in_place: bool = False
) -> None:
    """Make each optladder optimizer state dict inside ``state_dict`` take the keys, sizes
    and dtypes a DCP checkpoint holds for it, in place (the same dict objects).

    For each param: with ``in_place``, kept when its template entry matches the saved
    entries exactly (every key, every tensor's global size and dtype, tensors where
    tensors were saved); otherwise (always without ``in_place``) replaced by
    uninitialized tensors of the saved sizes and dtypes (a DTensor
    sharded like the param's rows when the template's moments are DTensors and the saved
    tensor has as many rows as the param; code books and 0-d tensors plain) and ``None``
    for saved non-tensor values (DCP puts the saved object there). Template params the
    checkpoint has no state for are dropped; the param groups are rebuilt the same way
    when their keys differ or without ``in_place`` (a tensor lr is the live group's).
    Optimizers the checkpoint does not hold (no saved param groups under their path) are
    left alone, as is everything else.

    Args:
        state_dict: the template passed to ``dcp.load`` (nested dicts, as DCP flattens
            them: dict keys become strings, list items their index).
        metadata: the checkpoint's metadata; its ``planner_data`` (flattened key -> path,
            written by DCP's default save planner) locates the saved entries. Without it
            nothing is changed.
        in_place: keep the entries that fit (see :class:`DCPLoadPlanner`).
    """
    paths: Mapping[str, Path] | None = metadata.planner_data
    if not paths:
        return
    for prefix, osd in _optimizer_state_dicts(state_dict, ()):
        n = len(prefix)
        saved_state: dict[str, dict[Path, Any]] = {}
        saved_groups: dict[Path, Any] = {}
        for key, path in paths.items():
            path = tuple(path)
            if path[:n] != prefix or len(path) < n + 3:
                continue
            md = metadata.state_dict_metadata.get(key)
            if path[n] == "state":
                saved_state.setdefault(str(path[n + 1]), {})[path[n + 2 :]] = md
            elif path[n] == "param_groups":
                saved_groups[path[n + 1 :]] = md
        if not saved_groups:  # the checkpoint does not hold this optimizer
            continue
        _fit_state(osd["state"], saved_state, in_place)
        if not (in_place and _matches(osd["param_groups"], saved_groups)):
            osd["param_groups"] = _build(saved_groups, None)


def _optimizer_state_dicts(node: Any, path: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """``(path, dict)`` of every optladder optimizer state dict in the nested ``node``
    (in dicts under their keys as strings, in lists and tuples under their indices, as
    DCP's flattening names them)."""
    if isinstance(node, list | tuple):
        for i, item in enumerate(node):
            yield from _optimizer_state_dicts(item, (*path, i))
        return
    if not isinstance(node, dict):
        return
    groups = node.get("param_groups")
    if (
        isinstance(node.get("state"), dict)
        and isinstance(groups, list)
        and all(isinstance(g, Mapping) for g in groups)
        and any(RUNG_KEY in g for g in groups)
    ):
        yield path, node
        return
    for key, value in node.items():
        yield from _optimizer_state_dicts(value, (*path, str(key)))


def _fit_state(template: dict[Any, Any], saved: dict[str, dict[Path, Any]], in_place: bool) -> None:
    """Fit the template's per-param entries to the saved ones (see the caller)."""
    keys = {str(k): k for k in template}
    for key in [k for k in template if str(k) not in saved]:
        del template[key]  # the checkpoint has no state for this param
    for name, leaves in saved.items():
        key = keys.get(name, name)
        current = template.get(key)
        if current is None or not (in_place and _matches(current, leaves)):
            template[key] = _build(leaves, _reference(current))


def _leaves(value: Any) -> dict[Path, Any]:
    """``value``'s leaves by path, as DCP flattens it (its own function)."""
    flat, mappings = flatten_state_dict({"": value})
    return {tuple(mappings[k][1:]): v for k, v in flat.items()}


def _matches(value: Any, saved: dict[Path, Any]) -> bool:
    """Whether DCP can load the saved entries into ``value`` as they are: the same paths,
    tensors where tensors were saved (of the saved global size and dtype), other values
    where other values were saved."""
    leaves = _leaves(value)
    if leaves.keys() != saved.keys():
        return False
    for path, leaf in leaves.items():
        md = saved[path]
        if isinstance(md, TensorStorageMetadata) != isinstance(leaf, torch.Tensor):
            return False
        if isinstance(md, TensorStorageMetadata) and (
            tuple(leaf.shape) != tuple(md.size) or leaf.dtype != md.properties.dtype
        ):
            return False
    return True


def _reference(entry: Any) -> torch.Tensor | None:
    """A template tensor of one param laid out like the param (a moment), or None."""
    if not isinstance(entry, Mapping):
        return None
    leaves = _leaves(entry)
    for path, leaf in leaves.items():
        if path[-1] in _PARAM_SHAPED and isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf
    return None


def _placeholder(name: str | int, md: Any, ref: torch.Tensor | None) -> Any:
    """An uninitialized tensor DCP can load a saved tensor of ``md`` into, or None for a
    saved non-tensor value (DCP replaces it with the saved object)."""
    if not isinstance(md, TensorStorageMetadata):
        return None
    size, dtype = tuple(md.size), md.properties.dtype
    device = local_tensor(ref).device if ref is not None else torch.device("cpu")
    if (
        ref is not None
        and is_dtensor(ref)
        and name not in _REPLICATED
        and len(size) > 0
        and size[0] == ref.shape[0]
    ):
        rows = local_tensor(ref).shape[0]
        return rows_like(torch.empty((rows, *size[1:]), dtype=dtype, device=device), ref)
    return torch.empty(size, dtype=dtype, device=device)


def _build(leaves: dict[Path, Any], ref: torch.Tensor | None) -> Any:
    """A nested value with a placeholder at each saved path (dicts for string keys,
    lists for indices)."""
    root: Any = [] if leaves and isinstance(next(iter(leaves))[0], int) else {}
    for path, md in leaves.items():
        node = root
        for part, following in pairwise(path):
            empty: Any = [] if isinstance(following, int) else {}
            node = _child(node, part, empty)
        _child(node, path[-1], _placeholder(path[-1], md, ref), replace=True)
    return root


def _child(node: Any, part: str | int, value: Any, *, replace: bool = False) -> Any:
    """``node[part]``, set to ``value`` first when absent (or when ``replace``)."""
    if isinstance(node, list):
        assert isinstance(part, int)
        node.extend([None] * (part + 1 - len(node)))
        if replace or node[part] is None:
            node[part] = value
        return node[part]
    if replace or part not in node:
        node[part] = value
    return node[part]
