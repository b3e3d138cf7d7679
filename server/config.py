"""The server's configuration: one frozen dataclass, parsed once from flags and environment.

Every flag has an environment variable ``PSG_<FLAG>`` (``--max-batch-rows`` <-> ``PSG_MAX_BATCH_ROWS``);
a flag given on the command line wins over the environment (``--ray-address`` also reads Ray's own
``RAY_ADDRESS``). Tokens come from ``--tokens-file``
(one token per line, optionally ``label token``; ``#`` starts a comment) or from ``PSG_TOKENS``
(comma-separated), never from a flag, so they do not show up in process listings.

>>> config = ServerConfig.from_args(["--port", "0", "--max-batch-rows", "64"], environ={})
>>> config.port, config.max_batch_rows
(0, 64)
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from psg_core.errors import ConfigError
from psg_server.resident import check_device_name

__all__ = ["ServerConfig", "default_state_dir", "load_tokens"]

logger = logging.getLogger(__name__)

_MIB = 1 << 20
_GIB = 1 << 30
# Room for the protobuf framing around a chunk of tensor bytes.
_FRAME_OVERHEAD = 64 * 1024


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``psg-server`` keeps its sessions unless told otherwise: ``$XDG_STATE_HOME/psg``, else
    ``~/.local/state/psg`` (the XDG base directory convention for state that survives restarts).

    >>> default_state_dir({"XDG_STATE_HOME": "/var/state"})
    PosixPath('/var/state/psg')
    """
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "psg"


