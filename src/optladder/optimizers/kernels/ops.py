"""``torch.ops.optladder.adamw_bf16_``: the Triton kernel as a torch.library custom op.

Importing this module registers the op (and nothing else); it is imported only when a step
needs the Triton backend, or by user code that calls the op directly. Triton itself is
imported at the op's first call. As a custom op with declared mutations, it can be called
inside ``torch.compile``d code (it is opaque to the compiler) and captured in CUDA graphs
after one warm-up call (see :mod:`.triton_adamw`).

Annotations here are real (not postponed) because ``torch.library`` reads them to build
the op's schema.
"""

from typing import Optional

import torch
from torch import Tensor

from optladder.optimizers.rounding import MASK32, hash32

_GOLDEN = 0x9E3779B9


def seed_prefix(seed: int) -> int:
    """The part of :func:`~optladder.optimizers.rounding.element_key` fixed by the seed.

    ``element_key`` mixes 0x5EED, the seed's low and high words, the step and the param
    index's low and high words, in that order; the kernel mixes the last three on device.

    Args:
        seed: ``0 <= seed < 2**64``.

    Returns:
        An integer in ``[0, 2**32)``.
    """
    k = 0x5EED
    for word in (seed & MASK32, seed >> 32):
        k = hash32(((k * _GOLDEN) & MASK32) ^ word)
    return k


@torch.library.custom_op(
    "optladder::adamw_bf16_",
    mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs", "steps"),
)
def adamw_bf16_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    param_indices: list[int],
    lr: float,
    lr_tensor: Optional[Tensor],  # noqa: UP045 - torch.library parses Optional
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    stochastic: bool,
    param_stochastic: bool,
    seed_key: int,
    grad_scale: Optional[Tensor],  # noqa: UP045
    found_inf: Optional[Tensor],  # noqa: UP045
) -> None:
    """One AdamW step for a group of params, in one kernel launch (the bf16 rung's
    bfloat16 moments, or the fp32 rung's float32 moments for low-precision params).

    All tensors are on one device. Each ``steps[i]`` is incremented first, as torch's
    fused Adam does; with ``found_inf`` nonzero the kernel changes nothing and the
    increment is taken back, so nothing changes at all.

    Args:
        params: params of one dtype (float32, bfloat16 or float16), contiguous, updated
            in place.
        grads: their grads, one dtype for all (float32, bfloat16 or float16), contiguous;
            divided in place by ``grad_scale`` when it is given (as torch's fused Adam).
        exp_avgs: first moments, all bfloat16 or all float32, contiguous, the params'
            shapes.
        exp_avg_sqs: second moments, likewise.
        steps: 0-d float64 step counts on the params' device, one per param.
        param_indices: each param's index over all param groups (for the random bits).
        lr: learning rate when ``lr_tensor`` is None.
        lr_tensor: 0-d float32 tensor learning rate on the device, or None.
        beta1: first-moment decay, ``[0, 1)``.
        beta2: second-moment decay, ``[0, 1)``.
        eps: denominator term.
        weight_decay: decay coefficient (0 disables it).
        decoupled_weight_decay: AdamW (True) or Adam (False).
        maximize: ascend instead of descend.
        stochastic: stochastic rounding of bfloat16 moments (the bits of
            :mod:`optladder.optimizers.rounding`) or round to nearest even.
        param_stochastic: stochastic rounding of bfloat16/float16 param writes (their own
            stream of the same hash) or round to nearest even.
        seed_key: :func:`seed_prefix` of the optimizer's seed.
        grad_scale: AMP scale (float32 tensor of one element) or None.
        found_inf: float32 tensor of one element, nonzero to skip the step, or None.
    """
    if not params:
        return
    from optladder.optimizers.kernels import triton_adamw  # imports Triton

    torch._foreach_add_(steps, 1.0)
    triton_adamw.launch(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps,
        param_indices,
        lr=lr,
        lr_tensor=lr_tensor,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        stochastic=stochastic,
        param_stochastic=param_stochastic,
        seed_key=seed_key,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf.reshape(())] * len(steps))


@adamw_bf16_.register_fake
def _adamw_bf16_fake(*args: object, **kwargs: object) -> None:
    return None
