"""Where ``torch.compile`` stops: the optimizer's methods run eagerly inside compiled code.

torch's own optimizers mark ``zero_grad``, ``state_dict``, ``load_state_dict`` and
``add_param_group`` so that TorchDynamo does not trace them (``torch._disable_dynamo`` in
``torch/optim/optimizer.py``): a compiled function that calls them breaks its graph there
and runs them as plain Python. optladder's optimizer marks those and ``step`` too. Its
step cannot be traced: it reads grads and state through ctypes and the C kernels' tables,
catches out-of-memory errors to retry on a cheaper rung, and holds back Ctrl-C during the
commit; traced, it failed on every rung (the fp32 rung's fused kernel call in AOT
autograd's functionalization, the others in TorchDynamo). Run eagerly, it is the same
fused step as outside ``torch.compile``, each hook once per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["run_eagerly"]

F = TypeVar("F", bound=Callable[..., Any])

_DISABLED = "_optladder_run_eagerly"


def run_eagerly(fn: F) -> F:
    """Decorate ``fn`` so that ``torch.compile`` graph-breaks at each call and runs it
    eagerly (``torch._dynamo.disable(fn, recursive=True)``), as torch's optimizers mark
    their methods. Outside compiled code the call is ``fn``'s own, through the same
    wrapper.

    ``torch._dynamo`` is imported at the first call, not when a module using this is
    imported (it takes over a second to import); the disabled function is then kept as
    an attribute of ``fn``, as torch's ``_disable_dynamo`` keeps it.

    Args:
        fn: a function or method.

    Returns:
        The wrapper, with ``fn``'s name, docstring and signature (``functools.wraps``).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        disabled = fn.__dict__.get(_DISABLED)
        if disabled is None:
            try:
                import torch._dynamo
            except ImportError:  # a build without TorchDynamo: nothing compiles, run fn
                disabled = fn
            else:
                disabled = torch._dynamo.disable(fn, recursive=True)
            setattr(fn, _DISABLED, disabled)
        return disabled(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
