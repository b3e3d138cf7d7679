"""mode='ew' (torch's ExpandedWeights) on three models it used to get wrong without an error.

* An InstanceNorm with ``track_running_stats=True`` in eval() normalises with its running
  statistics; torch's ExpandedWeights kernel differentiated it as if the input's own statistics
  had been used (wrong per-sample gradients, silently).
* An ``nn.Embedding(max_norm=...)`` whose weight is also read by a tied output head: the in-place
  renormalisation of the batch's token rows makes a sample's output depend on the other samples'
  tokens. ew returned gradients that were not the samples' own; it now refuses the model (an
  untied ``max_norm`` embedding stays supported: it is exact).
* A module registered twice (``nn.Sequential(l, act, l)``): the call left ``l``'s parameters
  replaced by ExpandedWeight objects in the model, and every later call failed.

Each is checked through the functional API (``per_sample_gradients``, ``dp_gradient``) and the
wrapper (``wrap_model(mode="ew")``: forward, ``loss.backward()``, ``p.grad_sample``), against the
float64 microbatch oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients, wrap_model
from tests.oracle import assert_close_scaled, microbatch_oracle

N = 4
PATHS = ["per_sample_gradients", "dp_gradient", "wrapper"]


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _ce_seq(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # (B, T, V) logits, (B, T) targets
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


def _ew(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Callable[..., torch.Tensor], K: int,
        path: str) -> dict[str, torch.Tensor]:
    """Per-sample gradients (sample loss: the mean over its K rows) from mode='ew', by ``path``.

    For ``dp_gradient`` (no clipping, no noise) it is their sum over the samples."""
    if path == "per_sample_gradients":
        return per_sample_gradients(model, x, y, loss_fn=loss, mode="ew", augmentation_multiplicity=K)
    if path == "dp_gradient":
        return dp_gradient(model, x, y, loss_fn=loss,
                           config=DPConfig(mode="ew", augmentation_multiplicity=K, max_grad_norm=1e9)).grads
    wrapped = wrap_model(model, mode="ew", augmentation_multiplicity=K, loss_reduction="mean")
    try:
        loss(wrapped(x), y).mean().backward()
        return {name: p.grad_sample for name, p in model.named_parameters()}
    finally:
        for p in model.parameters():
            p.grad, p.grad_sample = None, None


def _check(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Callable[..., torch.Tensor], K: int,
           path: str) -> None:
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: loss(out, t).mean())
    got = _ew(model, x, y, loss, K, path)
    if path == "dp_gradient":
        expected = {name: g.sum(0) for name, g in expected.items()}
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close_scaled(got[name], value.to(got[name].dtype), name=name)


# ---------------------------------------------------------------- InstanceNorm with running statistics
class NormNet(nn.Module):
    """Two InstanceNorms with running statistics: one on the raw input (no input gradient), one
    inside the network."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        norm: type[nn.Module] = nn.InstanceNorm1d if dims == 1 else nn.InstanceNorm2d
        conv: type[nn.Module] = nn.Conv1d if dims == 1 else nn.Conv2d
        self.norm0 = norm(2, affine=True, track_running_stats=True)
        self.conv = conv(2, 4, 3)
        self.norm1 = norm(4, affine=True, track_running_stats=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm1(self.conv(self.norm0(x))))
        return self.head(h.flatten(2).mean(-1))


def _norm_net(dims: int) -> NormNet:
    model = NormNet(dims)
    with torch.no_grad():
        for norm in (model.norm0, model.norm1):
            assert norm.running_mean is not None and norm.running_var is not None
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
            norm.weight.normal_()
            norm.bias.normal_()
    return model.eval()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("K", [1, 2])
def test_instance_norm_with_running_stats_in_eval_uses_them(K: int, dims: int, path: str) -> None:
    torch.manual_seed(0)
    model = _norm_net(dims)
    x = torch.randn(N * K, 2, *(7,) * dims)
    y = torch.randint(0, 3, (N * K,))
    _check(model, x, y, _ce, K, path)


