"""``make deploy-check``: the CPU compose stack built and run for real, as an operator runs it.

Runs with Docker Compose v2 (a reachable Docker daemon) or podman + podman-compose, whichever is
present (``--engine`` picks one), from the repository root, in these phases, each printed with its
time:

=========  ===========================================================================================
engine     which engine and compose runs it, and their versions
build      the CPU image (deploy/docker/Dockerfile.cpu, ``--build-arg`` passed through), and its size
up         deploy/docker-compose.yml + docker-compose.cpu.yml + docker-compose.cores.yml (one
           core per worker replica: PSG_WORKER_CPUS=1) under a project of its own (``psg-check``),
           with a test token and Ray token of its own and free host ports; waits until every
           container is healthy and the frontend serves
store      every Ray node's object store was sized by the entry point to fit its /dev/shm, and none
           fell back to disk ("This will harm performance")
steps      a client session (token required; a call without it is refused): DP steps without
           noise; the first gradient equals ``psg_core.dp_gradient`` run here, in-process
scale      ``--scale cpu-worker=3``: the running frontend gives the new workers actors (no restart),
           and steps go on until every worker container ran shards (Ray's task list, by node)
faults     steps back to back while one worker container is stopped (SIGTERM: Ray drains it, psg
           moves its work away; the stop must end well before the 30 s drain) and another is
           SIGKILLed (the engine restarts it): no step may fail; prints the slowest step
restart    the frontend restarted after a worker left: its pool counts the live workers only
down       ``down -v``: containers, network and volume gone
=========  ===========================================================================================

Not part of ``make test``: CI has no container engine. Exits 0 when every check passed, 1
otherwise; the stack is torn down either way (``--keep`` leaves it up to look around).

Example (this machine, podman; PyTorch's CPU index unreachable, so torch comes from a local index
baked into the base image, deploy/README.md "Engines this was run on")::

    make deploy-check DEPLOY_CHECK_ARGS="--build-arg TORCH_INDEX_URL=file:///opt/torch-cpu/simple"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
#: The CPU stack, with one core per worker replica (the way to add cores with --scale).
COMPOSE_FILES = (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.cpu.yml", DEPLOY / "docker-compose.cores.yml")
DOCKERFILE_CPU = DEPLOY / "docker" / "Dockerfile.cpu"
IMAGE = "psg:0.1.0-cpu"
PROJECT = "psg-check"
#: The model of the session: small enough for a shared 2-core host, big enough to shard.
IN_FEATURES, NUM_CLASSES = 32, 10
MODEL, MODEL_KWARGS = "mlp", {"in_features": IN_FEATURES, "hidden": [64], "num_classes": NUM_CLASSES}
#: How the check's steps run: batch (samples), clipping bound.
BATCH, MAX_GRAD_NORM = 512, 4.0
#: The fault phase's batch: steps long enough that the faults hit shards in flight.
FAULT_BATCH = 8192
#: Ray's drain on SIGTERM (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S): a stop must end well before it.
RAY_DRAIN_S = 30.0


class CheckFailed(Exception):
    """A check of the deployment failed; the message says which and what was seen."""


# ------------------------------------------------------------------------------------ engines
@dataclass
class Engine:
    """The container engine and its compose, as commands."""

    name: str  # "docker" or "podman"
    engine: list[str]
    compose: list[str]
    versions: str
    #: podman without systemd runs no health checks by itself: the check runs them (healthcheck run).
    manual_health: bool = False
    workdir: Path | None = None

    def run(self, *args: str, check: bool = True, timeout: float = 600.0,
            capture: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self.engine, *args], check=check, timeout=timeout, capture=capture)

    def compose_run(self, files: Sequence[Path], *args: str, env: dict[str, str], check: bool = True,
                    timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
        command = [*self.compose, "-p", PROJECT]
        for path in files:
            command += ["-f", str(path)]
        return _run([*command, *args], check=check, timeout=timeout, env={**os.environ, **env})

    def containers(self, service: str | None = None, *, running_only: bool = True) -> list[dict[str, str]]:
        """The project's containers (name, id, service, state), sorted by name."""
        args = ["ps", "--format", "{{.ID}}\t{{.Names}}"]
        if not running_only:
            args.insert(1, "-a")
        args += ["--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service is not None:
            args += ["--filter", f"label=com.docker.compose.service={service}"]
        found = []
        for line in self.run(*args).stdout.splitlines():
            if line.strip():
                container_id, name = line.split("\t", 1)
                found.append({"id": container_id, "name": name.strip()})
        return sorted(found, key=lambda c: c["name"])

    def inspect(self, container: str) -> dict[str, Any]:
        data = json.loads(self.run("inspect", container).stdout)
        return data[0] if isinstance(data, list) else data

    def health(self, container: str) -> str:
        """"healthy", "unhealthy", "starting" or "none" (no check)."""
        if self.manual_health:
            # Runs the container's check now and records its result (podman has no timer here).
            result = self.run("healthcheck", "run", container, check=False, timeout=120)
            if result.returncode == 0:
                return "healthy"
            text = (result.stdout + result.stderr).lower()
            return "none" if "no healthcheck" in text or "not defined" in text else "starting"
        state = self.inspect(container).get("State", {})
        return str((state.get("Health") or {}).get("Status", "none"))

    def ip_address(self, container: str) -> str:
        networks = self.inspect(container).get("NetworkSettings", {}).get("Networks", {}) or {}
        for network in networks.values():
            if network.get("IPAddress"):
                return str(network["IPAddress"])
        raise CheckFailed(f"container {container} has no IP address")


def _run(command: Sequence[str], *, check: bool = True, timeout: float = 600.0, capture: bool = True,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(command), capture_output=capture, text=True, timeout=timeout, env=env,
                            cwd=REPO, check=False)
    if check and result.returncode != 0:
        output = ((result.stdout or "") + (result.stderr or ""))[-3000:] if capture else ""
        raise CheckFailed(f"`{' '.join(command)}` exited with {result.returncode}\n{output}")
    return result


def find_engine(choice: str, workdir: Path) -> Engine:
    """Docker Compose v2 with a reachable daemon, else podman + podman-compose (``choice``: auto,
    docker or podman)."""
    problems = []
    if choice in ("auto", "docker") and shutil.which("docker"):
        plugin = _run(["docker", "compose", "version", "--short"], check=False)
        daemon = _run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False)
        if plugin.returncode == 0 and daemon.returncode == 0:
            return Engine("docker", ["docker"], ["docker", "compose"],
                          f"Docker {daemon.stdout.strip()}, Compose {plugin.stdout.strip()}")
        problems.append("docker: " + ("no compose v2 plugin" if plugin.returncode else "no reachable daemon"))
    if choice in ("auto", "podman") and shutil.which("podman"):
        if not shutil.which("podman-compose"):
            problems.append("podman: podman-compose is not on PATH (pip install podman-compose)")
        else:
            version = _run(["podman", "version", "--format", "{{.Client.Version}}"]).stdout.strip()
            compose_version = _run(["podman-compose", "--version"]).stdout.strip().splitlines()[0]
            compose = ["podman-compose"]
            # podman-compose passes --health-startup-interval for healthcheck.start_interval, which
            # podman before 4.6 rejects: a wrapper drops it (the check runs health checks itself).
            if "--health-startup-interval" not in _run(["podman", "run", "--help"]).stdout:
                wrapper = workdir / "podman"
                wrapper.write_text('#!/bin/sh\n# podman without --health-startup-interval (deploy_check.py)\n'
                                   'for a in "$@"; do shift; case "$a" in --health-startup-interval) skip=1; '
                                   'continue;; esac; if [ -n "${skip:-}" ]; then skip=; continue; fi; '
                                   f'set -- "$@" "$a"; done\nexec {shutil.which("podman")} "$@"\n')
                wrapper.chmod(0o755)
                compose = ["podman-compose", "--podman-path", str(wrapper)]
            return Engine("podman", ["podman"], compose, f"podman {version}, {compose_version}",
                          manual_health=True, workdir=workdir)
    if choice in ("auto", "docker") and not shutil.which("docker"):
        problems.append("docker: not installed")
    if choice in ("auto", "podman") and not shutil.which("podman"):
        problems.append("podman: not installed")
    raise CheckFailed("no container engine to run the stack: " + "; ".join(problems))


