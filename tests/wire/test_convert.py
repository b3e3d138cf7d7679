"""psg_wire.convert and psg_wire.names: each message's unset rules, read and written in one place."""

from __future__ import annotations

import math

import pytest
import torch

from psg_core.config import DPConfig
from psg_core.errors import ConfigError
from psg_wire.codec import CodecError
from psg_wire.convert import (PrivacyRequest, StepReport, dp_config_from_proto, dp_config_to_proto,
                              parameter_spec_from_proto, parameter_spec_to_proto, privacy_from_proto,
                              privacy_to_proto, step_stats_from_proto, step_stats_to_proto)
from psg_wire.names import INPUT_PREFIX, SERVICE_NAME, TARGETS, Reason, input_name
from psg_wire.v1 import gradient_service_pb2 as pb


@pytest.mark.parametrize("config", [
    DPConfig(),
    DPConfig(mode="ghost", augmentation_multiplicity=4, loss_reduction="sum", batch_first=False,
             max_grad_norm=0.25, clipping="automatic", noise_multiplier=1.3),
    DPConfig(clipping="per_layer", per_layer_max_grad_norms=(0.5, 2.0, 1.0)),
])
def test_dp_config_round_trips(config: DPConfig) -> None:
    wire = pb.DPSettings.FromString(dp_config_to_proto(config).SerializeToString())
    assert dp_config_from_proto(wire) == config


def test_unset_dp_settings_read_as_dp_config_defaults() -> None:
    assert dp_config_from_proto(pb.DPSettings(max_grad_norm=1.0)) == DPConfig()
    # batch_first is optional: an explicit false is kept, an absent one is true.
    assert dp_config_from_proto(pb.DPSettings(max_grad_norm=1.0, batch_first=False)).batch_first is False
    with pytest.raises(ConfigError, match="max_grad_norm"):
        dp_config_from_proto(pb.DPSettings())  # C = 0 is not a default but an error


def test_privacy_settings_zero_means_not_given() -> None:
    assert privacy_from_proto(pb.PrivacySettings()) == PrivacyRequest()
    given = PrivacyRequest(accountant="rdp", sample_rate=0.01, delta=1e-5, target_epsilon=3.0)
    assert privacy_from_proto(privacy_to_proto(given)) == given
    assert privacy_to_proto(PrivacyRequest()) == pb.PrivacySettings()
    for plan in (PrivacyRequest(target_epsilon=3.0, delta=1e-5, steps=120),
                 PrivacyRequest(target_epsilon=3.0, delta=1e-5, epochs=2.5)):
        assert privacy_from_proto(privacy_to_proto(plan)) == plan


def test_a_part_s_stats_say_pending() -> None:
    report = StepReport(step=0, param_version=1, samples=4, mean_loss=0.5, norm_quantiles={}, fraction_clipped=0.0,
                        epsilon_spent=0.0, budget_left=math.inf, server_seconds=0.0, pending=True)
    assert step_stats_from_proto(step_stats_to_proto(report)) == report


def test_step_stats_round_trip() -> None:
    report = StepReport(step=3, param_version=7, samples=12, mean_loss=0.5,
                        norm_quantiles={0.0: 0.1, 0.5: 0.9, 1.0: 4.0}, fraction_clipped=0.25,
                        epsilon_spent=math.inf, budget_left=math.inf, server_seconds=0.125, num_dropped=2)
    stats = step_stats_to_proto(report)
    assert stats.num_dropped == 2
    assert [q.quantile for q in stats.norm_quantiles] == [0.0, 0.5, 1.0]
    assert step_stats_from_proto(pb.StepStats.FromString(stats.SerializeToString())) == report


def test_parameter_specs() -> None:
    spec = parameter_spec_to_proto("0.weight", torch.bfloat16, (4, 3), requires_grad=False)
    assert (spec.name, spec.dtype, list(spec.shape), spec.requires_grad) == ("0.weight", "bfloat16", [4, 3], False)
    assert parameter_spec_from_proto(spec) == (torch.bfloat16, (4, 3))
    with pytest.raises(CodecError, match="cannot be sent"):
        parameter_spec_to_proto("z", torch.complex64, (1,), requires_grad=True)
    with pytest.raises(CodecError, match="unknown dtype 'float8'"):
        parameter_spec_from_proto(pb.ParameterSpec(name="w", dtype="float8", shape=[1]))


def test_names() -> None:
    assert SERVICE_NAME == "psg.v1.GradientService"
    assert [input_name(i) for i in range(2)] == ["inputs/0", "inputs/1"]
    assert input_name("mask") == INPUT_PREFIX + "mask" and TARGETS == "targets"
    reasons = {name: value for name, value in vars(Reason).items() if not name.startswith("_")}
    assert all(name == value for name, value in reasons.items())  # the wire value is the name
