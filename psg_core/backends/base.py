"""What every per-sample gradient wrapper shares."""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from psg_core.errors import ConfigError, UnsupportedModuleError
from psg_core.layout import BatchLayout, check_multiplicity, unwrap_batch_free
from psg_core.modes import LossReduction, parse_enum
from psg_core.support import trainable_parameters

__all__ = ["AbstractGradSampleModule", "PerSampleOutput", "PerSampleBackend", "check_rows", "earliest_edges", "parameters_kept", "on_output_grads", "get_grad_sample", "set_grad_sample",
           "trainable_parameters"]


@dataclass(frozen=True)
class PerSampleOutput:
    """Per-sample gradients of one batch and the loss they belong to."""

    #: ``{name: (N, *shape)}`` for every trainable parameter, named as in named_parameters().
    grads: dict[str, torch.Tensor]
    #: ``(N,)`` each sample's loss (detached).
    per_sample_losses: torch.Tensor
    num_samples: int


#: The protocol of a backend that materialises per-sample gradients:
#: ``backend(module, inputs: ModelInputs, targets, loss_fn, *, layout: BatchLayout,
#: reduction: LossReduction) -> PerSampleOutput``, the layout validated by the caller.
PerSampleBackend = Callable[..., PerSampleOutput]


def empty_output(params: dict[str, nn.Parameter]) -> PerSampleOutput:
    """The result for a batch of zero samples."""
    first = next(iter(params.values()), None)
    device = first.device if first is not None else torch.device("cpu")
    return PerSampleOutput(grads={name: torch.zeros(0, *p.shape, dtype=p.dtype, device=device)
                                  for name, p in params.items()},
                           per_sample_losses=torch.zeros(0, device=device), num_samples=0)


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
    """Returns N = rows / K, or raises :class:`BatchLayoutError` naming both numbers (the rule of
    :meth:`psg_core.layout.BatchLayout.of`)."""
    return BatchLayout.of(rows=rows, augmentation_multiplicity=augmentation_multiplicity, batch_first=True,
                          where=where).num_samples


@contextlib.contextmanager
def parameters_kept(module: nn.Module) -> Iterator[None]:
    """Puts every module's own parameters and buffers back as they were when the block ends.

    ``torch.func.functional_call`` swaps a module's tensors in and out by attribute, once per path
    to the module; a module registered under two paths (``nn.Sequential(l, act, l)``) is swapped
    twice, and the restore leaves the swapped-in plain tensors in it: the model would keep training
    a copy the optimizer never sees.

    >>> from torch.func import functional_call
    >>> shared = nn.Linear(2, 2)
    >>> weight, model = shared.weight, nn.Sequential(shared, nn.Tanh(), shared)
    >>> with parameters_kept(model):
    ...     _ = functional_call(model, {n: p.detach() for n, p in model.named_parameters()}, torch.zeros(1, 2))
    >>> shared.weight is weight
    True
    """
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    try:
        yield
    finally:
        for m, params, buffers in saved:
            for name, param in params.items():
                if m._parameters.get(name) is not param:
                    m._parameters[name] = param
            for name, buffer in buffers.items():
                if m._buffers.get(name) is not buffer:
                    m._buffers[name] = buffer


