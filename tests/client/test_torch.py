"""psg_client.torch: how a batch is named on the wire and which parameters a push may send."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psg_client.torch import batch_tensors, check_parameters, parameter_tensors
from psg_core.errors import ConfigError


def test_positional_and_keyword_inputs_get_their_wire_names() -> None:
    x, y, t = torch.zeros(2, 3), torch.ones(2, 1), torch.zeros(2)
    assert [n for n, _ in batch_tensors(x, t)] == ["inputs/0", "targets"]
    assert [n for n, _ in batch_tensors((x, y), t)] == ["inputs/0", "inputs/1", "targets"]
    named = batch_tensors({"input_ids": x, "attention_mask": y}, t)
    assert [n for n, _ in named] == ["inputs/input_ids", "inputs/attention_mask", "targets"]
    assert named[1][1] is y  # no copy


@pytest.mark.parametrize("inputs", [{"input-ids": torch.zeros(1)}, {"ïds": torch.zeros(1)}, {3: torch.zeros(1)},
                                    {"x" * 65: torch.zeros(1)}])
def test_keywords_must_be_argument_names(inputs: dict[object, torch.Tensor]) -> None:
    with pytest.raises(ConfigError, match="keyword inputs must be named like Python arguments"):
        batch_tensors(inputs, torch.zeros(1))  # type: ignore[arg-type]


def test_inputs_must_be_tensors() -> None:
    with pytest.raises(ConfigError, match="inputs must be tensors"):
        batch_tensors({"input_ids": [1, 2]}, torch.zeros(1))  # type: ignore[dict-item]


def test_trainable_flags_must_agree_with_the_session() -> None:
    model = nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    named = parameter_tensors(model)
    specs = {n: (t.dtype, tuple(t.shape)) for n, t in named}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    check_parameters(named, specs, requires_grad=flags, trainable={"weight": True, "bias": False})
    with pytest.raises(ConfigError, match="\\['bias'\\] are trainable here but frozen in the session's model, or "
                                          "the other way round"):
        check_parameters(named, specs, requires_grad=flags, trainable={"weight": True, "bias": True})
