"""The compose topology run for real without Docker (deploy/README.md).

The services of deploy/docker-compose.yml + deploy/docker-compose.cpu.yml (this machine has no GPU;
the CPU worker runs the GPU worker's command) start as local processes, in compose's dependency
order, each through the image's entry point (deploy/docker/entrypoint.sh), with the commands,
environment and health checks read from the compose files, so they cannot drift: `ray start
--head`, a `ray start --address` worker node, and the frontend joining the cluster and running
`psg-server --ray-address`. A dependent starts once its dependencies' compose health checks pass,
and a client then runs a DP step through the cluster.

What the test changes, and only that: ports (free ones instead of the containers' fixed ports,
since another test may run Ray on this machine), addresses (loopback instead of compose service
names), /run/secrets/* (files from deploy/make-secrets.sh run in a temporary copy), and a few
`ray start` flags a shared 2-core machine needs: a private --temp-dir, --node-ip-address=127.0.0.1,
a small object store and one CPU on the worker node. Teardown signals only the process groups it
started and the processes under its private temp dir; it never calls `ray stop`.
"""

from __future__ import annotations

import tests.ports

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from psg_client import GradientClient, RetryPolicy, ServiceError
from psg_core.config import DPConfig
from tests.integration.compose_model import (COMPOSE, COMPOSE_CPU, DEPLOY, DOCKERFILE_CPU, REPO, active_services,
                                             command_of, dependencies, environment_of, healthcheck_command,
                                             load_compose, parse_dockerfile, start_order)
from tests.server.service_harness import MLP_KWARGS, build, local_dp, mlp_batch

pytestmark = pytest.mark.timeout(420)

VENV_BIN = Path(sys.executable).parent
#: Each service gets this long to pass its health check (the compose start_period is 60-180 s).
HEALTH_DEADLINE_S = 150.0
STOP_GRACE_S = 5.0
#: Object store of each local node: the model here is tiny, and the machine is shared.
OBJECT_STORE_BYTES = 256 << 20


def _free_port() -> int:
    return tests.ports.free_port()


def _entrypoint() -> list[str]:
    """The image's ENTRYPOINT, resolved to the repository file the Dockerfile installs there."""
    instructions = parse_dockerfile(DOCKERFILE_CPU)
    (entrypoint,) = [json.loads(i.arguments) for i in instructions if i.keyword == "ENTRYPOINT"]
    installed = {}
    for copy in (i for i in instructions if i.keyword == "COPY"):
        *sources, destination = [w for w in copy.arguments.split() if not w.startswith("--")]
        installed.update({Path(destination).name: REPO / source for source in sources})
    return [str(installed[entrypoint[0]]), *entrypoint[1:]]


@dataclass
class _Service:
    name: str
    command: list[str]
    probe: list[str]
    environment: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    started_s: float = 0.0
    healthy_s: float = 0.0


@dataclass
class Topology:
    """The running services, their local addresses and the trainer token."""

    workdir: Path
    services: dict[str, _Service]
    gcs_address: str
    frontend_target: str
    token: str
    child_env: dict[str, str]
    pids_seen: set[int] = field(default_factory=set)


class _Localizer:
    """Rewrites a service's compose strings for this machine; every rewrite must apply somewhere,
    so a renamed flag in the compose file fails the test instead of silently running defaults."""

    def __init__(self, exact: Mapping[str, str], inside: Mapping[str, str],
                 optional: Mapping[str, str] | None = None) -> None:
        self._exact = dict(exact)
        self._inside = {**(optional or {}), **inside}
        self._optional = set(optional or {})
        self._used: set[str] = set()

    def __call__(self, text: str) -> str:
        if text in self._exact:
            self._used.add(text)
            return self._exact[text]
        for old, new in self._inside.items():
            if old in text:
                self._used.add(old)
                text = text.replace(old, new)
        return text

    def check_all_used(self, service: str) -> None:
        unused = (set(self._exact) | set(self._inside)) - self._used - self._optional
        assert not unused, f"{service}: the compose file no longer has {sorted(unused)}"


def _secret_files(model: Mapping[str, Any], workdir: Path) -> dict[str, str]:
    """``/run/secrets/<name>`` -> the file make-secrets.sh wrote in the temporary copy of deploy/."""
    copy = workdir / "deploy"
    copy.mkdir()
    shutil.copy2(DEPLOY / "make-secrets.sh", copy / "make-secrets.sh")
    subprocess.run(["sh", str(copy / "make-secrets.sh")], check=True, capture_output=True, timeout=30)
    files = {}
    for name, secret in model["secrets"].items():
        path = (copy / secret["file"]).resolve()
        assert path.is_file() and path.stat().st_mode & 0o077 == 0, f"make-secrets.sh did not write {path}"
        files[f"/run/secrets/{name}"] = str(path)
    return files


