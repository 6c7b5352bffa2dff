"""Alembic environment for the ledger.

Run by :func:`meshnet.ledger.database.upgrade` with an open connection in
``config.attributes["connection"]`` (so an in-memory SQLite database is migrated on the connection that
will use it); without one it connects to ``sqlalchemy.url`` from the config.
"""

from alembic import context
from sqlalchemy import create_engine

from meshnet.ledger.schema import metadata

config = context.config


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    conn = config.attributes.get("connection")
    if conn is not None:
        _run(conn)
    else:
        engine = create_engine(config.get_main_option("sqlalchemy.url"))
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
