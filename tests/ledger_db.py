"""Databases for the ledger tests: each test gets a fresh SQLite file, or a fresh database on the
PostgreSQL server named by ``$MESHNET_TEST_POSTGRES_URL`` (``scripts/test.sh`` starts a throwaway one where
the machine allows). Without that variable the PostgreSQL cases skip, saying why.

Import the ``ledger_url`` fixture into a test module to run its tests on both."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

POSTGRES_URL = os.environ.get("MESHNET_TEST_POSTGRES_URL", "")
NO_POSTGRES = ("MESHNET_TEST_POSTGRES_URL is not set (scripts/test.sh starts a throwaway PostgreSQL server "
               "where the machine allows)")
needs_postgres = pytest.mark.skipif(not POSTGRES_URL, reason=NO_POSTGRES)
BACKENDS = [pytest.param("sqlite", id="sqlite"), pytest.param("postgresql", id="postgresql", marks=needs_postgres)]


@contextmanager
def fresh_database(backend: str, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database: ``sqlite:///TMP/ledger.db``, or a new PostgreSQL database on the
    test server (dropped, with its connections, afterwards), spelled as in ``$MESHNET_TEST_POSTGRES_URL``."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    if not POSTGRES_URL:
        pytest.skip(NO_POSTGRES)
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from meshnet.ledger.database import normalise_url

    name = f"ledger_{uuid.uuid4().hex[:16]}"
    admin = create_engine(normalise_url(POSTGRES_URL), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def ledger_url(request, tmp_path) -> Iterator[str]:
    """An empty database's URL, once on SQLite and once on PostgreSQL."""
    with fresh_database(request.param, tmp_path) as url:
        yield url
