"""Ghost norms of a weight shared by several modules, against the microbatch oracle.

GPT-2's LM head is tied to its token table: one ``(V, d)`` Parameter owned by an ``nn.Embedding``
(INDEX factors) and an ``nn.Linear`` (DOT factors). Its per-sample gradient is the sum of both
owners' contributions, and the ghost backend takes its norm from their factors with the cross
terms between them (:func:`psg_core.grad_sample.ghost_norm.shared_sq_norms`), never from an
``(N, V, d)`` tensor. Covered: a tied LM (K in {1, 2}, sum and mean, ``padding_idx``), Linear
layers sharing a weight (one called twice, one a transposed transformers ``Conv1D``), convolutions
tied to a transposed convolution and to a grouped one, EmbeddingBag tables, a tiny GPT-2; and the
fallbacks that keep materialising (an EmbeddingBag beside a Linear, a shared weight that also
meets the batch through a batch-free lookup).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import psg_core
import psg_core.backends.ghost as ghost_module
from psg_core import DPConfig, GhostFactors, WeightLayout, dp_gradient
from psg_core.errors import ConfigError
from psg_core.grad_sample.ghost_norm import GhostNormRegistry, can_share, shared_sq_norms
from tests.core.test_host_syncs import DP_READS, HostReads, host_reads  # noqa: F401  (a fixture)
from tests.devices import to_device
from tests.oracle import assert_close_scaled, microbatch_oracle, split_samples

BOUND = 0.05  # small enough that every sample is clipped
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------ helpers
class _Spy:
    """What one ghost pass did with shared weights: the parameters whose per-sample gradients were
    materialised, and how many times :func:`shared_sq_norms` ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.materialised: list[torch.Tensor] = []
        self.shared_calls = 0
        add, shared = ghost_module._GhostBookkeeping._add, ghost_module.shared_sq_norms

        def spy_add(bookkeeping: Any, param: torch.Tensor, grad_sample: torch.Tensor) -> None:
            self.materialised.append(param)
            add(bookkeeping, param, grad_sample)

        def spy_shared(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.shared_calls += 1
            return shared(*args, **kwargs)

        monkeypatch.setattr(ghost_module._GhostBookkeeping, "_add", spy_add)
        monkeypatch.setattr(ghost_module, "shared_sq_norms", spy_shared)

    def was_materialised(self, param: torch.Tensor) -> bool:
        return any(p is param for p in self.materialised)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.numel = max(self.numel, value.numel())
        return out


def _labelled(label: str) -> Callable[[str], str]:
    """An ``assert_close`` message naming what was compared."""
    return lambda message: f"{label}: {message}"


def _reduced(loss: LossFn, reduction: str) -> LossFn:
    return lambda out, target: loss(out, target).mean() if reduction == "mean" else loss(out, target).sum()


def _check_ghost(model: nn.Module, inputs: Any, targets: torch.Tensor, loss: LossFn, *, K: int,
                 reduction: str = "mean") -> psg_core.DPGradient:
    """Ghost's clipped sum and norms equal clipping the oracle's per-sample gradients."""
    expected = microbatch_oracle(model, split_samples(inputs, targets, K), _reduced(loss, reduction))
    reference = psg_core.clip_and_sum({n: g.to(torch.float32) for n, g in expected.items()}, max_grad_norm=BOUND)
    result = dp_gradient(model, inputs, targets, loss_fn=loss,
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, loss_reduction=reduction,
                                         max_grad_norm=BOUND))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    assert result.num_clipped == reference.num_clipped
    assert set(result.grads) == set(reference.grads)
    for name, grad in reference.grads.items():
        assert_close_scaled(result.grads[name], grad, name=name)
    return result


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(N*K, T)`` cross-entropy of ``(N*K, T, V)`` logits against the next tokens."""
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target, reduction="none")


# ------------------------------------------------------------------------------ shared_sq_norms
def _dense_dot(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``(N, G*O, I)``: each group's ``right^T @ left`` stacked on the rows."""
    grads = torch.einsum("ngto,ngti->ngoi", right, left)
    return grads.reshape(grads.shape[0], -1, grads.shape[-1])


