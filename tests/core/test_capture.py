"""psg_core.capture.CapturedStep: replays equal the eager dp_gradient, and what cannot be replayed
runs eagerly (with the reason)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from benchmarks.models import MODELS, Variant
from psg_core.capture import CapturedStep
from psg_core.config import DPConfig, DPGradient
from psg_core.dp import dp_gradient
from psg_core.errors import ConfigError, NonFiniteInputError
from tests.devices import to_device

CE = nn.CrossEntropyLoss(reduction="none")


def _assert_same(actual: DPGradient, expected: DPGradient) -> None:
    assert (actual.num_samples, actual.num_clipped, actual.num_dropped) == (
        expected.num_samples, expected.num_clipped, expected.num_dropped)
    assert actual.loss_sum == pytest.approx(expected.loss_sum, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(actual.per_sample_norms, expected.per_sample_norms, rtol=1e-5, atol=1e-6,
                               equal_nan=True)
    assert actual.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        torch.testing.assert_close(actual.grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _sgd_(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """An optimizer's in-place update, from the eager twin's gradient."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in grads:
                p.sub_(0.5 * grads[name] / max(1.0, float(grads[name].norm())))


def _run_against_eager(model: nn.Module, batches: list[tuple[tuple, torch.Tensor]], config: DPConfig,
                       loss_fn=CE, **options) -> CapturedStep:
    """Each batch through a CapturedStep (with ``options``) and through dp_gradient on a copy of the
    model, both models updated in place alike after each step; the step's ``last_path`` after each
    call is kept in ``paths``."""
    twin = copy.deepcopy(model)
    step = CapturedStep(model, loss_fn=loss_fn, config=config, **options)
    assert step.last_path is None
    step.paths = []  # type: ignore[attr-defined]
    for inputs, targets in batches:
        actual = step(inputs, targets)
        step.paths.append(step.last_path)  # type: ignore[attr-defined]
        expected = dp_gradient(twin, inputs, targets, loss_fn=loss_fn, config=config)
        _assert_same(actual, expected)
        _sgd_(model, expected.grads)
        _sgd_(twin, expected.grads)
    return step


