"""A DP step recorded once and replayed: :func:`~psg_core.dp_gradient` without psg's per-step Python.

An eager :func:`~psg_core.dp_gradient` runs a lot of Python around the model's own ops: the batch
tracker follows every torch function of the forward pass, hooks capture each layer's call, the
ghost book-keeping builds its norms and sums layer by layer. On a model whose kernels are small (a
GPU's step, a CPU's small layers) that Python is most of the step. :class:`CapturedStep` runs the
step eagerly once, then records a second batch's step into a graph of torch's operators
(``torch.fx``, real tensors: all of psg's checks and decisions run while it records), checks the
graph against an eager step on a third batch, and from then on replays the graph: the same
operators on the new batch, no tracker, no hooks, no book-keeping.

The contract is the one every recorded-graph runtime has (CUDA graphs, ``torch.compile``): for
batches of one signature (the inputs' structure, shapes, dtypes and devices, the parameters and
the modules' training flags, the configuration) the step must run the same operators whatever
the values. psg checks what it can, and runs the step eagerly where the check fails:

* psg's native CPU kernels (called through ctypes, which a graph would not see) are called as
  ``torch.ops.psg`` operators while recording, so that the graph holds them;
* a number read into Python while recording (``bool(t)``, ``.item()``, ``int(t)``,
  ``torch.equal``, a C++ composite's read) chose the recorded path, and a size set by values
  (``x[mask]``, ``nonzero``, ``unique``, a write through a mask) sized it: each becomes a *guard*,
  its tensor an output of the graph, and a replay where it reads otherwise is discarded (what the
  graph wrote in a module's buffer put back) and the batch computed eagerly (``stats["reruns"]``).
  Three discarded in a row record the signature again (the usual value changed: padded batches
  after unpadded ones); after three recordings it runs eagerly. transformers' attention masks
  (``if padding_mask.all():``) are such reads. Reads of many values (``.tolist()``, ``.numpy()``)
  and packed sequences refuse the recording. psg's own reads (how many were clipped, the loss sum)
  are deferred to the replay's outputs (:mod:`psg_core._host`); its clipping records the common
  path (no sample dropped for a non-finite gradient), and a replay whose batch drops one is
  discarded likewise;
* the graph is checked against the eager step on a different batch (same random draws): a
  mismatch refuses it;
* each replay first checks the batch is finite, as :func:`~psg_core.dp_gradient` does.

Batches of varying sizes (Poisson sampling) are each a signature of their own; with
``pad_to_multiple`` they are recorded and replayed padded to a multiple of that many samples, the
padding's loss zeroed (exactly nothing added to the sums, norms or counts), and the checked step
compares the padded graph with the eager step on the padded batch.

A refused signature runs eagerly from then on; :attr:`CapturedStep.refusals` says why. What psg
cannot see is Python state the forward reads besides the training flags (an attribute changed
between steps, a global): such a model must not be captured.

>>> from psg_core.config import DPConfig
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
>>> step = CapturedStep(model, loss_fn=nn.CrossEntropyLoss(), config=DPConfig(mode="ghost", max_grad_norm=1.0))
>>> for _ in range(4):
...     out = step(torch.randn(6, 4), torch.randint(0, 2, (6,)))
>>> step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 1, "refused": 0, "reruns": 0}
True
>>> out.num_samples, sorted(out.grads), out.per_sample_norms.shape
(6, ['0.bias', '0.weight', '2.bias', '2.weight'], torch.Size([6]))
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from psg_core._cuda_graph import CudaGraphReplay, obstacle
from psg_core._host import Deferred, Guard, guard_read, recording
from psg_core.config import DPConfig, DPGradient
from psg_core.dp import _check_finite, dp_gradient
from psg_core.errors import BatchLayoutError, ConfigError
from psg_core.modes import GradSampleMode
from psg_core.gemm import probe_host
from psg_core.accumulate import pad_batch
from psg_core.layout import ModelInputs
from psg_core.losses import LossFn, as_unreduced, loss_batch_dim
from psg_core.provenance import active_tracker
from psg_core.precision import fp16_autocast, no_autocast
from psg_core.support import exclusive

__all__ = ["CapturedStep"]

logger = logging.getLogger(__name__)

_WHERE = "CapturedStep"

#: Tensor methods that read values into Python (``tolist`` and ``numpy`` without an operator a graph
#: could see). A data pointer is an address, not a value (psg's memos key on it); the one way it
#: leads to values, a kernel called through ctypes, psg's own kernels take as ``torch.ops.psg``
#: operators while recording, and the check on another batch catches a model's own.
_HOST_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__})

#: Reads of one number, which a recording keeps as a guard (see psg_core._host.guard_read): the
#: graph outputs the tensor, and a replay where it reads otherwise is discarded for the eager step.
#: ``__bool__`` guards the truth value only (``if mask.any():``).
_SCALAR_READS = frozenset({torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                           torch.Tensor.__index__})

#: After this many replays in a row discarded by a value the step read, the signature is recorded
#: again (on the batch at hand: the reads' usual values may have changed, a padded batch after
#: unpadded ones) ...
_MISSES_BEFORE_RERECORDING = 3
#: ... and after this many recordings of one signature it runs eagerly (its reads change too often).
_MAX_RECORDINGS = 3


#: One recording at a time in the process: torch.fx patches ``torch.nn.Module.__call__`` (and the
#: modules' globals) process-wide while it traces, and two tracers' patches at once undo each other
#: out of order (a recording fails). Other threads' eager steps and replays pass through the patches
#: unchanged (the tracer forwards calls that are not its own), so only recordings take this lock.
_RECORDING = threading.Lock()

#: Splits whose points may come as a tensor (sizes set by its values).
_SPLITS = frozenset({torch.tensor_split, torch.Tensor.tensor_split})


class _Refused(Exception):
    """The step cannot be recorded (the message says why)."""


def _read_guarded(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None, tensor: torch.Tensor, *,
                  truth: bool) -> Any:
    """``func(*args)``, a read of the one-element ``tensor``'s value, made on the real tensor (not
    recorded) and kept as a guard of the recording (the tensor, recorded, becomes an output)."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        value = func(*args, **(kwargs or {}))
    guard_read(tensor, value, truth=truth)
    return value


