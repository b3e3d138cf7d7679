"""Loss functions a session can name, and the checks their targets must pass.

Every loss is built unreduced (``reduction="none"``), as :mod:`psg_core.losses` expects; psg reduces
per sample and per batch itself. A loss reads a model's output tensor, or the ``logits`` of a
Hugging Face ``ModelOutput``.

The token-level losses (``token_cross_entropy``, and ``causal_lm`` which adds the causal shift)
return one value per row: the mean of its per-token losses over its labelled tokens (targets
:data:`IGNORE_INDEX` mark the others: padding, a prompt). So a sample's loss is the mean over its
real tokens, not over the padded length, whatever the other rows of the batch hold; with K > 1 it
is the mean (or sum, per ``loss_reduction``) of its K rows' means.

>>> entry = get_loss("cross_entropy")
>>> entry.build()(torch.zeros(2, 3), torch.tensor([0, 2])).shape
torch.Size([2])
>>> get_loss("causal_lm").build()(torch.zeros(2, 5, 7), torch.tensor([[1] * 5, [2, 3, -100, -100, -100]]))
tensor([1.9459, 1.9459])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from psg_core.errors import ConfigError, NonFiniteInputError
from psg_server.errors import InvalidRequestError, LossNotFoundError

__all__ = ["IGNORE_INDEX", "LOSSES", "LossEntry", "TokenCrossEntropy", "get_loss", "logits_of", "prepare_targets"]

#: Target of a token that has no label (padding, a prompt): the token-level losses skip it, as
#: torch's and transformers' losses do.
IGNORE_INDEX = -100


def logits_of(outputs: Any) -> torch.Tensor:
    """The tensor a loss reads: ``outputs`` itself, or the ``logits`` of a Hugging Face
    ``ModelOutput`` (or of any mapping or object that has them)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(f"loss: the model returned a {type(outputs).__name__}, neither a tensor nor an output "
                          "with logits")
    return logits


