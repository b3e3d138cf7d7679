"""Sessions on disk: an embedded SQLite database under ``--state-dir``, so that a frontend restart
(a deploy, a crash, a rescheduled container) loses no session and no accounted step.

One row per open session holds what cannot be rebuilt: the ``CreateSessionRequest`` as the session
was opened (the sigma it chose, the seed it drew), its owner, and its progress: steps, the
accountant's :meth:`~psg_core.accounting.PrivacyAccountant.state_dict`, the latest parameter
version and, with adaptive clipping, the bound the next step clips at; and in the ``step_seeds``
table, the step seeds its steps used (runs of consecutive seeds, :mod:`psg_server.step_seeds`), so a
restarted server still refuses a seed that would repeat a step's noise. The frontend writes the
progress of a step *before* it returns the step's gradient, so a gradient a client received is
always in the ledger after a restart (a step accounted but not delivered, when the process dies in
between, over-counts epsilon, never under-counts it). Parameter tensors are not kept: after a
restart, steps answer PARAMETERS_MISSING and the client pushes again.

SQLite integers are signed 64-bit: a parameter version must be below 2**63 (the server refuses
larger ones at push), and step seeds (``uint64`` on the wire) are stored shifted by -2**63, which
keeps their order.

Every write is one committed transaction in WAL mode with ``synchronous=FULL``: durable when
the call returns, even if the process is killed right after. One server owns a state directory at
a time (an exclusive ``flock`` on ``state_dir/lock``, released by the kernel when the process dies).

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as folder:
...     database = SessionDatabase(Path(folder))
...     database.insert(SessionRecord(session_id="s1", owner="alice", request=b"", steps=0, ledger=None,
...                                   epsilon_spent=0.0, param_version=0, updated=0.0))
...     database.save_progress("s1", steps=1, ledger='{"ledger": []}', epsilon_spent=0.5, param_version=1)
...     [(r.session_id, r.steps, r.param_version) for r in database.load()]
...     database.close()
[('s1', 1, 1)]
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from psg_core.errors import ConfigError

__all__ = ["DATABASE_NAME", "SCHEMA_VERSION", "SessionDatabase", "SessionRecord"]

logger = logging.getLogger(__name__)

#: File name of the database inside the state directory.
DATABASE_NAME = "sessions.sqlite3"
#: Layout of the tables; a database of another version is refused rather than misread (one of
#: version 1, before ``sessions.clip_bound``, or 2, before ``step_seeds``, is upgraded in place: its
#: sessions have no adaptive clipping, and each is taken to have used the step seeds 1..steps, the
#: default seeds of its steps; the explicit ones they were given before are not known).
SCHEMA_VERSION = 3
_LOCK_NAME = "lock"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    -- the CreateSessionRequest as opened: sigma chosen, seed drawn (serialised protobuf)
    request BLOB NOT NULL,
    steps INTEGER NOT NULL,
    -- PrivacyAccountant.state_dict() as JSON; NULL for a session without noise (nothing accounted)
    ledger TEXT,
    epsilon_spent REAL NOT NULL,
    param_version INTEGER NOT NULL,
    -- wall-clock seconds of the last write, for idle expiry across restarts
    updated REAL NOT NULL,
    -- adaptive clipping: the flat bound the next step clips at; NULL for a session without
    clip_bound REAL
);
CREATE TABLE IF NOT EXISTS step_seeds (
    session_id TEXT NOT NULL,
    -- a run of consecutive step seeds the session used, low..high included, each stored minus 2**63
    low INTEGER NOT NULL,
    high INTEGER NOT NULL,
    PRIMARY KEY (session_id, low)
) WITHOUT ROWID;
"""
# Version 1 -> 2: adaptive clipping's bound (NULL for every session of a version 1 database).
_UPGRADE_FROM_1 = "ALTER TABLE sessions ADD COLUMN clip_bound REAL"
#: Step seeds are stored shifted by this (an order-preserving map of uint64 onto SQLite's int64).
_SEED_OFFSET = 1 << 63
# Version 2 -> 3: the step seeds used; a session's default ones (its step indices) are all that is known.
_UPGRADE_FROM_2 = ("INSERT OR IGNORE INTO step_seeds (session_id, low, high) "
                   "SELECT session_id, 1 + ?, steps + ? FROM sessions WHERE steps > 0", (-_SEED_OFFSET, -_SEED_OFFSET))


@dataclass(frozen=True)
class SessionRecord:
    """One session's row."""

    session_id: str
    owner: str
    #: The serialised ``CreateSessionRequest`` the session was opened with.
    request: bytes
    steps: int
    #: The accountant's state as JSON, or None when the session is not accounted.
    ledger: str | None
    epsilon_spent: float
    param_version: int
    #: Wall-clock time (``time.time()``) of the last write.
    updated: float
    #: Adaptive clipping: the bound the session's next step clips at; None without.
    clip_bound: float | None = None
    #: The step seeds its steps used: runs ``(low, high)`` of consecutive seeds, in order.
    step_seeds: tuple[tuple[int, int], ...] = ()