# ------------------------------------------------------------------------------------ phases
@dataclass
class Report:
    """Phase lines as they are printed, and whether every check passed."""

    failures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[list[str]]:
        """Prints ``name``, its notes and its time; a CheckFailed inside is recorded and re-raised."""
        notes: list[str] = []
        began = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            yield notes
        except CheckFailed as failure:
            self.failures.append(f"{name}: {failure}")
            print(f"   FAILED: {failure}", flush=True)
            print(f"-- {name}: FAILED after {time.monotonic() - began:.1f} s", flush=True)
            raise
        print(f"-- {name}: ok in {time.monotonic() - began:.1f} s", flush=True)

    @staticmethod
    def note(notes: list[str], text: str) -> None:
        notes.append(text)
        print(f"   {text}", flush=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Stack:
    """The running check project: its files, ports and token."""

    engine: Engine
    workdir: Path
    override: Path
    token: str
    port: int
    env: dict[str, str]

    @property
    def files(self) -> list[Path]:
        return [*COMPOSE_FILES, self.override]

    def compose(self, *args: str, check: bool = True, timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
        return self.engine.compose_run(self.files, *args, env=self.env, check=check, timeout=timeout)

    def client(self, **kwargs: Any) -> Any:
        from psg_client import GradientClient, RetryPolicy

        retry = RetryPolicy(max_attempts=6, initial_backoff_s=0.5, max_backoff_s=4.0)
        return GradientClient(f"127.0.0.1:{self.port}", token=self.token, retry=retry, timeout_s=300, **kwargs)


def write_project(workdir: Path) -> tuple[Path, str]:
    """The check's secrets (a test token, a Ray token) and the compose override that mounts them, in
    ``workdir``."""
    secrets_dir = workdir / "secrets"
    secrets_dir.mkdir()
    token = secrets.token_urlsafe(24)
    (secrets_dir / "psg_tokens.txt").write_text(f"check {token}\n")
    (secrets_dir / "ray_auth_token").write_text(secrets.token_hex(32) + "\n")
    for path in (workdir, secrets_dir):  # the containers run as uid 1000
        path.chmod(0o755)
    for path in secrets_dir.iterdir():
        path.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    override = workdir / "docker-compose.check.yml"
    override.write_text(json.dumps({
        "name": PROJECT,
        "secrets": {
            "psg_tokens": {"file": str(secrets_dir / "psg_tokens.txt")},
            "ray_auth_token": {"file": str(secrets_dir / "ray_auth_token")},
        },
    }, indent=2) + "\n")
    return override, token


def phase_build(engine: Engine, notes: list[str], build_args: Sequence[str], no_build: bool) -> None:
    if no_build:
        Report.note(notes, f"--no-build: using the existing {IMAGE}")
    else:
        command = ["build", "-f", str(DOCKERFILE_CPU), "-t", IMAGE]
        if engine.name == "podman":
            command += ["--format", "docker"]  # OCI images drop HEALTHCHECK
        for arg in build_args:
            command += ["--build-arg", arg]
        began = time.monotonic()
        engine.run(*command, ".", timeout=3600)
        Report.note(notes, f"built {IMAGE} in {time.monotonic() - began:.0f} s")
    size = int(engine.inspect(IMAGE).get("Size", 0))
    torch_version = engine.run("run", "--rm", "--entrypoint", "python", IMAGE, "-c",
                               "import torch, ray; print(torch.__version__, ray.__version__)").stdout.split()
    Report.note(notes, f"image {IMAGE}: {size / 1e9:.2f} GB, torch {torch_version[0]}, ray {torch_version[1]}")


def phase_up(stack: Stack, notes: list[str]) -> None:
    began = time.monotonic()
    stack.compose("up", "-d")
    containers = stack.engine.containers()
    services = sorted(c["name"] for c in containers)
    Report.note(notes, f"started {len(containers)} containers: {', '.join(services)}")
    if len(containers) != 3:
        raise CheckFailed(f"expected 3 containers (ray-head, cpu-worker, frontend), got {services}")
    wait_healthy(stack, notes, began)
    with stack.client() as client:
        workers = wait_for(lambda: list(client.server_info().workers), 240, "a live worker in server_info")
        Report.note(notes, f"serving on 127.0.0.1:{stack.port}: {len(workers)} worker(s) "
                           f"{[(w.id, w.node) for w in workers]}")
    from psg_client import GradientClient, RetryPolicy, ServiceError

    with GradientClient(f"127.0.0.1:{stack.port}", retry=RetryPolicy(max_attempts=1), timeout_s=30) as anonymous:
        try:
            anonymous.server_info()
        except ServiceError as refused:
            if refused.code.name != "UNAUTHENTICATED":
                raise CheckFailed(f"a call without a token got {refused.code.name}, not UNAUTHENTICATED") from None
            Report.note(notes, "a call without a token is refused: UNAUTHENTICATED")
        else:
            raise CheckFailed("a call without a token was answered")


def wait_healthy(stack: Stack, notes: list[str], began: float) -> None:
    pending = {c["name"] for c in stack.engine.containers()}
    healthy_after: dict[str, float] = {}

    def all_healthy() -> bool:
        for name in sorted(pending - set(healthy_after)):
            if stack.engine.health(name) in ("healthy", "none"):
                healthy_after[name] = time.monotonic() - began
        return set(healthy_after) >= pending

    wait_for(all_healthy, 300, "every container to be healthy", interval=3.0)
    Report.note(notes, "healthy after: " + ", ".join(f"{name} {seconds:.0f} s"
                                                    for name, seconds in sorted(healthy_after.items())))


def phase_store(stack: Stack, notes: list[str]) -> None:
    for container in stack.engine.containers():
        name = container["name"]
        logs = stack.engine.run("logs", name, check=False)
        text = logs.stdout + logs.stderr
        if "This will harm performance" in text or "is using /tmp instead of /dev/shm" in text:
            raise CheckFailed(f"{name}: Ray put its object store on disk:\n"
                              + "\n".join(line for line in text.splitlines() if "harm performance" in line)[:600])
        sized = [line for line in text.splitlines() if "Ray's object store:" in line]
        if not sized:
            raise CheckFailed(f"{name}: the entry point did not size Ray's object store (no 'Ray's object store:' "
                              "line in its log)")
        Report.note(notes, f"{name}: {sized[-1].split('psg-entrypoint: ', 1)[-1]}")


def _session(client: Any, expected_batch_size: int) -> Any:
    from psg_core.config import DPConfig

    return client.create_session(MODEL, model_kwargs=MODEL_KWARGS, loss="cross_entropy",
                                 expected_batch_size=expected_batch_size,
                                 config=DPConfig(max_grad_norm=MAX_GRAD_NORM))


def _model_and_batch(seed: int, batch: int = BATCH) -> tuple[Any, Any, Any]:
    import torch

    from psg_server.models import default_registry

    registry = default_registry()
    torch.manual_seed(seed)
    model = registry.build(MODEL, registry.parse_kwargs(MODEL, json.dumps(MODEL_KWARGS)))
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, IN_FEATURES, generator=generator)  # (N, in_features)
    targets = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)  # (N,)
    return model, inputs, targets