class AbstractGradSampleModule(nn.Module, abc.ABC):
    """Wraps a model so that ``loss.backward()`` leaves ``p.grad_sample`` (N, *p.shape) on every
    trainable parameter, where N is the number of samples (rows / K).

    Subclasses implement one backend each; see :func:`psg_core.wrap_model`.
    """

    #: The wrappers' own plain state (flags, counters, trackers, logs: never a parameter, buffer or
    #: submodule), set without nn.Module's registration checks: the functional API builds a
    #: wrapper on every step and updates these on every pass, and each check asks Parameter's
    #: Python-level isinstance hook. Stored in the instance's ``__dict__`` as nn.Module stores them.
    _PLAIN_STATE: frozenset[str] = frozenset({
        "batch_first", "loss_reduction", "augmentation_multiplicity", "strict", "force_functorch", "config",
        "_call_free", "_handles", "_hooks_enabled", "_capture_suspended", "_accumulation_allowed", "_forward_id",
        "_pass_rows", "_edge_log", "_explicit_tracker", "_implicit_tracker", "_sources", "_owned",
        "_pass_thread", "_pass_depth"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in AbstractGradSampleModule._PLAIN_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

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
        check_multiplicity(augmentation_multiplicity, where=type(self).__name__)
        self._module = module
        self.batch_first = bool(batch_first)
        self.loss_reduction = LossReduction(parse_enum(LossReduction, loss_reduction,
                                                       what="loss_reduction"))
        self.augmentation_multiplicity = augmentation_multiplicity
        # Every trainable parameter has the attribute (None until a backward pass reaches it), so
        # that reading p.grad_sample for each one is safe after a pass that did not use some.
        for p in trainable_parameters(module).values():  # (one walk of the tree shared within a step)
            if get_grad_sample(p) is None:
                set_grad_sample(p, None)
        #: ids of the running forward call's :func:`~psg_core.batch_free` tensors.
        self._call_free: frozenset[int] = frozenset()

    @property
    def batch_dim(self) -> int:
        """Dimension of the batch axis in inputs (0 when ``batch_first``, else 1)."""
        return 0 if self.batch_first else 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs, free = unwrap_batch_free(args, kwargs)
        with self._batch_free(free):
            return self._module(*args, **kwargs)

    @contextlib.contextmanager
    def _batch_free(self, free: frozenset[int]) -> Iterator[None]:
        """The ids of the call's :func:`~psg_core.batch_free` tensors, for the forward's hooks."""
        previous, self._call_free = self._call_free, free
        try:
            yield
        finally:
            self._call_free = previous

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


def backward_to_edges(loss: torch.Tensor, edges: list[GradientEdge], *, where: str) -> None:
    """``torch.autograd.grad(loss, earliest_edges(edges))``: the one backward pass of the backends
    that hook layer outputs. torch's reentrant checkpoint cannot run under ``autograd.grad``; its
    error becomes a :class:`~psg_core.errors.UnsupportedModuleError` that says what to change."""
    try:
        torch.autograd.grad(loss, earliest_edges(edges), allow_unused=True)
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise UnsupportedModuleError(
            f"{where}: the model runs torch.utils.checkpoint with use_reentrant=True, which cannot be "
            "differentiated with torch.autograd.grad (psg backpropagates to the hooked layers' "
            "outputs only); pass use_reentrant=False") from err


def earliest_edges(edges: list[GradientEdge]) -> list[GradientEdge]:
    """The edges of ``edges`` that no other edge's node lies below.

    Asking ``torch.autograd.grad`` for the gradients of these edges makes autograd run through
    every edge of ``edges`` (firing the gradient hooks registered on them) while computing no
    parameter gradient: the backends that hook layer outputs backpropagate this way, which skips
    the weight-gradient kernels a plain ``backward()`` would run and throw away.

    >>> x = torch.randn(3, 2, requires_grad=True)
    >>> h = x * 2
    >>> y = h.sin()
    >>> [e.node is y.grad_fn for e in earliest_edges([get_gradient_edge(y), get_gradient_edge(h)])]
    [False]
    """
    hooked = {e.node for e in edges}
    # node -> whether a hooked node lies at or below it, for every node a search has decided: a
    # node is visited once over all the edges' searches (the whole graph at worst), and a search
    # stops at the first hooked node it meets (in a chain of layers, a few nodes below the edge).
    reaches: dict[Any, bool] = {}

    def children(node: Any) -> Iterator[Any]:
        return (child for child, _ in node.next_functions if child is not None)

    def reach(root: Any) -> bool:
        if root in hooked:
            return True
        if root in reaches:
            return reaches[root]
        path = [(root, children(root))]  # depth first; the nodes on the path are undecided
        while path:
            node, rest = path[-1]
            for child in rest:
                if child in hooked or reaches.get(child):
                    for on_path, _ in path:
                        reaches[on_path] = True
                    return True
                if child not in reaches:
                    path.append((child, children(child)))
                    break
            else:
                reaches[node] = False  # every child decided, none reaching a hooked node
                path.pop()
        return reaches[root]

    def below(start: Any) -> bool:
        return any(reach(child) for child in children(start))

    decided: dict[Any, bool] = {}
    seen: set[tuple[int, int]] = set()
    out = []
    for edge in edges:
        key = (id(edge.node), edge.output_nr)
        if key in seen:
            continue
        if edge.node not in decided:
            decided[edge.node] = below(edge.node)
        if not decided[edge.node]:
            seen.add(key)
            out.append(edge)
    return out


class _OutputGrads:
    """The gradient hooks of one forward call's outputs (see :func:`on_output_grads`)."""

    def __init__(self, tensors: list[torch.Tensor], fn: Any) -> None:
        self._fn = fn
        self._count = len(tensors)
        # graph task id -> (gradients so far, how many arrived)
        self._tasks: dict[int, tuple[list[torch.Tensor | None], list[int]]] = {}
        if self._count == 1:
            # One tensor (a layer's one output, the common case): its hook runs once per backward
            # pass, with the whole gradient, so the gradients need no gathering by pass.
            self._handles = [tensors[0].register_hook(self._arrive_one)]
        else:
            self._handles = [t.register_hook(functools.partial(self._arrive, i)) for i, t in enumerate(tensors)]

    def _arrive_one(self, grad: torch.Tensor) -> None:
        self._fn([grad])

    def _arrive(self, index: int, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        entry = self._tasks.get(task)
        if entry is None:
            entry = self._tasks[task] = ([None] * self._count, [0])
            if self._count > 1:
                # Outputs the backward pass never reaches send nothing: hand over what came, at
                # the end of the pass.
                torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
                    functools.partial(self._flush, task))
        grads, arrived = entry
        grads[index] = grad
        arrived[0] += 1
        if arrived[0] == self._count:
            self._flush(task)

    def _flush(self, task: int) -> None:
        entry = self._tasks.pop(task, None)
        if entry is not None:
            self._fn(entry[0])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def on_output_grads(tensors: list[torch.Tensor], fn: Any) -> _OutputGrads:
    """Calls ``fn(grads)`` once per backward pass with the gradients of ``tensors`` (None for those
    the pass does not reach), as soon as all have arrived, else at the end of the pass.

    Unlike ``torch.autograd.graph.register_multi_grad_hook`` it keeps no reference to the
    tensors' autograd nodes, whose hooks refer back to it: that cycle runs through C++ objects
    that Python's garbage collector cannot see, and would keep every hooked call's state (and
    whatever ``fn`` holds, such as saved activations) alive after the step.

    >>> x = torch.randn(3, requires_grad=True)
    >>> a, b = x * 2, x * 3
    >>> seen = []
    >>> _ = on_output_grads([a, b], lambda grads: seen.append([g is not None for g in grads]))
    >>> _ = torch.autograd.grad(a.sum(), x)
    >>> seen
    [[True, False]]
    """
    return _OutputGrads(tensors, fn)
