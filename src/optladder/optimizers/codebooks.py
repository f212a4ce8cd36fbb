"""The check of saved 8-bit state: one param's uint8 codes against what decodes them.

bitsandbytes' ``AdamW8bit`` keeps each moment of a large param as uint8 codes
(``state1``/``state2``) that index a 256-entry code book (``qmap1``: signed, ``qmap2``:
unsigned) and are scaled by one float32 absmax per started 256-element block
(``absmax1``/``absmax2``). Codes without either cannot be stepped (its step raised
KeyError) nor converted. One check, :func:`check_8bit_codes`, refuses them, for
:meth:`optladder.optimizers.adamw.LadderAdamW.load_state_dict` (before anything loads)
and for the checkpoint conversion of :func:`optladder.optimizers.migrate.check_param_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from optladder.rungs import BNB_BLOCKSIZE
from optladder.sharding import local_tensor

_BOOK_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def describe(value: object) -> str:
    """A tensor's dtype and element count (``"a torch.int32 tensor of 256 elements"``),
    ``"nothing"`` for None, else the value's type (for messages)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of {value.numel()} elements"
    return "nothing" if value is None else type(value).__name__


def check_values(t: torch.Tensor, name: str, where: str, *, nonnegative: bool) -> None:
    """Refuse NaN or infinite values in ``t`` (and negative ones when ``nonnegative``).

    Raises:
        ValueError: naming ``where``, ``name`` and how many values are refused.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(
            f"{where}: {name} holds {bad} NaN or infinite values; a rung would carry them "
            "as other values (the 8-bit format turns them finite), so the checkpoint is "
            "refused: allowed are finite values"
        )
    if nonnegative:
        negative = int((t < 0).sum())
        if negative:
            raise ValueError(
                f"{where}: {name} holds {negative} negative values; it is a running average "
                "of squared grads (or a block's largest magnitude), so allowed are values >= 0"
            )


def check_8bit_codes(
    state: Mapping[str, Any], name: str, where: str, numel: int | None = None
) -> None:
    """Refuse the uint8 codes ``state[name]`` (``"state1"`` or ``"state2"``) of one
    param's saved state without what decodes them.

    Required: ``absmax{i}`` a float32 tensor of finite values ``>= 0`` (one per started
    256-element block of ``numel`` elements, when given), ``qmap{i}`` a code book of 256
    finite floating values, all ``>= 0`` for ``state2`` (the running average of squared
    grads: codes decoded with a negative value would give NaN at its square root).

    Args:
        state: one param's saved state, in bitsandbytes' flat layout (unwrapped).
        name: ``"state1"`` or ``"state2"``, holding uint8 codes.
        where: names the param in messages, e.g. ``"param 3"``.
        numel: the element count the codes step (the param's local shard), or None to
            leave the number of block scales to the step or conversion that reads them.

    Raises:
        ValueError: naming the param, the key, what was found and what is allowed.
    """
    i = name[-1]
    absmax, qmap = state.get(f"absmax{i}"), state.get(f"qmap{i}")
    if not (isinstance(absmax, torch.Tensor) and absmax.dtype == torch.float32):
        raise ValueError(
            f"{where}: 8-bit {name} needs a float32 absmax{i} tensor of block scales (one "
            f"per started {BNB_BLOCKSIZE}-element block); got {describe(absmax)}"
        )
    if numel is not None:
        blocks = -(-numel // BNB_BLOCKSIZE)
        if absmax.numel() != blocks:
            raise ValueError(
                f"{where}: absmax{i} has {absmax.numel()} values; {numel} elements in "
                f"{BNB_BLOCKSIZE}-element blocks need {blocks}"
            )
    if not (isinstance(qmap, torch.Tensor) and qmap.numel() == 256 and qmap.dtype in _BOOK_DTYPES):
        raise ValueError(
            f"{where}: 8-bit {name} needs qmap{i}, a code book of 256 floating "
            f"values; got {describe(qmap)}"
        )
    if not bool(torch.isfinite(qmap).all()):
        raise ValueError(
            f"{where}: qmap{i} (the code book {name}'s codes index) holds non-finite "
            "values, so the codes cannot be decoded"
        )
    negative = int((qmap < 0).sum()) if name == "state2" else 0
    if negative:  # they would decode to a negative exp_avg_sq: NaN at its sqrt
        raise ValueError(
            f"{where}: qmap{i} (the code book {name}'s codes index) holds {negative} "
            f"negative values; {name} is the running average of squared grads, so "
            "allowed are books of values >= 0 (bitsandbytes' unsigned map)"
        )
    check_values(local_tensor(absmax), f"absmax{i}", where, nonnegative=True)