def _benchmark_batches(name: str, count: int, K: int = 1) -> tuple[nn.Module, list]:
    spec = MODELS[name]
    model = spec.build(Variant.PSG, "tiny", seed=0)
    batches = [spec.make_batch(rows=spec.samples("tiny") * K, size="tiny", generator=torch.Generator().manual_seed(s))
               for s in range(count)]
    return model, batches


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("name", ["transformer", "cnn", "lstm", "embedding_bag"])
def test_replays_equal_the_eager_step_on_new_batches_as_the_parameters_change(name: str, mode: str,
                                                                               device: torch.device) -> None:
    model, batches = _benchmark_batches(name, 5)
    model, batches = to_device(model, device), to_device(batches, device)
    step = _run_against_eager(model, batches, DPConfig(mode=mode, max_grad_norm=0.5))
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 2, "refused": 0, "reruns": 0}, \
        step.refusals


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_replays_hold_with_k_copies_every_reduction_and_clipping_rule(clipping: str, reduction: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    batches = [((torch.randn(8, 6),), torch.randint(0, 3, (8,))) for _ in range(5)]
    config = DPConfig(mode="ghost", max_grad_norm=0.3, augmentation_multiplicity=2, loss_reduction=reduction,
                      clipping=clipping)
    step = _run_against_eager(model, batches, config, loss_fn=nn.CrossEntropyLoss(reduction=reduction))
    assert step.stats["replayed"] == 2


def _dropout_against_eager(steps: int, device: str = "cpu", **options) -> CapturedStep:
    """A dropout model's CapturedStep (with ``options``) against dp_gradient on a copy, each call
    after the same seed: the same draws give the same result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 3)).to(device)
    twin = copy.deepcopy(model)
    config = DPConfig(mode="ghost", max_grad_norm=1.0)
    step = CapturedStep(model, loss_fn=CE, config=config, **options)
    for seed in range(steps):
        x, y = torch.randn(8, 6, device=device), torch.randint(0, 3, (8,), device=device)
        torch.manual_seed(100 + seed)
        actual = step((x,), y)
        torch.manual_seed(100 + seed)
        _assert_same(actual, dp_gradient(twin, (x,), y, loss_fn=CE, config=config))
    return step


def test_dropout_draws_as_the_eager_step_does() -> None:
    assert _dropout_against_eager(5).stats["replayed"] == 2


class _Branchy(nn.Module):
    """Chooses a path from a value: the recording would bake it."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.read == "bool" and h.sum() > 0:
            h = h * 2
        if self.read == "tolist":
            h = h * (1 + len([v for v in h.sum(1).tolist() if v > 0]))
        if self.read == "mask":
            h = h * (h > 0).sum(1, keepdim=True)  # a value per row, but through torch's ops: fine
        return self.second(h)


def test_a_forward_that_reads_a_list_of_values_runs_eagerly_with_the_reason() -> None:
    torch.manual_seed(0)
    batches = [((torch.randn(6, 4),), torch.randint(0, 2, (6,))) for _ in range(4)]
    step = _run_against_eager(_Branchy("tolist"), batches, DPConfig(mode="ghost", max_grad_norm=1.0))
    assert step.stats == {"eager": 1, "recorded": 0, "validated": 0, "replayed": 0, "refused": 3, "reruns": 0}
    assert step.paths == ["eager", "refused", "refused", "refused"]
    assert len(step.refusals) == 1 and "reads a tensor's values" in step.refusals[0], step.refusals


class _Reading(nn.Module):
    """Chooses its path by one value it reads (as transformers' masks do: ``if mask.all():``), by
    ``read``: ``bool``, ``item``, ``int``, ``equal`` (torch.equal), ``size`` (a masked selection's size)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)  # a buffer written in place: once per step, whatever is replayed or discarded
        h = self.first(x)
        positive = {"bool": lambda: bool(x[:, 0].sum() > 0), "item": lambda: (x[:, 0].sum() > 0).item(),
                    "equal": lambda: torch.equal(x[:, 0] > 0, x[:, 0] > -100),
                    # int() of a float truncates: the guard compares the number read, not the float
                    "int": lambda: int(x[:, 0].sum().clamp(-0.5, 0.5) * 3.9) >= 0,
                    "size": lambda: x[x[:, 0] > 0].shape[0] == x.shape[0],
                    # a write through a mask (Longformer's global tokens): the values fit one count
                    "masked write": lambda: bool(x.abs().index_put_((x[:, 0] > 0,), x.abs()[x[:, 0] > 0] + 1).sum()
                                                 > x.abs().sum()),
                    }[self.read]()
        return self.second(h * 2 if positive else -h)


def _signed_batches(signs: str) -> list[tuple[tuple, torch.Tensor]]:
    """One batch per sign: '+' all of column 0 positive, '-' all negative."""
    batches = []
    for sign in signs:
        x = torch.randn(6, 4)
        x[:, 0] = x[:, 0].abs() * (1 if sign == "+" else -1) + (0.1 if sign == "+" else -0.1)
        batches.append(((x,), torch.randint(0, 2, (6,))))
    return batches


@pytest.mark.parametrize("read", ["bool", "item", "equal", "size", "int", "masked write"])
def test_a_value_the_step_reads_guards_its_replays(read: str) -> None:
    """The recording keeps the value read as a guard: a replay where it reads otherwise is discarded
    (the batch computed eagerly; what the graph wrote in a buffer put back), and three discarded in
    a row record the signature again; every result is the eager step's."""
    torch.manual_seed(0)
    model = _Reading(read)
    #      eager, recorded, checked, replayed, discarded, replayed, 3 discarded, recorded, checked, replayed
    signs = "+" + "+" + "+" + "+" + "-" + "+" + "---" + "-" + "-" + "-"
    step = _run_against_eager(model, _signed_batches(signs), DPConfig(mode="ghost", max_grad_norm=1.0))
    assert step.stats == {"eager": 1, "recorded": 2, "validated": 2, "replayed": 3, "refused": 0, "reruns": 4}
    assert step.paths == ["eager", "recorded", "validated", "replayed", "reruns", "replayed", "reruns", "reruns",
                          "reruns", "recorded", "validated", "replayed"]
    assert not step.refusals
    # one step per batch (plus the twin's), the checked steps' and the discarded replays' writes undone
    assert int(model.calls) == len(signs)


class _DroppingReader(nn.Module):
    """Dropout and a counting buffer before a value read: ``bool`` (a guard) or ``tolist`` (refuses the
    recording, after its dropout drew and its buffer was written)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.first, self.drop, self.second = nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.drop(torch.tanh(self.first(x)))
        positive = bool((x[:, 0] > 0).all()) if self.read == "bool" else min(x[:, 0].tolist()) > 0
        return self.second(h * 2 if positive else -h)


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("read", ["bool", "tolist"])
def test_a_step_computed_eagerly_in_a_replay_s_place_draws_what_the_eager_step_draws(read: str, mode: str) -> None:
    """A discarded replay (a guard reads otherwise, in a checked step or later) and a refused
    recording have already run the step's random draws and buffer writes: both are put back before
    the batch is computed eagerly, so every call equals dp_gradient from the same generator state,
    leaves the generator where it does, and the buffer counts one write per batch. (The discarded
    replays used to leave the generator advanced: the eager rerun drew other dropout masks.)"""
    torch.manual_seed(0)
    model = _DroppingReader(read).train()
    twin = copy.deepcopy(model)
    config = DPConfig(mode=mode, max_grad_norm=1.0)
    step = CapturedStep(model, loss_fn=CE, config=config)
    batches = _signed_batches("++-+-++-")
    for seed, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 + seed)
        actual = step(inputs, targets)
        after = torch.get_rng_state()
        torch.manual_seed(100 + seed)
        _assert_same(actual, dp_gradient(twin, inputs, targets, loss_fn=CE, config=config))
        assert torch.equal(after, torch.get_rng_state()), (seed, step.last_path)
    if read == "bool":  # eager, recorded, a check discarded, checked, discarded, replayed x2, discarded
        assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 2, "refused": 0, "reruns": 3}
    else:
        assert step.stats["refused"] == len(batches) - 1 and "reads a tensor's values" in step.refusals[0]
    assert int(model.calls) == int(twin.calls) == len(batches)


def test_values_that_keep_changing_run_eagerly_after_three_recordings() -> None:
    torch.manual_seed(0)
    signs = "++" + "+" + "---" + "-" + "-" + "+++" + "+" + "+" + "---" + "--"
    step = _run_against_eager(_Reading("bool"), _signed_batches(signs), DPConfig(mode="ghost", max_grad_norm=1.0))
    assert step.stats["recorded"] == 3 and step.stats["refused"] == 2, step.stats
    assert len(step.refusals) == 1 and "changed from batch to batch through 3 recordings" in step.refusals[0]


def test_values_used_through_torch_ops_are_replayed() -> None:
    torch.manual_seed(0)
    batches = [((torch.randn(6, 4),), torch.randint(0, 2, (6,))) for _ in range(4)]
    step = _run_against_eager(_Branchy("mask"), batches, DPConfig(mode="ghost", max_grad_norm=1.0))
    assert step.stats["replayed"] == 1 and not step.refusals


class _Counting(nn.Module):
    """Writes Python state (a step counter) into a buffer: the recording bakes the count it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.register_buffer("total", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.total.add_(self.calls)
        return self.layer(x)


def test_a_graph_that_writes_a_buffer_otherwise_than_the_eager_step_is_refused() -> None:
    """The gradients agree, the buffer the step writes does not: the checked step catches it (and
    the eager step's write is the one kept)."""
    torch.manual_seed(0)
    model = _Counting()
    batches = [((torch.randn(6, 4),), torch.randint(0, 2, (6,))) for _ in range(5)]
    step = _run_against_eager(model, batches, DPConfig(mode="ghost", max_grad_norm=1.0))
    assert step.stats["replayed"] == 0 and "a module tensor that the step writes" in step.refusals[0]
    assert float(model.total) == 1 + 2 + 3 + 4 + 5


class _Selecting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = x[x > 0]  # a size set by values, and the selection used through torch's ops
        return self.layer(x) * picked.numel() + picked.sum() * x[:, :2]


def test_value_dependent_sizes_are_guarded() -> None:
    """``x[x > 0]``: a replay runs on the recording's sizes, so it stands only where the selection
    has the recording's size (the batch computed eagerly otherwise)."""
    torch.manual_seed(0)
    batches = []
    for count in (12, 12, 12, 12, 13, 12):  # eager, recorded, checked, replayed, discarded, replayed
        x = torch.randn(6, 4).abs() + 0.1
        x.view(-1)[torch.randperm(24)[:24 - count]] *= -1
        batches.append(((x,), torch.randint(0, 2, (6,))))
    step = _run_against_eager(_Selecting(), batches, DPConfig(mode="ghost", max_grad_norm=1.0))
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 2, "refused": 0, "reruns": 1}


def test_new_signatures_start_over_and_old_ones_are_remembered() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.0), nn.Linear(8, 2))
    step = CapturedStep(model, loss_fn=CE, config=DPConfig(mode="ghost"), max_signatures=2)

    def batch(rows: int) -> tuple[tuple, torch.Tensor]:
        return (torch.randn(rows, 4),), torch.randint(0, 2, (rows,))

    for _ in range(4):
        step(*batch(6))
    assert step.stats["replayed"] == 1
    step(*batch(5))  # another batch size: eager first
    assert step.stats["eager"] == 2
    model.eval()  # the training flags are part of the signature
    step(*batch(6))
    assert step.stats["eager"] == 3
    model.train()  # six rows in training mode was dropped (two signatures kept): eager again
    step(*batch(6))
    assert step.stats["eager"] == 4
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())  # a new parameter: a new signature
    step(*batch(6))
    assert step.stats["eager"] == 5