class OnLogits(nn.Module):
    """An elementwise loss applied to :func:`logits_of` the outputs."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(logits_of(outputs), targets)


class ClassesLast(nn.Module):
    """A class-index loss whose outputs carry the classes on their *last* dimension.

    ``(rows, C)`` passes through; ``(B, T, C)`` or ``(T, B, C)`` (token-level losses, either batch
    layout) becomes ``(B, C, T)`` / ``(T, C, B)`` as torch's class losses want, so the unreduced
    loss keeps the batch on the same dimension as the inputs.
    """

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(outputs)
        return self.loss(logits.movedim(-1, 1) if logits.dim() > 2 else logits, targets)


class TokenCrossEntropy(nn.Module):
    """Cross entropy per token, averaged over each row's labelled tokens.

    ``outputs``: logits ``(rows, T, C)``; ``targets``: class indices ``(rows, T)``, with
    :data:`IGNORE_INDEX` where a token has no label. With ``shift=True`` (causal language models)
    the logits at position t predict the token at t + 1, as in transformers' own causal LM loss:
    ``logits[:, :-1]`` are scored against ``targets[:, 1:]``, so the targets are the input ids
    themselves (padding set to IGNORE_INDEX).

    Returns ``(rows,)``: each row's mean loss over its labelled tokens (0 for a row with none).
    """

    def __init__(self, *, shift: bool) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(outputs)  # (rows, T, C)
        if logits.dim() != 3 or targets.shape != logits.shape[:2]:
            raise ConfigError(f"loss: token-level logits (rows, T, classes) must match targets (rows, T); got "
                              f"{list(logits.shape)} and {list(targets.shape)}")
        if self.shift:
            logits, targets = logits[:, :-1], targets[:, 1:]  # (rows, T-1, C), (rows, T-1)
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                    reduction="none")  # (rows, T')
        labelled = (targets != IGNORE_INDEX).sum(1).clamp(min=1)  # (rows,)
        return per_token.sum(1) / labelled  # (rows,)


@dataclass(frozen=True)
class LossEntry:
    """A loss by name: how to build it and what its targets look like."""

    name: str
    build: Callable[[], nn.Module]
    #: "class": one class index per row; "float": one value per output; "probability": one value
    #: in [0, 1] per output; "token": one class index or IGNORE_INDEX per token, (rows, T).
    target_kind: str
    #: The loss reads the batch on dimension 0 (sessions must use batch_first=True).
    batch_first_only: bool = False


LOSSES: dict[str, LossEntry] = {
    entry.name: entry for entry in (
        LossEntry("cross_entropy", lambda: ClassesLast(nn.CrossEntropyLoss(reduction="none")), "class"),
        LossEntry("nll", lambda: ClassesLast(nn.NLLLoss(reduction="none")), "class"),
        LossEntry("mse", lambda: OnLogits(nn.MSELoss(reduction="none")), "float"),
        LossEntry("bce_with_logits", lambda: OnLogits(nn.BCEWithLogitsLoss(reduction="none")), "probability"),
        LossEntry("token_cross_entropy", lambda: TokenCrossEntropy(shift=False), "token", batch_first_only=True),
        LossEntry("causal_lm", lambda: TokenCrossEntropy(shift=True), "token", batch_first_only=True),
    )
}


def get_loss(name: str) -> LossEntry:
    """The loss called ``name``, or :class:`LossNotFoundError`."""
    entry = LOSSES.get(name)
    if entry is None:
        raise LossNotFoundError(f"CreateSession: unknown loss {name[:80]!r}; known: {', '.join(LOSSES)}")
    return entry


def prepare_targets(entry: LossEntry, targets: torch.Tensor, *, rows: int, num_outputs: int | None,
                    dtype: torch.dtype, batch_dim: int = 0,
                    like: tuple[str, torch.Size] | None = None) -> torch.Tensor:
    """Checks ``targets`` for ``entry`` and casts them (class indices to int64, values to ``dtype``).

    Args:
        entry: the session's loss.
        targets: as decoded from the wire.
        rows: N * K, the batch's rows.
        num_outputs: outputs per row (per token for token-level models) of the model, when its
            signature is known.
        dtype: the model's floating dtype.
        batch_dim: where the rows are (the session's batch layout; targets follow the inputs).
        like: ``(wire name, shape)`` of the input whose shape token-level targets must have, when
            the model's signature names one.
    """
    where = f"ComputeGradients: targets for loss {entry.name!r}"
    if targets.dim() <= batch_dim or targets.shape[batch_dim] != rows:
        raise InvalidRequestError(f"{where} must have {rows} rows (one per input row) on dimension "
                                  f"{batch_dim}, got shape {list(targets.shape)}")
    if entry.target_kind == "token":
        return _token_targets(where, targets, num_outputs=num_outputs, like=like)
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


def _token_targets(where: str, targets: torch.Tensor, *, num_outputs: int | None,
                   like: tuple[str, torch.Size] | None) -> torch.Tensor:
    if targets.dim() != 2 or targets.is_floating_point() or targets.dtype == torch.bool:
        raise InvalidRequestError(f"{where} must be an integer tensor (rows, T) of token labels ({IGNORE_INDEX} "
                                  f"where a token has none), got {targets.dtype} {list(targets.shape)}")
    if like is not None and targets.shape != like[1]:
        raise InvalidRequestError(f"{where} must have the shape of {like[0]!r}, {list(like[1])} (one label per "
                                  f"token), got {list(targets.shape)}")
    targets = targets.to(torch.int64)
    labels = targets[targets != IGNORE_INDEX]  # (labelled tokens,)
    if labels.numel() and (int(labels.min()) < 0 or (num_outputs is not None and int(labels.max()) >= num_outputs)):
        bound = f"[0, {num_outputs})" if num_outputs is not None else "[0, classes)"
        raise InvalidRequestError(f"{where} must be class indices in {bound} or {IGNORE_INDEX}, got values in "
                                  f"[{int(labels.min())}, {int(labels.max())}]")
    return targets