def phase_steps(stack: Stack, notes: list[str], steps: int = 5) -> None:
    import torch

    from psg_core import dp_gradient
    from psg_core.config import DPConfig
    from psg_server.losses import get_loss

    model, inputs, targets = _model_and_batch(seed=0)
    expected = dp_gradient(model, inputs, targets, loss_fn=get_loss("cross_entropy").build(),
                           config=DPConfig(max_grad_norm=MAX_GRAD_NORM))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seconds = []
    with stack.client() as client, _session(client, BATCH) as session:
        for step in range(steps):
            session.push_parameters(model)
            began = time.monotonic()
            result = session.compute_gradients(inputs, targets)
            seconds.append(time.monotonic() - began)
            if step == 0:
                worst = 0.0
                for name, grad in expected.grads.items():
                    reference = grad / BATCH  # the service divides by the expected batch size
                    if not torch.allclose(result.grads[name], reference, rtol=1e-4, atol=1e-6):
                        raise CheckFailed(f"step 1's gradient of {name} differs from psg_core.dp_gradient")
                    worst = max(worst, float((result.grads[name] - reference).abs().max()))
                Report.note(notes, f"step 1 equals psg_core.dp_gradient in-process (max abs diff {worst:.1e}, "
                                   f"{result.samples} samples, fraction clipped {result.fraction_clipped:.2f})")
            optimizer.zero_grad()
            result.apply_to(model)
            optimizer.step()
    Report.note(notes, f"{steps} DP steps of {BATCH} samples: " + ", ".join(f"{s:.2f}" for s in seconds) + " s")