def _dense_table(tokens: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(N, V, d)`` tables of INDEX factors."""
    n, d = tokens.shape[0], rows.shape[-1]
    index = (torch.arange(n)[:, None] * vocab + tokens).flatten()
    return torch.zeros(n * vocab, d, dtype=rows.dtype).index_add(0, index, rows.flatten(0, 1)).view(n, vocab, d)


def test_shared_sq_norms_of_every_pairing() -> None:
    """Each pairing of layouts against the norm of the summed dense gradients (float64)."""
    torch.manual_seed(0)
    n, vocab, dim = 3, 7, 4
    f64 = torch.float64
    left, right = torch.randn(n, 1, 5, dim, dtype=f64), torch.randn(n, 1, 5, vocab, dtype=f64)  # Linear(d, V)
    c_left, c_right = torch.randn(n, 1, 2, vocab, dtype=f64), torch.randn(n, 1, 2, dim, dtype=f64)  # Conv1D(d, V)
    tokens, rows = torch.randint(0, vocab, (n, 6)), torch.randn(n, 6, dim, dtype=f64)
    tokens[:, :2] = 3  # repeated tokens: a same-row pair inside the table and against the products
    b_tokens, b_rows = torch.randint(0, vocab, (5,)), torch.randn(5, dim, dtype=f64)
    b_sample = torch.tensor([0, 0, 2, 2, 2])
    linear = (WeightLayout.ROWS_RIGHT, GhostFactors.dot(left, right))
    conv1d = (WeightLayout.ROWS_LEFT, GhostFactors.dot(c_left, c_right))
    table = (WeightLayout.TABLE, GhostFactors.index(tokens, rows))
    bag = (WeightLayout.KEYED_TABLE, GhostFactors.keyed(b_sample, b_tokens, b_rows, n))
    dense = {
        "linear": _dense_dot(left, right),
        "conv1d": c_left[:, 0].transpose(1, 2) @ c_right[:, 0],  # (N, V, d) = left^T right
        "table": _dense_table(tokens, rows, vocab),
        "bag": torch.zeros(n * vocab, dim, dtype=f64).index_add(0, b_sample * vocab + b_tokens, b_rows).view(
            n, vocab, dim),
    }
    parts = {"linear": linear, "conv1d": conv1d, "table": table, "bag": bag}
    for combo in (["linear", "table"], ["conv1d", "table"], ["linear", "conv1d"], ["table", "bag"],
                  ["linear", "conv1d", "table"], ["table", "table"], ["linear", "linear", "table", "table"]):
        expected = sum(dense[name] for name in combo).square().sum((1, 2))  # type: ignore[union-attr]
        actual = shared_sq_norms([parts[name] for name in combo], (vocab, dim), f64)
        torch.testing.assert_close(actual, expected, msg=_labelled(str(combo)))
    with pytest.raises(ConfigError, match="layout TABLE gave DOT"):
        shared_sq_norms([(WeightLayout.TABLE, linear[1]), linear], (vocab, dim), f64)


def test_shared_sq_norms_groups() -> None:
    """Products with the same groups concatenate; different groups (rows laid out differently)
    are materialised from the factors and still give the norm of the sum."""
    torch.manual_seed(1)
    n, f64 = 2, torch.float64
    grouped = GhostFactors.dot(torch.randn(n, 2, 4, 5, dtype=f64), torch.randn(n, 2, 4, 3, dtype=f64))  # (6, 5)
    other = GhostFactors.dot(torch.randn(n, 2, 3, 5, dtype=f64), torch.randn(n, 2, 3, 3, dtype=f64))
    single = GhostFactors.dot(torch.randn(n, 1, 3, 5, dtype=f64), torch.randn(n, 1, 3, 6, dtype=f64))
    for parts in ([grouped, other], [grouped, single], [single, other, grouped]):
        expected = sum(_dense_dot(p.left, p.right) for p in parts).square().sum((1, 2))  # type: ignore[union-attr]
        actual = shared_sq_norms([(WeightLayout.ROWS_RIGHT, p) for p in parts], (6, 5), f64)
        torch.testing.assert_close(actual, expected)


def test_layouts_that_share_and_the_registry_option() -> None:
    assert can_share([WeightLayout.ROWS_RIGHT, WeightLayout.ROWS_LEFT, WeightLayout.TABLE])
    assert can_share([WeightLayout.TABLE, WeightLayout.KEYED_TABLE])
    assert not can_share([WeightLayout.KEYED_TABLE, WeightLayout.ROWS_RIGHT])
    assert not can_share([WeightLayout.TABLE, None])
    for layer_type, layout in ((nn.Linear, WeightLayout.ROWS_RIGHT), (nn.Embedding, WeightLayout.TABLE),
                               (nn.EmbeddingBag, WeightLayout.KEYED_TABLE), (nn.Conv2d, WeightLayout.ROWS_RIGHT),
                               (nn.ConvTranspose1d, WeightLayout.ROWS_RIGHT)):
        entry = psg_core.GHOST_NORMS.lookup(layer_type)
        assert entry is not None and entry.layout is layout, layer_type
    registry = GhostNormRegistry()
    with pytest.raises(ConfigError, match="layout must be a WeightLayout"):
        registry.register(nn.Linear, weight_sum=lambda *a: a[2], positions=lambda *a: 1,
                          layout="rows_right")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ a tied LM
class TiedLM(nn.Module):
    """A token table, a mixing layer and an LM head sharing the table's weight."""

    def __init__(self, vocab: int, dim: int, *, padding_idx: int | None = None, head_bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=head_bias)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))  # (N*K, T, V)


