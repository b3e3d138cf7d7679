"""transformers' ``Conv1D`` (GPT-2's projections): grad sampler and ghost norm, registered by name.

psg_core never imports transformers; the registries resolve the name once the model has. GPT-2
(tied input/output embeddings, broadcast position ids) is checked against the microbatch oracle in
the hooks backend (functional and ``GradSampleModule(strict=True)``) and in ghost clipping.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core.backends.ghost as ghost_module
from psg_core import GHOST_NORMS, GRAD_SAMPLERS, DPConfig, clip_and_sum, dp_gradient, per_sample_gradients
from psg_core.grad_sample.linear import TRANSFORMERS_CONV1D, conv1d_ghost_factors, conv1d_grad_sample
from tests.oracle import assert_close_scaled, check_against_oracle, microbatch_oracle, split_samples

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402  (after the skip)

VOCAB, T, N_SAMPLES = 40, 5, 3


def test_importing_psg_core_leaves_transformers_unimported() -> None:
    code = ("import sys, psg_core; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'transformers'], 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_conv1d_resolves_by_name() -> None:
    layer = Conv1D(4, 3)
    assert TRANSFORMERS_CONV1D == f"{Conv1D.__module__}.{Conv1D.__qualname__}"
    assert GRAD_SAMPLERS.lookup(layer).fn is conv1d_grad_sample
    assert GHOST_NORMS.lookup(layer).fn is conv1d_ghost_factors
    assert TRANSFORMERS_CONV1D in GRAD_SAMPLERS.deferred_names()
    assert Conv1D not in list(GRAD_SAMPLERS)  # listings do not depend on what was imported


# ------------------------------------------------------------------------------------- GPT-2
class _LanguageModel(nn.Module):
    """GPT-2's next-token logits ``(B, T, V)`` from token ids."""

    def __init__(self) -> None:
        super().__init__()
        # Dropout off: the oracle's forward passes must see the same function as the batch's.
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=1, eos_token_id=1)
        self.gpt2 = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt2(tokens).logits


def _token_loss(reduction: str) -> Any:
    return lambda logits, targets: F.cross_entropy(logits.transpose(1, 2), targets, reduction=reduction)


def _gpt2_case(K: int, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(K)
    model = _LanguageModel()
    tokens = torch.randint(0, VOCAB, (N_SAMPLES * K, T))
    targets = torch.randint(0, VOCAB, (N_SAMPLES * K, T))
    return model.to(device), tokens.to(device), targets.to(device)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_hooks_match_the_oracle(K: int, reduction: str, device: torch.device) -> None:
    model, tokens, targets = _gpt2_case(K, device)
    # GradSampleModule(strict=True): every GPT-2 layer has a sampler, Conv1D included.
    check_against_oracle(model, tokens, targets, K=K, loss_reduction=reduction, loss=_token_loss, strict=True)
    expected = microbatch_oracle(model, split_samples(tokens, targets, K), _token_loss(reduction))
    actual = per_sample_gradients(model, tokens, targets, loss_fn=_token_loss("none"), mode="hooks",
                                  augmentation_multiplicity=K, loss_reduction=reduction)
    assert set(actual) == set(expected)
    for name in expected:
        assert_close_scaled(actual[name], expected[name], name=name)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_ghost_matches_the_oracle(K: int, reduction: str, device: torch.device) -> None:
    model, tokens, targets = _gpt2_case(K, device)
    expected = microbatch_oracle(model, split_samples(tokens, targets, K), _token_loss(reduction))
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)  # (N,)
    smallest = norms.sort().values
    bound = float(smallest[0] + smallest[1]) / 2  # the smallest sample unclipped, the others clipped
    reference = clip_and_sum(expected, max_grad_norm=bound)
    result = dp_gradient(model, tokens, targets, loss_fn=_token_loss("none"),
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, loss_reduction=reduction,
                                         max_grad_norm=bound))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    assert result.num_clipped == reference.num_clipped == N_SAMPLES - 1
    for name in expected:
        assert_close_scaled(result.grads[name], reference.grads[name], name=name)


# ------------------------------------------------------------------------ Conv1D, both plans
class _Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = Conv1D(12, 4)  # weight (4, 12)
        self.down = Conv1D(3, 12)  # weight (12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.parametrize("plan", ["ghost", "materialise"])
@pytest.mark.parametrize("K", [1, 2])
def test_conv1d_ghost_plans(plan: str, K: int, monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """Gram factors and the materialised grad sampler give the same norms and clipped sums."""
    planned: list[nn.Module] = []

    def cheaper(layer: nn.Module, positions: int) -> bool:
        planned.append(layer)
        return plan == "ghost"

    monkeypatch.setattr(ghost_module, "_ghost_is_cheaper", cheaper)
    torch.manual_seed(K)
    model = _Projections().to(device)
    x, y = torch.randn(N_SAMPLES * K, 6, 4).to(device), torch.randn(N_SAMPLES * K, 6, 3).to(device)
    expected = microbatch_oracle(model, split_samples(x, y, K), lambda out, t: F.mse_loss(out, t, reduction="sum"))
    reference = clip_and_sum(expected, max_grad_norm=0.5, clipping="per_layer")
    result = dp_gradient(model, x, y, loss_fn=nn.MSELoss(reduction="none"),
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, loss_reduction="sum",
                                         max_grad_norm=0.5, clipping="per_layer"))
    assert planned == [model.down, model.up]  # both have a ghost norm (backward order)
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    for name in expected:
        assert_close_scaled(result.grads[name], reference.grads[name], name=name)


def test_conv1d_grad_sample_batch_second(device: torch.device) -> None:
    torch.manual_seed(0)
    model = _Projections()
    x, y = torch.randn(6, 2 * N_SAMPLES, 4), torch.randn(6, 2 * N_SAMPLES, 3)
    check_against_oracle(model, x, y, K=2, loss_reduction="mean", batch_first=False, device=device)
