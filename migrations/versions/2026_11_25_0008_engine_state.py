"""engine_state: what the service's processes share about the engine (the newest weight version,
a pause not continued yet), in one row

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25 13:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "engine_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("newest_weight_version", sa.BigInteger(), nullable=True),
        sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("paused_by", sa.String(length=128), nullable=True),
        sa.Column("pause_mode", sa.String(length=16), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_engine_state")),
    )
    op.bulk_insert(table, [{"id": 1}])


def downgrade() -> None:
    op.drop_table("engine_state")
