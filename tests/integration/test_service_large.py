"""A parameter set larger than 64 MiB crosses a server whose max message size is 4 MiB: tensors
travel in chunks both ways."""

from __future__ import annotations

import torch

from psg_core.config import DPConfig
from tests.server.service_harness import build, client_for, local_dp, serve

# 4096*4096 + 4096 + 4096*16 + 16 = 16,846,864 float32 parameters = 67,387,456 bytes > 64 MiB.
BIG = {"in_features": 4096, "hidden": [4096], "num_classes": 16}


def test_parameter_set_over_64_mib_round_trips_under_a_4_mib_message_limit() -> None:
    model = build("mlp", BIG)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total > 64 << 20
    config = DPConfig(max_grad_norm=1e3)  # no clipping: the gradient keeps its full size and detail
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2, 4096, generator=generator)
    targets = torch.tensor([3, 11])
    with serve(max_message_bytes=4 << 20, chunk_bytes=1 << 20) as server, \
            client_for(server, max_message_bytes=4 << 20) as client:
        assert client.server_info().limits.max_message_bytes == 4 << 20
        with client.create_session("mlp", model_kwargs=BIG, loss="cross_entropy", expected_batch_size=2,
                                   config=config) as session:
            session.push_parameters(model)
            result = session.compute_gradients(inputs, targets)
    local = local_dp(model, inputs, targets, config)
    assert sum(g.numel() * g.element_size() for g in result.grads.values()) == total
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, local.grads[name] / 2, rtol=1e-5, atol=1e-7)