def load_tokens(text: str, *, source: str) -> dict[str, str]:
    """Parses a tokens file: ``{token: label}``.

    The label is the token's principal: sessions belong to it. Two tokens with the same label
    share sessions (useful while rotating a token); an unlabeled token gets a label derived from
    its hash, so distinct tokens never share one by accident.

    >>> load_tokens("alice alice-secret-0123456\\n# ops\\nanother-token-98765\\n", source="inline")
    {'alice-secret-0123456': 'alice', 'another-token-98765': 'token-b06617ad43'}
    """
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ConfigError(f"load_tokens: {source} line {number} has {len(parts)} fields; expected "
                              "'token' or 'label token'")
        token = parts[-1]
        label = parts[0] if len(parts) == 2 else f"token-{hashlib.sha256(token.encode()).hexdigest()[:10]}"
        if len(token) < 16:
            raise ConfigError(f"load_tokens: {source} line {number}: tokens must have at least 16 "
                              "characters")
        if token in tokens:
            raise ConfigError(f"load_tokens: {source} line {number} repeats a token")
        tokens[token] = label
    return tokens


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs, validated on construction.

    Defaults suit one host and a loopback address; ``port=0`` binds an ephemeral port (tests).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    #: gRPC max message size, both directions. Tensors travel in chunks well below it.
    max_message_bytes: int = 4 * _MIB
    #: Chunk size of the tensors the server sends. What it accepts is :attr:`max_chunk_bytes`.
    chunk_bytes: int = 1 * _MIB
    #: Largest single tensor accepted.
    max_tensor_bytes: int = 2 * _GIB
    #: Largest sum of tensor bytes in one request (a parameter set or a batch).
    max_request_bytes: int = 8 * _GIB
    #: Most rows (N * K) in one batch.
    max_batch_rows: int = 65_536
    #: Largest parameter set a model built from the registry may have.
    max_model_bytes: int = 8 * _GIB
    #: Open sessions across all tokens.
    max_sessions: int = 256
    #: Open sessions of one token (its label; every caller is one when the server has no tokens), so
    #: that one trainer cannot take all of ``max_sessions`` for the idle period.
    max_sessions_per_token: int = 64
    #: Sessions idle this long are closed.
    session_idle_seconds: float = 3600.0
    #: A request stream (PushParameters, ComputeGradients) that sends no message for this long is
    #: ended with DEADLINE_EXCEEDED (reason STREAM_IDLE), releasing what it held.
    stream_idle_seconds: float = 60.0
    #: Parameter sets kept in memory across sessions; beyond it the least recently used sets are
    #: dropped (their sessions stay open, and clients push again on PARAMETERS_MISSING).
    parameter_memory_bytes: int = 16 * _GIB
    #: Largest shard in samples; a batch is split into at least one shard per worker.
    max_shard_samples: int = 1024
    #: Where shards run: "inprocess" (threads of this process; the library default) or "ray" (the
    #: worker pool; the ``psg-server`` command's default).
    executor: str = "inprocess"
    #: Workers: in-process threads (None = 1) or Ray actors (None = one per GPU, or one per
    #: ``cpus_per_worker`` CPUs on a cluster without GPUs).
    num_workers: int | None = None
    #: CPU cores Ray reserves for each worker, and its torch threads.
    cpus_per_worker: int = 1
    #: Where shards compute: "auto" (a GPU when there is one: the in-process executor's current CUDA
    #: device, one GPU per Ray worker when the cluster has GPUs), "cpu", "cuda" or "cuda:<i>" (Ray
    #: workers: any "cuda" means one GPU each, whatever the index). Ray workers share the GPUs when
    #: ``num_workers`` exceeds them; "cpu" asks Ray for none.
    device: str = "auto"
    #: Ray cluster to join (``host:port``); None starts an embedded local Ray.
    ray_address: str | None = None
    #: Ray pool: small steps reach the workers on the frontend's node through a compiled Ray graph
    #: (a shared-memory channel) instead of an actor call (psg_server.channel): ~1.4 ms less per
    #: step, for one CPU core kept busy on each side of every channel (Ray's readers poll).
    direct_channels: bool = False
    #: Server-side cap on one step; a client deadline can only shorten it.
    step_timeout_seconds: float = 600.0
    #: Accountant used when a session does not name one: "rdp" or "pld".
    default_accountant: str = "rdp"
    #: Directory of the SQLite session store (settings, epsilon ledger, step counter, parameter
    #: version), so sessions survive a restart; None keeps them in memory only (the library's
    #: default, for servers embedded in tests; the ``psg-server`` command defaults to
    #: :func:`default_state_dir`). ``--state-dir none`` turns the store off.
    state_dir: Path | None = None
    tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: CA bundle for client certificates; setting it turns on mutual TLS.
    tls_client_ca: Path | None = None
    #: Allow a non-loopback bind without tokens or TLS.
    insecure: bool = False
    #: Prometheus HTTP port; None = no metrics endpoint, 0 = an ephemeral port.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: Modules whose ``register_models(registry)`` adds architectures.
    model_plugins: tuple[str, ...] = ()
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ServerConfig: port must be in 0..65535, got {self.port}")
        if self.max_message_bytes < 2 * _FRAME_OVERHEAD:
            raise ConfigError(f"ServerConfig: max_message_bytes must be >= {2 * _FRAME_OVERHEAD}, got "
                              f"{self.max_message_bytes}")
        if not 1 <= self.chunk_bytes <= self.max_message_bytes - _FRAME_OVERHEAD:
            raise ConfigError(f"ServerConfig: chunk_bytes must be in 1..max_message_bytes - "
                              f"{_FRAME_OVERHEAD}, got {self.chunk_bytes}")
        for name in ("max_tensor_bytes", "max_request_bytes", "max_batch_rows", "max_model_bytes",
                     "max_sessions", "max_sessions_per_token", "parameter_memory_bytes", "max_shard_samples",
                     "num_workers", "cpus_per_worker"):
            value = getattr(self, name)
            if name == "num_workers" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ServerConfig: {name} must be an int >= 1, got {value!r}")
        for name in ("session_idle_seconds", "stream_idle_seconds", "step_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ServerConfig: {name} must be > 0, got {getattr(self, name)!r}")
        try:
            check_device_name(self.device)
        except ConfigError as error:
            raise ConfigError(f"ServerConfig: {error}") from None
        if self.executor not in ("inprocess", "ray"):
            raise ConfigError(f"ServerConfig: executor must be 'inprocess' or 'ray', got {self.executor!r}")
        if self.default_accountant not in ("rdp", "pld"):
            raise ConfigError(f"ServerConfig: default_accountant must be 'rdp' or 'pld', got "
                              f"{self.default_accountant!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("ServerConfig: tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("ServerConfig: tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"ServerConfig: metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.state_dir is not None:
            text = str(self.state_dir).strip()
            object.__setattr__(self, "state_dir", None if text.lower() in ("", "none") else
                               Path(text).expanduser())
        object.__setattr__(self, "tokens", dict(self.tokens))
        object.__setattr__(self, "model_plugins", tuple(self.model_plugins))

    @property
    def tls(self) -> bool:
        """Whether the server listens with TLS."""
        return self.tls_cert is not None

    @property
    def max_chunk_bytes(self) -> int:
        """The largest chunk the server accepts: what fits a message of ``max_message_bytes`` with
        room for its framing (``Limits.max_chunk_bytes``)."""
        return self.max_message_bytes - _FRAME_OVERHEAD

    @property
    def address(self) -> str:
        """``host:port`` to bind (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, *,
                  defaults: Mapping[str, object] | None = None) -> ServerConfig:
        """Parses flags (``argv``, default ``sys.argv[1:]``) over ``PSG_*`` environment variables.

        ``defaults`` replaces field defaults for fields that neither a flag nor the environment
        sets (the ``psg-server`` command passes :func:`psg_server.cli.command_defaults`).
        """
        environ = os.environ if environ is None else environ
        parser = build_parser(defaults)
        args = parser.parse_args(argv)
        values: dict[str, object] = {}
        for item in fields(cls):
            if item.name == "tokens":
                continue
            value = getattr(args, item.name, None)
            env_value = environ.get(f"PSG_{item.name.upper()}")
            if value is None and env_value is not None:
                value = _from_env(item.name, env_value)
            if value is None and item.name == "ray_address":
                value = environ.get("RAY_ADDRESS") or None
            if value is None and defaults is not None:
                value = defaults.get(item.name)
            if value is not None:
                values[item.name] = value
        values["tokens"] = _tokens(args.tokens_file or environ.get("PSG_TOKENS_FILE"),
                                   environ.get("PSG_TOKENS"))
        return cls(**values)  # type: ignore[arg-type]


_INT_FIELDS = {"port", "max_message_bytes", "chunk_bytes", "max_tensor_bytes", "max_request_bytes",
               "max_batch_rows", "max_model_bytes", "max_sessions", "max_sessions_per_token",
               "parameter_memory_bytes", "max_shard_samples", "num_workers", "cpus_per_worker", "metrics_port"}
_FLOAT_FIELDS = {"session_idle_seconds", "stream_idle_seconds", "step_timeout_seconds"}
_PATH_FIELDS = {"tls_cert", "tls_key", "tls_client_ca", "state_dir"}
_BOOL_FIELDS = {"insecure", "direct_channels"}


def _from_env(name: str, text: str) -> object:
    try:
        if name in _INT_FIELDS:
            return int(text)
        if name in _FLOAT_FIELDS:
            return float(text)
    except ValueError:
        raise ConfigError(f"ServerConfig: PSG_{name.upper()}={text!r} is not a number") from None
    if name in _PATH_FIELDS:
        return Path(text)
    if name in _BOOL_FIELDS:
        return text.strip().lower() in ("1", "true", "yes", "on")
    if name == "model_plugins":
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return text


def _tokens(path: str | None, inline: str | None) -> dict[str, str]:
    tokens: dict[str, str] = {}
    if path:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"ServerConfig: cannot read tokens file {path!r}: {err}") from None
        tokens.update(load_tokens(text, source=str(path)))
    if inline:
        tokens.update(load_tokens("\n".join(inline.split(",")), source="PSG_TOKENS"))
    return tokens


def build_parser(defaults: Mapping[str, object] | None = None) -> argparse.ArgumentParser:
    """The ``psg-server`` argument parser.

    Every default lives in :class:`ServerConfig`; the parser's own defaults stay ``None`` so that
    ``from_args`` can tell a flag that was given from one that was not (and fall back to the
    environment). The help text shows each flag's effective default, read from the dataclass with
    ``defaults`` (the command's overrides, as in :meth:`ServerConfig.from_args`) on top.

    >>> "(default: 65536)" in " ".join(build_parser().format_help().split())
    True
    """
    parser = argparse.ArgumentParser(
        prog="psg-server",
        description="psg gradient service (gRPC). Every flag also reads the environment variable "
                    "PSG_<FLAG> (--max-batch-rows = PSG_MAX_BATCH_ROWS); a flag given here wins.")
    field_defaults = _field_defaults(defaults)

    def add(*flags: str, help: str, shown: str | None = None, **kwargs: object) -> None:
        """Adds a flag whose help ends with its default: ``shown``, else the field's default."""
        dest = str(kwargs.get("dest") or flags[0].removeprefix("--").replace("-", "_"))
        default = shown if shown is not None else _show_default(dest, field_defaults[dest])
        # argparse %-formats help strings.
        parser.add_argument(*flags, help=f"{help} (default: {default})".replace("%", "%%"),
                            **kwargs)  # type: ignore[arg-type]

    add("--host", metavar="HOST",
        help="address to bind; a non-loopback address needs tokens or TLS, or --insecure")
    add("--port", type=int, metavar="PORT", help="port to bind; 0 = an ephemeral port")
    add("--max-message-bytes", type=int, metavar="BYTES", help="gRPC max message size, both directions")
    add("--chunk-bytes", type=int, metavar="BYTES",
        help="chunk size of the tensors the server sends; it accepts chunks up to --max-message-bytes "
             "less 64 KiB of framing")
    add("--max-tensor-bytes", type=int, metavar="BYTES", help="largest single tensor accepted")
    add("--max-request-bytes", type=int, metavar="BYTES",
        help="largest sum of tensor bytes in one request, a parameter set or a batch")
    add("--max-batch-rows", type=int, metavar="ROWS", help="most rows (N*K) in one batch")
    add("--max-model-bytes", type=int, metavar="BYTES",
        help="largest parameter set of a model the server builds")
    add("--max-sessions", type=int, metavar="N", help="open sessions across all tokens")
    add("--max-sessions-per-token", type=int, metavar="N",
        help="open sessions of one token (its label; without tokens, of all callers together)")
    add("--session-idle-seconds", type=float, metavar="SECONDS", help="sessions idle this long are closed")
    add("--stream-idle-seconds", type=float, metavar="SECONDS",
        help="a request stream that sends no message this long ends with DEADLINE_EXCEEDED "
             "(reason STREAM_IDLE)")
    add("--parameter-memory-bytes", type=int, metavar="BYTES",
        help="parameter sets kept in memory across sessions; beyond it the least recently used are "
             "dropped and their clients push them again")
    add("--max-shard-samples", type=int, metavar="N",
        help="largest shard in samples; a batch is split into at least one shard per worker")
    add("--executor", choices=("ray", "inprocess"),
        help="where shards run: the Ray worker pool, or threads of this process")
    add("--workers", "--num-workers", dest="num_workers", type=int, metavar="N",
        help="workers: Ray actors or in-process threads",
        shown="one per GPU, else one per --cpus-per-worker CPUs with Ray; 1 in-process")
    add("--cpus-per-worker", type=int, metavar="N", help="CPU cores (and torch threads) of each Ray worker")
    add("--device", metavar="auto|cpu|cuda[:i]",
        help="where shards compute: auto = a GPU when there is one (in-process: the current CUDA device; Ray: "
             "one GPU per worker when the cluster has GPUs), cpu, or cuda / cuda:<i> (in-process: that GPU; "
             "Ray: one GPU per worker, whatever the index; more --workers than GPUs share them)")
    add("--ray-address", metavar="HOST:PORT", help="Ray cluster to join",
        shown="RAY_ADDRESS, else start an embedded local Ray")
    add("--direct-channels", action=argparse.BooleanOptionalAction, default=None,
        help="Ray pool: small steps reach the workers on this node through a compiled Ray graph (a "
             "shared-memory channel: ~1.4 ms less per step) instead of an actor call; each channel keeps a "
             "CPU core busy in the worker and in the frontend (Ray's channel readers poll)", shown="off")
    add("--step-timeout-seconds", type=float, metavar="SECONDS",
        help="server-side cap on one step; a client deadline can only shorten it")
    add("--default-accountant", choices=("rdp", "pld"),
        help="privacy accountant of sessions that do not name one")
    add("--state-dir", type=Path, metavar="PATH",
        help="directory of the SQLite session store: settings, epsilon ledger, step counter and "
             "parameter version of every session, written before a step's result is returned, so "
             "sessions survive a restart (clients push their parameters again); 'none' keeps "
             "sessions in memory only; one server per directory",
        shown=None if field_defaults["state_dir"] is not None else "none, sessions in memory only")
    add("--tokens-file", metavar="PATH", help="bearer tokens, one per line: 'token' or 'label token'",
        shown="PSG_TOKENS=tok1,tok2, else no authentication")
    add("--tls-cert", type=Path, metavar="PATH", help="PEM certificate chain; with --tls-key turns on TLS",
        shown="none, plaintext")
    add("--tls-key", type=Path, metavar="PATH", help="PEM private key of --tls-cert", shown="none")
    add("--tls-client-ca", type=Path, metavar="PATH",
        help="PEM CA bundle; requires client certificates signed by it (mutual TLS)", shown="none")
    # None, not store_true's False, keeps "not given" apart so PSG_INSECURE can apply.
    add("--insecure", action="store_true", default=None,
        help="allow a non-loopback address without tokens or TLS", shown="off")
    add("--metrics-port", type=int, metavar="PORT", help="Prometheus HTTP port; 0 = an ephemeral port",
        shown="off, no metrics endpoint")
    add("--metrics-host", metavar="HOST", help="address of the Prometheus endpoint")
    add("--model-plugin", dest="model_plugins", action="append", metavar="MODULE",
        help="module whose register_models(registry) adds architectures; repeatable", shown="none")
    add("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    return parser


def _field_defaults(overrides: Mapping[str, object] | None) -> dict[str, object]:
    values = {item.name: item.default for item in fields(ServerConfig)}
    values.update(overrides or {})
    return values


def _show_default(name: str, value: object) -> str:
    """``4194304`` -> ``"4194304 = 4 MiB"`` for byte sizes; ``str(value)`` otherwise."""
    if name.endswith("_bytes") and isinstance(value, int):
        for unit, size in (("GiB", _GIB), ("MiB", _MIB)):
            if value >= size and value % size == 0:
                return f"{value} = {value // size} {unit}"
    return str(value)
