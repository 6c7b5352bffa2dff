"""The ledger's tables (SQLAlchemy Core). The Alembic migrations in ``migrations/versions`` create them;
this module only describes them for queries, so a schema change needs both a new migration and an edit
here."""

from __future__ import annotations

from sqlalchemy import (BigInteger, Boolean, Column, Float, Index, Integer, LargeBinary, MetaData, String, Table,
                        UniqueConstraint)

metadata = MetaData()

# One row per distinct step a node reported. The unique key is what makes reports idempotent; the
# credited token-layers are fixed when the row is written (the step's area not covered before).
work = Table(
    "work", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("model_sha256", String(64), nullable=False),
    Column("session_id", String(256), nullable=False),
    Column("layer_start", Integer, nullable=False),
    Column("layer_end", Integer, nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("n_tokens", Integer, nullable=False),
    Column("decode", Boolean, nullable=False),
    Column("node_id", String(256), nullable=False),
    Column("n_layer", Integer, nullable=False),
    Column("credited_token_layers", BigInteger, nullable=False),
    Column("recorded_at", Float, nullable=False),  # tracker's Unix time
    UniqueConstraint("model_sha256", "session_id", "layer_start", "layer_end", "position", "n_tokens",
                     name="uq_work_step"),
    Index("ix_work_session_position", "model_sha256", "session_id", "position"),
    Index("ix_work_node", "node_id"),
)

# One row per token delivered to a client.
deliveries = Table(
    "deliveries", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("client_id", String(256), nullable=False),
    Column("session_id", String(256), nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("model_sha256", String(64), nullable=False),
    Column("recorded_at", Float, nullable=False),
    UniqueConstraint("client_id", "session_id", "position", name="uq_delivery_token"),
    Index("ix_deliveries_client", "client_id"),
)

# Node id -> Ed25519 public key, bound at the id's first signed registration.
node_keys = Table(
    "node_keys", metadata,
    Column("node_id", String(256), primary_key=True),
    Column("public_key", LargeBinary(32), nullable=False),
    Column("bound_at", Float, nullable=False),
)
