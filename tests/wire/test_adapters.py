"""psg_wire's LoRA adapter (validation, proto round trip, the peft recipe) and the names of keyword inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psg_core.errors import ConfigError
from psg_wire.adapters import LoraAdapter
from psg_wire.convert import lora_from_proto, lora_to_proto
from psg_wire.names import input_name, parse_input_name
from psg_wire.v1 import gradient_service_pb2 as pb


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(4, 4)
        self.value = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.query(x) + self.value(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@pytest.mark.parametrize("adapter", [LoraAdapter(rank=2, target_modules=("query",)),
                                     LoraAdapter(rank=8, target_modules=("query", "blocks.1.value"), alpha=16)])
def test_lora_settings_round_trip(adapter: LoraAdapter) -> None:
    assert lora_from_proto(lora_to_proto(adapter)) == adapter


@pytest.mark.parametrize("settings, message", [
    (pb.LoraSettings(rank=0, target_modules=["q"]), "rank must be an int in \\[1, 1024\\]"),
    (pb.LoraSettings(rank=2000, target_modules=["q"]), "rank must be"),
    (pb.LoraSettings(rank=2, alpha=-1.0, target_modules=["q"]), "alpha must be a finite number > 0"),
    (pb.LoraSettings(rank=2), "must name 1 to 64 modules"),
    (pb.LoraSettings(rank=2, target_modules=["q; import os"]), "is not a module name"),
    (pb.LoraSettings(rank=2, target_modules=[".q"]), "is not a module name"),
])
def test_out_of_range_settings_are_config_errors(settings: pb.LoraSettings, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        lora_from_proto(settings)


def test_apply_freezes_the_model_and_trains_only_the_adapter() -> None:
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(3, 4)
    before = model(x).detach()
    adapted = LoraAdapter(rank=2, target_modules=("query",), alpha=4).apply(model)
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trainable == [f"base_model.model.blocks.{i}.query.lora_{m}.default.weight" for i in (0, 1) for m in "AB"]
    frozen = [name for name, p in adapted.named_parameters() if not p.requires_grad]
    assert "base_model.model.blocks.0.query.base_layer.weight" in frozen and "base_model.model.head.weight" in frozen
    torch.testing.assert_close(adapted(x), before)  # lora_B starts at zero


def test_the_same_adapter_gives_the_same_names_on_both_ends() -> None:
    adapter = LoraAdapter(rank=2, target_modules=("value", "head"))
    server, client = adapter.apply(Tiny()), adapter.apply(Tiny())
    assert [(n, p.shape, p.requires_grad) for n, p in server.named_parameters()] == \
        [(n, p.shape, p.requires_grad) for n, p in client.named_parameters()]


def test_a_target_that_matches_nothing_names_the_candidates() -> None:
    with pytest.raises(ConfigError, match="\\['attn'\\] match no module of the Tiny model; its adaptable modules "
                                          "are named \\['head', 'query', 'value'\\]"):
        LoraAdapter(rank=2, target_modules=("query", "attn")).apply(Tiny())


def test_a_module_peft_cannot_adapt_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="peft cannot adapt"):
        LoraAdapter(rank=2, target_modules=("blocks",)).apply(Tiny())


@pytest.mark.parametrize("name, key", [
    ("inputs/0", 0), ("inputs/12", 12), ("inputs/input_ids", "input_ids"), ("inputs/_x1", "_x1"),
    ("inputs/007", None), ("inputs/-1", None), ("inputs/a.b", None), ("inputs/", None), ("inputs/é", None),
    ("inputs/" + "x" * 65, None), ("targets", None), ("input_ids", None),
])
def test_input_names(name: str, key: int | str | None) -> None:
    assert parse_input_name(name) == key
    if key is not None:
        assert input_name(key) == name