def test_instance_norm_in_training_still_matches() -> None:
    torch.manual_seed(0)
    model = _norm_net(1).train()  # the input's own statistics: torch's kernel
    model.norm1 = nn.Identity()  # (it would cancel conv's bias: a zero gradient, compared in noise)
    x, y = torch.randn(N, 2, 7), torch.randint(0, 3, (N,))
    _check(model, x, y, _ce, 1, "per_sample_gradients")


# ---------------------------------------------------------------- Embedding(max_norm) and a tied head
V, T, E = 9, 5, 6


class TiedLM(nn.Module):
    """An embedding with max_norm; the output head reads its weight (``head``: an nn.Linear whose
    weight is the embedding's, ``functional``: F.linear on it, ``untied``: its own weight)."""

    def __init__(self, head: str, max_norm: float | None = 0.5) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E, max_norm=max_norm)
        self.mix = nn.Linear(E, E)
        self.kind = head
        self.head = nn.Linear(E, V, bias=False)
        if head == "head":
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids)))
        return F.linear(h, self.emb.weight) if self.kind == "functional" else self.head(h)


def _tokens(K: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, V, (N * K, T)), torch.randint(0, V, (N * K, T))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head", ["head", "functional"])
@pytest.mark.parametrize("K", [1, 2])
def test_max_norm_embedding_tied_to_the_head_is_refused(K: int, head: str, path: str) -> None:
    torch.manual_seed(0)
    model = TiedLM(head)
    ids, y = _tokens(K)
    params = dict(model.named_parameters())
    with pytest.raises(UnsupportedModuleError, match=r"'emb.weight' is renormalised in place by an embedding "
                                                     r"with max_norm(.|\n)*Untie the weight"):
        _ew(model, ids, y, _ce_seq, K, path)
    assert all(p is params[name] for name, p in model.named_parameters())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("K", [1, 2])
def test_max_norm_embedding_untied_matches_the_oracle(K: int, path: str) -> None:
    torch.manual_seed(0)
    model = TiedLM("untied").double()
    ids, y = _tokens(K)
    _check(model, ids, y, _ce_seq, K, path)


@pytest.mark.parametrize("head", ["head", "functional"])
def test_tied_head_without_max_norm_matches_the_oracle(head: str) -> None:
    torch.manual_seed(0)
    model = TiedLM(head, max_norm=None).double()
    ids, y = _tokens(2)
    _check(model, ids, y, _ce_seq, 2, "per_sample_gradients")


class SharedMaxNorm(nn.Module):
    """Two lookups of one max_norm embedding (the same max_norm): each reads only its own rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E, max_norm=0.5)
        self.head = nn.Linear(E, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids) + self.emb(ids.flip(1))))


def test_two_lookups_of_one_max_norm_embedding_match_the_oracle() -> None:
    torch.manual_seed(0)
    ids, y = _tokens(1)
    _check(SharedMaxNorm().double(), ids, y, _ce_seq, 1, "per_sample_gradients")


# ---------------------------------------------------------------- a module registered twice
D = 6


def _shared_net() -> nn.Sequential:
    layer = nn.Linear(D, D)
    return nn.Sequential(layer, nn.Tanh(), layer, nn.Tanh(), nn.Linear(D, 3))


def _snapshot(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def _assert_untouched(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    after = _snapshot(model)
    assert list(after) == list(before)
    for name, p in after.items():
        assert p is before[name], f"{name}: {type(p).__name__} left in the model"
        assert type(p) is nn.Parameter


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("K", [1, 2])
def test_a_module_registered_twice_is_left_as_it_was(K: int, path: str) -> None:
    torch.manual_seed(0)
    model = _shared_net()
    before = _snapshot(model)
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    for _ in range(2):  # the second call used to fail on the ExpandedWeights left behind
        _check(model, x, y, _ce, K, path)
        _assert_untouched(model, before)
    model(x)  # and a plain forward


class SharedThenUnsupported(nn.Module):
    """The shared layer runs, then its weight meets an op ExpandedWeights cannot handle."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(D, D)
        self.again = self.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.again(torch.tanh(self.layer(x)))
        return h @ self.layer.weight.t()