def _lm_batch(rows: int, vocab: int, steps: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, steps), generator=generator)
    ids[0, -2:] = 0  # padding, where padding_idx = 0
    ids[1, :2] = 5  # a token seen twice in a row
    return ids, torch.randint(0, vocab, (rows, steps), generator=generator)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_tied_lm(K: int, reduction: str, padding_idx: int | None, monkeypatch: pytest.MonkeyPatch,
                 device: torch.device) -> None:
    torch.manual_seed(2)
    model = TiedLM(64, 32, padding_idx=padding_idx, head_bias=padding_idx is None).to(device)
    ids, targets = to_device(_lm_batch(4 * K, 64, 3), device)
    spy = _Spy(monkeypatch)
    _check_ghost(model, ids, targets, _token_loss, K=K, reduction=reduction)
    assert spy.shared_calls == 1 and not spy.was_materialised(model.embed.weight)


@pytest.mark.parametrize("K", [1, 2])
def test_tied_lm_holds_no_per_sample_table(K: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tensor of the pass has ``N * V * d`` elements; a materialised plan of the same weight has."""
    torch.manual_seed(3)
    n, vocab, dim = 4, 64, 32
    model = TiedLM(vocab, dim, padding_idx=0)
    ids, targets = _lm_batch(n * K, vocab, 3)
    config = DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=BOUND)
    largest = _Largest()
    with largest:
        ghost = dp_gradient(model, ids, targets, loss_fn=_token_loss, config=config)
    assert largest.numel < n * vocab * dim // 2, largest.numel
    monkeypatch.setattr(ghost_module._GhostBookkeeping, "_plan_shared", lambda self, weight: False)
    largest = _Largest()
    with largest:
        materialised = dp_gradient(model, ids, targets, loss_fn=_token_loss, config=config)
    assert largest.numel >= n * vocab * dim
    assert_close_scaled(ghost.per_sample_norms, materialised.per_sample_norms, name="norms")
    for name, grad in materialised.grads.items():
        assert_close_scaled(ghost.grads[name], grad, name=name)


# ------------------------------------------------------------------------------ matrix products
class TiedLinears(nn.Module):
    """One Linear called twice (a recurrence) and a second one tied to it, then a head."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.step = nn.Linear(dim, dim)
        self.tied = nn.Linear(dim, dim, bias=False)
        self.tied.weight = self.step.weight
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.step(x))
        h = torch.tanh(self.step(h))
        return self.head(torch.tanh(self.tied(h)))


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linears_sharing_a_weight(K: int, reduction: str, monkeypatch: pytest.MonkeyPatch,
                                  device: torch.device) -> None:
    torch.manual_seed(4)
    model = TiedLinears(24).to(device)
    x, y = torch.randn(3 * K, 2, 24).to(device), torch.randn(3 * K, 2, 2).to(device)
    spy = _Spy(monkeypatch)
    _check_ghost(model, x, y, _mse, K=K, reduction=reduction)
    assert spy.shared_calls == 1 and not spy.was_materialised(model.step.weight)