def shards_by_node(stack: Stack) -> dict[str, int]:
    """Finished shard tasks (``GradientWorker.run*``) per node IP, from Ray's task list (asked from
    inside the frontend container, which is a node of the cluster)."""
    script = (
        "import collections, json\n"
        "from ray.util.state import list_nodes, list_tasks\n"
        "ips = {n.node_id: n.node_ip for n in list_nodes(address='http://ray-head:8265', limit=1000)}\n"
        "tasks = list_tasks(address='http://ray-head:8265', limit=10000, raise_on_missing_output=False,\n"
        "                   filters=[('state', '=', 'FINISHED'), ('type', '=', 'ACTOR_TASK'),\n"
        "                            ('func_or_class_name', '!=', 'GradientWorker.ping')])\n"
        "shards = [t for t in tasks if t.func_or_class_name.startswith('GradientWorker.run')]\n"
        "print('SHARDS ' + json.dumps(collections.Counter(ips.get(t.node_id, t.node_id) for t in shards)))\n")
    frontend = stack.engine.containers("frontend")[0]["name"]
    output = stack.engine.run("exec", frontend, "python", "-c", script, timeout=120).stdout
    return json.loads(output.split("SHARDS ", 1)[1].splitlines()[0])


def phase_scale(stack: Stack, notes: list[str], replicas: int = 3) -> None:
    stack.compose("up", "-d", "--scale", f"cpu-worker={replicas}")
    workers = stack.engine.containers("cpu-worker")
    if len(workers) != replicas:
        raise CheckFailed(f"expected {replicas} cpu-worker containers, got {[w['name'] for w in workers]}")
    ips = {stack.engine.ip_address(w["name"]): w["name"] for w in workers}
    with stack.client() as client:
        def every_worker_has_an_actor() -> bool:
            nodes = {w.node.split("/", 1)[0] for w in client.server_info().workers}
            return set(ips) <= nodes

        began = time.monotonic()
        wait_for(every_worker_has_an_actor, 240, f"actors on all {replicas} worker containers (no frontend restart)")
        workers_info = list(client.server_info().workers)
        Report.note(notes, f"the running frontend has {len(workers_info)} workers on {replicas} containers "
                           f"{time.monotonic() - began:.0f} s after the scale-up: "
                           + ", ".join(f"{w.id}@{ips.get(w.node.split('/', 1)[0], w.node)}" for w in workers_info))
        model, inputs, targets = _model_and_batch(seed=1)
        steps = 0
        with _session(client, BATCH) as session:
            session.push_parameters(model)

            def every_worker_ran_shards() -> bool:
                nonlocal steps
                session.compute_gradients(inputs, targets)
                steps += 1
                counts = shards_by_node(stack)
                return all(counts.get(ip, 0) > 0 for ip in ips)

            wait_for(every_worker_ran_shards, 240, "shards on every worker container", interval=0.5)
        counts = shards_by_node(stack)
        Report.note(notes, f"after {steps} step(s), shards run per worker container: "
                           + ", ".join(f"{name} {counts.get(ip, 0)}" for ip, name in sorted(ips.items(),
                                                                                       key=lambda x: x[1])))


