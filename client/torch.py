"""Between torch models and the wire: which tensors a push sends, and how gradients land in ``p.grad``.

>>> import torch
>>> from torch import nn
>>> model = nn.Linear(2, 1)
>>> apply_gradients(model, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
>>> model.weight.grad
tensor([[1., 1.]])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from psg_core.errors import ConfigError

__all__ = ["apply_gradients", "check_parameters", "parameter_tensors"]


def parameter_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter (trainable or not), detached, in named_parameters() order.

    The tensors share memory with the model: nothing is copied until they are encoded.
    """
    return [(name, p.detach()) for name, p in model.named_parameters()]


def check_parameters(named: Sequence[tuple[str, torch.Tensor]],
                     specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Raises :class:`ConfigError` unless ``named`` has exactly the parameters ``specs`` describes.

    Args:
        named: what would be pushed.
        specs: ``{name: (dtype, shape)}`` the session reported.
    """
    names = [name for name, _ in named]
    missing = [name for name in specs if name not in names]
    extra = [name for name in names if name not in specs]
    if missing or extra:
        raise ConfigError(f"push_parameters: the model does not match the session's model; missing "
                          f"{missing[:8]}, unexpected {extra[:8]}")
    for name, tensor in named:
        dtype, shape = specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ConfigError(f"push_parameters: parameter {name!r} is {tensor.dtype} {list(tensor.shape)}, "
                              f"the session expects {dtype} {list(shape)}")


def apply_gradients(model: nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Sets ``p.grad`` of every trainable parameter of ``model`` from ``grads`` (by name).

    The gradient is copied to the parameter's device and dtype, replacing any previous ``p.grad``,
    so a torch optimizer can step right after. Raises :class:`ConfigError` when names or shapes
    do not match.
    """
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing = [name for name in params if name not in grads]
    extra = [name for name in grads if name not in params]
    if missing or extra:
        raise ConfigError(f"apply_to: the gradients do not match the model's trainable parameters; "
                          f"missing {missing[:8]}, unexpected {extra[:8]}")
    for name, p in params.items():
        grad = grads[name]
        if grad.shape != p.shape:
            raise ConfigError(f"apply_to: gradient {name!r} has shape {list(grad.shape)}, the parameter "
                              f"{list(p.shape)}")
        p.grad = grad.detach().to(device=p.device, dtype=p.dtype, copy=True)