@pytest.mark.parametrize("K", [1, 2])
def test_linear_tied_to_a_transposed_conv1d(K: int, monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """A tied autoencoder: transformers' ``Conv1D`` (weight ``(d_in, d_out)``) decodes with the
    encoder Linear's ``(d_out, d_in)`` weight: the two products are laid out transposed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    encoder = nn.Linear(12, 24)
    decoder = transformers.pytorch_utils.Conv1D(12, 24)  # nf = 12 outputs, nx = 24 inputs: weight (24, 12)
    decoder.weight = encoder.weight
    model = nn.Sequential(encoder, nn.Tanh(), decoder).to(device)
    x, y = torch.randn(3 * K, 2, 12).to(device), torch.randn(3 * K, 2, 12).to(device)
    spy = _Spy(monkeypatch)
    _check_ghost(model, x, y, _mse, K=K)
    assert spy.shared_calls == 1 and not spy.was_materialised(encoder.weight)


class TiedConvs(nn.Module):
    """A convolution tied to a transposed convolution (an autoencoder), optionally also to a
    grouped convolution whose rows lie differently in the same ``(6, 3, 3, 3)`` weight."""

    def __init__(self, grouped: bool) -> None:
        super().__init__()
        self.encode = nn.Conv2d(3, 6, 3, padding=1)
        self.decode = nn.ConvTranspose2d(6, 3, 3, padding=1)
        self.decode.weight = self.encode.weight
        self.grouped = nn.Conv2d(6, 6, 3, padding=1, groups=2) if grouped else None
        if self.grouped is not None:
            self.grouped.weight = self.encode.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encode(x))
        if self.grouped is not None:
            h = torch.tanh(self.grouped(h))
        return self.decode(h)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("K", [1, 2])
def test_convolutions_sharing_a_weight(grouped: bool, K: int, monkeypatch: pytest.MonkeyPatch,
                                       device: torch.device) -> None:
    monkeypatch.setattr(ghost_module, "_ghost_is_cheaper", lambda layer, positions: True)  # 16 positions
    torch.manual_seed(6)
    model = TiedConvs(grouped).to(device)
    x, y = torch.randn(2 * K, 3, 4, 4).to(device), torch.randn(2 * K, 3, 4, 4).to(device)
    spy = _Spy(monkeypatch)
    _check_ghost(model, x, y, _mse, K=K)
    assert spy.shared_calls == 1 and not spy.was_materialised(model.encode.weight)


# ------------------------------------------------------------------------------ tables
class TiedBag(nn.Module):
    """An EmbeddingBag sharing its table with an Embedding (``table``) or with a Linear head."""

    def __init__(self, partner: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 8, mode="mean")
        self.partner = nn.Embedding(30, 8) if partner == "table" else nn.Linear(8, 30)
        self.partner.weight = self.bag.weight
        self.head = nn.Linear(8, 30)

    def forward(self, bags: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.bag(bags)  # (N*K, 8)
        if isinstance(self.partner, nn.Embedding):
            return self.head(torch.tanh(pooled + self.partner(ids).mean(1)))  # (N*K, 30)
        return self.partner(torch.tanh(pooled))  # (N*K, 30)


@pytest.mark.parametrize("partner", ["table", "linear"])
@pytest.mark.parametrize("K", [1, 2])
def test_embedding_bag_sharing_a_weight(partner: str, K: int, monkeypatch: pytest.MonkeyPatch,
                                        device: torch.device) -> None:
    """With an Embedding, both tables' entries make one KEYED factor; with a Linear (a table of
    entries against a product) the weight is materialised, as before."""
    torch.manual_seed(7)
    model = TiedBag(partner).to(device)
    bags, ids = torch.randint(0, 30, (3 * K, 4)), torch.randint(0, 30, (3 * K, 2))
    bags[0, :2] = ids[0, 0]  # a row both tables send gradient to
    targets = torch.randint(0, 30, (3 * K,))
    spy = _Spy(monkeypatch)
    _check_ghost(model, to_device((bags, ids), device), targets.to(device),
                 lambda out, t: F.cross_entropy(out, t, reduction="none"), K=K)
    assert spy.shared_calls == (1 if partner == "table" else 0)
    assert spy.was_materialised(model.bag.weight) == (partner == "linear")


class TiedWithPositions(nn.Module):
    """A tied LM whose table is also looked up with batch-free ``(1, T)`` ids: that lookup meets
    the batch outside the table's forward, so the shared weight is materialised."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, T): no batch
        return self.head(torch.tanh(self.embed(ids) + self.embed(positions)))