def phase_faults(stack: Stack, notes: list[str], max_step_s: float) -> None:
    workers = stack.engine.containers("cpu-worker")
    if len(workers) < 3:
        raise CheckFailed(f"the fault phase needs 3 worker containers, has {len(workers)}")
    # Two of the replicas added by --scale: podman-compose makes the frontend require the first
    # replica (podman --requires), and podman will not start the frontend again (the restart
    # phase) while that one is stopped.
    stopped, killed = workers[-1]["name"], workers[-2]["name"]
    grace_s = stop_grace_period_s("cpu-worker")
    # Larger steps than elsewhere: every worker has a shard running most of the time.
    model, inputs, targets = _model_and_batch(seed=2, batch=FAULT_BATCH)
    frontend = stack.engine.containers("frontend")[0]["name"]
    log_lines_before = len(_log(stack, frontend).splitlines())
    durations: list[float] = []
    errors: list[BaseException] = []
    done = threading.Event()
    stop_seconds: list[float] = []

    with stack.client() as client, _session(client, FAULT_BATCH) as session:
        session.push_parameters(model)

        def steps() -> None:
            while not done.is_set():
                began = time.monotonic()
                try:
                    session.compute_gradients(inputs, targets)
                except Exception as error:  # reported below
                    errors.append(error)
                    return
                durations.append(time.monotonic() - began)

        def stop() -> None:
            # As compose stops a service: SIGTERM, and SIGKILL after its stop_grace_period (podman-compose
            # applies that to its own stop and down only, so it is passed here).
            began = time.monotonic()
            stack.engine.run("stop", "-t", str(int(grace_s)), stopped, timeout=grace_s + 60)
            stop_seconds.append(time.monotonic() - began)

        trainer = threading.Thread(target=steps, daemon=True)
        trainer.start()
        wait_for(lambda: len(durations) >= 3 or errors, 120, "steps before the faults", interval=0.2)
        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        Report.note(notes, f"stopping {stopped} (SIGTERM) after step {len(durations)}")
        time.sleep(2.0)
        killed_ip = stack.engine.ip_address(killed)
        old_nodes = {w.node for w in client.server_info().workers if w.node.startswith(killed_ip + "/")}
        old_start = stack.engine.inspect(killed).get("State", {}).get("StartedAt")
        # A crash, not a stop: every process of the container but its init SIGKILLed from inside;
        # init then exits, and the engine restarts the container (restart: unless-stopped). An
        # engine's `kill` would count as the operator stopping it.
        stack.engine.run("exec", killed, "sh", "-c", "kill -9 -1", check=False)
        killed_at = time.monotonic()
        Report.note(notes, f"SIGKILLed every process of {killed} after step {len(durations)}")
        stopper.join(timeout=130)
        # Steps go on until the killed worker is back (restarted by the engine: a new Ray node) and
        # has an actor again.

        def killed_back() -> bool:
            if errors:
                return True
            state = stack.engine.inspect(killed).get("State", {})
            if not state.get("Running") or state.get("StartedAt") == old_start:
                return False
            address = stack.engine.ip_address(killed)
            return any(w.node.startswith(address + "/") and w.node not in old_nodes
                       for w in client.server_info().workers)

        wait_for(killed_back, 180, f"{killed} restarted by the engine and given an actor again")
        Report.note(notes, f"{killed} restarted by the engine; its new node has an actor "
                           f"{time.monotonic() - killed_at:.0f} s after the kill")
        count_after = len(durations)
        wait_for(lambda: len(durations) >= count_after + 5 or errors, 120, "steps after the faults", interval=0.2)
        done.set()
        trainer.join(timeout=300)
        workers_after = list(client.server_info().workers)
    pool_lines = [line.split(" psg_server.", 1)[-1] for line in _log(stack, frontend).splitlines()[log_lines_before:]
                  if "psg_server.supervisor" in line or "psg_server.dispatch" in line]
    for line in pool_lines[:16]:
        Report.note(notes, f"frontend: {line[:160]}")
    if errors:
        raise CheckFailed(f"a step failed during the faults: {errors[0]!r}")
    if not stop_seconds:
        raise CheckFailed(f"`stop {stopped}` did not return")
    Report.note(notes, f"`stop {stopped}` returned after {stop_seconds[0]:.1f} s (Ray's drain allows "
                       f"{RAY_DRAIN_S:.0f} s, the stop_grace_period {grace_s:.0f} s)")
    slowest = max(durations)
    Report.note(notes, f"{len(durations)} steps, none failed; slowest {slowest:.2f} s, median "
                       f"{sorted(durations)[len(durations) // 2]:.2f} s")
    running = {stack.engine.ip_address(w["name"]) for w in stack.engine.containers("cpu-worker")}
    placed = {w.node.split("/", 1)[0] for w in workers_after}
    Report.note(notes, f"workers now: {[(w.id, w.node) for w in workers_after]}")
    if not placed <= running:
        raise CheckFailed(f"workers placed on nodes that are gone: {sorted(placed - running)}")
    if stop_seconds[0] > RAY_DRAIN_S - 5:
        raise CheckFailed(f"the stopped worker took {stop_seconds[0]:.1f} s to stop: its node was not released")
    if slowest > max_step_s:
        raise CheckFailed(f"the slowest step took {slowest:.1f} s (limit {max_step_s:g} s)")


