"""Alembic migrations of the ledger database (``upgrade head`` runs at tracker start)."""
