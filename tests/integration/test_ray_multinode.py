"""Real multi-node Ray on one host: ``ray start --head`` plus a second ``ray start --address`` node
(its own raylet, object store, process tree and resources; Ray advertises the host's address
rather than 127.0.0.1), ``psg-server --ray-address`` on top, a client running steps.
Shards run on both nodes; SIGKILL of the second node's raylet mid-step costs latency, not the step.

The cluster runs with Ray's default authentication, as a user gets it: a token in ``~/.ray/auth_token``
(here a private ``HOME``), so ``ray start --head`` turns token authentication on; the second node is
told ``RAY_AUTH_MODE=token`` (as Ray's documentation says for every other node), and psg-server is
told nothing: it finds the token itself. A psg-server without the token exits with one line naming
the cause and the fix.

Everything is started and stopped inside the test, with timeouts everywhere. Teardown kills only
the processes this test started (the trees of its ``ray start --block`` and server processes, and
any stray process whose command line names this test's private Ray temp dir); ``ray stop`` is
never used, because it kills every Ray process of the machine, other people's included.
"""

from __future__ import annotations

import tests.ports

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from psg_client import GradientClient
from psg_core.config import DPConfig
from psg_server.models import default_registry
from tests.server.service_harness import FAST_RETRY, local_dp, mlp_batch

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process trees from /proc")

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
PLUGIN = "tests.server.pool_models"
#: Forward-pass sleep of the model: a step is in flight long enough to kill a node under it.
SLOW_MS = 1500
#: Node failure detection in seconds rather than Ray's default ~30 s (head only).
FAST_HEALTH_CHECKS = json.dumps({"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                                 "health_check_timeout_ms": 1000, "health_check_failure_threshold": 5})


def free_port() -> int:
    return tests.ports.free_port()


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().decode(errors="replace")
    except OSError:  # the process is gone
        return ""


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace("\0", " ")


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def process_name(pid: int) -> str:
    return _read(f"/proc/{pid}/comm").strip()


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc: no psutil here)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _read(f"/proc/{entry.name}/stat")
            if stat:  # "pid (comm) state ppid ...": comm may hold spaces, so split after ')'
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


class Processes:
    """The processes this test starts, each with its log file; :meth:`stop` kills their trees."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                                   cwd=self.root, start_new_session=True)
        log.close()
        self.started[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def wait_log(self, name: str, pattern: str, timeout: float) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            if self.started[name].poll() is not None:
                code = self.started[name].returncode
                raise AssertionError(f"{name} exited with {code}:\n{self.log(name)[-3000:]}")
            return re.search(pattern, self.log(name))
        try:
            return wait_for(found, timeout, f"{pattern!r} in {name}'s output")
        except AssertionError as error:
            raise AssertionError(f"{error}\n--- {name} output ---\n{self.log(name)[-3000:]}") from None

    def tree(self, name: str) -> list[int]:
        """Process ids of ``name``'s process and its descendants."""
        process = self.started[name]
        return descendants(process.pid) if process.poll() is None else []

    def stop(self) -> None:
        doomed = {pid for name in self.started for pid in self.tree(name)}
        marker = str(self.root)
        for entry in Path("/proc").iterdir():  # strays: Ray workers retitle themselves, but keep their cwd
            pid = int(entry.name) if entry.name.isdigit() else None
            if pid is not None and (marker in cmdline(pid) or _cwd(pid).startswith(marker)):
                doomed.add(pid)
        doomed.discard(os.getpid())
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for process in self.started.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=15)
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{pid}").exists() and "zombie" not in _read(f"/proc/{pid}/status").lower()
                  for pid in doomed) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.fixture()
