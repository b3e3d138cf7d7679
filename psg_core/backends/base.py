"""What every per-sample gradient wrapper shares."""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

from psg_core.errors import BatchLayoutError, ConfigError
from psg_core.modes import LossReduction, parse_enum

__all__ = ["AbstractGradSampleModule", "check_rows", "get_grad_sample", "set_grad_sample",
           "trainable_parameters"]


# ``p.grad_sample`` is the one attribute psg sets on user objects (the public output). torch's
# stubs do not declare it, so every read and write goes through these two functions.
def get_grad_sample(param: torch.Tensor) -> torch.Tensor | None:
    """``param.grad_sample``, or None when it is unset.

    >>> get_grad_sample(nn.Parameter(torch.zeros(2))) is None
    True
    """
    return getattr(param, "grad_sample", None)


def set_grad_sample(param: torch.Tensor, grad_sample: torch.Tensor | None) -> None:
    """Sets ``param.grad_sample`` (None clears it).

    >>> p = nn.Parameter(torch.zeros(2))
    >>> set_grad_sample(p, torch.ones(4, 2))
    >>> p.grad_sample.shape
    torch.Size([4, 2])
    """
    setattr(param, "grad_sample", grad_sample)


def check_rows(rows: int, augmentation_multiplicity: int, *, where: str) -> int:
    """Returns N = rows / K, or raises :class:`BatchLayoutError` naming both numbers."""
    if rows % augmentation_multiplicity:
        raise BatchLayoutError(
            f"{where}: the batch has {rows} rows, which is not divisible by "
            f"augmentation_multiplicity K={augmentation_multiplicity}; each sample must arrive as "
            "exactly K consecutive rows")
    return rows // augmentation_multiplicity


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """``named_parameters()`` restricted to parameters with ``requires_grad``."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


class AbstractGradSampleModule(nn.Module, abc.ABC):
    """Wraps a model so that ``loss.backward()`` leaves ``p.grad_sample`` (N, *p.shape) on every
    trainable parameter, where N is the number of samples (rows / K).

    Subclasses implement one backend each; see :func:`psg_core.wrap_model`.
    """

    def __init__(self, module: nn.Module, *, batch_first: bool = True,
                 loss_reduction: str | LossReduction = "mean",
                 augmentation_multiplicity: int = 1) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{type(self).__name__}: expected an nn.Module, got "
                              f"{type(module).__name__}")
        if isinstance(module, AbstractGradSampleModule):
            raise ConfigError(f"{type(self).__name__}: the module is already wrapped by "
                              f"{type(module).__name__}")
        if (isinstance(augmentation_multiplicity, bool) or not isinstance(augmentation_multiplicity, int)
                or augmentation_multiplicity < 1):
            raise ConfigError(f"{type(self).__name__}: augmentation_multiplicity must be an int "
                              f">= 1, got {augmentation_multiplicity!r}")
        self._module = module
        self.batch_first = bool(batch_first)
        self.loss_reduction = LossReduction(parse_enum(LossReduction, loss_reduction,
                                                       what="loss_reduction"))
        self.augmentation_multiplicity = augmentation_multiplicity

    @property
    def batch_dim(self) -> int:
        """Dimension of the batch axis in inputs (0 when ``batch_first``, else 1)."""
        return 0 if self.batch_first else 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``p.grad`` as torch does, and ``p.grad_sample`` too."""
        super().zero_grad(set_to_none)
        self.clear_grad_samples()

    def clear_grad_samples(self) -> None:
        """Sets ``p.grad_sample`` to None on every parameter."""
        for p in self._module.parameters():
            if get_grad_sample(p) is not None:
                set_grad_sample(p, None)

    def grad_samples(self) -> dict[str, torch.Tensor | None]:
        """``{name: p.grad_sample}`` for every trainable parameter (names of the wrapped model)."""
        return {name: get_grad_sample(p)
                for name, p in trainable_parameters(self._module).items()}

    def __getattr__(self, item: str) -> Any:
        try:
            return super().__getattr__(item)
        except AttributeError as err:
            module = self._modules.get("_module")
            if module is not None and hasattr(module, item):
                return getattr(module, item)
            raise err
