"""psg's custom autograd functions' common base.

torch's ``Function.apply`` binds the call's arguments to ``forward``'s signature on every call
(``inspect.signature`` and ``bind``: about 20 us on the 2-core AMD EPYC) when the class defines
``setup_context``, which psg's functions do so that ``torch.func`` transforms can run them. Their
``forward`` takes every argument positionally and has no defaults, so that binding returns the
arguments as they came: :class:`PositionalFunction` skips it outside ``torch.func`` transforms
(where torch's own path runs, unchanged). A DP LSTM step applies three of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch import utils as _functorch_utils

__all__ = ["PositionalFunction"]


class PositionalFunction(torch.autograd.Function):
    """A ``torch.autograd.Function`` whose ``forward`` takes its arguments positionally, without
    defaults: ``apply`` calls it without binding them to its signature first.

    >>> class Twice(PositionalFunction):
    ...     @staticmethod
    ...     def forward(x):
    ...         return 2 * x
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         pass
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return 2 * grad
    >>> x = torch.ones(2, requires_grad=True)
    >>> Twice.apply(x).sum().backward()
    >>> x.grad
    tensor([2., 2.])
    """

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs or torch._C._are_functorch_transforms_active():
            return super().apply(*args, **kwargs)
        # What torch.autograd.Function.apply does next, without the binding: the C++ apply runs
        # forward, then setup_context with the inputs and the output.
        base: Any = super(torch.autograd.Function, cls)  # torch's C++ FunctionBase
        return base.apply(*_functorch_utils.unwrap_dead_wrappers(args))
