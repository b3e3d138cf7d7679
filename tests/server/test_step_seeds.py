"""No two steps of a session draw the same noise: a step seed an earlier step used (the step index
counts as the seed of a step sent without one) is refused with FAILED_PRECONDITION
(STEP_SEED_REUSED) before anything is computed or charged, across restarts too. Sessions draw
distinct noise unless the caller gives them the same explicit seed, which replays a run."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import grpc
import pytest
import torch

from psg_client import GradientClient, ServiceError, Session
from psg_core.config import DPConfig
from psg_server.state import DATABASE_NAME, SCHEMA_VERSION, SessionDatabase
from psg_server.step_seeds import MAX_STEP_SEED, UsedSeeds
from psg_wire.names import Reason
from tests.ports import free_port
from tests.server.service_harness import MLP_KWARGS, build, client_for, mlp_batch, serve

NOISY = DPConfig(max_grad_norm=1.0, noise_multiplier=1.0)


# ------------------------------------------------------------------------------- the used seeds
def test_used_seeds_are_a_set_kept_as_runs() -> None:
    generator = random.Random(0)
    for _ in range(50):
        used, plain = UsedSeeds(), set()
        for _ in range(60):
            seed = generator.choice([generator.randrange(40), generator.randrange(MAX_STEP_SEED + 1),
                                     MAX_STEP_SEED, 0])
            would = used.run_with(seed)
            assert used.add(seed) == would and would[0] <= seed <= would[1]
            plain.add(seed)
            runs = used.runs()
            assert all(high + 1 < low for (_, high), (low, _) in zip(runs, runs[1:]))  # sorted, apart
            assert len(used) == len(plain)
            for probe in [*plain, *(generator.randrange(42) for _ in range(5))]:
                assert (probe in used) == (probe in plain)
            assert UsedSeeds(runs).runs() == runs
    assert UsedSeeds([(5, 7), (1, 4), (9, 9)]).runs() == [(1, 7), (9, 9)]
    with pytest.raises(ValueError, match="outside"):
        UsedSeeds().add(MAX_STEP_SEED + 1)


# ---------------------------------------------------------------------------------- the service
def open_noisy(client: GradientClient, config: DPConfig = NOISY, **kwargs: object) -> Session:
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                    config=config, delta=1e-5, **kwargs)  # type: ignore[arg-type]
    session.push_parameters(build())
    return session


def refused(session: Session, step_seed: int | None, **kwargs: object) -> str:
    """Runs a step that must be refused as a reused seed, checks it charged nothing; its message."""
    before = session.info()
    with pytest.raises(ServiceError) as err:
        session.compute_gradients(*mlp_batch(8, seed=9), step_seed=step_seed, **kwargs)  # type: ignore[arg-type]
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.STEP_SEED_REUSED)
    after = session.info()
    assert (after.steps, after.epsilon_spent) == (before.steps, before.epsilon_spent)
    return err.value.details


def test_a_step_seed_is_used_once_per_session(client: GradientClient) -> None:
    session = open_noisy(client)
    first = session.compute_gradients(*mlp_batch(4, seed=1), step_seed=7)
    details = refused(session, 7)  # other data, same noise: the difference would be noise-free
    assert f"this step of session {session.id!r} would use step_seed 7, which an earlier step" in details
    assert "the same noise" in details
    again = session.compute_gradients(*mlp_batch(4, seed=2), step_seed=8)
    assert (first.step, again.step) == (1, 2)


def test_the_step_index_is_the_seed_of_a_step_sent_without_one(client: GradientClient) -> None:
    session = open_noisy(client)
    session.compute_gradients(*mlp_batch(4, seed=1), step_seed=2)  # step 1
    # Step 2 without a seed would use its index, 2: the noise of step 1.
    details = refused(session, None)
    assert "its default step seed 2 (its step index; the request gives no step_seed)" in details
    assert session.compute_gradients(*mlp_batch(4, seed=2), step_seed=9).step == 2
    # Unset seeds after steps that never set one are always new.
    fresh = open_noisy(client)
    assert [fresh.compute_gradients(*mlp_batch(4, seed=s)).step for s in range(3)] == [1, 2, 3]
    refused(fresh, 3)  # ... and an explicit one equal to a used index is refused
    assert fresh.compute_gradients(*mlp_batch(4), step_seed=4).step == 4


def test_a_reused_seed_on_the_last_part_of_a_logical_batch_is_refused(client: GradientClient) -> None:
    session = open_noisy(client)
    session.compute_gradients(*mlp_batch(4, seed=1), step_seed=5)
    details = refused(session, 5, max_rows=3)  # parts of 3, 3 and 2 rows: the last one releases
    assert "step_seed 5" in details
    assert session.compute_gradients(*mlp_batch(8, seed=9), step_seed=6, max_rows=3).samples == 8


def test_seeds_that_draw_no_seeded_noise_are_not_restricted(client: GradientClient) -> None:
    for session in (open_noisy(client, DPConfig(max_grad_norm=1.0)), open_noisy(client, secure_rng=True)):
        assert [session.compute_gradients(*mlp_batch(4, seed=s), step_seed=1).step for s in (1, 2)] == [1, 2]


def test_sessions_draw_distinct_noise_unless_given_the_same_seed(client: GradientClient) -> None:
    inputs, targets = mlp_batch(4, seed=3)
    unseeded = [open_noisy(client).compute_gradients(inputs, targets, step_seed=1) for _ in range(2)]
    assert not torch.equal(unseeded[0].grads["0.weight"], unseeded[1].grads["0.weight"])
    # The same explicit seed replays a run: the same noise for the same step seeds (or indices).
    replays = [open_noisy(client, seed=42) for _ in range(2)]
    for step_seed in (None, 9, None):
        results = [session.compute_gradients(inputs, targets, step_seed=step_seed) for session in replays]
        assert results[0].step == results[1].step
        assert all(torch.equal(results[0].grads[name], results[1].grads[name]) for name in results[0].grads)


def test_used_seeds_survive_a_restart(tmp_path: Path) -> None:
    port = free_port()
    with serve(port=port, state_dir=tmp_path) as running, client_for(running) as client:
        session = open_noisy(client)
        for step_seed in (None, None, 10, 12, 11):  # the runs 1..2 and 10..12
            session.compute_gradients(*mlp_batch(4), step_seed=step_seed)
        session_id = session.id
    with sqlite3.connect(tmp_path / DATABASE_NAME) as connection:
        stored = connection.execute("SELECT low, high FROM step_seeds WHERE session_id = ? ORDER BY low",
                                    (session_id,)).fetchall()
    connection.close()
    assert [(low + 2**63, high + 2**63) for low, high in stored] == [(1, 2), (10, 12)]
    with serve(port=port, state_dir=tmp_path) as running, client_for(running) as client:
        session = client.session(session_id)
        session.push_parameters(build())
        for step_seed in (1, 2, 11, None):  # None: index 6 is free, then 6 is taken
            if step_seed is None:
                assert session.compute_gradients(*mlp_batch(4)).step == 6
            else:
                refused(session, step_seed)
        refused(session, 6)
        assert session.compute_gradients(*mlp_batch(4), step_seed=2**64 - 1).step == 7  # the largest uint64


def test_a_version_2_database_is_upgraded_with_the_default_seeds_used(tmp_path: Path) -> None:
    SessionDatabase(tmp_path).close()
    with sqlite3.connect(tmp_path / DATABASE_NAME) as connection:
        connection.executescript("""
            DROP TABLE step_seeds;
            UPDATE meta SET value = '2' WHERE key = 'schema_version';
            INSERT INTO sessions VALUES ('old', 'alice', x'', 3, NULL, 0.0, 2, 0.0, NULL);
            INSERT INTO sessions VALUES ('new', 'alice', x'', 0, NULL, 0.0, 0, 0.0, NULL);
        """)
    connection.close()
    database = SessionDatabase(tmp_path)
    records = {record.session_id: record for record in database.load()}
    assert (records["old"].step_seeds, records["new"].step_seeds) == (((1, 3),), ())
    database.save_progress("old", steps=4, ledger=None, epsilon_spent=0.0, param_version=2, step_seeds=(1, 4))
    assert database.load()[-1].step_seeds == ((1, 4),)
    database.delete("old")
    with sqlite3.connect(tmp_path / DATABASE_NAME) as connection:
        assert connection.execute("SELECT COUNT(*) FROM step_seeds").fetchone()[0] == 0
        assert connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == \
            str(SCHEMA_VERSION) == "3"
    connection.close()
    database.close()