def _plan(workdir: Path) -> tuple[dict[str, _Service], str, str, str, dict[str, str]]:
    model = load_compose(COMPOSE, COMPOSE_CPU)
    services = active_services(model)
    secrets = _secret_files(model, workdir)
    ray_temp = workdir / "ray"
    gcs, dashboard, client_server, grpc_port, metrics = (_free_port() for _ in range(5))
    gcs_address = f"127.0.0.1:{gcs}"
    common = {"ray-head:6379": gcs_address}
    node_flags = [f"--temp-dir={ray_temp}", "--node-ip-address=127.0.0.1",
                  f"--object-store-memory={OBJECT_STORE_BYTES}"]
    plan: dict[str, _Service] = {}
    for name in start_order(services):
        service = services[name]
        agent = str(_free_port())
        exact = {"--dashboard-agent-listen-port=52365": f"--dashboard-agent-listen-port={agent}"}
        inside = dict(common)
        extra: list[str] = []
        if name == "ray-head":
            exact.update({"--port=6379": f"--port={gcs}", "--dashboard-port=8265": f"--dashboard-port={dashboard}",
                          "--ray-client-server-port=10001": f"--ray-client-server-port={client_server}",
                          "--dashboard-host=0.0.0.0": "--dashboard-host=127.0.0.1"})
            extra = node_flags
        elif name == "frontend":
            exact = {"50051": str(grpc_port), "9090": str(metrics), "0.0.0.0": "127.0.0.1",
                     "/var/lib/psg": str(workdir / "psg-state")}
            inside["127.0.0.1:50051"] = f"127.0.0.1:{grpc_port}"
        else:  # the worker node; one CPU, so the pool runs one actor on this 2-core machine
            inside["127.0.0.1:52365"] = f"127.0.0.1:{agent}"
            extra = [*node_flags, "--num-cpus=1"]
        localize = _Localizer(exact, inside, optional=secrets)
        command = [localize(arg) for arg in command_of(service)] + extra
        probe = [localize(arg) for arg in healthcheck_command(service)]
        environment = {key: localize(value) for key, value in environment_of(service).items()}
        if "PSG_RAY_JOIN" in environment:  # the frontend's own Ray node, started by the entry point
            join = [environment.get("PSG_RAY_JOIN_ARGS", ""), *node_flags, f"--dashboard-agent-listen-port={agent}"]
            environment["PSG_RAY_JOIN_ARGS"] = " ".join(part for part in join if part)
        localize.check_all_used(name)
        plan[name] = _Service(name, _entrypoint() + command, probe, environment)
    token = Path(secrets["/run/secrets/psg_tokens"]).read_text().split()[1]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PSG_"))}
    child_env["PATH"] = f"{VENV_BIN}{os.pathsep}{child_env.get('PATH', '')}"
    return plan, gcs_address, f"127.0.0.1:{grpc_port}", token, child_env


# ------------------------------------------------------------------------------- process hygiene
def _process_table() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, process group)}`` of every live process, from /proc (zombies are dead
    already; they only wait for their parent to reap them)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] not in ("Z", "X"):
                table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


def _cmdline_has(pid: int, marker: str) -> bool:
    with contextlib.suppress(OSError):
        return marker in (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    return False


def _ours(roots: set[int], marker: str) -> set[int]:
    """Processes we started: in our process groups, descending from our roots, or running under our
    private temp dir."""
    table = _process_table()
    ours = {pid for pid, (_, group) in table.items() if group in roots}
    ours |= {pid for pid in table if _cmdline_has(pid, marker)}
    frontier = set(ours | roots)
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier} - ours
        ours |= frontier
    return (ours & set(table)) - {os.getpid()}


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _start(service: _Service, topology: Topology) -> None:
    service.log = topology.workdir / f"{service.name}.log"
    with service.log.open("wb") as log:
        service.process = subprocess.Popen(service.command, env={**topology.child_env, **service.environment},
                                           cwd=topology.workdir, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    service.started_s = time.monotonic()


def _wait_healthy(service: _Service, topology: Topology) -> None:
    deadline = time.monotonic() + HEALTH_DEADLINE_S
    env = {**topology.child_env, **service.environment}
    last = ""
    while time.monotonic() < deadline:
        assert service.process is not None
        if service.process.poll() is not None:
            raise AssertionError(f"{service.name} exited with {service.process.returncode}:\n{_tail(service.log)}")
        probe = subprocess.run(service.probe, env=env, capture_output=True, text=True, timeout=60, check=False)
        if probe.returncode == 0:
            service.healthy_s = time.monotonic() - service.started_s
            return
        last = (probe.stdout + probe.stderr)[-400:]
        time.sleep(1.0)
    raise AssertionError(f"{service.name} never passed its health check {service.probe}: {last}\n"
                         f"{_tail(service.log)}")


def _stop(topology: Topology) -> None:
    marker = str(topology.workdir)
    roots = {s.process.pid for s in topology.services.values() if s.process is not None}
    doomed = _ours(roots, marker)
    for service in reversed(list(topology.services.values())):
        if service.process is not None and service.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for service in topology.services.values():
        if service.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
    deadline = time.monotonic() + 20.0
    while True:
        doomed |= _ours(roots, marker)
        _signal_all(doomed, signal.SIGKILL)
        for service in topology.services.values():
            if service.process is not None and service.process.poll() is None:
                service.process.wait(timeout=10)
        time.sleep(0.5)
        doomed = _ours(roots, marker)
        if not doomed or time.monotonic() > deadline:
            break
    assert not doomed, f"processes of the topology outlived its teardown: {sorted(doomed)}"


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    # Short path: Ray puts unix sockets under --temp-dir (limit ~107 bytes).
    workdir = Path(tempfile.mkdtemp(prefix="psgc-", dir="/tmp"))
    plan, gcs_address, target, token, child_env = _plan(workdir)
    running = Topology(workdir, plan, gcs_address, target, token, child_env)
    try:
        for service in plan.values():  # start_order: dependencies first
            model_service = active_services(load_compose(COMPOSE, COMPOSE_CPU))[service.name]
            for dependency, spec in dependencies(model_service).items():
                if dependency in plan:
                    assert spec["condition"] == "service_healthy"
                    assert plan[dependency].healthy_s > 0, f"{dependency} must be healthy before {service.name}"
            _start(service, running)
            _wait_healthy(service, running)
        yield running
    finally:
        try:
            _stop(running)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


# ----------------------------------------------------------------------------------------- tests
def test_services_start_in_compose_order_and_turn_healthy(topology: Topology) -> None:
    assert list(topology.services) == ["ray-head", "cpu-worker", "frontend"]
    assert all(service.healthy_s > 0 for service in topology.services.values())
    frontend = topology.services["frontend"]
    assert frontend.command[:2] == [str(DEPLOY / "docker" / "entrypoint.sh"), "psg-server"]
    assert "--ray-address" in frontend.command and topology.gcs_address in frontend.command


def test_a_dp_step_through_the_cluster(topology: Topology) -> None:
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.5, max_backoff_s=2.0)
    config = DPConfig(augmentation_multiplicity=2, max_grad_norm=0.7)
    model = build(seed=3)
    inputs, targets = mlp_batch(8, seed=3)  # 4 samples x K=2
    with GradientClient(topology.frontend_target, token=topology.token, retry=retry, timeout_s=120) as client:
        info = client.server_info()
        assert len(info.workers) == 1, info.workers  # one CPU on the worker node, one actor
        assert info.workers[0].device == "cpu" and "/" in info.workers[0].node  # "<ip>/<node id>"
        with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                   config=config) as session:
            session.push_parameters(model)
            result = session.compute_gradients(inputs, targets)
    local = local_dp(model, inputs, targets, config)
    assert result.samples == 4 and set(result.grads) == set(local.grads)
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, local.grads[name] / 4, rtol=1e-5, atol=1e-6)


def test_a_token_is_required(topology: Topology) -> None:
    retry = RetryPolicy(max_attempts=1)
    with GradientClient(topology.frontend_target, retry=retry, timeout_s=30) as anonymous, \
            pytest.raises(ServiceError) as err:
        anonymous.server_info()
    assert err.value.code.name == "UNAUTHENTICATED"


def test_the_kubernetes_wait_for_workers_script(topology: Topology) -> None:
    """frontend.yaml's init container, run against this cluster (CPU stands in for GPU)."""
    with (DEPLOY / "k8s" / "frontend.yaml").open() as handle:
        deployment = next(d for d in yaml.safe_load_all(handle) if d["kind"] == "Deployment")
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    env = {**topology.child_env, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": topology.services["ray-head"].environment["RAY_AUTH_TOKEN_PATH"],
           "PSG_RAY_JOIN": topology.gcs_address}
    joined = subprocess.run(init["command"], env={**env, "PSG_WAIT_RESOURCE": "CPU", "PSG_WAIT_AMOUNT": "1"},
                            capture_output=True, text=True, timeout=120, check=False)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert f"{topology.gcs_address}: 1 of 1 CPU" in joined.stdout
    missing = subprocess.run(init["command"], env={**env, "PSG_WAIT_RESOURCE": "GPU", "PSG_WAIT_TIMEOUT_S": "1"},
                             capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 1 and "gave up waiting for 1 GPU" in missing.stderr
