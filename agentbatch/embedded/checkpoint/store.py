"""The checkpoint database: one SQLite file in WAL mode per ``checkpoint_dir``.

One row per agent holds its latest committed state (and, once it ended, its latency). The
engine awaits ``save`` before its next action, so after a SIGKILL each agent repeats at most
the one model call it had in flight. Writes go through one writer thread that commits every
queued row in a single transaction (group commit): the event loop only enqueues and awaits.
``synchronous=NORMAL`` in WAL mode survives a killed process (the OS holds the written WAL);
a power loss may lose the last transactions, which only repeats their turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentbatch.core.agent_state import AgentState
from agentbatch.core.errors import BatchSpecError
from agentbatch.embedded.checkpoint.fingerprint import PARTS, Fingerprint

log = logging.getLogger(__name__)

DB_NAME = "checkpoint.sqlite"
LOCK_NAME = "checkpoint.lock"
SCHEMA_VERSION = "1"
SQLITE_MAGIC = b"SQLite format 3\x00"
WRITE_BATCH = 512  # rows per transaction at most
CLOSE_DEADLINE_S = 30.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS agents (
    idx INTEGER PRIMARY KEY, version INTEGER NOT NULL, status TEXT NOT NULL,
    state TEXT NOT NULL, latency_s REAL, saved_at REAL NOT NULL);
"""
_UPSERT = ("INSERT INTO agents (idx, version, status, state, latency_s, saved_at) "
           "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (idx) DO UPDATE SET version = excluded.version, "
           "status = excluded.status, state = excluded.state, latency_s = excluded.latency_s, "
           "saved_at = excluded.saved_at")


class CheckpointCorrupted(BatchSpecError):
    """The checkpoint database cannot be read; it was left exactly as it was."""


@dataclass(frozen=True)
class SavedAgent:
    state: AgentState
    latency_s: float | None


_STOP = object()


class CheckpointStore:
    """An open checkpoint: the saved agents, and a writer thread for new saves."""

    def __init__(self, where: str, conn: sqlite3.Connection, lock_fd: int,
                 saved: dict[int, SavedAgent]) -> None:
        self.where = where
        self.saved = saved
        self._conn = conn
        self._lock_fd = lock_fd
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                         name="agentbatch-checkpoint")
        self._writer.start()
        self.commits = 0  # transactions written (each may hold many agents' rows)

    async def save(self, state: AgentState, latency_s: float | None = None) -> None:
        """Return once ``state`` is committed; raises what the write raised."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queue.put((state, latency_s, loop, done))
        await done

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            with contextlib.suppress(queue.Empty):
                while len(batch) < WRITE_BATCH:
                    nxt = self._queue.get_nowait()
                    if nxt is _STOP:
                        self._queue.put(_STOP)  # write this batch, then stop
                        break
                    batch.append(nxt)
            error: BaseException | None = None
            try:
                now = time.time()
                rows = [(s.index, s.version, s.status.value, s.model_dump_json(), lat, now)
                        for s, lat, _, _ in batch]
                with self._conn:
                    self._conn.executemany(_UPSERT, rows)
                self.commits += 1
            except Exception as exc:  # surfaced to every waiting agent
                log.exception("checkpoint write to %s failed", self.where)
                error = exc
            for _, _, loop, done in batch:
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(_settle, done, error)

    def close(self) -> None:
        """Write what is queued, stop the writer, close the database and release the lock."""
        self._queue.put(_STOP)
        self._writer.join(CLOSE_DEADLINE_S)
        if self._writer.is_alive():
            log.error("checkpoint writer for %s did not stop within %.0fs", self.where,
                      CLOSE_DEADLINE_S)
            return
        self._conn.close()
        os.close(self._lock_fd)


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():  # the waiting agent was cancelled; the row is written anyway
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def open_checkpoint(checkpoint_dir: str | os.PathLike[str], fingerprint: Fingerprint
                    ) -> CheckpointStore:
    """Open (or create) the checkpoint of this batch in ``checkpoint_dir``.

    Raises ``BatchSpecError`` naming ``checkpoint_dir`` when it is a file, cannot be written,
    is in use by a running batch or holds another batch's checkpoint, and
    ``CheckpointCorrupted`` when its database cannot be read (it is not touched).
    """
    where = os.fspath(checkpoint_dir)
    path = Path(where)
    if path.exists() and not path.is_dir():
        raise BatchSpecError(f"checkpoint_dir {where!r} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise BatchSpecError(f"checkpoint_dir {where!r} cannot be created or written: "
                             f"{exc.strerror or exc}") from None
    try:
        _lock(lock_fd, where)
        conn, saved = _open_db(where, path / DB_NAME, fingerprint)
    except BaseException:
        os.close(lock_fd)
        raise
    return CheckpointStore(where, conn, lock_fd, saved)


def _lock(fd: int, where: str) -> None:
    """One running batch per checkpoint: two writers would interleave their agents' rows.
    The lock goes with the process, so a killed run never leaves it held."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise BatchSpecError(f"checkpoint_dir {where!r} is in use by another running batch "
                             "(its lock file is held); wait for it or use another "
                             "directory") from None


