"""Between torch models and the wire: which tensors a push sends, how a batch is named, and how
gradients land in ``p.grad``.

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
from psg_wire.names import TARGETS, input_name, parse_input_name

__all__ = ["apply_gradients", "batch_tensors", "check_parameters", "parameter_tensors"]


def parameter_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter (trainable or not), detached, in named_parameters() order.

    The tensors share memory with the model: nothing is copied until they are encoded.
    """
    return [(name, p.detach()) for name, p in model.named_parameters()]


def batch_tensors(inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                  targets: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The wire names and tensors of a batch: a tensor or a sequence of tensors are the model's
    positional arguments (``inputs/0``, ...), a mapping its keyword arguments (``inputs/<name>``).

    >>> [name for name, _ in batch_tensors({"input_ids": torch.zeros(2, 3)}, torch.zeros(2, 3))]
    ['inputs/input_ids', 'targets']
    """
    if isinstance(inputs, Mapping):
        for key in inputs:
            if not isinstance(key, str) or parse_input_name(input_name(key)) != key:
                raise ConfigError(f"compute_gradients: keyword inputs must be named like Python arguments "
                                  f"(ASCII, at most 64 characters), got {key!r:.80}")
        named = [(input_name(key), tensor) for key, tensor in inputs.items()]
    else:
        positional = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        named = [(input_name(i), tensor) for i, tensor in enumerate(positional)]
    if not all(isinstance(tensor, torch.Tensor) for _, tensor in named):
        raise ConfigError("compute_gradients: inputs must be tensors")
    return named + [(TARGETS, targets)]


def check_parameters(named: Sequence[tuple[str, torch.Tensor]],
                     specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], *,
                     requires_grad: Mapping[str, bool] | None = None,
                     trainable: Mapping[str, bool] | None = None) -> None:
    """Raises :class:`ConfigError` unless ``named`` has exactly the parameters ``specs`` describes
    (and, when both flags are given, the same trainable ones).

    Args:
        named: what would be pushed.
        specs: ``{name: (dtype, shape)}`` the session reported.
        requires_grad: ``{name: requires_grad}`` of the trainer's model.
        trainable: ``{name: requires_grad}`` the session reported.
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
    if requires_grad is not None and trainable is not None:
        differ = [name for name in names if requires_grad[name] != trainable[name]]
        if differ:
            raise ConfigError(f"push_parameters: parameters {differ[:8]} are trainable here but frozen in the "
                              f"session's model, or the other way round; requires_grad must agree (give the "
                              f"model the session's LoRA adapter, adapter.apply(model))")


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
