"""Models resident on their device, flat parameter and gradient buffers, in-place merges, the step's
device (noise where the sum is) and the --device choice. CUDA cases skip without a GPU."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from psg_core.config import DPConfig, DPGradient
from psg_core.errors import ConfigError
from psg_server.config import ServerConfig
from psg_server.executor import InProcessExecutor, ParameterSet, SessionSpec, ShardResult, ShardRunner
from psg_server.models import default_registry
from psg_server.resident import ResidentModel, check_device_name, resolve_device
from psg_server.scheduler import ShardPlan, cut_shards
from psg_server.step import merge_results, reply_tensors
from psg_wire.flat import FlatTensors
from tests.server.service_harness import MLP_KWARGS, build, local_dp, mlp_batch
from tests.devices import requires_cuda

cuda = requires_cuda  # marked ``cuda`` (``pytest -m cuda``), skipped without a device


def spec(config: DPConfig = DPConfig(max_grad_norm=0.5), session_id: str = "s") -> SessionSpec:
    parsed = default_registry().parse_kwargs("mlp", json.dumps(MLP_KWARGS))
    return SessionSpec(session_id=session_id, model="mlp", model_kwargs_json=json.dumps(parsed, sort_keys=True),
                       loss="cross_entropy", dp_config=config)


def parameters_of(model: torch.nn.Module, version: int, **kwargs: object) -> ParameterSet:
    return ParameterSet(version=version, tensors={n: p.detach().clone() for n, p in model.named_parameters()},
                        **kwargs)  # type: ignore[arg-type]


def test_device_names() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for name in ("gpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(ConfigError):
            check_device_name(name)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda:0")
    with pytest.raises(ConfigError, match="device must be"):
        ServerConfig(device="tpu")
    assert ServerConfig.from_args(["--device", "cpu"], environ={}).device == "cpu"
    assert ServerConfig.from_args([], environ={"PSG_DEVICE": "cuda:1"}).device == "cuda:1"


def test_loading_a_version_is_one_copy_into_parameters_that_stay_views_of_one_buffer() -> None:
    model = build(seed=1)
    resident = ResidentModel(model, torch.nn.CrossEntropyLoss(), torch.device("cpu"))
    first = parameters_of(build(seed=2), 1)
    resident.load(first.varying, slot="varying")
    buffer = dict(model.named_parameters())["0.weight"].untyped_storage().data_ptr()
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == {buffer}
    resident.load(parameters_of(build(seed=3), 2).varying, slot="varying")
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == {buffer}  # no new buffer
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), build(seed=3).parameters()))
    with pytest.raises(RuntimeError, match="no parameters"):
        resident.load(FlatTensors.pack({"nope": torch.zeros(1)}), slot="other")


def test_frozen_parameters_load_only_when_their_version_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ShardRunner(default_registry())
    loads: list[tuple[str, ...]] = []
    original = ResidentModel.load

    def counting(self: ResidentModel, flat: FlatTensors, *, slot: str) -> None:
        loads.append(flat.layout.names)
        original(self, flat, slot=slot)

    monkeypatch.setattr(ResidentModel, "load", counting)
    frozen = frozenset({"0.weight", "0.bias"})
    inputs, targets = mlp_batch(4)
    shard = cut_shards((inputs,), targets, ShardPlan.even(4, 1), augmentation_multiplicity=1, batch_first=True)[0]
    model = build(seed=4)
    for version, frozen_from in ((1, 1), (2, 1), (2, 1), (3, 3)):
        result = runner.run_shard(spec(), parameters_of(model, version, frozen_version=frozen_from, frozen=frozen),
                                  shard)
    assert loads == [("0.weight", "0.bias"), ("2.weight", "2.bias"), ("2.weight", "2.bias"),
                     ("0.weight", "0.bias"), ("2.weight", "2.bias")]
    expected = local_dp(model, inputs, targets, DPConfig(max_grad_norm=0.5))
    assert isinstance(result, ShardResult) and result.flat is not None
    for name, grad in expected.grads.items():
        torch.testing.assert_close(result.grads[name], grad)
        assert result.grads[name].untyped_storage().data_ptr() == result.flat.buffer.untyped_storage().data_ptr()
    assert result.timings.compute > 0 and result.timings.copy_in >= 0 and result.timings.copy_out >= 0


def test_flat_results_merge_in_place_in_shard_order_exactly_as_dpgradient_merge() -> None:
    runner = ShardRunner(default_registry())
    model = build(seed=5)
    inputs, targets = mlp_batch(9, seed=1)
    shards = cut_shards((inputs,), targets, ShardPlan.even(9, 3), augmentation_multiplicity=1, batch_first=True)
    results = [runner.run_shard(spec(), parameters_of(model, 1), shard) for shard in shards]
    reference = DPGradient.merge([DPGradient(grads={n: g.clone() for n, g in r.grads.items()},
                                             per_sample_norms=r.per_sample_norms, loss_sum=r.loss_sum,
                                             num_samples=r.num_samples, num_clipped=r.num_clipped) for r in results])
    first = results[0].flat.buffer.data_ptr()  # type: ignore[union-attr]
    merged = merge_results(results)
    assert next(iter(merged.grads.values())).untyped_storage().data_ptr() == first  # summed in place
    assert all(torch.equal(merged.grads[n], g) for n, g in reference.grads.items())  # bit for bit
    assert torch.equal(merged.per_sample_norms, reference.per_sample_norms)
    assert (merged.num_samples, merged.loss_sum) == (reference.num_samples, reference.loss_sum)


def test_reply_tensors_are_host_views_or_one_flat_buffer() -> None:
    grads = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    assert reply_tensors(grads, dtype=None) is grads
    half = reply_tensors(grads, dtype=torch.bfloat16)
    assert isinstance(half, FlatTensors) and half.layout.num_bytes == 64 + 4
    assert torch.equal(half.views()["w"], grads["w"].to(torch.bfloat16))


def test_the_in_process_executor_computes_on_its_device() -> None:
    executor = InProcessExecutor(default_registry(), device="cpu")
    assert executor.device == torch.device("cpu") and not executor.pinned_inputs
    asyncio.run(executor.start())
    try:
        assert executor.workers()[0].device == "cpu"
    finally:
        asyncio.run(executor.close())


@cuda
def test_cuda_in_process_executor_keeps_results_on_the_gpu_and_equals_the_cpu() -> None:
    model = build(seed=6)
    inputs, targets = mlp_batch(8)
    shards = cut_shards((inputs,), targets, ShardPlan.even(8, 2), augmentation_multiplicity=1, batch_first=True)

    async def run(device: str) -> list[ShardResult]:
        executor = InProcessExecutor(default_registry(), device=device)
        await executor.start()
        try:
            return await executor.run(spec(), parameters_of(model, 1), shards)
        finally:
            await executor.close()

    on_gpu, on_cpu = asyncio.run(run("cuda")), asyncio.run(run("cpu"))
    assert all(r.flat is not None and r.flat.device.type == "cuda" for r in on_gpu)
    merged_gpu, merged_cpu = merge_results(on_gpu), merge_results(on_cpu)
    for name, grad in merged_cpu.grads.items():
        torch.testing.assert_close(merged_gpu.grads[name].cpu(), grad, rtol=1e-4, atol=1e-6)
    host = reply_tensors(merged_gpu.grads, dtype=None)
    assert isinstance(host, FlatTensors) and host.device.type == "cpu"


@cuda
def test_cuda_runner_loads_parameters_from_pinned_memory() -> None:
    runner = ShardRunner(default_registry(), "cuda")
    parameters = parameters_of(build(seed=7), 1)
    pinned = FlatTensors(parameters.varying.layout, parameters.varying.buffer.pin_memory())
    pinned_set = ParameterSet(version=1, tensors=pinned.views())
    inputs, targets = mlp_batch(4)
    shard = cut_shards((inputs,), targets, ShardPlan.even(4, 1), augmentation_multiplicity=1, batch_first=True)[0]
    result = runner.run_shard(spec(), pinned_set, shard)
    assert result.flat is not None and result.flat.device.type == "cpu" and result.flat.buffer.is_pinned()
    expected = local_dp(build(seed=7), inputs, targets, DPConfig(max_grad_norm=0.5))
    for name, grad in expected.grads.items():
        torch.testing.assert_close(result.grads[name], grad, rtol=1e-4, atol=1e-6)


@cuda
def test_noise_is_drawn_where_the_sum_is_and_reproducible_per_device_type() -> None:
    from tests.server.service_harness import client_for, serve

    inputs, targets = mlp_batch(8)
    config = DPConfig(max_grad_norm=0.5, noise_multiplier=1.0)
    grads: dict[str, list[dict[str, torch.Tensor]]] = {}
    for device in ("cuda", "cuda", "cpu"):
        with serve(device=device) as server, client_for(server) as client:
            session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                            expected_batch_size=8, config=config, seed=7, delta=1e-5)
            result = session.compute_gradients(inputs, targets, parameters=build(), step_seed=3)
            grads.setdefault(device, []).append(result.grads)
    first, second = grads["cuda"]
    assert all(torch.equal(first[name], second[name]) for name in first)  # same seeds, same noise
    assert not all(torch.equal(first[name], grads["cpu"][0][name]) for name in first)  # another generator
