"""``pip install "psg[client]"`` is enough for a trainer: the client imports nothing of the server's.

A fresh environment per test would need a torch download, so the test checks the two halves of
the promise: the ``client`` extra declares what psg_client and psg_wire import from outside the
standard library and the base dependencies, and importing the client (and using its codec) in a
process where the server's dependencies cannot be imported works.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: What the server extra brings and a client must not need.
SERVER_ONLY = ("ray", "grpc_health", "grpc_reflection", "grpc_tools", "prometheus_client", "transformers", "peft",
               "psg_server")


def test_the_client_extra_declares_grpc_and_protobuf() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    client = {r.split(">")[0].split("=")[0].strip() for r in project["optional-dependencies"]["client"]}
    assert {"grpcio", "protobuf"} <= client
    assert not any(name.startswith(("ray", "grpcio-tools", "transformers")) for name in client)


@pytest.mark.slow  # a subprocess importing torch
def test_the_client_works_without_the_server_s_dependencies() -> None:
    script = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_ONLY!r}:
            raise ImportError(f"{{name}} is not installed with psg[client]")
sys.meta_path.insert(0, Block())
import torch
from psg_client import GradientClient, TLSConfig
from psg_wire.codec import CodecLimits, TensorDecoder
from psg_wire.convert import dp_config_to_proto
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_core.config import DPConfig
assert dp_config_to_proto(DPConfig(noise_multiplier=1.0)).noise_multiplier == 1.0
with GradientClient("127.0.0.1:1") as client:
    pass
print("client ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0 and "client ok" in result.stdout, result.stderr[-3000:]
