"""Small tensor helpers shared by the grad samplers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13+; torch depends on typing_extensions anyway
    from typing_extensions import TypeIs

__all__ = ["wants_grad"]


def wants_grad(param: torch.Tensor | None) -> TypeIs[torch.Tensor]:
    """True for a parameter that exists and is trainable (narrows ``Tensor | None`` for mypy)."""
    return param is not None and param.requires_grad
