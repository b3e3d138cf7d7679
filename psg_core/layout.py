"""The batch layout of one call: validated once at the public entry points, then passed down.

A batch has ``N*K`` rows, sample-major (rows ``n*K .. n*K+K-1`` are the K augmented copies of
sample n), on the batch dimension of its batch tensors (0, or 1 when ``batch_first=False``).
:class:`BatchLayout` holds those numbers; :class:`ModelInputs` holds the model's arguments (a
tensor, a sequence of positional tensors or a mapping of named ones) and says which of them carry
the batch, from what the caller passed: the rows are counted on the targets (on their own shape)
or, without targets, on the first batch tensor; a ``PackedSequence`` counts its sequences.

An input tensor with the batch's rows on the batch dimension is a batch tensor. One that holds no
samples but has that many rows by coincidence (a ``(T, T)`` bias matrix when T equals N*K) is
declared with :func:`batch_free`, and is then never split or followed as the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten

from psg_core.errors import BatchLayoutError, ConfigError

__all__ = ["BatchFree", "BatchLayout", "ModelInputs", "batch_free", "fold_rows", "check_multiplicity"]


@dataclass(frozen=True)
class BatchFree:
    """An input tensor declared batch-free (see :func:`batch_free`)."""

    tensor: torch.Tensor


def batch_free(tensor: torch.Tensor) -> BatchFree:
    """Declares a model input that holds no samples: every sample sees the whole tensor, whatever
    its size on the batch dimension (without it, an input with N*K rows there is a batch tensor).

    Pass it among the inputs of :func:`psg_core.per_sample_gradients`, :func:`psg_core.dp_gradient`,
    :class:`psg_core.DPStep`, :func:`psg_core.split_batch` or a wrapped model's forward; the model
    receives the tensor itself.

    >>> bias = torch.zeros(4, 4)  # a (T, T) matrix, T equal to the batch's 4 rows
    >>> inputs = ModelInputs.parse((torch.zeros(4, 4, 8), batch_free(bias)), where="demo")
    >>> inputs.args[1] is bias, [tuple(t.shape) for t, _ in inputs.batch_tensors(
    ...     BatchLayout(rows=4, augmentation_multiplicity=1, batch_dim=0))]
    (True, [(4, 4, 8)])
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"batch_free: expected a tensor, got {type(tensor).__name__}")
    return BatchFree(tensor)


def _unwrap(value: Any, free: set[int]) -> Any:
    """``value`` with every :class:`BatchFree` replaced by its tensor (whose id goes into ``free``);
    containers without one are returned as they are."""
    if isinstance(value, BatchFree):
        free.add(id(value.tensor))
        return value.tensor
    if isinstance(value, (torch.Tensor, PackedSequence)):
        return value
    if isinstance(value, Mapping):
        items = {key: _unwrap(item, free) for key, item in value.items()}
        return value if all(items[k] is value[k] for k in items) else items
    if isinstance(value, (tuple, list)):
        unwrapped = [_unwrap(item, free) for item in value]
        if all(a is b for a, b in zip(unwrapped, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*unwrapped)
        return type(value)(unwrapped)
    return value


def unwrap_batch_free(args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any], frozenset[int]]:
    """A call's arguments with the :class:`BatchFree` declarations replaced by their tensors, and
    the ids of those tensors."""
    free: set[int] = set()
    return tuple(_unwrap(a, free) for a in args), {k: _unwrap(v, free) for k, v in kwargs.items()}, frozenset(free)


def check_multiplicity(augmentation_multiplicity: Any, *, where: str) -> int:
    """``augmentation_multiplicity`` as an int >= 1, or :class:`ConfigError` naming ``where``."""
    K = augmentation_multiplicity
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ConfigError(f"{where}: augmentation_multiplicity must be an int >= 1, got {K!r}")
    return K


