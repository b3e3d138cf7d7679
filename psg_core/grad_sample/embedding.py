"""Per-sample gradients of ``nn.Embedding`` and ``nn.EmbeddingBag``, and the ghost norm of ``nn.Embedding``.

A lookup table's gradient is a scatter of output gradients into the rows that were looked up.
Per sample, every looked-up token of row ``r = n*K + k`` adds into sample n's own
``(num_embeddings, dim)`` slice, so one ``index_add_`` on an ``(N*num_embeddings, dim)`` buffer at
index ``n * num_embeddings + token`` sums over the K copies and every sequence position at once,
without an ``(N*K, num_embeddings, dim)`` intermediate.

``EmbeddingBag`` is batch-first whatever the model's layout (torch fixes its bags at dim 0). Called
with a 1-D input and ``offsets``, its rows are its bags (``len(offsets)``, minus one with
``include_last_offset``), sample-major like every other layer's rows; ``offsets`` and
``per_sample_weights`` may be passed positionally or by keyword.

The ghost norm of ``nn.Embedding``: sample n's gradient scatters its output gradients ``g_t`` into
the rows of its tokens, so its squared norm is ``sum_{s,t} [token_s == token_t] (g_s . g_t)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import psg_core.native as native
from psg_core.errors import UnsupportedModuleError
from psg_core.grad_sample._utils import accumulation_target, adds_into_targets, wants_grad
from psg_core.grad_sample.ghost_norm import FactorKind, GhostFactors, WeightLayout, register_ghost_norm
from psg_core.grad_sample.registry import register_grad_sampler
from psg_core.precision import as_dtype

__all__ = ["embedding_grad_sample", "embedding_ghost_factors", "embedding_bag_grad_sample"]


def _per_sample_scatter(tokens: torch.Tensor, sample_of_token: torch.Tensor, values: torch.Tensor,
                        n_samples: int, num_embeddings: int) -> torch.Tensor:
    """Sums ``values[i]`` into row ``tokens[i]`` of sample ``sample_of_token[i]``'s table."""
    dim = values.shape[-1]
    out = values.new_zeros(n_samples * num_embeddings, dim)  # (N*V, d)
    out.index_add_(0, sample_of_token * num_embeddings + tokens, values)
    return out.view(n_samples, num_embeddings, dim)  # (N, V, d)


def _reject_batch_mixing(layer: nn.Embedding | nn.EmbeddingBag, where: str) -> None:
    # scale_grad_by_freq divides by token counts over the whole batch, so one sample's gradient
    # depends on the other samples: there is no per-sample gradient to compute.
    if layer.scale_grad_by_freq:
        raise UnsupportedModuleError(
            f"{where}: scale_grad_by_freq=True scales gradients by token frequencies over the whole "
            "batch, which mixes samples; per-sample gradients are undefined for it")