class _NoHostReads(TorchFunctionMode):
    """While a step is recorded: a read of one number into Python becomes a guard of the recording;
    other reads of tensor values refuse it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in _SCALAR_READS and args and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
            tensor = args[0]
            if func is torch.Tensor.__int__ and (tensor.is_floating_point() or tensor.is_complex()):
                tensor = tensor.real.trunc()  # (int() truncates: the guard compares what was read)
            return _read_guarded(func, args, kwargs, tensor, truth=func is torch.Tensor.__bool__)
        if func in _HOST_READS:
            raise _Refused(f"the step reads a tensor's values into Python ({getattr(func, '__name__', func)}), "
                           "which a recorded graph would replay as the recording batch's values")
        if func in _SPLITS and len(args) > 1 and isinstance(args[1], torch.Tensor):
            # (composite: it reads the split points in C++, no operator the dispatch guard sees)
            raise _Refused("the step splits a tensor at points given as a tensor: sizes set by values")
        return func(*args, **(kwargs or {}))


#: Operators whose result's size depends on values: recorded with a guard on that size (a replay
#: where it differs is discarded; its operators after that one would run on the recording's sizes).
_SIZE_GUARDED = frozenset({"aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
                           "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
                           "aten::bincount"})

#: Refused: a PackedSequence's data holds sum(lengths) rows and its batch sizes drive psg's native
#: recurrent loops, which must never run on buffers sized for another batch.
_REFUSED = frozenset({"aten::_pack_padded_sequence"})


def _size_guarded(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether an operator's result has a size set by values (guarded by it)."""
    name = func._schema.name
    if name in _SIZE_GUARDED:
        return True
    if name == "aten::repeat_interleave" and args and isinstance(args[0], torch.Tensor) and len(args) == 1:
        return True  # repeats given as a tensor
    if name == "aten::index" and len(args) > 1:  # a boolean mask selects
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return False


