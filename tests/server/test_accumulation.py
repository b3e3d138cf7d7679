"""Gradient accumulation through the service: a logical batch sent as several requests is noised and
accounted once, and gives the result of the same batch sent whole (same seed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from psg_client import ServiceError, Session
from psg_client.batches import split_named_batch
from psg_core.config import DPConfig
from psg_core.errors import ConfigError
from psg_server.accumulation import PendingBatch, check_part
from psg_server.errors import AccumulationLostError
from psg_wire.codec import FrameWire
from psg_wire.names import Reason
from psg_wire.v1 import gradient_service_pb2 as pb
from tests.server.service_harness import MLP_KWARGS, build, client_for, mlp_batch, serve


def open_session(client: Any, config: DPConfig) -> Session:
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=16,
                                    config=config, sample_rate=0.1, delta=1e-5, seed=11)
    session.push_parameters(build())
    return session


@pytest.mark.parametrize("K", [1, 2])
def test_parts_release_the_whole_batch_s_step(K: int) -> None:
    config = DPConfig(noise_multiplier=1.1, max_grad_norm=0.5, augmentation_multiplicity=K)
    inputs, targets = mlp_batch(23 * K)
    with serve() as server, client_for(server) as client:
        whole = open_session(client, config).compute_gradients(inputs, targets, step_seed=4)
        session = open_session(client, config)
        parts = session.compute_gradients(inputs, targets, step_seed=4, max_rows=5 * K)  # 5 requests
        info = session.info()
    for name, grad in whole.grads.items():
        torch.testing.assert_close(parts.grads[name], grad, rtol=1e-5, atol=1e-6)
    assert (parts.step, parts.samples, parts.param_version) == (whole.step, whole.samples, 1) == (1, 23, 1)
    assert parts.epsilon_spent == whole.epsilon_spent and info.steps == 1  # accounted once
    assert parts.mean_loss == pytest.approx(whole.mean_loss, rel=1e-5)
    assert parts.fraction_clipped == whole.fraction_clipped
    assert parts.norm_quantiles == pytest.approx(whole.norm_quantiles, rel=1e-5)


def test_parts_carry_a_logical_batch_past_the_server_s_row_limit() -> None:
    inputs, targets = mlp_batch(20)
    with serve(max_batch_rows=8) as server, client_for(server) as client:
        session = open_session(client, DPConfig(noise_multiplier=1.0))
        with pytest.raises(ServiceError) as refused:
            session.compute_gradients(inputs, targets)
        assert refused.value.reason == Reason.LIMIT_EXCEEDED
        by_bytes = session.compute_gradients(inputs, targets, max_bytes=8 * (6 * 4 + 8))  # 8 samples' bytes
        by_rows = session.compute_gradients(inputs, targets, max_rows=8)
        assert (by_bytes.samples, by_rows.samples, by_rows.step) == (20, 20, 2)


def raw_part(client: Any, session: Session, part: int, more_parts: bool, rows: int = 4) -> pb.StepStats:
    """One request of a logical batch, sent by hand: its stats."""
    inputs, targets = mlp_batch(rows)
    header = pb.ComputeGradientsHeader(session_id=session.id, param_version=session.param_version, part=part,
                                       more_parts=more_parts)
    named = [("inputs/0", inputs), ("targets", targets)]
    frames = list(FrameWire(pb.ComputeGradientsRequest).messages(named, chunk_bytes=1 << 20))

    def invoke(stub: Any, kw: dict[str, Any]) -> pb.StepStats:
        replies = stub.ComputeGradients(iter([pb.ComputeGradientsRequest(header=header), *frames]), **kw)
        return next(iter(replies)).stats

    return client.call(invoke)


def test_a_part_replies_with_its_statistics_and_accounts_nothing() -> None:
    with serve() as server, client_for(server) as client:
        session = open_session(client, DPConfig(noise_multiplier=1.0))
        first = raw_part(client, session, 0, True, rows=3)
        assert (first.pending, first.step, first.samples, first.epsilon_spent) == (True, 0, 3, 0.0)
        assert session.info().steps == 0
        last = raw_part(client, session, 1, False, rows=2)
        assert (last.pending, last.step, last.samples) == (False, 1, 5) and last.epsilon_spent > 0


def test_a_part_without_its_predecessors_is_refused() -> None:
    with serve() as server, client_for(server) as client:
        session = open_session(client, DPConfig(noise_multiplier=1.0))
        with pytest.raises(ServiceError) as lost:
            raw_part(client, session, 1, False)
        assert lost.value.reason == Reason.ACCUMULATION_LOST and lost.value.code.name == "FAILED_PRECONDITION"
        raw_part(client, session, 0, True)
        with pytest.raises(ServiceError, match="part 2"):
            raw_part(client, session, 2, False)  # part 1 is missing
        assert session.info().steps == 0


def test_the_pending_batch_follows_parts_and_versions() -> None:
    check_part(None, part=0, param_version=1, session_id="s")
    pending = PendingBatch(param_version=1, parts=2)
    check_part(pending, part=2, param_version=1, session_id="s")
    for part, version in ((1, 1), (3, 1), (2, 2)):
        with pytest.raises(AccumulationLostError):
            check_part(pending, part=part, param_version=version, session_id="s")


def test_the_client_splits_whole_samples_within_both_budgets() -> None:
    inputs = torch.zeros(12, 5)  # float32: 20 bytes a row
    targets = torch.zeros(12, dtype=torch.int64)  # 8 bytes a row
    named = [("inputs/0", inputs), ("targets", targets)]
    sizes = lambda parts: [part[0][1].shape[0] for part in parts]  # noqa: E731
    assert sizes(split_named_batch(named, max_rows=5, augmentation_multiplicity=2)) == [4, 4, 4]
    assert sizes(split_named_batch(named, max_bytes=3 * 28)) == [3, 3, 3, 3]
    assert sizes(split_named_batch(named, max_rows=7, max_bytes=5 * 28)) == [5, 5, 2]
    assert sizes(split_named_batch(named, max_rows=12)) == [12]
    time_major = [("inputs/0", torch.zeros(3, 12, 5)), ("targets", targets)]  # targets: (N*K,) labels
    parts = split_named_batch(time_major, max_rows=5, batch_first=False)
    assert [tuple(part[0][1].shape) for part in parts] == [(3, 5, 5), (3, 5, 5), (3, 2, 5)]
    assert [tuple(part[1][1].shape) for part in parts] == [(5,), (5,), (2,)]
    with pytest.raises(ConfigError, match="below one sample"):
        split_named_batch(named, max_rows=1, augmentation_multiplicity=2)
    with pytest.raises(ConfigError, match="below one sample"):
        split_named_batch(named, max_bytes=10)
    with pytest.raises(ConfigError, match="rows"):
        split_named_batch([("inputs/0", torch.zeros(5, 2)), ("targets", targets)], max_rows=4)
