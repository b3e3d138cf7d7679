"""``CapturedStep(cuda_graphs=True)``: a checked graph replayed as one CUDA graph, equal to the eager
step; a graph a CUDA graph cannot hold (host reads, CPU tensors) replays operator by operator, with
the reason. The CUDA cases run where torch sees a GPU (``pytest -m cuda``); on a CPU host the
option is inert and the screening of the graph's operators is checked directly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psg_core._cuda_graph import CudaGraphReplay, _syncs, screen
from psg_core.capture import CapturedStep
from psg_core.config import DPConfig
from psg_core.dp import dp_gradient
from psg_core.errors import ConfigError
from tests.core.test_capture import (CE, _assert_same, _benchmark_batches, _dropout_against_eager, _padded_cases,
                                     _Reading, _run_against_eager, _Selecting, _signed_batches)
from tests.devices import requires_cuda, to_device

GHOST = DPConfig(mode="ghost", max_grad_norm=1.0)


def _batches(count: int, rows: int = 6) -> list[tuple[tuple, torch.Tensor]]:
    torch.manual_seed(0)
    return [((torch.randn(rows, 4),), torch.randint(0, 2, (rows,))) for _ in range(count)]


def _graph_of(model: nn.Module, batches: list[tuple[tuple, torch.Tensor]]) -> torch.fx.GraphModule:
    step = CapturedStep(model, loss_fn=CE, config=GHOST)
    for inputs, targets in batches:
        step(inputs, targets)
    entry = next(iter(step._entries.values()))
    assert entry.graph is not None, step.refusals
    return entry.graph


def test_cuda_graphs_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="cuda_graphs must be a bool"):
        CapturedStep(nn.Linear(2, 2), loss_fn=CE, config=GHOST, cuda_graphs=1)  # type: ignore[arg-type]


def test_a_batch_off_the_gpu_replays_operator_by_operator_with_the_reason() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    step = _run_against_eager(model, _batches(5), GHOST, cuda_graphs=True)
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 2, "refused": 0, "reruns": 0}
    assert step.cuda_graph_replays == 0
    assert len(step.cuda_graph_refusals) == 1, step.cuda_graph_refusals
    assert step.cuda_graph_refusals[0] in ("torch sees no CUDA device",
                                           "the batch is not on one CUDA device (its tensors are on ['cpu'])")


def test_operators_that_read_values_on_the_host_are_found_in_the_graph() -> None:
    """A selection by values (``x[x > 0]``: a boolean index, sized on the host) cannot be held by a
    CUDA graph; an MLP's graph has no such operator."""
    torch.manual_seed(0)
    selecting = _graph_of(_Selecting(), [((torch.randn(6, 4).abs() + 0.1,), torch.randint(0, 2, (6,)))] * 3)
    found = [str(node.target) for node in selecting.graph.nodes if node.op == "call_function" and _syncs(node)]
    assert found and all("index" in name or "nonzero" in name for name in found), found
    plain = _graph_of(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), _batches(3))
    assert not [node for node in plain.graph.nodes if node.op == "call_function" and _syncs(node)]
    # the whole screen, as for a graph of this host's kernels, and as for a GPU's
    assert screen(plain, "cpu") is None
    assert "reads values on the host" in str(screen(selecting, "cpu"))
    assert "copies a constant cpu tensor (_param_constant0)" in str(screen(plain, "cuda"))  # (its weight)


# ------------------------------------------------------------------------------ the capture's book-keeping
class _RerunOnReplay(CudaGraphReplay):
    """A stand-in for the device's capture, for CPU hosts: the warm-up run and its undo as on a GPU,
    then each ``replay()`` runs the recorded graph on the replay's own input tensors (what a CUDA
    graph's replay computes). What it leaves to the GPU cases is torch.cuda's capture itself; what
    it checks here is CapturedStep's part: the state put back around the warm-up and the check, the
    guards, the counts, the outputs copied out of the replay's tensors."""

    def capture(self, reset) -> None:  # type: ignore[no-untyped-def]
        self._run(self._static)
        reset()
        self._graph = self
        reset()

    def replay(self) -> None:
        self._outputs = self._run(self._static)


@pytest.fixture
def rerun_on_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    import psg_core.capture as capture

    monkeypatch.setattr(capture, "CudaGraphReplay", _RerunOnReplay)
    monkeypatch.setattr(capture, "obstacle", lambda graph, inputs: None)