@pytest.mark.parametrize("path", PATHS)
def test_a_module_registered_twice_is_left_as_it_was_when_the_call_fails(path: str) -> None:
    torch.manual_seed(0)
    model = SharedThenUnsupported()
    before = _snapshot(model)
    x, y = torch.randn(N, D), torch.randint(0, D, (N,))
    with pytest.raises(UnsupportedModuleError):
        _ew(model, x, y, _ce, 1, path)
    _assert_untouched(model, before)
    model(x)


# ------------------------------------------------------------------ outputs and compiled modules
def _dataclass_output_model() -> nn.Module:
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        hidden: dict

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(5, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> Output:
            h = torch.tanh(self.body(x))
            return Output(logits=self.head(h), hidden={"last": h})

    return Net()


@pytest.mark.parametrize("K", [1, 2])
def test_the_wrapper_finds_the_tensors_of_a_dataclass_output(K: int) -> None:
    """Before, the backward pass through such an output filled neither p.grad nor p.grad_sample."""
    torch.manual_seed(0)
    model = _dataclass_output_model()
    x, y = torch.randn(N * K, 5), torch.randint(0, 3, (N * K,))
    wrapped = wrap_model(model, mode="ew", augmentation_multiplicity=K)
    _ce(wrapped(x).logits, y).mean().backward()

    class Logits(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).logits

    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(Logits(model), samples, lambda out, t: _ce(out, t).mean())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert_close_scaled(p.grad_sample, expected["inner." + name].to(p.dtype), name=name)


def test_a_compiled_submodule_is_refused() -> None:
    model = nn.Sequential(nn.Linear(5, 6), torch.compile(nn.Linear(6, 3), backend="eager"))
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    with pytest.raises(UnsupportedModuleError, match="torch.compile"):
        per_sample_gradients(model, x, y, loss_fn=_ce, mode="ew")


# ---------------------------------------------------------------- a model that moves the batch
class TimeMajorInside(nn.Module):
    """Batch-first at its boundary, time-major inside (as XLNet computes on ``(T, N, d)``): the
    linear layers see the batch on axis 1, which ExpandedWeights read as axis 0 unless told; a
    convolution over the moved batch cannot be told."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.mid = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 1) if conv else None
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 3)
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # (T, N*K, 4)
        h = torch.tanh(self.mid(h))
        if self.conv is not None:
            h = self.conv(h.permute(1, 2, 0)).permute(2, 0, 1)  # batch on axis 0 of the conv's input
            h = self.conv(h.transpose(1, 2)).transpose(1, 2)  # (T, C, N*K): the batch on axis 2
        return self.out(h.mean(0))


@pytest.mark.parametrize("path", ["per_sample_gradients", "wrapper"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_linear_layer_on_a_moved_batch_is_told_where_it_is(K: int, path: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(N * K, 5, 3), torch.randint(0, 3, (N * K,))
    _check(TimeMajorInside(conv=False), x, y, _ce, K, path)
    with pytest.raises(UnsupportedModuleError, match=r"module 'conv' \(Conv1d\) calls conv1d on an input whose batch "
                                                     r"is on axis 2, where torch's ExpandedWeights read axis 0"):
        _ew(TimeMajorInside(conv=True), x, y, _ce, K, path)


class BatchFirstInside(nn.Module):
    """Time-major at its boundary (``batch_first=False``), batch-first inside: a linear layer sees the
    batch on axis 0 where ExpandedWeights read axis 1 for this layout unless told."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, N*K, 3)
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # (N*K, T, 4)
        return self.out(torch.tanh(self.mid(h)).mean(1))  # (N*K, 3)


@pytest.mark.parametrize("K", [1, 2])
def test_a_linear_layer_on_a_batch_first_view_of_a_time_major_batch(K: int) -> None:
    torch.manual_seed(0)
    model = BatchFirstInside()
    x, y = torch.randn(5, N * K, 3), torch.randint(0, 3, (N * K,))
    samples = [((x[:, n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: _ce(out, t).mean())
    got = per_sample_gradients(model, x, y, loss_fn=_ce, mode="ew", augmentation_multiplicity=K, batch_first=False)
    for name, value in expected.items():
        assert_close_scaled(got[name], value.to(got[name].dtype), name=name)
