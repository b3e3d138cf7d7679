"""Joining a Ray cluster, or starting the embedded one, with errors that name the cause and the fix.

``ray start --head`` of Ray 2.60 turns token authentication on whenever a token exists on the
head's host (``ray get-auth-token --generate`` writes one; so does every embedded ``ray.init()``),
and its GCS then refuses every process that does not present it. A driver that joins with an
explicit address (``psg-server --ray-address``) does not turn the mode on by itself, so it would be
refused although the token sits in ``~/.ray/auth_token``. :func:`prepare_token_auth` does what
Ray does for ``address="auto"``: when ``RAY_AUTH_MODE`` is unset and a token is available
(``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, or Ray's default file
``~/.ray/auth_token``), the process joins in token mode. That is safe against a cluster without
authentication too: its GCS ignores the token. ``RAY_AUTH_MODE`` set by the operator is left as
it is.

:func:`connect` joins (or starts) Ray and turns every failure into one
:class:`~psg_server.errors.NoWorkersError` whose message says what went wrong and what to do:
a refused or missing token, nothing listening at the address, or an embedded Ray that did not
come up (Ray raises plain ``Exception`` when its processes time out starting).

:func:`live_nodes` is the pool's view of the cluster's membership: the nodes the GCS holds alive
right now, with their resources and whether they drain. It is read from the node table, not from
``ray.cluster_resources()``, whose totals keep a node that left for a while (a frontend started
then would plan actors for cores that are gone); a draining node (``ray start --block`` stopped
with SIGTERM: a container stop, a scale-down, a pod deletion) is marked at once, seconds to tens of
seconds before Ray declares it dead.

>>> token_source({"RAY_AUTH_TOKEN": "0123456789abcdef"})
'RAY_AUTH_TOKEN'
>>> token_source({}, home=Path("/nonexistent")) is None
True
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psg_server.errors import NoWorkersError

__all__ = ["AUTH_MODE", "NodeView", "connect", "describe_failure", "live_nodes", "prepare_token_auth",
           "token_source"]

logger = logging.getLogger(__name__)

#: Ray's environment variable for its authentication mode ("token" or "disabled").
AUTH_MODE = "RAY_AUTH_MODE"
_TOKEN = "RAY_AUTH_TOKEN"
_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


def token_source(environ: Mapping[str, str] | None = None, *, home: Path | None = None) -> str | None:
    """Where Ray would read this process's token from, in Ray's own order, or None without one.

    ``RAY_AUTH_TOKEN`` (the token itself), then ``RAY_AUTH_TOKEN_PATH`` (a file; named even when
    missing, so the error can say so), then ``~/.ray/auth_token``.
    """
    environ = os.environ if environ is None else environ
    if environ.get(_TOKEN, "").strip():
        return _TOKEN
    if environ.get(_TOKEN_PATH):
        return f"{_TOKEN_PATH}={environ[_TOKEN_PATH]}"
    default = (home if home is not None else Path.home()) / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def prepare_token_auth(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Turns Ray's token mode on for this process when ``RAY_AUTH_MODE`` is unset and a token is
    available; returns where the token comes from (None: the mode was left alone).

    Call it before joining a cluster by address; Ray reads the mode from its configuration, which
    is reloaded here.
    """
    environ = os.environ if environ is None else environ
    if environ.get(AUTH_MODE):
        return None
    source = token_source(environ)
    if source is None:
        return None
    environ[AUTH_MODE] = "token"
    if environ is os.environ:
        from ray._raylet import Config  # type: ignore[attr-defined]  # Ray's own opt-in does the same

        Config.initialize("")
    return source


