"""The model registry: built-ins, kwargs validation, sizing on the meta device, plugins."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from psg_core.errors import ConfigError
from psg_server.errors import InvalidRequestError, LimitExceededError, ModelNotFoundError
from psg_server.models import BUILTIN, ModelRegistry, default_registry

SMALL = {
    "mlp": {"in_features": 6, "hidden": [8, 5], "num_classes": 3},
    "cnn_groupnorm": {"in_channels": 2, "image_size": 8, "channels": [4, 4], "groups": 2, "num_classes": 3},
    "resnet_groupnorm": {"in_channels": 3, "image_size": 8, "width": 4, "stages": [1, 2], "groups": 2,
                         "num_classes": 3},
    "transformer_classifier": {"vocab_size": 20, "max_len": 6, "d_model": 8, "num_heads": 2, "num_layers": 1,
                               "dim_feedforward": 16, "num_classes": 3},
    "lstm_classifier": {"vocab_size": 20, "max_len": 6, "embed_dim": 4, "hidden_size": 5, "bidirectional": True,
                        "num_classes": 3},
    "embedding_bag_classifier": {"vocab_size": 20, "max_len": 6, "embed_dim": 4, "mode": "sum", "num_classes": 3},
}


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return default_registry()


def test_the_six_builtins_and_the_hugging_face_family_are_registered(registry: ModelRegistry) -> None:
    from psg_server.huggingface import TASKS

    assert {e.name for e in registry.entries()} == set(SMALL) | set(TASKS)
    assert all(e.origin == BUILTIN and e.description and e.signature for e in registry.entries())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_builtin_matches_its_signature_and_meta_description(registry: ModelRegistry, name: str) -> None:
    kwargs = registry.parse_kwargs(name, json.dumps(SMALL[name]))
    model = registry.build(name, kwargs)
    signature = registry.signature(name, kwargs)
    assert signature is not None and len(signature.inputs) == 1
    spec = signature.inputs[0]
    shape = tuple(d if isinstance(d, int) else d[1] for d in spec.sample_shape)
    x = (torch.randn(3, *shape) if spec.kind == "float"
         else torch.randint(0, spec.num_embeddings or 1, (3, *shape)))
    assert model(x).shape == (3, signature.num_outputs)
    described = registry.describe(name, kwargs, max_bytes=1 << 30)
    assert [(p.name, p.shape, p.dtype) for p in described] == \
        [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    # every parameter sits in a layer psg can compute per-sample gradients for (no BatchNorm, no fused RNN)
    assert not any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.RNNBase, nn.MultiheadAttention))
                   for m in model.modules())


def test_defaults_fill_in_and_arguments_are_typed(registry: ModelRegistry) -> None:
    assert registry.parse_kwargs("mlp", "") == {"in_features": 784, "hidden": (128,), "num_classes": 10}
    arguments = {a.name: a for a in registry.entry("mlp").arguments}
    assert arguments["hidden"].type_name == "list[int]" and arguments["hidden"].default == (128,)
    assert registry.parse_kwargs("lstm_classifier", '{"bidirectional": true}')["bidirectional"] is True


@pytest.mark.parametrize("kwargs_json, message", [
    ('{"width": 3}', "has no argument\\(s\\) \\['width'\\]"),
    ('{"in_features": true}', "must be an integer"),
    ('{"in_features": "4"}', "must be an integer"),
    ('{"in_features": 4294967296}', "below 2\\*\\*31"),
    ('{"hidden": [1.5]}', "list of at most 64 integers"),
    ('{"hidden": 4}', "list of at most 64 integers"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_bad_kwargs_are_invalid_requests(registry: ModelRegistry, kwargs_json: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        registry.parse_kwargs("mlp", kwargs_json)


def test_oversized_kwargs_json_is_refused(registry: ModelRegistry) -> None:
    with pytest.raises(InvalidRequestError, match="characters, more than"):
        registry.parse_kwargs("mlp", " " * (64 * 1024 + 1))


@pytest.mark.parametrize("name, kwargs", [
    ("mlp", {"hidden": (0,)}),
    ("cnn_groupnorm", {"channels": (6,), "groups": 4}),
    ("cnn_groupnorm", {"image_size": 2, "channels": (4, 4)}),
    ("transformer_classifier", {"d_model": 10, "num_heads": 4}),
    ("embedding_bag_classifier", {"mode": "max"}),
    ("resnet_groupnorm", {"stages": (100,)}),
])
def test_builders_reject_bad_values_as_invalid_requests(registry: ModelRegistry, name: str,
                                                        kwargs: dict[str, object]) -> None:
    full = {**registry.parse_kwargs(name, ""), **kwargs}
    with pytest.raises(InvalidRequestError, match=f"model '{name}' rejected its arguments"):
        registry.describe(name, full, max_bytes=1 << 40)


def test_sizing_happens_on_meta_and_enforces_the_limit(registry: ModelRegistry) -> None:
    # 2**20 x 2**20 float32 weights would be 4 TiB: only the meta device can describe them.
    huge = {"in_features": 1 << 20, "hidden": (1 << 20,), "num_classes": 2}
    with pytest.raises(LimitExceededError, match="parameter bytes, more than the server's limit"):
        registry.describe("mlp", huge, max_bytes=1 << 30)


def test_unknown_model_is_not_found(registry: ModelRegistry) -> None:
    with pytest.raises(ModelNotFoundError, match="unknown model 'gpt5'; known: cnn_groupnorm"):
        registry.entry("gpt5")


def test_registration_rules() -> None:
    registry = ModelRegistry()

    def linear(*, width: int = 2) -> nn.Module:
        return nn.Linear(width, 1)

    registry.register("linear", linear)
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("linear", linear)
    registry.register("linear", linear, description="replaced", replace=True)
    assert registry.entry("linear").description == "replaced"

    def untyped(*, width=2) -> nn.Module:  # type: ignore[no-untyped-def]
        return nn.Linear(width, 1)

    with pytest.raises(ConfigError, match="has annotation None"):
        registry.register("untyped", untyped)

    def star(*layers: int) -> nn.Module:
        return nn.Linear(1, 1)

    with pytest.raises(ConfigError, match="plain keyword argument"):
        registry.register("star", star)
    with pytest.raises(ConfigError, match="letters, digits"):
        registry.register("bad name", linear)


def test_plugins_add_models_with_their_origin() -> None:
    registry = default_registry(["tests.server.plugin_models"])
    entry = registry.entry("tiny_regressor")
    assert entry.origin == "tests.server.plugin_models" and entry.signature is None
    assert registry.plugins == ("tests.server.plugin_models",)
    with pytest.raises(ConfigError, match="cannot import 'no.such.plugin'"):
        registry.load_plugin("no.such.plugin")
    with pytest.raises(ConfigError, match="has no register_models"):
        registry.load_plugin("tests.server")