def _log(stack: Stack, container: str) -> str:
    logs = stack.engine.run("logs", container, check=False)
    return logs.stdout + logs.stderr


def stop_grace_period_s(service: str) -> float:
    """The service's stop_grace_period in the compose files (the last file that sets it wins)."""
    import yaml

    seconds = 10.0  # compose's default
    for path in COMPOSE_FILES:
        value = (yaml.safe_load(path.read_text())["services"].get(service) or {}).get("stop_grace_period")
        if value is not None:
            text = str(value)
            seconds = float(text[:-1]) * (60 if text.endswith("m") else 1) if text[-1] in "sm" else float(text)
    return seconds


def phase_restart(stack: Stack, notes: list[str]) -> None:
    expected = {stack.engine.ip_address(w["name"]) for w in stack.engine.containers("cpu-worker")}
    frontend = stack.engine.containers("frontend")[0]["name"]
    started_before = stack.engine.inspect(frontend).get("State", {}).get("StartedAt")
    began = time.monotonic()
    stack.compose("restart", "frontend")
    if stack.engine.inspect(frontend).get("State", {}).get("StartedAt") == started_before:
        raise CheckFailed(f"`restart frontend` did not restart {frontend}")
    Report.note(notes, f"restarted {frontend} in {time.monotonic() - began:.1f} s")
    with stack.client() as client:
        def serving_every_worker() -> list[Any] | None:
            try:
                workers = list(client.server_info().workers)
            except Exception:  # noqa: BLE001 - still starting
                return None
            return workers if {w.node.split("/", 1)[0] for w in workers} >= expected else None

        workers = wait_for(serving_every_worker, 240, "the restarted frontend to serve every live worker")
        if len(workers) != len(expected):  # cpus: 1 per replica -> one actor each
            raise CheckFailed(f"{len(expected)} live worker containers, but the pool has {len(workers)} workers")
        Report.note(notes, f"restarted frontend serves {len(workers)} worker(s), one per live worker container, "
                           f"{time.monotonic() - began:.0f} s after the restart")
        started = [line.split("psg_server.supervisor: ", 1)[1] for line in _log(stack, frontend).splitlines()
                   if "psg_server.supervisor: pool:" in line and "live" in line]
        if started:
            Report.note(notes, f"frontend: {started[-1]}")
        model, inputs, targets = _model_and_batch(seed=3)
        with _session(client, BATCH) as session:
            session.push_parameters(model)
            session.compute_gradients(inputs, targets)
        Report.note(notes, "a step after the restart: ok")


