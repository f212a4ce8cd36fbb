"""Param dtype names as users spell them: ``bf16``, ``fp16``, ``half``, ``float``.

Standard library only, so that the command line checks ``--dtype`` before torch is
imported. The canonical names are torch's (``str(torch.bfloat16)`` without ``torch.``).
"""

from __future__ import annotations

PARAM_DTYPE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "float32": ("fp32", "float"),
    "bfloat16": ("bf16",),
    "float16": ("fp16", "half"),
}
"""Each param dtype ``--dtype`` takes, and its other spellings. ``float`` and ``half`` are
torch's aliases (``torch.float``, ``torch.half``); ``bf16``, ``fp16`` and ``fp32`` are the
abbreviations of Hugging Face's ``TrainingArguments`` (``bf16=True``) and of mixed-precision
flags (``--precision bf16``)."""

_CANONICAL: dict[str, str] = {
    spelling: name for name, others in PARAM_DTYPE_SPELLINGS.items() for spelling in (name, *others)
}


def dtype_name(dtype: object) -> str:
    """torch's name of a dtype without its module, the form the rung tables and messages
    use: ``torch.bfloat16`` -> ``"bfloat16"`` (``str()`` of a ``torch.dtype``)."""
    return str(dtype).removeprefix("torch.")


def allowed_spellings() -> str:
    """The accepted spellings in words: ``float32 (fp32, float), bfloat16 (bf16), ...``."""
    return ", ".join(
        f"{name} ({', '.join(others)})" for name, others in PARAM_DTYPE_SPELLINGS.items()
    )


def canonical_dtype(value: object, name: str) -> str:
    """The canonical name of a param dtype spelled ``value``.

    Args:
        value: e.g. ``"bf16"``, ``"BFloat16"``, ``"torch.float16"``, ``"half"`` (case and
            surrounding spaces ignored, a ``torch.`` prefix allowed).
        name: where the value came from (``"--dtype"``), for the error message.

    Returns:
        ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Raises:
        ValueError: naming ``name``, the value and every accepted spelling, for any other
            value (``float64`` included: the plan's rungs are sized for these three).
    """
    text = value.strip().lower().removeprefix("torch.") if isinstance(value, str) else None
    if text is not None and text in _CANONICAL:
        return _CANONICAL[text]
    raise ValueError(
        f"{name}={value!r} is not a param dtype this accepts; expected one of {allowed_spellings()}"
    )
