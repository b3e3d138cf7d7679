"""state_dict / load_state_dict of PrivacyAccountant and DPStep: JSON values, versioned, and a
torch.save / torch.load round trip that resumes the ledger (and the noise) exactly."""

from __future__ import annotations

import copy
import io
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from psg_core.accounting import STATE_VERSION, PrivacyAccountant
from psg_core.config import DPConfig
from psg_core.dp_step import DPStep
from psg_core.errors import BudgetExhaustedError, ConfigError

FAST_PLD = 1e-3
README = Path(__file__).resolve().parents[2] / "README.md"


def used_accountant() -> PrivacyAccountant:
    accountant = PrivacyAccountant("pld", target_epsilon=8.0, target_delta=1e-5,
                                   value_discretization_interval=FAST_PLD)
    accountant.step(1.1, 0.01, num_steps=30)
    accountant.step(0.9, 0.02, num_steps=5)
    accountant.step(1.1, 0.01)
    return accountant


def torch_round_trip(value: object) -> object:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only (torch's default): plain values only


def test_accountant_state_is_json_and_resumes_the_ledger_exactly() -> None:
    accountant = used_accountant()
    state = accountant.state_dict()
    assert state["version"] == STATE_VERSION
    restored_state = json.loads(json.dumps(state))
    assert restored_state == state
    resumed = PrivacyAccountant("rdp")
    resumed.load_state_dict(restored_state)
    assert resumed.history == accountant.history == [(1.1, 0.01, 31), (0.9, 0.02, 5)]
    assert (resumed.method, resumed.target_epsilon, resumed.target_delta, resumed.value_discretization_interval) \
        == (accountant.method, 8.0, 1e-5, FAST_PLD)
    assert resumed.epsilon() == accountant.epsilon()
    # The last step's mechanism is the default of steps_within_budget: it is resumed too.
    assert resumed.steps_within_budget() == accountant.steps_within_budget()


def test_accountant_survives_torch_save_and_pickle() -> None:
    accountant = used_accountant()
    resumed = PrivacyAccountant()
    resumed.load_state_dict(torch_round_trip({"accountant": accountant.state_dict()})["accountant"])  # type: ignore[index]
    assert resumed.state_dict() == accountant.state_dict()
    unpickled = pickle.loads(pickle.dumps(accountant))
    assert unpickled.state_dict() == accountant.state_dict() and unpickled.epsilon() == accountant.epsilon()
    unpickled.step(1.1, 0.01)  # a working accountant (its lock was rebuilt)
    assert unpickled.steps == accountant.steps + 1


def test_a_resumed_budget_still_refuses() -> None:
    accountant = PrivacyAccountant("rdp", target_epsilon=1.0, target_delta=1e-5)
    allowed = accountant.steps_within_budget(noise_multiplier=2.0, sample_rate=0.01)
    assert allowed > 0
    accountant.step(2.0, 0.01, num_steps=allowed)
    resumed = PrivacyAccountant()
    resumed.load_state_dict(accountant.state_dict())
    with pytest.raises(BudgetExhaustedError):
        resumed.step(2.0, 0.01)


@pytest.mark.parametrize(("change", "match"), [
    ({"version": 99}, "version 99 is not supported"),
    ({"format": "something else"}, "not a PrivacyAccountant state"),
    ({"ledger": [[1.0, 2.0, 3]]}, "sample_rate"),
    ({"ledger": [[1.0, 0.1, 0]]}, "num_steps"),
    ({"ledger": [[1.0, 0.1]]}, "malformed"),
    ({"method": "moments"}, "method"),
    ({"last": [2.0, 0.5]}, "not in the ledger"),
    ({"target_delta": None}, "both"),
])
def test_bad_accountant_states_change_nothing(change: dict[str, object], match: str) -> None:
    accountant = used_accountant()
    before = accountant.state_dict()
    with pytest.raises(ConfigError, match=match):
        accountant.load_state_dict({**before, **change})
    assert accountant.state_dict() == before
    with pytest.raises(ConfigError, match="not a PrivacyAccountant state"):
        accountant.load_state_dict([1, 2])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- DPStep
def make_run(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, DPStep]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(max_grad_norm=0.7, noise_multiplier=1.3),
                  sample_rate=0.05, expected_batch_size=4.0,
                  accountant=PrivacyAccountant("rdp", target_epsilon=50.0, target_delta=1e-5),
                  generator=torch.Generator().manual_seed(123))
    return model, optimizer, step


