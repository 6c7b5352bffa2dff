"""The first ledger schema: work, deliveries, node_keys.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "work",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("model_sha256", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("layer_start", sa.Integer, nullable=False),
        sa.Column("layer_end", sa.Integer, nullable=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
        sa.Column("decode", sa.Boolean, nullable=False),
        sa.Column("node_id", sa.String(256), nullable=False),
        sa.Column("n_layer", sa.Integer, nullable=False),
        sa.Column("credited_token_layers", sa.BigInteger, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.UniqueConstraint("model_sha256", "session_id", "layer_start", "layer_end", "position", "n_tokens",
                            name="uq_work_step"),
    )
    op.create_index("ix_work_session_position", "work", ["model_sha256", "session_id", "position"])
    op.create_index("ix_work_node", "work", ["node_id"])
    op.create_table(
        "deliveries",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("client_id", sa.String(256), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("model_sha256", sa.String(64), nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.UniqueConstraint("client_id", "session_id", "position", name="uq_delivery_token"),
    )
    op.create_index("ix_deliveries_client", "deliveries", ["client_id"])
    op.create_table(
        "node_keys",
        sa.Column("node_id", sa.String(256), primary_key=True),
        sa.Column("public_key", sa.LargeBinary(32), nullable=False),
        sa.Column("bound_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_keys")
    op.drop_index("ix_deliveries_client", table_name="deliveries")
    op.drop_table("deliveries")
    op.drop_index("ix_work_node", table_name="work")
    op.drop_index("ix_work_session_position", table_name="work")
    op.drop_table("work")