def processes() -> Iterator[Processes]:
    # A short private root: Ray's socket paths live under it and must stay short.
    root = Path(tempfile.mkdtemp(prefix="psgray-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Ray's default authentication: a token in ~/.ray/auth_token of a HOME of the test's own.
    (root / "home").mkdir()
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", HOME=str(root / "home"))
    subprocess.run([str(RAY), "get-auth-token", "--generate"], env=env, cwd=root, capture_output=True, timeout=120,
                   check=True)
    assert (root / "home" / ".ray" / "auth_token").is_file()
    started = Processes(root, env)
    try:
        yield started
    finally:
        started.stop()
        shutil.rmtree(root, ignore_errors=True)


#: What a node joining a token-authenticated cluster, or a script connecting to it, is told (Ray
#: turns the mode on by itself only on the head, and for drivers of address="auto").
TOKEN_MODE = {"RAY_AUTH_MODE": "token"}


def ray_node(processes: Processes, name: str, *extra: str, env: dict[str, str] | None = None) -> None:
    processes.start(name, [str(RAY), "start", "--block", "--num-cpus=1", "--num-gpus=0",
                           f"--object-store-memory={100 << 20}", f"--temp-dir={processes.root / name}",
                           f"--dashboard-agent-listen-port={free_port()}",
                           f"--metrics-export-port={free_port()}",
                           "--disable-usage-stats", *extra], env=env)
    processes.wait_log(name, r"Ray runtime started", timeout=90)


def node_ids_by_resource(processes: Processes, address: str) -> dict[str, str]:
    """Custom resource -> node id, from a short-lived driver of its own."""
    script = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
              "print('NODES ' + json.dumps({r: n['NodeID'] for n in ray.nodes() if n['Alive'] "
              "for r in n['Resources'] if r.startswith('psg_')}))" % address)
    output = subprocess.run([sys.executable, "-c", script], env={**processes.env, **TOKEN_MODE}, cwd=processes.root,
                            capture_output=True, text=True, timeout=90, check=True).stdout
    return json.loads(output.split("NODES ", 1)[1].splitlines()[0])


def running_shard(tree: list[int]) -> bool:
    # A small shard's call is run_packed (the whole call pickled in one argument), a larger one run_shard.
    return any(method in cmdline(pid) for pid in tree
               for method in ("GradientWorker.run_shard", "GradientWorker.run_packed"))


def test_shards_run_on_both_nodes_and_survive_losing_one(processes: Processes) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    ray_node(processes, "head", "--head", f"--port={port}", "--include-dashboard=false",
             f"--ray-client-server-port={free_port()}", "--resources={\"psg_head\": 1}",
             f"--system-config={FAST_HEALTH_CHECKS}")
    assert "Token authentication is enabled" in processes.log("head")  # Ray's default with a token at hand
    ray_node(processes, "node2", f"--address={address}", "--resources={\"psg_node2\": 1}", env=TOKEN_MODE)
    nodes = node_ids_by_resource(processes, address)
    assert set(nodes) == {"psg_head", "psg_node2"}

    # Without the token, psg-server cannot join: one line says why and what to do, and it exits.
    (processes.root / "tokenless").mkdir()
    tokenless = processes.start("tokenless", [sys.executable, "-m", "psg_server", "--port", "0", "--ray-address",
                                              address], env={"HOME": str(processes.root / "tokenless")})
    assert tokenless.wait(timeout=180) == 2
    refusal = [line for line in processes.log("tokenless").splitlines() if "psg_server" in line and "ERROR" in line]
    assert len(refusal) == 1 and "requires token authentication and this host has no Ray token" in refusal[0], \
        processes.log("tokenless")[-3000:]
    assert "Traceback" not in processes.log("tokenless")

    processes.start("server", [sys.executable, "-m", "psg_server", "--port", "0", "--ray-address", address,
                               "--cpus-per-worker", "1", "--model-plugin", PLUGIN])
    server_port = int(processes.wait_log("server", r"serving on port (\d+)", timeout=120).group(1))
    with GradientClient(f"127.0.0.1:{server_port}", retry=FAST_RETRY, timeout_s=120) as client:
        workers = client.server_info().workers
        node_of = {w.id: w.node.split("/", 1)[1] for w in workers}  # node = "<ip>/<node id>"
        assert len(workers) == 2 and {w.device for w in workers} == {"cpu"}
        assert sorted(node_of.values()) == sorted(n[:12] for n in nodes.values()), node_of

        config = DPConfig(max_grad_norm=0.5)
        kwargs = {"in_features": 6, "hidden": 8, "num_classes": 3, "delay_ms": SLOW_MS}
        model = default_registry((PLUGIN,)).build("slow_mlp", kwargs)
        inputs, targets = mlp_batch(6)
        expected = local_dp(model, inputs, targets, config)
        with client.create_session("slow_mlp", model_kwargs=kwargs, loss="cross_entropy",
                                   expected_batch_size=6, config=config) as session:
            session.push_parameters(model)

            def check(result: Any) -> None:
                for name, grad in result.grads.items():
                    torch.testing.assert_close(grad, expected.grads[name] / 6, rtol=1e-5, atol=1e-6)

            check(session.compute_gradients(inputs, targets))
            results: list[Any] = []
            errors: list[BaseException] = []
            stop = threading.Event()

            def steps() -> None:  # steps back to back, so shards keep running on both nodes
                while not stop.is_set():
                    try:
                        results.append(session.compute_gradients(inputs, targets))
                    except Exception as error:  # reported by the main thread
                        errors.append(error)
                        return

            trainer = threading.Thread(target=steps, daemon=True)
            trainer.start()
            seen: set[str] = set()

            def both_seen_and_node2_busy() -> bool:
                # Ray titles a worker process after the task it runs.
                busy = {node for node in ("head", "node2") if running_shard(processes.tree(node))}
                seen.update(busy)
                return bool(errors) or (seen == {"head", "node2"} and "node2" in busy)

            wait_for(both_seen_and_node2_busy, 120, "a shard running on each node")
            assert not errors, errors
            raylets = [pid for pid in processes.tree("node2") if process_name(pid) == "raylet"]
            assert len(raylets) == 1
            done_before_kill = len(results)
            os.kill(raylets[0], signal.SIGKILL)  # mid-shard on node2
            wait_for(lambda: errors or len(results) >= done_before_kill + 2, 180, "two steps after the kill")
            stop.set()
            trainer.join(timeout=120)
            assert not trainer.is_alive() and not errors, errors
            for result in results:
                check(result)
            check(session.compute_gradients(inputs, targets))

        workers = client.server_info().workers
        assert [node_of.get(w.id) for w in workers] == [nodes["psg_head"][:12]]
    processes.started["server"].send_signal(signal.SIGTERM)
    assert processes.started["server"].wait(timeout=60) == 0
