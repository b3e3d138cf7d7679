"""The ghost-norm registry: how the ghost backend gets a layer's per-sample weight-gradient norms
without materialising the per-sample gradients.

Sample n's weight gradient of a Linear-like layer is ``sum_t g_t a_t^T`` over its ``T = K *
positions`` rows, and ``||sum_t g_t a_t^T||^2 = sum_{s,t} (a_s . a_t)(g_s . g_t)``: two ``(T, T)``
Gram matrices instead of the ``(d_out, d_in)`` gradient ("ghost norm", Li et al. 2022). A layer
family says how its gradient factors, beside its grad sampler, with :func:`register_ghost_norm`:

* ``factors(layer, activation, backprop, K)``: the :class:`GhostFactors` of each sample's weight
  gradient, and the ``(N, *shape)`` per-sample gradients of the layer's other trainable
  parameters (a bias: small, so materialised);
* ``weight_sum(layer, activation, backprop)``: the weight gradient summed over the rows, which
  with ``backprop`` scaled row by row is the clipped sum ("book-keeping", Bu et al. 2023); not
  needed by a lookup table (layout ``TABLE`` or ``KEYED_TABLE``), whose clipped sum comes from
  the factors its norm used (each entry's row scaled and added into its table row);
* ``positions(layer, activation, output, batch_dim)``: the factor rows one input row
  contributes (sequence length, convolution positions), known at the forward call;
* ``is_cheaper(layer, positions)``: whether the Gram pair beats materialising the per-sample
  weight gradient (default: ``2 * T^2 <= weight.numel()``);
* optionally ``choose(layer, activation, backprop, K)``: the same question asked with a
  single-call layer's tensors in hand (the convolutions measure, see
  :mod:`psg_core.grad_sample.conv_strategy`); None defers to ``is_cheaper``;
* optionally ``layout`` (a :class:`WeightLayout`): where the factors' numbers lie in the weight,
  so that a weight shared by several modules (GPT-2's LM head tied to its token table, a tied
  autoencoder) gets its ghost norm from every owner's factors (:func:`shared_sq_norms`); a family
  without one has a shared weight's per-sample gradient materialised.

``activation``, ``backprop`` are batch-first with ``N*K`` rows, sample-major.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn

import psg_core.native as native
from psg_core.errors import ConfigError
from psg_core.grad_sample._type_registry import LayerKey, LayerTypeRegistry
from psg_core.precision import as_dtype

__all__ = ["FactorKind", "GhostFactors", "GhostNormEntry", "GhostNormRegistry", "GHOST_NORMS", "TensorMemo",
           "WeightLayout", "can_share", "gram_dtype", "register_ghost_norm", "shared_sq_norms"]


class FactorKind(enum.Enum):
    """How :class:`GhostFactors` make a gradient."""

    #: ``grad[n]`` holds ``right[n, g]^T @ left[n, g]`` for each group g (Linear, convolutions
    #: per group; the groups are blocks of the weight, their squared norms add up).
    DOT = "dot"
    #: a lookup table: ``grad[n][v] = sum_{t: left[n, t] == v} right[n, t]`` (Embedding).
    INDEX = "index"
    #: a lookup table with any number of entries per sample: ``left (2, M)`` holds each entry's
    #: sample and table row, ``grad[n][v] = sum_{m: left[:, m] == (n, v)} entry(m)`` (EmbeddingBag).
    #: ``entry(m)`` is ``right[m]``, or ``weight[m] * right[source[m]]`` when the entries are
    #: weighted copies of a few shared rows (an EmbeddingBag's tokens, of their bag's gradient).
    KEYED = "keyed"


@dataclass(frozen=True)
class GhostFactors:
    """One call's factors of each sample's weight gradient, the K rows folded into T.

    ``DOT``: ``left (N, G, T, I)``, ``right (N, G, T, O)``. ``INDEX``: ``left (N, T)`` token ids,
    ``right (N, T, d)`` output gradients (rows that get no gradient, e.g. padding, zeroed).
    ``KEYED``: ``left (2, M)`` (sample, token id) of M entries, ``right (M, d)``, ``samples`` N;
    or, with ``source`` and ``weight`` (both ``(M,)``), ``right (N*K, d)`` holds K rows per sample
    (sample n's are ``n*K .. n*K+K-1``) and entry m is ``weight[m] * right[source[m]]``, a row of
    its own sample: the norms and the clipped sum then need no ``(M, d)`` entry rows
    (:meth:`entries` makes them where a caller needs them).
    """

    kind: FactorKind
    left: torch.Tensor
    right: torch.Tensor
    samples: int = 0
    source: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    #: KEYED: the table's number of rows when known (every token is below it), 0 otherwise.
    table_rows: int = 0

    @classmethod
    def dot(cls, left: torch.Tensor, right: torch.Tensor) -> GhostFactors:
        """``grad[n]``'s group g is ``right[n, g]^T @ left[n, g]``: ``(N, G, T, I)`` and ``(N, G, T, O)``."""
        if left.dim() != 4 or right.dim() != 4 or left.shape[:3] != right.shape[:3]:
            raise ConfigError(f"GhostFactors.dot: expected (N, G, T, I) and (N, G, T, O), got "
                              f"{tuple(left.shape)} and {tuple(right.shape)}")
        return cls(FactorKind.DOT, left, right)

    @classmethod
    def index(cls, tokens: torch.Tensor, right: torch.Tensor) -> GhostFactors:
        """A lookup table's gradient: ``(N, T)`` token ids and their ``(N, T, d)`` gradients."""
        if tokens.dim() != 2 or right.dim() != 3 or tokens.shape != right.shape[:2]:
            raise ConfigError(f"GhostFactors.index: expected (N, T) and (N, T, d), got "
                              f"{tuple(tokens.shape)} and {tuple(right.shape)}")
        return cls(FactorKind.INDEX, tokens, right)

    @classmethod
    def keyed(cls, sample: torch.Tensor, tokens: torch.Tensor, right: torch.Tensor, samples: int, *,
              source: torch.Tensor | None = None, weight: torch.Tensor | None = None,
              table_rows: int = 0) -> GhostFactors:
        """A lookup table's gradient from M entries: their ``(M,)`` samples and table rows and
        ``(M, d)`` gradients; ``samples`` is N. Entries that get no gradient carry zeros.

        With ``source`` and ``weight`` (``(M,)`` each), ``right`` is ``(N*K, d)``, K rows per
        sample, and entry m's gradient is ``weight[m] * right[source[m]]``; ``source[m]`` must be a
        row of entry m's sample (``source // K == sample``) and an entry that gets no gradient has
        weight 0 and a finite row.
        """
        if sample.shape != tokens.shape or tokens.dim() != 1 or right.dim() != 2 or (
                source is None and right.shape[0] != tokens.shape[0]):
            raise ConfigError(f"GhostFactors.keyed: expected (M,), (M,) and (M, d), got {tuple(sample.shape)}, "
                              f"{tuple(tokens.shape)} and {tuple(right.shape)}")
        if (source is None) != (weight is None) or (source is not None and (
                source.shape != tokens.shape or cast(torch.Tensor, weight).shape != tokens.shape
                or right.shape[0] % max(samples, 1) or (samples == 0 and right.shape[0]))):
            raise ConfigError(f"GhostFactors.keyed: source and weight come together, (M,) each, with K rows "
                              f"of right per sample; got source {_shape(source)}, weight {_shape(weight)}, "
                              f"right {tuple(right.shape)} for {samples} samples")
        return cls(FactorKind.KEYED, torch.stack([sample, tokens]), right, samples, source, weight, table_rows)

    def entries(self) -> torch.Tensor:
        """KEYED factors' ``(M, d)`` entry rows (``right`` itself unless the entries are weighted
        rows of ``right``)."""
        if self.source is None or self.weight is None:
            return self.right
        return _weighted_rows(self.right, self.source, as_dtype(self.weight, self.right.dtype))

    @staticmethod
    def concat(parts: Sequence[GhostFactors]) -> GhostFactors:
        """The factors of several calls of one layer, along T (the norm of the summed gradient)."""
        if len(parts) == 1:
            return parts[0]
        if parts[0].kind is FactorKind.KEYED:
            return GhostFactors(FactorKind.KEYED, torch.cat([p.left for p in parts], 1),
                                torch.cat([p.entries() for p in parts], 0), parts[0].samples)
        axis = 2 if parts[0].kind is FactorKind.DOT else 1
        return GhostFactors(parts[0].kind, torch.cat([p.left for p in parts], axis),
                            torch.cat([p.right for p in parts], axis))

    def sq_norms(self, dtype: torch.dtype, grams: TensorMemo | None = None,
                 left_grams: TensorMemo | None = None) -> torch.Tensor:
        """``(N,)`` squared Frobenius norms of the per-sample weight gradients, from Gram matrices.

        ``grams``: the output gradients' Gram matrices of one pass, to reuse (layers fed the same
        output gradient, as a DP LSTM's ``ih`` and ``hh``, compute its Gram once). ``left_grams``:
        the activations' (``DOT``), to reuse likewise (an attention block's query, key and value
        projections, or an MLP's gate and up projections, read one input).

        >>> a, g = torch.randn(2, 1, 5, 3), torch.randn(2, 1, 5, 4)
        >>> grads = g.transpose(-1, -2) @ a  # (N, 1, 4, 3)
        >>> torch.allclose(GhostFactors.dot(a, g).sq_norms(torch.float32), grads.square().sum((1, 2, 3)))
        True
        """
        precise = gram_dtype(dtype)
        # (cast where the rows are read as they are: the Grams below read the rows in their own
        # dtype, and a float64 copy of a tied LM head's (N, T, V) rows is 131 MB at GPT-2's sizes)
        right = as_dtype(self.right, dtype) if self.kind is not FactorKind.DOT or self.right.shape[-2] == 1 \
            else self.right
        if self.kind is FactorKind.KEYED:
            if self.source is not None and self.weight is not None:
                weight = as_dtype(self.weight, dtype)
                norms = native.keyed_sq_norms(self.left, self.source, weight, right, self.samples) \
                    if right.device.type == "cpu" else None
                return norms if norms is not None else _weighted_keyed_sq_norms(
                    self.left, self.source, weight, right, self.samples, self.table_rows)
            return _keyed_sq_norms(self.left[0], self.left[1], right, self.samples)
        if self.kind is FactorKind.INDEX and right.device.type == "cpu":
            # each (sample, token) run of rows summed, in float64 (no T x T Gram: at T 64 a third
            # of its time, at T 512 a twentieth), where the native library runs
            norms = _index_sq_norms(self.left, right)
            if norms is not None:
                return norms
        if self.kind is FactorKind.DOT and right.shape[-2] == 1:
            # one row per sample and group (a Linear on (N, d) inputs): the products of the rows'
            # squared norms, summed over the groups
            left = as_dtype(self.left, dtype)
            products = torch.linalg.vecdot(left, left) * torch.linalg.vecdot(right, right)  # (N, G, 1)
            return products.view(products.shape[0]) if products.shape[1] == 1 else products.sum((1, 2))
        # (N, [G,] T, T) in float64 (see gram_dtype); a one-row Gram is a squared norm: computing it
        # costs less than looking it up
        cast_gram = functools.partial(_cast_gram, dtype=precise)
        gram_right = cast_gram(self.right) if grams is None or right.shape[-2] == 1 else \
            grams.get(self.right, cast_gram, precise)
        if self.kind is FactorKind.DOT:
            gram_left = cast_gram(self.left) if left_grams is None else \
                left_grams.get(self.left, cast_gram, precise)  # (N, G, T, T)
            return as_dtype((gram_left * gram_right).sum((1, 2, 3)).clamp_min(0), dtype)
        same_token = self.left.unsqueeze(2) == self.left.unsqueeze(1)  # (N, T, T)
        return as_dtype((gram_right * same_token).sum((1, 2)).clamp_min(0), dtype)


def _shape(tensor: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(tensor.shape)


def gram_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a squared norm's Gram matrices are computed in: float64 below it.

    ``sum_{i,j} (a_i . a_j)(g_i . g_j)`` is the squared norm of ``sum_i g_i a_i^T``, and rows that
    nearly cancel there (a sample's tokens ``a`` and ``a + d`` with opposite output gradients)
    leave a norm far below the terms: in float32 (a unit roundoff of 6e-8 of terms up to
    ``(sum_i |a_i| |g_i|)^2``) the computed value is rounding noise, even 0 (measured: one crafted
    sample of a Linear layer on 2-token rows reported norm 0 and added 31 times the clipping
    bound to the clipped sum, which the per-sample gradient's own norm clips to 1). Products of
    float32 numbers are exact in float64, whose rounding (1.1e-16) is then far below any norm the
    clipping could act on."""
    return torch.float64 if dtype in (torch.float32, torch.float16, torch.bfloat16) else dtype


def _cast_gram(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``_gram(rows.to(dtype))``. Float64 Grams of CPU rows are psg's native kernel's where it runs
    (:func:`psg_core.native.gram64`: no float64 copy of the rows, one triangle computed; an LSTM's
    gate gradients 1.0 ms against 2.2 ms and more for torch's cast and float64 product)."""
    if dtype is torch.float64 and rows.device.type == "cpu" and rows.dim() >= 3 and rows.shape[-2] > 1:
        positions, width = rows.shape[-2], rows.shape[-1]
        grams = native.gram64(rows.reshape(-1, positions, width))  # (B, T, T)
        if grams is not None:
            return grams.view(*rows.shape[:-2], positions, positions)
    return _gram(as_dtype(rows, dtype))


def _gram(rows: torch.Tensor) -> torch.Tensor:
    """``(..., T, T)`` inner products of the last axis' ``T`` rows (one row, as a Linear layer on
    ``(N, d)`` inputs has: its squared norm, without a batched matmul of 1 x 1 products)."""
    if rows.shape[-2] == 1:
        return (rows * rows).sum(-1, keepdim=True)  # (..., 1, 1)
    # one bmm over the leading axes merged: the product matmul makes of them, without its
    # broadcasting ops (each op costs the host a dispatch; on a GPU that is the step's cost)
    positions, width = rows.shape[-2], rows.shape[-1]
    flat = rows.reshape(-1, positions, width)  # (B, T, D), a view for the factors' layouts
    return torch.bmm(flat, flat.transpose(1, 2)).view(*rows.shape[:-2], positions, positions)


class TensorMemo:
    """Results computed from tensors in one ghost pass, by the tensor (and any extra key parts).

    A tensor is known by its first element's address, shape, strides, dtype and version: equal keys hold
    equal values as long as the tensor lives, and the memo holds it alive, so a key can never be
    taken over by another tensor's memory. Only the ``capacity`` latest results are kept (layers
    that share an output gradient, as a DP LSTM's ih and hh, come one after the other; a
    long-sequence model's Gram matrices are large), and the memo is dropped with the pass.

    >>> memo, g = TensorMemo(), torch.randn(2, 1, 5, 3)
    >>> first = memo.get(g, _gram)
    >>> memo.get(g.view(2, 1, 5, 3), _gram) is first, len(memo)  # the same numbers: computed once
    (True, 1)
    """

    def __init__(self, capacity: int = 4) -> None:
        self._results: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._results)

    def get(self, tensor: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor], *key: Any) -> torch.Tensor:
        """``compute(tensor)``, computed once per distinct (tensor, ``key``)."""
        if tensor.requires_grad or tensor.is_sparse:
            return compute(tensor)
        # (the address of its first element stands for storage and offset: the memo holds the
        # tensor, so no other storage can start there while the key lives)
        full_key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device,
                    tensor._version, *key)
        held = self._results.get(full_key)
        if held is None:
            while len(self._results) >= self._capacity:
                del self._results[next(iter(self._results))]  # the oldest
            held = self._results[full_key] = (tensor, compute(tensor))
        return held[1]

    def clear(self) -> None:
        """Drops every result and the tensors they were computed from."""
        self._results.clear()


def _keyed_sq_norms(sample: torch.Tensor, tokens: torch.Tensor, right: torch.Tensor, samples: int) -> torch.Tensor:
    """``(N,)``: ``sum_n sum_v ||sum_{m: (sample, token)_m = (n, v)} right[m]||^2``.

    Entries sorted by (sample, token) make each table row of each sample one run; the runs are
    summed into an ``(M, d)`` buffer (never the ``(N, V, d)`` gradient), with fixed shapes only:
    no count of distinct keys is read on the host.

    >>> right = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    >>> _keyed_sq_norms(torch.tensor([0, 0, 1]), torch.tensor([4, 4, 4]), right, 2).tolist()  # (1+2)^2, 3^2
    [9.0, 9.0]
    """
    count = tokens.shape[0]
    if count == 0:
        return right.new_zeros(samples)
    order, run = _runs(sample, tokens)
    sums = right.new_zeros(count, right.shape[1]).index_add_(0, run, right[order])  # (M, d), runs first
    run_sample = torch.zeros_like(run).scatter_(0, run, sample[order])  # (M,) 0 for unused run numbers
    return right.new_zeros(samples).index_add_(0, run_sample, sums.square().sum(1))


def _index_sq_norms(tokens: torch.Tensor, right: torch.Tensor) -> torch.Tensor | None:
    """``(N,)`` squared norms of INDEX factors (``(N, T)`` tokens, ``(N, T, d)`` rows) by the
    native library's keyed runs, every row its own entry of weight 1; None where it cannot
    (no library, token ids not int64, no rows).

    >>> tokens, right = torch.tensor([[3, 3], [1, 2]]), torch.ones(2, 2, 2)
    >>> out = _index_sq_norms(tokens, right)
    >>> out is None or out.tolist() == [8.0, 4.0]
    True
    """
    samples, positions = tokens.shape
    count = samples * positions
    if count == 0 or tokens.dtype is not torch.int64:
        return None
    sample = torch.arange(count, device=tokens.device) // positions  # (M,)
    return native.keyed_sq_norms(torch.stack([sample, tokens.reshape(count)]), torch.arange(count, device=tokens.device),
                                 right.new_ones(count), right.reshape(count, right.shape[-1]), samples)


def _weighted_rows(rows: torch.Tensor, source: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(M, d)``: ``weight[m] * rows[source[m]]``, 0 where the weight is 0 (whatever the row holds)."""
    weight = weight[:, None]
    return torch.where(weight != 0, rows[source] * weight, 0)


def _runs(sample: torch.Tensor, tokens: torch.Tensor, table_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries sorted by (sample, token): the order and each sorted entry's run (one run per
    distinct key, numbered from 0), ``(M,)`` each, with fixed shapes only. ``table_rows``: a bound
    on the tokens when known (else read from them, on the device).

    >>> order, run = _runs(torch.tensor([1, 0, 0]), torch.tensor([3, 5, 3]))
    >>> order.tolist(), run.tolist()
    ([2, 1, 0], [0, 1, 2])
    """
    key = sample * (table_rows if table_rows else tokens.max() + 1) + tokens  # (M,), stays on the device
    key, order = key.sort()
    run = (torch.diff(key, prepend=key[:1]) != 0).cumsum(0)  # (M,) a new run where the key changes
    return order, run


def _weighted_keyed_sq_norms(left: torch.Tensor, source: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                             samples: int, table_rows: int = 0) -> torch.Tensor:
    """:func:`_keyed_sq_norms` of entries ``weight[m] * rows[source[m]]`` (``left (2, M)`` their
    samples and table rows, ``rows (N*K, d)``, K per sample): a run (the entries of one sample
    and table row) sends ``sum_k c_k rows[n*K + k]``, ``c_k`` the weights of its entries from
    row k, so sample n's squared norm is ``sum_{k,l} S_n[k, l] Gram_n[k, l]`` with ``S_n`` the sum
    of ``c c^T`` over its runs. ``S_n[k]`` is also the sum over its entries m from row k of
    ``weight[m] * c(run of m)``: ``(M, K)`` numbers and ``(N, K, K)`` Grams, no ``(M, d)`` rows,
    and no per-run sample. Where ``K*K`` exceeds d the ``(M, d)`` runs are cheaper and serve.

    >>> rows = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # one row (bag) per sample
    >>> left = torch.tensor([[0, 0, 1], [4, 4, 5]])  # (sample, table row) of 3 entries
    >>> _weighted_keyed_sq_norms(left, torch.tensor([0, 0, 1]), torch.tensor([0.5, 0.5, 3.0]), rows,
    ...                          2).tolist()  # (0.5+0.5)^2 * 1, 3^2 * 4
    [1.0, 36.0]
    """
    count, dim = left.shape[1], rows.shape[1]
    if count == 0 or samples == 0:
        return rows.new_zeros(samples)
    K = rows.shape[0] // samples
    sample, tokens = left[0], left[1]
    if K * K > dim:
        return _keyed_sq_norms(sample, tokens, _weighted_rows(rows, source, weight), samples)
    run, runs = _run_of_entry(sample, tokens, table_rows)
    if K == 1:  # rows (N, d)
        coef = weight.new_zeros(runs).index_add_(0, run, weight)  # (R,) each run's weight
        weights = weight.new_zeros(samples).index_add_(0, sample, weight * coef[run])  # (N,) sum of c^2
        # a sample with no weighted entry has norm 0 whatever its row holds (an empty bag's)
        return torch.where(weights != 0, weights * (rows * rows).sum(1), 0)
    per_sample = rows.view(samples, K, dim)
    slot = source - sample * K  # (M,) the entry's row among its sample's K
    coef = weight.new_zeros(runs * K).index_add_(0, run * K + slot, weight).view(runs, K)  # (R, K)
    pairs = weight.new_zeros(samples * K, K).index_add_(0, source, coef[run] * weight[:, None])  # (N*K, K)
    precise = per_sample.to(gram_dtype(per_sample.dtype))  # (see gram_dtype: copies that nearly cancel)
    gram = precise @ precise.transpose(1, 2)  # (N, K, K)
    pairs = pairs.view(samples, K, K).to(precise.dtype)
    return as_dtype(torch.where(pairs != 0, pairs * gram, 0).sum((1, 2)).clamp_min(0), rows.dtype)


def _run_of_entry(sample: torch.Tensor, tokens: torch.Tensor, table_rows: int = 0) -> tuple[torch.Tensor, int]:
    """Each entry's run, one per distinct (sample, table row), and the number of run slots (M: a
    sort of the keys with fixed shapes only; counting the distinct keys would read them on the
    host, a device's sync, and on a CPU measured no faster).

    >>> _run_of_entry(torch.tensor([0, 0, 1, 0]), torch.tensor([4, 2, 4, 4]))[0].tolist()
    [1, 0, 2, 1]
    """
    order, sorted_run = _runs(sample, tokens, table_rows)
    return torch.empty_like(sorted_run).scatter_(0, order, sorted_run), tokens.shape[0]


class WeightLayout(enum.Enum):
    """Where a family's :class:`GhostFactors` lie in its weight, declared with its ghost norm.

    A weight shared by several modules (GPT-2's LM head tied to its token table) has one gradient,
    the sum of its owners' contributions; its ghost norm needs every owner's factors laid out in
    the same matrix. Only families that declare a layout take part (:func:`can_share`).
    """

    #: DOT factors: ``weight.reshape(G * O, I)`` stacks group g's ``right[:, g]^T @ left[:, g]``
    #: (``nn.Linear``'s ``(d_out, d_in)``; a convolution's ``(C, C'/G, *kernel)``).
    ROWS_RIGHT = "rows_right"
    #: DOT factors with one group: ``weight.reshape(I, O) = left^T @ right`` (transformers'
    #: ``Conv1D``, whose weight is ``(d_in, d_out)``).
    ROWS_LEFT = "rows_left"
    #: INDEX factors of a ``(V, d)`` table: row v gets the ``right`` rows of the tokens ``v``
    #: (``nn.Embedding``).
    TABLE = "table"
    #: KEYED factors of a ``(V, d)`` table (``nn.EmbeddingBag``).
    KEYED_TABLE = "keyed_table"

    @property
    def kind(self) -> FactorKind:
        """The :class:`FactorKind` of the factors the layout describes."""
        if self is WeightLayout.TABLE:
            return FactorKind.INDEX
        return FactorKind.KEYED if self is WeightLayout.KEYED_TABLE else FactorKind.DOT


#: The layouts of lookup tables, whose clipped sums come from their factors.
_TABLE_LAYOUTS = (WeightLayout.TABLE, WeightLayout.KEYED_TABLE)


def can_share(layouts: Sequence[WeightLayout | None]) -> bool:
    """Whether owners with these layouts can give a shared weight's ghost norm: every one declared,
    and no table of KEYED entries beside a matrix product (their cross term would gather the
    product's factors once per entry; that weight is materialised instead).

    >>> can_share([WeightLayout.TABLE, WeightLayout.ROWS_RIGHT]), can_share([WeightLayout.ROWS_RIGHT, None])
    (True, False)
    >>> can_share([WeightLayout.KEYED_TABLE, WeightLayout.TABLE]), can_share([WeightLayout.KEYED_TABLE,
    ...                                                                       WeightLayout.ROWS_LEFT])
    (True, False)
    """
    if any(layout is None for layout in layouts):
        return False
    kinds = {cast(WeightLayout, layout).kind for layout in layouts}
    return not (FactorKind.KEYED in kinds and FactorKind.DOT in kinds)


def shared_sq_norms(parts: Sequence[tuple[WeightLayout, GhostFactors]], shape: Sequence[int],
                    dtype: torch.dtype) -> torch.Tensor:
    """``(N,)`` squared norms of each sample's gradient of a weight shared by several owners: the
    norm of the sum of their contributions, ``sum_m ||G_m||^2 + 2 sum_{m<m'} <G_m, G_m'>``.

    ``parts`` holds each owner's layout and factors (all of its calls), ``shape`` the weight's.
    Matrix products laid out alike are one product over their rows concatenated (the Gram of the
    concatenation holds the cross terms, as for a layer called twice); tables likewise (INDEX
    entries become KEYED ones beside a KEYED table). A product ``W = R^T L`` (``R (T, V)``,
    ``L (T, d)``) meets a table of tokens ``tok_s`` with rows ``r_s`` in
    ``<W, table> = sum_{s,t} R[t, tok_s] (L_t . r_s)``: an ``(N, T, S)`` gather and Gram, never
    the ``(N, V, d)`` gradient. Owners whose factors do not line up (products with different
    groups) have their gradients materialised from the factors, summed, and normed.

    >>> W = torch.randn(4, 3)  # an Embedding(4, 3) and a Linear(3, 4) sharing their weight
    >>> tokens, rows = torch.tensor([[1, 1, 3]]), torch.randn(1, 3, 3)  # the table's factors
    >>> left, right = torch.randn(1, 1, 5, 3), torch.randn(1, 1, 5, 4)  # the Linear's
    >>> dense = right[0, 0].T @ left[0, 0] + torch.zeros(4, 3).index_add(0, tokens[0], rows[0])
    >>> parts = [(WeightLayout.TABLE, GhostFactors.index(tokens, rows)),
    ...          (WeightLayout.ROWS_RIGHT, GhostFactors.dot(left, right))]
    >>> torch.allclose(shared_sq_norms(parts, W.shape, torch.float64), dense.square().sum().double())
    True
    """
    for layout, factors in parts:
        if factors.kind is not layout.kind or (layout is WeightLayout.ROWS_LEFT and factors.left.shape[1] != 1):
            raise ConfigError(f"shared_sq_norms: a ghost norm declared with layout {layout.name} gave "
                              f"{factors.kind.name} factors of shapes {tuple(factors.left.shape)} and "
                              f"{tuple(factors.right.shape)}")
    # the products' rows in one dtype, not widened: their Grams are float64 whatever the rows'
    # dtype (sq_norms), and a tied LM head's rows in float64 would be an (N, T, V) copy
    dot_parts = [(layout, factors) for layout, factors in parts if factors.kind is FactorKind.DOT]
    common = functools.reduce(torch.promote_types, (t.dtype for _, f in dot_parts for t in (f.left, f.right)),
                              torch.float32)
    products = [_rows_on_right(layout, factors, common) for layout, factors in dot_parts]
    tables = [factors for _, factors in parts if factors.kind is not FactorKind.DOT]
    product = _concat_products(products, math.prod(shape)) if products else None
    table = _concat_tables(tables) if tables else None
    if (products and product is None) or (product is not None and table is not None
                                          and not _meets_table(product, table, shape)):
        dense = functools.reduce(torch.add, (_dense(layout, factors, shape, dtype) for layout, factors in parts))
        return dense.flatten(1).square().sum(1)  # (N,)
    terms = [f.sq_norms(dtype) for f in (product, table) if f is not None]
    if product is not None and table is not None:
        terms.append(2 * _product_table_dot(product, table, dtype))
    return functools.reduce(torch.add, terms).clamp_min(0)


def _rows_on_right(layout: WeightLayout, factors: GhostFactors, dtype: torch.dtype) -> GhostFactors:
    """DOT factors as ``ROWS_RIGHT`` ones in ``dtype``: a ``ROWS_LEFT`` product (one group)
    swaps them, ``left^T @ right`` being ``right'^T @ left'`` with ``right' = left``."""
    left, right = factors.left.to(dtype), factors.right.to(dtype)
    return GhostFactors.dot(left, right) if layout is WeightLayout.ROWS_RIGHT else GhostFactors.dot(right, left)


def _concat_products(products: Sequence[GhostFactors], numel: int) -> GhostFactors | None:
    """One DOT over the owners' rows, or None when their groups or sizes differ (their rows lie
    differently in the weight)."""
    sizes = {(p.left.shape[1], p.right.shape[-1], p.left.shape[-1]) for p in products}  # (G, O, I)
    if len(sizes) != 1 or math.prod(next(iter(sizes))) != numel:
        return None
    return GhostFactors.concat(products)


def _concat_tables(tables: Sequence[GhostFactors]) -> GhostFactors:
    """The owners' table factors as one: INDEX along T, or all as KEYED entries."""
    if all(t.kind is FactorKind.INDEX for t in tables):
        return GhostFactors.concat(tables)
    return GhostFactors.concat([_as_keyed(t) for t in tables])


def _as_keyed(table: GhostFactors) -> GhostFactors:
    """INDEX factors ``(N, T)``, ``(N, T, d)`` as KEYED entries, one per (sample, position)."""
    if table.kind is FactorKind.KEYED:
        return table
    samples, positions = table.left.shape
    sample = torch.arange(samples, device=table.left.device).repeat_interleave(positions)  # (N*T,)
    return GhostFactors.keyed(sample, table.left.reshape(-1), table.right.reshape(samples * positions, -1), samples)


def _meets_table(product: GhostFactors, table: GhostFactors, shape: Sequence[int]) -> bool:
    """Whether a product's rows are the table's: one group, ``(V, d)`` both, INDEX entries."""
    return (table.kind is FactorKind.INDEX and len(shape) == 2 and product.left.shape[1] == 1
            and product.right.shape[-1] == shape[0] and product.left.shape[-1] == shape[1] == table.right.shape[-1])


def _product_table_dot(product: GhostFactors, table: GhostFactors, dtype: torch.dtype) -> torch.Tensor:
    """``(N,)``: ``<R_n^T L_n, table_n> = sum_{s,t} R_n[t, tok_s] (L_n[t] . r_s)`` per sample.

    >>> R, L = torch.randn(2, 1, 4, 5), torch.randn(2, 1, 4, 3)  # W (5, 3) = R^T L
    >>> tokens, rows = torch.tensor([[0, 4], [2, 2]]), torch.randn(2, 2, 3)
    >>> tables = torch.zeros(2 * 5, 3).index_add(0, (torch.arange(2)[:, None] * 5 + tokens).flatten(),
    ...                                           rows.flatten(0, 1)).view(2, 5, 3)
    >>> expected = ((R[:, 0].transpose(1, 2) @ L[:, 0]) * tables).sum((1, 2))
    >>> torch.allclose(_product_table_dot(GhostFactors.dot(L, R), GhostFactors.index(tokens, rows),
    ...                                   torch.float32), expected, atol=1e-5)
    True
    """
    right, left = product.right[:, 0], product.left[:, 0].to(dtype)  # (N, T, V), (N, T, d)
    rows = table.right.to(dtype)  # (N, S, d)
    tokens = table.left.unsqueeze(1).expand(-1, right.shape[1], -1)  # (N, T, S)
    at_tokens = right.gather(2, tokens).to(dtype)  # (N, T, S): R[t, tok_s] (gathered, then widened)
    return (at_tokens * (left @ rows.transpose(1, 2))).sum((1, 2))  # (N,)


def _dense(layout: WeightLayout, factors: GhostFactors, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The ``(N, *shape)`` per-sample gradients the factors describe (the fallback of
    :func:`shared_sq_norms` for owners whose factors do not line up)."""
    right = factors.right.to(dtype)
    if layout is WeightLayout.ROWS_RIGHT:
        grads = torch.einsum("ngto,ngti->ngoi", right, factors.left.to(dtype))  # (N, G, O, I)
        return grads.reshape(grads.shape[0], *shape)
    if layout is WeightLayout.ROWS_LEFT:
        grads = torch.einsum("nti,nto->nio", factors.left[:, 0].to(dtype), right[:, 0])  # (N, I, O), one group
        return grads.reshape(grads.shape[0], *shape)
    keyed = _as_keyed(factors)
    samples, rows = keyed.samples, shape[0]
    flat = right.new_zeros(samples * rows, right.shape[-1]).index_add_(
        0, keyed.left[0] * rows + keyed.left[1], keyed.entries().to(dtype))  # (N*V, d)
    return flat.view(samples, *shape)


#: ``factors(layer, activation, backprop, K) -> (GhostFactors, {other parameter: (N, *shape)})``.
FactorFn = Callable[..., tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]]
#: ``weight_sum(layer, activation, backprop) -> weight-shaped tensor`` (summed over the rows).
WeightSumFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``positions(layer, activation, output, batch_dim) -> int | None``.
PositionsFn = Callable[[Any, torch.Tensor, Any, int], int | None]
#: ``is_cheaper(layer, positions) -> bool`` with ``positions = K * sum over calls``.
CostRule = Callable[[Any, int], bool]
#: ``choose(layer, activation, backprop, K) -> bool | None``: Gram factors (True) or the
#: materialised gradient (False) for one call's tensors; None defers to the cost rule.
ChooseFn = Callable[[Any, torch.Tensor, torch.Tensor, int], bool | None]

_Factors = TypeVar("_Factors", bound=FactorFn)


@dataclass(frozen=True)
class GhostNormEntry:
    """A registered ghost norm (the pieces of :func:`register_ghost_norm`)."""

    fn: FactorFn
    layer_type: type[nn.Module]
    #: None for a lookup table (its clipped sum comes from its factors: :attr:`sums_from_factors`).
    weight_sum: WeightSumFn | None
    positions: PositionsFn
    cost_rule: CostRule | None = None
    #: the attribute holding the parameter the factors describe.
    parameter: str = "weight"
    chooser: ChooseFn | None = None
    #: ``activation`` is the whole call (a :class:`~psg_core.backends.capture.LayerCall`: its
    #: args and kwargs), for layers whose rows are not their first input's (EmbeddingBag with
    #: offsets).
    whole_call: bool = False
    #: where the factors lie in the weight (None: a shared weight is materialised).
    layout: WeightLayout | None = None
    #: ``weight_sum`` is linear in each row of the activation as well as of the output gradient
    #: (a matrix product or a convolution of the two): the clipped sum may scale whichever of the
    #: two is smaller by the rows' clipping factors.
    linear_in_input: bool = False

    @property
    def sums_from_factors(self) -> bool:
        """A lookup table (layout ``TABLE`` or ``KEYED_TABLE``): its clipped sum comes from the
        factors of its norm, not from a ``weight_sum``."""
        return self.layout in _TABLE_LAYOUTS

    def weight(self, layer: nn.Module) -> torch.Tensor | None:
        """The parameter whose norm the factors give (None if the layer has none)."""
        value = getattr(layer, self.parameter, None)
        return value if isinstance(value, torch.Tensor) else None

    def is_cheaper(self, layer: nn.Module, positions: int) -> bool:
        """Whether the Gram pair (``2 * T^2`` numbers per group) costs less than the
        materialised per-sample weight (``weight.numel()`` per sample)."""
        if self.cost_rule is not None:
            return self.cost_rule(layer, positions)
        weight = self.weight(layer)
        return weight is not None and 2 * positions * positions <= weight.numel()

    def choose(self, layer: nn.Module, activation: torch.Tensor, backprop: torch.Tensor, K: int) -> bool | None:
        """Gram factors (True) or the materialised gradient (False) for a layer called once with
        these batch-first tensors; None when the family has no such choice (ask
        :meth:`is_cheaper`)."""
        return None if self.chooser is None else self.chooser(layer, activation, backprop, K)


class GhostNormRegistry(LayerTypeRegistry[GhostNormEntry]):
    """Maps layer types to ghost norms; lookup walks the class MRO (a subclass that overrides
    ``forward`` inherits none), and a type may be registered by its dotted name."""

    def __init__(self) -> None:
        super().__init__(what="ghost norm", decorator="register_ghost_norm")

    def register(self, *layer_types: LayerKey, weight_sum: WeightSumFn | None = None, positions: PositionsFn,
                 is_cheaper: CostRule | None = None, parameter: str = "weight",
                 replace: bool = False, choose: ChooseFn | None = None,
                 whole_call: bool = False, layout: WeightLayout | None = None,
                 linear_in_input: bool = False) -> Callable[[_Factors], _Factors]:
        """Decorator registering a factor function; see :func:`register_ghost_norm`."""
        self.check_keys(layer_types)
        if not callable(positions):
            raise ConfigError(f"register_ghost_norm: positions must be callable, got {positions!r}")
        if not callable(weight_sum) and not (weight_sum is None and layout in _TABLE_LAYOUTS):
            raise ConfigError(f"register_ghost_norm: weight_sum must be callable (only a lookup table, layout "
                              f"TABLE or KEYED_TABLE, may leave it out), got {weight_sum!r}")
        for name, optional in (("is_cheaper", is_cheaper), ("choose", choose)):
            if optional is not None and not callable(optional):
                raise ConfigError(f"register_ghost_norm: {name} must be callable or None, got {optional!r}")
        if not (isinstance(parameter, str) and parameter.isidentifier()):
            raise ConfigError(f"register_ghost_norm: parameter must be an attribute name, got {parameter!r}")
        if layout is not None and not isinstance(layout, WeightLayout):
            raise ConfigError(f"register_ghost_norm: layout must be a WeightLayout or None, got {layout!r}")
        if linear_in_input and (whole_call or weight_sum is None):
            raise ConfigError("register_ghost_norm: linear_in_input needs a weight_sum over the first input "
                              "(not whole_call, not a lookup table)")

        def decorator(fn: _Factors) -> _Factors:
            self.add(layer_types, lambda layer_type: GhostNormEntry(
                fn, layer_type, weight_sum=weight_sum, positions=positions, cost_rule=is_cheaper,
                parameter=parameter, chooser=choose, whole_call=whole_call, layout=layout,
                linear_in_input=bool(linear_in_input)), replace=replace)
            return fn

        return decorator


#: The process-wide registry the ghost backend asks.
GHOST_NORMS = GhostNormRegistry()


def register_ghost_norm(*layer_types: LayerKey, weight_sum: WeightSumFn | None = None, positions: PositionsFn,
                        is_cheaper: CostRule | None = None, parameter: str = "weight",
                        replace: bool = False, choose: ChooseFn | None = None,
                        whole_call: bool = False, layout: WeightLayout | None = None,
                        linear_in_input: bool = False) -> Callable[[_Factors], _Factors]:
    """Registers how the ghost backend gets per-sample norms of ``layer_types``' weight.

    The decorated function is ``factors(layer, activation, backprop, K)``: from the layer's
    first input and its output gradient (batch-first, ``N*K`` rows) it returns the
    :class:`GhostFactors` of each sample's weight gradient (summed over its K rows) and a dict of
    ``(N, *shape)`` per-sample gradients of the layer's other trainable parameters. A layer
    without a ghost norm (or one where the Gram matrices would be larger) gets its per-sample
    gradients materialised through its grad sampler instead.

    Args:
        layer_types: ``nn.Module`` subclasses, or dotted names ``"package.module.Class"``.
        weight_sum: ``(layer, activation, backprop) -> weight.shape``, the weight gradient
            summed over all rows (``backprop`` arrives scaled by each row's clipping factor,
            or, with ``linear_in_input``, whichever of the two is smaller).
            A lookup table (``layout`` ``TABLE`` or ``KEYED_TABLE``) leaves it out: its clipped
            sum comes from its factors, each entry's row scaled and added into its table row.
        positions: ``(layer, activation, output, batch_dim) -> int | None``, the factor rows T
            one input row contributes (None: no ghost norm for this call).
        is_cheaper: ``(layer, positions) -> bool``; default ``2 * positions**2 <= weight.numel()``.
        parameter: the attribute holding the weight the factors describe.
        replace: override an existing registration instead of raising :class:`ConfigError`.
        choose: ``(layer, activation, backprop, K) -> bool | None``, asked instead of
            ``is_cheaper`` when the layer is called once per pass, with that call's tensors
            (None: ask ``is_cheaper``).
        whole_call: ``factors``, ``weight_sum`` and ``choose`` get the whole call (a
            :class:`~psg_core.backends.capture.LayerCall`: ``.args``, ``.kwargs``) in place of the
            first input, and the layer may count its rows itself (EmbeddingBag with offsets).
        layout: where the factors lie in the weight (:class:`WeightLayout`); with it, a weight
            this layer shares with other modules that declare theirs keeps its ghost norm
            (:func:`shared_sq_norms`), without it that weight's per-sample gradient is
            materialised.
        linear_in_input: ``weight_sum`` is linear in each row of ``activation`` too (a matrix
            product, a convolution): the clipped sum then scales the smaller of the activation
            and the output gradient by the rows' clipping factors (a normalisation layer, whose
            gradient normalises its input, must leave it False).

    A layer ``y = x @ W`` (weight ``(d_in, d_out)``), with its grad sampler and its ghost norm:

    >>> import psg_core
    >>> class RightMatmul(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.randn(6, 4))
    ...     def forward(self, x):
    ...         return x @ self.weight
    >>> @psg_core.register_grad_sampler(RightMatmul, k_aware=True)
    ... def right_matmul_grad_sample(layer, activations, backprops, K):
    ...     x, g = activations[0], backprops  # (N*K, d_in), (N*K, d_out)
    ...     return {layer.weight: torch.einsum("nki,nko->nio", x.view(-1, K, 6), g.view(-1, K, 4))}
    >>> def right_matmul_sum(layer, x, g):
    ...     return x.T @ g  # (d_in, d_out)
    >>> def right_matmul_positions(layer, x, output, batch_dim):
    ...     return 1  # one factor row per input row
    >>> @psg_core.register_ghost_norm(RightMatmul, weight_sum=right_matmul_sum,
    ...                               positions=right_matmul_positions)
    ... def right_matmul_factors(layer, x, g, K):
    ...     n = x.shape[0] // K
    ...     return GhostFactors.dot(x.view(n, 1, K, 6), g.view(n, 1, K, 4)), {}
    >>> model = nn.Sequential(RightMatmul(), nn.Tanh())
    >>> config = psg_core.DPConfig(mode="ghost", augmentation_multiplicity=2, max_grad_norm=1e6)
    >>> x, y = torch.randn(8, 6), torch.randn(8, 4)
    >>> ghost = psg_core.dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=config)
    >>> hooks = psg_core.per_sample_gradients(model, x, y, loss_fn=nn.MSELoss(), augmentation_multiplicity=2)
    >>> torch.allclose(ghost.per_sample_norms, hooks["0.weight"].flatten(1).norm(dim=1), atol=1e-6)
    True
    >>> GHOST_NORMS.unregister(RightMatmul); psg_core.GRAD_SAMPLERS.unregister(RightMatmul)
    """
    return GHOST_NORMS.register(*layer_types, weight_sum=weight_sum, positions=positions,
                                is_cheaper=is_cheaper, parameter=parameter, replace=replace, choose=choose,
                                whole_call=whole_call, layout=layout, linear_in_input=linear_in_input)
