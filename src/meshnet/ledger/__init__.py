"""The tracker's ledger: work each node did, tokens each client received, counted exactly once.

* :mod:`meshnet.ledger.store`: the database (:class:`Ledger`), SQLite by default, PostgreSQL by URL,
  schema versioned by the Alembic migrations in ``migrations/``.
* :mod:`meshnet.ledger.database`: the URL (``postgresql://`` gets the psycopg driver), the engine and
  ``upgrade head``.
* :mod:`meshnet.ledger.credit`: how much of a step is new work (pure functions).
* :mod:`meshnet.ledger.reporting`: the node's and the client's reporters, which batch records, resend
  after a tracker outage, and rely on the tracker's idempotent keys.
* :mod:`meshnet.ledger.cli`: ``meshnet ledger --tracker HOST:PORT``.

Nothing is imported here: a node imports the reporters alone, without the database's SQLAlchemy (a
quarter of a second at every node and worker start).
"""
