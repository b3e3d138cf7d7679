"""A recorded step's graph replayed as one CUDA graph (:class:`~psg_core.capture.CapturedStep`'s
``cuda_graphs=True``).

A replay of the recorded ``torch.fx`` graph still launches each of its operators from Python: on a
GPU whose kernels are short (a recurrent layer's time steps, small layers) those launches are the
step. A CUDA graph launches them all at once: the batch is copied into the graph's own input
tensors, the graph replayed, and its outputs (in the graph's memory, which the next replay
overwrites) copied out.

What a CUDA graph cannot hold, the step keeps replaying operator by operator: an operator that
reads values on the host or sizes its result by them (a boolean index, ``nonzero``: the recording
guards them, and on a GPU they wait for the device), a tensor on the CPU, a capture that fails.
Every capture is checked once against the operator-by-operator replay of the same batch (the same
random draws, a module's buffers as they were) before it is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["CudaGraphReplay", "obstacle", "screen"]

#: Operators that read values on the host or size their result by them: a CUDA graph cannot hold
#: them (their host read fails the capture), so a graph holding one replays operator by operator.
_HOST_SYNCING = frozenset({
    "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount", "aten::_local_scalar_dense",
    "aten::item", "aten::is_nonzero", "aten::equal", "aten::masked_scatter", "aten::_pack_padded_sequence",
})


def _is_bool_index(value: Any) -> bool:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def _syncs(node: torch.fx.Node) -> bool:
    """Whether an operator of the graph reads values on the host (see _HOST_SYNCING)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target._schema.name
    if name in _HOST_SYNCING:
        return True
    if name == "aten::repeat_interleave" and target._overloadname == "Tensor" and "output_size" not in node.kwargs:
        return True  # repeats given as a tensor, their total read on the host
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_") and len(node.args) > 1:
        indices = node.args[1]
        return isinstance(indices, (list, tuple)) and any(_is_bool_index(i) for i in indices)
    return False


def obstacle(graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> str | None:
    """Why ``graph`` (a recorded step, called on ``inputs``) cannot be replayed as a CUDA graph, or
    None when it may be (the capture itself, and its check, decide then)."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"the batch is not on one CUDA device (its tensors are on {sorted(map(str, devices))})"
    return screen(graph, "cuda")


def screen(graph: torch.fx.GraphModule, device_type: str) -> str | None:
    """What in ``graph`` a graph of ``device_type`` kernels cannot hold: an operator that reads
    values on the host, a tensor computed or kept (a constant) on another device; None: nothing."""
    for node in graph.graph.nodes:
        if node.op == "get_attr":  # a constant of the recording: one elsewhere is copied over each step
            value = getattr(graph, str(node.target), None)
            if isinstance(value, torch.Tensor) and value.device.type != device_type and value.dim() > 0:
                return f"the step copies a constant {value.device.type} tensor ({node.target}) to the device"
            continue
        if node.op != "call_function":
            continue
        if _syncs(node):
            return f"the step runs {node.target}, which reads values on the host"
        val = node.meta.get("val")
        for value in val if isinstance(val, (list, tuple)) else (val,):
            if isinstance(value, torch.Tensor) and value.device.type != device_type and value.dim() > 0:
                return f"the step computes a tensor on the {value.device.type} ({node.target})"
    return None


class CudaGraphReplay:
    """One recorded step captured as a CUDA graph, with its own input and output tensors.

    ``run(inputs)`` runs the recorded graph operator by operator (the module's lock held, no grad);
    :meth:`capture` captures that run on copies of ``inputs`` (on their device); :meth:`__call__`
    replays it on a new batch of the same signature and returns its outputs copied out of the
    graph's memory.
    """

    def __init__(self, run: Callable[[Sequence[torch.Tensor]], Any], inputs: Sequence[torch.Tensor]) -> None:
        self._run = run
        self.device = inputs[0].device
        self._static = [t.clone() for t in inputs]
        self._graph: Any = None
        self._outputs: Any = None

    def capture(self, reset: Callable[[], None]) -> None:
        """Captures the step: one run on the capture's stream first (cuBLAS and cuDNN choose and
        allocate their work space on the stream they run on; a capture cannot), then the capture
        (which runs nothing). ``reset()`` is called after the warm-up run, to undo what it did (a
        module's buffers, the random generators' state), and again after the capture, so that the
        check's replay surely starts where the replay it is checked against did."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(self._static)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            reset()
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' work on the device (the service's workers) goes on
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                outputs = self._run(self._static)
            reset()
        self._graph, self._outputs = graph, outputs

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The graph replayed on ``inputs``: ``(grads, norms, numbers)`` as the recorded graph returns
        them, in tensors of their own (the next replay overwrites the graph's)."""
        for static, tensor in zip(self._static, inputs):
            static.copy_(tensor)
        self._graph.replay()
        grads, norms, numbers = self._outputs
        copies = torch._foreach_mul(list(grads), 1.0) if grads else []  # (one multi-tensor kernel, exact)
        return list(copies), norms.clone(), numbers.clone()