def phase_down(stack: Stack, notes: list[str]) -> None:
    if stack.engine.name == "podman":
        # podman-compose's down knows one replica per service: it would stop the head before the
        # scaled-up workers (which then cannot drain through it and wait out their grace period)
        # and leave those. So the services stop here first, in compose's order, each with its
        # stop_grace_period; down then removes what it knows, and the rest is removed by name.
        for service in ("frontend", "cpu-worker", "ray-head"):
            names = [c["name"] for c in stack.engine.containers(service)]
            if names:
                grace = stop_grace_period_s(service)
                began = time.monotonic()
                stack.engine.run("stop", "-t", str(int(grace)), *names, check=False, timeout=grace + 120)
                Report.note(notes, f"stopped {len(names)} {service} container(s) in {time.monotonic() - began:.1f} s")
    stack.compose("down", "-v", check=False, timeout=600)
    left = stack.engine.containers(running_only=False)
    if left:
        Report.note(notes, f"{stack.engine.compose[0]} down left {[c['name'] for c in left]}: removing them")
        stack.engine.run("rm", "-f", *[c["name"] for c in left], check=False, timeout=300)
        stack.compose("down", "-v", check=False, timeout=600)
    left = stack.engine.containers(running_only=False)
    if left:
        raise CheckFailed(f"containers left after down: {[c['name'] for c in left]}")
    leftovers = []
    for kind in ("volume", "network", *(("pod",) if stack.engine.name == "podman" else ())):
        names = stack.engine.run(kind, "ls", "--format", "{{.Name}}").stdout.split()
        leftovers += [f"{kind} {name}" for name in names if PROJECT in name]  # pod_psg-check
    if leftovers:
        raise CheckFailed(f"left after down: {leftovers}")
    Report.note(notes, "no container, volume or network of the project left")