def train(model: nn.Module, optimizer: torch.optim.Optimizer, step: DPStep, batches: list[tuple[torch.Tensor, ...]]
          ) -> None:
    for inputs, targets in batches:
        optimizer.zero_grad()
        step(inputs, targets)
        optimizer.step()


def test_a_training_checkpoint_resumes_ledger_noise_and_parameters_exactly() -> None:
    data = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4, 4, generator=data), torch.randn(4, 2, generator=data)) for _ in range(5)]
    model, optimizer, step = make_run()
    train(model, optimizer, step, batches[:3])
    checkpoint = torch_round_trip({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                   "dp_step": step.state_dict()})
    json.dumps(step.state_dict())  # JSON values only
    train(model, optimizer, step, batches[3:])  # the uninterrupted run

    resumed_model, resumed_optimizer, resumed_step = make_run(seed=1)  # different weights and generator
    resumed_step.generator = None  # the saved generator state makes a new generator
    resumed_model.load_state_dict(checkpoint["model"])  # type: ignore[index]
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])  # type: ignore[index]
    resumed_step.load_state_dict(checkpoint["dp_step"])  # type: ignore[index]
    assert resumed_step.accountant.steps == 3
    train(resumed_model, resumed_optimizer, resumed_step, batches[3:])

    assert resumed_step.accountant.history == step.accountant.history == [(1.3, 0.05, 5)]
    assert resumed_step.epsilon() == step.epsilon()
    for mine, theirs in zip(resumed_model.parameters(), model.parameters()):
        assert torch.equal(mine, theirs)


def test_dp_step_state_restores_the_settings() -> None:
    _, _, step = make_run()
    step.config = DPConfig(mode="functorch", augmentation_multiplicity=2, loss_reduction="sum", batch_first=False,
                           clipping="per_layer", per_layer_max_grad_norms=(1.0, 2.0, 3.0, 4.0), noise_multiplier=0.8)
    other = DPStep(nn.Linear(2, 2), loss_fn=nn.MSELoss(), config=DPConfig(), sample_rate=1.0, expected_batch_size=1.0)
    other.load_state_dict(json.loads(json.dumps(step.state_dict())))
    assert other.config == step.config
    assert (other.sample_rate, other.expected_batch_size, other.secure_rng) == (0.05, 4.0, False)
    assert other.accountant.state_dict() == step.accountant.state_dict()
    assert other.generator is not None and torch.equal(other.generator.get_state(), step.generator.get_state())


def test_bad_dp_step_states_change_nothing() -> None:
    _, _, step = make_run()
    state = step.state_dict()
    before = copy.deepcopy(state)
    for bad, match in ((dict(state, version=2), "version 2"), (dict(state, sample_rate=3.0), "sample_rate"),
                       (dict(state, config={**state["config"], "clipping": "none"}), "clipping"),
                       (dict(state, accountant={}), "PrivacyAccountant"), ({}, "not a DPStep state")):
        with pytest.raises(ConfigError, match=match):
            step.load_state_dict(bad)
        assert step.state_dict() == before


@pytest.mark.slow  # the example calibrates sigma under PLD for 2340 planned steps (seconds)
def test_the_readme_s_in_process_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = README.read_text().split("### DP-SGD in process", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    loader = [(torch.randn(rows, 784), torch.randint(0, 10, (rows,))) for rows in (70, 0, 40)]
    namespace: dict[str, object] = {"model": model, "poisson_loader": loader,
                                    "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), str(README), "exec"), namespace)  # noqa: S102 - our own README
    step = namespace["step"]
    assert isinstance(step, DPStep) and step.accountant.steps == 3 and step.config.noise_multiplier > 0
    assert step.accountant.target_epsilon == 3.0 and step.epsilon() <= 3.0