@pytest.mark.usefixtures("rerun_on_replay")
def test_the_capture_is_checked_and_its_replays_counted_and_guarded() -> None:
    """The guard test's batches: each replay after the first of a graph is the captured one, a
    discarded one's buffer write undone, the warm-up's and the check's writes too (the buffer counts
    one per batch)."""
    torch.manual_seed(0)
    model = _Reading("bool")
    signs = "+" + "+" + "+" + "+" + "-" + "+" + "---" + "-" + "-" + "-" + "-"
    step = _run_against_eager(model, _signed_batches(signs), GHOST, cuda_graphs=True)
    assert step.stats == {"eager": 1, "recorded": 2, "validated": 2, "replayed": 4, "refused": 0, "reruns": 4}
    assert not step.cuda_graph_refusals and step.cuda_graph_replays == 6
    assert int(model.calls) == len(signs)


@pytest.mark.usefixtures("rerun_on_replay")
def test_the_capture_check_repeats_the_replays_random_draws() -> None:
    step = _dropout_against_eager(6, cuda_graphs=True)
    assert not step.cuda_graph_refusals and step.cuda_graph_replays == 2


@pytest.mark.usefixtures("rerun_on_replay")
@pytest.mark.parametrize("case,K", [("mlp", 2), ("tokens", 1), ("seq_first", 2)])
def test_padded_batches_replay_the_captured_graph(case: str, K: int) -> None:
    """Poisson-sized batches padded to 8 samples: one signature, its replays the captured graph's,
    each trimmed to the batch's own samples and equal to the eager step on the batch as given."""
    torch.manual_seed(0)
    model, batches, config, loss_fn = _padded_cases(case, [5, 7, 8, 3, 6, 8, 1], K)
    step = _run_against_eager(model, batches, config, loss_fn=loss_fn, pad_to_multiple=8, cuda_graphs=True)
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 4, "refused": 0, "reruns": 0}
    assert not step.cuda_graph_refusals and step.cuda_graph_replays == 3


