"""Eight trainers at once, twenty steps each, every answer correct."""

from __future__ import annotations

import concurrent.futures

import torch

from psg_core.config import DPConfig
from tests.server.service_harness import MLP_KWARGS, build, client_for, local_dp, mlp_batch, serve

CLIENTS = 8
STEPS = 20


def test_eight_concurrent_clients_twenty_steps_each() -> None:
    with serve(num_workers=2, max_shard_samples=3) as server:

        def trainer(index: int) -> int:
            config = DPConfig(augmentation_multiplicity=1 + index % 2, max_grad_norm=0.5 + index / 10)
            K = config.augmentation_multiplicity
            model = build(seed=index)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            with client_for(server) as client, \
                    client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                          expected_batch_size=4, config=config) as session:
                for step in range(STEPS):
                    inputs, targets = mlp_batch(4 * K, seed=1000 * index + step)
                    session.push_parameters(model)
                    result = session.compute_gradients(inputs, targets)
                    local = local_dp(model, inputs, targets, config)
                    for name, grad in result.grads.items():
                        torch.testing.assert_close(grad, local.grads[name] / 4, rtol=1e-5, atol=1e-6)
                    assert (result.step, result.param_version, result.samples) == (step + 1, step + 1, 4)
                    result.apply_to(model)
                    optimizer.step()
                return session.info().steps

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            steps = list(pool.map(trainer, range(CLIENTS)))
    assert steps == [STEPS] * CLIENTS
