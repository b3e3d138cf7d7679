"""The deploy files, checked without Docker or Kubernetes (deploy/README.md).

* docker-compose.yml (and the CPU override) validate against the Compose Specification schema,
  vendored in tests/data/compose-spec.json from check-jsonschema's built-in copy (Apache-2.0,
  tests/data/LICENSE.compose-spec); nothing is fetched at test time.
* Topology: every command parses with the real CLI it names (psg-server's parser, Ray's click
  commands, psg-health's parser), addresses and ports agree across services, the GPU worker reserves
  GPUs and can be scaled, secrets and the Ray token reach every node.
* Dockerfiles, by rule: a pinned base tag, a non-root USER, a HEALTHCHECK by role (psg-health in
  the frontend, the raylet's health elsewhere), no secrets, every COPY source present and let
  through .dockerignore, versions that agree across images.
* k8s manifests parse and agree with the compose file on image, ports and commands.
* make-secrets.sh writes what compose mounts, TLS files a psg-server serves with included; the
  README tells a trainer how to get its token and the client, and lists the tools it uses.
* What running the stack for real found (issue 22), checked without it: Ray's object store fits
  each container's /dev/shm (the entry point sizes it; KubeRay's flags), stops outlast Ray's drain,
  the images' torch pin is met from PyPI and is the version tested (the Makefile's), and
  ``make deploy-check`` (deploy/deploy_check.py, which runs the stack) stays out of ``make test``.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.scripts.scripts as ray_cli
import yaml
from packaging.requirements import Requirement

from psg_server.config import ServerConfig, build_parser
from psg_server.health import build_parser as health_parser
from psg_server.security import check_bind_allowed
from tests.integration.compose_model import (COMPOSE, COMPOSE_CPU, COMPOSE_TLS, DEPLOY, DOCKERFILE, DOCKERFILE_CPU,
                                             REPO, active_services, command_of, dependencies, environment_of,
                                             flag_value, healthcheck_command, load_compose, load_yaml,
                                             parse_dockerfile, start_order)

SCHEMA = REPO / "tests" / "data" / "compose-spec.json"
CONSTRAINTS = DEPLOY / "docker" / "constraints.txt"
K8S = DEPLOY / "k8s"
COMPOSE_CORES = DEPLOY / "docker-compose.cores.yml"
HEAD, GPU_WORKER, CPU_WORKER, FRONTEND = "ray-head", "gpu-worker", "cpu-worker", "frontend"
RAY_TOKEN_PATH = "/run/secrets/ray_auth_token"


@pytest.fixture(scope="module")
def schema_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def gpu_model() -> dict[str, Any]:
    return load_compose(COMPOSE)


@pytest.fixture(scope="module")
def cpu_model() -> dict[str, Any]:
    return load_compose(COMPOSE, COMPOSE_CPU)


def _errors(validator: jsonschema.Draft202012Validator, document: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


# ------------------------------------------------------------------------------------ compose schema
@pytest.mark.parametrize("paths", [(COMPOSE,), (COMPOSE_CPU,), (COMPOSE, COMPOSE_CPU)],
                         ids=["base", "cpu-override", "merged"])
def test_compose_files_validate_against_the_compose_spec(schema_validator: jsonschema.Draft202012Validator,
                                                         paths: tuple[Path, ...]) -> None:
    if len(paths) == 1:  # as written, before interpolation
        assert _errors(schema_validator, load_yaml(paths[0])) == []
    assert _errors(schema_validator, load_compose(*paths)) == []
    overridden = load_compose(*paths, environ={"PSG_GPUS_PER_WORKER": "2", "PSG_PORT": "443"})
    assert _errors(schema_validator, overridden) == []


def test_the_cores_override_limits_each_cpu_worker_replica(schema_validator: jsonschema.Draft202012Validator) -> None:
    # Without a limit every replica advertises every core of the host to Ray (issue 22, item 6).
    assert _errors(schema_validator, load_yaml(COMPOSE_CORES)) == []
    merged = load_compose(COMPOSE, COMPOSE_CPU, COMPOSE_CORES, environ={"PSG_WORKER_CPUS": "4"})
    assert _errors(schema_validator, merged) == []
    assert merged["services"][CPU_WORKER]["cpus"] == "4"
    assert set(load_yaml(COMPOSE_CORES)["services"]) == {CPU_WORKER}
    with pytest.raises(ValueError, match="PSG_WORKER_CPUS is required"):
        load_compose(COMPOSE, COMPOSE_CPU, COMPOSE_CORES, environ={})


def test_the_schema_catches_mistakes(schema_validator: jsonschema.Draft202012Validator,
                                     gpu_model: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(gpu_model))
    broken["services"][GPU_WORKER]["shm_sise"] = "2gb"
    broken["services"][FRONTEND]["depends_on"][HEAD]["condition"] = "service_ready"
    errors = "\n".join(_errors(schema_validator, broken))
    assert "services/gpu-worker: Unevaluated properties are not allowed ('shm_sise' was unexpected)" in errors
    assert "services/frontend/depends_on: {'ray-head': {'condition': 'service_ready'}" in errors


# ---------------------------------------------------------------------------------- compose topology
def test_tls_override_configures_server_and_probe(schema_validator: jsonschema.Draft202012Validator,
                                                  tmp_path: Path) -> None:
    assert _errors(schema_validator, load_yaml(COMPOSE_TLS)) == []
    for paths in ((COMPOSE, COMPOSE_TLS), (COMPOSE, COMPOSE_CPU, COMPOSE_TLS)):
        model = load_compose(*paths)
        assert _errors(schema_validator, model) == []
        frontend = model["services"][FRONTEND]
        environment = environment_of(frontend)
        local = {}  # the container's /run/secrets/<name>, as files here
        for name in frontend["secrets"]:
            declared = (COMPOSE.parent / model["secrets"][name]["file"]).resolve()
            assert declared.parent in (DEPLOY / "secrets", DEPLOY / "secrets" / "tls"), declared
            local[f"/run/secrets/{name}"] = tmp_path / name
            (tmp_path / name).write_text("trainer a-token-of-at-least-16-chars\n")
        for key in ("PSG_TLS_CERT", "PSG_TLS_KEY", "PSG_HEALTH_TLS_CA"):
            assert environment[key] in local, key
        environ = {key: str(local.get(value, value)) for key, value in environment.items()}
        command = [str(local.get(arg, arg)) for arg in command_of(frontend)]
        config = ServerConfig.from_args(command[1:], environ=environ)
        assert config.tls and config.tls_cert == local["/run/secrets/tls_cert"] and config.tokens
        probe = health_parser(environ=environ).parse_args(healthcheck_command(frontend)[1:])
        assert probe.tls_ca == local["/run/secrets/tls_ca"] and probe.tls_server_name == "localhost"


def _head_address(model: dict[str, Any]) -> str:
    head = command_of(model["services"][HEAD])
    assert head[:3] == ["ray", "start", "--head"]
    return f"{HEAD}:{flag_value(head, '--port')}"


def _ray_start_params(command: list[str]) -> dict[str, Any]:
    assert command[:2] == ["ray", "start"], command
    return ray_cli.start.make_context("start", command[2:]).params  # raises on unknown flags


def test_every_command_parses_with_the_cli_it_names(gpu_model: dict[str, Any], cpu_model: dict[str, Any],
                                                    tmp_path: Path) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["psg-server"] == "psg_server.cli:main" and scripts["psg-health"] == "psg_server.health:main"
    for model in (gpu_model, cpu_model):
        for name, service in active_services(model).items():
            command = command_of(service)
            if command[0] == "ray":
                params = _ray_start_params(command)
                assert params["block"], f"{name}: a container's Ray node must stay in the foreground"
                assert params["disable_usage_stats"]
            else:
                assert command[0] in scripts, f"{name}: {command[0]} is not a console script of psg"
                args = build_parser().parse_args(command[1:])
                tokens = tmp_path / "tokens"
                tokens.write_text("trainer a-token-of-at-least-16-chars\n")
                config = ServerConfig.from_args([tokens.as_posix() if a == args.tokens_file else a
                                                 for a in command[1:]], environ={})
                check_bind_allowed(config)  # 0.0.0.0 is allowed because tokens are required
                assert config.executor == "ray" or "--executor" not in command
            probe = healthcheck_command(service)
            if probe[0] == "psg-health":
                health_parser(environ={}).parse_args(probe[1:])
            elif probe[0] == "ray":
                ray_cli.cli.commands[probe[1]].make_context(probe[1], probe[2:])
            else:
                assert probe[:2] == ["python", "-c"], probe
                compile(probe[2], f"<{name} healthcheck>", "exec")


def test_addresses_and_ports_agree(gpu_model: dict[str, Any]) -> None:
    services = gpu_model["services"]
    address = _head_address(gpu_model)
    head = command_of(services[HEAD])
    assert healthcheck_command(services[HEAD]) == ["ray", "health-check", "--address", address]
    worker = command_of(services[GPU_WORKER])
    assert flag_value(worker, "--address") == address
    frontend = command_of(services[FRONTEND])
    assert flag_value(frontend, "--ray-address") == address
    assert environment_of(services[FRONTEND])["PSG_RAY_JOIN"] == address
    # The frontend publishes its gRPC port and probes it.
    port = flag_value(frontend, "--port")
    assert flag_value(frontend, "--host") == "0.0.0.0"
    assert [p.rsplit(":", 1)[1] for p in services[FRONTEND]["ports"]] == [port]
    assert services[FRONTEND]["ports"] == [f"50051:{port}"]  # PSG_PORT unset: same port outside
    probe = healthcheck_command(services[FRONTEND])
    assert flag_value(probe, "--target") == f"127.0.0.1:{port}"
    # The dashboard is published on the host's loopback only; the agent probe hits its own port.
    assert services[HEAD]["ports"] == [f"127.0.0.1:8265:{flag_value(head, '--dashboard-port')}"]
    agent_port = flag_value(worker, "--dashboard-agent-listen-port")
    assert f"http://127.0.0.1:{agent_port}/api/local_raylet_healthz" in healthcheck_command(services[GPU_WORKER])[2]
    assert "ports" not in services[GPU_WORKER]


def test_the_gpu_worker_reserves_gpus_and_scales(gpu_model: dict[str, Any]) -> None:
    services = gpu_model["services"]
    worker = services[GPU_WORKER]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] and d.get("driver") == "nvidia" for d in devices)
    assert devices[0]["count"] == "all"
    assert "container_name" not in worker and "ports" not in worker  # --scale needs both absent
    assert _bytes(worker["shm_size"]) >= 1 << 30
    for name in (HEAD, FRONTEND):
        assert "deploy" not in services[name], f"{name} must not hold GPUs"
        assert _bytes(services[name]["shm_size"]) >= 1 << 30
    # The head and the frontend's node offer nothing to schedule on: shards go to workers.
    head = _ray_start_params(command_of(services[HEAD]))
    assert head["num_cpus"] == 0 and head["num_gpus"] == 0
    entrypoint = (DEPLOY / "docker" / "entrypoint.sh").read_text()
    assert "--num-cpus=0 --num-gpus=0" in entrypoint


def test_start_order_and_health_conditions(gpu_model: dict[str, Any], cpu_model: dict[str, Any]) -> None:
    assert start_order(active_services(gpu_model)) == [HEAD, GPU_WORKER, FRONTEND]
    assert start_order(active_services(cpu_model)) == [HEAD, CPU_WORKER, FRONTEND]
    for model in (gpu_model, cpu_model):
        services = active_services(model)
        for name, service in services.items():
            assert service["healthcheck"]["test"], f"{name} has no healthcheck"
            assert service.get("init") is True and service.get("restart") == "unless-stopped"
            for dependency, spec in dependencies(service).items():
                if dependency in services:
                    assert spec["condition"] == "service_healthy", (name, dependency)
        assert set(dependencies(services[FRONTEND])) >= {HEAD}
        worker = CPU_WORKER if CPU_WORKER in services else GPU_WORKER
        assert dependencies(services[FRONTEND])[worker]["condition"] == "service_healthy"
        assert dependencies(services[worker]) == {HEAD: {"condition": "service_healthy", "required": True}}


def test_secrets_and_the_ray_token_reach_every_node(gpu_model: dict[str, Any], cpu_model: dict[str, Any]) -> None:
    for model in (gpu_model, cpu_model):
        declared = model["secrets"]
        for name, service in active_services(model).items():
            environment = environment_of(service)
            assert environment["RAY_AUTH_MODE"] == "token", name
            assert environment["RAY_AUTH_TOKEN_PATH"] == RAY_TOKEN_PATH, name
            assert "ray_auth_token" in service["secrets"], name
            for secret in service["secrets"]:
                assert secret in declared
        frontend = model["services"][FRONTEND]
        tokens_file = flag_value(command_of(frontend), "--tokens-file")
        assert tokens_file is not None and tokens_file.startswith("/run/secrets/")
        assert tokens_file.removeprefix("/run/secrets/") in frontend["secrets"]
    for secret in gpu_model["secrets"].values():
        path = (COMPOSE.parent / secret["file"]).resolve()
        assert path.parent == DEPLOY / "secrets"
    ignore = (DEPLOY / "secrets" / ".gitignore").read_text().split()
    assert ignore[ignore.index("*"):] == ["*", "!.gitignore"]
    assert subprocess.run(["sh", "-n", str(DEPLOY / "make-secrets.sh")], check=False).returncode == 0


def test_one_image_per_topology(gpu_model: dict[str, Any], cpu_model: dict[str, Any]) -> None:
    for model, image, dockerfile in ((gpu_model, "psg:0.1.0-gpu", DOCKERFILE),
                                     (cpu_model, "psg:0.1.0-cpu", DOCKERFILE_CPU)):
        for name, service in active_services(model).items():
            assert service["image"] == image, name
            context = (COMPOSE.parent / service["build"]["context"]).resolve()
            assert context == REPO and context / service["build"]["dockerfile"] == dockerfile, name
    gpu, cpu = gpu_model["services"], cpu_model["services"]
    assert command_of(cpu[CPU_WORKER]) == command_of(gpu[GPU_WORKER])
    assert healthcheck_command(cpu[CPU_WORKER]) == healthcheck_command(gpu[GPU_WORKER])
    assert environment_of(cpu[CPU_WORKER]) == environment_of(gpu[GPU_WORKER])
    assert "deploy" not in cpu[CPU_WORKER] and GPU_WORKER not in active_services(cpu_model)
    for name in (HEAD, FRONTEND):
        assert command_of(cpu[name]) == command_of(gpu[name])


def _bytes(size: str | int) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", size.lower())
    assert match is not None, size
    return int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2)]


# ---------------------------------------------------------------------------------------- Dockerfiles
def _args(instructions: list[Instruction]) -> dict[str, str]:
    values = {}
    for item in instructions:
        if item.keyword == "ARG" and "=" in item.arguments:
            name, value = item.arguments.split("=", 1)
            values[name] = value
    return values


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves ``path`` (relative, '/'-separated) out of the build context:
    the last pattern matching the path or one of its parents wins; '!' lets a path back in."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        body = body.strip("/")
        regex = fnmatch.translate(body).replace(".*", "[^/]*")
        if body.startswith("**/"):
            regex = "(?:.*/)?" + fnmatch.translate(body[3:]).replace(".*", "[^/]*")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negated
    return excluded


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def _files_under(path: Path) -> Iterator[str]:
    if path.is_file():
        yield path.relative_to(REPO).as_posix()
        return
    for item in sorted(path.rglob("*")):
        if item.is_file():
            yield item.relative_to(REPO).as_posix()


def test_dockerignore_matcher_follows_docker_rules() -> None:
    patterns = ["*", "!server", "**/__pycache__", "!deploy/docker/x.sh"]
    assert _dockerignore_excludes(".venv/bin/python", patterns)
    assert not _dockerignore_excludes("server/cli.py", patterns)
    assert _dockerignore_excludes("server/__pycache__/cli.cpython-311.pyc", patterns)
    assert not _dockerignore_excludes("deploy/docker/x.sh", patterns)
    assert _dockerignore_excludes("deploy/docker/Dockerfile", patterns)


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE_CPU], ids=["gpu", "cpu"])
def test_dockerfile_rules(dockerfile: Path) -> None:
    instructions = parse_dockerfile(dockerfile)
    keywords = [i.keyword for i in instructions]
    # A single stage on a base pinned by a version tag (not latest, no variable).
    (base,) = [i for i in instructions if i.keyword == "FROM"]
    image = base.arguments.split()[0]
    assert "$" not in image and ":" in image, image
    tag = image.rsplit(":", 1)[1].split("@")[0]
    assert tag != "latest" and re.match(r"\d+\.\d+(\.\d+)?-", tag), f"base tag {tag!r} is not a pinned version"
    # Runs as an unprivileged user from the first command on.
    users = [i for i in instructions if i.keyword == "USER"]
    assert users and users[-1].arguments.split(":")[0] not in ("root", "0")
    assert keywords.index("USER") < keywords.index("ENTRYPOINT") and keywords.index("USER") < keywords.index("CMD")
    # A health check by role (healthcheck.sh, installed by COPY; its psg-health call is checked below).
    (health,) = [i for i in instructions if i.keyword == "HEALTHCHECK"]
    options, _, command = health.arguments.partition("CMD ")
    assert json.loads(command) == ["psg-container-health"]
    assert re.search(r"--timeout=\d+s", options) and re.search(r"--start-period=\d+s", options)
    # Entry point: the join-then-exec script, installed by COPY; default command psg-server.
    assert instructions[keywords.index("ENTRYPOINT")].json_args() == ["psg-entrypoint"]
    assert instructions[keywords.index("CMD")].json_args()[0] == "psg-server"
    # The package comes from the repository, with the exact Ray pin.
    runs = " ".join(i.arguments for i in instructions if i.keyword == "RUN")
    assert 'pip install --constraint deploy/docker/constraints.txt' in runs and '".[server]"' in runs
    assert "ADD" not in keywords, "COPY only: ADD fetches URLs and unpacks archives"
    exposed = {port for i in instructions if i.keyword == "EXPOSE" for port in i.arguments.split()}
    assert {"50051", "6379", "8265", "52365"} <= exposed


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE_CPU], ids=["gpu", "cpu"])
def test_dockerfile_copies_exist_and_pass_dockerignore(dockerfile: Path) -> None:
    patterns = _dockerignore()
    copies = [i for i in parse_dockerfile(dockerfile) if i.keyword == "COPY"]
    assert copies
    destinations = []
    for copy in copies:
        words = [w for w in shlex.split(copy.arguments) if not w.startswith("--")]
        assert not any(w.startswith("--from") for w in shlex.split(copy.arguments))
        *sources, destination = words
        destinations.append(destination)
        for source in sources:
            path = REPO / source
            assert path.exists(), f"{dockerfile.name} line {copy.line}: COPY source {source} does not exist"
            files = list(_files_under(path))
            assert files, source
            let_through = [f for f in files if not _dockerignore_excludes(f, patterns)]
            python_files = [f for f in files if f.endswith((".py", ".toml", ".md", ".txt", ".sh", ".typed"))]
            assert set(python_files) <= set(let_through), \
                f"{dockerfile.name}: .dockerignore drops {sorted(set(python_files) - set(let_through))[:3]}"
    assert {"/usr/local/bin/psg-entrypoint", "/usr/local/bin/psg-container-health"} <= set(destinations)
    # What must never reach a build context.
    for secret_like in (".venv/bin/python", ".git/config", "deploy/secrets/psg_tokens.txt",
                        "deploy/secrets/ray_auth_token", "tests/data/compose-spec.json", "server/tls.key"):
        assert _dockerignore_excludes(secret_like, patterns), secret_like


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE_CPU], ids=["gpu", "cpu"])
def test_dockerfile_copies_every_package_folder(dockerfile: Path) -> None:
    # pip installs what pyproject's package-dir maps (psg_wire lives in proto/wire): each folder
    # must be copied into the image, or the install inside it silently lacks a package.
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(package_dir) == {"psg_core", "psg_wire", "psg_server", "psg_client"}
    copied = set()
    for copy in (i for i in parse_dockerfile(dockerfile) if i.keyword == "COPY"):
        *sources, _ = [w for w in shlex.split(copy.arguments) if not w.startswith("--")]
        copied.update(source.rstrip("/") for source in sources)
    for package, folder in package_dir.items():
        assert any(folder == source or folder.startswith(source + "/") for source in copied), \
            f"{dockerfile.name} does not COPY {folder} (package {package})"


_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE|CREDENTIAL)", re.I)


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE_CPU], ids=["gpu", "cpu"])
def test_dockerfile_holds_no_secrets(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert "PRIVATE KEY" not in text and "Bearer " not in text
    for item in parse_dockerfile(dockerfile):
        if item.keyword in ("ENV", "ARG"):
            for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", item.arguments) or [item.arguments.split()[0]]:
                assert not _SECRET_NAME.search(name), f"{dockerfile.name} line {item.line}: {item.keyword} {name}"
        if item.keyword == "COPY":
            assert "secrets" not in item.arguments and ".pem" not in item.arguments and ".key" not in item.arguments


def _tested_torch() -> str:
    """The torch version everything is tested on: the Makefile's pin."""
    match = re.search(r"^TORCH := torch==(\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert match, "the Makefile pins no torch"
    return match.group(1)


def test_images_agree_on_python_torch_and_ray() -> None:
    gpu, cpu = parse_dockerfile(DOCKERFILE), parse_dockerfile(DOCKERFILE_CPU)
    gpu_base = next(i for i in gpu if i.keyword == "FROM").arguments
    cpu_base = next(i for i in cpu if i.keyword == "FROM").arguments
    # One base: one Python patch release in both images (Ray refuses a node whose Python differs).
    assert gpu_base == cpu_base
    python = _args(gpu)["PYTHON_VERSION"]
    assert _args(cpu)["PYTHON_VERSION"] == python and re.search(rf":{re.escape(python)}\.\d+-slim", cpu_base)
    assert _args(gpu)["PSG_UID"] == _args(cpu)["PSG_UID"] == "1000"
    # The torch everything is tested on, in both; the GPU one from PyPI (its Linux wheels are the
    # CUDA builds), the CPU one from PyTorch's CPU index.
    torch_version = _tested_torch()
    assert _args(gpu)["TORCH_VERSION"] == _args(cpu)["TORCH_VERSION"] == torch_version
    assert _args(gpu)["TORCH_INDEX_URL"] == "https://pypi.org/simple"
    assert _args(cpu)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    for instructions in (gpu, cpu):
        runs = [i.arguments for i in instructions if i.keyword == "RUN"]
        assert any('--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in run for run in runs)
    # Torch and Python within what the package supports.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    assert requirements["torch"].specifier.contains(torch_version)
    assert Requirement(f"python{project['requires-python']}").specifier.contains(f"{python}.0")
    # The exact Ray pin satisfies the package's range, and KubeRay is told the same version.
    pins = [Requirement(line) for line in CONSTRAINTS.read_text().splitlines() if line and not line.startswith("#")]
    (ray_pin,) = [p for p in pins if p.name == "ray"]
    (pinned,) = [s.version for s in ray_pin.specifier if s.operator == "=="]
    ray_requirement = next(Requirement(r) for r in project["optional-dependencies"]["server"]
                           if Requirement(r).name == "ray")
    assert ray_requirement.specifier.contains(pinned)
    (cluster,) = [d for d in _k8s_documents() if d["kind"] == "RayCluster"]
    assert cluster["spec"]["rayVersion"] == pinned


@pytest.mark.parametrize("installed", ["2.13.0+cu128", "2.13.0+cpu", "2.13.0"])
def test_the_torch_constraint_is_met_from_pypi(tmp_path: Path, installed: str) -> None:
    # The images pin the torch they installed before installing psg. With the local label
    # ("torch==2.9.0+cu128") pip could meet the pin only from PyTorch's own index, and failed with
    # ResolutionImpossible whenever it looked for torch again (issue 22, defect 5).
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"__version__ = {installed!r}\n")
    script = DEPLOY / "docker" / "torch_constraint.py"
    result = subprocess.run([sys.executable, str(script)], env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=60, check=True)
    (constraint,) = [Requirement(line) for line in result.stdout.splitlines()]
    public = installed.split("+")[0]
    assert str(constraint) == f"torch=={public}"
    assert constraint.specifier.contains(public)  # what PyPI publishes
    assert constraint.specifier.contains(installed)  # the build already installed: pip keeps it
    for dockerfile in (DOCKERFILE, DOCKERFILE_CPU):
        runs = " ".join(i.arguments for i in parse_dockerfile(dockerfile) if i.keyword == "RUN")
        assert "python deploy/docker/torch_constraint.py > /tmp/torch-pin.txt" in runs
        assert "--constraint /tmp/torch-pin.txt" in runs and "torch.__version__)" not in runs


def _entrypoint_run(tmp_path: Path, command: list[str], *, shm_bytes: int, memory_bytes: int,
                    cgroup_limit: str = "max", environment: dict[str, str] | None = None) -> tuple[list[list[str]], str]:
    """Runs the images' entry point with ``ray`` and ``df`` stubbed, a /dev/shm of ``shm_bytes``
    and ``memory_bytes`` of memory; returns the `ray` command lines it ran and its stderr."""
    bin_dir, proc, cgroup, calls = tmp_path / "bin", tmp_path / "proc", tmp_path / "cgroup", tmp_path / "calls"
    for folder in (bin_dir, proc, cgroup):
        folder.mkdir(parents=True, exist_ok=True)
    (bin_dir / "ray").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{calls}"\n')
    (bin_dir / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                                f"echo 'shm {shm_bytes // 1024} 0 {shm_bytes // 1024} 0% /dev/shm'\n")
    if command[0] != "ray":  # the container's own command (psg-server): does nothing here
        (bin_dir / command[0]).write_text("#!/bin/sh\nexit 0\n")
    for stub in {"ray", "df", command[0]}:
        (bin_dir / stub).chmod(0o755)
    (proc / "meminfo").write_text(f"MemTotal:       {memory_bytes // 1024} kB\nMemFree: 1 kB\n")
    (cgroup / "memory.max").write_text(cgroup_limit + "\n")
    calls.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PSG_ENTRYPOINT_PROC": str(proc), "PSG_ENTRYPOINT_CGROUP": str(cgroup),
           **(environment or {})}
    result = subprocess.run(["sh", str(DEPLOY / "docker" / "entrypoint.sh"), *command], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    ran = [line.split() for line in calls.read_text().splitlines()] if calls.exists() else []
    return ran, result.stderr


def _object_store(ray_args: list[str]) -> int | None:
    value = flag_value(ray_args, "--object-store-memory")
    return None if value is None else int(value)


@pytest.mark.parametrize("topology", ["gpu", "cpu"])
def test_ray_s_object_store_fits_every_container_s_dev_shm(tmp_path: Path, topology: str,
                                                           gpu_model: dict[str, Any],
                                                           cpu_model: dict[str, Any]) -> None:
    # On a host with more than ~13 GB, Ray's default store (30% of the memory) exceeded the
    # containers' shm_size, and Ray put it on disk ("This will harm performance!", issue 22).
    model = gpu_model if topology == "gpu" else cpu_model
    memory = 64 << 30
    for name, service in active_services(model).items():
        shm = _bytes(service["shm_size"])
        environment = environment_of(service)
        ran, stderr = _entrypoint_run(tmp_path / name, command_of(service), shm_bytes=shm, memory_bytes=memory,
                                      environment={k: v for k, v in environment.items() if k.startswith("PSG_")})
        ray_nodes = [args for args in ran if args[:1] == ["start"]]
        assert ray_nodes, f"{name} starts no Ray node"
        for args in ray_nodes:
            size = _object_store(args)
            assert size is not None and 100 << 20 <= size <= 0.9 * shm, (name, size, shm)
            assert size <= 0.3 * memory
        assert "Ray's object store:" in stderr
    # The container's memory limit counts when lower than the host's; flags that size the store
    # win; a /dev/shm too small for any store leaves Ray's default (and says so).
    ran, _ = _entrypoint_run(tmp_path / "limited", ["ray", "start", "--head"], shm_bytes=16 << 30,
                             memory_bytes=memory, cgroup_limit=str(4 << 30))
    assert _object_store(ran[0]) == int(0.3 * (4 << 30))
    ran, _ = _entrypoint_run(tmp_path / "given", ["ray", "start", "--object-store-memory=123456789"],
                             shm_bytes=16 << 30, memory_bytes=memory)
    assert ran == [["start", "--object-store-memory=123456789"]]
    ran, stderr = _entrypoint_run(tmp_path / "tiny", ["ray", "start"], shm_bytes=64 << 20, memory_bytes=memory)
    assert ran == [["start"]] and "will be on disk" in stderr
    ran, _ = _entrypoint_run(tmp_path / "joined", ["psg-server"], shm_bytes=4 << 30, memory_bytes=memory,
                             environment={"PSG_RAY_JOIN": "h:1", "PSG_RAY_JOIN_ARGS": "--object-store-memory=99"})
    assert ran == [["start", "--address=h:1", "--num-cpus=0", "--num-gpus=0", "--disable-usage-stats",
                    "--object-store-memory=99"]]


def test_kuberay_object_stores_fit_their_dev_shm() -> None:
    (cluster,) = [d for d in _k8s_documents() if d["kind"] == "RayCluster"]
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:  # KubeRay runs `ray start` itself: the image's entry point does not size these
        pod = group["template"]["spec"]
        (shm,) = [v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "dshm"]
        (container,) = pod["containers"]
        memory = container["resources"]["limits"]["memory"]
        size = int(group["rayStartParams"]["object-store-memory"])
        assert size <= 0.9 * _quantity(shm) and size <= 0.3 * _quantity(memory) + 1, (size, shm, memory)


def _quantity(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)
    assert match, text
    return int(match.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[match.group(2)]


def _seconds(text: str | int) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(text))
    assert match and any(match.groups()), text
    return int(match.group(1) or 0) * 60 + float(match.group(2) or 0)


def test_stops_outlast_ray_s_drain(gpu_model: dict[str, Any], cpu_model: dict[str, Any]) -> None:
    # `ray start --block` drains its node for up to this long on SIGTERM; compose's default 10 s
    # (and Kubernetes' 30 s) killed workers mid-drain on stop, down and scale-down (issue 22).
    from ray._private.ray_constants import RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S as drain_s

    for model in (gpu_model, cpu_model):
        for name, service in active_services(model).items():
            assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" not in environment_of(service)
            assert _seconds(service["stop_grace_period"]) >= drain_s + 10, name
    for document in _k8s_documents():
        for name, pod in _pod_specs(document):
            assert pod["terminationGracePeriodSeconds"] >= drain_s + 10, name


def test_make_deploy_check_runs_the_stack_outside_make_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            schema_validator: jsonschema.Draft202012Validator) -> None:
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^deploy-check:.*\n\t(.+)$", makefile, re.M)
    assert target and "deploy/deploy_check.py" in target.group(1)
    test_recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert test_recipe and "deploy" not in test_recipe.group(0)
    sys.path.insert(0, str(DEPLOY))
    try:
        import deploy_check
    finally:
        sys.path.remove(str(DEPLOY))
    # The compose files it runs, with the override it writes (its own secrets, a CPU limit per
    # worker replica), validate as one model.
    override, token = deploy_check.write_project(tmp_path)
    assert len(token) >= 16 and (tmp_path / "secrets" / "psg_tokens.txt").read_text().split()[1] == token
    assert deploy_check.COMPOSE_FILES == (COMPOSE, COMPOSE_CPU, COMPOSE_CORES)
    merged = load_compose(*deploy_check.COMPOSE_FILES, override, environ={"PSG_WORKER_CPUS": "1"})
    assert _errors(schema_validator, merged) == []
    assert merged["services"][CPU_WORKER]["cpus"] == "1"
    assert {Path(s["file"]).parent for s in merged["secrets"].values()} == {tmp_path / "secrets"}
    assert deploy_check.stop_grace_period_s(CPU_WORKER) == _seconds(merged["services"][CPU_WORKER]["stop_grace_period"])
    # Without an engine it says so, and names what it looked for.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(deploy_check.CheckFailed, match="no container engine.*docker: not installed.*podman: not"):
        deploy_check.find_engine("auto", tmp_path)


def test_entrypoint_script() -> None:
    script = DEPLOY / "docker" / "entrypoint.sh"
    assert script.stat().st_mode & 0o111, "entrypoint.sh must be executable"
    assert subprocess.run(["sh", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n") and "set -eu" in text and 'exec "$@"' in text


def _container_health(tmp_path: Path, processes: list[list[str]], answers: int = 0) -> tuple[int, list[str]]:
    """Runs the images' health check in a container whose processes run ``processes`` (a /proc of
    its own) with psg-health and wget stubbed; returns its exit status and the probe it ran."""
    proc, bin_dir, calls = tmp_path / "proc", tmp_path / "bin", tmp_path / "calls"
    for pid, argv in enumerate(processes, start=1):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    bin_dir.mkdir()
    for stub in ("psg-health", "wget"):
        (bin_dir / stub).write_text(f'#!/bin/sh\nprintf "%s\\n" {stub} "$@" > "{calls}"\nexit {answers}\n')
        (bin_dir / stub).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PSG_HEALTH_PROC": str(proc)}
    result = subprocess.run(["sh", str(DEPLOY / "docker" / "healthcheck.sh")], env=env, capture_output=True,
                            text=True, timeout=30, check=False)
    return result.returncode, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("role", ["frontend", "ray-head", "gpu-worker", "other"])
def test_the_image_health_check_follows_the_container_s_role(tmp_path: Path, role: str) -> None:
    raylet = ["/opt/conda/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--node_ip_address=10.0.0.2"]
    processes = {
        "frontend": [["tini", "--", "psg-entrypoint", "psg-server"], raylet,
                     ["/opt/conda/bin/python", "/opt/conda/bin/psg-server", "--ray-address", "ray-head:6379"]],
        "ray-head": [["/opt/conda/bin/python", "/opt/conda/bin/ray", "start", "--head", "--block"], raylet],
        "gpu-worker": [["/opt/conda/bin/python", "/opt/conda/bin/ray", "start", "--address=10.0.0.1:6379"], raylet,
                       ["ray::GradientWorker"]],
        "other": [["python", "train.py"]],
    }[role]
    status, probe = _container_health(tmp_path, processes)
    assert status == 0
    if role == "frontend":  # a GPU worker host must not be probed as a frontend (issue: always unhealthy)
        assert probe[0] == "psg-health"
        health_parser(environ={}).parse_args(probe[1:])
    elif role in ("ray-head", "gpu-worker"):
        assert probe[0] == "wget" and probe[-1] == "http://127.0.0.1:52365/api/local_raylet_healthz"
    else:
        assert probe == []
    if probe:  # a failing probe makes the container unhealthy
        assert _container_health(tmp_path / "failing", processes, answers=1)[0] == 1


# --------------------------------------------------------------------------------------- Kubernetes
def _k8s_documents() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        with path.open() as handle:
            documents.extend(d for d in yaml.safe_load_all(handle) if d is not None)
    return documents


def _pod_specs(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = document["spec"]
    if document["kind"] == "RayCluster":
        yield "head", spec["headGroupSpec"]["template"]["spec"]
        for group in spec["workerGroupSpecs"]:
            yield group["groupName"], group["template"]["spec"]
    elif document["kind"] == "Deployment":
        yield document["metadata"]["name"], spec["template"]["spec"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("initContainers", [])) + list(pod["containers"])


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def test_k8s_manifests_parse_and_are_complete() -> None:
    documents = _k8s_documents()
    kinds = sorted((d["apiVersion"], d["kind"]) for d in documents)
    assert kinds == [("apps/v1", "Deployment"), ("ray.io/v1", "RayCluster"), ("v1", "PersistentVolumeClaim"),
                     ("v1", "Service")]
    kustomization = load_yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    assert [i["name"] for i in kustomization["images"]] == ["psg"]


def test_k8s_agrees_with_compose(gpu_model: dict[str, Any]) -> None:
    services = gpu_model["services"]
    documents = {d["kind"]: d for d in _k8s_documents()}
    cluster, deployment, service = documents["RayCluster"], documents["Deployment"], documents["Service"]
    head_service = f"{cluster['metadata']['name']}-head-svc"  # the Service KubeRay creates for the head
    compose_address = _head_address(gpu_model)
    gcs_port = compose_address.rsplit(":", 1)[1]
    k8s_address = f"{head_service}:{gcs_port}"
    # One image everywhere, the compose file's.
    for document in (cluster, deployment):
        for _, pod in _pod_specs(document):
            for container in _containers(pod):
                assert container["image"] == services[FRONTEND]["image"], container["name"]
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
            for container in _containers(pod):
                env = _env(container)
                assert env["RAY_AUTH_MODE"] == "token", container["name"]
                assert env["RAY_AUTH_TOKEN"]["secretKeyRef"] == {"name": "psg-ray-auth", "key": "auth_token"}
    # The head: no work scheduled on it, like the compose head; GCS on the compose port.
    head_params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    compose_head = _ray_start_params(command_of(services[HEAD]))
    assert int(head_params["num-cpus"]) == compose_head["num_cpus"] == 0
    assert int(head_params["num-gpus"]) == compose_head["num_gpus"] == 0
    (head_container,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in head_container["ports"]}["gcs-server"] == int(gcs_port)
    # GPU workers hold a GPU each.
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    # The frontend: the compose command with the head's Kubernetes address, through the entry point.
    pod = deployment["spec"]["template"]["spec"]
    (frontend,) = pod["containers"]
    assert "command" not in frontend, "the image's entry point must run (it joins the Ray cluster)"
    expected = [k8s_address if arg == compose_address else arg for arg in command_of(services[FRONTEND])]
    assert frontend["args"] == expected
    assert _env(frontend)["PSG_RAY_JOIN"] == k8s_address
    port = int(flag_value(frontend["args"], "--port") or 0)
    ports = {p["name"]: p["containerPort"] for p in frontend["ports"]}
    assert ports["grpc"] == port and ports["metrics"] == int(flag_value(frontend["args"], "--metrics-port") or 0)
    assert frontend["readinessProbe"]["grpc"]["port"] == port
    assert frontend["livenessProbe"]["tcpSocket"]["port"] == port
    # The tokens file the args name is mounted from the psg-tokens Secret.
    tokens_file = Path(flag_value(frontend["args"], "--tokens-file") or "")
    (mount,) = [m for m in frontend["volumeMounts"] if m["mountPath"] == str(tokens_file.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    items = [item for source in volume["projected"]["sources"] for item in source["secret"]["items"]]
    assert {"key": "psg_tokens", "path": tokens_file.name} in items
    # The session store (--state-dir) is the claim's volume, as in compose it is a named volume.
    state_dir = flag_value(frontend["args"], "--state-dir")
    assert state_dir and deployment["spec"]["strategy"]["type"] == "Recreate"  # one owner of the store
    (mount,) = [m for m in frontend["volumeMounts"] if m["mountPath"] == state_dir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = documents["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert f"{next(iter(gpu_model['volumes']))}:{state_dir}" in services[FRONTEND]["volumes"]
    # The init container waits on the same cluster, and its script compiles.
    (wait,) = pod["initContainers"]
    assert _env(wait)["PSG_RAY_JOIN"] == k8s_address and _env(wait)["PSG_WAIT_RESOURCE"] == "GPU"
    assert wait["command"][:2] == ["python", "-c"]
    compile(wait["command"][2], "<wait-for-workers>", "exec")
    # The Service routes the gRPC port to the frontend pods.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == port and grpc_port["targetPort"] == "grpc"


# ----------------------------------------------------------------------------------------- README
def test_deploy_readme_names_files_and_commands_that_exist() -> None:
    text = (DEPLOY / "README.md").read_text()
    paths = set(re.findall(r"\b(deploy/[\w./-]+\w)", text))
    assert paths
    for path in paths:
        assert (REPO / path).exists() or path.startswith("deploy/secrets/"), path
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    # Used as a command with flags (not a container or Secret name given to --name / create secret).
    commands = set(re.findall(r"(?<!--name )(?<!generic )\b(psg-[a-z]+) --", text))
    assert {"psg-server", "psg-health"} <= commands <= set(scripts)


# ----------------------------------------------------------------------------------- make-secrets.sh
def _make_secrets(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs a copy of make-secrets.sh in ``tmp_path`` (it writes beside itself, never into deploy/)."""
    script = tmp_path / "make-secrets.sh"
    script.write_bytes((DEPLOY / "make-secrets.sh").read_bytes())
    return subprocess.run(["sh", str(script), *args], capture_output=True, text=True, timeout=120, check=False)


def test_make_secrets_writes_what_compose_mounts(tmp_path: Path, gpu_model: dict[str, Any]) -> None:
    result = _make_secrets(tmp_path)
    assert result.returncode == 0, result.stderr
    for secret in gpu_model["secrets"].values():  # "./secrets/..." beside the compose file, here beside the script
        written = tmp_path / secret["file"]
        assert written.is_file() and written.stat().st_mode & 0o077 == 0, written
    label, token = (tmp_path / "secrets" / "psg_tokens.txt").read_text().split()
    assert label == "trainer" and len(token) >= 16
    assert "awk '$1 == \"trainer\" {print $2}' deploy/secrets/psg_tokens.txt" in result.stdout  # how to hand it out
    assert _make_secrets(tmp_path, "--tls").returncode == 2  # a name is required


@pytest.mark.skipif(shutil.which("openssl") is None, reason="make-secrets.sh --tls needs openssl")
def test_make_secrets_tls_files_serve_tls(tmp_path: Path) -> None:
    from cryptography import x509

    from psg_client import GradientClient, TLSConfig
    from tests.server.service_harness import serve

    result = _make_secrets(tmp_path, "--tls", "psg.example.org")
    assert result.returncode == 0, result.stderr
    tls = tmp_path / "secrets" / "tls"
    for name in ("ca.pem", "ca.key", "server.pem", "server.key"):  # what the TLS override mounts, and the CA key
        assert (tls / name).is_file() and (tls / name).stat().st_mode & 0o077 == 0, name
    override = load_yaml(COMPOSE_TLS)
    assert {Path(s["file"]).name for s in override["secrets"].values()} <= {"ca.pem", "server.pem", "server.key"}
    certificate = x509.load_pem_x509_certificate((tls / "server.pem").read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"psg.example.org", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    # A psg-server serves TLS with them, and a trainer holding ca.pem verifies it.
    with serve(tls_cert=tls / "server.pem", tls_key=tls / "server.key") as server:
        trust = TLSConfig(root_certificates=(tls / "ca.pem").read_bytes(), server_name_override="psg.example.org")
        with GradientClient(server.target, tls=trust, timeout_s=30) as client:
            assert client.server_info().version


# ------------------------------------------------------------------------------------------- README
def _section(text: str, number: int) -> str:
    match = re.search(rf"^## {number}\. .*?(?=^## )", text, re.M | re.S)
    assert match, f"deploy/README.md has no section {number}"
    return match.group(0)


def test_compose_header_agrees_with_the_readme() -> None:
    header = "\n".join(line for line in COMPOSE.read_text().splitlines() if line.startswith("#"))
    readme = (DEPLOY / "README.md").read_text()
    secrets_command = re.search(r"^(sudo deploy/make-secrets\.sh 1000)$", _section(readme, 2), re.M)
    assert secrets_command and secrets_command.group(1) in header
    # GPU workers are not scaled on one host (README section 4); CPU workers are.
    assert "Do not --scale gpu-worker" in header and "--scale cpu-worker=N" in header
    assert "Do not run several GPU worker containers on one host with `--scale`" in _section(readme, 4)


def test_the_readme_says_how_a_trainer_gets_its_token_and_the_client() -> None:
    section = _section((DEPLOY / "README.md").read_text(), 3)
    assert "sudo awk '$1 == \"trainer\" {print $2}' deploy/secrets/psg_tokens.txt" in section
    assert 'pip install ".[client]"' in section and "[client]" in section
    assert "client" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert 'open("deploy/secrets/psg_tokens.txt")' not in section  # that file is on the deploy host only


def test_the_readme_lists_the_kubernetes_tools_it_uses() -> None:
    readme = (DEPLOY / "README.md").read_text()
    requirements = readme.split("## 1.", 1)[0]
    lines = [line for block in re.findall(r"```sh\n(.*?)```", _section(readme, 7), re.S)
             for line in block.splitlines() if line.strip() and not line.startswith("#")]
    commands = {part.split()[0].strip("()") for line in lines for part in re.split(r"&&|;", line) if part.strip()}
    assert {"helm", "kubectl", "kustomize"} <= commands
    for tool in commands - {"cd"}:
        assert f"`{tool}`" in requirements or tool == "docker", f"README requirements do not list {tool}"
