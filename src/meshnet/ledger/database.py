"""The ledger's database connection: the URL a user writes, the engine, and the schema migrations.

SQLite (``sqlite:///PATH``, ``sqlite://`` in memory) needs nothing installed; PostgreSQL needs the
``postgres`` extra (``pip install 'meshnet[postgres]'``, which brings psycopg 3). A PostgreSQL URL may be
written as libpq spells it (``postgresql://USER:PASS@HOST:PORT/DB``, or ``postgres://...``): it is
given the psycopg driver (``postgresql+psycopg://``) when psycopg is installed, so users need not know
SQLAlchemy's driver names. A URL naming a driver (``postgresql+psycopg2://...``) is taken as written.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

log = logging.getLogger("meshnet.ledger")

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
URL_HELP = ("SQLite: sqlite:////ABSOLUTE/PATH or sqlite:///RELATIVE/PATH; PostgreSQL: postgresql://USER:PASS@HOST:PORT/DB with psycopg installed "
            "(pip install 'meshnet[postgres]')")
# pg_advisory_xact_lock key held while migrating, so trackers starting at once on an empty PostgreSQL
# database migrate one after the other (the later one finds the schema current).
_MIGRATION_LOCK = 0x6D6573686E6574  # "meshnet"
# Alembic keeps the running migration's context in module globals: one migration at a time per process.
_UPGRADE_LOCK = threading.Lock()


def data_dir() -> Path:
    """``$XDG_DATA_HOME/meshnet``, by default ``~/.local/share/meshnet``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "meshnet"


def default_ledger_url() -> str:
    """The ledger ``meshnet tracker`` uses without ``--ledger``: ``sqlite:///<data_dir>/ledger.db``."""
    return f"sqlite:///{data_dir() / 'ledger.db'}"