def _corrupted(where: str, db: Path, why: object) -> CheckpointCorrupted:
    return CheckpointCorrupted(
        f"checkpoint_dir {where!r}: the checkpoint database {db.name} is corrupted ({why}); "
        "it was left as it is. Move it away to start the batch over, or restore it from a "
        "backup")


def _open_db(where: str, db: Path, fingerprint: Fingerprint
             ) -> tuple[sqlite3.Connection, dict[int, SavedAgent]]:
    """Check an existing database before anything can write to it, then set it up."""
    existed = db.exists() and db.stat().st_size > 0
    if existed:
        with db.open("rb") as fh:
            if fh.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                raise _corrupted(where, db, "not an SQLite database")
    try:
        conn = sqlite3.connect(db, check_same_thread=False)  # used by the writer thread
    except sqlite3.Error as exc:
        raise BatchSpecError(f"checkpoint_dir {where!r} cannot be written: {exc}") from None
    try:
        if existed:
            _check_integrity(conn, where, db)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            if existed and not isinstance(exc, sqlite3.OperationalError):
                raise _corrupted(where, db, exc) from None
            raise BatchSpecError(f"checkpoint_dir {where!r} cannot be written: {exc}") \
                from None
        _check_batch(conn, where, db, fingerprint)
        return conn, _load(conn, where, db)
    except BaseException:
        conn.close()
        raise


def _check_integrity(conn: sqlite3.Connection, where: str, db: Path) -> None:
    try:
        rows = conn.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as exc:
        raise _corrupted(where, db, exc) from None
    problems = [r[0] for r in rows if r[0] != "ok"]
    if problems:
        raise _corrupted(where, db, "; ".join(problems[:3]))


def _check_batch(conn: sqlite3.Connection, where: str, db: Path, fp: Fingerprint) -> None:
    """Write this batch's fingerprint into a new checkpoint, or refuse another batch's."""
    stored = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    if not stored:
        with conn:
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [
                ("schema_version", SCHEMA_VERSION), ("inputs_count", str(fp.inputs_count)),
                *((f"hash:{name}", fp.parts[name]) for name in PARTS)])
        return
    if stored.get("schema_version") != SCHEMA_VERSION:
        raise BatchSpecError(f"checkpoint_dir {where!r} holds a checkpoint written by another "
                             f"version of agentbatch (format {stored.get('schema_version')!r}, "
                             f"this one reads {SCHEMA_VERSION!r})")
    count = stored.get("inputs_count")
    differ = fp.differences({n: stored.get(f"hash:{n}", "") for n in PARTS},
                            int(count) if count and count.isdigit() else None)
    if differ:
        raise BatchSpecError(
            f"checkpoint_dir {where!r} holds the checkpoint of a different batch: "
            f"{', '.join(differ)} differ from the batch that wrote it. Use another "
            f"checkpoint_dir, or delete {db} to start this batch over")


def _load(conn: sqlite3.Connection, where: str, db: Path) -> dict[int, SavedAgent]:
    saved: dict[int, SavedAgent] = {}
    for idx, state, latency in conn.execute("SELECT idx, state, latency_s FROM agents"):
        try:
            saved[idx] = SavedAgent(AgentState.model_validate_json(state), latency)
        except ValidationError as exc:
            raise _corrupted(where, db, f"agent {idx}'s saved state does not parse: "
                             f"{exc.errors()[0]['msg']}") from None
    return saved