class _NoValueShapes(TorchDispatchMode):
    """While a step is recorded: operators that read one value on the host (from C++: a composite's
    ``.item()``, ``torch.equal``) keep it as a guard, and so do those whose result's size depends on
    values (a guard on the size: ``x[mask]``, ``nonzero``, ``unique``); a packed sequence refuses the
    recording."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = func._schema.name
        if name in ("aten::_local_scalar_dense", "aten::is_nonzero"):
            return _read_guarded(func, args, kwargs, args[0], truth=name == "aten::is_nonzero")
        if name == "aten::equal":
            a, b = args[0], args[1]
            if a.shape != b.shape:  # (shapes are fixed per signature: no guard needed)
                return False
            return _read_guarded(func, args, kwargs, torch.eq(a, b).all(), truth=True)
        if name in _REFUSED:
            raise _Refused(f"the step runs {name}, whose result's size depends on the batch's values and "
                           "sets the loops of psg's recurrent kernels")
        out = func(*args, **(kwargs or {}))
        if _size_guarded(func, args):
            first = out[0] if isinstance(out, (tuple, list)) else out
            # the size, as a tensor the graph computes from the result (a replay's own size)
            guard_read(torch.ones_like(first, dtype=torch.int64).sum(), first.numel(), truth=False)
        elif name in ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_") and len(args) > 1:
            for mask in args[1]:  # a write through a mask: the values must match its count
                if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
                    with _disable_current_modes(), torch._C.DisableTorchFunction():
                        count = int(mask.sum())
                    guard_read(mask.sum(dtype=torch.int64), count, truth=False)
        return out


@dataclass
class _Entry:
    """What is known of one batch signature."""

    graph: Any = None  # the recorded torch.fx.GraphModule
    #: where the batch's tensors are among its leaves (the graph's inputs; the others are baked in)
    positions: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    num_samples: int = 0
    #: DPGradient's counts and loss sum: the index of their deferred tensor in the graph's
    #: numbers output, or their constant value
    numbers: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    #: conditions on the numbers output for a replay to stand (see _host.expect_zero, guard_read)
    guards: tuple[Guard, ...] = ()
    #: the graph's constants it writes in place (a module's buffer), by attribute: restored when a
    #: replay is discarded, before its batch is computed eagerly
    mutated: tuple[str, ...] = ()
    validated: bool = False
    refused: str | None = None
    recordings: int = 0
    #: replays in a row discarded by a value the step read (see _MISSES_BEFORE_RERECORDING)
    misses: int = 0
    #: the graph captured as a CUDA graph (``cuda_graphs=True``), once checked; tried once per graph
    cuda: CudaGraphReplay | None = None
    cuda_tried: bool = False
    #: the CUDA devices whose random generators the step may draw from (its batch's and parameters')
    devices: list[int] = field(default_factory=list)

    def drop_graph(self) -> None:
        """Forgets the recorded graph (and its CUDA graph): refused, or to be recorded again."""
        self.graph, self.cuda, self.cuda_tried = None, None, False


def _leaf_signature(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", type(leaf), tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.layout,
                leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        raise _Refused(f"a batch input of type {type(leaf).__name__} is not hashable, so batches cannot be told "
                       "apart by signature") from None
    return ("value", type(leaf), leaf)


class CapturedStep:
    """:func:`~psg_core.dp_gradient` of ``module`` with ``loss_fn`` and ``config``, recorded per batch
    signature and replayed (see the module docstring).

    Args:
        module: the model (its parameters may be updated in place between calls, as optimizers
            do; a parameter or buffer replaced by another tensor makes a new signature).
        loss_fn: as for :func:`~psg_core.dp_gradient`.
        config: as for :func:`~psg_core.dp_gradient`.
        max_signatures: how many batch signatures are remembered (least recently used dropped):
            each one costs an eager step, a recording and a checked step before it replays, so
            batches should come in a few fixed shapes (a loader with ``drop_last``, padded
            sequences).
        validate: check each graph against an eager step before replaying it (default; turning it
            off trusts the recording).
        pad_to_multiple: record and replay each batch padded to a multiple of this many samples
            (:func:`psg_core.accumulate.pad_batch`: copies of its first sample, whose loss is zeroed,
            so that they weigh nothing), so that batches of varying sizes (Poisson sampling) share a
            few signatures; the result is the batch's own (its samples' norms and counts). Not
            with ``mode="functorch"``, whose loss is computed sample by sample. None: no padding.
        cuda_graphs: on a CUDA device, replay each checked graph as one CUDA graph (its operators
            launched at once, not one by one from Python), after checking the capture against the
            operator-by-operator replay of a batch; a graph that reads values on the host (a
            boolean index, ``nonzero``) or computes on the CPU, or whose capture fails or differs,
            replays operator by operator (:attr:`cuda_graph_refusals` says why). Each captured
            signature holds its step's intermediate tensors in memory of its own. Ignored on a CPU.

    Calling it returns what :func:`~psg_core.dp_gradient` returns for the batch: a replay runs the
    same operators (psg's native CPU kernels, the recurrent cells' loops and the lookup tables', as
    ``torch.ops.psg`` operators).
    """

    def __init__(self, module: nn.Module, *, loss_fn: LossFn | nn.Module, config: DPConfig,
                 max_signatures: int = 16, validate: bool = True, pad_to_multiple: int | None = None,
                 cuda_graphs: bool = False) -> None:
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{_WHERE}: expected an nn.Module, got {type(module).__name__}")
        if not isinstance(config, DPConfig):
            raise ConfigError(f"{_WHERE}: config must be a DPConfig, got {type(config).__name__}")
        if not isinstance(max_signatures, int) or isinstance(max_signatures, bool) or max_signatures < 1:
            raise ConfigError(f"{_WHERE}: max_signatures must be a positive int, got {max_signatures!r}")
        if pad_to_multiple is not None and (not isinstance(pad_to_multiple, int) or isinstance(pad_to_multiple, bool)
                                            or pad_to_multiple < 1):
            raise ConfigError(f"{_WHERE}: pad_to_multiple must be a positive int or None, got {pad_to_multiple!r}")
        if pad_to_multiple is not None and config.mode is GradSampleMode.FUNCTORCH:
            raise ConfigError(f"{_WHERE}: pad_to_multiple zeroes the padding samples' loss, which mode='functorch' "
                              "computes sample by sample (under vmap); use mode 'ghost', 'hooks' or 'ew'")
        if not isinstance(cuda_graphs, bool):
            raise ConfigError(f"{_WHERE}: cuda_graphs must be a bool, got {cuda_graphs!r}")
        self.module, self.loss_fn, self.config = module, loss_fn, config
        self.cuda_graphs = cuda_graphs
        #: why signatures replay operator by operator although ``cuda_graphs`` is on, in order
        self.cuda_graph_refusals: list[str] = []
        #: replays that ran as CUDA graphs (each counted in ``stats`` too: replayed, or reruns where
        #: its guards discarded it)
        self.cuda_graph_replays = 0
        self.pad_to_multiple = pad_to_multiple
        self.max_signatures = max_signatures
        self.validate = bool(validate)
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        #: how many calls ran each way (``refused``: eager calls of refused signatures)
        #: (``reruns``: batches a replay did not hold for, a sample's gradient not being finite,
        #: computed eagerly instead)
        self.stats = {"eager": 0, "recorded": 0, "validated": 0, "replayed": 0, "refused": 0, "reruns": 0}
        #: how the latest call ran: the first of the ``stats`` names it counted in (a recording whose
        #: batch is then computed eagerly is ``"recorded"``); None before the first call
        self.last_path: str | None = None
        #: why signatures were refused, in order
        self.refusals: list[str] = []
        self._lock = threading.RLock()  # one call at a time (the signatures' states change per call)

    # ------------------------------------------------------------------------------ the call
    def __call__(self, inputs: Any, targets: torch.Tensor) -> DPGradient:
        with self._lock:
            return self._call(inputs, targets)

    def _call(self, inputs: Any, targets: torch.Tensor) -> DPGradient:
        self.last_path = None
        # the batch the graph takes: padded (with the mask of its real samples) when asked
        padded = None if self.pad_to_multiple is None else pad_batch(
            inputs, targets, multiple=self.pad_to_multiple, augmentation_multiplicity=self.config.augmentation_multiplicity,
            batch_first=self.config.batch_first)
        batch: tuple[Any, ...] = (inputs, targets) if padded is None else padded[:3]
        real = None if padded is None else padded[3]
        try:
            key, leaves, spec = self._signature(batch)
        except _Refused as refused:
            self._refuse(None, str(refused))
            self._count("refused")
            return self._eager(inputs, targets)
        entry = self._entries.get(key)
        if entry is None:
            result = self._eager(inputs, targets)  # raises as dp_gradient does; warms psg's decisions
            self._remember(key, _Entry())
            self._count("eager")
            return result
        self._entries.move_to_end(key)
        if entry.refused is not None:
            self._count("refused")
            return self._eager(inputs, targets)
        if entry.graph is None:
            return self._record(entry, inputs, targets, leaves, spec, real)
        self._check_finite(inputs, targets)
        if not entry.validated:
            return self._validate(entry, batch, leaves, real)
        if self.cuda_graphs and not entry.cuda_tried:
            replayed = self._replay_and_capture(entry, leaves, real)
        else:
            replayed = self._replay(entry, leaves, real)
        if replayed is None:
            self._count("reruns")
            return self._eager(inputs, targets)
        self._count("replayed")
        return replayed

    # ------------------------------------------------------------------------------ internals
    def _eager(self, inputs: Any, targets: torch.Tensor) -> DPGradient:
        return dp_gradient(self.module, inputs, targets, loss_fn=self.loss_fn, config=self.config)

    def _loss_for(self, batch: tuple[Any, ...]) -> LossFn | nn.Module:
        """The loss of ``(inputs, targets)``, or of a padded ``(inputs, targets, mask)`` (its padding's
        rows zeroed)."""
        return self.loss_fn if len(batch) == 2 else _MaskedLoss(self.loss_fn, batch[2], self.config)

    def _remember(self, key: Hashable, entry: _Entry) -> None:
        self._entries[key] = entry
        while len(self._entries) > self.max_signatures:
            self._entries.popitem(last=False)

    def _count(self, path: str) -> None:
        self.stats[path] += 1
        if self.last_path is None:
            self.last_path = path

    def _refuse(self, entry: _Entry | None, reason: str) -> None:
        """Notes why a signature (``entry``: its graph dropped for good) or a call (None: a batch
        that has no signature) runs eagerly; a call's reason is noted once."""
        if entry is None and reason in self.refusals:
            return
        if entry is not None:
            entry.drop_graph()
            entry.refused = reason
        self.refusals.append(reason)
        logger.warning("%s: %s runs eagerly: %s", _WHERE, "this call" if entry is None else "this batch signature",
                       reason)

    def _check_finite(self, inputs: Any, targets: torch.Tensor) -> None:
        _check_finite(ModelInputs.parse(inputs, where=_WHERE), targets)

    def _signature(self, batch: tuple[Any, ...]) -> tuple[Hashable, list[Any], Any]:
        """The batch's signature (what a graph is valid for), its leaves and their structure
        (``batch``: ``(inputs, targets)``, or padded ``(inputs, targets, mask)``)."""
        if fp16_autocast():
            raise _Refused("float16 autocast scales the loss and retries on overflow, a decision on values")
        leaves, spec = tree_flatten(batch)
        state: list[Hashable] = []  # each module's training flag, parameters and buffers (one walk)
        for layer in self.module.modules():
            state.append(layer.training)
            # (a tensor's memory too: a CUDA graph reads it by address, and ``p.data = ...``, as
            # vector_to_parameters does, moves a parameter to new memory under the same object)
            state.extend((id(p), p.data_ptr(), tuple(p.shape), p.dtype, p.device, p.requires_grad)
                         for p in layer._parameters.values() if p is not None)
            state.extend((id(b), b.data_ptr()) for b in layer._buffers.values() if b is not None)
        autocast = tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in ("cpu", "cuda") if torch.is_autocast_enabled(device))
        key = (str(spec), tuple(_leaf_signature(leaf) for leaf in leaves), tuple(state), autocast,
               torch.is_grad_enabled(), torch.get_default_dtype(), id(self.loss_fn))
        return key, leaves, spec

    def _record(self, entry: _Entry, inputs: Any, targets: torch.Tensor, leaves: list[Any], spec: Any,
                real: int | None) -> DPGradient:
        """Records this batch's step into a graph, which also computes its result (``leaves``: of the
        padded batch when ``real`` is its count of real samples)."""
        from torch.fx.experimental.proxy_tensor import make_fx

        self._check_finite(inputs, targets)
        probe_host()  # (its probes read results on the host: run once for the process, not recorded)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        holder: dict[str, Any] = {}

        def step(*flat: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
            full = list(leaves)
            for i, t in zip(positions, flat):
                full[i] = t
            batch = tree_unflatten(full, spec)
            loss_fn = self._loss_for(batch)
            with recording() as record, _NoHostReads(), _NoValueShapes():
                out = dp_gradient(self.module, batch[0], batch[1], loss_fn=loss_fn, config=self.config)
            device = out.per_sample_norms.device  # (a guarded read's tensor may sit elsewhere)
            numbers = (torch.stack([t.to(device=device, dtype=torch.float64) for t in record.tensors])
                       if record.tensors else torch.zeros(0, dtype=torch.float64, device=device))
            holder["out"], holder["numbers"], holder["guards"] = out, numbers, tuple(record.guards)
            return list(out.grads.values()), out.per_sample_norms, numbers

        devices = _rng_devices(tensors, self.module)
        # (the recording runs the step for real: an eager step in its place starts where it did)
        before = _StepState.of_module(self.module, devices)
        try:
            with _RECORDING, exclusive(self.module), _one_fake_mode():
                graph = make_fx(step, tracing_mode="real")(*tensors)
        except Exception as error:  # noqa: BLE001 - any failure to record means: run eagerly
            before.put_back()
            result = self._eager(inputs, targets)  # a genuine error of this batch raises here
            self._refuse(entry, _describe(error))
            self._count("refused")
            return result
        _simplify(graph.graph)
        graph.recompile()
        out: DPGradient = holder["out"]
        entry.drop_graph()
        entry.graph, entry.positions = graph, tuple(positions)
        entry.names, entry.num_samples = tuple(out.grads), out.num_samples
        entry.numbers = {name: _number_source(getattr(out, name))
                         for name in ("loss_sum", "num_clipped", "num_dropped")}
        entry.guards, entry.mutated = holder["guards"], _mutated_constants(graph.graph)
        entry.devices = devices
        entry.validated, entry.misses = not self.validate, 0
        entry.recordings += 1
        self._count("recorded")
        numbers = holder["numbers"].tolist()
        if _failed(entry, numbers) is not None:
            self._count("reruns")
            before.put_back()
            return self._eager(inputs, targets)  # (the graph stands for batches that drop no sample)
        return self._result(entry, out.grads, out.per_sample_norms, _numbers(entry, numbers), real)

    def _run(self, entry: _Entry, leaves: list[Any]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        inputs = [leaves[i] for i in entry.positions]
        if entry.cuda is not None:
            with exclusive(self.module):
                result = entry.cuda(inputs)
            self.cuda_graph_replays += 1
            return result
        return self._run_graph(entry, inputs)

    def _run_graph(self, entry: _Entry, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                             torch.Tensor]:
        """The recorded graph operator by operator (outside the caller's autocast: the recording
        holds the casts autocast made, and a second pass of autocast over them casts again)."""
        with exclusive(self.module), torch.no_grad(), no_autocast():
            grads, norms, numbers = entry.graph(*inputs)
        return grads, norms, numbers

    def _replay_and_capture(self, entry: _Entry, leaves: list[Any], real: int | None) -> DPGradient | None:
        """:meth:`_replay`, then (``cuda_graphs``) the graph captured as a CUDA graph and replayed on
        the same batch from the same state (a module's buffers, the random generators'), kept if it
        gives the same result; the replay's result and state stand either way."""
        inputs = [leaves[i] for i in entry.positions]
        reason = obstacle(entry.graph, inputs)
        if reason is not None:
            entry.cuda_tried = True
            self._refuse_cuda_graph(reason)
            return self._replay(entry, leaves, real)
        before = _StepState.of(entry, entry.devices)
        replayed = self._replay(entry, leaves, real)
        if replayed is None or entry.graph is None:
            return replayed  # (tried again on a batch the graph holds for)
        entry.cuda_tried = True
        after = _StepState.of(entry, entry.devices)
        captured: CudaGraphReplay | None
        try:
            captured = CudaGraphReplay(lambda xs: self._run_graph(entry, list(xs)), inputs)
            with exclusive(self.module):
                captured.capture(before.put_back)
                grads, norms, numbers = captured(inputs)
            values = numbers.tolist()
            mismatch = "a value its step reads" if _failed(entry, values) is not None else _mismatch(
                replayed, self._result(entry, dict(zip(entry.names, grads)), norms, _numbers(entry, values), real))
            if mismatch is None:
                mismatch = after.unlike_now()
            reason = None if mismatch is None else \
                f"the CUDA graph differs from the replay on the same batch ({mismatch})"
        except Exception as error:  # noqa: BLE001 - a graph the device cannot capture replays as before
            captured, reason = None, f"its capture failed: {_describe(error)}"
        after.put_back()  # (the replay's result and state stand)
        if reason is None:
            entry.cuda = captured
        else:
            self._refuse_cuda_graph(reason)
        return replayed

    def _refuse_cuda_graph(self, reason: str) -> None:
        if reason not in self.cuda_graph_refusals:
            self.cuda_graph_refusals.append(reason)
            logger.warning("%s: a signature replays operator by operator, not as a CUDA graph: %s", _WHERE, reason)

    def _replay(self, entry: _Entry, leaves: list[Any], real: int | None) -> DPGradient | None:
        """The graph's result on the batch; None where its guards say the recorded path does not
        hold for it (a sample dropped, a value the step read that reads otherwise): what the
        graph wrote in the module (a buffer) and the random generators' states are then put back,
        for the eager step (the draws it makes are the ones it would have made in the replay's place)."""
        before = _StepState.of(entry, entry.devices)
        try:
            grads, norms, numbers = self._run(entry, leaves)
        except Exception as error:  # noqa: BLE001 - sizes the recording read, otherwise this time
            failed: Guard | None = next((guard for guard in entry.guards if guard.read), None)
            if failed is None:  # (no value read, so no reason to fail: the graph is not kept)
                before.put_back()
                self._refuse(entry, f"its replay failed: {_describe(error)}")
                return None
        else:
            values = numbers.tolist()  # (one read: the counts, the loss sum and the guards)
            failed = _failed(entry, values)
            if failed is None:
                entry.misses = 0
                return self._result(entry, dict(zip(entry.names, grads)), norms, _numbers(entry, values), real)
        before.put_back()
        if failed.read:
            self._missed(entry)
        return None

    def _missed(self, entry: _Entry) -> None:
        """A replay discarded by a value the step read: after a few in a row, the signature is
        recorded again on its next batch (at most _MAX_RECORDINGS times, then it runs eagerly)."""
        entry.misses += 1
        if entry.misses < _MISSES_BEFORE_RERECORDING:
            return
        if entry.recordings >= _MAX_RECORDINGS:
            self._refuse(entry, f"the values its step reads into Python (a mask's any/all, an item) changed "
                                f"from batch to batch through {entry.recordings} recordings")
        else:
            entry.drop_graph()
            entry.validated, entry.misses = False, 0

    def _validate(self, entry: _Entry, batch: tuple[Any, ...], leaves: list[Any], real: int | None) -> DPGradient:
        """The eager step and the graph's on this batch (padded when asked, the same draws of
        random numbers), the graph kept when they agree."""
        devices = entry.devices  # (whose random draws to repeat)
        before = _StepState.of(entry, devices)
        eager = _trim(dp_gradient(self.module, batch[0], batch[1], loss_fn=self._loss_for(batch), config=self.config),
                      real)
        after = _StepState.of(entry, devices)
        before.put_back()  # the replay starts where the eager step did
        try:
            replayed = self._replay(entry, leaves, real)
            mismatch = None if replayed is None else _mismatch(eager, replayed)
            if mismatch is None and replayed is not None:
                mismatch = after.unlike_now()
        except Exception as error:  # noqa: BLE001 - a graph that cannot replay is refused
            replayed, mismatch = None, f"its replay failed: {_describe(error)}"
        after.put_back()  # (the eager step's result stands)
        if mismatch is not None:
            self._refuse(entry, f"the recorded graph disagrees with the eager step on another batch ({mismatch}): "
                                "the step depends on values it does not read through torch's operators")
            self._count("refused")
        elif replayed is None:  # this batch dropped a sample: the graph is checked on a later one
            self._count("reruns")
        else:
            entry.validated = True
            self._count("validated")
        return eager

    def _result(self, entry: _Entry, grads: dict[str, torch.Tensor], norms: torch.Tensor,
                numbers: dict[str, Any], real: int | None) -> DPGradient:
        return _trim(DPGradient(grads=grads, per_sample_norms=norms, loss_sum=float(numbers["loss_sum"]),
                                num_samples=entry.num_samples, num_clipped=int(numbers["num_clipped"]),
                                num_dropped=int(numbers["num_dropped"])), real)


class _MaskedLoss:
    """``loss_fn`` with the rows of a padded batch's padding samples zeroed (``mask``: ``(N',)``, True
    for the real samples; see :func:`psg_core.accumulate.pad_batch`): their loss, hence their
    gradient, norm and share of the loss sum, are exactly 0. The loss's batch axis is the one
    :func:`psg_core.losses.loss_batch_dim` names, as the per-sample reduction finds it."""

    def __init__(self, loss_fn: LossFn | nn.Module, mask: torch.Tensor, config: DPConfig) -> None:
        self.loss_fn, self.mask = as_unreduced(loss_fn), mask
        self.batch_dim = 0 if config.batch_first else 1

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        per_element = self.loss_fn(outputs, targets)
        if not isinstance(per_element, torch.Tensor) or per_element.dim() == 0:
            return per_element  # (psg refuses it with its message)
        tracker = active_tracker()
        dim = loss_batch_dim(per_element, self.batch_dim, None if tracker is None else tracker.batch_dim(per_element))
        samples = self.mask.shape[0]
        rows = per_element.shape[dim]
        if rows % samples:  # (a recording refused: the batch then runs as given, unpadded)
            raise BatchLayoutError(f"{_WHERE}: the unreduced loss {tuple(per_element.shape)} has no axis of the "
                                   f"padded batch's {samples} samples' rows, so its padding cannot be zeroed")
        keep = self.mask.repeat_interleave(rows // samples).view((-1,) + (1,) * (per_element.dim() - 1 - dim))
        return torch.where(keep, per_element, torch.zeros((), dtype=per_element.dtype, device=per_element.device))


def _trim(result: DPGradient, real: int | None) -> DPGradient:
    """A padded batch's result for its ``real`` first samples (the padding weighs nothing: its norms
    are 0, and it is counted neither clipped nor dropped, unless a real sample it copies was
    dropped)."""
    if real is None or real == result.num_samples:
        return result
    norms = result.per_sample_norms[:real]
    dropped = result.num_dropped
    if dropped:  # (the copies of a dropped first sample are dropped too: counted over the real ones)
        dropped = int((~torch.isfinite(norms)).sum())
    return DPGradient(grads=result.grads, per_sample_norms=norms, loss_sum=result.loss_sum, num_samples=real,
                      num_clipped=result.num_clipped, num_dropped=dropped)


def _number_source(value: Any) -> tuple[bool, Any]:
    """(deferred, slot) for a stand-in number, (False, value) for a constant."""
    if isinstance(value, Deferred):
        return True, value.slot
    return False, value


def _simplify(graph: Any) -> None:
    """Drops what a replay does not need (it runs under no_grad, on the signature's shapes and
    strides): ``detach`` (an alias there) unless its result is an output, views of views (one view
    of the first base; a view's sizes are fixed per signature, and the check on another batch runs
    the simplified graph), and then the dead code."""
    view, detach = torch.ops.aten.view.default, torch.ops.aten.detach.default
    output = next(node for node in graph.nodes if node.op == "output")
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is detach and output not in node.users:
            node.replace_all_uses_with(node.args[0])
        elif node.target is view:
            base = node.args[0]
            while getattr(base, "op", None) == "call_function" and base.target is view:
                base = base.args[0]
            node.args = (base, *node.args[1:])
    graph.eliminate_dead_code()


def _failed(entry: _Entry, graph_numbers: list[float]) -> Guard | None:
    """The first guard by which the recorded path does not hold for the batch (None: it holds)."""
    return next((guard for guard in entry.guards if not guard.holds(graph_numbers[guard.slot])), None)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal (integers) or equal to float rounding (a running statistic)."""
    if not expected.is_floating_point():
        return torch.equal(actual, expected)
    return torch.allclose(actual, expected, rtol=1e-4, atol=1e-6, equal_nan=True)


def _one_fake_mode() -> Any:
    """A tracing context holding one fake-tensor mode for the recording: make_fx describes each
    recorded tensor (its node's ``val``) with a fake tensor, made under the ambient fake mode, or
    else under a new one per tensor, whose construction captures a Python stack trace (most of a
    transformer's recording time: 804 modes, 0.6 of 1.5 s on a tiny GPT-2). The context only
    provides that mode; nothing is traced under it."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    return tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True)))


@dataclass
class _StepState:
    """What a step leaves besides its result: the CPU generator's state and those of the CUDA
    ``devices``, and copies of the module's tensors the graph writes (a buffer), so that a second
    step can start where a first one did (a checked step, a capture's check), and the first one's
    end be put back after."""

    devices: list[int]
    cpu_rng: torch.Tensor
    cuda_rngs: list[torch.Tensor]
    written: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def now(cls, devices: list[int], written: list[tuple[torch.Tensor, torch.Tensor]]) -> _StepState:
        """The generators' states now, with ``written``: tensors and their copies."""
        return cls(devices, torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], written)

    @classmethod
    def of(cls, entry: _Entry, devices: list[int]) -> _StepState:
        return cls.now(devices, _snapshot(entry))

    @classmethod
    def of_module(cls, module: nn.Module, devices: list[int]) -> _StepState:
        """Before a step whose writes are not known yet (a recording): every buffer of ``module``."""
        return cls.now(devices, [(buffer, buffer.clone()) for buffer in module.buffers()])

    def put_back(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for d, state in zip(self.devices, self.cuda_rngs):
            torch.cuda.set_rng_state(state, d)
        _restore(self.written)

    def unlike_now(self) -> str | None:
        """Where the module's written tensors now differ from this state's (None: nowhere)."""
        return next(("a module tensor that the step writes" for tensor, value in self.written
                     if not _close(tensor, value)), None)


def _rng_devices(tensors: list[torch.Tensor], module: nn.Module) -> list[int]:
    """The CUDA devices of the batch's ``tensors`` and of ``module``'s parameters, whose generators
    a step may draw from."""
    return sorted({t.device.index or 0 for t in [*tensors, *module.parameters()] if t.is_cuda})


def _snapshot(entry: _Entry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the module's tensors that the graph writes (a buffer), with the tensors."""
    return [(tensor, tensor.clone()) for tensor in (getattr(entry.graph, name) for name in entry.mutated)]


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Puts back what a step wrote in the module's tensors (a replay discarded, a checked step's)."""
    with torch.no_grad():
        for tensor, value in saved:
            tensor.copy_(value)


def _mutated_constants(graph: Any) -> tuple[str, ...]:
    """The graph's constants (``get_attr``: the module's tensors) that an operator writes in place,
    through views or not."""
    names: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, argument in enumerate(node.target._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            base = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            while isinstance(base, torch.fx.Node) and base.op == "call_function" \
                    and isinstance(base.target, torch._ops.OpOverload) and base.target._schema.arguments \
                    and base.target._schema.arguments[0].alias_info is not None:  # a view: to its base
                base = base.args[0]
            if isinstance(base, torch.fx.Node) and base.op == "get_attr":
                names.add(str(base.target))
    return tuple(sorted(names))


def _numbers(entry: _Entry, graph_numbers: list[float]) -> dict[str, Any]:
    """DPGradient's counts and loss sum from the graph's numbers output (the deferred reads)."""
    return {name: graph_numbers[source] if deferred else source
            for name, (deferred, source) in entry.numbers.items()}


def _mismatch(eager: DPGradient, replayed: DPGradient) -> str | None:
    """Where a replay differs from the eager step beyond float rounding (None: nowhere)."""
    if (eager.num_clipped, eager.num_dropped, eager.num_samples) != (
            replayed.num_clipped, replayed.num_dropped, replayed.num_samples):
        return "the counts of clipped or dropped samples"
    if not math.isclose(eager.loss_sum, replayed.loss_sum, rel_tol=1e-3, abs_tol=1e-6):
        return "the loss sum"
    pairs: list[tuple[str, torch.Tensor, torch.Tensor | None]] = [
        ("per-sample norms", eager.per_sample_norms, replayed.per_sample_norms)]
    pairs += [(f"the gradient of {name!r}", g, replayed.grads.get(name)) for name, g in eager.grads.items()]
    for what, a, b in pairs:
        if b is None or a.shape != b.shape or a.dtype != b.dtype:
            return what
        a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
        finite = torch.isfinite(a64)
        if not torch.equal(finite, torch.isfinite(b64)) or not torch.equal(a64[~finite].nan_to_num(), b64[~finite].nan_to_num()):
            return f"{what} (where they are not finite)"
        a64, b64 = a64[finite], b64[finite]
        rel = 2e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-4
        if a64.numel() and float((a64 - b64).abs().max()) > rel * float(a64.abs().max()) + 1e-7:
            return what
    return None


def _describe(error: BaseException) -> str:
    text = str(error).split("\n")[0]
    return text if isinstance(error, _Refused) else f"{type(error).__name__}: {text[:300]}"
