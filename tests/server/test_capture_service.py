"""Captured steps through the service (CreateSessionRequest.capture): a real server over real gRPC
releases, step for step, the gradients of an eager session with the same model, seeds and batches,
while its workers replay their recorded steps (counted in psg_captured_shards_total, and in the
runner's CapturedStep stats); capture with adaptive clipping is INVALID_ARGUMENT; the flag is in
GetSession and survives a restart of the frontend. The runner's captured step is made per cached
model, dropped with it, and made again when the parameters move to new buffers."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from psg_client import GradientClient, QuantileClipping, RetryPolicy, ServiceError, Session
from psg_core.config import DPConfig
from psg_server.background import BackgroundServer
from psg_server.executor import CAPTURE_PAD_MULTIPLE, CAPTURE_PATHS, ParameterSet, SessionSpec, ShardRunner
from psg_server.models import default_registry
from psg_server.scheduler import ShardPlan, cut_shards
from psg_server.transport import TensorPayload
from psg_wire.names import Reason
from tests.ports import free_port
from tests.server.service_harness import MLP_KWARGS, build, client_for, local_dp, mlp_batch, serve

SEED = 11
CONFIG = DPConfig(max_grad_norm=0.5, noise_multiplier=1.0)


def create(client: GradientClient, *, capture: bool, config: DPConfig = CONFIG, **kwargs: Any) -> Session:
    return client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=12,
                                 config=config, sample_rate=0.01, delta=1e-5, seed=SEED, capture=capture, **kwargs)


def captured_shards(server: BackgroundServer) -> dict[str, float]:
    """psg_captured_shards_total by path, from the server's Prometheus registry."""
    registry = server.server.metrics.registry  # type: ignore[union-attr]
    counts = {path: registry.get_sample_value("psg_captured_shards_total", {"path": path}) for path in CAPTURE_PATHS}
    return {path: count for path, count in counts.items() if count}


@pytest.mark.parametrize("sizes", [[12] * 5, [12, 9, 11, 7, 10]])
def test_a_captured_session_releases_the_eager_gradients_and_replays(sizes: list[int]) -> None:
    """Two workers, two shards a step (each worker records its own): with parameters pushed between
    steps, the captured session's released (noised, normalised) gradients are the eager one's.
    Poisson batches vary in size: the shards are padded to a multiple of CAPTURE_PAD_MULTIPLE
    samples (the padding weighing nothing), so that each worker still replays one recording."""
    model = build(seed=3)
    batches = [mlp_batch(size, seed=index) for index, size in enumerate(sizes)]
    assert 6 <= CAPTURE_PAD_MULTIPLE  # (every shard, of at most 6 samples, is padded to one shape)
    with serve(num_workers=2, max_shard_samples=6) as server, client_for(server) as client:
        sessions = {capture: create(client, capture=capture) for capture in (False, True)}
        assert sessions[True].capture and not sessions[False].capture
        results: dict[bool, list[Any]] = {False: [], True: []}
        for step, (inputs, targets) in enumerate(batches):
            with torch.no_grad():  # a new version each step, as after an optimizer step
                for param in model.parameters():
                    param.mul_(0.9).add_(0.01 * (step + 1))
            for capture, session in sessions.items():
                session.push_parameters(model)
                results[capture].append(session.compute_gradients(inputs, targets, step_seed=step))
        counts = captured_shards(server)
        infos = {capture: session.info() for capture, session in sessions.items()}
    for eager, captured in zip(results[False], results[True]):
        assert (captured.step, captured.samples, captured.fraction_clipped) == \
            (eager.step, eager.samples, eager.fraction_clipped)
        assert captured.mean_loss == pytest.approx(eager.mean_loss, rel=1e-6)
        assert captured.epsilon_spent == eager.epsilon_spent
        for name, grad in eager.grads.items():
            torch.testing.assert_close(captured.grads[name], grad, rtol=1e-5, atol=1e-7)
    # Each worker: an eager step, a recording and a checked step, then replays; the eager session
    # counts nothing.
    assert counts == {"eager": 2, "recorded": 2, "validated": 2, "replayed": 4}
    assert infos[True].capture and not infos[False].capture