def test_a_replay_still_refuses_non_finite_inputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    step = CapturedStep(model, loss_fn=CE, config=DPConfig(mode="ghost"))
    for _ in range(4):
        step(torch.randn(6, 4), torch.randint(0, 2, (6,)))
    assert step.stats["replayed"] == 1
    bad = torch.randn(6, 4)
    bad[2, 1] = float("nan")
    with pytest.raises(NonFiniteInputError, match="NaN"):
        step(bad, torch.randint(0, 2, (6,)))


def test_a_non_finite_gradient_is_dropped_in_a_replay_as_in_the_eager_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    config = DPConfig(mode="ghost")

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return CE(out, y) * y.float().reciprocal()  # a target 0 makes that sample's loss infinite

    # batches 1 and 3 hold a target 0 (a sample dropped), 0, 2 and 4 none
    batches = [((torch.randn(6, 4),), torch.ones(6, dtype=torch.long).index_fill(0, torch.tensor([i % 6]), 0)
                if i % 2 else torch.ones(6, dtype=torch.long)) for i in range(5)]
    step = _run_against_eager(model, batches, config, loss_fn=loss_fn)
    # 0 eager; 1 recorded, but it drops a sample: computed eagerly; 2 checked; 3 drops: eagerly; 4 replayed
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 1, "refused": 0, "reruns": 2}
    assert step.paths == ["eager", "recorded", "validated", "reruns", "replayed"]  # (a call's first count)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="nn.Module"):
        CapturedStep("model", loss_fn=CE, config=DPConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="DPConfig"):
        CapturedStep(nn.Linear(2, 2), loss_fn=CE, config={"mode": "ghost"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_signatures"):
        CapturedStep(nn.Linear(2, 2), loss_fn=CE, config=DPConfig(), max_signatures=0)


@pytest.mark.parametrize(("name", "kernels"), [
    ("embedding_bag", {"psg.bag_entries.default", "psg.keyed_sq_norms.default", "psg.keyed_table_sum.default"}),
    ("lstm", {"psg.recurrent_forward.default", "psg.recurrent_backward.default", "psg.gram64.default",
              "psg.keyed_sq_norms.default"}),  # (the embedding's norms: its rows' runs)
])
def test_the_native_kernels_are_recorded_as_operators(name: str, kernels: set[str]) -> None:
    """Where psg's native kernels build, a recorded step calls them through torch.ops.psg (a replay
    runs them on the new batch), not through ctypes, which a graph would not see."""
    from psg_core import native
    if native.library() is None:
        pytest.skip(f"native kernels not built here: {native.build_error()}")
    model, batches = _benchmark_batches(name, 4)
    step = _run_against_eager(model, batches, DPConfig(mode="ghost", max_grad_norm=0.5))
    graph = next(entry.graph for entry in step._entries.values() if entry.graph is not None)
    called = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert kernels <= called, called
    assert step.stats["replayed"] == 1


def test_the_host_probes_run_before_a_recording_not_inside_it() -> None:
    """psg_core.gemm's one-time probes compare results on the host: first asked inside a recording
    they would refuse it (or be cached wrong), so they run before it."""
    from psg_core import gemm
    expected = (gemm.onednn_available(), gemm._packing_available(), gemm._rule_prefers_onednn())
    for probe in (gemm.onednn_available, gemm._packing_available, gemm._rule_prefers_onednn):
        probe.cache_clear()
    torch.manual_seed(0)
    batches = [((torch.randn(6, 4),), torch.randint(0, 2, (6,))) for _ in range(4)]
    step = _run_against_eager(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), batches,
                              DPConfig(mode="hooks"))
    assert step.stats["replayed"] == 1 and not step.refusals
    assert (gemm.onednn_available(), gemm._packing_available(), gemm._rule_prefers_onednn()) == expected


@pytest.mark.parametrize("family", ["gpt2", "t5", "deberta", "gemma2"])
def test_hugging_face_steps_replay_and_equal_the_eager_step_whatever_the_padding(family: str) -> None:
    """transformers reads the padding mask to choose an attention path (``masking_utils``: GPT-2),
    T5's classifier counts each row's <eos> with ``unique_consecutive``, DeBERTa reads a size with
    ``.item()``: each recorded with guards (a write through a mask, as Longformer's global tokens:
    test_a_value_the_step_reads_guards_its_replays[masked write]); Gemma-2 pools each row's last token with an index ``arange`` made. Every batch's result
    is the eager one, with the padding moving from batch to batch; an unpadded batch (another
    attention path) is computed eagerly."""
    pytest.importorskip("transformers")
    from tests.core import hf_models as hf

    model = hf.build(family, lora=False)
    batches = []
    for seed in range(5):
        inputs, labels = hf.batch(family, 4, seed=seed)
        mask = inputs["attention_mask"].clone()
        mask[seed % 4, 1 + seed % 3:] = 0  # a different row and length padded each time
        batches.append(({**inputs, "attention_mask": mask}, labels))
    unpadded, labels = hf.batch(family, 4, seed=9)
    unpadded["attention_mask"].fill_(1)
    unpadded["input_ids"][0, -3:] = torch.tensor([5, 6, hf.EOS])  # (no pad; the last token is <eos>)
    batches.insert(4, (unpadded, labels))
    step = _run_against_eager(model, batches, DPConfig(mode="ghost", max_grad_norm=0.5), loss_fn=hf.loss_fn)
    # eager, recorded, checked, replayed, (unpadded), replayed
    assert step.stats["replayed"] >= 2 and not step.refusals, (step.stats, step.refusals)


class _Packed(nn.Module):
    """A DP LSTM over sequences packed in the forward (lengths given) or given packed."""

    def __init__(self) -> None:
        super().__init__()
        from psg_core.layers import DPLSTM
        self.lstm, self.head = DPLSTM(4, 6, batch_first=True), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence
        packed = x if lengths is None else pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


@pytest.mark.parametrize("packed_outside", [False, True])
def test_packed_sequences_run_eagerly(packed_outside: bool) -> None:
    """A PackedSequence holds sum(lengths) rows: sizes set by values, which a replay would bake
    (its kernels then sized for another batch's rows), so such steps are refused."""
    from torch.nn.utils.rnn import pack_padded_sequence
    torch.manual_seed(0)
    batches = []
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        x, lengths = torch.randn(4, 5, 4, generator=generator), torch.tensor([5, 4, 4, 2] if seed % 2 else [5, 5, 3, 2])
        inputs = (pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False),) if packed_outside \
            else (x, lengths)
        batches.append((inputs, torch.randint(0, 2, (4,), generator=generator)))
    step = _run_against_eager(_Packed(), batches, DPConfig(mode="ghost", max_grad_norm=0.5))
    assert step.stats["replayed"] == 0 and step.refusals, step.stats


