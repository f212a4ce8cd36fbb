"""``torch.ops.optladder.adamw_bf16_``: optladder's fused AdamW kernels as one
torch.library custom op, one implementation per device.

- CUDA (and any device but the CPU): the Triton kernel (:mod:`.triton_adamw`).
- CPU: the C kernel (:mod:`.cpu`), the one :class:`~optladder.optimizers.LadderAdamW`
  runs on CPU params; under ``TRITON_INTERPRET=1`` the Triton kernel in Triton's
  interpreter instead (how the Triton kernel is tested without a GPU).

So torch's dispatcher is the table that picks the kernel by device, and both give the
bits of the eager oracle (:mod:`optladder.optimizers.eager`). Importing this module
registers the op (and nothing else); it is imported only when a step needs the Triton
backend, or by user code that calls the op directly. Triton is imported at the op's
first Triton call, the C kernel built or loaded at its first CPU call. As a custom op
with declared mutations, it can be called inside ``torch.compile``d code (it is opaque to
the compiler) and captured in CUDA graphs after one warm-up call (see :mod:`.triton_adamw`).

Annotations here are real (not postponed) because ``torch.library`` reads them to build
the op's schema.
"""

import os
from typing import Any, Optional

import torch
from torch import Tensor

from optladder.optimizers.eager import step_scalars
from optladder.optimizers.rounding import seed_prefix, step_key_from_prefix
from optladder.optimizers.steps import BF16_MAX_STEP

__all__ = ["adamw_bf16_", "seed_prefix"]


def _adamw_bf16_triton(
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


# The op, with the Triton kernel as its implementation on every device but the CPU (the
# function stays callable as it is: the CPU implementation hands it Triton's interpreter)
adamw_bf16_ = torch.library.custom_op(
    "optladder::adamw_bf16_",
    mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs", "steps"),
)(_adamw_bf16_triton)


def _adamw_bf16_c(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    param_indices: list[int],
    lr: float,
    lr_tensor: Optional[Tensor],  # noqa: UP045
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
    """The op's C kernel over a table of these CPU params, in one call.

    The same contract as on CUDA: each step count is incremented first, with a nonzero
    ``found_inf`` nothing changes (read on the host: a CPU tensor, no device to wait
    for), grads are divided in place by ``grad_scale`` (a GradScaler's power of two, so
    the quotient is exact) before the update. The table is built for this call (its
    rows, about 1 us per param on the host; :class:`LadderAdamW` keeps one across
    steps instead).

    Raises:
        ValueError: a tensor the C kernel cannot point at (:class:`~.cpu.KernelTable`
            names it), a grad unlike its param (:func:`~.cpu.param_unsupported_reason`),
            lists of different lengths, or a step count outside ``[0, 2**32 - 2]`` (the
            random bits' key takes 32-bit steps).
        optladder.optimizers.kernels.cpu.KernelBuildError: no C compiler to build the
            kernel (LadderAdamW then steps eagerly; called directly, the op cannot).
    """
    from optladder.optimizers.kernels import cpu

    n = len(params)
    lengths = [len(grads), len(exp_avgs), len(exp_avg_sqs), len(steps), len(param_indices)]
    if lengths != [n] * 5:
        raise ValueError(
            f"params, grads, exp_avgs, exp_avg_sqs, steps and param_indices must have one "
            f"entry per param; got lengths {[n, *lengths]}"
        )
    if n == 0 or (found_inf is not None and float(found_inf) != 0):
        return
    for k, (p, g) in enumerate(zip(params, grads)):
        reason = cpu.param_unsupported_reason(p, g)
        if reason is not None:
            raise ValueError(f"params[{k}]: {reason}")
    table = cpu.KernelTable(params, exp_avgs, exp_avg_sqs, steps, param_indices)
    library = cpu.load_library()
    old = table.read_steps(library)
    bad = [s for s in old if not 0 <= s <= BF16_MAX_STEP]
    if bad:
        raise ValueError(
            f"steps hold {bad[0]:.0f}; the op steps from counts in [0, 2**32 - 2] (its "
            "random bits are keyed by a 32-bit step)"
        )
    lr_value = float(lr_tensor) if lr_tensor is not None else lr
    if grad_scale is not None:
        torch._foreach_div_(grads, float(grad_scale))
    new = [s + 1.0 for s in old]
    scalars = {}
    for s in set(new):
        step_size, bc2_sqrt = step_scalars(lr_value, beta1, beta2, int(s))
        scalars[s] = (step_key_from_prefix(seed_key, int(s)), step_size, bc2_sqrt)
    table.set_grads(grads)
    table.set_scalars(new, scalars)
    table.set_options(
        0,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        lr=lr_value,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        stochastic=stochastic,
        param_stochastic=param_stochastic,
    )
    cpu.run_table(table, library=library)
    table.bump_steps(library)


@adamw_bf16_.register_kernel("cpu")
def _adamw_bf16_cpu(*args: Any, **kwargs: Any) -> None:
    """The op on CPU tensors: the C kernel (:func:`_adamw_bf16_c`), or Triton's
    interpreter under ``TRITON_INTERPRET=1`` (so the Triton kernel's tests run on the
    CPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _adamw_bf16_triton(*args, **kwargs)
    else:
        _adamw_bf16_c(*args, **kwargs)


@adamw_bf16_.register_fake
def _adamw_bf16_fake(*args: object, **kwargs: object) -> None:
    return None