@pytest.mark.parametrize("K", [1, 2])
def test_shared_weight_meeting_the_batch_is_materialised(K: int, monkeypatch: pytest.MonkeyPatch,
                                                          device: torch.device) -> None:
    torch.manual_seed(8)
    model = TiedWithPositions().to(device)
    ids, targets = to_device(_lm_batch(3 * K, 40, 3), device)
    spy = _Spy(monkeypatch)
    _check_ghost(model, ids, targets, _token_loss, K=K)
    assert spy.shared_calls == 0 and spy.was_materialised(model.embed.weight)


@pytest.mark.parametrize("model_name", ["lm", "bag"])
def test_shared_norms_read_nothing_back(model_name: str, host_reads: HostReads) -> None:
    """The cross terms and KEYED tables make no host read: a step reads what it returns, no more
    (integer inputs: no finiteness check)."""
    torch.manual_seed(10)
    model: nn.Module
    args: tuple[torch.Tensor, ...]
    if model_name == "lm":
        model, inputs = TiedLM(64, 32, padding_idx=0), _lm_batch(4, 64, 3)[0]
        targets, args = _lm_batch(4, 64, 3, seed=1)[1], (inputs,)
        loss: LossFn = _token_loss
    else:
        model, args = TiedBag("table"), (torch.randint(0, 30, (4, 4)), torch.randint(0, 30, (4, 2)))
        targets, loss = torch.randint(0, 30, (4,)), lambda out, t: F.cross_entropy(out, t, reduction="none")
    config = DPConfig(mode="ghost", augmentation_multiplicity=2, max_grad_norm=BOUND)
    with host_reads:
        dp_gradient(model, args, targets, loss_fn=loss, config=config)
    expected = {site: count for site, count in DP_READS["ghost"].items() if site[1] != "_check_finite"}
    assert dict(host_reads.sites) == expected, sorted(host_reads.sites.items())


# ------------------------------------------------------------------------------ GPT-2
def _gpt2_lm_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-token causal LM loss: position t predicts token t+1; padding (-100) counts zero."""
    logits = outputs.logits[:, :-1]  # (N*K, T-1, V)
    return F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none", ignore_index=-100)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_tied_lm_head(K: int, reduction: str, monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """GPT-2 with ``tie_word_embeddings``: ``wte`` and ``lm_head`` share their ghost norm."""
    pytest.importorskip("transformers")
    from tests.core import hf_models as hf

    torch.manual_seed(9)
    cfg = hf.transformers.GPT2Config(vocab_size=hf.VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                     tie_word_embeddings=True)
    model = hf.transformers.GPT2LMHeadModel(cfg).eval().to(device)
    assert model.lm_head.weight is model.transformer.wte.weight
    inputs = to_device(hf.batch("gpt2", 3 * K)[0], device)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    reference_model = copy.deepcopy(model).double()
    params = dict(reference_model.named_parameters())
    per_sample: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for n in range(3):
        rows = slice(n * K, (n + 1) * K)
        loss = _reduced(_gpt2_lm_loss, reduction)(reference_model(**{k: v[rows] for k, v in inputs.items()}),
                                                  labels[rows])
        for name, grad in zip(params, torch.autograd.grad(loss, list(params.values()))):
            per_sample[name].append(grad)
    reference = psg_core.clip_and_sum({n: torch.stack(g).float() for n, g in per_sample.items()},
                                      max_grad_norm=BOUND)
    spy = _Spy(monkeypatch)
    result = dp_gradient(model, inputs, labels, loss_fn=_gpt2_lm_loss,
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, loss_reduction=reduction,
                                         max_grad_norm=BOUND))
    assert spy.shared_calls == 1 and not spy.was_materialised(model.lm_head.weight)
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms", rtol=1e-3, atol=1e-5)
    scale = max(float(g.abs().max()) for g in reference.grads.values())
    for name, grad in reference.grads.items():
        torch.testing.assert_close(result.grads[name].double(), grad.double(), rtol=1e-3, atol=1e-5 * scale,
                                   msg=_labelled(name))