@register_grad_sampler(nn.Embedding, k_aware=True)
@adds_into_targets
def embedding_grad_sample(layer: nn.Embedding, activations: list[torch.Tensor],
                          backprops: torch.Tensor, K: int) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradient of ``nn.Embedding.weight``: ``(N, num_embeddings, embedding_dim)``.

    ``activations[0]`` holds token ids ``(N*K, *)``; ``backprops`` is ``(N*K, *, dim)``. The row
    of ``padding_idx`` gets no gradient, as in torch. ``max_norm`` is fine (it renormalises the
    table in the forward pass, which does not change how gradients scatter).

    >>> layer = nn.Embedding(10, 3, padding_idx=0)
    >>> grads = embedding_grad_sample(layer, [torch.tensor([[1, 0], [1, 2]])], torch.ones(2, 2, 3), 2)
    >>> grads[layer.weight].shape, grads[layer.weight][0, 1].tolist()
    (torch.Size([1, 10, 3]), [2.0, 2.0, 2.0])
    """
    if not wants_grad(layer.weight):
        return {}
    _reject_batch_mixing(layer, "embedding_grad_sample")
    tokens = activations[0]  # (N*K, *)
    rows, dim = tokens.shape[0], layer.embedding_dim
    n_samples = rows // K
    per_row = tokens.reshape(rows, -1)  # (N*K, T)
    sample_of_row = torch.arange(rows, device=tokens.device) // K  # (N*K,)
    sample_of_token = sample_of_row[:, None].expand_as(per_row).reshape(-1)  # (N*K*T,)
    values = backprops.reshape(-1, dim)  # (N*K*T, d)
    flat = per_row.reshape(-1)  # (N*K*T,)
    into = accumulation_target(layer.weight, (n_samples, layer.num_embeddings, dim), values.dtype, values.device)
    if into is not None:
        # A tied weight whose other owner's per-sample gradient is already made (GPT-2's LM head,
        # whose backward runs first): the lookups add into it, no (N, V, d) buffer of their own.
        # The padding row's own gradient is 0 (torch's rule), so its tokens add an exact 0
        # (where, not a product: a padding position's gradient may hold inf or NaN).
        if layer.padding_idx is not None:
            values = torch.where((flat != layer.padding_idx)[:, None], values, values.new_zeros(()))
        into.view(-1, dim).index_add_(0, sample_of_token * layer.num_embeddings + flat, values)
        return {layer.weight: into}
    grad = _per_sample_scatter(flat, sample_of_token, values, n_samples, layer.num_embeddings)  # (N, V, d)
    if layer.padding_idx is not None:
        grad[:, layer.padding_idx] = 0
    return {layer.weight: grad}


def _embedding_positions(layer: nn.Embedding, tokens: torch.Tensor, output: Any, batch_dim: int) -> int | None:
    """Every token of an input row is a position: ``(rows, *T)`` gives ``prod(T)``."""
    return tokens.numel() // max(1, tokens.shape[batch_dim])


@register_ghost_norm(nn.Embedding, positions=_embedding_positions, layout=WeightLayout.TABLE)
def embedding_ghost_factors(layer: nn.Embedding, tokens: torch.Tensor, backprop: torch.Tensor,
                            K: int) -> tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]:
    """Sample n's token ids and output gradients over its ``K*T`` rows (padding rows zeroed).

    >>> factors, _ = embedding_ghost_factors(nn.Embedding(10, 3), torch.tensor([[1, 1], [2, 1]]),
    ...                                      torch.ones(2, 2, 3), 2)
    >>> factors.left.tolist(), float(factors.sq_norms(torch.float32)[0])  # row 1 gets 3 * (1, 1, 1)
    ([[1, 1, 2, 1]], 30.0)
    """
    _reject_batch_mixing(layer, "embedding_ghost_factors")
    n_samples = tokens.shape[0] // K
    per_sample = tokens.reshape(n_samples, -1)  # (N, K*T)
    right = backprop.reshape(n_samples, per_sample.shape[1], -1)  # (N, K*T, d)
    if layer.padding_idx is not None:
        right = right * (per_sample != layer.padding_idx).unsqueeze(-1).to(right.dtype)
    return GhostFactors.index(per_sample, right), {}


def _bag_call(activations: list[Any], kwargs: dict[str, Any]
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(input, offsets, per_sample_weights)`` of an EmbeddingBag call, positional or keyword."""
    named = ("input", "offsets", "per_sample_weights")
    values: list[Any] = [activations[i] if i < len(activations) else kwargs.get(name)
                         for i, name in enumerate(named)]
    return values[0], values[1], values[2]