def db_error(e: BaseException) -> str:
    """A database error in one line: the driver's own message (SQLAlchemy's text adds the SQL and a link)."""
    lines = str(getattr(e, "orig", None) or e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class LedgerError(RuntimeError):
    """The ledger database cannot be opened, migrated or written; the message names the URL's database."""


def normalise_url(url: str | URL) -> URL:
    """``url`` parsed, with a bare PostgreSQL scheme (``postgresql://``, ``postgres://``) given the
    psycopg driver when psycopg is installed (otherwise SQLAlchemy's default, psycopg2). An SQLite URL is
    SQLAlchemy's: ``sqlite:///x.db`` is relative to the working directory, ``sqlite:////tmp/x.db`` absolute.

    Raises:
        sqlalchemy.exc.ArgumentError: not a URL.
    """
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database.startswith("~"):
        # SQLite opens "~/x.db" as a directory named "~": the file went where its lock file did not
        u = u.set(database=str(Path(u.database).expanduser()))
    if u.drivername in ("postgresql", "postgres"):
        have_psycopg = importlib.util.find_spec("psycopg") is not None
        u = u.set(drivername="postgresql+psycopg" if have_psycopg else "postgresql")
    return u


def sqlite_path(url: URL) -> Path:
    """The file an SQLite URL opens: its database, or with ``?uri=true`` the path of its ``file:`` URI
    (``sqlite:///file:/tmp/x.db?mode=ro&uri=true``, a read-only open), without ``~`` expanded."""
    database = url.database or ""
    if url.query.get("uri") in ("true", "1") and database.startswith("file:"):
        database = database[len("file:"):]
    return Path(database)


def is_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def make_ledger_engine(url: str) -> Engine:
    """An engine for ``url`` (see :func:`normalise_url`); creates an SQLite file's directory. In-memory
    SQLite shares one connection between threads (each connection would otherwise see its own empty
    database).

    Raises:
        LedgerError: a malformed URL or a database driver that is not installed.
    """
    try:
        u = normalise_url(url)
        if u.get_backend_name() == "sqlite":
            if is_memory(u):
                return create_engine(u, poolclass=StaticPool, connect_args={"check_same_thread": False})
            path = sqlite_path(u)
            _warn_if_meant_absolute(path)
            path.expanduser().parent.mkdir(parents=True, exist_ok=True)
            # timeout: wait for another process's write lock instead of failing at once.
            return create_engine(u, connect_args={"check_same_thread": False, "timeout": 30})
        return create_engine(u, pool_pre_ping=True)
    except (ArgumentError, NoSuchModuleError, ImportError) as e:
        raise LedgerError(f"ledger URL {url!r}: {e} ({URL_HELP})") from None
    except OSError as e:
        raise LedgerError(f"ledger URL {url!r}: cannot create its directory: {e.strerror or e}") from None


def _warn_if_meant_absolute(path: Path) -> None:
    """``sqlite:///tmp/x.db`` (three slashes) is ``tmp/x.db`` under the working directory, which a user who
    meant ``/tmp/x.db`` finds only later, as a new folder. Warn when the path's first folder is missing here
    but exists at the root."""
    if path.is_absolute() or len(path.parts) < 2 or Path(path.parts[0]).exists():
        return
    if (Path("/") / path.parts[0]).is_dir():
        log.warning("ledger file %s is relative to the working directory (%s); for /%s write sqlite:////%s "
                    "(four slashes)", path, Path.cwd(), path, path)


def alembic_config(connection: Connection):
    """An Alembic ``Config`` for the ledger's migrations that runs them on ``connection`` (so an
    in-memory SQLite database is migrated on the connection that will use it)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    url = connection.engine.url.render_as_string(hide_password=False)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine) -> None:
    """Bring the database behind ``engine`` to the newest schema (Alembic ``upgrade head``) in one
    transaction that holds a lock other trackers wait for (PostgreSQL: an advisory lock; SQLite: the
    file's write lock): a failed migration leaves the database as it was, and trackers starting at once
    on an empty database migrate it once.

    Raises:
        LedgerError: the migration failed (the message names the database, its password masked).
    """
    with _UPGRADE_LOCK:
        _upgrade(engine)


def _upgrade(engine: Engine) -> None:
    from alembic import command
    from alembic.util.exc import CommandError

    for attempt in range(2):
        try:
            with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
                elif conn.dialect.name == "sqlite":
                    # Python's sqlite3 commits each CREATE at once unless a transaction is open: take the
                    # file's write lock first, so the migration is atomic and other processes wait for it.
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                command.upgrade(alembic_config(conn), "head")
                missing = _missing_schema(conn)
            break
        except OperationalError as e:
            # A database busy for a moment gets a second try; one that does not answer (a server that
            # is down, an SQLite file locked past its timeout) fails both.
            if attempt:
                raise LedgerError(f"cannot migrate ledger {engine.url.render_as_string()}: {db_error(e)}") from None
        except SQLAlchemyError as e:
            raise LedgerError(f"cannot open or migrate ledger {engine.url.render_as_string()}: {db_error(e)}") from None
        except CommandError as e:  # a revision this release's migrations do not hold
            raise LedgerError(f"ledger {engine.url.render_as_string()}: {e}: its schema comes from another meshnet "
                              "release (a newer one?); run that release's tracker on it, or give --ledger another "
                              "database") from None
    if missing:
        raise LedgerError(f"ledger {engine.url.render_as_string()} is at the newest schema revision but lacks "
                          f"{', '.join(missing)}: it is damaged or not a meshnet ledger; give --ledger another "
                          "database")


def _missing_schema(conn: Connection) -> list[str]:
    """The tables and columns of :mod:`meshnet.ledger.schema` that the database lacks (``table``,
    ``table.column``), checked after a migration: a table dropped by hand would otherwise fail every
    write later, and the ledger would lose what it is sent."""
    from sqlalchemy import inspect

    from meshnet.ledger.schema import metadata

    found = inspect(conn)
    tables = set(found.get_table_names())
    missing = []
    for table in metadata.sorted_tables:
        if table.name not in tables:
            missing.append(f"table {table.name}")
            continue
        have = {c["name"] for c in found.get_columns(table.name)}
        missing += [f"column {table.name}.{c.name}" for c in table.columns if c.name not in have]
    return missing