class _Split(nn.Module):
    """Splits its input's features at points held in a buffer (a tensor whose values set sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 2)
        self.register_buffer("points", torch.tensor([3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, *_ = torch.tensor_split(x, self.points, dim=1)
        return self.layer(torch.nn.functional.pad(first, (0, 6 - first.shape[1])))


def test_a_split_at_points_given_as_a_tensor_runs_eagerly() -> None:
    torch.manual_seed(0)
    batches = [((torch.randn(4, 6),), torch.randint(0, 2, (4,))) for _ in range(4)]
    step = _run_against_eager(_Split(), batches, DPConfig(mode="ghost", max_grad_norm=0.5))
    assert step.stats["replayed"] == 0 and "split" in step.refusals[0], (step.stats, step.refusals)


@pytest.mark.parametrize(("cell", "options"), [("DPGRU", {}), ("DPRNN", {}), ("DPRNN", {"nonlinearity": "relu"}),
                                               ("DPLSTM", {"bidirectional": True}), ("DPGRU", {"num_layers": 2})])
def test_every_dp_recurrent_layer_replays_its_native_loops(cell: str, options: dict) -> None:
    import psg_core.layers as layers

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(layers, cell)(4, 6, batch_first=True, **options)
            self.head = nn.Linear(12 if options.get("bidirectional") else 6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(x)
            return self.head(out[:, -1])

    torch.manual_seed(0)
    batches = [((torch.randn(5, 7, 4),), torch.randint(0, 2, (5,))) for _ in range(5)]
    step = _run_against_eager(Model(), batches, DPConfig(mode="ghost", max_grad_norm=0.5))
    assert step.stats["replayed"] == 2 and not step.refusals


def test_steps_recorded_at_once_in_several_threads_all_record() -> None:
    """torch.fx patches nn.Module process-wide while it traces: recordings take turns (two at once
    broke one another), and eager steps and replays in other threads run on meanwhile."""
    import threading

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(4)]
    steps = [CapturedStep(m, loss_fn=CE, config=DPConfig(mode="ghost", max_grad_norm=1.0)) for m in models]
    batches = [((torch.randn(6, 4),), torch.randint(0, 2, (6,))) for _ in range(6)]
    errors: list[BaseException] = []

    def train(step: CapturedStep) -> None:
        try:
            for inputs, targets in batches:
                step(inputs, targets)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=train, args=(step,)) for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for step, model in zip(steps, models):
        assert not step.refusals and step.stats["replayed"] == 3, (step.stats, step.refusals)
        expected = dp_gradient(model, *batches[-1], loss_fn=CE, config=DPConfig(mode="ghost", max_grad_norm=1.0))
        _assert_same(step(*batches[-1]), expected)


class _Tokens(nn.Module):
    """A per-token classifier: (B, T) ids -> (B, T, 5) logits (its loss per token, rows flattened)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 6), nn.Linear(6, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")  # (B*T,)


class _SeqFirst(nn.Module):
    """A time-major DP LSTM (inputs (T, B, 3)) with a head on its last state."""

    def __init__(self) -> None:
        super().__init__()
        from psg_core.layers import DPLSTM
        self.lstm, self.head = DPLSTM(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(x)
        return self.head(h[-1])


def _padded_cases(case: str, sizes: list[int], K: int) -> tuple[nn.Module, list, DPConfig, object]:
    batches: list = []
    if case == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        batches = [((torch.randn(n * K, 4),), torch.randint(0, 3, (n * K,))) for n in sizes]
        return model, batches, DPConfig(mode="ghost", max_grad_norm=0.5, augmentation_multiplicity=K), CE
    if case == "tokens":
        batches = [((torch.randint(0, 11, (n * K, 7)),), torch.randint(0, 5, (n * K, 7))) for n in sizes]
        return _Tokens(), batches, DPConfig(mode="hooks", max_grad_norm=0.5, augmentation_multiplicity=K), _token_loss
    batches = [((torch.randn(6, n * K, 3),), torch.randint(0, 2, (n * K,))) for n in sizes]
    return _SeqFirst(), batches, DPConfig(mode="ghost", max_grad_norm=0.5, augmentation_multiplicity=K,
                                          batch_first=False), CE


@pytest.mark.parametrize("case,K", [("mlp", 1), ("mlp", 2), ("tokens", 1), ("seq_first", 2)])
def test_padded_batches_share_one_signature_and_equal_the_eager_step(case: str, K: int) -> None:
    """pad_to_multiple: batches of 5, 7, 8, 3, 6, 8 and 1 samples (Poisson sizes) are computed as 8
    samples, the padding (copies of the first sample) weighing nothing: one signature replayed,
    and every result (norms and counts of the real samples, the loss sum, the sums) the eager
    step's on the batch as given. A token-level loss (rows flattened), K copies, a time-major model."""
    torch.manual_seed(0)
    model, batches, config, loss_fn = _padded_cases(case, [5, 7, 8, 3, 6, 8, 1], K)
    step = _run_against_eager(model, batches, config, loss_fn=loss_fn, pad_to_multiple=8)
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 4, "refused": 0, "reruns": 0}, \
        (step.stats, step.refusals)


def test_padding_copies_of_a_dropped_first_sample_are_not_counted() -> None:
    """The padding copies the first sample: where its gradient is not finite (dropped), so are its
    copies', and only the real samples are counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    config = DPConfig(mode="ghost")

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return CE(out, y) * y.float().reciprocal()  # a target 0 makes that sample's loss infinite

    targets = [torch.ones(5, dtype=torch.long) for _ in range(5)]
    targets[2][0] = 0  # the checked step's first sample is dropped (and its three copies)
    targets[4][3] = 0
    batches = [((torch.randn(5, 4),), t) for t in targets]
    step = _run_against_eager(model, batches, config, loss_fn=loss_fn, pad_to_multiple=8)
    # 0 eager; 1 recorded; 2 checked eagerly (padded: 1 + 3 copies dropped, 1 counted), its replay
    # not holding (a sample dropped); 3 checked; 4 drops a sample: eagerly
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 0, "refused": 0, "reruns": 2}


def test_padding_argument_errors() -> None:
    with pytest.raises(ConfigError, match="pad_to_multiple"):
        CapturedStep(nn.Linear(2, 2), loss_fn=CE, config=DPConfig(), pad_to_multiple=0)
    with pytest.raises(ConfigError, match="functorch"):
        CapturedStep(nn.Linear(2, 2), loss_fn=CE, config=DPConfig(mode="functorch"), pad_to_multiple=4)


@pytest.mark.parametrize("mode", ["ghost", "hooks", "functorch"])
def test_steps_under_bfloat16_autocast_replay_and_equal_the_eager_step(mode: str) -> None:
    """The recording holds the casts autocast made; its replays ran inside the caller's autocast,
    which cast again (hooks, functorch: the replay failed on mixed dtypes; ghost: the check refused
    the graph): every call ran eagerly. Replays now run outside it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))
    twin, config = copy.deepcopy(model), DPConfig(mode=mode, max_grad_norm=0.5)
    step = CapturedStep(model, loss_fn=CE, config=config)
    for _ in range(5):
        inputs, targets = (torch.randn(8, 10),), torch.randint(0, 5, (8,))
        # (autocast around the steps only, as around a forward pass: its cache of the parameters'
        # casts lives as long as the region, and would hide the updates below)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            actual = step(inputs, targets)
            expected = dp_gradient(twin, inputs, targets, loss_fn=CE, config=config)
        _assert_same(actual, expected)
        _sgd_(model, expected.grads)
        _sgd_(twin, expected.grads)
    assert step.stats == {"eager": 1, "recorded": 1, "validated": 1, "replayed": 2, "refused": 0, "reruns": 0}, \
        (step.stats, step.refusals)
