"""One tracker writes a ledger at a time: the hold a tracker keeps on its ledger while it runs.

An SQLite file's hold is an exclusive lock on ``<file>.lock`` (a second tracker on the same machine would
otherwise count the same steps into the file beside the first); a PostgreSQL database's is a
session-level advisory lock on a connection of its own, which the server drops with the session when the
tracker dies. That session can also end while the tracker runs (the server restarted, an
``idle_session_timeout``, an administrator's ``pg_terminate_backend``), and the lock with it: before a
write the hold is checked (:meth:`PostgresHold.check`), taken again where nobody else has, and writes are
refused while another tracker holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from typing import IO

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from meshnet.ledger.database import LedgerError, db_error, is_memory, sqlite_path

log = logging.getLogger("meshnet.ledger")

# How long a tracker waits for another process to let go of its SQLite ledger file, seconds: a tracker
# being restarted may start before the old process has exited.
LOCK_WAIT_S = 5.0


# The advisory lock a tracker holds on a PostgreSQL ledger while it writes it ("mldg": below 2**31, so
# pg_locks shows it as objid with classid 0).
_LEDGER_LOCK = 0x6D6C6467
# TCP keepalives the server sends on the connection holding it (idle, interval, probes: about 25 s from
# silence to the session's end), so that a tracker whose machine died does not hold the ledger for hours.
_HOLD_KEEPALIVES = (("tcp_keepalives_idle", 10), ("tcp_keepalives_interval", 5), ("tcp_keepalives_count", 3))
_HOLD_DEAD_S = 25
# Whether this session holds it.
_HELD = ("SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND classid = 0 AND objid = :key "
         "AND pid = pg_backend_pid() AND granted")
# How often a writing tracker checks that it still holds its PostgreSQL ledger, seconds at most.
CHECK_EVERY_S = 1.0


def hold_ledger(engine: Engine, wait_s: float = LOCK_WAIT_S):
    """What keeps a second tracker from writing the ledger behind ``engine`` while this process does
    (closed with ``.close()``), or None for an in-memory one: an SQLite file's lock file
    (:func:`hold_sqlite_file`), or a PostgreSQL session-level advisory lock held on a connection of its
    own, which the server drops with the session if the process dies. Waits up to ``wait_s`` seconds for a
    holder to let go (a tracker being restarted).

    Raises:
        LedgerError: another tracker still holds it (named: its pid, or its PostgreSQL server process and
            the address it connected from), or the database cannot be reached.
    """
    if engine.url.get_backend_name() == "postgresql":
        return _hold_postgres(engine, wait_s)
    return hold_sqlite_file(engine, wait_s)


class PostgresHold:
    """A session-level advisory lock on a connection of its own, until :meth:`close`."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self._engine = engine
        self._conn: Connection | None = conn
        self._checked = time.monotonic()

    def check(self) -> None:
        """Make sure this tracker still holds the lock before it writes (at most once a
        :data:`CHECK_EVERY_S`): its session may have ended without it. A lock lost is taken again where
        no other tracker has taken it (a warning says so).

        Raises:
            LedgerError: another tracker holds the ledger now (asked again at the next write).
        """
        now = time.monotonic()
        if self._conn is not None and now - self._checked < CHECK_EVERY_S:
            return  # held a moment ago (lost, it is asked for at every write until taken again)
        why = "its session's lock is gone"
        try:
            if self._conn is not None:
                held = self._conn.execute(text(_HELD), {"key": _LEDGER_LOCK}).scalar()
                self._conn.rollback()  # not left idle in a transaction
                if held:
                    self._checked = now
                    return
        except SQLAlchemyError as e:
            why = db_error(e)
        self.close()
        try:
            self._conn = _hold_postgres(self._engine, 0)._conn
        except LedgerError as e:
            raise LedgerError(f"this tracker's session holding the ledger ended ({why}) and it could not "
                              f"take it again: {e}") from None
        self._checked = time.monotonic()
        log.warning("ledger %s: this tracker's session holding it ended (%s); taken again",
                    self._engine.url.render_as_string(), why)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(SQLAlchemyError):
                self._conn.invalidate()  # closed, not pooled: the server ends the session and its lock
                self._conn.close()
            self._conn = None


def _hold_postgres(engine: Engine, wait_s: float) -> PostgresHold:
    url = engine.url.render_as_string()
    deadline = time.monotonic() + wait_s
    try:
        conn = engine.connect()
    except SQLAlchemyError as e:
        raise LedgerError(f"cannot open ledger {url}: {db_error(e)}") from None
    try:
        # The server keeps a session, and its lock, until it sees the connection die: at once for a killed
        # process, but for a machine gone or cut off only by TCP keepalives, which default to 2 hours.
        for setting, value in _HOLD_KEEPALIVES:
            conn.execute(text(f"SET {setting} = {value}"))
        while not conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": _LEDGER_LOCK}).scalar():
            conn.rollback()
            if time.monotonic() >= deadline:
                holder = conn.execute(text(
                    "SELECT a.pid, a.client_addr FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.classid = 0 AND l.objid = :key AND l.granted AND l.database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())"),
                    {"key": _LEDGER_LOCK}).first()
                who = "another session" if holder is None else f"PostgreSQL server process {holder[0]}" + (
                    f", connected from {holder[1]}" if holder[1] else "")
                end = (f"; if that tracker is gone, its session ends within about {_HOLD_DEAD_S} s of its machine "
                       f"going silent, or now with SELECT pg_terminate_backend({holder[0]})" if holder else "")
                raise LedgerError(f"the ledger {url} is in use by another tracker ({who}, still after {wait_s:g} "
                                  "s): one tracker writes a ledger at a time; give this one --ledger with another "
                                  f"database{end}")
            time.sleep(0.05)
        conn.commit()
    except LedgerError:
        conn.close()
        raise
    except SQLAlchemyError as e:
        conn.close()
        raise LedgerError(f"cannot open ledger {url}: {db_error(e)}") from None
    return PostgresHold(engine, conn)


def hold_sqlite_file(engine: Engine, wait_s: float = LOCK_WAIT_S) -> IO | None:
    """For a ledger in an SQLite file, an exclusive lock on ``<file>.lock`` held by this process until the
    returned file is closed (or the process dies), else None: one tracker writes a ledger at a time, and a
    second one on the same machine would otherwise count the same steps into it beside the first. Waits
    up to ``wait_s`` seconds for a holder to let go.

    Raises:
        LedgerError: another process still holds the file (its pid is named).
    """
    if engine.url.get_backend_name() != "sqlite" or is_memory(engine.url):
        return None
    path = sqlite_path(engine.url).expanduser()
    try:
        lock = open(path.with_name(path.name + ".lock"), "a+")
    except OSError as e:
        raise LedgerError(f"the ledger {path}: cannot open its lock file: {e.strerror or e}") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                lock.seek(0)
                holder = lock.read().strip() or "?"
                lock.close()
                who = "this process" if holder == str(os.getpid()) else f"pid {holder}"
                raise LedgerError(f"the ledger {path} is in use by another tracker ({who}, still after "
                                  f"{wait_s:g} s): one tracker writes a ledger at a time; give this one another "
                                  "file, --ledger sqlite:////ABSOLUTE/PATH (four slashes)") from None
            time.sleep(0.05)
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock
