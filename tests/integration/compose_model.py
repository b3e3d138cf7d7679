"""Reading deploy/docker-compose*.yml the way Docker Compose does (and the Dockerfiles), for the deploy tests.

No Docker engine exists on the development machines, so the tests read the compose files
themselves: variable interpolation (``${VAR:-default}``, ``$$``), override files merged over the
base file, profiles, the start order ``depends_on`` implies, and the flags inside commands. The
topology test then runs exactly these commands as local processes.

>>> interpolate("${PSG_PORT:-50051}:50051 $$HOME", {})
'50051:50051 $HOME'
>>> flag_value(["ray", "start", "--port=6379", "--block"], "--port")
'6379'
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_CPU = DEPLOY / "docker-compose.cpu.yml"
COMPOSE_TLS = DEPLOY / "docker-compose.tls.yml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERFILE_CPU = DEPLOY / "docker" / "Dockerfile.cpu"

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)


def interpolate(text: str, environ: Mapping[str, str]) -> str:
    """Compose's variable substitution on one string (``environ`` stands for the shell and .env)."""
    def replace(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        if match.group("named"):
            return environ.get(match.group("named"), "")
        braced = _BRACED.match(match.group("braced"))
        if braced is None:
            raise ValueError(f"interpolate: invalid substitution {match.group(0)!r}")
        name, op, arg = braced.group("name"), braced.group("op"), braced.group("arg")
        value = environ.get(name)
        if op == ":-":
            return value if value else interpolate(arg, environ)
        if op == "-":
            return value if value is not None else interpolate(arg, environ)
        if op in (":?", "?"):
            if (op == ":?" and not value) or value is None:
                raise ValueError(f"interpolate: {name} is required: {arg}")
            return value
        if op == ":+":
            return interpolate(arg, environ) if value else ""
        if op == "+":
            return interpolate(arg, environ) if value is not None else ""
        return value or ""
    return _VARIABLE.sub(replace, text)


def interpolate_tree(node: Any, environ: Mapping[str, str]) -> Any:
    """:func:`interpolate` on every string of a parsed YAML tree (keys included, like Compose)."""
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, list):
        return [interpolate_tree(item, environ) for item in node]
    if isinstance(node, dict):
        return {interpolate_tree(k, environ): interpolate_tree(v, environ) for k, v in node.items()}
    return node


def load_yaml(path: Path) -> dict[str, Any]:
    """One YAML document as a dict (YAML merge keys ``<<`` resolved)."""
    with path.open() as handle:
        document = yaml.safe_load(handle)
    if not isinstance(document, dict):
        raise ValueError(f"load_yaml: {path} does not hold a mapping")
    return document


def merge(base: Any, override: Any) -> Any:
    """Compose's override merge for what psg's files use: mappings merge key by key, anything
    else (scalars, and sequences such as ``command`` or ``profiles``) is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    return override


def load_compose(*paths: Path, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose model of ``paths`` (base file first, then overrides), interpolated."""
    model: dict[str, Any] = {}
    for path in paths or (COMPOSE,):
        model = merge(model, load_yaml(path))
    return interpolate_tree(model, environ or {})


def active_services(model: Mapping[str, Any], profiles: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Services that ``docker compose up`` starts with these profiles active."""
    wanted = set(profiles)
    return {name: service for name, service in model["services"].items()
            if not service.get("profiles") or wanted & set(service["profiles"])}


def dependencies(service: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``depends_on`` in its long form: ``{service: {"condition": ..., "required": ...}}``."""
    depends = service.get("depends_on") or {}
    if isinstance(depends, list):
        return {name: {"condition": "service_started", "required": True} for name in depends}
    return {name: {"condition": spec.get("condition", "service_started"), "required": spec.get("required", True)}
            for name, spec in depends.items()}


def start_order(services: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The services in an order that honours ``depends_on`` (dependencies first).

    A dependency on a service that is not active is an error unless it has ``required: false``.
    """
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"start_order: dependency cycle through {name!r}")
        visiting.add(name)
        for dependency, spec in dependencies(services[name]).items():
            if dependency in services:
                visit(dependency)
            elif spec["required"]:
                raise ValueError(f"start_order: {name!r} requires {dependency!r}, which is not active")
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order


def command_of(service: Mapping[str, Any]) -> list[str]:
    """The service's command as an argument list (psg's files use the list form only)."""
    command = service.get("command")
    if not isinstance(command, list) or not all(isinstance(arg, str) for arg in command):
        raise ValueError(f"command_of: expected a list of strings, got {command!r}")
    return list(command)


def healthcheck_command(service: Mapping[str, Any]) -> list[str]:
    """The healthcheck's argument list (``[CMD, ...]`` form)."""
    test = service["healthcheck"]["test"]
    if not isinstance(test, list) or test[0] != "CMD":
        raise ValueError(f"healthcheck_command: expected ['CMD', ...], got {test!r}")
    return list(test[1:])


def environment_of(service: Mapping[str, Any]) -> dict[str, str]:
    """The service's ``environment`` as a dict of strings."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def flag_value(command: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``command`` (``--flag=value`` or ``--flag value``), or None."""
    for index, arg in enumerate(command):
        if arg == flag and index + 1 < len(command):
            return command[index + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: keyword (upper case), its arguments, its first line."""

    keyword: str
    arguments: str
    line: int

    def json_args(self) -> list[str]:
        """The exec (JSON array) form's arguments."""
        value = json.loads(self.arguments)
        assert isinstance(value, list), f"line {self.line}: {self.keyword} must use the exec form"
        return value


def parse_dockerfile(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, arguments = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
    assert not pending, f"{path}: dangling line continuation"
    return instructions