def describe_failure(error: BaseException, *, address: str | None, source: str | None,
                     environ: Mapping[str, str] | None = None) -> str:
    """One line: why joining (``address``) or starting (None) Ray failed, and how to fix it."""
    environ = os.environ if environ is None else environ
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    text = " ".join(str(e) for e in chain)
    names = {type(e).__name__ for e in chain}
    if address is None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"cannot start the embedded Ray: {first[:300]}. Fix: check free memory, /dev/shm and "
                "the temporary directory (Ray's processes may have been too slow to start on a busy "
                "host: try again), or start Ray yourself (`ray start --head`) and pass --ray-address")
    where = f"cannot join the Ray cluster at {address}"
    if "AuthenticationError" in names or "InvalidAuthToken" in text or "Unauthenticated" in text:
        mode = environ.get(AUTH_MODE, "")
        if source is None and mode.lower() != "token":
            return (f"{where}: the cluster requires token authentication and this host has no Ray token. "
                    f"Fix: give psg-server the head's token (`ray get-auth-token` on the head prints it) as "
                    f"{_TOKEN}, in the file {_TOKEN_PATH} names, or in ~/.ray/auth_token; see {_DOCS}")
        return (f"{where}: the cluster refused this host's Ray token (from {source or 'Ray defaults'}). "
                f"Fix: use the head's token (`ray get-auth-token` on the head prints it); see {_DOCS}")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"{where}: {first[:300]}. Fix: check that `ray start --head` runs there (`ray status --address "
            f"{address}`), that this host reaches its port, and that both run the same Ray version; or "
            "correct --ray-address / RAY_ADDRESS")


def connect(address: str | None, init_kwargs: Mapping[str, Any]) -> None:
    """Blocking: joins the cluster at ``address`` (token mode as :func:`prepare_token_auth` says),
    or starts an embedded local Ray when ``address`` is None.

    Raises:
        NoWorkersError: whatever went wrong, explained by :func:`describe_failure`.
    """
    import ray

    source = prepare_token_auth() if address else None
    if source is not None:
        logger.info("pool: joining Ray at %s with token authentication (token from %s)", address, source)
    try:
        ray.init(address=address or "local", **init_kwargs)
    except Exception as error:  # Ray raises ConnectionError, RuntimeError, its own errors, plain Exception
        # A half-made connection would make the next attempt say "already connected".
        if ray.is_initialized():
            ray.shutdown()
        raise NoWorkersError(f"WorkerPool.start: {describe_failure(error, address=address, source=source)}") \
            from None


@dataclass(frozen=True)
class NodeView:
    """One live Ray node as the pool sees it.

    Attributes:
        node_id: Ray's node id, hex.
        resources: the node's total resources (``CPU``, ``GPU``, ...).
        draining: the node is being drained (its ``ray start`` got SIGTERM, or ``ray drain-node``):
            it accepts no new work and leaves once idle.
    """

    node_id: str
    resources: Mapping[str, float] = field(default_factory=dict)
    draining: bool = False


def live_nodes(timeout_s: float = 5.0) -> list[NodeView]:
    """Blocking: the nodes of the connected cluster that are alive now (see the module docstring).

    Reads the GCS node table and the draining list through the driver's GCS client (the calls Ray
    Serve makes for the same purpose); where that client is not there (another Ray build), falls
    back to :func:`ray.nodes`, which knows liveness but not draining.

    Raises:
        Exception: whatever the GCS call raises (unreachable, timed out); callers keep their last view.
    """
    import ray

    from ray._private import worker as ray_worker

    gcs = getattr(getattr(ray_worker, "global_worker", None), "gcs_client", None)
    if gcs is None or not hasattr(gcs, "get_all_node_info") or not hasattr(gcs, "get_draining_nodes"):
        return [NodeView(node["NodeID"], dict(node.get("Resources", {})))
                for node in ray.nodes() if node.get("Alive")]
    from ray.core.generated import gcs_pb2

    infos = gcs.get_all_node_info(timeout=timeout_s)
    draining = {_hex(node_id) for node_id in gcs.get_draining_nodes(timeout=timeout_s)}
    return [NodeView(_hex(node_id), dict(info.resources_total), draining=_hex(node_id) in draining)
            for node_id, info in infos.items() if info.state == gcs_pb2.GcsNodeInfo.ALIVE]  # type: ignore[attr-defined]


def _hex(node_id: Any) -> str:
    """A node id as hex, whether Ray handed a NodeID, bytes or a hex string."""
    if isinstance(node_id, str):
        return node_id
    if isinstance(node_id, bytes):
        return node_id.hex()
    return str(node_id.hex())
