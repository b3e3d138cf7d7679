"""End to end over real sockets: a trainer runs DP steps through the service, and the service's
answer equals psg_core's dp_gradient on the whole batch, for every backend and K in {1, 2}."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import grpc
import pytest
import torch

from psg_client import GradientClient, ServiceError
from psg_core.config import DPConfig
from psg_server.background import BackgroundServer
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_wire.v1 import gradient_service_pb2_grpc as pb_grpc
from tests.server.service_harness import MLP_KWARGS, build, client_for, local_dp, mlp_batch, serve

MODES = ("hooks", "functorch", "ew", "ghost")


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    # Two worker threads and at most 2 samples per shard: every step is split and merged.
    with serve(num_workers=2, max_shard_samples=2) as running:
        yield running


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[GradientClient]:
    with client_for(server) as connected:
        yield connected


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_noise_free_gradient_equals_local_dp_gradient(client: GradientClient, mode: str, K: int) -> None:
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.7)
    model = build(seed=K)
    expected_batch_size = 6
    with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                               expected_batch_size=expected_batch_size, config=config) as session:
        assert session.push_parameters(model) == 1
        inputs, targets = mlp_batch(5 * K, seed=K)
        result = session.compute_gradients(inputs, targets)
    local = local_dp(model, inputs, targets, config)
    assert set(result.grads) == set(local.grads)
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, local.grads[name] / expected_batch_size, rtol=1e-5, atol=1e-6)
    assert (result.step, result.param_version, result.samples) == (1, 1, 5)
    assert result.mean_loss == pytest.approx(local.loss_sum / 5, rel=1e-5)
    assert result.fraction_clipped == pytest.approx(local.num_clipped / 5)
    quantiles = torch.quantile(local.per_sample_norms.double(), torch.tensor(list(result.norm_quantiles),
                                                                             dtype=torch.float64))
    assert list(result.norm_quantiles.values()) == pytest.approx(quantiles.tolist(), rel=1e-5)
    assert math.isinf(result.epsilon_spent) and math.isinf(result.budget_left)


@pytest.mark.parametrize("name, kwargs, inputs", [
    ("cnn_groupnorm", {"in_channels": 1, "image_size": 8, "channels": [4], "groups": 2, "num_classes": 3},
     lambda g: torch.randn(8, 1, 8, 8, generator=g)),
    ("transformer_classifier", {"vocab_size": 11, "max_len": 5, "d_model": 8, "num_heads": 2, "num_layers": 1,
                                "dim_feedforward": 8, "num_classes": 3},
     lambda g: torch.randint(0, 11, (8, 5), generator=g)),
    ("lstm_classifier", {"vocab_size": 11, "max_len": 5, "embed_dim": 4, "hidden_size": 4, "num_classes": 3},
     lambda g: torch.randint(0, 11, (8, 4), generator=g)),
    ("embedding_bag_classifier", {"vocab_size": 11, "max_len": 5, "embed_dim": 4, "num_classes": 3},
     lambda g: torch.randint(0, 11, (8, 5), generator=g)),
])
def test_builtin_architectures_through_the_service(client: GradientClient, name: str, kwargs: dict[str, object],
                                                   inputs: object) -> None:
    config = DPConfig(augmentation_multiplicity=2, max_grad_norm=0.5)
    model = build(name, kwargs)
    generator = torch.Generator().manual_seed(1)
    x = inputs(generator)  # type: ignore[operator]
    y = torch.randint(0, 3, (8,), generator=generator)
    with client.create_session(name, model_kwargs=kwargs, loss="cross_entropy", expected_batch_size=4,
                               config=config) as session:
        session.push_parameters(model)
        result = session.compute_gradients(x, y)
    local = local_dp(model, x, y, config)
    for key, grad in result.grads.items():
        torch.testing.assert_close(grad, local.grads[key] / 4, rtol=1e-4, atol=1e-6)


def test_a_trainer_runs_private_steps_and_the_noise_is_reproducible(client: GradientClient) -> None:
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.8)
    options = dict(model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=8, config=config,
                   sample_rate=0.05, delta=1e-5, seed=1234)
    model = build(seed=3)
    replay = build(seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replay_optimizer = torch.optim.SGD(replay.parameters(), lr=0.1)
    epsilons = []
    with client.create_session("mlp", **options) as session, \
            client.create_session("mlp", **options) as twin:
        for step in range(1, 4):
            inputs, targets = mlp_batch(8, seed=step)
            session.push_parameters(model)
            result = session.compute_gradients(inputs, targets)
            twin.push_parameters(replay)
            twin_result = twin.compute_gradients(inputs, targets)
            # same session seed and step index: bit-identical noise
            for name in result.grads:
                assert torch.equal(result.grads[name], twin_result.grads[name])
            result.apply_to(model)
            twin_result.apply_to(replay)
            optimizer.step()
            replay_optimizer.step()
            assert (result.step, result.param_version) == (step, step)
            epsilons.append(result.epsilon_spent)
        assert epsilons == sorted(epsilons) and 0 < epsilons[0] < epsilons[-1] < math.inf
        info = session.info()
        assert (info.steps, info.param_version) == (3, 3) and info.epsilon_spent == pytest.approx(epsilons[-1])
        # noise has the calibrated size: the noised gradient differs from the clipped sum / B
        inputs, targets = mlp_batch(8, seed=9)
        noisy = session.compute_gradients(inputs, targets, step_seed=7)
        again = twin.compute_gradients(inputs, targets, step_seed=7)
        other = twin.compute_gradients(inputs, targets, step_seed=8)
    local = local_dp(model, inputs, targets, config)
    noise = torch.cat([(noisy.grads[n] * 8 - local.grads[n]).flatten() for n in local.grads])
    assert noise.std().item() == pytest.approx(0.8 * 1.0, rel=0.25)
    assert all(torch.equal(noisy.grads[n], again.grads[n]) for n in noisy.grads)
    assert not torch.equal(noisy.grads["0.weight"], other.grads["0.weight"])


def test_secure_rng_sessions_never_repeat_noise(client: GradientClient) -> None:
    config = DPConfig(noise_multiplier=1.0)
    model = build()
    inputs, targets = mlp_batch(4)
    results = []
    for _ in range(2):
        with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                   config=config, delta=1e-5, seed=5, secure_rng=True) as session:
            session.push_parameters(model)
            results.append(session.compute_gradients(inputs, targets, step_seed=1))
    assert not torch.equal(results[0].grads["0.weight"], results[1].grads["0.weight"])


def test_sum_reduction_is_not_normalised_and_per_layer_bounds_are_honoured(client: GradientClient) -> None:
    config = DPConfig(loss_reduction="sum", clipping="per_layer", per_layer_max_grad_norms=(0.1, 0.2, 0.3, 0.4))
    model = build()
    inputs, targets = mlp_batch(6)
    with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=3,
                               config=config) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, targets)
    local = local_dp(model, inputs, targets, config)
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, local.grads[name], rtol=1e-5, atol=1e-6)


def test_other_losses_and_inputs_of_other_dtypes(client: GradientClient) -> None:
    config = DPConfig(max_grad_norm=2.0)
    model = build()
    inputs, _ = mlp_batch(4)
    for loss, targets in (("mse", torch.randn(4, 3, dtype=torch.float64)),
                          ("bce_with_logits", torch.rand(4, 3)),
                          ("nll", torch.tensor([0, 1, 2, 1], dtype=torch.int32))):
        with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss=loss, expected_batch_size=4,
                                   config=config) as session:
            session.push_parameters(model)
            result = session.compute_gradients(inputs.double(), targets)  # cast on the server
        cast = targets.float() if targets.is_floating_point() else targets.long()
        local = local_dp(model, inputs, cast, config, loss=loss)
        for name, grad in result.grads.items():
            torch.testing.assert_close(grad, local.grads[name] / 4, rtol=1e-5, atol=1e-6)


def test_server_info_models_and_session_lifecycle(client: GradientClient, server: BackgroundServer) -> None:
    info = client.server_info()
    assert set(info.backends) == set(MODES) and info.limits.max_message_bytes == 4 << 20
    assert [w.device for w in info.workers] == ["cpu", "cpu"]
    assert set(info.losses) == {"cross_entropy", "nll", "mse", "bce_with_logits", "token_cross_entropy", "causal_lm"}
    models = {m.name: m for m in client.list_models()}
    assert {"mlp", "cnn_groupnorm", "resnet_groupnorm", "transformer_classifier", "lstm_classifier",
            "embedding_bag_classifier", "hf_causal_lm", "hf_sequence_classification"} <= set(models)
    hidden = next(a for a in models["mlp"].arguments if a.name == "hidden")
    assert (hidden.type, hidden.default_json, hidden.required) == ("list[int]", "[128]", False)
    # parameters at the default arguments, trainable ones marked; none where an argument is required
    assert [(p.name, list(p.shape), p.requires_grad) for p in models["mlp"].parameters] == [
        ("0.weight", [128, 784], True), ("0.bias", [128], True), ("2.weight", [10, 128], True), ("2.bias", [10], True)]
    assert not models["hf_causal_lm"].parameters and models["hf_causal_lm"].arguments[0].name == "model_type"
    # the input signature at the default arguments: what a client builds its batches by
    (image,) = models["mlp"].signature.inputs
    assert (image.name, image.kind, [(d.min, d.max) for d in image.row_shape], image.required) == \
        ("inputs/0", "float", [(784, 784)], True)
    assert models["mlp"].signature.num_outputs == 10 and not models["mlp"].signature.targets_like
    (tokens,) = models["transformer_classifier"].signature.inputs
    assert tokens.kind == "index" and tokens.num_embeddings > 0 and tokens.row_shape[0].min == 1
    assert not models["hf_causal_lm"].HasField("signature")  # no default config: CreateSession tells
    assert info.default_accountant == "rdp"
    assert info.limits.max_chunk_bytes == info.limits.max_message_bytes - (64 << 10) >= info.limits.chunk_bytes
    with grpc.insecure_channel(server.target) as channel:
        created = pb_grpc.GradientServiceStub(channel).CreateSession(pb.CreateSessionRequest(
            model="mlp", model_kwargs_json=json.dumps(MLP_KWARGS), loss="cross_entropy", expected_batch_size=2,
            dp=pb.DPSettings(max_grad_norm=1.0)), timeout=30)
        assert [(d.min, d.max) for d in created.signature.inputs[0].row_shape] == [(6, 6)]
        assert created.signature.num_outputs == 3
        client.session(created.session_id).close()
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
    assert list(session.parameter_specs) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    attached = client.session(session.id)
    assert attached.parameter_specs == session.parameter_specs and attached.param_version == 0
    session.close()
    with pytest.raises(ServiceError) as err:
        session.info()
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_empty_poisson_batch_is_a_step_with_noise_only() -> None:
    # Poisson sampling draws empty batches; they still cost a step of privacy and carry noise.
    with serve(num_workers=2) as running, client_for(running) as client:
        config = DPConfig(max_grad_norm=1.0, noise_multiplier=1.0)
        with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                   config=config, sample_rate=0.01, delta=1e-5, seed=3) as session:
            model = build(seed=1)
            session.push_parameters(model)
            inputs, targets = mlp_batch(0)
            result = session.compute_gradients(inputs, targets, step_seed=0)
            assert (result.samples, result.step) == (1 - 1, 1)
            assert math.isfinite(result.epsilon_spent) and result.epsilon_spent > 0
            for name, param in model.named_parameters():
                grad = result.grads[name]
                assert grad.shape == param.shape and bool(torch.isfinite(grad).all())
                assert grad.abs().sum() > 0  # noise sigma*C/B per coordinate, nothing else
            assert math.isnan(result.mean_loss) or result.mean_loss == 0.0


@pytest.mark.parametrize("K", [1, 2])
def test_sequence_first_plugin_model_with_token_targets(K: int) -> None:
    from tests.server.plugin_models import seq_first_tagger

    with serve(num_workers=2, max_shard_samples=2, model_plugins=("tests.server.plugin_models",)) as running, \
            client_for(running) as client:
        config = DPConfig(augmentation_multiplicity=K, max_grad_norm=0.5, batch_first=False)
        torch.manual_seed(K)
        model = seq_first_tagger()
        generator = torch.Generator().manual_seed(K)
        tokens = torch.randint(0, 11, (4, 3 * K), generator=generator)  # (T, N*K)
        labels = torch.randint(0, 3, (4, 3 * K), generator=generator)  # (T, N*K)
        with client.create_session("seq_first_tagger", loss="cross_entropy", expected_batch_size=3,
                                   config=config) as session:
            session.push_parameters(model)
            result = session.compute_gradients(tokens, labels)
        local = local_dp(model, tokens, labels, config)
        assert result.samples == 3
        for name, grad in result.grads.items():
            torch.testing.assert_close(grad, local.grads[name] / 3, rtol=1e-5, atol=1e-6)
        assert result.mean_loss == pytest.approx(local.loss_sum / 3, rel=1e-5)