def _moved_parameters(device: str) -> None:
    """A CUDA graph reads the parameters by address: ``vector_to_parameters`` (``p.data = ...``)
    moves them under the same objects, and the step starts over on the new memory (recorded and
    checked again), equal to the eager step throughout."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    batches = to_device(_batches(10), device)
    step = _run_against_eager(model, batches[:5], GHOST, cuda_graphs=True)
    assert step.stats["replayed"] == 2 and step.cuda_graph_replays == 1
    flat = nn.utils.parameters_to_vector(model.parameters()).clone()
    nn.utils.vector_to_parameters(flat, model.parameters())  # the same values, in new memory
    for inputs, targets in batches[5:]:
        _assert_same(step(inputs, targets), dp_gradient(model, inputs, targets, loss_fn=CE, config=GHOST))
    assert step.stats == {"eager": 2, "recorded": 2, "validated": 2, "replayed": 4, "refused": 0, "reruns": 0}
    assert step.cuda_graph_replays == 2


@pytest.mark.usefixtures("rerun_on_replay")
def test_a_parameter_moved_to_new_memory_makes_a_new_signature() -> None:
    _moved_parameters("cpu")


class _Drifting(_RerunOnReplay):
    """A capture whose replays compute something else (a kernel the capture got wrong)."""

    def replay(self) -> None:
        grads, norms, numbers = self._run(self._static)
        self._outputs = ([g + 1 for g in grads], norms, numbers)


def test_a_capture_that_differs_from_the_replay_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import psg_core.capture as capture

    monkeypatch.setattr(capture, "CudaGraphReplay", _Drifting)
    monkeypatch.setattr(capture, "obstacle", lambda graph, inputs: None)
    torch.manual_seed(0)
    step = _run_against_eager(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), _batches(6), GHOST,
                              cuda_graphs=True)
    assert step.stats["replayed"] == 3 and step.cuda_graph_replays == 0
    assert step.cuda_graph_refusals == ["the CUDA graph differs from the replay on the same batch (the gradient "
                                        "of '0.weight')"], step.cuda_graph_refusals


class _Failing(_RerunOnReplay):
    """A capture the device refuses (an operator not permitted while a stream captures)."""

    def capture(self, reset) -> None:  # type: ignore[no-untyped-def]
        self._run(self._static)
        reset()
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_the_replays_operator_by_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    import psg_core.capture as capture

    monkeypatch.setattr(capture, "CudaGraphReplay", _Failing)
    monkeypatch.setattr(capture, "obstacle", lambda graph, inputs: None)
    torch.manual_seed(0)
    model = _Reading("bool")
    step = _run_against_eager(model, _signed_batches("++++++"), GHOST, cuda_graphs=True)
    assert step.stats["replayed"] == 3 and step.cuda_graph_replays == 0
    assert step.cuda_graph_refusals == ["its capture failed: RuntimeError: operation not permitted when stream is "
                                        "capturing"]
    assert int(model.calls) == 6  # the warm-up's write undone


# ------------------------------------------------------------------------------ on a GPU
@requires_cuda
@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("name", ["transformer", "cnn", "lstm", "embedding_bag"])
def test_cuda_graph_replays_equal_the_eager_step(name: str, mode: str) -> None:
    """The first replay after the check runs operator by operator, then captures the CUDA graph and
    checks it on the same batch; the later ones are the CUDA graph's, each equal to the eager step
    as the parameters change."""
    model, batches = _benchmark_batches(name, 6)
    model, batches = to_device(model, "cuda"), to_device(batches, "cuda")
    step = _run_against_eager(model, batches, DPConfig(mode=mode, max_grad_norm=0.5), cuda_graphs=True)
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 3, "refused": 0, "reruns": 0}, \
        step.refusals
    assert not step.cuda_graph_refusals and step.cuda_graph_replays == 2


@requires_cuda
def test_a_cuda_graph_replays_results_are_the_callers_own() -> None:
    """A replay's tensors are copied out of the graph's memory: results kept across calls keep
    their values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    step = CapturedStep(model, loss_fn=CE, config=GHOST, cuda_graphs=True)
    batches = to_device(_batches(7), "cuda")
    kept = [step(inputs, targets) for inputs, targets in batches]
    assert step.cuda_graph_replays == 3, step.cuda_graph_refusals
    for result, (inputs, targets) in zip(kept, batches):
        _assert_same(result, dp_gradient(model, inputs, targets, loss_fn=CE, config=GHOST))


@requires_cuda
def test_a_cuda_graph_draws_dropout_as_the_eager_step_does() -> None:
    step = _dropout_against_eager(6, "cuda", cuda_graphs=True)
    assert not step.cuda_graph_refusals and step.cuda_graph_replays == 2


@requires_cuda
def test_guards_and_buffers_hold_in_cuda_graph_replays() -> None:
    """A value the step reads guards the CUDA graph's replays as it does the operator-by-operator
    ones (a discarded replay's buffer write undone), the graph captured again after a new recording."""
    torch.manual_seed(0)
    model = _Reading("bool").cuda()
    signs = "+" + "+" + "+" + "+" + "-" + "+" + "---" + "-" + "-" + "-" + "-"
    step = _run_against_eager(model, to_device(_signed_batches(signs), "cuda"), GHOST, cuda_graphs=True)
    assert step.stats == {"eager": 1, "recorded": 2, "validated": 2, "replayed": 4, "refused": 0, "reruns": 4}
    # (the discarded replays ran as the CUDA graph too: batches 5-9 and 13)
    assert not step.cuda_graph_refusals and step.cuda_graph_replays == 6
    assert int(model.calls) == len(signs)


@requires_cuda
def test_a_cuda_graph_is_not_replayed_on_parameters_moved_to_new_memory() -> None:
    _moved_parameters("cuda")


@requires_cuda
def test_a_selection_by_values_replays_operator_by_operator_on_the_gpu() -> None:
    torch.manual_seed(0)
    batches = []
    for _ in range(5):
        x = torch.randn(6, 4).abs() + 0.1
        x.view(-1)[torch.randperm(24)[:12]] *= -1
        batches.append(((x,), torch.randint(0, 2, (6,))))
    step = _run_against_eager(_Selecting().cuda(), to_device(batches, "cuda"), GHOST, cuda_graphs=True)
    assert step.stats["replayed"] == 2 and step.cuda_graph_replays == 0
    assert len(step.cuda_graph_refusals) == 1 and "reads values on the host" in step.cuda_graph_refusals[0]
