"""Batch validation of the step pipeline (no sockets); shard planning is in test_scheduler.py."""

from __future__ import annotations

import pytest
import torch

from psg_core.errors import BatchLayoutError, NonFiniteInputError
from psg_server.config import ServerConfig
from psg_server.errors import InvalidRequestError
from psg_server.losses import get_loss, prepare_targets
from psg_server.models import default_registry
from psg_server.sessions import Session, open_session
from psg_server.step import validate_batch
from psg_server.streams import all_finite
from psg_wire.v1 import gradient_service_pb2 as pb

REGISTRY = default_registry()


def session(model: str = "mlp", kwargs: str = '{"in_features": 3, "num_classes": 4}', loss: str = "cross_entropy",
            K: int = 1) -> Session:
    request = pb.CreateSessionRequest(model=model, model_kwargs_json=kwargs, loss=loss, expected_batch_size=2,
                                      dp=pb.DPSettings(max_grad_norm=1.0, augmentation_multiplicity=K))
    return open_session(request, owner="a", registry=REGISTRY, config=ServerConfig())


def test_valid_batches_are_cast_for_the_model() -> None:
    batch = validate_batch(session(), {"inputs/0": torch.randn(4, 3, dtype=torch.float64),
                                       "targets": torch.tensor([0, 3, 1, 2], dtype=torch.int16)})
    assert batch.inputs[0].dtype == torch.float32 and batch.targets.dtype == torch.int64 and batch.num_samples == 4
    tokens = session("embedding_bag_classifier", '{"vocab_size": 5, "max_len": 4}')
    index_batch = validate_batch(tokens, {"inputs/0": torch.tensor([[0, 4, 1], [2, 2, 3]], dtype=torch.uint8),
                                          "targets": torch.tensor([0, 1])})
    assert index_batch.inputs[0].dtype == torch.int64


@pytest.mark.parametrize("tensors, error, message", [
    ({"inputs/0": torch.randn(4, 3)}, InvalidRequestError, "no 'targets' tensor"),
    ({"inputs/1": torch.randn(4, 3), "targets": torch.zeros(4, dtype=torch.long)}, InvalidRequestError,
     "inputs must be named"),
    ({"inputs/0": torch.randn(4, 3), "inputs/1": torch.randn(4, 3), "targets": torch.zeros(4, dtype=torch.long)},
     InvalidRequestError, "takes 1 input\\(s\\), got 2"),
    ({"inputs/0": torch.randn(4, 2), "targets": torch.zeros(4, dtype=torch.long)}, InvalidRequestError,
     "does not fit the model"),
    ({"inputs/0": torch.randn(4, 3, 1), "targets": torch.zeros(4, dtype=torch.long)}, InvalidRequestError,
     "does not fit the model"),
    ({"inputs/0": torch.ones(4, 3, dtype=torch.long), "targets": torch.zeros(4, dtype=torch.long)},
     InvalidRequestError, "must be floating point"),
    ({"inputs/0": torch.full((4, 3), float("nan")), "targets": torch.zeros(4, dtype=torch.long)},
     NonFiniteInputError, "NaN or infinity"),
    ({"inputs/0": torch.randn(4, 3), "targets": torch.zeros(3, dtype=torch.long)}, InvalidRequestError,
     "must have 4 rows"),
    ({"inputs/0": torch.randn(4, 3), "targets": torch.full((4,), 4)}, InvalidRequestError, "\\[0, 4\\)"),
])
def test_invalid_batches(tensors: dict[str, torch.Tensor], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        validate_batch(session(), tensors)


def test_index_inputs_are_range_checked_and_rows_must_divide_by_K() -> None:
    tokens = session("transformer_classifier", '{"vocab_size": 5, "max_len": 4, "d_model": 4, "num_heads": 2}')
    with pytest.raises(InvalidRequestError, match="indices in \\[0, 5\\], outside \\[0, 5\\)"):
        validate_batch(tokens, {"inputs/0": torch.tensor([[0, 5]]), "targets": torch.tensor([0])})
    with pytest.raises(InvalidRequestError, match="expected \\['rows', '1..4'\\]"):
        validate_batch(tokens, {"inputs/0": torch.zeros(1, 5, dtype=torch.long), "targets": torch.tensor([0])})
    with pytest.raises(InvalidRequestError, match="integer indices"):
        validate_batch(tokens, {"inputs/0": torch.zeros(1, 3), "targets": torch.tensor([0])})
    with pytest.raises(BatchLayoutError, match="not divisible by augmentation_multiplicity K=2"):
        validate_batch(session(K=2), {"inputs/0": torch.randn(3, 3), "targets": torch.zeros(3, dtype=torch.long)})


def test_plugin_models_without_signature_only_get_layout_checks() -> None:
    registry = default_registry(["tests.server.plugin_models"])
    request = pb.CreateSessionRequest(model="tiny_regressor", loss="mse", expected_batch_size=2,
                                      dp=pb.DPSettings(max_grad_norm=1.0))
    plugin = open_session(request, owner="a", registry=registry, config=ServerConfig())
    batch = validate_batch(plugin, {"inputs/0": torch.randn(2, 7), "targets": torch.randn(2, 9)})
    assert batch.num_samples == 2  # shapes are the model's business: no signature to check against


@pytest.mark.parametrize("loss, targets, message", [
    ("mse", torch.zeros(2, 3, dtype=torch.long), "must be floating point"),
    ("mse", torch.zeros(2, 2), "must have shape \\[2, 3\\]"),
    ("bce_with_logits", torch.full((2, 3), 1.5), "must lie in \\[0, 1\\]"),
    ("mse", torch.full((2, 3), float("inf")), "NaN or infinity"),
    ("nll", torch.zeros(2, 1, dtype=torch.long), "integer tensor of class indices"),
])
def test_targets_are_checked_per_loss(loss: str, targets: torch.Tensor, message: str) -> None:
    with pytest.raises((InvalidRequestError, NonFiniteInputError), match=message):
        prepare_targets(get_loss(loss), targets, rows=2, num_outputs=3, dtype=torch.float32)


@pytest.mark.parametrize("tensor, finite", [
    (torch.full((4,), 3e38), True),  # the sum overflows: the elementwise test decides
    (torch.full((3,), 6e4, dtype=torch.float16), True),
    (torch.tensor([1.0, float("nan"), 2.0]), False),
    (torch.tensor([float("inf"), -float("inf")]), False),
    (torch.tensor([1.0, -float("inf")], dtype=torch.bfloat16), False),
    (torch.zeros(0), True),
    (torch.tensor([2**62, 2**62]), True),  # not floating point: nothing to check
])
def test_all_finite(tensor: torch.Tensor, finite: bool) -> None:
    assert all_finite(tensor) is finite
