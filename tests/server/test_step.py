"""Batch validation of the step pipeline (no sockets); shard planning is in test_scheduler.py."""

from __future__ import annotations

import json

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


# ------------------------------------------------------------------------------ keyword inputs
def causal_lm_session() -> Session:
    from tests.server.hf_harness import GPT2

    return session("hf_causal_lm", json.dumps(GPT2), loss="causal_lm")


def test_keyword_inputs_are_checked_against_the_signature_and_keep_their_names() -> None:
    ids = torch.randint(0, 32, (4, 6), dtype=torch.int32)
    mask = torch.ones(4, 6, dtype=torch.uint8)
    labels = ids.long().masked_fill(mask == 0, -100)
    batch = validate_batch(causal_lm_session(), {"inputs/input_ids": ids, "inputs/attention_mask": mask,
                                                 "targets": labels})
    float_mask = validate_batch(causal_lm_session(), {"inputs/input_ids": ids, "inputs/attention_mask": mask.float(),
                                                      "targets": labels})
    assert float_mask.inputs[0].dtype == torch.int64  # masks of any dtype become 0/1 integers
    assert batch.keywords == ("attention_mask", "input_ids") and batch.num_samples == 4
    assert all(t.dtype == torch.int64 for t in batch.inputs)
    torch.testing.assert_close(batch.inputs[1], ids.long())
    only_ids = validate_batch(causal_lm_session(), {"inputs/input_ids": ids, "targets": labels})
    assert only_ids.keywords == ("input_ids",)  # the mask is optional


@pytest.mark.parametrize("tensors, message", [
    ({"inputs/attention_mask": torch.ones(2, 6, dtype=torch.long)},
     "lacks the required input\\(s\\) \\['inputs/input_ids'\\]"),
    ({"inputs/input_ids": torch.zeros(2, 6, dtype=torch.long), "inputs/pixel_values": torch.zeros(2, 6)},
     "has no keyword input\\(s\\) \\['inputs/pixel_values'\\]; it takes inputs/input_ids, inputs/attention_mask"),
    ({"inputs/0": torch.zeros(2, 6, dtype=torch.long)},
     "takes 0 input\\(s\\), got 1; it takes keyword inputs inputs/input_ids, inputs/attention_mask"),
    ({"inputs/input_ids": torch.zeros(2, 6, dtype=torch.long),
      "inputs/attention_mask": torch.ones(2, 5, dtype=torch.int8)},
     "inputs/attention_mask must have the shape of inputs/input_ids, \\[2, 6\\]; got \\[2, 5\\]"),
    ({"inputs/input_ids": torch.full((2, 6), 32)}, "outside \\[0, 32\\)"),
    ({"inputs/input_ids": torch.zeros(2, 6, dtype=torch.long), "inputs/attention_mask": torch.full((2, 6), 0.5)},
     "inputs/attention_mask must be a mask of 0 and 1"),
    ({"inputs/input_ids": torch.zeros(2, 17, dtype=torch.long)}, "expected \\['rows', '1..16'\\]"),
])
def test_bad_keyword_inputs(tensors: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        validate_batch(causal_lm_session(), {**tensors, "targets": torch.zeros(2, 6, dtype=torch.long)})


@pytest.mark.parametrize("targets, message", [
    (torch.zeros(2, 5, dtype=torch.long), "must have the shape of 'inputs/input_ids', \\[2, 6\\]"),
    (torch.zeros(2, dtype=torch.long), "integer tensor \\(rows, T\\) of token labels"),
    (torch.zeros(2, 6), "integer tensor \\(rows, T\\) of token labels"),
    (torch.full((2, 6), 32), "class indices in \\[0, 32\\) or -100, got values in \\[32, 32\\]"),
    (torch.full((2, 6), -5), "class indices in \\[0, 32\\) or -100"),
])
def test_token_targets_follow_the_token_input(targets: torch.Tensor, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        validate_batch(causal_lm_session(), {"inputs/input_ids": torch.zeros(2, 6, dtype=torch.long),
                                             "targets": targets})


def test_keyword_inputs_of_a_model_without_signature_pass_with_layout_checks() -> None:
    registry = default_registry(["tests.server.plugin_models"])
    request = pb.CreateSessionRequest(model="tiny_regressor", loss="mse", expected_batch_size=2,
                                      dp=pb.DPSettings(max_grad_norm=1.0))
    plugin = open_session(request, owner="a", registry=registry, config=ServerConfig())
    batch = validate_batch(plugin, {"inputs/0": torch.randn(2, 7), "inputs/scale": torch.randn(2, 1),
                                    "targets": torch.randn(2, 9)})
    assert batch.keywords == ("scale",) and len(batch.inputs) == 2
    with pytest.raises(BatchLayoutError, match="same number of rows"):
        validate_batch(plugin, {"inputs/0": torch.randn(2, 7), "inputs/scale": torch.randn(3, 1),
                                "targets": torch.randn(2, 9)})


def test_token_losses_need_batch_first() -> None:
    request = pb.CreateSessionRequest(model="seq_first_tagger", loss="causal_lm", expected_batch_size=2,
                                      dp=pb.DPSettings(max_grad_norm=1.0, batch_first=False))
    registry = default_registry(["tests.server.plugin_models"])
    with pytest.raises(InvalidRequestError, match="loss 'causal_lm' takes its batch on dimension 0"):
        open_session(request, owner="a", registry=registry, config=ServerConfig())