def fold_rows(tensor: torch.Tensor, augmentation_multiplicity: int) -> torch.Tensor:
    """Views ``(N*K, ...)`` as ``(N, K, ...)`` (rows are sample-major). No copy.

    >>> fold_rows(torch.zeros(6, 5), 3).shape
    torch.Size([2, 3, 5])
    """
    rows = tensor.shape[0]
    return tensor.reshape(rows // augmentation_multiplicity, augmentation_multiplicity, *tensor.shape[1:])


@dataclass(frozen=True)
class BatchLayout:
    """Rows, K and batch dimension of one batch.

    >>> layout = BatchLayout.of(rows=6, augmentation_multiplicity=2, batch_first=True, where="demo")
    >>> layout.num_samples, layout.batch_dim
    (3, 0)
    """

    rows: int
    augmentation_multiplicity: int
    batch_dim: int

    @property
    def num_samples(self) -> int:
        """N: rows / K."""
        return self.rows // self.augmentation_multiplicity

    @property
    def K(self) -> int:  # noqa: N802  (the paper's name)
        return self.augmentation_multiplicity

    @classmethod
    def of(cls, *, rows: int, augmentation_multiplicity: int, batch_first: bool, where: str) -> BatchLayout:
        """Checks that K divides the rows (:class:`BatchLayoutError` naming both numbers)."""
        K = check_multiplicity(augmentation_multiplicity, where=where)
        if rows % K:
            raise BatchLayoutError(
                f"{where}: the batch has {rows} rows, which is not divisible by "
                f"augmentation_multiplicity K={K}; each sample must arrive as exactly K consecutive rows")
        return cls(rows=rows, augmentation_multiplicity=K, batch_dim=0 if batch_first else 1)

    @classmethod
    def of_call(cls, inputs: ModelInputs, targets: Any, *, augmentation_multiplicity: int,
                batch_first: bool, where: str) -> BatchLayout:
        """The layout of a functional call: rows counted on the targets (their own shape), else on
        the first batch tensor of the inputs; at least one input must carry them."""
        K = check_multiplicity(augmentation_multiplicity, where=where)
        batch_dim = 0 if batch_first else 1
        if isinstance(targets, torch.Tensor) and targets.dim() > 0:
            rows = int(targets.shape[batch_dim if targets.dim() > batch_dim else 0])
        else:
            first = inputs.first_rows(batch_dim)
            if first is None:
                raise ConfigError(f"{where}: inputs must hold a tensor with a batch dimension {batch_dim}")
            rows = first
        layout = cls.of(rows=rows, augmentation_multiplicity=K, batch_first=batch_first, where=where)
        if rows and not inputs.batch_tensors(layout):
            shapes = [tuple(t.shape) for t in inputs.leaves() if isinstance(t, torch.Tensor)]
            raise BatchLayoutError(
                f"{where}: the targets have {rows} rows (N*K) but no input tensor has {rows} rows on the "
                f"batch dimension {batch_dim} (input shapes {shapes}); inputs and targets must hold the "
                "same rows")
        return layout

    def target_dim(self, targets: torch.Tensor) -> int:
        """The batch dimension of ``targets``, from their own shape: the layout's when they have
        it, else 0 (e.g. ``(N*K,)`` class labels of a time-major model's last step)."""
        return self.batch_dim if targets.dim() > self.batch_dim else 0

    def fold(self, tensor: torch.Tensor, batch_dim: int | None = None) -> torch.Tensor:
        """``(N, K, ...)`` view of a batched tensor, its batch axis moved first."""
        dim = self.batch_dim if batch_dim is None else batch_dim
        return fold_rows(tensor.movedim(dim, 0), self.augmentation_multiplicity)


def _leaves(value: Any, out: list[Any]) -> list[Any]:
    """``tree_flatten(value)[0]``, with plain lists, tuples and dicts walked here: torch's flatten
    makes a reference cycle per call (a nested recursive helper), which would hold the batch's
    tensors until the garbage collector ran. Other containers (named tuples, registered pytree
    nodes) go to torch's.

    >>> _leaves([(1, {"a": 2}), [3]], [])
    [1, 2, 3]
    """
    kind = type(value)
    if kind is list or kind is tuple:
        for item in value:
            _leaves(item, out)
    elif kind is dict:
        for item in value.values():
            _leaves(item, out)
    elif isinstance(value, torch.Tensor) or value is None or kind in (int, float, bool, str):
        out.append(value)
    else:
        out.extend(tree_flatten(value)[0])
    return out


def _visit_batch_tensors(value: Any, layout: BatchLayout, free: Any, found: list[tuple[torch.Tensor, int]],
                         offsets: list[tuple[int, torch.Tensor]], indices: list[torch.Tensor]) -> None:
    """:meth:`ModelInputs.batch_tensors`' walk of one argument (``free``: ids of batch-free tensors;
    ``offsets``: where in ``found`` a tensor shaped as a bag's offsets with the last one would go,
    and the tensor; ``indices``: the integer tensors met, which such offsets must index)."""
    if isinstance(value, PackedSequence):
        if _rows_of(value, 0) == layout.rows:
            found.append((value.data, -1))
        return
    if isinstance(value, (tuple, list)):
        for item in value:
            _visit_batch_tensors(item, layout, free, found, offsets, indices)
        return
    if isinstance(value, Mapping):
        for item in value.values():
            _visit_batch_tensors(item, layout, free, found, offsets, indices)
        return
    if isinstance(value, torch.Tensor):
        if id(value) in free:
            return
        if not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
            indices.append(value)
        dim = layout.batch_dim if value.dim() > layout.batch_dim else 0
        if value.dim() > dim and value.shape[dim] == layout.rows:
            found.append((value, dim))
        elif value.dim() == 1 and value.shape[0] == layout.rows + 1:
            offsets.append((len(found), value))


def _rows_of(value: Any, batch_dim: int) -> int | None:
    if isinstance(value, PackedSequence):
        return int(value.batch_sizes[0]) if value.batch_sizes.numel() else 0
    if isinstance(value, torch.Tensor) and value.dim() > batch_dim:
        return int(value.shape[batch_dim])
    return None


def _bag_offsets_with_last(value: torch.Tensor, rows: int, indices: list[torch.Tensor]) -> bool:
    """An EmbeddingBag's offsets with ``include_last_offset=True`` for ``rows`` bags: 1-D integers,
    ``rows + 1`` of them, starting at 0, non-decreasing and ending at the size of one of the other
    integer inputs, the indices they cut into bags (checked by value: ``arange(rows + 1)`` position
    ids beside ``(rows, T)`` tokens are no offsets)."""
    if value.dim() != 1 or value.shape[0] != rows + 1 or value.is_floating_point() or value.dtype == torch.bool:
        return False
    sizes = {t.numel() for t in indices if t is not value}
    return bool(sizes) and bool(value[0] == 0) and bool((value[1:] >= value[:-1]).all()) \
        and int(value[-1]) in sizes


@dataclass(frozen=True)
class ModelInputs:
    """The model's arguments: ``module(*args, **kwargs)``.

    >>> ModelInputs.parse({"input_ids": torch.zeros(2, 3)}, where="demo").kwargs.keys()
    dict_keys(['input_ids'])
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: ids of the tensors declared with :func:`batch_free` (never batch tensors, whatever their size).
    free: frozenset[int] = field(default=frozenset())

    @classmethod
    def parse(cls, inputs: Any, *, where: str) -> ModelInputs:
        """A tensor is one positional argument; a tuple or list are positional arguments; a
        mapping (str keys) holds keyword arguments (``input_ids``, ``attention_mask``, ...).
        Tensors declared with :func:`batch_free` are passed as themselves."""
        if isinstance(inputs, ModelInputs):
            return inputs
        if isinstance(inputs, Mapping):
            if not all(isinstance(k, str) for k in inputs):
                raise ConfigError(f"{where}: a mapping of inputs must have str keys (argument names)")
            args: tuple[Any, ...] = ()
            kwargs = dict(inputs)
        elif isinstance(inputs, (tuple, list)) and not isinstance(inputs, PackedSequence):
            args, kwargs = tuple(inputs), {}
        else:
            args, kwargs = (inputs,), {}
        args, kwargs, free = unwrap_batch_free(args, kwargs)
        return cls(args, kwargs, free)

    @classmethod
    def of_call(cls, args: tuple[Any, ...], kwargs: dict[str, Any], free: frozenset[int] = frozenset()
                ) -> ModelInputs:
        """A forward call's arguments as given (the :class:`BatchFree` ones already unwrapped into
        the ids ``free``)."""
        return cls(tuple(args), dict(kwargs), free)

    def leaves(self) -> list[Any]:
        return _leaves([self.args, self.kwargs], [])

    def first_rows(self, batch_dim: int) -> int | None:
        """Rows of the first batch tensor (a PackedSequence counts its sequences; batch-free
        tensors are skipped)."""
        for value in list(self.args) + list(self.kwargs.values()):
            if isinstance(value, PackedSequence):
                return _rows_of(value, batch_dim)
            for leaf in _leaves(value, []):
                if id(leaf) in self.free:
                    continue
                rows = _rows_of(leaf, batch_dim)
                if rows is not None:
                    return rows
        return None

    def batch_tensors(self, layout: BatchLayout) -> list[tuple[torch.Tensor, int]]:
        """The tensors that carry the batch and their batch axis: those with the batch's rows on
        the batch dimension (1-D ones on dimension 0); a PackedSequence whose sequences are the
        batch, and an EmbeddingBag's offsets with the last offset included (their axis is then
        not a plain dimension of rows: -1)."""
        found: list[tuple[torch.Tensor, int]] = []
        # (a module-level walk: a nested recursive function would be a reference cycle holding the
        # batch's tensors until the garbage collector ran)
        offsets: list[tuple[int, torch.Tensor]] = []
        indices: list[torch.Tensor] = []
        _visit_batch_tensors(list(self.args), layout, self.free, found, offsets, indices)
        _visit_batch_tensors(self.kwargs, layout, self.free, found, offsets, indices)
        for at, value in reversed(offsets):  # (from the last: the positions before stay valid)
            if _bag_offsets_with_last(value, layout.rows, indices):
                found.insert(at, (value, -1))  # one offset per bag, plus the end: not an axis of rows
        return found

    def split(self, layout: BatchLayout) -> list[ModelInputs]:
        """Per-sample microbatches of K rows each (for tests and oracles)."""
        marked = {id(t): d for t, d in self.batch_tensors(layout)}
        out = []
        K = layout.augmentation_multiplicity
        for n in range(layout.num_samples):
            def take(value: Any) -> Any:
                d = marked.get(id(value))
                if isinstance(value, torch.Tensor) and d is not None and d >= 0:
                    return value.narrow(d, n * K, K)
                return value
            out.append(ModelInputs(tuple(take(a) for a in self.args),
                                   {k: take(v) for k, v in self.kwargs.items()}, self.free))
        return out