# -------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy_check.py", description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", choices=("auto", "docker", "podman"), default="auto",
                        help="container engine to use")
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="passed to the image build (repeatable)")
    parser.add_argument("--no-build", action="store_true", help=f"use the existing {IMAGE} image")
    parser.add_argument("--max-step-seconds", type=float, default=20.0,
                        help="the slowest step of the fault phase may take this long")
    parser.add_argument("--keep", action="store_true", help="leave the stack up (then: down -v by hand)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))

    report = Report()
    workdir = Path(tempfile.mkdtemp(prefix="psg-deploy-check-"))
    stack: Stack | None = None
    try:
        with report.phase("engine") as notes:
            engine = find_engine(args.engine, workdir)
            Report.note(notes, f"{engine.name}: {engine.versions} ({' '.join(engine.compose)})")
        with report.phase("build") as notes:
            phase_build(engine, notes, args.build_arg, args.no_build)
        override, token = write_project(workdir)
        port = _free_port()
        stack = Stack(engine, workdir, override, token, port,
                      {"PSG_PORT": str(port), "PSG_DASHBOARD_PORT": str(_free_port()), "PSG_CPU_IMAGE": IMAGE,
                       "PSG_WORKER_CPUS": "1"})
        if engine.containers(running_only=False):
            raise CheckFailed(f"a project {PROJECT} exists already: `{' '.join(engine.compose)} -p {PROJECT} "
                              "down -v` it first")
        for name, run_phase in (("up", phase_up), ("store", phase_store), ("steps", phase_steps),
                                ("scale", phase_scale)):
            with report.phase(name) as notes:
                run_phase(stack, notes)
        with report.phase("faults") as notes:
            phase_faults(stack, notes, args.max_step_seconds)
        with report.phase("restart") as notes:
            phase_restart(stack, notes)
    except CheckFailed as failure:
        if not report.failures:
            report.failures.append(str(failure))
            print(f"FAILED: {failure}", flush=True)
        if stack is not None:
            _dump_logs(stack)
    finally:
        if stack is not None and not args.keep:
            try:
                with report.phase("down") as notes:
                    phase_down(stack, notes)
            except CheckFailed:
                pass
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    total = time.monotonic() - report.started
    if report.failures:
        print(f"deploy-check FAILED in {total:.0f} s: " + "; ".join(f.splitlines()[0] for f in report.failures))
        return 1
    print(f"deploy-check passed in {total:.0f} s")
    return 0


def _dump_logs(stack: Stack) -> None:
    for container in stack.engine.containers(running_only=False):
        logs = stack.engine.run("logs", "--tail", "40", container["name"], check=False)
        print(f"---- last log lines of {container['name']} ----")
        print((logs.stdout + logs.stderr)[-4000:])


if __name__ == "__main__":
    sys.exit(main())
