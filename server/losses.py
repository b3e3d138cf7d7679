"""Loss functions a session can name, and the checks their targets must pass.

Every loss is built unreduced (``reduction="none"``), as :mod:`psg_core.losses` expects; psg reduces
per sample and per batch itself.

>>> entry = get_loss("cross_entropy")
>>> entry.build()(torch.zeros(2, 3), torch.tensor([0, 2])).shape
torch.Size([2])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from psg_core.errors import NonFiniteInputError
from psg_server.errors import InvalidRequestError, LossNotFoundError

__all__ = ["LOSSES", "LossEntry", "get_loss", "prepare_targets"]


class ClassesLast(nn.Module):
    """A class-index loss whose outputs carry the classes on their *last* dimension.

    ``(rows, C)`` passes through; ``(B, T, C)`` or ``(T, B, C)`` (token-level losses, either batch
    layout) becomes ``(B, C, T)`` / ``(T, C, B)`` as torch's class losses want, so the unreduced
    loss keeps the batch on the same dimension as the inputs.
    """

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(outputs.movedim(-1, 1) if outputs.dim() > 2 else outputs, targets)


@dataclass(frozen=True)
class LossEntry:
    """A loss by name: how to build it and what its targets look like."""

    name: str
    build: Callable[[], nn.Module]
    #: "class": one class index per row; "float": one value per output; "probability": one value
    #: in [0, 1] per output.
    target_kind: str


LOSSES: dict[str, LossEntry] = {
    entry.name: entry for entry in (
        LossEntry("cross_entropy", lambda: ClassesLast(nn.CrossEntropyLoss(reduction="none")), "class"),
        LossEntry("nll", lambda: ClassesLast(nn.NLLLoss(reduction="none")), "class"),
        LossEntry("mse", lambda: nn.MSELoss(reduction="none"), "float"),
        LossEntry("bce_with_logits", lambda: nn.BCEWithLogitsLoss(reduction="none"), "probability"),
    )
}


def get_loss(name: str) -> LossEntry:
    """The loss called ``name``, or :class:`LossNotFoundError`."""
    entry = LOSSES.get(name)
    if entry is None:
        raise LossNotFoundError(f"CreateSession: unknown loss {name[:80]!r}; known: {', '.join(LOSSES)}")
    return entry


def prepare_targets(entry: LossEntry, targets: torch.Tensor, *, rows: int, num_outputs: int | None,
                    dtype: torch.dtype, batch_dim: int = 0) -> torch.Tensor:
    """Checks ``targets`` for ``entry`` and casts them (class indices to int64, values to ``dtype``).

    Args:
        entry: the session's loss.
        targets: as decoded from the wire.
        rows: N * K, the batch's rows.
        num_outputs: outputs per row of the model, when its signature is known.
        dtype: the model's floating dtype.
        batch_dim: where the rows are (the session's batch layout; targets follow the inputs).
    """
    where = f"ComputeGradients: targets for loss {entry.name!r}"
    if targets.dim() <= batch_dim or targets.shape[batch_dim] != rows:
        raise InvalidRequestError(f"{where} must have {rows} rows (one per input row) on dimension "
                                  f"{batch_dim}, got shape {list(targets.shape)}")
    if entry.target_kind == "class":
        # one index per row (1-D), or per row and position for token-level outputs
        class_dims_ok = targets.dim() == 1 or (num_outputs is None and targets.dim() > batch_dim)
        if targets.is_floating_point() or targets.dtype == torch.bool or not class_dims_ok:
            raise InvalidRequestError(f"{where} must be an integer tensor of class indices (1-D for "
                                      f"this model), got {targets.dtype} {list(targets.shape)}")
        targets = targets.to(torch.int64)
        if num_outputs is not None and targets.numel() and (
                int(targets.min()) < 0 or int(targets.max()) >= num_outputs):
            raise InvalidRequestError(f"{where} must be class indices in [0, {num_outputs}), got values "
                                      f"in [{int(targets.min())}, {int(targets.max())}]")
        return targets
    if not targets.is_floating_point():
        raise InvalidRequestError(f"{where} must be floating point, got {targets.dtype}")
    if num_outputs is not None and tuple(targets.shape) != (rows, num_outputs):
        raise InvalidRequestError(f"{where} must have shape {[rows, num_outputs]}, got {list(targets.shape)}")
    targets = targets.to(dtype)
    if not bool(torch.isfinite(targets).all()):
        raise NonFiniteInputError(f"{where} contain NaN or infinity")
    if entry.target_kind == "probability" and targets.numel() and (
            float(targets.min()) < 0 or float(targets.max()) > 1):
        raise InvalidRequestError(f"{where} must lie in [0, 1]")
    return targets
