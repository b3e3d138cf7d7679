"""Worker nodes joining and leaving a running cluster, with real ``ray start`` nodes on one host (the
container lifecycle of deploy/, without containers): a head without CPUs, two worker nodes, and
``psg-server --ray-address`` following them.

* A worker node stopped as a container stops (SIGTERM to its ``ray start --block``) while shards
  run on it: Ray drains the node for up to 30 s before it stops. psg-server sees the node draining,
  sends its shards elsewhere at once and releases it, so the node stops within seconds; no step
  fails or waits for Ray to declare the node dead, and no actor is placed on it again.
* A worker node that joins gets an actor without a restart of the frontend.
* A frontend started right after a node left counts the live nodes' CPUs, not Ray's resource
  totals (which keep the departed node for a while): every actor it plans comes up.

Teardown kills only what the test started (see test_ray_multinode.py, whose process helpers this
module shares).
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from typing import Any

import pytest
import torch

from psg_client import GradientClient
from psg_core.config import DPConfig
from psg_server.models import default_registry
from tests.integration import test_ray_multinode as multinode
from tests.integration.test_ray_multinode import PLUGIN, RAY, TOKEN_MODE, Processes, free_port, running_shard, wait_for
from tests.server.service_harness import FAST_RETRY, local_dp, mlp_batch

#: The fixture of test_ray_multinode: a private root and HOME (Ray's token), and a teardown that
#: kills only what the test started.
processes = multinode.processes

pytestmark = pytest.mark.timeout(600)

#: Forward-pass sleep: a step is in flight long enough to stop a node under it.
SLOW_MS = 1000
#: Ray's drain on SIGTERM (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, default): a released node stops well
#: before it ends.
RAY_DRAIN_S = 30.0


def start_node(processes: Processes, name: str, *args: str, cpus: int) -> None:
    processes.start(name, [str(RAY), "start", "--block", f"--num-cpus={cpus}", "--num-gpus=0",
                           f"--object-store-memory={100 << 20}", f"--temp-dir={processes.root / name}",
                           f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
                           "--disable-usage-stats", *args], env=TOKEN_MODE)
    processes.wait_log(name, r"Ray runtime started", timeout=120)


def start_server(processes: Processes, name: str, address: str) -> GradientClient:
    processes.start(name, [sys.executable, "-m", "psg_server", "--port", "0", "--ray-address", address,
                           "--cpus-per-worker", "1", "--model-plugin", PLUGIN,
                           "--state-dir", str(processes.root / f"{name}-state")])
    port = int(processes.wait_log(name, r"serving on port (\d+)", timeout=180).group(1))
    return GradientClient(f"127.0.0.1:{port}", retry=FAST_RETRY, timeout_s=180)


def node_of(worker: Any) -> str:
    return str(worker.node.split("/", 1)[1])  # "<ip>/<first 12 hex digits of the node id>"


def test_workers_join_and_leave_a_running_cluster(processes: Processes) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    start_node(processes, "head", "--head", f"--port={port}", "--include-dashboard=false",
               f"--ray-client-server-port={free_port()}", cpus=0)
    start_node(processes, "left", f"--address={address}", cpus=1)
    start_node(processes, "stays", f"--address={address}", cpus=1)
    client = start_server(processes, "server", address)
    with client:
        workers = wait_for(lambda: len(client.server_info().workers) == 2 and client.server_info().workers, 120,
                           "an actor on each worker node")
        assert len({node_of(w) for w in workers}) == 2

        config = DPConfig(max_grad_norm=0.5)
        kwargs = {"in_features": 6, "hidden": 8, "num_classes": 3, "delay_ms": SLOW_MS}
        model = default_registry((PLUGIN,)).build("slow_mlp", kwargs)
        inputs, targets = mlp_batch(6)
        expected = local_dp(model, inputs, targets, config)
        with client.create_session("slow_mlp", model_kwargs=kwargs, loss="cross_entropy", expected_batch_size=6,
                                   config=config) as session:
            session.push_parameters(model)
            durations: list[float] = []
            errors: list[BaseException] = []
            stop = threading.Event()

            def steps() -> None:  # back to back, so shards keep running on both nodes
                while not stop.is_set():
                    began = time.monotonic()
                    try:
                        result = session.compute_gradients(inputs, targets)
                    except Exception as error:  # reported by the main thread
                        errors.append(error)
                        return
                    durations.append(time.monotonic() - began)
                    for name, grad in result.grads.items():
                        torch.testing.assert_close(grad, expected.grads[name] / 6, rtol=1e-5, atol=1e-6)

            trainer = threading.Thread(target=steps, daemon=True)
            trainer.start()
            wait_for(lambda: errors or running_shard(processes.tree("left")), 120, "a shard running on 'left'")
            assert not errors, errors
            # What `docker stop` does to a worker container: SIGTERM to its `ray start --block`.
            stopped_at = time.monotonic()
            processes.started["left"].send_signal(signal.SIGTERM)
            processes.started["left"].wait(timeout=RAY_DRAIN_S + 30)
            stop_seconds = time.monotonic() - stopped_at
            assert stop_seconds < RAY_DRAIN_S - 10, f"the node took {stop_seconds:.1f} s to stop: psg held it"
            count = len(durations)
            wait_for(lambda: errors or len(durations) >= count + 2, 120, "two steps after the node left")
            remaining = {node_of(w) for w in client.server_info().workers}
            assert len(remaining) == 1 and {node_of(w) for w in workers} - remaining, remaining

            # A node joins: the running frontend gives it an actor.
            start_node(processes, "joined", f"--address={address}", cpus=1)
            wait_for(lambda: errors or len(client.server_info().workers) == 2, 120, "an actor on the joined node")
            count = len(durations)
            wait_for(lambda: errors or len(durations) >= count + 2, 120, "steps on the grown pool")
            stop.set()
            trainer.join(timeout=120)
            assert not trainer.is_alive() and not errors, errors
            # Not one step waited for Ray's node timeout (the shards of the stopped node went
            # elsewhere when it started draining).
            assert max(durations) < 15.0, sorted(durations)[-3:]
        joined = {node_of(w) for w in client.server_info().workers}
        assert len(joined) == 2 and remaining < joined

    # The frontend restarted, seconds after a node left: its pool counts the live nodes only, and
    # every actor it plans comes up.
    processes.started["server"].send_signal(signal.SIGTERM)
    assert processes.started["server"].wait(timeout=60) == 0
    with start_server(processes, "restarted", address) as restarted:
        assert {node_of(w) for w in restarted.server_info().workers} == joined
    started = re.findall(r"pool: (\d+) of (\d+) 1-CPU worker\(s\) live", processes.log("restarted"))
    assert started == [("2", "2")], processes.log("restarted")[-3000:]
