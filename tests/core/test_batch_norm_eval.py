"""BatchNorm in eval mode, with its running statistics: a per-channel affine map of each row, so
its weight and bias get exact per-sample gradients (a pretrained network fine-tuned with its
statistics frozen). In training mode it normalises with the batch's statistics and is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psg_core import DPConfig, GradSampleModule, UnsupportedModuleError, dp_gradient
from tests.oracle import check_mode, cross_entropy_rows as _loss

N = 3


def _cnn() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():  # statistics as a pretrained network has them
        for layer in model:
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer.running_mean.uniform_(-0.5, 0.5)
                layer.running_var.uniform_(0.5, 2.0)
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.5, 0.5)
    return model.eval()


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_batch_norm_in_eval_mode_matches_the_oracle(mode: str, K: int) -> None:
    torch.manual_seed(0)
    model = _cnn()
    x, y = torch.randn(N * K, 2, 5, 5), torch.randint(0, 3, (N * K,))
    check_mode(model, x, y, K=K, mode=mode, loss=_loss)


def test_the_wrapper_takes_an_eval_model_and_refuses_a_training_one() -> None:
    model = _cnn()
    wrapped = GradSampleModule(model)
    _loss(wrapped(torch.randn(4, 2, 5, 5)), torch.randint(0, 3, (4,))).mean().backward()
    assert model[1].weight.grad_sample.shape == (4, 4)
    with pytest.raises(UnsupportedModuleError, match="BatchNorm in training mode"):
        GradSampleModule(_cnn().train())


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
def test_batch_norm_switched_to_training_is_refused(mode: str) -> None:
    model = _cnn()
    model[1].train()
    with pytest.raises(UnsupportedModuleError, match="training mode"):
        dp_gradient(model, torch.randn(4, 2, 5, 5), torch.randint(0, 3, (4,)), loss_fn=_loss,
                    config=DPConfig(mode=mode, max_grad_norm=1.0))
