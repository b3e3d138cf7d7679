"""Adaptive clipping through the service (CreateSessionRequest.adaptive_clipping): a real server over
real gRPC gives what psg_core.DPStep gives in process with the same settings and the same noise
seeds (gradient, released unclipped fraction, bound sequence, epsilon), over a logical batch sent in
parts too; the bound survives a restart of the frontend; bad settings are INVALID_ARGUMENT."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from psg_client import GradientClient, GradientResult, QuantileClipping, RetryPolicy, ServiceError, Session
from psg_core.accounting import PrivacyAccountant
from psg_core.adaptive_clipping import gradient_noise_multiplier, updated_bound
from psg_core.config import DPConfig
from psg_core.dp_step import DPStep
from psg_server.config import ServerConfig
from psg_server.losses import get_loss
from psg_server.models import default_registry
from psg_server.sessions import open_session as open_server_session
from psg_server.state import DATABASE_NAME, SCHEMA_VERSION, SessionDatabase
from psg_wire.codec import FrameWire
from psg_wire.convert import dp_config_to_proto
from psg_wire.names import Reason
from psg_wire.v1 import gradient_service_pb2 as pb
from tests.ports import free_port
from tests.server.service_harness import MLP_KWARGS, build, client_for, mlp_batch, serve

SEED = 5
SAMPLE_RATE = 0.02
DELTA = 1e-5
EXPECTED_BATCH = 12
CLIPPING = QuantileClipping(target_quantile=0.6, learning_rate=0.3, count_noise_multiplier=2.0)


def create(client: GradientClient, config: DPConfig, clipping: QuantileClipping | None = CLIPPING,
           **kwargs: Any) -> Session:
    kwargs.setdefault("seed", SEED)
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                    expected_batch_size=EXPECTED_BATCH, config=config, sample_rate=SAMPLE_RATE,
                                    delta=DELTA, accountant="rdp", adaptive_clipping=clipping, **kwargs)
    session.push_parameters(build())
    return session


def noise_seeds(config: DPConfig, step_seeds: list[int]) -> list[int]:
    """The seeds of the service's per-step generators: the server's own scheme
    (Session.noise_seed, tested in test_sessions.py) for a session of seed SEED."""
    request = pb.CreateSessionRequest(model="mlp", model_kwargs_json=json.dumps(MLP_KWARGS), loss="cross_entropy",
                                      expected_batch_size=EXPECTED_BATCH, dp=dp_config_to_proto(config), seed=SEED,
                                      privacy=pb.PrivacySettings(sample_rate=SAMPLE_RATE, delta=DELTA))
    session = open_server_session(request, owner="test", registry=default_registry(), config=ServerConfig())
    return [session.noise_seed(step_seed) for step_seed in step_seeds]


def in_process(config: DPConfig) -> DPStep:
    return DPStep(build(), loss_fn=get_loss("cross_entropy").build(), config=config, sample_rate=SAMPLE_RATE,
                  expected_batch_size=EXPECTED_BATCH, accountant=PrivacyAccountant("rdp"),
                  adaptive_clipping=CLIPPING)


def assert_equal_in_process(results: list[GradientResult], local: DPStep,
                            batches: list[tuple[torch.Tensor, torch.Tensor]], step_seeds: list[int]) -> None:
    """The service's ``results`` are what ``local`` (a fresh DPStep) releases on the same batches,
    its generator seeded per step as the service seeds its own: bound, fraction, next bound, gradient."""
    for result, (inputs, targets), seed in zip(results, batches, noise_seeds(local.config, step_seeds)):
        bound = local.config.max_grad_norm
        local.generator = torch.Generator().manual_seed(seed)
        local(inputs, targets)
        assert result.clip_bound == bound
        assert result.unclipped_fraction == pytest.approx(local.unclipped_fraction, rel=1e-12)
        assert result.next_clip_bound == pytest.approx(local.config.max_grad_norm, rel=1e-12)
        for name, param in local.model.named_parameters():
            torch.testing.assert_close(result.grads[name], param.grad, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the service equals DPStep in process
@pytest.mark.parametrize("noise_multiplier", [0.0, 1.0])
def test_steps_equal_dp_step_in_process_with_the_same_noise_seeds(noise_multiplier: float) -> None:
    config = DPConfig(noise_multiplier=noise_multiplier, max_grad_norm=0.5)
    step_seeds = [7, 8, 9, 10]
    local = in_process(config)
    batches = [mlp_batch(rows, seed=index) for index, rows in enumerate([12, 9, 15, 11])]
    with serve(num_workers=2, max_shard_samples=4) as server, client_for(server) as client:  # several shards
        session = create(client, config)
        assert session.clip_bound == 0.5 and session.adaptive_clipping == CLIPPING
        results = [session.compute_gradients(inputs, targets, step_seed=step_seed)
                   for (inputs, targets), step_seed in zip(batches, step_seeds)]
        info = session.info()
    assert_equal_in_process(results, local, batches, step_seeds)
    bounds = [result.clip_bound for result in results]
    assert len(set(bounds)) == len(bounds)  # the bound moved every step ...
    for result, following in zip(results, results[1:]):  # ... by the update rule, on the released fraction
        assert following.clip_bound == result.next_clip_bound
        assert result.next_clip_bound == updated_bound(result.clip_bound, unclipped_fraction=result.unclipped_fraction,
                                                       clipping=CLIPPING)
    assert session.clip_bound == info.clip_bound == results[-1].next_clip_bound
    assert info.dp.max_grad_norm == 0.5  # the bound the session started at
    if noise_multiplier:  # gradient and count: one mechanism accounted at z, as in process
        expected = PrivacyAccountant("rdp")
        expected.step(noise_multiplier, SAMPLE_RATE, num_steps=len(results))
        assert results[-1].epsilon_spent == pytest.approx(local.epsilon(DELTA), rel=1e-12)
        assert results[-1].epsilon_spent == pytest.approx(expected.epsilon(DELTA), rel=1e-12)
    else:
        assert math.isinf(results[-1].epsilon_spent)


def test_the_gradient_pays_for_the_count_with_more_noise() -> None:
    """Same seeds, same batch: with adaptive clipping the gradient's noise is the plain session's
    scaled by gradient_noise_multiplier(z, count sigma) / z."""
    config = DPConfig(noise_multiplier=1.0, max_grad_norm=0.5)
    inputs, targets = mlp_batch(12)
    wide = QuantileClipping(count_noise_multiplier=0.6)
    factor = gradient_noise_multiplier(1.0, 0.6)  # (1 - 1/1.2^2)^-1/2 = 1.809
    assert factor == pytest.approx(1.809, abs=1e-3)
    with serve() as server, client_for(server) as client:
        plain = create(client, config, clipping=None).compute_gradients(inputs, targets, step_seed=1)
        adaptive = create(client, config, clipping=wide).compute_gradients(inputs, targets, step_seed=1)
        exact = create(client, DPConfig(max_grad_norm=0.5), clipping=None).compute_gradients(inputs, targets)
    assert plain.clip_bound is None and plain.next_clip_bound is None and plain.unclipped_fraction is None
    assert adaptive.epsilon_spent == plain.epsilon_spent
    for name, grad in exact.grads.items():
        torch.testing.assert_close(adaptive.grads[name] - grad, (plain.grads[name] - grad) * factor, rtol=1e-4,
                                   atol=1e-5)


def test_ray_workers_clip_at_the_session_s_current_bound(ray_session: Any) -> None:
    """The bound travels with each shard to the Ray actors (their resident model stays, built for
    the spec the session opened with): the pool's steps equal the in-process executor's."""
    from psg_server.pool import WorkerPool

    config = DPConfig(noise_multiplier=1.0, max_grad_norm=0.5)
    batches = [mlp_batch(rows, seed=index) for index, rows in enumerate([12, 9, 15])]
    step_seeds = [1, 2, 3]
    pool = WorkerPool(num_workers=2, probe_interval_s=0.5)
    with serve(executor=pool, max_shard_samples=4) as running, client_for(running) as client:
        session = create(client, config)
        results = [session.compute_gradients(inputs, targets, step_seed=step_seed)
                   for (inputs, targets), step_seed in zip(batches, step_seeds)]
    assert len({result.clip_bound for result in results}) == 3
    assert_equal_in_process(results, in_process(config), batches, step_seeds)


# ----------------------------------------------------------------------------- gradient accumulation
def test_a_logical_batch_in_parts_counts_every_sample_and_moves_the_bound_once() -> None:
    config = DPConfig(noise_multiplier=1.0, max_grad_norm=0.5)
    inputs, targets = mlp_batch(21)
    with serve() as server, client_for(server) as client:
        whole_session = create(client, config)
        whole = [whole_session.compute_gradients(inputs, targets, step_seed=s) for s in (3, 4)]
        parts_session = create(client, config)
        parts = [parts_session.compute_gradients(inputs, targets, step_seed=s, max_rows=4) for s in (3, 4)]
        pending = raw_part(client, parts_session, part=0, more_parts=True)
        info = parts_session.info()
    for one, split in zip(whole, parts):
        assert (split.samples, split.clip_bound) == (21, one.clip_bound)
        assert split.unclipped_fraction == pytest.approx(one.unclipped_fraction, rel=1e-12)
        assert split.next_clip_bound == pytest.approx(one.next_clip_bound, rel=1e-12)
        assert split.epsilon_spent == one.epsilon_spent
        for name, grad in one.grads.items():
            torch.testing.assert_close(split.grads[name], grad, rtol=1e-5, atol=1e-6)
    assert info.steps == 2 and info.clip_bound == parts[-1].next_clip_bound  # one update per logical batch
    # A part that is not the last: clipped at the current bound, nothing released.
    assert pending.pending and pending.clip_bound == parts[-1].next_clip_bound
    assert not pending.HasField("next_clip_bound") and not pending.HasField("unclipped_fraction")


def raw_part(client: GradientClient, session: Session, *, part: int, more_parts: bool) -> pb.StepStats:
    """One request of a logical batch, sent by hand: its stats."""
    inputs, targets = mlp_batch(4)
    header = pb.ComputeGradientsHeader(session_id=session.id, param_version=session.param_version, part=part,
                                       more_parts=more_parts)
    frames = FrameWire(pb.ComputeGradientsRequest).messages([("inputs/0", inputs), ("targets", targets)],
                                                            chunk_bytes=1 << 20)

    def invoke(stub: Any, kw: dict[str, Any]) -> pb.StepStats:
        replies = stub.ComputeGradients(iter([pb.ComputeGradientsRequest(header=header), *frames]), **kw)
        return next(iter(replies)).stats

    return client.call(invoke)


# ---------------------------------------------------------------------------------- noise sources
def test_the_count_noise_follows_the_seeds_or_the_secure_source() -> None:
    config = DPConfig(noise_multiplier=1.0, max_grad_norm=0.5)
    inputs, targets = mlp_batch(12)
    with serve() as server, client_for(server) as client:
        seeded = [create(client, config).compute_gradients(inputs, targets, step_seed=2) for _ in range(2)]
        other_step = create(client, config).compute_gradients(inputs, targets, step_seed=3)
        secure = [create(client, config, secure_rng=True).compute_gradients(inputs, targets, step_seed=2)
                  for _ in range(2)]
    assert seeded[0].unclipped_fraction == seeded[1].unclipped_fraction  # reproducible from the seeds
    assert other_step.unclipped_fraction != seeded[0].unclipped_fraction
    fractions = {result.unclipped_fraction for result in [*secure, seeded[0]]}
    assert len(fractions) == 3  # the CSPRNG ignores the seeds
    assert all(result.clip_bound == 0.5 and result.next_clip_bound != 0.5 for result in secure)


# ---------------------------------------------------------------------------------------- restarts
def test_the_bound_survives_a_restart_of_the_frontend(tmp_path: Path) -> None:
    config = DPConfig(noise_multiplier=1.0, max_grad_norm=0.5)
    inputs, targets = mlp_batch(12)
    port = free_port()
    patient = RetryPolicy(max_attempts=30, initial_backoff_s=0.05, max_backoff_s=0.5)
    with serve(port=port, state_dir=tmp_path) as server:
        client = client_for(server, retry=patient)
        control = create(client, config)  # the same session, never interrupted
        expected = [control.compute_gradients(inputs, targets) for _ in range(4)]
        session = create(client, config)
        before = [session.compute_gradients(inputs, targets) for _ in range(3)]
    with sqlite3.connect(tmp_path / DATABASE_NAME) as connection:
        stored = dict(connection.execute("SELECT session_id, clip_bound FROM sessions").fetchall())
    assert stored[session.id] == before[-1].next_clip_bound  # written before the step's reply
    with serve(port=port, state_dir=tmp_path):
        info = session.info()
        assert (info.steps, info.clip_bound) == (3, before[-1].next_clip_bound)
        assert info.adaptive_clipping == pb.AdaptiveClippingSettings(target_quantile=0.6, learning_rate=0.3,
                                                                     count_noise_multiplier=2.0)
        attached = client.session(session.id)
        assert (attached.adaptive_clipping, attached.clip_bound) == (CLIPPING, before[-1].next_clip_bound)
        fourth = session.compute_gradients(inputs, targets)  # pushes again (PARAMETERS_MISSING), goes on
    client.close()
    assert [r.clip_bound for r in [*before, fourth]] == [r.clip_bound for r in expected]
    assert (fourth.step, fourth.next_clip_bound, fourth.epsilon_spent) == \
        (4, expected[-1].next_clip_bound, expected[-1].epsilon_spent)
    for name, grad in expected[-1].grads.items():
        torch.testing.assert_close(fourth.grads[name], grad)


def test_a_version_1_database_is_upgraded_in_place(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / DATABASE_NAME) as connection:
        connection.executescript("""
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '1');
            CREATE TABLE sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, request BLOB NOT NULL,
                                   steps INTEGER NOT NULL, ledger TEXT, epsilon_spent REAL NOT NULL,
                                   param_version INTEGER NOT NULL, updated REAL NOT NULL);
            INSERT INTO sessions VALUES ('old', 'alice', x'', 3, NULL, 0.0, 2, 0.0);
        """)
    connection.close()
    database = SessionDatabase(tmp_path)
    [old] = database.load()
    assert (old.session_id, old.steps, old.clip_bound, old.step_seeds) == ("old", 3, None, ((1, 3),))
    database.save_progress("old", steps=4, ledger=None, epsilon_spent=0.0, param_version=2, clip_bound=0.75)
    assert database.load()[0].clip_bound == 0.75
    database.close()
    with sqlite3.connect(tmp_path / DATABASE_NAME) as connection:
        version = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    connection.close()
    assert version == str(SCHEMA_VERSION) == "3"
    SessionDatabase(tmp_path).close()  # opens as it is now


# ------------------------------------------------------------------------------------- bad settings
@pytest.mark.parametrize("dp, settings, message", [
    (pb.DPSettings(max_grad_norm=1.0, clipping="per_layer", noise_multiplier=1.0),
     pb.AdaptiveClippingSettings(count_noise_multiplier=5.0), "adaptive clipping moves one flat bound; got "
                                                              "clipping='per_layer'"),
    (pb.DPSettings(max_grad_norm=1.0, clipping="automatic"),
     pb.AdaptiveClippingSettings(count_noise_multiplier=5.0), "clipping='automatic'"),
    (pb.DPSettings(max_grad_norm=1.0, noise_multiplier=1.0),
     pb.AdaptiveClippingSettings(target_quantile=1.5, count_noise_multiplier=5.0),
     r"target_quantile must be a number in \(0.0, 1.0\), got 1.5"),
    (pb.DPSettings(max_grad_norm=1.0, noise_multiplier=1.0),
     pb.AdaptiveClippingSettings(learning_rate=-0.1, count_noise_multiplier=5.0), "learning_rate must be"),
    (pb.DPSettings(max_grad_norm=1.0, noise_multiplier=1.0),
     pb.AdaptiveClippingSettings(count_noise_multiplier=float("nan")), "count_noise_multiplier must be"),
    (pb.DPSettings(max_grad_norm=1.0, noise_multiplier=1.0),
     pb.AdaptiveClippingSettings(target_quantile=0.5), "count_noise_multiplier is required"),
    (pb.DPSettings(max_grad_norm=1.0, noise_multiplier=2.0),
     pb.AdaptiveClippingSettings(count_noise_multiplier=1.0),
     r"count_noise_multiplier \(1.0\) must exceed half the noise multiplier \(2.0\)"),
])
def test_bad_settings_are_invalid_argument(dp: pb.DPSettings, settings: pb.AdaptiveClippingSettings,
                                           message: str) -> None:
    request = pb.CreateSessionRequest(model="mlp", model_kwargs_json=json.dumps(MLP_KWARGS), loss="cross_entropy",
                                      expected_batch_size=8, dp=dp, adaptive_clipping=settings,
                                      privacy=pb.PrivacySettings(sample_rate=0.1, delta=1e-5))
    with serve() as server, client_for(server) as client:
        with pytest.raises(ServiceError, match=message) as refused:
            client.call(lambda stub, kw: stub.CreateSession(request, **kw))
        assert client.call(lambda stub, kw: stub.GetServerInfo(pb.GetServerInfoRequest(), **kw)).version
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_REQUEST)
    assert refused.value.details.startswith("CreateSession: ")


def test_the_count_noise_is_checked_against_the_calibrated_sigma() -> None:
    with serve() as server, client_for(server) as client:
        with pytest.raises(ServiceError, match="must exceed half the noise multiplier") as refused:
            client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=8,
                                  config=DPConfig(max_grad_norm=1.0), sample_rate=0.5, delta=1e-5,
                                  target_epsilon=0.5, steps=100,  # a large sigma
                                  adaptive_clipping=QuantileClipping(count_noise_multiplier=1.0))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_session_without_adaptive_clipping_reports_none() -> None:
    inputs, targets = mlp_batch(6)
    with serve() as server, client_for(server) as client:
        session = create(client, DPConfig(noise_multiplier=1.0, max_grad_norm=0.5), clipping=None)
        result = session.compute_gradients(inputs, targets)
        info = session.info()
    assert (result.clip_bound, result.next_clip_bound, result.unclipped_fraction) == (None, None, None)
    assert session.clip_bound is None and session.adaptive_clipping is None
    assert not info.HasField("adaptive_clipping") and info.clip_bound == 0.0
