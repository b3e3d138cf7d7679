"""An empty batch (Poisson sampling draws them) is a step with noise only, for every built-in
architecture that takes index inputs (token ids): the range check of index inputs has nothing to
check in zero rows (it called min() of an empty tensor: INTERNAL)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from psg_client import GradientClient
from psg_core.config import DPConfig
from psg_core.noise import add_noise
from psg_server.config import ServerConfig
from psg_server.models import InputSpec, default_registry
from psg_server.sessions import open_session
from psg_wire.v1 import gradient_service_pb2 as pb
from tests.server.service_harness import client_for, serve
from tests.server.test_huggingface import CASES

REGISTRY = default_registry()
SEED, STEP_SEED, SIGMA, BOUND, BATCH = 11, 5, 1.0, 0.5, 4
TOKENS = {"vocab_size": 11, "max_len": 5, "num_classes": 3}
BUILTIN: dict[str, tuple[str, dict[str, Any]]] = {
    "transformer_classifier": ("transformer_classifier", {**TOKENS, "d_model": 8, "num_heads": 2, "num_layers": 1,
                                                          "dim_feedforward": 8}),
    "embedding_bag_classifier": ("embedding_bag_classifier", {**TOKENS, "embed_dim": 4}),
    "lstm_classifier": ("lstm_classifier", TOKENS),
}
#: Every Hugging Face case of test_huggingface.py whose task takes token ids.
TOKEN_TASKS = {"hf_causal_lm": "causal_lm", "hf_sequence_classification": "cross_entropy",
               "hf_token_classification": "token_cross_entropy", "hf_seq2seq_lm": "token_cross_entropy"}
HUGGING_FACE = {name: case for name, case in CASES.items() if case[0] in TOKEN_TASKS}
ARCHITECTURES = {**BUILTIN, **HUGGING_FACE}


def test_the_cases_cover_every_architecture_with_index_inputs() -> None:
    def takes_indices(name: str, kwargs: dict[str, Any]) -> bool:
        signature = REGISTRY.signature(name, REGISTRY.parse_kwargs(name, json.dumps(kwargs)))
        return signature is not None and any(spec.kind == "index" for spec in
                                             [*signature.inputs, *signature.keyword_inputs.values()])

    assert {name for name, kwargs in ARCHITECTURES.values() if takes_indices(name, kwargs)} == \
        {"transformer_classifier", "embedding_bag_classifier", "lstm_classifier", *TOKEN_TASKS}
    for name, (model, kwargs) in HUGGING_FACE.items():
        assert takes_indices(model, kwargs), name


@pytest.fixture(scope="module")
def client() -> Iterator[GradientClient]:
    with serve(num_workers=1) as server, client_for(server) as connected:
        yield connected


def empty_input(spec: InputSpec) -> torch.Tensor:
    """Zero rows of an input, each row as short as the spec allows."""
    row = [dim if isinstance(dim, int) else dim[0] for dim in spec.sample_shape]
    return torch.zeros(0, *row, dtype=torch.float32 if spec.kind == "float" else torch.int64)


def expected_noise(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the step releases from an empty batch: noise N(0, (sigma C)^2) on a zero sum, from the
    generator the server seeds for step seed STEP_SEED of a session of seed SEED, over B."""
    request = pb.CreateSessionRequest(model="mlp", model_kwargs_json="{}", loss="cross_entropy", expected_batch_size=1,
                                      dp=pb.DPSettings(max_grad_norm=BOUND), seed=SEED)
    seed = open_session(request, owner="test", registry=REGISTRY, config=ServerConfig()).noise_seed(STEP_SEED)
    zeros = {name: torch.zeros_like(p) for name, p in model.named_parameters() if p.requires_grad}
    noised = add_noise(zeros, noise_multiplier=SIGMA, sensitivity=BOUND, generator=torch.Generator().manual_seed(seed))
    return {name: grad / BATCH for name, grad in noised.items()}


@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_an_empty_batch_is_a_step_with_noise_only(client: GradientClient, case: str) -> None:
    name, kwargs = ARCHITECTURES[case]
    loss = TOKEN_TASKS.get(name, "cross_entropy")
    parsed = REGISTRY.parse_kwargs(name, json.dumps(kwargs))
    signature = REGISTRY.signature(name, parsed)
    assert signature is not None
    if signature.inputs:
        inputs: Any = [empty_input(spec) for spec in signature.inputs]
    else:
        inputs = {key: empty_input(spec) for key, spec in signature.keyword_inputs.items() if spec.required}
    targets = torch.zeros(*(inputs[signature.targets_like].shape if signature.targets_like else (0,)),
                          dtype=torch.int64)
    torch.manual_seed(0)
    model = REGISTRY.build(name, parsed)
    with client.create_session(name, model_kwargs=kwargs, loss=loss, expected_batch_size=BATCH,
                               config=DPConfig(max_grad_norm=BOUND, noise_multiplier=SIGMA), sample_rate=0.01,
                               delta=1e-5, seed=SEED) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, targets, step_seed=STEP_SEED)
        assert (result.samples, result.step, result.num_dropped) == (0, 1, 0)
        assert math.isfinite(result.epsilon_spent) and result.epsilon_spent > 0
        assert result.mean_loss == 0.0 and result.norm_quantiles == {}
        noise = expected_noise(model)
        assert list(result.grads) == list(noise)
        for parameter, grad in noise.items():
            assert torch.equal(result.grads[parameter], grad), parameter
        assert session.info().steps == 1