def _bag_rows(layer: nn.EmbeddingBag, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Number of bags of a 1-D-input call (``None`` for 2-D input: its rows are dim 0)."""
    inputs, offsets, _ = _bag_call(list(args), kwargs)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 1 or offsets is None:
        return None
    return offsets.numel() - int(layer.include_last_offset)


def _bag_of_token(inputs: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flat token ids, the bag each belongs to (-1: after the last offset, unused), bag count."""
    if inputs.dim() == 2:
        bags, length = inputs.shape
        bag = torch.arange(bags, device=inputs.device)[:, None].expand(bags, length)  # (B, L)
        return inputs.reshape(-1), bag.reshape(-1), bags
    if offsets is None:
        raise UnsupportedModuleError(
            f"embedding_bag_grad_sample: a {inputs.dim()}-D input needs offsets (got None)")
    bags = offsets.numel() - int(include_last_offset)
    position = torch.arange(inputs.numel(), device=inputs.device)  # (M,)
    if not include_last_offset:  # torch starts the first bag at 0: a token's bag counts the later starts
        return inputs, torch.searchsorted(offsets[1:], position, right=True), bags  # (M,)
    bag = torch.searchsorted(offsets[:bags], position, right=True) - 1  # (M,)
    # torch documents the extra last offset as the input's length; tokens past it are left out
    # (torch itself treats them inconsistently, depending on padding_idx).
    return inputs, torch.where(position < offsets[bags], bag, -1), bags


def _max_grad_sample(layer: nn.EmbeddingBag, tokens: torch.Tensor, bag: torch.Tensor,
                     counted: torch.Tensor, backprops: torch.Tensor, bags: int,
                     K: int) -> torch.Tensor:
    """mode="max": each (bag, feature) sends its gradient to the one table row that won the max.

    The winner is found as torch's forward finds it (the first of the bag's counted tokens that
    holds the maximum), with fixed-shape reductions over all tokens: no compaction of the counted
    ones, whose number only the device knows.
    """
    count, dim = tokens.shape[0], layer.embedding_dim
    bag_index = bag.clamp(min=0)[:, None].expand(count, dim)  # (M, d)
    with torch.no_grad():
        rows = layer.weight[torch.where(counted, tokens, 0)]  # (M, d)
        lowest = torch.finfo(rows.dtype).min
        rows = rows.masked_fill(~counted[:, None], lowest)
        best = rows.new_full((bags, dim), lowest).scatter_reduce_(0, bag_index, rows, "amax")  # (B, d)
        holds_max = (rows == best.gather(0, bag_index)) & counted[:, None]  # (M, d)
        position = torch.arange(count, device=tokens.device)[:, None].expand(count, dim)  # (M, d)
        first = torch.full((bags, dim), count, dtype=position.dtype, device=tokens.device).scatter_reduce_(
            0, bag_index, torch.where(holds_max, position, count), "amin")  # (B, d); count: empty bag
        empty = first == count  # (B, d)
        winners = tokens[first.clamp(max=max(count - 1, 0))] if count else first  # (B, d)
    n_samples = bags // K
    sample = (torch.arange(bags, device=tokens.device) // K)[:, None]  # (B, 1)
    index = torch.where(empty, 0, sample * layer.num_embeddings + winners)  # (B, d)
    values = torch.where(empty, 0, backprops)  # (B, d); empty bags have no winner
    out = backprops.new_zeros(n_samples * layer.num_embeddings, dim)  # (N*V, d)
    out.scatter_add_(0, index, values)
    return out.view(n_samples, layer.num_embeddings, dim)  # (N, V, d)


# torch fixes the bags at dim 0 whatever the model's layout, and a 1-D input's rows are its bags.
@register_grad_sampler(nn.EmbeddingBag, k_aware=True, batch_first_only=True, count_rows=_bag_rows,
                       with_kwargs=True)
def embedding_bag_grad_sample(layer: nn.EmbeddingBag, activations: list[Any],
                              backprops: torch.Tensor, K: int, *,
                              kwargs: dict[str, Any]) -> dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradient of ``nn.EmbeddingBag.weight``: ``(N, num_embeddings, embedding_dim)``.

    Handles ``mode`` "sum", "mean" and "max", 2-D input ``(N*K, L)`` or 1-D input with
    ``offsets`` (``N*K`` bags, ``include_last_offset`` either way), ``per_sample_weights`` (mode
    "sum") and ``padding_idx`` (those entries are left out of their bag, as in torch). Sample n
    owns bags ``n*K .. n*K+K-1``; ``backprops`` is ``(N*K, dim)``.

    >>> layer = nn.EmbeddingBag(10, 3, mode="mean")
    >>> bags = [torch.tensor([1, 2, 2, 3, 4]), torch.tensor([0, 4])]  # bags [1, 2, 2, 3] and [4]
    >>> grads = embedding_bag_grad_sample(layer, bags, torch.ones(2, 3), 1, kwargs={})
    >>> grads[layer.weight][0, 2].tolist(), grads[layer.weight].shape
    ([0.5, 0.5, 0.5], torch.Size([2, 10, 3]))
    """
    if not wants_grad(layer.weight):
        return {}
    _reject_batch_mixing(layer, "embedding_bag_grad_sample")
    if layer.mode == "max":
        inputs, offsets, _ = _bag_call(activations, kwargs)
        tokens, bag, bags, counted = _counted_tokens(layer, inputs, offsets)  # (M,) each
        return {layer.weight: _max_grad_sample(layer, tokens, bag, counted, backprops, bags, K)}
    tokens, bag_index, weight, bags = _bag_weights(layer, activations, kwargs, backprops.dtype)
    values = torch.where(weight[:, None] != 0, backprops[bag_index] * weight[:, None], 0)  # (M, d)
    grad = _per_sample_scatter(tokens, bag_index // K, values, bags // K, layer.num_embeddings)  # (N, V, d)
    return {layer.weight: grad}


def _flat_input(inputs: Any) -> torch.Tensor:
    if not isinstance(inputs, torch.Tensor) or inputs.is_nested:
        raise UnsupportedModuleError("embedding_bag_grad_sample: nested-tensor input is not "
                                     "supported; pass a flat input with offsets")
    return inputs


def _counted_tokens(layer: nn.EmbeddingBag, inputs: Any, offsets: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Flat token ids, their bags (-1: after the last offset), the number of bags, and whether each
    token counts (in a bag and not ``padding_idx``)."""
    tokens, bag, bags = _bag_of_token(_flat_input(inputs), offsets, layer.include_last_offset)  # (M,), (M,)
    counted = bag >= 0  # (M,)
    if layer.padding_idx is not None:
        counted = counted & (tokens != layer.padding_idx)
    return tokens, bag, bags, counted


def _bag_weights(layer: nn.EmbeddingBag, args: Sequence[Any], kwargs: dict[str, Any], dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Mode "sum"/"mean": each token's table row and bag, and the ``(M,)`` weight of its bag's
    gradient in the gradient it sends to that row (0 for padding and tokens after the last
    offset, whose row is then 0 and bag 0), with the number of bags.

    Every token takes part, the ones not counted with weight 0: selecting the counted ones would
    need their number on the host (a device sync).
    """
    inputs, offsets, per_sample_weights = _bag_call(list(args), kwargs)
    flat = _flat_input(inputs)
    if layer.padding_idx is None and not (layer.include_last_offset and flat.dim() == 1) \
            and layer.mode in ("sum", "mean"):
        # Every token counts (torch starts the first bag at offset 0): no mask to apply.
        tokens, bag, bags = _bag_of_token(flat, offsets, False)  # (M,) each
        count = tokens.shape[0]
        if layer.mode == "sum":
            weight = (as_dtype(per_sample_weights.reshape(-1), dtype) if per_sample_weights is not None
                      else torch.ones(count, dtype=dtype, device=tokens.device))
        elif flat.dim() == 2:  # fixed-length bags
            weight = torch.full((count,), 1.0 / max(1, flat.shape[1]), dtype=dtype, device=tokens.device)
        else:  # an empty bag's size is 0, but no token reads it
            ones = torch.ones(count, dtype=dtype, device=tokens.device)
            weight = torch.zeros(bags, dtype=dtype, device=tokens.device).index_add_(0, bag, ones).reciprocal()[bag]
        return tokens, bag, weight, bags
    tokens, bag, bags, counted = _counted_tokens(layer, inputs, offsets)  # (M,) each
    weight = counted.to(dtype)  # (M,)
    if per_sample_weights is not None:
        weight = weight * per_sample_weights.reshape(-1).to(dtype)
    bag_index = bag.clamp(min=0)  # (M,)
    if layer.mode == "mean":
        sizes = torch.zeros(bags, dtype=dtype, device=weight.device).index_add_(0, bag_index, counted.to(dtype))
        weight = weight / sizes.clamp(min=1)[bag_index]
    elif layer.mode != "sum":
        raise UnsupportedModuleError(
            f"embedding_bag_grad_sample: unknown EmbeddingBag mode {layer.mode!r}")
    return torch.where(counted, tokens, 0), bag_index, weight, bags


def _native_bag_entries(layer: nn.EmbeddingBag, args: Sequence[Any], kwargs: dict[str, Any], backprop: torch.Tensor,
                        K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`_bag_weights`' entries (as KEYED factors hold them) from psg's native kernel, where
    it applies (a CPU; see :func:`psg_core.native.bag_entries`), else None."""
    if backprop.device.type != "cpu" or layer.mode not in ("sum", "mean"):
        return None
    inputs, offsets, per_sample_weights = _bag_call(list(args), kwargs)
    if not isinstance(inputs, torch.Tensor) or inputs.is_nested or inputs.dim() not in (1, 2) \
            or (inputs.dim() == 1 and offsets is None):
        return None
    flat = inputs.reshape(-1)
    if per_sample_weights is not None:
        per_sample_weights = as_dtype(per_sample_weights.reshape(-1), backprop.dtype)
    return native.bag_entries(flat, offsets if inputs.dim() == 1 else None, bags=inputs.shape[0],
                              include_last_offset=layer.include_last_offset and inputs.dim() == 1,
                              mean=layer.mode == "mean", padding_idx=layer.padding_idx,
                              per_sample_weights=per_sample_weights, K=K, table_rows=layer.num_embeddings,
                              dtype=backprop.dtype)


# The ghost norm of EmbeddingBag (modes sum and mean): sample n's gradient scatters its tokens'
# weighted bag gradients into table rows; summing the entries of each (sample, row) pair gives
# the norm from (M, d) numbers instead of the (N, V, d) gradient. Mode max keeps the materialised
# gradient (its rows are chosen per feature).
def _bag_positions(layer: nn.EmbeddingBag, tokens: torch.Tensor, output: Any, batch_dim: int) -> int | None:
    return None if layer.mode == "max" else 1


@register_ghost_norm(nn.EmbeddingBag, positions=_bag_positions,
                     is_cheaper=lambda layer, positions: True, whole_call=True, layout=WeightLayout.KEYED_TABLE)
def embedding_bag_ghost_factors(layer: nn.EmbeddingBag, call: Any, backprop: torch.Tensor,
                                K: int) -> tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]:
    """Each token's (sample, table row) and the gradient it sends there (modes sum and mean): its
    weight (1, a mean's 1/size or its per-sample weight) times its bag's gradient.

    >>> from types import SimpleNamespace
    >>> layer = nn.EmbeddingBag(10, 3, mode="sum")
    >>> call = SimpleNamespace(args=(torch.tensor([1, 1, 2]), torch.tensor([0, 2])), kwargs={})
    >>> factors, _ = embedding_bag_ghost_factors(layer, call, torch.ones(2, 3), 1)
    >>> factors.sq_norms(torch.float32).tolist()  # sample 0: row 1 gets 2 * (1, 1, 1)
    [12.0, 3.0]
    """
    _reject_batch_mixing(layer, "embedding_bag_ghost_factors")
    entries = _native_bag_entries(layer, call.args, call.kwargs, backprop, K)
    if entries is not None:
        left, source, weight = entries
        return GhostFactors(FactorKind.KEYED, left, backprop, backprop.shape[0] // K,
                            source, weight, layer.num_embeddings), {}
    tokens, bag_index, weight, bags = _bag_weights(layer, call.args, call.kwargs, backprop.dtype)
    sample = bag_index if K == 1 else bag_index // K  # (M,)
    return GhostFactors.keyed(sample, tokens, backprop, bags // K, source=bag_index, weight=weight,
                              table_rows=layer.num_embeddings), {}