class SessionDatabase:
    """The SQLite store of one state directory (created if missing); see the module docstring.

    Thread-safe: calls may come from the event loop and from worker threads.

    Raises:
        ConfigError: the directory cannot be created or written, another live server holds it, or
            its database has another schema version.
    """

    def __init__(self, state_dir: Path) -> None:
        where = "psg-server: --state-dir"
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(state_dir / _LOCK_NAME, "a+")  # noqa: SIM115 (held until close)
        except OSError as err:
            raise ConfigError(f"{where} {str(state_dir)!r} cannot be used: {err}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            self._lock_file.close()
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"{where} {str(state_dir)!r} is in use by another psg-server; give each "
                                  "server its own state directory") from None
            raise ConfigError(f"{where} {str(state_dir)!r}: cannot lock it: {err}") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"{os.getpid()}\n")
        self._lock_file.flush()
        self.path = state_dir / DATABASE_NAME
        self._connection: sqlite3.Connection | None = None
        try:
            self._connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=FULL")
            self._connection.executescript(_SCHEMA)
            self._check_version()
        except sqlite3.Error as err:
            self._release()
            raise ConfigError(f"{where}: cannot open the session database {str(self.path)!r}: {err}") from None
        except ConfigError:
            self._release()
            raise
        self._lock = threading.Lock()

    def _open(self) -> sqlite3.Connection:
        if self._connection is None:
            raise RuntimeError("SessionDatabase: the database is closed")
        return self._connection

    def _check_version(self) -> None:
        row = self._open().execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            self._open().execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)",
                                     (str(SCHEMA_VERSION),))
        elif row[0] in ("1", "2"):  # one transaction: the changes and the version together, or neither
            with self._transaction() as connection:
                if row[0] == "1":
                    connection.execute(_UPGRADE_FROM_1)
                connection.execute(*_UPGRADE_FROM_2)
                connection.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            logger.info("state: upgraded the session database %s from schema version %s to %d", self.path,
                        row[0], SCHEMA_VERSION)
        elif row[0] != str(SCHEMA_VERSION):
            raise ConfigError(f"psg-server: the session database {str(self.path)!r} has schema version "
                              f"{row[0]}; this server reads version {SCHEMA_VERSION}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction: every statement inside commits together, or none does."""
        connection = self._open()
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield connection
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def _release(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if not self._lock_file.closed:
            self._lock_file.close()  # closing the descriptor releases the flock

    # ----------------------------------------------------------------------------- writes
    def insert(self, record: SessionRecord) -> None:
        """Stores a new session."""
        with self._lock:
            self._open().execute(
                "INSERT INTO sessions (session_id, owner, request, steps, ledger, epsilon_spent, param_version, "
                "updated, clip_bound) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.session_id, record.owner, record.request, record.steps, record.ledger,
                 record.epsilon_spent, record.param_version, record.updated, record.clip_bound))

    def save_progress(self, session_id: str, *, steps: int, ledger: str | None, epsilon_spent: float,
                      param_version: int, clip_bound: float | None = None,
                      step_seeds: tuple[int, int] | None = None) -> None:
        """Records a session's progress after a step (with adaptive clipping, ``clip_bound``: the
        bound its next step clips at; ``step_seeds``: the run of used step seeds that now holds the
        step's seed, which replaces the runs it covers); one transaction, durable when it returns.

        Raises:
            OverflowError: a value SQLite cannot store (an integer beyond 64 bits); nothing is written.
        """
        with self._lock, self._transaction() as connection:
            connection.execute(
                "UPDATE sessions SET steps = ?, ledger = ?, epsilon_spent = ?, param_version = ?, clip_bound = ?, "
                "updated = ? WHERE session_id = ?",
                (steps, ledger, epsilon_spent, param_version, clip_bound, time.time(), session_id))
            if step_seeds is not None:
                low, high = step_seeds[0] - _SEED_OFFSET, step_seeds[1] - _SEED_OFFSET
                connection.execute("DELETE FROM step_seeds WHERE session_id = ? AND low BETWEEN ? AND ?",
                                   (session_id, low, high))
                connection.execute("INSERT INTO step_seeds (session_id, low, high) VALUES (?, ?, ?)",
                                   (session_id, low, high))

    def delete(self, session_id: str) -> None:
        """Forgets a closed or expired session."""
        with self._lock, self._transaction() as connection:
            connection.execute("DELETE FROM step_seeds WHERE session_id = ?", (session_id,))
            connection.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))

    # ----------------------------------------------------------------------------- reads
    def load(self) -> list[SessionRecord]:
        """Every stored session, oldest write first."""
        with self._lock:
            rows = self._open().execute(
                "SELECT session_id, owner, request, steps, ledger, epsilon_spent, param_version, updated, "
                "clip_bound FROM sessions ORDER BY updated").fetchall()
            seeds: dict[str, list[tuple[int, int]]] = {}
            for session_id, low, high in self._open().execute(
                    "SELECT session_id, low, high FROM step_seeds ORDER BY session_id, low"):
                seeds.setdefault(session_id, []).append((low + _SEED_OFFSET, high + _SEED_OFFSET))
        return [SessionRecord(session_id=row[0], owner=row[1], request=bytes(row[2]), steps=row[3], ledger=row[4],
                              epsilon_spent=row[5], param_version=row[6], updated=row[7], clip_bound=row[8],
                              step_seeds=tuple(seeds.get(row[0], ())))
                for row in rows]

    def close(self) -> None:
        """Closes the database and releases the state directory."""
        with self._lock:
            self._release()