def test_the_runner_keeps_one_captured_step_per_cached_model() -> None:
    """Made lazily for a session with capture (none for one without, nor for a shard with its own
    bound), reused across versions, dropped on release, made again when the parameters are
    re-homed; every result equals dp_gradient on the shard."""
    registry = default_registry()
    kwargs = json.dumps(registry.parse_kwargs("mlp", json.dumps(MLP_KWARGS)), sort_keys=True)
    config = DPConfig(max_grad_norm=0.5)
    captured_spec = SessionSpec(session_id="c", model="mlp", model_kwargs_json=kwargs, loss="cross_entropy",
                                dp_config=config, capture=True)
    eager_spec = SessionSpec(session_id="e", model="mlp", model_kwargs_json=kwargs, loss="cross_entropy",
                             dp_config=config)
    runner = ShardRunner(registry)
    model = build(seed=4)

    def run(spec: SessionSpec, version: int, seed: int, **parameters: Any) -> Any:
        with torch.no_grad():  # a new version of the parameters that travel with each version
            for name, param in model.named_parameters():
                if name not in parameters.get("frozen", ()):
                    param.add_(0.01)
        inputs, targets = mlp_batch(6, seed=seed)
        shard = cut_shards((inputs,), targets, ShardPlan.even(6, 1), augmentation_multiplicity=1,
                           batch_first=True)[0]
        tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
        result = runner.run_shard(spec, ParameterSet(version=version, tensors=tensors, **parameters), shard)
        expected = local_dp(model, inputs, targets, config)
        for name, grad in expected.grads.items():
            torch.testing.assert_close(result.grads[name], grad, rtol=1e-5, atol=1e-7)
        return result

    paths = [run(captured_spec, version, seed=version).capture_path for version in range(1, 5)]
    assert paths == ["eager", "recorded", "validated", "replayed"]
    assert run(eager_spec, 1, seed=9).capture_path is None
    assert runner.capture_stats() == {"c": {"eager": 1, "recorded": 1, "validated": 1, "replayed": 1,
                                            "refused": 0, "reruns": 0}}
    # The result crosses Ray's object store with its path (the pool's metrics count it too).
    last = run(captured_spec, 5, seed=5)
    assert pickle.loads(pickle.dumps(TensorPayload(last), protocol=5)).capture_path == "replayed"
    # A shard with its own bound (adaptive clipping's, which a captured session never has) runs eagerly.
    inputs, targets = mlp_batch(6, seed=1)
    bounded = cut_shards((inputs,), targets, ShardPlan.even(6, 1), augmentation_multiplicity=1,
                         batch_first=True)[0]
    bounded = type(bounded)(index=0, inputs=bounded.inputs, targets=bounded.targets, max_grad_norm=0.25)
    tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert runner.run_shard(captured_spec, ParameterSet(version=6, tensors=tensors), bounded).capture_path is None
    # New parameter buffers (the frozen split changed the layout): a new captured step.
    frozen = frozenset({"0.weight", "0.bias"})
    assert run(captured_spec, 7, seed=7, frozen_version=7, frozen=frozen).capture_path == "eager"
    assert [run(captured_spec, version, seed=version, frozen_version=7, frozen=frozen).capture_path
            for version in (8, 9, 10)] == ["recorded", "validated", "replayed"]
    runner.release("c")
    assert runner.capture_stats() == {} and runner.sessions() == ["e"]


def test_capture_with_adaptive_clipping_is_invalid_argument() -> None:
    with serve() as server, client_for(server) as client:
        with pytest.raises(ServiceError, match="capture and adaptive_clipping cannot go together") as refused:
            create(client, capture=True, adaptive_clipping=QuantileClipping(count_noise_multiplier=2.0))
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_REQUEST)
    assert refused.value.details.startswith("CreateSession: ")
    assert "moves the clipping bound every step" in refused.value.details


def test_the_flag_is_in_get_session_and_survives_a_restart(tmp_path: Path) -> None:
    inputs, targets = mlp_batch(12)
    port = free_port()
    patient = RetryPolicy(max_attempts=30, initial_backoff_s=0.05, max_backoff_s=0.5)
    with serve(port=port, state_dir=tmp_path) as server:
        client = client_for(server, retry=patient)
        captured, eager = create(client, capture=True), create(client, capture=False)
        for session in (captured, eager):
            session.push_parameters(build())
            session.compute_gradients(inputs, targets, step_seed=1)
    with serve(port=port, state_dir=tmp_path) as server:
        assert captured.info().capture and not eager.info().capture
        attached = client.session(captured.id)
        assert attached.capture and not client.session(eager.id).capture
        second = [session.compute_gradients(inputs, targets, step_seed=2) for session in (captured, eager)]
        counts = captured_shards(server)
    client.close()
    assert second[0].step == second[1].step == 2
    for name, grad in second[1].grads.items():
        torch.testing.assert_close(second[0].grads[name], grad, rtol=1e-5, atol=1e-7)
    assert counts == {"eager": 1}  # the reopened session's shard went through a (new) captured step
